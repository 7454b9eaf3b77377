"""The runtime layer: the Backend / Buffer / Executable protocols, the kernel table, the Communicator
protocol with the data-parallel plan it runs, and :class:`Model`, which trains through any
registered backend; the run-time annotations (hooks, probes, asserts) a Model acts on."""

from kiln.core.plan._program import SyncPlan
from kiln.core.runtime._backend import Backend, Buffer, Executable, optimizer_step
from kiln.core.runtime._communicator import Communicator, DataParallel
from kiln.core.runtime._hooks import HookHandle, HookInfo, Hooks, ProbeRecord, Probes, check_expression
from kiln.core.runtime._kernels import ANY_DTYPE, Kernel, KernelTable
from kiln.core.runtime._model import IGNORE_INDEX, Model, init_value, segment_ids

__all__ = ["ANY_DTYPE", "IGNORE_INDEX", "Backend", "Buffer", "Communicator", "DataParallel", "Executable",
           "HookHandle", "HookInfo", "Hooks", "Kernel", "KernelTable", "Model", "ProbeRecord", "Probes",
           "SyncPlan", "check_expression", "init_value", "optimizer_step", "segment_ids"]
