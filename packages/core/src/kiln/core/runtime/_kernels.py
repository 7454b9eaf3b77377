"""The kernel table: ``(op, backend, dtype) -> kernel``.

An op has one meaning, its reference semantics (``OpDef.kernel``), and any number of kernels: one
per backend and float type that implements it. Plugins fill the table through the
``kiln_register_kernels`` hook; ``compile`` looks every scheduled op up for the backend it plans for,
so a backend that lacks a kernel fails at compile time, naming the op and the backend.

Two calling conventions: ``out=True`` kernels write into preallocated outputs
(``kernel(*inputs, out=(arrays...), **attrs)``) and may declare ``inplace`` inputs whose storage the
first output can take over; the others return their results (``kernel(*inputs, **attrs)``), which
the backend copies into the planned slots.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from kiln.core._errors import KilnError
from kiln.core.plugins._registry import NamedRegistry, declare_kind

__all__ = ["ANY_DTYPE", "Kernel", "KernelTable", "resolve"]

#: the dtype of a kernel that serves every float type of its backend
ANY_DTYPE = "*"
#: the backend name of an op's reference kernel (``OpDef.kernel``), which is not in the table
REFERENCE = "reference"


def _frozenset(items: Iterable[int]) -> frozenset[int]:
    return frozenset(items)


@attrs.frozen
class Kernel:
    """One implementation of ``op`` for ``backend`` computing in ``dtype`` (``"*"``: any)."""

    op: str
    backend: str
    dtype: str
    fn: Callable[..., Any]
    out: bool = False
    inplace: frozenset[int] = attrs.field(default=frozenset(), converter=_frozenset)

    @property
    def key(self) -> str:
        """Its name in the table (what ``Step.kernel`` records); "" for an op's reference kernel."""
        return "" if self.backend == REFERENCE else key(self.op, self.backend, self.dtype)


def key(op: str, backend: str, dtype: str) -> str:
    return f"{op}@{backend}:{dtype}"


class KernelTable(NamedRegistry[Kernel]):
    """Kernels by ``(op, backend, dtype)``; a second kernel for one key names both plugins."""

    def __init__(self, kind: str = "kernels", *, providers: Mapping[str, str] | None = None) -> None:
        super().__init__(kind, providers=providers)

    def register_kernel(self, op: str, backend: str, dtype: str, fn: Callable[..., Any], *, out: bool = False,
                        inplace: Iterable[int] = (), plugin: str | None = None) -> Kernel:
        """Add ``fn`` as the kernel of ``op`` on ``backend`` for ``dtype`` (``"*"``: every float type)."""
        if not callable(fn):
            raise KilnError(f"the kernel of {op!r} for backend {backend!r} must be callable, "
                            f"found {type(fn).__name__}")
        kernel = Kernel(op, backend, dtype, fn, out, inplace)
        self.register(key(op, backend, dtype), kernel, plugin=plugin)
        return kernel

    def lookup(self, op: str, backend: Any, dtype: str) -> Kernel | None:
        """The kernel of ``op`` the backend object runs: its own, else its ``kernel_fallback``'s."""
        for name in (backend.name, getattr(backend, "kernel_fallback", None)):
            found = self.find(op, name, dtype) if name else None
            if found is not None:
                return found
        return None

    def find(self, op: str, backend: str, dtype: str) -> Kernel | None:
        """The kernel of ``op`` for ``backend`` and ``dtype``, else its any-dtype kernel, else None."""
        for k in (key(op, backend, dtype), key(op, backend, ANY_DTYPE)):
            if k in self:
                found: Kernel = self[k]
                return found
        return None

    def resolve(self, op: Any, backend: Any, dtype: str) -> Kernel:
        """See :func:`resolve`."""
        return resolve(self, op, backend, dtype)

    def ops_of(self, backend: str) -> list[str]:
        """The ops that have a kernel for ``backend``."""
        return sorted({k.op for _, k in self.items() if k.backend == backend})


def resolve(table: KernelTable, op: Any, backend: Any, dtype: str) -> Kernel:
    """The kernel ``backend`` runs for op definition ``op`` in ``dtype``: its own, else its
    ``kernel_fallback`` backend's, else (for a backend that runs references) the op's reference kernel.

    A backend that has none is an error naming the op and the backend.
    """
    found = table.lookup(op.name, backend, dtype)
    if found is not None:
        return found
    if getattr(backend, "reference", False):
        return Kernel(op.name, REFERENCE, ANY_DTYPE, op.kernel)
    have = ", ".join(table.ops_of(backend.name)[:8]) or "none"
    raise KilnError(f"backend {backend.name!r} has no kernel for op {op.name!r} ({dtype}); it has kernels "
                    f"for {have}", hint="register one through the kiln_register_kernels hook, or compile for "
                                    "another backend")


declare_kind("kernels", "kiln_register_kernels", KernelTable)
