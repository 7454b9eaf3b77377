"""kiln-dist: communicators, data parallel, ZeRO-1, tensor-parallel sharding pass."""

from importlib.metadata import version

__version__ = version("kiln-dist")

__all__ = ["__version__"]
