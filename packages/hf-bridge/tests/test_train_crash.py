"""Crash safety: a training process killed with SIGKILL at 20 moments, half of them while a checkpoint
is being written or an old one removed, always leaves intact checkpoints; resuming from them gives
the losses of a run never stopped, bit for bit. And Ctrl-C through the real CLI saves and exits 130."""

from __future__ import annotations

import io
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.hf import _checkpoint, train

sys.path.insert(0, str(Path(__file__).parent))
from test_train import make_corpus, metrics, write_config

pytestmark = pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(),
                                reason="needs the forkserver start method")

KEYS = {"train": {"steps": 100_000, "checkpoint_every": 1, "eval_every": 7, "keep_last": 2},
        "optimizer": {"schedule": "constant", "warmup_steps": 3}}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def _writing(root: Path) -> bool:
    try:
        return any(name.startswith((".tmp-", ".old-")) for name in os.listdir(root))
    except FileNotFoundError:
        return False


def test_sigkill_at_20_moments_always_leaves_an_intact_checkpoint(tmp_path: Path, corpus: Path) -> None:
    config = write_config(tmp_path / "crash", corpus, **KEYS)
    root = tmp_path / "crash" / "out" / "checkpoints"
    rng = random.Random(9)
    mid_write = 0
    # trainers forked by a fresh server process: forking this one would copy the state of threads that
    # earlier tests started (kiln-core's kernel pool) without the threads
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["kiln.hf"])
    for kill in range(20):
        _checkpoint.clean(root)  # what the last kill left half done (the trainer would clean it too)
        proc = context.Process(target=train, args=(str(config),),
                               kwargs={"resume": True, "stream": io.StringIO()})
        proc.start()
        if kill % 2:  # wait for a checkpoint write (or removal) in progress, then kill at once
            deadline = time.monotonic() + 5.0
            while not _writing(root) and time.monotonic() < deadline:
                pass
        else:
            time.sleep(rng.uniform(0.05, 1.5))
        proc.kill()  # SIGKILL
        proc.join()
        assert proc.exitcode == -signal.SIGKILL
        mid_write += _writing(root)  # the kill left a write half done
        for path in _checkpoint.checkpoints(root):  # every checkpoint there is intact
            _checkpoint.load(path)
    assert mid_write >= 3, "too few kills landed inside a checkpoint write"
    last = int(_checkpoint.checkpoints(root)[-1].name.split("-")[1])
    assert last >= 20, "the trainer made too little progress between kills"

    # finish a few steps past the last checkpoint, and compare with a run that was never killed
    steps = {"train": {**KEYS["train"], "steps": last + 3}, "optimizer": KEYS["optimizer"]}
    resumed = train(write_config(tmp_path / "crash", corpus, **steps), resume=True, stream=io.StringIO())
    straight = train(write_config(tmp_path / "straight", corpus, **steps), stream=io.StringIO())
    assert resumed["losses"] == straight["losses"] and len(straight["losses"]) == last + 3
    assert [r.get("eval_loss") for r in metrics(tmp_path / "crash")] == \
        [r.get("eval_loss") for r in metrics(tmp_path / "straight")]
    assert (resumed["model"] / "model.safetensors").read_bytes() == \
        (straight["model"] / "model.safetensors").read_bytes()


def test_ctrl_c_in_the_cli_saves_a_checkpoint_and_exits_130(tmp_path: Path, corpus: Path) -> None:
    config = write_config(tmp_path, corpus, **KEYS)
    proc = subprocess.Popen([sys.executable, "-m", "kiln.core", "train", str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    log = tmp_path / "out" / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not log.exists() or log.read_text().count("\n") < 4):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Ctrl-C" in out and "interrupted: checkpoint of step" in out and "Traceback" not in err
    step = int(out.split("interrupted: checkpoint of step ")[1].split()[0])
    assert _checkpoint.checkpoints(tmp_path / "out" / "checkpoints")[-1].name == f"step-{step:08d}"
    assert metrics(tmp_path)[-1]["step"] == step
