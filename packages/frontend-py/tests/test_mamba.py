"""The Mamba layers of the standard library: ``MambaModel``'s loss against a NumPy forward written from HF
``MambaForCausalLM``'s definition, the block's derived backward against float64 finite differences,
(``parity``) logits and gradients against transformers on tiny random checkpoints loaded through kiln-hf,
and ``HybridModel`` (attention every k-th layer, Mamba elsewhere): its layer layout, that it trains, and
that every recompute mode gives the no-recompute loss and gradients bit for bit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.core import KilnError, Model
from kiln.core.autodiff import verify_backward
from kiln.core.ir import dim_bindings
from kiln.dsl import build_bundle
from kiln.dsl._decorators import _REGISTRY
from kiln.dsl.stdlib import mamba
from kiln.dsl.stdlib.mamba import hybrid_attention_layers

TINY = {"vocab_size": 29, "d_model": 8, "n_layers": 2, "d_state": 3, "d_conv": 3, "expand": 2, "dt_rank": 2}


@pytest.fixture(autouse=True)
def _stdlib_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """Other tests define their own ``MambaBlock`` (seed 004's example); give the names back."""
    monkeypatch.setitem(_REGISTRY["block"], "MambaBlock", mamba.MambaBlock)
    for name in ("MambaModel", "HybridModel"):
        monkeypatch.setitem(_REGISTRY["model"], name, getattr(mamba, name))


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def _mixer(h: np.ndarray, p: dict[str, np.ndarray]) -> np.ndarray:
    """HF ``MambaMixer.slow_forward``, one time step at a time, channels last."""
    b, t, _ = h.shape
    di, n, k = p["D"].shape[0], p["A_log"].shape[1], p["conv1d_weight"].shape[-1]
    xz = h @ p["in_proj_weight"].T
    xs, z = xz[..., :di], xz[..., di:]
    u = np.zeros_like(xs)
    for s in range(t):  # causal depthwise conv: tap j reads step s - (k - 1) + j
        acc = p["conv1d_bias"].copy() if "conv1d_bias" in p else np.zeros(di)
        for j in range(k):
            if s - (k - 1) + j >= 0:
                acc = acc + p["conv1d_weight"][:, 0, j] * xs[:, s - (k - 1) + j]
        u[:, s] = _silu(acc)
    dbc = u @ p["x_proj_weight"].T
    r = p["dt_proj_weight"].shape[1]
    dt = np.logaddexp(0, dbc[..., :r] @ p["dt_proj_weight"].T + p["dt_proj_bias"])
    bs, cs = dbc[..., r:r + n], dbc[..., r + n:]
    a = -np.exp(p["A_log"])
    state = np.zeros((b, di, n))
    y = np.zeros_like(u)
    for s in range(t):
        step = dt[:, s, :, None]
        state = np.exp(step * a) * state + step * bs[:, s, None, :] * u[:, s, :, None]
        y[:, s] = np.einsum("bdn,bn->bd", state, cs[:, s]) + p["D"] * u[:, s]
    return (y * _silu(z)) @ p["out_proj_weight"].T


def reference_loss(params: dict[str, np.ndarray], ids: np.ndarray, targets: np.ndarray,
                   eps: float = 1e-5) -> float:
    h = params["embedding"][ids]
    for layer in range(TINY["n_layers"]):
        p = {k.split(".", 2)[2]: v for k, v in params.items() if k.startswith(f"blocks.{layer}.")}
        h = h + _mixer(_rms(h, p["norm_weight"], eps), p)
    logits = _rms(h, params["final_norm"], eps) @ params["embedding"].T  # tied LM head
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return float(np.mean(lse - picked))


def _batch(vocab: int = TINY["vocab_size"], t: int = 7) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(4)
    return rng.integers(0, vocab, (2, t)), rng.integers(0, vocab, (2, t))


def test_mamba_model_matches_the_numpy_definition() -> None:
    model = Model.from_ir(build_bundle("MambaModel", TINY), dtype="float64", seed=2)
    params = model.parameters()
    rng = np.random.default_rng(0)
    for name, value in params.items():  # norms away from 1 and biases away from 0: every term shows
        if "norm" in name or "bias" in name:
            params[name] = value + 0.3 * rng.standard_normal(value.shape)
    model.set_parameters(params)
    assert "lm_head" not in params  # tied to the embedding, as in transformers
    ids, targets = _batch()
    assert model.loss(ids, targets) == pytest.approx(reference_loss(params, ids, targets), rel=1e-10)


def test_mamba_model_cannot_mask_padding() -> None:
    model = Model.from_ir(build_bundle("MambaModel", TINY), seed=0)
    ids, targets = _batch()
    mask = np.ones_like(ids)
    mask[1, 5:] = 0
    with pytest.raises(KilnError, match="segment_ids"):
        model.loss(ids, targets, attention_mask=mask)


@pytest.mark.parametrize("options", [{}, {"use_bias": True, "use_conv_bias": False}],
                         ids=["hf-default", "biases"])
def test_mamba_block_gradients_match_finite_differences(options: dict[str, Any]) -> None:
    config = {"d_model": 6, "d_inner": 8, "d_state": 3, "d_conv": 3, "dt_rank": 2, **options}
    block = build_bundle("MambaBlock", config).module("MambaBlock")
    errors = verify_backward(block.forward, bindings={**dim_bindings(block.config), "B": 2, "T": 4},
                             loss_name=block.forward.outputs[0].name)
    assert max(errors.values()) < 1e-6, errors
    expected = {"norm_weight", "in_proj_weight", "conv1d_weight", "x_proj_weight", "dt_proj_weight",
                "dt_proj_bias", "A_log", "D", "out_proj_weight"}
    expected |= {"in_proj_bias", "out_proj_bias"} if options else {"conv1d_bias"}
    assert set(errors) == expected


def test_mamba_model_config_defaults_follow_transformers() -> None:
    block = build_bundle("MambaModel", {"vocab_size": 50, "d_model": 40, "n_layers": 1}).module("MambaBlock")
    cfg = block.config
    # intermediate_size = expand * hidden_size, time_step_rank "auto" = ceil(hidden_size / 16)
    assert (cfg["d_inner"], cfg["dt_rank"], cfg["d_state"], cfg["d_conv"]) == (80, 3, 16, 4)
    assert {p.name for p in block.params} >= {"conv1d_bias", "A_log", "D"}
    assert "in_proj_bias" not in {p.name for p in block.params}


# --- the hybrid model ------------------------------------------------------------------------------

HYBRID = {"vocab_size": 31, "d_model": 16, "n_layers": 5, "num_query_heads": 2, "num_kv_heads": 1,
          "head_size": 8, "d_ff": 24, "max_seq": 16, "d_state": 4, "d_conv": 3, "dt_rank": 2,
          "attn_layer_period": 3, "attn_layer_offset": 1}


def test_hybrid_layer_layout() -> None:
    assert hybrid_attention_layers(5, 3, 1) == [False, True, False, False, True]
    bundle = build_bundle("HybridModel", HYBRID)
    model = bundle.module(bundle.entry)
    assert model.param("attn_blocks").array_of == "DenseTransformerBlock"
    assert model.param("mamba_blocks").array_of == "MambaBlock"
    calls = [(op.attrs["params"], op.attrs["n_layers"], op.attrs.get("first", 0), len(op.inputs))
             for op in model.forward.ops if op.type == "call"]
    # mamba 0 | attn 1 | mamba 2, 3 | attn 4: each run of one kind is one call of its stack
    assert calls == [("mamba_blocks", 1, 0, 2), ("attn_blocks", 1, 0, 4), ("mamba_blocks", 2, 1, 2),
                     ("attn_blocks", 1, 1, 4)]
    params = Model.from_ir(bundle, seed=0).parameters()
    assert {k.split(".")[0] for k in params} == {"embedding", "attn_blocks", "mamba_blocks", "final_norm",
                                                 "lm_head"}
    assert {int(k.split(".")[1]) for k in params if k.startswith("mamba_blocks.")} == {0, 1, 2}


MOE = {**HYBRID, "num_experts": 4, "num_experts_per_tok": 2, "moe_d_ff": 8}


def test_hybrid_with_moe_carries_the_routing_statistics_past_the_mamba_layers() -> None:
    bundle = build_bundle("HybridModel", {**MOE, "output_router_logits": True})
    model = bundle.module(bundle.entry)
    assert {p.name for p in model.params if p.array_of} == {"moe_blocks", "mamba_blocks"}
    assert model.param("moe_blocks").array_of == "MoETransformerBlock"
    calls = [(op.attrs["params"], len(op.inputs), len(op.outputs)) for op in model.forward.ops
             if op.type == "call"]
    # MoE layers take (x, residual, load, mean_probs, positions, segments); Mamba layers (x, residual)
    mamba, moe = ("mamba_blocks", 2, 2), ("moe_blocks", 6, 4)
    assert calls == [mamba, moe, mamba, moe]
    moe_calls = [op for op in model.forward.ops if op.type == "call" and op.attrs["params"] == "moe_blocks"]
    assert moe_calls[1].inputs[2:4] == moe_calls[0].outputs[2:4]  # the first MoE layer's statistics
    assert [op.type for op in model.forward.ops][-1] == "moe_aux_loss"


def test_hybrid_load_balancing_loss_adds_to_the_loss() -> None:
    plain = Model.from_ir(build_bundle("HybridModel", MOE), dtype="float64", seed=0)
    balanced = Model.from_ir(build_bundle("HybridModel", {**MOE, "output_router_logits": True,
                                                          "router_aux_loss_coef": 0.1}), dtype="float64")
    balanced.set_parameters(plain.parameters())
    ids, targets = _batch(HYBRID["vocab_size"])
    extra = balanced.loss(ids, targets) - plain.loss(ids, targets)
    # transformers' aux loss of top-2 routing is at least 2 (its value when the experts are balanced)
    assert extra >= 0.1 * 2 - 1e-9, extra


def test_hybrid_without_mamba_layers_is_all_attention() -> None:
    bundle = build_bundle("HybridModel", {**HYBRID, "attn_layer_period": 1, "attn_layer_offset": 0})
    model = bundle.module(bundle.entry)
    assert [p.name for p in model.params if p.array_of] == ["attn_blocks"]


def test_hybrid_rejects_an_offset_outside_the_period() -> None:
    with pytest.raises(KilnError, match="attn_layer_offset"):
        build_bundle("HybridModel", {**HYBRID, "attn_layer_offset": 3})


@pytest.mark.parametrize("config", [HYBRID, {**MOE, "output_router_logits": True}], ids=["dense", "moe"])
def test_hybrid_model_trains(config: dict[str, Any]) -> None:
    model = Model.from_ir(build_bundle("HybridModel", config), seed=3,
                          optimizer={"name": "adamw", "lr": 1e-2})
    ids = np.tile(np.arange(8) % 5, (2, 1))
    batch = {"input_ids": ids, "labels": np.roll(ids, -1, axis=1)}
    losses = [model.train_step(batch)["loss"] for _ in range(12)]
    assert all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("recompute", [("dsl", None), ("auto", 0.5), ("block", None)],
                         ids=["dsl", "auto", "block"])
@pytest.mark.parametrize(("name", "config"), [("HybridModel", HYBRID),
                                              ("HybridModel", {**MOE, "output_router_logits": True}),
                                              ("MambaModel", TINY)], ids=["dense", "moe", "mamba"])
def test_models_recompute_bit_for_bit(name: str, config: dict[str, Any], recompute: tuple[str, Any]) -> None:
    bundle = build_bundle(name, config)
    ids, targets = _batch(config["vocab_size"])
    loss0, ref = Model.from_ir(bundle, seed=1).loss_and_grads(ids, targets)
    mode, budget = recompute
    model = Model.from_ir(bundle, seed=1, recompute=mode, recompute_budget=budget)
    assert any(s.recompute for s in model.program(2, 7).steps)
    loss, grads = model.loss_and_grads(ids, targets)
    assert loss == loss0 and grads.keys() == ref.keys()
    for name, g in ref.items():
        assert np.array_equal(grads[name], g), name


# --- parity with transformers ----------------------------------------------------------------------

@pytest.mark.parity
def test_mamba_model_defaults_are_transformers_config_defaults(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from kiln.hf import config_bundle

    hf = transformers.MambaConfig()
    # what a config.json that omits every key means: kiln's defaults must be transformers'
    config = {"architectures": ["MambaForCausalLM"], "model_type": "mamba"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    bundle = config_bundle(tmp_path)
    block = bundle.module("MambaBlock").config
    assert (block["d_model"], block["d_inner"], block["d_state"], block["d_conv"], block["dt_rank"]) == (
        hf.hidden_size, hf.intermediate_size, hf.state_size, hf.conv_kernel, hf.time_step_rank)
    assert (block["eps"], block["use_bias"], block["use_conv_bias"]) == (hf.layer_norm_epsilon, hf.use_bias,
                                                                         hf.use_conv_bias)
    model = bundle.module("MambaModel").config
    assert (model["vocab_size"], model["n_layers"], model["tie_word_embeddings"]) == (
        hf.vocab_size, hf.num_hidden_layers, hf.tie_word_embeddings)


PARITY_CASES = {
    "hf-default": {},
    "biases": {"use_bias": True, "use_conv_bias": False, "tie_word_embeddings": False},
}


@pytest.mark.parity
@pytest.mark.parametrize("case", PARITY_CASES)
def test_logits_and_gradients_match_transformers(case: str, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    from kiln.hf import from_pretrained, shift_labels

    vocab = 37
    config = transformers.MambaConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=3, state_size=4,
                                      conv_kernel=3, expand=2, time_step_rank=3, **PARITY_CASES[case])
    torch.manual_seed(sum(map(ord, case)))
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF's own init for A_log and dt_proj.bias; the rest random and larger
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "A_log" not in name and "dt_proj.bias" not in name:
                p.copy_(0.3 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["MambaForCausalLM"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    model = from_pretrained(tmp_path / "hf")
    stored = safetensors_numpy.load_file(str(tmp_path / "hf" / "model.safetensors"))
    exported = model.hf_state_dict()  # every tensor back under its name, bit for bit
    assert exported.keys() == stored.keys() and all(np.array_equal(exported[k], stored[k]) for k in stored)

    ids = np.random.default_rng(5).integers(0, vocab, (2, 11))
    labels = ids.copy()
    labels[0, :2] = -100
    out = hf(input_ids=torch.tensor(ids), labels=torch.tensor(labels))
    out.loss.backward()
    close(model.logits(ids), out.logits.detach().numpy(), "logits")
    loss, grads = model.loss_and_grads(ids, shift_labels(labels))
    assert loss == pytest.approx(out.loss.item(), rel=1e-5)

    with torch.no_grad():  # transformers' gradients under the checkpoint's names
        for p in hf.parameters():
            p.copy_(p.grad)
    hf.save_pretrained(tmp_path / "grads")
    expected = safetensors_numpy.load_file(str(tmp_path / "grads" / "model.safetensors"))
    assert set(grads) == set(expected)
    for name, g in expected.items():
        close(grads[name], g, name)


def close(ours: np.ndarray, theirs: np.ndarray, what: str, rel: float = 1e-4) -> None:
    assert ours.shape == theirs.shape, what
    scale = float(np.abs(theirs).max())
    err = float(np.abs(ours.astype(np.float64) - theirs).max())
    assert err <= rel * scale, f"{what}: max error {err:.3g} exceeds {rel} x {scale:.3g}"
