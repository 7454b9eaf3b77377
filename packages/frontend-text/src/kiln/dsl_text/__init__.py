"""kiln-dsl-text: kiln's text model language (seed 004), lowered to the same IR as kiln-dsl.

``load_program(path)`` parses and lowers a file; ``compile_file(path, model=None, config=None)``
returns the IR Bundle of one of its models. Errors are ``KilnError``s with the seed's codes,
``file:line:column`` and a caret under the culprit.
"""

from importlib import resources
from importlib.metadata import version
from pathlib import Path
from typing import Any

from kiln.dsl_text._errors import TextError
from kiln.dsl_text._lower import Program, load_program
from kiln.dsl_text._parser import parse

__version__ = version("kiln-dsl-text")

__all__ = ["Program", "TextError", "__version__", "compile_file", "load_program", "model_path", "parse"]


def compile_file(path: str | Path, model: str | None = None, config: dict[str, Any] | None = None) -> Any:
    """The IR Bundle of ``model`` (default: the file's only model) declared in the text file ``path``."""
    return load_program(path).bundle(model, config)


def model_path(name: str) -> Path:
    """The path of a model shipped with kiln-dsl-text (``"qwen3"``: ``models/qwen3.kiln``)."""
    return Path(str(resources.files("kiln.dsl_text").joinpath("models", f"{name}.kiln")))
