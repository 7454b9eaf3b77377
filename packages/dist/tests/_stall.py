"""Ranks that all-reduce 20 times, except rank 1, which stops answering after 5 (the hang tests)."""

from __future__ import annotations

import time

import numpy as np

from kiln.core import get_registry

comm = get_registry("communicators")["mpi"]
buf = np.ones(4, np.float32)
for i in range(20):
    if comm.rank == 1 and i == 5:
        time.sleep(600)  # hung
    comm.all_reduce(buf)
