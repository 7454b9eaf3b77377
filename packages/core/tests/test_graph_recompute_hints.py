"""A block graph's own hints in ``recompute="dsl"`` mode: ``Graph.recompute`` names tensors the backward
recomputes by replaying their producer, ``Graph.save`` names tensors kept whatever other hints say.
Also: ``recompute_attrs`` that the recompute op does not take are rejected, naming key and op."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kiln.core import KilnError, Model, compile
from kiln.core.ir import ActivationLayout, ActivationSlot, Bundle, Graph, Module, Op, ParamSpec, TensorDecl
from kiln.core.recompute import BlockPlan

ACT = ["B", "T", "C"]
BINDS = {"B": 2, "T": 5}
N = ActivationSlot("n", ACT, "fp32")  # what slot h is recomputed from


def lm(recompute: tuple[str, ...] = (), save: tuple[str, ...] = (), slots: tuple[ActivationSlot, ...] = (),
       model_recompute: tuple[str, ...] = ()) -> Bundle:
    """Embedding, two layers of ``y = x + relu(silu(rmsnorm(x)) * w)``, tied LM-head loss."""
    block = Module(
        "Blk", kind="block", config={"C": 4},
        params=[ParamSpec("norm", ["C"], "fp32", init={"kind": "ones"}),
                ParamSpec("w", ["C"], "fp32", init={"kind": "normal", "std": 0.5})],
        activations=ActivationLayout(slots),
        forward=Graph(
            "Blk", inputs=[TensorDecl("x", ACT, "fp32")],
            params=[TensorDecl("norm", ["C"], "fp32"), TensorDecl("w", ["C"], "fp32")],
            ops=[Op("rmsnorm", ["x", "norm"], ["n", "rstd"]), Op("silu", ["n"], ["h"]),
                 Op("mul", ["h", "w"], ["m"]), Op("relu", ["m"], ["r"]), Op("add", ["x", "r"], ["y"])],
            outputs=[TensorDecl("y", ACT, "fp32")], save=save, recompute=recompute))
    model = Module(
        "LM", kind="model", config={"V": 11, "C": 4, "L": 2},
        params=[ParamSpec("embedding", ["V", "C"], "fp32", init={"kind": "normal", "std": 0.5}),
                ParamSpec("blocks", [], "fp32", array_of="Blk", count="L")],
        forward=Graph(
            "LM", inputs=[TensorDecl("token_ids", ["B", "T"], "int32"),
                          TensorDecl("targets", ["B", "T"], "int32")],
            params=[TensorDecl("embedding", ["V", "C"], "fp32"), TensorDecl("blocks", [], "fp32")],
            ops=[Op("embedding", ["token_ids", "embedding"], ["x0"]),
                 Op("call", ["x0"], ["xN"], {"module": "Blk", "n_layers": "L", "params": "blocks"}),
                 Op("view", ["xN"], ["x_flat"], {"shape": ["B * T", "C"]}),
                 Op("view", ["targets"], ["t_flat"], {"shape": ["B * T"]}),
                 Op("fused_lm_head_loss", ["x_flat", "embedding", "t_flat"], ["loss", "lse"])],
            outputs=[TensorDecl("loss", ["B * T"], "fp32")], recompute=model_recompute))
    return Bundle([model, block], entry="LM")


def plan(bundle: Bundle) -> BlockPlan:
    b = compile(bundle, bindings=BINDS, recompute="dsl").recompute.block("Blk")
    assert b is not None
    return b


def grads(bundle: Bundle, recompute: str) -> tuple[float, dict[str, Any]]:
    ids = np.random.default_rng(7).integers(0, 11, (2, 6))
    return Model.from_ir(bundle, seed=2, recompute=recompute).loss_and_grads(ids[:, :-1], ids[:, 1:])


def assert_bitwise_as_without_recompute(bundle: Bundle) -> None:
    loss0, ref = grads(bundle, "none")
    loss, got = grads(bundle, "dsl")
    assert loss == loss0 and got.keys() == ref.keys()
    for name, g in ref.items():
        assert np.array_equal(got[name], g), name


def test_a_listed_tensor_is_replayed_from_what_its_producer_reads_bit_for_bit() -> None:
    none = compile(lm(), bindings=BINDS, recompute="dsl")
    assert none.recompute.block("Blk").recomputed == ()  # type: ignore[union-attr]
    bundle = lm(recompute=("m", "h"))
    b = plan(bundle)
    assert b.recomputed == ("h", "m")
    assert [(op.name, [r.type for r in op.replay]) for op in b.ops] == [("h", ["silu"]), ("m", ["mul"])]
    assert b.op("m").inputs == ("h", "w")  # h is recomputed in turn, not kept
    assert "n" in b.saved and not {"h", "m"} & set(b.saved)
    program = compile(bundle, bindings=BINDS, recompute="dsl")
    assert [st.op.type for st in program.steps if st.recompute] == ["silu", "mul"] * 2  # per layer
    assert program.memory_report()["saved_activations"] < none.memory_report()["saved_activations"]
    assert_bitwise_as_without_recompute(bundle)


def test_a_listed_tensor_the_backward_never_reads_needs_no_replay() -> None:
    b = plan(lm(recompute=("r",)))  # relu's backward reads m, not r
    assert b.ops == () and b.recomputed == ()


def test_a_kept_statistic_turns_the_replay_into_its_apply_saved_variant() -> None:
    b = plan(lm(recompute=("n",), save=("rstd",)))
    assert [r.type for r in b.op("n").replay] == ["rmsnorm_apply_saved"]
    assert "rstd" in b.saved and b.recomputed == ("n",)
    whole = plan(lm(recompute=("n",)))  # nothing keeps rstd: the whole rmsnorm is replayed
    assert [r.type for r in whole.op("n").replay] == ["rmsnorm"] and {"n", "rstd"} <= set(whole.recomputed)
    for bundle in (lm(recompute=("n",), save=("rstd",)), lm(recompute=("n",))):
        assert_bitwise_as_without_recompute(bundle)


def test_save_keeps_a_tensor_whatever_the_other_hints_say() -> None:
    slot = ActivationSlot("h", ACT, "fp32", recompute=True, recompute_from=["n"], recompute_op="silu")
    assert plan(lm(slots=(N, slot))).recomputed == ("h",)
    for bundle in (lm(slots=(N, slot), save=("h",)), lm(recompute=("h",), save=("h",))):
        b = plan(bundle)
        assert b.ops == () and "h" in b.saved and b.recomputed == ()


def test_a_listed_tensor_is_recomputed_even_where_a_slot_would_keep_it() -> None:
    b = plan(lm(slots=(N,), recompute=("n",)))  # slot n is persistent; the graph's list recomputes it
    assert b.op("n").replay[0].type == "rmsnorm" and "n" in b.recomputed


def test_a_tensor_a_slot_recomputes_follows_its_slot_policy() -> None:
    slot = ActivationSlot("h", ACT, "fp32", recompute=True, recompute_from=["n"], recompute_op="silu",
                          recompute_policy="lora_only")
    b = plan(lm(slots=(N, slot), recompute=("h",)))  # full training: the slot's policy keeps it saved
    assert b.recomputed == () and b.gated == ("h",)


@pytest.mark.parametrize(("kw", "code", "names"), [
    ({"recompute": ("zzz",)}, "E002", ["'zzz'", "'Blk'", "recompute list"]),
    ({"save": ("zzz",)}, "E002", ["'zzz'", "'Blk'", "save list"]),
    ({"recompute": ("x",)}, "E021", ["'x'", "'Blk'", "input"]),
    ({"model_recompute": ("x0",)}, "E021", ["'x0'", "'LM'", "repeated blocks"]),
])
def test_hint_errors_name_the_tensor_and_the_module(kw: dict[str, Any], code: str, names: list[str]) -> None:
    with pytest.raises(KilnError) as err:
        compile(lm(**kw), bindings=BINDS, recompute="dsl")
    assert err.value.code == code, err.value
    for name in names:
        assert name in str(err.value), (name, str(err.value))
    compile(lm(**kw), bindings=BINDS, recompute="none")  # hints are read by the dsl planner only


def test_recompute_attrs_the_op_does_not_take_are_rejected_naming_key_and_op() -> None:
    def slot(**attrs: Any) -> ActivationSlot:
        return ActivationSlot("h", ACT, "fp32", recompute=True, recompute_from=["n"], recompute_op="silu",
                              recompute_attrs=attrs)

    with pytest.raises(KilnError) as err:
        plan(lm(slots=(N, slot(attn_impl="cudnn"))))
    assert err.value.code == "E003" and "'attn_impl'" in str(err.value) and "'silu'" in str(err.value)
    assert plan(lm(slots=(N, slot(_attn_impl="cudnn")))).recomputed == ("h",)  # an annotation is kept
