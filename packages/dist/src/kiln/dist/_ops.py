"""The collective ops of a data-parallel Program: steps of its ``grad_sync`` and ``optimizer``
phases that update their inputs in place, so that ``kiln plan`` shows every collective.

A bucket op packs its tensors into one flat buffer, runs one collective on it and unpacks the
result: one collective per bucket, whatever the number of tensors in it. ``owners`` gives each
tensor's owning rank (ZeRO-1); the ranks' parts of a bucket are padded to equal chunks. The
attribute ``communicator`` names the communicator in the ``communicators`` registry. The kernels
take host (NumPy) arrays; they also receive the optimizer phase's run-time scalars, and ignore them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from kiln.core import AttrSpec, InferContext, OpDef, get_registry, no_gradient
from kiln.core.runtime import Communicator

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


def sharded_grad_norm(norm: np.ndarray, *grads: np.ndarray, communicator: str, **_scalars: Any) -> None:
    """``norm`` = the L2 norm of the gradients of every rank's share (each rank passes its own)."""
    total = np.array([sum(float(np.dot(g.reshape(-1), g.reshape(-1))) for g in grads)])
    _communicator(communicator).all_reduce(total)
    norm[...] = math.sqrt(total[0])


def _no_outputs(ctx: InferContext) -> list[Any]:
    return []


_COMM = AttrSpec("communicator", "str")
_OWNERS = AttrSpec("owners", "ints")


def _op(name: str, inputs: tuple[str, ...], kernel: Any, attrs: tuple[AttrSpec, ...], doc: str) -> OpDef:
    return OpDef(name, inputs, (), kernel, _no_outputs, backward=no_gradient, attrs=attrs, collective=True,
                 doc=doc)


OPS = [
    _op("bucket_all_reduce", ("*tensors",), bucket_all_reduce, (_COMM,),
        "In place: every tensor summed over the ranks (data parallelism's gradients)."),
    _op("bucket_reduce_scatter", ("*tensors",), bucket_reduce_scatter, (_COMM, _OWNERS),
        "In place: each tensor summed over the ranks into its owner's copy (ZeRO-1's gradients)."),
    _op("bucket_all_gather", ("*tensors",), bucket_all_gather, (_COMM, _OWNERS),
        "In place: each tensor copied from its owner to every rank (ZeRO-1's parameters)."),
    _op("sharded_grad_norm", ("norm", "*grads"), sharded_grad_norm, (_COMM,),
        "In place: norm = the global L2 norm of the gradients each rank owns (ZeRO-1's clipping)."),
]
