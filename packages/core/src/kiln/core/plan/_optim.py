"""Optimizers: update rules that ``compile`` emits into a Program's ``optimizer`` phase as ops.

An optimizer is an attrs class registered under a name through ``kiln_register_optimizers`` (core
registers ``adamw`` and ``sgd``). It says which state tensors each trained parameter carries
(``state``: the names torch uses), which op updates a parameter (``update_op``, run by every backend
with its own kernel from the kernel table) and that op's attributes for one parameter, from the
parameter group the parameter falls in. What changes from step to step (the learning rate of the
schedule, the clipping scale from the global gradient norm) is computed on the host between the
``grad_norm`` step and the updates, the same for every optimizer.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import attrs

from kiln.core._errors import KilnError
from kiln.core.ir._ir import PARAM_ROLES as ROLES
from kiln.core.plugins._registry import declare_kind

__all__ = ["HF_TRAINER_GROUPS", "SGD", "AdamW", "Optimizer", "ParamGroup", "make_optimizer"]


#: the learning-rate schedules after warm-up (transformers' ``constant_with_warmup``, ``linear``,
#: ``cosine``; with ``min_lr_ratio``, ``cosine_with_min_lr``)
SCHEDULES = ("cosine", "linear", "constant")


def _positive(_: object, a: attrs.Attribute[float], value: float) -> None:
    if not value > 0:
        raise KilnError(f"{a.name} must be positive, found {value!r}")


def _fraction(_: object, a: attrs.Attribute[float], value: float) -> None:
    if not 0 <= value < 1:
        raise KilnError(f"{a.name} must be in [0, 1), found {value!r}")


def _schedule(_: object, a: attrs.Attribute[str], value: str) -> None:
    if value not in SCHEDULES:
        raise KilnError(f"schedule={value!r} is not one of {', '.join(map(repr, SCHEDULES))}")


def _nonnegative(_: object, a: attrs.Attribute[float], value: float) -> None:
    if not value >= 0:
        raise KilnError(f"{a.name} must be 0 or more, found {value!r}")


def _strs(items: Iterable[str] | str) -> tuple[str, ...]:
    return (items,) if isinstance(items, str) else tuple(items)


def _roles(items: Iterable[str] | str) -> tuple[str, ...]:
    out = _strs(items)
    for r in out:
        if r not in ROLES:
            raise KilnError(f"parameter role {r!r} is not one of {', '.join(ROLES)}")
    return out


@attrs.frozen
class ParamGroup:
    """Parameters chosen by name pattern (``fnmatch`` on kiln's parameter names, e.g.
    ``"blocks.*.attn.*"``) or by role, with their own weight decay and learning-rate scale.

    A parameter belongs to the first group that matches it (by a pattern or a role); parameters no
    group matches use the optimizer's own settings.
    """

    params: tuple[str, ...] = attrs.field(default=(), converter=_strs)
    roles: tuple[str, ...] = attrs.field(default=(), converter=_roles)
    weight_decay: float | None = None  # None: the optimizer's
    lr_scale: float = attrs.field(default=1.0, validator=_nonnegative)

    def matches(self, name: str, role: str) -> bool:
        return role in self.roles or any(fnmatch.fnmatchcase(name, p) for p in self.params)


#: the HF Trainer's default: no weight decay for biases and norm weights (torch's default decays all)
HF_TRAINER_GROUPS = (ParamGroup(roles=("bias", "norm"), weight_decay=0.0),)


def _groups(items: Iterable[ParamGroup | Mapping[str, Any]]) -> tuple[ParamGroup, ...]:
    out = []
    for g in items:
        if isinstance(g, Mapping):
            unknown = sorted(set(g) - {"params", "roles", "weight_decay", "lr_scale"})
            if unknown:
                raise KilnError(f"parameter group key(s) {', '.join(unknown)} unknown; "
                                "a group takes params, roles, weight_decay and lr_scale")
            g = ParamGroup(**g)
        if not isinstance(g, ParamGroup):
            raise KilnError(f"parameter groups must be ParamGroup or dicts, found {type(g).__name__}")
        out.append(g)
    return tuple(out)


@attrs.frozen(kw_only=True)
class Optimizer:
    """What every optimizer shares: the learning-rate schedule, gradient clipping, parameter groups.

    The schedule is transformers' ``get_scheduler`` (as the HF Trainer steps it: update ``t`` uses
    the factor of scheduler step ``t - 1``): the learning rate rises linearly from 0 over
    ``warmup_steps``, then ``schedule`` decides: ``"cosine"`` follows a cosine down to
    ``lr * min_lr_ratio`` at ``total_steps``, ``"linear"`` falls linearly to it, ``"constant"``
    stays at ``lr`` (as do the others with ``total_steps=None``). Gradients are scaled so that their
    global L2 norm is at most ``max_grad_norm`` (``None``: no clipping). ``weight_decay`` is
    decoupled (``p -= lr * wd * p``) and applies to every trained parameter unless a group in
    ``groups`` says otherwise.
    """

    name: ClassVar[str]
    update_op: ClassVar[str]

    lr: float = attrs.field(default=1e-3, validator=_positive)
    weight_decay: float = attrs.field(default=0.0, validator=_nonnegative)
    max_grad_norm: float | None = 1.0
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.0
    schedule: str = attrs.field(default="cosine", validator=_schedule)
    groups: tuple[ParamGroup, ...] = attrs.field(default=(), converter=_groups)

    @property
    def state(self) -> tuple[str, ...]:
        """The state tensors of each trained parameter, each shaped like it."""
        return ()

    def lr_at(self, step: int) -> float:
        """The learning rate of update number ``step`` (1-based)."""
        s, w = step - 1, self.warmup_steps  # the scheduler's step, 0-based
        if s < w:
            return self.lr * s / max(1, w)
        if self.total_steps is None or self.schedule == "constant":
            return self.lr
        progress = min((s - w) / max(1, self.total_steps - w), 1.0)
        decay = 1.0 - progress if self.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * decay)

    def clip_scale(self, grad_norm: float) -> float:
        """The factor applied to every gradient: 1, or ``max_grad_norm / grad_norm`` if that is smaller."""
        if self.max_grad_norm is None or not grad_norm > self.max_grad_norm:
            return 1.0
        return self.max_grad_norm / (grad_norm + 1e-6)

    def group(self, name: str, role: str) -> tuple[float, float]:
        """(weight decay, learning-rate scale) of the parameter ``name`` with ``role``."""
        for g in self.groups:
            if g.matches(name, role):
                return (self.weight_decay if g.weight_decay is None else g.weight_decay), g.lr_scale
        return self.weight_decay, 1.0

    def update_attrs(self, name: str, role: str) -> dict[str, Any]:
        """The attributes of ``update_op`` for one parameter."""
        decay, scale = self.group(name, role)
        return {"weight_decay": decay, "lr_scale": scale}


@attrs.frozen(kw_only=True)
class AdamW(Optimizer):
    """AdamW (decoupled weight decay, bias correction), as ``torch.optim.AdamW``."""

    name: ClassVar[str] = "adamw"
    update_op: ClassVar[str] = "adamw_update"

    beta1: float = attrs.field(default=0.9, validator=_fraction)
    beta2: float = attrs.field(default=0.999, validator=_fraction)
    eps: float = attrs.field(default=1e-8, validator=_positive)

    @property
    def state(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def update_attrs(self, name: str, role: str) -> dict[str, Any]:
        return {**super().update_attrs(name, role), "beta1": self.beta1, "beta2": self.beta2, "eps": self.eps}


@attrs.frozen(kw_only=True)
class SGD(Optimizer):
    """SGD with momentum, dampening and Nesterov momentum, as ``torch.optim.SGD`` (weight decay here
    is decoupled, as in AdamW, unlike torch's L2 term)."""

    name: ClassVar[str] = "sgd"
    update_op: ClassVar[str] = "sgd_update"

    momentum: float = attrs.field(default=0.0, validator=_fraction)
    dampening: float = attrs.field(default=0.0, validator=_fraction)
    nesterov: bool = False

    def __attrs_post_init__(self) -> None:
        if self.nesterov and (self.momentum == 0 or self.dampening != 0):
            raise KilnError("SGD: Nesterov momentum needs momentum > 0 and dampening 0")

    @property
    def state(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum else ()

    def update_attrs(self, name: str, role: str) -> dict[str, Any]:
        return {**super().update_attrs(name, role), "momentum": self.momentum, "dampening": self.dampening,
                "nesterov": self.nesterov}


def make_optimizer(registry: Any, spec: Optimizer | Mapping[str, Any] | str | None) -> Optimizer | None:
    """An optimizer from an instance, a registered name, or a dict ``{"name": ..., **settings}`` (as in
    a TOML ``[optimizer]`` table); None stays None."""
    if spec is None or isinstance(spec, Optimizer):
        return spec
    settings = {"name": spec} if isinstance(spec, str) else dict(spec)
    name = settings.pop("name", "adamw")
    cls = registry[name]  # an unknown name lists the registered ones
    try:
        made = cls(**settings)
    except TypeError as exc:
        fields = ", ".join(a.name for a in attrs.fields(cls))
        raise KilnError(f"optimizer {name!r}: {exc}; it takes {fields}") from None
    if not isinstance(made, Optimizer):
        raise KilnError(f"optimizer {name!r} is a {type(made).__name__}, not a kiln.core.Optimizer")
    return made


declare_kind("optimizers", "kiln_register_optimizers")
