"""kiln-core's own plugin: core contributes through the same hooks as every other plugin."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kiln.core._hookspecs import hookimpl


@hookimpl
def kiln_register_ops(registry: Any) -> None:
    from kiln.core._oplib import register_core_ops

    register_core_ops(registry)


@hookimpl
def kiln_cli_commands(register: Callable[..., None]) -> None:
    from kiln.core._cli import configure_plan, run_plan, run_plugins

    register("plugins", help="list the loaded plugins with their distribution and version", run=run_plugins)
    register("plan", help="print the recompute plan of a model per layer and its planned peak memory",
             run=run_plan, configure=configure_plan)


@hookimpl
def kiln_register_backends(registry: Any) -> None:
    from kiln.core._numpy_backend import NumpyBackend

    registry.register("numpy", NumpyBackend())


@hookimpl
def kiln_register_kernels(registry: Any) -> None:
    from kiln.core._oplib import register_numpy_kernels

    register_numpy_kernels(registry)


@hookimpl
def kiln_register_optimizers(registry: Any) -> None:
    from kiln.core._optim import SGD, AdamW

    registry.register("adamw", AdamW)
    registry.register("sgd", SGD)
