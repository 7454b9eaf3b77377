"""``kiln train`` as a user meets it: every bad input exits with its documented code and a message
naming the culprit, never a traceback; nothing half-made is left; SIGTERM and SIGINT checkpoint and
resume bit for bit; run folders move; checkpoints are kept by age and by eval loss."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.core import Model
from kiln.core.cli import main
from kiln.hf import _checkpoint, save_pretrained, train
from kiln.hf._progress import Progress
from kiln.hf._train import _Run

sys.path.insert(0, str(Path(__file__).parent))
from test_train import TINY, interrupt_at, make_corpus, metrics, write_config


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def kiln(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, err
    return code, out, err


def checkpoint_folder(folder: Path, corpus: Path) -> Path:
    """A HF checkpoint of a tiny Qwen3 (64 positions) with the corpus's tokenizer."""
    from kiln.dsl import build_bundle

    bundle = build_bundle("Qwen3Model", {**TINY, "vocab_size": 300, "max_seq": 64,
                                         "tie_word_embeddings": True})
    save_pretrained(Model.from_ir(bundle), folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(corpus / "tokenizer" / name, folder / name)
    return folder


@pytest.mark.parametrize(("keys", "culprit", "words"), [
    ({"train": {"seq_len": -5}}, "train.seq_len", ["must be >= 1, found -5"]),
    ({"train": {"batch_size": 0}}, "train.batch_size", ["must be >= 1, found 0"]),
    ({"train": {"memory_budget": "50%"}}, "train.memory_budget", ['recompute = "auto"', "'none'"]),
    ({"train": {"keep_best": -1}}, "train.keep_best", [">= 0, found -1"]),
    ({"model": {"name": "Qwen3Model", "config": {**TINY, "d_model": "16"}}}, "model.config.d_model",
     ["expected int, found str '16'"]),
], ids=["seq-len", "batch", "budget-without-auto", "keep-best", "model-config-type"])
def test_bad_config_values_exit_2_naming_key_and_value(tmp_path: Path, corpus: Path, keys: dict[str, Any],
                                                       culprit: str, words: list[str],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = kiln(capsys, "train", str(write_config(tmp_path, corpus, **keys)))
    assert code == 2 and f"{culprit}: " in err, err
    assert all(w in err for w in words), err
    assert not (tmp_path / "out").exists()  # checked before anything is written


def test_seq_len_beyond_the_checkpoints_positions_names_train_seq_len(
        tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = checkpoint_folder(tmp_path / "ckpt", corpus)
    config = write_config(tmp_path, corpus, model={"checkpoint": str(ckpt)}, train={"seq_len": 65})
    code, _, err = kiln(capsys, "train", str(config))
    assert code == 2 and "train.seq_len: 65 is more than the 64 positions" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_damaged_weight_file_is_named_before_any_work(tmp_path: Path, corpus: Path, damage: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = checkpoint_folder(tmp_path / "ckpt", corpus)
    weights = ckpt / "model.safetensors"
    if damage == "missing":
        weights.unlink()
    else:
        weights.write_bytes(weights.read_bytes()[:-100])
    code, _, err = kiln(capsys, "train", str(write_config(tmp_path, corpus, model={"checkpoint": str(ckpt)})))
    assert code == 2 and "model.checkpoint" in err and "model.safetensors" in err, err
    assert ("truncated" if damage == "truncated" else "no model.safetensors") in err
    assert not (tmp_path / "out").exists()  # nothing tokenized or written


def test_a_lora_target_typo_is_named_with_the_closest_before_loading_weights(
        tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("kiln.peft")
    ckpt = checkpoint_folder(tmp_path / "ckpt", corpus)

    def no_weights(*args: Any, **kw: Any) -> None:
        raise AssertionError("weights were loaded")

    monkeypatch.setattr("kiln.hf.from_pretrained", no_weights)
    config = write_config(tmp_path, corpus, model={"checkpoint": str(ckpt)}, train={"mode": "lora"},
                          lora={"target_modules": ["q_proj", "v_prj"]})
    code, _, err = kiln(capsys, "train", str(config))
    assert code == 2 and "lora.target_modules" in err and "'v_prj'" in err, err
    assert "did you mean 'v_proj'?" in err
    assert not (tmp_path / "out").exists()


def test_non_utf8_data_without_a_tokenizer_is_a_data_error(tmp_path: Path, corpus: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\u00e9 au lait\n".encode("latin-1") * 50)
    config = write_config(tmp_path, corpus, data={"files": [str(corpus / "text.txt"), str(bad)],
                                                  "tokenizer": None, "vocab_size": 300})
    text = config.read_text().replace("tokenizer = null\n", "")
    config.write_text(text)
    code, _, err = kiln(capsys, "train", str(config))
    assert code == 3 and str(bad) in err and "not UTF-8" in err and "byte 3" in err, err
    assert not (tmp_path / "out").exists()  # the failed run left no folder behind


def test_an_output_dir_that_is_a_file_or_cannot_be_written(tmp_path: Path, corpus: Path,
                                                           capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "taken").write_text("not a folder")
    for out, words in ((tmp_path / "taken", "is a file, not a folder"),
                       (tmp_path / "taken" / "run", "is a file")):
        config = write_config(tmp_path, corpus, train={"output_dir": str(out)})
        code, _, err = kiln(capsys, "train", str(config))
        assert code == 2 and "train.output_dir" in err and str(out) in err and words in err, err
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if os.access(locked, os.W_OK):  # root writes anywhere: deny it as the kernel would deny a user
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != locked and real(p, mode, **kw))
    code, _, err = kiln(capsys, "train", str(write_config(tmp_path, corpus,
                                                          train={"output_dir": str(locked / "run")})))
    assert code == 2 and "train.output_dir" in err and "not writable" in err and str(locked) in err, err
    locked.chmod(0o755)


def test_a_failed_run_leaves_no_half_made_folder_and_exits_with_its_code(
        tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    too_big = write_config(tmp_path, corpus, train={"batch_size": 4096,
                                                    "output_dir": str(tmp_path / "a" / "b")})
    code, _, err = kiln(capsys, "train", str(too_big))
    assert code == 3 and "train.batch_size" in err, err
    assert not (tmp_path / "a").exists()
    nan = write_config(tmp_path, corpus, optimizer={"lr": 1e39, "max_grad_norm": 0, "warmup_steps": 0})
    code, _, err = kiln(capsys, "train", str(nan), "--debug-nans")
    # the update of step 1 made every weight infinite: named at that step, not at the next one's first op
    assert code == 4 and "non-finite weight" in err and "update of step 1" in err, err
    assert not (tmp_path / "out").exists()


def test_traceback_flag_shows_the_traceback(tmp_path: Path, corpus: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    bad = write_config(tmp_path, corpus, train={"steps": 0})
    assert main(["train", str(bad), "--traceback"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "train.steps: must be >= 1, found 0" in err


def test_ctrl_c_at_start_up_says_there_is_nothing_to_resume(tmp_path: Path, corpus: Path,
                                                            capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    original = _Run.data

    def data(self: _Run, *args: Any) -> None:
        signal.raise_signal(signal.SIGINT)  # while tokenizing
        original(self, *args)

    monkeypatch.setattr(_Run, "data", data)
    code, _, err = kiln(capsys, "train", str(write_config(tmp_path, corpus)))
    assert code == 130, err
    assert "interrupted by SIGINT: no checkpoint was written, so there is nothing to resume" in err
    assert "intact" not in err and not (tmp_path / "out").exists()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_is_not_drawn_again_after_ctrl_c(tmp_path: Path, corpus: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    interrupt_at(monkeypatch, 3)
    screen = _Terminal()
    summary = train(write_config(tmp_path, corpus), stream=screen)
    assert summary["interrupted"] and summary["signal"] == signal.SIGINT
    shown = screen.getvalue()
    assert "\r" in shown.split("Ctrl-C: saving")[0]  # the bar was live
    after = shown.split("Ctrl-C: saving")[1]
    assert "\r" not in after and "step 3/12" not in after and "interrupted: checkpoint of step 3" in after


def test_the_bar_shows_lr_grad_norm_elapsed_and_no_stale_eval() -> None:
    log = io.StringIO()
    plain = Progress(4, stream=log, tty=False, every=1)
    for step in range(1, 5):
        plain.update(step, 2.0, 64, eval_loss=1.5 if step == 2 else None, lr=3e-3, grad_norm=0.25,
                     elapsed=60.0 + step)
    lines = log.getvalue().splitlines()
    assert ["eval 1.5000" in line for line in lines] == [False, True, False, False]
    assert all("lr 3.00e-03" in line and "grad 0.250" in line for line in lines)
    assert "1m04s elapsed" in lines[-1]
    tty = io.StringIO()
    bar = Progress(4, stream=tty, tty=True)
    bar.update(1, 2.0, 64, eval_loss=1.5)
    bar.update(2, 2.0, 64)
    assert bar.line().split("  ")[2] == "eval@1 1.5000"  # the last eval, with its step


def test_sigterm_checkpoints_then_resume_is_bit_exact(tmp_path: Path, corpus: Path) -> None:
    keys = {"train": {"steps": 200, "checkpoint_every": 1000, "eval_every": 50, "log_every": 1000},
            "optimizer": {"warmup_steps": 3}}
    config = write_config(tmp_path / "b", corpus, **keys)
    proc = subprocess.Popen([sys.executable, "-m", "kiln.core", "train", str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    log = tmp_path / "b" / "out" / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not log.exists() or log.read_text().count("\n") < 4):
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err  # 128 + SIGTERM
    assert "SIGTERM: saving a checkpoint" in out and "Traceback" not in out + err
    step = int(out.split("interrupted: checkpoint of step ")[1].split()[0])
    assert 3 <= step < 200 and metrics(tmp_path / "b")[-1]["step"] == step
    resumed = train(config, resume=True, stream=io.StringIO())
    straight = train(write_config(tmp_path / "a", corpus, **keys), stream=io.StringIO())
    assert resumed["losses"] == straight["losses"]
    for a, b in zip(_checkpoint.load(straight["checkpoint"])[:2], _checkpoint.load(resumed["checkpoint"])[:2],
                    strict=True):
        assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)
    assert (resumed["model"] / "model.safetensors").read_bytes() == \
        (straight["model"] / "model.safetensors").read_bytes()


def _project(folder: Path, corpus: Path) -> Path:
    """A self-contained project: config, text and tokenizer side by side, all paths relative."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(corpus / "text.txt", folder / "text.txt")
    shutil.copytree(corpus / "tokenizer", folder / "tokenizer", dirs_exist_ok=True)
    config = write_config(folder, corpus, train={"output_dir": "out"})
    text = config.read_text().replace(json.dumps(str(corpus / "text.txt")), '"text.txt"')
    config.write_text(text.replace(json.dumps(str(corpus / "tokenizer")), '"tokenizer"'))
    return config


def test_a_moved_project_folder_resumes(tmp_path: Path, corpus: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    interrupt_at(monkeypatch, 5)
    first = train(_project(tmp_path / "here", corpus), stream=io.StringIO())
    monkeypatch.undo()
    assert first["interrupted"] and str(tmp_path) not in (first["checkpoint"] / "state.json").read_text()
    shutil.move(tmp_path / "here", tmp_path / "elsewhere" / "there")
    out = io.StringIO()
    moved = train(tmp_path / "elsewhere" / "there" / "run.toml", resume=True, stream=out)
    assert "resuming from" in out.getvalue() and "(step 5)" in out.getvalue()
    straight = train(_project(tmp_path / "straight", corpus), stream=io.StringIO())
    assert moved["losses"] == straight["losses"] and len(moved["losses"]) == 12
    assert (moved["model"] / "model.safetensors").read_bytes() == \
        (straight["model"] / "model.safetensors").read_bytes()


def test_resuming_with_fewer_steps_than_done_says_so(tmp_path: Path, corpus: Path) -> None:
    train(write_config(tmp_path, corpus, train={"steps": 8}), stream=io.StringIO())
    out = io.StringIO()
    summary = train(write_config(tmp_path, corpus, train={"steps": 4}), resume=True, stream=out)
    assert "has done 8 steps, more than train.steps = 4" in out.getvalue()
    assert summary["checkpoint"].name == "step-00000008"
    assert (summary["model"] / "model.safetensors").is_file()


def test_keep_last_and_keep_best(tmp_path: Path) -> None:
    w, m = {"a": np.zeros(2, np.float32)}, {"exp_avg.a": np.zeros(2, np.float32)}
    for step, loss in enumerate([3.0, 1.0, 2.0, None, 5.0], start=1):
        _checkpoint.save(tmp_path, step, w, m, {"eval_loss": loss}, keep=2, keep_best=1)
    assert [p.name for p in _checkpoint.checkpoints(tmp_path)] == ["step-00000002", "step-00000004",
                                                                   "step-00000005"]
    assert _checkpoint.best(_checkpoint.checkpoints(tmp_path)) == tmp_path / "step-00000002"


def test_a_run_keeps_its_best_checkpoints(tmp_path: Path, corpus: Path) -> None:
    config = write_config(tmp_path, corpus, train={"keep_last": 1, "keep_best": 2})
    summary = train(config, stream=io.StringIO())
    evals = {r["step"]: r["eval_loss"] for r in metrics(tmp_path) if "eval_loss" in r and r["step"] % 4 == 0}
    best = sorted(evals, key=evals.__getitem__)[:2]  # checkpoints every 4 steps, evaluated there
    kept = {p.name for p in _checkpoint.checkpoints(tmp_path / "out" / "checkpoints")}
    assert kept == {f"step-{s:08d}" for s in [12, *best]} and len(kept) >= 2
    assert summary["best_checkpoint"].name == f"step-{best[0]:08d}"


def test_a_demo_phase_stopped_by_sigterm_exits_143_naming_its_checkpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    def stopped(config: Path, **kw: Any) -> dict[str, Any]:  # SIGTERM came during phase 1
        return {"signal": signal.SIGTERM, "checkpoint": config.parent / "pretrain" / "step-00000007"}

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("kiln.hf._train.train", stopped)
    code, _, err = kiln(capsys, "demo")
    assert code == 143 and "step-00000007 is kept" in err and "pretrain.toml --resume" in err, err
