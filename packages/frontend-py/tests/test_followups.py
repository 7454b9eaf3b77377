"""Follow-ups from the standard library: LoRA targets on parameters, the layer offset of an indexed HF
mapping, call outputs typed in the caller's symbols in the backward, and a model's output named loss."""

# ruff: noqa: F821  (dimension names inside Tensor[...] annotations are not Python names)

from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from kiln.core import Model
from kiln.core.autodiff import DeriveBackwardOptions, derive_backward
from kiln.core.ir import LoraTarget, Module, dim_bindings, from_json, parse_dim, verify
from kiln.dsl import (
    Array,
    B,
    Dim,
    Param,
    T,
    Tensor,
    block,
    build_bundle,
    compile_model,
    forward,
    fuse,
    graph,
    hf_mapping,
    model,
    module,
    param,
    save,
)
from kiln.dsl._decorators import _REGISTRY
from kiln.dsl.stdlib import blocks, models, modules
from kiln.dsl.stdlib.modules import LMHead

F, I32 = "fp32", "int32"
TINY = {"vocab_size": 37, "d_model": 16, "n_layers": 3, "num_query_heads": 4, "num_kv_heads": 2,
        "d_ff": 24, "max_seq": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_d_ff": 12}
#: the HF module a LoRA target of the standard library adapts (PEFT's target_modules names)
HF_MODULE = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
             "down": "down_proj"}


@pytest.fixture(autouse=True)
def _stdlib_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """Other tests define classes named like the standard library's; give the names back."""
    for kind, mod in (("module", modules), ("block", blocks), ("model", models)):
        for name in mod.__all__:
            monkeypatch.setitem(_REGISTRY[kind], name, getattr(mod, name))


def _batch(vocab: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.integers(0, vocab, (2, 5)), rng.integers(0, vocab, (2, 5))


# --- 1. LoRA targets -------------------------------------------------------------------------------


def test_stdlib_lora_targets_pair_with_the_fused_hf_sources() -> None:
    """Target i of a weight is source i of its HF mapping; together the slices tile the weight's rows."""
    bundle = build_bundle("Qwen3MoEModel", {**TINY, "head_size": 4, "mlp_only_layers": [0]})
    found: dict[str, dict[str, list[tuple[str, int, int]]]] = {}
    for blk in bundle.modules[1:]:
        binds = dim_bindings(blk.config)
        for p in blk.params:
            if not p.lora_targets:
                continue
            sources = p.hf_mapping["sources"] if isinstance(p.hf_mapping, Mapping) else [p.hf_mapping]
            extent, end = p.shape[0].evaluate(binds), 0
            for t, source in zip(p.lora_targets, sources, strict=True):
                size = extent - end if t.size is None else t.size.evaluate(binds)
                assert (t.dim, t.start.evaluate(binds)) == (0, end)
                assert source.split(".")[-2] == HF_MODULE[t.name], (p.name, t, source)
                found.setdefault(blk.name, {}).setdefault(p.name, []).append((t.name, end, size))
                end += size
            assert end == extent, p.name
    hq_d, hkv_d, m = 4 * 4, 2 * 4, 24
    attention = {"qkv_weight": [("q", 0, hq_d), ("k", hq_d, hkv_d), ("v", hq_d + hkv_d, hkv_d)],
                 "out_weight": [("o", 0, 16)]}
    assert found["MoETransformerBlock"] == attention  # experts, router and shared expert: no targets
    assert found["DenseTransformerBlock"] == {**attention, "mlp_up_weight": [("gate", 0, m), ("up", m, m)],
                                              "mlp_down_weight": [("down", 0, 16)]}
    qkv = bundle.module("DenseTransformerBlock").param("qkv_weight")
    assert qkv.to_dict()["lora_targets"][1:] == [
        {"name": "k", "start": "Hq * D", "size": "Hkv * D"},
        {"name": "v", "start": "(Hq + Hkv) * D", "size": "Hkv * D"},
    ]
    hc = build_bundle("HyperConnectionModel", {**TINY, "n_streams": 2}).module("HyperConnectionBlock")
    assert [t.name for p in hc.params for t in p.lora_targets] == ["q", "k", "v", "o", "gate", "up", "down"]


@module
class Fused:
    """A weight of two stacked projections, a (A rows) then b (C rows)."""

    def __init__(self, d_model: int = 8, n_a: int = 4):
        self.d_model, self.n_a = d_model, n_a
        self.A = Dim("n_a")

    w = Param(Tensor["A + C", "C", F], lora_targets=[("a", 0, "A"), LoraTarget("b", "A")])

    @param(lora_targets=["whole"])
    def v(self) -> Tensor["C", "C", F]: ...

    @forward
    def forward(self, x: Tensor["B", "T", "C", F]) -> Tensor["B * T", "A + C", F]:
        with graph() as g:
            flat = g.view(x, shape=[B * T, "C"])
            return g.matmul(g.matmul(flat, "v", transpose="NT"), "w", transpose="NT")


@module
class UsesFused:
    def __init__(self, width: int = 8, extra: int = 3):
        self.width, self.extra = width, extra
        self.inner = Fused(Dim("width"), Dim("extra"))

    @forward
    def forward(self, x: Tensor["B", "T", "width", F]) -> Tensor["B * T", "extra + width", F]:
        with graph() as g:
            return g.call(self.inner, x)


def test_lora_targets_compile_into_param_specs() -> None:
    m = build_bundle(Fused, {}).module("Fused")
    assert m.param("w").lora_targets == (LoraTarget("a", 0, "A"), LoraTarget("b", "A", None, 0))
    assert m.param("v").lora_targets == (LoraTarget("whole"),)
    assert from_json(m.to_json()) == m
    outer = build_bundle(UsesFused, {}).module("UsesFused")  # an inlined module's dims are the caller's
    assert outer.param("inner.w").lora_targets == (LoraTarget("a", 0, "extra"), LoraTarget("b", "extra"))


def _with_targets(targets: Any, mapping: Any = None) -> type:
    @module
    class Targeted:
        def __init__(self, d_model: int = 8, n_a: int = 4):
            self.d_model, self.n_a = d_model, n_a
            self.A = Dim("n_a")

        w = Param(Tensor["A + C", "C", F], lora_targets=targets, hf_mapping=mapping)

        @forward
        def forward(self, x: Tensor["B", "T", "C", F]) -> Tensor["B * T", "A + C", F]:
            with graph() as g:
                return g.matmul(g.view(x, shape=[B * T, "C"]), "w", transpose="NT")

    return Targeted


@pytest.mark.parametrize("targets, mapping, code, words", [
    ([("a", 0, "A"), ("a", "A")], None, "E003", "listed twice"),
    ([("a", 0, "A + C + 1")], None, "E003", "not inside dim 0 of size 12"),
    ([("a", "A", "C", 1)], None, "E003", "not inside dim 1 of size 8"),
    ([("a", 0, "Z")], None, "E002", "'Z'"),
    ([("a", 0, None, 2)], None, "E003", "not an axis"),
    ([42], None, "E003", "expected a name"),
    (["a"], fuse("x.weight", "y.weight", dim=0), "E010", "1 LoRA target(s) (a) but the weight mapping has 2"),
    ([("a", 0, "A", 1), ("b", "A", None, 1)], fuse("x.weight", "y.weight", dim=0), "E010", "another dim"),
], ids=["twice", "too-long", "other-dim", "unknown-dim", "bad-dim", "not-a-target", "count", "fuse-dim"])
def test_bad_lora_targets_are_reported_at_the_param(targets: Any, mapping: Any, code: str,
                                                    words: str) -> None:
    (err,) = compile_model(_with_targets(targets, mapping), {})["errors"]
    assert err["code"] == code and words in err["message"], err
    assert "test_followups.py" in err["location"]


def test_matching_lora_targets_and_fuse_compile() -> None:
    cls = _with_targets([("a", 0, "A"), ("b", "A")], fuse("a.weight", "b.weight", dim=0))
    assert compile_model(cls, {})["success"]


# --- 2. layer offset of an indexed mapping -------------------------------------------------------


@block
class MLPLayer:
    def __init__(self, d_model: int, d_ff: int):
        self.d_model, self.d_ff = d_model, d_ff

    up_weight = Param(Tensor["MUp", "C", F], lora_targets=[("gate", 0, "M"), ("up", "M", "M")])
    down_weight = Param(Tensor["C", "M", F], lora_targets=["down"])

    @forward
    def forward(self, x: Tensor["B", "T", "C", F], position_ids: Tensor["T", I32]
                ) -> Tensor["B", "T", "C", F]:
        with graph() as g:
            up = g.matmul(g.view(x, shape=[B * T, "C"]), "up_weight", transpose="NT")
            down = g.matmul(g.swiglu(up), "down_weight", transpose="NT")
            return g.add(x, g.view(down, shape=[B, T, "C"]))


def _offset_lm(offset: Any = 0, layers: Any = None) -> type:
    @model
    @hf_mapping.indexed("blocks", layer_offset=offset, layers=layers,
                        up_weight=fuse("model.layers.{layer}.mlp.gate_proj.weight",
                                       "model.layers.{layer}.mlp.up_proj.weight"),
                        down_weight="model.layers.{layer}.mlp.down_proj.weight")
    class OffsetLM:
        def __init__(self, vocab_size: int = 11, d_model: int = 8, d_ff: int = 6, n_layers: int = 2,
                     n_first: int = 5):
            self.vocab_size, self.d_model, self.d_ff, self.n_layers = vocab_size, d_model, d_ff, n_layers
            self.n_first = n_first
            self.picked = [4, 1]

        embedding = Param(Tensor["vocab_size", "d_model", F])
        blocks = Param(Array["n_layers", MLPLayer])

        @forward
        def forward(self, token_ids: Tensor["B", "T", I32], position_ids: Tensor["T", I32],
                    targets: Tensor["B", "T", I32]) -> Tensor["B * T", F]:
            with graph() as g:
                x = g.embedding(token_ids, "embedding")
                xN = g.call("StackedBlocks", x, position_ids, blocks="blocks", n_layers=self.n_layers)
                return g.fused_lm_head_loss(g.view(xN, shape=[B * T, "d_model"]), "embedding", targets)

    return OffsetLM


@pytest.mark.parametrize("offset, expected", [(3, [3, 4]), ("n_first", [5, 6]),
                                              ("n_first - n_layers", [3, 4]), (0, None)])
def test_indexed_mapping_layer_offset(offset: Any, expected: list[int] | None) -> None:
    lm = build_bundle(_offset_lm(offset), {}).module("OffsetLM")
    entry = lm.hf_mappings["blocks"]
    assert lm.hf_layers("blocks", 2) == expected and entry["index"] == "{layer}"
    assert from_json(lm.to_json()) == lm


@pytest.mark.parametrize("layers", [[2, 0], "picked"])
def test_indexed_mapping_layers(layers: Any) -> None:
    lm = build_bundle(_offset_lm(layers=layers), {}).module("OffsetLM")
    assert lm.hf_layers("blocks", 2) == ([2, 0] if layers != "picked" else [4, 1])


@pytest.mark.parametrize("layers", [[1], [0, -1], "n_layers", "missing"])
def test_bad_layers_are_e010(layers: Any) -> None:
    (err,) = compile_model(_offset_lm(layers=layers), {})["errors"]
    assert err["code"] == "E010" and "list of 2 non-negative ints" in err["message"], err


@pytest.mark.parametrize("offset", ["n_missing", -1, 1.5])
def test_bad_layer_offset_is_e010(offset: Any) -> None:
    (err,) = compile_model(_offset_lm(offset), {})["errors"]
    assert err["code"] == "E010" and "layer_offset" in err["message"], err
    assert "test_followups.py" in err["location"]


def test_qwen3_moe_stacks_number_their_hf_layers() -> None:
    def layers(**config: Any) -> dict[str, Any]:
        lm = build_bundle("Qwen3MoEModel", {**TINY, **config}).module("Qwen3MoEModel")
        return {k: list(v["layers"]) for k, v in lm.hf_mappings.items() if isinstance(v, Mapping)
                and v.get("type") == "indexed"}

    assert layers(n_layers=4, mlp_only_layers=[0, 1]) == {"dense_blocks": [0, 1], "blocks": [2, 3]}
    assert layers(n_layers=3, mlp_only_layers=[]) == {"blocks": [0, 1, 2]}
    assert layers(n_layers=4, decoder_sparse_step=2) == {"dense_blocks": [0, 2], "blocks": [1, 3]}


# --- 3. call outputs in the caller's symbols ----------------------------------------------------


@block
class Streams:
    """n_streams copies of width C, scaled per element; the side output is not used by the model."""

    _dims_ = {"SC": "S * C"}  # noqa: RUF012

    def __init__(self, d_model: int, n_streams: int):
        self.d_model, self.n_streams = d_model, n_streams
        self.S = Dim("n_streams")

    scale = Param(Tensor["SC", F])

    @forward
    def forward(self, h: Tensor["B", "T", "SC", F], side: Tensor["B", "T", "SC", F],
                position_ids: Tensor["T", I32]
                ) -> tuple[Tensor["B", "T", "SC", F], Tensor["B", "T", "SC", F]]:
        with graph() as g:
            scaled = g.mul(h, g.view("scale", shape=[1, 1, "SC"]))
            return g.add(h, scaled), g.add(side, scaled)


@model
class StreamLM:
    """The block's S and SC are not symbols of the model, which says n_streams * C."""

    def __init__(self, vocab_size: int = 11, d_model: int = 4, n_streams: int = 3, n_layers: int = 2):
        self.vocab_size, self.d_model = vocab_size, d_model
        self.n_streams, self.n_layers = n_streams, n_layers

    embedding = Param(Tensor["vocab_size", "n_streams * d_model", F])
    head = Param(Tensor["vocab_size", "d_model", F])
    blocks = Param(Array["n_layers", Streams])

    @forward
    def forward(self, token_ids: Tensor["B", "T", I32], position_ids: Tensor["T", I32],
                targets: Tensor["B", "T", I32]) -> Tensor["B * T", F]:
        with graph() as g:
            h0 = g.embedding(token_ids, "embedding")
            hN, _ = g.call("StackedBlocks", h0, h0, position_ids, blocks="blocks", n_layers=self.n_layers)
            xN = g.custom("reduce_sum", g.view(hN, shape=[B, T, "n_streams", "d_model"]), axes=[2])
            return g.fused_lm_head_loss(g.view(xN, shape=[B * T, "d_model"]), "head", targets)


def _dims_of(op_attrs: Mapping[str, Any]) -> set[str]:
    shape = op_attrs.get("shape") or ()
    return {s for d in shape for s in parse_dim(d).free_symbols()}


def test_backward_types_call_outputs_in_the_callers_symbols() -> None:
    bundle = build_bundle(StreamLM, {})
    lm = bundle.module("StreamLM")
    assert "S" not in lm.config
    mods = {m.name: m for m in bundle.modules}
    backward = derive_backward(lm.forward, DeriveBackwardOptions(), modules=mods).backward
    bound = {*dim_bindings(lm.config), "B", "T"}
    shaped = [op for op in backward.ops if "shape" in op.attrs]
    assert {op.type for op in shaped} >= {"view", "zeros"}  # the unused side output gets zeros
    for op in shaped:
        assert _dims_of(op.attrs) <= bound, op
    runtime = Model.from_ir(bundle, dtype="float64", seed=1)
    ids, targets = _batch(11)
    loss, grads = runtime.loss_and_grads(ids, targets)
    assert np.isfinite(loss) and all(np.isfinite(g).all() for g in grads.values())
    first = runtime.train_step({"input_ids": ids, "labels": targets})["loss"]
    assert runtime.loss(ids, targets) < first


def test_hyper_connection_model_needs_no_alias_of_the_block_dims() -> None:
    config = {**TINY, "n_layers": 2, "n_streams": 2, "hc_sinkhorn_iters": 2}
    bundle = build_bundle("HyperConnectionModel", config)
    lm = bundle.module("HyperConnectionModel")
    assert "S" not in lm.config and "n_streams" in lm.config
    ops = {op.type for op in bundle.module("HyperConnectionBlock").forward.ops}
    assert {"div", "sigmoid"} <= ops and "rmsnorm" in ops and "moe_sigmoid" not in ops
    runtime = Model.from_ir(bundle, dtype="float64")
    _, grads = runtime.loss_and_grads(*_batch(37))
    assert all(np.isfinite(g).all() for g in grads.values())


# --- 4. a model's output is loss -------------------------------------------------------------------


@model
class HeadLM:
    def __init__(self, vocab_size: int = 11, d_model: int = 8):
        self.vocab_size, self.d_model = vocab_size, d_model
        self.head = LMHead(Dim("vocab_size"), Dim("d_model"))

    embedding = Param(Tensor["vocab_size", "d_model", F])

    @forward
    def forward(self, token_ids: Tensor["B", "T", I32], position_ids: Tensor["T", I32],
                targets: Tensor["B", "T", I32]) -> Tensor["B * T", F]:
        with graph() as g:
            return g.call(self.head, g.embedding(token_ids, "embedding"), targets)


@model
class NamedLM:
    def __init__(self, vocab_size: int = 11, d_model: int = 8):
        self.vocab_size, self.d_model = vocab_size, d_model

    embedding = Param(Tensor["vocab_size", "d_model", F])

    @save("nll")
    @forward
    def forward(self, token_ids: Tensor["B", "T", I32], position_ids: Tensor["T", I32],
                targets: Tensor["B", "T", I32]) -> Tensor["B * T", F]:
        with graph() as g:
            x = g.view(g.embedding(token_ids, "embedding"), shape=[B * T, "d_model"])
            return g.fused_lm_head_loss(x, "embedding", targets, out_name="nll")


@pytest.mark.parametrize("cls", [HeadLM, NamedLM])
def test_a_models_single_output_is_named_loss(cls: type) -> None:
    payload = compile_model(cls, {})
    # NamedLM's save list keeps only the loss, so its derived backward recomputes what it reads (W003)
    assert payload["success"] and [w for w in payload["warnings"] if w["code"] != "W003"] == [], payload
    assert any(w["code"] == "W003" for w in payload["warnings"]) == (cls is NamedLM)
    bundle = build_bundle(cls, {})
    lm: Module = bundle.module(cls.__name__)
    verify(bundle)
    assert [d.name for d in lm.forward.outputs] == ["loss"]
    assert [op.outputs for op in lm.forward.ops if op.type == "fused_lm_head_loss"] == [("loss", "loss_lse")]
    if cls is NamedLM:
        assert lm.forward.save == ("loss",)  # the save list follows the rename
    else:
        assert [p.name for p in lm.params] == ["embedding", "head.weight"]
    runtime = Model.from_ir(bundle, dtype="float64")
    assert np.isfinite(runtime.loss(*_batch(11)))


@pytest.mark.parametrize(("config", "culprit", "expected"), [
    ({"d_model": "16"}, "d_model", "int"), ({"use_qk_norm": 1}, "use_qk_norm", "bool"),
    ({"mlp_only_layers": [0, "1"]}, "mlp_only_layers", "list or None"), ({"eps": "1e-6"}, "eps", "float"),
])
def test_a_config_value_of_the_wrong_type_is_e012_naming_it(config: dict[str, Any], culprit: str,
                                                          expected: str) -> None:
    from kiln.dsl import config_type_errors

    name = "Qwen3MoEModel"
    (err,) = compile_model(name, {**TINY, **config})["errors"]
    assert err["code"] == "E012"
    assert f"config value {culprit} of {name}: expected {expected}" in err["message"]
    assert [(k, e) for k, _, e in config_type_errors(name, {**TINY, **config})] == [(culprit, expected)]


def test_config_values_of_the_annotated_types_pass() -> None:
    from kiln.dsl import config_type_errors

    fine = {**TINY, "rope_theta": 10000, "head_size": None, "mlp_only_layers": [0], "norm_topk_prob": True}
    assert config_type_errors("Qwen3MoEModel", fine) == []
    assert compile_model("Qwen3MoEModel", fine)["success"]
