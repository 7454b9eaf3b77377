"""The runtime layer: the Backend / Buffer / Executable protocols, the kernel table and
:class:`Model`, which trains through any registered backend."""

from kiln.core.runtime._backend import Backend, Buffer, Executable
from kiln.core.runtime._kernels import ANY_DTYPE, Kernel, KernelTable
from kiln.core.runtime._model import Model, init_value

__all__ = ["ANY_DTYPE", "Backend", "Buffer", "Executable", "Kernel", "KernelTable", "Model", "init_value"]
