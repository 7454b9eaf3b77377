"""The standard library: every model compiles to IR that verifies and differentiates; the dense block
carries seed 000's recompute declarations; forward numerics match independent NumPy implementations
of HuggingFace Llama / Qwen3 / Qwen3-MoE and of an mHC layer."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kiln.core import Model
from kiln.core.autodiff import DeriveBackwardOptions, derive_backward, verify_backward
from kiln.core.autodiff._interp import run_graph
from kiln.core.ir import Bundle, Module, dim_bindings, evaluate_shape, from_json, verify
from kiln.dsl import (
    B,
    T,
    Tensor,
    build_bundle,
    compile_model,
    compile_model_for_hf,
    forward,
    graph,
    model,
)
from kiln.dsl._decorators import _REGISTRY
from kiln.dsl.stdlib import blocks, models, modules

I32, F32 = "int32", "fp32"
TINY = {"vocab_size": 37, "d_model": 16, "n_layers": 2, "num_query_heads": 4, "num_kv_heads": 2,
        "d_ff": 24, "max_seq": 32}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_d_ff": 12}
HF_DENSE = {"vocab_size": 37, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 24, "max_position_embeddings": 32,
            "rms_norm_eps": 1e-6, "rope_theta": 100.0, "attention_bias": False, "tie_word_embeddings": False}
HF_QWEN3 = {**HF_DENSE, "head_dim": 8, "model_type": "qwen3"}  # head_dim != hidden_size / heads on purpose
HF_LLAMA = {**HF_DENSE, "model_type": "llama"}
HF_QWEN3_MOE = {**HF_QWEN3, "num_hidden_layers": 3, "model_type": "qwen3_moe", "num_experts": 4,
                "num_experts_per_tok": 2, "moe_intermediate_size": 12, "norm_topk_prob": True,
                "decoder_sparse_step": 1, "mlp_only_layers": []}

MODELS = {
    "qwen3": ("Qwen3Model", {**TINY, "head_size": 8}),
    "qwen3-bias-tied": ("Qwen3Model", {**TINY, "use_qkv_bias": True, "tie_word_embeddings": True}),
    "llama": ("LlamaModel", TINY),
    "qwen3-moe": ("Qwen3MoEModel", {**TINY, **MOE, "head_size": 8}),
    "qwen3-moe-dense-first-shared": ("Qwen3MoEModel", {**TINY, **MOE, "n_layers": 3, "mlp_only_layers": [0],
                                                       "shared_d_ff": 8, "norm_topk_prob": False}),
    "qwen3-moe-interleaved": ("Qwen3MoEModel", {**TINY, **MOE, "n_layers": 4, "decoder_sparse_step": 2}),
    "hyper-connection": ("HyperConnectionModel", {**TINY, "n_streams": 3, "hc_sinkhorn_iters": 3}),
    "mistral-window": ("MistralModel", {**TINY, "sliding_window": 3}),
    "mixtral": ("MixtralModel", {k: v for k, v in {**TINY, **MOE}.items() if k != "d_ff"}),
}


@pytest.fixture(autouse=True)
def _stdlib_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """Other tests define classes named like the standard library's (seed 003's examples), and user
    classes take a name from the standard library; give the names back for the length of a test."""
    for kind, mod in (("module", modules), ("block", blocks), ("model", models)):
        for name in mod.__all__:
            monkeypatch.setitem(_REGISTRY[kind], name, getattr(mod, name))


def _bundle(payload: dict[str, Any]) -> Bundle:
    assert payload["success"], payload["errors"]
    return Bundle([from_json(m) for m in payload["modules"]], entry=payload["entry"])


def _modules(bundle: Bundle) -> dict[str, Module]:
    return {m.name: m for m in bundle.modules}


# --- compilation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", MODELS)
def test_model_compiles_verifies_and_differentiates(case: str) -> None:
    name, config = MODELS[case]
    payload = compile_model(name, config)
    assert payload["warnings"] == []
    bundle = _bundle(payload)
    verify(bundle)
    assert from_json(bundle.to_json()) == bundle
    model = bundle.module(bundle.entry)
    assert [d.name for d in model.forward.inputs] == ["token_ids", "position_ids", "segment_ids", "targets"]
    assert [(d.name, d.dtype) for d in model.forward.outputs] == [("loss", "fp32")]
    assert model.forward.ops[-1].type == "fused_lm_head_loss"
    for m in bundle.modules:  # every symbol of every shape is an int of the module's config
        names = {*dim_bindings(m.config), "B", "T"}
        for d in (*m.forward.inputs, *m.forward.params, *m.forward.outputs):
            assert {s for dim in d.shape for s in dim.free_symbols()} <= names, d
    result = derive_backward(model.forward, DeriveBackwardOptions(), modules=_modules(bundle))
    assert {"d_embedding", "d_blocks"} <= {d.name for d in result.backward.outputs}
    assert any(op.type == "call_backward" for op in result.backward.ops)


def test_ir_does_not_grow_with_layers() -> None:
    small = compile_model("Qwen3Model", {**TINY, "n_layers": 2})
    large = compile_model("Qwen3Model", {**TINY, "n_layers": 64})
    assert len(small["modules"]) == len(large["modules"]) == 2
    assert len(str(large["modules"])) - len(str(small["modules"])) < 10  # "64" for "2" in config and call


def test_tied_lm_head_reads_the_embedding() -> None:
    model = build_bundle("Qwen3Model", {**TINY, "tie_word_embeddings": True}).module("Qwen3Model")
    assert model.param("lm_head").tied_to == "embedding"
    assert "lm_head" not in {d.name for d in model.forward.params}
    assert model.forward.ops[-1].inputs[1] == "embedding"


@pytest.mark.parametrize("arch, hf, name", [("LlamaForCausalLM", HF_LLAMA, "LlamaModel"),
                                            ("Qwen3ForCausalLM", HF_QWEN3, "Qwen3Model"),
                                            ("Qwen3MoeForCausalLM", HF_QWEN3_MOE, "Qwen3MoEModel")])
def test_hf_architectures_compile_from_hf_configs(arch: str, hf: dict[str, Any], name: str) -> None:
    bundle = _bundle(compile_model_for_hf(arch, hf))
    model = bundle.module(name)
    assert model.hf_config["architecture"] == arch
    block = bundle.module(model.param("blocks").array_of).config
    assert (block["head_size"], block["rope_theta"]) == (hf.get("head_dim", 4), 100.0)
    v5 = {k: v for k, v in hf.items() if k != "rope_theta"} | {"rope_parameters": {"rope_type": "default",
                                                                                   "rope_theta": 5e5}}
    v5_bundle = _bundle(compile_model_for_hf(arch, v5))
    assert v5_bundle.module(model.param("blocks").array_of).config["rope_theta"] == 5e5
    scaled = compile_model_for_hf(arch, {**hf, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    assert [e["code"] for e in scaled["errors"]] == ["E027"]


def test_llama_defaults_and_unsupported_options() -> None:
    mha = build_bundle("LlamaModel", {**TINY, "num_kv_heads": None})  # HF: one kv head per q head
    assert mha.module("DenseTransformerBlock").config["num_kv_heads"] == 4
    assert mha.module("DenseTransformerBlock").config["head_size"] == 4
    assert [e["code"] for e in compile_model("LlamaModel", {**TINY, "mlp_bias": True})["errors"]] == ["E027"]


@pytest.mark.parametrize("name", ["LlamaModel", "Qwen3Model", "Qwen3MoEModel"])
def test_query_heads_must_group_over_the_kv_heads(name: str) -> None:
    errors = compile_model(name, {**TINY, "num_query_heads": 3, "num_kv_heads": 2})["errors"]
    assert [e["code"] for e in errors] == ["E027"]
    assert "multiple of num_kv_heads" in errors[0]["message"]
    assert not compile_model(name, {**TINY, "num_query_heads": 4, "num_kv_heads": 2})["errors"]


def test_attention_bias_also_biases_the_output_projection() -> None:
    block = build_bundle("LlamaModel", {**TINY, "use_qkv_bias": True}).module("DenseTransformerBlock")
    params = {p.name: p for p in block.params}
    assert params["out_bias"].hf_mapping == "model.layers.{layer}.self_attn.o_proj.bias"
    assert params["qkv_bias"].hf_mapping["type"] == "fuse"


@pytest.mark.parametrize("name, config", [
    ("Linear", {"in_dim": 8, "out_dim": 4, "use_bias": True}), ("RMSNorm", {"d_model": 8}),
    ("SwiGLUMLP", {"d_model": 8, "d_ff": 12}), ("Embedding", {"vocab_size": 11, "d_model": 8}),
    ("LMHead", {"vocab_size": 11, "d_model": 8})])
def test_module_compiles(name: str, config: dict[str, Any]) -> None:
    bundle = _bundle(compile_model(name, config))
    verify(bundle)
    assert [m.kind for m in bundle.modules] == ["module"]


def test_modules_inline_into_a_caller() -> None:
    @model
    class StdlibModulesLM:
        def __init__(self, vocab_size: int, d_model: int, d_ff: int):
            self.embed, self.norm = modules.Embedding(vocab_size, d_model), modules.RMSNorm(d_model)
            self.mlp, self.head = modules.SwiGLUMLP(d_model, d_ff), modules.LMHead(vocab_size, d_model)
            self.proj = modules.Linear(d_model, d_model, use_bias=True)

        @forward
        def forward(self, token_ids: Tensor[B, T, I32], targets: Tensor[B, T, I32]) -> Tensor[B * T, F32]:
            with graph() as g:
                h = g.call(self.mlp, g.call(self.norm, g.call(self.embed, token_ids)))
                return g.call(self.head, g.call(self.proj, h), targets)

    bundle = build_bundle(StdlibModulesLM, {"vocab_size": 11, "d_model": 8, "d_ff": 12})
    verify(bundle)
    (module,) = bundle.modules
    assert {p.name: dict(p.init)["kind"] for p in module.params} == {
        "embed.weight": "normal", "norm.weight": "ones", "mlp.up_weight": "normal",
        "mlp.down_weight": "normal", "proj.weight": "normal", "proj.bias": "zeros", "head.weight": "normal"}
    loss = module.forward.outputs[0].name
    assert derive_backward(module.forward, DeriveBackwardOptions(loss_name=loss)).saves


def test_swiglu_mlp_numerics() -> None:
    module = build_bundle("SwiGLUMLP", {"d_model": 8, "d_ff": 12}).module("SwiGLUMLP")
    rng = np.random.default_rng(0)
    x, up, down = rng.standard_normal((2, 3, 8)), rng.standard_normal((24, 8)), rng.standard_normal((8, 12))
    env = run_graph(module.forward, {"x": x, "up_weight": up, "down_weight": down}, float_dtype=np.float64,
                    bindings=dim_bindings(module.config))
    gate, value = x @ up[:12].T, x @ up[12:].T
    want = (gate / (1 + np.exp(-gate)) * value) @ down.T
    np.testing.assert_allclose(env[module.forward.outputs[0].name], want, rtol=1e-12)


# --- the dense block's activation layout (seed 000 §2) ---------------------------------------------

BLOCK = {"d_model": 16, "num_query_heads": 4, "num_kv_heads": 2, "head_size": 8, "max_seq": 32}


def _block(config: dict[str, Any], name: str = "DenseTransformerBlock") -> Module:
    base = BLOCK if name == "MoETransformerBlock" else {**BLOCK, "d_ff": 24}
    return build_bundle(name, {**base, **config}).module(name)


SEED_000_SLOTS = {
    "ln1_rstd", "ln2_rstd", "lse", "q_rstd", "k_rstd", "res_ffn", "ln1", "qkv", "qkv_rope", "att", "att_out",
    "res_att", "ln2", "mlp_up", "swiglu", "mlp_down", "d_ln1", "d_qkv", "d_att", "d_ln2", "d_mlp_up",
    "d_swiglu", "d_res_att", "d_res_ffn",
}


def test_dense_block_recompute_declarations() -> None:
    block = _block({"use_qk_norm": True})
    layout = block.activations
    assert {s.name for s in layout.slots} == SEED_000_SLOTS
    slot = {s.name: s for s in layout.slots}
    groups = {n: slot[n].recompute_group for n in ("res_ffn", "ln1", "qkv_rope", "q_rstd", "k_rstd", "att",
                                                     "lse", "res_att", "ln2")}
    assert groups == {"res_ffn": "ln1_fused", "ln1": "ln1_fused", "qkv_rope": "qk_norm_rope",
                      "q_rstd": "qk_norm_rope", "k_rstd": "qk_norm_rope", "att": "attn_fwd",
                      "lse": "attn_fwd", "res_att": "ln2_fused", "ln2": "ln2_fused"}

    res_ffn = slot["res_ffn"]
    assert (res_ffn.recompute, res_ffn.recompute_policy) == (True, "always")
    assert res_ffn.recompute_op == "fused_residual_rmsnorm_apply_saved"
    assert res_ffn.recompute_from == ("@input:residual", "@input:x", "ln1_rstd", "@param:ln1_weight")
    assert res_ffn.recompute_outputs == ("res_ffn", "ln1") and res_ffn.aliases == ("residual_ffn",)

    qkv = slot["qkv"]
    assert (qkv.recompute_op, qkv.recompute_policy) == ("matmul", "lora_only")
    assert qkv.lora_targets == ("q", "k", "v") and qkv.aliases == ("qkv_flat", "qkv_biased")
    assert qkv.recompute_from == ("ln1", "@param:qkv_weight", "?@param:qkv_bias")
    assert dict(qkv.recompute_attrs) == {"_matmul_op": "qkv", "transpose": "NT"}

    rope = slot["qkv_rope"]
    assert rope.recompute_op == "qkv_qk_norm_rope"
    assert rope.recompute_outputs == ("qkv_rope", "q_rstd", "k_rstd")
    assert rope.recompute_from == ("qkv", "?@global:freq_cis", "@input:position_ids",
                                   "?@param:q_norm_weight", "?@param:k_norm_weight")
    assert dict(rope.recompute_attrs) == {"_use_qk_norm": "use_qk_norm", "_rope_fused": "auto",
                                          "rotary_dim": "D"}

    att = slot["att"]
    assert (att.recompute_outputs, att.recompute_from) == (
        ("att", "lse"), ("qkv_rope", "?@input:segment_ids"))
    assert (att.recompute_op, att.recompute_policy) == ("flash_attention", "lora_only")
    assert dict(att.recompute_attrs) == {} and att.aliases == ("att_flat", "attn")
    assert slot["att_out"].recompute_from == ("att", "@param:out_weight", "?@param:out_bias")
    assert slot["att_out"].lora_targets == ("o",) and slot["mlp_up"].lora_targets == ("up", "gate")
    assert slot["res_att"].recompute_from == ("res_ffn", "att_out", "ln2_rstd", "@param:ln2_weight")
    assert slot["res_att"].recompute_outputs == ("res_att", "ln2")
    assert slot["swiglu"].recompute_from == ("mlp_up",)
    assert dict(slot["swiglu"].recompute_attrs) == {"_activation": "swiglu"}

    for name in ("ln1_rstd", "ln2_rstd"):
        assert (slot[name].save, slot[name].recompute, slot[name].dtype) == (True, False, "fp32")
    lse, q_rstd = slot["lse"], slot["q_rstd"]
    assert (lse.save, lse.recompute, lse.recompute_policy, [str(d) for d in lse.shape]) == (
        True, True, "lora_only", ["B", "Hq", "T"])
    assert (q_rstd.condition, q_rstd.recompute_policy, q_rstd.save) == ("use_qk_norm", "lora_only", True)
    assert (slot["d_res_ffn"].gradient_of, slot["d_qkv"].scope) == ("res_ffn", "gradient")
    assert layout.get("qkv_flat").name == "qkv" and layout.get("residual_att").name == "res_att"
    tensors = {o for op in block.forward.ops for o in op.outputs}  # each slot holds a tensor of the graph
    assert all({s.name, *s.aliases} & tensors for s in layout.slots if s.scope == "block")


def test_qk_norm_and_qkv_bias_switch_params_and_slots() -> None:
    plain = _block({})
    assert {p.name for p in plain.params} == {"ln1_weight", "ln2_weight", "qkv_weight", "out_weight",
                                              "mlp_up_weight", "mlp_down_weight"}
    slots = {s.name: s for s in plain.activations.slots}
    assert "q_rstd" not in slots and "k_rstd" not in slots
    assert slots["qkv_rope"].recompute_outputs == ("qkv_rope",)  # absent outputs are dropped
    (rope,) = [op for op in plain.forward.ops if op.type == "qkv_qk_norm_rope"]
    assert rope.inputs[1:4] == ("", "", "")
    assert not [op for op in plain.forward.ops if op.type == "matmul_bias"]

    full = _block({"use_qk_norm": True, "use_qkv_bias": True})
    params = {p.name: p for p in full.params}
    assert (params["q_norm_weight"].condition, dict(params["q_norm_weight"].init)) == ("use_qk_norm",
                                                                                        {"kind": "ones"})
    assert (params["qkv_bias"].condition, dict(params["qkv_bias"].init)) == ("use_qkv_bias",
                                                                              {"kind": "zeros"})
    assert [str(d) for d in params["qkv_bias"].shape] == ["(Hq + 2 * Hkv) * D"]
    assert {"q_rstd", "k_rstd"} <= {s.name for s in full.activations.slots}
    (rope,) = [op for op in full.forward.ops if op.type == "qkv_qk_norm_rope"]
    assert rope.inputs[1:3] == ("q_norm_weight", "k_norm_weight")
    assert [op.inputs for op in full.forward.ops if op.type == "matmul_bias"] == [
        ("ln1_flat", "qkv_weight", "qkv_bias")]


@pytest.mark.parametrize("name, config", [
    ("DenseTransformerBlock", {"use_qk_norm": True, "use_qkv_bias": True, "use_out_bias": True, "d_ff": 6}),
    ("MoETransformerBlock", {"num_experts": 3, "num_experts_per_tok": 2, "moe_d_ff": 4, "shared_d_ff": 4}),
    ("HyperConnectionBlock", {"n_streams": 2, "hc_sinkhorn_iters": 2, "d_ff": 6}),
], ids=["dense", "moe", "hyper-connection"])
def test_block_gradients_match_finite_differences(name: str, config: dict[str, Any]) -> None:
    small = {"d_model": 8, "num_query_heads": 2, "num_kv_heads": 1, "head_size": 4, "max_seq": 8}
    block = build_bundle(name, {**small, **config}).module(name)
    errors = verify_backward(block.forward, bindings={**dim_bindings(block.config), "B": 1, "T": 3},
                             loss_name=block.forward.outputs[0].name)
    assert max(errors.values()) < 1e-6, errors


def test_moe_layers_interleave_with_one_body_per_kind() -> None:
    bundle = build_bundle("Qwen3MoEModel", {**TINY, **MOE, "n_layers": 5, "mlp_only_layers": [1, 2]})
    model = bundle.module("Qwen3MoEModel")
    calls = [(op.attrs["params"], op.attrs.get("first", 0), op.attrs["n_layers"]) for op in model.forward.ops
             if op.type == "call"]  # HF layers: moe, dense, dense, moe, moe
    assert calls == [("blocks", 0, 1), ("dense_blocks", 0, 2), ("blocks", 1, 2)]
    assert sorted(m.name for m in bundle.modules) == ["DenseTransformerBlock", "MoETransformerBlock",
                                                       "Qwen3MoEModel"]
    assert model.hf_layers("blocks", 3) == [0, 3, 4] and model.hf_layers("dense_blocks", 2) == [1, 2]
    # the backward runs one call_backward per call, each over its own layers, from one derived body each
    result = derive_backward(model.forward, DeriveBackwardOptions(), modules=_modules(bundle))
    backs = [(op.attrs["params"], op.attrs.get("first", 0)) for op in result.backward.ops
             if op.type == "call_backward"]
    assert backs == [("blocks", 1), ("dense_blocks", 0), ("blocks", 0)]


def test_moe_dense_layers_become_a_first_stack() -> None:
    model = build_bundle("Qwen3MoEModel", {**TINY, **MOE, "n_layers": 3, "mlp_only_layers": [0, 1]})
    model = model.module("Qwen3MoEModel")
    calls = [(op.attrs["module"], op.attrs["n_layers"], op.attrs["params"]) for op in model.forward.ops
             if op.type == "call"]
    assert calls == [("DenseTransformerBlock", 2, "dense_blocks"), ("MoETransformerBlock", 1, "blocks")]
    assert (model.config["n_dense_layers"], model.config["n_moe_layers"]) == (2, 1)


# --- numerics: independent NumPy implementations of the HF forward --------------------------------


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rotate_half(x: np.ndarray) -> np.ndarray:
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _linear(x: np.ndarray, hf: dict[str, np.ndarray], key: str) -> np.ndarray:
    y = x @ hf[key + ".weight"].T
    return y + hf[key + ".bias"] if key + ".bias" in hf else y


def _swiglu_mlp(x: np.ndarray, hf: dict[str, np.ndarray], p: str) -> np.ndarray:
    gate = _linear(x, hf, p + "gate_proj")
    return _linear(gate * _sigmoid(gate) * _linear(x, hf, p + "up_proj"), hf, p + "down_proj")


def _attention(x: np.ndarray, hf: dict[str, np.ndarray], p: str, cfg: dict[str, Any]) -> np.ndarray:
    """HF LlamaAttention / Qwen3Attention (q/k per-head RMSNorm when the weights exist), causal, GQA."""
    b, t, _ = x.shape
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // hq
    q, k, v = (_linear(x, hf, p + f"self_attn.{n}_proj").reshape(b, t, -1, d) for n in "qkv")
    if p + "self_attn.q_norm.weight" in hf:
        q = _rms(q, hf[p + "self_attn.q_norm.weight"], cfg["rms_norm_eps"])
        k = _rms(k, hf[p + "self_attn.k_norm.weight"], cfg["rms_norm_eps"])
    inv_freq = 1.0 / cfg["rope_theta"] ** (np.arange(0, d, 2) / d)
    angle = np.concatenate([np.arange(t)[:, None] * inv_freq] * 2, axis=-1)[:, None, :]  # [T, 1, D]
    q = q * np.cos(angle) + _rotate_half(q) * np.sin(angle)
    k = k * np.cos(angle) + _rotate_half(k) * np.sin(angle)
    mask = np.triu(np.full((t, t), -np.inf), 1)
    out = np.empty((b, t, hq, d))
    for head in range(hq):
        kv = head // (hq // hkv)
        s = np.einsum("bqd,bkd->bqk", q[:, :, head], k[:, :, kv]) / np.sqrt(d) + mask
        out[:, :, head] = np.einsum("bqk,bkd->bqd", _softmax(s), v[:, :, kv])
    return _linear(out.reshape(b, t, hq * d), hf, p + "self_attn.o_proj")


def _moe(x: np.ndarray, hf: dict[str, np.ndarray], p: str, cfg: dict[str, Any]) -> np.ndarray:
    """HF Qwen3MoeSparseMoeBlock: softmax router, top-k (renormalised if norm_topk_prob), SwiGLU experts;
    plus Qwen2-MoE's sigmoid-gated shared expert when its weights exist."""
    probs = _softmax(_linear(x, hf, p + "mlp.gate"))
    top = np.argsort(-probs, axis=-1, kind="stable")[..., :cfg["num_experts_per_tok"]]
    weights = np.take_along_axis(probs, top, -1)
    if cfg["norm_topk_prob"]:
        weights = weights / weights.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for e in range(cfg["num_experts"]):
        w_e = np.sum(np.where(top == e, weights, 0.0), axis=-1, keepdims=True)
        out = out + w_e * _swiglu_mlp(x, hf, p + f"mlp.experts.{e}.")
    if p + "mlp.shared_expert_gate.weight" in hf:
        out = out + _sigmoid(_linear(x, hf, p + "mlp.shared_expert_gate")) * _swiglu_mlp(
            x, hf, p + "mlp.shared_expert.")
    return out


def reference_loss(hf: dict[str, np.ndarray], cfg: dict[str, Any], ids: np.ndarray,
                   targets: np.ndarray) -> np.ndarray:
    """Per-token loss [B * T] of HF Llama / Qwen3 / Qwen3-MoE ForCausalLM (targets already shifted)."""
    eps = cfg["rms_norm_eps"]
    h = hf["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = h + _attention(_rms(h, hf[p + "input_layernorm.weight"], eps), hf, p, cfg)
        x = _rms(h, hf[p + "post_attention_layernorm.weight"], eps)
        h = h + (_moe(x, hf, p, cfg) if p + "mlp.gate.weight" in hf else _swiglu_mlp(x, hf, p + "mlp."))
    head = hf["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else hf["lm_head.weight"]
    logits = _rms(h, hf["model.norm.weight"], eps) @ head.T
    m = logits.max(-1)
    lse = m + np.log(np.exp(logits - m[..., None]).sum(-1))
    picked = np.take_along_axis(logits, np.maximum(targets, 0)[..., None], -1)[..., 0]
    return np.where(targets == -100, 0.0, lse - picked).reshape(-1)


def random_hf(cfg: dict[str, Any], rng: np.random.Generator, sparse: list[bool] | None = None,
              shared_d_ff: int = 0) -> dict[str, np.ndarray]:
    """A random HF state dict for ``cfg`` (norm weights near 1, projections ~ N(0, 0.3))."""
    c, v = cfg["hidden_size"], cfg["vocab_size"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or c // hq

    def w(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape) * 0.3

    def norm(n: int) -> np.ndarray:
        return 1.0 + 0.1 * rng.standard_normal(n)

    def mlp(p: str, m: int) -> dict[str, np.ndarray]:
        return {p + "gate_proj.weight": w(m, c), p + "up_proj.weight": w(m, c),
                p + "down_proj.weight": w(c, m)}

    hf = {"model.embed_tokens.weight": w(v, c), "model.norm.weight": norm(c), "lm_head.weight": w(v, c)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        hf |= {p + "input_layernorm.weight": norm(c), p + "post_attention_layernorm.weight": norm(c),
               p + "self_attn.o_proj.weight": w(c, hq * d)}
        for n, rows in (("q", hq * d), ("k", hkv * d), ("v", hkv * d), ("o", c)):
            if n != "o":
                hf[p + f"self_attn.{n}_proj.weight"] = w(rows, c)
            if cfg["attention_bias"]:
                hf[p + f"self_attn.{n}_proj.bias"] = w(rows)
        if cfg["model_type"] != "llama":
            hf |= {p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d)}
        if sparse is not None and sparse[i]:
            hf[p + "mlp.gate.weight"] = w(cfg["num_experts"], c)
            for e in range(cfg["num_experts"]):
                hf |= mlp(p + f"mlp.experts.{e}.", cfg["moe_intermediate_size"])
            if shared_d_ff:
                hf |= mlp(p + "mlp.shared_expert.", shared_d_ff)
                hf[p + "mlp.shared_expert_gate.weight"] = w(1, c)
        else:
            hf |= mlp(p + "mlp.", cfg["intermediate_size"])
    return hf


def _from_hf(spec: Any, hf: dict[str, np.ndarray], layer: int, num_experts: int) -> np.ndarray:
    """The value of a weight-mapping spec (as kiln-hf will read it) from a HF state dict."""
    if isinstance(spec, str):
        return hf[spec.replace("{layer}", str(layer))]
    if spec["type"] == "fuse":
        parts = [_from_hf(s, hf, layer, num_experts) for s in spec["sources"]]
        return np.concatenate(parts, axis=spec["dim"])
    assert spec["type"] == "stack_experts", spec
    patterns = [spec["pattern"], spec["up_pattern"]] if spec.get("fuse_gate_up") else [spec["pattern"]]
    return np.stack([np.concatenate([_from_hf(pt.replace("{expert}", str(e)), hf, layer, num_experts)
                                     for pt in patterns]) for e in range(num_experts)])


def kiln_params(bundle: Bundle, hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every parameter of the compiled model, read from ``hf`` through the compiled HF mappings.
    Layer ``i`` of a stack is HF layer ``layers[i]`` of its indexed mapping (``i`` without one)."""
    model = bundle.module(bundle.entry)
    out = {p.name: _from_hf(p.hf_mapping, hf, 0, 0) for p in model.params
           if p.array_of is None and p.tied_to is None}
    for op in model.forward.ops:
        if op.type != "call":
            continue
        block, stack, first = bundle.module(op.attrs["module"]), op.attrs["params"], op.attrs.get("first", 0)
        count = model.param(stack).count.evaluate(dim_bindings(model.config))
        layers = model.hf_layers(stack, count) or list(range(count))
        for i in range(first, first + op.attrs["n_layers"]):
            for p in block.params:
                out[f"{stack}.{i}.{p.name}"] = _from_hf(p.hf_mapping, hf, layers[i],
                                                        block.config.get("num_experts", 0))
    return out


def _run_loss(bundle: Bundle, values: dict[str, np.ndarray], ids: np.ndarray,
              targets: np.ndarray) -> np.ndarray:
    model = bundle.module(bundle.entry)
    feed = {**values, "token_ids": ids.astype(np.int32), "targets": targets.astype(np.int32),
            "position_ids": np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape),
            "segment_ids": np.ones(ids.shape, np.int32)}
    env = run_graph(model.forward, feed, modules=_modules(bundle), bindings=dim_bindings(model.config),
                    float_dtype=np.float64)
    return env["loss"]


def _batch(rng: np.random.Generator, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    ids, targets = rng.integers(0, vocab, (2, 6)), rng.integers(0, vocab, (2, 6))
    targets[0, 2] = targets[1, 5] = -100
    return ids, targets


HF_CASES = {
    "qwen3": ("Qwen3ForCausalLM", HF_QWEN3, None),
    "qwen3-bias-tied": ("Qwen3ForCausalLM", {**HF_QWEN3, "attention_bias": True, "tie_word_embeddings": True},
                        None),
    "llama": ("LlamaForCausalLM", HF_LLAMA, None),
    "llama-bias": ("LlamaForCausalLM", {**HF_LLAMA, "attention_bias": True}, None),
    "qwen3-moe": ("Qwen3MoeForCausalLM", HF_QWEN3_MOE, [True] * 3),
    "qwen3-moe-dense-first": ("Qwen3MoeForCausalLM", {**HF_QWEN3_MOE, "mlp_only_layers": [0],
                                                      "norm_topk_prob": False}, [False, True, True]),
    "qwen3-moe-interleaved": ("Qwen3MoeForCausalLM", {**HF_QWEN3_MOE, "mlp_only_layers": [1]},
                              [True, False, True]),
}


@pytest.mark.parametrize("case", HF_CASES)
def test_forward_matches_numpy_reference(case: str) -> None:
    arch, cfg, sparse = HF_CASES[case]
    rng = np.random.default_rng(7)
    hf = random_hf(cfg, rng, sparse)
    bundle = _bundle(compile_model_for_hf(arch, cfg))
    ids, targets = _batch(rng, cfg["vocab_size"])
    loss = _run_loss(bundle, kiln_params(bundle, hf), ids, targets)
    np.testing.assert_allclose(loss, reference_loss(hf, cfg, ids, targets), rtol=1e-10, atol=1e-12)
    assert loss[2] == loss[11] == 0.0


def test_moe_shared_expert_matches_numpy_reference() -> None:
    cfg = {**HF_QWEN3_MOE, "num_hidden_layers": 2}
    rng = np.random.default_rng(3)
    hf = random_hf(cfg, rng, [True, True], shared_d_ff=8)
    config = {**TINY, **MOE, "head_size": 8, "rope_theta": 100.0, "shared_d_ff": 8}
    bundle = build_bundle("Qwen3MoEModel", config)
    ids, targets = _batch(rng, cfg["vocab_size"])
    loss = _run_loss(bundle, kiln_params(bundle, hf), ids, targets)
    np.testing.assert_allclose(loss, reference_loss(hf, cfg, ids, targets), rtol=1e-10, atol=1e-12)


def test_qwen3_runs_on_the_numpy_runtime() -> None:
    """The compiled Qwen3 on kiln-core's Model: the reference's mean loss, finite gradients."""
    rng = np.random.default_rng(11)
    hf = random_hf(HF_QWEN3, rng)
    bundle = _bundle(compile_model_for_hf("Qwen3ForCausalLM", HF_QWEN3))
    runtime = Model.from_ir(bundle, dtype="float64")
    runtime.set_parameters(kiln_params(bundle, hf))
    ids, targets = _batch(rng, HF_QWEN3["vocab_size"])
    mean = reference_loss(hf, HF_QWEN3, ids, targets).sum() / np.count_nonzero(targets != -100)
    assert runtime.loss(ids, targets) == pytest.approx(mean, rel=1e-9)
    _, grads = runtime.loss_and_grads(ids, targets)
    assert all(np.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize("case", MODELS)
def test_model_trains_a_step_on_the_numpy_runtime(case: str) -> None:
    name, config = MODELS[case]
    runtime = Model.from_ir(build_bundle(name, config), seed=1)
    ids, targets = _batch(np.random.default_rng(2), config["vocab_size"])
    first = runtime.train_step({"input_ids": ids, "labels": targets})["loss"]
    assert np.isfinite(first) and runtime.loss(ids, targets) < first  # AdamW's first step lowers the loss


# --- Hyper-Connection block vs a NumPy mHC layer ---------------------------------------------------


def _mhc_reference(values: dict[str, np.ndarray], h: np.ndarray, n: int, iters: int,
                   cfg: dict[str, Any]) -> np.ndarray:
    """Two mHC sublayers: h <- h_res h + h_post^T f(h_pre h), Sinkhorn-normalised h_res."""
    b, t, _ = h.shape
    c, m, eps = cfg["hidden_size"], cfg["intermediate_size"], cfg["rms_norm_eps"]
    d = c // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    p = "model.layers.0."
    qkv, up = values["qkv_weight"], values["mlp_up_weight"]
    hf = {p + "self_attn.q_proj.weight": qkv[:q], p + "self_attn.k_proj.weight": qkv[q:q + kv],
          p + "self_attn.v_proj.weight": qkv[q + kv:], p + "self_attn.o_proj.weight": values["out_weight"],
          p + "mlp.gate_proj.weight": up[:m], p + "mlp.up_proj.weight": up[m:],
          p + "mlp.down_proj.weight": values["mlp_down_weight"]}

    def sublayer(s: str, h: np.ndarray, f: Any) -> np.ndarray:
        streams = h.reshape(b, t, n, c)
        normed = _rms(h, values[f"{s}_hc_norm_weight"], eps)
        logits = normed @ values[f"{s}_hc_proj"].T + values[f"{s}_hc_bias"]
        pre, post = _sigmoid(logits[..., :n]), 2 * _sigmoid(logits[..., n:2 * n])
        res = _softmax(logits[..., 2 * n:].reshape(b, t, n, n))
        for _ in range(iters):  # Sinkhorn-Knopp: columns, then rows
            res = res / res.sum(-2, keepdims=True)
            res = res / res.sum(-1, keepdims=True)
        out = f(np.einsum("btn,btnc->btc", pre, streams))
        mixed = np.einsum("btij,btjc->btic", res, streams) + post[..., None] * out[:, :, None, :]
        return mixed.reshape(b, t, n * c)

    h = sublayer("attn", h, lambda x: _attention(_rms(x, values["ln1_weight"], eps), hf, p, cfg))
    return sublayer("mlp", h, lambda x: _swiglu_mlp(_rms(x, values["ln2_weight"], eps), hf, p + "mlp."))


def test_hyper_connection_block_matches_numpy_mhc() -> None:
    n, iters = 3, 4
    block = _block({"head_size": 4, "n_streams": n, "hc_sinkhorn_iters": iters, "rope_theta": 100.0},
                   "HyperConnectionBlock")
    bindings = {**dim_bindings(block.config), "B": 2, "T": 5}
    rng = np.random.default_rng(5)
    values = {d.name: 0.3 * rng.standard_normal(evaluate_shape(d.shape, bindings))
              for d in block.forward.params}
    h = rng.standard_normal((2, 5, n * 16))
    feed = {"h": h, "position_ids": np.tile(np.arange(5, dtype=np.int32), (2, 1)),
            "segment_ids": np.ones((2, 5), np.int32)}
    env = run_graph(block.forward, {**values, **feed},
                    bindings=bindings, float_dtype=np.float64)
    cfg = {**HF_LLAMA, "rope_theta": 100.0}
    np.testing.assert_allclose(env["h_out"], _mhc_reference(values, h, n, iters, cfg), rtol=1e-10, atol=1e-12)
    h_res = env["attn_h_res"]  # doubly stochastic: rows exactly, columns after a few Sinkhorn steps
    np.testing.assert_allclose(h_res.sum(-1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(h_res.sum(-2), 1.0, atol=0.05)


# --- parity with transformers (needs torch) --------------------------------------------------------


@pytest.mark.parity
def test_qwen3_matches_transformers() -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(**{k: v for k, v in HF_QWEN3.items() if k != "model_type"})
    hf_model = transformers.Qwen3ForCausalLM(config).double().eval()
    with torch.no_grad():  # HF initialises norms to ones: perturb them so the test sees their weights
        for name, tensor in hf_model.named_parameters():
            if "norm" in name:
                tensor.add_(0.1 * torch.randn_like(tensor))
    hf = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    bundle = _bundle(compile_model_for_hf("Qwen3ForCausalLM", HF_QWEN3))
    ids, targets = _batch(np.random.default_rng(1), HF_QWEN3["vocab_size"])
    with torch.no_grad():
        logits = hf_model(torch.from_numpy(ids)).logits.flatten(0, 1)
        want = torch.nn.functional.cross_entropy(logits, torch.from_numpy(targets).flatten(),
                                                 ignore_index=-100, reduction="none").numpy()
    got = _run_loss(bundle, kiln_params(bundle, hf), ids, targets)
    # HF builds its RoPE inverse frequencies in float32 even in a float64 model: ~1e-8 apart
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("recompute", ["block", "auto"])
def test_interleaved_stacks_recompute_bit_for_bit(recompute: str) -> None:
    bundle = build_bundle("Qwen3MoEModel", {**TINY, **MOE, "n_layers": 5, "mlp_only_layers": [1, 2]})
    ids, targets = _batch(np.random.default_rng(4), TINY["vocab_size"])
    plain = Model.from_ir(bundle, seed=1, dtype="float64")
    replayed = Model.from_ir(bundle, seed=1, dtype="float64", recompute=recompute)
    assert any(st.recompute for st in replayed.program(*ids.shape).steps)
    loss, grads = plain.loss_and_grads(ids, targets)
    loss2, grads2 = replayed.loss_and_grads(ids, targets)
    assert loss == loss2 and set(grads) == set(grads2)
    for name, g in grads.items():
        np.testing.assert_array_equal(grads2[name], g, err_msg=name)
