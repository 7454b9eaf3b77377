"""Tensor manipulation: view/reshape, transpose, permute, split, concat, copy, contiguous.

Every kernel returns a fresh array, never a view of its input, so no aliasing leaks between
tensors of the reference interpreter (the real backends make view, split and transpose free).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from kiln.core._errors import OpError
from kiln.core.ir._dims import Const, DimExpr, simplify
from kiln.core.ir._ir import TensorType
from kiln.core.ops._ops import AttrSpec, BackwardContext, Cost, InferContext, Sample
from kiln.core.ops.library._common import CoreOp, check_same, core_op, randn, same_as


def _prod(dims: Sequence[DimExpr]) -> DimExpr:
    return functools.reduce(operator.mul, dims, Const(1))


def _provably_different(a: DimExpr, b: DimExpr) -> bool:
    """Whether ``a - b`` simplifies to a nonzero constant (undecidable cases count as equal)."""
    d = simplify(a - b)
    return isinstance(d, Const) and d.value != 0


def _axis(ctx: InferContext, dim: int, rank: int) -> int:
    if not -rank <= dim < rank:
        raise ctx.fail(f"dim {dim} is out of range for rank {rank}")
    return dim % rank


def _fmt(shape: Sequence[DimExpr]) -> str:
    return f"[{', '.join(map(str, shape))}]"


def _bytes(shapes: Sequence[tuple[int, ...]]) -> float:
    return 4.0 * sum(math.prod(s) for s in shapes)


# --- view / reshape ------------------------------------------------------------------------------


def _view(x: np.ndarray, *, shape: tuple[int, ...]) -> np.ndarray:
    return np.reshape(x, shape).copy()


def _view_infer(ctx: InferContext) -> list[TensorType]:
    src, dst = ctx.shape(0), ctx.dims("shape")
    holes = [i for i, d in enumerate(dst) if d == Const(-1)]
    if len(holes) > 1:
        raise ctx.fail(f"at most one -1 may be inferred, found {len(holes)} in {_fmt(dst)}")
    if any(isinstance(d, Const) and d.value < 0 for i, d in enumerate(dst) if i not in holes):
        raise ctx.fail(f"negative size in {_fmt(dst)}")
    numel = _prod(src)
    if holes:
        others = _prod([d for i, d in enumerate(dst) if i != holes[0]])
        if simplify(others) == Const(0):
            raise ctx.fail(f"cannot infer the -1 in {_fmt(dst)} next to a zero-size dim")
        if _provably_different(simplify(numel % others), Const(0)):
            raise ctx.fail(f"cannot view {_fmt(src)} as {_fmt(dst)}: "
                           f"{simplify(numel)} elements do not divide into rows of {simplify(others)}")
        dst = (*dst[:holes[0]], simplify(numel // others), *dst[holes[0] + 1:])
    elif _provably_different(numel, _prod(dst)):
        raise ctx.fail(f"cannot view {_fmt(src)} ({simplify(numel)} elements) as {_fmt(dst)} "
                       f"({simplify(_prod(dst))} elements)")
    return [TensorType(dst, ctx.dtype(0))]


def _view_backward(op: str) -> Callable[[BackwardContext], list[str | None]]:
    return lambda ctx: [ctx.emit(op, ctx.d_out, shape=ctx.shape_of(0))]


def _view_samples(rng: np.random.Generator) -> Iterator[Sample]:
    yield Sample((randn(rng, 2, 3, 4),), {"shape": (6, 4)})
    yield Sample((randn(rng, 2, 3, 4),), {"shape": (4, -1, 2)})


def _view_def(name: str) -> CoreOp:
    return core_op(
        name, ("x",), ("out",), _view, _view_infer, backward=_view_backward(name),
        attrs=(AttrSpec("shape", "dims"),), samples=_view_samples, cost=lambda s, a: Cost(), alias=True,
        any_dtype=True,
        doc="The same elements in row-major order under a new shape; one -1 dim is inferred.",
    )


# --- transpose / permute -------------------------------------------------------------------------


def _transpose(x: np.ndarray, *, dim0: int, dim1: int) -> np.ndarray:
    return np.swapaxes(x, dim0, dim1).copy()


def _transpose_infer(ctx: InferContext) -> list[TensorType]:
    shape = list(ctx.shape(0))
    a, b = (_axis(ctx, ctx.attrs[k], len(shape)) for k in ("dim0", "dim1"))
    shape[a], shape[b] = shape[b], shape[a]
    return [TensorType(tuple(shape), ctx.dtype(0))]


def _permute(x: np.ndarray, *, dims: tuple[int, ...]) -> np.ndarray:
    return np.transpose(x, dims).copy()


def _permute_infer(ctx: InferContext) -> list[TensorType]:
    shape, dims = ctx.shape(0), ctx.attrs["dims"]
    axes = [_axis(ctx, d, len(shape)) for d in dims]
    if sorted(axes) != list(range(len(shape))):
        raise ctx.fail(f"dims {list(dims)} are not a permutation of the {len(shape)} axes of {_fmt(shape)}")
    return [TensorType(tuple(shape[a] for a in axes), ctx.dtype(0))]


def _permute_backward(ctx: BackwardContext) -> list[str | None]:
    rank = len(ctx.shape_of(0))
    inverse = tuple(int(i) for i in np.argsort([d % rank for d in ctx.attrs["dims"]]))
    return [ctx.emit("permute", ctx.d_out, dims=inverse)]


# --- split / concat ------------------------------------------------------------------------------


def _split(x: np.ndarray, *, sizes: tuple[int, ...], dim: int) -> tuple[np.ndarray, ...]:
    if sum(sizes) != x.shape[dim]:
        raise OpError(f"op 'split': sizes {list(sizes)} sum to {sum(sizes)}, but dim {dim} of {x.shape} "
                      f"is {x.shape[dim]}", op="split", code="E004")
    return tuple(p.copy() for p in np.split(x, np.cumsum(sizes)[:-1], axis=dim))


def _split_infer(ctx: InferContext) -> list[TensorType]:
    shape, sizes = ctx.shape(0), ctx.dims("sizes")
    axis = _axis(ctx, ctx.attrs["dim"], len(shape))
    if not sizes or any(isinstance(s, Const) and s.value < 0 for s in sizes):
        raise ctx.fail(f"sizes must be a non-empty list of sizes >= 0, found [{', '.join(map(str, sizes))}]")
    if _provably_different(_sum(sizes), shape[axis]):
        raise ctx.fail(f"sizes [{', '.join(map(str, sizes))}] sum to {_sum(sizes)}, "
                       f"but dim {axis} of {_fmt(shape)} is {shape[axis]}")
    return [TensorType((*shape[:axis], s, *shape[axis + 1:]), ctx.dtype(0)) for s in sizes]


def _sum(dims: Sequence[DimExpr]) -> DimExpr:
    return simplify(functools.reduce(operator.add, dims, Const(0)))


def _split_backward(ctx: BackwardContext) -> list[str | None]:
    if not ctx.needs_grad(0) or all(d is None for d in ctx.d_outputs):
        return [None]
    parts = []
    for name, d in zip(ctx.outputs, ctx.d_outputs, strict=True):
        if d is None:
            t = ctx.type_of(name)
            d = ctx.emit("zeros", shape=tuple(s.to_json() for s in t.shape), dtype=t.dtype)
        parts.append(d)
    return [parts[0] if len(parts) == 1 else ctx.emit("concat", *parts, dim=ctx.attrs["dim"])]


def _concat(*xs: np.ndarray, dim: int) -> np.ndarray:
    return np.concatenate(xs, axis=dim)


def _concat_infer(ctx: InferContext) -> list[TensorType]:
    first = ctx.shape(0)
    axis = _axis(ctx, ctx.attrs["dim"], len(first))
    for i in range(1, len(ctx.inputs)):
        shape = ctx.shape(i)
        if ctx.dtype(i) != ctx.dtype(0):
            raise ctx.fail(f"input {i} is {ctx.dtype(i)}, input 0 is {ctx.dtype(0)}")
        if len(shape) != len(first):
            raise ctx.fail(f"input {i} has rank {len(shape)}, input 0 has rank {len(first)}")
        check_same(ctx, first[:axis] + first[axis + 1:], shape[:axis] + shape[axis + 1:],
                   f"input {i} differs from input 0 outside dim {axis}")
    total = _sum([ctx.shape(i)[axis] for i in range(len(ctx.inputs))])
    return [TensorType((*first[:axis], total, *first[axis + 1:]), ctx.dtype(0))]


def _concat_backward(ctx: BackwardContext) -> list[str | None]:
    n = len(ctx.inputs)
    if not any(ctx.needs_grad(i) for i in range(n)):
        return [None] * n
    if n == 1:
        return [ctx.d_out]
    axis = ctx.attrs["dim"] % len(ctx.shape_of(0))
    parts = ctx.emit("split", ctx.d_out, n_out=n, sizes=tuple(ctx.shape_of(i)[axis] for i in range(n)),
                     dim=ctx.attrs["dim"])
    return [p if ctx.needs_grad(i) else None for i, p in enumerate(parts)]


def _split_samples(rng: np.random.Generator) -> Iterator[Sample]:
    yield Sample((randn(rng, 3, 7),), {"sizes": (2, 4, 1)})
    yield Sample((randn(rng, 5, 2, 3),), {"sizes": (3, 2), "dim": 0})
    yield Sample((randn(rng, 2, 4),), {"sizes": (4,)})


def _concat_samples(rng: np.random.Generator) -> Iterator[Sample]:
    yield Sample((randn(rng, 3, 2), randn(rng, 3, 4), randn(rng, 3, 1)), {})
    yield Sample((randn(rng, 2, 2, 3), randn(rng, 1, 2, 3)), {"dim": 0})
    yield Sample((randn(rng, 2, 3),), {"dim": 1})


def _identity_backward(ctx: BackwardContext) -> list[str | None]:
    return [ctx.d_out]


def _copy_def(name: str, doc: str, alias: bool = False) -> CoreOp:
    return core_op(name, ("x",), ("out",), lambda x: x.copy(), same_as(), backward=_identity_backward,
                   out_kernel=lambda x, *, out: np.copyto(out[0], x),
                   samples=lambda rng: [Sample((randn(rng, 3, 4),), {})],
                   cost=lambda s, a: Cost(bytes=2 * _bytes(s)), alias=alias, any_dtype=True, doc=doc)


CORE_OPS = [
    _view_def("view"),
    _view_def("reshape"),
    core_op(
        "transpose", ("x",), ("out",), _transpose, _transpose_infer,
        backward=lambda ctx: [ctx.emit("transpose", ctx.d_out, **ctx.attrs)],
        attrs=(AttrSpec("dim0", "int"), AttrSpec("dim1", "int")),
        samples=lambda rng: [Sample((randn(rng, 2, 3, 4),), {"dim0": 0, "dim1": -1}),
                             Sample((randn(rng, 3, 5),), {"dim0": 1, "dim1": 0})],
        cost=lambda s, a: Cost(bytes=2 * _bytes(s)),
        any_dtype=True,
        doc="x with axes dim0 and dim1 swapped.",
    ),
    core_op(
        "permute", ("x",), ("out",), _permute, _permute_infer, backward=_permute_backward,
        attrs=(AttrSpec("dims", "ints"),),
        samples=lambda rng: [Sample((randn(rng, 2, 3, 4),), {"dims": (2, 0, 1)}),
                             Sample((randn(rng, 2, 3, 1, 4),), {"dims": (0, -2, 3, 1)})],
        cost=lambda s, a: Cost(bytes=2 * _bytes(s)),
        any_dtype=True,
        doc="x with its axes reordered: output axis k is input axis dims[k].",
    ),
    core_op(
        "split", ("x",), ("*parts",), _split, _split_infer, backward=_split_backward,
        attrs=(AttrSpec("sizes", "dims"), AttrSpec("dim", "int", -1)), samples=_split_samples,
        cost=lambda s, a: Cost(),
        any_dtype=True,
        doc="Consecutive slices of x along dim, one output per entry of sizes (which sum to that dim).",
    ),
    core_op(
        "concat", ("*xs",), ("out",), _concat, _concat_infer, backward=_concat_backward,
        attrs=(AttrSpec("dim", "int", -1),), samples=_concat_samples,
        cost=lambda s, a: Cost(bytes=2 * _bytes(s)),
        any_dtype=True,
        doc="The inputs joined along dim (equal shapes elsewhere).",
    ),
    _copy_def("copy", "A copy of x."),
    _copy_def("contiguous", "x laid out contiguously: the same bytes, planned as a view of x.", alias=True),
]

OPS = [c.opdef for c in CORE_OPS]
