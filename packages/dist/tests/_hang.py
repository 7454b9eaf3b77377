"""A rank that notes its pid in ``OUT/rank<r>.pid`` and then all-reduces forever (the fault tests kill
one of them)."""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from kiln.core import get_registry

comm = get_registry("communicators")["mpi"]
buf = np.ones(4, np.float32)
comm.all_reduce(buf)  # every rank is up
with open(f"{sys.argv[1]}/rank{comm.rank}.pid", "w") as f:
    f.write(str(os.getpid()))
while True:
    comm.all_reduce(buf)
    time.sleep(0.01)
