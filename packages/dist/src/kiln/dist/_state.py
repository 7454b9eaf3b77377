"""State dicts independent of the number of ranks: :func:`gather_state` gives every rank the state
one process training the whole model would hold (a ZeRO-1 rank's missing optimizer state, a
tensor-parallel rank's missing slices); :func:`scatter_state` loads such a state into a rank. A run
saved on N ranks resumes on M, and a HF checkpoint can be written from any run."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kiln.core import KilnError
from kiln.core.runtime import Communicator
from kiln.dist._parallel import DataParallel
from kiln.dist._tensor import VOCAB, TensorParallel, shard, split_axis

__all__ = ["gather_state", "scatter_state", "unshard"]

def _axis(name: str, bundle: Any) -> int | None:
    return split_axis(name, bundle)


def unshard(parts: Sequence[Mapping[str, np.ndarray]], bundle: Any) -> dict[str, np.ndarray]:
    """The whole model's tensors from every rank's slices (``parts[r]``: rank ``r``'s, as
    :func:`shard` cut them, for ``len(parts)`` ranks): the inverse of :func:`shard`."""
    world = len(parts)
    out: dict[str, np.ndarray] = {}
    for name, first in parts[0].items():
        axis = _axis(name, bundle)
        if axis is None or world == 1:
            out[name] = first
            continue
        if name in VOCAB:  # the ranks' rows in order, less the padding rows past the vocabulary
            model = bundle.module(bundle.entry)
            sizes = {k: v for k, v in model.config.items() if isinstance(v, int) and not isinstance(v, bool)}
            out[name] = np.concatenate([p[name] for p in parts])[:model.param(name).shape[0].evaluate(sizes)]
            continue
        shape = list(first.shape)
        shape[axis] *= world
        index = np.arange(math.prod(shape)).reshape(shape)
        whole = np.empty(math.prod(shape), first.dtype)
        for r, part in enumerate(parts):  # where shard puts each element of the whole tensor on rank r
            whole[shard({name: index}, bundle, r, world)[name].reshape(-1)] = part[name].reshape(-1)
        out[name] = whole.reshape(shape)
    return out


def _parallel(model: Any) -> tuple[Communicator | None, DataParallel | None]:
    """The tensor-parallel communicator (if any) and the ZeRO-1 data parallelism (if any) of a Model."""
    par = model.data_parallel
    if isinstance(par, TensorParallel):
        from kiln.core import get_registry

        tp: Communicator = get_registry("communicators")[par.comm]
        dp = par.data_parallel
        zero = dp if dp is not None and dp.zero and dp.communicator.world_size > 1 else None
        return (tp if tp.world_size > 1 else None), zero
    if isinstance(par, DataParallel) and par.zero and par.communicator.world_size > 1:
        return None, par
    return None, None


def _gather(comm: Communicator, tensors: Mapping[str, np.ndarray], bundle: Any) -> dict[str, np.ndarray]:
    """Every rank's slices of ``tensors`` (the same names and shapes on every rank), made whole."""
    if not tensors:
        return {}
    names = list(tensors)
    send = np.concatenate([np.ascontiguousarray(tensors[k]).reshape(-1) for k in names])
    recv = np.empty(comm.world_size * send.size, send.dtype)
    comm.all_gather(send, recv)
    parts = []
    for r in range(comm.world_size):
        flat, at, part = recv[r * send.size:(r + 1) * send.size], 0, {}
        for k in names:
            part[k] = flat[at:at + tensors[k].size].reshape(tensors[k].shape)
            at += tensors[k].size
        parts.append(part)
    return unshard(parts, bundle)


def gather_state(model: Any) -> dict[str, Any]:
    """``model.state_dict()`` as one process training the whole model holds it, on every rank (every
    rank must call it: it runs collectives). A ZeRO-1 rank gets the optimizer state of the parameters
    the other ranks own (one all-reduce per state, each parameter's from its owner); a
    tensor-parallel rank gets the whole parameters and optimizer state (one all-gather each)."""
    state = model.state_dict()
    tp, zero = _parallel(model)
    opt = dict(state["optimizer"])
    names = [k for k in model.optimizer.state if isinstance(opt.get(k), dict)]
    if zero is not None:
        trained = [k for k, t in model.trainable.items() if t]
        shapes = {k: shape for k, (_, shape) in model.parameter_specs().items()}
        for s in names:
            flat = np.zeros(sum(math.prod(shapes[k]) for k in trained), model.dtype)
            at = 0
            for k in trained:  # the owner's values, zeros elsewhere: the sum is the owner's, exactly
                n = math.prod(shapes[k])
                if k in opt[s]:
                    flat[at:at + n] = opt[s][k].reshape(-1)
                at += n
            zero.communicator.all_reduce(flat)
            opt[s], at = {}, 0
            for k in trained:
                n = math.prod(shapes[k])
                opt[s][k] = flat[at:at + n].reshape(shapes[k]).copy()
                at += n
    if tp is not None:
        state = {**state, "parameters": _gather(tp, state["parameters"], model.ir)}
        for s in names:
            opt[s] = _gather(tp, opt[s], model.ir)
    return {**state, "optimizer": opt}


def scatter_state(model: Any, state: Mapping[str, Any]) -> None:
    """Load a whole model's state (:func:`gather_state`'s, or one process's ``state_dict()``) into
    this rank: a tensor-parallel rank takes its slices, a ZeRO-1 rank its share of the optimizer
    state. Parameters the state leaves out keep their values."""
    tp, _ = _parallel(model)
    if tp is None:
        model.load_state_dict(state)
        return
    bundle = model.ir
    if not hasattr(bundle, "entry"):
        raise KilnError("scatter_state needs a Model built from a Bundle to cut a tensor-parallel rank's "
                        "slices")
    opt = dict(state.get("optimizer", {}))
    for s in model.optimizer.state:
        if isinstance(opt.get(s), dict):
            opt[s] = shard(opt[s], bundle, tp.rank, tp.world_size)
    model.load_state_dict({**state, "parameters": shard(state["parameters"], bundle, tp.rank, tp.world_size),
                           "optimizer": opt})
