"""``LoraConfig``: HF PEFT's LoRA settings, and their ``adapter_config.json`` form."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from kiln.core.ir import FrozenDict
from kiln.peft._errors import AdapterError

ALL_LINEAR = "all-linear"
#: PEFT fields that describe the file, not the computation: read past.
_IGNORED = {"base_model_name_or_path", "revision", "inference_mode", "auto_mapping", "peft_version",
            "megatron_core", "qalora_group_size", "runtime_config", "ensure_weight_tying"}
#: Every other field kiln does not compute (DoRA, modules_to_save, layers_to_transform...) must hold
#: an empty default (None, False, {}, []): a setting is refused rather than silently dropped.
_DEFAULTS: dict[str, Any] = {"peft_type": "LORA"}
_EMPTY: tuple[Any, ...] = (None, False, {}, [], "")


def _targets(value: Any) -> str | tuple[str, ...] | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (list, tuple, set, frozenset)) and all(isinstance(v, str) for v in value):
        return tuple(sorted(value)) if isinstance(value, (set, frozenset)) else tuple(value)
    raise AdapterError(f"target_modules must be a module name list, a regular expression or "
                       f"{ALL_LINEAR!r}, found {value!r}", key="target_modules")


def _pattern(kind: type, key: str) -> Any:
    def conv(value: Any) -> FrozenDict:
        try:
            return FrozenDict({str(k): kind(v) for k, v in value.items()})
        except (AttributeError, TypeError, ValueError):
            raise AdapterError(f"expected a mapping of module patterns to {kind.__name__}s, found "
                               f"{value!r}", key=key) from None

    return conv


@attrs.frozen(kw_only=True)
class LoraConfig:
    """LoRA settings, named and defaulted as in HF PEFT's ``LoraConfig``.

    ``target_modules``: HF module names (``["q_proj", "v_proj"]``; a name matches a module whose path
    ends with it), a regular expression matched against the whole module path, or ``"all-linear"``
    (every projection the model declares a LoRA target for). ``scaling`` is ``lora_alpha / r``, or
    ``lora_alpha / sqrt(r)`` with ``use_rslora``; ``rank_pattern`` and ``alpha_pattern`` override ``r``
    and ``lora_alpha`` for the modules whose path ends with a key (a regular expression).
    ``init_lora_weights``: True (A Kaiming-uniform, B zero), ``"gaussian"`` (A normal with std 1/r,
    B zero) or False (both as a fresh ``nn.Linear``: the adapter does not start as the identity).
    """

    r: int = 8
    lora_alpha: float = 8
    lora_dropout: float = 0.0
    target_modules: str | tuple[str, ...] | None = attrs.field(default=None, converter=_targets)
    use_rslora: bool = False
    init_lora_weights: bool | str = True
    bias: str = "none"
    rank_pattern: FrozenDict = attrs.field(factory=FrozenDict, converter=_pattern(int, "rank_pattern"))
    alpha_pattern: FrozenDict = attrs.field(factory=FrozenDict, converter=_pattern(float, "alpha_pattern"))
    task_type: str | None = None

    def __attrs_post_init__(self) -> None:
        def bad(key: str, expected: str) -> AdapterError:
            return AdapterError(f"{key}={getattr(self, key)!r} is not valid; expected {expected}", key=key)

        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r <= 0:
            raise bad("r", "a positive int")
        if any(r <= 0 for r in self.rank_pattern.values()):
            raise bad("rank_pattern", "positive ranks")
        if isinstance(self.lora_alpha, bool) or not isinstance(self.lora_alpha, (int, float)) or \
                not math.isfinite(self.lora_alpha):
            raise bad("lora_alpha", "a number")
        if not isinstance(self.lora_dropout, (int, float)) or not 0.0 <= self.lora_dropout < 1.0:
            raise bad("lora_dropout", "a probability in [0, 1)")
        if self.init_lora_weights not in (True, False, "gaussian"):
            raise bad("init_lora_weights", "True, False or 'gaussian' (PEFT's data-driven inits such as "
                      "pissa, olora or loftq are not supported)")
        if self.bias != "none":
            raise bad("bias", "'none': kiln's LoRA adds no bias, and leaves the base biases frozen")
        if self.task_type not in (None, "CAUSAL_LM"):
            raise bad("task_type", "'CAUSAL_LM' (or None)")

    def rank_and_alpha(self, path: str) -> tuple[int, float]:
        """``(r, lora_alpha)`` of the module at ``path``, after ``rank_pattern``/``alpha_pattern``."""
        from kiln.peft._lora import pattern_key

        r = self.rank_pattern.get(pattern_key(self.rank_pattern, path), self.r)
        return r, self.alpha_pattern.get(pattern_key(self.alpha_pattern, path), float(self.lora_alpha))

    def scaling(self, r: int, alpha: float) -> float:
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def to_dict(self, **extra: Any) -> dict[str, Any]:
        """The ``adapter_config.json`` that PEFT writes for this config (``extra`` fields added)."""
        targets = self.target_modules
        return {
            "peft_type": "LORA", "task_type": self.task_type or "CAUSAL_LM", "r": self.r,
            "lora_alpha": self.lora_alpha, "lora_dropout": self.lora_dropout,
            "target_modules": list(targets) if isinstance(targets, tuple) else targets,
            "use_rslora": self.use_rslora, "init_lora_weights": self.init_lora_weights, "bias": self.bias,
            "rank_pattern": dict(self.rank_pattern), "alpha_pattern": dict(self.alpha_pattern),
            "fan_in_fan_out": False, "modules_to_save": None, "use_dora": False, "inference_mode": True,
            **extra,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, file: str | Path | None = None) -> LoraConfig:
        """A config from ``adapter_config.json`` data. PEFT fields that only describe the file are
        read past; a field kiln does not compute (DoRA, ``modules_to_save``, per-layer selection...)
        set to anything but its default is an :class:`AdapterError` naming it."""
        if not isinstance(data, Mapping):
            raise AdapterError(f"expected a JSON object, found {type(data).__name__}", file=file)
        fields = {f.name for f in attrs.fields(cls)}
        for key, value in data.items():
            if key in fields or key in _IGNORED:
                continue
            default = _DEFAULTS.get(key)
            if value != default and not (default in _EMPTY and value in _EMPTY):
                what = f"only {default!r}" if key in _DEFAULTS else "kiln does not compute this PEFT setting"
                raise AdapterError(f"{value!r} is not supported ({what})", file=file, key=key)
        try:
            return cls(**{k: v for k, v in data.items() if k in fields})
        except AdapterError as exc:
            raise AdapterError(exc.detail, file=file, key=exc.key, hint=exc.hint) from None
        except TypeError as exc:
            raise AdapterError(f"a setting has the wrong type: {exc}", file=file) from None
