"""kiln-kernels-cuda: the CUDA backend, NVRTC-compiled kernels loaded and launched through cuda-python."""

from importlib.metadata import version

__version__ = version("kiln-kernels-cuda")

__all__ = ["__version__"]
