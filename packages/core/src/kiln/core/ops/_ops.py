"""The op registry: per op type its schema, shape rule, traits, reference kernel and backward rule.

An :class:`OpDef` keeps them side by side; the reference kernel (NumPy) is the op's meaning; the
kernels backends run live in the kernel table (:mod:`kiln.core.runtime._kernels`). Kernels receive concrete
values: NumPy arrays for
inputs (``None`` for an omitted optional input) and attributes with defaults filled in, symbolic
dims evaluated and dtypes mapped to NumPy dtypes. Backward rules build IR through a
:class:`BackwardContext` and return one gradient tensor name per forward input (``None`` where the
input gets no gradient).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
from attrs import field

from kiln.core._errors import OpError
from kiln.core.ir._dims import DimExpr, evaluate_shape, parse_dim, parse_shape
from kiln.core.ir._infer import InferContext, infer_types
from kiln.core.ir._ir import DTYPES, Op, TensorType, freeze, is_float
from kiln.core.plugins._registry import NamedRegistry, declare_kind

if TYPE_CHECKING:
    from numpy.typing import DTypeLike


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


def _tuple(items: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(items)


def _frozenset(items: Iterable[int]) -> frozenset[int]:
    return frozenset(items)
ATTR_KINDS = ("bool", "int", "float", "str", "dim", "dims", "dtype", "ints", "floats", "any")


@attrs.frozen
class AttrSpec:
    """An op attribute. ``kind`` decides validation and how the value reaches the kernel:
    ``dim``/``dims`` are symbolic dims evaluated to ints, ``dtype`` becomes a NumPy dtype."""

    name: str
    kind: str = field(validator=attrs.validators.in_(ATTR_KINDS))
    default: Any = REQUIRED
    choices: tuple[Any, ...] | None = None

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def check(self, value: Any, op: str) -> None:
        checks: dict[str, Callable[[Any], bool]] = {
            "bool": lambda v: isinstance(v, bool),
            "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
            "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
            "str": lambda v: isinstance(v, str),
            "dim": lambda v: isinstance(v, (int, str)) and not isinstance(v, bool),
            "dims": lambda v: isinstance(v, tuple) and all(
                isinstance(x, (int, str)) and not isinstance(x, bool) for x in v
            ),
            "dtype": lambda v: v in DTYPES,
            "ints": lambda v: isinstance(v, tuple) and all(
                isinstance(x, int) and not isinstance(x, bool) for x in v
            ),
            "floats": lambda v: isinstance(v, tuple) and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in v
            ),
            "any": lambda v: True,
        }
        ok = checks[self.kind]
        if value is None and self.default is None:
            return
        if not ok(value) or (self.choices is not None and value not in self.choices):
            expected = f"one of {list(self.choices)}" if self.choices is not None else f"a {self.kind}"
            raise OpError(
                f"op {op!r}: attribute {self.name!r} = {value!r} is not {expected}", op=op, code="E003"
            )
        if self.kind in ("dim", "dims"):
            for v in value if self.kind == "dims" else (value,):
                parse_dim(v)


@attrs.frozen
class Sample:
    """Inputs and attributes on which the generic gradient check exercises an op (float64 arrays)."""

    inputs: tuple[np.ndarray | None, ...] = field(converter=_tuple)
    attrs: Mapping[str, Any] = field(factory=dict)
    #: indices of inputs to check gradients for (default: every float input)
    check: tuple[int, ...] | None = None


@attrs.frozen
class Cost:
    flops: float = 0.0
    bytes: float = 0.0


_AUTOCAST = attrs.validators.in_(("", "lower", "fp32", "promote"))


@attrs.frozen
class OpDef:
    """One op type. ``inputs``/``outputs`` are names; ``"bias?"`` marks an optional input and
    ``"*xs"`` a variadic last input or output. ``backward`` is ``None`` when no rule exists."""

    name: str
    inputs: tuple[str, ...] = field(converter=_tuple)
    outputs: tuple[str, ...] = field(converter=_tuple)
    kernel: Callable[..., Any]
    infer: Callable[[InferContext], Sequence[TensorType]]
    backward: Callable[[BackwardContext], Sequence[str | None]] | None = None
    attrs: tuple[AttrSpec, ...] = field(default=(), converter=_tuple)
    samples: Callable[[np.random.Generator], Iterable[Sample]] | None = None
    cost: Callable[[Sequence[tuple[int, ...]], Mapping[str, Any]], Cost] | None = None
    # -- traits: what planners and autodiff need to know about the op
    #: draws random numbers (never replayed by the automatic recompute planner)
    random: bool = False
    #: talks to other processes (never replayed)
    collective: bool = False
    #: indices of inputs that never receive a gradient (indices, masks), whatever their dtype
    nondiff_inputs: frozenset[int] = field(default=frozenset(), converter=_frozenset)
    #: the output is its first input's bytes in the same order (a view): it shares the input's storage
    alias: bool = False
    #: dominated by multiply-adds (matmuls, grouped GEMMs): replayed only when a budget forces it
    flop_heavy: bool = False
    #: ops that rebuild some outputs from kept tensors instead of replaying this op: (op type,
    #: {its input: this op's input or output schema name}, {its output: this op's output}); a fused
    #: residual + rmsnorm's normalized output is ``rmsnorm_apply_saved`` of its kept sum and rstd
    variants: tuple[tuple[str, Mapping[str, str], Mapping[str, str]], ...] = field(default=(),
                                                                                converter=_tuple)
    #: where a lower-precision recipe (``bf16``) computes the op, as autocast does: ``lower`` (its float
    #: inputs rounded to bf16, fp32 accumulation, its first output bf16), ``fp32`` (inputs read as
    #: fp32, outputs fp32: norms, softmax, losses) or ``promote`` (outputs bf16 when every float
    #: input is, else fp32); "" derives it: ``lower`` for a ``flop_heavy`` op, else ``promote``
    autocast: str = field(default="", validator=_AUTOCAST)
    #: schema names (inputs and outputs, without ``?``/``*``) of the float32 statistics the op reads or
    #: writes, and their cotangents: a log-sum-exp, a norm's ``rstd`` and ``mean``, a loss. A
    #: lower-precision recipe never rounds them, wherever the op computes: a step that computes in bf16
    #: reads them as they are stored and writes them in float32 (torch keeps SDPA's logsumexp, the
    #: rms norm's rstd and autocast's ``cross_entropy`` in float32)
    statistics: frozenset[str] = field(default=frozenset(), converter=frozenset)
    #: an LM-head loss op's logits: the op type ``Model.logits`` puts in its place, reading its first
    #: two inputs (``x``, the head's weight) with the attributes that op takes (as ``fused_lm_head_loss``
    #: becomes a ``matmul``; kiln-dist's vocabulary-parallel loss, its gathered logits)
    logits: str | None = None
    doc: str = ""

    def __attrs_post_init__(self) -> None:
        names = {n.strip("*?") for n in (*self.inputs, *self.outputs)}
        unknown = sorted(self.statistics - names)
        if unknown:
            raise OpError(f"op {self.name!r}: statistics names {', '.join(map(repr, unknown))}, which is not "
                          f"one of its inputs or outputs ({', '.join(sorted(names))})", op=self.name)

    def statistic_flags(self, n: int, outputs: bool = False) -> tuple[bool, ...]:
        """Per position of ``n`` inputs (or ``outputs``) as a step lists them: whether it is one of the
        op's :attr:`statistics` (a variadic last schema entry covers the positions from it on)."""
        if not self.statistics:
            return (False,) * n
        schema = [s.strip("*?") for s in (self.outputs if outputs else self.inputs)]
        return tuple(bool(schema) and schema[min(i, len(schema) - 1)] in self.statistics for i in range(n))

    @property
    def variadic_inputs(self) -> bool:
        return bool(self.inputs) and self.inputs[-1].startswith("*")

    @property
    def variadic_outputs(self) -> bool:
        return bool(self.outputs) and self.outputs[-1].startswith("*")

    @property
    def default_outputs(self) -> int:
        """How many outputs the op has when a caller gives no count: its fixed ones (``("y", "*state")``
        emits ``y`` alone; a wholly variadic ``("*parts",)`` one)."""
        return max(1, len(self.outputs) - 1) if self.variadic_outputs else len(self.outputs)

    def arity_ok(self, n_in: int, n_out: int) -> str | None:
        """None if ``n_in``/``n_out`` fit the schema, else what was expected."""
        fixed = [i for i in self.inputs if not i.startswith("*")]
        required = [i for i in fixed if not i.endswith("?")]
        if self.variadic_inputs:
            if n_in < len(fixed) + 1:
                return f"at least {len(fixed) + 1} inputs"
        elif not len(required) <= n_in <= len(fixed):
            return f"{len(required)} inputs" if len(required) == len(fixed) else \
                f"{len(required)} to {len(fixed)} inputs"
        if self.variadic_outputs:
            if n_out < len(self.outputs) - 1:
                return f"at least {len(self.outputs) - 1} outputs"
        elif n_out != len(self.outputs):
            return f"{len(self.outputs)} outputs"
        return None

    def resolve_attrs(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """Validate attrs against the schema and fill defaults (names starting with ``_`` are annotations)."""
        specs = {a.name: a for a in self.attrs}
        unknown = sorted(k for k in given if k not in specs and not k.startswith("_"))
        if unknown:
            raise OpError(f"op {self.name!r}: unknown attribute(s) {', '.join(unknown)}; "
                          f"it takes {', '.join(specs) or 'none'}", op=self.name, code="E003")
        out: dict[str, Any] = {}
        for name, spec in specs.items():
            if name in given:
                value = freeze(given[name], f"{self.name}.{name}")
                spec.check(value, self.name)
                out[name] = value
            elif spec.required:
                raise OpError(
                    f"op {self.name!r}: missing required attribute {name!r}", op=self.name, code="E003"
                )
            else:
                out[name] = spec.default
        return out

    def kernel_attrs(self, resolved: Mapping[str, Any], bindings: Mapping[str, int],
                     float_dtype: Any = np.float32) -> dict[str, Any]:
        """Attrs as the kernel receives them: dims evaluated, dtypes mapped to NumPy."""
        kinds = {a.name: a.kind for a in self.attrs}
        out: dict[str, Any] = {}
        for k, v in resolved.items():
            kind = kinds.get(k)
            if kind == "dim" and v is not None:
                v = parse_dim(v).evaluate(bindings)
            elif kind == "dims" and v is not None:
                v = evaluate_shape(parse_shape(v), bindings)
            elif kind == "dtype" and v is not None:
                v = numpy_dtype(v, float_dtype)
            out[k] = v
        return out

    def run(self, inputs: Sequence[np.ndarray | None], attrs: Mapping[str, Any],
            bindings: Mapping[str, int] | None = None,
            float_dtype: Any = np.float64) -> tuple[np.ndarray, ...]:
        """Run the reference kernel on concrete inputs; always returns a tuple of arrays."""
        kattrs = self.kernel_attrs(self.resolve_attrs(attrs), bindings or {}, float_dtype)
        out = self.kernel(*inputs, **kattrs)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def numpy_dtype(dtype: str, float_dtype: DTypeLike = np.float32) -> np.dtype[Any]:
    """The NumPy dtype an IR dtype computes in: every float type in ``float_dtype``."""
    if is_float(dtype):
        return np.dtype(float_dtype)
    return np.dtype({"int8": np.int8, "int32": np.int32}[dtype])


class OpRegistry(NamedRegistry[OpDef]):
    """Registry of :class:`OpDef` by op name; duplicates name both contributing plugins."""

    def __init__(self, kind: str = "ops", *, providers: Mapping[str, str] | None = None) -> None:
        super().__init__(kind, providers=providers)

    def register_op(self, opdef: OpDef, *, plugin: str | None = None) -> OpDef:
        if not isinstance(opdef, OpDef):
            raise OpError(f"register_op expects an OpDef, found {type(opdef).__name__}")
        self.register(opdef.name, opdef, plugin=plugin)
        return opdef

    def set_backward(self, op_type: str, rule: Callable[[BackwardContext], Sequence[str | None]],
                     *, replace: bool = False) -> None:
        opdef: OpDef = self[op_type]
        if opdef.backward is not None and not replace:
            raise OpError(f"op {op_type!r} already has a backward rule; pass replace=True to override it",
                          op=op_type)
        self._entries[op_type] = (attrs.evolve(opdef, backward=rule), self._entries[op_type][1])

    def get_op(self, op_type: str) -> OpDef:
        if op_type not in self:
            raise OpError(f"unknown op {op_type!r}", op=op_type, code="E014",
                          hint="register it with kiln.core.register_op(OpDef(...)) or through the "
                               "kiln_register_ops hook of a plugin")
        op: OpDef = self[op_type]
        return op


# ---------------------------------------------------------------------------------------------
# Backward rules


class BackwardContext:
    """What a backward rule sees while it emits backward ops for one forward op.

    ``d_outputs[i]`` is the gradient tensor of forward output ``i`` or ``None`` if no gradient
    flows into it. ``saved(name)`` gives the name by which a forward tensor is read in backward:
    parameters as they are, everything else through the ``saved.`` prefix.
    """

    def __init__(self, op: Op, opdef: OpDef, attrs: Mapping[str, Any], d_outputs: Sequence[str | None],
                 needs: Sequence[bool], types: Mapping[str, TensorType], params: frozenset[str],
                 graph_inputs: frozenset[str], registry: OpRegistry, namer: Callable[[str], str]) -> None:
        self.op = op
        self.opdef = opdef
        self.attrs = attrs
        self.d_outputs = tuple(d_outputs)
        self._needs = tuple(needs)
        self._types = types
        self._params = params
        self._graph_inputs = graph_inputs
        self._registry = registry
        self._namer = namer
        self.emitted: list[Op] = []

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.op.inputs

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.op.outputs

    @property
    def d_out(self) -> str:
        """Gradient of the first output (rules of single-output ops use this)."""
        d = self.d_outputs[0]
        if d is None:
            raise OpError(f"op {self.op.type!r}: no gradient flows into its first output", op=self.op.type)
        return d

    def needs_grad(self, i: int) -> bool:
        return i < len(self._needs) and self._needs[i]

    def is_param(self, name: str) -> bool:
        return name in self._params

    def is_input(self, name: str) -> bool:
        return name in self._graph_inputs

    def saved(self, name_or_index: str | int) -> str:
        name = self.op.inputs[name_or_index] if isinstance(name_or_index, int) else name_or_index
        if not name or name in self._params or name.startswith("saved."):
            return name
        return f"saved.{name}"

    def saved_output(self, i: int) -> str:
        return self.saved(self.op.outputs[i])

    def type_of(self, name_or_index: str | int) -> TensorType:
        name = self.op.inputs[name_or_index] if isinstance(name_or_index, int) else name_or_index
        name = name.removeprefix("saved.")
        if name not in self._types:
            raise OpError(f"op {self.op.type!r}: no type known for tensor {name!r}", op=self.op.type)
        return self._types[name]

    def shape_of(self, name_or_index: str | int) -> tuple[Any, ...]:
        """The symbolic shape as attr data (ints and strings), ready to pass as a ``dims`` attr."""
        return tuple(d.to_json() for d in self.type_of(name_or_index).shape)

    def emit(self, op_type: str, *inputs: str | None, n_out: int | None = None, name: str | None = None,
             **attrs: Any) -> Any:
        """Append a backward op; returns its output name (or a tuple of names if it has several)."""
        opdef = self._registry.get_op(op_type)
        count = n_out if n_out is not None else opdef.default_outputs
        base = name or f"{op_type}"
        outs = tuple(self._namer(f"{base}.{k}" if count > 1 else base) for k in range(count))
        op = Op(op_type, tuple(i or "" for i in inputs), outs,
                {k: v for k, v in attrs.items() if v is not None}, loc=self.op.loc)
        self.emitted.append(op)
        return outs[0] if count == 1 and not opdef.variadic_outputs else outs


def no_gradient(ctx: BackwardContext) -> list[str | None]:
    """The rule of an op whose inputs never get gradients (creation ops, integer ops)."""
    return [None] * len(ctx.inputs)


def bytes_of(shape: tuple[int, ...], dtype: str) -> int:
    return math.ceil(math.prod(shape) * DTYPES[dtype][0] / 8)


__all__ = [
    "AttrSpec",
    "BackwardContext",
    "Cost",
    "DimExpr",
    "InferContext",
    "OpDef",
    "OpRegistry",
    "Sample",
    "infer_types",
    "no_gradient",
    "numpy_dtype",
]

declare_kind("ops", "kiln_register_ops", OpRegistry)
