"""Ahead-of-time autodiff: derive a backward graph from a forward graph (public API)."""

from kiln.core._autodiff import (
    NONDIFF_PATTERNS,
    BackwardResult,
    DeriveBackwardOptions,
    check_backward,
    derive_backward,
    has_rule,
    registered_ops,
    verify_backward,
)
from kiln.core._ops import BackwardContext, no_gradient


def register_rule(op_type: str, rule, *, replace: bool = False) -> None:  # type: ignore[no-untyped-def]
    """Attach the backward rule ``rule(ctx) -> [grad name or None per input]`` to a registered op."""
    from kiln.core._oplib import op_registry

    op_registry().set_backward(op_type, rule, replace=replace)


__all__ = [
    "NONDIFF_PATTERNS",
    "BackwardContext",
    "BackwardResult",
    "DeriveBackwardOptions",
    "check_backward",
    "derive_backward",
    "has_rule",
    "no_gradient",
    "register_rule",
    "registered_ops",
    "verify_backward",
]
