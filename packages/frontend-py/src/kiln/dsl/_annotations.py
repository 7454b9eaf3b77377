"""Seed 004 §7 annotations in the Python DSL.

An annotation is written where the seed writes it, with Python's ``@`` operator after the thing it
annotates, or as a class decorator for a whole module::

    qkv = g.matmul(x, "qkv_weight", transpose="NT") @ hook("AfterQKVProjection", mode="modify")
    weight = Param(Tensor["O", "C"]) @ shard("column") @ frozen

    @checkpoint
    @block
    class Layer: ...

Each factory checks its arguments when it is called (E008 for an unknown argument or value, E015
for an unknown dtype, E013 for an unknown fusion pattern), with the user's ``file:line``. The
compiler checks where it is attached (``applies_to``) and the names it refers to, and carries it
in ``Module.annotations``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kiln.core.ir import DTYPES
from kiln.dsl._errors import error, user_location

__all__ = ["ANNOTATIONS", "AnnotationFactory", "AnnotationValue", "annotation_kinds", "check_condition_text"]

_REQUIRED = object()


@attrs.frozen
class _Arg:
    kind: str  # str | int | float | bool | enum | dtype | strs | pair
    default: Any = None
    choices: tuple[str, ...] = ()


@attrs.frozen
class _Spec:
    name: str
    positional: tuple[str, ...]
    args: Mapping[str, _Arg]
    applies_to: tuple[str, ...]
    doc: str


def _a(kind: str, default: Any = None, choices: tuple[str, ...] = ()) -> _Arg:
    return _Arg(kind, default, choices)


_DT = tuple(DTYPES)
#: the fusion patterns of seed 004 §7.5.1
FUSION_PATTERNS = (
    "residual_norm",
    "norm_linear",
    "gated_mlp",
    "attention_softmax",
    "bias_activation",
    "linear_bias_act",
)
#: the hook points of seed 004 §7.3.1; a hook may also name a point of its own
HOOK_POINTS = (
    "AfterEmbedding",
    "AfterQKVProjection",
    "AfterQKNorm",
    "BeforeAttention",
    "AfterAttention",
    "AfterAttnOutProjection",
    "BeforeResidualAdd",
    "AfterResidualAdd",
    "AfterMLPUpProjection",
    "AfterMLPActivation",
    "AfterMLPDownProjection",
    "AfterRouterProjection",
    "BeforeExpertCompute",
    "AfterExpertCompute",
    "BeforeLMHead",
    "AfterLMHead",
)

_SPECS = [
    _Spec(
        "memory",
        ("mode",),
        {
            "mode": _a("enum", _REQUIRED, ("save", "recompute", "temporary", "pin", "offload", "stream")),
            "priority": _a("int", 0),
            "prefetch": _a("bool", True),
            "async": _a("bool", True),
        },
        ("tensor", "param"),
        "the memory lifecycle of a tensor: save, recompute, temporary, pin, offload, stream",
    ),
    _Spec(
        "checkpoint",
        ("granularity",),
        {"granularity": _a("enum", "full", ("full", "selective", "none")), "preserve": _a("strs", ())},
        ("tensor", "module"),
        "activation checkpointing: recompute in backward instead of saving",
    ),
    _Spec(
        "lifetime",
        ("scope",),
        {
            "scope": _a("enum", "operation", ("operation", "sublayer", "block", "layer", "global")),
            "start": _a("str"),
            "end": _a("str"),
        },
        ("tensor",),
        "the lifetime scope of a tensor (buffer aliasing)",
    ),
    _Spec(
        "hook",
        ("point", "mode"),
        {
            "point": _a("str", _REQUIRED),
            "mode": _a("enum", "observe", ("observe", "modify", "replace")),
            "priority": _a("int", 0),
        },
        ("tensor",),
        "a named hook point that Python callbacks attach to at run time",
    ),
    _Spec(
        "adapter",
        ("type",),
        {
            "type": _a("enum", _REQUIRED, ("lora", "ia3", "prefix", "prompt", "adapter")),
            "rank": _a("int", 16),
            "alpha": _a("float", 32.0),
            "dropout": _a("float", 0.0),
            "targets": _a("strs", ()),
            "length": _a("int", 10),
            "hidden_dim": _a("int"),
            "bottleneck_dim": _a("int", 64),
            "activation": _a("enum", "relu", ("relu", "gelu", "silu")),
        },
        ("tensor", "param"),
        "an adapter injection point (LoRA, IA3, ...)",
    ),
    _Spec(
        "probe",
        ("name",),
        {
            "name": _a("str", _REQUIRED),
            "capture": _a(
                "enum", "stats", ("stats", "histogram", "sample", "full", "grad_stats", "grad_full")
            ),
            "condition": _a("str"),
            "frequency": _a("int", 1),
        },
        ("tensor",),
        "capture statistics or values of a tensor at run time",
    ),
    _Spec("dtype", ("type",), {"type": _a("dtype", _REQUIRED)}, ("tensor", "param"), "the dtype of a tensor"),
    _Spec(
        "precision",
        (),
        {
            "compute": _a("dtype"),
            "accumulate": _a("dtype", "fp32"),
            "output": _a("dtype"),
            "storage": _a("dtype"),
            "policy": _a("enum", None, ("fp32", "bf16", "fp16", "fp8_hybrid", "fp8_pure", "fp4")),
        },
        ("tensor", "param", "module"),
        "compute, accumulation, output and storage dtypes of an op",
    ),
    _Spec(
        "scaling",
        ("strategy",),
        {
            "strategy": _a(
                "enum",
                _REQUIRED,
                ("per_tensor", "per_channel", "per_token", "per_block", "delayed", "dynamic"),
            ),
            "history_len": _a("int", 16),
            "update_interval": _a("int", 1),
            "block_size": _a("pair", (32, 32)),
            "margin": _a("float", 0.0),
        },
        ("tensor", "param"),
        "the quantization scaling strategy of FP8/FP4 tensors",
    ),
    _Spec(
        "fuse",
        ("pattern",),
        {"pattern": _a("str"), "ops": _a("strs"), "scope": _a("enum", "local", ("local", "global"))},
        ("tensor", "module"),
        "a kernel fusion hint",
    ),
    _Spec("nofuse", ("reason",), {"reason": _a("str")}, ("tensor", "module"), "never fuse this op"),
    _Spec(
        "kernel",
        ("name",),
        {
            "name": _a("str", _REQUIRED),
            "autotune": _a("bool", True),
            "workspace": _a("int"),
            "fallback": _a("bool", True),
        },
        ("tensor",),
        "the kernel that runs the op producing the tensor",
    ),
    _Spec(
        "shard",
        ("strategy",),
        {
            "strategy": _a(
                "enum", _REQUIRED, ("column", "row", "replicated", "expert", "sequence", "batch", "head")
            ),
            "tp_size": _a("int"),
            "ep_size": _a("int"),
            "pp_size": _a("int"),
            "async_comm": _a("bool", True),
            "reduce_scatter": _a("bool", True),
        },
        ("param", "tensor"),
        "how a tensor is partitioned across devices",
    ),
    _Spec(
        "partition",
        ("stage",),
        {"stage": _a("int", _REQUIRED), "micro_batch": _a("bool", True), "recompute": _a("bool", False)},
        ("tensor", "module"),
        "the pipeline stage that computes the tensor (or the module)",
    ),
    _Spec(
        "comm",
        ("op",),
        {
            "op": _a(
                "enum",
                _REQUIRED,
                ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv", "broadcast"),
            ),
            "group": _a("str", "default"),
            "async": _a("bool", True),
            "bucket_size": _a("int"),
        },
        ("tensor",),
        "an explicit collective on the tensor",
    ),
    _Spec(
        "assert",
        ("condition",),
        {"condition": _a("str", _REQUIRED), "message": _a("str"), "enabled": _a("bool", True)},
        ("tensor",),
        "a condition checked at run time",
    ),
    _Spec(
        "profile",
        ("name",),
        {
            "name": _a("str", _REQUIRED),
            "memory": _a("bool", False),
            "cuda_events": _a("bool", True),
            "nvtx": _a("bool", True),
        },
        ("tensor", "module"),
        "time the op (or every op of the module)",
    ),
    _Spec(
        "trace",
        ("level",),
        {"level": _a("enum", "ops", ("ops", "tensors", "values"))},
        ("tensor", "module"),
        "print each op as it runs",
    ),
    _Spec("frozen", (), {}, ("param", "module"), "a parameter that is never trained"),
    _Spec(
        "trainable",
        (),
        {"lr_scale": _a("float", 1.0), "wd_scale": _a("float", 1.0), "grad_clip": _a("float")},
        ("param", "module"),
        "a parameter that is trained (overrides @frozen of its module)",
    ),
    _Spec(
        "gradient",
        ("mode",),
        {
            "mode": _a("enum", "compute", ("compute", "skip", "accumulate", "checkpoint")),
            "scale": _a("float", 1.0),
            "clip": _a("float"),
        },
        ("param", "tensor"),
        "gradient scaling and clipping of a parameter",
    ),
]
ANNOTATIONS: dict[str, _Spec] = {s.name: s for s in _SPECS}


def annotation_kinds() -> tuple[str, ...]:
    return tuple(ANNOTATIONS)


def _value(spec: _Spec, key: str, arg: _Arg, value: Any, loc: str | None) -> Any:
    def bad(expected: str, code: str = "E008") -> Any:
        raise error(
            code,
            f"@{spec.name}: {key}={value!r} is not valid; expected {expected}",
            f"@{spec.name} takes {', '.join(spec.args) or 'no arguments'}",
            loc,
        )

    if value is None and arg.default is not _REQUIRED and arg.kind != "bool":
        return None
    if arg.kind == "str":
        return value if isinstance(value, str) and value else bad("a non-empty string")
    if arg.kind == "int":
        return (
            value
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0
            else bad("an int >= 0")
        )
    if arg.kind == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
        return float(value) if ok else bad("a number")
    if arg.kind == "bool":
        return value if isinstance(value, bool) else bad("True or False")
    if arg.kind == "enum":
        return value if value in arg.choices else bad("one of " + ", ".join(arg.choices))
    if arg.kind == "dtype":
        return value if value in DTYPES else bad("a dtype: " + ", ".join(_DT), "E015")
    if arg.kind == "strs":
        items = [value] if isinstance(value, str) else value
        if isinstance(items, (list, tuple)) and all(isinstance(v, str) and v for v in items):
            return list(items)
        return bad("a list of names")
    if arg.kind == "pair":
        if (
            isinstance(value, (list, tuple))
            and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
        ):
            return list(value)
        return bad("two positive ints, e.g. (32, 32)")
    raise AssertionError(arg.kind)


class AnnotationValue:
    """One annotation with checked arguments: ``kind`` and ``args`` (what differs from the defaults is
    kept; the defaults are those of the seed). Use it after ``@`` on a tensor or a ``Param``, or as a
    class decorator."""

    __slots__ = ("args", "kind", "loc")

    def __init__(self, kind: str, args: dict[str, Any], loc: str | None) -> None:
        self.kind, self.args, self.loc = kind, args, loc

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.args.items())
        return f"@{self.kind}({args})" if args else f"@{self.kind}"

    def __call__(self, cls: Any) -> Any:
        """As a class decorator: annotate the module."""
        return _decorate(self, cls)

    def __rmatmul__(self, other: Any) -> Any:
        return _attach(other, self)

    def value(self, key: str) -> Any:
        """The argument, or the seed's default."""
        arg = ANNOTATIONS[self.kind].args[key]
        return self.args.get(key, None if arg.default is _REQUIRED else arg.default)


class AnnotationFactory:
    """``memory("recompute")``, ``hook("AfterAttention", mode="modify")``; the factory itself is the
    annotation with its defaults (``@checkpoint``, ``x @ frozen``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        spec = ANNOTATIONS[kind]
        self.__doc__ = (
            f"``@{kind}``: {spec.doc} (seed 004 §7). Arguments: " + (", ".join(spec.args) or "none") + "."
        )
        self.__name__ = kind if kind != "assert" else "assert_"

    def __repr__(self) -> str:
        return f"<annotation @{self.kind}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and isinstance(args[0], type):
            return _decorate(self.make((), {}, user_location()), args[0])
        return self.make(args, kwargs, user_location())

    def __rmatmul__(self, other: Any) -> Any:
        return _attach(other, self.make((), {}, user_location()))

    def make(self, args: tuple[Any, ...], kwargs: dict[str, Any], loc: str | None) -> AnnotationValue:
        spec = ANNOTATIONS[self.kind]
        if len(args) > len(spec.positional):
            raise error(
                "E008",
                f"@{self.kind} takes at most {len(spec.positional)} positional argument(s) "
                f"({', '.join(spec.positional) or 'none'}), found {len(args)}",
                f"@{self.kind} takes {', '.join(spec.args) or 'no arguments'}",
                loc,
            )
        given = dict(zip(spec.positional, args, strict=False))
        for k, v in kwargs.items():
            key = k.rstrip("_")  # async_= for the seed's async
            if key not in spec.args:
                raise error(
                    "E008",
                    f"@{self.kind} has no argument {k!r}",
                    f"@{self.kind} takes {', '.join(spec.args) or 'no arguments'}",
                    loc,
                )
            if key in given:
                raise error("E008", f"@{self.kind}: {key} given twice", "pass it once", loc)
            given[key] = v
        out: dict[str, Any] = {}
        for key, arg in spec.args.items():
            if key not in given:
                if arg.default is _REQUIRED:
                    raise error("E008", f"@{self.kind} needs {key}", f"e.g. @{self.kind}({key}=...)", loc)
                continue
            value = _value(spec, key, arg, given[key], loc)
            if value is not None and value != (
                list(arg.default) if isinstance(arg.default, tuple) else arg.default
            ):
                out[key] = value
        _check_semantics(self.kind, out, loc)
        return AnnotationValue(self.kind, out, loc)


def _check_semantics(kind: str, args: dict[str, Any], loc: str | None) -> None:
    if kind == "fuse":
        pattern = args.get("pattern")
        if pattern is not None and pattern not in FUSION_PATTERNS:
            raise error(
                "E013",
                f"@fuse: unknown fusion pattern {pattern!r}",
                f"patterns: {', '.join(FUSION_PATTERNS)}; or list the ops: @fuse(ops=[...])",
                loc,
            )
        if pattern is None and not args.get("ops") and args.get("scope") != "global":
            raise error(
                "E013",
                "@fuse needs a pattern, an ops list or scope='global'",
                'e.g. @fuse("residual_norm") or @fuse(ops=["matmul", "add", "silu"])',
                loc,
            )
    if kind == "checkpoint" and args.get("preserve") and args.get("granularity") == "none":
        raise error(
            "E008",
            "@checkpoint(granularity='none') preserves everything: preserve= has no meaning",
            "drop preserve= or use granularity='full'",
            loc,
        )
    if kind == "assert":
        check_condition_text(args["condition"], loc)
    if kind == "probe" and args.get("frequency", 1) < 1:
        raise error("E008", "@probe: frequency must be 1 or more", "capture every N steps: frequency=N", loc)
    if kind == "lifetime" and "scope" in args and ("start" in args or "end" in args):
        raise error(
            "E008", "@lifetime takes a scope or start/end, not both", "e.g. @lifetime(end='op3')", loc
        )


# --- attaching ------------------------------------------------------------------------------------


def _attach(target: Any, ann: AnnotationValue) -> Any:
    from kiln.dsl._builder import GraphRef
    from kiln.dsl._decorators import Param

    if isinstance(target, GraphRef):
        target.builder.annotate(target, ann)
        return target
    if isinstance(target, Param):
        target.annotations = (*target.annotations, ann)
        return target
    if isinstance(target, (tuple, list)) and target and all(isinstance(t, GraphRef) for t in target):
        for t in target:
            t.builder.annotate(t, ann)
        return target
    raise error(
        "E008",
        f"@{ann.kind} cannot annotate {type(target).__name__} {target!r:.60}",
        "annotate a tensor of the graph, a Param(...) or (as a class decorator) a module",
        ann.loc,
    )


def _decorate(ann: AnnotationValue, cls: Any) -> Any:
    if not isinstance(cls, type):
        raise error(
            "E008",
            f"@{ann.kind} as a decorator annotates a class, found {type(cls).__name__}",
            "put it above @module, @block or @model",
            ann.loc,
        )
    own = cls.__dict__.get("__kiln_annotations__", ())
    cls.__kiln_annotations__ = (ann, *own)  # decorators apply bottom-up: keep source order
    return cls


# --- @assert conditions -----------------------------------------------------------------------------


def check_condition_text(text: str, loc: str | None) -> None:
    """E026 unless ``text`` is a condition the run time can check (see ``kiln.core.runtime``)."""
    from kiln.core import KilnError
    from kiln.core.runtime import check_expression

    try:
        check_expression(text)
    except KilnError as exc:
        raise error("E026", exc.message, exc.hint, loc) from None


# --- compiling: check, carry, and map onto the planner's inputs ----------------------------------


def _short(loc: str | None) -> str | None:
    from kiln.dsl._builder import _short as short

    return short(loc)


def param_annotations(spec: Any, p: Any, full: str) -> tuple[list[Any], bool]:
    """The IR annotations of parameter ``p`` (named ``full`` in the module being compiled) and whether
    it is frozen: ``Param(frozen=True)``, ``@ frozen``, or ``@frozen`` on its class without
    ``@ trainable`` on the parameter."""
    from kiln.core.ir import Annotation

    out = []
    for ann in p.annotations:
        if "param" not in ANNOTATIONS[ann.kind].applies_to:
            where = " or ".join(ANNOTATIONS[ann.kind].applies_to)
            raise error(
                "E008",
                f"@{ann.kind} annotates a {where}, not a parameter ({spec.name}.{p.name})",
                f"write it on a {where}",
                ann.loc,
            )
        out.append(Annotation(ann.kind, "param", full, ann.args, _short(ann.loc)))
    kinds = {a.kind for a in p.annotations}
    module_frozen = any(a.kind == "frozen" for a in spec.annotations)
    if "frozen" in kinds and "trainable" in kinds:
        loc = next(a.loc for a in p.annotations if a.kind == "trainable")
        raise error(
            "E008",
            f"parameter {spec.name}.{p.name} is annotated both @frozen and @trainable",
            "keep one of them",
            loc,
        )
    skipped = any(a.kind == "gradient" and a.args.get("mode") == "skip" for a in p.annotations)
    frozen = bool(p.frozen) or "frozen" in kinds or skipped or (module_frozen and "trainable" not in kinds)
    return out, frozen


def adapter_targets(spec: Any, params: list[Any], annotations: list[Any]) -> list[Any]:
    """``@adapter("lora" | "ia3")`` on a weight: the weight is LoRA-targetable (``ParamSpec.lora_targets``;
    one target over all its rows, named like it, unless it declares its own); ``targets=`` must name
    declared targets (E002)."""
    from kiln.core.ir import LoraTarget

    wanted = {
        a.target: a for a in annotations if a.kind == "adapter" and a.args.get("type") in ("lora", "ia3")
    }
    out = []
    for p in params:
        a = wanted.get(p.name)
        if a is not None:
            names = [t.name for t in p.lora_targets]
            unknown = [t for t in a.args.get("targets", ()) if t not in names]
            if unknown:
                raise error(
                    "E002",
                    f"@adapter targets {unknown} of {spec.name}.{p.name}: not LoRA targets of the weight",
                    f"declare them: Param(..., lora_targets=[...]); it has {', '.join(names) or 'none'}",
                    a.loc,
                )
            if len(p.shape) != 2:
                raise error(
                    "E008",
                    f"@adapter('lora') on {spec.name}.{p.name}: LoRA adapts a matrix, the "
                    f"parameter has {len(p.shape)} dimensions",
                    "annotate a projection's weight",
                    a.loc,
                )
            if not p.lora_targets:
                p = p.evolve(lora_targets=[LoraTarget(p.name.rpartition(".")[2])])
        out.append(p)
    return out


def module_annotations(spec: Any, prefix: str = "") -> list[Any]:
    from kiln.core.ir import Annotation

    out = []
    for ann in spec.annotations:
        if "module" not in ANNOTATIONS[ann.kind].applies_to:
            where = " or ".join(ANNOTATIONS[ann.kind].applies_to)
            raise error(
                "E008",
                f"@{ann.kind} annotates a {where}, not a module ({spec.name})",
                f"write it on a {where}",
                ann.loc,
            )
        out.append(Annotation(ann.kind, "module", prefix.rstrip("."), ann.args, _short(ann.loc)))
    return out


def resolve(
    spec: Any,
    state: Any,
    ops: list[Any],
    kind: str,
    inputs: list[str],
    outputs: list[str],
    save: list[str],
    recompute: list[str],
) -> tuple[list[Any], list[str], list[str]]:
    """Carry the annotations of one compiled graph and apply the memory precedence of seed 004 §7.2.0
    to its save and recompute lists (highest first): ``@memory`` on a tensor; the ``preserve`` list of a
    ``@checkpoint``; ``@checkpoint`` regions (a module, an inlined call's result, an op's result); the
    ``save`` list; the ``recompute`` list. Returns (annotations, save, recompute)."""
    from kiln.core import op_registry
    from kiln.core.ir import Annotation

    produced = [o for op in ops for o in op.outputs if o]
    known = set(produced) | set(inputs)
    tensor_anns = [(ref.name, ann) for ref, ann in state.annotations]
    out = [*module_annotations(spec)]
    out += [
        Annotation(ann.kind, "module", prefix.rstrip("."), ann.args, _short(ann.loc))
        for prefix, ann in state.module_annotations
    ]
    for name, ann in tensor_anns:
        out.append(Annotation(ann.kind, "tensor", name, ann.args, _short(ann.loc)))

    def check_name(name: str, what: str, loc: str | None) -> None:
        if name not in known:
            raise error(
                "E002",
                f"{what} names {name!r}, which is not a tensor of {spec.name}'s graph",
                f"tensors: {', '.join(produced[:12])}{', ...' if len(produced) > 12 else ''}",
                loc,
            )

    registry = op_registry()
    producer = {o: op for op in ops for o in op.outputs if o}
    position = {**{n: -1 for n in inputs}, **{o: i for i, op in enumerate(ops) for o in op.outputs if o}}
    stages: dict[str, int] = {}
    for name, ann in tensor_anns:
        if ann.kind == "lifetime":
            for key in ("start", "end"):
                if key in ann.args:
                    other = ann.args[key]
                    check_name(other, f"@lifetime({key}=...)", ann.loc)
                    at, mine = position.get(other, -1), position.get(name, -1)
                    if (key == "start" and at > mine) or (key == "end" and at < mine):
                        raise error(
                            "E008",
                            f"@lifetime({key}={other!r}) on {name!r}: {other!r} is computed "
                            f"{'after' if key == 'start' else 'before'} {name!r}",
                            "start= names a tensor computed earlier, end= one computed later",
                            ann.loc,
                        )
        if ann.kind == "hook" and ann.value("mode") != "observe":
            op = producer.get(name)
            if op is not None and op.type in registry and registry.get_op(op.type).alias:
                raise error(
                    "E008",
                    f"@hook(mode={ann.value('mode')!r}) on {name!r}: {op.type} makes a view that "
                    "shares its input's storage, and a hook that changes it would change that input too",
                    f"hook the tensor the {op.type} reads, or copy it first (g.copy)",
                    ann.loc,
                )
        if ann.kind == "partition":
            stages[name] = ann.args["stage"]

    # the precedence ladder, lowest first: each level overrides the ones before it
    decision: dict[str, str] = {}
    for n in recompute:
        decision[n] = "recompute"
    for n in save:
        decision[n] = "save"
    regions: list[tuple[list[str], Any]] = []
    for ann in spec.annotations:
        if ann.kind == "checkpoint":  # the graph's outputs are the next layer's inputs: kept
            regions.append(([n for n in produced if n not in outputs], ann))
    for prefix, ann in state.module_annotations:
        if ann.kind == "checkpoint":
            regions.append(([n for n in produced if n.startswith(prefix)], ann))
    for ref, ann in state.annotations:
        if ann.kind == "checkpoint" and ref.producer is not None and ops[ref.producer].type == "call":
            # a StackedBlocks call: checkpoint the block it repeats (every layer, every call of it)
            state.block_checkpoints.append((str(ops[ref.producer].attrs["module"]), ann))
        elif ann.kind == "checkpoint":
            start, end, _ = state.regions.get(id(ref), (None, None, ""))
            names = [o for op in ops[start:end] for o in op.outputs if o] if start is not None else [ref.name]
            regions.append((names, ann))
    for names, ann in regions:
        spanned = {stages[n] for n in names if n in stages}
        if len(spanned) > 1:
            raise error(
                "E025",
                f"@checkpoint spans pipeline stages {sorted(spanned)}",
                "checkpoint boundaries must align with @partition stages: one checkpoint per stage",
                ann.loc,
            )
        granularity = ann.value("granularity")
        if granularity != "selective":
            for n in names:
                decision[n] = "recompute" if granularity == "full" else "save"
    for _, ann in regions:
        for n in ann.value("preserve"):
            check_name(n, "@checkpoint(preserve=...)", ann.loc)
            decision[n] = "save"
    for name, ann in tensor_anns:  # temporary: freed after its consumers, so the backward replays it
        if ann.kind == "memory" and ann.value("mode") in ("save", "recompute", "temporary"):
            decision[name] = "save" if ann.value("mode") == "save" else "recompute"
    wanted = [n for n, d in decision.items() if d == "recompute"]
    if wanted and (kind == "model" or any(n in inputs for n in wanted)):
        first = next(n for n in wanted)
        loc = next(
            (a.loc for n, a in tensor_anns if n == first and a.kind in ("memory", "checkpoint")),
            next((a.loc for a in spec.annotations if a.kind == "checkpoint"), None),
        )
        if any(n in inputs for n in wanted):
            bad = next(n for n in wanted if n in inputs)
            raise error(
                "E021",
                f"{spec.name}: {bad!r} is marked for recompute but is an input of the graph: "
                "nothing in the graph computes it",
                "recompute tensors the forward computes",
                loc,
            )
        if regions or any(a.kind == "memory" and a.value("mode") in ("recompute", "temporary")
                          for _, a in tensor_anns):
            raise error(
                "E021",
                f"{spec.name}: {first!r} is marked for recompute in a @model graph; kiln "
                "recomputes inside blocks only (the backward of each layer replays its block)",
                "put @checkpoint on the @block class or on the result of its StackedBlocks call, or "
                "@memory('recompute') on a tensor of its forward",
                loc,
            )
    order = {n: i for i, n in enumerate([*inputs, *produced])}
    new_save = sorted((n for n, d in decision.items() if d == "save"), key=lambda n: order.get(n, len(order)))
    new_rec = sorted(
        (n for n, d in decision.items() if d == "recompute"), key=lambda n: order.get(n, len(order))
    )
    if not any(a.kind == "memory" for _, a in tensor_anns) and not regions:
        return out, save, recompute  # nothing to resolve: keep the lists as written
    return out, new_save, new_rec


#: the @fuse patterns kiln rewrites into one op: pattern -> (op sequence, the fused op)
FUSIONS = {"residual_norm": (("add", "rmsnorm"), "fused_residual_rmsnorm"),
           "gated_mlp": (("silu", "mul"), "silu_mul")}


def _fusion_name(ann: Any) -> str | None:
    listed = tuple(ann.args.get("ops", ()))
    return ann.args.get("pattern") or next((p for p, (seq, _) in FUSIONS.items() if seq == listed), None)


def apply_fusions(spec: Any, state: Any, ops: list[Any], save: list[str], recompute: list[str]) -> list[Any]:
    """``@fuse`` (seed 004 §7.5.1): ops become the fused op of the library that computes the same
    thing, a rewrite kiln does not do by default. ``residual_norm`` (or ``ops=["add", "rmsnorm"]``)
    makes ``y = rmsnorm(a + b, w)`` one ``fused_residual_rmsnorm(a, b, w)`` (its residual output keeps
    the sum's name); ``gated_mlp`` (or ``ops=["silu", "mul"]``) makes ``silu(gate) * up`` one
    ``silu_mul(gate, up)``. On a tensor: the ops computing it, E013 when they cannot be fused; on a
    module (or an inlined submodule): every place of its graph where they can, E013 when there is none.
    The other patterns of the seed are advisory and carried (kiln has no kernel for them)."""
    from kiln.core.ir import Op

    wanted: list[tuple[str | None, str, Any, str]] = []  # (tensor or None, prefix of a module, ann, pattern)
    for ref, ann in state.annotations:
        if ann.kind == "fuse" and _fusion_name(ann) in FUSIONS:
            wanted.append((ref.name, "", ann, str(_fusion_name(ann))))
    for prefix, ann in [*(("", a) for a in spec.annotations), *state.module_annotations]:
        if ann.kind == "fuse" and _fusion_name(ann) in FUSIONS:
            wanted.append((None, prefix, ann, str(_fusion_name(ann))))
    if not wanted:
        return ops
    producer = {o: i for i, op in enumerate(ops) for o in op.outputs if o}
    readers: dict[str, int] = {}
    for op in ops:
        for n in op.inputs:
            readers[n] = readers.get(n, 0) + 1
    out: list[Any] = list(ops)
    used: set[int] = set()

    def fuse_at(i: int, name: str, ann: Any, target: str) -> str | None:
        """Fuse the ops ending at ``ops[i]``; or why not."""
        (first_type, last_type), fused = FUSIONS[name]
        last = ops[i]
        j = producer.get(last.inputs[0]) if last.inputs else None
        if name == "gated_mlp" and last.type == "mul":
            j = next((producer[n] for n in last.inputs if n in producer and ops[producer[n]].type == "silu"),
                     None)
        first = ops[j] if j is not None else None
        if first is None or last.type != last_type or first.type != first_type or target != last.outputs[0]:
            got = last.type + (f" of {first.type}" if first is not None else "")
            return f"it is computed by {got}, not {last_type} of {first_type}"
        assert j is not None
        if {i, j} & used:
            return "its ops are fused already"
        mid = first.outputs[0]
        if name == "residual_norm":
            shapes = {str(r.type.shape) for _, ins, outs, _, _ in state.ops if outs and outs[0].name == mid
                      for r in ins if r is not None}
            if len(shapes) != 1:
                return f"the add broadcasts ({' + '.join(sorted(shapes))}); the fused op adds one shape"
            new = Op(fused, [*first.inputs, last.inputs[1]], [mid, *last.outputs], dict(last.attrs),
                     loc=last.loc)
            at, gone = j, i  # at the add: readers of the sum between the two still find it there
        else:
            if readers.get(mid, 0) != 1 or mid in save or mid in recompute:
                return f"silu's output {mid!r} is read elsewhere, so the fused op cannot drop it"
            up = next(n for n in last.inputs if n != mid)
            new = Op(fused, [first.inputs[0], up], list(last.outputs), {}, loc=last.loc)
            at, gone = i, j
        dropped = {o for o in ops[gone].outputs if o} - set(new.outputs)
        for other, a in state.annotations:
            if a.kind == "nofuse" and other.name in {*first.outputs, *last.outputs}:
                raise error("E008", f"{target!r} is annotated both @fuse({name!r}) and @nofuse "
                            f"(on {other.name!r})", "keep one of them", a.loc)
            if other.name in dropped:
                return f"{other.name!r}, which the fused op does not write, is annotated @{a.kind}"
        out[at], out[gone] = new, None
        used.update((i, j))
        return None

    for target, prefix, ann, name in wanted:
        hint = f"{name} fuses {' then '.join(FUSIONS[name][0])}; annotate the output of the last"
        if target is not None:
            i = producer.get(target)
            why = "it is a graph input" if i is None else fuse_at(i, name, ann, target)
            if why is not None:
                raise error("E013", f"@fuse({name!r}) on {target!r}: {why}", hint, ann.loc)
            continue
        last_type = FUSIONS[name][0][1]
        sites = [i for i, op in enumerate(ops) if op.type == last_type and op.outputs[0].startswith(prefix)]
        if not [i for i in sites if fuse_at(i, name, ann, ops[i].outputs[0]) is None]:
            where = f"{spec.name}" + (f" ({prefix.rstrip('.')})" if prefix else "")
            raise error("E013", f"@fuse({name!r}) on module {where}: no {' then '.join(FUSIONS[name][0])} "
                        "in its graph can be fused", hint, ann.loc)
    return [op for op in out if op is not None]


def checkpoint_block(module: Any, ann: Any) -> Any:
    """Block ``module`` with ``@checkpoint`` applied from its caller (``g.call("StackedBlocks", ...)
    @ checkpoint``): its graph's save and recompute lists as a ``@checkpoint`` on the block class would
    make them, below the block's own ``@memory`` annotations (seed 004 §7.2.0)."""
    fwd = module.forward
    outputs = {d.name for d in fwd.outputs}
    decision = {n: "recompute" for n in fwd.recompute}
    decision.update({n: "save" for n in fwd.save})
    granularity = ann.value("granularity")
    produced = [o for op in fwd.ops for o in op.outputs if o]
    if granularity != "selective":
        for n in produced:
            if n not in outputs:
                decision[n] = "recompute" if granularity == "full" else "save"
    for n in ann.value("preserve"):
        if n not in produced:
            raise error(
                "E002",
                f"@checkpoint(preserve=...) names {n!r}, which is not a tensor of block {module.name!r}",
                f"its tensors: {', '.join(produced[:12])}",
                ann.loc,
            )
        decision[n] = "save"
    for a in module.annotations:
        if a.kind == "memory" and a.on == "tensor" and a.args.get("mode") in ("save", "recompute",
                                                                              "temporary"):
            decision[a.target] = "save" if a.args["mode"] == "save" else "recompute"
    order = {n: i for i, n in enumerate([*(d.name for d in fwd.inputs), *produced])}
    pick = [n for n in order if n in decision]
    return module.evolve(
        forward=fwd.evolve(
            save=[n for n in pick if decision[n] == "save"],
            recompute=[n for n in pick if decision[n] == "recompute"],
        )
    )


def memory_slots(spec: Any, state: Any, kind: str, layout: list[Any]) -> list[Any]:
    """``@memory("offload")`` on a tensor of a block: its activation slot (declared, or added here) is
    hinted ``memory_hint="offload"``, so the ``dsl`` recompute plan moves it to the host pool wherever
    it keeps it (seed 004 §7.2.1: an offload candidate). A model graph's tensors are E021: kiln
    offloads inside blocks only."""
    from kiln.core.ir import ActivationSlot

    wanted = [(ref, ann) for ref, ann in state.annotations
              if ann.kind == "memory" and ann.value("mode") == "offload"]
    if not wanted:
        return layout
    if kind == "model":
        ref, ann = wanted[0]
        raise error(
            "E021",
            f"{spec.name}: @memory('offload') on {ref.name!r} in a @model graph; kiln offloads the "
            "activations blocks compute",
            "put it on a tensor of the block's forward",
            ann.loc,
        )
    out = list(layout)
    for ref, _ in wanted:
        i = next((i for i, s in enumerate(out) if ref.name in (s.name, *s.aliases)), None)
        if i is not None:
            out[i] = out[i].evolve(memory_hint="offload")
        else:
            out.append(ActivationSlot(ref.name, list(ref.type.shape), ref.type.dtype, memory_hint="offload"))
    return out


def refuse_in_backward(spec: Any, state: Any) -> None:
    """An annotation on a tensor of a ``@backward`` method is E008: kiln carries annotations on forward
    tensors only (rather than dropping one silently). The forward spelling reaches the gradient: a
    ``grad_*`` probe, ``@gradient`` on the tensor; a backward op follows the precision recipe."""
    if state.annotations:
        ref, ann = state.annotations[0]
        raise error(
            "E008",
            f"{spec.name}.backward: @{ann.kind} on {ref.name!r}: annotations inside a @backward method "
            "are not carried yet",
            "annotate the forward tensor instead: @probe(capture='grad_stats') and @gradient(scale=, clip=) "
            "act on its gradient; backward ops follow the precision recipe",
            ann.loc,
        )
