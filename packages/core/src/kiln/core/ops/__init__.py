"""The op layer: :class:`OpDef` (schema, attributes, shape rule, traits, backward rule, reference
kernel), the op registry and kiln-core's op library."""

from collections.abc import Callable, Sequence

from kiln.core.ir._infer import InferContext, infer_types
from kiln.core.ops._ops import (
    AttrSpec,
    BackwardContext,
    Cost,
    OpDef,
    OpRegistry,
    Sample,
    no_gradient,
    numpy_dtype,
)
from kiln.core.ops.library._attention import check_rotary_dim, rope_tables
from kiln.core.ops.library._elementwise import dropout_key
from kiln.core.ops.library._loss import FUSED_LOGITS_TILE, loss_targets
from kiln.core.ops.library._rope_freqs import ROPE_TYPES, rope_freqs_table, rope_inv_freq


def op_registry() -> OpRegistry:
    """The op registry of the current plugin session (every plugin's ``kiln_register_ops`` and the
    ops registered at run time)."""
    from kiln.core.ops.library import op_registry as _op_registry

    return _op_registry()


def register_op(opdef: OpDef) -> OpDef:
    """Register an op at run time (schema, shape rule, reference kernel and backward rule in one
    ``OpDef``)."""
    return op_registry().register_op(opdef)


def register_backward_rule(op_type: str, rule: Callable[[BackwardContext], Sequence[str | None]], *,
                           replace: bool = False) -> None:
    """Attach a backward rule to a registered op; see :class:`BackwardContext`."""
    op_registry().set_backward(op_type, rule, replace=replace)


__all__ = [
    "FUSED_LOGITS_TILE",
    "ROPE_TYPES",
    "AttrSpec",
    "BackwardContext",
    "Cost",
    "InferContext",
    "OpDef",
    "OpRegistry",
    "Sample",
    "check_rotary_dim",
    "dropout_key",
    "infer_types",
    "loss_targets",
    "no_gradient",
    "numpy_dtype",
    "op_registry",
    "register_backward_rule",
    "register_op",
    "rope_freqs_table",
    "rope_inv_freq",
    "rope_tables",
]
