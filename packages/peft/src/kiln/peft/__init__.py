"""kiln-peft: LoRA (and later other adapters) as a graph pass, PEFT-format save and load, merge."""

from importlib.metadata import version

__version__ = version("kiln-peft")

__all__ = ["__version__"]
