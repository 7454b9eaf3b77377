"""Compile decorated classes to kiln IR: a Bundle of the model Module and the block Modules it repeats.

Submodules are inlined into their caller's graph under a dotted prefix; a ``StackedBlocks`` call
stays one structural ``call`` op plus one block Module, so the IR does not grow with the layer
count. Every symbol of a module's shapes (other than ``B`` and ``T``) is an int entry of its config.
"""

from __future__ import annotations

import inspect
import json
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from kiln.core import Diagnostic, KilnError, TensorType, op_registry
from kiln.core.autodiff import DeriveBackwardOptions, derive_backward
from kiln.core.ir import (
    PARAM_ROLES,
    ActivationLayout,
    ActivationSlot,
    Bundle,
    ConditionError,
    DimExpr,
    Graph,
    LoraTarget,
    Module,
    ParamSpec,
    TensorDecl,
    diagnostics,
    dim_bindings,
    dims_equal,
    freeze,
    parse_condition,
    parse_dim,
    thaw,
)
from kiln.dsl import _annotations
from kiln.dsl._builder import GraphBuilder, GraphRef, _State, active, finalize_names, iter_refs, to_ops
from kiln.dsl._decorators import (
    _REGISTRY,
    Activation,
    Gradient,
    ModuleSpec,
    Param,
    _lookup_name,
    _ParamMethod,
    is_component,
    kind_of,
    registry,
    spec_of,
)
from kiln.dsl._errors import (
    DSLError,
    class_location,
    diag,
    error,
    function_location,
    traceback_location,
    user_location,
)
from kiln.dsl._hf import mapping_json
from kiln.dsl._scope import Scope, check_condition, translate
from kiln.dsl._types import ArrayType, TensorAnnotation

__all__ = ["build_bundle", "compile_model", "compile_model_for_hf", "hf_to_config"]

# (op, input index) of weights that normalise (init ones) and of biases (init zeros)
_ONES = {
    ("rmsnorm", 1),
    ("fused_residual_rmsnorm", 2),
    ("layernorm", 1),
    ("qkv_qk_norm_rope", 1),
    ("qkv_qk_norm_rope", 2),
    ("rmsnorm_apply_saved", 2),
    ("fused_residual_rmsnorm_apply_saved", 3),
}
_ZEROS = {("matmul_bias", 2), ("bias_add", 1), ("layernorm", 2)}


def _json_value(v: Any) -> bool:
    if isinstance(v, DimExpr):
        return False
    try:
        freeze(v)
        return True
    except KilnError:
        return False


#: ``Tensor["*", "C"]``: variadic leading dims (seed 004 §3), bound by each ``g.call`` to the leading dims
#: of the tensor passed; the IR holds the specialised shapes
VARIADIC = "*"


def _short_loc(loc: str) -> str:
    """``file:line`` as the IR keeps it on an op (base name only)."""
    path, _, line = loc.rpartition(":")
    return f"{path.replace(chr(92), '/').rsplit('/', 1)[-1]}:{line}"


def _tensor_types(annotation: Any) -> list[Any]:
    """The ``Tensor[...]`` annotations of a forward's return (one, or a tuple of them)."""
    if annotation is None or annotation is inspect.Signature.empty:
        return []
    if isinstance(annotation, TensorAnnotation):
        return [annotation]
    if typing.get_origin(annotation) is tuple:
        return list(typing.get_args(annotation))
    return [annotation]


class _Built:
    """One compiled module with what its callers need: scope, inputs and outputs."""

    def __init__(self, module: Module, scope: Scope, spec: ModuleSpec) -> None:
        self.module, self.scope, self.spec = module, scope, spec


class _Compiler:
    def __init__(self) -> None:
        self.warnings: list[Diagnostic] = []
        self.errors: list[Diagnostic] = []
        self.blocks: dict[Any, _Built] = {}
        self.block_order: list[Module] = []
        self.extra_inputs: list[GraphRef] = []
        self.arrays: dict[int, dict[str, tuple[_Built, int]]] = {}

    # -- instantiation --
    def instantiate(self, cls: type, config: Mapping[str, Any]) -> Any:
        init = cls.__init__  # type: ignore[misc]
        where = class_location(cls)
        if init is object.__init__:
            obj = cls()
            obj.__dict__["__kiln_args__"] = dict(config)
            obj.__dict__.update(config)
            return obj
        sig = inspect.signature(init)
        params = list(sig.parameters.values())[1:]
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
        names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        kwargs = {k: v for k, v in config.items() if takes_any or k in names}  # other keys are ignored
        missing = [
            p.name
            for p in params
            if p.default is p.empty
            and p.name not in kwargs
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        if missing:
            raise error(
                "E012",
                f"{cls.__name__} needs config value(s) for {', '.join(missing)}",
                "add them to the config passed to compile_model",
                where,
            )
        for key, value, expected in config_type_errors(cls, kwargs):
            raise error(
                "E012",
                f"config value {key} of {cls.__name__}: expected {expected}, found {type(value).__name__} "
                f"{value!r}",
                f"give {key} as {expected}",
                where,
            )
        try:
            return cls(**kwargs)
        except DSLError:
            raise
        except Exception as exc:
            raise error(
                "E001",
                f"{cls.__name__}.__init__ failed: {type(exc).__name__}: {exc}",
                "the constructor runs once at compile time with the config values",
                traceback_location(exc) or where,
            ) from None

    def config_of(self, obj: Any, caller: Scope | None) -> tuple[dict[str, Any], dict[str, DimExpr]]:
        """Constructor arguments, as the instance stored them (``__init__`` may fill in defaults)."""
        args = dict(obj.__dict__.get("__kiln_args__", {}))
        for k in args:
            v = obj.__dict__.get(k)
            if (
                v is not None
                and not isinstance(v, DimExpr)
                and _json_value(v)
                and not isinstance(args[k], DimExpr)
            ):
                args[k] = v
        config: dict[str, Any] = {}
        foreign: dict[str, DimExpr] = {}
        for k, v in args.items():
            if isinstance(v, DimExpr):
                if caller is None:
                    raise error(
                        "E008",
                        f"{type(obj).__name__} got dimension {v} for {k!r}; config values are ints",
                        "dimensions can be passed to submodules, not to the compiled root",
                        class_location(type(obj)),
                    )
                foreign[k] = v
                config[k] = caller.value(v)
            elif _json_value(v):
                config[k] = v
        return config, foreign

    # -- one module --
    def build(self, cls: type, config: Mapping[str, Any], kind: str | None = None) -> _Built:
        spec = spec_of(cls)
        kind = kind or kind_of(cls) or "module"
        self._check_compilable(spec)
        obj = self.instantiate(cls, config)
        cfg, foreign = self.config_of(obj, None)
        scope = Scope(obj, cfg, spec.dims, foreign)
        self.check_constraints(spec, scope)
        state = _State(self)
        builder = GraphBuilder(state, scope, obj)
        self.arrays[id(state)] = {}
        specs, decls = self.declare_params(builder, spec, state)
        inputs = self.declare_inputs(builder, spec)
        outs = self.run_forward(builder, spec, inputs)
        if kind == "model" and len(outs) == 1:
            self.name_loss(state, outs[0])
        finalize_names(state)
        ops = to_ops(state)
        save = self.memory_list(state, state.save, spec.save, spec, "save", ops, builder)
        recompute = self.memory_list(state, state.recompute, spec.recompute, spec, "recompute", ops, builder)
        annotations, save, recompute = _annotations.resolve(spec, state, ops, kind, [r.name for r in inputs],
                                                            [r.name for r in outs], save, recompute)
        ops = _annotations.apply_fusions(spec, state, ops, save, recompute)
        annotations = state.param_annotations + annotations
        for block_name, ann in state.block_checkpoints:
            i = next(i for i, m in enumerate(self.block_order) if m.name == block_name)
            self.block_order[i] = _annotations.checkpoint_block(self.block_order[i], ann)
        outputs = self.output_decls(builder, spec, outs)
        specs = _annotations.adapter_targets(spec, self.with_init(specs + state.extra_params, ops, scope),
                                             state.param_annotations)
        graph_params = decls + [TensorDecl(p.name, p.shape, p.dtype) for p in state.extra_params]
        layout = self.layout(builder, spec, scope, [d.name for d in inputs], specs) + state.extra_slots
        layout = _annotations.memory_slots(spec, state, kind, layout)
        self.check_replays(spec, state, {s.name for s in layout})
        hf_mappings = self.hf_mappings(spec, specs, scope)
        specs = [
            p.evolve(hf_mapping=hf_mappings[p.name])
            if p.name in hf_mappings
            and isinstance(hf_mappings[p.name], (str, Mapping))
            and p.array_of is None
            else p
            for p in specs
        ]
        config_out = {**cfg, **scope.extra}
        name = self.module_name(spec, kind)
        metadata = {"doc": spec.doc.splitlines()[0]} if spec.doc else {}
        if spec.extends:
            metadata["extends"] = spec.extends
        try:
            module = Module(
                name,
                kind=kind,
                config=config_out,
                params=specs,
                forward=Graph(
                    name,
                    inputs=[r_decl(r) for r in inputs]
                    + [r_decl(r) for r in self.extra_inputs if r.builder is builder],
                    outputs=outputs,
                    params=graph_params,
                    ops=ops,
                    save=save,
                    recompute=recompute,
                ),
                activations=ActivationLayout(layout),
                hf_config=self.hf_config(spec, cls),
                hf_mappings=hf_mappings,
                hf_export=self.hf_export(spec),
                metadata=metadata,
                annotations=annotations,
            )
        except KilnError as exc:
            raise error(exc.code or "E003", f"{spec.name}: {exc.message}", exc.hint, spec.loc) from None
        if spec.backward is not None:
            assert module.forward is not None
            forward, backward = self.backward_graph(spec, builder, module.forward, layout)
            module = module.evolve(forward=forward, backward=backward)
        elif spec.save or state.save:
            self.check_derived_saves(spec, state, module.forward)
        if spec.name in op_registry() or spec.name in _REGISTRY["primitive"]:
            self.warnings.append(
                diag(
                    "W001",
                    f"{kind} {spec.name!r} has the name of a registered primitive op",
                    "rename it: ops and modules share one namespace in diagnostics and tools",
                    spec.loc,
                )
            )
        return _Built(module, scope, spec)

    def check_derived_saves(self, spec: ModuleSpec, state: _State, graph: Graph | None) -> None:
        """W003 (seed 004 §5.12.6): a module that declares its save list and leaves its backward to kiln
        should list what the derived backward reads. A forward tensor it reads that the list leaves out
        is saved anyway (more memory than the list promises), named at the op whose rule reads it."""
        if graph is None or any(op.type == "call" for op in graph.ops):
            return  # blocks repeated by a call are derived, and their saves checked, on their own
        try:
            result = derive_backward(graph, DeriveBackwardOptions(loss_name=None))
        except KilnError:
            return  # not differentiable as it stands: compiling the training step says why
        declared = {*graph.save, *graph.recompute}
        full = {_short_loc(loc): loc for *_, loc in state.ops if loc}
        seen: set[str] = set()
        for op in result.backward.ops:
            for name in op.inputs:
                tensor = name.removeprefix("saved.")
                if name == tensor or tensor in declared or tensor in seen:
                    continue
                seen.add(tensor)
                self.warnings.append(diag(
                    "W003",
                    f"{spec.name}: the derived backward of this op reads {tensor!r}, which the save list "
                    f"({', '.join(graph.save) or 'empty'}) leaves out: it is kept for the backward anyway",
                    f"add {tensor!r} to @save (or recompute it), or write a @backward that does without it",
                    full.get(op.loc or "", op.loc) or function_location(spec.forward),  # type: ignore[arg-type]
                ))

    def name_loss(self, state: _State, out: GraphRef) -> None:
        """The runtime reads a model's single output as ``loss``, whatever produced it: a tensor of an
        inlined submodule (``head.loss``) or one named otherwise is renamed, unless another tensor
        already holds the name."""
        if out.kind != "op" or out.name == "loss" or "loss" in state.taken:
            return
        if out.explicit:
            state.renamed[out.name] = "loss"
        out._name, out.explicit = "loss", True
        state.taken["loss"] = None

    def module_name(self, spec: ModuleSpec, kind: str) -> str:
        if kind != "block":
            return spec.name
        taken = {m.name for m in self.block_order}
        name, k = spec.name, 1
        while name in taken:
            k += 1
            name = f"{spec.name}_{k}"
        return name

    def _check_compilable(self, spec: ModuleSpec) -> None:
        if spec.abstract:
            raise error(
                "E012",
                f"{spec.name} is @abstract: it declares an interface but no graph to compile",
                f'compile a class decorated with @extends("{spec.name}") that defines @forward',
                spec.loc,
            )
        if spec.forward is None:
            named = callable(getattr(spec.cls, "forward", None))
            raise error(
                "E012",
                f"{spec.kind} {spec.name} has no @forward method",
                "decorate the method that builds the graph with @forward"
                if named
                else "add a @forward method that builds the graph with `with graph() as g:`",
                spec.loc,
            )

    def check_constraints(self, spec: ModuleSpec, scope: Scope) -> None:
        for item in spec.constraints:
            entry = (item,) if isinstance(item, str) else tuple(item)
            text, message, where = (*entry, None, None)[:3]
            # a third entry is the constraint's own source place (a frontend's file:line:col)
            loc = where if isinstance(where, str) else (
                class_location(spec.cls, repr(text)[1:-1]) if isinstance(text, str) else spec.loc)
            if not isinstance(text, str):
                raise error(
                    "E026",
                    f"{spec.name}._constraints_: expected (condition, message), found {item!r}",
                    'write _constraints_ = [("d_model % num_heads == 0", "message"), ...]',
                    loc,
                )
            try:
                condition = parse_condition(text)
            except ConditionError as exc:
                raise error(
                    "E026",
                    f"invalid constraint {text!r}: {exc.reason}",
                    "a constraint compares dimension expressions (+ - * // %, min, max, ceil_div, sqrt) with "
                    "== != < <= > >=, joined by and, or, not",
                    loc,
                ) from None
            try:
                ok = condition.evaluate(scope.lookup)
            except ConditionError as exc:
                if exc.name is not None:
                    raise error(
                        "E026",
                        f"constraint {text!r} names {exc.name!r}, which is not a config value "
                        f"or dimension of {spec.name}",
                        "use constructor arguments and dimensions",
                        loc,
                    ) from None
                raise error(
                    "E026",
                    f"constraint {text!r} cannot be evaluated: {exc.reason}",
                    "constraints compare integer config values and dimensions",
                    loc,
                ) from None
            except KilnError as exc:  # a dimension the scope cannot evaluate
                raise error(
                    "E026",
                    f"constraint {text!r} cannot be evaluated: {exc.message}",
                    "constraints compare integer config values and dimensions",
                    loc,
                ) from None
            if not ok:
                values = ", ".join(f"{n} = {scope.lookup(n)!r}" for n in sorted(condition.names))
                raise error(
                    "E027",
                    f"{spec.name}: {message or 'constraint violated'} ({text})",
                    f"with {values}" if values else None,
                    loc,
                )

    def condition(self, when: Any, obj: Any, scope: Scope, loc: str | None) -> bool:
        if when is None:
            return True
        if isinstance(when, bool):
            return when
        if callable(when):
            try:
                return bool(when(obj))
            except Exception as exc:
                raise error(
                    "E001",
                    f"condition {when!r} failed: {type(exc).__name__}: {exc}",
                    "a callable condition receives the module instance",
                    traceback_location(exc) or loc,
                ) from None
        if isinstance(when, str):
            try:
                return check_condition(when, scope)
            except DSLError as exc:
                raise error(exc.code or "E026", exc.message, exc.hint, loc) from None
        raise error(
            "E008",
            f"when={when!r}: expected a config flag name, a condition string or a callable",
            'e.g. when="use_bias" or when=lambda self: self.use_bias',
            loc,
        )

    # -- parameters and inputs --
    def declare_params(
        self, builder: GraphBuilder, spec: ModuleSpec, state: _State, prefix: str = ""
    ) -> tuple[list[ParamSpec], list[TensorDecl]]:
        specs, decls = [], []
        scope, obj = builder.scope, builder.obj
        for name, p in spec.params.items():
            ptype = p.resolve_type() if isinstance(p, _ParamMethod) else p.type
            if not isinstance(ptype, (TensorAnnotation, ArrayType)):
                raise error(
                    "E008",
                    f"parameter {spec.name}.{name} needs a Tensor[...] or Array[...] type, found {ptype!r}",
                    'e.g. Param(Tensor["O", "C"]) or @param def w(self) -> Tensor["O", "C"]',
                    p.loc,
                )
            if not self.condition(p.when, obj, scope, p.loc):
                continue
            if name in spec.redefined:
                self.check_redefinition(builder, spec, name, ptype)
            full = prefix + name
            anns, frozen = _annotations.param_annotations(spec, p, full)
            state.param_annotations += anns
            condition = p.when if isinstance(p.when, str) and not prefix else None
            optional = p.optional or p.when is not None
            tied = p.tied
            if tied is not None and self.condition(tied.when, obj, scope, tied.loc or p.loc):
                target = tied.target
                if target not in spec.params:
                    raise error(
                        "E002",
                        f"{spec.name}.{name} is tied to {target!r}, which is not a parameter",
                        "name another parameter of the same module",
                        tied.loc or p.loc,
                    )
                builder.tied[name] = target
                shape = [builder.dim(d) for d in ptype.dims] if isinstance(ptype, TensorAnnotation) else []
                specs.append(
                    ParamSpec(
                        full,
                        shape,
                        ptype.dtype,
                        frozen=frozen,
                        optional=optional,
                        condition=condition,
                        tied_to=prefix + target,
                        lora_targets=self.lora_targets(builder, spec, p, ptype),
                        description=p.description,
                    )
                )
                continue
            if isinstance(ptype, ArrayType):
                if prefix:
                    raise error(
                        "E003",
                        f"{spec.name}.{name}: a submodule cannot hold an Array of blocks",
                        "declare stacks in the model",
                        p.loc,
                    )
                built, count = self.array_block(builder, spec, name, ptype, p.loc)
                self.arrays[id(state)][name] = (built, count)
                specs.append(
                    ParamSpec(
                        name,
                        (),
                        "fp32",
                        frozen=frozen,
                        optional=optional,
                        condition=condition,
                        array_of=built.module.name,
                        count=count,
                        lora_targets=self.lora_targets(builder, spec, p, ptype),
                        description=p.description,
                    )
                )
                ref = builder.declare(name, TensorType((), "fp32"), "param")
                decls.append(TensorDecl(name, (), "fp32"))
                continue
            try:
                shape = [builder.dim(d) for d in ptype.dims]
            except DSLError as exc:
                raise error(
                    exc.code or "E002", f"parameter {spec.name}.{name}: {exc.message}", exc.hint, p.loc
                ) from None
            init = p.init if p.init is None or isinstance(p.init, Mapping) else {"kind": p.init}
            if p.role is not None and p.role not in PARAM_ROLES:
                raise error("E003", f"parameter {spec.name}.{name}: role {p.role!r} is not one of "
                            f"{', '.join(PARAM_ROLES)}", "leave role out to let kiln infer it", p.loc)
            specs.append(
                ParamSpec(
                    full,
                    shape,
                    ptype.dtype,
                    frozen=frozen,
                    optional=optional,
                    condition=condition,
                    init=init or {},
                    lora_targets=self.lora_targets(builder, spec, p, ptype),
                    description=p.description,
                    role=p.role,
                )
            )
            ref = builder.declare(full, TensorType(shape, ptype.dtype), "param", name)
            decls.append(TensorDecl(full, ref.shape, ref.dtype))
        return specs, decls

    def check_redefinition(self, builder: GraphBuilder, spec: ModuleSpec, name: str, ptype: Any) -> None:
        """E011: a parameter redefined by a subclass keeps the inherited shape and dtype."""
        base, owner = spec.redefined[name]
        btype = base.resolve_type() if isinstance(base, _ParamMethod) else base.type

        def same(a: Any, b: Any) -> bool:
            if not (isinstance(a, TensorAnnotation) and isinstance(b, TensorAnnotation)):
                return bool(a == b)  # Array[...] stacks, or a base whose type is no annotation
            return a.dtype == b.dtype and len(a.dims) == len(b.dims) and all(
                dims_equal(builder.dim(x), builder.dim(y)) for x, y in zip(a.dims, b.dims, strict=True))

        if same(ptype, btype):
            return
        where = f" (at {base.loc})" if base.loc else ""
        raise error(
            "E011",
            f"{spec.name}.{name} is {ptype!r}, incompatible with the parameter it inherits from {owner}: "
            f"{btype!r}{where}",
            f"keep the inherited shape and dtype, or give the new parameter another name than {name!r}",
            spec.params[name].loc,
        )

    def lora_targets(
        self, builder: GraphBuilder, spec: ModuleSpec, p: Param, ptype: Any
    ) -> list[LoraTarget]:
        """``p.lora_targets`` in the IR: slices of the weight, their dims in the compiled module's symbols."""
        where = f"parameter {spec.name}.{p.name}: lora target"
        hint = 'e.g. lora_targets=["o"] or [("q", 0, "Hq * D"), ("k", "Hq * D", "Hkv * D"), ...]'
        if p.lora_targets and not isinstance(ptype, TensorAnnotation):
            raise error("E003", f"{where}s need a Tensor[...] parameter, found {ptype!r}", hint, p.loc)
        out: list[LoraTarget] = []
        for item in p.lora_targets:
            if isinstance(item, LoraTarget):
                item = (item.name, item.start, item.size, item.dim)
            elif isinstance(item, str):
                item = (item,)
            fields = tuple(item) if isinstance(item, tuple | list) else ()
            if not 1 <= len(fields) <= 4 or not isinstance(fields[0], str) or not fields[0]:
                raise error("E003", f"{where} {item!r}: expected a name or (name, start, size[, dim])", hint,
                            p.loc)
            name, start, size, dim = (*fields, *(0, None, 0)[len(fields) - 1:])
            rank = len(ptype.dims)
            if not isinstance(dim, int) or isinstance(dim, bool) or not -rank <= dim < rank:
                raise error("E003", f"{where} {name!r}: dim {dim!r} is not an axis of a rank-{rank} weight",
                            hint, p.loc)
            dim %= rank
            try:
                lo = builder.scope.value(start)
                extent = builder.scope.value(ptype.dims[dim])
                n = extent - lo if size is None else builder.scope.value(size)
                rows = None if size is None else builder.dim(size)
                target = LoraTarget(name, builder.dim(start), rows, dim)
            except (DSLError, KilnError) as exc:
                raise error(exc.code or "E002", f"{where} {name!r}: {exc.message}", exc.hint, p.loc) from None
            if name in {t.name for t in out}:
                raise error("E003", f"{where} {name!r} is listed twice", hint, p.loc)
            if lo < 0 or n <= 0 or lo + n > extent:
                raise error("E003", f"{where} {name!r}: rows [{lo}, {lo + n}) are not inside dim {dim} "
                            f"of size {extent}", hint, p.loc)
            out.append(target)
        return out

    def forward_signature(self, spec: ModuleSpec) -> tuple[list[tuple[str, Any]], Any]:
        fn = spec.forward
        assert fn is not None
        loc = function_location(fn)
        try:
            hints = inspect.get_annotations(fn, eval_str=True)
        except Exception as exc:
            raise error(
                "E008",
                f"{spec.name}.forward: cannot read its annotations: {exc}",
                "annotate tensors with Tensor[...] (dimension names in quotes)",
                loc,
            ) from None
        args = []
        for name in list(inspect.signature(fn).parameters)[1:]:
            ann = hints.get(name)
            if not isinstance(ann, TensorAnnotation):
                raise error(
                    "E008",
                    f"{spec.name}.forward argument {name!r} needs a Tensor[...] annotation, found {ann!r}",
                    'e.g. x: Tensor["B", "T", "C"]',
                    loc,
                )
            args.append((name, ann))
        ret = hints.get("return")
        for what, ann in [*((f"argument {n!r}", a) for n, a in args),
                          *(("output", a) for a in _tensor_types(ret) if isinstance(a, TensorAnnotation))]:
            if VARIADIC in ann.dims[1:]:
                raise error(
                    "E008",
                    f"{spec.name}.forward {what}: {ann!r} puts the variadic {VARIADIC!r} after the first dim",
                    'variadic dims are leading only: Tensor["*", "T", "C"], not Tensor["B", "*", "C"]',
                    loc,
                )
        return args, ret

    def declare_inputs(self, builder: GraphBuilder, spec: ModuleSpec) -> list[GraphRef]:
        args, _ = self.forward_signature(spec)
        loc = function_location(spec.forward)  # type: ignore[arg-type]
        out = []
        for name, ann in args:
            if ann.dims[:1] == (VARIADIC,):
                raise error(
                    "E008",
                    f"{spec.name}.forward argument {name!r} has variadic leading dims ({ann!r}), which "
                    "only a caller binds",
                    f"compile a module that calls {spec.name} (g.call binds `*` to the leading dims of the "
                    "tensor it passes), or name the leading dims",
                    loc,
                )
            try:
                shape = [builder.dim(d) for d in ann.dims]
            except DSLError as exc:
                raise error(
                    exc.code or "E002", f"{spec.name}.forward argument {name!r}: {exc.message}", exc.hint, loc
                ) from None
            out.append(builder.declare(name, TensorType(shape, ann.dtype), "input"))
        return out

    def run_forward(self, builder: GraphBuilder, spec: ModuleSpec, inputs: list[Any]) -> list[GraphRef]:
        loc = function_location(spec.forward)  # type: ignore[arg-type]
        result = _capture(builder, spec.forward, inputs, "forward", spec.name, loc)  # type: ignore[arg-type]
        outs = list(iter_refs([result])) if result is not None else (builder._state.outputs or [])
        if not outs or (result is not None and not isinstance(result, (GraphRef, tuple, list))):
            raise error(
                "E001",
                f"{spec.name}.forward returned {result!r}, not graph tensors",
                "return the output GraphRef(s) from inside `with graph() as g:`",
                loc,
            )
        return outs

    def output_decls(self, builder: GraphBuilder, spec: ModuleSpec, outs: list[GraphRef]) -> list[TensorDecl]:
        _, ret = self.forward_signature(spec)
        anns = _tensor_types(ret)
        loc = function_location(spec.forward)  # type: ignore[arg-type]
        if anns and len(anns) != len(outs):
            raise error(
                "E003",
                f"{spec.name}.forward is annotated with {len(anns)} output(s) but returns {len(outs)}",
                "return one tensor per annotated output (tuple[Tensor[...], ...] for several)",
                loc,
            )
        decls = []
        for i, ref in enumerate(outs):
            shape, dtype = ref.shape, ref.dtype
            ann = anns[i] if anns else None
            if isinstance(ann, TensorAnnotation):
                declared = [builder.dim(d) for d in ann.dims]
                if len(declared) != len(shape) or not all(
                    dims_equal(a, b) for a, b in zip(declared, shape, strict=False)
                ):
                    raise error(
                        "E004",
                        f"{spec.name}.forward output {i} ({ref.name}) is "
                        f"[{', '.join(map(str, shape))}] but annotated [{', '.join(map(str, declared))}]",
                        "fix the return annotation or the graph",
                        loc,
                    )
                if ann.explicit_dtype and ann.dtype != dtype:
                    raise error(
                        "E003",
                        f"{spec.name}.forward output {i} ({ref.name}) is {dtype} but annotated {ann.dtype}",
                        "fix the return annotation's dtype or the graph",
                        loc,
                    )
                shape = tuple(declared)
            decls.append(TensorDecl(ref.name, shape, dtype))
        return decls

    def memory_list(
        self,
        state: _State,
        directives: list[Any],
        decorated: tuple[str, ...],
        spec: ModuleSpec,
        what: str,
        ops: list[Any],
        builder: GraphBuilder,
    ) -> list[str]:
        names = {n for op in ops for n in op.outputs} | set(state.taken)
        locs = getattr(spec.forward, "__kiln_locs__", {})
        items = [
            *directives,
            *[
                ("", n, locs.get(n) or function_location(spec.forward))  # type: ignore[arg-type]
                for n in decorated
            ],
        ]
        out: list[str] = []
        for prefix, item, loc in items:
            name = item.name if isinstance(item, GraphRef) else prefix + str(item)
            name = state.renamed.get(name, name)
            if name.startswith("saved.") or name not in names:
                if what == "save":
                    self.warnings.append(
                        diag(
                            "W004",
                            f"{spec.name}: @save lists {item!r}, which is not a tensor of the compiled graph",
                            "save a graph input or a tensor the forward "
                            "computes (names come from out_name= or the variable assigned)",
                            loc,
                        )
                    )
                else:
                    raise error(
                        "E002",
                        f"{spec.name}: recompute lists {item!r}, which is not a tensor of the graph",
                        "name a tensor the forward computes (out_name= or its variable)",
                        loc,
                    )
                continue
            if name not in out:
                out.append(name)
        return out

    def backward_graph(
        self, spec: ModuleSpec, fwd: GraphBuilder, graph: Graph, layout: list[ActivationSlot]
    ) -> tuple[Graph, Graph]:
        """Compile the ``@backward`` method: its arguments are the gradients of the forward outputs, in
        order (IR names ``d_<output>``); it reads parameters by name and forward tensors through
        ``g.saved(name)``, and returns the gradients ``d_<input>`` / ``d_<param>``. The tensors it reads
        join the forward's save list (its recompute list, if a slot recomputes them). kiln-core checks
        the graph against the derived backward when it compiles the module."""
        fn = spec.backward
        assert fn is not None
        loc = function_location(fn)
        state = _State(self)
        state.forward = {d.name: d.type for d in (*graph.inputs, *graph.params)}
        state.forward.update({r.name: r.type for _, _, outs, _, _ in fwd._state.ops for r in outs})
        state.taken.update(dict.fromkeys(state.forward))  # one namespace: the runtime holds both graphs
        b = GraphBuilder(state, fwd.scope, fwd.obj)
        b.tied = dict(fwd.tied)
        for d in graph.params:
            b.declare(d.name, d.type, "param")
        args = list(inspect.signature(fn).parameters)[1:]
        if len(args) != len(graph.outputs):
            raise error(
                "E003",
                f"{spec.name}.backward takes {len(args)} gradient(s), but the forward has "
                f"{len(graph.outputs)} output(s) ({', '.join(d.name for d in graph.outputs)})",
                "take one argument per forward output, in order: the gradient of that output",
                loc,
            )
        pairs = zip(args, graph.outputs, strict=True)
        inputs = [b.declare(f"d_{d.name}", d.type, "input", arg) for arg, d in pairs]
        result = _capture(b, fn, inputs, "backward", spec.name, loc)
        outs = list(iter_refs([result])) if result is not None else (state.outputs or [])
        finalize_names(state)
        _annotations.refuse_in_backward(spec, state)
        leaves = {f"d_{d.name}" for d in (*graph.inputs, *graph.params)}
        for ref in outs:
            if ref.name not in leaves:
                raise error(
                    "E002",
                    f"{spec.name}.backward returns {ref.name!r}, which is not the gradient of a forward "
                    "input or parameter",
                    f"name each gradient d_<name> (out_name= or its variable): {', '.join(sorted(leaves))}",
                    loc,
                )
        if not outs:
            raise error("E005", f"{spec.name}.backward returns no gradients",
                        "return the gradients d_<input> and d_<param> it computes", loc)
        ops = to_ops(state)
        read = [i for op in ops for i in op.inputs]
        saved = list(dict.fromkeys(i.removeprefix("saved.") for i in read if i.startswith("saved.")))
        recomputed = {n for s in layout if s.recompute for n in (s.name, *s.aliases)}
        new = [n for n in saved if n not in graph.save and n not in graph.recompute]
        forward = graph.evolve(
            save=(*graph.save, *(n for n in new if n not in recomputed)),
            recompute=(*graph.recompute, *(n for n in new if n in recomputed)),
        )
        backward = Graph(
            f"{graph.name}_backward",
            inputs=[TensorDecl(r.name, r.shape, r.dtype) for r in inputs],
            outputs=[TensorDecl(r.name, r.shape, r.dtype) for r in outs],
            params=[d for d in graph.params if d.name in read],
            ops=ops,
            metadata={"forward": graph.name, "grad_prefix": "d_"},
        )
        return forward, backward

    def with_init(self, specs: list[ParamSpec], ops: list[Any], scope: Scope) -> list[ParamSpec]:
        role: dict[str, str] = {}
        for op in ops:
            for i, name in enumerate(op.inputs):
                if (op.type, i) in _ONES:
                    role.setdefault(name, "ones")
                elif (op.type, i) in _ZEROS:
                    role.setdefault(name, "zeros")
        std = scope.config.get("initializer_range", getattr(scope.obj, "initializer_range", 0.02))
        std = float(std) if isinstance(std, (int, float)) and not isinstance(std, bool) else 0.02
        out = []
        for p in specs:
            if p.init or p.array_of is not None or p.tied_to is not None:
                out.append(p)
                continue
            short = p.name.rsplit(".", 1)[-1]
            kind = role.get(p.name) or (
                "zeros"
                if short.endswith("bias")
                else "ones"
                if "norm" in short or short.startswith("ln")
                else "normal"
            )
            out.append(p.evolve(init={"kind": "normal", "std": std} if kind == "normal" else {"kind": kind}))
        return out

    # -- activation slots --
    def layout(
        self,
        builder: GraphBuilder,
        spec: ModuleSpec,
        scope: Scope,
        inputs: list[str],
        params: list[ParamSpec],
        prefix: str = "",
    ) -> list[ActivationSlot]:
        declared = spec.activations
        names = {n for n in declared} | {a for s in declared.values() for a in s.aliases}
        param_names = set(spec.params)
        present: dict[str, bool] = {}
        slots = []
        for name, a in declared.items():
            present[name] = self.condition(a.when, builder.obj, scope, a.loc)
        for name, a in declared.items():
            self.check_slot_refs(spec, a, names, param_names, inputs)
            if not present[name]:
                continue
            slots.append(self.slot(builder, a, prefix, present))
        return slots

    def check_slot_refs(
        self, spec: ModuleSpec, a: Activation, names: set[str], params: set[str], inputs: list[str]
    ) -> None:
        def fail(what: str, ref: str, hint: str) -> None:
            raise error("E002", f"{spec.name}.{a.name}: {what} {ref!r} is not defined", hint, a.loc)

        for entry in a.recompute_from:
            ref = entry.removeprefix("?")
            optional = entry.startswith("?")
            if ref.startswith("@param:"):
                if ref[7:] not in params and not optional:
                    fail("recompute_from parameter", ref[7:], f"parameters: {', '.join(sorted(params))}")
            elif ref.startswith("@input:"):
                if ref[7:] not in inputs:
                    fail("recompute_from input", ref[7:], f"forward inputs: {', '.join(inputs)}")
            elif ref.startswith("@global:"):
                continue
            elif ref.startswith("@"):
                fail("recompute_from reference", ref, "prefixes are @input:, @param: and @global:")
            elif ref not in names and not optional:
                fail("recompute_from slot", ref, "name an activation slot (or one of its aliases)")
        for what, ref in (
            ("gradient_of", a.gradient_of),
            ("shares_with", a.shares_with),
            ("alias_of", a.alias_of),
        ):
            if ref is not None and ref not in names:
                fail(what, ref, "name a declared slot")

    def slot(
        self, builder: GraphBuilder, a: Activation, prefix: str, present: dict[str, bool]
    ) -> ActivationSlot:
        def p(n: str) -> str:
            if not prefix or n.startswith("@global:") or n.startswith("@input:"):
                return n
            opt, n = ("?", n[1:]) if n.startswith("?") else ("", n)
            if n.startswith("@param:"):
                return f"{opt}@param:{prefix}{n[7:]}"
            return opt + prefix + n

        try:
            shape = [builder.dim(d) for d in a.type.dims]
        except DSLError as exc:
            raise error(exc.code or "E002", f"slot {a.name}: {exc.message}", exc.hint, a.loc) from None
        hint = a.memory_hint or (
            "shared" if a.shares_with else "recompute" if a.recompute else "save" if a.save else "persistent"
        )
        attrs = {k: v.to_json() if isinstance(v, DimExpr) else v for k, v in a.recompute_attrs.items()}
        self.check_recompute_op(a)
        outputs = [p(o) for o in a.recompute_outputs if present.get(o, True)]
        try:
            return ActivationSlot(
                prefix + a.name,
                shape,
                a.dtype or a.type.dtype,
                scope=a.scope,
                aliases=[p(x) for x in a.aliases],
                memory_hint=hint,
                save=a.save,
                recompute=a.recompute,
                shares_with=p(a.shares_with) if a.shares_with else None,
                share_policy=a.share_policy,
                gradient_of=p(a.gradient_of) if a.gradient_of else None,
                alias_of=p(a.alias_of) if a.alias_of else None,
                condition=a.when if isinstance(a.when, str) and not prefix else None,
                recompute_from=[p(x) for x in a.recompute_from],
                recompute_op=a.recompute_op,
                recompute_attrs=attrs,
                recompute_policy=a.recompute_policy,
                recompute_group=a.recompute_group,
                recompute_outputs=outputs,
                lora_targets=list(a.lora_targets),
                description=a.description,
            )
        except KilnError as exc:
            kind = "Gradient" if isinstance(a, Gradient) else "Activation"
            raise error("E003", f"{kind} {a.name}: {exc.message}", exc.hint, a.loc) from None

    def check_recompute_op(self, a: Activation) -> None:
        """``recompute_op`` is a registered op; ``recompute_attrs`` are its attributes (or ``_*`` notes)."""
        if a.recompute_op is None:
            return
        registry = op_registry()
        if a.recompute_op not in registry:
            raise error(
                "E014",
                f"slot {a.name}: recompute_op {a.recompute_op!r} is not a registered op",
                "name an op of kiln's registry (`kiln plugins` lists the plugins that add ops)",
                a.loc,
            )
        takes = [s.name for s in registry.get_op(a.recompute_op).attrs]
        for key in a.recompute_attrs:
            if key not in takes and not key.startswith("_"):
                raise error(
                    "E003",
                    f"slot {a.name}: recompute_attrs key {key!r} is not an attribute of op "
                    f"{a.recompute_op!r} (it takes {', '.join(takes) or 'none'})",
                    f"drop it; a note kiln should keep but not use is named '_{key}'",
                    a.loc,
                )

    def check_replays(self, spec: ModuleSpec, state: _State, present: set[str]) -> None:
        """A slot's ``recompute_op`` is the op that computes its tensor in the forward graph (looking
        through views), a variant of that op, or its fused form (``matmul_bias`` for ``matmul``,
        ``fused_residual_rmsnorm_apply_saved`` for ``fused_residual_rmsnorm``)."""
        registry = op_registry()
        producer = {r.name: (op_type, ins) for op_type, ins, outs, _, _ in state.ops for r in outs}

        def computed_by(name: str) -> list[str]:
            found = []
            while name in producer:
                op_type, ins = producer[name]
                found.append(op_type)
                if op_type not in registry or not registry[op_type].alias or not ins or ins[0] is None:
                    break
                name = ins[0].name
            return found

        def replays(declared: str, op_type: str) -> bool:
            variants = [v[0] for v in registry[op_type].variants] if op_type in registry else []
            return declared == op_type or declared in variants or declared.startswith(op_type + "_") or \
                op_type.startswith(declared + "_")

        for a in spec.activations.values():
            if a.recompute_op is None or a.name not in present:
                continue
            found = [t for n in (a.name, *a.aliases, *a.recompute_outputs) for t in computed_by(n)]
            computing = [t for t in dict.fromkeys(found) if t not in registry or not registry[t].alias]
            if computing and not any(replays(a.recompute_op, t) for t in found):
                raise error(
                    "E021",
                    f"slot {a.name}: recompute_op {a.recompute_op!r} does not replay the op that computes it "
                    f"in the forward graph ({', '.join(computing)})",
                    f"declare recompute_op={computing[0]!r}, the op the forward calls",
                    a.loc,
                )

    # -- HuggingFace data --
    def hf_config(self, spec: ModuleSpec, cls: type) -> dict[str, Any]:
        cfg = spec.hf_config
        if not cfg:
            return {}
        out = {k: cfg[k] for k in ("architecture", "model_type") if cfg.get(k) is not None}
        out["param_mapping"] = dict(cfg["param_mapping"])
        return out

    def hf_mappings(self, spec: ModuleSpec, params: list[ParamSpec], scope: Scope) -> dict[str, Any]:
        diags: list[Diagnostic] = []
        declared = set(spec.params)
        out: dict[str, Any] = {}
        entries = [(n, p.hf_mapping, p.loc) for n, p in spec.params.items() if p.hf_mapping is not None]
        entries += [(n, v, loc) for n, (v, loc) in spec.hf_mappings.items()]
        for name, value, loc in entries:
            if name not in declared:
                diags.append(
                    diag(
                        "E010",
                        f"{spec.name}: weight mapping for {name!r}, which is not a parameter",
                        f"parameters: {', '.join(sorted(declared))}",
                        loc,
                    )
                )
                continue
            own = next((p for p in params if p.name == name), None)
            if own is not None:
                out[name] = mapping_json(value, f"{spec.name}.{name}", loc, diags)
                diags += _lora_pairing(own, out[name], f"{spec.name}.{name}", loc)
        indexed = dict(spec.hf_indexed)
        block_map = getattr(spec.cls, "_hf_block_mappings_", None)
        arrays = [p for p in params if p.array_of is not None]
        if block_map:
            target = (
                "blocks"
                if any(p.name == "blocks" for p in arrays)
                else (arrays[0].name if arrays else "blocks")
            )
            entry = indexed.setdefault(target, {"index_var": "{layer}", "mappings": {}})
            loc = class_location(spec.cls, "_hf_block_mappings_")
            entry["mappings"] = {**{k: (v, loc) for k, v in block_map.items()}, **entry["mappings"]}
        for array, entry in indexed.items():
            index_var = entry["index_var"]
            arr = next((p for p in arrays if p.name == array), None)
            first_loc = next(iter(entry["mappings"].values()))[1] if entry["mappings"] else spec.loc
            if (
                arr is None
                and isinstance(spec.params.get(array), Param)
                and isinstance(spec.params[array].type, ArrayType)
            ):
                continue  # a stack left out by its condition
            if arr is None:
                diags.append(
                    diag(
                        "E010",
                        f"{spec.name}: indexed mapping for {array!r}, which is not an Array parameter",
                        "name the Array[...] parameter that stacks the blocks",
                        first_loc,
                    )
                )
                continue
            block = next(m for m in self.block_order if m.name == arr.array_of)
            block_params = {p.name: p for p in block.params}
            declared_params = next(b.spec.params for b in self.blocks.values() if b.module.name == block.name)
            maps = {}
            for name, (value, loc) in entry["mappings"].items():
                if name not in block_params and name in declared_params:
                    continue  # a parameter left out by its condition
                if name not in block_params:
                    diags.append(
                        diag(
                            "E010",
                            f"{spec.name}: indexed mapping for {array}.{name}, which is not a "
                            f"parameter of {block.name}",
                            f"parameters: {', '.join(sorted(block_params))}",
                            loc,
                        )
                    )
                    continue
                maps[name] = mapping_json(value, f"{spec.name}.{array}.{name}", loc, diags, index_var)
                diags += _lora_pairing(block_params[name], maps[name], f"{spec.name}.{array}.{name}", loc)
            out[array] = {"type": "indexed", "index": index_var, "module": block.name, "mappings": maps}
            if "layers" in entry or "layer_offset" in entry:
                out[array]["layers"] = self.hf_layers(spec, array, scope, arr, entry)
            self.attach_block_mappings(block.name, maps)
        self.errors += [d for d in diags if d.is_error]
        return {k: v for k, v in out.items() if v is not None}

    def hf_layers(self, spec: ModuleSpec, array: str, scope: Scope, arr: ParamSpec,
                  entry: dict[str, Any]) -> list[int]:
        """The HF layer of each block of ``array``: its mapping's ``layers`` (a list, or a config
        attribute holding one) or ``layer_offset + i``."""
        assert arr.count is not None
        count = arr.count.evaluate(scope.bindings())
        if "layer_offset" in entry:
            offset = self.layer_offset(spec, array, scope, *entry["layer_offset"])
            return [offset + i for i in range(count)]
        value, loc = entry["layers"]
        try:
            found = scope.lookup(value) if isinstance(value, str) else value
        except KeyError:
            found = None
        if not (isinstance(found, list | tuple) and len(found) == count
                and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in found)):
            raise error(
                "E010",
                f"{spec.name}: layers={value!r} of the indexed mapping for {array!r} must be a list of "
                f"{count} non-negative ints (the HF layer of each block), found {found!r}",
                'e.g. @hf_mapping.indexed("blocks", layers="moe_layers", ...) with self.moe_layers = [1, 3]',
                loc,
            )
        return list(found)

    def layer_offset(self, spec: ModuleSpec, array: str, scope: Scope, value: Any, loc: str | None) -> int:
        """The HF layer of the first block of ``array``, as an int of the model's config."""
        try:
            offset = scope.value(value)
        except (DSLError, KilnError) as exc:
            offset, why = -1, exc.message
        else:
            why = f"it is {offset}"
        if offset < 0 or isinstance(value, bool) or not isinstance(value, int | str | DimExpr):
            raise error(
                "E010",
                f"{spec.name}: layer_offset={value!r} of the indexed mapping for {array!r} is not a "
                f"non-negative int or config name ({why})",
                'e.g. @hf_mapping.indexed("blocks", layer_offset="n_dense_layers", ...)',
                loc,
            )
        return offset

    def attach_block_mappings(self, block_name: str, maps: dict[str, Any]) -> None:
        for i, m in enumerate(self.block_order):
            if m.name == block_name:
                params = [p.evolve(hf_mapping=maps[p.name]) if p.name in maps else p for p in m.params]
                self.block_order[i] = m.evolve(params=params, hf_mappings={**thaw(m.hf_mappings), **maps})

    def hf_export(self, spec: ModuleSpec) -> dict[str, Any]:
        diags: list[Diagnostic] = []
        out = {}
        for name, (value, loc) in spec.hf_export.items():
            out[name] = (
                mapping_json(value, f"{spec.name} hf_export {name}", loc, diags)
                if not _json_value(value) or isinstance(value, str)
                else value
            )
        self.errors += [d for d in diags if d.is_error]
        return out

    # -- blocks and submodules --
    def array_block(
        self, builder: GraphBuilder, spec: ModuleSpec, name: str, arr: ArrayType, loc: str | None
    ) -> tuple[_Built, int]:
        block_cls = arr.element if isinstance(arr.element, type) else _lookup_name(arr.element, spec.cls)
        if block_cls is None or not is_component(block_cls):
            raise error(
                "E002",
                f"{spec.name}.{name}: Array element {arr.element_name!r} is not a DSL block",
                f"registered blocks: {', '.join(registry.list('block')) or 'none'}",
                loc,
            )
        try:
            count = builder.scope.value(arr.count)
        except DSLError as exc:
            raise error(
                exc.code or "E002", f"{spec.name}.{name}: Array count: {exc.message}", exc.hint, loc
            ) from None
        obj, model_cfg = builder.obj, builder.scope.config
        kwargs = {}
        init = block_cls.__init__  # type: ignore[misc]
        params = list(inspect.signature(init).parameters.values())[1:] if init is not object.__init__ else []
        for p in params:
            value = obj.__dict__.get(p.name, model_cfg.get(p.name, inspect.Parameter.empty))
            if value is not inspect.Parameter.empty and _json_value(value):
                kwargs[p.name] = value
        key = (block_cls, json.dumps(kwargs, sort_keys=True, default=str))
        if key not in self.blocks:
            built = self.build(block_cls, kwargs, "block")
            self.blocks[key] = built
            self.block_order.append(built.module)
        return self.blocks[key], count

    def stacked_call(
        self, builder: GraphBuilder, inputs: list[Any], num_outputs: int | None, kwargs: dict[str, Any]
    ) -> Any:
        loc = user_location()
        arrays = self.arrays.get(id(builder._state), {})
        blocks = kwargs.pop("blocks", None)
        n_layers = kwargs.pop("n_layers", None)
        first = kwargs.pop("first", 0)
        names = kwargs.pop("out_names", ())
        if kwargs:
            raise error(
                "E003",
                f"StackedBlocks: unknown argument(s) {', '.join(kwargs)}",
                "it takes blocks=, n_layers=, first=, num_outputs= and out_names=",
                loc,
            )
        if blocks is None:
            if len(arrays) != 1:
                raise error(
                    "E012",
                    "StackedBlocks needs blocks=<the Array[...] parameter>",
                    'e.g. blocks="blocks" for blocks = Param(Array["n_layers", "MyBlock"])',
                    loc,
                )
            blocks = next(iter(arrays))
        if blocks not in arrays:
            if blocks in builder.params:
                raise error(
                    "E003",
                    f"StackedBlocks: parameter {blocks!r} is not an Array[n, Block]",
                    'declare it as Param(Array["n_layers", "MyBlock"])',
                    loc,
                )
            raise error(
                "E002",
                f"StackedBlocks: no Array parameter named {blocks!r}",
                f"Array parameters: {', '.join(arrays) or 'none'}",
                loc,
            )
        if n_layers is None:
            raise error("E012", "StackedBlocks needs n_layers=", "pass n_layers=self.n_layers", loc)
        built, count = arrays[blocks]
        try:
            n = builder.scope.value(n_layers)
        except DSLError as exc:
            raise error(exc.code or "E002", f"StackedBlocks n_layers: {exc.message}", exc.hint, loc) from None
        try:
            first = builder.scope.value(first)
        except DSLError as exc:
            raise error(exc.code or "E002", f"StackedBlocks first: {exc.message}", exc.hint, loc) from None
        if first < 0 or first + n > count:
            raise error(
                "E003",
                f"StackedBlocks runs layers {first} to {first + n - 1} but {blocks!r} stacks {count}",
                "first= + n_layers= must not exceed the Array's count",
                loc,
            )
        fwd = built.module.forward
        assert fwd is not None
        refs = [builder._ref(x, "StackedBlocks input") for x in inputs]
        if len(refs) != len(fwd.inputs):
            raise error(
                "E003",
                f"StackedBlocks: block {built.module.name} takes {len(fwd.inputs)} inputs "
                f"({', '.join(d.name for d in fwd.inputs)}), found {len(refs)}",
                "pass one tensor per argument of the block's @forward",
                loc,
            )
        if num_outputs is not None and num_outputs != len(fwd.outputs):
            raise error(
                "E003",
                f"StackedBlocks: block {built.module.name} returns {len(fwd.outputs)} outputs, "
                f"num_outputs={num_outputs}",
                "num_outputs= must match what the block's @forward returns",
                loc,
            )
        for ref, decl in zip(refs, fwd.inputs, strict=True):
            want = [builder.lift(translate(d, built.scope, builder.scope)) for d in decl.shape]
            if (
                ref is None
                or len(want) != len(ref.shape)
                or not all(dims_equal(a, b) for a, b in zip(want, ref.shape, strict=False))
                or ref.dtype != decl.dtype
            ):
                found = ref.type if ref is not None else None
                raise error(
                    "E003",
                    f"StackedBlocks: block input {decl.name!r} is {decl.dtype}"
                    f"[{', '.join(map(str, want))}], found {found}",
                    "a layer's inputs must have the types of the block's @forward arguments",
                    loc,
                )
        types = [
            TensorType([builder.lift(translate(d, built.scope, builder.scope)) for d in o.shape], o.dtype)
            for o in fwd.outputs
        ]
        attrs = {"module": built.module.name, "n_layers": n, "params": blocks}
        if first:
            attrs["first"] = first
        outs = builder.emit_call(refs, types, attrs, list(names))
        return outs[0] if len(outs) == 1 else tuple(outs)

    def inline_call(
        self,
        builder: GraphBuilder,
        target: Any,
        inputs: list[Any],
        num_outputs: int | None,
        name: str | None,
        kwargs: dict[str, Any],
    ) -> Any:
        loc = user_location()
        obj = builder.obj
        sub = None
        if is_component(type(target)):
            sub = target
            name = name or next((k for k, v in obj.__dict__.items() if v is target), None)
        elif isinstance(target, str) and is_component(type(obj.__dict__.get(target))):
            sub, name = obj.__dict__[target], name or target
        else:
            cls = (
                target
                if is_component(target)
                else (_lookup_name(target, type(obj)) if isinstance(target, str) else None)
            )
            if cls is None:
                raise error(
                    "E002",
                    f"call({target!r}): not a submodule, a DSL module or StackedBlocks",
                    "pass a module instance, the name of an attribute holding one, or a module class",
                    loc,
                )
            sub = cls(**kwargs)
            kwargs = {}
            name = name or cls.__name__.lower()
        if kwargs:
            raise error(
                "E003",
                f"call({name!r}): unexpected argument(s) {', '.join(kwargs)}",
                "constructor arguments are only taken when call() names a module class",
                loc,
            )
        if not name:
            raise error(
                "E003",
                "call(...) of a submodule needs a name: its prefix in the graph",
                'pass name="mlp" (tensors and parameters become mlp.*)',
                loc,
            )
        spec = spec_of(type(sub))
        self._check_compilable(spec)
        cfg, foreign = self.config_of(sub, builder.scope)
        scope = Scope(sub, cfg, spec.dims, foreign)
        self.check_constraints(spec, scope)
        prefix = builder.prefix + name + "."
        child = GraphBuilder(builder._state, scope, sub, prefix, builder)
        specs, _ = self.declare_params(child, spec, builder._state, prefix)
        builder._state.extra_params += specs
        args, _ = self.forward_signature(spec)
        # trailing optional inputs may be left out: the forward then sees None, as if passed
        omitted = len(args) - len(inputs)
        if omitted < 0 or not all(ann.optional for _, ann in args[len(inputs):]):
            raise error(
                "E003",
                f"call({name!r}): {spec.name}.forward takes {len(args)} inputs "
                f"({', '.join(a for a, _ in args)}), found {len(inputs)}",
                "pass one tensor per argument of its @forward (only optional, `| None`, trailing ones "
                "may be left out)",
                loc,
            )
        refs: list[GraphRef | None] = []
        star: tuple[str, tuple[DimExpr, ...]] | None = None  # the input that bound `*`, and its dims
        for x, (arg, ann) in zip([*inputs, *[None] * omitted], args, strict=True):
            if x is None and ann.optional:  # compile-time specialisation: the forward takes its None branch
                refs.append(None)
                continue
            if x is None:
                raise error(
                    "E003",
                    f"call({name!r}): input {arg!r} of {spec.name} is None, but it is not optional",
                    f"pass a tensor, or annotate the argument Tensor[...] | None and handle "
                    f"`{arg} is None` in the forward",
                    loc,
                )
            ref = builder._ref(x, f"{spec.name} input {arg!r}")
            variadic = ann.dims[:1] == (VARIADIC,)
            want = [child.dim(d) for d in ann.dims[variadic:]]
            if variadic and ref is not None and len(ref.shape) >= len(want):
                # `*` unifies with the leading dims of the tensor passed: the same for every input
                lead = tuple(ref.shape[:len(ref.shape) - len(want)])
                if star is None:
                    star = (arg, lead)
                elif len(star[1]) != len(lead) or not all(map(dims_equal, star[1], lead)):
                    raise error(
                        "E004",
                        f"call({name!r}): the variadic leading dims `*` of {spec.name} are "
                        f"[{', '.join(map(str, star[1]))}] from input {star[0]!r}, but input {arg!r} has "
                        f"[{', '.join(map(str, lead))}] ({ref.type})",
                        "every input annotated Tensor[\"*\", ...] must have the same leading dims",
                        loc,
                    )
                want = [*star[1], *want]
            if (
                ref is None
                or len(want) != len(ref.shape)
                or not all(dims_equal(a, b) for a, b in zip(want, ref.shape, strict=False))
            ):
                raise error(
                    "E004",
                    f"call({name!r}): input {arg!r} of {spec.name} must be "
                    f"[{', '.join(map(str, want))}], found {ref.type if ref is not None else None}",
                    "pass a tensor of the annotated shape (pass Dims to the submodule's constructor "
                    "to tie its dimensions to yours)",
                    loc,
                )
            if ann.explicit_dtype and ref.dtype != ann.dtype:
                raise error(
                    "E003",
                    f"call({name!r}): input {arg!r} of {spec.name} must be {ann.dtype}, found {ref.dtype}",
                    "the annotation names an explicit dtype",
                    loc,
                )
            refs.append(ref)
            child.inputs[arg] = ref
        start = len(builder._state.ops)
        outs = self.run_forward(child, spec, refs)
        for out in outs:
            builder._state.regions[id(out)] = (start, len(builder._state.ops), prefix)
        _annotations.module_annotations(spec, prefix)  # checks where they apply
        builder._state.module_annotations += [(prefix, a) for a in spec.annotations]
        if num_outputs is not None and num_outputs != len(outs):
            raise error(
                "E003",
                f"call({name!r}): {spec.name} returns {len(outs)} outputs, num_outputs={num_outputs}",
                "num_outputs= must match what its @forward returns",
                loc,
            )
        absent = {a for (a, _), r in zip(args, refs, strict=True) if r is None}  # optional inputs left out
        builder._state.save += [(prefix, child.inputs.get(n, n), loc) for n in spec.save if n not in absent]
        builder._state.recompute += [(prefix, child.inputs.get(n, n), loc) for n in spec.recompute
                                     if n not in absent]
        builder._state.extra_slots += self.layout(child, spec, scope, [a for a, _ in args], specs, prefix)
        return outs[0] if len(outs) == 1 else tuple(outs)


def _lora_pairing(p: ParamSpec, mapping: Any, where: str, loc: str | None) -> list[Diagnostic]:
    """A consumer adapts LoRA target ``i`` of a weight as the HF module of its mapping's source ``i``: a
    plain key has one target, a ``fuse`` one per source, slicing the fused dim."""
    if not p.lora_targets:
        return []
    if isinstance(mapping, str):
        count, dim = 1, None
    elif isinstance(mapping, Mapping) and mapping.get("type") == "fuse":
        count, dim = len(mapping["sources"]), mapping["dim"]
    else:
        return []
    names = ", ".join(t.name for t in p.lora_targets)
    hint = "list one LoRA target per fused source, in the order of the sources (target i is source i)"
    if count != len(p.lora_targets):
        return [diag("E010", f"{where}: {len(p.lora_targets)} LoRA target(s) ({names}) but the weight "
                             f"mapping has {count} source(s)", hint, loc)]
    if dim is not None and any(t.dim != dim for t in p.lora_targets):
        return [diag("E010", f"{where}: the LoRA targets ({names}) slice another dim than the fuse "
                             f"(dim={dim})", hint, loc)]
    return []


def r_decl(ref: GraphRef) -> TensorDecl:
    return TensorDecl(ref.name, ref.shape, ref.dtype)


# --- public API ----------------------------------------------------------------------------------


def _parse_config(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, (str, bytes)):
        try:
            config = json.loads(config)
        except ValueError as exc:
            raise error(
                "E001", f"config is not valid JSON: {exc}", "pass a dict or a JSON object", user_location()
            ) from None
    if not isinstance(config, Mapping):
        raise error(
            "E008",
            f"config must be a dict or a JSON object, found {type(config).__name__}",
            'e.g. {"d_model": 1024, "n_layers": 28}',
            user_location(),
        )
    return dict(config)


def _capture(builder: GraphBuilder, fn: Callable[..., Any], inputs: list[Any], what: str, name: str,
             loc: str | None) -> Any:
    """Run a module's ``forward`` or ``backward`` method once with placeholder tensors; any failure
    becomes a diagnostic at the user's line."""
    try:
        with active(builder):
            return fn(builder.obj, *inputs)
    except DSLError:
        raise
    except KilnError as exc:
        raise error(exc.code or "E001", exc.message, exc.hint, traceback_location(exc) or loc) from None
    except Exception as exc:
        raise error(
            "E001",
            f"could not capture the {what} graph of {name}: {type(exc).__name__}: {exc}",
            f"the {what} method runs once at compile time with GraphRef placeholders for tensors",
            traceback_location(exc) or loc,
        ) from None


def config_keys(name_or_class: Any) -> list[str] | None:
    """The config keys a DSL model takes (its constructor's parameters), or None if it takes any."""
    init = _resolve(name_or_class).__init__  # type: ignore[misc]
    if init is object.__init__:
        return None
    params = list(inspect.signature(init).parameters.values())[1:]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _fits(value: Any, hint: Any) -> bool:
    """Whether a JSON config value fits a constructor annotation (what is not a plain type fits)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if (origin or hint) in (list, tuple):
        return isinstance(value, list | tuple) and (not args or all(_fits(v, args[0]) for v in value))
    if (origin or hint) is dict:
        return isinstance(value, Mapping)
    return True


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    return "None" if hint is type(None) else getattr(hint, "__name__", str(hint))


def config_type_errors(name_or_class: Any, config: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    """``(key, value, expected type)`` for each value of ``config`` that does not fit the type the
    model's constructor annotates it with."""
    init = _resolve(name_or_class).__init__
    try:
        hints = typing.get_type_hints(init)
    except Exception:  # annotations that do not evaluate: nothing to check against
        return []
    return [(k, v, _type_name(hints[k])) for k, v in config.items() if k in hints and not _fits(v, hints[k])]


def unknown_config_keys(name_or_class: Any, config: Mapping[str, Any]) -> list[tuple[str, str | None]]:
    """Keys of ``config`` the model does not take, each with the closest key it does take (or None)."""
    import difflib

    keys = config_keys(name_or_class)
    if keys is None:
        return []
    return [(k, next(iter(difflib.get_close_matches(k, keys, n=1)), None)) for k in config if k not in keys]


def _resolve(name_or_class: Any) -> type:
    if isinstance(name_or_class, str):
        cls = _lookup_name(name_or_class)
        if cls is None:
            raise error(
                "E002",
                f"no DSL model named {name_or_class!r} is registered",
                f"registered models: {', '.join(registry.list('model')) or 'none'}",
                user_location(),
            )
        return cls
    if not is_component(name_or_class):
        what = name_or_class.__name__ if isinstance(name_or_class, type) else repr(name_or_class)
        raise error(
            "E008",
            f"{what} is not a DSL @model (nor a @block or @module)",
            "decorate the class with @model",
            class_location(name_or_class) if isinstance(name_or_class, type) else None,
        )
    return name_or_class


def _unbound_dims(module: Module) -> list[Diagnostic]:
    """The runtime binds only int config entries plus B and T: any other symbol is a compiler bug."""
    ints = set(dim_bindings(module.config))
    registry = op_registry()
    dims: list[Any] = [d for p in module.params for d in p.shape]
    dims += [d for s in module.activations.slots for d in s.shape]
    if module.forward is not None:
        g = module.forward
        dims += [d for t in (*g.inputs, *g.params, *g.outputs) for d in t.shape]
        for op in g.ops:
            kinds = {a.name: a.kind for a in registry[op.type].attrs} if op.type in registry else {}
            for name, value in op.attrs.items():
                if kinds.get(name) == "dim" and value is not None:
                    dims.append(value)
                elif kinds.get(name) == "dims":
                    dims += list(value)
    free = set().union(*(parse_dim(d).free_symbols() for d in dims)) - {"B", "T"} - ints
    return [
        diag(
            "E002",
            f"module {module.name!r} uses dimension {name!r}, which is not an int config entry",
            "bind it in the module's config (a constructor argument, a Dim alias or _dims_)",
        )
        for name in sorted(free)
    ]


def _compile(name_or_class: Any, config: Any) -> tuple[Bundle | None, list[Diagnostic], list[Diagnostic]]:
    compiler = _Compiler()
    bundle = None
    try:
        cls = _resolve(name_or_class)
        built = compiler.build(cls, _parse_config(config))
        if not compiler.errors:
            bundle = Bundle([built.module, *compiler.block_order], entry=built.module.name)
            for m in bundle.modules:
                compiler.errors += _unbound_dims(m)
            for d in diagnostics(bundle):
                if d.is_error:
                    compiler.errors.append(d)
                else:
                    compiler.warnings.append(d)
    except DSLError as exc:
        compiler.errors += list(exc.diagnostics)
    except KilnError as exc:
        compiler.errors += list(exc.diagnostics) or [
            diag(exc.code or "E001", exc.message, exc.hint, exc.location)
        ]
    except Exception as exc:  # a compiler bug: still a diagnostic, never a traceback from deep inside
        compiler.errors.append(
            diag(
                "E001",
                f"internal compiler error: {type(exc).__name__}: {exc}",
                "please report it with the model definition",
                traceback_location(exc),
            )
        )
    if compiler.errors:
        bundle = None
    return bundle, compiler.errors, compiler.warnings


def _payload(
    bundle: Bundle | None, errors: list[Diagnostic], warnings: list[Diagnostic], raise_on_error: bool
) -> dict[str, Any]:
    if errors and raise_on_error:
        first = errors[0]
        raise DSLError(
            first.message if len(errors) == 1 else f"compilation failed with {len(errors)} error(s)",
            diagnostics=errors,
        )
    out: dict[str, Any] = {
        "success": bundle is not None,
        "errors": [d.to_dict() for d in errors],
        "warnings": [d.to_dict() for d in warnings],
    }
    if bundle is not None:
        out["entry"] = bundle.entry
        out["modules"] = [m.to_dict() for m in bundle.modules]
    return out


def compile_model(name_or_class: Any, config: Any = None, *, raise_on_error: bool = False) -> dict[str, Any]:
    """Compile a DSL model (or block or module) with ``config`` (dict or JSON text) to the IR payload:
    ``{"success", "errors", "warnings", "entry", "modules"}`` where each module is ``Module.to_dict()``."""
    bundle, errors, warnings = _compile(name_or_class, config)
    return _payload(bundle, errors, warnings, raise_on_error)


def build_bundle(
    name_or_class: Any, config: Any = None, *, warnings: list[Diagnostic] | None = None
) -> Bundle:
    """Compile to a :class:`kiln.core.ir.Bundle`; raises :class:`DSLError` listing every error. A list
    passed as ``warnings`` receives the compile's warning diagnostics (W001-W005), which
    ``compile_model`` returns in its payload."""
    bundle, errors, found = _compile(name_or_class, config)
    if warnings is not None:
        warnings.extend(found)
    _payload(bundle, errors, found, True)
    assert bundle is not None
    return bundle


def _hf_value(cfg: Mapping[str, Any], key: str) -> Any:
    value: Any = cfg
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def hf_to_config(cls: type, hf_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The constructor config of a DSL model from a HuggingFace config, through its ``@hf_config``."""
    mapping = (spec_of(cls).hf_config or {}).get("param_mapping", {})
    out = {}
    for dsl_name, hf_key in mapping.items():
        value = _hf_value(hf_cfg, hf_key)
        if value is not None:
            out[dsl_name] = value
    init = cls.__init__  # type: ignore[misc]
    if init is not object.__init__:
        for name in list(inspect.signature(init).parameters)[1:]:
            if name not in out and name not in mapping and hf_cfg.get(name) is not None:
                out[name] = hf_cfg[name]
    return out


def compile_model_for_hf(
    architecture: str, hf_config: Any, *, raise_on_error: bool = False
) -> dict[str, Any]:
    """Compile the DSL model whose ``@hf_config(architecture=...)`` matches, configured from a HF config."""
    try:
        cfg = _parse_config(hf_config)
        cls = registry.find_hf_architecture(architecture)
        if cls is None:
            raise error(
                "E002",
                f"no DSL model maps HuggingFace architecture {architecture!r}",
                f"architectures with a DSL model: {', '.join(registry.architectures()) or 'none'}",
                user_location(),
            )
    except DSLError as exc:
        return _payload(None, list(exc.diagnostics), [], raise_on_error)
    return compile_model(cls, hf_to_config(cls, cfg), raise_on_error=raise_on_error)
