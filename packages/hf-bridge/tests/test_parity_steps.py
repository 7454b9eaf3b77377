"""20 training steps side by side: kiln and transformers + torch AdamW (as the HF Trainer sets it up:
no weight decay for biases and norm weights, gradient clipping at 1.0, ``get_scheduler``) from the same
random checkpoint, on the same batches. Every step's loss within 1e-4 relative, every final weight
within 1e-3 of the tensor's largest magnitude (``nox -s parity``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy

from kiln.core import HF_TRAINER_GROUPS, AdamW
from kiln.hf import from_pretrained, shift_labels

sys.path.insert(0, str(Path(__file__).parent))
from test_parity_pretrained import VOCAB, assert_close, make_checkpoint

pytestmark = pytest.mark.parity
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

STEPS, BATCH, SEQ, LR, WARMUP = 20, 4, 16, 1e-2, 3
HF_SCHEDULES = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}


def plain(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    ids = rng.integers(0, VOCAB, (BATCH, SEQ))
    ids[step % BATCH, -3:] = 0  # the pad id of the *-pad cases occurs in the input
    return {"input_ids": ids, "labels": ids.copy()}


def left_padded(step: int) -> dict[str, np.ndarray]:
    b = plain(step)
    mask = np.ones_like(b["input_ids"])
    for row, pad in enumerate((0, 5, 2, 9)):
        mask[row, :pad] = 0
        b["labels"][row, :pad + 1] = -100  # padding, and the first real token (see test_parity_pretrained)
    b["input_ids"][mask == 0] = 0
    return {**b, "attention_mask": mask}


def documents(step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(200 + step)
    lengths = rng.integers(3, 9, 12)
    lengths = lengths[np.cumsum(lengths) <= 2 * SEQ]
    return [rng.integers(1, VOCAB, n) for n in lengths]


def unpacked(step: int) -> dict[str, np.ndarray]:
    """The documents one per row, right-padded (what transformers trains on)."""
    docs = documents(step)
    ids, mask = np.zeros((len(docs), 8), np.int64), np.zeros((len(docs), 8), np.int64)
    for row, d in enumerate(docs):
        ids[row, :len(d)], mask[row, :len(d)] = d, 1
    return {"input_ids": ids, "labels": np.where(mask == 1, ids, -100), "attention_mask": mask}


def packed(step: int) -> dict[str, np.ndarray]:
    """The same documents packed into one row (what kiln trains on)."""
    docs = documents(step)
    ids = np.concatenate(docs)[None]
    labels = ids.copy()
    labels[0, np.cumsum([len(d) for d in docs])[:-1]] = -100  # no document predicts the next one's start
    positions = np.concatenate([np.arange(len(d)) for d in docs])[None]
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def hf_groups(model: Any) -> list[dict[str, Any]]:
    """The HF Trainer's parameter groups: no weight decay for biases and normalisation weights."""
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or "norm" in n]
    decay = [p for n, p in model.named_parameters() if not (n.endswith("bias") or "norm" in n)]
    return [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]


def run_side_by_side(case: str, tmp_path: Path, *, schedule: str = "cosine", kiln_batch: Any = plain,
                     hf_batch: Any = plain, micro_batches: int = 1) -> None:
    hf = make_checkpoint(case, tmp_path / "hf")
    hf.train()
    opt = AdamW(lr=LR, weight_decay=0.01, max_grad_norm=1.0, warmup_steps=WARMUP, total_steps=STEPS,
                schedule=schedule, groups=HF_TRAINER_GROUPS)
    model = from_pretrained(tmp_path / "hf", optimizer=opt)
    reference = torch.optim.AdamW(hf_groups(hf), lr=LR, betas=(0.9, 0.999), eps=1e-8)
    scheduler = transformers.get_scheduler(HF_SCHEDULES[schedule], reference, num_warmup_steps=WARMUP,
                                           num_training_steps=STEPS)
    for step in range(1, STEPS + 1):
        theirs = hf_batch(step)
        out = hf(**{k: torch.tensor(v) for k, v in theirs.items()})
        reference.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        reference.step()
        scheduler.step()

        ours = kiln_batch(step)
        ours = {**ours, "labels": shift_labels(ours["labels"])}
        stats = model.train_step(ours, micro_batches=micro_batches)
        assert stats["loss"] == pytest.approx(out.loss.item(), rel=1e-4), f"step {step}"
    hf.save_pretrained(tmp_path / "after")
    expected = safetensors.numpy.load_file(str(tmp_path / "after" / "model.safetensors"))
    got = model.hf_state_dict()
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert_close(got[name], value, name, rel=1e-3)


@pytest.mark.parametrize("case", ["qwen3-tied", "qwen3-untied", "llama-attention-bias", "qwen3-pad-tied",
                                  "llama-pad", "qwen3-moe-interleaved", "mistral-window", "mixtral"])
def test_twenty_steps_track_transformers(case: str, tmp_path: Path) -> None:
    run_side_by_side(case, tmp_path)


@pytest.mark.parametrize("schedule", ["linear", "constant"])
def test_each_schedule_tracks_transformers(schedule: str, tmp_path: Path) -> None:
    run_side_by_side("qwen3-untied", tmp_path, schedule=schedule)


def test_a_left_padded_batch_with_attention_mask(tmp_path: Path) -> None:
    run_side_by_side("qwen3-untied", tmp_path, kiln_batch=left_padded, hf_batch=left_padded)


def test_packed_rows_train_as_the_documents_unpacked(tmp_path: Path) -> None:
    run_side_by_side("qwen3-untied", tmp_path, kiln_batch=packed, hf_batch=unpacked)


def test_gradient_accumulation_trains_as_the_whole_batch(tmp_path: Path) -> None:
    run_side_by_side("llama-pad", tmp_path, micro_batches=2)
