"""The Communicator protocol: collectives across the ranks of a distributed run, and the
data-parallel plan a :class:`~kiln.core.Model` takes.

Communicators are contributed through ``kiln_register_communicators`` (kiln-dist registers
``local``, ``mpi`` and ``nccl``). A collective works in place on the backend's buffers (NumPy
arrays for the ``numpy`` backend, device arrays for a GPU backend); every communicator also takes
host NumPy arrays, which is how a Model sums a step's loss over the ranks. Every rank calls the
same collectives in the same order, with buffers of the same size and dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kiln.core.plan._program import SyncPlan

__all__ = ["Communicator", "DataParallel"]


@runtime_checkable
class Communicator(Protocol):
    """The ranks of one run: ``rank`` in ``range(world_size)``; ``name`` is its registry name."""

    name: str

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce(self, buf: Any) -> None:
        """Replace ``buf`` on every rank by the elementwise sum of every rank's ``buf``."""
        ...

    def reduce_scatter(self, send: Any, recv: Any) -> None:
        """Sum ``send`` (``world_size`` equal chunks) over the ranks; rank ``r`` receives chunk ``r``
        of the sum in ``recv``."""
        ...

    def all_gather(self, send: Any, recv: Any) -> None:
        """``recv`` (``world_size`` equal chunks) receives every rank's ``send``, in rank order."""
        ...

    def broadcast(self, buf: Any, root: int = 0) -> None:
        """Copy ``buf`` of rank ``root`` into ``buf`` of every other rank."""
        ...

    def barrier(self) -> None:
        """Return once every rank has called it."""
        ...


@runtime_checkable
class DataParallel(Protocol):
    """What a Model trained by data parallelism needs (kiln-dist's ``DataParallel`` is one): the
    communicator of its ranks, and this rank's :class:`~kiln.core.runtime.SyncPlan` for the trained
    parameters (key and shape, in the model's order), the same for every Program of the model.

    A ``plan`` that also takes a keyword ``module_ir`` receives the :class:`~kiln.core.ir.Bundle` the
    model trains, after its graph passes (a tensor-parallel plan reads there which parameters its pass
    sliced); a ``plan(trained)`` is called as it is.

    Optional: ``rank_device(backend) -> int | None``, the device of ``backend`` this rank trains on
    (kiln-dist: its node-local GPU), which a Model takes when its backend has devices to choose from
    (``on_device``) and was named without an index; None keeps the backend's default."""

    @property
    def communicator(self) -> Communicator: ...

    def plan(self, trained: Sequence[tuple[str, tuple[int, ...]]]) -> SyncPlan: ...
