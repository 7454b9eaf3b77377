"""Small helpers shared by the op modules: shape rules and sample generators."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from kiln.core._errors import OpError
from kiln.core.ir._dims import Shape, dims_equal
from kiln.core.ir._ir import TensorType, is_float
from kiln.core.ops._ops import InferContext, OpDef, no_gradient


@attrs.frozen
class CoreOp:
    """A core op: its definition and the NumPy backend's ``out=`` kernel for it (if it has one)."""

    opdef: OpDef
    out_kernel: Callable[..., None] | None = None
    #: inputs whose storage the out kernel's first output may take over (elementwise, same shape)
    inplace: frozenset[int] = frozenset()


Infer = Callable[[InferContext], Sequence[TensorType]]


def core_op(name: str, inputs: Sequence[str], outputs: Sequence[str], kernel: Callable[..., Any],
            infer: Infer, *,
            out_kernel: Callable[..., None] | None = None, inplace: Sequence[int] | set[int] = (),
            any_dtype: bool = False, **kwargs: Any) -> CoreOp:
    """An :class:`OpDef` with the NumPy backend's fast kernel beside it (registered in the kernel table).

    The dtype rule of a differentiable op is part of its shape rule: its differentiable inputs are
    float (E015), unless ``any_dtype`` (data movement and integer arithmetic), where they share one
    kind, all float or all integer."""
    if kwargs.get("backward") not in (None, no_gradient):
        infer = _dtype_checked(infer, tuple(inputs), frozenset(kwargs.get("nondiff_inputs", ())), any_dtype)
    return CoreOp(OpDef(name, inputs, outputs, kernel, infer, **kwargs), out_kernel, frozenset(inplace))


def _dtype_checked(infer: Infer, schema: tuple[str, ...], nondiff: frozenset[int], any_dtype: bool) -> Infer:
    def checked(ctx: InferContext) -> Sequence[TensorType]:
        given = [(schema[min(i, len(schema) - 1)].strip("*?"), t) for i, t in enumerate(ctx.inputs)
                 if t is not None and i not in nondiff]
        ints = [(name, t.dtype) for name, t in given if not is_float(t.dtype)]
        floats = [(name, t.dtype) for name, t in given if is_float(t.dtype)]
        if ints and (floats or not any_dtype):
            name, dtype = ints[0]
            why = (f"it is combined with {floats[0][0]!r} ({floats[0][1]})" if any_dtype else
                   f"{ctx.op} computes in floating point")
            raise OpError(f"op {ctx.op!r}: input {name!r} is {dtype}, but {why}", op=ctx.op, code="E015",
                          hint="pass a float tensor; an integer tensor (ids, positions) converts to float "
                               "only explicitly")
        return infer(ctx)

    return checked


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

