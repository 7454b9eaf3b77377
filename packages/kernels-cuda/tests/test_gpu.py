"""On a GPU (``nox -s gpu``): every kernel against the NumPy reference on the device, and whole-model
training on ``cuda`` against ``numpy``. Skipped, with the reason, where there is no GPU."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.cuda import _device
from kiln.cuda._check import CASES, run_case

ok, why = _device.device_status()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ok, reason=f"needs a CUDA GPU: {why}")]


@pytest.fixture(scope="module")
def gpu():
    return _device.CudaDevice()


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
def test_kernel_on_device_matches_numpy_reference(gpu, case) -> None:
    assert run_case(case, gpu) <= case.atol


GEMMS = {k: c for k, c in CASES.items() if "matmul" in c.op or "gemm" in c.op or "lm_head" in c.op}


@pytest.mark.parametrize("case", GEMMS.values(), ids=list(GEMMS))
def test_simt_gemms_on_device_without_cublaslt(gpu, case, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where cuBLASLt runs the matmuls above, the SIMT kernels they fall back to, on the same device."""
    monkeypatch.setattr(gpu, "blas", None)
    assert run_case(case, gpu) <= case.atol


def test_qwen3_training_on_cuda_equals_numpy() -> None:
    from kiln.core import Model

    build_bundle = pytest.importorskip("kiln.dsl").build_bundle
    from kiln.dsl.stdlib.models import Qwen3Model

    bundle = build_bundle(Qwen3Model, {"vocab_size": 128, "d_model": 64, "n_layers": 2, "num_query_heads": 4,
                                       "num_kv_heads": 2, "head_size": 16, "d_ff": 128, "max_seq": 32})
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 128, (4, 17))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    models = [Model.from_ir(bundle, seed=0, backend=b) for b in ("numpy", "cuda")]
    for _ in range(20):
        ref, got = (m.train_step(batch) for m in models)
        assert got["loss"] == pytest.approx(ref["loss"], abs=1e-4)
    want, have = models[0].parameters(), models[1].parameters()
    assert max(float(np.abs(want[k] - have[k]).max()) for k in want) < 1e-4


def test_qwen3_bf16_training_on_cuda_tracks_numpy() -> None:
    """The bf16 recipe on the GPU (matmuls on cuBLASLt's bf16 GEMM, attention on the tensor cores) against
    the NumPy backend's emulation of it: the same rounding points, other fp32 summation orders, so a
    rounding flips now and then: losses within 5e-3 over 10 steps, parameters within 1e-2."""
    pytest.importorskip("ml_dtypes")
    from kiln.core import Model

    build_bundle = pytest.importorskip("kiln.dsl").build_bundle
    from kiln.dsl.stdlib.models import Qwen3Model

    bundle = build_bundle(Qwen3Model, {"vocab_size": 128, "d_model": 64, "n_layers": 2, "num_query_heads": 4,
                                       "num_kv_heads": 2, "head_size": 16, "d_ff": 128, "max_seq": 32})
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 128, (4, 17))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    models = [Model.from_ir(bundle, seed=0, backend=b, precision="bf16") for b in ("numpy", "cuda")]
    for _ in range(10):
        ref, got = (m.train_step(batch) for m in models)
        assert got["loss"] == pytest.approx(ref["loss"], abs=5e-3)
    want, have = models[0].parameters(), models[1].parameters()
    assert max(float(np.abs(want[k] - have[k]).max()) for k in want) < 1e-2

def test_offload_on_the_gpu_gives_the_gradients_of_keep_all() -> None:
    """Host offload on the device (pinned host memory, the copy stream, events): the same bits as keeping
    every activation on the device."""
    from kiln.core import Model

    build_bundle = pytest.importorskip("kiln.dsl").build_bundle
    from kiln.dsl.stdlib.models import Qwen3Model

    bundle = build_bundle(Qwen3Model, {"vocab_size": 128, "d_model": 64, "n_layers": 2, "num_query_heads": 4,
                                       "num_kv_heads": 2, "head_size": 16, "d_ff": 128, "max_seq": 32})
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 128, (4, 17))
    keep, off = (Model.from_ir(bundle, seed=0, backend="cuda", recompute=r) for r in ("none", "offload"))
    (want_loss, want), (loss, have) = (m.loss_and_grads(ids[:, :-1], ids[:, 1:]) for m in (keep, off))
    assert loss == want_loss
    assert all(np.array_equal(have[k], want[k]) for k in want)

@pytest.mark.parametrize("transpose", ["NN", "NT", "TN", "TT"])
def test_cublaslt_bf16_in_fp32_accumulate(gpu, transpose: str) -> None:
    """bf16 a and b, a float32 out: cuBLASLt against NumPy in float64 on the same bf16 values."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    if gpu.blas is None:
        pytest.skip(gpu.blas_error)
    from kiln.cuda._check import _to_device, _to_host
    from kiln.cuda._ops import matmul

    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 70, 129) if transpose[0] == "N" else (3, 129, 70)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((3, 129, 45) if transpose[1] == "N" else (3, 45, 129)).astype(ml_dtypes.bfloat16)
    out = _to_device(gpu, np.zeros((3, 70, 45), np.float32))
    matmul(_to_device(gpu, a), _to_device(gpu, b), out=(out,), transpose=transpose, alpha=0.5)
    op = [x.astype(np.float64) for x in (a, b)]
    op = [x.swapaxes(1, 2) if t == "T" else x for x, t in zip(op, transpose, strict=True)]
    assert np.abs(_to_host(out) - 0.5 * op[0] @ op[1]).max() < 1e-3


def test_forward_and_backward_as_a_cuda_graph_equal_eager() -> None:
    """The step's forward and backward captured once (stream capture) and replayed twice, against the same
    phases run eagerly on a second arena with the same contents: the same bits."""
    from kiln.core import compile, get_registry

    build_bundle = pytest.importorskip("kiln.dsl").build_bundle
    from kiln.dsl.stdlib.models import Qwen3Model

    bundle = build_bundle(Qwen3Model, {"vocab_size": 128, "d_model": 64, "n_layers": 2, "num_query_heads": 4,
                                       "num_kv_heads": 2, "head_size": 16, "d_ff": 128, "max_seq": 32})
    program = compile(bundle, bindings={"B": 2, "T": 16}, backend="cuda")
    backend = get_registry("backends")["cuda"]
    eager, graphed = (backend.compile(program, backend.allocate(program.arena_bytes), None) for _ in range(2))
    rng = np.random.default_rng(0)
    for name, t in program.tensors.items():
        ints = t.dtype.startswith("int")
        v = rng.integers(0, 16, t.shape) if ints else rng.standard_normal(t.shape) * 0.1
        for exe in (eager, graphed):
            exe.write(name, v.astype(t.dtype))
    graphed.capture(("forward", "backward"))
    for _ in range(2):
        eager.run(("forward", "backward"))
        graphed.run(("forward", "backward"))
    for name in program.tensors:
        assert np.array_equal(eager.read(name), graphed.read(name), equal_nan=True), name


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_whole_step_as_a_cuda_graph_equals_eager(precision: str) -> None:
    """``capture(PHASES)`` on the device: forward, backward and the optimizer (norm, clipping factor and
    rates in device scalars) replayed for three steps give the eager steps' bits and scalars; under
    bf16 too (no host steps: the ops that round inside run their recipe kernels)."""
    from kiln.core import PHASES, AdamW, compile, get_registry

    build_bundle = pytest.importorskip("kiln.dsl").build_bundle
    from kiln.dsl.stdlib.models import Qwen3Model

    bundle = build_bundle(Qwen3Model, {"vocab_size": 128, "d_model": 64, "n_layers": 2, "num_query_heads": 4,
                                       "num_kv_heads": 2, "head_size": 16, "d_ff": 128, "max_seq": 32})
    program = compile(bundle, bindings={"B": 2, "T": 16}, backend="cuda", precision=precision)
    backend = get_registry("backends")["cuda"]
    eager, graphed = (backend.compile(program, backend.allocate(program.arena_bytes), None) for _ in range(2))
    assert eager.host_steps == {}
    rng = np.random.default_rng(0)
    for name, t in program.tensors.items():
        ints = t.dtype.startswith("int")
        v = rng.integers(0, 16, t.shape) if ints else rng.standard_normal(t.shape) * 0.1
        v = np.abs(v) if name.startswith("adamw.exp_avg_sq.") else v
        for exe in (eager, graphed):
            exe.write(name, v)  # in the slot's dtype (bf16 too)
    opt = AdamW(lr=1e-2, warmup_steps=2, total_steps=5, max_grad_norm=1e-3)
    graphed.capture(PHASES)
    for step in (1, 2, 3):
        hyper = {"step": step, "optimizer": opt}
        assert graphed.run(PHASES, hyper=hyper) == eager.run(PHASES, hyper=hyper)
    for name in program.tensors:
        assert np.array_equal(eager.read(name), graphed.read(name), equal_nan=True), name
