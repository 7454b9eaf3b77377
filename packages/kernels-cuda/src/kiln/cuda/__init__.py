"""kiln-kernels-cuda: the CUDA backend, NVRTC-compiled kernels loaded and launched through cuda-python."""

from importlib.metadata import version

from kiln.cuda._backend import CudaBackend
from kiln.cuda._emulate import EmulatedCuda, EmulatedDevice
from kiln.cuda._nvrtc import compile_cubin
from kiln.cuda._plugin import cuda_available, unavailable_reason

__version__ = version("kiln-kernels-cuda")

__all__ = ["CudaBackend", "EmulatedCuda", "EmulatedDevice", "__version__", "compile_cubin", "cuda_available",
           "unavailable_reason"]
