"""Programs (schedule and memory plan), the NumPy backend's kernels, the optimizer and the Model API."""

from __future__ import annotations

import math

import numpy as np
import pytest
from kiln_core_tiny import random_batch, tiny_qwen3_bundle

from kiln.core import AdamW, KilnError, Model, compile, get_registry, op_registry
from kiln.core.ir import Bundle, Graph, Module, Op, ParamSpec, TensorDecl
from kiln.core.ops.library._optimizer import adamw_update

BINDS = {"B": 2, "T": 5}


def _slot_of(program: object, tensor: str) -> str:
    return next(s.name for s in program.slots if tensor in s.tensors)  # type: ignore[attr-defined]


def test_the_block_backward_is_derived_once_and_runs_per_layer_in_reverse() -> None:
    program = compile(tiny_qwen3_bundle(num_layers=3), bindings=BINDS)
    fwd = [s.layer for s in program.phase("forward") if s.layer is not None]
    bwd = [s.layer for s in program.phase("backward") if s.layer is not None]
    assert sorted(set(fwd)) == [0, 1, 2] and fwd == sorted(fwd)
    assert bwd == sorted(bwd, reverse=True)
    per_layer = [[s.op for s in program.phase("backward") if s.layer == i] for i in range(3)]
    assert all(a is b for a, b in zip(per_layer[0], per_layer[2], strict=True))  # the same body ops


def test_memory_report_adds_up_views_are_free_and_saved_activations_are_per_layer() -> None:
    program = compile(tiny_qwen3_bundle(), bindings=BINDS)
    report = program.memory_report()
    kinds = ("weights", "gradients", "optimizer_state", "inputs", "outputs", "saved_activations", "transient")
    assert sum(report[k] for k in kinds) == report["peak"] == program.arena_bytes
    assert report["gradients"] == report["weights"] and report["optimizer_state"] == 2 * report["weights"]
    # a view shares its input's slot
    assert _slot_of(program, "blocks.1.attn.x_flat") == _slot_of(program, "blocks.1.attn_norm.y")
    # every layer keeps its own saved activations until its backward
    saved = {s.name for s in program.slots if s.kind == "saved"}
    assert {"blocks.0.attn.lse", "blocks.1.attn.lse"} <= saved
    slots = program.slots
    for i, a in enumerate(slots):  # two slots share memory only if they are never alive together
        for b in slots[i + 1:]:
            if a.offset < b.offset + b.nbytes and b.offset < a.offset + a.nbytes:
                assert a.last <= b.first or b.last <= a.first, (a, b)


def test_an_elementwise_op_writes_over_an_input_that_dies_there() -> None:
    x = TensorDecl("x", ["N", "C"], "fp32")
    model = Module("m", kind="model", config={"C": 8, "V": 16},
                   params=[ParamSpec("emb", ["V", "C"], "fp32", init={"kind": "normal", "std": 0.5})],
                   forward=Graph("m", inputs=[TensorDecl("token_ids", ["N"], "int32"),
                                             TensorDecl("targets", ["N"], "int32")],
                                 params=[TensorDecl("emb", ["V", "C"], "fp32")],
                                 ops=[Op("embedding", ["token_ids", "emb"], ["h"]),
                                      Op("scale", ["h"], ["s"], {"factor": 2.0}),
                                      Op("fused_lm_head_loss", ["s", "emb", "targets"], ["loss", "lse"])],
                                 outputs=[x.evolve(name="loss", shape=["N"])]))
    program = compile(model, bindings={"N": 6}, task="logits")
    assert _slot_of(program, "s") == _slot_of(program, "h")


def test_unknown_recompute_modes_budgets_and_backends_are_rejected_naming_the_valid_ones() -> None:
    with pytest.raises(KilnError, match=r"recompute='blocks' is not valid; expected one of 'none', 'dsl', "
                                        r"'auto', 'block'"):
        compile(tiny_qwen3_bundle(), bindings=BINDS, recompute="blocks")
    with pytest.raises(KilnError, match="exceeds memory_budget"):
        compile(tiny_qwen3_bundle(), bindings=BINDS, memory_budget=1000)
    # without kiln-kernels-cuda: the error names the package; with it and no GPU: why it is unavailable
    with pytest.raises(KilnError, match=r"kiln-kernels-cuda|backend 'cuda' is unavailable"):
        compile(tiny_qwen3_bundle(), bindings=BINDS, backend="cuda")


def test_logits_agree_with_the_loss() -> None:
    model = Model.from_ir(tiny_qwen3_bundle(), seed=0, dtype="float64")
    batch = random_batch(32, 2, 5, seed=4)
    logits = model.logits(batch["input_ids"])
    assert logits.shape == (2, 5, 32)
    lab = batch["labels"]
    lse = np.log(np.sum(np.exp(logits), axis=-1))
    picked = np.take_along_axis(logits, np.where(lab < 0, 0, lab)[..., None], axis=-1)[..., 0]
    expected = np.sum(np.where(lab >= 0, lse - picked, 0)) / np.sum(lab >= 0)
    assert model.loss(batch["input_ids"], lab) == pytest.approx(expected, rel=1e-12)


def test_programs_are_cached_per_shape_and_weights_survive_a_growing_arena() -> None:
    model = Model.from_ir(tiny_qwen3_bundle(), seed=0)
    small, big = random_batch(32, 1, 3), random_batch(32, 4, 9)
    before = model.parameters()
    first = model.loss(small["input_ids"], small["labels"])
    arena = model.arena_bytes
    model.loss(big["input_ids"], big["labels"])
    assert model.arena_bytes > arena and model.program(4, 9) is model.program(4, 9)
    assert all(np.array_equal(v, model.parameters()[k]) for k, v in before.items())
    assert model.loss(small["input_ids"], small["labels"]) == first


def test_tied_weights_share_storage_and_frozen_params_get_no_gradient_or_state() -> None:
    bundle = tiny_qwen3_bundle(tie_word_embeddings=True)
    top = bundle.module("Qwen3Model")
    frozen = top.evolve(params=[p.evolve(frozen=p.name == "final_norm.weight") for p in top.params])
    bundle = Bundle([frozen, bundle.module("Qwen3Block")], entry="Qwen3Model")
    model = Model.from_ir(bundle, seed=0)
    assert "lm_head" not in model.parameters() and "embedding" in model.parameters()
    batch = random_batch(32, 2, 5)
    _, grads = model.loss_and_grads(batch["input_ids"], batch["labels"])
    assert "final_norm.weight" not in grads and "embedding" in grads
    norm = model.parameters()["final_norm.weight"]
    model.train_step(batch)
    assert np.array_equal(model.parameters()["final_norm.weight"], norm)
    assert "final_norm.weight" not in model.state_dict()["optimizer"]["exp_avg"]
    with pytest.raises(KilnError, match="tied to 'embedding'"):
        model.set_parameters({"lm_head": np.zeros((32, 16))})


def test_state_dict_round_trips_and_bad_inputs_name_the_culprit() -> None:
    batch = random_batch(32, 2, 5)
    a = Model.from_ir(tiny_qwen3_bundle(), seed=0)
    a.train_step(batch)
    b = Model.from_ir(tiny_qwen3_bundle(), seed=1)
    b.load_state_dict(a.state_dict())
    assert a.train_step(batch) == b.train_step(batch)
    with pytest.raises(KilnError, match="no parameter 'nope'"):
        a.set_parameters({"nope": np.zeros(3)})
    with pytest.raises(KilnError, match=r"'embedding' is \[32, 16\], the value given is \[2\]"):
        a.set_parameters({"embedding": np.zeros(2)})
    with pytest.raises(KilnError, match="labels must be an integer array"):
        a.loss_and_grads(batch["input_ids"], batch["labels"][:, :2])


@pytest.mark.parametrize("name", get_registry("kernels").ops_of("numpy"))
def test_numpy_kernels_equal_their_reference_kernels(name: str) -> None:
    if name not in op_registry():  # a fusion of several ops (tested against them in test_runtime)
        return
    opdef = op_registry()[name]
    kernel = get_registry("kernels").find(name, "numpy", "float64")
    assert kernel is not None
    if not kernel.out:  # the reference kernel itself
        assert kernel.fn is opdef.kernel
        return
    assert opdef.samples is not None
    for sample in opdef.samples(np.random.default_rng(0)):
        attrs = opdef.kernel_attrs(opdef.resolve_attrs(sample.attrs), {}, np.float64)
        expected = opdef.run(list(sample.inputs), sample.attrs)
        outs = tuple(np.empty_like(e) for e in expected)
        kernel.fn(*sample.inputs, out=outs, **attrs)
        assert all(np.array_equal(o, e) for o, e in zip(outs, expected, strict=True)), sample.attrs


def test_adamw_schedule_clipping_and_update() -> None:
    opt = AdamW(lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1, max_grad_norm=2.0, weight_decay=0.1)
    # transformers' schedules as the HF Trainer steps them: update t gets the factor of step t - 1
    assert [opt.lr_at(s) for s in (1, 2, 4, 5)] == [0.0, 0.25, 0.75, 1.0]
    assert opt.lr_at(10) == pytest.approx(0.55) and opt.lr_at(15) == pytest.approx(0.1) == opt.lr_at(99)
    assert opt.clip_scale(1.0) == 1.0 and opt.clip_scale(4.0) == pytest.approx(0.5)
    with pytest.raises(KilnError, match="beta1 must be in"):
        AdamW(beta1=1.0)

    rng = np.random.default_rng(0)
    p, g = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    m, v = rng.standard_normal((3, 4)) * 0.1, rng.random((3, 4)) * 0.1
    want_m = 0.9 * m + 0.1 * (0.5 * g)
    want_v = 0.999 * v + 0.001 * (0.5 * g) ** 2
    step, lr = 3, 0.01
    update = lr * (want_m / (1 - 0.9**step)) / (np.sqrt(want_v / (1 - 0.999**step)) + opt.eps)
    want_p = p * (1 - lr * 0.1) - update
    adamw_update(p, g, m, v, np.empty(12), step=step, lr=lr, scale=0.5, **opt.update_attrs("w", "weight"))
    assert np.allclose(m, want_m) and np.allclose(v, want_v) and np.allclose(p, want_p, rtol=1e-12)


def test_train_step_reports_metrics() -> None:
    opt = AdamW(lr=0.5, warmup_steps=2, max_grad_norm=0.01)
    model = Model.from_ir(tiny_qwen3_bundle(), seed=0, optimizer=opt)
    batch = random_batch(32, 2, 5)
    loss, grads = model.loss_and_grads(batch["input_ids"], batch["labels"])
    stats = model.train_step(batch)
    norm = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values()))
    assert stats["loss"] == loss and stats["lr"] == 0.0 and stats["step"] == 1 and stats["tokens"] == 8
    assert stats["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert model.train_step(batch)["lr"] == 0.25 and model.train_step(batch)["lr"] == 0.5


def test_programs_of_other_shapes_running_in_between_change_nothing() -> None:
    """All Programs of a model share its arena: one shape's inputs may lie where another's position_ids
    do, so every run writes its own inputs (a regression: positions were written once per Program)."""
    big, small = random_batch(32, 4, 5, seed=1), random_batch(32, 2, 3, seed=2)
    alone = Model.from_ir(tiny_qwen3_bundle(), seed=0)
    mixed = Model.from_ir(tiny_qwen3_bundle(), seed=0)
    assert mixed.train_step(big) == alone.train_step(big)
    mixed.loss(small["input_ids"], small["labels"])  # an eval Program of another shape, in between
    mixed.logits(small["input_ids"])
    assert mixed.train_step(big) == alone.train_step(big)
    assert all(np.array_equal(a, b) for a, b in zip(mixed.parameters().values(), alone.parameters().values(),
                                                    strict=True))


def test_the_ignored_label_is_the_loss_ops_ignore_index() -> None:
    bundle = tiny_qwen3_bundle()
    model_ir = bundle.module(bundle.entry)
    ops = [op.evolve(attrs={**op.attrs, "ignore_index": 7}) if op.type == "fused_lm_head_loss" else op
           for op in model_ir.forward.ops]
    changed = model_ir.evolve(forward=model_ir.forward.evolve(ops=ops))
    custom = bundle.evolve(modules=[changed if m is model_ir else m for m in bundle.modules])
    batch = random_batch(32, 2, 5, seed=3)
    batch["labels"] = np.where(batch["labels"] == 7, 8, np.abs(batch["labels"]) % 32)  # no other ignored
    batch["labels"][:, :2] = 7
    default, seven = Model.from_ir(bundle, seed=0), Model.from_ir(custom, seed=0)
    assert (default.ignore_index, seven.ignore_index) == (-100, 7)
    stats = seven.train_step(batch)
    assert stats["tokens"] == 6  # 10 positions, 4 labelled 7
    other = dict(batch, labels=np.where(batch["labels"] == 7, -100, batch["labels"]))
    assert default.train_step(other)["loss"] == pytest.approx(stats["loss"], rel=1e-6)
