"""kiln-hf's errors: each keeps the file and the tensor or key at fault, and names them in its message."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.core import KilnError


def _where(file: str | Path | None, what: str | None) -> str:
    parts = [str(file)] if file is not None else []
    if what is not None:
        parts.append(what)
    return ": ".join(parts) + ": " if parts else ""


class CheckpointError(KilnError):
    """A safetensors file or index that cannot be read or written, or a tensor that is not as expected.

    ``file`` is the file at fault and ``tensor`` the tensor or header key (``None`` when the whole file
    is at fault, e.g. a header length past its end).
    """

    def __init__(self, message: str, *, file: str | Path | None = None, tensor: str | None = None,
                 **kw: Any) -> None:
        self.file = None if file is None else str(file)
        self.tensor = tensor
        super().__init__(_where(file, None if tensor is None else f"tensor {tensor!r}") + message, **kw)


class HFConfigError(KilnError):
    """A HF ``config.json`` value that is missing, of the wrong kind or not supported (names ``key``)."""

    def __init__(self, message: str, *, key: str | None = None, file: str | Path | None = None,
                 **kw: Any) -> None:
        self.key = key
        self.file = None if file is None else str(file)
        super().__init__(_where(file, None if key is None else f"key {key!r}") + message, **kw)


class DataError(KilnError):
    """A tokenizer or text file that cannot be used, or a data-loader state that does not fit."""

    def __init__(self, message: str, *, file: str | Path | None = None, **kw: Any) -> None:
        self.file = None if file is None else str(file)
        super().__init__(_where(file, None) + message, **kw)
