"""IA³ (seed 004 §7.3.2, PEFT's ``IA3``) as a graph pass: learned vectors that rescale projections.

For a projection ``y = x @ W^T`` whose module path ``target_modules`` names, IA³ multiplies the output
rows by a learned vector ``l`` (``y * l``); for one that ``feedforward_modules`` also names, it
multiplies the input instead (``(x * l) @ W^T``), as PEFT's ``IA3Layer`` does. The vectors start at
one (``init_ia3_weights=True``), so the adapted model starts as the base model. Projections are found
as for LoRA (:func:`kiln.peft._lora.resolve`): a weight's LoRA targets with their HF module paths.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from kiln.core.ir import Bundle, Const, DimExpr, Module, Op, ParamSpec, TensorDecl, simplify
from kiln.peft._config import ALL_LINEAR, LoraConfig, _targets
from kiln.peft._errors import AdapterError
from kiln.peft._lora import _PROJECTIONS, PREFIX, _rows, resolve

__all__ = ["IA3Config", "IA3Site", "apply_ia3", "ia3"]


def _matches(targets: str | tuple[str, ...] | None, path: str) -> bool:
    if targets is None:
        return False
    if targets == ALL_LINEAR:
        return True
    if isinstance(targets, str):
        return re.fullmatch(targets, path) is not None
    return any(path == t or path.endswith(f".{t}") for t in targets)


@attrs.frozen(kw_only=True)
class IA3Config:
    """IA³ settings, named and defaulted as in HF PEFT's ``IA3Config``: ``target_modules`` (names, a
    regular expression or ``"all-linear"``, as for :class:`~kiln.peft.LoraConfig`), ``feedforward_modules``
    (those of the targets whose input, not output, is scaled), ``init_ia3_weights`` (True: ones; False:
    standard normal, as PEFT draws them)."""

    target_modules: str | tuple[str, ...] | None = attrs.field(default=None, converter=_targets)
    feedforward_modules: str | tuple[str, ...] | None = attrs.field(default=None, converter=_targets)
    init_ia3_weights: bool = True
    task_type: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.init_ia3_weights not in (True, False):
            raise AdapterError(
                f"init_ia3_weights={self.init_ia3_weights!r} is not valid; expected True or False",
                key="init_ia3_weights",
            )
        if self.task_type not in (None, "CAUSAL_LM"):
            raise AdapterError(
                f"task_type={self.task_type!r} is not valid; expected 'CAUSAL_LM' (or None)", key="task_type"
            )

    def to_dict(self, **extra: Any) -> dict[str, Any]:
        """The ``adapter_config.json`` that PEFT writes for this config (``extra`` fields added)."""

        def listed(t: Any) -> Any:
            return list(t) if isinstance(t, tuple) else t

        return {
            "peft_type": "IA3",
            "task_type": self.task_type or "CAUSAL_LM",
            "target_modules": listed(self.target_modules),
            "feedforward_modules": listed(self.feedforward_modules),
            "init_ia3_weights": self.init_ia3_weights,
            "fan_in_fan_out": False,
            "modules_to_save": None,
            "inference_mode": True,
            **extra,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, file: str | Path | None = None) -> IA3Config:
        """A config from PEFT's ``adapter_config.json`` data (fields that only describe the file are read
        past; ``fan_in_fan_out`` and ``modules_to_save`` must keep their defaults)."""
        for key, default in (("fan_in_fan_out", False), ("modules_to_save", None)):
            if data.get(key, default) not in (default, [], {}):
                raise AdapterError(f"{data[key]!r} is not supported (only {default!r})", file=file, key=key)
        fields = {f.name for f in attrs.fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in fields})
        except AdapterError as exc:
            raise AdapterError(exc.detail, file=file, key=exc.key, hint=exc.hint) from None


@attrs.frozen
class IA3Site:
    """One projection IA³ rescales: rows ``[start, start + size)`` of ``weight`` (target ``target``) in
    every layer of ``stack``; ``feedforward``: its input (``in_features`` wide) is scaled, not its rows."""

    module: str
    stack: str | None
    weight: str
    target: str
    start: int
    size: int
    rows: int
    in_features: int
    feedforward: bool
    paths: tuple[str, ...]

    @property
    def param(self) -> str:
        return f"{self.weight}.{self.target}.ia3_l"

    def key(self, layer: int, _: str = "l") -> str:
        return (f"{self.stack}.{layer}." if self.stack is not None else "") + self.param

    def tensors(self) -> list[tuple[str, str, str]]:
        """Per layer: (kiln key, PEFT file key, "l")."""
        return [(self.key(i), f"{PREFIX}{path}.ia3_l", "l") for i, path in enumerate(self.paths)]

    def shape(self, _: str = "l") -> tuple[int, int]:
        """PEFT's shape of the vector: ``(1, in_features)`` for a feed-forward module, else ``(size, 1)``."""
        return (1, self.in_features) if self.feedforward else (self.size, 1)

    def weight_key(self, layer: int) -> str:
        return f"{self.stack}.{layer}.{self.weight}" if self.stack is not None else self.weight


def apply_ia3(bundle: Bundle, config: IA3Config, *, trainable: bool = True) -> tuple[Bundle, list[IA3Site]]:
    """``bundle`` with ``config``'s IA³ vectors and its base parameters frozen, and the sites adapted."""
    for m in bundle.modules:
        for p in m.params:
            if p.role == "adapter":
                raise AdapterError(
                    f"module {m.name!r} has adapters already",
                    key=p.name,
                    hint="apply the pass to the model without them, or merge them first",
                )
    lora_sites = resolve(bundle, LoraConfig(r=1, target_modules=config.target_modules))
    sites = [
        IA3Site(
            s.module,
            s.stack,
            s.weight,
            s.target,
            s.start,
            s.size,
            s.rows,
            s.in_features,
            _matches(config.feedforward_modules, s.paths[0]),
            s.paths,
        )
        for s in lora_sites
    ]
    if isinstance(config.feedforward_modules, tuple):
        unknown = [
            f
            for f in config.feedforward_modules
            if not any(s.feedforward and _matches((f,), s.paths[0]) for s in sites)
        ]
        if unknown:
            raise AdapterError(
                f"feedforward_modules {unknown} are not among the target modules",
                key="feedforward_modules",
                hint="every feed-forward module is also a target",
            )
    by_module: dict[str, dict[tuple[str, str], IA3Site]] = {}
    for s in sites:
        by_module.setdefault(s.module, {})[(s.weight, s.target)] = s
    modules = []
    for m in bundle.modules:
        m = attrs.evolve(
            m, params=tuple(p if p.array_of is not None else attrs.evolve(p, frozen=True) for p in m.params)
        )
        if m.name in by_module:
            m = _adapt(m, list(by_module[m.name].values()), trainable)
        if m.name == bundle.entry:
            m = attrs.evolve(m, metadata=m.metadata.set(ia3=config.to_dict()))
        modules.append(m)
    return attrs.evolve(bundle, modules=tuple(modules)), sites


def ia3(bundle: Bundle, config: IA3Config | Mapping[str, Any]) -> Bundle:
    """The ``ia3`` graph pass: ``bundle`` with the IA³ vectors ``config`` asks for (an :class:`IA3Config`
    or its ``adapter_config.json`` dict) and every base parameter frozen."""
    if not isinstance(config, IA3Config):
        config = IA3Config.from_dict(config)
    return apply_ia3(bundle, config)[0]


def _adapt(module: Module, sites: list[IA3Site], trainable: bool) -> Module:
    g = module.forward
    if g is None:
        raise AdapterError(f"module {module.name!r} has no forward graph to adapt", key=module.name)
    specs = {p.name: p for p in module.params}
    new_specs, decls = [], []
    by_weight: dict[str, list[IA3Site]] = {}
    for s in sorted(sites, key=lambda s: s.start):
        w = specs[s.weight]
        if s.feedforward and (s.start != 0 or s.size != s.rows):
            raise AdapterError(
                f"{s.paths[0]} is a slice of the fused weight {s.weight!r}: IA³ scales a "
                "feed-forward module's input, which its fused neighbours share",
                key="feedforward_modules",
            )
        shape: tuple[DimExpr, ...] = (w.shape[1],) if s.feedforward else (_rows(w, s.target)[1],)
        new_specs.append(
            ParamSpec(
                s.param,
                shape,
                w.dtype,
                frozen=not trainable,
                role="adapter",
                init={"kind": "ones"},
                description=f"IA3 vector of {s.weight}[{s.target}] ({s.paths[0]})",
            )
        )
        decls.append(TensorDecl(s.param, shape, w.dtype))
        by_weight.setdefault(s.weight, []).append(s)
    ops: list[Op] = []
    adapted: set[str] = set()
    for k, op in enumerate(g.ops):
        reads = [i for i, name in enumerate(op.inputs) if name in by_weight]
        if not reads:
            ops.append(op)
            continue
        weight = op.inputs[reads[0]]
        if op.type not in _PROJECTIONS or reads != [1] or op.attrs.get("transpose") != "NT":
            raise AdapterError(
                f"op #{k} of {module.name!r} ({op}) reads the adapted weight; IA³ adapts only "
                "projections y = x @ W^T (matmul or matmul_bias, transpose NT)",
                key=weight,
            )
        ops += _scale(op, specs[weight], by_weight[weight])
        adapted.add(weight)
    unread = sorted(by_weight.keys() - adapted)
    if unread:
        raise AdapterError(
            f"no matmul of {module.name!r} reads this weight, so it cannot be adapted", key=unread[0]
        )
    forward = attrs.evolve(g, params=(*g.params, *decls), ops=tuple(ops))
    return attrs.evolve(module, params=(*module.params, *new_specs), forward=forward)


def _scale(op: Op, weight: ParamSpec, sites: list[IA3Site]) -> list[Op]:
    """``op`` with its input (feed-forward) or its output rows scaled by each site's vector."""
    x, y = op.inputs[0], op.outputs[0]
    ff = [s for s in sites if s.feedforward]
    if ff:  # the whole weight (checked): scale the input
        scaled = f"{y}.ia3_x"
        return [
            Op("mul", (x, ff[0].param), (scaled,), loc=op.loc),
            attrs.evolve(op, inputs=(scaled, *op.inputs[1:])),
        ]
    base = f"{y}.ia3_base"
    out = [attrs.evolve(op, outputs=(base, *op.outputs[1:]))]
    if len(sites) == 1 and sites[0].start == 0 and sites[0].size == sites[0].rows:
        return [*out, Op("mul", (base, sites[0].param), (y,), loc=op.loc)]
    pieces: list[tuple[DimExpr, IA3Site | None]] = []
    end: DimExpr = Const(0)
    at = 0
    for s in sites:
        start, size = _rows(weight, s.target)
        if s.start > at:
            pieces.append((simplify(start - end), None))
        pieces.append((size, s))
        end, at = simplify(start + size), s.start + s.size
    if at < sites[0].rows:
        pieces.append((simplify(weight.shape[0] - end), None))
    parts = [f"{y}.ia3_part{i}" for i in range(len(pieces))]
    out.append(Op("split", (base,), parts, {"sizes": [d.to_json() for d, _ in pieces], "dim": 1}, loc=op.loc))
    joined = []
    for part, (_, s) in zip(parts, pieces, strict=True):
        if s is not None:
            out.append(Op("mul", (part, s.param), (f"{y}.{s.target}.ia3_out",), loc=op.loc))
            part = f"{y}.{s.target}.ia3_out"
        joined.append(part)
    return [*out, Op("concat", joined, (y,), {"dim": 1}, loc=op.loc)]
