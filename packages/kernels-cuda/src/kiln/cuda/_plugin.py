"""The ``kiln`` entry point of kiln-kernels-cuda: its hook implementations.

Every kiln run loads this module, GPU or not, so it must stay cheap: it looks for the CUDA stack
with ``find_spec`` and never imports it. The backend ``cuda`` is registered when `cuda_available()`
(cuda-python and NVRTC installed, the driver loads and sees a GPU); without a GPU it is registered as
unavailable, so asking for it is an error that says why. The kernels are registered either way: they
are launch functions that touch a device only when they run.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import Any

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


def unavailable_reason() -> str | None:
    """Why the ``cuda`` backend cannot run here, or None when it can (never hangs: the driver library is
    loaded with ctypes before any driver call)."""
    if not cuda_available():
        return "cuda-python or NVRTC is not installed (pip install cuda-python nvidia-cuda-nvrtc)"
    from kiln.cuda._device import device_status

    ok, why = device_status()
    return None if ok else why


@hookimpl
def kiln_register_backends(registry: Any) -> None:
    from kiln.cuda._backend import CudaBackend, UnavailableBackend

    reason = unavailable_reason()
    registry.register("cuda", CudaBackend() if reason is None else UnavailableBackend(reason))


#: the optimizer phase's ops: called with the run-time scalars, not with ``out=``
UPDATE_OPS = frozenset({"grad_norm", "adamw_update", "sgd_update"})


def register_kernels(registry: Any, without: Iterable[str] = ()) -> None:
    """Put kiln's CUDA kernels (less those of the ops in ``without``) in the kernel table ``registry``."""
    from kiln.cuda._ops import KERNELS

    skip = set(without)
    for op, (fn, inplace) in KERNELS.items():
        if op not in skip:
            registry.register_kernel(op, "cuda", "float32", fn, out=op not in UPDATE_OPS, inplace=inplace)


@hookimpl
def kiln_register_kernels(registry: Any) -> None:
    register_kernels(registry)


def _configure_cuda(p: Any) -> None:
    from kiln.cuda._cli import configure

    p.add_argument("action", choices=["check", "roofline"],
                   help="check: compile every kernel per architecture, verify its argument layout and "
                        "resources, and run every kernel case on the emulator (and the GPU); roofline: "
                        "predict a model's training step time and MFU on a GPU from kiln's op costs")
    configure(p)


def _run_cuda(args: Any) -> int:
    from kiln.cuda._cli import run, run_roofline

    return run_roofline(args) if args.action == "roofline" else run(args)


@hookimpl
def kiln_cli_commands(register: Any) -> None:
    register("cuda", help="kiln-kernels-cuda's checks: `kiln cuda check` compiles and checks every kernel, "
             "with or without a GPU", run=_run_cuda, configure=_configure_cuda)
