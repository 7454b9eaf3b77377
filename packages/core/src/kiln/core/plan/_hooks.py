"""kiln-core's optimizers, contributed through ``kiln_register_optimizers``."""

from __future__ import annotations

from typing import Any

from kiln.core.plugins import hookimpl


@hookimpl
def kiln_register_optimizers(registry: Any) -> None:
    from kiln.core.plan._optim import SGD, AdamW

    registry.register("adamw", AdamW)
    registry.register("sgd", SGD)
