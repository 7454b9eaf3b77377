"""kiln-peft against HF peft + transformers on a tiny random Qwen3 made here.

The base checkpoint is written by transformers and loaded by kiln-hf; adapters go both ways through
their files. "Within 1e-4 relative" is per tensor: the largest difference is at most 1e-4 of the
tensor's largest magnitude. Adapters start from ``init_lora_weights=False`` (A and B random), so
their gradients and their contribution to the logits are not zero. Logits are compared with LoRA
dropout on: both sides leave it out of inference (PEFT in eval mode).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.parity
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
kiln_hf = pytest.importorskip("kiln.hf")

from kiln.peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

VOCAB, BATCH, SEQ = 97, 2, 24
QWEN3 = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64,
         "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIGS: dict[str, dict[str, Any]] = {
    "all-seven": {"r": 4, "lora_alpha": 8, "target_modules": SEVEN},
    "rslora": {"r": 4, "lora_alpha": 6, "target_modules": SEVEN, "use_rslora": True},
    "patterns": {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "rank_pattern": {"v_proj": 2},
                 "alpha_pattern": {"mlp.down_proj": 3.0}},
    "q-and-v": {"r": 3, "lora_alpha": 5, "target_modules": ["q_proj", "v_proj", "up_proj"]},
}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(**QWEN3)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


def hf_model(folder: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    ids = rng.integers(0, VOCAB, (BATCH, SEQ))
    labels = ids.copy()
    labels[0, :5] = -100
    return ids, labels


def assert_close(ours: np.ndarray, theirs: np.ndarray, what: str, rel: float = 1e-4) -> None:
    assert ours.shape == theirs.shape, what
    scale = float(np.abs(theirs).max())
    err = float(np.abs(ours.astype(np.float64) - theirs).max())
    assert err <= rel * scale, f"{what}: max error {err:.3g} exceeds {rel} x {scale:.3g}"


def torch_logits(model: Any, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def peft_adapter(base_dir: Path, folder: Path, config: dict[str, Any]) -> Any:
    """A PEFT model over a fresh transformers model, its adapters random, saved into ``folder``."""
    torch.manual_seed(1)
    model = peft.get_peft_model(hf_model(base_dir), peft.LoraConfig(**config, init_lora_weights=False))
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_logits_and_adapter_gradients_match_peft(base_dir: Path, tmp_path: Path, case: str) -> None:
    theirs = peft_adapter(base_dir, tmp_path, CONFIGS[case])
    ours = PeftModel.from_pretrained(kiln_hf.from_pretrained(base_dir), tmp_path, is_trainable=True)
    ids, labels = batch()
    out = theirs(torch.tensor(ids), labels=torch.tensor(labels))
    out.loss.backward()
    expected = {name.replace(".default", ""): p.grad.numpy() for name, p in theirs.named_parameters()
                if p.requires_grad}
    loss, grads = ours.loss_and_grads(ids, kiln_hf.shift_labels(labels))

    assert_close(ours.logits(ids), out.logits.detach().numpy(), "logits")
    assert loss == pytest.approx(out.loss.item(), rel=1e-5)
    assert set(grads) == set(expected) and len(grads) == 2 * 2 * len({s.target for s in ours.sites})
    for name, g in expected.items():
        assert_close(grads[name], g, name)


def test_an_adapter_saved_by_kiln_loads_in_peft(base_dir: Path, tmp_path: Path) -> None:
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                        lora_dropout=0.1)
    ours = get_peft_model(kiln_hf.from_pretrained(base_dir), config, seed=3)
    ours.save_pretrained(tmp_path)
    theirs = peft.PeftModel.from_pretrained(hf_model(base_dir), tmp_path)  # eval mode: no dropout
    assert sorted(theirs.peft_config["default"].target_modules) == sorted(SEVEN)
    assert theirs.peft_config["default"].lora_dropout == 0.1
    ids, _ = batch()
    assert_close(ours.logits(ids), torch_logits(theirs, ids), "logits")


def test_an_adapter_saved_by_peft_loads_in_kiln(base_dir: Path, tmp_path: Path) -> None:
    theirs = peft_adapter(base_dir, tmp_path, {**CONFIGS["q-and-v"], "lora_dropout": 0.1})
    ours = PeftModel.from_pretrained(kiln_hf.from_pretrained(base_dir), tmp_path)
    assert ours.peft_config["default"].lora_dropout == 0.1
    theirs.eval()  # inference: PEFT leaves dropout out, as kiln's logits do
    ids, _ = batch()
    assert_close(ours.logits(ids), torch_logits(theirs, ids), "logits")
    assert ours.loss_and_grads(ids, ids)[1] == {}  # PEFT's default: loaded for inference, frozen


def test_a_merged_model_saves_a_checkpoint_transformers_loads(base_dir: Path, tmp_path: Path) -> None:
    theirs = peft_adapter(base_dir, tmp_path / "adapter", CONFIGS["all-seven"])
    ours = PeftModel.from_pretrained(kiln_hf.from_pretrained(base_dir), tmp_path / "adapter")
    ids, _ = batch()
    unmerged = ours.logits(ids)
    merged = ours.merge_and_unload()
    assert_close(merged.logits(ids), unmerged, "merged logits")
    merged.save_pretrained(tmp_path / "merged")
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    loaded = hf_model(tmp_path / "merged")
    assert_close(torch_logits(loaded, ids), unmerged, "transformers on the merged checkpoint")
    assert_close(torch_logits(theirs.merge_and_unload(), ids), unmerged, "peft's own merge")


def test_twenty_lora_steps_track_peft(base_dir: Path, tmp_path: Path) -> None:
    """20 AdamW steps of the adapters with HF Trainer settings (clipping at 1.0, cosine schedule with
    warm-up): every step's loss within 1e-4, the trained adapters within 1e-3."""
    from kiln.core import HF_TRAINER_GROUPS, AdamW

    steps, lr = 20, 1e-2
    theirs = peft_adapter(base_dir, tmp_path / "start", CONFIGS["all-seven"])
    opt = AdamW(lr=lr, weight_decay=0.01, warmup_steps=3, total_steps=steps, groups=HF_TRAINER_GROUPS)
    ours = PeftModel.from_pretrained(kiln_hf.from_pretrained(base_dir, optimizer=opt), tmp_path / "start",
                                     is_trainable=True)
    trained = [p for p in theirs.parameters() if p.requires_grad]
    reference = torch.optim.AdamW(trained, lr=lr, weight_decay=0.01)
    scheduler = transformers.get_scheduler("cosine", reference, num_warmup_steps=3, num_training_steps=steps)
    rng = np.random.default_rng(11)
    for step in range(1, steps + 1):
        ids = rng.integers(0, VOCAB, (BATCH, SEQ))
        out = theirs(torch.tensor(ids), labels=torch.tensor(ids))
        reference.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        reference.step()
        scheduler.step()
        stats = ours.train_step({"input_ids": ids, "labels": kiln_hf.shift_labels(ids)})
        assert stats["loss"] == pytest.approx(out.loss.item(), rel=1e-4), f"step {step}"
    expected = {name.replace(".default", ""): p.detach().numpy() for name, p in theirs.named_parameters()
                if p.requires_grad}
    got = ours.adapter_state_dict()
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert_close(got[name], value, name, rel=1e-3)
