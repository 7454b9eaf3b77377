"""kiln-peft's error: it keeps the file and the key at fault, and names them in its message."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.core import KilnError


class AdapterError(KilnError):
    """A LoRA config, adapter file or adapter tensor that kiln cannot use.

    ``file`` is the file at fault (``adapter_config.json``, ``adapter_model.safetensors``) or None,
    ``key`` the config field, tensor or module at fault, and ``detail`` the message without them.
    """

    def __init__(self, message: str, *, file: str | Path | None = None, key: str | None = None,
                 **kw: Any) -> None:
        self.file = None if file is None else str(file)
        self.key, self.detail = key, message
        where = [w for w in (self.file, None if key is None else repr(key)) if w is not None]
        super().__init__(": ".join([*where, message]), **kw)
