"""The bf16 recipe's rounding points inside kiln's fused ops (``op@numpy:bfloat16`` kernels): silu's
bf16 output before swiglu's gate product, the q/k norms' bf16 output before their weight, SDPA's
bf16 probabilities. Oracles: float64 NumPy written here from torch's unfused bf16 sequence (HF's
``act_fn(gate) * up``, ``weight * hidden.to(bf16)``, rotate_half rope, CPU SDPA), rounded with
ml_dtypes at its points; the backward kernels against float64 central finite differences of the
fp32 op (they may differ from it by the bf16 rounding of their results only).
"""

from __future__ import annotations

import numpy as np
import pytest

from kiln.core import op_registry
from kiln.core.plugins._session import get_registry

ml_dtypes = pytest.importorskip("ml_dtypes", reason="the bf16 recipe needs ml_dtypes (kiln-core[bf16])")
OPS = op_registry()


def r(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def bf16_kernel(op: str):
    k = get_registry("kernels").resolve(OPS.get_op(op), get_registry("backends")["numpy"], "bfloat16")
    assert k.key == f"{op}@numpy:bfloat16"
    return k.fn


def ulps(got: np.ndarray, want: np.ndarray) -> float:
    """The largest difference in bf16 steps at ``want``'s scale (the tensor's max magnitude)."""
    return float(np.abs(np.asarray(got, np.float64) - want).max() / (np.abs(want).max() * 2.0 ** -8))


def is_bf16(x: np.ndarray) -> bool:
    return bool(np.array_equal(np.asarray(x, np.float64), r(x)))


def fd(f, x: np.ndarray, d: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """The gradient of ``sum(d * f(x))`` by central differences (float64)."""
    g = np.zeros_like(x)
    for i in np.ndindex(*x.shape):
        e = np.zeros_like(x)
        e[i] = eps
        g[i] = np.sum(d * (f(x + e) - f(x - e))) / (2 * eps)
    return g


def test_swiglu_rounds_silu_before_the_gate_product() -> None:
    rng = np.random.default_rng(0)
    x = r(rng.normal(0, 2, (3, 5, 16))).astype(np.float32)
    g, u = x[..., :8].astype(np.float64), x[..., 8:].astype(np.float64)
    silu = g / (1 + np.exp(-g))
    want = r(r(silu) * u)
    got = bf16_kernel("swiglu")(x)
    assert np.array_equal(got, want)
    assert not np.array_equal(got, r(silu * u))  # the fp32 kernel's single rounding differs
    d = r(rng.normal(0, 1, (3, 5, 8))).astype(np.float32)
    sig = 1 / (1 + np.exp(-g))
    want_d = np.concatenate([r(r(d * u) * sig * (1 + g * (1 - sig))), r(d * r(silu))], -1)
    got_d = bf16_kernel("swiglu_backward")(d, x)
    assert ulps(got_d, want_d) <= 1 and np.mean(got_d == want_d) > 0.98
    exact = fd(lambda z: OPS.get_op("swiglu").kernel(z), x.astype(np.float64), d.astype(np.float64))
    assert ulps(got_d, exact) <= 4


def rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """HF's rotate_half rope of ``x`` ([B, T, H, D])."""
    dh = x.shape[-1]
    inv = 1 / theta ** (np.arange(0, dh, 2) / dh)
    ang = pos[:, None] * inv
    cos, sin = (np.concatenate([f(ang)] * 2, -1)[None, :, None] for f in (np.cos, np.sin))
    rot = np.concatenate([-x[..., dh // 2:], x[..., : dh // 2]], -1)
    return x * cos + rot * sin


def test_qk_norm_rounds_the_normalised_heads_before_the_weight() -> None:
    rng = np.random.default_rng(1)
    hq, hkv, d, eps, theta = 4, 2, 8, 1e-6, 100.0
    b, t = 2, 5
    qkv = r(rng.normal(0, 1.5, (b, t, (hq + 2 * hkv) * d))).astype(np.float32)
    qw, kw = ((1 + 0.1 * rng.normal(size=d)).astype(np.float32) for _ in range(2))
    pos = np.arange(t)
    attrs = {"Hq": hq, "Hkv": hkv, "D": d, "eps": eps, "theta": theta, "rotary_dim": None,
             "interleaved": False}
    out, q_rstd, k_rstd = bf16_kernel("qkv_qk_norm_rope")(qkv, qw, kw, None, pos, **attrs)
    x = qkv.astype(np.float64)
    want = x.copy()
    for cols, heads, w in ((slice(0, hq * d), hq, qw), (slice(hq * d, (hq + hkv) * d), hkv, kw)):
        h = x[..., cols].reshape(b, t, heads, d)
        rstd = 1 / np.sqrt(np.mean(h * h, -1, keepdims=True) + eps)
        want[..., cols] = rope(r(h * rstd) * w, pos, theta).reshape(b, t, -1)
    assert ulps(out, want) <= 0.01  # fp32 arithmetic on the same bf16 points
    plain = OPS.get_op("qkv_qk_norm_rope").kernel(qkv, qw, kw, None, pos, **attrs)[0]
    assert ulps(plain, want) > 0.05  # without the point: a visible difference

    d_out = r(rng.normal(0, 1, out.shape)).astype(np.float32)
    backward = bf16_kernel("qkv_qk_norm_rope_backward")
    d_qkv, d_qw, _ = backward(d_out, qkv, qw, kw, None, pos, q_rstd, k_rstd, **attrs)
    assert is_bf16(d_qkv)
    f = OPS.get_op("qkv_qk_norm_rope").kernel
    x64, dd = qkv.astype(np.float64), d_out.astype(np.float64)
    exact = fd(lambda z: f(z, qw.astype(np.float64), kw.astype(np.float64), None, pos, **attrs)[0], x64, dd)
    assert ulps(d_qkv, exact) <= 4
    kw64 = kw.astype(np.float64)
    exact_qw = fd(lambda w: f(x64, w, kw64, None, pos, **attrs)[0], qw.astype(np.float64), dd)
    assert abs(d_qw - exact_qw).max() <= 2 ** -7 * abs(exact_qw).max()


def test_attention_rounds_the_probabilities_before_v() -> None:
    rng = np.random.default_rng(2)
    hq, hkv, d, b, t = 4, 2, 8, 2, 6
    qkv = r(rng.normal(0, 1.5, (b, t, (hq + 2 * hkv) * d))).astype(np.float32)
    attrs = {"Hq": hq, "Hkv": hkv, "D": d, "causal": True, "softmax_scale": None, "window_size": None,
             "softcap": None, "alibi": False}
    out, lse = bf16_kernel("flash_attention")(qkv, None, **attrs)
    x = qkv.astype(np.float64)
    q = x[..., : hq * d].reshape(b, t, hq, d)
    k = np.repeat(x[..., hq * d: (hq + hkv) * d].reshape(b, t, hkv, d), 2, axis=2)
    v = np.repeat(x[..., (hq + hkv) * d:].reshape(b, t, hkv, d), 2, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    want = r(np.einsum("bhqk,bkhd->bqhd", r(e), v) / e.sum(-1)[..., None].transpose(0, 2, 1, 3))
    got = out.reshape(b, t, hq, d)
    assert ulps(got, want) <= 1 and np.mean(got == want) > 0.97
    plain = OPS.get_op("flash_attention").kernel(qkv, None, **attrs)[0].reshape(b, t, hq, d)
    assert np.mean(r(plain) == want) < np.mean(got == want)

    d_out = r(rng.normal(0, 1, out.shape)).astype(np.float32)
    d_qkv = bf16_kernel("flash_attention_backward")(d_out, qkv, out, lse, None, None, **attrs)
    assert is_bf16(d_qkv)
    f = OPS.get_op("flash_attention").kernel
    exact = fd(lambda z: f(z, None, **attrs)[0], qkv.astype(np.float64), d_out.astype(np.float64))
    assert ulps(d_qkv, exact) <= 6


def test_softcapped_attention_keeps_the_fp32_kernel() -> None:
    rng = np.random.default_rng(3)
    qkv = rng.normal(0, 1, (1, 4, 12)).astype(np.float32)
    attrs = {"Hq": 2, "Hkv": 1, "D": 3, "causal": True, "softmax_scale": None, "window_size": None,
             "softcap": 1.5, "alibi": False}
    got = bf16_kernel("flash_attention")(qkv, None, **attrs)
    want = OPS.get_op("flash_attention").kernel(qkv, None, **attrs)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
