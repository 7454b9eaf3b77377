"""The lora graph pass on a small model written in IR (kiln-core only): the ops it adds, kiln's own
module names where a weight has no HF mapping, frozen base weights, and gradients against float64
finite differences."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest

from kiln.core import Model
from kiln.core.ir import Bundle, Graph, LoraTarget, Module, Op, ParamSpec, TensorDecl, from_json
from kiln.peft import AdapterError, LoraConfig, get_peft_model, lora

CONFIG = {"V": 11, "C": 6, "L": 2}
ACT = ["B", "T", "C"]


def tiny(up_transpose: str = "NT") -> Bundle:
    """Embedding, two layers of ``x + down(silu_mul(up(norm(x))))`` (``up`` fused [gate | up]), LM head."""
    params = [("norm.weight", ["C"], {"kind": "ones"}, ()),
              ("up.weight", ["2 * C", "C"], {"kind": "normal", "std": 0.3},
               (LoraTarget("gate", 0, "C"), LoraTarget("up", "C", "C"))),
              ("down.weight", ["C", "C"], {"kind": "normal", "std": 0.3}, (LoraTarget("down"),))]
    block = Module(
        "Block", kind="block", config=CONFIG,
        params=[ParamSpec(n, s, "fp32", init=i, lora_targets=t) for n, s, i, t in params],
        forward=Graph(
            "Block", inputs=[TensorDecl("x", ACT, "fp32")],
            params=[TensorDecl(n, s, "fp32") for n, s, _, _ in params],
            ops=[Op("rmsnorm", ["x", "norm.weight"], ["h", "rstd"]),
                 Op("view", ["h"], ["h_flat"], {"shape": ["B * T", "C"]}),
                 Op("matmul", ["h_flat", "up.weight"], ["gu"], {"transpose": up_transpose}),
                 Op("split", ["gu"], ["g", "u"], {"sizes": ["C", "C"], "dim": 1}),
                 Op("silu_mul", ["g", "u"], ["a"]),
                 Op("matmul", ["a", "down.weight"], ["d_flat"], {"transpose": "NT"}),
                 Op("view", ["d_flat"], ["d"], {"shape": ACT}),
                 Op("add", ["x", "d"], ["y"])],
            outputs=[TensorDecl("y", ACT, "fp32")]))
    model = Module(
        "Tiny", kind="model", config=CONFIG,
        params=[ParamSpec("embedding", ["V", "C"], "fp32", init={"kind": "normal", "std": 0.5}),
                ParamSpec("blocks", [], "fp32", array_of="Block", count="L")],
        forward=Graph(
            "Tiny", inputs=[TensorDecl(n, ["B", "T"], "int32") for n in ("token_ids", "targets")],
            params=[TensorDecl("embedding", ["V", "C"], "fp32"), TensorDecl("blocks", [], "fp32")],
            ops=[Op("embedding", ["token_ids", "embedding"], ["x0"]),
                 Op("call", ["x0"], ["xN"], {"module": "Block", "n_layers": "L", "params": "blocks"}),
                 Op("view", ["xN"], ["x_flat"], {"shape": ["B * T", "C"]}),
                 Op("view", ["targets"], ["t_flat"], {"shape": ["B * T"]}),
                 Op("fused_lm_head_loss", ["x_flat", "embedding", "t_flat"], ["loss", "lse"])],
            outputs=[TensorDecl("loss", ["B * T"], "fp32")]))
    return Bundle([model, block], entry="Tiny")


def config(**kw: Any) -> LoraConfig:
    kw = {"r": 2, "lora_alpha": 3, "target_modules": ["up", "down"], "init_lora_weights": False, **kw}
    return LoraConfig(**kw)


def test_the_pass_adds_a_branch_per_target_and_freezes_the_base() -> None:
    out = lora(tiny(), config(lora_dropout=0.2))
    assert out == from_json(out.to_json())  # still plain IR: exact JSON round trip
    out.verify()
    block = out.module("Block")
    assert [str(op) for op in block.forward.ops[2:9]] == [
        'gu.lora_base = matmul(h_flat, up.weight) {transpose="NT"}',
        f'gu.up.lora_x = dropout(h_flat) {{p=0.2, seed={block.forward.ops[3].attrs["seed"]}}}',
        'gu.up.lora_h = matmul(gu.up.lora_x, up.weight.up.lora_A) {transpose="NT"}',
        'gu.lora_part0, gu.lora_part1 = split(gu.lora_base) {sizes=["C", "C"], dim=1}',
        "gu.up.lora_out = matmul(gu.up.lora_h, up.weight.up.lora_B, gu.lora_part1) "
        '{transpose="NT", alpha=1.5}',
        "gu = concat(gu.lora_part0, gu.up.lora_out) {dim=1}",
        'g, u = split(gu) {sizes=["C", "C"], dim=1}',
    ]
    specs = {p.name: p for p in block.params}
    assert [str(d) for d in specs["up.weight.up.lora_B"].shape] == ["C", "2"]
    assert not specs["down.weight.down.lora_A"].frozen and specs["down.weight"].frozen
    assert out.module("Tiny").param("embedding").frozen and not out.module("Tiny").param("blocks").frozen
    assert out.module("Tiny").metadata["lora"]["lora_dropout"] == 0.2


def test_without_hf_mappings_kiln_names_the_modules() -> None:
    pm = get_peft_model(Model.from_ir(tiny()), config())
    assert [s.paths for s in pm.sites] == [("blocks.0.up.weight.up", "blocks.1.up.weight.up"),
                                           ("blocks.0.down.weight.down", "blocks.1.down.weight.down")]
    assert "base_model.model.blocks.1.up.weight.up.lora_B.weight" in pm.adapter_state_dict()
    assert len(get_peft_model(Model.from_ir(tiny()), config(target_modules="all-linear")).sites) == 3


def test_adapter_gradients_match_finite_differences() -> None:
    pm = get_peft_model(Model.from_ir(tiny(), dtype="float64", seed=2), config(target_modules="all-linear"))
    ids = np.random.default_rng(0).integers(0, CONFIG["V"], (2, 5))
    _, grads = pm.loss_and_grads(ids, ids[:, ::-1], names="kiln")
    assert set(grads) == {k for s in pm.sites for k, _, _ in s.tensors()}
    rng = np.random.default_rng(1)
    for name, g in grads.items():
        value = pm.parameters()[name]
        for idx in [tuple(rng.integers(0, n) for n in value.shape) for _ in range(2)]:
            losses = []
            for h in (1e-6, -1e-6):
                bumped = value.copy()
                bumped[idx] += h
                pm.set_parameters({name: bumped})
                losses.append(pm.loss(ids, ids[:, ::-1]))
            pm.set_parameters({name: value})
            assert g[idx] == pytest.approx((losses[0] - losses[1]) / 2e-6, rel=1e-5, abs=1e-9), (name, idx)


def test_only_projections_y_equals_x_w_transposed_are_adapted() -> None:
    with pytest.raises(AdapterError, match=r"'up.weight'.*op #2 .*transpose NT"):
        lora(tiny(up_transpose="NN"), config())
    bundle = tiny()
    block = bundle.module("Block")
    ops = (*block.forward.ops[:-3], Op("view", ["a"], ["d"], {"shape": ACT}), Op("add", ["x", "d"], ["y"]))
    unread = attrs.evolve(block, forward=attrs.evolve(block.forward, ops=ops))
    with pytest.raises(AdapterError, match=r"'down\.weight'.*no matmul"):
        lora(attrs.evolve(bundle, modules=(bundle.modules[0], unread)), config())


def test_a_model_with_adapters_is_not_adapted_twice() -> None:
    with pytest.raises(AdapterError, match="has LoRA adapters already"):
        lora(lora(tiny(), config()), config())
