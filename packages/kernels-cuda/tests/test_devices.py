"""Which GPU the ``cuda`` backend runs on: ``backend="cuda"`` is GPU 0, ``backend="cuda:1"`` GPU 1 (as
``torch.device`` spells it), an index past the GPUs the process sees is a KilnError naming both. Without a
GPU the driver's device count is monkeypatched and the device is a stand-in (the CPU emulator) that notes
the ordinal it was opened with; with two GPUs (``nox -s gpu``) the same runs on the second one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.core import KilnError, Model, PluginSession, get_registry
from kiln.core.plugins import hookimpl
from kiln.cuda import CudaBackend, EmulatedDevice, _device

CONFIG = {"vocab_size": 64, "d_model": 32, "n_layers": 1, "num_query_heads": 4, "num_kv_heads": 2,
          "head_size": 8, "d_ff": 64, "max_seq": 16}
BATCH = {"input_ids": np.arange(16).reshape(2, 8) % 64, "labels": np.arange(1, 17).reshape(2, 8) % 64}


@pytest.fixture(scope="module")
def bundle() -> Any:
    dsl = pytest.importorskip("kiln.dsl", reason="the Qwen3 model comes from kiln-dsl")
    from kiln.dsl.stdlib.models import Qwen3Model

    return dsl.build_bundle(Qwen3Model, CONFIG)


class Gpus:
    """``cuda`` as the installed plugin registers it on a machine with GPUs (``CudaBackend()``, its device
    opened on first use), and kiln's CUDA kernels."""

    @hookimpl
    def kiln_register_backends(self, registry: Any) -> None:
        registry.register("cuda", CudaBackend())

    @hookimpl
    def kiln_register_kernels(self, registry: Any) -> None:
        from kiln.cuda._plugin import register_kernels

        register_kernels(registry)


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch, cache: Path) -> list[int]:
    """A driver that sees two GPUs; each device opened is the emulator, noting its ordinal (returned)."""
    opened: list[int] = []

    class StandIn(EmulatedDevice):
        def __init__(self, ordinal: int = 0) -> None:
            _device.check_ordinal(ordinal, _device.device_count())  # as CudaDevice checks it
            super().__init__(cache=cache / "emulated")
            self.ordinal = ordinal
            opened.append(ordinal)

    monkeypatch.setattr(_device, "device_count", lambda: 2)
    monkeypatch.setattr(_device, "CudaDevice", StandIn)
    return opened


def test_an_index_in_the_backend_name_picks_the_gpu(bundle: Any, two_gpus: list[int]) -> None:
    with PluginSession(autoload=False).activate() as session:
        session.register(Gpus(), "gpus")
        reference = Model.from_ir(bundle, seed=0).train_step(BATCH)["loss"]
        second = Model.from_ir(bundle, seed=0, backend="cuda:1")
        assert two_gpus == [1] and second.backend.gpu.ordinal == 1 and second.backend_name == "cuda"
        assert abs(second.train_step(BATCH)["loss"] - reference) < 1e-5  # it trains there
        first = Model.from_ir(bundle, seed=0, backend="cuda")  # no index: GPU 0, as before
        assert first.backend is get_registry("backends")["cuda"] and first.backend.gpu.ordinal == 0
        # one backend (one device) per GPU, however it is named
        assert Model.from_ir(bundle, backend="cuda:0").backend is first.backend
        assert Model.from_ir(bundle, backend="cuda:1").backend is second.backend
        assert two_gpus == [1, 0]


@pytest.mark.parametrize(("name", "message"), [
    ("cuda:2", r"backend 'cuda:2': there is no GPU 2; this process sees 2 GPUs \(cuda:0 to cuda:1\)"),
    ("cuda:one", r"backend 'cuda:one': the device index 'one' is not a non-negative integer"),
    ("cuda:-1", r"the device index '-1' is not a non-negative integer"),
    ("numpy:1", r"backend 'numpy' has no devices to choose from, so 'numpy:1' names none"),
    ("tpu:0", r"unknown name 'tpu' in the backends registry"),
])
def test_a_device_index_the_backend_does_not_have_is_an_error(bundle: Any, two_gpus: list[int], name: str,
                                                              message: str) -> None:
    with PluginSession(autoload=False).activate() as session:
        session.register(Gpus(), "gpus")
        with pytest.raises(KilnError, match=message):
            Model.from_ir(bundle, backend=name)
    assert two_gpus == []  # refused before any device opened


def test_a_device_past_those_the_process_sees_is_refused_before_the_driver_is_asked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_device, "device_status", lambda: (True, ""))
    monkeypatch.setattr(_device, "device_count", lambda: 1)
    with pytest.raises(KilnError, match=r"no GPU 3; this process sees 1 GPU \(cuda:0 to cuda:0\)") as info:
        _device.CudaDevice(3)
    assert "CUDA_VISIBLE_DEVICES" in str(info.value.hint)
    with pytest.raises(KilnError, match="sees no GPU"):
        _device.check_ordinal(0, 0)


def test_a_backend_given_its_device_has_that_one_alone(cache: Path) -> None:
    """``CudaBackend(EmulatedDevice())`` (the emulator, a test's device) runs on the device it was given."""
    backend = CudaBackend(EmulatedDevice(cache=cache / "emulated"))
    assert backend.device_count == 1 and backend.on_device(0) is backend
    with pytest.raises(KilnError, match="no GPU 1; this process sees 1 GPU"):
        backend.on_device(1)


@pytest.mark.skipif(_device.device_status()[0], reason="a GPU is present here")
def test_without_a_gpu_an_indexed_name_says_why_cuda_cannot_run(bundle: Any) -> None:
    with pytest.raises(KilnError, match=r"backend 'cuda' is unavailable"):
        Model.from_ir(bundle, backend="cuda:1")


@pytest.mark.gpu
def test_training_on_the_second_gpu_equals_numpy(bundle: Any) -> None:
    ok, why = _device.device_status()
    if not ok or _device.device_count() < 2:
        pytest.skip(f"needs two CUDA GPUs: {why or f'found {_device.device_count()}'}")
    reference = Model.from_ir(bundle, seed=0)
    model = Model.from_ir(bundle, seed=0, backend="cuda:1")
    gpu = model.backend.gpu
    second = _device._check(gpu.driver.cuDeviceGet(1), "cuDeviceGet")
    assert gpu.ordinal == 1 and int(gpu.handle) == int(second)
    d = gpu.driver
    ptr = model._arena.ptr  # the arena lives on GPU 1
    where = _device._check(d.cuPointerGetAttribute(
        d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr), "cuPointerGetAttribute")
    assert int(where) == 1
    for _ in range(3):
        assert model.train_step(BATCH)["loss"] == pytest.approx(reference.train_step(BATCH)["loss"], abs=1e-4)
