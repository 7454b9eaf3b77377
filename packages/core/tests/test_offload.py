"""Activation offload (issue 24, seed 000 §4.2): a third choice of the recompute planner beside keep
and recompute. The forward copies an activation to a host pool after its last forward use, the backward
copies it back before its first use; the host pool is not part of the device arena.

Model: the tiny Qwen3 written in IR, with dropout (whose mask a replay must reproduce). The references
are the no-recompute Program and Model: offload moves bytes, so gradients must be bitwise the same.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from kiln_core_tiny import random_batch, tiny_qwen3_bundle, with_dropout

from kiln.core import KilnError, Model, compile
from kiln.core.backends.numpy import NumpyBackend
from kiln.core.cli._cli import main
from kiln.core.ir import ActivationLayout, ActivationSlot, Bundle
from kiln.core.recompute import pareto, plan_context

BINDS = {"B": 2, "T": 8}
VOCAB = 32


def bundle(layers: int = 3) -> Bundle:
    return with_dropout(tiny_qwen3_bundle(vocab_size=VOCAB, num_layers=layers))


def with_slots(b: Bundle, *slots: ActivationSlot) -> Bundle:
    block = b.module("Qwen3Block").evolve(activations=ActivationLayout(slots))
    return b.evolve(modules=[block if m.name == block.name else m for m in b.modules])


def same_training(b: Bundle, **options: Any) -> None:
    """Loss, gradients and two training steps (dropout masks move with the step) bitwise equal to the
    no-recompute model's."""
    batch = random_batch(VOCAB, BINDS["B"], BINDS["T"], seed=3)
    ref, got = Model(b, seed=0), Model(b, seed=0, **options)
    loss_r, grads_r = ref.loss_and_grads(batch["input_ids"], batch["labels"])
    loss_g, grads_g = got.loss_and_grads(batch["input_ids"], batch["labels"])
    assert np.array_equal(loss_r, loss_g)
    assert grads_r.keys() == grads_g.keys()
    for name in grads_r:
        assert np.array_equal(grads_r[name], grads_g[name]), name
    for _ in range(2):
        assert ref.train_step(batch)["loss"] == got.train_step(batch)["loss"]
    for name, value in ref.parameters().items():
        assert np.array_equal(value, got.parameter(name)), name


def block_io(b: Bundle) -> set[str]:
    g = b.module("Qwen3Block").forward
    assert g is not None
    return {d.name for d in (*g.inputs, *g.outputs)}


# ---------------------------------------------------------------------------------------------
# recompute="offload"


def test_offload_lowers_the_device_peak_at_bit_exact_losses_and_gradients() -> None:
    b = bundle()
    none = compile(b, bindings=BINDS)
    off = compile(b, bindings=BINDS, recompute="offload")
    assert off.arena_bytes < none.arena_bytes
    assert off.memory_report()["saved_activations"] < none.memory_report()["saved_activations"]
    hosted = [t for t in off.tensors.values() if t.pool == "host"]
    assert hosted and not any(t.pool == "host" for t in none.tensors.values())
    assert none.host_bytes == 0
    assert off.host_bytes == off.memory_report()["host"] == sum(-(-t.nbytes // 64) * 64 for t in hosted)
    # every host tensor has its own range of the pool
    ranges = sorted((t.offset, t.offset + t.nbytes) for t in hosted)
    assert all(a[1] <= b_[0] for a, b_ in itertools.pairwise(ranges))
    assert ranges[-1][1] <= off.host_bytes
    same_training(b, recompute="offload")


def test_offload_moves_what_keep_all_saves_but_the_block_inputs_and_outputs() -> None:
    b = bundle()
    ctx = plan_context(b, bindings=BINDS)
    from kiln.core.recompute import plan_recompute

    keep = plan_recompute(ctx, "none").block("Qwen3Block")
    off = plan_recompute(ctx, "offload").block("Qwen3Block")
    assert keep is not None and off is not None
    assert not off.recomputed and not off.ops
    assert set(off.saved) | set(off.offloaded) == set(keep.saved)
    assert set(off.saved) <= block_io(b) and not set(off.offloaded) & block_io(b)
    assert {"mlp.gate_up", "attn.lse", "res1"} <= set(off.offloaded)
    assert off.offloaded_bytes == keep.saved_bytes - off.saved_bytes > 0


def test_an_offloaded_tensor_leaves_after_its_last_forward_use_and_returns_before_its_first_backward_use(
) -> None:
    prog = compile(bundle(), bindings=BINDS, recompute="offload")
    steps = prog.steps
    outs = [st for st in steps if st.how == "offload"]
    hosted = [t.name for t in prog.tensors.values() if t.pool == "host"]
    assert sorted(st.outputs[0] for st in outs) == sorted(hosted)
    assert {st.layer for st in outs} == {0, 1, 2}
    slot = {sl.name: sl for sl in prog.slots}
    kind = {m: sl.kind for sl in prog.slots for m in sl.tensors}
    for st in outs:
        (key,), (host,) = st.inputs, st.outputs
        assert st.phase == "forward" and prog.tensors[host].pool == "host" and kind[host] == "host"
        # the device storage (the tensor and its views) is read by no step after the copy out
        storage = {key} | {s.outputs[0] for s in steps if s.how == "alias" and s.inputs[0] == key}
        assert not [s for s in steps[st.index + 1:] if set(s.inputs) & storage]
        assert kind[key] == "transient" and slot[prog.tensors[key].slot].last == st.index
        # it comes back once, in its layer's backward, right before a backward step reads it
        back = [s for s in steps if s.how == "fetch" and s.inputs == (host,)]
        assert len(back) == 1 and back[0].phase == "backward" and back[0].layer == st.layer
        readers = [s for s in steps if back[0].outputs[0] in s.inputs]
        assert readers and all(s.index > back[0].index and s.phase == "backward" for s in readers)
        assert all(s.index < back[0].index for s in steps if host in s.outputs)


def test_a_backend_without_host_offload_refuses_an_offload_plan_by_name() -> None:
    class DeviceOnly(NumpyBackend):
        name = "device-only"
        capabilities = frozenset()

    compile(bundle(), bindings=BINDS, recompute="none", backend=DeviceOnly())  # runs there
    with pytest.raises(KilnError, match=r"backend 'device-only' does not implement.*host_offload"):
        compile(bundle(), bindings=BINDS, recompute="offload", backend=DeviceOnly())


# ---------------------------------------------------------------------------------------------
# dsl: memory_hint="offload" per slot


def test_a_slot_hinted_offload_is_offloaded_in_dsl_mode_and_the_rest_kept() -> None:
    b = with_slots(bundle(2),
                   ActivationSlot("mlp.gate_up", ["B * T", "2 * M"], "fp32", memory_hint="offload"),
                   ActivationSlot("mlp.act", ["B * T", "M"], "fp32", save=True))
    none = compile(b, bindings=BINDS)
    prog = compile(b, bindings=BINDS, recompute="dsl")
    plan = prog.recompute.block("Qwen3Block")
    assert plan is not None and plan.offloaded == ("mlp.gate_up",) and "mlp.act" in plan.saved
    rows, c2m = BINDS["B"] * BINDS["T"], 2 * 32
    assert prog.host_bytes == 2 * rows * c2m * 4  # 2 layers of [B*T, 2M] fp32
    assert prog.arena_bytes < none.arena_bytes
    same_training(b, recompute="dsl")


def test_a_slot_saved_by_its_recompute_policy_is_offloaded_when_hinted() -> None:
    up = ActivationSlot("mlp.gate_up", ["B * T", "2 * M"], "fp32", memory_hint="offload", recompute=True,
                        recompute_op="matmul", recompute_from=["mlp.x_flat", "@param:mlp.up_weight"],
                        recompute_policy="lora_only")
    norm = ActivationSlot("mlp_norm.y", ["B", "T", "C"], "fp32", aliases=["mlp.x_flat"], save=True)
    b = with_slots(bundle(2), norm, up)
    plan = compile(b, bindings=BINDS, recompute="dsl").recompute.block("Qwen3Block")
    assert plan is not None and plan.gated == ("mlp.gate_up",)  # lora_only: kept in full training ...
    assert plan.offloaded == ("mlp.gate_up",) and not plan.recomputed  # ... on the host
    always = with_slots(bundle(2), norm, attrs.evolve(up, recompute_policy="always"))
    plan = compile(always, bindings=BINDS, recompute="dsl").recompute.block("Qwen3Block")
    assert plan is not None and "mlp.gate_up" in plan.recomputed and not plan.offloaded  # recomputed
    same_training(b, recompute="dsl")


def test_an_offload_hint_on_a_block_output_is_an_error_naming_it() -> None:
    b = with_slots(bundle(2), ActivationSlot("res2", ["B", "T", "C"], "fp32", memory_hint="offload"))
    with pytest.raises(KilnError, match=r"Qwen3Block.*'res2' asks for offload.*output") as err:
        compile(b, bindings=BINDS, recompute="dsl")
    assert err.value.code == "E021"


# ---------------------------------------------------------------------------------------------
# auto: offload priced by the bytes it moves


def test_the_auto_planner_prices_offload_by_the_bytes_it_moves() -> None:
    from kiln.core.plan._recompute_auto import to_plan

    ctx = plan_context(bundle(), bindings=BINDS)
    for cost in (0.5, 3.0):
        points = pareto(ctx, offload_cost=cost, allow_matmul=False)
        assert any(any(o) for p in points for o in p.offloaded)
        for p in points:
            plan = to_plan(ctx, p)
            assert p.flops == pytest.approx(plan.extra_flops + cost * 2 * plan.offloaded_bytes)
    # never allowed unless asked: no point offloads
    assert not any(any(o) for p in pareto(ctx, allow_matmul=False) for o in p.offloaded)


def test_auto_offloads_when_moving_is_cheaper_than_replaying_and_not_otherwise() -> None:
    b = bundle()
    none = compile(b, bindings=BINDS)
    free = compile(b, bindings=BINDS, recompute="auto", recompute_budget=0.3,
                   recompute_options={"offload": True, "offload_cost": 0})
    assert free.recompute.extra_flops == 0 and free.recompute.offloaded_bytes > 0
    assert free.memory_report()["saved_activations"] <= 0.3 * none.memory_report()["saved_activations"] + 4096
    assert free.arena_bytes < none.arena_bytes
    dear = compile(b, bindings=BINDS, recompute="auto", recompute_budget=0.8,
                   recompute_options={"offload": True, "offload_cost": 1e12})
    plain = compile(b, bindings=BINDS, recompute="auto", recompute_budget=0.8)
    assert dear.recompute.offloaded_bytes == 0
    assert dear.recompute.extra_flops == plain.recompute.extra_flops
    same_training(b, recompute="auto", recompute_budget=0.3,
                  recompute_options={"offload": True, "offload_cost": 0})


@pytest.mark.parametrize(("options", "match"), [
    ({"offload": "yes"}, r"offload='yes' is not valid"),
    ({"offload": True, "offload_cost": -1}, r"offload_cost=-1 is not valid"),
    ({"offload_cost": 2.0}, r"offload_cost is given but offload is not allowed"),
])
def test_bad_offload_options_are_named(options: dict[str, Any], match: str) -> None:
    with pytest.raises(KilnError, match=match):
        compile(bundle(2), bindings=BINDS, recompute="auto", recompute_options=options)


# ---------------------------------------------------------------------------------------------
# kiln plan


def test_kiln_plan_shows_the_offloaded_tensors_and_the_host_pool(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tiny.json"
    path.write_text(bundle().to_json())
    assert main(["plan", str(path), "--recompute", "offload", "--batch", "2", "--seq", "8"]) == 0
    out = capsys.readouterr().out
    prog = compile(bundle(), bindings=BINDS, recompute="offload")
    plan = prog.recompute.block("Qwen3Block")
    assert plan is not None
    assert f"offloaded to the host pool in Qwen3Block: {', '.join(plan.offloaded)}" in out
    host = next(line for line in out.splitlines() if line.split()[:1] == ["host"])
    n = sum(1 for t in prog.tensors.values() if t.pool == "host")
    assert f"{prog.host_bytes / 1024:.2f} KiB" in host and f"pool of {n} offloaded" in host
    header = next(line.split() for line in out.splitlines() if line.split()[:2] == ["layer", "block"])
    assert "offloaded" in header
    assert main(["plan", str(path), "--recompute", "auto", "--offload", "--budget", "30%", "--batch", "2",
                 "--seq", "8"]) == 0
    assert "host" in capsys.readouterr().out
    assert main(["plan", str(path), "--recompute", "dsl", "--offload"]) == 2
    assert "--offload applies only with --recompute auto" in capsys.readouterr().err


def test_a_plugin_plan_may_not_offload_a_block_output() -> None:
    from kiln.core.plan._recompute import check_plan
    from kiln.core.recompute import plan_recompute

    ctx = plan_context(bundle(2), bindings=BINDS)
    plan = plan_recompute(ctx, "offload")
    bad = attrs.evolve(plan, blocks=[attrs.evolve(plan.blocks[0], offloaded=("res2",))])
    with pytest.raises(KilnError, match=r"'res2' marked offloaded"):
        check_plan(bad, ctx)
    assert math.isfinite(plan.offloaded_bytes)


def test_a_view_of_a_view_of_an_offloaded_tensor_comes_back_from_the_host() -> None:
    """The backward reads n2, a view of a view of n: it must read the copy fetched from the host, not
    keep the device n alive through the view between."""
    from kiln.core.ir import Graph, Module, Op, ParamSpec, TensorDecl

    act = ["B", "T", "C"]
    block = Module(
        "Block", kind="block", config={"C": 8},
        params=[ParamSpec("norm", ["C"], "fp32", init={"kind": "ones"}),
                ParamSpec("w", ["C"], "fp32", init={"kind": "normal", "std": 0.5})],
        forward=Graph("Block", inputs=[TensorDecl("x", act, "fp32")],
                      params=[TensorDecl("norm", ["C"], "fp32"), TensorDecl("w", ["C"], "fp32")],
                      ops=[Op("rmsnorm", ["x", "norm"], ["n", "rstd"]),
                           Op("view", ["n"], ["n1"], {"shape": ["B * T", "C"]}),
                           Op("view", ["n1"], ["n2"], {"shape": act}),
                           Op("mul", ["n2", "w"], ["m"]), Op("add", ["x", "m"], ["y"])],
                      outputs=[TensorDecl("y", act, "fp32")]))
    lm = tiny_lm(block)
    prog = compile(lm, bindings=BINDS, recompute="offload")
    plan = prog.recompute.block("Block")
    assert plan is not None and {"n", "n2"} <= set(plan.offloaded) and "n1" not in plan.offloaded
    hosted = {t.name for t in prog.tensors.values() if t.pool == "host"}
    fetched = {k for st in prog.steps if st.how == "fetch" for k in st.inputs}
    assert hosted and hosted == fetched  # every host copy is read back
    device = {f"blocks.{i}.{n}" for i in range(2) for n in ("n", "n1", "n2")}
    assert not device & {k for st in prog.steps if st.phase == "backward" for k in st.inputs}
    ids = np.random.default_rng(1).integers(0, 16, (BINDS["B"], BINDS["T"] + 1))
    _, ref = Model(lm, seed=0).loss_and_grads(ids[:, :-1], ids[:, 1:])
    _, got = Model(lm, seed=0, recompute="offload").loss_and_grads(ids[:, :-1], ids[:, 1:])
    assert all(np.array_equal(ref[k], got[k]) for k in ref)


def tiny_lm(block: Any) -> Bundle:
    from kiln.core.ir import Graph, Module, Op, ParamSpec, TensorDecl

    model = Module(
        "LM", kind="model", config={"V": 16, "C": 8, "L": 2},
        params=[ParamSpec("embedding", ["V", "C"], "fp32", init={"kind": "normal", "std": 0.5}),
                ParamSpec("blocks", [], "fp32", array_of="Block", count="L")],
        forward=Graph(
            "LM", inputs=[TensorDecl("token_ids", ["B", "T"], "int32"),
                          TensorDecl("targets", ["B", "T"], "int32")],
            params=[TensorDecl("embedding", ["V", "C"], "fp32"), TensorDecl("blocks", [], "fp32")],
            ops=[Op("embedding", ["token_ids", "embedding"], ["x0"]),
                 Op("call", ["x0"], ["xN"], {"module": "Block", "n_layers": "L", "params": "blocks"}),
                 Op("view", ["xN"], ["x_flat"], {"shape": ["B * T", "C"]}),
                 Op("view", ["targets"], ["t_flat"], {"shape": ["B * T"]}),
                 Op("fused_lm_head_loss", ["x_flat", "embedding", "t_flat"], ["loss", "lse"])],
            outputs=[TensorDecl("loss", ["B * T"], "fp32")]))
    return Bundle([model, block], entry="LM")
