"""Starting the ranks of a run through the MPI launcher (``mpiexec``; the ``mpich`` wheel puts one
beside the Python interpreter)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from kiln.core import KilnError

__all__ = ["launch", "launched", "launcher", "stop_job"]

#: set in every rank by the launchers of MPICH (Hydra), PMIx-based ones (Open MPI, Slurm's srun
#: --mpi=pmix) and Open MPI
RANK_VARIABLES = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")
#: the folder where the ranks :func:`launch` starts note their process ids (see :func:`note_rank`)
RANK_DIR = "KILN_RANK_DIR"


#: seconds a collective waits for the other ranks before the job is stopped (default 300: a rank may
#: be saving a large checkpoint while the others wait)
TIMEOUT = "KILN_DIST_TIMEOUT"
#: what MPICH prints for a rank that called MPI_Abort
_MPI_ABORT = re.compile(r"Abort\(\d+\) on node \d+ \(rank \d+ in comm \d+\): application called MPI_Abort")
_noted: dict[str, int] = {"rank": -1, "collectives": 0}


def timeout() -> float:
    text = os.environ.get(TIMEOUT, "300")
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise KilnError(f"{TIMEOUT}={text!r}: expected a number of seconds > 0")
    return value


def note_rank(rank: int) -> None:
    """In a rank :func:`launch` started: record this process's id under its rank, so that the launcher
    can name the rank of a process that died."""
    _noted["rank"] = rank
    folder = os.environ.get(RANK_DIR)
    if folder:
        Path(folder, str(os.getpid())).write_text(str(rank))


def note_collective() -> int:
    """Count a collective this rank starts (noted in the launch's rank folder, where the other ranks
    read it when one of them waits too long); its number."""
    _noted["collectives"] += 1
    folder = os.environ.get(RANK_DIR)
    if folder and _noted["rank"] >= 0:
        Path(folder, f"rank{_noted['rank']}.collectives").write_text(str(_noted["collectives"]))
    return _noted["collectives"]


def note_stop(message: str) -> None:
    """Say why this rank stops the job: in the rank folder of a job :func:`launch` started (the launcher
    may drop the output of a rank that aborts; :func:`launch` prints each note once, after the job),
    else on stderr."""
    folder = os.environ.get(RANK_DIR)
    if folder and _noted["rank"] >= 0:
        with contextlib.suppress(OSError):  # the launcher is gone: say it here
            Path(folder, f"rank{_noted['rank']}.stopped").write_text(message)
            return
    print(message, file=sys.stderr, flush=True)


def stop_job(message: str, exit_code: int = 1) -> NoReturn:
    """In a rank of a job of several ranks that cannot go on: say why (:func:`note_stop`) and stop every
    rank now (``MPI_Abort``), with ``exit_code`` as the launcher's exit status. Returning with an error
    instead would leave the other ranks waiting in their next collective, and this one in MPICH's
    ``MPI_Finalize``, until the collective timeout."""
    from mpi4py import MPI

    note_rank(int(MPI.COMM_WORLD.Get_rank()))
    note_stop(message)
    MPI.COMM_WORLD.Abort(exit_code)
    raise SystemExit(exit_code)  # not reached: MPI_Abort ends the process


def ranks_behind(number: int, world_size: int) -> list[int]:
    """The ranks whose notes say they have not started collective ``number`` yet (a rank without a note
    has started none); none known outside a job :func:`launch` started."""
    folder = os.environ.get(RANK_DIR)
    if not folder:
        return []
    behind = []
    for rank in range(world_size):
        try:
            started = int(Path(folder, f"rank{rank}.collectives").read_text() or 0)
        except (OSError, ValueError):
            started = 0
        if started < number:
            behind.append(rank)
    return behind


def launcher() -> str:
    """The MPI launcher: ``mpiexec`` in the interpreter's ``bin`` folder, else on ``PATH``."""
    beside = Path(sys.executable).with_name("mpiexec")
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        raise KilnError("no MPI launcher: mpiexec is neither beside the Python interpreter nor on PATH",
                        hint="pip install kiln-dist brings MPICH's mpiexec (the mpich wheel)")
    return found


def launched() -> bool:
    """Whether this process is a rank that an MPI launcher started."""
    return any(v in os.environ for v in RANK_VARIABLES)


def launch(nproc: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None) -> int:
    """Run ``python argv...`` as ``nproc`` ranks through the MPI launcher and wait for them; the exit
    status is the launcher's (non-zero when a rank failed). ``env``: variables added for the ranks."""
    if not isinstance(nproc, int) or nproc < 1:
        raise KilnError(f"nproc={nproc!r}: expected a positive number of ranks")
    # a rank the launcher is still stopping may write a note while the folder goes
    with tempfile.TemporaryDirectory(prefix="kiln-ranks-", ignore_cleanup_errors=True) as ranks:
        proc = subprocess.Popen([launcher(), "-n", str(nproc), sys.executable, *argv], text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={**os.environ, **(env or {}), RANK_DIR: ranks})
        dead: list[str] = []  # the launcher reports a dead rank by its pid (MPICH: on stdout)
        seen: set[str] = set()

        def forward(source: Any, sink: Any) -> None:
            for line in source:  # passed on as it comes
                if _MPI_ABORT.match(line):  # MPICH's line for a rank's stop_job: its note says why
                    continue
                sink.write(line)
                sink.flush()
                seen.add(line.rstrip("\n"))
                dead.extend(re.findall(r"^=\s+PID (\d+) RUNNING AT", line))

        threads = [threading.Thread(target=forward, args=pair, daemon=True)
                   for pair in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))]
        for t in threads:
            t.start()
        status = proc.wait()
        for t in threads:
            t.join()
        for note in sorted(Path(ranks).glob("rank*.stopped")):  # a rank that stopped the job said why
            lines = note.read_text().rstrip("\n").splitlines()
            if not seen.issuperset(lines):  # once: the ranks may all stop on the same error
                seen.update(lines)
                print("\n".join(lines), file=sys.stderr, flush=True)
        for pid in dict.fromkeys(dead):
            noted = Path(ranks, pid)
            rank = noted.read_text() if noted.exists() else "?"
            print(f"kiln: rank {rank} (pid {pid}) ended abnormally; the launcher stopped the other ranks",
                  file=sys.stderr, flush=True)
        return status
