"""The ``kiln`` entry point of kiln-dsl: its hook implementations, found by kiln's plugin manager."""

from typing import Any

import pluggy

hookimpl = pluggy.HookimplMarker("kiln")


class ModelNames:
    """kiln-dsl's model source (``kiln_register_model_sources``): a registered model's name, with its
    config from ``--config``."""

    what = "kiln-dsl model names (e.g. Qwen3Model)"

    def claims(self, arg: str) -> bool:
        return arg.isidentifier()

    def load(self, arg: str, config: dict[str, Any] | None) -> tuple[Any, dict[str, Any]]:
        import difflib

        from kiln.core import KilnError
        from kiln.dsl import build_bundle, config_keys, list_registered_models, unknown_config_keys

        models = list_registered_models()
        if arg not in models:
            close = difflib.get_close_matches(arg, models, n=1)
            raise KilnError(f"no kiln-dsl model is named {arg!r}"
                            + (f" (did you mean {close[0]!r}?)" if close else ""),
                            hint=f"registered models: {', '.join(models)}")
        for key, near in unknown_config_keys(arg, config or {}):
            raise KilnError(f"--config: {key!r} is not a config key of {arg}"
                            + (f" (did you mean {near!r}?)" if near else ""),
                            hint=f"{arg} takes {', '.join(config_keys(arg) or [])}")
        return build_bundle(arg, config or {}), {}


@hookimpl
def kiln_register_model_sources(registry: Any) -> None:
    registry.register("dsl", ModelNames())
