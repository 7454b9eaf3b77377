"""The optimizer phase's ops: the global gradient norm and one in-place update per parameter.

They update their inputs in place and have no outputs. Besides their attributes (fixed per
parameter group), update kernels receive the run-time scalars ``step`` (1-based), ``lr`` (the
schedule's learning rate) and ``scale`` (the clipping factor for the gradient) as keywords. The
arrays are arena views: every update runs in place with ufuncs writing through ``out=`` and
allocates nothing; blocks of the flattened arrays run on kiln's threads.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kiln.core._errors import KilnError
from kiln.core._threads import flat_blocks, parallel
from kiln.core.ops._ops import AttrSpec, InferContext, no_gradient
from kiln.core.ops.library._common import core_op


def global_norm(*grads: np.ndarray) -> float:
    """The L2 norm of all gradients together (a sum of dot products: no temporary arrays)."""
    total = 0.0
    for g in grads:
        flat = g.reshape(-1)
        total += float(np.dot(flat, flat))
    return math.sqrt(total)


def _flat(*arrays: np.ndarray) -> list[np.ndarray]:
    flat = [a.reshape(-1) for a in arrays]
    if any(not np.may_share_memory(f, a) for f, a in zip(flat, arrays, strict=True) if a.size):
        raise KilnError("optimizer updates need contiguous parameter, gradient and state arrays")
    return flat


def adamw_update(p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, work: np.ndarray, *, step: int,
                 lr: float, scale: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 lr_scale: float) -> None:
    """One AdamW update of ``p`` from gradient ``scale * g``, as ``torch.optim.AdamW``; ``work`` is
    scratch of at least p's size."""
    b1, b2, lr = beta1, beta2, lr * lr_scale
    bc1, bc2 = 1 - b1**step, 1 - b2**step
    decay = 1 - lr * weight_decay if weight_decay else None
    pf, gf, mf, vf = _flat(p, g, m, v)
    wf = work.reshape(-1)[: p.size]

    def block(r: slice) -> None:
        p, g, m, v, w = pf[r], gf[r], mf[r], vf[r], wf[r]
        np.multiply(g, scale * (1 - b1), out=w)  # m = b1 m + (1 - b1) g
        m *= b1
        m += w
        np.multiply(g, g, out=w)  # v = b2 v + (1 - b2) g^2
        w *= (1 - b2) * scale * scale
        v *= b2
        v += w
        np.sqrt(v, out=w)  # update = lr * (m / bc1) / (sqrt(v / bc2) + eps)
        w *= 1 / math.sqrt(bc2)
        w += eps
        np.divide(m, w, out=w)
        w *= lr / bc1
        if decay is not None:
            p *= decay  # decoupled: the decay does not go through the moments
        p -= w

    parallel(block, flat_blocks(p.size))


def sgd_update(p: np.ndarray, g: np.ndarray, *rest: np.ndarray, step: int, lr: float, scale: float,
               momentum: float, dampening: float, nesterov: bool, weight_decay: float,
               lr_scale: float) -> None:
    """One SGD update of ``p`` from gradient ``scale * g`` (``rest``: the momentum buffer if momentum is
    on, then scratch), as ``torch.optim.SGD`` with decoupled weight decay."""
    lr = lr * lr_scale
    decay = 1 - lr * weight_decay if weight_decay else None
    buf, work = (rest[0], rest[1]) if momentum else (None, rest[0])
    pf, gf = _flat(p, g)
    bf = _flat(buf)[0] if buf is not None else None
    wf = work.reshape(-1)[: p.size]

    def block(r: slice) -> None:
        p, g, w = pf[r], gf[r], wf[r]
        np.multiply(g, scale, out=w)  # d = scale g
        if bf is not None:
            b = bf[r]
            if step == 1:  # torch starts the buffer at the first gradient, undamped
                np.copyto(b, w)
            else:
                b *= momentum
                b += (1 - dampening) * w
            if nesterov:
                w += momentum * b
            else:
                np.copyto(w, b)
        w *= lr
        if decay is not None:
            p *= decay
        p -= w

    parallel(block, flat_blocks(p.size))


def _no_outputs(ctx: InferContext) -> list[Any]:
    return []


_GROUP = (AttrSpec("weight_decay", "float", 0.0), AttrSpec("lr_scale", "float", 1.0))

CORE_OPS = [
    core_op("grad_norm", ("*grads",), (), global_norm, _no_outputs, backward=no_gradient,
            doc="The global L2 norm of every gradient, returned to the host (clipping, logging)."),
    core_op("adamw_update", ("param", "grad", "exp_avg", "exp_avg_sq", "work"), (), adamw_update, _no_outputs,
            backward=no_gradient,
            attrs=(AttrSpec("beta1", "float", 0.9), AttrSpec("beta2", "float", 0.999),
                   AttrSpec("eps", "float", 1e-8), *_GROUP),
            doc="In place: one AdamW step of param (run-time keywords step, lr, scale)."),
    core_op("sgd_update", ("param", "grad", "*state"), (), sgd_update, _no_outputs, backward=no_gradient,
            attrs=(AttrSpec("momentum", "float", 0.0), AttrSpec("dampening", "float", 0.0),
                   AttrSpec("nesterov", "bool", False), *_GROUP),
            doc="In place: one SGD step of param; state is the momentum buffer (if momentum) then scratch."),
]

OPS = [c.opdef for c in CORE_OPS]
