"""kiln-core's op library, contributed through the same hook as every plugin's ops."""

from __future__ import annotations

from typing import Any

from kiln.core.plugins import hookimpl


@hookimpl
def kiln_register_ops(registry: Any) -> None:
    from kiln.core.ops.library import register_core_ops

    register_core_ops(registry)
