"""Issue 20's acceptance, annotation by annotation: the arguments the other annotation tests leave
out (``@probe`` frequency/condition/captures, ``@hook`` ordering, ``@assert(enabled=False)``,
``@trainable(grad_clip=)`` and overriding ``@frozen``), each checked against NumPy, and an annotated
LoRA adapter trained, saved and loaded by PEFT (``parity``)."""

import numpy as np
import pytest

from kiln.core import Model
from kiln.dsl import build_bundle
from kiln.dsl.annotations import assert_, frozen, hook, probe, trainable
from kiln.dsl.testing import C, V, lm


def batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    ids = np.random.default_rng(seed).integers(0, V, (2, 5))
    return ids[:, :-1], ids[:, 1:]


def h_of(m: Model, ids: np.ndarray) -> np.ndarray:
    return m.parameter("embedding")[ids].reshape(-1, C).astype(np.float64) @ m.parameter("blocks.0.w1").T


def test_probe_frequency_condition_and_captures() -> None:
    bundle = build_bundle(lm("ProbeArgs", h_ann=(
        probe("every2", frequency=2), probe("never", condition="max(h) > 1e9"),
        probe("hist", capture="histogram"), probe("few", capture="sample"))), {})
    carried = {a.args["name"]: dict(a.args) for a in bundle.module("ProbeArgsBlock").annotated("probe")}
    assert carried["every2"] == {"name": "every2", "frequency": 2}
    assert carried["never"]["condition"] == "max(h) > 1e9"
    m = Model(bundle, seed=1)
    m.probes.enable()
    ids, labels = batch(2)
    for _ in range(4):
        m.train_step({"input_ids": ids, "labels": labels})
    steps = [r.step for r in m.probes["every2"]]
    assert len(steps) == 2 and all(s % 2 == 0 for s in steps)  # every second of the four steps
    assert m.probes["never"] == []  # its condition never holds
    m.probes.clear()
    m.loss(ids, labels)
    h = h_of(m, ids)
    (hist,) = m.probes["hist"]
    counts, edges = np.histogram(h, bins=16)
    np.testing.assert_array_equal(hist.histogram, counts)
    np.testing.assert_allclose(hist.edges, edges, rtol=1e-5)
    (few,) = m.probes["few"]
    assert len(few.value) == 16 and set(np.round(few.value, 4)) <= set(np.round(h.ravel(), 4))


def test_hooks_of_one_point_run_by_priority_then_in_order() -> None:
    """The annotation's ``priority=`` is carried; callbacks are ordered by ``hooks.add(priority=)``."""
    bundle = build_bundle(lm("HookOrder", h_ann=(hook("Up", mode="modify", priority=3),)), {})
    (ann,) = bundle.module("HookOrderBlock").annotated("hook")
    assert dict(ann.args) == {"point": "Up", "mode": "modify", "priority": 3}
    m = Model(bundle, seed=2)
    ids, labels = batch(3)
    order: list[str] = []

    def add(tag: str, value: float):
        def fn(t: np.ndarray, info) -> None:
            order.append(tag)
            t[...] = value if not order[:-1] else t * 2

        return fn

    m.hooks.add("Up", add("late", 0.0), priority=5)
    m.hooks.add("Up", add("first", 1.0), priority=-1)
    m.hooks.add("Up", add("second", 0.0))
    m.loss(ids, labels)
    assert order == ["first", "second", "late"]
    # h = 1 then doubled twice: the model sees h = 4 everywhere
    x = m.parameter("embedding")[ids].reshape(-1, C).astype(np.float64)
    a = np.full_like(x, 4.0) / (1 + np.exp(-4.0))
    y = x + a @ m.parameter("blocks.0.w2").T
    z = y @ m.parameter("embedding").T
    want = np.mean(np.log(np.exp(z).sum(1)) - z[np.arange(len(z)), labels.ravel()])
    assert m.loss(ids, labels) == pytest.approx(want, rel=1e-5)


def test_disabled_assert_is_carried_and_not_checked() -> None:
    bundle = build_bundle(lm("AssertOff", h_ann=(assert_("all(h > 1e9)", enabled=False),)), {})
    (ann,) = bundle.module("AssertOffBlock").annotated("assert")
    assert dict(ann.args) == {"condition": "all(h > 1e9)", "enabled": False}
    ids, labels = batch(4)
    Model(bundle).train_step({"input_ids": ids, "labels": labels})  # false, but not checked


def test_trainable_grad_clip_and_override_of_a_frozen_module() -> None:
    bundle = build_bundle(lm("ClipTrain", w_ann=(trainable(grad_clip=0.05),), cls_ann=(frozen,)), {})
    blk = bundle.module("ClipTrainBlock")
    assert [dict(a.args) for a in blk.annotated("trainable")] == [{"grad_clip": 0.05}]
    assert not blk.param("w1").frozen and blk.param("w2").frozen
    sgd = {"name": "sgd", "lr": 1.0, "max_grad_norm": None, "weight_decay": 0.0}
    m = Model(bundle, seed=3, optimizer=sgd)
    rng = np.random.default_rng(5)
    m.set_parameters({k: rng.normal(0, 0.5, v.shape) for k, v in m.parameters().items()})
    ids, labels = batch(6)
    w1, w2 = m.parameter("blocks.0.w1"), m.parameter("blocks.0.w2")
    _, grads = m.loss_and_grads(ids, labels)
    assert "blocks.0.w2" not in grads and np.linalg.norm(grads["blocks.0.w1"]) > 0.1
    m.train_step({"input_ids": ids, "labels": labels})
    step = w1 - m.parameter("blocks.0.w1")
    assert np.linalg.norm(step) == pytest.approx(0.05, rel=1e-3)  # clipped to grad_clip
    g = grads["blocks.0.w1"]
    np.testing.assert_allclose(step / np.linalg.norm(step), g / np.linalg.norm(g), rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(m.parameter("blocks.0.w2"), w2)  # frozen by its module


@pytest.mark.parity
def test_an_annotated_lora_adapter_trains_and_saves_in_a_format_peft_loads(tmp_path) -> None:
    """The acceptance's last sentence end to end: ``@adapter("lora")`` on the weights of an HF model's
    IR, a few training steps (LoRA B starts at zero, so only training moves the logits), save, and
    PEFT's ``PeftModel.from_pretrained`` on the transformers model gives kiln's logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    kiln_hf = pytest.importorskip("kiln.hf")
    kiln_peft = pytest.importorskip("kiln.peft")
    from kiln.core.ir import Annotation

    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False,
    )
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf.save_pretrained(tmp_path / "base")
    base = kiln_hf.from_pretrained(tmp_path / "base")
    bundle = base.ir
    stack = next(p for p in bundle.module(bundle.entry).params if p.array_of)
    layer = bundle.module(stack.array_of)
    annotated = layer.evolve(annotations=[
        *layer.annotations,
        Annotation("adapter", "param", "qkv_weight",
                   {"type": "lora", "rank": 4, "alpha": 8.0, "targets": ["q", "v"]}),
    ])
    bundle = bundle.evolve(modules=[annotated if m is layer else m for m in bundle.modules])
    assert [a.target for a in bundle.module(stack.array_of).annotated("adapter")] == ["qkv_weight"]
    ours = kiln_peft.get_peft_model(base, kiln_peft.annotated_lora_config(bundle), seed=3)
    ids = np.random.default_rng(7).integers(0, 61, (2, 12))
    before = ours.logits(ids)
    for _ in range(3):
        ours.train_step({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    after = ours.logits(ids)
    assert np.abs(after - before).max() > 1e-3  # it trained
    ours.save_pretrained(tmp_path / "adapter")
    theirs = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32),
        tmp_path / "adapter",
    )
    adapted = {n.rsplit(".lora_A", 1)[0].split("layers.")[1] for n, _ in theirs.named_parameters()
               if ".lora_A" in n}
    assert adapted == {f"{i}.self_attn.{m}" for i in (0, 1) for m in ("q_proj", "v_proj")}
    with torch.no_grad():
        expected = theirs(torch.tensor(ids)).logits.numpy()
    assert np.abs(after - expected).max() <= 1e-4 * np.abs(expected).max()
