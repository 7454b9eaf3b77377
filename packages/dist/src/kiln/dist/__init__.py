"""kiln-dist: communicators, data parallelism and ZeRO-1 for kiln.

Registers the ``local``, ``mpi`` and ``nccl`` communicators and the collective ops of a data-parallel
Program; :class:`DataParallel` makes a :class:`kiln.core.Model` one rank of a data-parallel run, and
:func:`launch` starts the ranks through the MPI launcher.
"""

from importlib.metadata import version

from kiln.dist._communicators import (
    LocalCommunicator,
    MpiCommunicator,
    NcclCommunicator,
    mpi_available,
    nccl_available,
)
from kiln.dist._launch import launch, launched, launcher
from kiln.dist._parallel import DataParallel
from kiln.dist._tensor import TensorParallel, grid, shard, tensor_parallel

__version__ = version("kiln-dist")

__all__ = [
    "DataParallel",
    "LocalCommunicator",
    "MpiCommunicator",
    "NcclCommunicator",
    "TensorParallel",
    "__version__",
    "grid",
    "launch",
    "launched",
    "launcher",
    "mpi_available",
    "nccl_available",
    "shard",
    "tensor_parallel",
]
