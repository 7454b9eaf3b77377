"""Attention: rope, qkv_qk_norm_rope, flash_attention (packed qkv), attention (separate q, k, v).

Conventions are HuggingFace Llama/Qwen3 in the input float dtype:

* Layouts. ``rope`` takes ``x: [B, T, H * head_dim]`` (heads contiguous, as a projection makes
  them). A packed ``qkv: [B, T, (Hq + 2 * Hkv) * D]`` holds the q heads, then the k heads, then the
  v heads. ``attention`` takes ``q: [B, Tq, Hq, D]``, ``k``/``v: [B, Tk, Hkv, D]`` (HF's layout before
  its transpose). ``lse`` is ``[B, Hq, Tq]``; rstd outputs are ``[B, T, H]``.
* RoPE is ``rotate_half``: each head's first ``rotary_dim`` dims split into halves ``[x1 | x2]``
  (pairs ``(i, i + rotary_dim / 2)``), ``out = x * cos + [-x2 | x1] * sin``; dims past
  ``rotary_dim`` pass through. ``interleaved=True`` takes GPT-J's layout instead: pairs
  ``(2i, 2i + 1)`` (``rotate_every_two``), each rotated by the angle of frequency ``i``. Angles are
  ``position * inv_freq`` with
  ``inv_freq = 1 / theta ** (arange(0, rotary_dim, 2) / rotary_dim)``. A ``freqs`` table
  ``[MaxSeq, rotary_dim // 2, 2]`` of (cos, sin) rows, indexed by position, replaces that formula
  (scaled RoPE variants build their own table, attention scaling folded in). ``inverse=True``
  negates the sine: the transpose of the rotation, which is rope's own backward.
* Attention scores are ``(q @ k^T) * softmax_scale`` (default ``D ** -0.5``); query head ``h`` reads
  kv head ``h // (Hq // Hkv)``. Query ``i`` sits at key position ``p = i + Tk - Tq`` (aligned to the
  end of the keys, as flash-attn; ``p = i`` when ``Tq == Tk``). ``causal`` keeps keys ``j <= p``;
  ``window_size = w`` keeps ``p - w < j`` (the HF mask ``kv_idx > q_idx - sliding_window``: ``w`` keys
  including the query's own) and, when not causal, also ``j < p + w`` (flash-attn's
  ``window_size=(w - 1, w - 1)``). A fully masked query row gives ``out = 0`` and ``lse = +inf`` (as
  flash-attn), so the backward's ``exp(s - lse)`` is 0 there.
* ``attention`` (separate q, k, v) and ``flash_attention`` (packed qkv) also take ``softcap = c``:
  scores become ``c * tanh(s / c)`` (Gemma-2's logit soft-capping), and ``alibi``: head ``h`` adds
  ``-slope_h * |p - j|`` to its scores (flash-attn's ALiBi), with the slopes of ALiBi's paper
  (``2 ** (-8 i / n)``, :func:`alibi_slopes`). Capping comes first, then the bias, then the masks.
* ``segment_ids: [B, Tk]`` (optional, int) restricts attention to keys of the query's own segment:
  query ``i`` sees key ``j`` only when ``segment_ids[b, p] == segment_ids[b, j]`` (so they need
  ``Tq <= Tk``: more queries than keys is an ``OpError``). Packed documents
  are segments 1, 2, ...; padding is its own segment (0), so real tokens never see it (HF's
  ``attention_mask``) and a padding query still sees itself (its row stays finite).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import numpy as np

from kiln.core._errors import OpError
from kiln.core._threads import chunks, parallel, row_blocks, scratch
from kiln.core.ir._dims import Const, DimExpr, parse_dim, simplify
from kiln.core.ir._ir import TensorType
from kiln.core.ops._ops import AttrSpec, BackwardContext, Cost, InferContext, Sample
from kiln.core.ops.library._common import Outs, allocating, check_same, core_op, or_scratch, randn, view
from kiln.core.ops.library._norms import rms_rstd, rmsnorm_grad_rows

_ROPE_ATTRS = (
    AttrSpec("rotary_dim", "dim", None),
    AttrSpec("theta", "float", 10000.0),
    AttrSpec("interleaved", "bool", False),
)
_ATTN_ATTRS = (
    AttrSpec("causal", "bool", True),
    AttrSpec("softmax_scale", "float", None),
    AttrSpec("window_size", "int", None),
)
_SCORE_ATTRS = (AttrSpec("softcap", "float", None), AttrSpec("alibi", "bool", False))
_HEADS = (AttrSpec("Hq", "dim"), AttrSpec("Hkv", "dim"), AttrSpec("D", "dim"))


def _dim(ctx: InferContext, name: str) -> DimExpr:
    return parse_dim(ctx.attrs[name])


def _const(d: DimExpr) -> int | None:
    d = simplify(d)
    return d.value if isinstance(d, Const) else None


# --- rope ----------------------------------------------------------------------------------------


def rope_tables(freqs: np.ndarray | None, position_ids: np.ndarray, rotary_dim: int, theta: float,
                dtype: np.dtype, op: str) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, ``[*position_ids.shape, rotary_dim // 2]``, computed as HF's rotary embedding."""
    pos = np.asarray(position_ids)
    if freqs is not None:
        if pos.size and (pos.min() < 0 or pos.max() >= freqs.shape[0]):
            raise OpError(f"op {op!r}: position ids must lie in [0, {freqs.shape[0]}) to index the freqs "
                          f"table, found [{pos.min()}, {pos.max()}]", op=op)
        table = freqs[pos]
        return table[..., 0].astype(dtype, copy=False), table[..., 1].astype(dtype, copy=False)
    f = dtype.type
    inv_freq = f(1) / (f(theta) ** (np.arange(0, rotary_dim, 2).astype(dtype) / f(rotary_dim)))
    angle = pos.astype(dtype)[..., None] * inv_freq
    return np.cos(angle), np.sin(angle)


def _pairs(h: int, interleaved: bool) -> tuple[slice, slice]:
    """The two members of the rotated pairs among a head's first ``2 h`` dims: the halves, or (GPT-J)
    the even and the odd dims."""
    return (slice(0, 2 * h, 2), slice(1, 2 * h, 2)) if interleaved else (slice(0, h), slice(h, 2 * h))


def rope_into(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, out: np.ndarray,
              inverse: bool = False, interleaved: bool = False) -> None:
    """Rotate ``x: [B, T, H, D]`` with tables ``[T or B, T, rotary_dim // 2]`` into ``out`` (which may be
    ``x``): ``[x1 | x2] -> [x1 cos - x2 sin | x2 cos + x1 sin]`` on the first rotary_dim dims (``x1``,
    ``x2`` the even and odd dims when ``interleaved``)."""
    h = cos.shape[-1]
    c, s = cos[..., None, :], sin[..., None, :]
    if inverse:
        s = -s
    a, b = _pairs(h, interleaved)
    x1, x2, o1, o2 = x[..., a], x[..., b], out[..., a], out[..., b]
    x1_s, x2_s = x1 * s, x2 * s  # before out (perhaps x) is written
    np.multiply(x1, c, out=o1)
    o1 -= x2_s
    np.multiply(x2, c, out=o2)
    o2 += x1_s
    if out is not x:
        out[..., 2 * h:] = x[..., 2 * h:]


def check_rotary_dim(rotary_dim: int | None, head_dim: int, op: str) -> int:
    rd = head_dim if rotary_dim is None else rotary_dim
    if rd % 2 or not 0 < rd <= head_dim:
        raise OpError(f"op {op!r}: rotary_dim must be even and in (0, {head_dim}], found {rd}", op=op)
    return rd


def _rope_out(x: np.ndarray, freqs: np.ndarray | None, position_ids: np.ndarray, *, out: Outs, head_dim: int,
              rotary_dim: int | None, theta: float, inverse: bool, interleaved: bool = False) -> None:
    b, t, f = x.shape
    if f % head_dim:
        raise OpError(f"op 'rope': last dim {f} is not a multiple of head_dim {head_dim}", op="rope")
    rd = check_rotary_dim(rotary_dim, head_dim, "rope")
    cos, sin = rope_tables(freqs, position_ids, rd, theta, x.dtype, "rope")
    heads = (b, t, f // head_dim, head_dim)
    rope_into(x.reshape(heads), cos, sin, view(out[0], heads), inverse, interleaved)  # type: ignore[arg-type]


def _rope(x: np.ndarray, *inputs: np.ndarray | None, **attrs: Any) -> np.ndarray:
    return allocating(_rope_out, [x.shape], x, *inputs, **attrs)[0]


def _check_rope_inputs(ctx: InferContext, x: int, freqs: int, pos: int, head_dim: DimExpr) -> None:
    b, t = ctx.shape(x)[:2]
    p = ctx.shape(pos)
    if len(p) == 1:
        check_same(ctx, p, (t,), "position_ids must be [T] or [B, T]")
    else:
        check_same(ctx, p, (b, t), "position_ids must be [T] or [B, T]")
    rd = head_dim if ctx.attrs["rotary_dim"] is None else _dim(ctx, "rotary_dim")
    rd_c, hd_c = _const(rd), _const(head_dim)
    if rd_c is not None and (rd_c % 2 or rd_c <= 0 or (hd_c is not None and rd_c > hd_c)):
        raise ctx.fail(f"rotary_dim must be even and in (0, head_dim = {head_dim}], found {rd}")
    if ctx.inputs[freqs] is not None:
        fr = ctx.shape(freqs)
        if len(fr) != 3:
            raise ctx.fail(f"freqs must be [MaxSeq, rotary_dim // 2, 2], found rank {len(fr)}")
        check_same(ctx, fr[1:], (rd // 2, Const(2)), "freqs must be [MaxSeq, rotary_dim // 2, 2]")


def _rope_infer(ctx: InferContext) -> list[TensorType]:
    x = ctx.shape(0)
    if len(x) != 3:
        raise ctx.fail(f"x must be [B, T, H * head_dim], found rank {len(x)}")
    hd = _dim(ctx, "head_dim")
    rest = _const(x[2] % hd)
    if rest:
        raise ctx.fail(f"last dim {x[2]} is not a multiple of head_dim {hd}")
    _check_rope_inputs(ctx, 0, 1, 2, hd)
    return [TensorType(x, ctx.dtype(0))]


def _rope_backward(ctx: BackwardContext) -> list[str | None]:
    if ctx.d_outputs[0] is None or not ctx.needs_grad(0):
        return [None, None, None]
    attrs = {**ctx.attrs, "inverse": not ctx.attrs["inverse"]}
    return [ctx.emit("rope", ctx.d_out, ctx.saved(1), ctx.saved(2), **attrs), None, None]


def _rope_samples(rng: np.random.Generator) -> Iterator[Sample]:
    x = randn(rng, 2, 3, 8)
    pos = np.array([0, 3, 5])
    yield Sample((x, None, pos), {"head_dim": 4, "theta": 100.0})
    yield Sample((x, None, pos), {"head_dim": 4, "theta": 100.0, "inverse": True})
    yield Sample((x, None, rng.integers(0, 9, (2, 3))), {"head_dim": 4, "rotary_dim": 2, "theta": 10.0})
    yield Sample((randn(rng, 2, 3, 12), randn(rng, 6, 2, 2), rng.integers(0, 6, (2, 3))), {"head_dim": 6,
                                                                                          "rotary_dim": 4})
    yield Sample((x, None, pos), {"head_dim": 4, "theta": 100.0, "interleaved": True})
    yield Sample((randn(rng, 2, 3, 12), randn(rng, 6, 2, 2), rng.integers(0, 6, (2, 3))),
                 {"head_dim": 6, "rotary_dim": 4, "interleaved": True, "inverse": True})


def _rope_cost(shapes: Sequence[tuple[int, ...]], attrs: Any) -> Cost:
    n = float(np.prod(shapes[0]))
    return Cost(flops=3.0 * n, bytes=8.0 * n)


# --- qkv_qk_norm_rope ----------------------------------------------------------------------------


def _split_qkv(qkv: np.ndarray, hq: int, hkv: int, d: int, op: str) -> tuple[np.ndarray, ...]:
    b, t, f = qkv.shape
    if f != (hq + 2 * hkv) * d:
        raise OpError(f"op {op!r}: packed qkv has last dim {f}, expected (Hq + 2 * Hkv) * D = "
                      f"{(hq + 2 * hkv) * d}", op=op)
    if hkv <= 0 or hq % hkv:
        raise OpError(f"op {op!r}: Hq = {hq} must be a multiple of Hkv = {hkv}", op=op)
    return (qkv[..., : hq * d].reshape(b, t, hq, d), qkv[..., hq * d: (hq + hkv) * d].reshape(b, t, hkv, d),
            qkv[..., (hq + hkv) * d:].reshape(b, t, hkv, d))


def _qkv_pieces(b: int, t: int, f: int) -> list[tuple[int, slice]]:
    """(sequence, positions) pieces of a packed qkv for the backend's threads: shapes decide the cut."""
    return [(i, r) for i in range(b) for r in row_blocks(t, f)]


def _at(table: np.ndarray, position_ids: np.ndarray, i: int, r: slice) -> np.ndarray:
    """Rows of a rope table (``[T, ...]`` or ``[B, T, ...]``, as the position ids) for piece (i, r)."""
    return table[r] if position_ids.ndim == 1 else table[i, r]


def _wide_tables(cos: np.ndarray, sin: np.ndarray, heads: int, d: int, weight: np.ndarray | None = None,
                 interleaved: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """RoPE as ``out = x * C + swap(x) * S`` over whole rows of ``heads`` heads (``[..., heads * d]``,
    :func:`_rotate`), where ``swap`` exchanges each head's two rotary halves: ``C = [cos | cos | 1]``,
    ``S = [-sin | sin | 0]`` per head, times ``weight`` (C) and its swap (S) when a norm weight
    is folded in. Whole-row tables keep the ufunc loops long (the halves alone are short strided
    runs). ``interleaved``: the pairs are (even, odd) dims instead of the halves (:func:`_pairs`)."""
    h = cos.shape[-1]
    a, b = _pairs(h, interleaved)
    c, s = np.ones((*cos.shape[:-1], d), cos.dtype), np.zeros((*sin.shape[:-1], d), sin.dtype)
    c[..., a], c[..., b], s[..., a], s[..., b] = cos, cos, -sin, sin
    if weight is not None:
        c *= weight
        swapped = weight.copy()
        swapped[a], swapped[b] = weight[b], weight[a]
        s *= swapped
    return np.tile(c, heads), np.tile(s, heads)


def _rotate(x: np.ndarray, c: np.ndarray, s: np.ndarray, out: np.ndarray, tmp: np.ndarray, heads: int,
            h: int, inverse: bool = False, interleaved: bool = False) -> np.ndarray:
    """``out = x * c + swap(x) * s`` (``-`` with ``inverse``) over rows ``[n, heads * d]``, where
    ``swap`` exchanges the members of each head's pairs (:func:`_pairs`); ``tmp`` is scratch of x's
    shape."""
    n = x.shape[0]
    x3, s3, t3 = x.reshape(n, heads, -1), s.reshape(n, heads, -1), tmp.reshape(n, heads, -1)
    a, b = _pairs(h, interleaved)
    np.multiply(x3[..., b], s3[..., a], out=t3[..., a])
    np.multiply(x3[..., a], s3[..., b], out=t3[..., b])
    if t3.shape[-1] > 2 * h:
        t3[..., 2 * h:] = 0  # the sine is 0 past the rotary dims
    np.multiply(x, c, out=out)
    if inverse:
        out -= tmp
    else:
        out += tmp
    return out


def _qkv_out(qkv: np.ndarray, q_norm_weight: np.ndarray | None, k_norm_weight: np.ndarray | None,
             freqs: np.ndarray | None, position_ids: np.ndarray, *, out: Outs, Hq: int, Hkv: int, D: int,
             eps: float, theta: float, rotary_dim: int | None, interleaved: bool = False) -> None:
    """q and k: ``rope(x * rstd * weight)`` computed as ``rstd * (x * C + swap(x) * S)`` with the
    weight folded into the tables (:func:`_wide_tables`); v copied. Pieces run on the backend's
    threads."""
    op = "qkv_qk_norm_rope"
    b, t, f = qkv.shape
    qkv_out, q_rstd, k_rstd = or_scratch(out, [qkv.shape, (b, t, Hq), (b, t, Hkv)], qkv.dtype)
    _split_qkv(qkv, Hq, Hkv, D, op)  # checks the layout
    cos_t, sin_t = rope_tables(freqs, position_ids, check_rotary_dim(rotary_dim, D, op), theta, qkv.dtype, op)
    h = cos_t.shape[-1]
    parts = ((0, Hq, q_norm_weight, q_rstd), (Hq * D, Hkv, k_norm_weight, k_rstd))
    tables = [_wide_tables(cos_t, sin_t, heads, D, w, interleaved) for _, heads, w, _ in parts]

    def piece(p: tuple[int, slice]) -> None:
        i, r = p
        for (start, heads, w, rstd), (c, s) in zip(parts, tables, strict=True):
            cols = slice(start, start + heads * D)
            x, o = qkv[i, r, cols], qkv_out[i, r, cols]
            n = x.shape[0]
            tmp = scratch("qkv_rope", n * heads * D, qkv.dtype).reshape(n, heads * D)
            _rotate(x, _at(c, position_ids, i, r), _at(s, position_ids, i, r), o, tmp, heads, h,
                    interleaved=interleaved)
            if w is None:
                rstd[i, r] = 1
            else:
                rows = rms_rstd(x.reshape(n, heads, D), eps)
                rstd[i, r] = rows
                o.reshape(n, heads, D)[...] *= rows[..., None]
        qkv_out[i, r, (Hq + Hkv) * D:] = qkv[i, r, (Hq + Hkv) * D:]

    parallel(piece, _qkv_pieces(b, t, f))


def _qkv_norm_rope(qkv: np.ndarray, *inputs: np.ndarray | None, **attrs: Any) -> tuple[np.ndarray, ...]:
    b, t = qkv.shape[:2]
    return allocating(_qkv_out, [qkv.shape, (b, t, attrs["Hq"]), (b, t, attrs["Hkv"])], qkv, *inputs, **attrs)


def _qkv_infer(ctx: InferContext) -> list[TensorType]:
    hq, hkv, d = (_dim(ctx, n) for n in ("Hq", "Hkv", "D"))
    x = ctx.shape(0)
    if len(x) != 3:
        raise ctx.fail(f"qkv must be [B, T, (Hq + 2 * Hkv) * D], found rank {len(x)}")
    check_same(ctx, x[2:], ((hq + 2 * hkv) * d,), "packed qkv last dim must be (Hq + 2 * Hkv) * D")
    for i, which in ((1, "q_norm_weight"), (2, "k_norm_weight")):
        if ctx.inputs[i] is not None:
            check_same(ctx, ctx.shape(i), (d,), f"{which} must be [D]")
    _check_rope_inputs(ctx, 0, 3, 4, d)
    b, t = x[:2]
    return [TensorType(x, ctx.dtype(0)), TensorType((b, t, hq), "fp32"), TensorType((b, t, hkv), "fp32")]


def _qkv_backward(ctx: BackwardContext) -> list[str | None]:
    wanted = [ctx.needs_grad(i) and bool(ctx.inputs[i]) for i in range(3)]
    if all(d is None for d in ctx.d_outputs) or not any(wanted):
        return [None] * 5
    grads = ctx.emit("qkv_qk_norm_rope_backward", ctx.d_outputs[0], *(ctx.saved(i) for i in range(5)),
                     ctx.saved_output(1), ctx.saved_output(2), *ctx.d_outputs[1:], **ctx.attrs)
    return [g if w else None for g, w in zip(grads, wanted, strict=True)] + [None, None]


def _qkv_bwd_out(d_qkv_out: np.ndarray | None, qkv: np.ndarray, q_norm_weight: np.ndarray | None,
                 k_norm_weight: np.ndarray | None, freqs: np.ndarray | None, position_ids: np.ndarray,
                 q_rstd: np.ndarray, k_rstd: np.ndarray, d_q_rstd: np.ndarray | None = None,
                 d_k_rstd: np.ndarray | None = None, *, out: Outs, Hq: int, Hkv: int, D: int,
                 eps: float, theta: float, rotary_dim: int | None, interleaved: bool = False) -> None:
    op = "qkv_qk_norm_rope_backward"
    d_qkv, d_qw, d_kw = or_scratch(out, [qkv.shape, (D,), (D,)], qkv.dtype)
    b, t = qkv.shape[:2]
    q, k, _ = _split_qkv(qkv, Hq, Hkv, D, op)
    d_q, d_k, d_v = _split_qkv(np.zeros_like(qkv) if d_qkv_out is None else d_qkv_out, Hq, Hkv, D, op)
    g_q, g_k, g_v = _split_qkv(d_qkv, Hq, Hkv, D, op)
    cos_t, sin_t = rope_tables(freqs, position_ids, check_rotary_dim(rotary_dim, D, op), theta, qkv.dtype, op)
    h = cos_t.shape[-1]
    pieces = _qkv_pieces(b, t, qkv.shape[2])
    grads = np.empty((len(pieces), 2, D), qkv.dtype)  # each piece's share of the two norm weights' grads
    parts = ((q, d_q, q_norm_weight, q_rstd, d_q_rstd, g_q, Hq, 0),
             (k, d_k, k_norm_weight, k_rstd, d_k_rstd, g_k, Hkv, 1))
    tables = [_wide_tables(cos_t, sin_t, heads, D, interleaved=interleaved) for *_, heads, _ in parts]

    def piece(n: int) -> None:
        i, r = pieces[n]
        for (x, dy, w, rstd, d_rstd, g, heads, j), (c, s) in zip(parts, tables, strict=True):
            rows = r.stop - r.start
            dy2, g2 = dy[i, r].reshape(rows, heads * D), view(g[i, r], (rows, heads * D))
            tmp = scratch("qkv_rope", rows * heads * D, qkv.dtype).reshape(rows, heads * D)
            cr, sr = _at(c, position_ids, i, r), _at(s, position_ids, i, r)
            _rotate(dy2, cr, sr, g2, tmp, heads, h, inverse=True, interleaved=interleaved)  # rotate back
            if w is None:  # no norm: the rstd output is constant ones
                grads[n, j] = 0
            else:
                rmsnorm_grad_rows(g[i, r], x[i, r], rstd[i, r], w, None if d_rstd is None else d_rstd[i, r],
                                  g[i, r], grads[n, j])
        g_v[i, r] = d_v[i, r]

    parallel(piece, range(len(pieces)))
    total = grads.sum(axis=0) if len(pieces) else np.zeros((2, D), qkv.dtype)
    d_qw[...], d_kw[...] = total[0], total[1]


def _qkv_bwd_kernel(d_qkv_out: np.ndarray | None, qkv: np.ndarray, *inputs: np.ndarray | None,
                    **attrs: Any) -> tuple[np.ndarray, ...]:
    d = attrs["D"]
    return allocating(_qkv_bwd_out, [qkv.shape, (d,), (d,)], d_qkv_out, qkv, *inputs, **attrs)


def _qkv_bwd_infer(ctx: InferContext) -> list[TensorType]:
    d = _dim(ctx, "D")
    return [TensorType(ctx.shape(1), ctx.dtype(1)), *[TensorType((d,), ctx.dtype(1))] * 2]


def _qkv_samples(rng: np.random.Generator) -> Iterator[Sample]:
    heads = {"Hq": 2, "Hkv": 1, "D": 4}
    qkv, pos = randn(rng, 2, 3, 16), np.array([1, 2, 4])
    yield Sample((qkv, randn(rng, 4), randn(rng, 4), None, pos), {**heads, "theta": 50.0})
    yield Sample((qkv, None, None, None, rng.integers(0, 7, (2, 3))), {**heads, "theta": 50.0})
    yield Sample((qkv, randn(rng, 4), None, None, pos), {**heads, "rotary_dim": 2, "eps": 0.1})
    yield Sample((randn(rng, 1, 3, 24), None, randn(rng, 4), randn(rng, 5, 2, 2), pos),
                 {"Hq": 2, "Hkv": 2, "D": 4})
    yield Sample((qkv, randn(rng, 4), randn(rng, 4), None, pos),
                 {**heads, "theta": 50.0, "interleaved": True})
    yield Sample((randn(rng, 1, 3, 36), randn(rng, 6), None, None, pos),
                 {"Hq": 2, "Hkv": 2, "D": 6, "rotary_dim": 4, "interleaved": True})


def _qkv_bwd_samples(rng: np.random.Generator) -> Iterator[Sample]:
    for s in _qkv_samples(rng):
        qkv, *rest = s.inputs
        assert qkv is not None
        heads = {"eps": 1e-6, "theta": 10000.0, "rotary_dim": None, "interleaved": False, **s.attrs}
        _, q_rstd, k_rstd = _qkv_norm_rope(qkv, *rest, **heads)
        d_rstd = [randn(rng, *q_rstd.shape), randn(rng, *k_rstd.shape)]
        for d_out, extra in ((randn(rng, *qkv.shape), [None, None]), (None, d_rstd),
                             (randn(rng, *qkv.shape), d_rstd)):
            yield Sample((d_out, qkv, *rest, q_rstd, k_rstd, *extra), s.attrs)


def _qkv_cost(shapes: Sequence[tuple[int, ...]], attrs: Any) -> Cost:
    n = float(np.prod(shapes[0]))
    return Cost(flops=8.0 * n, bytes=8.0 * n)


# --- attention core ([B, T, H, D] layout) ----------------------------------------------------------


def _scale(softmax_scale: float | None, d: int) -> float:
    return d ** -0.5 if softmax_scale is None else softmax_scale


def _keep(tq: int, tk: int, causal: bool, window: int | None, op: str) -> np.ndarray:
    p = np.arange(tq)[:, None] + (tk - tq)
    j = np.arange(tk)[None, :]
    keep = np.ones((tq, tk), dtype=bool)
    if causal:
        keep &= j <= p
    if window is not None:
        if window < 1:
            raise OpError(f"op {op!r}: window_size must be >= 1, found {window}", op=op)
        keep &= j > p - window
        if not causal:
            keep &= j < p + window
    return keep


def _segment_keep(keep: np.ndarray, segments: np.ndarray | None, tq: int) -> np.ndarray:
    """``keep`` ([Tq, Tk]) restricted to each sequence's segments: ``[B, Tq, Tk]``, or ``keep`` itself
    when there are no segments or every sequence is one segment."""
    if segments is None or not segments.size or (segments == segments[:, :1]).all():
        return keep
    seg_q = segments[:, segments.shape[1] - tq:]
    masked: np.ndarray = keep & (seg_q[:, :, None] == segments[:, None, :])
    return masked


def _tile(keep: np.ndarray, t0: int, t1: int, k0: int, k1: int) -> np.ndarray:
    """The mask of query rows [t0, t1) and keys [k0, k1), shaped to broadcast over ``[B, Hkv, rep, n, k]``."""
    tile = keep[..., t0:t1, k0:k1]
    return tile if tile.ndim == 2 else tile[:, None, None]


def _check_segments(segments: np.ndarray | None, b: int, tq: int, tk: int, op: str) -> None:
    if segments is not None and segments.shape != (b, tk):
        raise OpError(f"op {op!r}: segment_ids must be [B, Tk] = [{b}, {tk}], found {list(segments.shape)}",
                      op=op)
    if segments is not None and tq > tk:
        raise OpError(f"op {op!r}: " + _MORE_QUERIES.format(tq=tq, tk=tk), op=op)


#: segment ids with more queries than keys: the first queries align to no key position
_MORE_QUERIES = ("segment_ids need Tq <= Tk (query i's segment is that of its key position "
                 "i + Tk - Tq), found q with Tq = {tq} and k with Tk = {tk}")


def _group(hq: int, hkv: int, op: str) -> int:
    if hkv <= 0 or hq % hkv:
        raise OpError(f"op {op!r}: Hq = {hq} must be a multiple of Hkv = {hkv}", op=op)
    return hq // hkv


# The kernels below work on blocks of (query rows x keys), flash-attention style: a kv head's query
# heads are stacked ([rep * rows, D]) so that one product serves the group, and temporaries are
# bounded by the block. Batches (or, for a single sequence, kv heads) run on the backend's threads
# (kiln.core._threads), each piece's products in BLAS's single-threaded path.
BLOCK_MACS = 1 << 21
QUERY_ROWS = 256  # stacked query rows (rep * rows) per block


#: bound on the elements of one piece's block of scores (its sequences x kv heads x stacked query
#: rows x keys): a piece's temporaries stay this size whatever the batch
PIECE_SCORES = 1 << 18


def _pieces(b: int, tq: int, tk: int, hq: int, hkv: int, d: int) -> list[tuple[slice, slice]]:
    """Independent pieces of an attention: (batch range, kv head range), about four of them, fewer
    sequences each when their blocks of scores would exceed :data:`PIECE_SCORES`. The cut depends on
    the shapes only."""
    if b > 1:
        rep = max(1, hq // max(hkv, 1))
        rows = max(1, QUERY_ROWS // rep)
        width = max(8, BLOCK_MACS // (rows * rep * d))
        per_seq = hkv * min(rows, tq) * rep * min(width, tk)
        seqs = max(1, min(b // 4, PIECE_SCORES // max(per_seq, 1)))
        return [(slice(lo, hi), slice(0, hkv)) for lo, hi in chunks(b, seqs)]
    return [(slice(0, b), slice(lo, hi)) for lo, hi in chunks(hkv, max(1, hkv // 4))]


def _blocks(keep: np.ndarray, rep: int, d: int) -> Iterator[tuple[int, int, list[tuple[int, int]]]]:
    """``(t0, t1, [(k0, k1), ...])``: query rows ``[t0, t1)`` and the key blocks any of them sees."""
    tq, tk = keep.shape[-2:]
    rows = max(1, QUERY_ROWS // rep)
    width = max(8, BLOCK_MACS // (rows * rep * d))
    for t0 in range(0, tq, rows):
        t1 = min(t0 + rows, tq)
        block = keep[..., t0:t1, :]
        seen = np.any(block.reshape(-1, tk), axis=0)
        yield t0, t1, [(k0, min(k0 + width, tk)) for k0 in range(0, tk, width) if seen[k0:k0 + width].any()]


def _rows(x: np.ndarray, t0: int, t1: int, hkv: int, rep: int, factor: Any = None) -> np.ndarray:
    """Rows t0:t1 of ``x: [B, T, Hq, D]`` as a new ``[B, Hkv, rep * n, D]`` (a kv head's query heads
    stacked), times ``factor`` if given."""
    b, _, _, d = x.shape
    n = t1 - t0
    src = x[:, t0:t1].reshape(b, n, hkv, rep, d).transpose(0, 2, 3, 1, 4)
    tile = np.multiply(src, factor) if factor is not None else src.copy()
    return tile.reshape(b, hkv, rep * n, d)


def _unrows(tile: np.ndarray, x: np.ndarray, t0: int, t1: int, hkv: int, rep: int) -> None:
    """The inverse of :func:`_rows`: ``tile`` into rows t0:t1 of ``x``."""
    b, _, _, d = x.shape
    n = t1 - t0
    view(x[:, t0:t1], (b, n, hkv, rep, d))[...] = tile.reshape(b, hkv, rep, n, d).transpose(0, 3, 1, 2, 4)


def alibi_slopes(heads: int) -> np.ndarray:
    """ALiBi's head slopes (Press et al.; HF's ``build_alibi_tensor``): ``2 ** (-8 i / n)``, i = 1..n, for
    the power of two n at or below ``heads``; the remaining heads take every other slope of 2n heads."""
    n = 2 ** math.floor(math.log2(heads))
    slopes = 2.0 ** (-8.0 / n * np.arange(1, n + 1))
    extra = 2.0 ** (-4.0 / n * np.arange(1, 2 * (heads - n), 2))
    out: np.ndarray = np.concatenate([slopes, extra])
    return out


@attrs.frozen
class _Logits:
    """How raw scores become logits: ``softcap`` and the ALiBi slopes ``[Hkv, rep]`` of a piece's heads."""

    softcap: float | None = None
    slopes: np.ndarray | None = attrs.field(default=None, eq=False)

    def bias(self, tq: int, tk: int, t0: int, t1: int, k0: int, k1: int) -> np.ndarray | None:
        """ALiBi's ``-slope * |p - j|`` of query rows [t0, t1) and keys [k0, k1): ``[1, Hkv, rep * n, k]``."""
        if self.slopes is None:
            return None
        p = np.arange(t0, t1)[:, None] + (tk - tq)
        dist = np.abs(p - np.arange(k0, k1)[None, :])
        hkv, rep = self.slopes.shape
        bias: np.ndarray = (-self.slopes[:, :, None, None] * dist).reshape(1, hkv, rep * (t1 - t0), k1 - k0)
        return bias


def _scores(qt: np.ndarray, kh: np.ndarray, keep: np.ndarray, rep: int, logits: _Logits,
            bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """Scores of a query block (already scaled) against keys ``kh: [B, Hkv, k, D]``, capped and biased as
    ``logits`` says, masked: -inf; and ``tanh(s / softcap)`` (the cap's derivative is ``1 - tanh**2``)."""
    s: np.ndarray = np.matmul(qt, kh.swapaxes(-1, -2))
    t = None
    if logits.softcap is not None:
        t = np.tanh(s / logits.softcap)
        s = logits.softcap * t
    if bias is not None:
        s += bias
    if not keep.all():
        b, hkv, m, k = s.shape
        np.copyto(s.reshape(b, hkv, rep, m // rep, k), -np.inf, where=~keep)  # keep: see _tile
    return s, t


def _piece_logits(softcap: float | None, alibi: bool, hq: int, hkv: int, hs: slice, op: str) -> _Logits:
    """The :class:`_Logits` of the query heads of kv heads ``hs``."""
    if softcap is not None and softcap <= 0:
        raise OpError(f"op {op!r}: softcap must be > 0, found {softcap}", op=op)
    slopes = alibi_slopes(hq).reshape(hkv, hq // hkv)[hs] if alibi else None
    return _Logits(softcap, slopes)


def _attn_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray, lse: np.ndarray, causal: bool,
                  softmax_scale: float | None, window_size: int | None, op: str,
                  segments: np.ndarray | None = None, softcap: float | None = None,
                  alibi: bool = False) -> None:
    """Attention of ``q: [B, Tq, Hq, D]`` over ``k, v: [B, Tk, Hkv, D]`` (any strides) into ``out``
    (``q``'s shape) and ``lse: [B, Hq, Tq]``, with an online softmax over key blocks."""
    rep = _group(q.shape[2], k.shape[2], op)
    _check_segments(segments, k.shape[0], q.shape[1], k.shape[1], op)

    def piece(p: tuple[slice, slice]) -> None:
        bs, hs = p
        qs = slice(hs.start * rep, hs.stop * rep)
        _attn_forward_piece(q[bs, :, qs], k[bs, :, hs], v[bs, :, hs], out[bs, :, qs], lse[bs, qs], causal,
                            softmax_scale, window_size, op, None if segments is None else segments[bs],
                            _piece_logits(softcap, alibi, q.shape[2], k.shape[2], hs, op))

    parallel(piece, _pieces(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]))


def _attn_forward_piece(q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray, lse: np.ndarray,
                        causal: bool, softmax_scale: float | None, window_size: int | None, op: str,
                        segments: np.ndarray | None, logits: _Logits) -> None:
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    rep = _group(hq, hkv, op)
    keep = _segment_keep(_keep(tq, tk, causal, window_size, op), segments, tq)
    scale = q.dtype.type(_scale(softmax_scale, d))
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, Hkv, Tk, D] views
    lse4 = view(lse, (b, hkv, rep, tq))
    for t0, t1, keys in _blocks(keep, rep, d):
        if not keys:  # no query of the tile sees a key
            out[:, t0:t1] = 0
            lse4[..., t0:t1] = np.inf
            continue
        qt = _rows(q, t0, t1, hkv, rep, scale)
        m = np.full((*qt.shape[:3], 1), -np.inf, q.dtype)
        total = np.zeros_like(m)
        acc = np.zeros_like(qt)
        for k0, k1 in keys:
            s, _ = _scores(qt, kh[:, :, k0:k1], _tile(keep, t0, t1, k0, k1), rep, logits,
                           logits.bias(tq, tk, t0, t1, k0, k1))
            m_new = np.maximum(m, np.max(s, axis=-1, keepdims=True))
            shift = np.where(np.isfinite(m_new), m_new, 0)  # rows that saw no key yet: exp(s) = 0
            s -= shift
            np.exp(s, out=s)
            alpha = np.exp(m - shift)
            total *= alpha
            total += np.sum(s, axis=-1, keepdims=True)
            acc *= alpha
            acc += np.matmul(s, vh[:, :, k0:k1])
            m = m_new
        acc /= np.where(total > 0, total, 1)
        _unrows(acc, out, t0, t1, hkv, rep)
        with np.errstate(divide="ignore"):
            found = np.where(total > 0, m + np.log(total), np.inf)
        lse4[..., t0:t1] = found.reshape(b, hkv, rep, t1 - t0)


def _attn_backward(d_out: np.ndarray | None, q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray,
                   lse: np.ndarray, d_lse: np.ndarray | None, dq: np.ndarray, dk: np.ndarray, dv: np.ndarray,
                   causal: bool, softmax_scale: float | None, window_size: int | None, op: str,
                   segments: np.ndarray | None = None, softcap: float | None = None,
                   alibi: bool = False) -> None:
    """Gradients of :func:`_attn_forward` into ``dq, dk, dv`` (shaped as q, k, v), from the saved lse:
    ``P = exp(S - lse)``, ``dS = P * (dP - rowsum(dO * O) + d_lse)`` (times ``1 - tanh**2`` through a
    softcap), block by block."""
    rep = _group(q.shape[2], k.shape[2], op)
    _check_segments(segments, k.shape[0], q.shape[1], k.shape[1], op)

    def piece(p: tuple[slice, slice]) -> None:
        bs, hs = p
        qs = slice(hs.start * rep, hs.stop * rep)
        _attn_backward_piece(None if d_out is None else d_out[bs, :, qs], q[bs, :, qs], k[bs, :, hs],
                             v[bs, :, hs], out[bs, :, qs], lse[bs, qs],
                             None if d_lse is None else d_lse[bs, qs], dq[bs, :, qs], dk[bs, :, hs],
                             dv[bs, :, hs], causal, softmax_scale, window_size, op,
                             None if segments is None else segments[bs],
                             _piece_logits(softcap, alibi, q.shape[2], k.shape[2], hs, op))

    parallel(piece, _pieces(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]))


def _attn_backward_piece(d_out: np.ndarray | None, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                         out: np.ndarray, lse: np.ndarray, d_lse: np.ndarray | None, dq: np.ndarray,
                         dk: np.ndarray, dv: np.ndarray, causal: bool, softmax_scale: float | None,
                         window_size: int | None, op: str, segments: np.ndarray | None,
                         logits: _Logits) -> None:
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    rep = _group(hq, hkv, op)
    keep = _segment_keep(_keep(tq, tk, causal, window_size, op), segments, tq)
    scale = q.dtype.type(_scale(softmax_scale, d))
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    lse4 = np.reshape(lse, (b, hkv, rep, tq))
    dlse4 = None if d_lse is None else np.reshape(d_lse, (b, hkv, rep, tq))
    dkh, dvh = np.zeros(kh.shape, q.dtype), np.zeros(vh.shape, q.dtype)
    for t0, t1, keys in _blocks(keep, rep, d):
        if not keys:
            dq[:, t0:t1] = 0
            continue
        rows = (b, hkv, rep * (t1 - t0), 1)
        qt = _rows(q, t0, t1, hkv, rep, scale)
        lse_t = lse4[..., t0:t1].reshape(rows)
        # dS = P * (dP + shift), shift = d_lse - rowsum(dO * O)
        shift = np.zeros(rows, q.dtype) if dlse4 is None else dlse4[..., t0:t1].reshape(rows)
        dot = None
        if d_out is not None:
            dot = _rows(d_out, t0, t1, hkv, rep)
            shift = shift - np.sum(dot * _rows(out, t0, t1, hkv, rep), axis=-1, keepdims=True)
        dqt = np.zeros_like(qt)
        for k0, k1 in keys:
            p, cap = _scores(qt, kh[:, :, k0:k1], _tile(keep, t0, t1, k0, k1), rep, logits,
                             logits.bias(tq, tk, t0, t1, k0, k1))
            p -= lse_t
            np.exp(p, out=p)
            if dot is not None:
                dvh[:, :, k0:k1] += np.matmul(p.swapaxes(-1, -2), dot)
                ds = np.matmul(dot, vh[:, :, k0:k1].swapaxes(-1, -2))
                ds += shift
            else:
                ds = np.broadcast_to(shift, p.shape).copy()
            ds *= p
            if cap is not None:
                ds *= 1 - cap * cap
            dqt += np.matmul(ds, kh[:, :, k0:k1])
            dkh[:, :, k0:k1] += np.matmul(ds.swapaxes(-1, -2), qt)  # qt carries the scale
        dqt *= scale
        _unrows(dqt, dq, t0, t1, hkv, rep)
    dk[...] = dkh.transpose(0, 2, 1, 3)
    dv[...] = dvh.transpose(0, 2, 1, 3)


def _check_heads(ctx: InferContext, hq: DimExpr, hkv: DimExpr) -> None:
    a, b = _const(hq), _const(hkv)
    if a is not None and b is not None and (b <= 0 or a % b):
        raise ctx.fail(f"Hq = {a} must be a multiple of Hkv = {b}")


def _attn_cost(b: int, tq: int, tk: int, hq_d: int, causal: bool, io: float, factor: float) -> Cost:
    return Cost(flops=factor * 4.0 * b * tq * tk * hq_d * (0.5 if causal else 1.0), bytes=4.0 * io)


# --- flash_attention (packed qkv) ----------------------------------------------------------------


def _flash_out(qkv: np.ndarray, segment_ids: np.ndarray | None = None, *, out: Outs, Hq: int, Hkv: int,
               D: int, causal: bool, softmax_scale: float | None, window_size: int | None,
               softcap: float | None = None, alibi: bool = False) -> None:
    b, t = qkv.shape[:2]
    o, lse = or_scratch(out, [(b, t, Hq * D), (b, Hq, t)], qkv.dtype)
    q, k, v = _split_qkv(qkv, Hq, Hkv, D, "flash_attention")
    _attn_forward(q, k, v, view(o, (b, t, Hq, D)), lse, causal, softmax_scale, window_size, "flash_attention",
                  segment_ids, softcap, alibi)


def _flash(qkv: np.ndarray, *inputs: np.ndarray | None, **attrs: Any) -> tuple[np.ndarray, ...]:
    b, t = qkv.shape[:2]
    return allocating(_flash_out, [(b, t, attrs["Hq"] * attrs["D"]), (b, attrs["Hq"], t)], qkv, *inputs,
                      **attrs)


def _check_softcap(ctx: InferContext) -> None:
    if ctx.attrs["softcap"] is not None and ctx.attrs["softcap"] <= 0:
        raise ctx.fail(f"softcap must be > 0, found {ctx.attrs['softcap']}")


def _check_segment_input(ctx: InferContext, i: int, b: DimExpr, t: DimExpr) -> None:
    if len(ctx.inputs) > i and ctx.inputs[i]:
        check_same(ctx, ctx.shape(i), (b, t), "segment_ids must be [B, Tk]")
        if not ctx.dtype(i).startswith("int"):
            raise ctx.fail(f"segment_ids must be an integer tensor, found {ctx.dtype(i)}")


def _segments(ctx: BackwardContext, i: int) -> str | None:
    """The saved segment_ids input ``i`` of the forward op, if it has one."""
    return ctx.saved(i) if len(ctx.inputs) > i and ctx.inputs[i] else None


def _flash_infer(ctx: InferContext) -> list[TensorType]:
    hq, hkv, d = (_dim(ctx, n) for n in ("Hq", "Hkv", "D"))
    x = ctx.shape(0)
    if len(x) != 3:
        raise ctx.fail(f"qkv must be [B, T, (Hq + 2 * Hkv) * D], found rank {len(x)}")
    check_same(ctx, x[2:], ((hq + 2 * hkv) * d,), "packed qkv last dim must be (Hq + 2 * Hkv) * D")
    _check_heads(ctx, hq, hkv)
    b, t = x[:2]
    _check_segment_input(ctx, 1, b, t)
    _check_softcap(ctx)
    return [TensorType((b, t, hq * d), ctx.dtype(0)), TensorType((b, hq, t), "fp32")]


def _flash_backward(ctx: BackwardContext) -> list[str | None]:
    none: list[str | None] = [None] * (len(ctx.inputs) - 1)  # segment_ids, when given, gets no gradient
    if all(d is None for d in ctx.d_outputs) or not ctx.needs_grad(0):
        return [None, *none]
    return [ctx.emit("flash_attention_backward", ctx.d_outputs[0], ctx.saved(0), ctx.saved_output(0),
                     ctx.saved_output(1), ctx.d_outputs[1], _segments(ctx, 1), **ctx.attrs), *none]


def _flash_bwd_out(d_out: np.ndarray | None, qkv: np.ndarray, o: np.ndarray, lse: np.ndarray,
                   d_lse: np.ndarray | None = None, segment_ids: np.ndarray | None = None, *, out: Outs,
                   Hq: int, Hkv: int, D: int, causal: bool, softmax_scale: float | None,
                   window_size: int | None, softcap: float | None = None, alibi: bool = False) -> None:
    op = "flash_attention_backward"
    (d_qkv,) = or_scratch(out, [qkv.shape], qkv.dtype)
    heads = (*qkv.shape[:2], Hq, D)
    q, k, v = _split_qkv(qkv, Hq, Hkv, D, op)
    dq, dk, dv = _split_qkv(d_qkv, Hq, Hkv, D, op)
    _attn_backward(None if d_out is None else d_out.reshape(heads), q, k, v, o.reshape(heads), lse, d_lse,
                   dq, dk, dv, causal, softmax_scale, window_size, op, segment_ids, softcap, alibi)


def _flash_bwd_kernel(d_out: np.ndarray | None, qkv: np.ndarray, *rest: Any, **attrs: Any) -> np.ndarray:
    return allocating(_flash_bwd_out, [qkv.shape], d_out, qkv, *rest, **attrs)[0]


def _flash_bwd_infer(ctx: InferContext) -> list[TensorType]:
    return [TensorType(ctx.shape(1), ctx.dtype(1))]


def _flash_samples(rng: np.random.Generator) -> Iterator[Sample]:
    heads = {"Hq": 2, "Hkv": 1, "D": 3}
    qkv = randn(rng, 2, 4, 12)
    yield Sample((qkv,), heads)
    yield Sample((qkv,), {**heads, "causal": False, "softmax_scale": 0.8})
    yield Sample((qkv,), {**heads, "window_size": 2})
    yield Sample((randn(rng, 1, 5, 12),), {"Hq": 1, "Hkv": 1, "D": 4, "causal": False, "window_size": 2})
    packed = np.array([[1, 1, 2, 2], [0, 0, 1, 1]])  # two documents; left padding
    yield Sample((qkv, packed), heads)
    yield Sample((qkv, packed), {**heads, "causal": False})
    # logit soft-capping and ALiBi (3 query heads: slopes beyond a power of two)
    qkv3 = randn(rng, 2, 4, 10) * 2
    heads3 = {"Hq": 3, "Hkv": 1, "D": 2}
    yield Sample((qkv3,), {**heads3, "softcap": 1.5})
    yield Sample((qkv3,), {**heads3, "alibi": True, "causal": False})
    yield Sample((qkv3, packed), {**heads3, "softcap": 0.8, "alibi": True, "window_size": 3})


def _backward_samples(forward: Any, samples: Any, n_in: int) -> Any:
    """Samples of a backward op: each forward sample with its outputs, d_out and d_lse (each optional)."""
    def make(rng: np.random.Generator) -> Iterator[Sample]:
        for s in samples(rng):
            attrs = {"causal": True, "softmax_scale": None, "window_size": None, **s.attrs}
            o, lse = forward(*s.inputs, **attrs)
            d_lse = randn(rng, *lse.shape)
            segments = s.inputs[n_in:]
            for d_out, dl in ((randn(rng, *o.shape), None), (randn(rng, *o.shape), d_lse), (None, d_lse)):
                yield Sample((d_out, *s.inputs[:n_in], o, lse, dl, *segments), s.attrs)
    return make


def _flash_cost(qkv_index: int, factor: float) -> Any:
    def cost(shapes: Sequence[tuple[int, ...]], attrs: Any) -> Cost:
        b, t, f = shapes[qkv_index]
        hq, d = attrs["Hq"], attrs["D"]
        hq_d = hq * d if isinstance(hq, int) and isinstance(d, int) else f // 3  # unbound: guess Hkv = Hq
        return _attn_cost(b, t, t, hq_d, attrs["causal"], factor * 2 * b * t * f, factor)
    return cost


# --- attention (separate q, k, v) ----------------------------------------------------------------


def _attention_out(q: np.ndarray, k: np.ndarray, v: np.ndarray, segment_ids: np.ndarray | None = None, *,
                   out: Outs, causal: bool, softmax_scale: float | None, window_size: int | None,
                   softcap: float | None = None, alibi: bool = False) -> None:
    o, lse = or_scratch(out, [q.shape, (q.shape[0], q.shape[2], q.shape[1])], q.dtype)
    _attn_forward(q, k, v, o, lse, causal, softmax_scale, window_size, "attention", segment_ids, softcap,
                  alibi)


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, *inputs: np.ndarray | None,
               **attrs: Any) -> tuple[np.ndarray, ...]:
    return allocating(_attention_out, [q.shape, (q.shape[0], q.shape[2], q.shape[1])], q, k, v, *inputs,
                      **attrs)


def _attention_infer(ctx: InferContext) -> list[TensorType]:
    q, k = ctx.shape(0), ctx.shape(1)
    if len(q) != 4 or len(k) != 4:
        raise ctx.fail(f"q, k, v must be [B, T, H, D], found ranks {len(q)} and {len(k)}")
    check_same(ctx, ctx.shape(2), k, "k and v differ")
    check_same(ctx, (q[0], q[3]), (k[0], k[3]), "q and k differ in batch or head dim")
    _check_heads(ctx, q[2], k[2])
    _check_segment_input(ctx, 3, k[0], k[1])
    more = simplify(parse_dim(q[1]) - parse_dim(k[1]))  # a constant once the lengths are bound
    if len(ctx.inputs) > 3 and ctx.inputs[3] and isinstance(more, Const) and more.value > 0:
        raise ctx.fail(_MORE_QUERIES.format(tq=q[1], tk=k[1]))
    _check_softcap(ctx)
    return [TensorType(q, ctx.dtype(0)), TensorType((q[0], q[2], q[1]), "fp32")]


def _attention_backward(ctx: BackwardContext) -> list[str | None]:
    none: list[str | None] = [None] * (len(ctx.inputs) - 3)  # segment_ids, when given, gets no gradient
    if all(d is None for d in ctx.d_outputs) or not any(ctx.needs_grad(i) for i in range(3)):
        return [None] * 3 + none
    grads = ctx.emit("attention_backward", ctx.d_outputs[0], *(ctx.saved(i) for i in range(3)),
                     ctx.saved_output(0), ctx.saved_output(1), ctx.d_outputs[1], _segments(ctx, 3),
                     **ctx.attrs)
    return [g if ctx.needs_grad(i) else None for i, g in enumerate(grads)] + none


def _attention_bwd_out(d_out: np.ndarray | None, q: np.ndarray, k: np.ndarray, v: np.ndarray, o: np.ndarray,
                       lse: np.ndarray, d_lse: np.ndarray | None = None,
                       segment_ids: np.ndarray | None = None, *, out: Outs, causal: bool,
                       softmax_scale: float | None, window_size: int | None, softcap: float | None = None,
                       alibi: bool = False) -> None:
    dq, dk, dv = or_scratch(out, [q.shape, k.shape, v.shape], q.dtype)
    _attn_backward(d_out, q, k, v, o, lse, d_lse, dq, dk, dv, causal, softmax_scale, window_size,
                   "attention_backward", segment_ids, softcap, alibi)


def _attention_bwd_kernel(d_out: np.ndarray | None, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                          *rest: Any, **attrs: Any) -> tuple[np.ndarray, ...]:
    return allocating(_attention_bwd_out, [q.shape, k.shape, v.shape], d_out, q, k, v, *rest, **attrs)


def _attention_bwd_infer(ctx: InferContext) -> list[TensorType]:
    return [TensorType(ctx.shape(i), ctx.dtype(i)) for i in (1, 2, 3)]


def _attention_samples(rng: np.random.Generator) -> Iterator[Sample]:
    q, k, v = randn(rng, 1, 4, 2, 3), randn(rng, 1, 4, 1, 3), randn(rng, 1, 4, 1, 3)
    yield Sample((q, k, v), {})
    yield Sample((q, k, v), {"causal": False, "window_size": 2, "softmax_scale": 0.7})
    yield Sample((randn(rng, 2, 3, 2, 2), randn(rng, 2, 5, 2, 2), randn(rng, 2, 5, 2, 2)), {"window_size": 3})
    # segments (Tq < Tk: queries sit at the last Tq key positions)
    yield Sample((randn(rng, 2, 3, 2, 2), randn(rng, 2, 5, 2, 2), randn(rng, 2, 5, 2, 2),
                  np.array([[0, 1, 1, 2, 2], [1, 1, 1, 1, 1]])), {})
    # logit soft-capping and ALiBi (3 query heads: slopes beyond a power of two), with segments
    q3, kv3 = randn(rng, 1, 4, 3, 2) * 2, (randn(rng, 1, 4, 3, 2) * 2, randn(rng, 1, 4, 3, 2))
    yield Sample((q3, *kv3), {"softcap": 1.5})
    yield Sample((q3, *kv3), {"alibi": True, "causal": False})
    yield Sample((q3, *kv3, np.array([[1, 1, 2, 2]])), {"softcap": 0.8, "alibi": True, "window_size": 3})


def _attention_bwd_samples(rng: np.random.Generator) -> Iterator[Sample]:
    yield from _attention_samples(rng)
    # queries 0 and 1 see no key (lse = inf): no finite-difference check can take this one
    yield Sample((randn(rng, 1, 4, 2, 2), randn(rng, 1, 2, 1, 2), randn(rng, 1, 2, 1, 2)), {})


def _attention_cost(q_index: int, factor: float) -> Any:
    def cost(shapes: Sequence[tuple[int, ...]], attrs: Any) -> Cost:
        q, k = shapes[q_index], shapes[q_index + 1]
        io = 2 * np.prod(q) + 2 * np.prod(k)
        return _attn_cost(q[0], q[1], k[1], q[2] * q[3], attrs["causal"], factor * io, factor)
    return cost


CORE_OPS = [
    core_op(
        "rope", ("x", "freqs?", "position_ids"), ("out",), _rope, _rope_infer, backward=_rope_backward,
        attrs=(AttrSpec("head_dim", "dim"), *_ROPE_ATTRS, AttrSpec("inverse", "bool", False)),
        samples=_rope_samples, cost=_rope_cost, nondiff_inputs={1, 2}, out_kernel=_rope_out, inplace={0},
        doc="Rotary position embedding (HF rotate_half) of every head of x: [B, T, H * head_dim]; "
            "inverse=True rotates back.",
    ),
    core_op(
        "qkv_qk_norm_rope", ("qkv", "q_norm_weight?", "k_norm_weight?", "freqs?", "position_ids"),
        ("qkv_out", "q_rstd", "k_rstd"), _qkv_norm_rope, _qkv_infer, backward=_qkv_backward,
        attrs=(*_HEADS, AttrSpec("eps", "float", 1e-6), *_ROPE_ATTRS), samples=_qkv_samples, cost=_qkv_cost,
        nondiff_inputs={3, 4}, out_kernel=_qkv_out,
        statistics={"q_rstd", "k_rstd"},
        doc="Per-head RMSNorm of q and k (each only when its weight is given; its rstd is ones otherwise), "
            "then rope on q and k of packed qkv; v passes through.",
    ),
    core_op(
        "qkv_qk_norm_rope_backward",
        ("d_qkv_out?", "qkv", "q_norm_weight?", "k_norm_weight?", "freqs?", "position_ids", "q_rstd",
         "k_rstd", "d_q_rstd?", "d_k_rstd?"),
        ("d_qkv", "d_q_norm_weight", "d_k_norm_weight"), _qkv_bwd_kernel, _qkv_bwd_infer,
        attrs=(*_HEADS, AttrSpec("eps", "float", 1e-6), *_ROPE_ATTRS), cost=lambda s, a: _qkv_cost(s[1:], a),
        out_kernel=_qkv_bwd_out, samples=_qkv_bwd_samples,
        statistics={"q_rstd", "k_rstd", "d_q_rstd", "d_k_rstd"},
        doc="Gradients of qkv_qk_norm_rope (a weight's gradient is zeros when that weight was omitted).",
    ),
    core_op(
        "flash_attention", ("qkv", "segment_ids?"), ("out", "lse"), _flash, _flash_infer,
        backward=_flash_backward, attrs=(*_HEADS, *_ATTN_ATTRS, *_SCORE_ATTRS), samples=_flash_samples,
        cost=_flash_cost(0, 1.0), out_kernel=_flash_out, nondiff_inputs={1},
        flop_heavy=True,
        statistics={"lse"},
        doc="Softmax attention on packed qkv [B, T, (Hq + 2 * Hkv) * D] (GQA, causal, sliding window, "
            "segments: packed documents and padding; softcap and alibi as attention's): out [B, T, Hq * D] "
            "and lse [B, Hq, T].",
    ),
    core_op(
        "flash_attention_backward", ("d_out?", "qkv", "out", "lse", "d_lse?", "segment_ids?"), ("d_qkv",),
        _flash_bwd_kernel,
        _flash_bwd_infer, attrs=(*_HEADS, *_ATTN_ATTRS, *_SCORE_ATTRS), cost=_flash_cost(1, 2.5),
        out_kernel=_flash_bwd_out,
        samples=_backward_samples(_flash, _flash_samples, 1),
        statistics={"lse", "d_lse"},
        doc="Gradient of flash_attention from the saved lse: dS = P * (dP - rowsum(dO * O) + d_lse).",
    ),
    core_op(
        "attention", ("q", "k", "v", "segment_ids?"), ("out", "lse"), _attention, _attention_infer,
        backward=_attention_backward, attrs=(*_ATTN_ATTRS, *_SCORE_ATTRS), samples=_attention_samples,
        cost=_attention_cost(0, 1.0), out_kernel=_attention_out, nondiff_inputs={3},
        flop_heavy=True,
        statistics={"lse"},
        doc="Softmax attention on q [B, Tq, Hq, D], k and v [B, Tk, Hkv, D]: out [B, Tq, Hq, D] and "
            "lse [B, Hq, Tq]; softcap caps the logits (c * tanh(s / c)), alibi adds -slope_h * |p - j|.",
    ),
    core_op(
        "attention_backward", ("d_out?", "q", "k", "v", "out", "lse", "d_lse?", "segment_ids?"),
        ("d_q", "d_k", "d_v"),
        _attention_bwd_kernel, _attention_bwd_infer, attrs=(*_ATTN_ATTRS, *_SCORE_ATTRS),
        cost=_attention_cost(1, 2.5),
        out_kernel=_attention_bwd_out, samples=_backward_samples(_attention, _attention_bwd_samples, 3),
        statistics={"lse", "d_lse"},
        doc="Gradients of attention from the saved lse (same math as flash_attention_backward).",
    ),
]

OPS = [c.opdef for c in CORE_OPS]
