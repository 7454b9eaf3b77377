"""Elementwise arithmetic, activations, softmax, reductions, broadcasting, creation ops and dropout."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln.core._errors import KilnError
from kiln.core._threads import parallel, row_blocks, scratch
from kiln.core.ir._dims import Const, DimExpr, Shape, dims_equal, parse_dim, parse_shape, simplify
from kiln.core.ir._ir import TensorType
from kiln.core.ops._ops import AttrSpec, BackwardContext, Cost, InferContext, Sample, no_gradient
from kiln.core.ops.library._common import check_same, core_op, randn, same_as

Array = npt.NDArray[np.floating[Any]]
UInt = npt.NDArray[np.uint64]
Grads = list[str | None]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_C = 0.044715
_erf_object = np.frompyfunc(math.erf, 1, 1)


def _erf(x: Array) -> Array:
    return np.asarray(_erf_object(x), dtype=x.dtype)


def _is_one(d: Any) -> bool:
    return isinstance(d, Const) and d.value == 1


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _ew_cost(flops: float, arrays: int) -> Callable[[Sequence[tuple[int, ...]], Mapping[str, Any]], Cost]:
    """Cost of an op touching ``arrays`` tensors the size of its first input."""
    return lambda s, a: Cost(flops=flops * _numel(s[0]), bytes=4.0 * arrays * _numel(s[0]))


def _away_from_zero(rng: np.random.Generator, *shape: int) -> Array:
    """Random values with |x| in [0.1, 2]: no kink of relu inside the finite-difference step."""
    return rng.uniform(0.1, 2.0, shape) * np.where(rng.random(shape) < 0.5, -1.0, 1.0)


# ---------------------------------------------------------------------------------------------
# Axes and broadcasting


def _norm_axes(axes: Sequence[int], rank: int, ctx: InferContext | None = None) -> tuple[int, ...]:
    out = tuple(a + rank if a < 0 else a for a in axes)
    if ctx is not None:
        if not out:
            raise ctx.fail("axes must name at least one axis")
        bad = [a for a, n in zip(axes, out, strict=True) if not 0 <= n < rank]
        if bad:
            raise ctx.fail(f"axes {list(bad)} out of range for rank {rank}")
        if len(set(out)) != len(out):
            raise ctx.fail(f"axes {list(axes)} name an axis twice")
    return out


def _placement(rank_out: int, rank_in: int, axes: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Where an operand's dims land in a broadcast result: the new axes (``axes``, or the leading
    ones NumPy-style) and, in order, the result position of each operand dim."""
    new = tuple(sorted(axes)) if axes else tuple(range(rank_out - rank_in))
    return new, tuple(i for i in range(rank_out) if i not in new)


def _check_broadcast(ctx: InferContext, src: Shape, dst: Shape, axes: Sequence[int], what: str) -> None:
    if len(src) + len(axes) > len(dst) or (axes and len(src) + len(axes) != len(dst)):
        raise ctx.fail(f"{what}: rank {len(src)} does not broadcast to rank {len(dst)}"
                       + (f" with new axes {list(axes)}" if axes else ""))
    _, kept = _placement(len(dst), len(src), axes)
    for d, pos in zip(src, kept, strict=True):
        if not (_is_one(d) or dims_equal(d, dst[pos])):
            raise ctx.fail(f"{what}: [{', '.join(map(str, src))}] does not broadcast to "
                           f"[{', '.join(map(str, dst))}]")


def _sum_to(ctx: BackwardContext, grad: str, dst: Shape, src: Shape, axes: Sequence[int] = ()) -> str:
    """Reduce the gradient of a broadcast result (shape ``dst``) back to the operand's shape ``src``."""
    new, kept = _placement(len(dst), len(src), axes)
    ones = tuple(k for k, (d, pos) in enumerate(zip(src, kept, strict=True))
                 if _is_one(d) and not _is_one(dst[pos]))
    if new:
        grad = ctx.emit("reduce_sum", grad, axes=new)
    if ones:
        grad = ctx.emit("reduce_sum", grad, axes=ones, keepdims=True)
    return grad


def _broadcast_to(x: Array, *, shape: tuple[int, ...], axes: tuple[int, ...]) -> Array:
    y = np.expand_dims(x, _norm_axes(axes, len(shape))) if axes else x
    return np.broadcast_to(y, shape).copy()


def _broadcast_to_infer(ctx: InferContext) -> list[TensorType]:
    dst = ctx.dims("shape")
    axes = _norm_axes(ctx.attrs["axes"], len(dst), ctx) if ctx.attrs["axes"] else ()
    _check_broadcast(ctx, ctx.shape(0), dst, axes, "input")
    return [TensorType(dst, ctx.dtype(0))]


def _broadcast_to_backward(ctx: BackwardContext) -> Grads:
    if not ctx.needs_grad(0):
        return [None]
    dst = parse_shape(ctx.attrs["shape"])
    axes = _norm_axes(ctx.attrs["axes"], len(dst))
    return [_sum_to(ctx, ctx.d_out, dst, ctx.type_of(0).shape, axes)]


def _broadcast_to_samples(rng: np.random.Generator) -> Iterator[Sample]:
    yield Sample((randn(rng, 4),), {"shape": (2, 3, 4)})
    yield Sample((randn(rng, 3, 1),), {"shape": (2, 3, 4)})
    yield Sample((randn(rng, 2, 4),), {"shape": (2, 3, 4), "axes": (1,)})
    yield Sample((randn(rng, 3, 1),), {"shape": (2, 3, 4), "axes": (-3,)})


# ---------------------------------------------------------------------------------------------
# Binary arithmetic


def _ufunc_out(ufunc: np.ufunc) -> Callable[..., None]:
    """An ``out_kernel`` for a binary op that is one ufunc (``out`` has the broadcast shape)."""

    def kernel(a: Array, b: Array, *, out: Sequence[Array]) -> None:
        ufunc(a, b, out=out[0])

    return kernel


def _scale_out(x: Array, *, factor: float, out: Sequence[Array]) -> None:
    np.multiply(x, factor, out=out[0])


def broadcast_shapes(ctx: InferContext, a: Shape, b: Shape, what: str = "a and b") -> Shape:
    """The NumPy broadcast of two symbolic shapes: aligned from the right, a dim of 1 (or a missing one)
    takes the other's size; anything else must be the same dim."""
    out: list[DimExpr] = []
    for i in range(1, max(len(a), len(b)) + 1):
        x, y = (a[-i] if i <= len(a) else None), (b[-i] if i <= len(b) else None)
        if y is not None and (x is None or _is_one(x)):
            out.append(y)
        elif x is not None and (y is None or _is_one(y) or dims_equal(x, y)):
            out.append(x)
        else:
            raise ctx.fail(f"{what} do not broadcast: [{', '.join(map(str, a))}] and "
                           f"[{', '.join(map(str, b))}] differ in dim -{i} ({x} vs {y})")
    return tuple(reversed(out))


def _binary_cost(s: Sequence[tuple[int, ...]], a: Mapping[str, Any]) -> Cost:
    n = max(_numel(s[0]), _numel(s[1]))  # the result's size: at least the larger operand's
    return Cost(flops=float(n), bytes=4.0 * 3 * n)


def _binary_infer(ctx: InferContext) -> list[TensorType]:
    return [TensorType(broadcast_shapes(ctx, ctx.shape(0), ctx.shape(1)), ctx.dtype(0))]


def _unbroadcast(ctx: BackwardContext, grad: str, i: int) -> str:
    """The gradient of a binary op's result summed back to the shape of its input ``i``."""
    return _sum_to(ctx, grad, ctx.type_of(ctx.outputs[0]).shape, ctx.type_of(i).shape)


def _add_backward(ctx: BackwardContext) -> Grads:
    return [_unbroadcast(ctx, ctx.d_out, i) if ctx.needs_grad(i) else None for i in (0, 1)]


def _mul_backward(ctx: BackwardContext) -> Grads:
    da = _unbroadcast(ctx, ctx.emit("mul", ctx.d_out, ctx.saved(1)), 0) if ctx.needs_grad(0) else None
    db = _unbroadcast(ctx, ctx.emit("mul", ctx.d_out, ctx.saved(0)), 1) if ctx.needs_grad(1) else None
    return [da, db]


def _binary_samples(rng: np.random.Generator) -> Iterator[Sample]:
    yield Sample((randn(rng, 3, 4), randn(rng, 3, 4)))
    yield Sample((randn(rng, 3, 4, 5), randn(rng, 5)))
    yield Sample((randn(rng, 2, 4, 5), randn(rng, 4, 1)))
    yield Sample((randn(rng, 3, 4, 5), randn(rng, 1, 4, 1)))
    yield Sample((randn(rng, 4, 1), randn(rng, 2, 4, 5)))  # both ways: each operand is broadcast
    yield Sample((randn(rng, 5), randn(rng, 3, 1)))


def _bias_add_infer(ctx: InferContext) -> list[TensorType]:
    x = ctx.shape(0)
    if not x:
        raise ctx.fail("x must have at least one dim")
    check_same(ctx, ctx.shape(1), x[-1:], "bias must match x's last dim")
    return [TensorType(x, ctx.dtype(0))]


def _bias_add_backward(ctx: BackwardContext) -> Grads:
    db = None
    if ctx.needs_grad(1):
        lead = tuple(range(len(ctx.type_of(0).shape) - 1))
        db = ctx.emit("reduce_sum", ctx.d_out, axes=lead) if lead else ctx.d_out
    return [ctx.d_out if ctx.needs_grad(0) else None, db]


def _scale_backward(ctx: BackwardContext) -> Grads:
    return [ctx.emit("scale", ctx.d_out, factor=ctx.attrs["factor"]) if ctx.needs_grad(0) else None]


# ---------------------------------------------------------------------------------------------
# Activations


# The elementwise chains below run over blocks of rows, on the backend's threads: their temporaries
# stay in cache, and an output may take over an input's storage (a block is read completely before
# it is written).


def _rows2d(a: Array) -> Array:
    return a.reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1)


def _over_blocks(a: Array, fn: Callable[[slice], None]) -> None:
    """``fn(rows)`` over blocks of rows of the 2-D ``a``, on the backend's threads."""
    parallel(fn, row_blocks(*a.shape))


def _sigmoid_into(x: Array, out: Array) -> Array:
    """1 / (1 + exp(-x)) into ``out`` (exp overflows to inf for very negative x: the result is 0)."""
    np.negative(x, out=out)
    with np.errstate(over="ignore"):
        np.exp(out, out=out)
    out += 1
    return np.reciprocal(out, out=out)


def _silu_grads(d: Array, gate: Array, up: Array | None, d_gate: Array, s: Array) -> None:
    """d_gate = d * up * silu'(gate), silu' = s (1 + gate (1 - s)); leaves d * silu(gate) in ``s``."""
    _sigmoid_into(gate, s)
    np.subtract(1, s, out=d_gate)
    d_gate *= gate
    d_gate += 1
    d_gate *= s
    if up is not None:
        d_gate *= up
    d_gate *= d
    s *= gate
    s *= d


def _silu_out(x: Array, *, out: Sequence[Array]) -> None:
    x2, o = _rows2d(x), _rows2d(out[0])

    def block(r: slice) -> None:
        _sigmoid_into(x2[r], o[r])
        o[r] *= x2[r]

    _over_blocks(x2, block)


def _silu_backward_out(d: Array, x: Array, *, out: Sequence[Array]) -> None:
    d2, x2, o = _rows2d(d), _rows2d(x), _rows2d(out[0])
    _over_blocks(x2, lambda r: _silu_grads(d2[r], x2[r], None, o[r], np.empty_like(o[r])))


def _silu_mul_out(gate: Array, up: Array, *, out: Sequence[Array]) -> None:
    g2, u2, o = _rows2d(gate), _rows2d(up), _rows2d(out[0])

    def block(r: slice) -> None:
        _sigmoid_into(g2[r], o[r])
        o[r] *= g2[r]
        o[r] *= u2[r]

    _over_blocks(g2, block)


def _silu_mul_backward_out(d: Array, gate: Array, up: Array, *, out: Sequence[Array | None]) -> None:
    d_gate, d_up = (np.empty_like(gate) if o is None else o for o in out)
    d2, g2, u2, dg, du = (_rows2d(a) for a in (d, gate, up, d_gate, d_up))
    _over_blocks(g2, lambda r: _silu_grads(d2[r], g2[r], u2[r], dg[r], du[r]))


def _swiglu_out(x: Array, *, out: Sequence[Array]) -> None:
    """``silu(gate) * up`` as ``a * (1 + tanh(a)) * up`` with ``a = gate / 2`` (equal to
    ``gate * sigmoid(gate)``): five passes over a block, one transcendental, instead of seven."""
    x2, o = _rows2d(x), _rows2d(out[0])
    m = o.shape[1]

    def block(r: slice) -> None:
        a = np.multiply(x2[r, :m], 0.5, out=o[r])
        t = scratch("swiglu", a.size, a.dtype).reshape(a.shape)
        np.tanh(a, out=t)
        t += 1
        a *= t
        a *= x2[r, m:]

    _over_blocks(o, block)


def _swiglu_backward_out(d: Array, x: Array, *, out: Sequence[Array]) -> None:
    d2, x2, o = _rows2d(d), _rows2d(x), _rows2d(out[0])
    m = d2.shape[1]
    shared = np.may_share_memory(o, x2)  # d_x took over x's storage: each block goes through scratch

    def block(r: slice) -> None:
        grads = np.empty_like(o[r]) if shared else o[r]
        _silu_grads(d2[r], x2[r, :m], x2[r, m:], grads[:, :m], grads[:, m:])
        if shared:
            o[r] = grads

    _over_blocks(d2, block)


def _allocating(out_kernel: Callable[..., None], like: int = 0) -> Callable[..., Array]:
    """The reference kernel of a one-output op whose out_kernel is its implementation."""
    def kernel(*inputs: Array) -> Array:
        out = np.empty_like(inputs[like])
        out_kernel(*inputs, out=(out,))
        return out
    return kernel


def _swiglu(x: Array) -> Array:
    out = np.empty((*x.shape[:-1], x.shape[-1] // 2), x.dtype)
    _swiglu_out(x, out=(out,))
    return out


def _silu_mul_backward(d: Array, gate: Array, up: Array) -> tuple[Array, Array]:
    outs = (np.empty_like(gate), np.empty_like(gate))
    _silu_mul_backward_out(d, gate, up, out=outs)
    return outs


def _gelu(x: Array, *, approximate: str) -> Array:
    if approximate == "tanh":
        t: Array = np.tanh(_SQRT_2_OVER_PI * (x + _GELU_C * x * x * x))
        return 0.5 * x * (1 + t)
    return 0.5 * x * (1 + _erf(x * _INV_SQRT_2))


def _gelu_backward(d: Array, x: Array, *, approximate: str) -> Array:
    if approximate == "tanh":
        t: Array = np.tanh(_SQRT_2_OVER_PI * (x + _GELU_C * x * x * x))
        return d * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * _GELU_C * x * x))
    # d/dx x Φ(x) = Φ(x) + x φ(x)
    cdf = 0.5 * (1 + _erf(x * _INV_SQRT_2))
    return d * (cdf + x * _INV_SQRT_2PI * np.exp(-0.5 * x * x))


def _swiglu_infer(ctx: InferContext) -> list[TensorType]:
    x = ctx.shape(0)
    if not x:
        raise ctx.fail("x must have at least one dim")
    if isinstance(x[-1], Const) and x[-1].value % 2:
        raise ctx.fail(f"last dim {x[-1]} must be even: it holds [gate | up]")
    return [TensorType((*x[:-1], simplify(x[-1] // 2)), ctx.dtype(0))]


def _swiglu_backward_infer(ctx: InferContext) -> list[TensorType]:
    d, x = ctx.shape(0), ctx.shape(1)
    check_same(ctx, d, _swiglu_infer(InferContext(ctx.op, ctx.inputs[1:], ctx.attrs))[0].shape,
               "d_out must have x's shape with the last dim halved")
    return [TensorType(x, ctx.dtype(1))]


def _same_shapes_infer(n: int, n_out: int = 1) -> Callable[[InferContext], list[TensorType]]:
    """Shape rule: the first ``n`` inputs share one shape; ``n_out`` outputs of the last one's type."""

    def infer(ctx: InferContext) -> list[TensorType]:
        for i in range(1, n):
            check_same(ctx, ctx.shape(i), ctx.shape(0), f"input {i} must have input 0's shape")
        return same_as(n - 1, n_out)(ctx)

    return infer


def _unary_rule(backward_op: str, *attr_names: str) -> Callable[[BackwardContext], Grads]:
    """Rule of ``y = f(x)``: ``dx = backward_op(dy, x)``."""

    def rule(ctx: BackwardContext) -> Grads:
        if not ctx.needs_grad(0):
            return [None]
        return [ctx.emit(backward_op, ctx.d_out, ctx.saved(0), **{k: ctx.attrs[k] for k in attr_names})]

    return rule


def _silu_mul_rule(ctx: BackwardContext) -> Grads:
    if not (ctx.needs_grad(0) or ctx.needs_grad(1)):
        return [None, None]
    dg, du = ctx.emit("silu_mul_backward", ctx.d_out, ctx.saved(0), ctx.saved(1))
    return [dg if ctx.needs_grad(0) else None, du if ctx.needs_grad(1) else None]


def _geglu(gate: Array, up: Array, *, approximate: str) -> Array:
    return _gelu(gate, approximate=approximate) * up


def _geglu_rule(ctx: BackwardContext) -> Grads:
    approximate = ctx.attrs["approximate"]
    d_gate = d_up = None
    if ctx.needs_grad(0):  # d_gate = gelu'(gate) * (d_out * up)
        d_gate = ctx.emit("gelu_backward", ctx.emit("mul", ctx.d_out, ctx.saved(1)), ctx.saved(0),
                          approximate=approximate)
    if ctx.needs_grad(1):  # d_up = d_out * gelu(gate)
        d_up = ctx.emit("mul", ctx.d_out, ctx.emit("gelu", ctx.saved(0), approximate=approximate))
    return [d_gate, d_up]


def _geglu_samples(rng: np.random.Generator) -> Iterator[Sample]:
    yield Sample((randn(rng, 3, 4) * 2, randn(rng, 3, 4)))
    yield Sample((randn(rng, 2, 3, 5) * 2, randn(rng, 2, 3, 5)), {"approximate": "tanh"})


def _add3_rule(ctx: BackwardContext) -> Grads:
    return [ctx.d_out if ctx.needs_grad(i) else None for i in range(3)]


def _softmax(x: Array, *, axis: int) -> Array:
    e: Array = np.exp(x - np.max(x, axis=axis, keepdims=True))
    total: Array = np.sum(e, axis=axis, keepdims=True)
    return e / total


def _softmax_backward(d: Array, y: Array, *, axis: int) -> Array:
    dot: Array = np.sum(d * y, axis=axis, keepdims=True)
    return y * (d - dot)


def _softmax_infer(ctx: InferContext) -> list[TensorType]:
    x = ctx.shape(0)
    _norm_axes((ctx.attrs["axis"],), len(x), ctx)
    return [TensorType(x, ctx.dtype(0))]


def _softmax_rule(ctx: BackwardContext) -> Grads:
    if not ctx.needs_grad(0):
        return [None]
    return [ctx.emit("softmax_backward", ctx.d_out, ctx.saved_output(0), axis=ctx.attrs["axis"])]


def _unary_samples(rng: np.random.Generator) -> Iterator[Sample]:
    yield Sample((randn(rng, 3, 4) * 2,))
    yield Sample((randn(rng, 2, 3, 5) * 2,))


def _relu_samples(rng: np.random.Generator) -> Iterator[Sample]:
    yield Sample((_away_from_zero(rng, 3, 4),))
    yield Sample((_away_from_zero(rng, 2, 3, 5),))


def _gelu_samples(rng: np.random.Generator) -> Iterator[Sample]:
    for approximate in ("tanh", "none"):
        yield Sample((randn(rng, 3, 4) * 2,), {"approximate": approximate})
        yield Sample((randn(rng, 2, 3, 5) * 2,), {"approximate": approximate})


def _softmax_samples(rng: np.random.Generator) -> Iterator[Sample]:
    yield Sample((randn(rng, 3, 5),), {})
    yield Sample((randn(rng, 2, 3, 4),), {"axis": 0})
    yield Sample((randn(rng, 2, 3, 4),), {"axis": 1})
    yield Sample((randn(rng, 2, 3, 4),), {"axis": -1})


# ---------------------------------------------------------------------------------------------
# Reductions


def _reduce_kernel(fn: Callable[..., Any]) -> Callable[..., Array]:
    return lambda x, *, axes, keepdims: np.asarray(fn(x, axis=tuple(axes), keepdims=keepdims))


def _reduce_infer(ctx: InferContext) -> list[TensorType]:
    x = ctx.shape(0)
    axes = _norm_axes(ctx.attrs["axes"], len(x), ctx)
    if ctx.attrs["keepdims"]:
        out = tuple(parse_dim(1) if i in axes else d for i, d in enumerate(x))
    else:
        out = tuple(d for i, d in enumerate(x) if i not in axes)
    return [TensorType(out, ctx.dtype(0))]


def _expand_reduced(d: Array, shape: tuple[int, ...], axes: tuple[int, ...], keepdims: bool) -> Array:
    """A reduction's result with the reduced axes back as size 1."""
    return d if keepdims else np.expand_dims(d, _norm_axes(axes, len(shape)))


def _reduce_mean_backward(d: Array, *, shape: tuple[int, ...], axes: tuple[int, ...],
                          keepdims: bool) -> Array:
    count = math.prod(shape[a] for a in _norm_axes(axes, len(shape)))
    return np.broadcast_to(_expand_reduced(d, shape, axes, keepdims) / count, shape).copy()


def _reduce_max_backward(d: Array, x: Array, y: Array, *, axes: tuple[int, ...], keepdims: bool) -> Array:
    # Ties share the gradient evenly, so the sum of the routed gradient always equals d.
    hit = x == _expand_reduced(y, x.shape, axes, keepdims)
    count = np.sum(hit, axis=_norm_axes(axes, x.ndim), keepdims=True).astype(d.dtype)
    return np.where(hit, _expand_reduced(d, x.shape, axes, keepdims) / count, 0)


def _reduce_attrs(ctx: BackwardContext) -> dict[str, Any]:
    axes = _norm_axes(ctx.attrs["axes"], len(ctx.type_of(0).shape))
    return {"axes": axes, "keepdims": ctx.attrs["keepdims"]}


def _reduce_sum_rule(ctx: BackwardContext) -> Grads:
    if not ctx.needs_grad(0):
        return [None]
    a = _reduce_attrs(ctx)
    # with keepdims the reduced axes are still there as size 1: plain broadcasting restores them
    return [ctx.emit("broadcast_to", ctx.d_out, shape=ctx.shape_of(0),
                     axes=() if a["keepdims"] else a["axes"])]


def _reduce_mean_rule(ctx: BackwardContext) -> Grads:
    if not ctx.needs_grad(0):
        return [None]
    return [ctx.emit("reduce_mean_backward", ctx.d_out, shape=ctx.shape_of(0), **_reduce_attrs(ctx))]


def _reduce_max_rule(ctx: BackwardContext) -> Grads:
    if not ctx.needs_grad(0):
        return [None]
    return [ctx.emit("reduce_max_backward", ctx.d_out, ctx.saved(0), ctx.saved_output(0),
                     **_reduce_attrs(ctx))]


def _reduce_samples(rng: np.random.Generator, distinct: bool = False) -> Iterator[Sample]:
    for axes in ((0,), (1,), (-1,), (0, 2), (0, 1, 2)):
        for keepdims in (False, True):
            # values at least 0.04 apart: no tie for reduce_max, none created by the FD step
            x = (rng.permutation(24).reshape(2, 3, 4) * 0.05 + rng.uniform(0, 0.01, (2, 3, 4))) if distinct \
                else randn(rng, 2, 3, 4)
            yield Sample((x,), {"axes": axes, "keepdims": keepdims})


def _reduce_cost(shapes: Sequence[tuple[int, ...]], attrs: Mapping[str, Any]) -> Cost:
    return Cost(flops=_numel(shapes[0]), bytes=4.0 * _numel(shapes[0]))


_REDUCE_ATTRS = (AttrSpec("axes", "ints"), AttrSpec("keepdims", "bool", False))
_REDUCE_BACKWARD_ATTRS = (AttrSpec("axes", "ints"), AttrSpec("keepdims", "bool"))


# ---------------------------------------------------------------------------------------------
# Creation


def _creation_infer(ctx: InferContext) -> list[TensorType]:
    return [TensorType(ctx.dims("shape"), ctx.attrs["dtype"])]


def _creation_cost(shapes: Sequence[tuple[int, ...]], attrs: Mapping[str, Any]) -> Cost:
    return Cost(bytes=4.0 * _numel(attrs["shape"]))


def _creation_samples(**attrs: Any) -> Callable[[np.random.Generator], list[Sample]]:
    return lambda rng: [Sample((), {"shape": (2, 3), **attrs}),
                        Sample((), {"shape": (4,), "dtype": "int32", **attrs})]


_CREATION_ATTRS = (AttrSpec("shape", "dims"), AttrSpec("dtype", "dtype", "fp32"))


# ---------------------------------------------------------------------------------------------
# Dropout

_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _mix64(z: UInt) -> UInt:
    """The splitmix64 finaliser, a bijective avalanche hash of uint64 arrays (wraps mod 2**64)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def dropout_key(seed: int) -> int:
    """The 64-bit key of ``dropout``'s counter stream for the op's ``seed`` attribute: the splitmix64
    finaliser of ``seed`` taken modulo 2**64. Element j of a mask with counter offset ``offset`` draws
    ``mix64(key + (offset + j + 1) * 0x9E3779B97F4A7C15)`` (top 53 bits, ``>= p`` kept), so a backend
    kernel given this key (and :func:`~kiln.core.counter_offset`'s offset) draws the NumPy backend's
    masks."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise KilnError(f"dropout_key: seed must be an int, got {type(seed).__name__} {seed!r}")
    return int(_mix64(np.array([int(seed) & _M64], dtype=np.uint64))[0])


def dropout_uniform(seed: int, offset: int, n: int) -> Array:
    """Uniforms in [0, 1) for counters ``offset .. offset + n - 1``: element j is a pure function of
    (seed, offset + j), the j-th output of a splitmix64 stream keyed by :func:`dropout_key`."""
    key = np.array([dropout_key(seed)], dtype=np.uint64)
    counters = np.arange(n, dtype=np.uint64) + np.uint64(offset & _M64)
    bits = _mix64(key + (counters + np.uint64(1)) * np.uint64(_GAMMA))
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53  # top 53 bits: exact doubles


def _dropout(x: Array, *, p: float, seed: int, offset: int) -> Array:
    if p == 0.0:
        return x.copy()
    keep = dropout_uniform(seed, offset, x.size).reshape(x.shape) >= p
    return np.where(keep, x * (1.0 / (1.0 - p)), 0)


def _dropout_infer(ctx: InferContext) -> list[TensorType]:
    if not 0.0 <= ctx.attrs["p"] < 1.0:
        raise ctx.fail(f"p = {ctx.attrs['p']} is not a drop probability in [0, 1)")
    return [TensorType(ctx.shape(0), ctx.dtype(0))]


def _dropout_rule(ctx: BackwardContext) -> Grads:
    if not ctx.needs_grad(0):
        return [None]
    return [ctx.emit("dropout", ctx.d_out, **{k: ctx.attrs[k] for k in ("p", "seed", "offset")})]


def _dropout_samples(rng: np.random.Generator) -> Iterator[Sample]:
    yield Sample((randn(rng, 3, 4),), {"p": 0.0, "seed": 1})
    yield Sample((randn(rng, 4, 5),), {"p": 0.3, "seed": 7})
    yield Sample((randn(rng, 2, 3, 5),), {"p": 0.5, "seed": 123, "offset": 1000})


# ---------------------------------------------------------------------------------------------

_APPROX = AttrSpec("approximate", "str", "tanh", ("tanh", "none"))
_AXIS = AttrSpec("axis", "int", -1)

CORE_OPS = [
    core_op("add", ("a", "b"), ("out",), lambda a, b: a + b, _binary_infer, backward=_add_backward,
          samples=_binary_samples, cost=_binary_cost, out_kernel=_ufunc_out(np.add), inplace={0},
          any_dtype=True, doc="out = a + b, broadcast both ways (NumPy rules)."),
    core_op("mul", ("a", "b"), ("out",), lambda a, b: a * b, _binary_infer, backward=_mul_backward,
          samples=_binary_samples, cost=_binary_cost, out_kernel=_ufunc_out(np.multiply), inplace={0},
          any_dtype=True, doc="out = a * b, broadcast both ways (NumPy rules)."),
    core_op("scale", ("x",), ("out",), lambda x, *, factor: x * factor, same_as(), backward=_scale_backward,
          attrs=(AttrSpec("factor", "float"),), cost=_ew_cost(1, 2), out_kernel=_scale_out, inplace={0},
          samples=lambda rng: [Sample((randn(rng, 3, 4),), {"factor": -0.7})], doc="out = x * factor."),
    core_op("bias_add", ("x", "bias"), ("out",), lambda x, bias: x + bias, _bias_add_infer,
          backward=_bias_add_backward, cost=_ew_cost(1, 2), out_kernel=_ufunc_out(np.add), inplace={0},
          samples=lambda rng: [Sample((randn(rng, 2, 3, 5), randn(rng, 5))),
                               Sample((randn(rng, 4), randn(rng, 4)))],
          doc="out = x + bias, bias over x's last dim."),
    core_op("broadcast_to", ("x",), ("out",), _broadcast_to, _broadcast_to_infer,
          backward=_broadcast_to_backward, attrs=(AttrSpec("shape", "dims"), AttrSpec("axes", "ints", ())),
          samples=_broadcast_to_samples, any_dtype=True,
          cost=lambda s, a: Cost(bytes=4.0 * (_numel(s[0]) + _numel(a["shape"]))),
          doc="x broadcast to shape: NumPy rules, or with axes, x lacks exactly those result axes."),
    # activations
    core_op("silu", ("x",), ("out",), _allocating(_silu_out), same_as(),
            backward=_unary_rule("silu_backward"),
          samples=_unary_samples, cost=_ew_cost(5, 2), out_kernel=_silu_out, doc="out = x * sigmoid(x)."),
    core_op("silu_backward", ("d_out", "x"), ("d_x",), _allocating(_silu_backward_out, 1),
          _same_shapes_infer(2), out_kernel=_silu_backward_out,
          samples=lambda rng: [Sample((randn(rng, 3, 4), randn(rng, 3, 4) * 2))],
          cost=_ew_cost(8, 3), doc="d_x = d_out * sigmoid(x) * (1 + x * (1 - sigmoid(x)))."),
    core_op("relu", ("x",), ("out",), lambda x: np.maximum(x, 0), same_as(),
          backward=_unary_rule("relu_backward"), samples=_relu_samples, cost=_ew_cost(1, 2),
          doc="out = max(x, 0)."),
    core_op("relu_backward", ("d_out", "x"), ("d_x",), lambda d, x: np.where(x > 0, d, 0),
          _same_shapes_infer(2), cost=_ew_cost(1, 3), doc="d_x = d_out where x > 0, else 0."),
    core_op("relu2", ("x",), ("out",), lambda x: np.maximum(x, 0) ** 2, same_as(),
          backward=_unary_rule("relu2_backward"), samples=_relu_samples, cost=_ew_cost(2, 2),
          doc="out = max(x, 0)**2."),
    core_op("relu2_backward", ("d_out", "x"), ("d_x",), lambda d, x: 2 * d * np.maximum(x, 0),
          _same_shapes_infer(2), cost=_ew_cost(2, 3), doc="d_x = 2 * d_out * max(x, 0)."),
    core_op("gelu", ("x",), ("out",), _gelu, same_as(), backward=_unary_rule("gelu_backward", "approximate"),
          attrs=(_APPROX,), samples=_gelu_samples, cost=_ew_cost(10, 2),
          doc="out = x * Phi(x), exact (approximate='none') or with the tanh approximation."),
    core_op("gelu_backward", ("d_out", "x"), ("d_x",), _gelu_backward, _same_shapes_infer(2),
            attrs=(_APPROX,),
          cost=_ew_cost(15, 3), doc="d_x = d_out * gelu'(x) for the same approximation."),
    core_op("swiglu", ("x",), ("out",), _swiglu, _swiglu_infer, backward=_unary_rule("swiglu_backward"),
          samples=lambda rng: [Sample((randn(rng, 3, 8) * 2,)), Sample((randn(rng, 2, 3, 6) * 2,))],
          cost=lambda s, a: Cost(flops=3.0 * _numel(s[0]), bytes=6.0 * _numel(s[0])), out_kernel=_swiglu_out,
          doc="out = silu(gate) * up where x's last dim is laid out [gate | up]; out has half of it."),
    core_op("swiglu_backward", ("d_out", "x"), ("d_x",), _allocating(_swiglu_backward_out, 1),
          _swiglu_backward_infer, out_kernel=_swiglu_backward_out, inplace={1},
          samples=lambda rng: [Sample((randn(rng, 3, 4), randn(rng, 3, 8) * 2)),
                               Sample((randn(rng, 2, 3, 3), randn(rng, 2, 3, 6) * 2))],
          cost=lambda s, a: Cost(flops=6.0 * _numel(s[1]), bytes=10.0 * _numel(s[1])),
          doc="d_x = [d_gate | d_up] for swiglu."),
    core_op("geglu", ("gate", "up"), ("out",), _geglu, _same_shapes_infer(2), backward=_geglu_rule,
            attrs=(AttrSpec("approximate", "str", "none", ("tanh", "none")),), cost=_ew_cost(12, 3),
            samples=_geglu_samples, doc="out = gelu(gate) * up (GeGLU): exact gelu, or approximate='tanh'."),
    core_op("add3", ("a", "b", "c"), ("out",), lambda a, b, c: a + b + c, _same_shapes_infer(3),
            backward=_add3_rule, cost=_ew_cost(2, 4), any_dtype=True,
            samples=lambda rng: [Sample((randn(rng, 3, 4), randn(rng, 3, 4), randn(rng, 3, 4)))],
            doc="out = a + b + c, one shape (the parallel residual of GPT-NeoX-style blocks)."),
    core_op("silu_mul", ("gate", "up"), ("out",), _allocating(_silu_mul_out), _same_shapes_infer(2),
          backward=_silu_mul_rule, samples=lambda rng: [Sample((randn(rng, 3, 4) * 2, randn(rng, 3, 4)))],
          out_kernel=_silu_mul_out,
          cost=_ew_cost(6, 3), doc="out = silu(gate) * up."),
    core_op("silu_mul_backward", ("d_out", "gate", "up"), ("d_gate", "d_up"), _silu_mul_backward,
          _same_shapes_infer(3, 2), cost=_ew_cost(12, 5), out_kernel=_silu_mul_backward_out,
          samples=lambda rng: [Sample((randn(rng, 3, 4), randn(rng, 3, 4) * 2, randn(rng, 3, 4)))],
          doc="d_gate = d_out * up * silu'(gate), d_up = d_out * silu(gate)."),
    core_op("softmax", ("x",), ("out",), _softmax, _softmax_infer, backward=_softmax_rule, attrs=(_AXIS,),
          samples=_softmax_samples, cost=_ew_cost(5, 2), autocast="fp32",
          doc="out = exp(x) / sum(exp(x)) along axis."),
    core_op("softmax_backward", ("d_out", "out"), ("d_x",), _softmax_backward, _same_shapes_infer(2),
          attrs=(_AXIS,), cost=_ew_cost(4, 3), autocast="fp32",
          doc="d_x = out * (d_out - sum(d_out * out, axis))."),
    # reductions
    core_op("reduce_sum", ("x",), ("out",), _reduce_kernel(np.sum), _reduce_infer, backward=_reduce_sum_rule,
          attrs=_REDUCE_ATTRS, samples=_reduce_samples, cost=_reduce_cost, any_dtype=True,
          doc="Sum of x over axes."),
    core_op("reduce_mean", ("x",), ("out",), _reduce_kernel(np.mean), _reduce_infer,
            backward=_reduce_mean_rule,
          attrs=_REDUCE_ATTRS, samples=_reduce_samples, cost=_reduce_cost, doc="Mean of x over axes."),
    core_op("reduce_mean_backward", ("d_out",), ("d_x",), _reduce_mean_backward,
          lambda ctx: [TensorType(ctx.dims("shape"), ctx.dtype(0))],
          attrs=(AttrSpec("shape", "dims"), *_REDUCE_BACKWARD_ATTRS),
          cost=lambda s, a: Cost(flops=_numel(a["shape"]), bytes=4.0 * _numel(a["shape"])),
          doc="d_x = d_out broadcast back over the reduced axes, divided by their element count."),
    core_op("reduce_max", ("x",), ("out",), _reduce_kernel(np.max), _reduce_infer, backward=_reduce_max_rule,
          attrs=_REDUCE_ATTRS, samples=lambda rng: _reduce_samples(rng, distinct=True), cost=_reduce_cost,
          any_dtype=True,
          doc="Maximum of x over axes."),
    core_op("reduce_max_backward", ("d_out", "x", "out"), ("d_x",), _reduce_max_backward,
          lambda ctx: [TensorType(ctx.shape(1), ctx.dtype(0))], attrs=_REDUCE_BACKWARD_ATTRS,
          cost=lambda s, a: Cost(flops=2.0 * _numel(s[1]), bytes=8.0 * _numel(s[1])),
          doc="d_x = d_out at the positions of the maximum (shared evenly between ties), else 0."),
    # creation
    core_op("zeros", (), ("out",), lambda *, shape, dtype: np.zeros(shape, dtype), _creation_infer,
          backward=no_gradient, attrs=_CREATION_ATTRS, samples=_creation_samples(), cost=_creation_cost,
          out_kernel=lambda *, out, shape, dtype: out[0].fill(0), doc="A tensor of zeros."),
    core_op("ones", (), ("out",), lambda *, shape, dtype: np.ones(shape, dtype), _creation_infer,
          backward=no_gradient, attrs=_CREATION_ATTRS, samples=_creation_samples(), cost=_creation_cost,
          out_kernel=lambda *, out, shape, dtype: out[0].fill(1), doc="A tensor of ones."),
    core_op("fill", (), ("out",), lambda *, shape, value, dtype: np.full(shape, value, dtype),
            _creation_infer,
          backward=no_gradient, attrs=(AttrSpec("shape", "dims"), AttrSpec("value", "float"),
                                       AttrSpec("dtype", "dtype", "fp32")),
          samples=_creation_samples(value=2.0), cost=_creation_cost, doc="A tensor filled with value."),
    core_op("zeros_like", ("x",), ("out",), np.zeros_like, same_as(), backward=no_gradient,
          samples=lambda rng: [Sample((randn(rng, 2, 3),), check=())], cost=_ew_cost(0, 1),
          doc="Zeros with x's shape and dtype."),
    # dropout
    core_op("dropout", ("x",), ("out",), _dropout, _dropout_infer, backward=_dropout_rule,
          attrs=(AttrSpec("p", "float"), AttrSpec("seed", "int"), AttrSpec("offset", "int", 0)),
          samples=_dropout_samples, cost=_ew_cost(12, 2), random=True,
          doc="out = x * keep / (1 - p); keep of element j is a hash of (seed, offset + j) >= p."),
]

OPS = [c.opdef for c in CORE_OPS]
