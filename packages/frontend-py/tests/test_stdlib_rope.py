"""RoPE options of the standard library: a from-scratch model's ``rope_parameters`` (scaled kinds, a
partial rotary dim) become a ``rope_freqs`` table inside each block, bad settings are E027, and the
recompute planners replay such a block bit for bit; the blocks' ``rope_interleaved`` reaches the op.
Numerics of the ops themselves: kiln-core's test_ops_conformance_rope.py; equality with kiln-hf's
loaded tables: kiln-hf's test_dsl_scaled_rope.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kiln.core import Model
from kiln.core.autodiff import verify_backward
from kiln.core.ir import dim_bindings, thaw
from kiln.dsl import build_bundle, compile_model
from kiln.dsl.stdlib.blocks import DenseTransformerBlock  # by class: tests register blocks of that name

TINY = {"vocab_size": 32, "d_model": 16, "n_layers": 2, "num_query_heads": 2, "num_kv_heads": 1,
        "d_ff": 24, "max_seq": 12, "head_size": 8, "rope_theta": 100.0}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 4}


def _rope_ops(bundle: Any, block: str = "DenseTransformerBlock") -> dict[str, dict[str, Any]]:
    return {op.type: thaw(op.attrs) for op in bundle.module(block).forward.ops if "rope" in op.type}


def test_plain_rope_has_no_table() -> None:
    assert set(_rope_ops(build_bundle("Qwen3Model", TINY))) == {"qkv_qk_norm_rope"}


@pytest.mark.parametrize(("rope", "table"), [
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, {"rope_type": "linear", "factor": 2.0}),
    ({"rope_parameters": {**LLAMA3, "rope_theta": 7.0}}, {**LLAMA3, "theta": 7.0}),
    # transformers: original_max_position_embeddings defaults to max_position_embeddings
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}},
     {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 12}),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
     {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 12}),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, {"rotary_dim": 4}),
])
def test_rope_parameters_become_a_table_in_every_block(rope: dict[str, Any], table: dict[str, Any]) -> None:
    ops = _rope_ops(build_bundle("Qwen3Model", {**TINY, **rope}))
    freqs = ops["rope_freqs"]
    assert freqs["rows"] == 12 and {k: freqs[k] for k in table} == table
    assert ops["qkv_qk_norm_rope"]["rotary_dim"] == freqs["rotary_dim"]


@pytest.mark.parametrize("rope", [{"rope_type": "llama3", "factor": 8.0}, {"rope_type": "longrope"},
                                  {"rope_type": "default", "partial_rotary_factor": 0.375}])
def test_rope_settings_kiln_cannot_compute_are_e027(rope: dict[str, Any]) -> None:
    errors = compile_model("LlamaModel", {**TINY, "rope_parameters": rope})["errors"]
    assert [e["code"] for e in errors] == ["E027"] and "rope_type must be one of" in errors[0]["message"]


@pytest.mark.parametrize("recompute", ["dsl", "auto", "block"])
def test_a_scaled_rope_block_replays_bit_for_bit(recompute: str) -> None:
    bundle = build_bundle("Qwen3Model", {**TINY, "rope_parameters": {**LLAMA3, "partial_rotary_factor": 0.5}})
    rng = np.random.default_rng(0)
    ids, targets = rng.integers(0, 32, (2, 6)), rng.integers(0, 32, (2, 6))
    base = Model.from_ir(bundle, seed=1)
    loss0, ref = base.loss_and_grads(ids, targets)
    model = Model.from_ir(bundle, seed=1, recompute=recompute, recompute_budget=0.5 if recompute == "auto"
                          else None)
    assert any(s.recompute for s in model.program(2, 6).steps)
    loss, grads = model.loss_and_grads(ids, targets)
    assert loss == loss0
    for name, g in ref.items():
        assert np.array_equal(grads[name], g), name


def test_interleaved_rope_reaches_the_block_op_and_its_gradient_holds() -> None:
    config = {k: v for k, v in TINY.items() if k not in ("vocab_size", "n_layers", "rope_theta")}
    block = build_bundle(DenseTransformerBlock, {**config, "rope_interleaved": True, "use_qk_norm": True,
                                                   "scaled_rope": {"rope_type": "linear", "factor": 2.0,
                                                                   "rotary_dim": 8}}
                         ).module("DenseTransformerBlock")
    (rope,) = [op for op in block.forward.ops if op.type == "qkv_qk_norm_rope"]
    assert thaw(rope.attrs)["interleaved"] is True
    errors = verify_backward(block.forward, bindings={**dim_bindings(block.config), "B": 1, "T": 3},
                             loss_name=block.forward.outputs[0].name)
    assert max(errors.values()) < 1e-6, errors


@pytest.mark.parametrize("recompute", ["dsl", "block"])
def test_a_scaled_rope_block_replays_its_table_under_lora(recompute: str) -> None:
    """In LoRA mode the dsl hints recompute ``qkv_rope`` too: its replay recomputes the table."""
    peft = pytest.importorskip("kiln.peft", reason="the LoRA pass comes from kiln-peft")
    bundle = build_bundle("Qwen3Model", {**TINY, "rope_parameters": LLAMA3})
    bundle = peft.lora(bundle, peft.LoraConfig(r=2, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    rng = np.random.default_rng(1)
    ids, targets = rng.integers(0, 32, (2, 6)), rng.integers(0, 32, (2, 6))
    loss0, ref = Model.from_ir(bundle, seed=1, mode="lora").loss_and_grads(ids, targets)
    model = Model.from_ir(bundle, seed=1, mode="lora", recompute=recompute)
    assert any(s.recompute and s.op.type == "rope_freqs" for s in model.program(2, 6).steps)
    loss, grads = model.loss_and_grads(ids, targets)
    assert loss == loss0 and all(np.array_equal(grads[k], g) for k, g in ref.items())
