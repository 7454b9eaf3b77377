"""Data parallelism and ZeRO-1: the collectives one rank adds to its training Programs.

Every rank runs the same Programs on its own shard of each global batch (``Model.train_step``
shards it), each shard's loss divided by the global batch's token count; so the *sum* of the ranks'
gradients is the gradient of the global batch's mean loss, which is what the ``grad_sync`` phase
computes. Gradients travel in buckets of about ``bucket_bytes`` (as float32), last parameters
first, the order the backward produces them.

``zero=1`` (ZeRO-1) gives each trained parameter one owning rank (bucket by bucket, largest first,
to the rank owning the fewest elements so far): the owner alone keeps its optimizer state and runs
its update. ``grad_sync`` reduce-scatters each bucket's gradients to their owners (with ``overlap``,
started in the backward and waited for there) and takes the global gradient norm over every rank's
share; after the updates, each bucket's parameters are all-gathered from their owners.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from kiln.core import KilnError, get_registry
from kiln.core.ir import Op
from kiln.core.runtime import Communicator, SyncPlan

__all__ = ["NORM", "DataParallel"]

#: the Program tensor ZeRO-1's global gradient norm is written to
NORM = "grad_sync.norm"
#: the Program tensor an overlapped bucket is packed into while its collective is in flight (the
#: last input of its ``*_start`` and ``*_wait`` ops, which have ``buffer=1``): planned in the arena
BUFFER = "grad_sync.bucket{}"
#: what each communicator needs, for the error when it is not registered
NEEDS = {"mpi": "mpi4py and an MPI library (both dependencies of kiln-dist)",
         "nccl": "nccl4py (pip install 'kiln-dist[nccl]') on a machine with GPUs"}

Trained = Sequence[tuple[str, tuple[int, ...]]]


def _positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise KilnError(f"DataParallel({attribute.name}={value!r}): expected a positive int")


def _stage(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value not in (0, 1):
        raise KilnError(f"DataParallel(zero={value!r}): kiln-dist implements plain data parallelism "
                        "(zero=0) and ZeRO stage 1 (zero=1)")


@attrs.frozen
class DataParallel:
    """Train a :class:`~kiln.core.Model` as one rank of a data-parallel run:
    ``Model.from_ir(bundle, data_parallel=DataParallel("mpi"))`` on every rank, each rank calling
    ``train_step`` with the same global batch. ``comm``: the communicator's name in the
    ``communicators`` registry (``mpi``, ``nccl``, ``local``); ``zero``: 0, or 1 for ZeRO-1;
    ``bucket_bytes``: the gradient bytes (as float32) one collective carries at most, unless one
    tensor alone is larger; ``overlap``: start each bucket's all-reduce (ZeRO-1: reduce-scatter) in
    the backward, as soon as its gradients are final (non-blocking), and wait for it in
    ``grad_sync``."""

    comm: str = "mpi"
    zero: int = attrs.field(default=0, validator=_stage)
    bucket_bytes: int = attrs.field(default=25 * 2**20, validator=_positive)
    overlap: bool = False

    @property
    def communicator(self) -> Communicator:
        """The communicator named ``comm``, from the current plugin session's registry."""
        registry = get_registry("communicators")
        if self.comm not in registry:
            need = f": it needs {NEEDS[self.comm]}" if self.comm in NEEDS else ""
            raise KilnError(f"no communicator {self.comm!r} is registered{need}; registered: "
                            f"{', '.join(sorted(registry)) or 'none'}")
        comm: Communicator = registry[self.comm]
        return comm

    def rank_device(self, backend: object) -> int | None:
        """The GPU this rank trains on where ``backend`` has several (``Model(backend="cuda")``): its
        node-local rank's, so each rank of a node takes its own."""
        from kiln.dist._communicators import rank_device

        return rank_device(self.communicator, backend)

    def buckets(self, trained: Trained) -> list[list[tuple[str, tuple[int, ...]]]]:
        """The trained parameters, last first, cut into buckets of at most ``bucket_bytes``."""
        out: list[list[tuple[str, tuple[int, ...]]]] = []
        size = 0
        for key, shape in reversed(trained):
            n = 4 * math.prod(shape)
            if not out or size + n > self.bucket_bytes:
                out.append([])
                size = 0
            out[-1].append((key, shape))
            size += n
        return out

    def plan(self, trained: Trained) -> SyncPlan:
        """This rank's :class:`~kiln.core.runtime.SyncPlan` for the trained parameters (key, shape)."""
        comm = self.communicator
        world, rank = comm.world_size, comm.rank
        if world == 1:
            return SyncPlan()
        buckets = self.buckets(trained)
        on = {"communicator": self.comm}
        if self.overlap and not self.zero:  # each bucket in flight in its buffer (BUFFER), start to wait
            ops = [([*(k for k, _ in b), BUFFER.format(i)], {**on, "bucket": i, "buffer": 1})
                   for i, b in enumerate(buckets)]
            return SyncPlan(in_backward=[Op("bucket_all_reduce_start", keys, [], a) for keys, a in ops],
                            grad_sync=[Op("bucket_all_reduce_wait", keys, [], a) for keys, a in ops],
                            buffers=[(BUFFER.format(i), sum(math.prod(s) for _, s in b))
                                     for i, b in enumerate(buckets)])
        if not self.zero:
            return SyncPlan(grad_sync=[Op("bucket_all_reduce", [k for k, _ in b], [], on) for b in buckets])
        owned: list[str] = []
        shares = []
        chunks = []  # each bucket's chunk: the largest of the ranks' parts
        load = [0] * world
        for b in buckets:
            sizes = [math.prod(s) for _, s in b]
            owners = _balance(sizes, load)
            owned += [k for (k, _), r in zip(b, owners, strict=True) if r == rank]
            shares.append(([k for k, _ in b], {**on, "owners": tuple(owners)}))
            part = [0] * world
            for n, r in zip(sizes, owners, strict=True):
                part[r] += n
            chunks.append(max(part))
        buffers: list[tuple[str, int]] = []
        if self.overlap:  # each reduce-scatter started in the backward, waited for in grad_sync; in flight
            # in its buffer: the send chunks of every rank, then this rank's receive chunk
            ops = [([*keys, BUFFER.format(i)], {**a, "bucket": i, "buffer": 1})
                   for i, (keys, a) in enumerate(shares)]
            buffers = [(BUFFER.format(i), (world + 1) * c) for i, c in enumerate(chunks)]
            in_backward = [Op("bucket_reduce_scatter_start", keys, [], a) for keys, a in ops]
            scatter = [Op("bucket_reduce_scatter_wait", keys, [], a) for keys, a in ops]
        else:
            in_backward, scatter = [], [Op("bucket_reduce_scatter", keys, [], a) for keys, a in shares]
        return SyncPlan(grad_sync=[*scatter, Op("sharded_grad_norm", [NORM, *owned], [], on)],
                        in_backward=in_backward, owned=frozenset(owned), norm=(NORM,), outputs=(NORM,),
                        after_update=[Op("bucket_all_gather", keys, [], a) for keys, a in shares],
                        buffers=buffers)


def _balance(sizes: Sequence[int], load: list[int]) -> list[int]:
    """An owning rank per tensor: largest first, each to the rank holding the fewest elements so far
    (``load``, updated; the lowest such rank), so every rank computes the same."""
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(len(load)), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner
