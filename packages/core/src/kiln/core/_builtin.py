"""kiln-core's own plugin: core contributes through the same hooks as every other plugin."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from kiln.core._hookspecs import hookimpl


@hookimpl
def kiln_register_ops(registry: Any) -> None:
    try:
        oplib = importlib.import_module("kiln.core._oplib")
    except ModuleNotFoundError as exc:
        if exc.name != "kiln.core._oplib":
            raise
        return
    oplib.register_core_ops(registry)


@hookimpl
def kiln_cli_commands(register: Callable[..., None]) -> None:
    from kiln.core._cli import run_plugins

    register("plugins", help="list the loaded plugins with their distribution and version", run=run_plugins)
