"""The optimizer: AdamW with decoupled weight decay and bias correction, global-norm gradient
clipping, and a linear warm-up + cosine decay learning-rate schedule.

The update runs in place on arena views (weights, gradients, the two moment buffers and one scratch
buffer), with ufuncs writing through ``out=``: a step allocates nothing. The master weights and
state are in the Program's float type (float32 for training).
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from kiln.core._errors import KilnError
from kiln.core._threads import flat_blocks, parallel


def _positive(_: object, a: attrs.Attribute[float], value: float) -> None:
    if not value > 0:
        raise KilnError(f"AdamW.{a.name} must be positive, found {value!r}")


def _fraction(_: object, a: attrs.Attribute[float], value: float) -> None:
    if not 0 <= value < 1:
        raise KilnError(f"AdamW.{a.name} must be in [0, 1), found {value!r}")


@attrs.frozen
class AdamW:
    """AdamW hyperparameters and the learning-rate schedule.

    The learning rate rises linearly over ``warmup_steps`` to ``lr``, then follows a cosine down to
    ``lr * min_lr_ratio`` at ``total_steps`` (constant after that; with ``total_steps=None`` it stays
    at ``lr``). Gradients are scaled so that their global L2 norm is at most ``max_grad_norm``
    (``None``: no clipping). Weight decay applies to parameters of rank 2 and more, unless
    ``decay_all`` (norm weights and biases are usually left undecayed).
    """

    lr: float = attrs.field(default=1e-3, validator=_positive)
    beta1: float = attrs.field(default=0.9, validator=_fraction)
    beta2: float = attrs.field(default=0.999, validator=_fraction)
    eps: float = attrs.field(default=1e-8, validator=_positive)
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.0
    decay_all: bool = False

    def lr_at(self, step: int) -> float:
        """The learning rate of update number ``step`` (1-based)."""
        if self.warmup_steps and step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if self.total_steps is None:
            return self.lr
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min(max(step - self.warmup_steps, 0) / span, 1.0)
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine)

    def clip_scale(self, grad_norm: float) -> float:
        """The factor applied to every gradient: 1, or ``max_grad_norm / grad_norm`` if that is smaller."""
        if self.max_grad_norm is None or not grad_norm > self.max_grad_norm:
            return 1.0
        return self.max_grad_norm / (grad_norm + 1e-6)


def global_norm(grads: list[np.ndarray]) -> float:
    """The L2 norm of all gradients together (a sum of dot products: no temporary arrays)."""
    total = 0.0
    for g in grads:
        flat = g.reshape(-1)
        total += float(np.dot(flat, flat))
    return math.sqrt(total)


def adamw_update(p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, work: np.ndarray, *, opt: AdamW,
                 step: int, lr: float, scale: float) -> None:
    """One in-place AdamW update of ``p`` from gradient ``scale * g``; ``work`` is scratch of p's size.
    Blocks of the flattened arrays run on the NumPy backend's threads."""
    b1, b2 = opt.beta1, opt.beta2
    bc1, bc2 = 1 - b1**step, 1 - b2**step
    decay = 1 - lr * opt.weight_decay if opt.weight_decay and (opt.decay_all or p.ndim >= 2) else None
    flat = [a.reshape(-1) for a in (p, g, m, v)]
    if any(not np.may_share_memory(f, a) for f, a in zip(flat, (p, g, m, v), strict=True) if a.size):
        raise KilnError("adamw_update needs contiguous parameter, gradient and moment arrays")
    pf, gf, mf, vf = flat
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
        w += opt.eps
        np.divide(m, w, out=w)
        w *= lr / bc1
        if decay is not None:
            p *= decay  # decoupled: the decay does not go through the moments
        p -= w

    parallel(block, flat_blocks(p.size))
