"""Ahead-of-time autodiff: derive a backward graph, check an explicit one (public API)."""

from kiln.core.autodiff._autodiff import (
    BackwardResult,
    DeriveBackwardOptions,
    derive_backward,
    has_rule,
    registered_ops,
    verify_backward,
)
from kiln.core.autodiff._explicit import explicit_backward
from kiln.core.ir._verify import check_backward, nondiff_tensors
from kiln.core.ops import register_backward_rule
from kiln.core.ops._ops import BackwardContext, no_gradient

# seed 002's name for kiln.core.register_backward_rule (one mechanism, two spellings)
register_rule = register_backward_rule

__all__ = [
    "BackwardContext",
    "BackwardResult",
    "DeriveBackwardOptions",
    "check_backward",
    "derive_backward",
    "explicit_backward",
    "has_rule",
    "no_gradient",
    "nondiff_tensors",
    "register_rule",
    "registered_ops",
    "verify_backward",
]
