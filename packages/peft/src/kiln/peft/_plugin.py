"""The ``kiln`` entry point of kiln-peft: its hook implementations, found by kiln's plugin manager."""

from typing import Any

import pluggy

hookimpl = pluggy.HookimplMarker("kiln")


@hookimpl
def kiln_register_graph_passes(registry: Any) -> None:
    from kiln.peft._ia3 import ia3
    from kiln.peft._lora import lora

    registry.register("lora", lora)
    registry.register("ia3", ia3)


class LoraAdapter:
    """The ``lora`` adapter: ``config(**settings)`` is a :class:`~kiln.peft.LoraConfig`, ``apply``
    is :func:`~kiln.peft.get_peft_model`."""

    name = "lora"

    @property
    def config_class(self) -> Any:
        from kiln.peft._config import LoraConfig

        return LoraConfig

    def config(self, **settings: Any) -> Any:
        return self.config_class(**settings)

    def apply(self, model: Any, config: Any, **options: Any) -> Any:
        from kiln.peft._model import get_peft_model

        return get_peft_model(model, config, **options)


class IA3Adapter(LoraAdapter):
    """The ``ia3`` adapter: ``config(**settings)`` is a :class:`~kiln.peft.IA3Config`."""

    name = "ia3"

    @property
    def config_class(self) -> Any:
        from kiln.peft._ia3 import IA3Config

        return IA3Config


@hookimpl
def kiln_register_adapters(registry: Any) -> None:
    registry.register("lora", LoraAdapter())
    registry.register("ia3", IA3Adapter())
