"""kiln-core: the IR, op registry, autodiff, planners, NumPy backend and plugin manager of kiln."""

from importlib.metadata import PackageNotFoundError, version

from kiln.core._backend import Backend, Buffer, Executable
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
from kiln.core._gradcheck import GradReport, check_op
from kiln.core._hookspecs import hookimpl
from kiln.core._ir import TensorType
from kiln.core._kernels import Kernel, KernelTable
from kiln.core._model import Model, init_value
from kiln.core._numpy_backend import NumpyBackend, counter_offset
from kiln.core._ops import (
    AttrSpec,
    BackwardContext,
    Cost,
    InferContext,
    OpDef,
    OpRegistry,
    Sample,
    no_gradient,
)
from kiln.core._optim import HF_TRAINER_GROUPS, SGD, AdamW, Optimizer, ParamGroup
from kiln.core._passes import GraphPass, PassRun
from kiln.core._plugins import (
    PluginSession,
    failed_plugins,
    get_registry,
    list_plugins,
    plugin_manager,
    plugin_session,
    register_plugin,
    reset_plugins,
)
from kiln.core._program import PHASES, Fusion, Program, Slot, Step, Tensor, compile
from kiln.core._registry import NamedRegistry, PluginInfo
from kiln.core.recompute import RecomputePlan

try:
    __version__ = version("kiln-core")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"


def op_registry() -> OpRegistry:
    """The process-wide op registry (every plugin's ``kiln_register_ops`` plus run-time ops)."""
    from kiln.core._oplib import op_registry as _op_registry

    return _op_registry()


def register_op(opdef: OpDef) -> OpDef:
    """Register an op at run time (schema, shape rule, kernel and backward rule in one ``OpDef``)."""
    return op_registry().register_op(opdef)


def register_backward_rule(op_type: str, rule, *, replace: bool = False) -> None:  # type: ignore[no-untyped-def]
    """Attach a backward rule to a registered op; see :class:`BackwardContext`."""
    op_registry().set_backward(op_type, rule, replace=replace)


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
]
