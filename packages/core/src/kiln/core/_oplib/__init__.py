"""The ops kiln-core ships: each module lists its ops in ``OPS`` (definition and NumPy kernel)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln.core._kernels import KernelTable
    from kiln.core._oplib._common import CoreOp
    from kiln.core._ops import OpRegistry


def core_ops() -> list[CoreOp]:
    from kiln.core._oplib import (
        _attention,
        _elementwise,
        _linalg,
        _loss,
        _math,
        _moe,
        _norms,
        _optimizer,
        _tensor,
    )

    modules = (_linalg, _elementwise, _math, _norms, _attention, _tensor, _loss, _moe, _optimizer)
    return [op for module in modules
            for op in module.CORE_OPS]


def register_core_ops(registry: OpRegistry) -> None:
    """Register every core op (called through core's own ``kiln_register_ops`` hook)."""
    for op in core_ops():
        registry.register_op(op.opdef)


def register_numpy_kernels(table: KernelTable) -> None:
    """The NumPy backend's ``out=`` kernels, and the fused LM-head training pass it implements.

    Ops without an entry run their reference kernel (``OpDef.kernel``) on the NumPy backend.
    """
    from kiln.core._oplib._loss import fused_lm_head_loss_and_grad

    for op in core_ops():
        if op.out_kernel is not None:
            table.register_kernel(op.opdef.name, "numpy", "*", op.out_kernel, out=True, inplace=op.inplace)
    table.register_kernel("fused_lm_head_loss_and_grad", "numpy", "*", fused_lm_head_loss_and_grad, out=True)


def op_registry() -> OpRegistry:
    """The process-wide op registry, built from every plugin's ``kiln_register_ops``."""
    from kiln.core._plugins import get_registry

    return get_registry("ops")  # type: ignore[return-value]
