"""kiln-kernels-cpu: fused native CPU kernels (C through cffi, OpenMP threads) for kiln's NumPy backend.

They register in the kernel table for backend ``numpy`` and ``float32``; the NumPy kernels stay the
reference, run float64, and run everything when ``KILN_CPU_KERNELS=0`` or when no C compiler could
build the kernels. See docs/performance.md.
"""

from __future__ import annotations

from importlib.metadata import version

from kiln.cpu._build import build, cache_dir
from kiln.cpu._kernels import OPS
from kiln.cpu._plugin import ENV, available, enabled, unavailable_reason

__version__ = version("kiln-kernels-cpu")

__all__ = ["ENV", "OPS", "available", "build", "cache_dir", "enabled", "unavailable_reason"]
