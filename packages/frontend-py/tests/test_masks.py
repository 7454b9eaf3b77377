"""Padding (attention_mask), explicit positions and packed documents in the standard models, checked
against the same model run on the unpadded, unpacked sequences (RoPE is relative: a sequence's
logits do not depend on where it starts)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kiln.core import KilnError, Model
from kiln.dsl import build_bundle

TINY = {"vocab_size": 61, "d_model": 16, "n_layers": 2, "num_query_heads": 4, "num_kv_heads": 2,
        "head_size": 8, "d_ff": 24, "max_seq": 64, "rope_theta": 1000.0, "pad_token_id": 0}


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(build_bundle("Qwen3Model", TINY), seed=3, dtype="float64")


def _close(a: Any, b: Any, rtol: float = 1e-10) -> None:
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.max(np.abs(b)))


def test_left_padding_leaves_the_real_tokens_as_if_alone(model: Model) -> None:
    rng = np.random.default_rng(0)
    seqs = [rng.integers(1, 61, n) for n in (12, 7)]
    ids = np.zeros((2, 12), np.int64)
    mask = np.zeros((2, 12), np.int64)
    for i, s in enumerate(seqs):
        ids[i, 12 - len(s):], mask[i, 12 - len(s):] = s, 1
    padded = model.logits(ids, attention_mask=mask)
    for i, s in enumerate(seqs):
        _close(padded[i, 12 - len(s):], model.logits(s[None])[0], rtol=1e-9)
    # without the mask the short sequence sees its padding
    assert not np.allclose(model.logits(ids)[1, 5:], padded[1, 5:], atol=1e-6)
    # positions given as generate() would (counting real tokens only) agree exactly with the unpadded run
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    aligned = model.logits(ids, attention_mask=mask, position_ids=positions)
    _close(aligned[1, 5:], model.logits(seqs[1][None])[0])


def test_a_packed_row_trains_as_its_documents_unpacked(model: Model) -> None:
    rng = np.random.default_rng(1)
    docs = [rng.integers(1, 61, n) for n in (6, 4, 5)]
    ids = np.concatenate(docs)[None]
    positions = np.concatenate([np.arange(len(d)) for d in docs])[None]
    targets = np.concatenate([np.append(d[1:], -100) for d in docs])[None]  # kiln's targets: shifted

    loss, grads = model.loss_and_grads(ids, targets, position_ids=positions)
    count = sum(len(d) - 1 for d in docs)
    want_loss, want = 0.0, {k: np.zeros_like(v) for k, v in grads.items()}
    for d in docs:  # the mean over all positions = sum of each document's summed loss / count
        part, g = model.loss_and_grads(d[None], np.append(d[1:], -100)[None])
        share = (len(d) - 1) / count
        want_loss += part * share
        for k in want:
            want[k] += g[k] * share
    assert loss == pytest.approx(want_loss, rel=1e-12)
    for k in want:
        _close(grads[k], want[k], rtol=1e-9)


def test_micro_batches_with_masks_equal_the_whole_batch() -> None:
    rng = np.random.default_rng(2)
    ids = rng.integers(1, 61, (4, 10))
    mask = np.ones_like(ids)
    mask[1, :4] = mask[2, :2] = 0
    labels = np.where(mask == 1, np.roll(ids, -1, axis=1), -100)
    labels[:, -1] = -100
    positions = np.tile(np.arange(10), (4, 1))
    positions[3] = [0, 1, 2, 0, 1, 2, 3, 0, 1, 2]  # a packed row
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask, "position_ids": positions}
    whole, parts = (Model(build_bundle("Qwen3Model", TINY), seed=5, dtype="float64") for _ in range(2))
    a, b = whole.train_step(batch), parts.train_step(batch, micro_batches=2)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-12)
    for name, value in whole.parameters().items():
        _close(parts.parameters()[name], value, rtol=1e-9)


def test_bad_masks_and_positions_name_the_culprit(model: Model) -> None:
    ids = np.ones((2, 5), np.int64)
    with pytest.raises(KilnError, match=r"attention_mask must be shaped like input_ids \[2, 5\]"):
        model.logits(ids, attention_mask=np.ones((2, 4), np.int64))
    with pytest.raises(KilnError, match="position_ids must be an integer array"):
        model.logits(ids, position_ids=np.zeros((2, 5)))


def test_a_sliding_window_bounds_what_each_layer_sees() -> None:
    # window 3, 2 layers: a token reaches positions at most 2 * (3 - 1) = 4 after it, and no further
    config = {k: v for k, v in TINY.items() if k != "pad_token_id"}
    mistral = Model(build_bundle("MistralModel", {**config, "sliding_window": 3}), seed=1, dtype="float64")
    ids = np.random.default_rng(4).integers(1, 61, (1, 10))
    changed = ids.copy()
    changed[0, 0] = (ids[0, 0] + 1) % 61
    delta = np.abs(mistral.logits(ids) - mistral.logits(changed)).max(axis=-1)[0]
    assert (delta[:5] > 0).all() and (delta[5:] == 0).all(), delta
