"""The ``bf16`` precision recipe on the NumPy backend: bfloat16 emulated with ml_dtypes.

Every kernel still computes in float32. A step of a Program that follows a low-precision recipe
reads bfloat16 tensors as float32 (exact), rounds the float inputs of a ``lower`` op (a matmul,
attention) to bfloat16 first, and rounds each output the Program lists in ``rounded`` to bfloat16
when it writes it: the rounding points of :mod:`kiln.core.plan._precision`, where torch's autocast
has them. A step an ``@precision``/``@dtype`` annotation overrides (``Program.computes``) rounds its
inputs when it computes in bf16 and reads them as fp32 when it computes in fp32. Either way the op's
float32 statistics (``OpDef.statistics``: attention's ``lse``, a norm's ``rstd``, the LM head's ``lse``
and loss cotangent) are read as they are stored, as torch's SDPA backward reads its float32
logsumexp and as kiln.cuda's bf16 kernels read them (``kiln.core.plan._precision.rounded_reads``).
The rounding is ml_dtypes' float32 -> bfloat16 cast (round to nearest, ties to even).

The LM head's fused loss needs two points inside the op (its logits are bfloat16, and so is their
gradient before the two products of its backward): its bfloat16 kernels below hold them, as
``fused_lm_head_loss@numpy:bfloat16``. They build the whole ``[N, V]`` block of logits: the
emulation is there for the semantics, not the speed (nor is the rest, which converts each step's
bfloat16 inputs and outputs through float32 temporaries).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kiln.core._errors import KilnError
from kiln.core.ops._ops import OpDef
from kiln.core.ops.library._loss import _cross_entropy, _cross_entropy_backward
from kiln.core.plan._precision import LOWER, Precision, require_ml_dtypes, rounded_reads
from kiln.core.plan._program import Program, Step

Arrays = Sequence[np.ndarray | None]


def to_bf16(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to bfloat16 (nearest, ties to even), as float32."""
    ml_dtypes = require_ml_dtypes()
    out: np.ndarray = np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    return out


def _is_float(a: np.ndarray) -> bool:
    return a.dtype.kind == "f" or a.dtype.name == "bfloat16"


def emulated(program: Program, step: Step, opdef: OpDef, kernel: Callable[..., Any], ins: Arrays,
             outs: Arrays, attrs: Callable[[], dict[str, Any]], overlap: bool, arena: np.ndarray,
             where: str) -> Callable[[], None]:
    """A closure that runs ``step`` under the Program's low-precision recipe: ``kernel`` in float32 on
    the inputs (rounded first for a ``lower`` op), its outputs rounded where ``program.rounded`` says,
    stored in their own dtype. ``attrs()`` gives the kernel's attributes (a random op's move per run)."""
    recipe: Precision = program.precision
    low = np.dtype(require_ml_dtypes(recipe.name).bfloat16)
    f32 = np.dtype(program.dtype)
    computes = getattr(program, "computes", {}).get(next((k for k in step.outputs if k), ""))
    lower = computes == "bf16" if computes else recipe.default_class(opdef) == LOWER
    rounds = rounded_reads(opdef, len(ins), lower)  # the op's float32 statistics are read as stored
    rounded = [bool(k) and k in program.rounded for k in step.outputs]

    def read(a: np.ndarray | None, rnd: bool) -> np.ndarray | None:
        if a is None or not _is_float(a):
            return a
        if rnd:
            return a.astype(low).astype(f32)
        return a.astype(f32) if a.dtype != f32 else a

    def run() -> None:
        xs = [read(a, rnd) for a, rnd in zip(ins, rounds, strict=True)]
        # a float32 slot is written directly; a bfloat16 one through a float32 copy of its contents
        ys = [None if o is None else o if o.dtype == f32 else o.astype(f32) for o in outs]
        if step.how == "out":
            kernel(*xs, out=ys, **attrs())
        else:
            res = kernel(*xs, **attrs())
            results = res if isinstance(res, (tuple, list)) else (res,)
            if overlap:
                results = [r.copy() if np.may_share_memory(r, arena) else r for r in results]
            for y, r in zip(ys, results, strict=True):
                if y is None:
                    continue
                if np.shape(r) != y.shape:
                    raise KilnError(f"{where}: the kernel returned shape {np.shape(r)}, "
                                    f"the plan has {y.shape}")
                np.copyto(y, r, casting="unsafe")
        for o, y, r in zip(outs, ys, rounded, strict=True):
            if o is None or y is None:
                continue
            if o is not y:
                np.copyto(o, y, casting="unsafe")  # the store into bfloat16 is the rounding
            elif r:
                np.copyto(o, y.astype(low), casting="unsafe")

    return run


# --- the LM head ----------------------------------------------------------------------------------


def _head_logits(x: np.ndarray, weight: np.ndarray,
                 softcap: float | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """(bf16 x, bf16 weight, bf16 logits, tanh of the capped logits or None), all float32."""
    xb, wb = to_bf16(x), to_bf16(weight)
    z = to_bf16(xb @ wb.T)
    if softcap is None:
        return xb, wb, z, None
    th = np.tanh(z / softcap)
    return xb, wb, th * softcap, th


def fused_lm_head_loss_bf16(x: np.ndarray, weight: np.ndarray, targets: np.ndarray, *, ignore_index: int,
                            chunk_size: int, softcap: float | None) -> tuple[np.ndarray, ...]:
    """``fused_lm_head_loss`` under the bf16 recipe: x and weight rounded to bf16, the logits of their
    product rounded to bf16, the loss and log-sum-exp over them in float32 (autocast's ``linear`` then
    ``cross_entropy``)."""
    z = _head_logits(x, weight, softcap)[2]
    loss, lse = _cross_entropy(z, targets, ignore_index=ignore_index)
    return loss, lse


def fused_lm_head_loss_backward_bf16(d_loss: np.ndarray | None, x: np.ndarray, weight: np.ndarray,
                                     targets: np.ndarray, lse: np.ndarray, d_lse: np.ndarray | None, *,
                                     ignore_index: int, chunk_size: int,
                                     softcap: float | None) -> tuple[np.ndarray, ...]:
    """Its backward: the logits' gradient in float32, rounded to bf16 (the gradient of a bf16 tensor),
    then ``d_x = g @ w`` and ``d_weight = g^T @ x`` on the bf16 operands, each rounded to bf16."""
    xb, wb, z, th = _head_logits(x, weight, softcap)
    g = _cross_entropy_backward(d_loss, z, targets, lse, d_lse, ignore_index=ignore_index)
    if th is not None:
        g = g * (1 - th * th)
    gb = to_bf16(g)
    return to_bf16(gb @ wb), to_bf16(gb.T @ xb)


# --- swiglu: silu's bf16 output before the gate product --------------------------------------------


def _silu_parts(g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sigmoid(g), silu(g)) in g's float type (``sigmoid = (1 + tanh(g / 2)) / 2``: no overflow)."""
    sig: np.ndarray = 0.5 * (1 + np.tanh(0.5 * g))
    return sig, g * sig


def swiglu_bf16(x: np.ndarray) -> np.ndarray:
    """``swiglu`` as autocast runs HF's ``act_fn(gate) * up`` on bf16 projections: silu computed in
    fp32 and rounded to bf16, then the bf16 product rounded (``x = [gate | up]``)."""
    m = x.shape[-1] // 2
    s = to_bf16(_silu_parts(x[..., :m])[1])
    return to_bf16(s * x[..., m:])


def swiglu_backward_bf16(d: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Its backward, with autograd's bf16 points: ``d_up = bf16(d * s)``, ``d_s = bf16(d * up)`` and
    ``d_gate = bf16(d_s * silu'(gate))`` (silu's backward computes in fp32), ``s`` silu's bf16 output."""
    m = x.shape[-1] // 2
    g, u = x[..., :m], x[..., m:]
    sig, silu = _silu_parts(g)
    d_s = to_bf16(d * u)
    out = np.empty_like(x, dtype=np.float32)
    out[..., :m] = to_bf16(d_s * (sig * (1 + g * (1 - sig))))
    out[..., m:] = to_bf16(d * to_bf16(silu))
    return out


# --- qkv_qk_norm_rope: the q/k norms' bf16 output before their weight ------------------------------


def _qk_parts(hq: int, hkv: int, d: int, q_w: np.ndarray | None,
              k_w: np.ndarray | None) -> tuple[tuple[slice, int, np.ndarray | None], ...]:
    return ((slice(0, hq * d), hq, q_w), (slice(hq * d, (hq + hkv) * d), hkv, k_w))


def qkv_qk_norm_rope_bf16(qkv: np.ndarray, q_norm_weight: np.ndarray | None,
                          k_norm_weight: np.ndarray | None, freqs: np.ndarray | None,
                          position_ids: np.ndarray, **attrs: Any) -> tuple[np.ndarray, ...]:
    """``qkv_qk_norm_rope`` as autocast runs HF's Qwen3 q/k ``RMSNorm`` then rope: the normalised
    heads rounded to bf16 (``hidden_states.to(input_dtype)``) before the fp32 weight, then rope in fp32."""
    from kiln.core.ops.library._attention import _qkv_norm_rope
    from kiln.core.ops.library._norms import rms_rstd

    b, t, _ = qkv.shape
    hq, hkv, d = attrs["Hq"], attrs["Hkv"], attrs["D"]
    normed, rstds = qkv.copy(), []
    for cols, heads, w in _qk_parts(hq, hkv, d, q_norm_weight, k_norm_weight):
        x = qkv[..., cols].reshape(b, t, heads, d)
        if w is None:
            rstds.append(np.ones((b, t, heads), np.float32))
            continue
        rstd = rms_rstd(x, attrs["eps"])
        normed[..., cols] = (to_bf16(x * rstd[..., None]) * w).reshape(b, t, heads * d)
        rstds.append(rstd.astype(np.float32))
    out = _qkv_norm_rope(normed, None, None, freqs, position_ids, **attrs)[0]
    return out, rstds[0], rstds[1]


def qkv_qk_norm_rope_backward_bf16(d_out: np.ndarray | None, qkv: np.ndarray,
                                   q_norm_weight: np.ndarray | None, k_norm_weight: np.ndarray | None,
                                   freqs: np.ndarray | None,
                                   position_ids: np.ndarray, q_rstd: np.ndarray, k_rstd: np.ndarray,
                                   d_q_rstd: np.ndarray | None = None, d_k_rstd: np.ndarray | None = None,
                                   **attrs: Any) -> tuple[np.ndarray, ...]:
    """Its backward: rope's transpose in fp32; the weight's gradient against the bf16 normalised heads;
    the normalised heads' gradient rounded to bf16 (the gradient of a bf16 tensor), through the norm in
    fp32, and the packed input's gradient rounded to bf16 (its projections are bf16)."""
    from kiln.core.ops.library._attention import _qkv_bwd_kernel

    b, t, _ = qkv.shape
    hq, hkv, d = attrs["Hq"], attrs["Hkv"], attrs["D"]
    ones = (np.ones_like(q_rstd), np.ones_like(k_rstd))
    g_all = _qkv_bwd_kernel(d_out, qkv, None, None, freqs, position_ids, *ones, None, None, **attrs)[0]
    d_qkv, d_ws = g_all.astype(np.float32), []
    parts = _qk_parts(hq, hkv, d, q_norm_weight, k_norm_weight)
    for (cols, heads, w), rstd, d_rstd in zip(parts, (q_rstd, k_rstd), (d_q_rstd, d_k_rstd), strict=True):
        if w is None:
            d_ws.append(np.zeros(d, np.float32))
            continue
        g = g_all[..., cols].reshape(b, t, heads, d)
        x = qkv[..., cols].reshape(b, t, heads, d)
        r = rstd[..., None]
        u = x * r
        d_ws.append((g * to_bf16(u)).sum(axis=(0, 1, 2)).astype(np.float32))
        d_u = to_bf16(g * w)
        dx = r * (d_u - u * np.mean(d_u * u, axis=-1, keepdims=True))
        if d_rstd is not None:  # rstd = (mean(x^2) + eps)^(-1/2)
            dx -= d_rstd[..., None] * r ** 3 * x / d
        d_qkv[..., cols] = dx.reshape(b, t, heads * d)
    return to_bf16(d_qkv), d_ws[0], d_ws[1]


# --- flash_attention: SDPA's bf16 probabilities ----------------------------------------------------


def _attention_parts(qkv: np.ndarray, segment_ids: np.ndarray | None,
                     attrs: dict[str, Any]) -> tuple[np.ndarray, ...]:
    """(q, k, v as [B, H, T, D] with k and v repeated to the query heads, the scaled scores, the mask)."""
    from kiln.core.ops.library._attention import _keep, _scale, _segment_keep, _split_qkv

    hq, hkv, d = attrs["Hq"], attrs["Hkv"], attrs["D"]
    q, k, v = (x.transpose(0, 2, 1, 3) for x in _split_qkv(qkv, hq, hkv, d, "flash_attention"))
    k, v = np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)
    t = qkv.shape[1]
    keep = _keep(t, t, attrs["causal"], attrs["window_size"], "flash_attention")
    keep = _segment_keep(keep, segment_ids, t)
    mask = keep[:, None] if keep.ndim == 3 else keep
    s = np.where(mask, (q @ k.transpose(0, 1, 3, 2)) * _scale(attrs["softmax_scale"], d), -np.inf)
    return q, k, v, s, mask


def _plain(attrs: dict[str, Any]) -> bool:
    return attrs.get("softcap") is None and not attrs.get("alibi")


def flash_attention_bf16(qkv: np.ndarray, segment_ids: np.ndarray | None = None,
                         **attrs: Any) -> tuple[np.ndarray, np.ndarray]:
    """``flash_attention`` as torch's CPU SDPA runs bf16 q, k, v: scores and their softmax in fp32, the
    unnormalised probabilities rounded to bf16 before the product with v (one kv block: exact up to
    its 512 keys), the output divided by the fp32 sum and rounded. Softcap and ALiBi scores run the
    fp32 kernel (their bf16 points are not modelled)."""
    if not _plain(attrs):
        from kiln.core.ops.library._attention import _flash

        return _flash(qkv, segment_ids, **attrs)  # type: ignore[return-value]
    b, t = qkv.shape[:2]
    _, _, v, s, _ = _attention_parts(qkv, segment_ids, attrs)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    total = e.sum(-1, keepdims=True)
    out = to_bf16((to_bf16(e) @ v) / total)
    lse = (m + np.log(total))[..., 0]
    return out.transpose(0, 2, 1, 3).reshape(b, t, -1).astype(np.float32), lse.astype(np.float32)


def flash_attention_backward_bf16(d_out: np.ndarray | None, qkv: np.ndarray, o: np.ndarray, lse: np.ndarray,
                                  d_lse: np.ndarray | None = None, segment_ids: np.ndarray | None = None,
                                  **attrs: Any) -> np.ndarray:
    """Its backward as torch's CPU SDPA backward on bf16: the probabilities recomputed in fp32 and
    rounded to bf16 for ``d_v``; the scores' gradient rounded to bf16 before ``d_q`` and ``d_k``; each
    query head's ``d_k``/``d_v`` rounded, then summed over its group (HF's ``repeat_kv``) and rounded."""
    from kiln.core.ops.library._attention import _scale

    if not _plain(attrs):
        from kiln.core.ops.library._attention import _flash_bwd_kernel

        return _flash_bwd_kernel(d_out, qkv, o, lse, d_lse, segment_ids, **attrs)
    hq, hkv, d = attrs["Hq"], attrs["Hkv"], attrs["D"]
    b, t = qkv.shape[:2]
    q, k, v, s, mask = _attention_parts(qkv, segment_ids, attrs)
    p = np.where(mask, np.exp(s - lse[..., None]), 0)
    do = (np.zeros((b, hq, t, d), np.float32) if d_out is None
          else d_out.reshape(b, t, hq, d).transpose(0, 2, 1, 3))
    oh = o.reshape(b, t, hq, d).transpose(0, 2, 1, 3)
    d_v = to_bf16(to_bf16(p).transpose(0, 1, 3, 2) @ do)
    ds = p * (do @ v.transpose(0, 1, 3, 2) - (do * oh).sum(-1, keepdims=True))
    if d_lse is not None:
        ds = ds + p * d_lse[..., None]
    ds = to_bf16(ds)
    scale = _scale(attrs["softmax_scale"], d)
    d_q = to_bf16(ds @ k * scale)
    d_k = to_bf16(ds.transpose(0, 1, 3, 2) @ q * scale)
    rep = hq // hkv

    def group(x: np.ndarray) -> np.ndarray:
        return to_bf16(x.reshape(b, hkv, rep, t, d).sum(2)) if rep > 1 else x

    out = np.empty(qkv.shape, np.float32)
    for cols, x in ((slice(0, hq * d), d_q), (slice(hq * d, (hq + hkv) * d), group(d_k)),
                    (slice((hq + hkv) * d, None), group(d_v))):
        out[..., cols] = x.transpose(0, 2, 1, 3).reshape(b, t, -1)
    return out
