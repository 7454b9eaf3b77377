"""The NumPy backend and its kernels, contributed through the backend and kernel hooks."""

from __future__ import annotations

from typing import Any

from kiln.core.plugins import hookimpl


@hookimpl
def kiln_register_backends(registry: Any) -> None:
    from kiln.core.backends.numpy._backend import NumpyBackend

    registry.register("numpy", NumpyBackend())


@hookimpl
def kiln_register_kernels(registry: Any) -> None:
    """A kernel for every op of kiln-core's library (its ``out=`` kernel where it has one, else its
    reference kernel) and the fused LM-head training pass the backend implements. A plugin's op
    without a NumPy kernel runs its reference kernel (the backend's ``reference``)."""
    from kiln.core.ops.library import core_ops
    from kiln.core.ops.library._loss import fused_lm_head_loss_and_grad

    for op in core_ops():
        if op.out_kernel is not None:
            registry.register_kernel(op.opdef.name, "numpy", "*", op.out_kernel, out=True, inplace=op.inplace)
        else:
            registry.register_kernel(op.opdef.name, "numpy", "*", op.opdef.kernel)
    registry.register_kernel("fused_lm_head_loss_and_grad", "numpy", "*", fused_lm_head_loss_and_grad,
                             out=True)
