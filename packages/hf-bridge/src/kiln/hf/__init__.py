"""kiln-hf: the HuggingFace bridge: configs, safetensors weights in and out, tokenizers and data."""

from importlib.metadata import version

__version__ = version("kiln-hf")

__all__ = ["__version__"]
