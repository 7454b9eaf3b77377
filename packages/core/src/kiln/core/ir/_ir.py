"""kiln's graph IR: frozen attrs values with an exact, versioned JSON form (``"kiln_ir": 2``).

Tensors are named by strings (SSA). Shapes are tuples of symbolic :class:`DimExpr` bound when a
Program is built. Attribute values are JSON data frozen into tuples and :class:`FrozenDict`.
Every class here round-trips exactly: ``from_json(x.to_json()) == x``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar, TypeVar

import attrs
from attrs import field

from kiln.core._errors import IRError, KilnError
from kiln.core.ir._dims import Const, DimExpr, Shape, parse_dim, parse_shape

IR_VERSION = 2

#: The dtypes an IR tensor may carry: name -> (bits, kind) where kind is "float" or "int".
DTYPES: Mapping[str, tuple[int, str]] = {
    "fp32": (32, "float"),
    "bf16": (16, "float"),
    "fp16": (16, "float"),
    "fp8_e4m3": (8, "float"),
    "fp8_e5m2": (8, "float"),
    "fp4_e2m1": (4, "float"),
    "int8": (8, "int"),
    "int32": (32, "int"),
}

SCOPES = ("block", "global", "gradient", "global_gradient")
MEMORY_HINTS = ("persistent", "save", "recompute", "temporary", "shared", "offload")
SHARE_POLICIES = ("per_layer", "when_recomputed", "always_share", "fft_share", "lora_share")
RECOMPUTE_POLICIES = ("always", "lora_only", "fft_only", "never")
MODULE_KINDS = ("module", "block", "model", "primitive")
#: what a parameter is for, independent of its name (optimizer groups, LoRA trainability)
PARAM_ROLES = ("weight", "bias", "norm", "embedding", "adapter")
#: what an :class:`Annotation` is attached to (seed 004 §7.1)
ANNOTATION_TARGETS = ("tensor", "param", "module")


def is_float(dtype: str) -> bool:
    return DTYPES[dtype][1] == "float"


def dtype_bytes(dtype: str) -> float:
    return DTYPES[dtype][0] / 8


# ---------------------------------------------------------------------------------------------
# Frozen JSON data


class FrozenDict(Mapping[str, Any]):
    """An immutable, hashable mapping used for op attributes, configs and metadata."""

    __slots__ = ("_data", "_hash")

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        self._data: dict[str, Any] = dict(data or {})
        self._hash: int | None = None

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._data.items()))
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._data == dict(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"FrozenDict({self._data!r})"

    def set(self, **changes: Any) -> FrozenDict:
        return FrozenDict({**self._data, **{k: freeze(v) for k, v in changes.items()}})


def freeze(value: Any, path: str = "value") -> Any:
    """JSON data -> hashable data (lists become tuples, dicts FrozenDicts); rejects anything else."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isnan(value):
            raise IRError(f"{path}: NaN is not allowed in IR data", code="E003")
        return value
    if isinstance(value, DimExpr):
        return value.to_json()
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v, f"{path}[{i}]") for i, v in enumerate(value))
    if isinstance(value, Mapping):
        for k in value:
            if not isinstance(k, str):
                raise IRError(f"{path}: keys must be strings, found {k!r}", code="E003")
        return FrozenDict({k: freeze(v, f"{path}.{k}") for k, v in value.items()})
    raise IRError(f"{path}: {type(value).__name__} is not JSON data ({value!r:.60})", code="E003")


def thaw(value: Any) -> Any:
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    if isinstance(value, FrozenDict):
        return {k: thaw(v) for k, v in value.items()}
    return value


def _frozen_dict(value: Any) -> FrozenDict:
    out = freeze(value if value is not None else {})
    if not isinstance(out, FrozenDict):
        raise IRError(f"expected a mapping, found {type(value).__name__}", code="E003")
    return out


def _strs(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise IRError(f"expected a list of strings, found {value!r:.60}", code="E003")
    for v in value:
        if not isinstance(v, str):
            raise IRError(f"expected a string, found {v!r:.60}", code="E003")
    return tuple(value)


def _dtype(value: Any) -> str:
    if not isinstance(value, str) or value not in DTYPES:
        raise IRError(f"unknown dtype {value!r}; expected one of {', '.join(DTYPES)}", code="E003")
    return value


def _choice(choices: tuple[str, ...]) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in choices:
            raise IRError(f"{value!r} is not one of {', '.join(choices)}", code="E003")
        return str(value)

    return check


def _opt(conv: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: None if v is None else conv(v)


def _typed(kind: type) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise IRError(f"expected {kind.__name__}, found {value!r:.60}", code="E003")
        return value

    return check


_str = _typed(str)
_bool = _typed(bool)


def _tuple_of(cls: type[T]) -> Callable[[Any], tuple[T, ...]]:
    def conv(value: Any) -> tuple[T, ...]:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise IRError(f"expected a list of {cls.__name__}, found {value!r:.60}", code="E003")
        out = []
        for i, v in enumerate(value):
            try:
                out.append(v if isinstance(v, cls) else _decode(cls, v))
            except KilnError as exc:
                raise IRError(f"item {i}: {exc.message}", code=exc.code or "E003", hint=exc.hint) from None
        return tuple(out)

    return conv


def _one_of(cls: type[T]) -> Callable[[Any], T]:
    return lambda v: v if isinstance(v, cls) else _decode(cls, v)


# ---------------------------------------------------------------------------------------------
# JSON machinery: every IR class is an attrs class whose fields carry a converter that accepts
# both Python values and their JSON form, so decoding is just "call the constructor".

T = TypeVar("T")
_IR_CLASSES: dict[str, type] = {}


def _encode(value: Any) -> Any:
    if isinstance(value, DimExpr):
        return value.to_json()
    if attrs.has(type(value)):
        out: dict[str, Any] = {}
        for f in attrs.fields(type(value)):
            v = getattr(value, f.name)
            default = f.default.factory() if isinstance(f.default, attrs.Factory) else f.default  # type: ignore[arg-type]
            if default is not attrs.NOTHING and v == default and not f.metadata.get("always"):
                continue
            out[f.name] = _encode(v)
        return out
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    if isinstance(value, FrozenDict):
        return {k: _encode(v) for k, v in value.items()}
    return value


def _decode(cls: type[T], data: Any) -> T:
    if not isinstance(data, Mapping):
        raise IRError(f"{cls.__name__}: expected a JSON object, found {type(data).__name__}", code="E003")
    names = {f.name for f in attrs.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names - {"kiln_ir", "ir"})
    if unknown:
        raise IRError(
            f"{cls.__name__}: unknown field(s) {', '.join(map(repr, unknown))}",
            code="E003",
            hint=f"known fields: {', '.join(sorted(names))}",
        )
    kwargs = {k: v for k, v in data.items() if k in names}
    required = [f.name for f in attrs.fields(cls) if f.default is attrs.NOTHING]  # type: ignore[arg-type]
    missing = ", ".join(repr(n) for n in required if n not in kwargs)
    if missing:
        raise IRError(f"{cls.__name__}: missing required field(s) {missing}", code="E003")
    try:
        return cls(**kwargs)
    except KilnError as exc:
        raise IRError(
            f"{cls.__name__}{_failing_field(cls, kwargs)}: {exc.message}",
            code=exc.code or "E003",
            hint=exc.hint,
        ) from None


def _failing_field(cls: type, kwargs: Mapping[str, Any]) -> str:
    """``.name`` of the first field whose converter rejects its value (attrs does not say which)."""
    for f in attrs.fields(cls):
        try:
            if f.name in kwargs and f.converter is not None:
                f.converter(kwargs[f.name])
        except KilnError:
            return f".{f.name}"
    return ""


class _IRNode:
    """Mixin for every IR class: ``to_json()``, ``to_dict()`` and ``evolve()``."""

    _ir_tag: ClassVar[str]

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls._ir_tag = cls.__name__.lower()
        _IR_CLASSES[cls._ir_tag] = cls

    def to_dict(self) -> dict[str, Any]:
        return {"kiln_ir": IR_VERSION, "ir": self._ir_tag, **_encode(self)}

    def to_json(self, *, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    def evolve(self: T, **changes: Any) -> T:
        return attrs.evolve(self, **changes)


def from_json(data: str | bytes | Mapping[str, Any]) -> Any:
    """Load any IR object from its JSON text or dict (the ``"ir"`` field names the class)."""
    if isinstance(data, (str, bytes)):
        try:
            data = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise IRError(f"not valid JSON: {exc}", code="E001") from None
    if not isinstance(data, Mapping):
        raise IRError(f"IR JSON must be an object, found {type(data).__name__}", code="E001")
    version = data.get("kiln_ir")
    # True and 1.0 equal 1 but are not versions
    if type(version) is not int or not 1 <= version <= IR_VERSION:
        raise IRError(
            f'unsupported IR version {version!r}; this kiln reads "kiln_ir": 1 to {IR_VERSION}',
            code="E001",
            hint="was this file written by a newer kiln?",
        )
    while version < IR_VERSION:
        data, version = _MIGRATIONS[version](data), version + 1
    tag = data.get("ir")
    if not isinstance(tag, str) or tag not in _IR_CLASSES:
        raise IRError(
            f"unknown IR object {tag!r}; expected one of {', '.join(sorted(_IR_CLASSES))}", code="E001"
        )
    try:
        return _decode(_IR_CLASSES[tag], data)
    except RecursionError:
        raise IRError("IR JSON is nested too deeply", code="E001") from None


def _from_v1(data: Mapping[str, Any]) -> dict[str, Any]:
    """Version 1 -> 2: version 2 adds annotations (``Module.annotations``, empty by default), so a
    version 1 object reads as the same object with none."""
    return {**data, "kiln_ir": 2}


#: version n -> the function that turns a version-n JSON object into version n + 1
_MIGRATIONS: dict[int, Callable[[Mapping[str, Any]], dict[str, Any]]] = {1: _from_v1}


# ---------------------------------------------------------------------------------------------
# The IR


def _shape(value: Any) -> Shape:
    return parse_shape(value)


@attrs.frozen
class TensorType(_IRNode):
    """A symbolic shape and a dtype."""

    shape: Shape = field(converter=_shape, metadata={"always": True})
    dtype: str = field(converter=_dtype, metadata={"always": True})

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"


@attrs.frozen
class TensorDecl(_IRNode):
    """A named tensor of a graph: input, output, parameter or intermediate."""

    name: str = field(converter=_str)
    shape: Shape = field(converter=_shape, metadata={"always": True})
    dtype: str = field(converter=_dtype, metadata={"always": True})

    @property
    def type(self) -> TensorType:
        return TensorType(self.shape, self.dtype)


@attrs.frozen
class Op(_IRNode):
    """One operation: ``outputs = type(inputs, **attrs)``. An omitted optional input is ``""``."""

    type: str = field(converter=_str)
    inputs: tuple[str, ...] = field(converter=_strs, metadata={"always": True})
    outputs: tuple[str, ...] = field(converter=_strs, metadata={"always": True})
    attrs: FrozenDict = field(factory=FrozenDict, converter=_frozen_dict)
    loc: str | None = field(default=None, converter=_opt(_str))

    def __str__(self) -> str:
        attrs_text = ", ".join(f"{k}={json.dumps(thaw(v))}" for k, v in self.attrs.items())
        return f"{', '.join(self.outputs)} = {self.type}({', '.join(i or '_' for i in self.inputs)})" + (
            f" {{{attrs_text}}}" if attrs_text else ""
        )


@attrs.frozen
class Graph(_IRNode):
    """A dataflow graph in SSA form. ``save``/``recompute`` list forward tensors by name."""

    name: str = field(converter=_str)
    inputs: tuple[TensorDecl, ...] = field(default=(), converter=_tuple_of(TensorDecl))
    outputs: tuple[TensorDecl, ...] = field(default=(), converter=_tuple_of(TensorDecl))
    params: tuple[TensorDecl, ...] = field(default=(), converter=_tuple_of(TensorDecl))
    intermediates: tuple[TensorDecl, ...] = field(default=(), converter=_tuple_of(TensorDecl))
    ops: tuple[Op, ...] = field(default=(), converter=_tuple_of(Op))
    save: tuple[str, ...] = field(default=(), converter=_strs)
    recompute: tuple[str, ...] = field(default=(), converter=_strs)
    metadata: FrozenDict = field(factory=FrozenDict, converter=_frozen_dict)

    def decls(self) -> dict[str, TensorDecl]:
        """Every declared tensor by name (inputs, params, intermediates, outputs)."""
        out: dict[str, TensorDecl] = {}
        for d in (*self.inputs, *self.params, *self.intermediates, *self.outputs):
            out.setdefault(d.name, d)
        return out

    def producers(self) -> dict[str, int]:
        """Tensor name -> index of the op that produces it."""
        return {o: i for i, op in enumerate(self.ops) for o in op.outputs if o}

    def pretty(self, mark: int | None = None, window: tuple[int, int] | None = None) -> str:
        lo, hi = window or (0, len(self.ops))
        lines = [
            f"%{i:<3}{'>>' if i == mark else '  '} {op}" for i, op in enumerate(self.ops) if lo <= i < hi
        ]
        return "\n".join(lines)

    def verify(self, *, registry: Any = None) -> None:
        from kiln.core.ir._verify import verify

        verify(self, registry=registry)


@attrs.frozen
class LoraTarget(_IRNode):
    """A LoRA-targetable slice of a (possibly fused) weight: rows ``[start, start + size)`` of ``dim``."""

    name: str = field(converter=_str)
    start: DimExpr = field(default=Const(0), converter=parse_dim)
    size: DimExpr | None = field(default=None, converter=_opt(parse_dim))
    dim: int = field(default=0, converter=_typed(int))


@attrs.frozen
class ParamSpec(_IRNode):
    """A parameter of a module. ``array_of``/``count`` describe ``Array[count, Block]`` stacks."""

    name: str = field(converter=_str)
    shape: Shape = field(default=(), converter=_shape)
    dtype: str = field(default="bf16", converter=_dtype)
    frozen: bool = field(default=False, converter=_bool)
    optional: bool = field(default=False, converter=_bool)
    condition: str | None = field(default=None, converter=_opt(_str))
    tied_to: str | None = field(default=None, converter=_opt(_str))
    lora_targets: tuple[LoraTarget, ...] = field(default=(), converter=_tuple_of(LoraTarget))
    array_of: str | None = field(default=None, converter=_opt(_str))
    count: DimExpr | None = field(default=None, converter=_opt(parse_dim))
    hf_mapping: Any = field(default=None, converter=freeze)
    init: FrozenDict = field(factory=FrozenDict, converter=_frozen_dict)
    description: str = field(default="", converter=_str)
    #: one of PARAM_ROLES; None: inferred from the shape and init (see :meth:`inferred_role`)
    role: str | None = field(default=None, converter=_opt(_choice(PARAM_ROLES)))

    def inferred_role(self) -> str:
        """The role, or when none is declared: a vector initialised to ones is a norm weight, another
        vector a bias, anything else a weight."""
        if self.role is not None:
            return self.role
        if len(self.shape) == 1:
            return "norm" if self.init.get("kind") == "ones" else "bias"
        return "weight"


@attrs.frozen
class ActivationSlot(_IRNode):
    """A pre-declared activation or gradient buffer with its memory and recompute hints."""

    name: str = field(converter=_str)
    shape: Shape = field(default=(), converter=_shape)
    dtype: str = field(default="bf16", converter=_dtype)
    scope: str = field(default="block", converter=_choice(SCOPES))
    aliases: tuple[str, ...] = field(default=(), converter=_strs)
    memory_hint: str = field(default="persistent", converter=_choice(MEMORY_HINTS))
    save: bool = field(default=False, converter=_bool)
    recompute: bool = field(default=False, converter=_bool)
    shares_with: str | None = field(default=None, converter=_opt(_str))
    share_policy: str = field(default="per_layer", converter=_choice(SHARE_POLICIES))
    gradient_of: str | None = field(default=None, converter=_opt(_str))
    alias_of: str | None = field(default=None, converter=_opt(_str))
    condition: str | None = field(default=None, converter=_opt(_str))
    recompute_from: tuple[str, ...] = field(default=(), converter=_strs)
    recompute_op: str | None = field(default=None, converter=_opt(_str))
    recompute_attrs: FrozenDict = field(factory=FrozenDict, converter=_frozen_dict)
    recompute_policy: str = field(default="always", converter=_choice(RECOMPUTE_POLICIES))
    recompute_group: str | None = field(default=None, converter=_opt(_str))
    recompute_outputs: tuple[str, ...] = field(default=(), converter=_strs)
    lora_targets: tuple[str, ...] = field(default=(), converter=_strs)
    description: str = field(default="", converter=_str)


@attrs.frozen
class ActivationLayout(_IRNode):
    """The activation and gradient slots of a block or model."""

    slots: tuple[ActivationSlot, ...] = field(default=(), converter=_tuple_of(ActivationSlot))

    def alias_map(self) -> dict[str, str]:
        """Alias -> slot name (every slot also maps to itself)."""
        out = {s.name: s.name for s in self.slots}
        out.update({a: s.name for s in self.slots for a in s.aliases})
        return out

    def get(self, name: str) -> ActivationSlot | None:
        target = self.alias_map().get(name)
        return next((s for s in self.slots if s.name == target), None)


@attrs.frozen
class Annotation(_IRNode):
    """A seed 004 §7 annotation: ``kind`` (``memory``, ``hook``, ``frozen``, ...) with its arguments
    ``args``, attached to a tensor of the forward graph, a parameter or the whole module (``on``) by
    name (``target``; empty for the module). ``loc`` is the ``file:line`` that wrote it."""

    kind: str = field(converter=_str)
    on: str = field(default="tensor", converter=_choice(ANNOTATION_TARGETS))
    target: str = field(default="", converter=_str)
    args: FrozenDict = field(factory=FrozenDict, converter=_frozen_dict)
    loc: str | None = field(default=None, converter=_opt(_str))

    def __str__(self) -> str:
        args = ", ".join(f"{k}={json.dumps(thaw(v))}" for k, v in self.args.items())
        where = f"{self.on} {self.target}" if self.target else self.on
        return f"{where} @{self.kind}" + (f"({args})" if args else "")


@attrs.frozen
class Module(_IRNode):
    """A compiled module, block or model: config, params, forward graph, activation layout, HF data."""

    name: str = field(converter=_str)
    kind: str = field(default="module", converter=_choice(MODULE_KINDS))
    config: FrozenDict = field(factory=FrozenDict, converter=_frozen_dict)
    params: tuple[ParamSpec, ...] = field(default=(), converter=_tuple_of(ParamSpec))
    forward: Graph | None = field(default=None, converter=_opt(_one_of(Graph)))
    backward: Graph | None = field(default=None, converter=_opt(_one_of(Graph)))
    activations: ActivationLayout = field(factory=ActivationLayout, converter=_one_of(ActivationLayout))
    hf_config: FrozenDict = field(factory=FrozenDict, converter=_frozen_dict)
    hf_mappings: FrozenDict = field(factory=FrozenDict, converter=_frozen_dict)
    hf_export: FrozenDict = field(factory=FrozenDict, converter=_frozen_dict)
    metadata: FrozenDict = field(factory=FrozenDict, converter=_frozen_dict)
    #: seed 004 §7 annotations of the module, its parameters and its forward graph's tensors
    annotations: tuple[Annotation, ...] = field(default=(), converter=_tuple_of(Annotation))

    def param(self, name: str) -> ParamSpec | None:
        return next((p for p in self.params if p.name == name), None)

    def annotated(self, kind: str, on: str | None = None) -> tuple[Annotation, ...]:
        """The annotations of ``kind`` (on ``on``: tensor, param or module; None: any)."""
        return tuple(a for a in self.annotations if a.kind == kind and (on is None or a.on == on))

    def hf_layers(self, stack: str, count: int) -> list[int] | None:
        """The HF layer of each of the ``count`` blocks of layer stack ``stack``, as its indexed HF
        mapping's ``layers`` lists them; None when it lists none."""
        entry = self.hf_mappings.get(stack)
        layers = entry.get("layers") if isinstance(entry, Mapping) else None
        if layers is None:
            return None
        if len(layers) != count:
            raise IRError(f"module {self.name!r}: the HF mapping of {stack!r} lists {len(layers)} layers for "
                          f"{count} blocks")
        return [int(i) for i in layers]

    def verify(self, *, registry: Any = None, modules: Mapping[str, Module] | None = None) -> None:
        from kiln.core.ir._verify import verify

        verify(self, registry=registry, modules=modules)


@attrs.frozen
class Bundle(_IRNode):
    """A set of modules that reference each other (a model and its blocks); ``entry`` is the root."""

    modules: tuple[Module, ...] = field(default=(), converter=_tuple_of(Module))
    entry: str | None = field(default=None, converter=_opt(_str))

    def module(self, name: str) -> Module:
        for m in self.modules:
            if m.name == name:
                return m
        raise IRError(
            f"no module named {name!r} in this bundle; it has {', '.join(m.name for m in self.modules)}",
            code="E002",
        )

    def verify(self, *, registry: Any = None) -> None:
        from kiln.core.ir._verify import verify

        verify(self, registry=registry)


__all__ = [
    "ANNOTATION_TARGETS",
    "DTYPES",
    "IR_VERSION",
    "ActivationLayout",
    "ActivationSlot",
    "Annotation",
    "Bundle",
    "FrozenDict",
    "Graph",
    "LoraTarget",
    "Module",
    "Op",
    "ParamSpec",
    "TensorDecl",
    "TensorType",
    "dtype_bytes",
    "freeze",
    "from_json",
    "is_float",
    "thaw",
]
