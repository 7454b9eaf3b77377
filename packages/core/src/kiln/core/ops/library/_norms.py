"""Normalization: rmsnorm, fused_residual_rmsnorm, layernorm, their backward ops and the
recompute-only ``*_apply_saved`` variants that reuse a saved rstd.

Conventions follow HuggingFace (``LlamaRMSNorm``, ``nn.LayerNorm``): statistics over the last dim,
``rstd = 1 / sqrt(mean + eps)``, ``y = (x * rstd) * weight``. The statistic outputs (rstd, mean)
are differentiable too, so a backward op takes their gradients as optional inputs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kiln.core._threads import parallel, parallel_sum, row_blocks
from kiln.core.ir._ir import TensorType
from kiln.core.ops._ops import AttrSpec, BackwardContext, Cost, InferContext, Sample
from kiln.core.ops.library._common import Outs, check_same, core_op, or_scratch, randn, view

_EPS_RMS = (AttrSpec("eps", "float", 1e-6),)
_EPS_LN = (AttrSpec("eps", "float", 1e-5),)


def normalize(x: np.ndarray, rstd: np.ndarray, weight: np.ndarray,
              out: np.ndarray | None = None) -> np.ndarray:
    """``(x * rstd) * weight``: the one place forward and apply_saved compute y, so they agree bitwise."""
    y: np.ndarray = np.multiply(x, rstd[..., None], out=out)
    y *= weight
    return y


def rms_rstd(x: np.ndarray, eps: float) -> np.ndarray:
    rstd: np.ndarray = 1 / np.sqrt(np.mean(x * x, axis=-1) + x.dtype.type(eps))
    return rstd


def rows(a: np.ndarray) -> np.ndarray:
    """``a`` as rows ``[-1, last dim]`` (a view when ``a`` is contiguous, as outputs are)."""
    return a.reshape(-1, a.shape[-1])


def out_rows(a: np.ndarray) -> np.ndarray:
    """An output as rows: always a view, so that writing it writes ``a``."""
    return view(a, (-1, a.shape[-1])) if a.size else a.reshape(-1, a.shape[-1])


def rmsnorm_grad_into(d_y: np.ndarray | None, x: np.ndarray, rstd: np.ndarray, weight: np.ndarray,
                      d_rstd: np.ndarray | None, d_x: np.ndarray, d_w: np.ndarray | None,
                      d_extra: np.ndarray | None = None) -> None:
    """(d_x, d_weight) of y = x * rstd * weight, rstd = (mean(x^2) + eps)^-1/2, written into ``d_x`` and
    ``d_w``; ``d_extra`` (a residual's gradient) is added to d_x. ``d_x`` may be ``d_y`` itself.
    Blocks of rows run on the backend's threads; d_weight sums their parts in order."""
    c = x.shape[-1]
    opt = [None if a is None else rows(a) for a in (d_y, d_extra)]
    x2, r1, dx2 = rows(x), rstd.reshape(-1), out_rows(d_x)
    dr1 = None if d_rstd is None else d_rstd.reshape(-1)

    def block(b: slice, part: np.ndarray | None) -> None:
        d_y_b, extra_b = (None if a is None else a[b] for a in opt)
        rmsnorm_grad_rows(d_y_b, x2[b], r1[b], weight, None if dr1 is None else dr1[b], dx2[b], part, extra_b)

    blocks = row_blocks(x2.shape[0], c)
    if d_w is None:
        parallel(lambda b: block(b, None), blocks)
    else:
        parallel_sum(block, blocks, d_w)


def rmsnorm_grad_rows(d_y: np.ndarray | None, x: np.ndarray, rstd: np.ndarray, weight: np.ndarray,
                       d_rstd: np.ndarray | None, d_x: np.ndarray, d_w: np.ndarray | None,
                       d_extra: np.ndarray | None = None) -> None:
    """:func:`rmsnorm_grad_into` on the calling thread (any rank; d_weight sums over all leading dims)."""
    r = rstd[..., None]
    if d_y is None:
        d_x[...] = 0
        if d_w is not None:
            d_w[...] = 0
    else:
        xhat = x * r
        work = d_y * xhat
        if d_w is not None:
            np.sum(work, axis=tuple(range(x.ndim - 1)), out=d_w)
        np.multiply(d_y, weight, out=d_x)  # g = d_y * weight; d_y is not read again
        np.multiply(d_x, xhat, out=work)
        xhat *= np.mean(work, axis=-1, keepdims=True)
        d_x -= xhat
        d_x *= r  # d_x = rstd * (g - xhat * mean(g * xhat))
    if d_rstd is not None:  # d rstd / d x = -rstd^3 x / C
        d_x -= d_rstd[..., None] * r ** 3 * x / x.shape[-1]
    if d_extra is not None:
        d_x += d_extra


def rmsnorm_grad(d_y: np.ndarray | None, x: np.ndarray, rstd: np.ndarray, weight: np.ndarray,
                 d_rstd: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(d_x, d_weight) of y = x * rstd * weight, rstd = (mean(x^2) + eps)^-1/2."""
    d_x, d_w = np.empty_like(x), np.empty_like(weight)
    rmsnorm_grad_into(d_y, x, rstd, weight, d_rstd, d_x, d_w)
    return d_x, d_w


def _check_norm(ctx: InferContext, x: int, w: int) -> None:
    if len(ctx.shape(x)) < 1:
        raise ctx.fail("the normalized input needs rank >= 1")
    check_same(ctx, ctx.shape(w), ctx.shape(x)[-1:], "weight must match the last dim")


def _stat(ctx: InferContext, i: int) -> TensorType:
    return TensorType(ctx.shape(i)[:-1], "fp32")


def _like(ctx: InferContext, i: int) -> TensorType:
    return TensorType(ctx.shape(i), ctx.dtype(i))


def _numel(s: Sequence[int]) -> float:
    return float(np.prod(s))


# --- rmsnorm -------------------------------------------------------------------------------------


def _rmsnorm(x: np.ndarray, weight: np.ndarray, *, eps: float) -> tuple[np.ndarray, np.ndarray]:
    rstd = rms_rstd(x, eps)
    return normalize(x, rstd, weight), rstd


def _rmsnorm_out(x: np.ndarray, weight: np.ndarray, *, out: Outs, eps: float) -> None:
    y, rstd = or_scratch(out, [x.shape, x.shape[:-1]], x.dtype)
    x2, y2, r1 = rows(x), out_rows(y), rstd.reshape(-1)

    def block(b: slice) -> None:
        r1[b] = rms_rstd(x2[b], eps)
        normalize(x2[b], r1[b], weight, out=y2[b])

    parallel(block, row_blocks(*x2.shape))


def _rmsnorm_infer(ctx: InferContext) -> list[TensorType]:
    _check_norm(ctx, 0, 1)
    return [_like(ctx, 0), _stat(ctx, 0)]


def _rmsnorm_backward(ctx: BackwardContext) -> list[str | None]:
    d_y, d_rstd = ctx.d_outputs
    if (d_y is None and d_rstd is None) or not (ctx.needs_grad(0) or ctx.needs_grad(1)):
        return [None, None]
    d_x, d_w = ctx.emit("rmsnorm_backward", d_y, ctx.saved(0), ctx.saved_output(1), ctx.saved(1), d_rstd)
    return [d_x if ctx.needs_grad(0) else None, d_w if ctx.needs_grad(1) else None]


def _rmsnorm_bwd_kernel(d_y: np.ndarray | None, x: np.ndarray, rstd: np.ndarray, weight: np.ndarray,
                        d_rstd: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    return rmsnorm_grad(d_y, x, rstd, weight, d_rstd)


def _rmsnorm_bwd_out(d_y: np.ndarray | None, x: np.ndarray, rstd: np.ndarray, weight: np.ndarray,
                     d_rstd: np.ndarray | None = None, *, out: Outs) -> None:
    d_x, d_w = or_scratch(out, [x.shape, weight.shape], x.dtype)
    rmsnorm_grad_into(d_y, x, rstd, weight, d_rstd, d_x, d_w)


def _rmsnorm_bwd_infer(ctx: InferContext) -> list[TensorType]:
    _check_norm(ctx, 1, 3)
    return [_like(ctx, 1), _like(ctx, 3)]


def _rms_samples(rng: np.random.Generator) -> Iterator[Sample]:
    yield Sample((randn(rng, 2, 3, 5), randn(rng, 5)), {})
    yield Sample((randn(rng, 4, 6), randn(rng, 6)), {"eps": 0.3})


def _rms_cost(shapes: Sequence[tuple[int, ...]], attrs: Any) -> Cost:
    n = _numel(shapes[0])
    return Cost(flops=4.0 * n, bytes=4.0 * (2 * n + shapes[0][-1]))


# --- qk_norm: rmsnorm of q and of k, each over its head dim --------------------------------------


def _qk_norm(q: np.ndarray, k: np.ndarray, q_weight: np.ndarray, k_weight: np.ndarray, *,
             eps: float) -> tuple[np.ndarray, ...]:
    (q_norm, q_rstd), (k_norm, k_rstd) = _rmsnorm(q, q_weight, eps=eps), _rmsnorm(k, k_weight, eps=eps)
    return q_norm, k_norm, q_rstd, k_rstd


def _qk_norm_infer(ctx: InferContext) -> list[TensorType]:
    _check_norm(ctx, 0, 2)
    _check_norm(ctx, 1, 3)
    if len(ctx.shape(0)) != len(ctx.shape(1)):
        raise ctx.fail(f"q and k differ in rank: [{', '.join(map(str, ctx.shape(0)))}] vs "
                       f"[{', '.join(map(str, ctx.shape(1)))}]")
    return [_like(ctx, 0), _like(ctx, 1), _stat(ctx, 0), _stat(ctx, 1)]


def _qk_norm_backward(ctx: BackwardContext) -> list[str | None]:
    grads: list[str | None] = [None] * 4
    for x, w in ((0, 2), (1, 3)):  # q with q_weight, k with k_weight: two independent rmsnorms
        d_y, d_rstd = ctx.d_outputs[x], ctx.d_outputs[x + 2]
        if (d_y is None and d_rstd is None) or not (ctx.needs_grad(x) or ctx.needs_grad(w)):
            continue
        d_x, d_w = ctx.emit("rmsnorm_backward", d_y, ctx.saved(x), ctx.saved_output(x + 2), ctx.saved(w),
                            d_rstd)
        grads[x] = d_x if ctx.needs_grad(x) else None
        grads[w] = d_w if ctx.needs_grad(w) else None
    return grads


def _qk_norm_samples(rng: np.random.Generator) -> Iterator[Sample]:
    yield Sample((randn(rng, 2, 4, 3, 5), randn(rng, 2, 2, 3, 5), randn(rng, 5), randn(rng, 5)), {})
    yield Sample((randn(rng, 3, 6), randn(rng, 2, 6), randn(rng, 6), randn(rng, 6)), {"eps": 0.3})


# --- fused residual + rmsnorm --------------------------------------------------------------------


def _fused(residual: np.ndarray, x: np.ndarray, weight: np.ndarray, *,
           eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    res = residual + x
    rstd = rms_rstd(res, eps)
    return res, normalize(res, rstd, weight), rstd


def _fused_out(residual: np.ndarray, x: np.ndarray, weight: np.ndarray, *, out: Outs, eps: float) -> None:
    res, y, rstd = or_scratch(out, [x.shape, x.shape, x.shape[:-1]], x.dtype)
    a2, x2, res2, y2, r1 = rows(residual), rows(x), out_rows(res), out_rows(y), rstd.reshape(-1)

    def block(b: slice) -> None:
        np.add(a2[b], x2[b], out=res2[b])  # res may be residual's own storage
        r1[b] = rms_rstd(res2[b], eps)
        normalize(res2[b], r1[b], weight, out=y2[b])

    parallel(block, row_blocks(*x2.shape))


def _fused_infer(ctx: InferContext) -> list[TensorType]:
    check_same(ctx, ctx.shape(0), ctx.shape(1), "residual and input differ")
    _check_norm(ctx, 0, 2)
    return [_like(ctx, 0), _like(ctx, 0), _stat(ctx, 0)]


def _fused_backward(ctx: BackwardContext) -> list[str | None]:
    d_res, d_y, d_rstd = ctx.d_outputs
    if all(d is None for d in ctx.d_outputs) or not any(ctx.needs_grad(i) for i in range(3)):
        return [None, None, None]
    d_residual, d_x, d_w = ctx.emit("fused_residual_rmsnorm_backward", d_y, d_res, ctx.saved_output(0),
                                    ctx.saved_output(2), ctx.saved(2), d_rstd)
    return [d_residual if ctx.needs_grad(0) else None, d_x if ctx.needs_grad(1) else None,
            d_w if ctx.needs_grad(2) else None]


def _fused_bwd_kernel(d_y: np.ndarray | None, d_residual_out: np.ndarray | None, residual_out: np.ndarray,
                      rstd: np.ndarray, weight: np.ndarray,
                      d_rstd: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d_residual, d_x, d_w = (np.empty_like(a) for a in (residual_out, residual_out, weight))
    _fused_bwd_out(d_y, d_residual_out, residual_out, rstd, weight, d_rstd, out=(d_residual, d_x, d_w))
    return d_residual, d_x, d_w


def _fused_bwd_out(d_y: np.ndarray | None, d_residual_out: np.ndarray | None, residual_out: np.ndarray,
                   rstd: np.ndarray, weight: np.ndarray, d_rstd: np.ndarray | None = None, *,
                   out: Outs) -> None:
    d_residual, d_x, d_w = out
    first = d_residual if d_residual is not None else d_x if d_x is not None else np.empty_like(residual_out)
    rmsnorm_grad_into(d_y, residual_out, rstd, weight, d_rstd, first, d_w, d_residual_out)
    if d_residual is not None and d_x is not None:
        np.copyto(d_x, d_residual)


def _fused_bwd_infer(ctx: InferContext) -> list[TensorType]:
    _check_norm(ctx, 2, 4)
    return [_like(ctx, 2), _like(ctx, 2), _like(ctx, 4)]


def _fused_samples(rng: np.random.Generator) -> Iterator[Sample]:
    yield Sample((randn(rng, 2, 3, 5), randn(rng, 2, 3, 5), randn(rng, 5)), {})
    yield Sample((randn(rng, 4, 6), randn(rng, 4, 6), randn(rng, 6)), {"eps": 0.1})


def _rms_bwd_samples(rng: np.random.Generator) -> Iterator[Sample]:
    x, w = randn(rng, 2, 3, 5), randn(rng, 5)
    rstd = _rmsnorm(x, w, eps=1e-6)[1]
    yield Sample((randn(rng, 2, 3, 5), x, rstd, w, None))
    yield Sample((randn(rng, 2, 3, 5), x, rstd, w, randn(rng, 2, 3)))
    yield Sample((None, x, rstd, w, randn(rng, 2, 3)))


def _fused_bwd_samples(rng: np.random.Generator) -> Iterator[Sample]:
    for s in _rms_bwd_samples(rng):
        d_y, x, rstd, w, d_rstd = s.inputs
        yield Sample((d_y, randn(rng, 2, 3, 5), x, rstd, w, d_rstd))
        yield Sample((d_y, None, x, rstd, w, d_rstd))


# --- apply_saved (recompute only) ----------------------------------------------------------------


def _rms_apply_saved(x: np.ndarray, rstd: np.ndarray, weight: np.ndarray) -> np.ndarray:
    return normalize(x, rstd, weight)


def _rms_apply_saved_out(x: np.ndarray, rstd: np.ndarray, weight: np.ndarray, *, out: Outs) -> None:
    normalize(x, rstd, weight, out=out[0])


def _rms_apply_saved_infer(ctx: InferContext) -> list[TensorType]:
    _check_norm(ctx, 0, 2)
    check_same(ctx, ctx.shape(1), ctx.shape(0)[:-1], "rstd must be x's shape without its last dim")
    return [_like(ctx, 0)]


def _fused_apply_saved(residual: np.ndarray, x: np.ndarray, rstd: np.ndarray,
                       weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    res = residual + x
    return res, normalize(res, rstd, weight)


def _fused_apply_saved_out(residual: np.ndarray, x: np.ndarray, rstd: np.ndarray, weight: np.ndarray, *,
                           out: Outs) -> None:
    res, y = or_scratch(out, [x.shape, x.shape], x.dtype)
    np.add(residual, x, out=res)
    normalize(res, rstd, weight, out=y)


def _fused_apply_saved_infer(ctx: InferContext) -> list[TensorType]:
    check_same(ctx, ctx.shape(0), ctx.shape(1), "residual and input differ")
    _check_norm(ctx, 0, 3)
    check_same(ctx, ctx.shape(2), ctx.shape(0)[:-1], "rstd must be x's shape without its last dim")
    return [_like(ctx, 0), _like(ctx, 0)]


# --- layernorm -----------------------------------------------------------------------------------


def _layernorm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None, *,
               eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    mean = np.mean(x, axis=-1)
    xc = x - mean[..., None]
    rstd = 1 / np.sqrt(np.mean(xc * xc, axis=-1) + x.dtype.type(eps))  # biased variance, as torch
    y = normalize(xc, rstd, weight)
    return (y if bias is None else y + bias), mean, rstd


def _layernorm_infer(ctx: InferContext) -> list[TensorType]:
    _check_norm(ctx, 0, 1)
    if len(ctx.inputs) > 2 and ctx.inputs[2] is not None:
        check_same(ctx, ctx.shape(2), ctx.shape(0)[-1:], "bias must match the last dim")
    return [_like(ctx, 0), _stat(ctx, 0), _stat(ctx, 0)]


def _layernorm_backward(ctx: BackwardContext) -> list[str | None]:
    has_bias = len(ctx.inputs) > 2 and bool(ctx.inputs[2])
    n = 3 if len(ctx.inputs) > 2 else 2
    if all(d is None for d in ctx.d_outputs) or not any(ctx.needs_grad(i) for i in range(n)):
        return [None] * len(ctx.inputs)
    d_y, d_mean, d_rstd = ctx.d_outputs
    d_x, d_w, d_b = ctx.emit("layernorm_backward", d_y, ctx.saved(0), ctx.saved_output(1),
                             ctx.saved_output(2), ctx.saved(1), d_mean, d_rstd)
    grads = [d_x if ctx.needs_grad(0) else None, d_w if ctx.needs_grad(1) else None]
    if len(ctx.inputs) > 2:
        grads.append(d_b if has_bias and ctx.needs_grad(2) else None)
    return grads


def _layernorm_bwd_kernel(d_y: np.ndarray | None, x: np.ndarray, mean: np.ndarray, rstd: np.ndarray,
                          weight: np.ndarray, d_mean: np.ndarray | None = None,
                          d_rstd: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r = rstd[..., None]
    xc = x - mean[..., None]
    xhat = xc * r
    batch = tuple(range(x.ndim - 1))
    d_x, d_w, d_b = np.zeros_like(x), np.zeros_like(weight), np.zeros_like(weight)
    if d_y is not None:
        g = d_y * weight
        d_x = r * (g - np.mean(g, axis=-1, keepdims=True) - xhat * np.mean(g * xhat, axis=-1, keepdims=True))
        d_w, d_b = np.sum(d_y * xhat, axis=batch), np.sum(d_y, axis=batch)
    if d_mean is not None:
        d_x = d_x + d_mean[..., None] / x.shape[-1]
    if d_rstd is not None:  # d rstd / d x = -rstd^3 (x - mean) / C (the mean's own term sums to 0)
        d_x = d_x - d_rstd[..., None] * r ** 3 * xc / x.shape[-1]
    return d_x, d_w, d_b


def _layernorm_bwd_infer(ctx: InferContext) -> list[TensorType]:
    _check_norm(ctx, 1, 4)
    return [_like(ctx, 1), _like(ctx, 4), _like(ctx, 4)]


def _ln_samples(rng: np.random.Generator) -> Iterator[Sample]:
    yield Sample((randn(rng, 2, 3, 5), randn(rng, 5), randn(rng, 5)), {})
    yield Sample((randn(rng, 4, 6), randn(rng, 6), None), {"eps": 0.2})


CORE_OPS = [
    core_op(
        "rmsnorm", ("x", "weight"), ("y", "rstd"), _rmsnorm, _rmsnorm_infer, backward=_rmsnorm_backward,
        attrs=_EPS_RMS, samples=_rms_samples, cost=_rms_cost, out_kernel=_rmsnorm_out,
        autocast="fp32",
        statistics={"rstd"},
        doc="rstd = 1/sqrt(mean(x^2, last dim) + eps); y = x * rstd * weight.",
    ),
    core_op(
        "rmsnorm_backward", ("d_y?", "x", "rstd", "weight", "d_rstd?"), ("d_x", "d_weight"),
        _rmsnorm_bwd_kernel, _rmsnorm_bwd_infer, cost=lambda s, a: _rms_cost(s[1:], a),
        out_kernel=_rmsnorm_bwd_out, samples=_rms_bwd_samples,
        autocast="fp32",
        statistics={"rstd", "d_rstd"},
        doc="Gradients of rmsnorm from d_y and (optionally) d_rstd; d_weight sums over all leading dims.",
    ),
    core_op(
        "qk_norm", ("q", "k", "q_weight", "k_weight"), ("q_norm", "k_norm", "q_rstd", "k_rstd"), _qk_norm,
        _qk_norm_infer, backward=_qk_norm_backward, attrs=_EPS_RMS, samples=_qk_norm_samples,
        cost=lambda s, a: Cost(flops=_rms_cost(s[:1], a).flops + _rms_cost(s[1:2], a).flops,
                               bytes=_rms_cost(s[:1], a).bytes + _rms_cost(s[1:2], a).bytes),
        autocast="fp32",
        statistics={"q_rstd", "k_rstd"},
        doc="(q_norm, q_rstd) = rmsnorm(q, q_weight) and (k_norm, k_rstd) = rmsnorm(k, k_weight), each over "
            "the last (head) dim; q and k have one rank (heads may differ), rstd drops the last dim.",
    ),
    core_op(
        "fused_residual_rmsnorm", ("residual", "x", "weight"), ("residual_out", "y", "rstd"), _fused,
        _fused_infer, backward=_fused_backward, attrs=_EPS_RMS, samples=_fused_samples, cost=_rms_cost,
        out_kernel=_fused_out, inplace={0, 1},
        variants=(("rmsnorm_apply_saved", {"x": "residual_out", "rstd": "rstd", "weight": "weight"},
                   {"y": "y"}),),
        autocast="fp32",
        statistics={"rstd"},
        doc="residual_out = residual + x; (y, rstd) = rmsnorm(residual_out, weight).",
    ),
    core_op(
        "fused_residual_rmsnorm_backward",
        ("d_y?", "d_residual_out?", "residual_out", "rstd", "weight", "d_rstd?"),
        ("d_residual", "d_x", "d_weight"), _fused_bwd_kernel, _fused_bwd_infer,
        cost=lambda s, a: _rms_cost(s[2:], a), out_kernel=_fused_bwd_out, samples=_fused_bwd_samples,
        autocast="fp32",
        statistics={"rstd", "d_rstd"},
        doc="Gradients of fused_residual_rmsnorm; d_residual and d_x are equal (both = d_residual_out + "
            "the norm's d_input).",
    ),
    core_op(
        "rmsnorm_apply_saved", ("x", "rstd", "weight"), ("y",), _rms_apply_saved, _rms_apply_saved_infer,
        cost=_rms_cost, out_kernel=_rms_apply_saved_out, inplace={0},
        samples=lambda rng: [Sample((randn(rng, 2, 3, 5), rng.random((2, 3)) + 0.5, randn(rng, 5)))],
        autocast="fp32",
        statistics={"rstd"},
        doc="y = x * rstd * weight with a saved rstd (recompute; bitwise equal to rmsnorm).",
    ),
    core_op(
        "fused_residual_rmsnorm_apply_saved", ("residual", "x", "rstd", "weight"), ("residual_out", "y"),
        _fused_apply_saved, _fused_apply_saved_infer, cost=_rms_cost, out_kernel=_fused_apply_saved_out,
        inplace={0, 1}, samples=lambda rng: [Sample((randn(rng, 2, 3, 5), randn(rng, 2, 3, 5),
                                                     rng.random((2, 3)) + 0.5, randn(rng, 5)))],
        autocast="fp32",
        statistics={"rstd"},
        doc="fused_residual_rmsnorm with a saved rstd (recompute; bitwise equal outputs).",
    ),
    core_op(
        "layernorm", ("x", "weight", "bias?"), ("y", "mean", "rstd"), _layernorm, _layernorm_infer,
        backward=_layernorm_backward, attrs=_EPS_LN, samples=_ln_samples, cost=_rms_cost,
        autocast="fp32",
        statistics={"mean", "rstd"},
        doc="y = (x - mean) * rstd * weight + bias over the last dim, rstd = 1/sqrt(biased var + eps).",
    ),
    core_op(
        "layernorm_backward", ("d_y?", "x", "mean", "rstd", "weight", "d_mean?", "d_rstd?"),
        ("d_x", "d_weight", "d_bias"), _layernorm_bwd_kernel, _layernorm_bwd_infer,
        cost=lambda s, a: _rms_cost(s[1:], a),
        autocast="fp32",
        statistics={"mean", "rstd", "d_mean", "d_rstd"},
        doc="Gradients of layernorm from d_y and optional d_mean, d_rstd (d_bias = sum of d_y).",
    ),
]

OPS = [c.opdef for c in CORE_OPS]
