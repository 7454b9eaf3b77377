"""One rank of the NCCL all-reduce test: ``python _nccl.py OUT`` sums a CuPy buffer on this rank's GPU
over the ranks and writes what it holds after to ``OUT/rank<r>.npz``."""

from __future__ import annotations

import sys

import cupy
import numpy as np

from kiln.core import get_registry


def main(out: str) -> None:
    comm = get_registry("communicators")["nccl"]
    cupy.cuda.Device(comm.device).use()  # the buffer on the rank's GPU, the one NCCL runs on
    buf = cupy.arange(8, dtype=cupy.float32) * (comm.rank + 1)
    comm.all_reduce(buf)
    comm.barrier()
    np.savez(f"{out}/rank{comm.rank}.npz", summed=cupy.asnumpy(buf), world=comm.world_size,
             device=cupy.cuda.runtime.getDevice())


if __name__ == "__main__":
    main(sys.argv[1])
