"""The recompute planner (issue 6): dsl plans from slot hints, policy gating, conditions, errors that name
slots, bit-exact gradients for every mode, memory on the benchmark config, buffer sharing, the hook, the CLI.

Models: the tiny Qwen3 written in IR (with an IR activation layout for dsl mode, and a variant with
dropout), and, when kiln-dsl is installed, its Qwen3Model, Qwen3MoEModel and HyperConnectionModel. LoRA
training runs on a hand-made adapter (``with_lora``): the LoRA graph pass belongs to kiln-peft.
"""

from __future__ import annotations

import json
import re
import tracemalloc
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kiln_core_tiny import random_batch, tiny_qwen3_bundle, with_dropout

from kiln.core import KilnError, Model, PluginError, compile, hookimpl, register_plugin, reset_plugins
from kiln.core.cli._cli import main
from kiln.core.ir import ActivationLayout, ActivationSlot, Bundle, Graph, Module, Op, ParamSpec, TensorDecl
from kiln.core.recompute import (
    BlockPlan,
    RecomputeOp,
    RecomputePlan,
    layout_ops,
    plan_context,
    plan_recompute,
)

MiB = 1 << 20
BENCH = {"vocab_size": 8192, "d_model": 256, "n_layers": 4, "num_query_heads": 4, "num_kv_heads": 2,
         "head_size": 64, "d_ff": 768}
BENCH_BINDS = {"B": 8, "T": 256}
SEED_ORDER = ["ln1_fused", "qkv", "qk_norm_rope", "attn_fwd", "att_out", "ln2_fused", "mlp_up", "swiglu"]
LORA_ONLY = ["qkv", "qkv_rope", "q_rstd", "k_rstd", "att", "lse", "att_out", "mlp_up", "swiglu"]


def dsl(name: str, **config: Any) -> Bundle:
    kiln_dsl = pytest.importorskip("kiln.dsl")
    cfg = {"vocab_size": 64, "d_model": 16, "n_layers": 2, "num_query_heads": 2, "num_kv_heads": 1,
           "head_size": 8, "d_ff": 32, "max_seq": 64, **config}
    bundle: Bundle = kiln_dsl.build_bundle(name, cfg)
    return bundle


# ---------------------------------------------------------------------------------------------
# IR models


def slot(name: str, **kw: Any) -> ActivationSlot:
    return ActivationSlot(name, ["B", "T", "C"], "fp32", **kw)


def tiny_layout(dropout: bool = False) -> ActivationLayout:
    """The tiny IR block's slots, declared as seed 000 §2 declares DenseTransformerBlock's."""
    lora = {"recompute": True, "recompute_policy": "lora_only"}
    proj = "attn.proj_drop" if dropout else "attn.proj"
    slots = [
        slot("attn_norm.rstd", save=True), slot("mlp_norm.rstd", save=True),
        slot("attn.lse", recompute_group="attn_fwd", **lora),
        slot("attn.q_rstd", recompute_group="qk_norm_rope", **lora),
        slot("attn.k_rstd", recompute_group="qk_norm_rope", **lora),
        slot("res1", recompute=True, recompute_group="ln1_fused", recompute_outputs=["res1", "attn_norm.y"],
             recompute_from=["@input:residual", "@input:x", "attn_norm.rstd", "@param:attn_norm.weight"],
             recompute_op="fused_residual_rmsnorm_apply_saved"),
        slot("attn_norm.y", aliases=["attn.x_flat"], recompute=True, recompute_group="ln1_fused"),
        slot("attn.qkv", aliases=["attn.qkv_flat"], recompute_from=["attn_norm.y", "@param:attn.qkv_weight"],
             recompute_op="matmul", lora_targets=["q", "k", "v"], **lora),
        slot("attn.qkv_rope", recompute_group="qk_norm_rope",
             recompute_outputs=["attn.qkv_rope", "attn.q_rstd", "attn.k_rstd"],
             recompute_from=["attn.qkv", "@input:position_ids", "?@param:attn.q_norm_weight",
                             "?@param:attn.k_norm_weight", "?@global:freq_cis"],
             recompute_op="qkv_qk_norm_rope", **lora),
        slot("attn.out", aliases=["attn.out_flat"], recompute_group="attn_fwd",
             recompute_outputs=["attn.out", "attn.lse"], recompute_from=["attn.qkv_rope"],
             recompute_op="flash_attention", **lora),
        slot("attn.proj", aliases=["attn.proj_flat"], recompute_from=["attn.out", "@param:attn.out_weight"],
             recompute_op="matmul", lora_targets=["o"], **lora),
        slot("res2", recompute=True, recompute_group="ln2_fused", recompute_outputs=["res2", "mlp_norm.y"],
             recompute_from=["res1", proj, "mlp_norm.rstd", "@param:mlp_norm.weight"],
             recompute_op="fused_residual_rmsnorm_apply_saved"),
        slot("mlp_norm.y", aliases=["mlp.x_flat"], recompute=True, recompute_group="ln2_fused"),
        slot("mlp.gate_up", recompute_from=["mlp_norm.y", "@param:mlp.up_weight"], recompute_op="matmul",
             lora_targets=["up", "gate"], **lora),
        slot("mlp.act", recompute_from=["mlp.gate_up"], recompute_op="swiglu", **lora),
    ]
    if dropout:
        slots.append(slot("attn.proj_drop", recompute=True, recompute_from=["attn.proj"],
                          recompute_op="dropout"))
    return ActivationLayout(slots)


def with_layout(bundle: Bundle, layout: ActivationLayout) -> Bundle:
    return bundle.evolve(modules=[m.evolve(activations=layout) if m.kind == "block" else m
                                  for m in bundle.modules])


def with_lora(bundle: Bundle, rank: int = 2) -> Bundle:
    """A LoRA adapter on every block matmul that reads a weight: ``y = x W^T + 2 / r * (x A^T) B^T``.
    Adapter parameters (``<weight>.lora_A`` / ``.lora_B``) have the role ``adapter``, so LoRA mode
    trains only them."""
    mods = []
    for m in bundle.modules:
        g = m.forward
        if m.kind != "block" or g is None:
            mods.append(m)
            continue
        weights = {d.name: d for d in g.params}
        ops: list[Op] = []
        decls: list[TensorDecl] = []
        specs: list[ParamSpec] = []
        for op in g.ops:
            w = op.inputs[1] if op.type in ("matmul", "matmul_bias") else ""
            if w not in weights or op.attrs.get("transpose", "NT") != "NT":
                ops.append(op)
                continue
            out, x, (n_out, n_in) = op.outputs[0], op.inputs[0], weights[w].shape
            for name, shape in ((f"{w}.lora_A", [rank, n_in]), (f"{w}.lora_B", [n_out, rank])):
                decls.append(TensorDecl(name, shape, "fp32"))
                specs.append(ParamSpec(name, shape, "fp32", init={"kind": "normal", "std": 0.3},
                                       role="adapter"))
            ops += [op.evolve(outputs=(f"{out}.base",)),
                    Op("matmul", [x, f"{w}.lora_A"], [f"{out}.lora_a"], {"transpose": "NT"}),
                    Op("matmul", [f"{out}.lora_a", f"{w}.lora_B"], [f"{out}.lora_b"], {"transpose": "NT"}),
                    Op("scale", [f"{out}.lora_b"], [f"{out}.lora"], {"factor": 2.0 / rank}),
                    Op("add", [f"{out}.base", f"{out}.lora"], [out])]
        forward = g.evolve(params=(*g.params, *decls), ops=ops)
        mods.append(m.evolve(params=(*m.params, *specs), forward=forward))
    return bundle.evolve(modules=mods)


def ir_model(dropout: bool = False, **kw: Any) -> Bundle:
    kw = {"num_layers": 3, "initializer_range": 0.2, **kw}
    bundle = tiny_qwen3_bundle(**kw)
    if dropout:
        bundle = with_dropout(bundle)
    return with_layout(bundle, tiny_layout(dropout))


# ---------------------------------------------------------------------------------------------
# 1. the dsl plan of DenseTransformerBlock (seed 000 §2)


def test_dense_block_dsl_plan_has_the_seeds_groups_and_order() -> None:
    block = dsl("Qwen3Model").module("DenseTransformerBlock")
    ops, gated = layout_ops(block, "lora")
    assert [op.name for op in ops] == SEED_ORDER
    assert gated == ()
    by = {op.name: op for op in ops}
    assert by["ln1_fused"].outputs == ("res_ffn", "ln1")
    assert by["ln1_fused"].inputs == ("@input:residual", "@input:x", "ln1_rstd", "@param:ln1_weight")
    assert by["ln1_fused"].op_type == "fused_residual_rmsnorm_apply_saved"
    assert by["qk_norm_rope"].outputs == ("qkv_rope", "q_rstd", "k_rstd")
    assert by["attn_fwd"].outputs == ("att", "lse") and by["attn_fwd"].op_type == "flash_attention"
    assert by["ln2_fused"].outputs == ("res_att", "ln2")
    assert by["qkv"].lora_targets == ("q", "k", "v") and by["mlp_up"].lora_targets == ("up", "gate")
    assert by["qkv"].attrs["_matmul_op"] == "qkv" and by["qkv"].policy == "lora_only"
    # full fine-tuning: the lora_only ops are gated off, their slots saved
    ops, gated = layout_ops(block, "full")
    assert [op.name for op in ops] == ["ln1_fused", "ln2_fused"]
    assert set(gated) == set(LORA_ONLY)


def test_lora_only_slots_are_saved_in_full_mode_and_recomputed_in_lora_mode() -> None:
    bundle = with_lora(dsl("Qwen3Model"))
    for training in ("full", "lora"):
        plan = compile(bundle, bindings={"B": 2, "T": 4}, mode=training, recompute="dsl").recompute
        b = plan.block("DenseTransformerBlock")
        assert b is not None
        saved, recomputed = set(b.saved), set(b.recomputed)
        assert {"res_ffn", "ln1", "res_att", "ln2"} <= recomputed  # policy always
        for name in LORA_ONLY:
            assert (name in recomputed) == (training == "lora"), (training, name)
            assert (name in saved) == (training == "full"), (training, name)
        assert {"ln1_rstd", "ln2_rstd"} <= saved
        assert {"q_rstd", "k_rstd", "lse", "att", "qkv_rope"} <= (saved if training == "full" else recomputed)
        # the replay of the lora_only ops runs the forward kernels, LoRA branch included
        if training == "lora":
            qkv = b.op("qkv")
            assert [op.type for op in qkv.replay].count("matmul") == 3 and qkv.replay[-1].type == "view"
            assert b.op("ln1_fused").replay[0].type == "fused_residual_rmsnorm_apply_saved"


# ---------------------------------------------------------------------------------------------
# 3. conditions


def test_use_qk_norm_and_qkv_bias_change_the_plan_as_the_conditions_say() -> None:
    plans = {}
    for qk_norm in (True, False):
        for bias in (True, False):
            bundle = dsl("Qwen3Model", use_qk_norm=qk_norm, use_qkv_bias=bias)
            ops, _ = layout_ops(bundle.module("DenseTransformerBlock"), "lora")
            by = {op.name: op for op in ops}
            rope, qkv = by["qk_norm_rope"], by["qkv"]
            assert rope.outputs == (("qkv_rope", "q_rstd", "k_rstd") if qk_norm else ("qkv_rope",))
            assert ("@param:q_norm_weight" in rope.inputs) == qk_norm
            assert ("@param:k_norm_weight" in rope.inputs) == qk_norm
            assert ("@param:qkv_bias" in qkv.inputs) == bias
            assert "@global:freq_cis" not in rope.inputs  # optional and absent
            lora = with_lora(bundle)
            b = compile(lora, bindings={"B": 2, "T": 4}, mode="lora", recompute="dsl").recompute.block(
                "DenseTransformerBlock")
            assert b is not None
            # the replay takes the forward's kernels: matmul_bias when the bias is there, then the adapter's
            assert [op.type for op in b.op("qkv").replay if "matmul" in op.type] == \
                [("matmul_bias" if bias else "matmul"), "matmul", "matmul"]
            plans[qk_norm, bias] = b
    assert plans[True, True].ops != plans[False, False].ops


# ---------------------------------------------------------------------------------------------
# 6. errors name the slots


def _block(*slots: ActivationSlot, forward: Graph | None = None, **config: Any) -> Module:
    params = [ParamSpec(d.name, d.shape, d.dtype) for d in forward.params] if forward is not None else []
    return Module("B", kind="block", config={"use_qk_norm": False, **config},
                  activations=ActivationLayout(slots), forward=forward, params=params)


@pytest.mark.parametrize(("slots", "code", "names"), [
    ([slot("a", recompute=True, recompute_from=["zzz"], recompute_op="relu")], "E021", ["'a'", "'zzz'"]),
    ([slot("a", recompute=True)], "E021", ["'a'", "neither recompute_from"]),
    ([slot("a", recompute=True, recompute_from=["q"], recompute_op="relu"),
      slot("q", condition="use_qk_norm")], "E021", ["'a'", "'q'", "use_qk_norm"]),
    ([slot("a", recompute=True, recompute_from=["@param:w"], recompute_op="relu")], "E021", ["'a'", "'w'"]),
    ([slot("a", recompute=True, recompute_from=["t"], recompute_op="relu"),
      slot("t", memory_hint="temporary")], "E021", ["'a'", "'t'", "temporary"]),
    ([slot("a", recompute=True, recompute_group="g"), slot("b", recompute=True, recompute_group="g")], "E021",
     ["'g'", "'a'", "'b'"]),
    ([slot("a", recompute=True, recompute_from=["b"], recompute_op="relu"),
      slot("b", recompute=True, recompute_from=["c"], recompute_op="relu"),
      slot("c", recompute=True, recompute_from=["a"], recompute_op="relu")], "E022", ["'a'", "'b'", "'c'"]),
    ([slot("a", recompute=True, recompute_from=["a"], recompute_op="relu")], "E022", ["'a'"]),
    ([slot("a", recompute=True, recompute_from=["x"], recompute_op="relu", recompute_outputs=["a", "b"]),
      slot("b", recompute=True, recompute_from=["y"], recompute_op="gelu"), slot("x"), slot("y")],
     "E017", ["'b'", "'a'"]),
    ([slot("a", recompute=True, recompute_group="g", recompute_from=["x"], recompute_op="relu"),
      slot("b", recompute=True, recompute_group="g", recompute_from=["x"], recompute_op="gelu"), slot("x")],
     "E013", ["'g'", "'a'", "'b'"]),
    ([slot("a", recompute=True, recompute_group="g", recompute_from=["x"], recompute_op="relu"),
      slot("b", recompute=True, recompute_group="g", recompute_policy="lora_only"), slot("x")],
     "E013", ["'g'", "'a'", "'b'", "lora_only"]),
])
def test_layout_errors_name_the_slots(slots: list[ActivationSlot], code: str, names: list[str]) -> None:
    with pytest.raises(KilnError) as err:
        layout_ops(_block(*slots), "lora")
    assert err.value.code == code, err.value
    for name in names:
        assert name in str(err.value), (name, str(err.value))


def test_identical_ops_merge_and_outputs_absent_by_condition_are_dropped() -> None:
    def split(name: str, dim: int) -> ActivationSlot:
        return slot(name, recompute=True, recompute_from=["x"], recompute_op="split",
                    recompute_attrs={"dim": dim})

    twins = [split("a", 1), split("b", 1), split("c", 2), slot("x")]
    ops, _ = layout_ops(_block(*twins), "full")
    assert [(op.name, op.outputs) for op in ops] == [("a", ("a", "b")), ("c", ("c",))]
    group = [slot("y", recompute=True, recompute_group="g", recompute_outputs=["y", "stat", "extra"],
                  recompute_from=["x", "?stat_in"], recompute_op="rmsnorm"),
             slot("stat", recompute=True, recompute_group="g", condition="use_qk_norm"),
             slot("extra", recompute=True, recompute_group="g", condition="not use_qk_norm"),
             slot("stat_in", condition="use_qk_norm"), slot("x")]
    for qk_norm in (True, False):
        (op,), _ = layout_ops(_block(*group, use_qk_norm=qk_norm), "full")
        assert op.outputs == (("y", "stat") if qk_norm else ("y", "extra"))
        assert op.inputs == (("x", "stat_in") if qk_norm else ("x",))


def test_a_slot_not_derivable_from_its_declared_inputs_is_e021() -> None:
    act = ["B", "T", "C"]
    g = Graph("B", inputs=[TensorDecl("x", act, "fp32")], params=[TensorDecl("w", ["C"], "fp32")],
              ops=[Op("silu", ["x"], ["h"]), Op("mul", ["h", "w"], ["m"]), Op("relu", ["m"], ["y"])],
              outputs=[TensorDecl("y", act, "fp32")])
    ok = _block(slot("h"), slot("m", recompute=True, recompute_from=["h", "@param:w"], recompute_op="mul"),
                forward=g, C=4)
    missing = _block(slot("h"), slot("m", recompute=True, recompute_from=["@param:w"], recompute_op="mul"),
                     forward=g, C=4)
    ctx = plan_context(Bundle([_host(ok), ok], entry="M"), bindings={"B": 1, "T": 2})
    assert plan_recompute(ctx, "dsl").blocks[0].recomputed == ("m",)
    ctx = plan_context(Bundle([_host(missing), missing], entry="M"), bindings={"B": 1, "T": 2})
    with pytest.raises(KilnError, match=r"\[E021\].*slot 'm' is not derivable .*reads slot 'h'"):
        plan_recompute(ctx, "dsl")


def _host(block: Module) -> Module:
    """A model that runs ``block`` twice and sums its output into a loss."""
    act = ["B", "T", "C"]
    return Module("M", kind="model", config={"C": 4}, params=[
        ParamSpec("blocks", [], "fp32", array_of="B", count=2), ParamSpec("w0", ["C"], "fp32")],
        forward=Graph("M", inputs=[TensorDecl("x", act, "fp32")],
                      params=[TensorDecl("blocks", [], "fp32"), TensorDecl("w0", ["C"], "fp32")],
                      ops=[Op("mul", ["x", "w0"], ["x0"]),
                           Op("call", ["x0"], ["xN"], {"module": "B", "n_layers": 2, "params": "blocks"}),
                           Op("reduce_sum", ["xN"], ["loss"], {"axes": [2]}),
                           Op("view", ["loss"], ["loss_flat"], {"shape": ["B * T"]})],
                      outputs=[TensorDecl("loss", ["B", "T"], "fp32")]))


# ---------------------------------------------------------------------------------------------
# 2. bit-exact gradients for every mode


MODES: list[tuple[str, float | None]] = [("dsl", None), ("auto", 0.9), ("auto", 0.7), ("auto", 0.5),
                                         ("block", None)]


def _models() -> Iterator[Any]:
    yield pytest.param(lambda: ir_model(), id="ir-qwen3")
    yield pytest.param(lambda: ir_model(dropout=True), id="ir-qwen3-dropout")
    yield pytest.param(lambda: dsl("Qwen3Model", n_layers=3), id="dsl-qwen3")
    yield pytest.param(lambda: dsl("Qwen3MoEModel", n_layers=3, num_experts=4, num_experts_per_tok=2,
                                   moe_d_ff=16, mlp_only_layers=[0]), id="dsl-qwen3-moe")
    yield pytest.param(lambda: dsl("HyperConnectionModel", n_streams=2, hc_sinkhorn_iters=3),
                       id="dsl-hyper-connection")


def _grads(bundle: Bundle, training: str, recompute: str,
           budget: float | None) -> tuple[float, dict[str, Any], Model]:
    model = Model.from_ir(bundle, seed=5, mode=training, recompute=recompute, recompute_budget=budget)
    config = bundle.module(str(bundle.entry)).config
    batch = random_batch(int(config.get("V", config.get("vocab_size", 32))), 2, 6, seed=3)
    loss, grads = model.loss_and_grads(batch["input_ids"], batch["labels"])
    return loss, grads, model


@pytest.mark.parametrize("make", list(_models()))
@pytest.mark.parametrize("training", ["full", "lora"])
def test_every_mode_gives_the_no_recompute_gradients_bit_for_bit(make: Any, training: str) -> None:
    bundle = make()
    if training == "lora":
        bundle = with_lora(bundle)
    loss0, ref, _ = _grads(bundle, training, "none", None)
    assert ref and all(np.isfinite(g).all() for g in ref.values())
    if training == "lora":
        assert all(".lora_" in k for k in ref)
    for recompute, budget in MODES:
        loss, grads, model = _grads(bundle, training, recompute, budget)
        program = model.program(2, 6)
        assert any(s.recompute for s in program.steps), (recompute, budget)
        assert loss == loss0, (recompute, budget)
        assert grads.keys() == ref.keys()
        for name, g in ref.items():
            assert np.array_equal(grads[name], g), (recompute, budget, name)


def test_auto_rebuilds_a_fused_norm_output_from_its_kept_sum_and_rstd() -> None:
    """The replay variant: the fused residual + rmsnorm is not replayed (that would need its inputs);
    its normalized output comes from the kept sum and rstd, bitwise as in the forward."""
    bundle = ir_model()
    plan = compile(bundle, bindings={"B": 2, "T": 6}, recompute="auto", recompute_budget=0.9).recompute
    rebuilt = [(b, op) for b in plan.blocks for op in b.ops if op.op_type == "rmsnorm_apply_saved"]
    assert ("res1", "attn_norm.rstd", "attn_norm.weight") in {op.inputs for _, op in rebuilt}
    for block, op in rebuilt:  # each from its kept sum and rstd
        total, rstd = op.inputs[:2]
        assert {total, rstd} <= set(block.saved) and op.outputs[0] in block.recomputed
        assert not any(total in o.outputs for o in block.ops)  # the sum is kept, not replayed
    loss0, ref, _ = _grads(bundle, "full", "none", None)
    loss, grads, _ = _grads(bundle, "full", "auto", 0.9)
    assert loss == loss0 and all(np.array_equal(grads[k], ref[k]) for k in ref)


@pytest.mark.parametrize("recompute", ["dsl", "auto", "block"])
def test_recompute_ops_run_right_before_their_first_consumer(recompute: str) -> None:
    program = compile(with_lora(ir_model()), bindings={"B": 2, "T": 6}, mode="lora", recompute=recompute,
                      recompute_budget=0.5)
    steps = program.steps
    runs: list[list[Any]] = []
    for st in steps:
        if st.recompute:
            if runs and runs[-1][-1].index == st.index - 1:
                runs[-1].append(st)
            else:
                runs.append([st])
    assert runs
    layers_seen = set()
    for run in runs:
        made = {o for st in run for o in st.outputs if o}
        after = steps[run[-1].index + 1]
        assert after.phase == "backward" and not after.recompute
        assert set(after.inputs) & made or recompute == "block", (run, after)  # the consumer comes next
        assert all(st.layer == run[0].layer for st in run)
        if recompute == "block":  # the whole block, before the layer's first backward step
            assert run[0].layer not in layers_seen
            layers_seen.add(run[0].layer)
            previous = steps[run[0].index - 1]
            assert previous.layer != run[0].layer or previous.phase == "forward"
    keys = [o for st in steps if st.recompute for o in st.outputs if o]
    assert keys and all(k.endswith(":recompute") for k in keys)


def test_dropout_replays_from_its_counter_state() -> None:
    bundle = ir_model(dropout=True)
    for recompute, budget in (("block", None), ("dsl", None), ("auto", 0.15)):
        plan = compile(bundle, bindings={"B": 2, "T": 6}, recompute=recompute, recompute_budget=budget,
                       recompute_options={"measure": None}).recompute
        b = plan.block("Qwen3Block")
        assert b is not None
        drops = [op for op in b.ops if any(r.type == "dropout" for r in op.replay)]
        assert drops, recompute
        assert dict(drops[0].rng) == {"attn.proj_drop": {"seed": 1234, "offset": 7}}


def test_random_ops_without_counter_state_and_collectives_are_never_replayed() -> None:
    from kiln.core import OpDef, OpRegistry, TensorType, op_registry
    from kiln.core.plan._recompute_auto import model_front

    registry = OpRegistry()
    for _, opdef in op_registry().items():
        registry.register_op(opdef)
    same = lambda ctx: [TensorType(ctx.shape(0), ctx.dtype(0))]  # noqa: E731
    ident, rule = (lambda x: x), (lambda c: [c.d_out])
    registry.register_op(OpDef("noise", ("x",), ("out",), ident, same, backward=rule, random=True))
    registry.register_op(OpDef("all_reduce", ("x",), ("out",), ident, same, backward=rule, collective=True))
    act = ["B", "T", "C"]
    g = Graph("B", inputs=[TensorDecl("x", act, "fp32")], params=[TensorDecl("w", ["C"], "fp32")],
              ops=[Op("noise", ["x"], ["n"]), Op("mul", ["n", "w"], ["a"]), Op("all_reduce", ["a"], ["r"]),
                   Op("mul", ["r", "w"], ["y"])], outputs=[TensorDecl("y", act, "fp32")])
    block = _block(forward=g, C=4)
    ctx = plan_context(Bundle([_host(block), block], entry="M"), bindings={"B": 1, "T": 3}, registry=registry)
    for point in model_front(ctx, True):
        assert not point.replayed[0] & {0, 2}, point  # noise and all_reduce: kept, never replayed
    b = plan_recompute(ctx, "block").blocks[0]
    assert {"n", "r"} <= set(b.saved) and not {"n", "r"} & set(b.recomputed)
    noisy = block.evolve(activations=ActivationLayout([
        slot("n", recompute=True, recompute_from=["@input:x"], recompute_op="noise")]))
    ctx = plan_context(Bundle([_host(noisy), noisy], entry="M"), bindings={"B": 1, "T": 3}, registry=registry)
    with pytest.raises(KilnError, match=r"\[E021\].*'noise'.*random.*seed"):
        plan_recompute(ctx, "dsl")


# ---------------------------------------------------------------------------------------------
# 4. memory on the benchmark config


def _saved(bundle: Bundle, **kw: Any) -> tuple[int, Any]:
    program = compile(bundle, bindings=BENCH_BINDS, **kw)
    report = program.memory_report()
    # the planner's model of the saved activations is exactly what the memory planner placed
    assert program.recompute.planned_bytes == report["saved_activations"], kw
    return int(report["saved_activations"]), program


def _activations(program: Any) -> int:
    report = program.memory_report()
    return int(report["saved_activations"] + report["transient"])


def test_benchmark_config_memory_block_and_auto() -> None:
    ir = tiny_qwen3_bundle(vocab_size=8192, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                           head_dim=64, intermediate_size=768)
    none, program = _saved(ir)
    assert none > 100 * MiB
    block, _ = _saved(ir, recompute="block")
    assert block <= 0.15 * none, block / none  # seed 001: only the block inputs are kept
    auto, auto_prog = _saved(ir, recompute="auto")  # the default budget: half the saved activations
    assert auto <= auto_prog.recompute.budget == int(0.5 * none)
    assert auto_prog.arena_bytes < program.arena_bytes
    # a fused norm's stats are not replayed: the norm output comes from the kept sum
    replays = {op.op_type for b in auto_prog.recompute.blocks for op in b.ops}
    assert "rmsnorm_apply_saved" in replays, replays
    # with the replays' working memory: within a peak budget when one is given
    peak = int(0.55 * _activations(program))
    _, bounded = _saved(ir, recompute="auto", recompute_options={"peak_budget": peak})
    assert _activations(bounded) <= peak < _activations(auto_prog)


def test_benchmark_config_memory_dsl_lora() -> None:
    bundle = with_lora(dsl("Qwen3Model", **BENCH))
    none_lora, _ = _saved(bundle, mode="lora")
    dsl_lora, _ = _saved(bundle, mode="lora", recompute="dsl")
    assert dsl_lora <= 0.5 * none_lora, dsl_lora / none_lora


def test_measured_the_backward_reads_only_the_planned_saved_slots() -> None:
    """Poison every byte of the arena the plan does not keep after the forward: gradients are unchanged,
    so what the backward really needs is within the planned saved activations."""
    bundle = ir_model(dropout=True, hidden_size=32, intermediate_size=64)
    batch = random_batch(32, 2, 8, seed=0)
    ref = None
    for recompute in ("none", "block", "dsl", "auto"):
        model = Model.from_ir(bundle, seed=1, recompute=recompute)
        program, ex = model._bind("train", 2, 8)
        model._feed("train", batch["input_ids"], batch["labels"])
        ex.run(("forward",), hyper={})
        poison = np.zeros(program.arena_bytes, bool)
        for s in program.slots:  # transient slots share offsets with saved ones at other times
            if s.kind == "transient":
                poison[s.offset:s.offset + s.nbytes] = True
        for s in program.slots:
            if s.kind != "transient":
                poison[s.offset:s.offset + s.nbytes] = False
        ex.arena[:program.arena_bytes][poison] = 0xFF  # NaN in float32
        ex.run(("backward",), hyper={})
        grads = {p.name: ex.read(p.grad) for p in program.params if p.grad}
        ref = ref or grads
        for name, g in ref.items():
            assert np.array_equal(grads[name], g), (recompute, name)
        assert model.arena_bytes == program.arena_bytes


def test_measured_block_mode_allocates_its_planned_peak_and_less_than_no_recompute() -> None:
    bundle = ir_model(vocab_size=256, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=128, num_layers=4)
    batch = random_batch(256, 4, 32, seed=1)
    arenas = {}
    for recompute in ("none", "block"):
        tracemalloc.start()
        try:
            model = Model.from_ir(bundle, seed=0, recompute=recompute)
            model.train_step(batch)
            blocks = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)]).traces
            arenas[recompute] = max(t.size for t in blocks)
        finally:
            tracemalloc.stop()
        assert arenas[recompute] == model.memory_report()["peak"] == model.arena_bytes
    assert arenas["block"] < arenas["none"]


def test_budget_to_flops_is_monotone_and_a_peak_budget_bounds_the_peak() -> None:
    bundle = ir_model(hidden_size=32, intermediate_size=64, num_layers=4)
    binds = {"B": 2, "T": 16}
    none = compile(bundle, bindings=binds)
    saved_none = none.memory_report()["saved_activations"]
    kept, flops = [], []
    for fraction in np.linspace(1.0, 0.2, 17):
        program = compile(bundle, bindings=binds, recompute="auto", recompute_budget=float(fraction))
        kept.append(program.memory_report()["saved_activations"])
        flops.append(program.recompute.extra_flops)
        assert kept[-1] <= fraction * saved_none
        # the peak budget of the no-recompute Program: never above it
        bounded = compile(bundle, bindings=binds, recompute="auto", recompute_budget=float(fraction),
                          recompute_options={"peak_budget": _activations(none)})
        assert _activations(bounded) <= _activations(none) and bounded.arena_bytes <= none.arena_bytes
    assert kept == sorted(kept, reverse=True) and kept[0] > kept[-1]
    assert flops == sorted(flops) and flops[0] < flops[-1]
    # without placement the planner bounds its saved bytes: monotone as well
    ctx = plan_context(bundle, bindings=binds)
    saved = [plan_recompute(ctx, "auto", budget=float(f)).planned_bytes for f in np.linspace(1.0, 0.2, 17)]
    assert saved == sorted(saved, reverse=True)


def test_an_unreachable_budget_names_the_lowest_plan() -> None:
    with pytest.raises(KilnError, match="the least any plan keeps is"):
        compile(ir_model(), bindings={"B": 2, "T": 6}, recompute="auto", recompute_budget=64)
    for bad in (0, -3, 1.5, "half", True):
        with pytest.raises(KilnError, match="budget"):
            compile(ir_model(), bindings={"B": 2, "T": 6}, recompute="auto", recompute_budget=bad)  # type: ignore


# ---------------------------------------------------------------------------------------------
# buffer sharing across layers (seed 000 §7)


def test_recomputed_buffers_follow_the_share_policy_only_when_really_recomputed() -> None:
    policies = {"mlp.gate_up": "lora_share", "mlp.act": "when_recomputed", "attn.out": "fft_share"}
    layout = ActivationLayout([s.evolve(share_policy=policies.get(s.name, "per_layer"))
                               for s in tiny_layout().slots])
    bundle = with_lora(with_layout(tiny_qwen3_bundle(num_layers=3, initializer_range=0.2), layout))
    batch = random_batch(32, 2, 6, seed=1)
    for training in ("full", "lora"):
        model = Model.from_ir(bundle, seed=0, mode=training, recompute="dsl")
        program = model.program(2, 6)
        b = program.recompute.block("Qwen3Block")
        assert b is not None
        assert set(b.shared) == ({"mlp.gate_up", "mlp.act"} if training == "lora" else set())
        for name in ("mlp.gate_up", "mlp.act", "attn.out"):
            homes = _homes(program, [f"blocks.{i}.{name}:recompute" for i in range(3)])
            if name in b.shared:  # one buffer holds every layer's copy
                assert len(homes) == 1
            elif training == "full":  # gated off: saved per layer, never recomputed
                assert not homes and name in b.saved
            else:
                assert len(homes) == 3
        _, grads = model.loss_and_grads(batch["input_ids"], batch["labels"])
        plain = Model.from_ir(bundle, seed=0, mode=training)
        _, ref = plain.loss_and_grads(batch["input_ids"], batch["labels"])
        assert all(np.array_equal(grads[k], ref[k]) for k in ref)


def test_a_shared_slot_that_is_a_view_shares_its_storage() -> None:
    bundle = with_lora(dsl("Qwen3Model", n_layers=3))
    block = bundle.module("DenseTransformerBlock")
    slots = [s.evolve(share_policy="lora_share") if s.name == "mlp_up" else s
             for s in block.activations.slots]
    block = block.evolve(activations=ActivationLayout(slots))
    bundle = bundle.evolve(modules=[block if m.name == block.name else m for m in bundle.modules])
    model = Model.from_ir(bundle, seed=0, mode="lora", recompute="dsl")
    program = model.program(2, 6)
    b = program.recompute.block("DenseTransformerBlock")
    assert b is not None and b.shared == ("mlp_up_flat",)  # mlp_up is a view of it
    keys = [f"blocks.{i}.{n}:recompute" for i in range(3) for n in ("mlp_up", "mlp_up_flat")]
    assert len(_homes(program, keys)) == 1
    batch = random_batch(64, 2, 6, seed=2)
    _, grads = model.loss_and_grads(batch["input_ids"], batch["labels"])
    _, ref = Model.from_ir(bundle, seed=0, mode="lora").loss_and_grads(batch["input_ids"], batch["labels"])
    assert all(np.array_equal(grads[k], ref[k]) for k in ref)


def _homes(program: Any, keys: list[str]) -> set[tuple[str, int]]:
    """The slots (name, offset) holding these tensors."""
    return {(program.tensors[k].slot, program.tensors[k].offset) for k in keys if k in program.tensors}


# ---------------------------------------------------------------------------------------------
# the kiln_plan_recompute hook


@pytest.fixture
def plugins() -> Iterator[None]:
    reset_plugins()
    yield
    reset_plugins()


def _hook(fn: Any) -> Any:
    return types.SimpleNamespace(kiln_plan_recompute=hookimpl(fn))


def test_a_plugin_replaces_the_planner_and_is_checked(plugins: None) -> None:
    seen: list[str] = []

    def only_swiglu(layout: Any, mode: str, training: str) -> RecomputePlan | None:
        seen.append(mode)
        if mode != "dsl":
            return None  # defer: the built-in planner decides
        ctx = layout.block("Qwen3Block")
        op = next(o for o in ctx.module.forward.ops if o.type == "swiglu")
        rop = RecomputeOp("act", "swiglu", op.inputs, op.outputs, replay=(op,))
        return RecomputePlan(mode, training, blocks=[BlockPlan("Qwen3Block", ctx.layers, [rop],
                                                               recomputed=["mlp.act"])])

    register_plugin(_hook(only_swiglu), "swiglu-planner")
    bundle = tiny_qwen3_bundle(initializer_range=0.2)
    program = compile(bundle, bindings={"B": 2, "T": 6}, recompute="dsl")
    assert program.recompute.planner == "swiglu-planner" and seen == ["dsl"]
    assert [s.op.type for s in program.steps if s.recompute] == ["swiglu", "swiglu"]
    assert compile(bundle, bindings={"B": 2, "T": 6}, recompute="block").recompute.planner == "kiln.core"
    batch = random_batch(32, 2, 6, seed=1)
    _, ref = Model.from_ir(bundle).loss_and_grads(batch["input_ids"], batch["labels"])
    _, got = Model.from_ir(bundle, recompute="dsl").loss_and_grads(batch["input_ids"], batch["labels"])
    assert all(np.array_equal(got[k], ref[k]) for k in ref)


def test_a_plugin_returning_a_bad_plan_is_named(plugins: None) -> None:
    register_plugin(_hook(lambda mode: "nonsense"), "confused-planner")
    with pytest.raises(PluginError, match=r"confused-planner.*returned str"):
        compile(tiny_qwen3_bundle(), bindings={"B": 2, "T": 6}, recompute="auto")
    reset_plugins()
    bad = BlockPlan("Qwen3Block", 2, [RecomputeOp("x", "relu", ["ghost"], ["y"], replay=(Op("relu", ["ghost"],
                                                                                             ["y"]),))])
    register_plugin(_hook(lambda training: RecomputePlan("auto", training, blocks=[bad])), "ghost-planner")
    with pytest.raises(PluginError, match=r"ghost-planner.*invalid recompute plan.*'ghost'") as err:
        compile(tiny_qwen3_bundle(), bindings={"B": 2, "T": 6}, recompute="auto")
    assert err.value.plugin == "ghost-planner"


# ---------------------------------------------------------------------------------------------
# kiln plan


def test_kiln_plan_prints_a_per_layer_table_and_the_peak(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tiny.json"
    path.write_text(ir_model(num_layers=3).to_json())
    assert main(["plan", str(path), "--recompute", "block", "--batch", "2", "--seq", "8"]) == 0
    out = capsys.readouterr().out
    program = compile(ir_model(num_layers=3), bindings={"B": 2, "T": 8}, recompute="block")
    report = program.memory_report()
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"])]
    assert [r[:2] for r in rows] == [["0", "Qwen3Block"], ["1", "Qwen3Block"], ["2", "Qwen3Block"]]
    for key in ("weights", "gradients", "optimizer_state", "saved_activations", "transient", "peak"):
        assert key in out
    assert f"{report['peak'] / 1024:.2f} KiB" in out
    table = program.memory_table().splitlines()  # what kiln plan prints
    # the host pool's row only where the plan offloads (block mode does not), the held one only where the
    # backend keeps buffers across steps (numpy keeps none)
    assert [row.split()[0] for row in table] == [k for k in report if k not in ("slots", "host", "held")]
    assert all(f"  {row}\n" in out for row in table)
    assert main(["plan", str(path), "--recompute", "auto", "--budget", "40%", "--batch", "2", "--seq", "8",
                 "--pareto"]) == 0
    out = capsys.readouterr().out
    table = out.split("auto plans")[1].splitlines()[2:]
    from kiln.core.recompute import parse_budget

    budgets = [parse_budget(line.split()[0]) for line in table if line.strip()]  # human units: 12.05KiB
    flops = [float(line.split()[7]) for line in table if line.strip()]  # budget, saved, peaks: 7 cells
    assert budgets == sorted(budgets, reverse=True) and flops == sorted(flops)
    assert main(["plan", str(path), "--budget", "lots"]) == 2
    assert "--budget 'lots'" in capsys.readouterr().err


def test_kiln_plan_on_a_dsl_model_in_lora_mode(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("kiln.dsl")
    config = json.dumps({k: v for k, v in BENCH.items() if k != "vocab_size"} | {"vocab_size": 512})
    assert main(["plan", "Qwen3Model", "--config", config, "--mode", "lora", "--recompute", "dsl",
                 "--batch", "2", "--seq", "32"]) == 0
    out = capsys.readouterr().out
    assert "recompute='dsl', lora training" in out and out.count("DenseTransformerBlock") == 4
    assert "no parameter trains" in out  # no adapters without kiln-peft's pass


@pytest.mark.parametrize(("text", "value"), [("123456", 123456), ("64MiB", 64 << 20), ("1.5KB", 1500),
                                             ("0.5", 0.5), ("50%", 0.5), (4096, 4096), (0.25, 0.25)])
def test_budgets_are_bytes_or_fractions(text: object, value: float) -> None:
    from kiln.core.recompute import parse_budget

    assert parse_budget(text) == value and type(parse_budget(text)) is type(value)


@pytest.mark.parametrize("bad", ["lots", "-5", 0, "0%", "150%", 1.5, True, None, "MiB"])
def test_a_budget_that_is_neither_is_an_error_naming_it(bad: object) -> None:
    from kiln.core.recompute import parse_budget

    with pytest.raises(KilnError, match=re.escape(repr(bad))):
        parse_budget(bad)


def test_kiln_plan_refuses_config_keys_the_model_does_not_take(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("kiln.dsl")
    for config, culprit, close in (('{"size": "tiny"}', "size", "head_size"),
                                   ('{"n_layerz": 2}', "n_layerz", "n_layers")):
        assert main(["plan", "Qwen3Model", "--config", config]) == 2
        err = capsys.readouterr().err
        assert f"{culprit!r} is not a config key of Qwen3Model (did you mean {close!r}?)" in err, err
        assert "Traceback" not in err


@pytest.mark.parametrize("n", [1, 1023, 1024, 12632064, 12632065, 3 * 2**30 + 1])
def test_pareto_budgets_are_human_units_that_admit_their_plan(n: int) -> None:
    from kiln.core.cli._cli import _budget
    from kiln.core.recompute import parse_budget

    text = _budget(n)
    unit = next((1 << s for u, s in (("GiB", 30), ("MiB", 20), ("KiB", 10)) if text.endswith(u)), 1)
    assert unit == 1 or text[:-3].replace(".", "").isdigit()
    assert n <= parse_budget(text) < n + max(unit / 100, 1)  # passed back, it admits a plan keeping n bytes
