"""kiln-core's own subcommands and model source, contributed through ``kiln_cli_commands`` and
``kiln_register_model_sources``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kiln.core.plugins import hookimpl


@hookimpl
def kiln_register_model_sources(registry: Any) -> None:
    from kiln.core.cli._cli import IRFileSource

    registry.register("ir", IRFileSource())


@hookimpl
def kiln_cli_commands(register: Callable[..., None]) -> None:
    from kiln.core.cli._cli import configure_plan, run_plan, run_plugins

    register("plugins", help="list the loaded plugins with their distribution and version", run=run_plugins)
    register("plan", help="print the recompute plan of a model per layer and its planned peak memory",
             run=run_plan, configure=configure_plan)
