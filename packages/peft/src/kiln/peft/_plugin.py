"""The ``kiln`` entry point of kiln-peft: its hook implementations, found by kiln's plugin manager."""

from typing import Any

import pluggy

hookimpl = pluggy.HookimplMarker("kiln")


@hookimpl
def kiln_register_graph_passes(registry: Any) -> None:
    from kiln.peft._lora import lora

    registry.register("lora", lora)


@hookimpl
def kiln_register_adapters(registry: Any) -> None:
    from kiln.peft._config import LoraConfig

    registry.register("lora", LoraConfig)
