"""The NumPy backend: host memory, every tensor a view into one arena."""

from kiln.core.backends.numpy._backend import NumpyBackend, counter_offset

__all__ = ["NumpyBackend", "counter_offset"]
