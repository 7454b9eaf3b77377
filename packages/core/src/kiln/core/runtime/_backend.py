"""The protocols a backend implements: Backend, Buffer and Executable.

``compile`` plans a Program *for* a backend (its kernels decide how each step writes its outputs,
its capabilities which fusions are planned); the backend then runs the Program as planned and never
re-plans it. :class:`kiln.core.Model` talks to a backend only through these protocols, so a plugin's
backend (registered through ``kiln_register_backends``) trains a model the same way ``numpy`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from kiln.core.plan._program import Program

__all__ = ["PHASES", "Backend", "Buffer", "Executable", "optimizer_step"]

#: the phases of a training Program, in the order a step runs them; ``grad_sync`` is empty on one
#: process (kiln-dist fills it with collectives)
PHASES = ("forward", "backward", "grad_sync", "optimizer")


def optimizer_step(op_type: str, kernel: Callable[..., Any], arrays: Sequence[Any],
                   hyper: MutableMapping[str, Any], attrs: Mapping[str, Any]) -> Callable[[], None]:
    """What an Executable runs for a step of the ``optimizer`` phase (``Step.how == "optimizer"``):
    ``grad_norm`` sets the run-time scalars in ``hyper`` (``grad_norm``, then ``lr`` from the
    schedule at ``hyper["step"]`` and the clipping ``scale``, from ``hyper["optimizer"]``); any
    other op (an update, a collective) is called with them."""
    if op_type == "grad_norm":
        def norm() -> None:
            opt = hyper["optimizer"]
            hyper["grad_norm"] = float(kernel(*arrays))
            hyper["lr"] = opt.lr_at(hyper["step"])
            hyper["scale"] = opt.clip_scale(hyper["grad_norm"])

        return norm
    return lambda: kernel(*arrays, step=hyper["step"], lr=hyper["lr"], scale=hyper["scale"], **attrs)


@runtime_checkable
class Buffer(Protocol):
    """Device memory a backend allocated: one arena."""

    @property
    def nbytes(self) -> int: ...


@runtime_checkable
class Executable(Protocol):
    """A Program bound to an arena, ready to run many times."""

    program: Program

    def run(self, phases: Iterable[str], *, hyper: Mapping[str, Any]) -> dict[str, float]:
        """Run the steps of ``phases`` in order. ``hyper`` holds what changes between steps (``step``,
        the optimizer, ...); returns the scalars the optimizer phase measured (``grad_norm``, ``lr``)."""
        ...

    def read(self, name: str) -> np.ndarray:
        """A host copy of the Program tensor ``name``."""
        ...

    def write(self, name: str, value: Any) -> None:
        """Copy a host array into the Program tensor ``name`` (cast to its dtype)."""
        ...


@runtime_checkable
class Backend(Protocol):
    """What runs Programs. Attributes:

    - ``name``: the registry name; ``device``: where its buffers live (``"cpu"``, ``"cuda"``);
    - ``dtypes``: the float types it computes in; ``capabilities``: the fusions it implements
      (``"fused_lm_head_loss_and_grad"``), which ``compile`` may plan for it;
    - ``kernel_fallback``: another backend whose kernels it can run (a host backend), or None;
      ``reference``: whether ops without a kernel run their reference semantics (``OpDef.kernel``).

    Optional: ``workspace_bytes(program, kernels) -> Mapping[int, int]``, the bytes of temporaries each
    step's kernel needs (by step index; the NumPy backend declares none). ``compile`` places each as a
    slot ``workspace.<index>`` (kind ``workspace``) of the arena, live during its step alone, so the
    planned peak covers them and the backend allocates nothing beside the arena.

    Optional: ``held_bytes(program, kernels) -> Mapping[str, tuple[int, int, int]]``, the backend's
    buffers kept across steps (``kiln.cuda``: a bf16 copy of each float32 weight its cuBLASLt matmuls
    read, made once per training step): name -> (first step, last step, bytes). ``compile`` places each
    as a slot of that name (kind ``held``) live from its first step to its last; the memory report
    counts them as ``held``.

    Optional, for a backend with several devices (``cuda``): ``on_device(index) -> Backend``, the same
    backend on its device ``index`` (a KilnError naming an index it does not have), which the name
    ``name:index`` (``"cuda:1"``) looks up; and ``device_count``, how many it has.
    """

    name: str
    device: str
    dtypes: tuple[str, ...]
    capabilities: frozenset[str]
    kernel_fallback: str | None
    reference: bool

    def allocate(self, nbytes: int) -> Buffer:
        """A zeroed arena of ``nbytes``."""
        ...

    def copy(self, src: Buffer, dst: Buffer, nbytes: int) -> None:
        """Copy the first ``nbytes`` of ``src`` to ``dst`` (arenas grow this way)."""
        ...

    def read(self, buffer: Buffer, offset: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """A host copy of the array at ``offset``."""
        ...

    def write(self, buffer: Buffer, offset: int, value: np.ndarray) -> None:
        """Copy a host array (already in the right dtype and shape) to ``offset``."""
        ...

    def compile(self, program: Program, buffer: Buffer, kernels: Any) -> Executable:
        """Bind ``program`` to ``buffer`` with kernels from the kernel table ``kernels``."""
        ...
