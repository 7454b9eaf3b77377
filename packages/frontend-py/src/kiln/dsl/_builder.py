"""The graph builder: ``with graph() as g: y = g.matmul(x, "weight", transpose="NT")``.

Each builder method emits one op of kiln's registry, translating the seed's argument names to the
op's attributes (``softmax(dim=)`` -> ``axis``, ``moe_topk(top_k=)`` -> ``k``, ...). Types are
inferred as the graph is built, so a bad shape is reported at the user's line. Tensors get SSA
names from ``out_name=``/``*_name=``, else from the Python variable they are assigned to, else a
generated ``<op>_<n>``.
"""

from __future__ import annotations

import contextvars
import os
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kiln.core import InferContext, KilnError, OpDef, TensorType, op_registry
from kiln.core.ir import DTYPES, Const, DimExpr, Op, dims_equal, is_float, simplify
from kiln.dsl._errors import DSLError, diag, error, user_frame, user_location

if TYPE_CHECKING:
    from kiln.dsl._scope import Scope

__all__ = [
    "GraphBuilder",
    "GraphRef",
    "active",
    "current_builder",
    "finalize_names",
    "graph",
    "iter_refs",
    "to_ops",
]

_ACTIVE: contextvars.ContextVar[GraphBuilder | None] = contextvars.ContextVar(
    "kiln_dsl_builder", default=None
)
# int attrs that name a dimension of the module: an int equal to that dimension is written symbolically
_DIM_ATTR_ALIASES = {"head_dim": "D", "rotary_dim": "D", "num_experts": "E"}


class GraphRef:
    """A tensor of the graph being built: pass it to other builder methods, or return it."""

    __slots__ = ("_name", "builder", "explicit", "kind", "producer", "type", "var")

    def __init__(
        self,
        builder: GraphBuilder,
        type_: TensorType,
        kind: str,
        name: str | None = None,
        explicit: bool = False,
    ) -> None:
        self.builder, self.type, self.kind = builder, type_, kind
        self._name, self.explicit, self.var = name, explicit, None
        self.producer: int | None = None

    @property
    def name(self) -> str:
        """The SSA name (final once the graph is complete; ``<pending>`` while it is generated)."""
        if self.kind == "saved":
            return f"saved.{self.var.name}"
        return self._name or "<pending>"

    @property
    def shape(self) -> tuple[DimExpr, ...]:
        return self.type.shape

    @property
    def dtype(self) -> str:
        return self.type.dtype

    def __repr__(self) -> str:
        return f"GraphRef({self.name!r}, {self.type})"

    def __getitem__(self, key: Any) -> GraphRef:
        """``x[:, :k]``, ``x[..., i]``: indexing with compile-time bounds (``GraphBuilder.index``)."""
        return self.builder.index(self, key)

    def __iter__(self) -> Any:
        # without this, __getitem__ would make `a, b = x` index x[0], x[1], ... as a sequence
        raise TypeError(f"graph tensor {self.name!r} is not iterable: index it (x[0]) or split it")

    def __bool__(self) -> bool:
        """A tensor has no value while the graph is built: ``if``, ``and``, ``or`` and ``not`` on it
        would silently build one branch (E016)."""
        raise error(
            "E016",
            f"tensor {self.name!r} used as a Python condition (if, and, or, not): its value is not known "
            "while the graph is built, so only one branch would be compiled",
            "guard on a config value or attribute (e.g. `if self.use_bias:`), a dimension known at compile "
            "time, or compute both and select with ops",
            user_location(),
        )


class _State:
    """What all builders of one module compilation share: ops, names, save lists."""

    def __init__(self, compiler: Any) -> None:
        self.compiler = compiler
        self.ops: list[tuple[str, list[GraphRef | None], list[GraphRef], dict[str, Any], str | None]] = []
        self.taken: dict[str, str | None] = {}  # fixed names -> where they were defined
        self.save: list[tuple[str, Any, str | None]] = []  # (prefix, name or ref, loc)
        self.recompute: list[tuple[str, Any, str | None]] = []
        self.outputs: list[GraphRef] | None = None
        self.offsets: dict[int, GraphRef] = {}  # id(scatter_idx) -> expert_offsets
        self.scatter: dict[int, GraphRef] = {}  # id(topk indices) -> scatter_idx
        self.extra_params: list[Any] = []  # ParamSpecs of inlined submodules
        self.extra_slots: list[Any] = []
        self.calls: list[Any] = []  # block modules called through StackedBlocks
        self.renamed: dict[str, str] = {}  # explicit names the compiler changed (a model's loss)
        self.forward: dict[str, TensorType] | None = None  # building a @backward: the forward's tensors
        self.annotations: list[tuple[GraphRef, Any]] = []  # (tensor, AnnotationValue), seed 004 §7
        self.regions: dict[int, tuple[int, int, str]] = {}  # id(output of an inlined call) -> its ops, prefix
        self.module_annotations: list[tuple[str, Any]] = []  # (prefix of an inlined submodule, annotation)
        self.param_annotations: list[Any] = []  # IR Annotations of the parameters declared
        self.block_checkpoints: list[tuple[str, Any]] = []  # (block module, @checkpoint on its call)


def _short(loc: str | None) -> str | None:
    if loc is None:
        return None
    path, _, line = loc.rpartition(":")
    return f"{os.path.basename(path)}:{line}"


class GraphBuilder:
    """Builds the forward graph of one module; see the module docstring."""

    def __init__(
        self, state: _State, scope: Scope, obj: Any, prefix: str = "", parent: GraphBuilder | None = None
    ) -> None:
        self._state, self.scope, self.obj, self.prefix, self.parent = state, scope, obj, prefix, parent
        self.params: dict[str, GraphRef] = {}
        self.tied: dict[str, str] = {}  # tied param -> the param it reads
        self.inputs: dict[str, GraphRef] = {}
        self.named: dict[str, GraphRef] = {}  # explicit names (local) -> ref

    # -- context manager and compile-time plumbing --
    def __enter__(self) -> GraphBuilder:
        return self

    def __exit__(self, *exc: Any) -> None:
        frame = sys._getframe(1)
        for var, value in frame.f_locals.items():
            if (
                isinstance(value, GraphRef)
                and value.builder is self
                and value.kind == "op"
                and not value.explicit
                and value.var is None
                and not var.startswith("_")
            ):
                value.var = var

    def lift(self, e: DimExpr) -> DimExpr:
        """A dim of this builder's scope in the symbols of the module being compiled."""
        if self.parent is None:
            return e
        from kiln.dsl._scope import translate

        return self.parent.lift(translate(e, self.scope, self.parent.scope))

    def dim(self, d: Any) -> DimExpr:
        try:
            return self.lift(self.scope.canon(d))
        except DSLError as exc:
            raise error(exc.code or "E002", exc.message, exc.hint, user_location()) from None

    def _scope_dim(self, name: str, what: str) -> DimExpr:
        found = self.scope.try_resolve(name)
        if found is None:
            raise error(
                "E012",
                f"{what} needs {name}: pass {name}=... or define the dimension {name!r}",
                f'e.g. self.{name} = Dim("config_key") in __init__',
                user_location(),
            )
        return self.lift(found)

    def declare(self, name: str, type_: TensorType, kind: str, local: str | None = None) -> GraphRef:
        ref = GraphRef(self, type_, kind, name, explicit=True)
        self._state.taken[name] = user_location()
        (self.params if kind == "param" else self.inputs)[local or name] = ref
        return ref

    # -- inputs --
    def _ref(self, x: Any, what: str = "input") -> GraphRef | None:
        if x is None or x == "":
            return None
        if isinstance(x, GraphRef):
            if x.builder._state is not self._state:
                raise error(
                    "E002",
                    f"{what} {x.name!r} belongs to another graph",
                    "use tensors of the graph being built",
                    user_location(),
                )
            return x
        if isinstance(x, str):
            name = self.tied.get(x, x)
            for table in (self.params, self.inputs, self.named):
                if name in table:
                    return table[name]
            if name.startswith("saved."):
                return self.saved(name.removeprefix("saved."))
            frame = user_frame()  # a tensor named by the variable it is assigned to
            local = frame.f_locals.get(name) if frame is not None else None
            if isinstance(local, GraphRef) and local.builder._state is self._state:
                if local.var is None and not local.explicit and local.kind == "op":
                    local.var = name
                return local
            known = ", ".join([*self.params, *self.inputs, *self.named]) or "none"
            raise error(
                "E002",
                f"{what} {x!r} is not a parameter, input or named tensor of {type(self.obj).__name__}",
                f"known names: {known}",
                user_location(),
            )
        raise error(
            "E003",
            f"{what}: expected a tensor (GraphRef or name), found {type(x).__name__} {x!r}",
            "pass a GraphRef returned by a builder method, or the name of a parameter or input",
            user_location(),
        )

    def _attr_value(self, op: str, name: str, kind: str, value: Any) -> Any:
        if kind == "dim":
            if isinstance(value, int) and not isinstance(value, bool):
                alias = _DIM_ATTR_ALIASES.get(name, name)
                found = self.scope.try_resolve(alias)
                if found is not None and self.scope.value(found) == value:
                    return self.lift(found).to_json()
                return value
            return self.dim(value).to_json()
        if kind == "dims":
            if isinstance(value, (str, int, DimExpr)):
                raise error(
                    "E003",
                    f"op {op!r}: attribute {name!r} takes a list of dims, found {value!r}",
                    "e.g. shape=[B * T, self.C]",
                    user_location(),
                )
            return [self.dim(v).to_json() for v in value]
        if isinstance(value, DimExpr) and kind in ("int", "any"):
            return self.scope.value(value) if kind == "int" else value.to_json()
        return value

    def _emit(
        self,
        op_type: str,
        inputs: Sequence[Any],
        attrs: dict[str, Any],
        names: Sequence[str | None] = (),
        n_out: int | None = None,
    ) -> list[GraphRef]:
        loc = user_location()
        registry = op_registry()
        if op_type not in registry:
            raise error(
                "E014",
                f"unknown op {op_type!r}",
                "name an op of kiln's registry (`kiln plugins` lists the plugins that add ops); "
                "register new ops with kiln.core.register_op",
                loc,
            )
        opdef = registry.get_op(op_type)
        refs = [self._ref(x, f"{op_type} input") for x in inputs]
        while refs and refs[-1] is None and len(refs) > len([i for i in opdef.inputs if not i.endswith("?")]):
            refs.pop()
        count = n_out if n_out is not None else opdef.default_outputs
        bad = opdef.arity_ok(len(refs), count)
        if bad:
            raise error(
                "E003",
                f"op {op_type!r} takes {bad}, found {len(refs)} inputs",
                f"signature: ({', '.join(opdef.inputs)}) -> ({', '.join(opdef.outputs)})",
                loc,
            )
        kinds = {a.name: a.kind for a in opdef.attrs}
        clean = {
            k: self._attr_value(op_type, k, kinds.get(k, "any"), v) for k, v in attrs.items() if v is not None
        }
        try:
            resolved = opdef.resolve_attrs(clean)
            in_types = [r.type if r is not None else None for r in refs]
            types = list(opdef.infer(InferContext(op_type, in_types, resolved)))
        except KilnError as exc:
            found = ", ".join(str(r.type) if r is not None else "_" for r in refs)
            raise error(
                exc.code or "E003", exc.message, exc.hint or f"the inputs are ({found})", loc
            ) from None
        self._check_narrowing(opdef, refs, types, loc)
        outs = []
        for k in range(count):
            name = names[k] if k < len(names) else None
            ref = GraphRef(self, types[min(k, len(types) - 1)], "op")
            if name is not None:
                self._claim(name, ref, loc)
            outs.append(ref)
        index = len(self._state.ops)
        for ref in outs:
            ref.producer = index
        self._state.ops.append((op_type, refs, outs, clean, loc))
        return outs

    def _check_narrowing(self, opdef: OpDef, refs: Sequence[GraphRef | None], types: Sequence[TensorType],
                         loc: str | None) -> None:
        """W005: a float input wider than every float result is rounded implicitly (an op with a ``dtype``
        attribute states its result type, so it narrows explicitly)."""
        if any(a.kind == "dtype" for a in opdef.attrs):
            return
        results = [DTYPES[t.dtype][0] for t in types if is_float(t.dtype)]
        if not results:
            return
        for i, ref in enumerate(refs):
            if ref is None or i in opdef.nondiff_inputs or not is_float(ref.dtype):
                continue
            if DTYPES[ref.dtype][0] > max(results):
                narrow = next(t.dtype for t in types if is_float(t.dtype))
                slot = opdef.inputs[min(i, len(opdef.inputs) - 1)].strip("*?")
                what = repr(slot) + (f" ({ref.name!r})" if ref.explicit and ref.name != slot else "")
                self._state.compiler.warnings.append(diag(
                    "W005",
                    f"op {opdef.name!r}: input {what} is {ref.dtype} but the result is {narrow}: the input "
                    "is rounded to the narrower dtype implicitly",
                    f"make both sides {narrow} where the tensor is declared, or keep the computation in "
                    f"{ref.dtype}",
                    loc,
                ))
                return

    def emit_call(
        self,
        inputs: Sequence[GraphRef],
        types: Sequence[TensorType],
        attrs: dict[str, Any],
        names: Sequence[str | None] = (),
    ) -> list[GraphRef]:
        """A structural ``call`` op (not in the op registry; checked against the called block)."""
        loc = user_location()
        outs = []
        for k, t in enumerate(types):
            ref = GraphRef(self, t, "op")
            if k < len(names) and names[k] is not None:
                self._claim(names[k], ref, loc)  # type: ignore[arg-type]
            ref.producer = len(self._state.ops)
            outs.append(ref)
        self._state.ops.append(("call", list(inputs), outs, attrs, loc))
        return outs

    def _claim(self, local: str, ref: GraphRef, loc: str | None) -> None:
        if not isinstance(local, str) or not local:
            raise error(
                "E003",
                f"an output name must be a non-empty string, found {local!r}",
                'e.g. out_name="qkv"',
                loc,
            )
        full = self.prefix + local
        if full in self._state.taken:
            first = self._state.taken[full]
            raise error(
                "E017",
                f"tensor {full!r} is defined twice" + (f" (first at {first})" if first else ""),
                "every tensor is assigned once (SSA): give this result another out_name",
                loc,
            )
        self._state.taken[full] = loc
        ref._name, ref.explicit = full, True
        self.named[local] = ref

    def _one(self, op: str, inputs: Sequence[Any], attrs: dict[str, Any], out_name: str | None) -> GraphRef:
        return self._emit(op, inputs, attrs, [out_name])[0]

    # -- graph I/O and memory directives (seed 003 §8.2, §8.14) --
    def input(self, name: str, shape: Sequence[Any] | None = None, dtype: str = "bf16") -> GraphRef:
        """The input ``name`` (declared by the forward signature, or here with ``shape``)."""
        if name in self.inputs:
            return self.inputs[name]
        if shape is None or self.parent is not None:
            raise error(
                "E002",
                f"{name!r} is not an input of {type(self.obj).__name__}",
                "declare it as a forward argument with a Tensor[...] annotation, or pass shape=",
                user_location(),
            )
        ref = self.declare(self.prefix + name, TensorType([self.dim(d) for d in shape], dtype), "input", name)
        self._state.compiler.extra_inputs.append(ref)
        return ref

    def output(self, *refs: Any) -> None:
        """Mark the graph outputs (when the forward returns nothing)."""
        outs = [self._ref(r, "output") for r in refs]
        self._state.outputs = [r for r in outs if r is not None]

    def save(self, *names: Any) -> None:
        """Keep these tensors (names or refs) for the backward pass."""
        self._state.save += [(self.prefix, n, user_location()) for n in names]

    def mark_recompute(self, *names: Any) -> None:
        """Recompute these tensors in the backward pass instead of keeping them."""
        self._state.recompute += [(self.prefix, n, user_location()) for n in names]

    def annotate(self, ref: Any, *annotations: Any) -> Any:
        """Attach seed 004 §7 annotations to a tensor, as ``ref @ annotation`` does (``ref`` may be a
        tuple of tensors); returns ``ref``."""
        from kiln.dsl._annotations import ANNOTATIONS, AnnotationFactory, AnnotationValue

        for t in ref if isinstance(ref, (tuple, list)) else (ref,):
            target = self._ref(t, "annotated tensor")
            for ann in annotations:
                if isinstance(ann, AnnotationFactory):
                    ann = ann.make((), {}, user_location())
                if not isinstance(ann, AnnotationValue):
                    raise error("E008", f"annotate(): expected an annotation, found {ann!r:.60}",
                                "e.g. g.annotate(q, hook('AfterQKNorm'))", user_location())
                if "tensor" not in ANNOTATIONS[ann.kind].applies_to:
                    where = " or ".join(ANNOTATIONS[ann.kind].applies_to)
                    raise error("E008", f"@{ann.kind} annotates a {where}, not a tensor "
                                f"({target.name if target is not None else ref!r})",
                                f"write it on a {where}", ann.loc)
                if target is not None:
                    self._state.annotations.append((target, ann))
        return ref

    def saved(self, name: str) -> GraphRef:
        """``saved.<name>``: the forward tensor as a backward graph reads it."""
        forward = self._state.forward
        if forward is None:
            base = self._ref(name, "saved tensor")
            assert base is not None
        elif name in forward:  # in a @backward method: any tensor of the forward graph
            base = GraphRef(self, forward[name], "forward", name, explicit=True)
        else:
            raise error(
                "E006",
                f"saved tensor {name!r} is not a tensor of the forward graph of {type(self.obj).__name__}",
                "name a forward input, parameter or tensor by its IR name (out_name= or its variable)",
                user_location(),
            )
        ref = GraphRef(self, base.type, "saved", explicit=True)
        ref.var = base
        return ref

    # -- matrix ops (§8.3) --
    def matmul(
        self,
        a: Any,
        b: Any,
        c: Any = None,
        *,
        transpose: str = "NN",
        accumulate: bool = False,
        alpha: float = 1.0,
        beta: float = 0.0,
        out_name: str | None = None,
    ) -> GraphRef:
        if accumulate and c is None:
            raise error(
                "E003",
                "matmul(accumulate=True) needs the accumulator tensor",
                "pass it as the third argument: g.matmul(a, b, c, accumulate=True)",
                user_location(),
            )
        attrs: dict[str, Any] = {"transpose": transpose}
        if alpha != 1.0:
            attrs["alpha"] = alpha
        if accumulate:
            attrs.update(accumulate=True, beta=beta if beta != 0.0 else 1.0)
        return self._one("matmul", [a, b, c], attrs, out_name)

    def matmul_bias(
        self, a: Any, b: Any, bias: Any, *, transpose: str = "NT", out_name: str | None = None
    ) -> GraphRef:
        return self._one("matmul_bias", [a, b, bias], {"transpose": transpose}, out_name)

    def batched_matmul(
        self, a: Any, b: Any, *, transpose: str = "NN", alpha: float = 1.0, out_name: str | None = None
    ) -> GraphRef:
        attrs: dict[str, Any] = {"transpose": transpose}
        if alpha != 1.0:
            attrs["alpha"] = alpha
        return self._one("batched_matmul", [a, b], attrs, out_name)

    # -- normalization (§8.4) --
    def rmsnorm(
        self,
        x: Any,
        weight: Any,
        *,
        eps: float = 1e-6,
        y_name: str | None = None,
        rstd_name: str | None = None,
        out_name: str | None = None,
    ) -> tuple[GraphRef, GraphRef]:
        y, rstd = self._emit("rmsnorm", [x, weight], {"eps": eps}, [y_name or out_name, rstd_name])
        return y, rstd

    def fused_residual_rmsnorm(
        self,
        residual: Any,
        x: Any,
        weight: Any,
        *,
        eps: float = 1e-6,
        res_out_name: str | None = None,
        y_name: str | None = None,
        rstd_name: str | None = None,
    ) -> tuple[GraphRef, GraphRef, GraphRef]:
        res, y, rstd = self._emit(
            "fused_residual_rmsnorm", [residual, x, weight], {"eps": eps}, [res_out_name, y_name, rstd_name]
        )
        return res, y, rstd

    def qk_norm(
        self,
        q: Any,
        k: Any,
        q_weight: Any,
        k_weight: Any,
        *,
        eps: float = 1e-6,
        q_name: str | None = None,
        k_name: str | None = None,
        q_rstd_name: str | None = None,
        k_rstd_name: str | None = None,
    ) -> tuple[GraphRef, GraphRef, GraphRef, GraphRef]:
        """RMSNorm of each query and key head vector (last dim); returns (q_norm, k_norm, q_rstd, k_rstd)."""
        q_norm, k_norm, q_rstd, k_rstd = self._emit(
            "qk_norm", [q, k, q_weight, k_weight], {"eps": eps}, [q_name, k_name, q_rstd_name, k_rstd_name]
        )
        return q_norm, k_norm, q_rstd, k_rstd

    def layernorm(
        self,
        x: Any,
        weight: Any,
        bias: Any = None,
        *,
        eps: float = 1e-5,
        y_name: str | None = None,
        mean_name: str | None = None,
        rstd_name: str | None = None,
    ) -> tuple[GraphRef, GraphRef, GraphRef]:
        y, mean, rstd = self._emit(
            "layernorm", [x, weight, bias], {"eps": eps}, [y_name, mean_name, rstd_name]
        )
        return y, mean, rstd

    # -- activations (§8.5) --
    def swiglu(self, x: Any, *, out_name: str | None = None) -> GraphRef:
        return self._one("swiglu", [x], {}, out_name)

    def silu(self, x: Any, *, out_name: str | None = None) -> GraphRef:
        return self._one("silu", [x], {}, out_name)

    def relu(self, x: Any, *, out_name: str | None = None) -> GraphRef:
        return self._one("relu", [x], {}, out_name)

    def relu2(self, x: Any, *, out_name: str | None = None) -> GraphRef:
        return self._one("relu2", [x], {}, out_name)

    def gelu(self, x: Any, *, approximate: str = "tanh", out_name: str | None = None) -> GraphRef:
        return self._one("gelu", [x], {"approximate": approximate}, out_name)

    def softmax(self, x: Any, dim: int = -1, *, out_name: str | None = None) -> GraphRef:
        return self._one("softmax", [x], {"axis": dim}, out_name)

    def silu_mul(self, gate: Any, up: Any, *, out_name: str | None = None) -> GraphRef:
        return self._one("silu_mul", [gate, up], {}, out_name)

    def geglu(
        self, gate: Any, up: Any, *, approximate: str = "none", out_name: str | None = None
    ) -> GraphRef:
        """``gelu(gate) * up``: exact gelu, or its tanh approximation with ``approximate="tanh"``."""
        return self._one("geglu", [gate, up], {"approximate": approximate}, out_name)

    # -- attention (§8.6) --
    def _heads(self, what: str, Hq: Any, Hkv: Any, D: Any) -> dict[str, Any]:
        return {
            "Hq": Hq if Hq is not None else self._scope_dim("Hq", what),
            "Hkv": Hkv if Hkv is not None else self._scope_dim("Hkv", what),
            "D": D if D is not None else self._scope_dim("D", what),
        }

    def _theta(self, theta: float | None) -> float:
        if theta is not None:
            return theta
        value = self.scope.config.get("rope_theta", getattr(self.obj, "rope_theta", None))
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 10000.0

    def flash_attention(
        self,
        qkv: Any,
        segment_ids: Any = None,
        *,
        causal: bool = True,
        softmax_scale: float | None = None,
        window_size: int | None = None,
        softcap: float | None = None,
        alibi: bool = False,
        Hq: Any = None,
        Hkv: Any = None,
        D: Any = None,
        out_name: str | None = None,
        lse_name: str | None = None,
    ) -> tuple[GraphRef, GraphRef]:
        """Attention on packed ``[B, T, (Hq + 2 * Hkv) * D]`` qkv; heads default to the module's dims.
        ``segment_ids [B, T]`` (optional) keeps each query to keys of its own segment (packed documents,
        padding); ``softcap`` and ``alibi`` as in :meth:`flash_attention_qkv`."""
        attrs = {
            **self._heads("flash_attention", Hq, Hkv, D),
            "causal": causal,
            "softmax_scale": softmax_scale,
            "window_size": window_size,
            "softcap": softcap,
            "alibi": alibi or None,
        }
        ins = [qkv] if segment_ids is None else [qkv, segment_ids]
        out, lse = self._emit("flash_attention", ins, attrs, [out_name, lse_name])
        return out, lse

    def flash_attention_qkv(
        self,
        q: Any,
        k: Any,
        v: Any,
        segment_ids: Any = None,
        *,
        causal: bool = True,
        softmax_scale: float | None = None,
        window_size: int | None = None,
        softcap: float | None = None,
        alibi: bool = False,
        out_name: str | None = None,
        lse_name: str | None = None,
    ) -> tuple[GraphRef, GraphRef]:
        """Attention on separate ``[B, T, H, D]`` q, k, v (kiln op ``attention``); ``segment_ids`` as in
        :meth:`flash_attention`. ``softcap`` caps the logits (``c * tanh(s / c)``, Gemma-2) and ``alibi``
        adds ALiBi's ``-slope_h * |p - j|``."""
        attrs = {"causal": causal, "softmax_scale": softmax_scale, "window_size": window_size,
                 "softcap": softcap, "alibi": alibi or None}
        ins = [q, k, v] if segment_ids is None else [q, k, v, segment_ids]
        out, lse = self._emit("attention", ins, attrs, [out_name, lse_name])
        return out, lse

    def rope(
        self,
        x: Any,
        freqs: Any = None,
        position_ids: Any = None,
        *,
        rotary_dim: Any = None,
        head_dim: Any = None,
        theta: float | None = None,
        inverse: bool = False,
        interleaved: bool = False,
        out_name: str | None = None,
    ) -> GraphRef:
        """RoPE of every head of ``x [B, T, H * head_dim]``: HF's ``rotate_half`` pairs, or GPT-J's
        ``(2i, 2i + 1)`` pairs with ``interleaved=True``; a ``freqs`` table (:meth:`rope_freqs`)
        replaces ``theta``."""
        attrs = {
            "head_dim": head_dim if head_dim is not None else self._scope_dim("D", "rope"),
            "rotary_dim": rotary_dim,
            "theta": self._theta(theta),
            "inverse": inverse or None,
            "interleaved": interleaved or None,
        }
        return self._one("rope", [x, freqs, position_ids], attrs, out_name)

    def rope_freqs(
        self,
        rows: Any,
        rotary_dim: Any,
        *,
        theta: float | None = None,
        rope_type: str = "default",
        out_name: str | None = None,
        **scaling: Any,
    ) -> GraphRef:
        """The ``freqs`` table ``[rows, rotary_dim // 2, 2]`` of a RoPE kind, transformers' ``rope_type``
        (``default``, ``linear``, ``dynamic``, ``yarn``, ``llama3``) and parameters as keywords
        (``factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``,
        ``max_position_embeddings``, ``beta_fast``, ``beta_slow``, ``attention_factor``, ``mscale``,
        ``mscale_all_dim``, ``truncate``): pass it to :meth:`rope` or :meth:`qkv_qk_norm_rope`."""
        attrs = {"rows": rows, "rotary_dim": rotary_dim, "theta": self._theta(theta), "rope_type": rope_type,
                 **scaling}
        return self._one("rope_freqs", [], attrs, out_name)

    def qkv_qk_norm_rope(
        self,
        qkv: Any,
        q_norm_weight: Any = None,
        k_norm_weight: Any = None,
        freqs: Any = None,
        position_ids: Any = None,
        *,
        eps: float = 1e-6,
        rotary_dim: Any = None,
        theta: float | None = None,
        interleaved: bool = False,
        Hq: Any = None,
        Hkv: Any = None,
        D: Any = None,
        out_name: str | None = None,
        qkv_out_name: str | None = None,
        q_rstd_name: str | None = None,
        k_rstd_name: str | None = None,
    ) -> tuple[GraphRef, GraphRef, GraphRef]:
        """Fused optional QK-RMSNorm and RoPE on packed qkv; returns (qkv_out, q_rstd, k_rstd).
        ``interleaved`` and ``freqs`` as in :meth:`rope`."""
        if position_ids is None:
            raise error(
                "E003",
                "qkv_qk_norm_rope needs position_ids",
                "g.qkv_qk_norm_rope(qkv, q_norm, k_norm, freqs, position_ids)",
                user_location(),
            )
        attrs = {
            **self._heads("qkv_qk_norm_rope", Hq, Hkv, D),
            "eps": eps,
            "rotary_dim": rotary_dim,
            "theta": self._theta(theta),
            "interleaved": interleaved or None,
        }
        out, q_rstd, k_rstd = self._emit(
            "qkv_qk_norm_rope",
            [qkv, q_norm_weight, k_norm_weight, freqs, position_ids],
            attrs,
            [qkv_out_name or out_name, q_rstd_name, k_rstd_name],
        )
        return out, q_rstd, k_rstd

    # -- tensor manipulation (§8.7) --
    def view(self, x: Any, shape: Sequence[Any], *, out_name: str | None = None) -> GraphRef:
        return self._one("view", [x], {"shape": list(shape)}, out_name)

    def reshape(self, x: Any, shape: Sequence[Any], *, out_name: str | None = None) -> GraphRef:
        return self._one("reshape", [x], {"shape": list(shape)}, out_name)

    def transpose(self, x: Any, dim0: int = 0, dim1: int = 1, *, out_name: str | None = None) -> GraphRef:
        return self._one("transpose", [x], {"dim0": dim0, "dim1": dim1}, out_name)

    def permute(self, x: Any, dims: Sequence[int], *, out_name: str | None = None) -> GraphRef:
        return self._one("permute", [x], {"dims": list(dims)}, out_name)

    def split(
        self, x: Any, split_size: Sequence[Any], dim: int = 0, *, out_names: Sequence[str | None] = ()
    ) -> tuple[GraphRef, ...]:
        if isinstance(split_size, (int, str, DimExpr)):
            raise error(
                "E003",
                f"split(...): split_size must be a list of part sizes, found {split_size!r}",
                "e.g. g.split(x, split_size=[d1, d2], dim=0)",
                user_location(),
            )
        return tuple(
            self._emit(
                "split", [x], {"sizes": list(split_size), "dim": dim}, list(out_names), n_out=len(split_size)
            )
        )

    def index(self, x: Any, key: Any, *, out_name: str | None = None) -> GraphRef:
        """``x[key]`` with ints, slices of step 1 and one ``...`` known at compile time (seed 004 §5.11.4):
        each sliced dim is a ``split`` (the part kept), and the dims an int selects are dropped by a
        ``view``. Bounds outside a dim of static size are E004; anything but a compile-time int is E003."""
        ref = self._ref(x, "index")
        loc = user_location()
        if ref is None:
            raise error("E003", "index: the tensor is None", "index a tensor", loc)
        items = list(key) if isinstance(key, tuple) else [key]
        shown = ", ".join(_key_text(k) for k in items)
        where = f"{ref.name if ref._name else 'tensor'}[{shown}] of {ref.type}"
        rank = len(ref.shape)
        used = sum(k is not Ellipsis for k in items)
        if items.count(Ellipsis) > 1 or used > rank:
            raise error("E004", f"{where}: {used} indices for a tensor of rank {rank}"
                        + (" (and `...` twice)" if items.count(Ellipsis) > 1 else ""),
                        "give one index or slice per dim, and at most one `...`", loc)
        at = items.index(Ellipsis) if Ellipsis in items else len(items)
        items[at:at + 1] = [slice(None)] * (rank - used)
        root = self
        while root.parent is not None:  # shapes are in the symbols of the module being compiled
            root = root.parent
        out, drop = ref, []
        for axis, k in enumerate(items):
            dim = ref.shape[axis]
            try:  # its size under the config (B and T stay unknown)
                size: int | None = dim.evaluate(root.scope.bindings())
            except Exception:
                size = None
            if isinstance(k, slice):
                if k.step not in (None, 1) or not all(b is None or _is_int(b) for b in (k.start, k.stop)):
                    raise error("E003", f"{where}: slice {_key_text(k)} of dim {axis}",
                                "slices take compile-time ints and step 1 (seed 004 §5.11.4)", loc)
                lo, hi = k.start or 0, k.stop
            elif _is_int(k):
                lo, hi, drop = k, (k + 1) or None, [*drop, axis]  # x[..., -1] is the slice -1:
            else:
                raise error("E003", f"{where}: index {k!r} of dim {axis} is not a compile-time int or slice",
                            "indices are ConstExpr (seed 004 §5.11.4); select data-dependent rows with ops "
                            "such as embedding", loc)
            if size is not None:
                bad = [b for b in (lo, hi) if b is not None and not -size <= b <= size]
                if _is_int(k) and not -size <= k < size:
                    bad = [k]
                if bad:
                    raise error("E004", f"{where}: index {bad[0]} is out of range for dim {axis} of size "
                                f"{size}", f"indices of that dim lie in [{-size}, {size})", loc)
            start = simplify(dim + lo if lo < 0 else Const(lo))  # symbolic: x[:, 1:-1] is [B, D - 2]
            stop = simplify(dim if hi is None else dim + hi if hi < 0 else Const(hi))
            if size is not None:  # a known size: the part kept must not be empty; one to the end ends at dim
                lo_at = lo + size if lo < 0 else lo
                hi_at = size if hi is None else hi + size if hi < 0 else hi
                if hi_at <= lo_at:
                    raise error("E004", f"{where}: dim {axis} of size {size} is sliced to {hi_at - lo_at} "
                                "elements", "a slice keeps at least one element", loc)
                start, stop = (Const(0) if lo_at == 0 else start), (dim if hi_at == size else stop)
            if dims_equal(start, Const(0)) and dims_equal(stop, dim):
                continue
            length = simplify(stop - start)
            if isinstance(length, Const) and length.value <= 0:
                raise error("E004", f"{where}: dim {axis} is sliced to {length.value} elements",
                            "a slice keeps at least one element", loc)
            sizes = [(start, False), (length, True), (simplify(dim - stop), False)]
            sizes = [(n, keep) for n, keep in sizes if keep or not dims_equal(n, Const(0))]
            parts = self._emit("split", [out], {"sizes": [n for n, _ in sizes], "dim": axis}, [],
                               n_out=len(sizes))
            out = parts[[keep for _, keep in sizes].index(True)]
        if drop:
            shape = [d for a, d in enumerate(out.shape) if a not in drop]
            return self._one("view", [out], {"shape": shape}, out_name)
        if out is ref or out_name is not None:
            return self._one("view", [out], {"shape": list(out.shape)}, out_name)  # an alias, named
        return out

    def concat(self, *xs: Any, dim: int = 0, out_name: str | None = None) -> GraphRef:
        return self._one("concat", list(xs), {"dim": dim}, out_name)

    def copy(self, x: Any, *, out_name: str | None = None) -> GraphRef:
        return self._one("copy", [x], {}, out_name)

    def cast(self, x: Any, dtype: str, *, out_name: str | None = None) -> GraphRef:
        """``x``'s values rounded to ``dtype`` (seed 004 §7.4.4; the gradient is cast back)."""
        return self._one("cast", [x], {"dtype": dtype}, out_name)

    def contiguous(self, x: Any, *, out_name: str | None = None) -> GraphRef:
        return self._one("contiguous", [x], {}, out_name)

    # -- elementwise (§8.8) --
    def add(self, a: Any, b: Any, *, out_name: str | None = None) -> GraphRef:
        return self._one("add", [a, b], {}, out_name)

    def add3(self, a: Any, b: Any, c: Any, *, out_name: str | None = None) -> GraphRef:
        """``a + b + c`` of one shape (a parallel residual: input, attention and MLP outputs)."""
        return self._one("add3", [a, b, c], {}, out_name)

    def mul(self, a: Any, b: Any, *, out_name: str | None = None) -> GraphRef:
        return self._one("mul", [a, b], {}, out_name)

    def scale(self, x: Any, factor: float, *, out_name: str | None = None) -> GraphRef:
        return self._one("scale", [x], {"factor": factor}, out_name)

    def bias_add(self, x: Any, bias: Any, *, out_name: str | None = None) -> GraphRef:
        return self._one("bias_add", [x, bias], {}, out_name)

    def div(self, a: Any, b: Any, *, out_name: str | None = None) -> GraphRef:
        """``a / b``; ``b`` has a's shape or broadcasts to it, as for ``add``."""
        return self._one("div", [a, b], {}, out_name)

    def exp(self, x: Any, *, out_name: str | None = None) -> GraphRef:
        return self._one("exp", [x], {}, out_name)

    def sigmoid(self, x: Any, *, out_name: str | None = None) -> GraphRef:
        return self._one("sigmoid", [x], {}, out_name)

    def reciprocal(self, x: Any, *, out_name: str | None = None) -> GraphRef:
        return self._one("reciprocal", [x], {}, out_name)

    # -- reductions (seed 004 §6.7: ``dims``, ``keepdim``) --
    def _reduce(
        self, op: str, x: Any, dims: int | Sequence[int], keepdim: bool, out_name: str | None
    ) -> GraphRef:
        axes = [dims] if isinstance(dims, int) else list(dims)
        return self._one(op, [x], {"axes": axes, "keepdims": keepdim}, out_name)

    def reduce_sum(self, x: Any, dims: int | Sequence[int], keepdim: bool = False, *,
                   out_name: str | None = None) -> GraphRef:
        """Sum over ``dims`` (kept as size 1 with ``keepdim``)."""
        return self._reduce("reduce_sum", x, dims, keepdim, out_name)

    def reduce_mean(self, x: Any, dims: int | Sequence[int], keepdim: bool = False, *,
                    out_name: str | None = None) -> GraphRef:
        """Mean over ``dims``."""
        return self._reduce("reduce_mean", x, dims, keepdim, out_name)

    def reduce_max(self, x: Any, dims: int | Sequence[int], keepdim: bool = False, *,
                   out_name: str | None = None) -> GraphRef:
        """Maximum over ``dims``; ties share the gradient evenly."""
        return self._reduce("reduce_max", x, dims, keepdim, out_name)

    # -- embedding and loss (§8.9) --
    def embedding(self, token_ids: Any, weight: Any, *, padding_idx: int | None = None,
                  out_name: str | None = None) -> GraphRef:
        """``weight[token_ids]``; the row ``padding_idx`` gets no gradient (``torch.nn.Embedding``)."""
        attrs = {} if padding_idx is None else {"padding_idx": padding_idx}
        return self._one("embedding", [token_ids, weight], attrs, out_name)

    def fused_lm_head_loss(
        self,
        x: Any,
        weight: Any,
        targets: Any,
        *,
        compute_accuracy: bool = False,
        ignore_index: int = -100,
        chunk_size: int | None = None,
        softcap: float | None = None,
        out_name: str | None = None,
        lse_name: str | None = None,
    ) -> GraphRef:
        """Per-token cross-entropy of ``x @ weight^T`` ([B * T], fp32); [B, T] targets are flattened."""
        t = self._ref(targets, "targets")
        assert t is not None
        if len(t.shape) > 1:
            rows = t.shape[0]
            for d in t.shape[1:]:
                rows = rows * d
            flat = self._emit("view", [t], {"shape": [rows]})[0]
            flat.var = f"{t.name.rsplit('.', 1)[-1]}_flat" if t.explicit else None
            t = flat
        attrs = {
            "ignore_index": ignore_index if ignore_index != -100 else None,
            "chunk_size": chunk_size,
            "softcap": softcap,
            "_compute_accuracy": compute_accuracy or None,
        }
        return self._emit("fused_lm_head_loss", [x, weight, t], attrs, [out_name, lse_name])[0]

    # -- initialization (§8.10) --
    def _creation(
        self, op: str, shape: Sequence[Any], dtype: str, out_name: str | None, **extra: Any
    ) -> GraphRef:
        if dtype not in DTYPES:
            raise error(
                "E003", f"{op}(...): unknown dtype {dtype!r}", f"one of {', '.join(DTYPES)}", user_location()
            )
        return self._one(op, [], {"shape": list(shape), "dtype": dtype, **extra}, out_name)

    def zeros(self, shape: Sequence[Any], dtype: str = "bf16", *, out_name: str | None = None) -> GraphRef:
        return self._creation("zeros", shape, dtype, out_name)

    def ones(self, shape: Sequence[Any], dtype: str = "bf16", *, out_name: str | None = None) -> GraphRef:
        return self._creation("ones", shape, dtype, out_name)

    def fill(
        self, shape: Sequence[Any], value: float, dtype: str = "bf16", *, out_name: str | None = None
    ) -> GraphRef:
        return self._creation("fill", shape, dtype, out_name, value=value)

    # -- MoE (§8.11) --
    def moe_softmax(self, logits: Any, *, out_name: str | None = None) -> GraphRef:
        return self._one("moe_softmax", [logits], {}, out_name)

    def moe_sigmoid(self, logits: Any, *, out_name: str | None = None) -> GraphRef:
        return self._one("moe_sigmoid", [logits], {}, out_name)

    def moe_router(
        self,
        x: Any,
        gate: Any,
        top_k: int,
        normalize: bool = True,
        *,
        aux_loss_coef: float = 0.01,
        use_sigmoid: bool = False,
        weights_name: str | None = None,
        indices_name: str | None = None,
        aux_loss_name: str | None = None,
    ) -> tuple[GraphRef, GraphRef, GraphRef]:
        """Routing of ``[N, C]`` tokens by ``gate [E, C]``: returns (weights, indices, aux_loss), the
        load-balancing loss already scaled by ``aux_loss_coef`` (add it to the model's loss)."""
        attrs = {"top_k": top_k, "normalize": normalize, "aux_loss_coef": aux_loss_coef,
                 "use_sigmoid": use_sigmoid}
        w, idx, aux = self._emit("moe_router", [x, gate], attrs, [weights_name, indices_name, aux_loss_name])
        return w, idx, aux

    def moe_load_stats(
        self,
        probs: Any,
        indices: Any,
        segment_ids: Any = None,
        *,
        load_name: str | None = None,
        mean_probs_name: str | None = None,
    ) -> tuple[GraphRef, GraphRef]:
        """One MoE layer's routing statistics ``[E]``: the share of the top-k assignments each expert
        gets and its mean router probability, over the rows whose ``segment_ids`` (``[N]``, optional)
        are not 0 (padding). Sum them over the layers and pass them to :meth:`moe_aux_loss`."""
        ins = [probs, indices] if segment_ids is None else [probs, indices, segment_ids]
        load, mean = self._emit("moe_load_stats", ins, {}, [load_name, mean_probs_name])
        return load, mean

    def moe_aux_loss(
        self,
        loss: Any,
        targets: Any,
        load: Any,
        mean_probs: Any,
        *,
        coef: float,
        num_layers: int,
        ignore_index: int = -100,
        out_name: str | None = None,
        aux_loss_name: str | None = None,
    ) -> GraphRef:
        """The per-token ``loss`` plus ``coef`` times transformers' load-balancing loss of ``num_layers``
        MoE layers (``load`` and ``mean_probs``: their :meth:`moe_load_stats` summed) on every token whose
        target is not ``ignore_index``: the mean loss grows by ``coef * aux_loss``, as in
        ``MixtralForCausalLM`` with ``output_router_logits``. [B, T] targets are flattened."""
        t = self._ref(targets, "targets")
        assert t is not None
        if len(t.shape) > 1:
            rows = t.shape[0]
            for d in t.shape[1:]:
                rows = rows * d
            t = self._emit("view", [t], {"shape": [rows]})[0]
        attrs = {"coef": coef, "num_layers": num_layers,
                 "ignore_index": ignore_index if ignore_index != -100 else None}
        return self._emit("moe_aux_loss", [loss, t, load, mean_probs], attrs, [out_name, aux_loss_name])[0]

    def grouped_gemm(
        self, x: Any, weight: Any, offsets: Any, *, transpose: str = "NT", out_name: str | None = None
    ) -> GraphRef:
        """Rows ``offsets[g]:offsets[g + 1]`` of ``x`` times ``weight[g]`` (transposed for ``NT``, the
        ``[G, O, I]`` layout); given :meth:`moe_permute`'s scatter indices, it reads their expert offsets."""
        attrs = {"transpose": transpose}
        return self._one("grouped_gemm", [x, weight, self._offsets(offsets)], attrs, out_name)

    def moe_topk(
        self,
        probs: Any,
        top_k: int,
        normalize: bool = False,
        *,
        weights_name: str | None = None,
        indices_name: str | None = None,
    ) -> tuple[GraphRef, GraphRef]:
        w, idx = self._emit(
            "moe_topk", [probs], {"k": top_k, "normalize": normalize}, [weights_name, indices_name]
        )
        return w, idx

    def moe_permute(
        self,
        x: Any,
        indices: Any,
        top_k: int | None = None,
        *,
        num_experts: Any = None,
        out_name: str | None = None,
        scatter_name: str | None = None,
        offsets_name: str | None = None,
    ) -> tuple[GraphRef, GraphRef]:
        """Group token rows by expert; returns (permuted, scatter_indices). The expert offsets it also
        produces are passed on automatically when the scatter indices reach a grouped GEMM."""
        e = num_experts if num_experts is not None else self._scope_dim("E", "moe_permute")
        x_perm, scatter, offsets = self._emit(
            "moe_permute", [x, indices], {"num_experts": e}, [out_name, scatter_name, offsets_name]
        )
        self._state.offsets[id(scatter)] = offsets
        idx = self._ref(indices)
        self._state.scatter[id(idx)] = scatter
        return x_perm, scatter

    def _offsets(self, ref: Any) -> Any:
        r = self._ref(ref, "expert offsets")
        return self._state.offsets.get(id(r), r)

    def moe_grouped_gemm_gate_up(
        self, x: Any, weight: Any, offsets: Any, *, out_name: str | None = None
    ) -> GraphRef:
        return self._one("moe_grouped_gemm_gate_up", [x, weight, self._offsets(offsets)], {}, out_name)

    def moe_grouped_gemm_down(
        self, x: Any, weight: Any, offsets: Any, *, out_name: str | None = None
    ) -> GraphRef:
        return self._one("moe_grouped_gemm_down", [x, weight, self._offsets(offsets)], {}, out_name)

    def moe_unpermute(
        self, y: Any, weights: Any, indices: Any, top_k: int | None = None, *, out_name: str | None = None
    ) -> GraphRef:
        idx = self._ref(indices, "scatter indices")
        scatter = self._state.scatter.get(id(idx), idx)
        return self._one("moe_unpermute", [y, weights, scatter], {"top_k": top_k}, out_name)

    # -- calls and custom ops (§8.12) --
    def custom(
        self,
        op: str,
        *inputs: Any,
        num_outputs: int | None = None,
        out_name: str | None = None,
        out_names: Sequence[str | None] = (),
        **attrs: Any,
    ) -> Any:
        """Any op of kiln's registry by name (E014 if it is not registered)."""
        outs = self._emit(op, list(inputs), attrs, list(out_names) or [out_name], n_out=num_outputs)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def call(
        self,
        target: Any,
        *inputs: Any,
        num_outputs: int | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """``call("StackedBlocks", x0, residual0, position_ids, num_outputs=2, blocks="blocks",
        n_layers=...)`` repeats a block; ``call(submodule, x, name="mlp")`` inlines a submodule
        (an instance, the name of an attribute holding one, or a module class or name plus its
        constructor arguments as keywords) with its tensors and parameters under ``name.``."""
        compiler = self._state.compiler
        if target == "StackedBlocks":
            return compiler.stacked_call(self, list(inputs), num_outputs, kwargs)
        return compiler.inline_call(self, target, list(inputs), num_outputs, name, kwargs)

    # -- for other frontends (docs/dsl.md, "API for other frontends") --
    @property
    def op_count(self) -> int:
        """How many ops the graph being compiled holds so far (inlined calls included): remember it
        before emitting a statement's ops, then pass it to :meth:`locate`."""
        return len(self._state.ops)

    def locate(self, since: int, loc: str | None, **attrs: Any) -> None:
        """Attribute the ops emitted from index ``since`` (an earlier :attr:`op_count`) on to the source
        location ``loc`` (``"file:line:col"``, what diagnostics and the IR's op locations show) instead
        of the Python line that emitted them; ``attrs`` are added to the last of those ops' attributes.
        Warnings those ops raised (W005) move to ``loc`` with them."""
        ops = self._state.ops
        if not 0 <= since <= len(ops):
            raise error("E003", f"locate: since must be an op count in [0, {len(ops)}], found {since!r}",
                        "pass g.op_count read before emitting the ops", loc)
        moved = {ops[i][4] for i in range(since, len(ops))} - {None, loc}
        for i in range(since, len(ops)):
            op_type, ins, outs, op_attrs, _ = ops[i]
            if attrs and i == len(ops) - 1:
                op_attrs = {**op_attrs, **attrs}
            ops[i] = (op_type, ins, outs, op_attrs, loc)
        warnings = self._state.compiler.warnings
        for k, w in enumerate(warnings):
            if w.location in moved:
                warnings[k] = diag(w.code, w.message, w.hint, loc)

    def name_tensor(self, name: str, ref: Any, loc: str | None = None) -> GraphRef:
        """Give the op result ``ref`` the fixed name ``name`` (like ``out_name=``, after the fact), as if
        it had been defined at ``loc``; a name already taken is E017 naming both places."""
        found = self.resolve(ref, "name_tensor")
        self._claim(name, found, loc)
        return found

    def resolve(self, x: Any, what: str = "input") -> GraphRef:
        """The tensor ``x`` stands for: a GraphRef of this graph, or the name of a parameter, input or
        named tensor (``"saved.x"`` for a saved forward tensor in a ``@backward``). E002 if unknown."""
        found = self._ref(x, what)
        if found is None:
            raise error("E003", f"{what}: expected a tensor, found {x!r}", "pass a GraphRef or a name",
                        user_location())
        return found

    def scatter_indices(self, indices: Any) -> GraphRef | None:
        """The scatter indices :meth:`moe_permute` produced for these top-k ``indices`` (what
        :meth:`moe_unpermute` and the grouped GEMMs read), or None if they were not permuted."""
        return self._state.scatter.get(id(self.resolve(indices, "scatter_indices")))


def _key_text(k: Any) -> str:
    if k is Ellipsis:
        return "..."
    if isinstance(k, slice):
        text = ":".join("" if b is None else str(b) for b in (k.start, k.stop))
        return text + ("" if k.step is None else f":{k.step}")
    return repr(k)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def graph() -> GraphBuilder:
    """The builder of the forward graph being compiled: ``with graph() as g: ...``."""
    builder = _ACTIVE.get()
    if builder is None:
        raise error(
            "E001",
            "graph() is only available while kiln compiles a @forward method",
            "compile the model with kiln.dsl.compile_model(...) or build_bundle(...)",
            user_location(),
        )
    return builder


def current_builder(what: str) -> GraphBuilder:
    builder = _ACTIVE.get()
    if builder is None:
        raise error(
            "E001",
            f"{what} can only be called inside a graph being compiled",
            "call it from a @forward method while kiln compiles the model",
            user_location(),
        )
    return builder


class active:
    """Make ``builder`` the one ``graph()`` returns while a forward method runs."""

    def __init__(self, builder: GraphBuilder) -> None:
        self.builder = builder

    def __enter__(self) -> GraphBuilder:
        self.token = _ACTIVE.set(self.builder)
        return self.builder

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.reset(self.token)


def finalize_names(state: _State) -> None:
    """Give every op result its SSA name: explicit, else its variable's, else ``<op>_<n>``."""
    taken = set(state.taken)
    for _, _, outs, _, _ in state.ops:
        for ref in outs:
            if not ref.explicit and ref.var is not None:
                name = ref.builder.prefix + ref.var
                if name not in taken:
                    ref._name = name
                    taken.add(name)
    counters: dict[str, int] = {}
    registry = op_registry()
    for op_type, _, outs, _, _ in state.ops:
        pending = [r for r in outs if r._name is None]
        if not pending:
            continue
        prefix = pending[0].builder.prefix
        schema = registry[op_type].outputs if op_type in registry else ()
        labels = [
            schema[i] if i < len(schema) and not schema[i].startswith("*") else str(i)
            for i in range(len(outs))
        ]
        named = next((r for r in outs if r._name is not None), None)
        if named is not None:  # siblings of a named result: "<name>_<output>", e.g. loss_lse
            for i, ref in enumerate(outs):
                candidate = f"{named._name}_{labels[i]}"
                if ref._name is None and candidate not in taken:
                    ref._name = candidate
                    taken.add(candidate)
            pending = [r for r in outs if r._name is None]
            if not pending:
                continue
        while True:
            counters[prefix + op_type] = k = counters.get(prefix + op_type, 0) + 1
            base = f"{prefix}{op_type}_{k}"
            names = [base] if len(outs) == 1 else [f"{base}_{label}" for label in labels]
            if not any(n in taken for n in names):
                break
        for i, ref in enumerate(outs):
            if ref._name is None:
                ref._name = names[0] if len(outs) == 1 else names[i]
                taken.add(ref._name)


def to_ops(state: _State) -> list[Op]:
    out = []
    for op_type, ins, outs, attrs, loc in state.ops:
        out.append(
            Op(
                op_type,
                [r.name if r is not None else "" for r in ins],
                [r.name for r in outs],
                attrs,
                loc=_short(loc),
            )
        )
    return out


def iter_refs(items: Iterable[Any]) -> Iterable[GraphRef]:
    for x in items:
        if isinstance(x, GraphRef):
            yield x
        elif isinstance(x, (tuple, list)):
            yield from iter_refs(x)
