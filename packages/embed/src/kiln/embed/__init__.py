"""kiln-embed: kiln inside other programs.

A JSON-in, JSON-out API over compiled programs (:func:`compile`, :class:`ProgramHandle`), the C ABI
built from it (``libkiln`` and ``kiln.h``: :func:`build_library`, ``kiln embed build``), and, with
torch installed, :class:`KilnModule`: kiln's forward and backward in a torch training loop.
"""

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from kiln.embed._build import build_library
from kiln.embed._handle import CODES, EmbedError, ProgramHandle, compile, error_dict

try:
    __version__ = version("kiln-embed")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "KilnModule":  # torch is optional: imported when the wrapper is asked for
        from kiln.embed._torch import KilnModule

        return KilnModule
    raise AttributeError(f"module 'kiln.embed' has no attribute {name!r}")


__all__ = ["CODES", "EmbedError", "KilnModule", "ProgramHandle", "__version__", "build_library", "compile",
           "error_dict"]
