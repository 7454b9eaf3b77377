"""kiln-dsl: the Python decorator DSL, graph builder, compiler to IR, diagnostics and model library."""

from importlib.metadata import version

__version__ = version("kiln-dsl")

__all__ = ["__version__"]
