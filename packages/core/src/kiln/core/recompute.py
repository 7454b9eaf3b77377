"""The recompute planner's public API (its home is :mod:`kiln.core.plan.recompute`)."""

from kiln.core.plan.recompute import *  # noqa: F403
from kiln.core.plan.recompute import __all__ as __all__
