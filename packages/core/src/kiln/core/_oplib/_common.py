"""Small helpers shared by the op modules: shape rules and sample generators."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kiln.core._dims import Shape, dims_equal
from kiln.core._ir import TensorType
from kiln.core._ops import InferContext


def same_as(i: int = 0, n: int = 1) -> Callable[[InferContext], list[TensorType]]:
    """Shape rule: ``n`` outputs with the type of input ``i``."""
    return lambda ctx: [TensorType(ctx.shape(i), ctx.dtype(i))] * n


def check_same(ctx: InferContext, a: Shape, b: Shape, what: str) -> None:
    if len(a) != len(b) or not all(dims_equal(x, y) for x, y in zip(a, b, strict=True)):
        raise ctx.fail(f"{what}: [{', '.join(map(str, a))}] vs [{', '.join(map(str, b))}]")


def randn(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape)


def float_dtype_of(*arrays: np.ndarray | None) -> np.dtype:
    """The float dtype a kernel computes in: that of its float inputs (float32 if none)."""
    dts = [a.dtype for a in arrays if a is not None and np.issubdtype(a.dtype, np.floating)]
    return np.result_type(*dts) if dts else np.dtype(np.float32)


def shapes(*dims: Sequence[int]) -> list[tuple[int, ...]]:
    return [tuple(d) for d in dims]
