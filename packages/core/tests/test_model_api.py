"""The parts of ``Model`` that embedders and external training loops use: token-id range checks, a model
without an optimizer, tensors read and written by name, a batch feed, and a backward seeded from the
gradient of the logits."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from kiln_core_tiny import random_batch, tiny_qwen3_bundle

from kiln.core import SGD, KilnError, Model

V = 32


@pytest.fixture(scope="module")
def bundle() -> Any:
    return tiny_qwen3_bundle(vocab_size=V, num_layers=1, hidden_size=16, initializer_range=0.2)


# -- 1. token ids outside the vocabulary


BAD = [("input_ids", (1, 2), V), ("input_ids", (0, 4), -1), ("labels", (1, 0), V + 7), ("labels", (0, 3), -5)]
CALLS = ["train_step", "micro_batches", "loss", "loss_and_grads", "logits"]


@pytest.mark.parametrize(("name", "where", "value", "call"), [
    (*bad, call) for bad in BAD for call in CALLS if not (call == "logits" and bad[0] == "labels")])
def test_ids_outside_the_vocabulary_are_refused_before_anything_runs(
        bundle: Any, name: str, where: tuple[int, int], value: int, call: str) -> None:
    model = Model.from_ir(bundle, seed=0)
    batch = random_batch(V, 2, 6, seed=1)
    batch[name] = batch[name].copy()
    batch[name][where] = value
    before = model.parameters()
    with pytest.raises(KilnError) as info:
        if call == "train_step":
            model.train_step(batch)
        elif call == "micro_batches":
            model.train_step(batch, micro_batches=2)
        elif call == "logits":
            model.logits(batch["input_ids"])
        else:
            getattr(model, call)(batch["input_ids"], batch["labels"])
    text = str(info.value)
    assert f"{name}{list(where)} is {value}" in text and f"[0, {V})" in text
    assert info.value.tensor == name  # type: ignore[attr-defined]
    assert model.step == 0 and model._programs == {}  # nothing compiled, nothing ran
    for k, v in model.parameters().items():
        assert np.array_equal(v, before[k]), k


def test_the_ignore_index_and_the_last_id_are_valid(bundle: Any) -> None:
    model = Model.from_ir(bundle, seed=0)
    batch = random_batch(V, 2, 6, seed=1)
    batch["input_ids"][0, 0] = V - 1
    batch["labels"][1, :3] = model.ignore_index
    assert np.isfinite(model.train_step(batch)["loss"])
    batch["labels"][1, 4] = model.ignore_index - 1  # another negative label is not ignored
    with pytest.raises(KilnError, match=r"labels\[1, 4\] is -101.*not the ignored label -100"):
        model.loss(batch["input_ids"], batch["labels"])


def test_the_range_of_a_tied_head_is_the_embeddings() -> None:
    model = Model.from_ir(tiny_qwen3_bundle(vocab_size=20, tie_word_embeddings=True), seed=0)
    batch = random_batch(20, 1, 4, seed=0)
    batch["labels"][0, 1] = 20
    with pytest.raises(KilnError, match=r"labels\[0, 1\] is 20, outside the vocabulary \[0, 20\)"):
        model.train_step(batch)


# -- 2. optimizer=None


def test_no_optimizer_plans_and_allocates_no_state(bundle: Any) -> None:
    adamw, none = Model.from_ir(bundle, seed=0), Model.from_ir(bundle, seed=0, optimizer=None)
    slots = [-(-4 * v.size // 64) * 64 for v in adamw.parameters().values()]  # fp32, 64-byte aligned
    for m, state in ((adamw, 2 * sum(slots)), (none, 0)):  # AdamW: two moments per parameter
        report = m.memory_report(2, 6)
        assert report["optimizer_state"] == state
        assert report["weights"] == report["gradients"] == sum(slots)  # every parameter trains
        row = next(r for r in m.program(2, 6).memory_table().splitlines() if "optimizer" in r)
        assert row.split()[1:] == ([f"{state / 1024:.2f}", "KiB"] if state else ["0", "B"]), row
    assert adamw.program(2, 6).persistent_bytes - none.program(2, 6).persistent_bytes == 2 * sum(slots)
    assert none.arena_bytes < adamw.arena_bytes
    assert none.program(2, 6).phase("optimizer") == ()
    assert none.optimizer is None and none.state_dict()["optimizer"] == {"name": None, "step": 0}


def test_no_optimizer_refuses_train_step(bundle: Any) -> None:
    model = Model.from_ir(bundle, seed=0, optimizer=None)
    with pytest.raises(KilnError, match=r"no optimizer.*train_step") as info:
        model.train_step(random_batch(V, 2, 6, seed=1))
    assert "forward_backward" in (info.value.hint or "")
    with pytest.raises(KilnError, match="holds optimizer 'adamw'; this model has none"):
        model.load_state_dict(Model.from_ir(bundle, seed=0).state_dict())


def test_forward_backward_leaves_the_gradients_loss_and_grads_computes(bundle: Any) -> None:
    batch = random_batch(V, 4, 6, seed=2)
    batch["labels"][0, :2] = -100
    oracle = Model.from_ir(bundle, seed=3, optimizer=None)
    loss, grads = oracle.loss_and_grads(batch["input_ids"], batch["labels"])
    for micro in (1, 2):
        model = Model.from_ir(bundle, seed=3, optimizer=None)
        out = model.forward_backward(batch, micro_batches=micro)
        assert out["loss"] == pytest.approx(loss, rel=1e-6)
        assert out["tokens"] == np.count_nonzero(batch["labels"] != -100)
        got = model.gradients()
        assert set(got) == set(grads)
        for k, g in grads.items():
            np.testing.assert_allclose(got[k], g, rtol=1e-5, atol=1e-7, err_msg=k)
        assert model.step == 0


def test_an_external_sgd_loop_equals_kilns_sgd(bundle: Any) -> None:
    """The loop a PyTorch user writes (forward_backward, read gradients, update, write back) against
    kiln's own SGD update with the same settings: the same parameters after three steps."""
    batch = random_batch(V, 2, 6, seed=4)
    lr = 0.1
    inner = Model.from_ir(bundle, seed=5, optimizer=SGD(lr=lr, max_grad_norm=1e9))
    outer = Model.from_ir(bundle, seed=5, optimizer=None)
    for _ in range(3):
        inner.train_step(batch)
        outer.forward_backward(batch)
        params = outer.parameters()
        outer.set_parameters({k: params[k] - lr * g for k, g in outer.gradients().items()})
        outer.step += 1
    for k, v in inner.parameters().items():
        np.testing.assert_allclose(outer.parameter(k), v, rtol=1e-5, atol=1e-6, err_msg=k)


# -- 3. tensors by name, the batch feed and phases


def test_tensors_read_and_write_reach_the_weights_before_any_program(bundle: Any) -> None:
    model = Model.from_ir(bundle, seed=0)
    tensors = model.tensors()
    params = model.parameters()
    for k, v in params.items():
        assert (tensors[k].shape, tensors[k].dtype) == (v.shape, "float32")
        assert tensors[f"grad.{k}"].shape == tensors[f"adamw.exp_avg.{k}"].shape == v.shape
        np.testing.assert_array_equal(model.read(k), v)
    model.write("embedding", np.ones((V, 16)))
    np.testing.assert_array_equal(model.parameter("embedding"), 1.0)
    with pytest.raises(KilnError, match=r"tensor 'embedding' is \[32, 16\], the value given is \[16\]"):
        model.write("embedding", np.ones(16))
    with pytest.raises(KilnError, match="no tensor 'embeding'") as info:
        model.read("embeding")
    assert "'embedding'" in (info.value.hint or "")


def test_feed_and_run_are_a_training_step(bundle: Any) -> None:
    """feed + run(all phases) on one model, train_step on another: the same loss and parameters."""
    batch = random_batch(V, 2, 6, seed=3)
    a, b = Model.from_ir(bundle, seed=1), Model.from_ir(bundle, seed=1)
    for _ in range(2):
        stats = a.train_step(batch)
        prog = b.feed(batch)
        assert (prog.task, prog.bindings["B"], prog.bindings["T"]) == ("train", 2, 6)
        listed = b.tensors()
        assert {"grad.embedding", "adamw.exp_avg_sq.embedding"} <= set(listed)
        assert {t.slot for t in listed.values()} == {t.slot for t in prog.tensors.values()} | {
            t.slot for t in listed.values() if t.name not in prog.tensors}
        np.testing.assert_array_equal(b.read("token_ids"), batch["input_ids"])
        np.testing.assert_array_equal(b.read("targets"), batch["labels"])
        mask = batch["labels"] != -100
        np.testing.assert_allclose(b.read("d_loss"), (mask / mask.sum()).reshape(-1), rtol=1e-6)
        assert b.run(("forward", "backward", "grad_sync")) == {}
        loss = float(b.read("loss").sum()) / mask.sum()
        update = b.run(["optimizer"])
        assert loss == pytest.approx(stats["loss"], rel=1e-6)
        assert update["grad_norm"] == pytest.approx(stats["grad_norm"], rel=1e-6) and b.step == a.step
    for k, v in a.parameters().items():
        np.testing.assert_array_equal(b.parameter(k), v, err_msg=k)


def test_a_scaled_seed_written_by_name_scales_the_gradients(bundle: Any) -> None:
    batch = random_batch(V, 2, 6, seed=5)
    model = Model.from_ir(bundle, seed=2, optimizer=None, dtype="float64")
    _, grads = model.loss_and_grads(batch["input_ids"], batch["labels"])
    model.feed(batch)
    model.write("d_loss", 3.0 * model.read("d_loss"))
    model.run()
    for k, g in grads.items():
        np.testing.assert_allclose(model.read(f"grad.{k}"), 3.0 * g, rtol=1e-10, atol=1e-14, err_msg=k)


def test_tensors_lists_each_gradient_slot_once_and_read_takes_both_names(bundle: Any) -> None:
    batch = random_batch(V, 2, 6, seed=4)
    model = Model.from_ir(bundle, seed=2, optimizer=None, dtype="float64")
    _, grads = model.loss_and_grads(batch["input_ids"], batch["labels"])
    prog = model.feed(batch)
    model.run()
    tensors = model.tensors()
    places = [(t.pool, t.offset) for t in tensors.values() if t.slot.startswith("grad.")]
    assert len(places) == len(set(places)), "a gradient slot is listed under two names"
    for k, g in grads.items():  # the oracle: loss_and_grads, a separate run of the same batch
        assert f"grad.{k}" in tensors and f"d_{k}" not in tensors
        np.testing.assert_allclose(model.read(f"grad.{k}"), g, rtol=1e-10, atol=1e-14, err_msg=k)
        if f"d_{k}" in prog.tensors:  # the Program's own name still reaches the same slot
            np.testing.assert_array_equal(model.read(f"d_{k}"), model.read(f"grad.{k}"))
    assert any(f"d_{k}" in prog.tensors for k in grads)
    model.write("d_embedding", np.zeros_like(grads["embedding"]))
    assert not model.read("grad.embedding").any()


def test_feed_and_run_refuse_what_they_cannot_do(bundle: Any) -> None:
    model = Model.from_ir(bundle, seed=0, optimizer=None)
    with pytest.raises(KilnError, match="no Program is current"):
        model.run()
    with pytest.raises(KilnError, match="holds input_ids and labels"):
        model.feed({"input_ids": np.zeros((1, 4), int)})
    with pytest.raises(KilnError, match=r"input_ids\[0, 1\] is 99"):
        model.feed({"input_ids": np.array([[1, 99]])}, task="logits")
    model.feed({"input_ids": np.array([[1, 2]])}, task="logits")
    model.run(["forward"])
    np.testing.assert_allclose(model.read("logits").reshape(1, 2, V), model.logits(np.array([[1, 2]])),
                               rtol=1e-6)
    with pytest.raises(KilnError, match="unknown phase 'backwards'"):
        model.run(["backwards"])
    with pytest.raises(KilnError, match="cannot run the optimizer phase"):
        model.run(["optimizer"])


# -- 4. a backward seeded from the gradient of the logits


@pytest.mark.parametrize("tied", [False, True])
def test_backward_from_logits_equals_finite_differences(tied: bool) -> None:
    """The gradient of sum(logits * G) for a random G, against central differences of model.logits in
    float64 (the tied head's embedding gets both its uses)."""
    bundle = tiny_qwen3_bundle(vocab_size=16, num_layers=2, hidden_size=16, initializer_range=0.2,
                               tie_word_embeddings=tied)
    model = Model.from_ir(bundle, seed=1, dtype="float64", optimizer=None)
    ids = random_batch(16, 2, 3, seed=0)["input_ids"]
    rng = np.random.default_rng(7)
    seed = rng.standard_normal((2, 3, 16))
    model.backward_from_logits(ids, seed)
    grads = model.gradients()
    params = model.parameters()
    assert set(grads) == set(params)
    eps = 1e-6
    for name, g in grads.items():
        x = params[name]
        for j in rng.choice(x.size, min(3, x.size), replace=False):
            sums = []
            for step in (eps, -eps):
                moved = x.copy()
                moved.reshape(-1)[j] += step
                model.set_parameters({name: moved})
                sums.append(float(np.sum(model.logits(ids) * seed)))
            model.set_parameters({name: x})
            fd = (sums[0] - sums[1]) / (2 * eps)
            assert g.reshape(-1)[j] == pytest.approx(fd, rel=1e-5, abs=1e-8), (name, j)


def test_the_cross_entropy_gradient_of_the_logits_gives_the_loss_gradients(bundle: Any) -> None:
    """Seeded with d(mean cross-entropy)/d(logits), computed here from the logits with NumPy, the backward
    gives what loss_and_grads gives."""
    model = Model.from_ir(bundle, seed=4, dtype="float64", optimizer=None)
    batch = random_batch(V, 2, 5, seed=6)
    batch["labels"][1, 1] = -100
    _, grads = model.loss_and_grads(batch["input_ids"], batch["labels"])
    logits = model.logits(batch["input_ids"])
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    keep = batch["labels"] != -100
    onehot = np.eye(V)[np.where(keep, batch["labels"], 0)]
    seed = (p - onehot) * keep[..., None] / keep.sum()
    model.backward_from_logits(batch["input_ids"], seed)
    for k, g in model.gradients().items():
        np.testing.assert_allclose(g, grads[k], rtol=1e-9, atol=1e-12, err_msg=k)


def test_backward_from_logits_refuses_a_seed_of_another_shape(bundle: Any) -> None:
    model = Model.from_ir(bundle, seed=0, optimizer=None)
    ids = np.zeros((2, 3), np.int64)
    with pytest.raises(KilnError, match=r"d_logits must be a float array \[batch, seq, vocab\] = "
                                        r"\[2, 3, 32\], found float64 \[2, 3, 31\]") as info:
        model.backward_from_logits(ids, np.zeros((2, 3, 31)))
    assert info.value.tensor == "d_logits"  # type: ignore[attr-defined]
    with pytest.raises(KilnError, match=r"input_ids\[1, 2\] is 32"):
        model.backward_from_logits(np.array([[0, 1, 2], [3, 4, 32]]), np.zeros((2, 3, V)))
