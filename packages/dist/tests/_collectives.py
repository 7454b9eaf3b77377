"""One rank of the MPI communicator test: runs every collective of ``MpiCommunicator`` on values that
depend on the rank and writes what it received to ``OUT/rank<r>.npz`` (``python _collectives.py OUT``)."""

from __future__ import annotations

import sys

import numpy as np

from kiln.core import get_registry
from kiln.dist import launched


def main(out: str) -> None:
    comm = get_registry("communicators")["mpi"]  # as the collective ops find it
    rank, world = comm.rank, comm.world_size
    summed = np.arange(6, dtype=np.float32) * (rank + 1)
    comm.all_reduce(summed)
    scattered = np.empty(3, np.float64)
    comm.reduce_scatter(np.arange(3 * world, dtype=np.float64) + 10 * rank, scattered)
    gathered = np.empty(2 * world, np.float32)
    comm.all_gather(np.full(2, rank, np.float32), gathered)
    cast = np.full(4, rank, np.int64)
    comm.broadcast(cast, root=world - 1)
    comm.barrier()
    np.savez(f"{out}/rank{rank}.npz", launched=launched(), world=world, summed=summed, scattered=scattered,
             gathered=gathered, cast=cast)


if __name__ == "__main__":
    main(sys.argv[1])
