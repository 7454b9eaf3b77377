"""The plan layer: graph passes by stage, the recompute planners, the scheduler and the memory
planner, which lower a model to a :class:`Program` for one backend; optimizers, emitted into the
Program's optimizer phase."""

from kiln.core.plan._optim import HF_TRAINER_GROUPS, SGD, AdamW, Optimizer, ParamGroup, make_optimizer
from kiln.core.plan._passes import GRAPH_STAGES, PLUGIN_STAGES, GraphPass, PassRun, run_passes
from kiln.core.plan._precision import RECIPES, Precision, precision_recipe, require_ml_dtypes, rounded_reads
from kiln.core.plan._program import (
    PHASES,
    Fusion,
    ParamInfo,
    Program,
    Slot,
    Step,
    Target,
    Tensor,
    compile,
    head_pair,
    measure,
)
from kiln.core.plan.recompute import RecomputePlan

__all__ = [
    "GRAPH_STAGES",
    "HF_TRAINER_GROUPS",
    "PHASES",
    "PLUGIN_STAGES",
    "RECIPES",
    "SGD",
    "AdamW",
    "Fusion",
    "GraphPass",
    "Optimizer",
    "ParamGroup",
    "ParamInfo",
    "PassRun",
    "Precision",
    "Program",
    "RecomputePlan",
    "Slot",
    "Step",
    "Target",
    "Tensor",
    "compile",
    "head_pair",
    "make_optimizer",
    "measure",
    "precision_recipe",
    "require_ml_dtypes",
    "rounded_reads",
    "run_passes",
]
