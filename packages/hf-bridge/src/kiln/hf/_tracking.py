"""Experiment tracking beside ``metrics.jsonl`` (``train.report_to``): TensorBoard event files,
written through tensorboardX (the ``tensorboard`` extra of kiln-hf)."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kiln.core import KilnError

#: ``train.report_to`` values, and the distribution each needs
TRACKERS: dict[str, str] = {"tensorboard": "tensorboardX"}
#: the scalars written, by ``metrics.jsonl`` key
TAGS = {"loss": "train/loss", "grad_norm": "train/grad_norm", "lr": "train/lr", "tokens": "train/tokens",
        "eval_loss": "eval/loss"}


def missing(names: Sequence[str]) -> list[str]:
    """The trackers of ``names`` whose library is not installed."""
    return [n for n in names if importlib.util.find_spec(TRACKERS[n]) is None]


class TensorBoard:
    """Event files in ``folder`` (``tensorboard --logdir folder``). A run resumed after step ``start``
    purges what an earlier process logged past it, so that the curves show one run."""

    def __init__(self, folder: Path, start: int) -> None:
        from tensorboardX import SummaryWriter

        # a file of its own per start: a run resumed within the second must not overwrite the last one's
        self.writer = SummaryWriter(str(folder), purge_step=start + 1 if start else None,
                                    filename_suffix=f".from-step-{start}")

    def write(self, record: Mapping[str, Any]) -> None:
        for key, tag in TAGS.items():
            if key in record:
                self.writer.add_scalar(tag, record[key], record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_trackers(names: Sequence[str], folder: Path, start: int) -> list[TensorBoard]:
    """A tracker per name, writing under ``folder/<name>``."""
    absent = missing(names)
    if absent:
        raise KilnError(f"report_to {absent[0]!r} needs {TRACKERS[absent[0]]}, which is not installed",
                        hint=f"pip install 'kiln-hf[{absent[0]}]'")
    return [TensorBoard(folder / name, start) for name in names]
