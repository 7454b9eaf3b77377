"""kiln-core's optimizers and graph passes, contributed through ``kiln_register_optimizers`` and
``kiln_register_graph_passes``."""

from __future__ import annotations

from typing import Any

from kiln.core.plugins import hookimpl


@hookimpl
def kiln_register_optimizers(registry: Any) -> None:
    from kiln.core.plan._optim import SGD, AdamW

    registry.register("adamw", AdamW)
    registry.register("sgd", SGD)


@hookimpl
def kiln_register_graph_passes(registry: Any) -> None:
    from kiln.core.plan._passes import GraphPass, ignore_index_pass

    registry.register("ignore_index", GraphPass("ignore_index", ignore_index_pass,
                                                doc="the label the losses ignore: {'value': int}"))
