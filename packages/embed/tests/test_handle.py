"""kiln.embed's Python API against kiln.core's: the same losses, gradients and parameters bit for bit,
in kiln's memory and in host memory; the plan is the Program's; bad input is an EmbedError naming
what is at fault."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kiln.core import PHASES, Model
from kiln.core import compile as compile_program
from kiln.dsl import build_bundle
from kiln.embed import EmbedError, ProgramHandle, compile, error_dict


def _aligned(nbytes: int) -> np.ndarray:
    raw = np.zeros(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + nbytes]


def _step(model: Any, batch: tuple[np.ndarray, np.ndarray]) -> float:
    return float(model.train_step({"input_ids": batch[0], "labels": batch[1]})["loss"])


def test_training_in_kiln_memory_then_in_host_memory_equals_model(
        spec: dict[str, Any], oracle: Callable[..., Any], batches: Callable[..., Any]) -> None:
    handle, model = compile(json.dumps(spec)), oracle()
    assert [handle.train_step(*batches(s))["loss"] for s in range(2)] == \
        [_step(model, batches(s)) for s in range(2)]
    host = _aligned(handle.arena_bytes)
    handle.bind(host)
    assert handle.model.step == 2
    assert [handle.train_step(*batches(s))["loss"] for s in range(2, 4)] == \
        [_step(model, batches(s)) for s in range(2, 4)]
    emb = handle.tensor("embedding")
    assert np.shares_memory(handle.view("embedding"), host)
    assert host[emb.offset:emb.offset + emb.nbytes].tobytes() == model.parameter("embedding").tobytes()
    for name, value in model.state_dict()["optimizer"]["exp_avg"].items():
        assert np.array_equal(handle.get(f"adamw.exp_avg.{name}"), value), name
    assert np.array_equal(handle.logits(batches(0)[0]), model.logits(batches(0)[0]))


def test_ir_json_compiles_what_the_dsl_name_does(spec: dict[str, Any], batches: Callable[..., Any]) -> None:
    bundle = build_bundle("Qwen3Model", spec["config"])
    by_name = compile(spec)
    rest = {k: v for k, v in spec.items() if k not in ("model", "config")}
    by_ir = compile({**rest, "ir": bundle.to_dict()})
    by_text = compile(json.dumps({**rest, "ir": json.dumps(bundle.to_dict())}))
    assert by_name.plan() == by_ir.plan() == by_text.plan()
    losses = {h.train_step(*batches(0))["loss"] for h in (by_name, by_ir, by_text)}
    assert len(losses) == 1


def test_the_plan_is_the_programs(spec: dict[str, Any]) -> None:
    handle = compile(spec)
    plan = json.loads(json.dumps(handle.plan()))  # JSON all the way down
    bundle = build_bundle("Qwen3Model", spec["config"])
    train, logits = (compile_program(bundle, bindings={"B": 2, "T": 8}, task=task, optimizer="adamw")
                     for task in ("train", "logits"))
    seeded = Model.from_ir(bundle, optimizer="adamw").program(2, 8, "logits_grad")  # logits_backward's
    assert plan["arena_bytes"] == max(train.arena_bytes, logits.arena_bytes, seeded.arena_bytes) \
        == handle.arena_bytes
    assert plan["memory"]["peak"] == train.arena_bytes
    assert plan["persistent_bytes"] == train.persistent_bytes
    assert plan["tensors"] == {k: {"shape": list(t.shape), "dtype": t.dtype, "offset": t.offset,
                                   "nbytes": t.nbytes} for k, t in train.tensors.items()}
    assert [p["name"] for p in plan["parameters"]] == [p.name for p in train.params]
    assert plan["phases"] == {ph: len(train.phase(ph)) for ph in PHASES}
    assert (plan["batch"], plan["seq"], plan["optimizer"], plan["step"]) == (2, 8, "adamw", 0)


def test_phases_run_on_the_tensors_the_host_wrote(spec: dict[str, Any], oracle: Callable[..., Any],
                                                 batches: Callable[..., Any]) -> None:
    handle, model = compile(spec), oracle()
    ids, labels = batches(0)
    inputs = {"token_ids": ids, "targets": labels, "d_loss": np.full(16, 1 / 16),
              "position_ids": np.broadcast_to(np.arange(8), (2, 8)), "segment_ids": np.ones((2, 8))}
    for name, value in inputs.items():
        handle.set(name, value)
    assert handle.run(["forward", "backward"]) == {}
    stats = handle.run(["grad_sync", "optimizer"])
    expected = model.train_step({"input_ids": ids, "labels": labels})
    assert handle.get("loss").sum() / 16 == pytest.approx(expected["loss"], rel=1e-6)
    assert stats["grad_norm"] == expected["grad_norm"] and handle.model.step == 1
    for name, value in model.parameters().items():
        assert np.array_equal(handle.get(name), value), name
    with pytest.raises(EmbedError, match="unknown phase 'update'") as info:
        handle.run(["forward", "update"])
    assert info.value.culprit == "update"


def test_backward_gives_views_of_the_gradients_of_the_last_forward(
        spec: dict[str, Any], oracle: Callable[..., Any], batches: Callable[..., Any]) -> None:
    handle = compile(spec)
    loss, forward = handle.loss(*batches(0))
    grads = handle.backward(forward, scale=2.0)
    expected_loss, expected = oracle().loss_and_grads(*batches(0))
    assert loss == expected_loss
    assert set(grads) == set(expected)
    slots = {p["name"]: p["grad"] for p in handle.plan()["parameters"]}
    for name, g in grads.items():
        np.testing.assert_allclose(g, 2 * expected[name], rtol=1e-5, atol=1e-7, err_msg=name)
        assert np.shares_memory(g, handle.view(slots[name]))
    with pytest.raises(EmbedError, match="last run only") as info:
        handle.backward(forward)  # once only
    assert info.value.culprit == "backward"
    _, forward = handle.loss(*batches(1))
    handle.logits(batches(1)[0])  # overwrites the activations
    with pytest.raises(EmbedError, match="last run only"):
        handle.backward(forward)


@pytest.mark.parametrize(("change", "kind", "culprit"), [
    ({"batch": 0}, "argument", "batch"),
    ({"seq": "8"}, "argument", "seq"),
    ({"steps": 3}, "argument", "steps"),
    ({"ir": {}}, "argument", "ir"),
    ({"model": 3}, "argument", "model"),
    ({"config": [1]}, "argument", "config"),
    ({"config": {"d_modle": 32}}, "argument", "config.d_modle"),
    ({"config": {"vocab_size": "x"}}, "model", "model 'Qwen3Model'"),
    ({"recompute": "sometimes"}, "model", "spec"),
    ({"optimizer": "adamw-ish"}, "model", "spec"),
])
def test_a_bad_spec_names_its_culprit(spec: dict[str, Any], change: dict[str, Any], kind: str,
                                      culprit: str) -> None:
    with pytest.raises(EmbedError) as info:
        compile({**spec, **change})
    assert (info.value.kind, info.value.culprit) == (kind, culprit), info.value.message
    assert error_dict(info.value) == {"code": kind, "message": info.value.message, "culprit": culprit}


def test_bad_tensors_and_buffers_name_their_culprit(spec: dict[str, Any]) -> None:
    handle: ProgramHandle = compile(spec)
    with pytest.raises(EmbedError, match=r"did you mean 'blocks\.0\.qkv_weight'") as info:
        handle.get("blocks.0.qkv_weights")
    assert (info.value.kind, info.value.culprit) == ("tensor", "blocks.0.qkv_weights")
    with pytest.raises(EmbedError, match=r"\[64, 32\] \(2048 values\); the value has 2") as info:
        handle.set("embedding", [1.0, 2.0])
    assert info.value.kind == "size"
    handle.set("embedding", np.zeros((64, 32)))
    assert not handle.model.parameter("embedding").any()
    for buffer, kind, match in [(bytes(handle.arena_bytes), "argument", "writable"),
                                (_aligned(64), "size", "the arena needs"),
                                (_aligned(handle.arena_bytes + 64)[1:], "argument", "multiple of 64"),
                                (object(), "argument", "cannot use object")]:
        with pytest.raises(EmbedError, match=match) as info:
            handle.bind(buffer)
        assert (info.value.kind, info.value.culprit) == (kind, "buffer")
    labels = np.zeros((2, 8), np.int64)
    labels[1, 0] = 64
    with pytest.raises(EmbedError, match=r"labels\[1, 0\] is 64, outside the vocabulary \[0, 64\)"):
        handle.train_step(np.zeros((2, 8), np.int64), labels)
    internal = {"code": "internal", "message": "ValueError: boom", "culprit": ""}
    assert error_dict(ValueError("boom")) == internal


def test_a_spec_without_an_optimizer_leaves_the_update_to_the_host(spec: dict[str, Any], batches: Any,
                                                                   oracle: Callable[[], Any]) -> None:
    """``"optimizer": null``: no state in the plan or the arena, updates refused, and the gradients of
    loss + backward those of kiln.core's loss_and_grads (up to float32 rounding)."""
    handle = compile(json.dumps({**spec, "optimizer": None}))
    plan = handle.plan()
    assert plan["optimizer"] is None and plan["memory"]["optimizer_state"] == 0
    assert all(p["state"] == [] for p in plan["parameters"])
    assert handle.arena_bytes < compile(spec).arena_bytes
    ids, labels = batches(0)
    for call in (lambda: handle.train_step(ids, labels), lambda: handle.run(["optimizer"])):
        with pytest.raises(EmbedError, match="no optimizer") as info:
            call()
        assert info.value.kind == "model"
    _, forward = handle.loss(ids, labels)
    grads = handle.backward(forward)
    _, expected = oracle().loss_and_grads(ids, labels)
    assert set(grads) == set(expected)
    for name, g in expected.items():  # the LM head's fused forward and backward sums in another order
        np.testing.assert_allclose(grads[name], g, rtol=1e-4, atol=1e-6, err_msg=name)
