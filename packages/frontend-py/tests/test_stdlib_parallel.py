"""The parallel (GPT-NeoX / GPT-J) block of the standard library: ``ParallelModel``'s loss against a NumPy
forward written from the definition ``h <- h + attention(norm1(h)) + mlp(norm2(h))`` (one shared norm
without ``parallel_norms``), the block's derived backward against float64 finite differences, and every
recompute mode giving the no-recompute gradients bit for bit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kiln.core import Model
from kiln.core.autodiff import verify_backward
from kiln.core.ir import dim_bindings
from kiln.dsl import build_bundle

TINY = {"vocab_size": 29, "d_model": 16, "n_layers": 2, "num_query_heads": 4, "num_kv_heads": 2,
        "head_size": 4, "d_ff": 12, "max_seq": 16, "rope_theta": 100.0}


def _rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _attention(x: np.ndarray, p: dict[str, np.ndarray]) -> np.ndarray:
    b, t, _ = x.shape
    hq, hkv, d = TINY["num_query_heads"], TINY["num_kv_heads"], TINY["head_size"]
    qkv = x @ p["qkv_weight"].T
    q = qkv[..., :hq * d].reshape(b, t, hq, d)
    k = qkv[..., hq * d:(hq + hkv) * d].reshape(b, t, hkv, d)
    v = qkv[..., (hq + hkv) * d:].reshape(b, t, hkv, d)
    angle = np.arange(t)[:, None] / TINY["rope_theta"] ** (np.arange(0, d, 2) / d)
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]

    def rope(z: np.ndarray) -> np.ndarray:  # HF rotate_half
        z1, z2 = z[..., :d // 2], z[..., d // 2:]
        return np.concatenate([z1 * cos - z2 * sin, z2 * cos + z1 * sin], axis=-1)

    q, k = rope(q), rope(k)
    causal = np.tril(np.ones((t, t), bool))
    out = np.empty((b, t, hq, d))
    for h in range(hq):
        kv = h // (hq // hkv)
        s = np.einsum("bqd,bkd->bqk", q[:, :, h], k[:, :, kv]) / np.sqrt(d)
        out[:, :, h] = np.einsum("bqk,bkd->bqd", _softmax(np.where(causal, s, -np.inf)), v[:, :, kv])
    return out.reshape(b, t, hq * d) @ p["out_weight"].T


def _mlp(x: np.ndarray, p: dict[str, np.ndarray]) -> np.ndarray:
    m = TINY["d_ff"]
    gate, up = x @ p["mlp_up_weight"][:m].T, x @ p["mlp_up_weight"][m:].T
    return (gate / (1 + np.exp(-gate)) * up) @ p["mlp_down_weight"].T


def reference_loss(params: dict[str, np.ndarray], ids: np.ndarray, targets: np.ndarray,
                   parallel_norms: bool) -> float:
    h = params["embedding"][ids]
    for layer in range(TINY["n_layers"]):
        p = {k.split(".", 2)[2]: v for k, v in params.items() if k.startswith(f"blocks.{layer}.")}
        attn_in = _rms(h, p["ln1_weight"])
        mlp_in = _rms(h, p["ln2_weight"]) if parallel_norms else attn_in
        h = h + _attention(attn_in, p) + _mlp(mlp_in, p)
    logits = _rms(h, params["final_norm"]) @ params["lm_head"].T
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return float(np.mean(lse - picked))


def _batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(4)
    return rng.integers(0, TINY["vocab_size"], (2, 7)), rng.integers(0, TINY["vocab_size"], (2, 7))


@pytest.mark.parametrize("parallel_norms", [True, False], ids=["neox-two-norms", "gptj-one-norm"])
def test_parallel_model_matches_the_numpy_definition(parallel_norms: bool) -> None:
    bundle = build_bundle("ParallelModel", {**TINY, "parallel_norms": parallel_norms})
    model = Model.from_ir(bundle, dtype="float64", seed=2)
    params = model.parameters()
    rng = np.random.default_rng(0)
    for name, value in params.items():  # norm weights away from 1, so that the two norms differ
        if "ln" in name:
            params[name] = value + 0.2 * rng.standard_normal(value.shape)
    model.set_parameters(params)
    assert ("blocks.0.ln2_weight" in params) == parallel_norms
    ids, targets = _batch()
    assert model.loss(ids, targets) == pytest.approx(reference_loss(params, ids, targets, parallel_norms),
                                                     rel=1e-10)


@pytest.mark.parametrize("parallel_norms", [True, False], ids=["neox-two-norms", "gptj-one-norm"])
def test_parallel_block_gradients_match_finite_differences(parallel_norms: bool) -> None:
    config = {"d_model": 8, "num_query_heads": 2, "num_kv_heads": 1, "head_size": 4, "max_seq": 8, "d_ff": 6,
              "parallel_norms": parallel_norms, "use_qk_norm": True, "use_qkv_bias": True}
    block = build_bundle("ParallelTransformerBlock", config).module("ParallelTransformerBlock")
    errors = verify_backward(block.forward, bindings={**dim_bindings(block.config), "B": 1, "T": 3},
                             loss_name=block.forward.outputs[0].name)
    assert max(errors.values()) < 1e-6, errors
    assert {"ln1_weight", "qkv_weight", "qkv_bias", "mlp_up_weight"} <= set(errors)


@pytest.mark.parametrize("recompute", [("dsl", None), ("auto", 0.6), ("block", None)],
                         ids=["dsl", "auto", "block"])
@pytest.mark.parametrize("parallel_norms", [True, False], ids=["neox-two-norms", "gptj-one-norm"])
def test_parallel_model_recomputes_bit_for_bit(parallel_norms: bool, recompute: tuple[str, Any]) -> None:
    bundle = build_bundle("ParallelModel", {**TINY, "parallel_norms": parallel_norms})
    ids, targets = _batch()
    loss0, ref = Model.from_ir(bundle, seed=1).loss_and_grads(ids, targets)
    mode, budget = recompute
    model = Model.from_ir(bundle, seed=1, recompute=mode, recompute_budget=budget)
    assert any(s.recompute for s in model.program(2, 7).steps)
    loss, grads = model.loss_and_grads(ids, targets)
    assert loss == loss0 and grads.keys() == ref.keys()
    for name, g in ref.items():
        assert np.array_equal(grads[name], g), name


# --- GPT-NeoX: LayerNorms with biases, per-head fused qkv, partial RoPE, GELU MLP -----------------

NEOX = {"vocab_size": 29, "d_model": 16, "n_layers": 2, "num_query_heads": 2, "d_ff": 20, "max_seq": 16,
        "rope_parameters": {"rope_type": "default", "rope_theta": 50.0, "partial_rotary_factor": 0.5}}


def _layernorm(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * w + b


def _neox_attention(x: np.ndarray, p: dict[str, np.ndarray]) -> np.ndarray:
    """GPTNeoXAttention: qkv rows per head [q_h | k_h | v_h]; rotate_half on each head's first rd dims."""
    b, t, _ = x.shape
    heads, d = NEOX["num_query_heads"], NEOX["d_model"] // NEOX["num_query_heads"]
    rd = d // 2
    qkv = (x @ p["qkv_weight"].T + p["qkv_bias"]).reshape(b, t, heads, 3 * d)
    q, k, v = qkv[..., :d], qkv[..., d:2 * d], qkv[..., 2 * d:]
    angle = np.arange(t)[:, None] / 50.0 ** (np.arange(0, rd, 2) / rd)
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]

    def rope(z: np.ndarray) -> np.ndarray:
        z1, z2 = z[..., :rd // 2], z[..., rd // 2:rd]
        return np.concatenate([z1 * cos - z2 * sin, z2 * cos + z1 * sin, z[..., rd:]], axis=-1)

    q, k = rope(q), rope(k)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    out = np.einsum("bhqk,bkhd->bqhd", _softmax(s), v).reshape(b, t, heads * d)
    return out @ p["out_weight"].T + p["out_bias"]


def _neox_mlp(x: np.ndarray, p: dict[str, np.ndarray]) -> np.ndarray:
    from math import erf, sqrt

    up = x @ p["mlp_up_weight"].T + p["mlp_up_bias"]
    act = np.vectorize(lambda u: 0.5 * u * (1 + erf(u / sqrt(2))))(up)
    return act @ p["mlp_down_weight"].T + p["mlp_down_bias"]


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel-residual", "sequential"])
def test_gptneox_model_matches_the_numpy_definition(parallel: bool) -> None:
    bundle = build_bundle("GPTNeoXModel", {**NEOX, "use_parallel_residual": parallel})
    model = Model.from_ir(bundle, dtype="float64", seed=5)
    rng = np.random.default_rng(3)
    params = {k: v + 0.1 * rng.standard_normal(v.shape) for k, v in model.parameters().items()}
    model.set_parameters(params)  # biases and norms away from their zero and one
    ids, targets = _batch()
    h = params["embedding"][ids]
    for layer in range(2):
        p = {k.split(".", 2)[2]: v for k, v in params.items() if k.startswith(f"blocks.{layer}.")}
        att = _neox_attention(_layernorm(h, p["ln1_weight"], p["ln1_bias"]), p)
        if parallel:
            h = h + att + _neox_mlp(_layernorm(h, p["ln2_weight"], p["ln2_bias"]), p)
        else:
            h = h + att
            h = h + _neox_mlp(_layernorm(h, p["ln2_weight"], p["ln2_bias"]), p)
    logits = _layernorm(h, params["final_norm"], params["final_norm_bias"]) @ params["lm_head"].T
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    want = float(np.mean(lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]))
    assert model.loss(ids, targets) == pytest.approx(want, rel=1e-10)


def test_gptneox_block_gradients_match_finite_differences() -> None:
    config = {"d_model": 8, "num_query_heads": 2, "head_size": 4, "d_ff": 6, "max_seq": 8,
              "scaled_rope": {"rope_type": "default", "rotary_dim": 2}}
    block = build_bundle("GPTNeoXBlock", config).module("GPTNeoXBlock")
    errors = verify_backward(block.forward, bindings={**dim_bindings(block.config), "B": 1, "T": 3},
                             loss_name=block.forward.outputs[0].name)
    assert max(errors.values()) < 1e-6, errors
    assert {"qkv_weight", "qkv_bias", "ln1_bias", "mlp_up_bias"} <= set(errors)
