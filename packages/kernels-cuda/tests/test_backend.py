"""The ``cuda`` backend: registered as unavailable (with the reason) where there is no GPU, detection
that cannot hang, and a whole training step of a tiny Qwen3 on the backend over the CPU emulator equal
to the NumPy backend."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kiln.core import KilnError, Model, PluginSession, compile, get_registry, op_registry
from kiln.cuda import EmulatedCuda, EmulatedDevice, _device
from kiln.cuda._backend import UnavailableBackend
from kiln.cuda._ops import KERNELS

CONFIG = {"vocab_size": 64, "d_model": 32, "n_layers": 1, "num_query_heads": 4, "num_kv_heads": 2,
          "head_size": 8, "d_ff": 64, "max_seq": 16}

no_gpu = pytest.mark.skipif(_device.device_status()[0], reason="a GPU is present here")


@pytest.fixture(scope="module")
def bundle():
    dsl = pytest.importorskip("kiln.dsl", reason="the Qwen3 model comes from kiln-dsl")
    from kiln.dsl.stdlib.models import Qwen3Model

    return dsl.build_bundle(Qwen3Model, CONFIG)


def test_every_kernel_is_for_a_core_op() -> None:
    assert set(KERNELS) <= set(op_registry().names())


@no_gpu
def test_without_a_gpu_the_backend_says_why(bundle) -> None:
    backend = get_registry("backends")["cuda"]
    assert isinstance(backend, UnavailableBackend)
    with pytest.raises(KilnError, match=r"backend 'cuda' is unavailable: .*(libcuda\.so\.1|no GPU)"):
        Model.from_ir(bundle, backend="cuda")


def test_detection_never_calls_the_driver_without_its_library(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_driver(name: str, *args: object, **kwargs: object) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(_device.ctypes, "CDLL", no_driver)
    _device.device_status.cache_clear()
    try:
        ok, why = _device.device_status()
        assert not ok and "libcuda.so.1 does not load" in why
        with pytest.raises(KilnError, match="backend 'cuda' is unavailable"):
            _device.CudaDevice()
    finally:
        _device.device_status.cache_clear()


def test_kiln_plugins_lists_the_plugin_promptly() -> None:
    kiln = Path(sys.executable).parent / "kiln"
    done = subprocess.run([str(kiln), "plugins"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "kiln-kernels-cuda" in done.stdout


@pytest.mark.parametrize("host_ops", [(), ("flash_attention", "swiglu_backward", "adamw_update")],
                         ids=["all-on-device", "some-on-host"])
def test_qwen3_training_on_emulated_cuda_equals_numpy(bundle, cache: Path, host_ops: tuple[str, ...]) -> None:
    """Every op of the step runs its CUDA kernel; ops without one run their reference on the host."""
    batch = {"input_ids": np.arange(16).reshape(2, 8) % 64, "labels": np.arange(1, 17).reshape(2, 8) % 64}
    batch["labels"][0, :3] = -100
    with PluginSession(autoload=False).activate() as session:
        plugin = EmulatedCuda(EmulatedDevice(cache=cache / "emulated"), without=host_ops)
        session.register(plugin, "cuda-emulated")
        program = compile(bundle, bindings={"B": 2, "T": 8}, backend="cuda")
        kernels = {s.op.type: s.kernel for s in program.steps if s.how != "alias"}
        assert {op for op, k in kernels.items() if not k} == set(host_ops)
        assert all(k == f"{op}@cuda:float32" for op, k in kernels.items() if op not in host_ops)
        models = [Model.from_ir(bundle, seed=0, backend=b) for b in ("numpy", "cuda")]
        for _ in range(2):
            ref, got = (m.train_step(batch) for m in models)
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6, abs=1e-6)
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        want, have = models[0].parameters(), models[1].parameters()
        assert max(float(np.abs(want[k] - have[k]).max()) for k in want) < 1e-5
        assert plugin.device.launches > 0
