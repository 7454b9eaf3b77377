"""Training checkpoints that survive a crash at any moment.

A checkpoint is a folder ``step-<n>`` under the run's ``checkpoints/`` holding ``weights.safetensors``
(the parameters), ``optimizer.safetensors`` (AdamW's moments) and ``state.json`` (step, data position,
RNG state, ...; it also lists every file with its size). It is written into a temporary folder, every
file and the folder fsynced, then renamed into place: a folder named ``step-<n>`` is always complete.
Older checkpoints are removed only after that, by renaming them aside first, so a crash can leave at
worst an ignored ``.tmp-*`` or ``.old-*`` folder, never a half-written or half-deleted checkpoint.
Kept are the newest ``keep`` and the ``keep_best`` of lowest ``eval_loss`` (as ``state.json`` says).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.numpy

from kiln.hf._errors import CheckpointError

_NAME = re.compile(r"step-(\d+)")
_FILES = ("weights", "optimizer")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root: str | Path, step: int, weights: Mapping[str, np.ndarray], optimizer: Mapping[str, np.ndarray],
         state: Mapping[str, Any], *, keep: int = 2, keep_best: int = 0) -> Path:
    """Write checkpoint ``step`` under ``root`` atomically; keep the newest ``keep`` checkpoints and
    the ``keep_best`` whose ``state["eval_loss"]`` is lowest."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    if final.is_dir():  # this step is saved already (a resumed run): the same state, bit for bit
        return final
    tmp = root / f".tmp-{step:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    sizes = {}
    for name, arrays in zip(_FILES, (weights, optimizer), strict=True):
        file = tmp / f"{name}.safetensors"
        safetensors.numpy.save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(file))
        sizes[file.name] = file.stat().st_size
    (tmp / "state.json").write_text(json.dumps({**state, "step": step, "files": sizes}), encoding="utf-8")
    for f in tmp.iterdir():
        _fsync(f)
    _fsync(tmp)
    os.rename(tmp, final)
    _fsync(root)
    found = checkpoints(root)
    scored = _scored(found) if keep_best else {}
    kept = {*found[-keep:], *sorted(scored, key=scored.__getitem__)[:keep_best]}
    for old in found:
        if old not in kept:
            _discard(old)
    return final


def _scored(found: list[Path]) -> dict[Path, float]:
    """The checkpoints of ``found`` that hold an eval loss, with it."""
    out = {}
    for path in found:
        try:
            loss = json.loads((path / "state.json").read_text(encoding="utf-8")).get("eval_loss")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(loss, (int, float)):
            out[path] = float(loss)
    return out


def best(found: list[Path]) -> Path | None:
    """The checkpoint of ``found`` with the lowest eval loss (the newest of equals), or None."""
    scored = _scored(found)
    return min(reversed(scored), key=scored.__getitem__, default=None)


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint ``corrupt-step-<n>``: kept for a look, never resumed from."""
    aside = path.with_name(f"corrupt-{path.name}")
    shutil.rmtree(aside, ignore_errors=True)
    os.rename(path, aside)
    return aside


def _discard(path: Path) -> None:
    aside = path.with_name(f".old-{path.name}-{os.getpid()}")
    os.rename(path, aside)  # atomic: from here on the checkpoint is gone as a whole
    shutil.rmtree(aside, ignore_errors=True)


def checkpoints(root: str | Path) -> list[Path]:
    """The checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m[1]), p) for p in root.iterdir() if (m := _NAME.fullmatch(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def clean(root: str | Path) -> None:
    """Remove what interrupted writes and removals left behind (``.tmp-*``, ``.old-*``)."""
    root = Path(root)
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith((".tmp-", ".old-")):
                shutil.rmtree(p, ignore_errors=True)


def load(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, Any]]:
    """``(weights, optimizer, state)`` of one checkpoint folder; checks every file against its size."""
    path = Path(path)
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
        for name, size in state["files"].items():
            if (path / name).stat().st_size != size:
                raise CheckpointError(f"is {(path / name).stat().st_size} bytes, state.json says {size}",
                                      file=path / name)
        weights, optimizer = (safetensors.numpy.load_file(str(path / f"{n}.safetensors")) for n in _FILES)
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, safetensors.SafetensorError) as e:
        raise CheckpointError(f"not a complete training checkpoint: {e}", file=path) from None
    return weights, optimizer, state
