"""Forward semantics of the normalization and attention ops against independent oracles: naive
per-row formulas, RoPE as complex rotations, attention as a per-query loop with explicit masks.
The backward rules are covered by the generic registry check; here only partial-gradient paths."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest

from kiln.core._errors import OpError
from kiln.core.autodiff._interp import run_graph
from kiln.core.ir._ir import Graph, Op, TensorType
from kiln.core.ops._ops import BackwardContext, InferContext, OpRegistry
from kiln.core.ops.library import _attention, _norms

OPS = {o.name: o for o in (*_norms.OPS, *_attention.OPS)}
REGISTRY = OpRegistry()
for _op in OPS.values():
    REGISTRY.register_op(_op)


def run(name: str, *inputs: Any, **attrs: Any) -> Any:
    outs = OPS[name].run([None if x is None else np.asarray(x) for x in inputs], attrs)
    return outs[0] if len(outs) == 1 else outs


def infer(name: str, *types: TensorType | None, **attrs: Any) -> list[TensorType]:
    op = OPS[name]
    return list(op.infer(InferContext(name, types, op.resolve_attrs(attrs))))


def fp32(shape: Any) -> TensorType:
    return TensorType(shape, "fp32")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def qkv_heads(rng: np.random.Generator, b: int, tq: int, tk: int, hq: int, hkv: int,
              d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return rng.standard_normal((b, tq, hq, d)), rng.standard_normal((b, tk, hkv, d)), \
        rng.standard_normal((b, tk, hkv, d))


# ---------------------------------------------------------------------------------------------
# Oracles, written from the definitions


def naive_rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    rows = x.reshape(-1, x.shape[-1])
    y, rstd = np.empty_like(rows), np.empty(len(rows))
    for r, row in enumerate(rows):
        ms = sum(float(v) ** 2 for v in row) / len(row)
        rstd[r] = 1.0 / math.sqrt(ms + eps)
        y[r] = [v * rstd[r] * wi for v, wi in zip(row, w, strict=True)]
    return y.reshape(x.shape), rstd.reshape(x.shape[:-1])


def complex_rope(head: np.ndarray, pos: int, rotary_dim: int, theta: float) -> np.ndarray:
    """One head vector: pairs (i, i + rotary_dim / 2) as complex numbers times e^{i pos theta^(-2i/rd)}."""
    out = head.astype(float).copy()
    half = rotary_dim // 2
    for i in range(half):
        z = complex(head[i], head[i + half]) * np.exp(1j * pos * theta ** (-2.0 * i / rotary_dim))
        out[i], out[i + half] = z.real, z.imag
    return out


def rope_oracle(x: np.ndarray, pos: np.ndarray, head_dim: int, rotary_dim: int, theta: float) -> np.ndarray:
    b, t, f = x.shape
    pos = np.broadcast_to(pos, (b, t))
    out = np.empty((b, t, f))
    for bi, ti, h in itertools.product(range(b), range(t), range(f // head_dim)):
        sl = slice(h * head_dim, (h + 1) * head_dim)
        out[bi, ti, sl] = complex_rope(x[bi, ti, sl], int(pos[bi, ti]), rotary_dim, theta)
    return out


def attention_oracle(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool = True,
                     scale: float | None = None, window: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """q [B, T, Hq, D], k/v [B, T, Hkv, D] (equal lengths): one query at a time, masks spelled out."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out, lse = np.zeros(q.shape), np.zeros((b, hq, t))
    for bi, h, i in itertools.product(range(b), range(hq), range(t)):
        g = h // (hq // hkv)
        allowed = [j for j in range(t) if (not causal or j <= i) and (window is None or i - window < j)
                   and (causal or window is None or j < i + window)]
        scores = [scale * sum(q[bi, i, h, c] * k[bi, j, g, c] for c in range(d)) for j in allowed]
        top = max(scores)
        weights = [math.exp(s - top) for s in scores]
        total = sum(weights)
        lse[bi, h, i] = top + math.log(total)
        for wgt, j in zip(weights, allowed, strict=True):
            out[bi, i, h] += wgt / total * v[bi, j, g]
    return out, lse


# ---------------------------------------------------------------------------------------------
# Normalization


def test_rmsnorm_matches_the_naive_formula(rng: np.random.Generator) -> None:
    x, w = rng.standard_normal((2, 3, 8)), rng.standard_normal(8)
    y, rstd = run("rmsnorm", x, w, eps=1e-5)
    ey, erstd = naive_rmsnorm(x, w, 1e-5)
    np.testing.assert_allclose(rstd, erstd, rtol=1e-13)
    np.testing.assert_allclose(y, ey, rtol=1e-12, atol=1e-14)
    assert rstd.shape == (2, 3)


def test_rmsnorm_default_eps_and_float32_stays_float32(rng: np.random.Generator) -> None:
    x, w = rng.standard_normal((4, 16)).astype(np.float32) * 1e-3, rng.standard_normal(16).astype(np.float32)
    y, rstd = run("rmsnorm", x, w)
    assert y.dtype == rstd.dtype == np.float32
    ey, _ = naive_rmsnorm(x.astype(float), w.astype(float), 1e-6)
    np.testing.assert_allclose(y, ey, rtol=1e-5, atol=1e-6)


def test_fused_residual_rmsnorm_adds_then_normalizes(rng: np.random.Generator) -> None:
    r, x, w = rng.standard_normal((3, 5)), rng.standard_normal((3, 5)), rng.standard_normal(5)
    res, y, rstd = run("fused_residual_rmsnorm", r, x, w, eps=1e-6)
    ey, erstd = naive_rmsnorm(r + x, w, 1e-6)
    np.testing.assert_array_equal(res, r + x)
    np.testing.assert_allclose(y, ey, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(rstd, erstd, rtol=1e-13)


def test_apply_saved_is_bitwise_equal_to_the_forward(rng: np.random.Generator) -> None:
    for dt in (np.float32, np.float64):
        r, x = rng.standard_normal((2, 3, 7)).astype(dt), rng.standard_normal((2, 3, 7)).astype(dt)
        w = rng.standard_normal(7).astype(dt)
        y, rstd = run("rmsnorm", x, w, eps=1e-6)
        assert np.array_equal(run("rmsnorm_apply_saved", x, rstd, w), y)
        res, y2, rstd2 = run("fused_residual_rmsnorm", r, x, w, eps=1e-6)
        res_again, y2_again = run("fused_residual_rmsnorm_apply_saved", r, x, rstd2, w)
        assert np.array_equal(res_again, res) and np.array_equal(y2_again, y2)
        assert y2.dtype == dt
    assert OPS["rmsnorm_apply_saved"].backward is None
    assert OPS["fused_residual_rmsnorm_apply_saved"].backward is None


def test_layernorm_matches_the_naive_formula(rng: np.random.Generator) -> None:
    x, w, b = rng.standard_normal((4, 6)) * 3 + 1, rng.standard_normal(6), rng.standard_normal(6)
    y, mean, rstd = run("layernorm", x, w, b)
    for r in range(4):
        mu = sum(x[r]) / 6
        var = sum((v - mu) ** 2 for v in x[r]) / 6  # biased, as torch.nn.LayerNorm
        assert mean[r] == pytest.approx(mu, rel=1e-13)
        assert rstd[r] == pytest.approx(1 / math.sqrt(var + 1e-5), rel=1e-13)
        np.testing.assert_allclose(y[r], (x[r] - mu) / math.sqrt(var + 1e-5) * w + b, rtol=1e-12, atol=1e-13)
    y_nobias, _, _ = run("layernorm", x, w, None)
    np.testing.assert_allclose(y_nobias, y - b, atol=1e-13)


def test_norm_shape_rules() -> None:
    y, rstd = infer("rmsnorm", fp32(["B", "T", "C"]), fp32(["C"]))
    assert y == fp32(["B", "T", "C"]) and rstd == fp32(["B", "T"])
    outs = infer("fused_residual_rmsnorm", fp32(["N", "C"]), fp32(["N", "C"]), fp32(["C"]))
    assert outs == [fp32(["N", "C"])] * 2 + [fp32(["N"])]
    with pytest.raises(OpError, match="weight must match the last dim") as err:
        infer("rmsnorm", fp32(["B", "C"]), fp32(["D"]))
    assert err.value.code == "E004"
    with pytest.raises(OpError, match="residual and input differ"):
        infer("fused_residual_rmsnorm", fp32(["N", "C"]), fp32(["M", "C"]), fp32(["C"]))


# ---------------------------------------------------------------------------------------------
# RoPE


def test_rope_is_a_complex_rotation_of_pairs_i_and_i_plus_half(rng: np.random.Generator) -> None:
    x = rng.standard_normal((2, 3, 2 * 8))
    pos = np.array([0, 5, 17])
    out = run("rope", x, None, pos, head_dim=8, theta=500.0)
    np.testing.assert_allclose(out, rope_oracle(x, pos, 8, 8, 500.0), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(out[:, 0], x[:, 0])  # position 0 is the identity


def test_rope_default_theta_and_per_batch_positions(rng: np.random.Generator) -> None:
    x = rng.standard_normal((2, 4, 6))
    pos = np.array([[0, 1, 2, 3], [7, 9, 30, 31]])
    out = run("rope", x, None, pos, head_dim=6)
    np.testing.assert_allclose(out, rope_oracle(x, pos, 6, 6, 10000.0), rtol=1e-12, atol=1e-12)


def test_partial_rotary_dim_leaves_the_tail_untouched(rng: np.random.Generator) -> None:
    x = rng.standard_normal((1, 3, 3 * 8))
    pos = np.array([2, 4, 6])
    out = run("rope", x, None, pos, head_dim=8, rotary_dim=4, theta=100.0)
    heads, xs = out.reshape(1, 3, 3, 8), x.reshape(1, 3, 3, 8)
    np.testing.assert_array_equal(heads[..., 4:], xs[..., 4:])
    np.testing.assert_allclose(out, rope_oracle(x, pos, 8, 4, 100.0), rtol=1e-12, atol=1e-12)


def test_a_freqs_table_wins_over_theta(rng: np.random.Generator) -> None:
    x = rng.standard_normal((2, 3, 8))
    pos = np.array([[1, 2, 3], [0, 4, 4]])
    inv = 77.0 ** (-np.arange(0, 4, 2) / 4)
    angles = np.arange(6)[:, None] * inv  # [MaxSeq, rotary_dim // 2]
    freqs = np.stack([np.cos(angles), np.sin(angles)], axis=-1)
    out = run("rope", x, freqs, pos, head_dim=4, theta=10000.0)
    np.testing.assert_allclose(out, rope_oracle(x, pos, 4, 4, 77.0), rtol=1e-12, atol=1e-12)
    # A scaled table (attention scaling folded into cos and sin) scales the rotated part.
    np.testing.assert_allclose(run("rope", x, 2.0 * freqs, pos, head_dim=4), 2.0 * out, rtol=1e-13)
    with pytest.raises(OpError, match="position ids must lie in"):
        run("rope", x, freqs, np.array([0, 1, 6]), head_dim=4)


def test_inverse_rope_undoes_rope(rng: np.random.Generator) -> None:
    x = rng.standard_normal((2, 5, 12))
    pos = np.arange(5) * 3
    there = run("rope", x, None, pos, head_dim=6, rotary_dim=4)
    np.testing.assert_allclose(run("rope", there, None, pos, head_dim=6, rotary_dim=4, inverse=True), x,
                               rtol=1e-12, atol=1e-13)


def test_rope_float32_stays_float32_and_angles_follow_hf(rng: np.random.Generator) -> None:
    x = rng.standard_normal((1, 4, 2 * 64)).astype(np.float32)
    pos = np.array([0, 1, 1000, 4095])
    out = run("rope", x, None, pos, head_dim=64, theta=500000.0)
    assert out.dtype == np.float32
    # HF computes inv_freq and the angles in float32; those rounded angles are the oracle's.
    f32 = np.float32
    inv32 = f32(1) / (f32(500000.0) ** (np.arange(0, 64, 2).astype(f32) / f32(64)))
    ang = pos.astype(np.float32)[:, None] * inv32
    c, s = np.cos(ang.astype(float)), np.sin(ang.astype(float))
    xs = x.reshape(1, 4, 2, 64).astype(float)
    x1, x2 = xs[..., :32], xs[..., 32:]
    expect = np.concatenate([x1 * c[:, None] - x2 * s[:, None], x2 * c[:, None] + x1 * s[:, None]], -1)
    np.testing.assert_allclose(out, expect.reshape(out.shape), rtol=1e-5, atol=1e-5)


def test_rope_shape_rule() -> None:
    x = fp32(["B", "T", "H * 64"])
    assert infer("rope", x, None, TensorType(["T"], "int32"), head_dim=64) == [x]
    pos_bt = TensorType(["B", "T"], "int32")
    assert infer("rope", x, fp32(["S", 16, 2]), pos_bt, head_dim=64, rotary_dim=32) == [x]
    with pytest.raises(OpError, match="freqs must be"):
        infer("rope", x, fp32(["S", 32, 2]), TensorType(["T"], "int32"), head_dim=64, rotary_dim=32)
    with pytest.raises(OpError, match="position_ids"):
        infer("rope", x, None, TensorType(["S"], "int32"), head_dim=64)
    with pytest.raises(OpError, match="rotary_dim"):
        infer("rope", fp32(["B", "T", 128]), None, TensorType(["T"], "int32"), head_dim=64, rotary_dim=65)
    with pytest.raises(OpError, match="multiple of head_dim"):
        infer("rope", fp32(["B", "T", 100]), None, TensorType(["T"], "int32"), head_dim=64)


# ---------------------------------------------------------------------------------------------
# qkv_qk_norm_rope


def _qkv(rng: np.random.Generator, b: int, t: int, hq: int, hkv: int, d: int) -> np.ndarray:
    return rng.standard_normal((b, t, (hq + 2 * hkv) * d))


def test_qkv_qk_norm_rope_normalizes_each_head_then_rotates(rng: np.random.Generator) -> None:
    hq, hkv, d = 4, 2, 6
    qkv = _qkv(rng, 2, 3, hq, hkv, d)
    qw, kw = rng.standard_normal(d), rng.standard_normal(d)
    pos = np.array([3, 1, 8])
    out, q_rstd, k_rstd = run("qkv_qk_norm_rope", qkv, qw, kw, None, pos, Hq=hq, Hkv=hkv, D=d, theta=300.0)
    q, k, v = np.split(qkv, [hq * d, (hq + hkv) * d], axis=-1)
    qn, eq_rstd = naive_rmsnorm(q.reshape(2, 3, hq, d), qw, 1e-6)
    kn, ek_rstd = naive_rmsnorm(k.reshape(2, 3, hkv, d), kw, 1e-6)
    expect = np.concatenate([rope_oracle(qn.reshape(2, 3, -1), pos, d, d, 300.0),
                             rope_oracle(kn.reshape(2, 3, -1), pos, d, d, 300.0), v], axis=-1)
    np.testing.assert_allclose(out, expect, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(q_rstd, eq_rstd, rtol=1e-13)
    np.testing.assert_allclose(k_rstd, ek_rstd, rtol=1e-13)
    assert q_rstd.shape == (2, 3, hq) and k_rstd.shape == (2, 3, hkv)
    np.testing.assert_array_equal(out[..., (hq + hkv) * d:], v)


def test_qkv_qk_norm_rope_without_weights_is_rope_on_q_and_k(rng: np.random.Generator) -> None:
    hq, hkv, d = 2, 1, 8
    qkv = _qkv(rng, 1, 4, hq, hkv, d)
    pos = np.array([[0, 2, 4, 6]])
    out, q_rstd, k_rstd = run("qkv_qk_norm_rope", qkv, None, None, None, pos, Hq=hq, Hkv=hkv, D=d,
                              rotary_dim=4)
    qk = qkv[..., : (hq + hkv) * d]
    roped = run("rope", qk, None, pos, head_dim=d, rotary_dim=4)
    np.testing.assert_allclose(out[..., : (hq + hkv) * d], roped, rtol=1e-14)
    np.testing.assert_allclose(out[..., : (hq + hkv) * d], rope_oracle(qk, pos, d, 4, 10000.0), rtol=1e-12,
                               atol=1e-12)
    np.testing.assert_array_equal(out[..., (hq + hkv) * d:], qkv[..., (hq + hkv) * d:])
    np.testing.assert_array_equal(q_rstd, np.ones((1, 4, hq)))
    np.testing.assert_array_equal(k_rstd, np.ones((1, 4, hkv)))


def test_qkv_qk_norm_rope_shape_rule() -> None:
    qkv = fp32(["B", "T", "(Hq + 2 * Hkv) * D"])
    out, q_rstd, k_rstd = infer("qkv_qk_norm_rope", qkv, fp32(["D"]), fp32(["D"]), None,
                                TensorType(["T"], "int32"), Hq="Hq", Hkv="Hkv", D="D")
    assert out == qkv and q_rstd == fp32(["B", "T", "Hq"]) and k_rstd == fp32(["B", "T", "Hkv"])
    with pytest.raises(OpError, match=r"\(Hq \+ 2 \* Hkv\) \* D"):
        infer("qkv_qk_norm_rope", fp32(["B", "T", "QKV"]), None, None, None, TensorType(["T"], "int32"),
              Hq="Hq", Hkv="Hkv", D="D")
    with pytest.raises(OpError, match="q_norm_weight must be"):
        infer("qkv_qk_norm_rope", qkv, fp32(["C"]), None, None, TensorType(["T"], "int32"), Hq="Hq",
              Hkv="Hkv", D="D")


# ---------------------------------------------------------------------------------------------
# Attention


@pytest.mark.parametrize(("causal", "scale", "window"), [
    (True, None, None), (False, None, None), (True, 0.3, 2), (False, None, 2), (True, None, 1)])
def test_attention_matches_a_per_query_loop(rng: np.random.Generator, causal: bool, scale: float | None,
                                            window: int | None) -> None:
    q, k, v = qkv_heads(rng, 2, 5, 5, 4, 2, 3)
    out, lse = run("attention", q, k, v, causal=causal, softmax_scale=scale, window_size=window)
    eout, ref_lse = attention_oracle(q, k, v, causal, scale, window)
    np.testing.assert_allclose(out, eout, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-13)
    assert lse.shape == (2, 4, 5)


def test_lse_is_the_log_sum_exp_of_the_masked_scaled_scores(rng: np.random.Generator) -> None:
    q, k, v = qkv_heads(rng, 1, 4, 4, 1, 1, 5)
    _, lse = run("attention", q, k, v, causal=True, softmax_scale=0.5)
    for i in range(4):
        scores = [0.5 * float(q[0, i, 0] @ k[0, j, 0]) for j in range(i + 1)]
        assert lse[0, 0, i] == pytest.approx(math.log(sum(math.exp(s) for s in scores)), rel=1e-13)


def test_flash_attention_unpacks_q_k_v_heads_in_order(rng: np.random.Generator) -> None:
    hq, hkv, d = 4, 2, 3
    qkv = _qkv(rng, 2, 5, hq, hkv, d)
    out, lse = run("flash_attention", qkv, Hq=hq, Hkv=hkv, D=d, window_size=3)
    q, k, v = (a.reshape(2, 5, -1, d) for a in np.split(qkv, [hq * d, (hq + hkv) * d], axis=-1))
    eout, ref_lse = attention_oracle(q, k, v, True, None, 3)
    np.testing.assert_allclose(out, eout.reshape(2, 5, hq * d), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-13)


def test_causal_outputs_ignore_future_tokens(rng: np.random.Generator) -> None:
    hq, hkv, d, t = 2, 1, 4, 6
    qkv = _qkv(rng, 1, t, hq, hkv, d)
    changed = qkv.copy()
    changed[:, 4:] = rng.standard_normal(changed[:, 4:].shape)
    out, lse = run("flash_attention", qkv, Hq=hq, Hkv=hkv, D=d)
    out2, lse2 = run("flash_attention", changed, Hq=hq, Hkv=hkv, D=d)
    np.testing.assert_array_equal(out[:, :4], out2[:, :4])
    np.testing.assert_array_equal(lse[..., :4], lse2[..., :4])
    assert not np.allclose(out[:, 4:], out2[:, 4:])
    # Non-causal attention does see them.
    assert not np.allclose(run("flash_attention", qkv, Hq=hq, Hkv=hkv, D=d, causal=False)[0][:, :4],
                           run("flash_attention", changed, Hq=hq, Hkv=hkv, D=d, causal=False)[0][:, :4])


def test_sliding_window_sees_exactly_w_keys(rng: np.random.Generator) -> None:
    q, k, v = qkv_heads(rng, 1, 6, 6, 1, 1, 2)
    out = run("attention", q, k, v, window_size=3)[0]
    k2, v2 = k.copy(), v.copy()
    k2[:, 2], v2[:, 2] = 9.0, 9.0  # key 2 is inside the window of queries 2, 3, 4 only
    out2 = run("attention", q, k2, v2, window_size=3)[0]
    changed = [i for i in range(6) if not np.array_equal(out[:, i], out2[:, i])]
    assert changed == [2, 3, 4]


def test_shorter_queries_align_to_the_end_of_the_keys(rng: np.random.Generator) -> None:
    q, k, v = qkv_heads(rng, 1, 5, 5, 2, 1, 3)
    full, full_lse = run("attention", q, k, v, window_size=2)
    tail, tail_lse = run("attention", q[:, 3:], k, v, window_size=2)
    np.testing.assert_allclose(tail, full[:, 3:], rtol=1e-14)
    np.testing.assert_allclose(tail_lse, full_lse[..., 3:], rtol=1e-14)


def test_fully_masked_rows_give_zero_and_infinite_lse(rng: np.random.Generator) -> None:
    q, k, v = qkv_heads(rng, 1, 4, 2, 1, 1, 2)
    out, lse = run("attention", q, k, v)  # queries 0 and 1 sit before every key
    np.testing.assert_array_equal(out[:, :2], 0.0)
    assert np.all(lse[..., :2] == np.inf) and np.all(np.isfinite(lse[..., 2:]))
    d_q, _, _ = run("attention_backward", np.ones_like(out), q, k, v, out, lse)
    assert np.all(np.isfinite(d_q)) and np.all(d_q[:, :2] == 0.0)


def test_segments_attend_within_their_document_as_if_run_alone(rng: np.random.Generator) -> None:
    # Oracle: each document's attention computed on its own, unpacked.
    hq, hkv, d = 4, 2, 3
    qkv = _qkv(rng, 2, 7, hq, hkv, d)
    segments = np.array([[1, 1, 1, 2, 2, 3, 3], [0, 0, 1, 1, 1, 1, 1]])  # packed; left-padded
    for causal in (True, False):
        out, lse = run("flash_attention", qkv, segments, Hq=hq, Hkv=hkv, D=d, causal=causal)
        for b, seg in itertools.product(range(2), range(4)):
            cols = np.flatnonzero(segments[b] == seg)
            if not cols.size:
                continue
            alone, alone_lse = run("flash_attention", qkv[b:b + 1, cols], Hq=hq, Hkv=hkv, D=d, causal=causal)
            np.testing.assert_allclose(out[b:b + 1, cols], alone, rtol=1e-12, atol=1e-13)
            np.testing.assert_allclose(lse[b:b + 1, :, cols], alone_lse, rtol=1e-12)


def test_segment_gradients_equal_per_document_gradients(rng: np.random.Generator) -> None:
    hq, hkv, d = 2, 1, 4
    qkv = _qkv(rng, 1, 6, hq, hkv, d)
    segments = np.array([[1, 1, 1, 1, 2, 2]])
    out, lse = run("flash_attention", qkv, segments, Hq=hq, Hkv=hkv, D=d)
    d_out = rng.standard_normal(out.shape)
    d_qkv = run("flash_attention_backward", d_out, qkv, out, lse, None, segments, Hq=hq, Hkv=hkv, D=d)
    for cols in (slice(0, 4), slice(4, 6)):
        o, o_lse = run("flash_attention", qkv[:, cols], Hq=hq, Hkv=hkv, D=d)
        alone = run("flash_attention_backward", d_out[:, cols], qkv[:, cols], o, o_lse, Hq=hq, Hkv=hkv, D=d)
        np.testing.assert_allclose(d_qkv[:, cols], alone, rtol=1e-11, atol=1e-13)


def test_segment_ids_are_checked() -> None:
    with pytest.raises(OpError, match=r"segment_ids must be \[B, Tk\]"):
        infer("flash_attention", fp32(["B", "T", 12]), TensorType(["B", "T + 1"], "int32"), Hq=2, Hkv=1, D=3)
    with pytest.raises(OpError, match="integer"):
        infer("flash_attention", fp32(["B", "T", 12]), fp32(["B", "T"]), Hq=2, Hkv=1, D=3)


def test_attention_float32_stays_float32(rng: np.random.Generator) -> None:
    qkv = _qkv(rng, 1, 4, 2, 2, 8).astype(np.float32)
    out, lse = run("flash_attention", qkv, Hq=2, Hkv=2, D=8)
    assert out.dtype == lse.dtype == np.float32
    eout, _ = run("flash_attention", qkv.astype(float), Hq=2, Hkv=2, D=8)
    np.testing.assert_allclose(out, eout, rtol=1e-5, atol=1e-6)


def test_attention_shape_rules() -> None:
    out, lse = infer("flash_attention", fp32(["B", "T", "(Hq + 2 * Hkv) * D"]), Hq="Hq", Hkv="Hkv", D="D")
    assert out == fp32(["B", "T", "Hq * D"]) and lse == fp32(["B", "Hq", "T"])
    out, lse = infer("flash_attention", fp32(["B", "T", 256]), Hq=4, Hkv=2, D=32)
    assert out.shape == fp32(["B", "T", 128]).shape
    with pytest.raises(OpError, match="multiple of Hkv"):
        infer("flash_attention", fp32(["B", "T", 224]), Hq=3, Hkv=2, D=32)
    with pytest.raises(OpError, match=r"\(Hq \+ 2 \* Hkv\) \* D"):
        infer("flash_attention", fp32(["B", "T", 200]), Hq=4, Hkv=2, D=32)
    out, lse = infer("attention", fp32(["B", "Tq", "Hq", "D"]), fp32(["B", "Tk", "Hkv", "D"]),
                     fp32(["B", "Tk", "Hkv", "D"]))
    assert out == fp32(["B", "Tq", "Hq", "D"]) and lse == fp32(["B", "Hq", "Tq"])
    with pytest.raises(OpError, match="k and v differ"):
        infer("attention", fp32(["B", "T", "H", "D"]), fp32(["B", "T", "H", "D"]), fp32(["B", "T", "H", "E"]))
    with pytest.raises(OpError, match="packed qkv has last dim"):
        run("flash_attention", np.zeros((1, 2, 10)), Hq=1, Hkv=1, D=4)


# ---------------------------------------------------------------------------------------------
# Backward rules when only some outputs carry a gradient (the generic check feeds all of them)


def _grads_with(name: str, inputs: list[np.ndarray | None], attrs: dict[str, Any],
                cots: list[np.ndarray | None]) -> list[np.ndarray | None]:
    opdef = OPS[name]
    names = [f"in{i}" if x is not None else "" for i, x in enumerate(inputs)]
    outs = opdef.run(inputs, attrs)
    out_names = [f"out{k}" for k in range(len(outs))]
    needs = [x is not None and np.issubdtype(x.dtype, np.floating) and i not in opdef.nondiff_inputs
             for i, x in enumerate(inputs)]
    counter = itertools.count()
    d_names = [f"d{k}" if c is not None else None for k, c in enumerate(cots)]
    ctx = BackwardContext(Op(name, names, out_names, attrs), opdef, opdef.resolve_attrs(attrs), d_names,
                          needs, {}, frozenset(), frozenset(n for n in names if n), REGISTRY,
                          lambda base: f"t{next(counter)}.{base}")
    grads = opdef.backward(ctx)  # type: ignore[misc]
    env: dict[str, Any] = {n: x for n, x in zip(names, inputs, strict=True) if n}
    env.update(zip(out_names, outs, strict=True))
    env.update({f"d{k}": c for k, c in enumerate(cots) if c is not None})
    env = run_graph(Graph("bwd", ops=ctx.emitted), env, registry=REGISTRY, float_dtype=np.float64)
    return [env[g] if g else None for g in grads]


def _fd(name: str, inputs: list[np.ndarray | None], attrs: dict[str, Any], cots: list[np.ndarray | None],
        i: int, eps: float = 1e-6) -> np.ndarray:
    def loss(xs: list[np.ndarray | None]) -> float:
        return sum(float(np.sum(c * y)) for c, y in zip(cots, OPS[name].run(xs, attrs), strict=True)
                   if c is not None)

    x = inputs[i]
    assert x is not None
    out = np.zeros(x.shape)
    for j in range(x.size):
        xp, xm = x.copy(), x.copy()
        xp.reshape(-1)[j] += eps
        xm.reshape(-1)[j] -= eps
        out.reshape(-1)[j] = (loss([xp if k == i else v for k, v in enumerate(inputs)])
                              - loss([xm if k == i else v for k, v in enumerate(inputs)])) / (2 * eps)
    return out


def _norm3(r: np.random.Generator) -> list[np.ndarray | None]:
    return [r.standard_normal((3, 4)), r.standard_normal((3, 4)), r.standard_normal(4)]


CASES = [
    ("rmsnorm", lambda r: [r.standard_normal((3, 4)), r.standard_normal(4)], {}, [True, False]),
    ("rmsnorm", lambda r: [r.standard_normal((3, 4)), r.standard_normal(4)], {}, [False, True]),
    ("fused_residual_rmsnorm", _norm3, {}, [False, True, False]),
    ("fused_residual_rmsnorm", _norm3, {}, [True, False, False]),
    ("layernorm", lambda r: [r.standard_normal((3, 4)), r.standard_normal(4), r.standard_normal(4)], {},
     [True, False, False]),
    ("flash_attention", lambda r: [r.standard_normal((1, 3, 8))], {"Hq": 2, "Hkv": 1, "D": 2}, [True, False]),
    ("flash_attention", lambda r: [r.standard_normal((1, 3, 8))], {"Hq": 2, "Hkv": 1, "D": 2}, [False, True]),
    ("attention", lambda r: [r.standard_normal((1, 3, 2, 2)), r.standard_normal((1, 3, 1, 2)),
                             r.standard_normal((1, 3, 1, 2))], {"causal": False}, [False, True]),
    ("qkv_qk_norm_rope", lambda r: [r.standard_normal((1, 2, 8)), None, r.standard_normal(2), None,
                                    np.array([1, 2])], {"Hq": 2, "Hkv": 1, "D": 2}, [True, False, False]),
    ("qkv_qk_norm_rope", lambda r: [r.standard_normal((1, 2, 8)), r.standard_normal(2), r.standard_normal(2),
                                    None, np.array([1, 2])], {"Hq": 2, "Hkv": 1, "D": 2},
     [False, True, False]),
]


@pytest.mark.parametrize(("name", "make", "attrs", "which"), CASES)
def test_backward_with_some_output_gradients_missing(rng: np.random.Generator, name: str, make: Any,
                                                     attrs: dict[str, Any], which: list[bool]) -> None:
    inputs = make(rng)
    outs = OPS[name].run(inputs, attrs)
    cots = [rng.standard_normal(o.shape) if w else None for o, w in zip(outs, which, strict=True)]
    grads = _grads_with(name, inputs, attrs, cots)
    for i, x in enumerate(inputs):
        if x is None or i in OPS[name].nondiff_inputs:
            assert grads[i] is None
            continue
        np.testing.assert_allclose(grads[i], _fd(name, inputs, attrs, cots, i), rtol=1e-6, atol=1e-8)


def test_no_gradient_in_emits_nothing(rng: np.random.Generator) -> None:
    x, w = rng.standard_normal((2, 3)), rng.standard_normal(3)
    assert _grads_with("rmsnorm", [x, w], {}, [None, None]) == [None, None]


# ---------------------------------------------------------------------------------------------
# Parity with PyTorch / HuggingFace formulas (only where torch is installed)


@pytest.mark.parity
def test_parity_with_torch_sdpa_and_rotate_half(rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch")
    b, t, hq, hkv, d = 2, 7, 4, 2, 8
    qkv = _qkv(rng, b, t, hq, hkv, d).astype(np.float32)
    pos = np.arange(t)

    def rotate_half(x: Any) -> Any:
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = (inv_freq[None, :, None] @ torch.tensor(pos)[None, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, :, None], emb.sin()[:, :, None]  # [1, T, 1, D]
    tq = torch.from_numpy(qkv)
    q, k, v = tq.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = (a.reshape(b, t, -1, d) for a in (q, k, v))
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    roped, _, _ = run("qkv_qk_norm_rope", qkv, None, None, None, pos, Hq=hq, Hkv=hkv, D=d)
    ref = torch.cat([q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1)], dim=-1).numpy()
    np.testing.assert_allclose(roped, ref, rtol=1e-5, atol=1e-6)

    for causal, window in ((True, None), (False, None), (True, 3)):
        qh, kh, vh = (a.transpose(1, 2) for a in (q, k, v))
        kh, vh = kh.repeat_interleave(hq // hkv, dim=1), vh.repeat_interleave(hq // hkv, dim=1)
        i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
        keep = (j <= i) if causal else torch.ones(t, t, dtype=torch.bool)
        if window is not None:
            keep = keep & (j > i - window)
        ref_out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=keep)
        out, _ = run("flash_attention", roped, Hq=hq, Hkv=hkv, D=d, causal=causal, window_size=window)
        ref_out = ref_out.transpose(1, 2).reshape(b, t, -1).numpy()
        np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)
