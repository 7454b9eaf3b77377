"""The collective ops' kernels on kiln-kernels-cuda's ``cuda`` backend (registered as
``<op>@cuda:*`` where that package is installed).

A Program's tensors there are ``DeviceArray`` views of the device arena (``device``, ``ptr``,
``shape``, ``dtype``). Where the op's communicator takes device buffers (``device_buffers = True``:
the ``nccl`` communicator), a bucket is packed into one flat device buffer by device-to-device
copies, the collective runs on it (a :class:`CudaBuffer`, which exposes the CUDA array interface)
and the result is copied back on the device: no host copy of the gradients or parameters. Such a
communicator's collectives take ``stream=``, the CUDA stream to enqueue on (the device's
``stream_handle``; None where the device has none, as the emulator): the plain bucket ops run on the
backend's own (compute) stream, in order with its kernels, so nothing synchronises the device.

The overlapped ops run on a third stream, the device's communication stream: ``*_start`` packs the
bucket on the compute stream, records an event there that the communication stream waits on, and
enqueues the collective on the communication stream (returning at once: the backward's kernels go on
while it runs), then records a second event; ``*_wait`` makes the compute stream wait on that event
before it unpacks. Whether a gradient changed since the start is known on the host, nothing is read
back: the Program runs the start after the last step that writes the bucket's gradients, so only a
host write can change them (micro-batches' sums, a parameter group's rule: ``Executable.write``,
which counts in the device's ``host_writes``); then the collective runs again, on every rank alike
(they make the same writes). ``sharded_grad_norm`` sums the ranks' squares on the device too: one
scalar collective.

Memory: the plain bucket ops and the norm take their flat buffers and temporaries from the step's
workspace (``kiln.cuda``'s ``Scratch``: the ``workspace.<step>`` slot the backend's dry run sized,
below); an overlapped bucket stays in flight in its planned buffer, the op's last input
(``buffer=1``, a ``buffer`` slot of the arena from ``SyncPlan.buffers``). A training step so
allocates nothing.

Tensor parallelism's ops (``tp_copy``, ``tp_all_reduce``, the vocabulary-parallel ops; float32) run
their collectives on device buffers on the compute stream too, their local parts composed of
``kiln.cuda``'s public launch functions (matmul, embedding, cross-entropy, the fused LM head loss),
temporaries in the step's workspace: nothing goes to the host. The token ids and targets are mapped into
the rank's rows on the device too (``kiln.cuda``'s ``vocab_local_ids``), with no synchronisation: an id
outside the vocabulary is an ``OpError`` naming the op where the backend next synchronises (when it reads
a tensor back: the loss, at the latest).

Any other communicator (``mpi`` takes host NumPy arrays), and a dtype a device collective does not
take, runs the op's NumPy reference on host copies, as the backend does for an op without a kernel.
In the backend's dry run that sizes kernel temporaries (a device named ``sizing``) they take the
memory they take when they run, and run no collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from kiln.core import KilnError
from kiln.dist._ops import (
    _buffered,
    _communicator,
    bucket_all_gather,
    bucket_all_reduce,
    bucket_all_reduce_start,
    bucket_all_reduce_wait,
    bucket_reduce_scatter,
    bucket_reduce_scatter_start,
    bucket_reduce_scatter_wait,
    sharded_grad_norm,
)

__all__ = ["CUDA_KERNELS", "CUDA_TP_KERNELS", "CudaBuffer", "on_device"]

#: the dtypes a device collective takes as they are (others run on host copies)
DEVICE_DTYPES = ("float32", "float64", "float16")


class CudaBuffer:
    """``size`` elements of ``dtype`` at device address ``ptr``, for a communicator's device
    collectives: NumPy-like ``size``/``dtype``/``nbytes`` and ``__cuda_array_interface__`` (v3)."""

    def __init__(self, ptr: int, size: int, dtype: str) -> None:
        self.ptr, self.size, self.dtype = int(ptr), int(size), np.dtype(dtype)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.size,)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.size,), "typestr": self.dtype.str, "data": (self.ptr, False), "version": 3,
                "strides": None}

    def __repr__(self) -> str:
        return f"CudaBuffer(ptr={self.ptr:#x}, size={self.size}, dtype={self.dtype})"


def on_device(comm: Any, arrays: Sequence[Any]) -> bool:
    """Whether the collective runs on device buffers: the communicator takes them and the arrays'
    dtype is one it takes as it is."""
    return bool(getattr(comm, "device_buffers", False)) and all(a.dtype in DEVICE_DTYPES for a in arrays)


def _host(reference: Callable[..., None], arrays: Sequence[Any], attrs: dict[str, Any]) -> None:
    """``reference`` (in place) on host copies of the device ``arrays``, written back."""
    dev = arrays[0].device
    dev.synchronize()
    hosts = [a.download() for a in arrays]
    reference(*hosts, **attrs)
    for a, h in zip(arrays, hosts, strict=True):
        dev.copy_to_device(a.ptr, np.ascontiguousarray(h))


def _same_dtype(op: str, arrays: Sequence[Any]) -> str:
    dtypes = sorted({a.dtype for a in arrays})
    if len(dtypes) != 1:
        raise KilnError(f"{op}: a bucket's tensors must share one dtype, found {', '.join(dtypes)}")
    return dtypes[0]


def _itemsize(dtype: str) -> int:
    return int(np.dtype(dtype).itemsize)


def _pack(dev: Any, arrays: Sequence[Any], ptr: int) -> None:
    for a in arrays:
        dev.copy(ptr, a.ptr, a.nbytes)
        ptr += a.nbytes


def _unpack(dev: Any, ptr: int, arrays: Sequence[Any]) -> None:
    for a in arrays:
        dev.copy(a.ptr, ptr, a.nbytes)
        ptr += a.nbytes


def _dry(arrays: Sequence[Any]) -> bool:
    """Whether this is the backend's dry run (sizing kernel temporaries): no collective may run."""
    return bool(arrays) and getattr(arrays[0].device, "name", "") == "sizing"


def _stream(dev: Any, name: str = "compute") -> Any:
    """The handle of the device's stream ``name`` for a communicator, or None (its default stream)."""
    handle = getattr(dev, "stream_handle", None)
    return None if handle is None else handle(name)


def _comm(name: str, arrays: Sequence[Any]) -> Any:
    """The communicator ``name``; None in a dry run where it is not registered (nothing to size)."""
    if _dry(arrays):
        from kiln.core import get_registry

        if name not in get_registry("communicators"):
            return None
    return _communicator(name)


def _flat(s: Any, size: int, dtype: str) -> CudaBuffer:
    """``size`` elements of the step's workspace (a ``kiln.cuda`` ``Scratch``)."""
    return CudaBuffer(s.array((size,), dtype).ptr, size, dtype)


def cuda_bucket_all_reduce(*grads: Any, communicator: str, **scalars: Any) -> None:
    """:func:`~kiln.dist._ops.bucket_all_reduce` on device arrays, packed in the step's workspace."""
    from kiln.cuda import Scratch

    comm, dry = _comm(communicator, grads), _dry(grads)
    if comm is None or not on_device(comm, grads):
        if not dry:
            _host(bucket_all_reduce, grads, {"communicator": communicator, **scalars})
        return
    dev, dtype = grads[0].device, _same_dtype("bucket_all_reduce", grads)
    with Scratch(dev) as s:
        flat = _flat(s, sum(g.size for g in grads), dtype)
        _pack(dev, grads, flat.ptr)
        if not dry:
            comm.all_reduce(flat, stream=_stream(dev))  # after the copies, on the same stream
        _unpack(dev, flat.ptr, grads)


def _parts(arrays: Sequence[Any], owners: Sequence[int], world: int) -> tuple[list[list[Any]], int]:
    parts: list[list[Any]] = [[] for _ in range(world)]
    for a, owner in zip(arrays, owners, strict=True):
        parts[owner].append(a)
    return parts, max(sum(a.size for a in p) for p in parts)


def _scatter_layout(dev: Any, parts: Sequence[Sequence[Any]], chunk: int, into: CudaBuffer) -> None:
    """Each rank's part packed at its chunk of ``into``, the padding zero."""
    dev.memset(into.ptr, 0, into.nbytes)
    step = chunk * into.dtype.itemsize
    for r, part in enumerate(parts):
        _pack(dev, part, into.ptr + r * step)


def cuda_bucket_reduce_scatter(*grads: Any, communicator: str, owners: tuple[int, ...],
                               **scalars: Any) -> None:
    """:func:`~kiln.dist._ops.bucket_reduce_scatter` on device arrays, packed in the step's workspace."""
    from kiln.cuda import Scratch

    comm, dry = _comm(communicator, grads), _dry(grads)
    if comm is None or not on_device(comm, grads):
        if not dry:
            _host(bucket_reduce_scatter, grads, {"communicator": communicator, "owners": owners, **scalars})
        return
    dev, dtype = grads[0].device, _same_dtype("bucket_reduce_scatter", grads)
    parts, chunk = _parts(grads, owners, comm.world_size)
    with Scratch(dev) as s:
        send, recv = _flat(s, len(parts) * chunk, dtype), _flat(s, chunk, dtype)
        _scatter_layout(dev, parts, chunk, send)
        if not dry:
            comm.reduce_scatter(send, recv, stream=_stream(dev))
        _unpack(dev, recv.ptr, parts[comm.rank])


def cuda_bucket_all_gather(*params: Any, communicator: str, owners: tuple[int, ...], **scalars: Any) -> None:
    """:func:`~kiln.dist._ops.bucket_all_gather` on device arrays, packed in the step's workspace."""
    from kiln.cuda import Scratch

    comm, dry = _comm(communicator, params), _dry(params)
    if comm is None or not on_device(comm, params):
        if not dry:
            _host(bucket_all_gather, params, {"communicator": communicator, "owners": owners, **scalars})
        return
    dev, dtype = params[0].device, _same_dtype("bucket_all_gather", params)
    parts, chunk = _parts(params, owners, comm.world_size)
    step = chunk * _itemsize(dtype)
    with Scratch(dev) as s:
        send, recv = _flat(s, chunk, dtype), _flat(s, len(parts) * chunk, dtype)
        dev.memset(send.ptr, 0, send.nbytes)  # the padding zero, as the reference sends it
        _pack(dev, parts[comm.rank], send.ptr)
        if not dry:
            comm.all_gather(send, recv, stream=_stream(dev))
        for r, part in enumerate(parts):
            if r != comm.rank:
                _unpack(dev, recv.ptr + r * step, part)


# -- overlapped: started in the backward on the communication stream, waited for in grad_sync


def host_writes(dev: Any) -> int:
    """How many times the host has written into ``dev``'s Programs' tensors (``Executable.write``)."""
    return int(getattr(dev, "host_writes", 0))


class _InFlight:
    """A collective started on the communication stream: ``done`` is recorded there after it; ``send``
    is what it reduces (packed from the gradients), ``recv`` where the result lands (``send`` itself
    for an all-reduce), both in the bucket's planned buffer (else in ``owned``, allocated);
    ``writes``: :func:`host_writes` when it started."""

    def __init__(self, dev: Any, send: CudaBuffer, recv: CudaBuffer, owned: Sequence[int], done: Any,
                 events: Sequence[Any]) -> None:
        self.dev, self.send, self.recv, self.owned = dev, send, recv, owned
        self.done, self.events, self.writes = done, events, host_writes(dev)

    def wait(self) -> None:
        """The compute stream waits for the collective."""
        self.dev.wait("compute", self.done)

    def written(self) -> bool:
        """Whether the host wrote into the Program's tensors since the start (its gradients may differ
        from what was sent: micro-batches' sums, a parameter group's rule)."""
        return host_writes(self.dev) != self.writes

    def free(self) -> None:
        if self.owned:
            self.dev.synchronize()  # the collective and the copies are done with the buffers
            for b in self.owned:
                self.dev.free(b)
        destroy = getattr(self.dev, "destroy", None)
        for e in self.events if destroy is not None else ():
            destroy(e)


#: the overlapped collectives started on device buffers and not yet waited for, by (op, communicator,
#: bucket)
IN_FLIGHT: dict[tuple[str, str, int], _InFlight] = {}


def _planned(dev: Any, into: Any, size: int, dtype: str) -> tuple[CudaBuffer, list[int]]:
    """``size`` elements at the start of the planned buffer ``into``; without one (an op called outside
    a Program), an allocation, returned to free."""
    if into is None:
        ptr = dev.alloc(size * _itemsize(dtype))
        return CudaBuffer(ptr, size, dtype), [ptr]
    if into.size < size or into.dtype != dtype:
        raise KilnError(f"the bucket's planned buffer holds {into.size} {into.dtype}; the bucket needs "
                        f"{size} {dtype}")
    return CudaBuffer(into.ptr, size, dtype), []


def _start(dev: Any, send: CudaBuffer, recv: CudaBuffer, owned: list[int],
           collective: Callable[[Any], None]) -> _InFlight:
    """``collective(stream)`` enqueued on the communication stream once the compute stream has packed
    ``send`` (an event)."""
    ready, done = dev.event(), dev.event()
    dev.record(ready, "compute")
    dev.wait("comm", ready)
    collective(_stream(dev, "comm"))
    dev.record(done, "comm")
    return _InFlight(dev, send, recv, owned, done, (ready, done))


def _taken(key: tuple[str, str, int], op: str) -> _InFlight:
    if key not in IN_FLIGHT:
        raise KilnError(f"{op}_wait of bucket {key[-1]} over {key[-2]!r}: no {op}_start of that bucket "
                        "is in flight (the start runs in the backward, before the wait)")
    return IN_FLIGHT.pop(key)


def _finish_earlier(key: tuple[str, str, int]) -> None:
    """A bucket still in flight from an earlier backward (micro-batches): waited for and let go, so
    every rank starts the same collectives (and its buffer is free to pack again)."""
    if key in IN_FLIGHT:
        earlier = IN_FLIGHT.pop(key)
        earlier.wait()
        earlier.free()


def _overlapped(comm: Any, arrays: Sequence[Any]) -> bool:
    """Whether an overlapped collective runs on the device: device buffers, float32; start and wait of
    a bucket decide alike."""
    return on_device(comm, arrays) and all(a.dtype == "float32" for a in arrays)


def cuda_bucket_all_reduce_start(*tensors: Any, communicator: str, bucket: int, buffer: int = 0,
                                 **scalars: Any) -> None:
    """:func:`~kiln.dist._ops.bucket_all_reduce_start` on device arrays: the bucket packed into its
    buffer on the compute stream, its all-reduce enqueued on the communication stream."""
    if _dry(tensors):
        return
    grads, into = _buffered(tensors, buffer)
    comm = _communicator(communicator)
    if not _overlapped(comm, grads):
        _host(bucket_all_reduce_start, tensors,
              {"communicator": communicator, "bucket": bucket, "buffer": buffer, **scalars})
        return
    key = ("all_reduce", communicator, bucket)
    _finish_earlier(key)
    dev, dtype = grads[0].device, _same_dtype("bucket_all_reduce_start", grads)
    flat, owned = _planned(dev, into, sum(g.size for g in grads), dtype)
    _pack(dev, grads, flat.ptr)
    IN_FLIGHT[key] = _start(dev, flat, flat, owned, lambda stream: comm.all_reduce(flat, stream=stream))


def cuda_bucket_all_reduce_wait(*tensors: Any, communicator: str, bucket: int, buffer: int = 0,
                                **scalars: Any) -> None:
    """:func:`~kiln.dist._ops.bucket_all_reduce_wait` on device arrays: the compute stream waits for
    the sum, which it unpacks (summed again, on the compute stream, if the host wrote since)."""
    if _dry(tensors):
        return
    grads, _ = _buffered(tensors, buffer)
    comm = _communicator(communicator)
    if not _overlapped(comm, grads):
        _host(bucket_all_reduce_wait, tensors,
              {"communicator": communicator, "bucket": bucket, "buffer": buffer, **scalars})
        return
    flight = _taken(("all_reduce", communicator, bucket), "bucket_all_reduce")
    dev = flight.dev
    flight.wait()
    try:
        if flight.written():  # the gradients as they are now, summed in the same buffer
            _pack(dev, grads, flight.send.ptr)
            comm.all_reduce(flight.send, stream=_stream(dev))
        _unpack(dev, flight.recv.ptr, grads)
    finally:
        flight.free()


def cuda_bucket_reduce_scatter_start(*tensors: Any, communicator: str, owners: tuple[int, ...], bucket: int,
                                     buffer: int = 0, **scalars: Any) -> None:
    """:func:`~kiln.dist._ops.bucket_reduce_scatter_start` on device arrays: each rank's part packed
    at its chunk of the buffer on the compute stream (this rank's receive chunk after them), the
    reduce-scatter enqueued on the communication stream."""
    if _dry(tensors):
        return
    grads, into = _buffered(tensors, buffer)
    comm = _communicator(communicator)
    attrs = {"communicator": communicator, "owners": owners, "bucket": bucket, "buffer": buffer, **scalars}
    if not _overlapped(comm, grads):
        _host(bucket_reduce_scatter_start, tensors, attrs)
        return
    key = ("reduce_scatter", communicator, bucket)
    _finish_earlier(key)
    dev, dtype = grads[0].device, _same_dtype("bucket_reduce_scatter_start", grads)
    parts, chunk = _parts(grads, owners, comm.world_size)
    whole, owned = _planned(dev, into, (len(parts) + 1) * chunk, dtype)
    send = CudaBuffer(whole.ptr, len(parts) * chunk, dtype)
    recv = CudaBuffer(whole.ptr + send.nbytes, chunk, dtype)
    _scatter_layout(dev, parts, chunk, send)
    IN_FLIGHT[key] = _start(dev, send, recv, owned,
                            lambda stream: comm.reduce_scatter(send, recv, stream=stream))


def cuda_bucket_reduce_scatter_wait(*tensors: Any, communicator: str, owners: tuple[int, ...], bucket: int,
                                    buffer: int = 0, **scalars: Any) -> None:
    """:func:`~kiln.dist._ops.bucket_reduce_scatter_wait` on device arrays: the compute stream waits
    for the reduce-scatter and unpacks this rank's chunk into the gradients it owns (reduce-scattered
    again, on the compute stream, if the host wrote since)."""
    if _dry(tensors):
        return
    grads, _ = _buffered(tensors, buffer)
    comm = _communicator(communicator)
    attrs = {"communicator": communicator, "owners": owners, "bucket": bucket, "buffer": buffer, **scalars}
    if not _overlapped(comm, grads):
        _host(bucket_reduce_scatter_wait, tensors, attrs)
        return
    flight = _taken(("reduce_scatter", communicator, bucket), "bucket_reduce_scatter")
    dev = flight.dev
    flight.wait()
    parts, chunk = _parts(grads, owners, comm.world_size)
    try:
        if flight.written():  # the gradients as they are now, reduce-scattered in the same buffer
            _scatter_layout(dev, parts, chunk, flight.send)
            comm.reduce_scatter(flight.send, flight.recv, stream=_stream(dev))
        _unpack(dev, flight.recv.ptr, parts[comm.rank])
    finally:
        flight.free()


def cuda_sharded_grad_norm(norm: Any, *grads: Any, communicator: str, over: str | None = None,
                           **scalars: Any) -> None:
    """:func:`~kiln.dist._ops.sharded_grad_norm` on the device: this rank's sum of squares by
    ``kiln.cuda``'s norm kernels (their temporaries in the step's workspace), summed over the ranks (and
    over ``over``'s) by a one-number device collective on the compute stream, its square root written to
    ``norm``; nothing read back."""
    from kiln.cuda import THREADS, Scratch, norm_into

    arrays = [norm, *grads]
    dry = _dry(arrays)
    comms = [_comm(communicator, arrays), *([_comm(over, arrays)] if over is not None else [])]
    if any(c is None for c in comms) or not all(_overlapped(c, arrays) for c in comms):
        if not dry:
            _host(sharded_grad_norm, arrays, {"communicator": communicator, "over": over, **scalars})
        return
    dev = norm.device
    with Scratch(dev) as t:
        mine = t.array((2,))  # this rank's norm, then its square: what the ranks sum
        if grads:
            norm_into(t, grads, mine.ptr)
            dev.launch("sumsq_partial_f32", (1,), (THREADS,), (mine.ptr, 1, mine.ptr + 4))
        total = CudaBuffer(mine.ptr + 4, 1, "float32")
        for c in comms if not dry else ():
            c.all_reduce(total, stream=_stream(dev))
        dev.launch("sqrt_sum_f32", (1,), (THREADS,), (total.ptr, 1, norm.ptr))


#: (op, kernel) registered for the ``cuda`` backend, any dtype
CUDA_KERNELS = (("bucket_all_reduce", cuda_bucket_all_reduce),
                ("bucket_reduce_scatter", cuda_bucket_reduce_scatter),
                ("bucket_all_gather", cuda_bucket_all_gather),
                ("bucket_all_reduce_start", cuda_bucket_all_reduce_start),
                ("bucket_all_reduce_wait", cuda_bucket_all_reduce_wait),
                ("bucket_reduce_scatter_start", cuda_bucket_reduce_scatter_start),
                ("bucket_reduce_scatter_wait", cuda_bucket_reduce_scatter_wait),
                ("sharded_grad_norm", cuda_sharded_grad_norm))


# -- tensor parallelism: tp_copy / tp_all_reduce and the vocabulary-parallel ops


def _ew(dev: Any, kernel: str, n: int, args: tuple[Any, ...]) -> None:
    """An elementwise (grid-stride) kernel of ``kiln.cuda`` over ``n`` elements."""
    from kiln.cuda import THREADS

    if n:
        dev.launch(kernel, (max(1, min(-(-n // THREADS), 4096)),), (THREADS,), args)


def _tp_comm(communicator: str, arrays: Sequence[Any]) -> Any:
    """The communicator of a tensor-parallel op when its collective runs on device buffers (float32
    tensors, a communicator that takes them), else None: the host path (which a dry run skips, as it
    does where the communicator is not registered)."""
    from kiln.core import get_registry

    if _dry(arrays) and communicator not in get_registry("communicators"):
        return None
    comm = _communicator(communicator)
    if not getattr(comm, "device_buffers", False) or any(a.dtype != "float32" for a in arrays):
        return None
    return comm


def _host_op(reference: Callable[..., Any], ins: Sequence[Any], outs: Sequence[Any],
             attrs: dict[str, Any]) -> None:
    """The op's NumPy reference on host copies of ``ins``, its results written to ``outs`` (the host
    path, for a communicator that takes host arrays)."""
    from kiln.cuda import np_dtype

    present = [a for a in (*ins, *outs) if a is not None]
    if _dry(present):
        return
    dev = present[0].device
    dev.synchronize()
    hosts = [None if a is None else a.download() for a in ins]
    got = reference(*hosts, **attrs)
    for o, h in zip(outs, got if isinstance(got, tuple) else (got,), strict=True):
        if o is not None:
            dev.copy_to_device(o.ptr, np.ascontiguousarray(np.asarray(h, np_dtype(o.dtype))))


def cuda_tp_copy(x: Any, *, out: Sequence[Any], communicator: str) -> None:
    """``tp_copy`` on the device: the input as it is (a device copy; its gradient's ``tp_all_reduce``
    is the collective)."""
    if out[0] is not None and out[0].ptr != x.ptr:
        x.device.copy(out[0].ptr, x.ptr, x.nbytes)


def cuda_tp_all_reduce(x: Any, *, out: Sequence[Any], communicator: str) -> None:
    """``tp_all_reduce`` on the device: the input copied into the output, summed there over the ranks by
    the communicator's device all-reduce on the compute stream (no host copy)."""
    from kiln.dist._tensor import _tp_all_reduce

    comm = _tp_comm(communicator, [x])
    if comm is None:
        _host_op(_tp_all_reduce, [x], out, {"communicator": communicator})
        return
    dev, o = x.device, out[0]
    if o.ptr != x.ptr:
        dev.copy(o.ptr, x.ptr, x.nbytes)
    if not _dry([x]):
        comm.all_reduce(CudaBuffer(o.ptr, o.size, o.dtype), stream=_stream(dev))


def _local_ids(ids: Any, out: Sequence[Any], comm: Any, rows: int, op: str, *, fill: int,
               ignore: int | None = None, vocab: int | None = None) -> None:
    """The reference's mapping (``_local``) on the device, into int32 ``out = (rel, mine, owner)``
    (``kiln.cuda``'s ``vocab_local_ids``: the id relative to this rank's first row where it falls in its
    rows, -1 for an ignored one, else ``fill``; 0/1 where it falls there; the rank holding it). An id
    outside the vocabulary is the reference's error naming ``op``, raised where the backend next
    synchronises: nothing is read back here."""
    from kiln.cuda import vocab_local_ids

    vocab_local_ids(ids, out=out, rank=comm.rank, rows=rows, fill=fill, ignore_index=ignore, op=op,
                    size=rows * comm.world_size if vocab is None else vocab)


def cuda_vocab_parallel_embedding(ids: Any, weight: Any, *, out: Sequence[Any], communicator: str,
                                  padding_idx: int | None = None, vocab_size: int | None = None) -> None:
    """The masked lookup on the device: ``kiln.cuda``'s embedding kernel over the ids relative to this
    rank's rows (0 for the others), times a 0/1 row mask (itself an embedding of a two-row table)."""
    from kiln.cuda import Scratch, embedding
    from kiln.dist._vocab import _embedding

    comm = _tp_comm(communicator, [weight])
    if comm is None:
        _host_op(_embedding, [ids, weight], out, {"communicator": communicator, "padding_idx": padding_idx,
                                                  "vocab_size": vocab_size})
        return
    dev, o = weight.device, out[0]
    rows, c = weight.shape
    with Scratch(dev) as s:
        rel_d, mask_d = s.array(ids.shape, "int32"), s.array(ids.shape, "int32")
        _local_ids(ids, (rel_d, mask_d), comm, rows, "vocab_parallel_embedding", fill=0, vocab=vocab_size)
        table, mask = s.array((2, c)), s.array((ids.size, c))
        _ew(dev, "fill_f32", c, (table.ptr, 0.0, c))
        _ew(dev, "fill_f32", c, (table.ptr + 4 * c, 1.0, c))
        embedding(rel_d, weight, out=(o,))
        embedding(mask_d, table, out=(mask,))
        _ew(dev, "mul_f32", o.size, (o.ptr, mask.ptr, o.ptr, o.size, o.size))


def cuda_vocab_parallel_embedding_backward(d_out: Any, ids: Any, *, out: Sequence[Any], communicator: str,
                                           num_embeddings: int, padding_idx: int | None = None,
                                           vocab_size: int | None = None) -> None:
    """This rank's rows of the scatter-add on the device: ``kiln.cuda``'s embedding backward over the ids
    relative to its rows (-1, matching no row, for the others)."""
    from kiln.cuda import Scratch, embedding_backward
    from kiln.dist._vocab import _embedding_backward

    comm = _tp_comm(communicator, [d_out])
    attrs = {"communicator": communicator, "num_embeddings": num_embeddings, "padding_idx": padding_idx,
             "vocab_size": vocab_size}
    if comm is None:
        _host_op(_embedding_backward, [d_out, ids], out, attrs)
        return
    dev = d_out.device
    pad = None if padding_idx is None else padding_idx - comm.rank * num_embeddings
    with Scratch(dev) as s:
        rel_d = s.array(ids.shape, "int32")
        _local_ids(ids, (rel_d,), comm, num_embeddings, "vocab_parallel_embedding_backward", fill=-1,
                   vocab=vocab_size)
        embedding_backward(d_out.reshape((ids.size, d_out.shape[-1])), rel_d, out=out,
                           num_embeddings=num_embeddings,
                           padding_idx=pad if pad is not None and 0 <= pad < num_embeddings else None)


def _first_rows(a: Any, n: int) -> Any:
    """The first ``n`` rows of the device array ``a`` (a view)."""
    return attrs.evolve(a, shape=(n, *a.shape[1:]))


def _real_rows(weight: Any, comm: Any, vocab: int | None) -> int:
    """How many of this rank's rows are in the vocabulary (the padding rows past ``vocab`` have
    ``-inf`` logits: left out)."""
    rows = weight.shape[0]
    return rows if vocab is None else max(0, min(rows, vocab - comm.rank * rows))


def cuda_vocab_parallel_logits(x: Any, weight: Any, *, out: Sequence[Any], communicator: str,
                               softcap: float | None = None, vocab_size: int | None = None) -> None:
    """Each rank's ``x @ w_r^T`` (``kiln.cuda``'s matmul, soft-capped) in the step's workspace, all-gathered
    on the device, each rank's columns copied into place (strided copies; the padding rows dropped)."""
    from kiln.cuda import Scratch, matmul, strided_copy
    from kiln.dist._vocab import _gathered_logits

    comm = _tp_comm(communicator, [x, weight])
    if comm is None:
        _host_op(_gathered_logits, [x, weight], out,
                 {"communicator": communicator, "softcap": softcap, "vocab_size": vocab_size})
        return
    dev, o = x.device, out[0]
    n, rows, world = x.shape[0], weight.shape[0], comm.world_size
    whole = o.shape[1]
    with Scratch(dev) as s:
        z, parts = s.array((n, rows)), s.array((world, n, rows))
        matmul(x, weight, out=(z,), transpose="NT")
        if softcap is not None:
            _ew(dev, "softcap_f32", z.size, (z.ptr, z.size, softcap))
        if _dry([x]):
            dev.copy(parts.ptr, z.ptr, z.nbytes)
        else:
            comm.all_gather(CudaBuffer(z.ptr, z.size, "float32"),
                            CudaBuffer(parts.ptr, parts.size, "float32"), stream=_stream(dev))
        for r in range(world):
            cols = min(rows, whole - r * rows)
            if cols > 0 and n:
                strided_copy(parts, o, (n, cols), (rows, 1), (whole, 1), r * n * rows, r * rows)


def cuda_vocab_parallel_lm_head_loss(x: Any, weight: Any, targets: Any, *, out: Sequence[Any],
                                     communicator: str, ignore_index: int, softcap: float | None,
                                     vocab_size: int | None = None) -> None:
    """The distributed cross-entropy on the device: ``kiln.cuda``'s ``fused_lm_head_loss`` over this rank's
    rows of the vocabulary gives each row's log-sum-exp there and, where the row's target is in them,
    ``lse_r - z_target``; one all-gather of both (2N numbers a rank); the whole log-sum-exp is the
    cross-entropy kernel's over the ranks' ``lse_r`` (a row of ``world`` logits, the target being the
    rank that holds it), and the loss that plus the holder's ``lse_r - z_target``."""
    from kiln.cuda import Scratch, cross_entropy, fused_lm_head_loss, strided_copy
    from kiln.dist._vocab import _loss

    attrs = {"communicator": communicator, "ignore_index": ignore_index, "softcap": softcap,
             "vocab_size": vocab_size}
    comm = _tp_comm(communicator, [x, weight])
    if comm is None:
        _host_op(_loss, [x, weight, targets], out, attrs)
        return
    dev, n, rows, world = x.device, x.shape[0], weight.shape[0], comm.world_size
    real = _real_rows(weight, comm, vocab_size)
    with Scratch(dev) as s:
        loss_out, lse_out = s.out(out[0], (n,)), s.out(out[1], (n,))
        # the targets in this rank's rows (-1 elsewhere), and the rank holding each (-1: ignored)
        mine_d, owner_d = s.array(targets.shape, "int32"), s.array(targets.shape, "int32")
        _local_ids(targets, (mine_d, None, owner_d), comm, rows, "vocab_parallel_lm_head_loss", fill=-1,
                   ignore=ignore_index, vocab=vocab_size)
        local, gathered = s.array((2, n)), s.array((world, 2, n))  # lse_r | lse_r - z_target (0: not held)
        held, ranks = s.array((n,)), s.array((n, world))
        if not n:
            return
        if real:
            fused_lm_head_loss(x, _first_rows(weight, real), mine_d, out=(_row(local, 1), _row(local, 0)),
                               ignore_index=-1, softcap=softcap)
        else:  # only padding rows here: no probability
            _ew(dev, "fill_f32", n, (local.ptr, -np.inf, n))
            _ew(dev, "fill_f32", n, (local.ptr + 4 * n, 0.0, n))
        if _dry([x]):
            dev.copy(gathered.ptr, local.ptr, local.nbytes)
        else:
            comm.all_gather(CudaBuffer(local.ptr, 2 * n, "float32"),
                            CudaBuffer(gathered.ptr, world * 2 * n, "float32"), stream=_stream(dev))
        # the ranks' lse_r as the rows of [n, world]; the holders' lse_r - z_target summed
        strided_copy(gathered, ranks, (world, n), (2 * n, 1), (1, world))
        dev.copy(held.ptr, gathered.ptr + 4 * n, 4 * n)
        for r in range(1, world):
            _ew(dev, "add_f32", n, (held.ptr, gathered.ptr + 4 * (2 * r + 1) * n, held.ptr, n, n))
        cross_entropy(ranks, owner_d, out=(loss_out, lse_out), ignore_index=-1)
        _ew(dev, "add_f32", n, (loss_out.ptr, held.ptr, loss_out.ptr, n, n))


def _row(a: Any, i: int) -> Any:
    """Row ``i`` of a [k, n] float32 device array, as an [n] array."""
    n = a.shape[-1]
    return attrs.evolve(a, ptr=a.ptr + i * n * 4, shape=(n,))


def cuda_vocab_parallel_lm_head_loss_backward(d_loss: Any, x: Any, weight: Any, targets: Any, lse: Any,
                                              d_lse: Any, *, out: Sequence[Any], communicator: str,
                                              ignore_index: int, softcap: float | None,
                                              vocab_size: int | None = None) -> None:
    """This rank's part of ``d_x`` and its rows of ``d_weight`` on the device: ``kiln.cuda``'s
    ``fused_lm_head_loss_backward`` over its rows with the whole log-sum-exp (a live target another rank
    holds maps past its rows: softmax only, no one-hot); the padding rows' gradient zero. No collective."""
    from kiln.cuda import Scratch, fused_lm_head_loss_backward
    from kiln.dist._vocab import _loss_backward

    attrs = {"communicator": communicator, "ignore_index": ignore_index, "softcap": softcap,
             "vocab_size": vocab_size}
    comm = _tp_comm(communicator, [x, weight])
    if comm is None:
        _host_op(_loss_backward, [d_loss, x, weight, targets, lse, d_lse], out, attrs)
        return
    dev, rows = x.device, weight.shape[0]
    real = _real_rows(weight, comm, vocab_size)
    d_x, d_w = out
    with Scratch(dev) as s:
        if d_w is not None and real < rows:  # the padding rows: no gradient
            done = real * weight.shape[1] * 4
            dev.memset(d_w.ptr + done, 0, d_w.nbytes - done)
        if not real:
            if d_x is not None:
                dev.memset(d_x.ptr, 0, d_x.nbytes)
            return
        # a live target another rank holds: past this rank's rows (no one-hot, the softmax's share kept)
        t_d = s.array(targets.shape, "int32")
        _local_ids(targets, (t_d,), comm, rows, "vocab_parallel_lm_head_loss_backward", fill=real,
                   ignore=ignore_index, vocab=vocab_size)
        fused_lm_head_loss_backward(d_loss, x, _first_rows(weight, real), t_d, lse, d_lse,
                                    out=(d_x, None if d_w is None else _first_rows(d_w, real)),
                                    ignore_index=-1, softcap=softcap)


#: (op, kernel) of tensor parallelism registered for the ``cuda`` backend, float32, with ``out=``
CUDA_TP_KERNELS = (("tp_copy", cuda_tp_copy),
                   ("tp_all_reduce", cuda_tp_all_reduce),
                   ("vocab_parallel_embedding", cuda_vocab_parallel_embedding),
                   ("vocab_parallel_embedding_backward", cuda_vocab_parallel_embedding_backward),
                   ("vocab_parallel_logits", cuda_vocab_parallel_logits),
                   ("vocab_parallel_lm_head_loss", cuda_vocab_parallel_lm_head_loss),
                   ("vocab_parallel_lm_head_loss_backward", cuda_vocab_parallel_lm_head_loss_backward))
