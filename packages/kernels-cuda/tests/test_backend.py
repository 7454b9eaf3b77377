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
from kiln.core.plugins import hookimpl
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


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_an_unavailable_backend_says_why_for_any_recipe(bundle, precision: str) -> None:
    """Asked for the bf16 recipe (or any), the stand-in names the reason it cannot run at all."""
    reason = "libcuda.so.1 does not load (test)"

    class Plugin:
        @hookimpl
        def kiln_register_backends(self, registry: object) -> None:
            registry.register("cuda", UnavailableBackend(reason))  # type: ignore[attr-defined]

    session = PluginSession(autoload=False)
    session.register(Plugin(), "unavailable-cuda")
    with session.activate():
        backend = get_registry("backends")["cuda"]
        with pytest.raises(KilnError, match=r"backend 'cuda' is unavailable: libcuda\.so\.1 does not load"):
            _ = backend.precisions
        for build in (lambda: compile(bundle, bindings={"B": 2, "T": 8}, backend="cuda", precision=precision),
                      lambda: Model.from_ir(bundle, seed=0, backend="cuda", precision=precision)):
            with pytest.raises(KilnError, match=r"backend 'cuda' is unavailable: libcuda\.so\.1") as info:
                build()
            assert "does not run" not in str(info.value)


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


def test_qwen3_moe_training_on_emulated_cuda_equals_numpy(cache: Path) -> None:
    """Routing (softmax, top-k), the expert permutation, the grouped GEMMs and the load statistics of the
    auxiliary loss run their CUDA kernels."""
    dsl = pytest.importorskip("kiln.dsl", reason="the Qwen3-MoE model comes from kiln-dsl")
    from kiln.dsl.stdlib.models import Qwen3MoEModel

    bundle = dsl.build_bundle(Qwen3MoEModel, {**CONFIG, "moe_d_ff": 16, "num_experts": 4,
                                              "num_experts_per_tok": 2})
    batch = {"input_ids": np.arange(16).reshape(2, 8) % 64, "labels": np.arange(1, 17).reshape(2, 8) % 64}
    with PluginSession(autoload=False).activate() as session:
        session.register(EmulatedCuda(EmulatedDevice(cache=cache / "emulated")), "cuda-emulated")
        program = compile(bundle, bindings={"B": 2, "T": 8}, backend="cuda")
        on_device = {s.op.type for s in program.steps if s.how != "alias" and s.kernel}
        assert {"moe_topk", "moe_permute", "moe_grouped_gemm_gate_up", "moe_grouped_gemm_dw", "moe_unpermute",
                "moe_unpermute_dw", "moe_permute_backward"} <= on_device
        models = [Model.from_ir(bundle, seed=0, backend=b) for b in ("numpy", "cuda")]
        for _ in range(2):
            ref, got = (m.train_step(batch) for m in models)
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6, abs=1e-6)
        want, have = models[0].parameters(), models[1].parameters()
        assert max(float(np.abs(want[k] - have[k]).max()) for k in want) < 1e-5


def test_dropout_on_the_device_draws_the_numpy_backends_masks() -> None:
    """Dropout's kernel with the NumPy backend's counter offsets per layer and training step: three steps of
    a two-layer model with hidden dropout train as on ``numpy`` (a mask off by one counter, layer or step
    would move the loss by far more than 1e-5), every dropout step on the CUDA kernel."""
    dsl = pytest.importorskip("kiln.dsl", reason="the model comes from kiln-dsl")
    from kiln.dsl.stdlib.models import HyperConnectionModel

    cfg = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "num_query_heads": 4, "num_kv_heads": 2,
           "head_size": 8, "d_ff": 64, "max_seq": 16, "hidden_dropout": 0.3, "dropout_seed": 5,
           "n_streams": 2}
    bundle = dsl.build_bundle(HyperConnectionModel, cfg)
    plain = dsl.build_bundle(HyperConnectionModel, {**cfg, "hidden_dropout": 0.0})
    rng = np.random.default_rng(0)
    batch = {"input_ids": rng.integers(0, 64, (2, 8)), "labels": rng.integers(0, 64, (2, 8))}
    with PluginSession(autoload=False).activate() as session:
        session.register(EmulatedCuda(), "cuda-emulated")
        ref, got = (Model.from_ir(bundle, seed=0, backend=b) for b in ("numpy", "cuda"))
        steps = [s for s in got.program(2, 8).steps if s.op.type == "dropout"]
        assert steps and all(s.kernel == "dropout@cuda:float32" for s in steps)
        undropped = Model.from_ir(plain, seed=0, backend="cuda").train_step(batch)["loss"]
        losses = []
        for _ in range(3):
            want, have = ref.train_step(batch)["loss"], got.train_step(batch)["loss"]
            assert have == pytest.approx(want, abs=1e-5)
            losses.append(have)
        assert abs(losses[0] - undropped) > 1e-3  # the dropout is live
