"""kiln-dist: communicators, data parallelism and ZeRO-1 for kiln.

Registers the ``local``, ``mpi`` and ``nccl`` communicators and the collective ops of a data-parallel
Program; :class:`DataParallel` makes a :class:`kiln.core.Model` one rank of a data-parallel run, and
:func:`launch` starts the ranks through the MPI launcher; :class:`TensorParallel` and the
``tensor_parallel`` pass split the model over ranks; :func:`gather_state` and :func:`scatter_state`
make state dicts that do not depend on the number of ranks.
"""

from importlib.metadata import version

from kiln.dist._communicators import (
    LocalCommunicator,
    MpiCommunicator,
    NcclCommunicator,
    bind_gpu,
    mpi_available,
    nccl_available,
)
from kiln.dist._launch import launch, launched, launcher, stop_job
from kiln.dist._parallel import DataParallel
from kiln.dist._plan import PlanRank, rank_programs
from kiln.dist._state import gather_state, scatter_state, unshard
from kiln.dist._tensor import TensorParallel, grid, shard, tensor_parallel

__version__ = version("kiln-dist")

__all__ = [
    "DataParallel",
    "LocalCommunicator",
    "MpiCommunicator",
    "NcclCommunicator",
    "PlanRank",
    "TensorParallel",
    "__version__",
    "bind_gpu",
    "gather_state",
    "grid",
    "launch",
    "launched",
    "launcher",
    "mpi_available",
    "nccl_available",
    "rank_programs",
    "scatter_state",
    "shard",
    "stop_job",
    "tensor_parallel",
    "unshard",
]
