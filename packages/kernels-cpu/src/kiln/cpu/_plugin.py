"""The ``kiln`` entry point of kiln-kernels-cpu. Importing it is cheap: the kernels are built (once per
machine, then loaded from the cache) when the kernel table is first filled."""

from __future__ import annotations

import os
import warnings
from types import ModuleType
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from kiln.core import KernelTable

hookimpl = pluggy.HookimplMarker("kiln")

#: "0" turns the native kernels off: the NumPy backend runs its NumPy kernels
ENV = "KILN_CPU_KERNELS"

_loaded: dict[str, tuple[ModuleType | None, str | None]] = {}


def enabled() -> bool:
    """Whether ``KILN_CPU_KERNELS`` lets the native kernels register (anything but ``0``)."""
    return os.environ.get(ENV, "1").strip() != "0"


def load() -> tuple[ModuleType | None, str | None]:
    """(the compiled module, None), or (None, why it could not be built); tried once per process and
    cache folder."""
    from kiln.cpu._build import build, cache_dir

    key = str(cache_dir())
    if key not in _loaded:
        try:
            _loaded[key] = (build(), None)
        except Exception as e:  # a KilnError from the build, or a module that does not load
            _loaded[key] = (None, str(e))
            from kiln.core import KilnWarning

            warnings.warn(f"kiln-kernels-cpu: {e}. The NumPy backend runs its NumPy kernels instead",
                          KilnWarning, stacklevel=2)
    return _loaded[key]


def available() -> bool:
    """Whether the native kernels are enabled and built (building them if needed)."""
    return enabled() and load()[0] is not None


def unavailable_reason() -> str | None:
    """Why the native kernels do not run here, or None when they do."""
    if not enabled():
        return f"{ENV}=0"
    return load()[1]


@hookimpl
def kiln_register_kernels(registry: KernelTable) -> None:
    """The native kernels for backend ``numpy`` and ``float32``: they take precedence over the NumPy
    kernels (registered for every dtype, ``"*"``), which stay for float64 and as their fallback."""
    if not enabled():
        return
    module, _ = load()
    if module is None:
        return
    from kiln.cpu._kernels import OPS, kernels

    found = {op: registry.find(op, "numpy", "*") for op in OPS}
    core = {op: k for op, k in found.items() if k is not None}
    native = kernels(module.lib, module.ffi, {op: k.fn for op, k in core.items()})
    for op, kernel in core.items():
        registry.register_kernel(op, "numpy", "float32", native[op], out=kernel.out, inplace=kernel.inplace)
