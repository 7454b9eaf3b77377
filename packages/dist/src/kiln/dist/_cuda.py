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
before it unpacks. Whether a gradient changed since the start (micro-batches, a parameter group's
rule) is decided on the device (the squared norm of the difference, ``kiln.cuda``'s norm kernels);
the one number read back per bucket (and summed over the ranks) says whether to run the collective
again. ``sharded_grad_norm`` sums the ranks' squares on the device too: one scalar collective.

Any other communicator (``mpi`` takes host NumPy arrays), and a dtype a device collective does not
take, runs the op's NumPy reference on host copies, as the backend does for an op without a kernel.
In the backend's dry run that sizes kernel temporaries (a device named ``sizing``) they do nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kiln.core import KilnError
from kiln.dist._ops import (
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

__all__ = ["CUDA_KERNELS", "CudaBuffer", "on_device"]

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


def _np_dtype(dtype: str) -> np.dtype[Any]:
    if dtype == "bfloat16":
        from kiln.core.plan import require_ml_dtypes

        return np.dtype(require_ml_dtypes().bfloat16)
    return np.dtype(dtype)


def _host(reference: Callable[..., None], arrays: Sequence[Any], attrs: dict[str, Any]) -> None:
    """``reference`` (in place) on host copies of the device ``arrays``, written back."""
    dev = arrays[0].device
    dev.synchronize()
    hosts = [dev.copy_to_host(a.ptr, a.nbytes).view(_np_dtype(a.dtype)).reshape(a.shape) for a in arrays]
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


class _Flat:
    """A flat device buffer of ``size`` elements (zeroed), freed on exit."""

    def __init__(self, dev: Any, size: int, dtype: str) -> None:
        self.dev, self.buf = dev, CudaBuffer(dev.alloc(size * _itemsize(dtype)), size, dtype)

    def __enter__(self) -> CudaBuffer:
        return self.buf

    def __exit__(self, *_: Any) -> None:
        self.dev.synchronize()  # the collective and the copies are done with it
        self.dev.free(self.buf.ptr)


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


def cuda_bucket_all_reduce(*grads: Any, communicator: str, **scalars: Any) -> None:
    """:func:`~kiln.dist._ops.bucket_all_reduce` on device arrays."""
    if _dry(grads):
        return
    comm = _communicator(communicator)
    if not on_device(comm, grads):
        _host(bucket_all_reduce, grads, {"communicator": communicator, **scalars})
        return
    dev, dtype = grads[0].device, _same_dtype("bucket_all_reduce", grads)
    with _Flat(dev, sum(g.size for g in grads), dtype) as flat:
        _pack(dev, grads, flat.ptr)
        comm.all_reduce(flat, stream=_stream(dev))  # after the copies, on the same stream
        _unpack(dev, flat.ptr, grads)


def _parts(arrays: Sequence[Any], owners: Sequence[int], world: int) -> tuple[list[list[Any]], int]:
    parts: list[list[Any]] = [[] for _ in range(world)]
    for a, owner in zip(arrays, owners, strict=True):
        parts[owner].append(a)
    return parts, max(sum(a.size for a in p) for p in parts)


def cuda_bucket_reduce_scatter(*grads: Any, communicator: str, owners: tuple[int, ...],
                               **scalars: Any) -> None:
    """:func:`~kiln.dist._ops.bucket_reduce_scatter` on device arrays."""
    if _dry(grads):
        return
    comm = _communicator(communicator)
    if not on_device(comm, grads):
        _host(bucket_reduce_scatter, grads, {"communicator": communicator, "owners": owners, **scalars})
        return
    dev, dtype = grads[0].device, _same_dtype("bucket_reduce_scatter", grads)
    parts, chunk = _parts(grads, owners, comm.world_size)
    step = chunk * _itemsize(dtype)
    with _Flat(dev, len(parts) * chunk, dtype) as send, _Flat(dev, chunk, dtype) as recv:
        for r, part in enumerate(parts):  # each rank's part at its chunk, the padding zero
            _pack(dev, part, send.ptr + r * step)
        comm.reduce_scatter(send, recv, stream=_stream(dev))
        _unpack(dev, recv.ptr, parts[comm.rank])


def cuda_bucket_all_gather(*params: Any, communicator: str, owners: tuple[int, ...], **scalars: Any) -> None:
    """:func:`~kiln.dist._ops.bucket_all_gather` on device arrays."""
    if _dry(params):
        return
    comm = _communicator(communicator)
    if not on_device(comm, params):
        _host(bucket_all_gather, params, {"communicator": communicator, "owners": owners, **scalars})
        return
    dev, dtype = params[0].device, _same_dtype("bucket_all_gather", params)
    parts, chunk = _parts(params, owners, comm.world_size)
    step = chunk * _itemsize(dtype)
    with _Flat(dev, chunk, dtype) as send, _Flat(dev, len(parts) * chunk, dtype) as recv:
        _pack(dev, parts[comm.rank], send.ptr)
        comm.all_gather(send, recv, stream=_stream(dev))
        for r, part in enumerate(parts):
            if r != comm.rank:
                _unpack(dev, recv.ptr + r * step, part)


# -- overlapped: started in the backward on the communication stream, waited for in grad_sync


class _InFlight:
    """A collective started on the communication stream: ``done`` is recorded there after it; ``send``
    is what it reduces (packed from the gradients), ``sent`` a copy kept to see whether they changed,
    ``recv`` where the result lands (``send`` itself for an all-reduce)."""

    def __init__(self, dev: Any, send: CudaBuffer, recv: CudaBuffer, sent: CudaBuffer, done: Any,
                 events: Sequence[Any]) -> None:
        self.dev, self.send, self.recv, self.sent = dev, send, recv, sent
        self.done, self.events = done, events

    def wait(self) -> None:
        """The compute stream waits for the collective."""
        self.dev.wait("compute", self.done)

    def free(self) -> None:
        self.dev.synchronize()  # the collective and the copies are done with the buffers
        for b in {self.send.ptr, self.recv.ptr, self.sent.ptr}:
            self.dev.free(b)
        destroy = getattr(self.dev, "destroy", None)
        for e in self.events if destroy is not None else ():
            destroy(e)


#: the overlapped collectives started on device buffers and not yet waited for, by (op, communicator,
#: bucket)
IN_FLIGHT: dict[tuple[str, str, int], _InFlight] = {}


def _buffer(dev: Any, size: int, dtype: str) -> CudaBuffer:
    """``size`` zeroed elements of device memory (freed by :meth:`_InFlight.free`)."""
    return CudaBuffer(dev.alloc(size * _itemsize(dtype)), size, dtype)


def _start(dev: Any, send: CudaBuffer, recv: CudaBuffer, collective: Callable[[Any], None]) -> _InFlight:
    """``collective(stream)`` enqueued on the communication stream once the compute stream has packed
    ``send`` (an event); keeps a copy of ``send`` to compare with at the wait."""
    sent = _buffer(dev, send.size, str(send.dtype))
    dev.copy(sent.ptr, send.ptr, send.nbytes)
    ready, done = dev.event(), dev.event()
    dev.record(ready, "compute")
    dev.wait("comm", ready)
    collective(_stream(dev, "comm"))
    dev.record(done, "comm")
    return _InFlight(dev, send, recv, sent, done, (ready, done))


def _taken(key: tuple[str, str, int], op: str) -> _InFlight:
    if key not in IN_FLIGHT:
        raise KilnError(f"{op}_wait of bucket {key[-1]} over {key[-2]!r}: no {op}_start of that bucket "
                        "is in flight (the start runs in the backward, before the wait)")
    return IN_FLIGHT.pop(key)


def _finish_earlier(key: tuple[str, str, int]) -> None:
    """A bucket still in flight from an earlier backward (micro-batches): waited for and let go, so
    every rank starts the same collectives."""
    if key in IN_FLIGHT:
        earlier = IN_FLIGHT.pop(key)
        earlier.wait()
        earlier.free()


class _Temporaries:
    """Device memory for the norm kernels' partial sums, freed on exit (``_Scratch``'s ``array``)."""

    def __init__(self, dev: Any) -> None:
        self.dev, self.ptrs = dev, []

    def array(self, shape: Sequence[int], dtype: str = "float32") -> Any:
        from kiln.cuda._ops import DeviceArray

        size = int(np.prod(shape))
        self.ptrs.append(self.dev.alloc(size * _itemsize(dtype)))
        return DeviceArray(self.dev, self.ptrs[-1], tuple(shape), dtype)

    def __enter__(self) -> _Temporaries:
        return self

    def __exit__(self, *_: Any) -> None:
        self.dev.synchronize()
        for p in self.ptrs:
            self.dev.free(p)


def _changed(comm: Any, flight: _InFlight, now: CudaBuffer) -> bool:
    """Whether ``now`` differs from what was sent on any rank: this rank's answer computed on the device
    (the norm of ``now - sent``; NaN counts as changed, as for the reference), read back (one number)
    and summed over the ranks, as the reference sums it."""
    from kiln.cuda._ops import KERNELS, DeviceArray, _norm_into, scale

    add, dev = KERNELS["add"][0], flight.dev
    with _Temporaries(dev) as t:
        diff = t.array((now.size,))
        scale(DeviceArray(dev, flight.sent.ptr, (now.size,), "float32"), out=[diff], factor=-1.0)
        add(DeviceArray(dev, now.ptr, (now.size,), "float32"), diff, out=[diff])
        norm = t.array((1,))
        _norm_into(t, [diff], norm.ptr)
        dev.synchronize()
        differs = dev.copy_to_host(norm.ptr, 4).view(np.float32)[0] != 0
    changed = np.array([1.0 if differs else 0.0])
    comm.all_reduce(changed)  # a host array: through the communicator's host path (MPI for nccl)
    return bool(changed[0])


def _overlapped(comm: Any, arrays: Sequence[Any]) -> bool:
    """Whether an overlapped collective runs on the device: device buffers, float32 (the dtype the
    change test's kernels read); start and wait of a bucket decide alike."""
    return on_device(comm, arrays) and all(a.dtype == "float32" for a in arrays)


def cuda_bucket_all_reduce_start(*grads: Any, communicator: str, bucket: int, **scalars: Any) -> None:
    """:func:`~kiln.dist._ops.bucket_all_reduce_start` on device arrays: the bucket packed on the
    compute stream, its all-reduce enqueued on the communication stream."""
    if _dry(grads):
        return
    comm = _communicator(communicator)
    if not _overlapped(comm, grads):
        _host(bucket_all_reduce_start, grads, {"communicator": communicator, "bucket": bucket, **scalars})
        return
    key = ("all_reduce", communicator, bucket)
    _finish_earlier(key)
    dev, dtype = grads[0].device, _same_dtype("bucket_all_reduce_start", grads)
    flat = _buffer(dev, sum(g.size for g in grads), dtype)
    _pack(dev, grads, flat.ptr)
    IN_FLIGHT[key] = _start(dev, flat, flat, lambda stream: comm.all_reduce(flat, stream=stream))


def cuda_bucket_all_reduce_wait(*grads: Any, communicator: str, bucket: int, **scalars: Any) -> None:
    """:func:`~kiln.dist._ops.bucket_all_reduce_wait` on device arrays: the compute stream waits for
    the sum, which it unpacks (summed again, on the compute stream, if a gradient changed since)."""
    if _dry(grads):
        return
    comm = _communicator(communicator)
    if not _overlapped(comm, grads):
        _host(bucket_all_reduce_wait, grads, {"communicator": communicator, "bucket": bucket, **scalars})
        return
    flight = _taken(("all_reduce", communicator, bucket), "bucket_all_reduce")
    dev = flight.dev
    flight.wait()
    now = _buffer(dev, flight.send.size, str(flight.send.dtype))
    try:
        _pack(dev, grads, now.ptr)
        if _changed(comm, flight, now):
            comm.all_reduce(now, stream=_stream(dev))
            _unpack(dev, now.ptr, grads)
        else:
            _unpack(dev, flight.recv.ptr, grads)
    finally:
        dev.synchronize()
        dev.free(now.ptr)
        flight.free()


def _scatter_layout(dev: Any, parts: Sequence[Sequence[Any]], chunk: int, into: CudaBuffer) -> None:
    step = chunk * into.dtype.itemsize
    for r, part in enumerate(parts):  # each rank's part at its chunk, the padding zero
        _pack(dev, part, into.ptr + r * step)


def cuda_bucket_reduce_scatter_start(*grads: Any, communicator: str, owners: tuple[int, ...], bucket: int,
                                     **scalars: Any) -> None:
    """:func:`~kiln.dist._ops.bucket_reduce_scatter_start` on device arrays: each rank's part packed
    at its chunk on the compute stream, the reduce-scatter enqueued on the communication stream."""
    if _dry(grads):
        return
    comm = _communicator(communicator)
    attrs = {"communicator": communicator, "owners": owners, "bucket": bucket, **scalars}
    if not _overlapped(comm, grads):
        _host(bucket_reduce_scatter_start, grads, attrs)
        return
    key = ("reduce_scatter", communicator, bucket)
    _finish_earlier(key)
    dev, dtype = grads[0].device, _same_dtype("bucket_reduce_scatter_start", grads)
    parts, chunk = _parts(grads, owners, comm.world_size)
    send, recv = _buffer(dev, len(parts) * chunk, dtype), _buffer(dev, chunk, dtype)
    _scatter_layout(dev, parts, chunk, send)
    IN_FLIGHT[key] = _start(dev, send, recv, lambda stream: comm.reduce_scatter(send, recv, stream=stream))


def cuda_bucket_reduce_scatter_wait(*grads: Any, communicator: str, owners: tuple[int, ...], bucket: int,
                                    **scalars: Any) -> None:
    """:func:`~kiln.dist._ops.bucket_reduce_scatter_wait` on device arrays: the compute stream waits
    for the reduce-scatter and unpacks this rank's chunk into the gradients it owns (reduce-scattered
    again, on the compute stream, if a gradient changed since)."""
    if _dry(grads):
        return
    comm = _communicator(communicator)
    attrs = {"communicator": communicator, "owners": owners, "bucket": bucket, **scalars}
    if not _overlapped(comm, grads):
        _host(bucket_reduce_scatter_wait, grads, attrs)
        return
    flight = _taken(("reduce_scatter", communicator, bucket), "bucket_reduce_scatter")
    dev = flight.dev
    flight.wait()
    parts, chunk = _parts(grads, owners, comm.world_size)
    now = _buffer(dev, flight.send.size, str(flight.send.dtype))
    try:
        _scatter_layout(dev, parts, chunk, now)
        if _changed(comm, flight, now):
            comm.reduce_scatter(now, flight.recv, stream=_stream(dev))
        _unpack(dev, flight.recv.ptr, parts[comm.rank])
    finally:
        dev.synchronize()
        dev.free(now.ptr)
        flight.free()


def cuda_sharded_grad_norm(norm: Any, *grads: Any, communicator: str, over: str | None = None,
                           **scalars: Any) -> None:
    """:func:`~kiln.dist._ops.sharded_grad_norm` on the device: this rank's sum of squares by
    ``kiln.cuda``'s norm kernels, summed over the ranks (and over ``over``'s) by a one-number device
    collective on the compute stream, its square root written to ``norm``; nothing read back."""
    arrays = [norm, *grads]
    if _dry(arrays):
        return
    comms = [_communicator(communicator), *([_communicator(over)] if over is not None else [])]
    if not all(_overlapped(c, arrays) for c in comms):
        _host(sharded_grad_norm, arrays, {"communicator": communicator, "over": over, **scalars})
        return
    from kiln.cuda._ops import THREADS, _norm_into

    dev = norm.device
    with _Temporaries(dev) as t:
        mine = t.array((2,))  # this rank's norm, then its square: what the ranks sum
        if grads:
            _norm_into(t, grads, mine.ptr)
            dev.launch("sumsq_partial_f32", (1,), (THREADS,), (mine.ptr, 1, mine.ptr + 4))
        total = CudaBuffer(mine.ptr + 4, 1, "float32")
        for c in comms:
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
