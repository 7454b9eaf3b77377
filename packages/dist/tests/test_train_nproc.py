"""``kiln train --nproc 2`` (kiln-hf's trainer on two MPI ranks) against the same run in one process:
the same losses, eval losses and saved model, to float32 rounding."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("kiln.hf", reason="kiln train is kiln-hf's")
pytest.importorskip("kiln.dsl", reason="kiln train builds its model with kiln-dsl")

from kiln.hf import save_tokenizer, train_bpe_tokenizer


def write_run(folder: Path, name: str, batch_size: int = 4, steps: int = 4, parallel: str = "") -> Path:
    from pydoc_data.topics import topics

    text = folder / "text.txt"
    if not text.exists():
        text.write_text("\n\n".join(topics[k] for k in sorted(topics))[:40_000], encoding="utf-8")
        save_tokenizer(train_bpe_tokenizer([text], 300), folder / "tokenizer")
    config = folder / f"{name}.toml"
    config.write_text(f"""[model]
name = "Qwen3Model"
size = "tiny"
config = {{ n_layers = 1, d_model = 32, num_query_heads = 2, num_kv_heads = 2, head_size = 16, d_ff = 64 }}
[data]
files = ["text.txt"]
tokenizer = "tokenizer"
separator = "\\n\\n"
[train]
output_dir = "out-{name}"
steps = {steps}
batch_size = {batch_size}
seq_len = 16
eval_every = 2
eval_batches = 2
checkpoint_every = 2
recompute = "none"
[parallel]
{parallel}
""")
    return config


def kiln(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``kiln train ARGS``; a rank that hangs stops the job (KILN_DIST_TIMEOUT) well before the test's
    own timeout, naming what it waited for."""
    return subprocess.run([sys.executable, "-m", "kiln.core", "train", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "KILN_NUM_THREADS": "1", "KILN_DIST_TIMEOUT": "150"})


def records(folder: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_two_ranks_train_as_one_process(tmp_path: Path) -> None:
    one, two = write_run(tmp_path, "one"), write_run(tmp_path, "two")
    assert kiln(str(one), cwd=tmp_path).returncode == 0
    done = kiln(str(two), "--nproc", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("data:") == 1  # rank 0 alone prints
    a, b = records(tmp_path / "out-one"), records(tmp_path / "out-two")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2, 3, 4]
    for x, y in zip(a, b, strict=True):
        for key in ("loss", "eval_loss", "grad_norm"):
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-5), (x["step"], key)
    # rank 0 alone writes: the run folder holds what a one-process run's holds
    names = [{p.name for p in (tmp_path / out).iterdir()} for out in ("out-one", "out-two")]
    assert names[0] == names[1]
    import safetensors.numpy

    w1 = safetensors.numpy.load_file(str(tmp_path / "out-one" / "model" / "model.safetensors"))
    w2 = safetensors.numpy.load_file(str(tmp_path / "out-two" / "model" / "model.safetensors"))
    for k, v in w1.items():  # float32 sums in another order
        assert np.linalg.norm(w2[k] - v) <= 1e-4 * np.linalg.norm(v), k


def test_a_batch_the_ranks_cannot_share_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    config = write_run(tmp_path, "odd", batch_size=3)
    done = kiln(str(config), "--nproc", "2", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "train.batch_size" in done.stderr and "--nproc 2" in done.stderr
    assert not (tmp_path / "out-odd").exists()


@pytest.mark.parametrize(("first", "then"), [("2", "1"), ("1", "2")], ids=["2-then-1", "1-then-2"])
def test_a_run_resumes_on_another_number_of_ranks(tmp_path: Path, first: str, then: str) -> None:
    reference, run = write_run(tmp_path, "ref", steps=6), write_run(tmp_path, "run", steps=6)
    assert kiln(str(reference), cwd=tmp_path).returncode == 0
    assert kiln(str(run), "--nproc", first, cwd=tmp_path).returncode == 0
    checkpoints = tmp_path / "out-run" / "checkpoints"
    shutil.rmtree(checkpoints / "step-00000006")  # as if stopped after step 4
    done = kiln(str(run), "--resume", "--nproc", then, cwd=tmp_path)
    assert done.returncode == 0 and "resuming from" in done.stdout and "(step 4)" in done.stdout, done.stderr
    a, b = records(tmp_path / "out-ref"), records(tmp_path / "out-run")
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4, 5, 6]
    for x, y in zip(a, b, strict=True):
        if "loss" in x:
            assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), x["step"]


PARALLEL = {"zero": "zero = true", "tensor": "tensor = 2", "zero+tensor": "zero = true\ntensor = 2"}
#: the ranks each kind runs on: ZeRO-1 with tensor parallelism on a 2 x 2 grid
NPROC = {"zero": "2", "tensor": "2", "zero+tensor": "4"}


def assert_same_losses(a: list[dict[str, float]], b: list[dict[str, float]], rel: float) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b, strict=True):
        for key in ("loss", "eval_loss", "grad_norm"):
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=rel), (x["step"], key)


@pytest.mark.parametrize("kind", ["zero", "tensor", "zero+tensor"])
def test_zero1_and_tensor_parallel_runs_of_kiln_train_equal_one_process(tmp_path: Path, kind: str) -> None:
    one, two = write_run(tmp_path, "one"), write_run(tmp_path, "two", parallel=PARALLEL[kind])
    assert kiln(str(one), cwd=tmp_path).returncode == 0
    done = kiln(str(two), "--nproc", NPROC[kind], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert_same_losses(records(tmp_path / "out-one"), records(tmp_path / "out-two"), rel=1e-5)
    if kind != "zero":
        assert "2-way tensor parallel" in done.stdout
    if kind == "zero+tensor":
        assert "ZeRO-1 over 2 data-parallel ranks" in done.stdout
    import safetensors.numpy  # the HF export holds the whole model

    w1 = safetensors.numpy.load_file(str(tmp_path / "out-one" / "model" / "model.safetensors"))
    w2 = safetensors.numpy.load_file(str(tmp_path / "out-two" / "model" / "model.safetensors"))
    assert w1.keys() == w2.keys()
    for k, v in w1.items():  # float32 sums in another order
        assert np.linalg.norm(w2[k] - v) <= 1e-4 * np.linalg.norm(v), k
    if kind == "tensor":  # the exported checkpoint trains on, tensor parallel and in one process
        for name, parallel in (("ft-one", ""), ("ft-two", PARALLEL[kind])):
            (tmp_path / f"{name}.toml").write_text(f"""[model]
checkpoint = "out-two/model"
[data]
files = ["text.txt"]
separator = "\\n\\n"
[train]
output_dir = "out-{name}"
steps = 2
batch_size = 4
seq_len = 16
eval_every = 2
eval_batches = 2
recompute = "none"
[parallel]
{parallel}
""")
        assert kiln(str(tmp_path / "ft-one.toml"), cwd=tmp_path).returncode == 0
        done = kiln(str(tmp_path / "ft-two.toml"), "--nproc", "2", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert_same_losses(records(tmp_path / "out-ft-one"), records(tmp_path / "out-ft-two"), rel=1e-5)


@pytest.mark.parametrize(("kind", "first", "then"), [
    ("zero", 2, 1), ("zero", 1, 2), ("tensor", 2, 1), ("tensor", 1, 2), ("zero+tensor", 4, 1),
    ("zero+tensor", 1, 4)], ids=lambda v: str(v))
def test_a_zero1_or_tensor_parallel_run_resumes_on_another_number_of_ranks(tmp_path: Path, kind: str,
                                                                           first: int, then: int) -> None:
    """The checkpoints hold the whole model's state, whatever the number of ranks that wrote them."""
    reference = write_run(tmp_path, "ref", steps=6)
    assert kiln(str(reference), cwd=tmp_path).returncode == 0
    run = write_run(tmp_path, "run", steps=6, parallel=PARALLEL[kind] if first > 1 else "")
    assert kiln(str(run), "--nproc", str(first), cwd=tmp_path).returncode == 0
    shutil.rmtree(tmp_path / "out-run" / "checkpoints" / "step-00000006")  # as if stopped after step 4
    write_run(tmp_path, "run", steps=6, parallel=PARALLEL[kind] if then > 1 else "")
    done = kiln(str(run), "--resume", "--nproc", str(then), cwd=tmp_path)
    assert done.returncode == 0 and "(step 4)" in done.stdout, done.stderr
    assert_same_losses(records(tmp_path / "out-ref"), records(tmp_path / "out-run"), rel=1e-5)


def test_a_tensor_parallel_degree_the_ranks_cannot_share_is_refused(tmp_path: Path) -> None:
    config = write_run(tmp_path, "odd", parallel="tensor = 2")
    done = kiln(str(config), "--nproc", "3", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "parallel.tensor" in done.stderr and "does not divide the 3 ranks" in done.stderr
    done = kiln(str(config), cwd=tmp_path)  # one process: no ranks to share the model
    assert done.returncode == 2 and "parallel.tensor" in done.stderr and "--nproc" in done.stderr


def _rank_pid(rank: int, cwd: Path) -> int | None:
    """The pid of the ``kiln train`` rank ``rank`` running in ``cwd`` (MPICH sets PMI_RANK)."""
    for proc in Path("/proc").iterdir():
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            if f"PMI_RANK={rank}".encode() in env and Path(os.readlink(proc / "cwd")) == cwd:
                return int(proc.name)
        except (OSError, ValueError):
            continue
    return None


def test_a_killed_rank_stops_the_run_names_it_and_leaves_a_checkpoint_to_resume(tmp_path: Path) -> None:
    config = write_run(tmp_path, "killed", steps=400)
    run = subprocess.Popen([sys.executable, "-m", "kiln.core", "train", str(config), "--nproc", "2"],
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "KILN_NUM_THREADS": "1"})
    checkpoints = tmp_path / "out-killed" / "checkpoints"
    deadline = time.monotonic() + 120
    while not (checkpoints.is_dir() and any(p.name.startswith("step-") for p in checkpoints.iterdir())):
        assert time.monotonic() < deadline and run.poll() is None, run.communicate()
        time.sleep(0.1)
    while (pid := _rank_pid(1, tmp_path)) is None:
        assert time.monotonic() < deadline and run.poll() is None, run.communicate()
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    _, err = run.communicate(timeout=60)
    assert run.returncode != 0 and time.monotonic() - killed < 60
    assert "kiln: rank 1 (pid " in err, err
    done = kiln(str(config), "--resume", cwd=tmp_path)  # the checkpoint is intact: one process goes on
    assert "resuming from" in done.stdout, done.stderr


@pytest.mark.parametrize("zero", [False, True], ids=["all-reduce", "zero1-reduce-scatter"])
def test_overlap_in_kiln_train_gives_the_losses_of_the_run_without(tmp_path: Path, zero: bool) -> None:
    """``[parallel] overlap = true``: the gradient sync started in the backward, the same sums."""
    plain = "zero = true" if zero else ""
    without = write_run(tmp_path, "plain", parallel=plain)
    overlapped = write_run(tmp_path, "overlap", parallel=f"{plain}\noverlap = true")
    a = kiln(str(without), "--nproc", "2", cwd=tmp_path)
    assert a.returncode == 0, a.stderr
    assert "overlapped" not in a.stdout
    done = kiln(str(overlapped), "--nproc", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    sync = "reduce-scatter" if zero else "all-reduce"
    assert f"{sync} overlapped with the backward" in done.stdout, done.stdout
    assert_same_losses(records(tmp_path / "out-plain"), records(tmp_path / "out-overlap"), rel=1e-6)


def test_mpiexec_of_kiln_train_trains_as_nproc(tmp_path: Path) -> None:
    """``mpiexec -n 2 python -m kiln.core train CONFIG`` (the command ``--nproc 2`` runs, as typed with
    the MPI launcher of the mpich wheel) trains as ``--nproc 2``: rank 0 alone prints and writes."""
    from kiln.dist import launcher

    nproc, typed = write_run(tmp_path, "nproc"), write_run(tmp_path, "typed")
    assert kiln(str(nproc), "--nproc", "2", cwd=tmp_path).returncode == 0
    done = subprocess.run([launcher(), "-n", "2", sys.executable, "-m", "kiln.core", "train", str(typed)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "KILN_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("data:") == 1  # rank 0 alone prints
    a, b = records(tmp_path / "out-nproc"), records(tmp_path / "out-typed")
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    assert_same_losses(a, b, rel=1e-6)
    names = [{p.name for p in (tmp_path / out).iterdir()} for out in ("out-nproc", "out-typed")]
    assert names[0] == names[1]
    # --nproc under the launcher is refused: the ranks would start ranks of their own
    nested = subprocess.run([launcher(), "-n", "1", sys.executable, "-m", "kiln.core", "train", str(typed),
                             "--nproc", "2"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert nested.returncode != 0 and "under mpiexec or srun leave it out" in nested.stderr, nested.stderr


def with_rank_patch(folder: Path, code: str) -> dict[str, str]:
    """The environment of a run whose ranks first run ``code`` (a ``sitecustomize`` module; ``RANK`` is
    the MPI rank, -1 outside a job): how a test makes one rank fail or wait."""
    site = folder / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text("import os\nRANK = int(os.environ.get('PMI_RANK', -1))\n" + code)
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "KILN_NUM_THREADS": "1"}


def test_a_rank_that_fails_stops_the_job_at_once_with_its_error(tmp_path: Path) -> None:
    """Rank 1 alone fails: the job ends now with its error and exit status (not after the other rank
    waited out its collective), the error printed once, without MPICH's abort line."""
    config = write_run(tmp_path, "failing")
    env = with_rank_patch(tmp_path, """
if RANK == 1:
    from kiln.core import KilnError
    from kiln.hf import _train

    def refuse(self, vocab_size):
        raise KilnError("rank one cannot build its model")

    _train._Run.build_model = refuse
""")
    env["KILN_DIST_TIMEOUT"] = "120"
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "kiln.core", "train", str(config), "--nproc", "2"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=200, env=env)
    assert time.monotonic() - start < 60, done.stderr
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("kiln: error: rank one cannot build its model") == 1, done.stderr
    assert "Traceback" not in done.stderr and "MPI_Abort" not in done.stderr, done.stderr


def test_every_rank_reads_the_saved_tokenizer_before_rank_0_replaces_it(tmp_path: Path) -> None:
    """On --resume each rank reads the run's tokenizer folder, which rank 0 then writes again: a rank
    slow to read it must not find it half-replaced (it did once, as 'not a valid tokenizer.json')."""
    config = write_run(tmp_path, "slow", steps=2)
    assert kiln(str(config), cwd=tmp_path).returncode == 0
    env = with_rank_patch(tmp_path, f"""
import time
import kiln.hf
from kiln.hf import _train

marks = {str(tmp_path)!r}
if RANK == 1:
    read = kiln.hf.load_tokenizer

    def slow_read(*args, **kwargs):
        time.sleep(1.5)
        tokenizer = read(*args, **kwargs)
        open(os.path.join(marks, "read"), "w").write(repr(time.monotonic()))
        return tokenizer

    kiln.hf.load_tokenizer = slow_read
if RANK == 0:
    replace = _train._replace_dir

    def timed_replace(final, fill):
        if final.name == "tokenizer":
            open(os.path.join(marks, "replaced"), "w").write(repr(time.monotonic()))
        return replace(final, fill)

    _train._replace_dir = timed_replace
""")
    write_run(tmp_path, "slow", steps=3)
    done = subprocess.run([sys.executable, "-m", "kiln.core", "train", str(config), "--resume", "--nproc",
                           "2"], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and "(step 2)" in done.stdout, done.stderr
    assert float((tmp_path / "read").read_text()) < float((tmp_path / "replaced").read_text())
