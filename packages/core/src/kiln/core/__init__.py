"""kiln-core: the IR, op registry, autodiff, planners, NumPy backend and plugin manager of kiln."""

from importlib.metadata import PackageNotFoundError, version

from kiln.core._errors import (
    AutodiffError,
    Diagnostic,
    DimError,
    IRError,
    KilnError,
    KilnWarning,
    OpError,
    PluginError,
)
from kiln.core.autodiff._gradcheck import GradReport, check_op
from kiln.core.backends.numpy._backend import NumpyBackend, counter_offset
from kiln.core.ir._condition import ConditionError
from kiln.core.ir._ir import TensorType
from kiln.core.ops import (
    AttrSpec,
    BackwardContext,
    Cost,
    InferContext,
    OpDef,
    OpRegistry,
    Sample,
    dropout_key,
    no_gradient,
    op_registry,
    register_backward_rule,
    register_op,
)
from kiln.core.plan._optim import HF_TRAINER_GROUPS, SGD, AdamW, Optimizer, ParamGroup
from kiln.core.plan._passes import GraphPass, PassRun
from kiln.core.plan._precision import Precision
from kiln.core.plan._program import PHASES, Fusion, Program, Slot, Step, Tensor, compile
from kiln.core.plan.recompute import RecomputePlan
from kiln.core.plugins._hookspecs import hookimpl
from kiln.core.plugins._registry import NamedRegistry, PluginInfo
from kiln.core.plugins._session import (
    PluginSession,
    failed_plugins,
    get_registry,
    list_plugins,
    plugin_manager,
    plugin_session,
    register_plugin,
    reset_plugins,
)
from kiln.core.runtime._backend import Backend, Buffer, Executable
from kiln.core.runtime._kernels import Kernel, KernelTable
from kiln.core.runtime._model import Model, init_value, segment_ids

try:
    __version__ = version("kiln-core")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"


__all__ = [
    "HF_TRAINER_GROUPS",
    "PHASES",
    "SGD",
    "AdamW",
    "AttrSpec",
    "AutodiffError",
    "Backend",
    "BackwardContext",
    "Buffer",
    "ConditionError",
    "Cost",
    "Diagnostic",
    "DimError",
    "Executable",
    "Fusion",
    "GradReport",
    "GraphPass",
    "IRError",
    "InferContext",
    "Kernel",
    "KernelTable",
    "KilnError",
    "KilnWarning",
    "Model",
    "NamedRegistry",
    "NumpyBackend",
    "OpDef",
    "OpError",
    "OpRegistry",
    "Optimizer",
    "ParamGroup",
    "PassRun",
    "PluginError",
    "PluginInfo",
    "PluginSession",
    "Precision",
    "Program",
    "RecomputePlan",
    "Sample",
    "Slot",
    "Step",
    "Tensor",
    "TensorType",
    "__version__",
    "check_op",
    "compile",
    "counter_offset",
    "dropout_key",
    "failed_plugins",
    "get_registry",
    "hookimpl",
    "init_value",
    "list_plugins",
    "no_gradient",
    "op_registry",
    "plugin_manager",
    "plugin_session",
    "register_backward_rule",
    "register_op",
    "register_plugin",
    "reset_plugins",
    "segment_ids",
]
