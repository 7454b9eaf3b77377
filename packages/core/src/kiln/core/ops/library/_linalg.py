"""Matrix products: matmul, matmul_bias, batched_matmul."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from kiln.core._threads import matmul_into
from kiln.core.ir._ir import TensorType
from kiln.core.ops._ops import AttrSpec, BackwardContext, Cost, InferContext, Sample
from kiln.core.ops.library._common import check_same, core_op, randn
from kiln.core.ops.library._elementwise import _sum_to, broadcast_shapes

TRANSPOSES = ("NN", "NT", "TN", "TT")
_MM_ATTRS = (
    AttrSpec("transpose", "str", "NN", TRANSPOSES),
    AttrSpec("accumulate", "bool", False),
    AttrSpec("alpha", "float", 1.0),
    AttrSpec("beta", "float", 1.0),
)


def _op(x: np.ndarray, flag: str) -> np.ndarray:
    return np.swapaxes(x, -1, -2) if flag == "T" else x


def _matmul(a: np.ndarray, b: np.ndarray, c: np.ndarray | None = None, *, transpose: str, accumulate: bool,
            alpha: float, beta: float) -> np.ndarray:
    out: np.ndarray = np.matmul(_op(a, transpose[0]), _op(b, transpose[1]))
    if alpha != 1.0:
        out *= alpha
    if c is not None:
        out += c if beta == 1.0 or accumulate else beta * c
    return out


def _matmul_out(a: np.ndarray, b: np.ndarray, c: np.ndarray | None = None, *, out: Sequence[np.ndarray],
                transpose: str, accumulate: bool, alpha: float, beta: float) -> None:
    """``_matmul`` into a preallocated output: BLAS writes straight into it (transposed operands
    are passed as strided views, which BLAS reads without a copy)."""
    o = out[0]
    matmul_into(_op(a, transpose[0]), _op(b, transpose[1]), o)
    if alpha != 1.0:
        o *= alpha
    if c is not None:
        o += c if beta == 1.0 or accumulate else beta * c


def _mm_infer(ctx: InferContext, batched: bool) -> list[TensorType]:
    a, b = ctx.shape(0), ctx.shape(1)
    t = ctx.attrs["transpose"]
    if not batched and (len(a) != 2 or len(b) != 2):
        raise ctx.fail(f"matmul takes 2-D operands, found ranks {len(a)} and {len(b)} (use batched_matmul)")
    if len(a) < 2 or len(b) < 2:
        raise ctx.fail(f"operands need rank >= 2, found ranks {len(a)} and {len(b)}")
    m, ka = (a[-1], a[-2]) if t[0] == "T" else (a[-2], a[-1])
    kb, n = (b[-1], b[-2]) if t[1] == "T" else (b[-2], b[-1])
    check_same(ctx, (ka,), (kb,), f"contraction dims differ (transpose={t})")
    batch = broadcast_shapes(ctx, a[:-2], b[:-2], f"the batch dims of a {_text(a)} and b {_text(b)}")
    out = TensorType((*batch, m, n), ctx.dtype(0))
    if len(ctx.inputs) > 2 and ctx.inputs[2] is not None:
        check_same(ctx, ctx.shape(2), out.shape, "accumulator shape differs from the product")
    elif ctx.attrs["accumulate"]:
        raise ctx.fail("accumulate=True needs the accumulator as third input")
    return [out]


def _mm_grads(ctx: BackwardContext, op: str, t: str, alpha: float) -> tuple[str | None, str | None]:
    """Gradients of alpha * op(A) op(B) for the four transpose cases: with X = op(A), Y = op(B),
    dX = dC Y^T and dY = X^T dC, then transposed back where the operand was used transposed."""
    a, b, d = ctx.saved(0), ctx.saved(1), ctx.d_out
    da = db = None
    if ctx.needs_grad(0):
        if t[0] == "N":
            da = ctx.emit(op, d, b, transpose="N" + ("T" if t[1] == "N" else "N"), alpha=alpha)
        else:
            da = ctx.emit(op, b, d, transpose=("N" if t[1] == "N" else "T") + "T", alpha=alpha)
    if ctx.needs_grad(1):
        if t[1] == "N":
            db = ctx.emit(op, a, d, transpose=("T" if t[0] == "N" else "N") + "N", alpha=alpha)
        else:
            db = ctx.emit(op, d, a, transpose="T" + ("N" if t[0] == "N" else "T"), alpha=alpha)
    return da, db


def _text(shape: Sequence[Any]) -> str:
    return f"[{', '.join(map(str, shape))}]"


def _mm_backward(ctx: BackwardContext, op: str = "matmul") -> list[str | None]:
    da, db = _mm_grads(ctx, op, ctx.attrs["transpose"], ctx.attrs["alpha"])
    # a broadcast operand's gradient comes out with the result's batch dims: sum it back over them
    batch = ctx.type_of(ctx.outputs[0]).shape[:-2]
    grads: list[str | None] = [
        None if g is None else _sum_to(ctx, g, (*batch, *ctx.type_of(i).shape[-2:]), ctx.type_of(i).shape)
        for i, g in enumerate((da, db))
    ]
    if len(ctx.inputs) > 2:
        beta = ctx.attrs["beta"]
        dc = None
        if ctx.inputs[2] and ctx.needs_grad(2):
            keep = beta == 1.0 or ctx.attrs["accumulate"]
            dc = ctx.d_out if keep else ctx.emit("scale", ctx.d_out, factor=beta)
        grads.append(dc)
    return grads


def _mm_cost(shapes: Sequence[tuple[int, ...]], attrs: Mapping[str, Any]) -> Cost:
    a, b = shapes[0], shapes[1]
    k = a[-2] if attrs["transpose"][0] == "T" else a[-1]
    batch = np.broadcast_shapes(a[:-2], b[:-2])
    n_out = int(np.prod(batch or (1,))) * (a[-1] if attrs["transpose"][0] == "T" else a[-2]) * \
        (b[-2] if attrs["transpose"][1] == "T" else b[-1])
    return Cost(flops=2.0 * n_out * k, bytes=4.0 * (np.prod(a) + np.prod(b) + n_out))


def _mm_samples(rng: np.random.Generator) -> Iterator[Sample]:
    m, k, n = 3, 4, 5
    for t in TRANSPOSES:
        a = randn(rng, *((k, m) if t[0] == "T" else (m, k)))
        b = randn(rng, *((n, k) if t[1] == "T" else (k, n)))
        yield Sample((a, b), {"transpose": t})
    yield Sample((randn(rng, m, k), randn(rng, n, k), randn(rng, m, n)), {"transpose": "NT", "alpha": 0.5,
                                                                          "beta": 2.0})
    yield Sample((randn(rng, m, k), randn(rng, k, n), randn(rng, m, n)), {"accumulate": True})


def _bmm_samples(rng: np.random.Generator) -> Iterator[Sample]:
    for t in TRANSPOSES:
        a = randn(rng, 2, *((4, 3) if t[0] == "T" else (3, 4)))
        b = randn(rng, 2, *((5, 4) if t[1] == "T" else (4, 5)))
        yield Sample((a, b), {"transpose": t})
    # batch dims broadcast both ways, as torch.matmul's do
    yield Sample((randn(rng, 2, 1, 3, 4), randn(rng, 3, 4, 5)), {})
    yield Sample((randn(rng, 3, 4), randn(rng, 2, 5, 4)), {"transpose": "NT"})
    yield Sample((randn(rng, 1, 2, 4, 3), randn(rng, 3, 1, 4, 5), randn(rng, 3, 2, 3, 5)), {"transpose": "TN",
                                                                                           "beta": 0.5})


def _matmul_bias(x: np.ndarray, w: np.ndarray, bias: np.ndarray, *, transpose: str) -> np.ndarray:
    out: np.ndarray = np.matmul(_op(x, transpose[0]), _op(w, transpose[1])) + bias
    return out


def _matmul_bias_infer(ctx: InferContext) -> list[TensorType]:
    out = _mm_infer(InferContext(ctx.op, ctx.inputs[:2], {**ctx.attrs, "accumulate": False}), False)[0]
    check_same(ctx, ctx.shape(2), out.shape[-1:], "bias must match the output's last dim")
    return [out]


def _matmul_bias_backward(ctx: BackwardContext) -> list[str | None]:
    da, dw = _mm_grads(ctx, "matmul", ctx.attrs["transpose"], 1.0)
    db = ctx.emit("reduce_sum", ctx.d_out, axes=(0,)) if ctx.needs_grad(2) else None
    return [da, dw, db]


CORE_OPS = [
    core_op(
        "matmul", ("a", "b", "c?"), ("out",), _matmul, lambda ctx: _mm_infer(ctx, False),
        backward=_mm_backward, attrs=_MM_ATTRS, samples=_mm_samples, cost=_mm_cost, out_kernel=_matmul_out,
        flop_heavy=True,
        doc="out = alpha * op(a) @ op(b) (+ beta * c); transpose picks op() per operand (N or T).",
    ),
    core_op(
        "batched_matmul", ("a", "b", "c?"), ("out",), _matmul, lambda ctx: _mm_infer(ctx, True),
        backward=lambda ctx: _mm_backward(ctx, "batched_matmul"), attrs=_MM_ATTRS, samples=_bmm_samples,
        cost=_mm_cost, out_kernel=_matmul_out,
        flop_heavy=True,
        doc="matmul over leading batch dims, which broadcast both ways (NumPy/torch rules).",
    ),
    core_op(
        "matmul_bias", ("x", "w", "bias"), ("out",), _matmul_bias, _matmul_bias_infer,
        backward=_matmul_bias_backward, attrs=(AttrSpec("transpose", "str", "NT", TRANSPOSES),),
        samples=lambda rng: [Sample((randn(rng, 3, 4), randn(rng, 5, 4), randn(rng, 5)), {})],
        cost=lambda s, a: _mm_cost(s, a),
        flop_heavy=True,
        doc="out = op(x) @ op(w) + bias (bias broadcast over rows).",
    ),
]

OPS = [c.opdef for c in CORE_OPS]
