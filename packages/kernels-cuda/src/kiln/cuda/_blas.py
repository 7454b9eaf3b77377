"""Matmuls and grouped GEMMs through cuBLASLt (nvmath-python's bindings), bf16 or fp32 in, fp32 accumulate.

:func:`gemm_plan` maps kiln's row-major ``out = alpha op(a) op(b) (+ beta c)`` onto cuBLASLt's
column-major GEMM: a row-major matrix is its transpose in column-major order, so cuBLASLt computes
``out^T = op(b)^T op(a)^T`` with ``b`` as its A operand and ``a`` as its B. The plan is plain data (sizes,
transposes, leading dimensions, batch strides, data and compute types), checked on any machine; running
it (:class:`Blas`) needs a GPU and nvmath-python. Where cuBLASLt is not there, the launch code uses the
SIMT kernels.
"""

from __future__ import annotations

import ctypes
import importlib.util
import math
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from kiln.core import KilnError

#: kiln dtype -> cudaDataType (library_types.h)
CUDA_TYPES = {"float32": 0, "bfloat16": 14}
#: cublasComputeType_t: fp32 accumulate, or fp32 with TF32 products for float32 inputs
COMPUTE_32F, COMPUTE_32F_FAST_TF32 = 68, 77
#: workspace cuBLASLt may use per call (its recommendation for Hopper)
WORKSPACE_BYTES = 32 << 20
#: the pointer alignment cuBLASLt's heuristic assumes of A, B, C and D unless told less
MAX_ALIGNMENT = 256


def alignment(ptr: int) -> int:
    """The alignment in bytes of a device pointer that cuBLASLt is told (the largest power of two
    dividing it, at most :data:`MAX_ALIGNMENT`): kiln's arena slots and their views are 64-byte aligned
    or less, and an algorithm chosen for 256-byte operands may not run on them."""
    return MAX_ALIGNMENT if ptr == 0 else min(MAX_ALIGNMENT, ptr & -ptr)


@attrs.frozen
class GemmPlan:
    """One (batched) cuBLASLt GEMM, column-major: ``D[m, n] = alpha opA(A) opB(B) + beta C``, A the
    kernel's ``b`` buffer and B its ``a`` buffer; ``ld*`` leading dimensions and ``stride_*`` batch strides
    in elements; ``types`` the cudaDataType of A, B, C (= D)."""

    m: int
    n: int
    k: int
    trans_a: bool
    trans_b: bool
    lda: int
    ldb: int
    ldc: int
    batch: int
    stride_a: int
    stride_b: int
    stride_c: int
    types: tuple[int, int, int]
    compute: int
    alpha: float
    beta: float


def gemm_plan(a_shape: Sequence[int], b_shape: Sequence[int], out_shape: Sequence[int],
              dtypes: Sequence[str], *, transpose: str = "NN", alpha: float = 1.0, beta: float = 0.0,
              tf32: bool = False) -> GemmPlan:
    """The cuBLASLt GEMM of ``out = alpha op(a) op(b) + beta c`` for row-major ``a``, ``b``, ``out`` with
    equal leading (batch) dims; ``dtypes`` are a's, b's and out's (``beta`` 0 when there is no c).
    A ``KilnError`` names what does not fit."""
    a_dt, b_dt, out_dt = dtypes
    if transpose not in ("NN", "NT", "TN", "TT"):
        raise KilnError(f"matmul on cuBLASLt: transpose must be NN, NT, TN or TT, found {transpose!r}")
    if a_dt != b_dt or a_dt not in CUDA_TYPES or out_dt not in CUDA_TYPES:
        raise KilnError(f"matmul on cuBLASLt: a and b must both be bfloat16 or both float32, out either; "
                        f"found a {a_dt}, b {b_dt}, out {out_dt}")
    if len(a_shape) < 2 or len(b_shape) != len(a_shape) or len(out_shape) != len(a_shape):
        raise KilnError(f"matmul on cuBLASLt: a {tuple(a_shape)}, b {tuple(b_shape)} and out "
                        f"{tuple(out_shape)} must have the same rank (>= 2)")
    ta, tb = transpose[0] == "T", transpose[1] == "T"
    rows, k = (a_shape[-1], a_shape[-2]) if ta else (a_shape[-2], a_shape[-1])
    kb, cols = (b_shape[-1], b_shape[-2]) if tb else (b_shape[-2], b_shape[-1])
    batch = tuple(a_shape[:-2])
    if kb != k or tuple(out_shape) != (*batch, rows, cols) or tuple(b_shape[:-2]) != batch:
        raise KilnError(f"matmul on cuBLASLt: op(a) of {tuple(a_shape)} ({transpose}) times op(b) of "
                        f"{tuple(b_shape)} does not make out {tuple(out_shape)}")
    compute = COMPUTE_32F_FAST_TF32 if tf32 and a_dt == "float32" else COMPUTE_32F
    # column-major: out^T [cols, rows] = op(b)^T [cols, k] op(a)^T [k, rows]; a row-major [r, c] buffer
    # is the column-major [c, r] matrix, with leading dimension c
    return GemmPlan(m=cols, n=rows, k=k, trans_a=tb, trans_b=ta, lda=b_shape[-1], ldb=a_shape[-1], ldc=cols,
                    batch=math.prod(batch), stride_a=k * cols, stride_b=rows * k, stride_c=rows * cols,
                    types=(CUDA_TYPES[b_dt], CUDA_TYPES[a_dt], CUDA_TYPES[out_dt]), compute=compute,
                    alpha=alpha, beta=beta)


def nvmath_installed() -> bool:
    try:
        return importlib.util.find_spec("nvmath") is not None
    except (ImportError, ValueError):
        return False


class Blas:
    """cuBLASLt on one GPU (nvmath-python's ``nvmath.bindings.cublasLt``): a handle, a workspace, and the
    descriptors of each plan, made once and kept. Created by :class:`kiln.cuda._device.CudaDevice` when
    nvmath-python is installed; never on a machine without a GPU."""

    def __init__(self, device: Any) -> None:
        from nvmath.bindings import cublasLt

        self.lt, self.device = cublasLt, device
        self.handle = cublasLt.create()
        self.workspace = device.alloc(WORKSPACE_BYTES)
        self._plans: dict[tuple[GemmPlan, tuple[int, ...]], tuple[Any, ...]] = {}

    def _descriptors(self, plan: GemmPlan, aligned: tuple[int, int, int, int]) -> tuple[Any, ...]:
        """The descriptors and heuristic algorithm of ``plan`` for operands A, B, C, D with the byte
        alignments ``aligned`` (:func:`alignment`), made once per pair."""
        found = self._plans.get((plan, aligned))
        if found is not None:
            return found
        lt = self.lt
        desc = lt.matmul_desc_create(plan.compute, CUDA_TYPES["float32"])
        for attr, value in ((lt.MatmulDescAttribute.TRANSA, plan.trans_a),
                            (lt.MatmulDescAttribute.TRANSB, plan.trans_b)):
            flag = ctypes.c_int32(int(value))  # cublasOperation_t: 0 = N, 1 = T
            lt.matmul_desc_set_attribute(desc, attr, ctypes.addressof(flag), 4)
        layouts = []
        a_dims = (plan.k, plan.m) if plan.trans_a else (plan.m, plan.k)  # as stored, before the transpose
        b_dims = (plan.n, plan.k) if plan.trans_b else (plan.k, plan.n)
        for dtype, rows, cols, ld, stride in ((plan.types[0], *a_dims, plan.lda, plan.stride_a),
                                              (plan.types[1], *b_dims, plan.ldb, plan.stride_b),
                                              (plan.types[2], plan.m, plan.n, plan.ldc, plan.stride_c)):
            layout = lt.matrix_layout_create(dtype, rows, cols, ld)
            if plan.batch > 1:
                count, offset = ctypes.c_int32(plan.batch), ctypes.c_int64(stride)
                lt.matrix_layout_set_attribute(layout, lt.MatrixLayoutAttribute.BATCH_COUNT,
                                               ctypes.addressof(count), 4)
                lt.matrix_layout_set_attribute(layout, lt.MatrixLayoutAttribute.STRIDED_BATCH_OFFSET,
                                               ctypes.addressof(offset), 8)
            layouts.append(layout)
        pref = lt.matmul_preference_create()
        size = ctypes.c_uint64(WORKSPACE_BYTES)
        lt.matmul_preference_set_attribute(pref, lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES,
                                           ctypes.addressof(size), 8)
        pa = lt.MatmulPreferenceAttribute
        mins = (pa.MIN_ALIGNMENT_A_BYTES, pa.MIN_ALIGNMENT_B_BYTES, pa.MIN_ALIGNMENT_C_BYTES,
                pa.MIN_ALIGNMENT_D_BYTES)
        for attr, value in zip(mins, aligned, strict=True):
            bytes_ = ctypes.c_uint32(value)
            lt.matmul_preference_set_attribute(pref, attr, ctypes.addressof(bytes_), 4)
        results, count = lt.MatmulHeuristicResult(1), ctypes.c_int32(0)
        a, b, c = layouts
        lt.matmul_algo_get_heuristic(self.handle, desc, a, b, c, c, pref, 1, results.ptr,
                                     ctypes.addressof(count))
        if count.value < 1:
            raise KilnError(f"cuBLASLt has no algorithm for {plan}")
        found = (desc, a, b, c, results)
        self._plans[(plan, aligned)] = found
        return found

    def gemm(self, plan: GemmPlan, a: int, b: int, c: int, d: int) -> None:
        """Runs ``plan`` on device pointers (cuBLASLt's A, B, C, D) on the default stream, with an
        algorithm chosen for their alignments."""
        aligned = (alignment(a), alignment(b), alignment(c or d), alignment(d))
        desc, la, lb, lc, algo = self._descriptors(plan, aligned)
        alpha, beta = np.array([plan.alpha], np.float32), np.array([plan.beta], np.float32)
        # the heuristic result begins with its cublasLtMatmulAlgo_t: its address is the algorithm's
        self.lt.matmul(self.handle, desc, alpha.ctypes.data, a, la, b, lb, beta.ctypes.data, c or d, lc, d,
                       lc, algo.ptr, self.workspace, WORKSPACE_BYTES, int(getattr(self.device, "stream", 0)))
