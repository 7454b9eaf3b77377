"""Matmuls through cuBLASLt: the plan (how kiln's row-major matmul maps onto cuBLASLt's column-major GEMM)
checked here by running it with cuBLASLt's documented semantics in NumPy, on the emulator's memory, as the
backend's matmul path; the real library runs in test_gpu.py."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest

from kiln.core import KilnError
from kiln.cuda import _blas
from kiln.cuda._blas import CUDA_TYPES, GemmPlan, gemm_plan
from kiln.cuda._check import CASES, run_case
from kiln.cuda._emulate import EmulatedDevice

_NP: dict[int, Any] = {CUDA_TYPES["float32"]: np.float32}
try:  # bf16 operands (the bf16 recipe's matmuls)
    import ml_dtypes

    _NP[CUDA_TYPES["bfloat16"]] = ml_dtypes.bfloat16
except ImportError:  # pragma: no cover - ml_dtypes comes with kiln-core[bf16]
    pass


def _colmajor(ptr: int, dtype: Any, rows: int, cols: int, ld: int, batch: int, stride: int) -> np.ndarray:
    """The column-major [batch, rows, cols] matrices at ``ptr`` (leading dimension ld, batch stride)."""
    item = np.dtype(dtype).itemsize
    size = (batch - 1) * stride + (cols - 1) * ld + rows if rows and cols else 0
    flat = np.ctypeslib.as_array((ctypes.c_char * max(size * item, 1)).from_address(ptr)).view(dtype)
    return np.lib.stride_tricks.as_strided(flat, (batch, rows, cols), (stride * item, item, ld * item))


class NumpyBlas:
    """cuBLASLt's GEMM as its documentation states it, D = alpha opA(A) opB(B) + beta C in column-major
    order, on host pointers (the emulator's memory): an oracle independent of :func:`gemm_plan`."""

    def __init__(self) -> None:
        self.calls: list[GemmPlan] = []

    def gemm(self, p: GemmPlan, a: int, b: int, c: int, d: int) -> None:
        self.calls.append(p)
        dt, operands = _NP[p.types[2]], _NP[p.types[0]]  # a and b share one type (gemm_plan checks)
        opa = _colmajor(a, operands, *((p.k, p.m) if p.trans_a else (p.m, p.k)), p.lda, p.batch, p.stride_a)
        opb = _colmajor(b, operands, *((p.n, p.k) if p.trans_b else (p.k, p.n)), p.ldb, p.batch, p.stride_b)
        opa, opb = (x.swapaxes(1, 2) if t else x for x, t in ((opa, p.trans_a), (opb, p.trans_b)))
        out = p.alpha * np.matmul(opa.astype(np.float64), opb.astype(np.float64))
        if p.beta:
            out += p.beta * _colmajor(c or d, dt, p.m, p.n, p.ldc, p.batch, p.stride_c)
        _colmajor(d, dt, p.m, p.n, p.ldc, p.batch, p.stride_c)[...] = out


@pytest.fixture
def blas_device(emulated: EmulatedDevice) -> Any:
    device = EmulatedDevice(kernel_dir=emulated.kernel_dir, cache=emulated.cache)
    device.blas = NumpyBlas()  # type: ignore[attr-defined]
    return device


MATMULS = [name for name, case in CASES.items()
           if case.op in ("matmul", "batched_matmul", "fused_lm_head_loss", "fused_lm_head_loss_backward",
                          "fused_lm_head_loss_and_grad")]


@pytest.mark.parametrize("name", MATMULS)
def test_matmul_cases_through_the_cublaslt_path(blas_device: Any, name: str) -> None:
    """Every transpose, alpha, beta, accumulate, a batch, and the LM head's tiles (its fused pass tiled over
    the vocabulary too): the plans cuBLASLt would get give the NumPy reference's results, and the SIMT
    kernel is not used. cuBLASLt cannot round on load: a float32 operand of the bf16 recipe's matmul takes
    a bf16 copy (one cast kernel), and a bf16 output is the GEMM's D type."""
    case = CASES[name]
    assert run_case(case, blas_device) <= case.atol
    assert blas_device.blas.calls
    if "matmul" in case.op:
        assert blas_device.launches == len(case.rounded_on_load)
        if case.bf16 and not case.fp32_out:
            assert {p.types[2] for p in blas_device.blas.calls} == {CUDA_TYPES["bfloat16"]}


@pytest.mark.parametrize("name", ["grouped_gemm-NT", "grouped_gemm-NN", "moe_grouped_gemm_dx",
                                  "moe_grouped_gemm_dw"])
def test_grouped_gemms_one_cublaslt_gemm_per_expert(blas_device: Any, name: str) -> None:
    case = CASES[name]
    assert run_case(case, blas_device) <= case.atol
    assert len(blas_device.blas.calls) == 3  # four experts, one of them empty: no GEMM (dw: zeros)
    assert blas_device.launches == 0


def test_bf16_in_fp32_accumulate() -> None:
    plan = gemm_plan((4, 8), (8, 6), (4, 6), ("bfloat16", "bfloat16", "float32"))
    assert plan.types == (14, 14, 0) and plan.compute == _blas.COMPUTE_32F
    tf32 = gemm_plan((4, 8), (8, 6), (4, 6), ("float32",) * 3, tf32=True)
    assert tf32.compute == _blas.COMPUTE_32F_FAST_TF32
    assert gemm_plan((4, 8), (8, 6), (4, 6), ("bfloat16",) * 3, tf32=True).compute == _blas.COMPUTE_32F


@pytest.mark.parametrize(("args", "message"), [
    (((4, 8), (8, 6), (4, 6), ("bfloat16", "float32", "float32")), "must both be bfloat16 or both float32"),
    (((4, 8), (8, 6), (4, 6), ("float16",) * 3), "must both be bfloat16 or both float32"),
    (((4, 8), (7, 6), (4, 6), ("float32",) * 3), r"op\(a\) of \(4, 8\) \(NN\) times op\(b\) of \(7, 6\)"),
    (((2, 4, 8), (3, 8, 6), (2, 4, 6), ("float32",) * 3), "does not make out"),
    (((8,), (8, 6), (6,), ("float32",) * 3), "same rank"),
])
def test_bad_matmuls_are_named(args: tuple, message: str) -> None:
    with pytest.raises(KilnError, match=message):
        gemm_plan(*args)
    with pytest.raises(KilnError, match="transpose must be"):
        gemm_plan((4, 8), (8, 6), (4, 6), ("float32",) * 3, transpose="NX")


def test_without_nvmath_a_gpu_device_keeps_the_simt_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_blas.importlib.util, "find_spec", lambda name: None)
    assert not _blas.nvmath_installed()


def test_the_bf16_recipe_gives_cublaslt_bf16_operands(emulated: EmulatedDevice) -> None:
    """Under the bf16 recipe the backend hands cuBLASLt bf16 a and b (fp32 out): a tiny Qwen3 trains two
    steps through that path, every GEMM of its matmuls with bf16 operands, within 1e-3 of the NumPy
    backend's emulation (the oracle GEMM sums in float64, NumPy in float32: a bf16 rounding of a matmul
    output flips now and then)."""
    pytest.importorskip("ml_dtypes")
    dsl = pytest.importorskip("kiln.dsl", reason="the Qwen3 model comes from kiln-dsl")
    from kiln.core import Model, PluginSession
    from kiln.cuda import EmulatedCuda
    from kiln.dsl.stdlib.models import Qwen3Model

    config = {"vocab_size": 64, "d_model": 32, "n_layers": 1, "num_query_heads": 4, "num_kv_heads": 2,
              "head_size": 8, "d_ff": 64, "max_seq": 16}
    bundle = dsl.build_bundle(Qwen3Model, config)
    device = EmulatedDevice(kernel_dir=emulated.kernel_dir, cache=emulated.cache)
    device.blas = NumpyBlas()  # type: ignore[attr-defined]
    rng = np.random.default_rng(0)
    batch = {"input_ids": rng.integers(0, 64, (2, 8)), "labels": rng.integers(0, 64, (2, 8))}
    session = PluginSession(autoload=False)
    session.register(EmulatedCuda(device), "cuda-emulated")
    with session.activate():
        ref, got = (Model.from_ir(bundle, seed=0, backend=b, precision="bf16") for b in ("numpy", "cuda"))
        for _ in range(2):
            assert got.train_step(batch)["loss"] == pytest.approx(ref.train_step(batch)["loss"], abs=1e-3)
    bf16 = CUDA_TYPES["bfloat16"]
    assert device.blas.calls and all(p.types[:2] == (bf16, bf16) for p in device.blas.calls)
