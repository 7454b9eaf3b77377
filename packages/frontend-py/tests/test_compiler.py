"""The compiler: the payload of seed 003 §12, IR conformance, HF configs and mappings, conditions,
performance (one block body whatever the layer count), and the standard library's Qwen3 (acceptance 2)."""

# ruff: noqa: F821  (dimension names inside Tensor[...] annotations are not Python names)

import importlib.util
import json
import subprocess
import sys
import time
from typing import Any

import pytest

from kiln.core import op_registry
from kiln.core.autodiff import DeriveBackwardOptions, derive_backward
from kiln.core.ir import (
    IR_VERSION,
    ActivationSlot,
    Bundle,
    Module,
    dim_bindings,
    from_json,
    parse_dim,
    thaw,
    verify,
)
from kiln.dsl import (
    Activation,
    Array,
    B,
    Param,
    T,
    Tensor,
    block,
    build_bundle,
    compile_model,
    compile_model_for_hf,
    forward,
    fuse,
    graph,
    hf_config,
    hf_export,
    hf_mapping,
    hf_tied_to,
    model,
    param,
    split,
    stack_experts,
    tied_to,
    transform,
)

F = "fp32"
HAS_STDLIB = importlib.util.find_spec("kiln.dsl.stdlib") is not None


@block
class ToyBlock:
    """A residual MLP layer: the smallest block with the contract's (x, residual, position_ids) signature."""

    def __init__(self, d_model: int, d_ff: int, eps: float = 1e-6, use_bias: bool = False):
        self.d_model, self.d_ff, self.eps, self.use_bias = d_model, d_ff, eps, use_bias

    ln_weight = Param(Tensor["C", F])
    up_weight = Param(Tensor["MUp", "C", F])
    up_bias = Param(Tensor["MUp", F], when="use_bias")
    down_weight = Param(Tensor["C", "M", F])

    h = Activation(
        Tensor["B", "T", "MUp", F],
        aliases=["h_flat"],
        recompute=True,
        recompute_op="matmul",
        recompute_from=["ln", "@param:up_weight", "?@param:up_bias"],
        lora_targets=["up", "gate"],
    )
    ln = Activation(Tensor["B", "T", "C", F], recompute=True, recompute_from=["@input:x", "@input:residual"])

    @forward
    def forward(
        self,
        x: Tensor["B", "T", "C", F],
        residual: Tensor["B", "T", "C", F],
        position_ids: Tensor["T", "int32"],
    ) -> tuple[Tensor["B", "T", "C", F], Tensor["B", "T", "C", F]]:
        with graph() as g:
            res, ln, _ = g.fused_residual_rmsnorm(
                residual, x, "ln_weight", eps=self.eps, res_out_name="res", y_name="ln"
            )
            flat = g.view(ln, shape=[B * T, "C"])
            if self.use_bias:
                h = g.matmul_bias(flat, "up_weight", "up_bias", out_name="h")
            else:
                h = g.matmul(flat, "up_weight", transpose="NT", out_name="h")
            out = g.matmul(g.swiglu(h), "down_weight", transpose="NT")
            return g.view(out, shape=[B, T, "C"]), res


@model
@hf_config(
    architecture="ToyForCausalLM",
    model_type="toy",
    d_model="hidden_size",
    n_layers="num_hidden_layers",
    d_ff="intermediate_size",
    vocab_size="vocab_size",
    eps="rms_norm_eps",
    use_bias="mlp_bias",
    initializer_range="initializer_range",
    theta="rope_scaling.theta",
)
@hf_mapping(final_norm="model.norm.weight")
@hf_mapping.indexed(
    "blocks",
    ln_weight="model.layers.{layer}.input_layernorm.weight",
    up_weight=fuse(
        "model.layers.{layer}.mlp.gate_proj.weight", "model.layers.{layer}.mlp.up_proj.weight", dim=0
    ),
    up_bias=fuse("model.layers.{layer}.mlp.gate_proj.bias", "model.layers.{layer}.mlp.up_proj.bias"),
    down_weight=transform("model.layers.{layer}.mlp.down_proj.weight", fn="transpose"),
)
@hf_export(
    architecture="ToyForCausalLM",
    lm_head=hf_tied_to("embedding"),
    gate=split("model.layers.{layer}.mlp.gate_up_proj.weight", ranges=[(0, "M")]),
)
class ToyModel:
    def __init__(
        self,
        vocab_size: int = 64,
        d_model: int = 16,
        n_layers: int = 2,
        d_ff: int = 24,
        eps: float = 1e-6,
        use_bias: bool = False,
        tie_word_embeddings: bool = True,
        initializer_range: float = 0.02,
        theta: float = 1.0,
    ):
        self.vocab_size, self.d_model, self.n_layers, self.d_ff = vocab_size, d_model, n_layers, d_ff
        self.eps, self.use_bias, self.tie_word_embeddings = eps, use_bias, tie_word_embeddings
        self.initializer_range, self.theta = initializer_range, theta

    embedding = Param(Tensor["vocab_size", "d_model", F], hf_mapping="model.embed_tokens.weight")
    blocks = Param(Array["n_layers", "ToyBlock"])
    final_norm = Param(Tensor["d_model", F])

    @param(hf_mapping="lm_head.weight")
    @tied_to("embedding", when="tie_word_embeddings")
    def lm_head(self) -> Tensor["vocab_size", "d_model", F]: ...

    token_ids = Activation(Tensor["B", "T"], dtype="int32", scope="global")
    loss = Activation(Tensor["B * T"], dtype="fp32", scope="global")

    @forward
    def forward(
        self,
        token_ids: Tensor["B", "T", "int32"],
        position_ids: Tensor["T", "int32"],
        targets: Tensor["B", "T", "int32"],
    ) -> Tensor["B * T", "fp32"]:
        with graph() as g:
            x0 = g.embedding(token_ids, "embedding")
            residual0 = g.zeros(shape=[B, T, "d_model"], dtype=F)
            xN, residualN = g.call(
                "StackedBlocks",
                x0,
                residual0,
                position_ids,
                num_outputs=2,
                blocks="blocks",
                n_layers=self.n_layers,
            )
            _, xF, _ = g.fused_residual_rmsnorm(residualN, xN, "final_norm", eps=self.eps)
            loss = g.fused_lm_head_loss(g.view(xF, shape=[B * T, "d_model"]), "lm_head", targets)
            return loss


def dims_are_config_entries(module: Module) -> None:
    """The contract: every symbol of a shape or dim/dims attr, but B and T, is an int config entry."""
    ints = set(dim_bindings(module.config))
    registry = op_registry()
    shapes = [d.shape for g in (module.forward,) for d in (*g.inputs, *g.params, *g.outputs)]
    shapes += [p.shape for p in module.params] + [s.shape for s in module.activations.slots]
    for op in module.forward.ops:
        kinds = {a.name: a.kind for a in registry[op.type].attrs} if op.type in registry else {}
        for name, value in op.attrs.items():
            if kinds.get(name) == "dim" and value is not None:
                shapes.append((parse_dim(value),))
            elif kinds.get(name) == "dims":
                shapes.append(tuple(parse_dim(v) for v in value))
    for shape in shapes:
        for d in shape:
            assert d.free_symbols() - {"B", "T"} <= ints, (module.name, str(d), sorted(ints))


def _bundle(payload: dict[str, Any]) -> Bundle:
    assert payload["success"], payload["errors"]
    bundle = Bundle([from_json(m) for m in payload["modules"]], entry=payload["entry"])
    verify(bundle)
    for m in bundle.modules:
        dims_are_config_entries(m)
    return bundle


def test_payload_matches_seed_section_12() -> None:
    payload = compile_model(ToyModel, {"n_layers": 3})
    assert set(payload) == {"success", "errors", "warnings", "entry", "modules"}
    assert payload["success"] and payload["errors"] == [] and payload["warnings"] == []
    json.dumps(payload)  # JSON data throughout
    assert [m["kind"] for m in payload["modules"]] == ["model", "block"]
    assert all(m["kiln_ir"] == IR_VERSION and m["ir"] == "module" for m in payload["modules"])
    bundle = _bundle(payload)
    assert bundle == build_bundle(ToyModel, {"n_layers": 3}) == build_bundle("ToyModel", '{"n_layers": 3}')
    failed = compile_model(ToyModel, {"vocab_size": "many"})
    assert not failed["success"] and "modules" not in failed and failed["errors"][0]["code"]


def test_model_structure_and_backward() -> None:
    bundle = build_bundle(ToyModel, {})
    mdl, blk = bundle.modules
    assert (mdl.kind, blk.kind, bundle.entry) == ("model", "block", "ToyModel")
    assert [d.name for d in mdl.forward.params] == ["embedding", "blocks", "final_norm"]  # lm_head is tied
    assert mdl.param("lm_head").tied_to == "embedding" and mdl.param("lm_head").init == {}
    assert mdl.param("blocks").array_of == "ToyBlock" and mdl.param("blocks").count.to_json() == 2
    assert mdl.param("final_norm").init == {"kind": "ones"} and blk.param("ln_weight").init == {
        "kind": "ones"
    }
    loss_op = mdl.forward.ops[-1]
    assert loss_op.type == "fused_lm_head_loss" and loss_op.inputs[1] == "embedding"
    for m in bundle.modules:
        ints = set(dim_bindings(m.config))
        decls = [*m.forward.inputs, *m.forward.params, *m.forward.outputs]
        assert all(d.free_symbols() - {"B", "T"} <= ints for x in decls for d in x.shape)
        assert all(s.free_symbols() - {"B", "T"} <= ints for x in m.activations.slots for s in x.shape)
    result = derive_backward(
        mdl.forward, DeriveBackwardOptions(loss_name="loss"), modules={m.name: m for m in bundle.modules}
    )
    assert {"d_embedding", "d_blocks", "d_final_norm"} <= {d.name for d in result.backward.outputs}
    untied = build_bundle(ToyModel, {"tie_word_embeddings": False}).module("ToyModel")
    assert "lm_head" in [d.name for d in untied.forward.params]
    assert untied.param("lm_head").init == {"kind": "normal", "std": 0.02}


def test_ir_does_not_grow_with_layers_and_compiles_fast() -> None:
    sizes = {}
    for n in (2, 64):
        start = time.perf_counter()
        payload = compile_model(ToyModel, {"n_layers": n})
        elapsed = time.perf_counter() - start
        assert payload["success"] and elapsed < 1.0, elapsed
        text = json.dumps(payload["modules"])
        sizes[n] = len(text.replace(f'"count": {n}', "").replace(f'"n_layers": {n}', ""))
    assert sizes[2] == sizes[64]


def test_hf_config_and_mappings_are_serialised() -> None:
    hf = {
        "architectures": ["ToyForCausalLM"],
        "hidden_size": 16,
        "num_hidden_layers": 2,
        "intermediate_size": 24,
        "vocab_size": 64,
        "rms_norm_eps": 1e-6,
        "mlp_bias": True,
        "tie_word_embeddings": False,
        "rope_scaling": {"theta": 2.0},
        "unrelated": [1, 2],
    }
    via_hf = compile_model_for_hf("ToyForCausalLM", json.dumps(hf))
    direct = compile_model(
        ToyModel,
        {
            "d_model": 16,
            "n_layers": 2,
            "d_ff": 24,
            "vocab_size": 64,
            "use_bias": True,
            "tie_word_embeddings": False,
            "theta": 2.0,
        },
    )
    assert via_hf == direct
    mdl, blk = _bundle(direct).modules
    assert thaw(mdl.hf_config) == {
        "architecture": "ToyForCausalLM",
        "model_type": "toy",
        "param_mapping": {
            "d_model": "hidden_size",
            "n_layers": "num_hidden_layers",
            "d_ff": "intermediate_size",
            "vocab_size": "vocab_size",
            "eps": "rms_norm_eps",
            "use_bias": "mlp_bias",
            "initializer_range": "initializer_range",
            "theta": "rope_scaling.theta",
        },
    }
    maps = thaw(mdl.hf_mappings)
    assert maps["embedding"] == "model.embed_tokens.weight" and maps["final_norm"] == "model.norm.weight"
    assert maps["lm_head"] == "lm_head.weight"
    assert maps["blocks"]["type"] == "indexed" and maps["blocks"]["index"] == "{layer}"
    assert maps["blocks"]["mappings"]["down_weight"] == {
        "type": "transform",
        "source": "model.layers.{layer}.mlp.down_proj.weight",
        "fn": "transpose",
    }
    assert maps["blocks"]["mappings"]["up_bias"]["type"] == "fuse"
    assert thaw(blk.hf_mappings)["up_weight"]["sources"][1] == "model.layers.{layer}.mlp.up_proj.weight"
    assert blk.param("ln_weight").hf_mapping == "model.layers.{layer}.input_layernorm.weight"
    assert thaw(mdl.hf_export) == {
        "architecture": "ToyForCausalLM",
        "lm_head": {"type": "tied_to", "target": "embedding"},
        "gate": {
            "type": "split",
            "source": "model.layers.{layer}.mlp.gate_up_proj.weight",
            "ranges": [[0, "M"]],
            "dim": 0,
        },
    }
    biasless = _bundle(compile_model(ToyModel, {})).modules[0]
    assert "up_bias" not in thaw(biasless.hf_mappings)["blocks"]["mappings"]  # its parameter is left out


def test_stack_experts_key_layouts() -> None:
    per_expert = stack_experts(
        "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight", num_experts=8, fuse_gate_up=True
    )
    assert per_expert.to_json() == {
        "type": "stack_experts",
        "pattern": "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
        "layout": "per_expert",
        "num_experts": 8,
        "fuse_gate_up": True,
        "up_pattern": "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
    }
    stacked = stack_experts("model.layers.{layer}.mlp.experts.gate_up_proj", fuse_gate_up=True)
    assert stacked.to_json() == {
        "type": "stack_experts",
        "pattern": "model.layers.{layer}.mlp.experts.gate_up_proj",
        "layout": "stacked",
        "fuse_gate_up": True,
    }
    assert per_expert.problems() == [] and stacked.problems() == []
    assert [p[0] for p in stack_experts("x.{expert}.w", fuse_gate_up=True).problems()] == ["E010"]
    assert hf_tied_to("embedding").to_json() == {"type": "tied_to", "target": "embedding"}


def test_string_conditions_are_evaluated_and_kept() -> None:
    @block
    class Conditional:
        def __init__(self, C: int = 4, use_a: bool = True, n: int = 2):
            self.C, self.use_a, self.n = C, use_a, n

        a = Param(Tensor["C", F], when="use_a and n >= 2")
        b = Param(Tensor["C", F], when="not use_a or (n + 1) % 2 == 0")
        c = Param(Tensor["C", F], when="C * 2 == 8")

        @forward
        def forward(self, x: Tensor["C", F]) -> Tensor["C", F]:
            with graph() as g:
                return g.relu(x)

    m = build_bundle(Conditional, {}).module("Conditional")
    assert [(p.name, p.condition) for p in m.params] == [("a", "use_a and n >= 2"), ("c", "C * 2 == 8")]
    m = build_bundle(Conditional, {"use_a": False, "n": 1}).module("Conditional")
    assert [p.name for p in m.params] == ["b", "c"]


@pytest.mark.skipif(HAS_STDLIB, reason="the standard library is installed")
def test_without_stdlib_lookups_still_work() -> None:
    assert "ToyModel" in compile_model("ToyModel", {})["entry"]


def test_importing_kiln_dsl_does_not_import_the_standard_library() -> None:
    code = (
        "import sys, kiln.dsl; assert 'kiln.dsl.stdlib' not in sys.modules;"
        "kiln.dsl.list_registered_models();"
        f"assert ('kiln.dsl.stdlib' in sys.modules) == {HAS_STDLIB}"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- acceptance 2: the standard library's Qwen3 ---------------------------------------------------

QWEN3 = {
    "vocab_size": 128,
    "d_model": 64,
    "n_layers": 2,
    "num_query_heads": 4,
    "num_kv_heads": 2,
    "d_ff": 96,
    "max_seq": 128,
    "head_size": 16,
    "eps": 1e-6,
    "rope_theta": 1000000.0,
    "use_qk_norm": True,
    "tie_word_embeddings": False,
}
QWEN3_HF = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "max_position_embeddings": 128,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
RECOMPUTE_FIELDS = (
    "recompute_from",
    "recompute_op",
    "recompute_attrs",
    "recompute_policy",
    "recompute_group",
    "recompute_outputs",
    "lora_targets",
)

needs_stdlib = pytest.mark.skipif(
    not HAS_STDLIB, reason="kiln.dsl.stdlib (the standard library) is not written yet"
)


@needs_stdlib
def test_qwen3_by_name_and_by_hf_architecture_give_the_same_ir() -> None:
    direct = compile_model("Qwen3Model", QWEN3)
    via_hf = compile_model_for_hf("Qwen3ForCausalLM", QWEN3_HF)
    assert direct["success"], direct["errors"]
    assert direct == via_hf
    bundle = _bundle(direct)
    mdl = bundle.module(bundle.entry)
    (call,) = [op for op in mdl.forward.ops if op.type == "call"]
    assert call.attrs["n_layers"] == 2
    block_module = bundle.module(call.attrs["module"])
    assert block_module.kind == "block"
    derive_backward(
        mdl.forward, DeriveBackwardOptions(loss_name="loss"), modules={m.name: m for m in bundle.modules}
    )


@needs_stdlib
def test_qwen3_activation_layout_carries_every_recompute_field_and_the_alias_map() -> None:
    bundle = _bundle(compile_model("Qwen3Model", QWEN3))
    blk = next(m for m in bundle.modules if m.kind == "block")
    slots = blk.activations.slots
    default = ActivationSlot("probe")
    for field in RECOMPUTE_FIELDS:
        assert any(getattr(s, field) != getattr(default, field) for s in slots), field
    refs = {r for s in slots for r in s.recompute_from}
    assert any(r.startswith("@input:") for r in refs) and any(r.startswith("@param:") for r in refs)
    assert any(r.startswith("?") for r in refs)
    alias_map = blk.activations.alias_map()
    assert any(alias != name for alias, name in alias_map.items())
    for s in slots:
        for r in s.recompute_from:
            plain = r.lstrip("?")
            if not plain.startswith("@"):
                assert plain in alias_map, (s.name, r)
    assert {s.scope for s in slots} >= {"block", "gradient"}
    payload_slots = next(m for m in compile_model("Qwen3Model", QWEN3)["modules"] if m["kind"] == "block")
    assert from_json(payload_slots).activations == blk.activations


@needs_stdlib
def test_qwen3_64_layers_compile_under_a_second_with_one_block_body() -> None:
    sizes = {}
    for n in (2, 64):
        start = time.perf_counter()
        payload = compile_model("Qwen3Model", {**QWEN3, "n_layers": n})
        assert payload["success"] and time.perf_counter() - start < 1.0
        mods = [from_json(m) for m in payload["modules"]]
        assert [m.kind for m in mods].count("block") == 1
        sizes[n] = sum(len(m.forward.ops) for m in mods if isinstance(m, Module))
    assert sizes[2] == sizes[64]
