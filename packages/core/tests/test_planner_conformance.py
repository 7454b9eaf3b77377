"""Seed conformance of the planners (issue 24, part B): ``shares_with`` in the memory planner, ``@global:``
references in the replay, checkpoint granularity and plan queries, ``grad_prefix`` in verify_backward,
non-differentiable inputs from op traits.

Each model is a tiny IR model built here; gradients are checked against the model without the feature
(bitwise) or against float64 finite differences.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kiln.core import KilnError, Model, compile
from kiln.core.ir import ActivationLayout, ActivationSlot, Bundle, Graph, Module, Op, ParamSpec, TensorDecl
from kiln.core.recompute import plan_context, plan_recompute

ACT = ["B", "T", "C"]
BINDS = {"B": 2, "T": 4}


def lm(block_ops: list[Op], *, slots: tuple[ActivationSlot, ...] = (), inputs: tuple[str, ...] = ("x",),
       call_inputs: tuple[str, ...] = ("x0",), model_ops: tuple[Op, ...] = (), layers: int = 2,
       extra_inputs: tuple[TensorDecl, ...] = ()) -> Bundle:
    """A tiny LM: embedding, ``layers`` blocks of ``block_ops`` (input ``x``, output ``y``), LM-head loss."""
    config = {"V": 16, "C": 8, "L": layers}
    block = Module(
        "Block", kind="block", config=config,
        params=[ParamSpec("norm", ["C"], "fp32", init={"kind": "ones"}),
                ParamSpec("w", ["C"], "fp32", init={"kind": "normal", "std": 0.5})],
        forward=Graph("Block", inputs=[TensorDecl("x", ACT, "fp32"), *extra_inputs],
                      params=[TensorDecl("norm", ["C"], "fp32"), TensorDecl("w", ["C"], "fp32")],
                      ops=block_ops, outputs=[TensorDecl("y", ACT, "fp32")]),
        activations=ActivationLayout(slots))
    model = Module(
        "LM", kind="model", config=config,
        params=[ParamSpec("embedding", ["V", "C"], "fp32", init={"kind": "normal", "std": 0.5}),
                ParamSpec("blocks", [], "fp32", array_of="Block", count="L")],
        forward=Graph(
            "LM", inputs=[TensorDecl("token_ids", ["B", "T"], "int32"),
                          TensorDecl("targets", ["B", "T"], "int32")],
            params=[TensorDecl("embedding", ["V", "C"], "fp32"), TensorDecl("blocks", [], "fp32")],
            ops=[Op("embedding", ["token_ids", "embedding"], ["x0"]), *model_ops,
                 Op("call", list(call_inputs), ["xN"],
                    {"module": "Block", "n_layers": "L", "params": "blocks"}),
                 Op("view", ["xN"], ["x_flat"], {"shape": ["B * T", "C"]}),
                 Op("view", ["targets"], ["t_flat"], {"shape": ["B * T"]}),
                 Op("fused_lm_head_loss", ["x_flat", "embedding", "t_flat"], ["loss", "lse"])],
            outputs=[TensorDecl("loss", ["B * T"], "fp32")]))
    return Bundle([model, block], entry="LM")


SIMPLE = [Op("rmsnorm", ["x", "norm"], ["n", "rstd"]), Op("silu", ["n"], ["h"]), Op("mul", ["h", "w"], ["m"]),
          Op("add", ["x", "m"], ["y"])]


def grads(bundle: Bundle, **options: Any) -> tuple[Any, dict[str, np.ndarray]]:
    ids = np.random.default_rng(0).integers(0, 16, (BINDS["B"], BINDS["T"] + 1))
    loss, g = Model(bundle, seed=0, **options).loss_and_grads(ids[:, :-1], ids[:, 1:])
    return loss, g


def same_grads(a: Bundle, b: Bundle, **options: Any) -> None:
    (la, ga), (lb, gb) = grads(a), grads(b, **options)
    assert np.array_equal(la, lb) and ga.keys() == gb.keys()
    assert all(np.array_equal(ga[k], gb[k]) for k in ga)


# ---------------------------------------------------------------------------------------------
# shares_with


def test_a_slot_that_shares_with_another_is_placed_in_its_storage() -> None:
    # block mode: the forward keeps only x, so rstd (read by nothing in the forward) is dead when m is
    # made; m is the larger: the storage is sized for it
    shared = lm(SIMPLE, slots=(ActivationSlot("rstd", ["B", "T"], "fp32"),
                               ActivationSlot("m", ACT, "fp32", shares_with="rstd")))
    prog = compile(shared, bindings=BINDS, recompute="block")
    size = {sl.name: sl.nbytes for sl in prog.slots}
    for layer in (0, 1):
        m, rstd = prog.tensors[f"blocks.{layer}.m"], prog.tensors[f"blocks.{layer}.rstd"]
        assert m.slot == rstd.slot and m.offset == rstd.offset and size[m.slot] >= m.nbytes > rstd.nbytes
    plain = compile(lm(SIMPLE), bindings=BINDS, recompute="block")
    assert plain.tensors["blocks.0.m"].slot != plain.tensors["blocks.0.rstd"].slot
    same_grads(lm(SIMPLE), shared, recompute="block")


def test_shares_with_over_overlapping_lifetimes_or_an_unknown_slot_is_an_error_naming_both() -> None:
    # without recompute n is kept for the backward (silu reads it): m cannot live in its storage
    overlap = lm(SIMPLE, slots=(ActivationSlot("n", ACT, "fp32"),
                                ActivationSlot("m", ACT, "fp32", shares_with="n")))
    with pytest.raises(KilnError, match=r"slot 'm' shares_with 'n', but their lifetimes overlap") as err:
        compile(overlap, bindings=BINDS)
    assert err.value.code == "E017"
    ghost = lm(SIMPLE, slots=(ActivationSlot("m", ACT, "fp32", shares_with="ghost"),))
    with pytest.raises(KilnError, match=r"slot 'm' shares_with 'ghost', which is not a slot") as err:
        compile(ghost, bindings=BINDS)
    assert err.value.code == "E002"


def test_a_recomputed_slot_that_shares_with_another_is_not_shared_across_layers() -> None:
    def bundle(shares: str | None) -> Bundle:
        return lm(SIMPLE, slots=(
            ActivationSlot("n", ACT, "fp32", save=True),
            ActivationSlot("h", ACT, "fp32", recompute=True, recompute_from=["n"], recompute_op="silu",
                           share_policy="when_recomputed", shares_with=shares)))

    def plan(b: Bundle) -> Any:
        return plan_recompute(plan_context(b, bindings=BINDS), "dsl").block("Block")

    assert plan(bundle(None)).shared == ("h",)  # when_recomputed: one buffer for every layer
    assert plan(bundle("n")).shared == ()  # seed 000 §7: its storage is n's, per layer


# ---------------------------------------------------------------------------------------------
# @global: references


ROPE_BLOCK = [Op("rmsnorm", ["x", "norm"], ["n", "rstd"]), Op("mul", ["n", "scale"], ["s"]),
              Op("silu", ["s"], ["h"]), Op("add", ["x", "h"], ["y"])]
SCALE = TensorDecl("scale", ["C"], "fp32")  # a table every layer reads from the model's graph


def global_model(dependency: str) -> Bundle:
    slots = (ActivationSlot("rstd", ["B", "T"], "fp32", save=True),
             ActivationSlot("s", ACT, "fp32", recompute=True, recompute_op="mul",
                            recompute_from=["@input:x", "rstd", "@param:norm", dependency]))
    return lm(ROPE_BLOCK, slots=slots, extra_inputs=(SCALE,), call_inputs=("x0", "freqs"),
              model_ops=(Op("ones", [], ["freqs"], {"shape": ["C"], "dtype": "fp32"}),))


def test_a_global_dependency_is_read_by_the_replay_from_the_block_input_that_carries_it() -> None:
    bundle = global_model("@global:freqs")
    prog = compile(bundle, bindings=BINDS, recompute="dsl")
    plan = prog.recompute.block("Block")
    assert plan is not None and plan.op("s").globals == {"freqs": "scale"}
    replays = [st for st in prog.steps if st.recompute and st.op.type == "mul"]
    assert len(replays) == 2 and all("freqs" in st.inputs for st in replays)  # the model's tensor itself
    same_grads(global_model("@global:freqs"), bundle, recompute="dsl")


def test_a_global_the_block_does_not_receive_is_an_error_naming_it() -> None:
    with pytest.raises(KilnError, match=r"'@global:x0', a tensor of the model's graph that the block does "
                                         r"not receive") as err:
        compile(global_model("@global:x0"), bindings=BINDS, recompute="dsl")
    assert err.value.code == "E021"
    # optional: dropped, like an absent one
    prog = compile(global_model("?@global:x0"), bindings=BINDS, recompute="dsl")
    assert "@global:x0" not in prog.recompute.block("Block").op("s").inputs  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------------------
# block mode: granularity, include_layernorm / include_bda, slot hints, queries


def qwen3(layers: int = 3) -> Bundle:
    from kiln_core_tiny import tiny_qwen3_bundle, with_dropout

    return with_dropout(tiny_qwen3_bundle(num_layers=layers))


def qwen3_grads(bundle: Bundle, **options: Any) -> tuple[Any, dict[str, np.ndarray]]:
    from kiln_core_tiny import random_batch

    batch = random_batch(32, BINDS["B"], BINDS["T"], seed=2)
    loss, g = Model(bundle, seed=0, **options).loss_and_grads(batch["input_ids"], batch["labels"])
    return loss, g


def bit_exact(bundle: Bundle, **options: Any) -> None:
    (la, ga), (lb, gb) = qwen3_grads(bundle), qwen3_grads(bundle, **options)
    assert np.array_equal(la, lb) and all(np.array_equal(ga[k], gb[k]) for k in ga)


def saved(bundle: Bundle, **options: Any) -> int:
    prog = compile(bundle, bindings=BINDS, recompute="block", **options)
    n: int = prog.memory_report()["saved_activations"]
    return n


def test_block_granularity_keeps_only_the_stack_input_and_replays_the_layers_in_forward_order() -> None:
    b = qwen3()
    prog = compile(b, bindings=BINDS, recompute="block", recompute_options={"granularity": "block"})
    plan = prog.recompute.block("Qwen3Block")
    assert plan is not None and plan.stack and not {"x", "residual"} & set(plan.saved)
    layer = compile(b, bindings=BINDS, recompute="block")
    assert not layer.recompute.block("Qwen3Block").stack  # type: ignore[union-attr]
    assert prog.memory_report()["saved_activations"] < layer.memory_report()["saved_activations"]
    # only the stack's input (layer 0's carried inputs, the model's x0 and residual0) lives across
    # forward and backward; no layer output does but the last's (the model's final norm reads it)
    outs = {f"blocks.{i}.{n}" for i in (0, 1) for n in ("res2", "mlp.out")}

    def read_in_backward(p: Any) -> set[str]:
        return {k for st in p.steps if st.phase == "backward" for k in st.inputs}

    assert not outs & read_in_backward(prog) and outs <= read_in_backward(layer)
    bwd = [st for st in prog.steps if st.phase == "backward" and st.layer is not None]
    replays = [st for st in bwd if st.recompute]
    first_step = next(k for k, st in enumerate(bwd) if not st.recompute)
    assert bwd[:first_step] == replays  # every replay before the stack's backward ...
    assert [st.layer for st in replays] == sorted(st.layer for st in replays)  # ... in forward order
    for i in (1, 2):  # a layer's replay reads the replayed outputs of the layer before
        reads = {k for st in replays if st.layer == i for k in st.inputs}
        assert {f"blocks.{i - 1}.res2:recompute", f"blocks.{i - 1}.mlp.out:recompute"} <= reads
    bit_exact(b, recompute="block", recompute_options={"granularity": "block"})


def test_include_layernorm_and_include_bda_keep_those_outputs_instead_of_replaying_them() -> None:
    b = qwen3()
    ctx = plan_context(b, bindings=BINDS)
    full = plan_recompute(ctx, "block").block("Qwen3Block")
    noln = plan_recompute(ctx, "block", options={"include_layernorm": False}).block("Qwen3Block")
    nobda = plan_recompute(ctx, "block", options={"include_bda": False}).block("Qwen3Block")
    assert full is not None and noln is not None and nobda is not None

    def replayed(plan: Any) -> set[str]:
        return {op.type for rop in plan.ops for op in rop.replay}

    assert {"fused_residual_rmsnorm", "dropout"} <= replayed(full)
    assert not {"fused_residual_rmsnorm", "rmsnorm"} & replayed(noln)
    assert {"attn_norm.y", "attn_norm.rstd", "mlp_norm.y", "mlp_norm.rstd"} <= set(noln.saved)
    # the bias-dropout-add: the dropout and the residual add (fused with the norm) that reads it
    assert "dropout" not in replayed(nobda) and {"res2", "mlp_norm.y"} <= set(nobda.saved)
    assert saved(b) < saved(b, recompute_options={"include_layernorm": False})
    assert saved(b) < saved(b, recompute_options={"include_bda": False})
    bit_exact(b, recompute="block", recompute_options={"include_layernorm": False})
    bit_exact(b, recompute="block", recompute_options={"include_bda": False, "granularity": "block"})
    with pytest.raises(KilnError, match=r"include_bda='no' is not valid in block mode; expected one of True"):
        plan_recompute(ctx, "block", options={"include_bda": "no"})
    with pytest.raises(KilnError, match=r"granularity='model'.*'layer', 'block'"):
        plan_recompute(ctx, "block", options={"granularity": "model"})


def test_slot_and_graph_hints_mix_into_block_mode() -> None:
    b = qwen3(2)
    block = b.module("Qwen3Block")
    assert block.forward is not None
    hinted = block.evolve(forward=block.forward.evolve(save=("attn.qkv_rope",)),
                          activations=ActivationLayout((
        ActivationSlot("mlp.gate_up", ["B * T", "2 * M"], "fp32", save=True, memory_hint="offload"),)))
    b2 = b.evolve(modules=[hinted if m.name == block.name else m for m in b.modules])
    plan = plan_recompute(plan_context(b2, bindings=BINDS), "block").block("Qwen3Block")
    assert plan is not None and "attn.qkv_rope" in plan.saved and "attn.qkv_rope" not in plan.recomputed
    assert plan.offloaded == ("mlp.gate_up",)  # kept by its slot, on the host
    assert not plan.can_recompute("attn.qkv_rope")
    bit_exact(b2, recompute="block")


def test_a_plan_answers_can_recompute_and_the_dependencies_of_a_tensor() -> None:
    plan = plan_recompute(plan_context(qwen3(2), bindings=BINDS), "block").block("Qwen3Block")
    assert plan is not None
    assert plan.can_recompute("mlp.act") and plan.can_recompute("attn.qkv")
    assert not plan.can_recompute("x") and not plan.can_recompute("ghost")
    assert plan.dependencies("mlp.act") == ("mlp.gate_up",)
    assert plan.dependencies("mlp.gate_up") == ("mlp.x_flat", "mlp.up_weight")
    assert plan.dependencies("attn_norm.y") == ("residual", "x", "attn_norm.weight")
    with pytest.raises(KilnError, match=r"'x' is not recomputed by this plan"):
        plan.dependencies("x")


# ---------------------------------------------------------------------------------------------
# verify_backward and grad_prefix


def small_graph() -> Graph:
    return Graph("f", inputs=[TensorDecl("x", ["B", "C"], "fp32")],
                 params=[TensorDecl("w", ["C"], "fp32"), TensorDecl("b", ["C"], "fp32")],
                 ops=[Op("mul", ["x", "w"], ["h"]), Op("add", ["h", "b"], ["z"]),
                      Op("silu", ["z"], ["loss"])],
                 outputs=[TensorDecl("loss", ["B", "C"], "fp32")])


def test_verify_backward_follows_the_gradient_prefix_of_the_backward() -> None:
    from kiln.core.autodiff import DeriveBackwardOptions, derive_backward, verify_backward

    g = small_graph()
    for prefix in ("grad_", "d_"):
        bwd = derive_backward(g, DeriveBackwardOptions(grad_prefix=prefix)).backward
        assert {f"{prefix}w", f"{prefix}b"} <= {o for op in bwd.ops for o in op.outputs}
        report = verify_backward(g, bwd, bindings={"B": 3, "C": 4})
        assert set(report) == {"w", "b"} and max(report.values()) < 1e-6, prefix
    # derived here with the prefix asked for
    assert set(verify_backward(g, bindings={"B": 3, "C": 4}, grad_prefix="g_")) == {"w", "b"}
    # a prefix the backward does not use finds nothing: an error, not an empty report
    bwd = derive_backward(g, DeriveBackwardOptions(grad_prefix="grad_")).backward
    with pytest.raises(KilnError, match=r"seeded by 'grad_loss', not 'd_loss' \(gradient prefix 'd_'\)"):
        verify_backward(g, bwd, bindings={"B": 3, "C": 4}, grad_prefix="d_")
    with pytest.raises(KilnError, match=r"'ghost' is not a parameter of 'f'"):
        verify_backward(g, bwd, bindings={"B": 3, "C": 4}, params=["w", "ghost"])
    stopped = derive_backward(g, DeriveBackwardOptions(grad_prefix="grad_", stop_gradients=("b",))).backward
    with pytest.raises(KilnError, match=r"computes no gradient 'grad_b'"):
        verify_backward(g, stopped, bindings={"B": 3, "C": 4}, params=["w", "b"])
    assert set(verify_backward(g, stopped, bindings={"B": 3, "C": 4})) == {"w"}


# ---------------------------------------------------------------------------------------------
# non-differentiability from op traits, not from names


def test_a_tensor_named_like_an_index_or_mask_still_carries_its_gradient() -> None:
    from kiln.core.autodiff import derive_backward, verify_backward

    # float tensors computed from the parameter, named as the old name patterns excluded them
    g = Graph("f", inputs=[TensorDecl("x", ["B", "C"], "fp32")], params=[TensorDecl("w", ["C"], "fp32")],
              ops=[Op("mul", ["x", "w"], ["pos_offsets"]), Op("silu", ["pos_offsets"], ["attn_mask"]),
                   Op("add", ["attn_mask", "x"], ["loss"])],
              outputs=[TensorDecl("loss", ["B", "C"], "fp32")])
    res = derive_backward(g)
    assert "w" in res.grads and "pos_offsets" in res.saves
    report = verify_backward(g, res.backward, bindings={"B": 3, "C": 4})  # float64 finite differences
    assert set(report) == {"w"} and report["w"] < 1e-6


def test_a_frequency_table_gets_a_gradient_where_an_op_passes_one_and_none_in_rope() -> None:
    from kiln.core.autodiff import derive_backward, nondiff_tensors

    decls = [TensorDecl("x", [2, 3, 12], "fp32"), TensorDecl("freqs", [6, 3, 2], "fp32"),
             TensorDecl("position_ids", [2, 3], "int32")]
    rope = Op("rope", ["x", "freqs", "position_ids"], ["loss"], {"head_dim": 6})
    only_rope = Graph("r", inputs=decls, ops=[rope], outputs=[TensorDecl("loss", [2, 3, 12], "fp32")])
    assert {"freqs", "position_ids"} <= nondiff_tensors(only_rope)
    leaves = {"x", "freqs", "position_ids"}
    assert set(derive_backward(only_rope).grads) & leaves == {"x"}
    # the same table also added into the loss: that use passes a gradient to it
    rope_r = Op("rope", ["x", "freqs", "position_ids"], ["r"], {"head_dim": 6})
    both = Graph("b", inputs=decls, ops=[rope_r, Op("view", ["freqs"], ["s"], {"shape": [3, 12]}),
                                         Op("add", ["r", "s"], ["loss"])],
                 outputs=[TensorDecl("loss", [2, 3, 12], "fp32")])
    assert "freqs" not in nondiff_tensors(both)
    assert set(derive_backward(both).grads) & leaves == {"x", "freqs"}


# ---------------------------------------------------------------------------------------------
# options: named errors, and kiln plan


def test_an_option_the_planner_does_not_take_is_named() -> None:
    ctx = plan_context(qwen3(2), bindings=BINDS)
    with pytest.raises(KilnError, match=r"'granularty' is not one kiln's 'block' planner takes \(it takes: "
                                         r"granularity, include_layernorm, include_bda\)"):
        plan_recompute(ctx, "block", options={"granularty": "block"})
    with pytest.raises(KilnError, match=r"'offload' is not one kiln's 'dsl' planner takes \(it takes: none"):
        compile(qwen3(2), bindings=BINDS, recompute="dsl", recompute_options={"offload": True})


def test_kiln_plan_passes_recompute_options(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from kiln.core.cli._cli import main

    path = tmp_path / "tiny.json"
    path.write_text(qwen3(3).to_json())
    args = ["plan", str(path), "--batch", "2", "--seq", "4", "--recompute", "block"]
    assert main([*args, "--recompute-option", "granularity=block"]) == 0
    out = capsys.readouterr().out
    stack = compile(qwen3(3), bindings=BINDS, recompute="block", recompute_options={"granularity": "block"})
    layer = compile(qwen3(3), bindings=BINDS, recompute="block")
    saved = next(line for line in out.splitlines() if line.split()[:1] == ["saved_activations"])
    assert f"{stack.memory_report()['saved_activations'] / 1024:.2f} KiB" in saved
    assert stack.memory_report()["saved_activations"] != layer.memory_report()["saved_activations"]
    assert main([*args, "--recompute-option", "include_bda=false", "--recompute-option",
                 "granularity=layer"]) == 0
    capsys.readouterr()
    assert main([*args, "--recompute-option", "granularity"]) == 2
    assert "expected NAME=VALUE" in capsys.readouterr().err
    assert main([*args, "--recompute-option", "include_bda=maybe"]) == 2
    assert "include_bda='maybe' is not valid in block mode" in capsys.readouterr().err
