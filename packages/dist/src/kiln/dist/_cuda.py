"""The collective ops' kernels on kiln-kernels-cuda's ``cuda`` backend (registered as
``<op>@cuda:*`` where that package is installed).

A Program's tensors there are ``DeviceArray`` views of the device arena (``device``, ``ptr``,
``shape``, ``dtype``). Where the op's communicator takes device buffers (``device_buffers = True``:
the ``nccl`` communicator), a bucket is packed into one flat device buffer by device-to-device
copies, the collective runs on it (a :class:`CudaBuffer`, which exposes the CUDA array interface),
and the result is copied back on the device: no host copy of the gradients or parameters. Any
other communicator (``mpi`` takes host NumPy arrays) runs the op's NumPy reference on host copies,
as the backend does for an op without a kernel.

The overlapped all-reduce (``bucket_all_reduce_start``/``_wait``) and ``sharded_grad_norm`` (one
scalar) keep running their references on host copies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kiln.core import KilnError
from kiln.dist._ops import _communicator, bucket_all_gather, bucket_all_reduce, bucket_reduce_scatter

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


def cuda_bucket_all_reduce(*grads: Any, communicator: str, **scalars: Any) -> None:
    """:func:`~kiln.dist._ops.bucket_all_reduce` on device arrays."""
    comm = _communicator(communicator)
    if not on_device(comm, grads):
        _host(bucket_all_reduce, grads, {"communicator": communicator, **scalars})
        return
    dev, dtype = grads[0].device, _same_dtype("bucket_all_reduce", grads)
    with _Flat(dev, sum(g.size for g in grads), dtype) as flat:
        _pack(dev, grads, flat.ptr)
        dev.synchronize()  # the copies (kiln's stream) before the collective (the communicator's)
        comm.all_reduce(flat)
        dev.synchronize()
        _unpack(dev, flat.ptr, grads)


def _parts(arrays: Sequence[Any], owners: Sequence[int], world: int) -> tuple[list[list[Any]], int]:
    parts: list[list[Any]] = [[] for _ in range(world)]
    for a, owner in zip(arrays, owners, strict=True):
        parts[owner].append(a)
    return parts, max(sum(a.size for a in p) for p in parts)


def cuda_bucket_reduce_scatter(*grads: Any, communicator: str, owners: tuple[int, ...],
                               **scalars: Any) -> None:
    """:func:`~kiln.dist._ops.bucket_reduce_scatter` on device arrays."""
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
        dev.synchronize()
        comm.reduce_scatter(send, recv)
        dev.synchronize()
        _unpack(dev, recv.ptr, parts[comm.rank])


def cuda_bucket_all_gather(*params: Any, communicator: str, owners: tuple[int, ...], **scalars: Any) -> None:
    """:func:`~kiln.dist._ops.bucket_all_gather` on device arrays."""
    comm = _communicator(communicator)
    if not on_device(comm, params):
        _host(bucket_all_gather, params, {"communicator": communicator, "owners": owners, **scalars})
        return
    dev, dtype = params[0].device, _same_dtype("bucket_all_gather", params)
    parts, chunk = _parts(params, owners, comm.world_size)
    step = chunk * _itemsize(dtype)
    with _Flat(dev, chunk, dtype) as send, _Flat(dev, len(parts) * chunk, dtype) as recv:
        _pack(dev, parts[comm.rank], send.ptr)
        dev.synchronize()
        comm.all_gather(send, recv)
        dev.synchronize()
        for r, part in enumerate(parts):
            if r != comm.rank:
                _unpack(dev, recv.ptr + r * step, part)


#: (op, kernel) registered for the ``cuda`` backend, any dtype
CUDA_KERNELS = (("bucket_all_reduce", cuda_bucket_all_reduce),
                ("bucket_reduce_scatter", cuda_bucket_reduce_scatter),
                ("bucket_all_gather", cuda_bucket_all_gather))
