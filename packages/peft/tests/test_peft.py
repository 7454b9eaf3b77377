"""LoRA on kiln-dsl's Qwen3: targets, frozen base weights, recompute, files, merge and bad adapters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.core import KilnError, Model, compile, get_registry
from kiln.core.ir import Bundle
from kiln.peft import AdapterError, LoraConfig, PeftModel, get_peft_model, lora

pytest.importorskip("kiln.dsl")
from kiln.dsl import build_bundle
from kiln.dsl.stdlib.models import Qwen3Model

CONFIG = {"vocab_size": 61, "d_model": 32, "n_layers": 2, "num_query_heads": 4, "num_kv_heads": 2, "d_ff": 48,
          "max_seq": 64, "head_size": 16}
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BLOCK = "DenseTransformerBlock"


@pytest.fixture(scope="module")
def bundle() -> Bundle:
    return build_bundle(Qwen3Model, CONFIG)


def batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    ids = np.random.default_rng(seed).integers(0, CONFIG["vocab_size"], (2, 10))
    return ids[:, :-1], ids[:, 1:]


def peft_model(bundle: Bundle, recompute: str = "none", **kw: Any) -> PeftModel:
    kw = {"r": 4, "lora_alpha": 8, "target_modules": SEVEN, "init_lora_weights": False, **kw}
    config = LoraConfig(**kw)
    return get_peft_model(Model.from_ir(bundle, seed=0), config, seed=1, recompute=recompute)


def test_the_pass_and_the_adapter_are_registered_by_kiln_peft() -> None:
    assert get_registry("graph_passes")["lora"] is lora
    assert get_registry("graph_passes").owner("lora").distribution == "kiln-peft"
    adapter = get_registry("adapters")["lora"]
    assert adapter.config_class is LoraConfig and adapter.config(r=4).r == 4
    assert get_registry("adapters").owner("lora").distribution == "kiln-peft"


def test_hf_module_names_resolve_to_slices_of_the_fused_weights(bundle: Bundle) -> None:
    pm = peft_model(bundle, target_modules="all-linear")
    rows = {(s.weight, s.target): (s.start, s.size) for s in pm.sites}
    assert rows == {("qkv_weight", "q"): (0, 64), ("qkv_weight", "k"): (64, 32),
                    ("qkv_weight", "v"): (96, 32), ("out_weight", "o"): (0, 32),
                    ("mlp_up_weight", "gate"): (0, 48), ("mlp_up_weight", "up"): (48, 48),
                    ("mlp_down_weight", "down"): (0, 32)}
    assert pm.sites[1].paths == ("model.layers.0.self_attn.k_proj", "model.layers.1.self_attn.k_proj")
    loss, grads = pm.loss_and_grads(*batch())
    assert len(grads) == 2 * 2 * 7 and np.isfinite(loss)
    assert grads["base_model.model.model.layers.1.mlp.gate_proj.lora_B.weight"].shape == (48, 4)
    kiln_names = {k for s in pm.sites for k, _, _ in s.tensors()}
    assert set(pm.loss_and_grads(*batch(), names="kiln")[1]) == kiln_names


def test_the_lora_branch_adds_scaled_low_rank_rows(bundle: Bundle) -> None:
    """y = x W^T + scaling (x A^T) B^T on the target's rows: the merged weights give the same logits."""
    pm = peft_model(bundle, target_modules=["k_proj", "up_proj", "o_proj"], lora_alpha=6, r=3)
    ids, _ = batch()
    before = pm.get_base_model().logits(ids)
    ours = pm.logits(ids)
    assert np.abs(ours - before).max() > 1e-3  # the adapters (random A and B) change the logits
    np.testing.assert_allclose(pm.merge_and_unload().logits(ids), ours, rtol=1e-4, atol=1e-5)


def test_a_lora_program_has_no_gradient_or_optimizer_bytes_for_base_weights(bundle: Bundle) -> None:
    pm = peft_model(bundle)
    report = pm.memory_report(2, 9)
    adapters = {k for s in pm.sites for k, _, _ in s.tensors()}
    by_kind: dict[str, set[str]] = {}
    for slot in report["slots"]:
        by_kind.setdefault(slot["kind"], set()).add(slot["name"])
    assert by_kind["gradient"] == {f"grad.{k}" for k in adapters}
    state = ("exp_avg", "exp_avg_sq")
    assert by_kind["optimizer_state"] == {f"adamw.{m}.{k}" for k in adapters for m in state}
    adapter_bytes = sum(-(-4 * int(np.prod(v.shape)) // 64) * 64 for k, v in pm.parameters().items()
                        if k in adapters)
    assert report["gradients"] == adapter_bytes and report["optimizer_state"] == 2 * adapter_bytes
    assert {p.name for p in pm.program(2, 9).params if p.grad} == adapters
    base = Model.from_ir(bundle).memory_report(2, 9)
    assert report["weights"] == base["weights"] + adapter_bytes and base["gradients"] > 0


def recompute_modes() -> list[str]:
    """Every recompute mode compile accepts, besides none."""
    try:
        from kiln.core.recompute import MODES
    except ImportError:
        return []
    return [m for m in MODES if m != "none"]


@pytest.mark.parametrize("mode", recompute_modes())
def test_recompute_gives_the_same_adapter_gradients_bit_for_bit(bundle: Bundle, mode: str) -> None:
    """With LoRA dropout: a replayed dropout draws the same mask from its counter."""
    plain, replayed = (peft_model(bundle, lora_dropout=0.1, recompute=m) for m in ("none", mode))
    ids, labels = batch()
    loss, grads = plain.loss_and_grads(ids, labels)
    loss2, grads2 = replayed.loss_and_grads(ids, labels)
    assert loss == loss2 and grads.keys() == grads2.keys()
    for name, g in grads.items():
        np.testing.assert_array_equal(grads2[name], g, err_msg=name)
    losses = [[m.train_step({"input_ids": ids, "labels": labels})["loss"] for _ in range(3)]
              for m in (plain, replayed)]
    assert losses[0] == losses[1]
    plan = replayed.program(2, 9).recompute
    replays = [op for rop in plan.block(BLOCK).ops for op in rop.replay]
    if mode == "offload":  # moves the activations to the host and back: nothing is replayed
        assert not replays and plan.block(BLOCK).offloaded, plan.pretty()
        return
    assert any(op.type == "dropout" for op in replays), plan.pretty()  # LoRA terms are replayed too


def test_the_dsl_plan_replays_each_projection_with_its_lora_terms(bundle: Bundle) -> None:
    """Seed 000 §6: a recomputed matmul re-applies its LoRA contribution; §5: lora_only slots are
    recomputed in LoRA training and saved in full fine-tuning."""
    if "dsl" not in recompute_modes():
        pytest.skip("this kiln-core has no dsl recompute")
    ir = lora(bundle, LoraConfig(r=4, target_modules=SEVEN, lora_dropout=0.1))
    lora_plan = compile(ir, bindings={"B": 2, "T": 8}, mode="lora", recompute="dsl").recompute.block(BLOCK)
    qkv = next(rop for rop in lora_plan.ops if rop.outputs[0] == "qkv")
    assert qkv.lora_targets == ("q", "k", "v") and qkv.policy == "lora_only"
    replay = [str(op) for op in qkv.replay]
    assert sum(op.type == "dropout" for op in qkv.replay) == 3, replay
    assert any("qkv_weight.v.lora_B" in op.inputs for op in qkv.replay), replay
    assert "qkv_flat.q.lora_h" in lora_plan.recomputed and not lora_plan.gated
    full_plan = compile(ir, bindings={"B": 2, "T": 8}, mode="full", recompute="dsl").recompute.block(BLOCK)
    assert "qkv" in full_plan.gated and "qkv" in full_plan.saved and "qkv" not in full_plan.recomputed


def test_dropout_applies_in_training_not_in_eval(bundle: Bundle) -> None:
    drop, keep = peft_model(bundle, lora_dropout=0.3), peft_model(bundle)
    ids, labels = batch()
    np.testing.assert_array_equal(drop.logits(ids), keep.logits(ids))
    assert drop.loss(ids, labels) == keep.loss(ids, labels)  # eval mode, as PEFT's model.eval()
    training = drop.loss(ids, labels, training=True)
    assert training != keep.loss(ids, labels, training=True)
    assert training == drop.loss(ids, labels, training=True)  # a mask is a function of its counters
    assert training == drop.loss_and_grads(ids, labels)[0]  # the loss the gradients are of


def test_initialisation_follows_peft(bundle: Bundle) -> None:
    base = Model.from_ir(bundle, seed=0)
    bound = 32 ** -0.5  # 1 / sqrt(fan_in)
    for init, check in ((True, lambda a, b: abs(a).max() <= bound and a.std() > 0.05 and not b.any()),
                        ("gaussian", lambda a, b: 0.2 < a.std() < 0.3 and not b.any()),
                        (False, lambda a, b: b.max() <= 0.5 and b.std() > 0.1)):
        pm = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=init))
        p = pm.parameters()
        assert check(p["blocks.0.qkv_weight.q.lora_A"], p["blocks.1.qkv_weight.q.lora_B"]), init
    ids, _ = batch()
    np.testing.assert_array_equal(get_peft_model(base, LoraConfig(target_modules=SEVEN)).logits(ids),
                                  base.logits(ids))  # B = 0: the adapted model starts as the base model


def test_save_and_load_round_trip(bundle: Bundle, tmp_path: Path) -> None:
    pm = peft_model(bundle, target_modules="all-linear", use_rslora=True, rank_pattern={"k_proj": 2})
    for _ in range(2):
        pm.train_step(dict(zip(("input_ids", "labels"), batch(), strict=True)))
    files = pm.save_pretrained(tmp_path)
    assert sorted(f.name for f in files) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["target_modules"] == sorted(SEVEN)
    assert config["use_rslora"] and config["rank_pattern"] == {"k_proj": 2}
    again = PeftModel.from_pretrained(Model.from_ir(bundle, seed=0), tmp_path)
    ids, _ = batch()
    np.testing.assert_array_equal(again.logits(ids), pm.logits(ids))
    assert again.adapter_state_dict().keys() == pm.adapter_state_dict().keys()
    assert again.loss_and_grads(*batch())[1] == {}  # loaded for inference unless is_trainable
    assert len(PeftModel.from_pretrained(Model.from_ir(bundle), tmp_path, is_trainable=True)
               .loss_and_grads(*batch())[1]) == 28


def test_merge_and_unload_gives_the_base_model_with_merged_weights(bundle: Bundle) -> None:
    pm = peft_model(bundle, target_modules=["v_proj", "down_proj"])
    base = pm.get_base_model()
    w = base.parameters()["blocks.1.qkv_weight"]
    p = pm.parameters()
    merged = pm.merge_and_unload()
    assert merged is base
    delta = merged.parameters()["blocks.1.qkv_weight"] - w
    a, b = p["blocks.1.qkv_weight.v.lora_A"], p["blocks.1.qkv_weight.v.lora_B"]
    np.testing.assert_allclose(delta[96:], 2.0 * b @ a, rtol=1e-5, atol=1e-6)
    assert not delta[:96].any()
    np.testing.assert_array_equal(pm.merge_and_unload().parameters()["blocks.1.qkv_weight"], w + delta)


# ---------------------------------------------------------------------------------------------
# Bad adapters and configs: a KilnError naming the culprit


def saved(bundle: Bundle, folder: Path, **kw: Any) -> Path:
    peft_model(bundle, **kw).save_pretrained(folder)
    return folder


def edit_config(folder: Path, **changes: Any) -> None:
    file = folder / "adapter_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


def test_an_adapter_of_another_rank_names_the_tensor(bundle: Bundle, tmp_path: Path) -> None:
    edit_config(saved(bundle, tmp_path), r=8)
    wrong = r"q_proj\.lora_A\.weight'.*is \[4, 32\].*r=8.*expects \[8, 32\]"
    with pytest.raises(KilnError, match=wrong) as exc:
        PeftModel.from_pretrained(Model.from_ir(bundle), tmp_path)
    assert exc.value.file == str(tmp_path / "adapter_model.safetensors")


def test_a_missing_tensor_names_it(bundle: Bundle, tmp_path: Path) -> None:
    edit_config(saved(bundle, tmp_path, target_modules=["q_proj"]), target_modules=["q_proj", "v_proj"])
    with pytest.raises(AdapterError, match=r"layers\.0\.self_attn\.v_proj\.lora_A\.weight'.*missing") as exc:
        PeftModel.from_pretrained(Model.from_ir(bundle), tmp_path)
    assert exc.value.key == "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"


def test_a_tensor_for_a_module_not_targeted_names_it(bundle: Bundle, tmp_path: Path) -> None:
    edit_config(saved(bundle, tmp_path, target_modules=["q_proj", "v_proj"]), target_modules=["q_proj"])
    with pytest.raises(AdapterError, match=r"v_proj\.lora_A\.weight'.*does not target"):
        PeftModel.from_pretrained(Model.from_ir(bundle), tmp_path)


def test_a_target_the_model_lacks_names_it(bundle: Bundle, tmp_path: Path) -> None:
    edit_config(saved(bundle, tmp_path), target_modules=["q_proj", "c_attn"])
    with pytest.raises(AdapterError, match=r"adapter_config\.json: 'c_attn'.*match no projection") as exc:
        PeftModel.from_pretrained(Model.from_ir(bundle), tmp_path)
    assert "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in str(exc.value)
    with pytest.raises(AdapterError, match="'lm_head'"):
        get_peft_model(Model.from_ir(bundle), LoraConfig(target_modules=["q_proj", "lm_head"]))


@pytest.mark.parametrize(("change", "culprit"), [
    ({"use_dora": True}, "use_dora"), ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"layers_to_transform": [0]}, "layers_to_transform"), ({"bias": "all"}, "bias"),
    ({"init_lora_weights": "pissa"}, "init_lora_weights"), ({"peft_type": "LOHA"}, "peft_type"),
    ({"lora_dropout": 1.5}, "lora_dropout"), ({"r": 0}, "'r'"),
])
def test_settings_kiln_does_not_compute_are_refused_by_name(bundle: Bundle, tmp_path: Path,
                                                             change: dict[str, Any], culprit: str) -> None:
    edit_config(saved(bundle, tmp_path), **change)
    with pytest.raises(AdapterError, match=culprit):
        PeftModel.from_pretrained(Model.from_ir(bundle), tmp_path)


def test_a_selection_that_differs_between_layers_is_refused(bundle: Bundle) -> None:
    with pytest.raises(AdapterError, match=r"selects some of its layers.*'blocks'"):
        get_peft_model(Model.from_ir(bundle), LoraConfig(target_modules=r".*layers\.0\.self_attn\.q_proj"))
    with pytest.raises(AdapterError, match="different ranks"):
        config = LoraConfig(target_modules=SEVEN, rank_pattern={"layers.1.mlp.up_proj": 2})
        get_peft_model(Model.from_ir(bundle), config)


def test_broken_files_name_the_file(bundle: Bundle, tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match=r"adapter_config\.json: not found"):
        PeftModel.from_pretrained(Model.from_ir(bundle), tmp_path)
    saved(bundle, tmp_path)
    weights = tmp_path / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(AdapterError, match=r"adapter_model\.safetensors: '.*lora_.\.weight': data_offsets"):
        PeftModel.from_pretrained(Model.from_ir(bundle), tmp_path)
    weights.write_bytes(b"\xff" * 16)
    with pytest.raises(AdapterError, match="not a safetensors file"):
        PeftModel.from_pretrained(Model.from_ir(bundle), tmp_path)


def test_compile_runs_the_lora_pass_and_trains_what_peft_would(bundle: Bundle) -> None:
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "init_lora_weights": False}
    program = compile(bundle, bindings={"B": 2, "T": 8}, mode="lora", passes=[("lora", config)])
    assert (program.passes[0].stage, program.passes[0].name) == ("adapt", "lora")
    trained = {p.name for p in program.params if p.trainable}
    pm = get_peft_model(Model.from_ir(bundle, seed=0), LoraConfig(**config), seed=1)
    assert trained and trained == {k for k, t in pm.trainable.items() if t}
    assert all(k.endswith(("lora_A", "lora_B")) for k in trained)
    model = Model.from_ir(bundle, mode="lora", passes=[("lora", config)], weights=pm.parameters())
    ids, labels = batch()
    assert model.loss_and_grads(ids, labels)[0] == pm.loss_and_grads(ids, labels)[0]


@pytest.mark.parametrize("is_trainable", [False, True])
def test_a_loaded_adapter_trains_exactly_when_it_is_trainable(bundle: Bundle, tmp_path: Path,
                                                              is_trainable: bool) -> None:
    peft_model(bundle).save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(Model.from_ir(bundle, seed=0), tmp_path, is_trainable=is_trainable)
    ids, labels = batch()
    _, grads = loaded.loss_and_grads(ids, labels)
    before = loaded.adapter_state_dict()
    loaded.train_step({"input_ids": ids, "labels": labels})
    moved = {k for k, v in loaded.adapter_state_dict().items() if not np.array_equal(v, before[k])}
    assert bool(grads) is bool(moved) is is_trainable  # as PEFT: frozen unless is_trainable
    assert len(grads) == (sum(loaded.trainable.values()) if is_trainable else 0)
