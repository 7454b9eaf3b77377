"""The load-balancing loss of the standard MoE models (Mixtral, Qwen3-MoE with ``output_router_logits``):
the mean loss grows by ``router_aux_loss_coef * aux`` with ``aux`` computed here by an independent NumPy
forward written from the models' definition (transformers' ``load_balancing_loss_func``: the MoE
layers' rows pooled, padding left out), and its gradient agrees with finite differences. Parity with
transformers itself is in kiln-hf's ``test_parity_moe_aux.py``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kiln.core import Model
from kiln.dsl import build_bundle

TINY = {"vocab_size": 41, "d_model": 16, "num_query_heads": 4, "num_kv_heads": 2, "head_size": 4,
        "max_seq": 16, "rope_theta": 100.0, "eps": 1e-6, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_d_ff": 8}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("MixtralModel", {**TINY, "n_layers": 2, "router_aux_loss_coef": 0.02}),
    # MoE, dense, MoE: the statistics pass across the dense stack; no renormalised top-k
    "qwen3-moe-interleaved": ("Qwen3MoEModel", {**TINY, "n_layers": 3, "d_ff": 12, "mlp_only_layers": [1],
                                                "norm_topk_prob": False, "router_aux_loss_coef": 0.5}),
}


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _swiglu(x: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    m = up.shape[0] // 2
    gate, value = x @ up[:m].T, x @ up[m:].T
    return (gate / (1 + np.exp(-gate)) * value) @ down.T


def _attention(x: np.ndarray, p: dict[str, np.ndarray], cfg: dict[str, Any], mask: np.ndarray) -> np.ndarray:
    b, t, _ = x.shape
    hq, hkv, d = cfg["num_query_heads"], cfg["num_kv_heads"], cfg["head_size"]
    qkv = x @ p["qkv_weight"].T
    q = qkv[..., :hq * d].reshape(b, t, hq, d)
    k = qkv[..., hq * d:(hq + hkv) * d].reshape(b, t, hkv, d)
    v = qkv[..., (hq + hkv) * d:].reshape(b, t, hkv, d)
    if "q_norm_weight" in p:
        q, k = _rms(q, p["q_norm_weight"], 1e-6), _rms(k, p["k_norm_weight"], 1e-6)
    angle = np.arange(t)[:, None] / cfg["rope_theta"] ** (np.arange(0, d, 2) / d)  # [T, D / 2]
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]

    def rope(z: np.ndarray) -> np.ndarray:
        z1, z2 = z[..., :d // 2], z[..., d // 2:]
        return np.concatenate([z1 * cos - z2 * sin, z2 * cos + z1 * sin], axis=-1)

    q, k = rope(q), rope(k)
    out = np.empty((b, t, hq, d))
    for h in range(hq):
        kv = h // (hq // hkv)
        s = np.einsum("bqd,bkd->bqk", q[:, :, h], k[:, :, kv]) / np.sqrt(d)
        out[:, :, h] = np.einsum("bqk,bkd->bqd", _softmax(np.where(mask, s, -np.inf)), v[:, :, kv])
    return out.reshape(b, t, hq * d) @ p["out_weight"].T


def reference(params: dict[str, np.ndarray], cfg: dict[str, Any], sparse: list[bool], ids: np.ndarray,
              targets: np.ndarray, pad: np.ndarray) -> tuple[float, float]:
    """(mean cross entropy, load-balancing loss) of the model from its parameters; ``pad`` marks padding
    (real tokens never attend to it)."""
    b, t = ids.shape
    mask = np.tril(np.ones((t, t), bool)) & (pad[:, None, :] == pad[:, :, None])
    h = params["embedding"][ids]
    loads, probs_means, rows = [], [], ~pad.reshape(-1)
    done = {True: 0, False: 0}
    for moe in sparse:
        stack = "blocks" if moe else "dense_blocks"
        p = {k.split(".", 2)[2]: v for k, v in params.items() if k.startswith(f"{stack}.{done[moe]}.")}
        done[moe] += 1
        h = h + _attention(_rms(h, p["ln1_weight"], 1e-6), p, cfg, mask)
        x = _rms(h, p["ln2_weight"], 1e-6).reshape(b * t, -1)
        if not moe:
            h = h + _swiglu(x, p["mlp_up_weight"], p["mlp_down_weight"]).reshape(h.shape)
            continue
        probs = _softmax(x @ p["router_weight"].T)
        top = np.argsort(-probs, axis=-1, kind="stable")[:, :cfg["num_experts_per_tok"]]
        w = np.take_along_axis(probs, top, -1)
        if cfg.get("norm_topk_prob", True):
            w = w / w.sum(-1, keepdims=True)
        out = np.zeros_like(x)
        for e in range(cfg["num_experts"]):
            w_e = np.sum(np.where(top == e, w, 0.0), axis=-1, keepdims=True)
            out += w_e * _swiglu(x, p["experts_gate_up"][e], p["experts_down"][e])
        h = h + out.reshape(h.shape)
        # load_balancing_loss_func: counts and probabilities of the rows that are not padding
        loads.append(np.array([np.sum(top[rows] == e) for e in range(cfg["num_experts"])]))
        probs_means.append(probs[rows].sum(axis=0))
    n = rows.sum() * len(loads)
    aux = cfg["num_experts"] * float(np.sum(np.sum(loads, axis=0) / n * np.sum(probs_means, axis=0) / n))
    logits = _rms(h, params["final_norm"], 1e-6) @ params["lm_head"].T
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    picked = np.take_along_axis(logits, np.maximum(targets, 0)[..., None], -1)[..., 0]
    scored = targets != -100
    return float(np.sum((lse - picked)[scored]) / scored.sum()), aux


def _models(name: str, config: dict[str, Any]) -> tuple[Model, Model, list[bool]]:
    on = Model.from_ir(build_bundle(name, {**config, "output_router_logits": True}), dtype="float64", seed=3)
    off = Model.from_ir(build_bundle(name, config), dtype="float64")
    off.set_parameters(on.parameters())
    sparse = [True] * config["n_layers"] if name == "MixtralModel" else \
        [i not in config["mlp_only_layers"] for i in range(config["n_layers"])]
    return on, off, sparse


def _batch() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    ids, targets = rng.integers(0, TINY["vocab_size"], (2, 7)), rng.integers(0, TINY["vocab_size"], (2, 7))
    targets[0, 1] = targets[1, 6] = -100
    mask = np.ones((2, 7), int)
    mask[1, 4:] = 0  # padding: left out of the load-balancing loss, as transformers' attention_mask
    targets[1, 4:] = -100
    return ids, targets, mask


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("padded", [False, True], ids=["dense-batch", "padded"])
def test_aux_loss_adds_coef_times_the_numpy_load_balancing_loss(case: str, padded: bool) -> None:
    name, config = CASES[case]
    on, off, sparse = _models(name, config)
    ids, targets, mask = _batch()
    kw = {"attention_mask": mask} if padded else {}
    pad = (mask == 0) if padded else np.zeros(ids.shape, bool)
    ce, aux = reference(on.parameters(), {**config, "norm_topk_prob": config.get("norm_topk_prob", True)},
                        sparse, ids, targets, pad)
    assert off.loss(ids, targets, **kw) == pytest.approx(ce, rel=1e-10)
    assert on.loss(ids, targets, **kw) == pytest.approx(ce + config["router_aux_loss_coef"] * aux, rel=1e-10)
    assert config["router_aux_loss_coef"] * aux > 1e-4 * ce  # the term is not lost in the tolerance


@pytest.mark.parametrize("case", CASES)
def test_aux_loss_gradient_matches_finite_differences(case: str) -> None:
    """The router weights' gradient, along a random direction, against a float64 central difference of
    the mean loss (small enough that no token changes experts)."""
    name, config = CASES[case]
    on, off, _ = _models(name, config)
    ids, targets, mask = _batch()
    _, grads = on.loss_and_grads(ids, targets, attention_mask=mask)
    _, plain = off.loss_and_grads(ids, targets, attention_mask=mask)
    params = on.parameters()
    rng = np.random.default_rng(1)
    for key in ("blocks.0.router_weight", "blocks.1.router_weight"):
        assert np.abs(grads[key] - plain[key]).max() > 1e-6, key  # the aux term reaches the router
        direction = rng.standard_normal(params[key].shape)
        eps = 1e-6
        losses = []
        for sign in (1, -1):
            on.set_parameters({key: params[key] + sign * eps * direction})
            losses.append(on.loss(ids, targets, attention_mask=mask, training=True))
        on.set_parameters({key: params[key]})
        fd = (losses[0] - losses[1]) / (2 * eps)
        assert float(np.sum(grads[key] * direction)) == pytest.approx(fd, rel=1e-6, abs=1e-10), key
