"""The ops kiln-core ships: each module lists its OpDefs in ``OPS``."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln.core._ops import OpRegistry

_MODULES = ("_linalg", "_elementwise", "_norms", "_attention", "_tensor", "_loss", "_moe")


def register_core_ops(registry: OpRegistry) -> None:
    """Register every core op (called through core's own ``kiln_register_ops`` hook)."""
    import importlib

    for name in _MODULES:
        try:
            module = importlib.import_module(f"kiln.core._oplib.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"kiln.core._oplib.{name}":
                raise
            continue
        for opdef in module.OPS:
            registry.register_op(opdef)


def op_registry() -> OpRegistry:
    """The process-wide op registry, built from every plugin's ``kiln_register_ops``."""
    from kiln.core._plugins import get_registry

    return get_registry("ops")  # type: ignore[return-value]
