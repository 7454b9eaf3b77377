"""The runtime's acceptance tests on a tiny Qwen3-style model: gradients, training, memory, oracle."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from kiln_core_tiny import random_batch, tiny_qwen3_bundle

from kiln.core import AdamW, KilnError, Model, op_registry
from kiln.core.autodiff import derive_backward
from kiln.core.autodiff._gradcheck import max_rel_error
from kiln.core.autodiff._interp import run_graph

MiB = 1 << 20


def _fd_check(model: Model, batch: dict[str, np.ndarray], grads: dict[str, np.ndarray], *, per_param: int,
              eps: float, seed: int = 0) -> dict[str, float]:
    """Central differences of the loss at ``per_param`` random entries of every parameter."""
    rng = np.random.default_rng(seed)
    params = model.parameters()
    report = {}
    for name, g in grads.items():
        x = params[name]
        idx = rng.choice(x.size, min(per_param, x.size), replace=False)
        fd = np.empty(len(idx))
        for n, j in enumerate(idx):
            losses = []
            for step in (eps, -eps):
                moved = x.copy()
                moved.reshape(-1)[j] += step
                model.set_parameters({name: moved})
                losses.append(model.loss(batch["input_ids"], batch["labels"]))
            fd[n] = (losses[0] - losses[1]) / (2 * eps)
        model.set_parameters({name: x})
        report[name] = max_rel_error(g.reshape(-1)[idx], fd)
    return report


def test_whole_model_gradients_equal_finite_differences() -> None:
    bundle = tiny_qwen3_bundle(num_layers=2, hidden_size=16, initializer_range=0.2)
    model = Model.from_ir(bundle, dtype="float64", seed=3)
    batch = random_batch(32, 2, 6, seed=1)
    loss, grads = model.loss_and_grads(batch["input_ids"], batch["labels"])
    assert np.isfinite(loss) and loss > 0
    assert set(grads) == set(model.parameters())  # every parameter trains and gets a gradient
    report = _fd_check(model, batch, grads, per_param=6, eps=1e-5)
    worst = max(report.items(), key=lambda kv: kv[1])
    assert worst[1] <= 1e-6, worst


def test_gradients_equal_the_reference_interpreter() -> None:
    bundle = tiny_qwen3_bundle(tie_word_embeddings=True, initializer_range=0.2)
    top, modules = bundle.module("Qwen3Model"), {m.name: m for m in bundle.modules}
    assert top.forward is not None
    batch = random_batch(32, 3, 5, seed=2)
    for dtype, tol in (("float64", 1e-12), ("float32", 1e-5)):
        model = Model.from_ir(bundle, dtype=dtype, seed=1)
        loss, grads = model.loss_and_grads(batch["input_ids"], batch["labels"])

        values = {**model.parameters(), "token_ids": batch["input_ids"], "targets": batch["labels"],
                  "position_ids": np.arange(5, dtype=np.int32)}
        binds = {"B": 3, "T": 5, **{k: v for k, v in top.config.items() if type(v) is int}}
        env = run_graph(top.forward, values, bindings=binds, float_dtype=np.dtype(dtype), modules=modules)
        mask = batch["labels"].reshape(-1) != -100
        backward = derive_backward(top.forward, modules=modules, registry=op_registry()).backward
        seed = {"d_loss": (mask / mask.sum()).astype(dtype), **{f"saved.{k}": v for k, v in env.items()}}
        genv = run_graph(backward, {**values, **seed}, bindings=binds, float_dtype=np.dtype(dtype),
                         modules=modules)
        reference = {**genv["d_blocks"], "embedding": genv["d_embedding"],
                     "final_norm.weight": genv["d_final_norm.weight"]}

        assert abs(loss - float(np.sum(env["loss"])) / mask.sum()) <= tol * abs(loss)
        assert set(grads) == set(reference)
        for name, g in reference.items():
            assert max_rel_error(grads[name], g) <= tol, (dtype, name)


def _train(steps: int) -> list[float]:
    bundle = tiny_qwen3_bundle(vocab_size=64, hidden_size=32, num_heads=4, num_kv_heads=2,
                               intermediate_size=64)
    batch = random_batch(64, 4, 16, seed=1)
    opt = AdamW(lr=1e-2, warmup_steps=10, total_steps=steps, weight_decay=0.01, min_lr_ratio=0.1)
    model = Model.from_ir(bundle, seed=0, optimizer=opt)
    return [model.train_step(batch)["loss"] for _ in range(steps)]


def test_training_memorises_a_batch_deterministically() -> None:
    first, second = _train(200), _train(200)
    assert first == second  # bit for bit
    assert first[-1] <= 0.1 * first[0], (first[0], first[-1])


def test_planned_peak_is_the_arena_and_steps_allocate_almost_nothing() -> None:
    # big enough that keeping every activation (the reference interpreter's way) would exceed 1 MiB
    bundle = tiny_qwen3_bundle(vocab_size=256, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                               intermediate_size=128)
    batch = random_batch(256, 4, 32, seed=1)
    tracemalloc.start()
    try:
        model = Model.from_ir(bundle, seed=0)
        model.train_step(batch)  # warm-up: compiles, allocates the arena, binds the views
        model.train_step(batch)
        report = model.memory_report()
        numpy_blocks = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)]).traces
        assert max(t.size for t in numpy_blocks) == report["peak"] == model.arena_bytes
        assert report["saved_activations"] + report["transient"] > MiB

        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        for _ in range(3):
            model.train_step(batch)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - before < MiB, (peak - before) / MiB


def _beyond_the_arena(model: Model, batch: dict[str, np.ndarray]) -> tuple[int, int]:
    """(bytes still held, peak bytes) that steady-state training steps allocate outside the arena."""
    model.train_step(batch)
    model.train_step(batch)
    before, _ = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    for _ in range(2):
        model.train_step(batch)
    after, peak = tracemalloc.get_traced_memory()
    return after - before, peak - before


def test_what_steps_allocate_beyond_the_arena_does_not_grow_with_the_batch() -> None:
    """The kernels' temporaries are bounded by their block sizes and thread count (and kept scratch
    is allocated once): four times the batch, four times the arena, the same few MiB beyond it."""
    bundle = tiny_qwen3_bundle(vocab_size=256, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                               intermediate_size=128)
    found = {}
    tracemalloc.start()
    try:
        for b in (64, 256):
            model = Model.from_ir(bundle, seed=0)
            found[b] = (*_beyond_the_arena(model, random_batch(256, b, 64, seed=2)), model.arena_bytes)
            del model
    finally:
        tracemalloc.stop()
    (held_s, peak_s, arena_s), (held_l, peak_l, arena_l) = found[64], found[256]
    assert arena_l > 3.5 * arena_s
    assert held_s < 64 * 1024 and held_l < 64 * 1024, (held_s, held_l)
    assert peak_l <= 1.1 * peak_s + 256 * 1024, (peak_s / MiB, peak_l / MiB)
    assert peak_l < 8 * MiB < arena_l / 4, (peak_l / MiB, arena_l / MiB)


def test_a_model_without_segment_ids_refuses_masks_it_cannot_apply() -> None:
    model = Model(tiny_qwen3_bundle())  # its position_ids are [T] and it has no segment_ids input
    ids = np.ones((2, 4), np.int64)
    plain = model.logits(ids)
    np.testing.assert_array_equal(model.logits(ids, attention_mask=np.ones_like(ids),
                                               position_ids=np.tile(np.arange(4), (2, 1))), plain)
    with pytest.raises(KilnError, match="no segment_ids input: it cannot mask padding"):
        model.logits(ids, attention_mask=np.array([[0, 1, 1, 1], [1, 1, 1, 1]]))
    with pytest.raises(KilnError, match="position_ids input is \\[seq\\], shared by the batch"):
        model.logits(ids, position_ids=np.array([[0, 1, 2, 3], [1, 2, 3, 4]]))


def test_the_ignore_index_pass_moves_the_label_the_losses_ignore() -> None:
    ids, labels = np.array([[1, 2, 3, 4]]), np.array([[2, 3, 4, -100]])
    plain = Model(tiny_qwen3_bundle(), seed=0, dtype="float64")
    moved = Model(tiny_qwen3_bundle(), seed=0, dtype="float64", passes=[("ignore_index", {"value": 31})])
    assert (plain.ignore_index, moved.ignore_index) == (-100, 31)
    loss, grads = plain.loss_and_grads(ids, labels)
    loss2, grads2 = moved.loss_and_grads(ids, np.where(labels == -100, 31, labels))
    assert loss2 == loss and all(np.array_equal(grads2[k], g) for k, g in grads.items())
    with pytest.raises(KilnError, match=r"labels\[0, 3\] is -100, outside"):  # a label like any other now
        moved.loss(ids, labels)
    with pytest.raises(KilnError, match=r"graph pass 'ignore_index' takes \{'value': int\}"):
        Model(tiny_qwen3_bundle(), passes=[("ignore_index", {"value": "x"})])
