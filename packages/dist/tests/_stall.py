"""Ranks that all-reduce 20 times, except rank 1, which stops answering after 5 (the hang tests);
``python _stall.py OUT [before]`` notes each rank's pid in ``OUT/rank<r>.pid``; with ``before``, the last
rank hangs before its first all-reduce instead."""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from kiln.core import get_registry

comm = get_registry("communicators")["mpi"]
buf = np.ones(4, np.float32)
if len(sys.argv) > 1:
    with open(f"{sys.argv[1]}/rank{comm.rank}.pid", "w") as f:
        f.write(str(os.getpid()))
hung_rank, hung_at = (comm.world_size - 1, 0) if sys.argv[2:] == ["before"] else (1, 5)
for i in range(20):
    if comm.rank == hung_rank and i == hung_at:
        time.sleep(600)  # hung
    comm.all_reduce(buf)
