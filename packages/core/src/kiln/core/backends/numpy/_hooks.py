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
    # the bf16 recipe's LM head, whose rounding points lie inside the op (kiln.core.plan._precision)
    from kiln.core.backends.numpy._precision import fused_lm_head_loss_backward_bf16, fused_lm_head_loss_bf16

    registry.register_kernel("fused_lm_head_loss", "numpy", "bfloat16", fused_lm_head_loss_bf16)
    registry.register_kernel("fused_lm_head_loss_backward", "numpy", "bfloat16",
                             fused_lm_head_loss_backward_bf16)
    # ... and the points autocast has inside kiln's fused swiglu, q/k norm + rope and attention
    from kiln.core.backends.numpy import _precision as bf16

    for name, fn in (("swiglu", bf16.swiglu_bf16), ("swiglu_backward", bf16.swiglu_backward_bf16),
                     ("qkv_qk_norm_rope", bf16.qkv_qk_norm_rope_bf16),
                     ("qkv_qk_norm_rope_backward", bf16.qkv_qk_norm_rope_backward_bf16),
                     ("flash_attention", bf16.flash_attention_bf16),
                     ("flash_attention_backward", bf16.flash_attention_backward_bf16)):
        registry.register_kernel(name, "numpy", "bfloat16", fn)
