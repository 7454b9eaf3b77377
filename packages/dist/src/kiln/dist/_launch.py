"""Starting the ranks of a run through the MPI launcher (``mpiexec``; the ``mpich`` wheel puts one
beside the Python interpreter)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from kiln.core import KilnError

__all__ = ["launch", "launched", "launcher"]

#: set in every rank by the launchers of MPICH (Hydra), PMIx-based ones (Open MPI, Slurm's srun
#: --mpi=pmix) and Open MPI
RANK_VARIABLES = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")


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
    return subprocess.call([launcher(), "-n", str(nproc), sys.executable, *argv],
                           env={**os.environ, **(env or {})})
