"""The mHC block's bias-dropout-add (``bda_bias``, ``hidden_dropout``): gradients against finite
differences, dropout on in training and off in eval, its masks replayed bit for bit by block-mode and
automatic recompute, and exactly what block mode keeps of an mHC layer (seed 001: the block input)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kiln.core import Model, compile
from kiln.core.autodiff import verify_backward
from kiln.core.ir import dim_bindings
from kiln.dsl import build_bundle

MHC = {"vocab_size": 32, "d_model": 8, "n_layers": 2, "num_query_heads": 2, "num_kv_heads": 1, "d_ff": 12,
       "max_seq": 8, "n_streams": 2, "hc_sinkhorn_iters": 2}
BDA = {"bda_bias": True, "hidden_dropout": 0.25, "dropout_seed": 11}


def _batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(6)
    return rng.integers(0, 32, (2, 5)), rng.integers(0, 32, (2, 5))


def _with_biases(model: Model) -> Model:
    rng = np.random.default_rng(1)
    model.set_parameters({k: 0.5 * rng.standard_normal(v.shape) for k, v in model.parameters().items()
                          if k.endswith("_bda_bias")})
    return model


@pytest.mark.parametrize("bda", [{"bda_bias": True}, BDA], ids=["bias", "bias-dropout"])
def test_mhc_block_with_bias_dropout_add_matches_finite_differences(bda: dict[str, Any]) -> None:
    config = {k: v for k, v in MHC.items() if k not in ("vocab_size", "n_layers")}
    bundle = build_bundle("HyperConnectionBlock", {**config, "head_size": 4, **bda})
    block = bundle.module("HyperConnectionBlock")
    assert {"attn_bda_bias", "mlp_bda_bias"} <= {p.name for p in block.params}
    assert sum(op.type == "dropout" for op in block.forward.ops) == (2 if "hidden_dropout" in bda else 0)
    errors = verify_backward(block.forward, bindings={**dim_bindings(block.config), "B": 1, "T": 3},
                             loss_name=block.forward.outputs[0].name)
    assert max(errors.values()) < 1e-6, errors
    assert {"attn_bda_bias", "mlp_bda_bias"} <= set(errors)


def test_bias_changes_the_loss_and_dropout_is_off_in_eval() -> None:
    ids, targets = _batch()
    plain = Model.from_ir(build_bundle("HyperConnectionModel", MHC), dtype="float64", seed=3)
    biased = Model.from_ir(build_bundle("HyperConnectionModel", {**MHC, "bda_bias": True}), dtype="float64")
    biased.set_parameters(plain.parameters())
    assert biased.loss(ids, targets) == plain.loss(ids, targets)  # zero biases at init
    _with_biases(biased)
    assert abs(biased.loss(ids, targets) - plain.loss(ids, targets)) > 1e-4
    dropped = Model.from_ir(build_bundle("HyperConnectionModel", {**MHC, **BDA}), dtype="float64")
    dropped.set_parameters(biased.parameters())
    assert dropped.loss(ids, targets) == biased.loss(ids, targets)  # eval: no dropout
    assert abs(dropped.loss(ids, targets, training=True) - biased.loss(ids, targets)) > 1e-4


@pytest.mark.parametrize("recompute", [("block", None), ("auto", 0.1)], ids=["block", "auto"])
def test_dropout_inside_an_mhc_block_replays_bit_for_bit(recompute: tuple[str, Any]) -> None:
    bundle = build_bundle("HyperConnectionModel", {**MHC, **BDA})
    ids, targets = _batch()
    loss0, ref = _with_biases(Model.from_ir(bundle, seed=2)).loss_and_grads(ids, targets)
    mode, budget = recompute
    model = _with_biases(Model.from_ir(bundle, seed=2, recompute=mode, recompute_budget=budget))
    replayed = [s for s in model.program(2, 5).steps if s.recompute and s.op.type == "dropout"]
    assert replayed, "the plan replays no dropout"  # auto: only a tight budget makes it replay them
    loss, grads = model.loss_and_grads(ids, targets)
    assert loss == loss0 and grads.keys() == ref.keys()
    for name, g in ref.items():
        assert np.array_equal(grads[name], g), name


def test_block_mode_keeps_only_the_mhc_block_input() -> None:
    """Seed 001: of an mHC layer, block mode keeps the block input ``h`` (and the positions and segments
    it reads), nothing else. ``attn_hc_in`` and ``attn_streams`` are views of ``h`` (0 bytes of their
    own); every other tensor the backward reads, dropout outputs included, is recomputed."""
    bundle = build_bundle("HyperConnectionModel", {**MHC, **BDA})
    (plan,) = compile(bundle, bindings={"B": 2, "T": 5}, recompute="block").recompute.blocks
    assert plan.module == "HyperConnectionBlock" and plan.whole_block
    assert set(plan.saved) == {"h", "position_ids", "segment_ids", "attn_hc_in", "attn_streams"}
    h_bytes = 2 * 5 * 2 * 8 * 4  # [B, T, n_streams * C] fp32
    assert (plan.bytes["h"], plan.bytes["attn_hc_in"], plan.bytes["attn_streams"]) == (h_bytes, 0, 0)
    assert {"attn_dropped", "mlp_dropped", "attn_biased", "mlp_biased", "h_mid"} <= set(plan.recomputed)
    dropouts = [op for rop in plan.ops for op in rop.replay if op.type == "dropout"]
    assert sorted(op.attrs["offset"] for op in dropouts) == [0, 1 << 31]
