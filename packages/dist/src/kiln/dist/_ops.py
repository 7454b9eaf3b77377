"""The collective ops of a data-parallel Program: steps of its ``grad_sync`` and ``optimizer``
phases that update their inputs in place, so that ``kiln plan`` shows every collective.

With ``overlap`` (``DataParallel(overlap=True)``), ``bucket_all_reduce_start`` runs in the backward
as soon as a bucket's gradients are final and starts a non-blocking all-reduce; the matching
``bucket_all_reduce_wait`` in ``grad_sync`` waits for it: the same sum, taken while the rest of the
backward runs. Under ZeRO-1, ``bucket_reduce_scatter_start``/``_wait`` do the same for the
reduce-scatter.

A bucket op packs its tensors into one flat buffer, runs one collective on it and unpacks the
result: one collective per bucket, whatever the number of tensors in it. ``owners`` gives each
tensor's owning rank (ZeRO-1); the ranks' parts of a bucket are padded to equal chunks. The
attribute ``communicator`` names the communicator in the ``communicators`` registry. The kernels
take host (NumPy) arrays; they also receive the optimizer phase's run-time scalars, and ignore them.
An overlapped op with ``buffer=1`` has one more input, last: the flat buffer (a Program tensor, planned
in the arena) its bucket is packed into while the collective is in flight, the same for its start and
its wait.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from kiln.core import AttrSpec, InferContext, KilnError, OpDef, get_registry, no_gradient
from kiln.core.runtime import Communicator
from kiln.dist._communicators import Done

__all__ = ["OPS"]


def _communicator(name: str) -> Communicator:
    comm: Communicator = get_registry("communicators")[name]
    return comm


def _pack(arrays: Sequence[np.ndarray], out: np.ndarray) -> None:
    at = 0
    for a in arrays:
        out[at:at + a.size] = a.reshape(-1)
        at += a.size


def _unpack(flat: np.ndarray, arrays: Sequence[np.ndarray]) -> None:
    at = 0
    for a in arrays:
        np.copyto(a, flat[at:at + a.size].reshape(a.shape))
        at += a.size


def _parts(arrays: Sequence[np.ndarray], owners: Sequence[int],
           world: int) -> tuple[list[list[np.ndarray]], int]:
    """Each rank's tensors, and the chunk every rank's part is padded to."""
    parts: list[list[np.ndarray]] = [[] for _ in range(world)]
    for a, owner in zip(arrays, owners, strict=True):
        parts[owner].append(a)
    return parts, max(sum(a.size for a in p) for p in parts)


def bucket_all_reduce(*grads: np.ndarray, communicator: str, **_scalars: Any) -> None:
    """Sum every tensor over the ranks, in place (one all-reduce)."""
    flat = np.empty(sum(g.size for g in grads), grads[0].dtype)
    _pack(grads, flat)
    _communicator(communicator).all_reduce(flat)
    _unpack(flat, grads)


#: the collectives a ``*_start`` op started and its ``*_wait`` has not waited for: the all-reduces by
#: (communicator, bucket), the handle, the buffer being summed and what it was when sent; the
#: reduce-scatters by ("reduce_scatter", communicator, bucket), the handle, the receive buffer and
#: the send buffer
PENDING: dict[tuple[Any, ...], tuple[Any, np.ndarray, np.ndarray]] = {}


def _started(key: tuple[Any, ...], op: str) -> tuple[Any, np.ndarray, np.ndarray]:
    """The collective in flight under ``key``, taken off :data:`PENDING`; an error naming the bucket
    where its ``_start`` never ran."""
    if key not in PENDING:
        raise KilnError(f"{op}_wait of bucket {key[-1]} over {key[-2]!r}: no {op}_start of that bucket "
                        "is in flight (the start runs in the backward, before the wait)")
    return PENDING.pop(key)


def _buffered(arrays: Sequence[Any], buffer: int) -> tuple[Sequence[Any], Any]:
    """The bucket's tensors and its planned flat buffer (the last input where ``buffer``), else None."""
    return (arrays[:-1], arrays[-1]) if buffer else (arrays, None)


def _flat(into: np.ndarray | None, size: int, dtype: Any) -> np.ndarray:
    """``size`` elements at the start of the planned buffer ``into``, else new ones."""
    return np.empty(size, dtype) if into is None else into.reshape(-1)[:size]


def bucket_all_reduce_start(*tensors: np.ndarray, communicator: str, bucket: int, buffer: int = 0,
                            **_scalars: Any) -> None:
    """Start the sum over the ranks of a bucket whose gradients are final (in the backward): the
    collective runs while the rest of the backward does. A bucket still in flight from an earlier
    backward (micro-batches) is waited for first, so every rank starts the same collectives."""
    grads, into = _buffered(tensors, buffer)
    key = (communicator, bucket)
    if key in PENDING:
        handle, _, _ = PENDING.pop(key)
        handle.wait()
    comm = _communicator(communicator)
    flat = _flat(into, sum(g.size for g in grads), grads[0].dtype)
    _pack(grads, flat)
    sent = flat.copy()
    start = getattr(comm, "all_reduce_start", None)
    if start is None:  # a communicator without non-blocking collectives: sum now
        comm.all_reduce(flat)
        PENDING[key] = (Done(), flat, sent)
        return
    PENDING[key] = (start(flat), flat, sent)


def bucket_all_reduce_wait(*tensors: np.ndarray, communicator: str, bucket: int, buffer: int = 0,
                           **_scalars: Any) -> None:
    """Wait for the bucket's sum and write it into the gradients. When a gradient changed after the
    sum started on any rank (gradients accumulated over micro-batches, or scaled or clipped by a
    parameter group's rule), every rank sums the gradients again, as they are now: one scalar
    all-reduce says whether; the result is then what ``bucket_all_reduce`` gives."""
    grads, _ = _buffered(tensors, buffer)
    comm = _communicator(communicator)
    handle, flat, sent = _started((communicator, bucket), "bucket_all_reduce")
    handle.wait()
    now = np.empty_like(sent)
    _pack(grads, now)
    changed = np.array([0.0 if np.array_equal(now, sent) else 1.0])
    comm.all_reduce(changed)
    if changed[0]:
        comm.all_reduce(now)
        flat = now
    _unpack(flat, grads)


def bucket_reduce_scatter(*grads: np.ndarray, communicator: str, owners: tuple[int, ...],
                          **_scalars: Any) -> None:
    """Sum each tensor over the ranks into its owner's copy (one reduce-scatter); the other ranks'
    copies keep their own values."""
    comm = _communicator(communicator)
    parts, chunk = _parts(grads, owners, comm.world_size)
    send = np.zeros(len(parts) * chunk, grads[0].dtype)
    for r, part in enumerate(parts):
        _pack(part, send[r * chunk:(r + 1) * chunk])
    recv = np.empty(chunk, grads[0].dtype)
    comm.reduce_scatter(send, recv)
    _unpack(recv, parts[comm.rank])


def _rs_buffers(grads: Sequence[np.ndarray], owners: Sequence[int], world: int,
                into: np.ndarray | None = None) -> tuple[list[list[np.ndarray]], int, np.ndarray]:
    """Each rank's tensors, the chunk, and the send buffer of a bucket's reduce-scatter (each rank's
    part packed at its chunk, the padding zero): the start of ``into`` where given."""
    parts, chunk = _parts(grads, owners, world)
    send = _flat(into, len(parts) * chunk, grads[0].dtype)
    send[...] = 0
    for r, part in enumerate(parts):
        _pack(part, send[r * chunk:(r + 1) * chunk])
    return parts, chunk, send


def bucket_reduce_scatter_start(*tensors: np.ndarray, communicator: str, owners: tuple[int, ...], bucket: int,
                                buffer: int = 0, **_scalars: Any) -> None:
    """Start the reduce-scatter of a bucket whose gradients are final (in the backward, ZeRO-1 with
    overlap): the collective runs while the rest of the backward does. A bucket still in flight from
    an earlier backward (micro-batches) is waited for first."""
    grads, into = _buffered(tensors, buffer)
    key = ("reduce_scatter", communicator, bucket)
    if key in PENDING:
        PENDING.pop(key)[0].wait()
    comm = _communicator(communicator)
    _, chunk, send = _rs_buffers(grads, owners, comm.world_size, into)
    recv = np.empty(chunk, grads[0].dtype) if into is None else into.reshape(-1)[send.size:send.size + chunk]
    start = getattr(comm, "reduce_scatter_start", None)
    if start is None:  # a communicator without non-blocking collectives: reduce now
        comm.reduce_scatter(send, recv)
        PENDING[key] = (Done(), recv, send)
        return
    PENDING[key] = (start(send, recv), recv, send)


def bucket_reduce_scatter_wait(*tensors: np.ndarray, communicator: str, owners: tuple[int, ...], bucket: int,
                               buffer: int = 0, **_scalars: Any) -> None:
    """Wait for the bucket's reduce-scatter and write this rank's chunk into the gradients it owns.
    When a gradient changed after the collective started on any rank (micro-batches, a parameter
    group's rule), every rank reduce-scatters the gradients again, as they are now: the result is then
    what ``bucket_reduce_scatter`` gives."""
    grads, _ = _buffered(tensors, buffer)
    comm = _communicator(communicator)
    handle, recv, sent = _started(("reduce_scatter", communicator, bucket), "bucket_reduce_scatter")
    handle.wait()
    parts, _, now = _rs_buffers(grads, owners, comm.world_size)
    changed = np.array([0.0 if np.array_equal(now, sent) else 1.0])
    comm.all_reduce(changed)
    if changed[0]:
        comm.reduce_scatter(now, recv)
    _unpack(recv, parts[comm.rank])


def bucket_all_gather(*params: np.ndarray, communicator: str, owners: tuple[int, ...],
                      **_scalars: Any) -> None:
    """Copy each tensor from its owner to every other rank (one all-gather)."""
    comm = _communicator(communicator)
    parts, chunk = _parts(params, owners, comm.world_size)
    send = np.zeros(chunk, params[0].dtype)
    _pack(parts[comm.rank], send)
    recv = np.empty(len(parts) * chunk, params[0].dtype)
    comm.all_gather(send, recv)
    for r, part in enumerate(parts):
        if r != comm.rank:
            _unpack(recv[r * chunk:(r + 1) * chunk], part)


def sharded_grad_norm(norm: np.ndarray, *grads: np.ndarray, communicator: str, over: str | None = None,
                      **_scalars: Any) -> None:
    """``norm`` = the L2 norm of the gradients of every rank's share (each rank passes its own),
    summed over ``communicator``'s ranks, then over ``over``'s (a grid's other axis) when given."""
    total = np.array([sum(float(np.dot(g.reshape(-1), g.reshape(-1))) for g in grads)])
    _communicator(communicator).all_reduce(total)
    if over is not None:
        _communicator(over).all_reduce(total)
    norm[...] = math.sqrt(total[0])


def _no_outputs(ctx: InferContext) -> list[Any]:
    return []


_COMM = AttrSpec("communicator", "str")
_OWNERS = AttrSpec("owners", "ints")
_BUCKET = AttrSpec("bucket", "int")
_BUFFER = AttrSpec("buffer", "int", 0)
_RS_OVERLAP = (_COMM, _OWNERS, _BUCKET, _BUFFER)


def _op(name: str, inputs: tuple[str, ...], kernel: Any, attrs: tuple[AttrSpec, ...], doc: str) -> OpDef:
    return OpDef(name, inputs, (), kernel, _no_outputs, backward=no_gradient, attrs=attrs, collective=True,
                 doc=doc)


OPS = [
    _op("bucket_all_reduce", ("*tensors",), bucket_all_reduce, (_COMM,),
        "In place: every tensor summed over the ranks (data parallelism's gradients)."),
    _op("bucket_all_reduce_start", ("*tensors",), bucket_all_reduce_start, (_COMM, _BUCKET, _BUFFER),
        "Starts the sum of a bucket of final gradients over the ranks, in the backward (non-blocking)."),
    _op("bucket_all_reduce_wait", ("*tensors",), bucket_all_reduce_wait, (_COMM, _BUCKET, _BUFFER),
        "In place: the bucket's sum started by bucket_all_reduce_start (summed again if a gradient "
        "changed since)."),
    _op("bucket_reduce_scatter", ("*tensors",), bucket_reduce_scatter, (_COMM, _OWNERS),
        "In place: each tensor summed over the ranks into its owner's copy (ZeRO-1's gradients)."),
    _op("bucket_reduce_scatter_start", ("*tensors",), bucket_reduce_scatter_start, _RS_OVERLAP,
        "Starts the reduce-scatter of a bucket of final gradients to their owners, in the backward "
        "(ZeRO-1 with overlap; non-blocking)."),
    _op("bucket_reduce_scatter_wait", ("*tensors",), bucket_reduce_scatter_wait, _RS_OVERLAP,
        "In place: the owner's sums of the reduce-scatter started by bucket_reduce_scatter_start "
        "(reduce-scattered again if a gradient changed since)."),
    _op("bucket_all_gather", ("*tensors",), bucket_all_gather, (_COMM, _OWNERS),
        "In place: each tensor copied from its owner to every rank (ZeRO-1's parameters)."),
    _op("sharded_grad_norm", ("norm", "*grads"), sharded_grad_norm, (_COMM, AttrSpec("over", "str", None)),
        "In place: norm = the global L2 norm of the gradients each rank owns (ZeRO-1's clipping); "
        "'over': a second communicator the squares are also summed over (ZeRO-1 on a grid)."),
]
