"""Ranks that all-reduce 20 times, except rank 1, which stops answering after 5 (the hang tests);
``python _stall.py [OUT]`` notes each rank's pid in ``OUT/rank<r>.pid``."""

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
for i in range(20):
    if comm.rank == 1 and i == 5:
        time.sleep(600)  # hung
    comm.all_reduce(buf)
