"""The NumPy backend: host memory, every tensor a view into one arena; and the thread pool its kernels
share (``KILN_NUM_THREADS``), which native kernels registered for the backend use too."""

from kiln.core._threads import chunks, matmul_into, parallel, scratch, threads
from kiln.core.backends.numpy._backend import NumpyBackend, counter_offset

__all__ = ["NumpyBackend", "chunks", "counter_offset", "matmul_into", "parallel", "scratch", "threads"]
