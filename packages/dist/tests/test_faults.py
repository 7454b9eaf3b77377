"""A rank killed with SIGKILL: the launcher stops the others within seconds, exits non-zero, and
kiln's launch names the rank that died; a hung rank: the others stop it past the timeout. Either
way no rank outlives the launch."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from kiln.dist import launch

HERE = Path(__file__).parent


def assert_gone(pid_files: list[Path]) -> None:
    """No process of ``pid_files`` is left (an orphan rank), a few seconds allowed for the exit."""
    pids = [int(p.read_text()) for p in pid_files]
    assert pids
    deadline = time.monotonic() + 10
    while True:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue
            if Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                continue  # exited, not yet reaped
            alive.append(pid)
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not alive, f"rank processes {alive} outlived the launch"


def test_a_killed_rank_stops_the_run_and_is_named(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    def kill_rank_1() -> None:
        pid_file = tmp_path / "rank1.pid"
        for _ in range(600):
            if pid_file.exists() and pid_file.read_text():
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_rank_1)
    killer.start()
    start = time.monotonic()
    status = launch(2, [str(HERE / "_hang.py"), str(tmp_path)], env={"KILN_NUM_THREADS": "1"})
    elapsed = time.monotonic() - start
    killer.join()
    assert status != 0 and elapsed < 60
    err = capfd.readouterr().err
    assert "kiln: rank 1 (pid " in err and "ended abnormally" in err, err
    assert_gone([tmp_path / "rank0.pid"])  # the rank that was not killed is stopped too


def test_a_hung_rank_stops_the_run_past_the_timeout_and_is_named(tmp_path: Path,
                                                                 capfd: pytest.CaptureFixture[str]) -> None:
    start = time.monotonic()
    status = launch(3, [str(HERE / "_stall.py"), str(tmp_path)],
                    env={"KILN_NUM_THREADS": "1", "KILN_DIST_TIMEOUT": "2"})
    elapsed = time.monotonic() - start
    assert status != 0 and elapsed < 60
    err = capfd.readouterr().err
    assert "an all-reduce waited" in err and "rank(s) 1 did not reach it" in err, err
    assert_gone([tmp_path / f"rank{r}.pid" for r in range(3)])  # the hung rank (asleep) included


def test_a_rank_hung_before_its_first_collective_is_named(tmp_path: Path,
                                                          capfd: pytest.CaptureFixture[str]) -> None:
    """It has noted no collective: it has started none, so it is behind the others' first."""
    status = launch(3, [str(HERE / "_stall.py"), str(tmp_path), "before"],
                    env={"KILN_NUM_THREADS": "1", "KILN_DIST_TIMEOUT": "2"})
    err = capfd.readouterr().err
    assert status != 0 and "rank(s) 2 did not reach it" in err, err
    assert_gone([tmp_path / f"rank{r}.pid" for r in range(3)])
