"""The ops kiln-core ships: each module lists its ops in ``OPS`` (definition and NumPy kernel)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln.core.ops._ops import OpRegistry
    from kiln.core.ops.library._common import CoreOp


def core_ops() -> list[CoreOp]:
    from kiln.core.ops.library import (
        _attention,
        _cast,
        _elementwise,
        _linalg,
        _loss,
        _mamba,
        _math,
        _moe,
        _norms,
        _optimizer,
        _rope_freqs,
        _router,
        _tensor,
    )

    modules = (_linalg, _elementwise, _math, _norms, _attention, _rope_freqs, _tensor, _loss, _moe, _router,
               _optimizer, _mamba, _cast)
    return [op for module in modules
            for op in module.CORE_OPS]


def register_core_ops(registry: OpRegistry) -> None:
    """Register every core op (called through core's own ``kiln_register_ops`` hook)."""
    for op in core_ops():
        registry.register_op(op.opdef)


def op_registry() -> OpRegistry:
    """The process-wide op registry, built from every plugin's ``kiln_register_ops``."""
    from kiln.core.plugins._session import get_registry

    return get_registry("ops")  # type: ignore[return-value]
