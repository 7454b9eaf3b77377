"""The ops kiln-core ships: each module lists its OpDefs in ``OPS``."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln.core._ops import OpRegistry

def register_core_ops(registry: OpRegistry) -> None:
    """Register every core op (called through core's own ``kiln_register_ops`` hook)."""
    from kiln.core._oplib import _attention, _elementwise, _linalg, _loss, _math, _moe, _norms, _tensor

    for module in (_linalg, _elementwise, _math, _norms, _attention, _tensor, _loss, _moe):
        for opdef in module.OPS:
            registry.register_op(opdef)


def op_registry() -> OpRegistry:
    """The process-wide op registry, built from every plugin's ``kiln_register_ops``."""
    from kiln.core._plugins import get_registry

    return get_registry("ops")  # type: ignore[return-value]
