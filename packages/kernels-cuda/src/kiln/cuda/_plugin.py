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
    from kiln.cuda._ops import BF16_KERNELS, FUSIONS, KERNELS

    skip = set(without)
    for op, (fn, inplace) in KERNELS.items():
        if op not in skip:
            registry.register_kernel(op, "cuda", "float32", fn, out=op not in UPDATE_OPS, inplace=inplace)
            # the bf16 recipe: the same kernel on float32 copies of bf16 tensors (the backend rounds
            # where the recipe says), or a kernel of its own that reads and writes bf16 (the ops whose
            # rounding points lie inside them, and attention on tensor cores)
            registry.register_kernel(op, "cuda", "bfloat16", BF16_KERNELS.get(op, fn),
                                     out=op not in UPDATE_OPS, inplace=() if op in BF16_KERNELS else inplace)
    # the fusions the backend plans (CudaBackend.capabilities), unless an op they fuse is left out
    for name, (fn, fn_bf16, fused) in FUSIONS.items():
        if name not in skip and not skip.intersection(fused):
            registry.register_kernel(name, "cuda", "float32", fn, out=True)
            registry.register_kernel(name, "cuda", "bfloat16", fn_bf16, out=True)


@hookimpl
def kiln_register_kernels(registry: Any) -> None:
    register_kernels(registry)


@hookimpl
def kiln_step_time(program: Any, device: str) -> Any:
    """``kiln plan --device h100``: the roofline of the Program on a GPU kiln knows (None for another
    device), its matmuls on tensor cores in bf16 under the bf16 precision recipe, else in float32 on
    CUDA cores, as kiln's kernels run them."""
    from kiln.cuda._roofline import DEVICES, roofline

    if device not in DEVICES:
        return None
    lowers = bool(getattr(getattr(program, "precision", None), "lowers", False))
    return roofline(program, device, "bf16" if lowers else "fp32")


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
