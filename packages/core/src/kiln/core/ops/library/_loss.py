"""Token embedding and the token losses: embedding, cross_entropy, fused_lm_head_loss."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from kiln.core._errors import OpError
from kiln.core._threads import chunks, matmul_into, parallel, row_blocks, scratch
from kiln.core.ir._dims import DimExpr, parse_dim
from kiln.core.ir._ir import TensorType, is_float
from kiln.core.ops._ops import AttrSpec, BackwardContext, Cost, InferContext, Sample
from kiln.core.ops.library._common import (
    Outs,
    allocating,
    check_same,
    core_op,
    float_dtype_of,
    or_scratch,
    randn,
)


def _check_ids(op: str, ids: np.ndarray, n: int, ignore: int | None = None) -> None:
    live = ids if ignore is None else ids[ids != ignore]
    bad = live[(live < 0) | (live >= n)]
    if bad.size:
        raise OpError(f"op {op!r}: index {bad[0]} is outside [0, {n})", op=op)


def _int_input(ctx: InferContext, i: int, what: str) -> None:
    if is_float(ctx.dtype(i)):
        raise ctx.fail(f"{what} must be an integer tensor, found {ctx.dtype(i)}")


# --- embedding -----------------------------------------------------------------------------------


def _embedding(ids: np.ndarray, weight: np.ndarray, *, padding_idx: int | None = None) -> np.ndarray:
    _check_ids("embedding", ids, weight.shape[0])
    out: np.ndarray = weight[ids]
    return out


def _embedding_infer(ctx: InferContext) -> list[TensorType]:
    _int_input(ctx, 0, "token_ids")
    w = ctx.shape(1)
    if len(w) != 2:
        raise ctx.fail(f"weight must be [num_embeddings, C], found rank {len(w)}")
    return [TensorType((*ctx.shape(0), w[1]), ctx.dtype(1))]


def _embedding_out(ids: np.ndarray, weight: np.ndarray, *, out: Outs, padding_idx: int | None = None) -> None:
    _check_ids("embedding", ids, weight.shape[0])
    np.take(weight, ids, axis=0, out=out[0], mode="clip")  # ids checked; "raise" would buffer the result


def _embedding_backward(d_out: np.ndarray, ids: np.ndarray, *, num_embeddings: int,
                        padding_idx: int | None = None) -> np.ndarray:
    dw = np.empty((num_embeddings, d_out.shape[-1]), d_out.dtype)
    _embedding_backward_out(d_out, ids, out=(dw,), num_embeddings=num_embeddings, padding_idx=padding_idx)
    return dw


def _embedding_backward_out(d_out: np.ndarray, ids: np.ndarray, *, out: Outs, num_embeddings: int,
                            padding_idx: int | None = None) -> None:
    _check_ids("embedding_backward", ids, num_embeddings)
    dw = out[0]
    assert dw is not None
    dw[...] = 0
    # repeated ids accumulate, in order of occurrence (unbuffered: no copy of d_out's rows)
    np.add.at(dw, ids.reshape(-1), d_out.reshape(-1, d_out.shape[-1]))
    if padding_idx is not None:  # as torch.nn.Embedding(padding_idx=...): that row gets no gradient
        dw[padding_idx] = 0


def _embedding_backward_infer(ctx: InferContext) -> list[TensorType]:
    _int_input(ctx, 1, "token_ids")
    d = ctx.shape(0)
    check_same(ctx, d[:-1], ctx.shape(1), "d_out's leading dims differ from token_ids")
    return [TensorType((parse_dim(ctx.attrs["num_embeddings"]), d[-1]), ctx.dtype(0))]


def _embedding_rule(ctx: BackwardContext) -> list[str | None]:
    if not ctx.needs_grad(1):
        return [None, None]
    return [None, ctx.emit("embedding_backward", ctx.d_out, ctx.saved(0), num_embeddings=ctx.shape_of(1)[0],
                           padding_idx=ctx.attrs.get("padding_idx"))]


def _embedding_samples(rng: np.random.Generator) -> Iterator[Sample]:
    yield Sample((np.array([[1, 4, 1, 0, 6], [4, 4, 2, 1, 3]]), randn(rng, 7, 4)), {})
    yield Sample((np.array([2, 0, 2]), randn(rng, 3, 5)), {})
    yield Sample((rng.integers(0, 5, (2, 2, 3)), randn(rng, 5, 3)), {})


# --- log-sum-exp over vocabulary chunks ----------------------------------------------------------
# Targets equal to ignore_index become -1, which no chunk contains; their loss and gradient are 0.


def loss_targets(targets: np.ndarray, v: int, ignore_index: int, op: str) -> np.ndarray:
    _check_ids(op, targets, v, ignore_index)
    return np.where(targets != ignore_index, targets, -1)


def _rows_in(t: np.ndarray, v0: int, v1: int) -> tuple[np.ndarray, np.ndarray]:
    rows = np.flatnonzero((t >= v0) & (t < v1))
    return rows, t[rows] - v0


def _streaming_loss(n: int, v: int, chunk: int, logits: Callable[[int, int], np.ndarray], t: np.ndarray,
                    dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(loss, lse) with an online log-sum-exp: only one [n, chunk] block of logits lives at a time."""
    m = np.full(n, -np.inf, dtype)  # running max
    s = np.zeros(n, dtype)  # running sum of exp(logit - m)
    target = np.zeros(n, dtype)
    for v0 in range(0, v, chunk):
        z = logits(v0, min(v0 + chunk, v))
        rows, cols = _rows_in(t, v0, v0 + z.shape[1])
        target[rows] = z[rows, cols]
        m_new = np.maximum(m, z.max(axis=1))
        z -= m_new[:, None]
        np.exp(z, out=z)
        s = s * np.exp(m - m_new) + z.sum(axis=1)
        m = m_new
        del z  # before the next chunk's logits are allocated
    lse = m + np.log(s)
    return np.where(t >= 0, lse - target, 0).astype(dtype), lse


def _logits_grad(z: np.ndarray, v0: int, lse: np.ndarray, t: np.ndarray, dl: np.ndarray,
                 dlse: np.ndarray) -> np.ndarray:
    """In place: logits z of columns v0: become d(sum loss*dl + lse*dlse)/dz = p*(dl + dlse) - onehot*dl."""
    z -= lse[:, None]
    np.exp(z, out=z)
    z *= (dl + dlse)[:, None]
    rows, cols = _rows_in(t, v0, v0 + z.shape[1])
    z[rows, cols] -= dl[rows]
    return z


def _cotangents(d_loss: np.ndarray | None, d_lse: np.ndarray | None, t: np.ndarray,
                dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    zero = np.zeros(t.shape, dtype)
    dl = zero if d_loss is None else np.where(t >= 0, d_loss, 0).astype(dtype)
    return dl, zero if d_lse is None else d_lse.astype(dtype)


# --- cross_entropy -------------------------------------------------------------------------------


def _cross_entropy(logits: np.ndarray, targets: np.ndarray, *, ignore_index: int) -> tuple[np.ndarray, ...]:
    n, v = logits.shape
    t = loss_targets(targets, v, ignore_index, "cross_entropy")
    return _streaming_loss(n, v, max(v, 1), lambda a, b: logits[:, a:b].copy(), t, logits.dtype)


def _cross_entropy_backward(d_loss: np.ndarray | None, logits: np.ndarray, targets: np.ndarray,
                            lse: np.ndarray, d_lse: np.ndarray | None, *, ignore_index: int) -> np.ndarray:
    t = loss_targets(targets, logits.shape[1], ignore_index, "cross_entropy_backward")
    dl, dlse = _cotangents(d_loss, d_lse, t, logits.dtype)
    return _logits_grad(logits.copy(), 0, lse, t, dl, dlse)


def _check_targets(ctx: InferContext, i: int, rows: DimExpr) -> None:
    _int_input(ctx, i, "targets")
    check_same(ctx, ctx.shape(i), (rows,), "targets must be [N], one per row")


def _cross_entropy_infer(ctx: InferContext) -> list[TensorType]:
    logits = ctx.shape(0)
    if len(logits) != 2:
        raise ctx.fail(f"logits must be [N, V], found rank {len(logits)}")
    _check_targets(ctx, 1, logits[0])
    return [TensorType(logits[:1], "fp32")] * 2


def _cross_entropy_rule(ctx: BackwardContext) -> list[str | None]:
    d_loss, d_lse = ctx.d_outputs
    if not ctx.needs_grad(0) or d_loss is d_lse is None:
        return [None, None]
    return [ctx.emit("cross_entropy_backward", d_loss, ctx.saved(0), ctx.saved(1), ctx.saved_output(1), d_lse,
                     ignore_index=ctx.attrs["ignore_index"]), None]


def _cross_entropy_samples(rng: np.random.Generator) -> Iterator[Sample]:
    yield Sample((randn(rng, 5, 7), np.array([3, -100, 0, 6, 3])), {})
    yield Sample((randn(rng, 4, 6), np.array([2, 5, 2, 1])), {"ignore_index": 2})


# --- fused_lm_head_loss --------------------------------------------------------------------------


#: bound on the elements of one block of logits ([rows, vocabulary chunk]) a thread of the fused
#: LM-head ops holds
LOGITS_TILE = 1 << 21


def _row_tiles(n: int, chunk: int) -> list[slice]:
    rows = max(1, min(n, LOGITS_TILE // max(chunk, 1)))
    return [slice(r0, min(r0 + rows, n)) for r0 in range(0, n, rows)]


def _chunk_logits(x: np.ndarray, w: np.ndarray, softcap: float | None, into: np.ndarray) -> np.ndarray:
    z: np.ndarray = np.matmul(x, w.T, out=into[: x.shape[0] * w.shape[0]].reshape(x.shape[0], w.shape[0]))
    if softcap is not None:
        z /= softcap
        np.tanh(z, out=z)
        z *= softcap
    return z


def _fused_lm_head_loss_out(x: np.ndarray, weight: np.ndarray, targets: np.ndarray, *, out: Outs,
                            ignore_index: int, chunk_size: int, softcap: float | None) -> None:
    """Tiles of rows run on the backend's threads, each over every vocabulary chunk in turn."""
    dtype = float_dtype_of(x, weight)
    x, weight = x.astype(dtype, copy=False), weight.astype(dtype, copy=False)
    n, v = x.shape[0], weight.shape[0]
    loss, lse = or_scratch(out, [(n,), (n,)], dtype)
    t = loss_targets(targets, v, ignore_index, "fused_lm_head_loss")
    chunk = min(chunk_size, v)

    def tile(r: slice) -> None:
        xr = x[r]
        buf = scratch("lm_head_logits", xr.shape[0] * chunk, dtype)

        def logits(a: int, b: int) -> np.ndarray:
            return _chunk_logits(xr, weight[a:b], softcap, buf)

        loss[r], lse[r] = _streaming_loss(xr.shape[0], v, chunk, logits, t[r], dtype)

    parallel(tile, _row_tiles(n, chunk))


def _fused_lm_head_loss(x: np.ndarray, weight: np.ndarray, targets: np.ndarray,
                        **attrs: Any) -> tuple[np.ndarray, ...]:
    n = x.shape[0]
    return allocating(_fused_lm_head_loss_out, [(n,), (n,)], x, weight, targets, **attrs)


def _fused_lm_head_loss_backward_out(d_loss: np.ndarray | None, x: np.ndarray, weight: np.ndarray,
                                     targets: np.ndarray, lse: np.ndarray, d_lse: np.ndarray | None, *,
                                     out: Outs, ignore_index: int, chunk_size: int,
                                     softcap: float | None) -> None:
    """Tile of rows after tile of rows; within one, the vocabulary chunks run on the backend's threads:
    each recomputes its logits, turns them into their gradient ``g``, adds ``g^T x`` to its own rows
    of ``d_weight`` and leaves ``g w`` for ``d_x``, summed over the chunks in order afterwards."""
    dtype = float_dtype_of(x, weight)
    x, weight = x.astype(dtype, copy=False), weight.astype(dtype, copy=False)
    n, v = x.shape[0], weight.shape[0]
    dx, dw = out
    t = loss_targets(targets, v, ignore_index, "fused_lm_head_loss_backward")
    dl, dlse = _cotangents(d_loss, d_lse, t, dtype)
    chunk = min(chunk_size, v)
    starts = list(range(0, v, chunk))
    tiles = _row_tiles(n, chunk)
    parts = scratch("lm_head_dx", len(starts) * (tiles[0].stop - tiles[0].start) * x.shape[1], dtype)
    for i, r in enumerate(tiles):
        xr = x[r]
        rows = xr.shape[0]
        dx_parts = parts[: len(starts) * rows * x.shape[1]].reshape(len(starts), rows, x.shape[1])

        def vocab_chunk(j: int, r: slice = r, xr: np.ndarray = xr, first: bool = i == 0,
                        dx_parts: np.ndarray = dx_parts) -> None:
            v0 = starts[j]
            w = weight[v0:v0 + chunk]
            buf = scratch("lm_head_logits", xr.shape[0] * chunk, dtype)
            if softcap is None:
                g = _logits_grad(_chunk_logits(xr, w, None, buf), v0, lse[r], t[r], dl[r], dlse[r])
            else:  # capped = softcap * tanh(raw / softcap), so d raw = d capped * (1 - tanh^2)
                th = _chunk_logits(xr, w, None, buf)
                th /= softcap
                np.tanh(th, out=th)
                g = _logits_grad(th * softcap, v0, lse[r], t[r], dl[r], dlse[r])
                np.square(th, out=th)
                g *= np.subtract(1, th, out=th)
            if dx is not None:
                np.matmul(g, w, out=dx_parts[j])
            if dw is not None:
                if first:
                    np.matmul(g.T, xr, out=dw[v0:v0 + chunk])
                else:
                    part = scratch("lm_head_dw", w.shape[0] * x.shape[1], dtype)
                    part = part.reshape(w.shape[0], x.shape[1])
                    dw[v0:v0 + chunk] += np.matmul(g.T, xr, out=part)

        parallel(vocab_chunk, range(len(starts)))
        if dx is not None:
            np.copyto(dx[r], dx_parts[0])
            for j in range(1, len(starts)):
                dx[r] += dx_parts[j]


#: bound on the elements of the one block of logits (rows x the whole vocabulary) that
#: :func:`fused_lm_head_loss_and_grad` holds (32 MiB in float32)
FUSED_LOGITS_TILE = 1 << 23
#: logits whose row maximum lies within +-this go through exp() without subtracting the maximum
#: first (float32's exp overflows past 88)
_EXP_SAFE = 60.0


def fused_lm_head_loss_and_grad(d_loss: np.ndarray, x: np.ndarray, weight: np.ndarray, targets: np.ndarray, *,
                                loss: np.ndarray, lse: np.ndarray, d_x: np.ndarray | None,
                                d_weight: np.ndarray | None, ignore_index: int) -> None:
    """``fused_lm_head_loss`` and its backward (for ``d_loss``, no ``d_lse``) in one pass.

    A training step knows its loss cotangent before the forward runs (the mean's ``mask / count``),
    so the NumPy backend runs the LM head's forward and backward together: each tile of rows
    computes its logits over the whole vocabulary once, their log-sum-exp and loss, and turns them
    in place into ``E = exp(z - m)`` with ``sum(E)`` taken off at each row's target; with
    ``a = d_loss / sum(E)`` per row, the logits' gradient is ``a * E``, so ``d_x = a * (E @ w)`` and
    ``d_weight += E^T @ (a * x)``: three products over the logits (a backward that recomputes them
    has four) and three passes over them. Tiles run one after another; the products and row blocks
    inside a tile run on the backend's threads.
    """
    dtype = float_dtype_of(x, weight)
    n, v = x.shape[0], weight.shape[0]
    t = loss_targets(targets, v, ignore_index, "fused_lm_head_loss")
    dl = np.where(t >= 0, d_loss, 0).astype(dtype)
    rows = max(1, min(n, FUSED_LOGITS_TILE // max(v, 1)))
    buf = scratch("lm_head_tile", min(n, rows) * v, dtype)
    scale = np.empty(n, dtype)
    vocab_pieces = [slice(lo, hi) for lo, hi in chunks(v, max(256, v // 16))]
    for i, r0 in enumerate(range(0, n, rows)):
        r = slice(r0, min(r0 + rows, n))
        xr = x[r]
        z = matmul_into(xr, weight.T, buf[: xr.shape[0] * v].reshape(xr.shape[0], v))

        def softmax(b: slice, z: np.ndarray = z, r: slice = r) -> None:
            zb, tb = z[b], t[r][b]
            picked = np.flatnonzero(tb >= 0)
            target = np.zeros(zb.shape[0], dtype)
            target[picked] = zb[picked, tb[picked]]
            m = zb.max(axis=1)
            if np.all(np.abs(m) < _EXP_SAFE):  # exp(z) cannot overflow, and each row's largest term is normal
                m[...] = 0
            else:
                zb -= m[:, None]
            np.exp(zb, out=zb)
            total = zb.sum(axis=1)
            row_lse = m + np.log(total)
            lse[r][b] = row_lse
            loss[r][b] = np.where(tb >= 0, row_lse - target, 0)
            zb[picked, tb[picked]] -= total[picked]
            scale[r][b] = dl[r][b] / total

        parallel(softmax, row_blocks(*z.shape))
        a = scale[r, None]
        if d_x is not None:
            matmul_into(z, weight, d_x[r])
            d_x[r] *= a
        if d_weight is not None:
            xs = np.multiply(xr, a, out=scratch("lm_head_xs", xr.size, dtype).reshape(xr.shape))
            if i == 0:
                matmul_into(z.T, xs, d_weight)
            else:
                def add_rows(p: slice, z: np.ndarray = z, xs: np.ndarray = xs) -> None:
                    part = scratch("lm_head_dw", (p.stop - p.start) * x.shape[1], dtype)
                    d_weight[p] += np.matmul(z[:, p].T, xs, out=part.reshape(p.stop - p.start, x.shape[1]))

                parallel(add_rows, vocab_pieces)


def _fused_lm_head_loss_backward(d_loss: np.ndarray | None, x: np.ndarray, weight: np.ndarray,
                                 *inputs: np.ndarray | None, **attrs: Any) -> tuple[np.ndarray, ...]:
    return allocating(_fused_lm_head_loss_backward_out, [x.shape, weight.shape], d_loss, x, weight, *inputs,
                      **attrs)


def _fused_infer(ctx: InferContext) -> list[TensorType]:
    x, w = ctx.shape(0), ctx.shape(1)
    if len(x) != 2 or len(w) != 2:
        raise ctx.fail(f"x must be [N, C] and weight [V, C], found ranks {len(x)} and {len(w)}")
    check_same(ctx, x[1:], w[1:], "x and weight differ in C")
    _check_targets(ctx, 2, x[0])
    if ctx.attrs["chunk_size"] < 1:
        raise ctx.fail(f"chunk_size must be positive, found {ctx.attrs['chunk_size']}")
    return [TensorType(x[:1], "fp32")] * 2


def _fused_backward_infer(ctx: InferContext) -> list[TensorType]:
    (loss, _), x = _fused_infer(InferContext(ctx.op, ctx.inputs[1:4], ctx.attrs)), ctx.shape(1)
    check_same(ctx, ctx.shape(4), loss.shape, "lse must be [N]")
    return [TensorType(x, ctx.dtype(1)), TensorType(ctx.shape(2), ctx.dtype(2))]


def _fused_rule(ctx: BackwardContext) -> list[str | None]:
    d_loss, d_lse = ctx.d_outputs
    if not (ctx.needs_grad(0) or ctx.needs_grad(1)) or d_loss is d_lse is None:
        return [None, None, None]
    dx, dw = ctx.emit("fused_lm_head_loss_backward", d_loss, ctx.saved(0), ctx.saved(1), ctx.saved(2),
                      ctx.saved_output(1), d_lse, **{k: ctx.attrs[k] for k in ("ignore_index", "chunk_size",
                                                                                "softcap")})
    return [dx if ctx.needs_grad(0) else None, dw if ctx.needs_grad(1) else None, None]


def _fused_samples(rng: np.random.Generator) -> Iterator[Sample]:
    targets = np.array([3, -100, 10, 0, 7, -100])
    yield Sample((randn(rng, 6, 4), randn(rng, 11, 4), targets), {"chunk_size": 4})  # chunks 4, 4, 3
    yield Sample((randn(rng, 6, 4), randn(rng, 11, 4), targets), {"chunk_size": 16})
    yield Sample((randn(rng, 6, 4), randn(rng, 11, 4), targets), {"chunk_size": 1})
    yield Sample((randn(rng, 6, 4), randn(rng, 11, 4), targets), {"chunk_size": 5, "softcap": 2.0})
    yield Sample((randn(rng, 5, 3), randn(rng, 9, 3), np.array([0, 8, 0, 4, 2])), {"chunk_size": 4,
                                                                                    "ignore_index": 0})


def _fused_bwd_samples(rng: np.random.Generator) -> Iterator[Sample]:
    for s in _fused_samples(rng):
        attrs = {"ignore_index": -100, "softcap": None, **s.attrs}
        x, w, targets = s.inputs
        assert x is not None and w is not None and targets is not None
        loss, lse = _fused_lm_head_loss(x, w, targets, **attrs)
        for d_loss, d_lse in ((randn(rng, *loss.shape), None), (None, randn(rng, *loss.shape)),
                              (randn(rng, *loss.shape), randn(rng, *loss.shape))):
            yield Sample((d_loss, *s.inputs, lse, d_lse), s.attrs)


def _fused_cost(shapes: Sequence[tuple[int, ...]], attrs: Mapping[str, Any], backward: bool = False) -> Cost:
    x, w = shapes[1:3] if backward else shapes[:2]
    n, (v, c) = x[0], w
    # the backward recomputes each chunk's logits and runs two more products over it
    flops = (6.0 if backward else 2.0) * n * v * c + 4.0 * n * v
    return Cost(flops=flops, bytes=4.0 * (2 if backward else 1) * (n * c + v * c) + 16.0 * n)


_IGNORE = AttrSpec("ignore_index", "int", -100)
_FUSED_ATTRS = (_IGNORE, AttrSpec("chunk_size", "int", 4096), AttrSpec("softcap", "float", None))

_PADDING = AttrSpec("padding_idx", "int", None)

CORE_OPS = [
    core_op(
        "embedding", ("token_ids", "weight"), ("out",), _embedding, _embedding_infer,
        backward=_embedding_rule, samples=_embedding_samples, nondiff_inputs={0}, out_kernel=_embedding_out,
        attrs=(_PADDING,), cost=lambda s, a: Cost(bytes=8.0 * math.prod(s[0]) * s[1][1]),
        doc="out[..., :] = weight[token_ids[...], :]. The row padding_idx (if set) gets no gradient, as in "
            "torch.nn.Embedding.",
    ),
    core_op(
        "embedding_backward", ("d_out", "token_ids"), ("d_weight",), _embedding_backward,
        _embedding_backward_infer, attrs=(AttrSpec("num_embeddings", "dim"), _PADDING), nondiff_inputs={1},
        out_kernel=_embedding_backward_out, samples=lambda rng: [
            Sample((randn(rng, 2, 5, 4), np.array([[1, 4, 1, 0, 6], [4, 4, 2, 1, 3]])),
                   {"num_embeddings": 7})],
        cost=lambda s, a: Cost(flops=float(math.prod(s[0])), bytes=8.0 * math.prod(s[0])),
        doc="d_weight[i] = sum of d_out rows whose token id is i (scatter-add); 0 for i = padding_idx.",
    ),
    core_op(
        "cross_entropy", ("logits", "targets"), ("loss", "lse"), _cross_entropy, _cross_entropy_infer,
        backward=_cross_entropy_rule, attrs=(_IGNORE,), samples=_cross_entropy_samples, nondiff_inputs={1},
        cost=lambda s, a: Cost(flops=5.0 * math.prod(s[0]), bytes=4.0 * math.prod(s[0])),
        autocast="fp32",
        statistics={"loss", "lse"},
        doc="Per row: loss = logsumexp(logits) - logits[target] (0 where target == ignore_index), and lse.",
    ),
    core_op(
        "cross_entropy_backward", ("d_loss?", "logits", "targets", "lse", "d_lse?"), ("d_logits",),
        _cross_entropy_backward, lambda ctx: [TensorType(ctx.shape(1), ctx.dtype(1))], attrs=(_IGNORE,),
        nondiff_inputs={2}, cost=lambda s, a: Cost(flops=5.0 * math.prod(s[1]), bytes=8.0 * math.prod(s[1])),
        autocast="fp32",
        statistics={"d_loss", "lse", "d_lse"},
        doc="d_logits = softmax(logits) * (d_loss + d_lse) - onehot(target) * d_loss (d_loss 0 if ignored).",
    ),
    core_op(
        "fused_lm_head_loss", ("x", "weight", "targets"), ("loss", "lse"), _fused_lm_head_loss, _fused_infer,
        backward=_fused_rule, attrs=_FUSED_ATTRS, samples=_fused_samples, nondiff_inputs={2},
        cost=_fused_cost, out_kernel=_fused_lm_head_loss_out,
        autocast="fp32",
        statistics={"loss", "lse"},
        doc="cross_entropy(x @ weight^T, targets) over vocabulary chunks; logits are never materialised.",
    ),
    core_op(
        "fused_lm_head_loss_backward", ("d_loss?", "x", "weight", "targets", "lse", "d_lse?"),
        ("d_x", "d_weight"), _fused_lm_head_loss_backward, _fused_backward_infer, attrs=_FUSED_ATTRS,
        nondiff_inputs={3}, cost=lambda s, a: _fused_cost(s, a, backward=True),
        out_kernel=_fused_lm_head_loss_backward_out, samples=_fused_bwd_samples,
        autocast="fp32",
        statistics={"d_loss", "lse", "d_lse"},
        doc="(d_x, d_weight) of fused_lm_head_loss, recomputing each vocabulary chunk's logits.",
    ),
]

OPS = [c.opdef for c in CORE_OPS]
