"""Small helpers shared by the op modules: shape rules and sample generators."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from kiln.core.ir._dims import Shape, dims_equal
from kiln.core.ir._ir import TensorType
from kiln.core.ops._ops import InferContext, OpDef


@attrs.frozen
class CoreOp:
    """A core op: its definition and the NumPy backend's ``out=`` kernel for it (if it has one)."""

    opdef: OpDef
    out_kernel: Callable[..., None] | None = None
    #: inputs whose storage the out kernel's first output may take over (elementwise, same shape)
    inplace: frozenset[int] = frozenset()


def core_op(*args: Any, out_kernel: Callable[..., None] | None = None, inplace: Sequence[int] | set[int] = (),
            **kwargs: Any) -> CoreOp:
    """An :class:`OpDef` with the NumPy backend's fast kernel beside it (registered in the kernel table)."""
    return CoreOp(OpDef(*args, **kwargs), out_kernel, frozenset(inplace))


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


#: the outputs an ``out_kernel`` writes: arena views, ``None`` for an output nothing reads
Outs = Sequence[np.ndarray | None]


def or_scratch(out: Outs, shapes: Sequence[tuple[int, ...]], dtype: np.dtype) -> list[np.ndarray]:
    """The ``out_kernel`` outputs, with a fresh array standing in for each unused (``None``) one."""
    return [np.empty(s, dtype) if o is None else o for o, s in zip(out, shapes, strict=True)]


def allocating(out_kernel: Callable[..., None], shapes: Sequence[tuple[int, ...]], *inputs: np.ndarray | None,
               **attrs: Any) -> tuple[np.ndarray, ...]:
    """Run ``out_kernel`` into fresh outputs (the float dtype of the inputs): the reference kernel of an
    op whose only implementation is its ``out_kernel``, so the two agree bit for bit."""
    dtype = float_dtype_of(*inputs)
    outs = tuple(np.empty(s, dtype) for s in shapes)
    out_kernel(*inputs, out=outs, **attrs)
    return outs


def view(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``x`` reshaped without a copy, so that writing the result writes ``x``."""
    out = x.reshape(shape)
    if out.size and not np.may_share_memory(out, x):
        raise AssertionError(f"a {x.shape} array with strides {x.strides} has no {shape} view")
    return out

