"""LoRA as a graph pass: which projections a :class:`LoraConfig` adapts, and the IR that adapts them.

A projection is a LoRA target a parameter declares (``ParamSpec.lora_targets``): rows ``[start,
start + size)`` of a possibly fused weight, such as ``q`` in ``qkv_weight``. Its HF module path
(``model.layers.3.self_attn.q_proj``) comes from the weight's HF mapping (the target's source of a
``fuse``), else kiln names it (``blocks.3.qkv_weight.q``). ``target_modules`` match those paths as in
PEFT. Every matmul ``y = x @ W^T`` reading an adapted weight gets its LoRA branch,

    y[:, start:start + size] += scaling * (dropout(x) @ A^T) @ B^T

as ordinary forward ops (dropout, matmul, split, concat). A recompute plan replays forward ops, so a
recomputed projection re-applies its LoRA contribution, with the same counter-based dropout mask.
Base weights become frozen: no gradients, no optimizer state.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from kiln.core.ir import (
    Bundle,
    Const,
    DimExpr,
    Module,
    Op,
    ParamSpec,
    TensorDecl,
    dim_bindings,
    simplify,
    thaw,
)
from kiln.peft._config import ALL_LINEAR, LoraConfig
from kiln.peft._errors import AdapterError

PREFIX = "base_model.model."  # PEFT's key prefix for a causal LM (PeftModelForCausalLM -> LoraModel)
_PROJECTIONS = ("matmul", "matmul_bias")


def pattern_key(patterns: Iterable[str], path: str) -> str:
    """PEFT's ``get_pattern_key``: the first pattern matching the end of ``path``, else ``path``."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", path):
            return key
    return path


@attrs.frozen
class Site:
    """One adapted projection of module ``module``: rows ``[start, start + size)`` of the ``rows`` of
    ``weight`` (LoRA target ``target``), in every layer of ``stack`` (None: a model parameter).
    ``paths`` holds the PEFT module path of each layer."""

    module: str
    stack: str | None
    weight: str
    target: str
    start: int
    size: int
    rows: int  # of the whole weight
    in_features: int
    r: int
    alpha: float
    scaling: float
    paths: tuple[str, ...]

    @property
    def params(self) -> tuple[str, str]:
        """The block (or model) parameter names of A and B."""
        return f"{self.weight}.{self.target}.lora_A", f"{self.weight}.{self.target}.lora_B"

    def key(self, layer: int, ab: str) -> str:
        """The kiln parameter key of A or B in ``layer``."""
        return (f"{self.stack}.{layer}." if self.stack is not None else "") + self.params["AB".index(ab)]

    def tensors(self) -> list[tuple[str, str, str]]:
        """Per layer, for A then B: (kiln key, PEFT file key, "A" or "B")."""
        return [(self.key(i, ab), f"{PREFIX}{path}.lora_{ab}.weight", ab)
                for i, path in enumerate(self.paths) for ab in "AB"]

    def shape(self, ab: str) -> tuple[int, int]:
        return (self.r, self.in_features) if ab == "A" else (self.size, self.r)

    def weight_key(self, layer: int) -> str:
        return f"{self.stack}.{layer}.{self.weight}" if self.stack is not None else self.weight


def _template(mapping: Any, j: int, n: int) -> str | None:
    """The HF module path (with its layer placeholder) of LoRA target ``j`` of ``n``: the weight's
    checkpoint key, or its ``j``-th source when the weight fuses one source per target."""
    fused = isinstance(mapping, Mapping) and mapping.get("type") == "fuse"
    if fused and len(mapping.get("sources", ())) == n:
        mapping = mapping["sources"][j]
    elif n != 1:
        return None
    if isinstance(mapping, str) and mapping.removeprefix("?").endswith(".weight"):
        return mapping.removeprefix("?").removesuffix(".weight")
    return None


Candidate = tuple[Module, str | None, list[str], dict[str, int], ParamSpec, Any, str]


def _candidates(bundle: Bundle) -> Iterable[Candidate]:
    """Each weight with LoRA targets: (module, stack, HF layer index of each layer, ints, spec, HF
    mapping, the placeholder a layer index fills)."""
    model = bundle.module(bundle.entry or "")
    ints = dim_bindings(model.config)
    for spec in model.params:
        if spec.tied_to is not None:
            continue
        if spec.array_of is None:
            if spec.lora_targets:
                mapping = thaw(model.hf_mappings.get(spec.name, spec.hf_mapping))
                yield model, None, [""], ints, spec, mapping, ""
            continue
        block = bundle.module(spec.array_of)
        indexed = thaw(model.hf_mappings.get(spec.name)) or {}
        count = spec.count.evaluate(ints) if spec.count is not None else 0
        layers = [str(i) for i in model.hf_layers(spec.name, count) or range(count)]
        maps = indexed.get("mappings") or {}
        for bspec in block.params:
            if bspec.lora_targets:
                yield (block, spec.name, layers, {**ints, **dim_bindings(block.config)}, bspec,
                       maps.get(bspec.name, thaw(bspec.hf_mapping)), indexed.get("index", "{layer}"))


def resolve(bundle: Bundle, config: LoraConfig) -> list[Site]:
    """The projections ``config`` adapts, in parameter order. Raises :class:`AdapterError` naming a
    ``target_modules`` entry that matches no projection, and a selection or rank that differs between
    layers of one stack (a stack runs one block body for all its layers)."""
    targets = config.target_modules
    if targets is None:
        raise AdapterError("no target_modules: name the projections to adapt, or 'all-linear'",
                           key="target_modules", hint=f"this model has {', '.join(_names(bundle))}")
    if isinstance(targets, str) and targets != ALL_LINEAR:
        try:
            regex = re.compile(targets)
        except re.error as exc:
            raise AdapterError(f"{targets!r} is not a regular expression: {exc}",
                               key="target_modules") from None
    used: set[str] = set()

    def hit(path: str) -> bool:
        if targets == ALL_LINEAR:
            return True
        if isinstance(targets, str):
            return regex.fullmatch(path) is not None
        found = [t for t in targets if path == t or path.endswith(f".{t}")]
        used.update(found)
        return bool(found)

    sites: list[Site] = []
    for module, stack, layers, ints, spec, mapping, var in _candidates(bundle):
        if len(spec.shape) != 2:
            raise AdapterError(f"weight {spec.name!r} of {module.name!r} is not a matrix", key=spec.name)
        rows, in_features = (d.evaluate(ints) for d in spec.shape)
        for j, lt in enumerate(spec.lora_targets):
            template = _template(mapping, j, len(spec.lora_targets))
            own = f"{stack}.{{}}.{spec.name}.{lt.name}" if stack is not None else f"{spec.name}.{lt.name}"
            paths = [own.format(i) if template is None else template.replace(var, layer) if var else template
                     for i, layer in enumerate(layers)]
            chosen = [hit(p) for p in paths]
            if not any(chosen):
                continue
            where = f"LoRA target {lt.name!r} of {module.name}.{spec.name} ({paths[0]})"
            ranks = {config.rank_and_alpha(p) for p in paths}
            if not all(chosen) or len(ranks) > 1:
                what = "gives its layers different ranks" if all(chosen) else "selects some of its layers"
                raise AdapterError(f"the config {what}: layers of {stack!r} run one block body, so they are "
                                   "adapted alike", key=where, hint="select all layers of a stack or none")
            if lt.dim != 0:
                raise AdapterError("slices along dim 1 are not supported (LoRA adapts output rows)",
                                   key=where)
            start = lt.start.evaluate(ints)
            size = lt.size.evaluate(ints) if lt.size is not None else rows - start
            if not 0 <= start < start + size <= rows:
                raise AdapterError(f"rows [{start}, {start + size}) are outside the weight's {rows}",
                                   key=where)
            (r, alpha), = ranks
            sites.append(Site(module.name, stack, spec.name, lt.name, start, size, rows, in_features, r,
                              alpha, config.scaling(r, alpha), tuple(paths)))
    if isinstance(targets, tuple):
        unknown = [t for t in targets if t not in used]
        if unknown:
            raise AdapterError(f"target_modules {unknown} match no projection of the model", key=unknown[0],
                               hint=f"this model has {', '.join(_names(bundle))}")
    elif not sites:
        raise AdapterError(f"target_modules {targets!r} match no projection of the model",
                           key="target_modules", hint=f"this model has {', '.join(_names(bundle))}")
    return sites


def _names(bundle: Bundle) -> list[str]:
    """The module names target_modules may list (the last component of each projection's path)."""
    out: dict[str, None] = {}
    for *_, spec, mapping, _ in _candidates(bundle):
        for j, lt in enumerate(spec.lora_targets):
            template = _template(mapping, j, len(spec.lora_targets))
            out[template.rsplit(".", 1)[-1] if template else lt.name] = None
    return list(out)


# ---------------------------------------------------------------------------------------------
# The rewrite


def init_spec(config: LoraConfig, site: Site, ab: str) -> dict[str, Any]:
    """PEFT's initialisation: A Kaiming-uniform (a = sqrt 5, i.e. bound 1/sqrt(fan_in)) or normal with
    std 1/r, B zero; ``init_lora_weights=False``: both as ``nn.Linear`` initialises them."""
    fan_in = site.in_features if ab == "A" else site.r
    if ab == "A" and config.init_lora_weights == "gaussian":
        return {"kind": "normal", "std": 1.0 / site.r}
    if ab == "A" or config.init_lora_weights is False:
        bound = 1.0 / math.sqrt(fan_in)
        return {"kind": "uniform", "low": -bound, "high": bound}
    return {"kind": "zeros"}


def _seed(site: Site) -> int:
    """The dropout seed of a site: fixed by its place in the model, different for every projection."""
    return zlib.crc32(f"{site.module}.{site.weight}.{site.target}".encode())


def apply(bundle: Bundle, config: LoraConfig, *, trainable: bool = True) -> tuple[Bundle, list[Site]]:
    """``bundle`` with ``config``'s LoRA branches and its base parameters frozen, and the sites adapted."""
    for m in bundle.modules:
        for p in m.params:
            if p.role == "adapter":
                raise AdapterError(f"module {m.name!r} has LoRA adapters already", key=p.name,
                                   hint="apply the pass to the model without them, or merge them first")
    sites = resolve(bundle, config)
    by_module: dict[str, dict[tuple[str, str], Site]] = {}
    for s in sites:
        seen = by_module.setdefault(s.module, {})
        other = seen.setdefault((s.weight, s.target), s)
        if (other.r, other.alpha) != (s.r, s.alpha):
            raise AdapterError(f"stacks {other.stack!r} and {s.stack!r} run the same block with different "
                               "ranks", key=f"{s.module}.{s.weight}.{s.target}")
    modules = []
    for m in bundle.modules:
        m = attrs.evolve(m, params=tuple(p if p.array_of is not None else attrs.evolve(p, frozen=True)
                                         for p in m.params))
        if m.name in by_module:
            m = _adapt(m, list(by_module[m.name].values()), config, trainable)
        if m.name == bundle.entry:
            m = attrs.evolve(m, metadata=m.metadata.set(lora=config.to_dict()))
        modules.append(m)
    return attrs.evolve(bundle, modules=tuple(modules)), sites


def lora(bundle: Bundle, config: LoraConfig | Mapping[str, Any]) -> Bundle:
    """The ``lora`` graph pass: ``bundle`` with the LoRA branches ``config`` asks for (a
    :class:`LoraConfig` or its ``adapter_config.json`` dict) and every base parameter frozen."""
    if not isinstance(config, LoraConfig):
        config = LoraConfig.from_dict(config)
    return apply(bundle, config)[0]


def _adapt(module: Module, sites: Sequence[Site], config: LoraConfig, trainable: bool) -> Module:
    g = module.forward
    if g is None:
        raise AdapterError(f"module {module.name!r} has no forward graph to adapt", key=module.name)
    specs = {p.name: p for p in module.params}
    new_specs, decls = [], []
    for s in sites:
        w = specs[s.weight]
        shapes = ((Const(s.r), w.shape[1]), (_rows(w, s.target)[1], Const(s.r)))
        for name, shape, ab in zip(s.params, shapes, "AB", strict=True):
            new_specs.append(ParamSpec(name, shape, w.dtype, frozen=not trainable, role="adapter",
                                       init=init_spec(config, s, ab),
                                       description=f"LoRA {ab} of {s.weight}[{s.target}] ({s.paths[0]})"))
            decls.append(TensorDecl(name, shape, w.dtype))
    by_weight: dict[str, list[Site]] = {}
    for s in sorted(sites, key=lambda s: s.start):
        by_weight.setdefault(s.weight, []).append(s)
    ops: list[Op] = []
    adapted: set[str] = set()
    for k, op in enumerate(g.ops):
        reads = [i for i, name in enumerate(op.inputs) if name in by_weight]
        if not reads:
            ops.append(op)
            continue
        weight = op.inputs[reads[0]]
        plain = op.type == "matmul_bias" or (op.attrs.get("alpha", 1.0) == 1.0 and not any(op.inputs[2:]))
        if op.type not in _PROJECTIONS or reads != [1] or op.attrs.get("transpose") != "NT" or not plain:
            raise AdapterError(f"op #{k} of {module.name!r} ({op}) reads the adapted weight; LoRA adapts "
                               "only projections y = x @ W^T (matmul or matmul_bias, transpose NT)",
                               key=weight)
        ops += _branch(op, specs[weight], by_weight[weight], config.lora_dropout)
        adapted.add(weight)
    unread = sorted(by_weight.keys() - adapted)
    if unread:
        raise AdapterError(f"no matmul of {module.name!r} reads this weight, so it cannot be adapted",
                           key=unread[0])
    forward = attrs.evolve(g, params=(*g.params, *decls), ops=tuple(ops))
    return attrs.evolve(module, params=(*module.params, *new_specs), forward=forward)


def _branch(op: Op, weight: ParamSpec, sites: Sequence[Site], p: float) -> list[Op]:
    """``op`` (its output renamed ``<y>.lora_base``) and the ops adding each site's LoRA term to its rows."""
    x, y = op.inputs[0], op.outputs[0]
    base = f"{y}.lora_base"
    out = [attrs.evolve(op, outputs=(base, *op.outputs[1:]))]
    hidden = {}
    for s in sites:
        xin = x
        if p > 0:
            xin = f"{y}.{s.target}.lora_x"
            out.append(Op("dropout", (x,), (xin,), {"p": float(p), "seed": _seed(s)}, loc=op.loc))
        hidden[s.target] = f"{y}.{s.target}.lora_h"
        out.append(Op("matmul", (xin, s.params[0]), (hidden[s.target],), {"transpose": "NT"}, loc=op.loc))

    def term(s: Site, acc: str, name: str) -> Op:  # name = acc + scaling * h @ B^T, as PEFT adds it
        return Op("matmul", (hidden[s.target], s.params[1], acc), (name,),
                  {"transpose": "NT", "alpha": s.scaling}, loc=op.loc)

    if len(sites) == 1 and sites[0].start == 0 and sites[0].size == sites[0].rows:
        return [*out, term(sites[0], base, y)]
    # the rows of the fused output: adapted slices and the rows between them, in order
    pieces: list[tuple[DimExpr, Site | None]] = []
    end: DimExpr = Const(0)
    at = 0
    for s in sites:
        if s.start < at:
            raise AdapterError(f"LoRA targets of {weight.name!r} overlap at row {s.start}", key=weight.name)
        start, size = _rows(weight, s.target)
        if s.start > at:
            pieces.append((simplify(start - end), None))
        pieces.append((size, s))
        end, at = simplify(start + size), s.start + s.size
    if at < sites[0].rows:
        pieces.append((simplify(weight.shape[0] - end), None))
    parts = [f"{y}.lora_part{i}" for i in range(len(pieces))]
    out.append(Op("split", (base,), parts, {"sizes": [d.to_json() for d, _ in pieces], "dim": 1}, loc=op.loc))
    joined = []
    for part, (_, adapted) in zip(parts, pieces, strict=True):
        if adapted is not None:
            out.append(term(adapted, part, f"{y}.{adapted.target}.lora_out"))
            part = f"{y}.{adapted.target}.lora_out"
        joined.append(part)
    return [*out, Op("concat", joined, (y,), {"dim": 1}, loc=op.loc)]



def _rows(weight: ParamSpec, target: str) -> tuple[DimExpr, DimExpr]:
    """Start and size of a LoRA target's rows, in the weight's symbols (no size: to the last row)."""
    lt = next(t for t in weight.lora_targets if t.name == target)
    return lt.start, lt.size if lt.size is not None else simplify(weight.shape[0] - lt.start)
