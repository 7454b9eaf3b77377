"""The ``kiln`` entry point of kiln-kernels-cuda: its hook implementations.

Every kiln run loads this module, GPU or not, so it must stay cheap: it looks for the CUDA stack
with ``find_spec`` and never imports it. Hooks register the backend only when `cuda_available()`.
"""

import importlib.util
from importlib.machinery import ModuleSpec
from pathlib import Path

import pluggy

hookimpl = pluggy.HookimplMarker("kiln")

# Where NVIDIA's NVRTC wheels put the library: nvidia-cuda-nvrtc (CUDA 13) and -cu12.
_NVRTC_WHEEL_PACKAGES = ("nvidia.cu13", "nvidia.cuda_nvrtc")


def _find(name: str) -> ModuleSpec | None:
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a missing or broken parent package
        return None


def _nvrtc_installed() -> bool:
    for name in _NVRTC_WHEEL_PACKAGES:
        spec = _find(name)
        for folder in (spec and spec.submodule_search_locations) or ():
            if any((Path(folder) / "lib").glob("libnvrtc.so*")):
                return True
    return False


def cuda_available() -> bool:
    """Whether cuda-python's bindings and NVRTC are installed; says nothing about a GPU being present."""
    return _find("cuda") is not None and _find("cuda.bindings") is not None and _nvrtc_installed()
