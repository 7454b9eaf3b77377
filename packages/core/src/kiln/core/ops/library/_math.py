"""Pointwise math: ``exp``, ``sigmoid``, ``reciprocal`` and ``div``.

The rules read the forward output back where the derivative is a function of it
(``exp' = exp``, ``sigmoid' = s (1 - s)``, ``(1/x)' = -(1/x)^2``, ``d(a/b)/db = -(a/b) / b``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln.core.ops._ops import BackwardContext, InferContext, Sample
from kiln.core.ops.library._common import check_same, core_op, randn, same_as
from kiln.core.ops.library._elementwise import _binary_cost, _binary_infer, _ew_cost, _unbroadcast

Array = npt.NDArray[np.floating[Any]]
Grads = list[str | None]


def _sigmoid_out(x: Array, *, out: Sequence[Array]) -> None:
    e = np.exp(-np.abs(x))  # never overflows; read all of x before out (which may be x) is written
    np.divide(np.where(x >= 0, 1, e), 1 + e, out=out[0])


def _sigmoid(x: Array) -> Array:
    out = np.empty_like(x)
    _sigmoid_out(x, out=(out,))
    return out


def _exp_rule(ctx: BackwardContext) -> Grads:
    return [ctx.emit("mul", ctx.d_out, ctx.saved_output(0)) if ctx.needs_grad(0) else None]


def _sigmoid_rule(ctx: BackwardContext) -> Grads:
    return [ctx.emit("sigmoid_backward", ctx.d_out, ctx.saved_output(0)) if ctx.needs_grad(0) else None]


def _reciprocal_rule(ctx: BackwardContext) -> Grads:
    if not ctx.needs_grad(0):
        return [None]
    y = ctx.saved_output(0)
    return [ctx.emit("scale", ctx.emit("mul", ctx.d_out, ctx.emit("mul", y, y)), factor=-1.0)]


def _div_rule(ctx: BackwardContext) -> Grads:
    if not (ctx.needs_grad(0) or ctx.needs_grad(1)):
        return [None, None]
    d_over_b = ctx.emit("div", ctx.d_out, ctx.saved(1))  # the result's shape
    db = None
    if ctx.needs_grad(1):
        d_full = ctx.emit("scale", ctx.emit("mul", d_over_b, ctx.saved_output(0)), factor=-1.0)
        db = _unbroadcast(ctx, d_full, 1)
    return [_unbroadcast(ctx, d_over_b, 0) if ctx.needs_grad(0) else None, db]


def _sigmoid_backward_infer(ctx: InferContext) -> list[Any]:
    check_same(ctx, ctx.shape(1), ctx.shape(0), "out must have d_out's shape")
    return same_as(0)(ctx)


def _nonzero(rng: np.random.Generator, *shape: int) -> Array:
    """Values with |x| in [0.5, 2]: 1/x stays smooth inside the finite-difference step."""
    return rng.uniform(0.5, 2.0, shape) * np.where(rng.random(shape) < 0.5, -1.0, 1.0)


def _unary_samples(rng: np.random.Generator) -> Iterator[Sample]:
    yield Sample((randn(rng, 3, 4),))
    yield Sample((randn(rng, 2, 3, 5) * 2,))


def _reciprocal_samples(rng: np.random.Generator) -> Iterator[Sample]:
    yield Sample((_nonzero(rng, 3, 4),))
    yield Sample((_nonzero(rng, 2, 3, 5),))


def _div_samples(rng: np.random.Generator) -> Iterator[Sample]:
    yield Sample((randn(rng, 3, 4), _nonzero(rng, 3, 4)))
    yield Sample((randn(rng, 3, 4, 5), _nonzero(rng, 5)))
    yield Sample((randn(rng, 2, 4, 5), _nonzero(rng, 4, 1)))
    yield Sample((randn(rng, 4, 1), _nonzero(rng, 2, 4, 5)))  # a broadcast as well


CORE_OPS = (
    core_op("exp", ("x",), ("out",), np.exp, same_as(), backward=_exp_rule, samples=_unary_samples,
          cost=_ew_cost(4, 2), out_kernel=lambda x, *, out: np.exp(x, out=out[0]), inplace={0},
          doc="out = e^x."),
    core_op("sigmoid", ("x",), ("out",), _sigmoid, same_as(), backward=_sigmoid_rule, samples=_unary_samples,
          cost=_ew_cost(5, 2), out_kernel=_sigmoid_out, inplace={0}, doc="out = 1 / (1 + e^-x)."),
    core_op("sigmoid_backward", ("d_out", "out"), ("d_x",), lambda d, y: d * y * (1 - y),
          _sigmoid_backward_infer, cost=_ew_cost(3, 3), doc="d_x = d_out * out * (1 - out)."),
    core_op("reciprocal", ("x",), ("out",), np.reciprocal, same_as(), backward=_reciprocal_rule,
          samples=_reciprocal_samples, cost=_ew_cost(1, 2),
          out_kernel=lambda x, *, out: np.reciprocal(x, out=out[0]), inplace={0}, doc="out = 1 / x."),
    core_op("div", ("a", "b"), ("out",), np.divide, _binary_infer, backward=_div_rule, samples=_div_samples,
          cost=_binary_cost, out_kernel=lambda a, b, *, out: np.divide(a, b, out=out[0]), inplace={0},
          doc="out = a / b, broadcast both ways (as for add)."),
)

OPS = [c.opdef for c in CORE_OPS]
