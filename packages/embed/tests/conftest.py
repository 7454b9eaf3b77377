"""The tiny Qwen3 every test of kiln-embed trains, its batches, and kiln's Python API as the oracle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kiln.core import Model
from kiln.dsl import build_bundle

CONFIG = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "num_query_heads": 4, "num_kv_heads": 2,
          "head_size": 8, "d_ff": 64, "max_seq": 16}
SPEC = {"model": "Qwen3Model", "config": CONFIG, "batch": 2, "seq": 8,
        "optimizer": {"name": "adamw", "lr": 0.01}}


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """Step ``step``'s batch as tests/c/train.c makes it: token (b * 7 + t * 3 + step) % 64, labels the
    next tokens."""
    b, t = np.meshgrid(np.arange(2), np.arange(8), indexing="ij")
    return (b * 7 + t * 3 + step) % 64, (b * 7 + (t + 1) * 3 + step) % 64


@pytest.fixture
def spec() -> dict[str, Any]:
    return {**SPEC, "config": dict(CONFIG)}


@pytest.fixture
def oracle() -> Callable[[], Model]:
    """A fresh kiln.core Model of the spec: what the embedded API must reproduce bit for bit."""
    bundle = build_bundle("Qwen3Model", CONFIG)
    return lambda: Model.from_ir(bundle, seed=0, optimizer=dict(SPEC["optimizer"]))


@pytest.fixture
def batches() -> Callable[[int], tuple[np.ndarray, np.ndarray]]:
    return batch
