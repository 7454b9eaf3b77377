"""Seed 004 §7 annotations: written in the DSL, checked at compile time, carried by the IR, honoured."""

# ruff: noqa: F821  (dimension names inside Tensor[...] annotations are not Python names)

import io
import json

import numpy as np
import pytest

from kiln.core import KilnError, Model, compile
from kiln.core.ir import from_json
from kiln.dsl import (
    Array,
    B,
    DSLError,
    Param,
    T,
    Tensor,
    block,
    build_bundle,
    compile_model,
    forward,
    graph,
    model,
    testing,
)
from kiln.dsl.annotations import (
    BY_NAME,
    adapter,
    assert_,
    checkpoint,
    comm,
    dtype,
    frozen,
    fuse,
    gradient,
    hook,
    kernel,
    lifetime,
    memory,
    nofuse,
    partition,
    precision,
    probe,
    profile,
    scaling,
    shard,
    trace,
    trainable,
)
from kiln.dsl.testing import C, V, head_lm, stack_lm


def lm(name: str, **kw: object) -> type:
    """:func:`kiln.dsl.testing.lm` (block ``{name}Block``) in two layers, with an LM head of its own."""
    return testing.lm(name, **{"n_layers": 2, "head": True, **kw})


def big_weights(m: Model, seed: int = 5) -> Model:
    """Weights of std 0.5, so that every op changes the loss visibly."""
    rng = np.random.default_rng(seed)
    m.set_parameters({k: rng.normal(0, 0.5, v.shape) for k, v in m.parameters().items()})
    return m


def batch(seed: int = 0, b: int = 2, t: int = 4) -> tuple[np.ndarray, np.ndarray]:
    ids = np.random.default_rng(seed).integers(0, V, (b, t + 1))
    return ids[:, :-1], ids[:, 1:]


# --- syntax, checks, IR ----------------------------------------------------------------------------


def test_every_annotation_compiles_is_carried_and_round_trips() -> None:
    every = lm(
        "EveryAnnotation",
        w_ann=(
            shard("column", tp_size=2),
            dtype("fp32"),
            precision(storage="bf16"),
            scaling("per_block"),
            gradient(scale=0.5, clip=1.0),
            adapter("lora", rank=4),
            memory("pin"),
            trainable(lr_scale=2.0),
        ),
        h_ann=(
            hook("AfterMLPUpProjection"),
            probe("h_stats"),
            lifetime(end="a"),
            kernel("my_gemm"),
            nofuse(reason="debug"),
            comm("all_reduce", group="tp"),
            memory("save"),
            partition(0),
        ),
        a_ann=(
            assert_("!has_nan(a) && all(a > -1)", message="silu is above -1"),
            trace(level="tensors"),
            profile("act"),
            fuse("bias_activation"),
            checkpoint(granularity="selective"),
        ),
        cls_ann=(checkpoint, frozen),
    )
    bundle = build_bundle(every, {})
    layer = bundle.module("EveryAnnotationBlock")
    kinds = {a.kind for m in (layer, bundle.module("EveryAnnotation")) for a in m.annotations}
    assert kinds == set(BY_NAME)  # every annotation of §7, carried
    (h_hook,) = layer.annotated("hook")
    assert (h_hook.on, h_hook.target, dict(h_hook.args)) == ("tensor", "h", {"point": "AfterMLPUpProjection"})
    assert h_hook.loc is not None and h_hook.loc.startswith("test_annotations.py:")
    shard_ann = next(a for a in layer.annotations if a.kind == "shard")
    assert (shard_ann.on, shard_ann.target, dict(shard_ann.args)) == (
        "param",
        "w1",
        {"strategy": "column", "tp_size": 2},
    )
    assert [(a.on, a.target) for a in layer.annotated("checkpoint")] == [("module", ""), ("tensor", "a")]
    assert layer.param("w1").frozen is False  # @trainable on the parameter overrides @frozen of its class
    assert layer.param("w2").frozen is True
    text = bundle.to_json()
    assert json.loads(text)["kiln_ir"] == 2
    assert from_json(text) == bundle


def test_version_1_ir_still_loads() -> None:
    bundle = build_bundle(lm("PlainMlp"), {})
    data = json.loads(bundle.to_json())
    assert not any("annotations" in m for m in data["modules"])  # nothing annotated: nothing written
    data["kiln_ir"] = 1
    assert from_json(data) == bundle
    assert from_json(json.dumps(data)).to_dict()["kiln_ir"] == 2


@pytest.mark.parametrize(
    ("make", "code", "words"),
    [
        (lambda: memory("later"), "E008", "mode='later'"),
        (lambda: hook("P", colour="red"), "E008", "no argument 'colour'"),
        (lambda: dtype("fp64"), "E015", "type='fp64'"),
        (lambda: fuse("everything"), "E013", "unknown fusion pattern"),
        (lambda: fuse(), "E013", "needs a pattern"),
        (lambda: assert_("import os"), "E026", "cannot be read"),
        (lambda: assert_("open(a)"), "E026", "unknown function 'open'"),
        (lambda: shard(), "E008", "needs strategy"),
        (lambda: partition(-1), "E008", "stage=-1"),
    ],
)
def test_bad_annotation_arguments_are_named_at_the_users_line(make, code: str, words: str) -> None:
    with pytest.raises(DSLError) as info:
        make()
    (diag,) = info.value.diagnostics
    assert diag.code == code and words in diag.message
    assert diag.location is not None and "test_annotations.py" in diag.location


#: the file of the line that wrote the annotation: this one for an annotation made by a call, the model's
#: (kiln.dsl.testing) for a bare one, which the model's line applies
HERE, MODEL = "test_annotations.py", "testing.py"


@pytest.mark.parametrize(
    ("kw", "code", "words", "where"),
    [
        ({"h_ann": (frozen,)}, "E008", "@frozen annotates a param or module, not a tensor", MODEL),
        ({"w_ann": (hook("X"),)}, "E008", "@hook annotates a tensor, not a parameter", HERE),
        ({"cls_ann": (kernel("k"),)}, "E008", "@kernel annotates a tensor, not a module", HERE),
        ({"h_ann": (lifetime(end="nowhere"),)}, "E002", "'nowhere'", HERE),
        ({"cls_ann": (checkpoint(preserve=["nope"]),)}, "E002", "'nope'", HERE),
        ({"h_ann": (partition(0),), "a_ann": (partition(1),), "cls_ann": (checkpoint,)}, "E025", "stages",
         MODEL),
    ],
)
def test_misplaced_annotations_are_compile_errors(kw: dict, code: str, words: str, where: str) -> None:
    name = f"Bad{code}{abs(hash(words)) % 10000}"
    with pytest.raises(DSLError) as info:
        build_bundle(lm(name, **kw), {})
    diag = info.value.diagnostics[0]
    assert diag.code == code and words in diag.message, diag.message
    assert where in (diag.location or ""), diag.location


def test_recompute_in_a_model_graph_is_e021() -> None:
    @model
    class RecomputeInModel:
        def __init__(self, vocab_size: int = V, d_model: int = C):
            self.vocab_size, self.d_model = vocab_size, d_model

        embedding = Param(Tensor["vocab_size", "d_model", "fp32"])

        @forward
        def forward(
            self,
            token_ids: Tensor["B", "T", "int32"],
            position_ids: Tensor["T", "int32"],
            targets: Tensor["B", "T", "int32"],
        ) -> Tensor["B * T", "fp32"]:
            with graph() as g:
                x = g.silu(g.embedding(token_ids, "embedding")) @ memory("recompute")
                return g.fused_lm_head_loss(g.view(x, shape=[B * T, "d_model"]), "embedding", targets)

    (error,) = compile_model(RecomputeInModel, {})["errors"]
    assert error["code"] == "E021" and "'x'" in error["message"] and "@model" in error["message"]


def test_modify_hook_on_a_view_is_refused() -> None:
    @block
    class HookedView:
        def __init__(self, d_model: int):
            self.d_model = d_model

        @forward
        def forward(self, x: Tensor["B", "T", "d_model", "fp32"]) -> Tensor["B", "T", "d_model", "fp32"]:
            with graph() as g:
                flat = g.view(x, shape=[B * T, "d_model"]) @ hook("Flat", mode="modify")
                return g.view(g.silu(flat), shape=[B, T, "d_model"])

    (error,) = compile_model(stack_lm("HookedViewLM", "HookedView"), {})["errors"]
    assert error["code"] == "E008" and "view" in error["message"]


# --- honoured: training annotations ------------------------------------------------------------------


@pytest.mark.parametrize("annotated", [True, False])
def test_frozen_weight_has_no_gradient_and_keeps_its_bytes(annotated: bool) -> None:
    name = f"FrozenW1{annotated}"
    anns = (frozen,) if annotated else ()
    bundle = build_bundle(lm(name, w_ann=anns, embedding_ann=anns), {})
    m = Model(bundle, optimizer={"name": "adamw", "lr": 0.1})
    ids, labels = batch()
    before = {k: m.parameter(k).tobytes() for k in ("blocks.0.w1", "blocks.1.w1", "embedding", "blocks.0.w2")}
    program = m.program(*ids.shape)
    m.train_step({"input_ids": ids, "labels": labels})
    grads = {p.name for p in program.params if p.grad}
    for key in ("blocks.0.w1", "blocks.1.w1", "embedding"):
        assert (key in grads) is not annotated
        assert (m.parameter(key).tobytes() == before[key]) is annotated
    # no gradient buffer is planned for a frozen parameter
    assert ("blocks.0.d_w1" in program.tensors) is not annotated
    assert ("d_embedding" in program.tensors) is not annotated
    assert ("adamw.exp_avg.blocks.0.w1" in program.tensors) is not annotated
    assert m.parameter("blocks.0.w2").tobytes() != before["blocks.0.w2"]  # the rest trains


def test_trainable_lr_scale_is_a_parameter_group() -> None:
    bundle = build_bundle(lm("ScaledLr", w_ann=(trainable(lr_scale=0.0),)), {})
    m = Model(bundle, optimizer={"name": "sgd", "lr": 0.5})
    ids, labels = batch()
    w1, w2 = m.parameter("blocks.1.w1"), m.parameter("blocks.1.w2")
    _, grads = m.loss_and_grads(ids, labels)
    m.train_step({"input_ids": ids, "labels": labels})
    assert np.abs(grads["blocks.1.w1"]).max() > 0  # it has a gradient, and its learning rate is 0
    np.testing.assert_array_equal(m.parameter("blocks.1.w1"), w1)
    np.testing.assert_allclose(
        m.parameter("blocks.1.w2"), w2 - 0.5 * grads["blocks.1.w2"], rtol=1e-5, atol=1e-7
    )


def test_gradient_scale_and_clip_apply_per_parameter() -> None:
    m = Model(
        build_bundle(lm("GradScaled", w_ann=(gradient(scale=0.5),)), {}),
        optimizer={"name": "sgd", "lr": 0.5, "max_grad_norm": None, "weight_decay": 0.0},
    )
    ids, labels = batch(6)
    w1, w2 = m.parameter("blocks.0.w1"), m.parameter("blocks.0.w2")
    _, grads = m.loss_and_grads(ids, labels)  # the gradient before the rule
    m.train_step({"input_ids": ids, "labels": labels})
    np.testing.assert_allclose(
        m.parameter("blocks.0.w1"), w1 - 0.5 * 0.5 * grads["blocks.0.w1"], rtol=1e-5, atol=1e-7
    )
    np.testing.assert_allclose(
        m.parameter("blocks.0.w2"), w2 - 0.5 * grads["blocks.0.w2"], rtol=1e-5, atol=1e-7
    )

    m = big_weights(
        Model(
            build_bundle(lm("GradClipped", w_ann=(gradient(clip=0.05),)), {}),
            optimizer={"name": "sgd", "lr": 1.0, "max_grad_norm": None, "weight_decay": 0.0},
        )
    )
    w1 = m.parameter("blocks.1.w1")
    _, grads = m.loss_and_grads(ids, labels)
    assert np.linalg.norm(grads["blocks.1.w1"]) > 0.1
    m.train_step({"input_ids": ids, "labels": labels}, micro_batches=2)
    step = w1 - m.parameter("blocks.1.w1")
    assert np.linalg.norm(step) == pytest.approx(0.05, rel=1e-3)  # clipped to its own norm
    np.testing.assert_allclose(
        step / np.linalg.norm(step),
        grads["blocks.1.w1"] / np.linalg.norm(grads["blocks.1.w1"]),
        rtol=1e-4,
        atol=1e-6,
    )


def test_gradient_skip_freezes_the_parameter() -> None:
    bundle = build_bundle(lm("GradSkipped", w_ann=(gradient("skip"),)), {})
    assert bundle.module("GradSkippedBlock").param("w1").frozen


# --- honoured: memory annotations -------------------------------------------------------------------


def test_checkpointed_block_lowers_the_planned_peak_and_keeps_gradients() -> None:
    plain = build_bundle(lm("Plain", n_layers=4), {})
    ckpt = build_bundle(lm("Checkpointed", cls_ann=(checkpoint,), n_layers=4), {})
    layer = ckpt.module("CheckpointedBlock")
    assert set(layer.forward.recompute) >= {"h", "a"} and plain.module("PlainBlock").forward.recompute == ()
    peaks = {}
    for name, bundle in (("plain", plain), ("ckpt", ckpt)):
        program = compile(bundle, bindings={"B": 4, "T": 16}, recompute="dsl")
        peaks[name] = program.memory_report()["saved_activations"]
    assert peaks["ckpt"] < peaks["plain"]
    ids, labels = batch(1)
    weights = Model(plain).parameters()
    renamed = weights  # the same parameter names: blocks.<i>.w1, ...
    _, reference = Model(plain, weights=renamed).loss_and_grads(ids, labels)
    _, grads = Model(ckpt, weights=renamed, recompute="dsl").loss_and_grads(ids, labels)
    assert all(np.array_equal(grads[k], reference[k]) for k in reference)


def test_checkpoint_on_a_stacked_blocks_call_checkpoints_the_block() -> None:
    @model
    class CheckpointedCall:
        def __init__(self, vocab_size: int = V, d_model: int = C, n_layers: int = 4):
            self.vocab_size, self.d_model, self.n_layers = vocab_size, d_model, n_layers

        embedding = Param(Tensor["vocab_size", "d_model", "fp32"])
        blocks = Param(Array["n_layers", "CallCkptBlock"])

        @forward
        def forward(
            self,
            token_ids: Tensor["B", "T", "int32"],
            position_ids: Tensor["T", "int32"],
            targets: Tensor["B", "T", "int32"],
        ) -> Tensor["B * T", "fp32"]:
            with graph() as g:
                x0 = g.embedding(token_ids, "embedding")
                xN = (
                    g.call("StackedBlocks", x0, num_outputs=1, blocks="blocks", n_layers=self.n_layers)
                    @ checkpoint
                )
                return g.fused_lm_head_loss(g.view(xN, shape=[B * T, "d_model"]), "embedding", targets)

    lm("CallCkpt", h_ann=(memory("save"),))  # registers the block CallCkptBlock
    bundle = build_bundle(CheckpointedCall, {})
    layer = bundle.module("CallCkptBlock")
    assert layer.forward.save == ("h",) and {"a", "x_flat"} <= set(layer.forward.recompute)  # @memory wins
    assert bundle.module("CheckpointedCall").forward.recompute == ()  # the model's graph recomputes nothing
    (ann,) = bundle.module("CheckpointedCall").annotated("checkpoint")
    assert ann.target == "xN"
    plain = bundle.evolve(
        modules=[m.evolve(forward=m.forward.evolve(save=(), recompute=())) for m in bundle.modules]
    )
    saved = {
        name: compile(b, bindings={"B": 4, "T": 16}, recompute="dsl").memory_report()["saved_activations"]
        for name, b in (("plain", plain), ("ckpt", bundle))
    }
    assert saved["ckpt"] < saved["plain"]


def test_memory_annotation_outranks_checkpoint_and_save_lists() -> None:
    bundle = build_bundle(lm("Precedence", cls_ann=(checkpoint(preserve=["a"]),), h_ann=(memory("save"),)),
                          {})
    layer = bundle.module("PrecedenceBlock")
    assert "h" in layer.forward.save and "a" in layer.forward.save  # @memory (1), preserve (2)
    assert "h" not in layer.forward.recompute and "x_flat" in layer.forward.recompute  # the checkpoint (3)
    bundle = build_bundle(lm("NoCheckpoint", cls_ann=(checkpoint(granularity="none"),),
                             h_ann=(memory("recompute"),)), {})
    layer = bundle.module("NoCheckpointBlock")
    assert layer.forward.recompute == ("h",) and "a" in layer.forward.save


# --- honoured: run-time annotations -----------------------------------------------------------------


def test_modify_hook_changes_the_tensor_as_an_op_would() -> None:
    hooked_lm = lm("Hooked", a_ann=(hook("AfterMLPActivation", mode="modify"),))
    hooked = big_weights(Model(build_bundle(hooked_lm, {})))
    # the oracle: the model without the hook, w2 doubled (2a @ w2^T is a @ (2 w2)^T, to the bit)
    doubled = Model(build_bundle(lm("Doubled"), {}),
                    weights={k: 2 * w if k.endswith(".w2") else w for k, w in hooked.parameters().items()})
    ids, labels = batch(2)
    plain = hooked.loss(ids, labels)
    seen = []

    def double(t: np.ndarray, info) -> None:
        seen.append((info.tensor, info.layer, info.key))
        t *= 2

    with hooked.hooks.add("AfterMLPActivation", double):
        assert hooked.loss(ids, labels) == pytest.approx(doubled.loss(ids, labels), rel=1e-6)
    assert seen == [("a", 0, "blocks.0.a"), ("a", 1, "blocks.1.a")]
    assert hooked.loss(ids, labels) == plain  # removed: the model is as before
    assert plain != pytest.approx(doubled.loss(ids, labels), rel=1e-6)


def test_modify_hook_runs_again_where_the_backward_replays_the_tensor() -> None:
    bundle = build_bundle(lm("HookedCkpt", cls_ann=(checkpoint,), a_ann=(hook("Act", mode="modify"),)), {})
    assert "a" in bundle.module("HookedCkptBlock").forward.recompute
    ids, labels = batch(11)
    grads = {}
    for mode in ("none", "dsl"):
        m = Model(bundle, recompute=mode)
        big_weights(m)
        calls = []

        def triple(t, info, calls=calls) -> None:
            calls.append(info.recompute)
            t *= 3

        m.hooks.add("Act", triple)
        _, grads[mode] = m.loss_and_grads(ids, labels)
        assert calls == ([False, False] if mode == "none" else [False, False, True, True])
    assert all(np.array_equal(grads["dsl"][k], grads["none"][k]) for k in grads["none"])


def test_observe_hook_sees_a_read_only_copy_and_replace_hooks_return_values() -> None:
    anns = {"h_ann": (hook("AfterMLPUpProjection"),), "a_ann": (hook("Act", mode="replace"),)}
    m = big_weights(Model(build_bundle(lm("Observed", n_layers=1, **anns), {})))
    ids, labels = batch(3)
    got = {}

    def look(t: np.ndarray, info) -> None:
        got["h"] = t.copy()
        with pytest.raises(ValueError):
            t += 1

    m.hooks.add("AfterMLPUpProjection", look)
    x = m.parameter("embedding")[ids].reshape(-1, C)
    base = m.loss(ids, labels)
    np.testing.assert_allclose(got["h"], x @ m.parameter("blocks.0.w1").T, rtol=1e-5, atol=1e-6)
    m.hooks.add("Act", lambda t, info: np.zeros_like(t))  # the MLP adds nothing: loss of x itself
    logits = x @ m.parameter("head").T
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    expected = float(np.mean(lse - logits[np.arange(len(logits)), labels.ravel()]))
    assert m.loss(ids, labels) == pytest.approx(expected, rel=1e-5) and m.loss(ids, labels) != base
    with pytest.raises(KilnError, match=r"declared @hook\(mode='observe'\)"):
        m.hooks.add("AfterMLPUpProjection", look, mode="modify")
    with pytest.raises(KilnError, match="no hook point 'Nope'"):
        m.hooks.add("Nope", look)


def test_failed_assert_stops_the_run_naming_the_tensor() -> None:
    m = Model(build_bundle(lm("Asserted", a_ann=(assert_("all(a < 0)", message="negative only"),)), {}))
    ids, labels = batch()
    with pytest.raises(KilnError, match=r"@assert failed on tensor 'a' in layer 0 .*negative only") as info:
        m.train_step({"input_ids": ids, "labels": labels})
    assert info.value.code == "E027" and "test_annotations.py" in (info.value.hint or "")
    ok = build_bundle(lm("AssertedOk", a_ann=(assert_("!has_nan(a) && all(a > -1)"),)), {})
    Model(ok).train_step({"input_ids": ids, "labels": labels})


def test_probe_captures_statistics_once_enabled() -> None:
    m = Model(build_bundle(lm("Probed", h_ann=(probe("up"),)), {}))
    ids, labels = batch(4)
    m.loss(ids, labels)
    assert m.probes["up"] == []  # off until enabled: nothing captured
    m.probes.enable()
    m.loss(ids, labels)
    first = m.probes["up"][0]
    h = m.parameter("embedding")[ids].reshape(-1, C) @ m.parameter("blocks.0.w1").T
    assert first.layer == 0 and first.tensor == "h"
    assert (first.mean, first.std, first.min, first.max) == pytest.approx(
        (h.mean(), h.std(), h.min(), h.max()), rel=1e-5, abs=1e-6
    )


def test_grad_probe_captures_the_gradient_of_the_tensor() -> None:
    anns = (probe("d_act", capture="grad_full"), probe("act", capture="full"))
    m = big_weights(Model(build_bundle(lm("GradProbed", a_ann=anns, n_layers=1), {})))
    ids, labels = batch(8)
    m.probes.enable()
    _, grads = m.loss_and_grads(ids, labels)
    (d_a,) = m.probes["d_act"]
    (a,) = m.probes["act"]
    h = m.parameter("embedding")[ids].reshape(-1, C) @ m.parameter("blocks.0.w1").T
    np.testing.assert_allclose(a.value, h / (1 + np.exp(-h)), rtol=1e-5, atol=1e-6)  # silu(h)
    # w2's gradient is d_out^T a, and d_a = d_out w2: so d_a^T a... checked through the chain rule of w2
    d_out = np.linalg.lstsq(m.parameter("blocks.0.w2").T, d_a.value.T, rcond=None)[0].T
    np.testing.assert_allclose(d_out.T @ a.value, grads["blocks.0.w2"], rtol=1e-3, atol=1e-6)


def test_trace_and_profile_print_each_op_with_shapes_and_times() -> None:
    out = io.StringIO()
    traced = lm("Traced", cls_ann=(trace(level="tensors"),), h_ann=(profile("up"),), n_layers=1)
    m = Model(build_bundle(traced, {}), trace_stream=out)
    ids, labels = batch(b=2, t=3)
    m.loss(ids, labels)
    lines = out.getvalue().splitlines()
    expected = "[TRACE] matmul [layer 0]: blocks.0.x_flat=[6, 8], blocks.0.w1=[8, 8] -> blocks.0.h=[6, 8]"
    assert any(line.startswith(expected) for line in lines)
    assert sum(line.startswith("[TRACE]") for line in lines) == 6  # every forward op of the block
    assert all(line.endswith(" ms)") for line in lines)
    assert any(line.startswith("[PROFILE] up: matmul") for line in lines) and m.profile["up"][0] == 1


def test_kernel_and_nofuse_choose_how_the_op_runs() -> None:
    plain = big_weights(Model(build_bundle(lm("KernelPlain", n_layers=1), {})))
    anns = {"h_ann": (kernel("reference"),), "a_ann": (kernel("silu@numpy:*"), nofuse)}
    chosen = Model(build_bundle(lm("KernelChosen", n_layers=1, **anns), {}), weights=plain.parameters())
    ids, labels = batch(9)

    def step_of(m: Model, key: str):
        return next(s for s in m.program(*ids.shape).steps if s.phase == "forward" and key in s.outputs)

    assert step_of(plain, "blocks.0.h").kernel == "matmul@numpy:*"  # the table's BLAS kernel
    assert (step_of(chosen, "blocks.0.h").kernel, step_of(chosen, "blocks.0.h").how) == ("", "kernel")
    assert step_of(chosen, "blocks.0.a").kernel == "silu@numpy:*"
    loss, grads = chosen.loss_and_grads(ids, labels)
    ref_loss, ref_grads = plain.loss_and_grads(ids, labels)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert all(np.allclose(grads[k], ref_grads[k], rtol=1e-5, atol=1e-6) for k in ref_grads)

    missing = lm("KernelMissing", h_ann=(kernel("cublas_gemm", fallback=False),), n_layers=1)
    with pytest.raises(KilnError, match=r"@kernel\('cublas_gemm'\) on tensor 'h'.*not in the kernel table"):
        Model(build_bundle(missing, {})).loss(ids, labels)


def test_nofuse_on_the_loss_keeps_the_head_unfused() -> None:
    bundle = build_bundle(head_lm("UnfusedHead", nofuse(reason="profile the head")), {})
    plain = bundle.evolve(modules=[m.evolve(annotations=()) for m in bundle.modules])
    ids, labels = batch(10)
    assert Model(plain).program(*ids.shape).fusions != ()
    m = Model(bundle)
    assert m.program(*ids.shape).fusions == ()
    assert m.loss_and_grads(ids, labels)[0] == pytest.approx(
        Model(plain).loss_and_grads(ids, labels)[0], rel=1e-6
    )


def test_partition_is_verified_carried_reported_and_refused_at_run_time(tmp_path, capsys) -> None:
    from kiln.core.cli import main

    bundle = build_bundle(lm("Staged", h_ann=(partition(1),)), {})
    (ann,) = bundle.module("StagedBlock").annotated("partition")
    assert dict(ann.args) == {"stage": 1}
    path = tmp_path / "staged.json"
    path.write_text(bundle.to_json())
    assert main(["plan", str(path), "--batch", "2", "--seq", "4"]) == 0
    out = capsys.readouterr().out
    assert "pipeline stages (@partition; not executed yet" in out
    assert "stage 1: tensor 'h' of StagedBlock" in out
    with pytest.raises(KilnError, match="not executed yet"):
        Model(bundle)


def test_bundle_with_annotations_is_plain_json() -> None:
    bundle = build_bundle(lm("Json", h_ann=(hook("P", mode="modify"), memory("save"))), {})
    data = json.loads(bundle.to_json())
    block_json = next(m for m in data["modules"] if m["name"] == "JsonBlock")
    first = block_json["annotations"][0]
    assert first == {
        "kind": "hook",
        "target": "h",
        "args": {"point": "P", "mode": "modify"},
        "loc": first["loc"],
    }
