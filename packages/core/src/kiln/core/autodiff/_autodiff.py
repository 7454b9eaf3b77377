"""Ahead-of-time reverse-mode differentiation of graph IR.

``derive_backward`` follows the five steps of the design: producer map, needs-grad propagation,
reverse traversal applying each op's backward rule, accumulation of fan-out gradients, and the
required saves read off the ``saved.`` references. A ``call`` of a repeated block is
differentiated by deriving the block's body once and emitting one ``call_backward``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
from attrs import field

from kiln.core._errors import AutodiffError
from kiln.core.ir._infer import infer_types
from kiln.core.ir._ir import FrozenDict, Graph, Module, Op, TensorDecl, TensorType, is_float
from kiln.core.ir._verify import nondiff_tensors
from kiln.core.ops._ops import BackwardContext, OpRegistry


def _strs(v: Sequence[str]) -> tuple[str, ...]:
    return tuple(v)


@attrs.frozen
class DeriveBackwardOptions:
    """Options of :func:`derive_backward`.

    ``loss_name``: the tensor differentiated (``None``: every graph output). ``auto_save``: derive
    the save list from the ``saved.`` references (otherwise only ``extra_saves`` are saved and a
    missing one is error E006). ``accumulate_grads``: sum the contributions of a tensor used several
    times (otherwise fan-out is an error). ``grad_prefix``: gradient names are prefix + tensor.
    ``stop_gradients``: tensors (e.g. frozen weights) that get no gradient and pass none on.
    """

    loss_name: str | None = "loss"
    auto_save: bool = True
    extra_saves: tuple[str, ...] = field(default=(), converter=_strs)
    accumulate_grads: bool = True
    grad_prefix: str = "d_"
    stop_gradients: tuple[str, ...] = field(default=(), converter=_strs)


@attrs.frozen
class BackwardResult:
    """The derived backward graph, the forward graph with its save list, and tensor -> gradient names."""

    forward: Graph
    backward: Graph
    saves: tuple[str, ...]
    grads: FrozenDict


def derive_backward(graph: Graph, options: DeriveBackwardOptions | None = None, *,
                    registry: OpRegistry | None = None, modules: Mapping[str, Module] | None = None,
                    ) -> BackwardResult:
    """Derive the backward graph of ``graph``; see :class:`DeriveBackwardOptions`."""
    opts = options or DeriveBackwardOptions()
    if registry is None:
        from kiln.core.ops.library import op_registry

        registry = op_registry()
    modules = modules or {}
    p = opts.grad_prefix

    # Step 1: producers and types.
    for op in graph.ops:
        if op.type != "call":
            registry.get_op(op.type)  # unknown ops fail here, with E014
    producers = graph.producers()
    types = _types_through_calls(graph, registry, modules)
    params = frozenset(d.name for d in graph.params)
    graph_inputs = frozenset(d.name for d in graph.inputs)
    stops = set(opts.stop_gradients)
    for name in stops:
        if name not in types and name not in producers:
            raise AutodiffError(
                f"stop_gradients names {name!r}, which is not a tensor of graph {graph.name!r}",
                tensor=name, code="E002")

    nondiff = nondiff_tensors(graph, registry, modules)  # from op traits, never from names

    def differentiable(name: str) -> bool:
        t = types.get(name)
        return (bool(name) and name not in stops and name not in nondiff
                and (t is None or is_float(t.dtype)))

    # Step 2: needs_grad = reaches the loss, depends on a trainable leaf, and is differentiable.
    if opts.loss_name is not None:
        if opts.loss_name not in producers:
            raise AutodiffError(
                f"loss tensor {opts.loss_name!r} is not produced by graph {graph.name!r}",
                tensor=opts.loss_name, code="E002",
                hint="set DeriveBackwardOptions(loss_name=...) to the tensor to differentiate")
        roots = [opts.loss_name]
    else:
        roots = [d.name for d in graph.outputs]
    trainable = {n for n in (*params, *graph_inputs) if differentiable(n)}
    for op in graph.ops:
        if op.type == "call":  # the block's own parameters train whatever flows in
            trainable.update(o for o in op.outputs if differentiable(o))
        elif op.type in registry:
            nd = registry.get_op(op.type).nondiff_inputs
            if any(n in trainable for k, n in enumerate(op.inputs) if k not in nd):
                trainable.update(o for o in op.outputs if differentiable(o))
    reaches: set[str] = set(roots)
    for op in reversed(graph.ops):
        if any(o in reaches for o in op.outputs):
            reaches.update(i for i in op.inputs if i)
    needs = {n for n in reaches & trainable if differentiable(n)}

    # Steps 3 and 4: reverse traversal with accumulation.
    grads: dict[str, str] = {}
    loss_decls: list[TensorDecl] = []
    for r in roots:
        if r in needs:
            grads[r] = p + r
            t = types.get(r)
            loss_decls.append(TensorDecl(p + r, t.shape if t else (), "fp32"))
    emitted: list[Op] = []
    used_names: set[str] = set(grads.values())

    def namer(base: str) -> str:
        name, k = base, 1
        while name in used_names:
            k += 1
            name = f"{base}.{k}"
        used_names.add(name)
        return name

    counts: dict[str, int] = {}
    origin: dict[str, str] = {}  # first output of an op a backward rule emitted -> its forward op's
    primal: dict[str, set[str]] = {}  # a gradient (or contribution to one) -> the tensors it is that of
    for op in reversed(graph.ops):
        d_outs = [grads.get(o) for o in op.outputs]
        if not any(d_outs):
            continue  # dead: nothing downstream needs this op's gradient
        if op.type == "call":
            contribs, d_block_params = _call_backward(op, d_outs, needs, modules, opts, registry, emitted,
                                                      namer, types)
            stack = op.attrs.get("params")
            # a stack several calls run (its layers interleaved with another stack's) keeps the name of
            # the gradient the backward meets first; each call's holds the gradients of its own layers
            if stack in params and stack not in stops:
                grads.setdefault(stack, d_block_params)
        else:
            opdef = registry.get_op(op.type)
            want = [bool(n) and n in needs and k not in opdef.nondiff_inputs for k, n in enumerate(op.inputs)]
            if not any(want):
                continue
            if opdef.backward is None:
                raise AutodiffError(
                    f"op {op.type!r} has no backward rule, but gradients must flow through it "
                    f"(to {', '.join(n for n, w in zip(op.inputs, want, strict=True) if w)})", op=op.type,
                    hint=f"register one: kiln.core.register_backward_rule({op.type!r}, rule) where rule(ctx) "
                         "emits ops with ctx.emit(...) and returns one gradient name (or None) per input")

            def op_namer(b: str, o: Op = op) -> str:
                return namer(f"{p}{o.outputs[0]}:{b}")

            ctx = BackwardContext(op, opdef, opdef.resolve_attrs(op.attrs), d_outs, want, types, params,
                                  graph_inputs, registry, op_namer)
            contribs = list(opdef.backward(ctx))
            if len(contribs) != len(op.inputs):
                raise AutodiffError(f"backward rule of {op.type!r} returned {len(contribs)} gradients for "
                                    f"{len(op.inputs)} inputs", op=op.type)
            emitted.extend(ctx.emitted)
            origin.update((e.outputs[0], op.outputs[0]) for e in ctx.emitted)
        for name, g in zip(op.inputs, contribs, strict=True):
            if g is None or name not in needs:
                continue
            counts[name] = counts.get(name, 0) + 1
            primal.setdefault(g, set()).add(name)
            if name not in grads:
                grads[name] = g
            elif opts.accumulate_grads:
                acc = namer(f"{p}{name}:acc")
                emitted.append(Op("add", (grads[name], g), (acc,), loc=op.loc))
                grads[name] = acc
                primal[acc] = {name}
            else:
                raise AutodiffError(
                    f"tensor {name!r} is used by {counts[name]} ops and accumulate_grads is off",
                    tensor=name, hint="enable DeriveBackwardOptions(accumulate_grads=True)")

    # Name every gradient prefix + tensor where that is free of aliasing; leaves get a copy if needed.
    leaves = [n for n in (*graph.inputs, *graph.params) if n.name in grads and n.name not in roots]
    produced = {o for op in emitted for o in op.outputs}
    aliased = {g for g in grads.values() if list(grads.values()).count(g) > 1}
    rename: dict[str, str] = {}
    for name, g in grads.items():
        want_name = p + name
        if g != want_name and g in produced and g not in aliased and want_name not in used_names:
            rename[g] = want_name
            used_names.add(want_name)
    emitted = [attrs.evolve(op, inputs=tuple(rename.get(i, i) for i in op.inputs),
                            outputs=tuple(rename.get(o, o) for o in op.outputs)) for op in emitted]
    grads = {n: rename.get(g, g) for n, g in grads.items()}
    for d in leaves:
        if grads[d.name] != p + d.name:
            emitted.append(Op("copy", (grads[d.name],), (p + d.name,)))
            grads[d.name] = p + d.name
            primal[p + d.name] = {d.name}
    outputs = tuple(TensorDecl(p + d.name, d.shape, d.dtype) for d in leaves)

    # Dead-code elimination: keep ops that (transitively) feed a leaf gradient.
    live = {d.name for d in outputs}
    kept: list[Op] = []
    for op in reversed(emitted):
        if any(o in live for o in op.outputs):
            kept.append(op)
            live.update(i for i in op.inputs if i)
    kept.reverse()

    # Step 5: required saves.
    refs = list(dict.fromkeys(
        i.removeprefix("saved.") for op in kept for i in op.inputs if i.startswith("saved.")))
    for name in opts.extra_saves:
        if name not in types:
            raise AutodiffError(f"extra_saves names {name!r}, which is not a tensor of graph {graph.name!r}",
                                tensor=name, code="E002")
    saves = tuple(dict.fromkeys((*refs, *opts.extra_saves))) if opts.auto_save else tuple(opts.extra_saves)
    used_params = sorted({i for op in kept for i in op.inputs if i in params})
    pdecl = {d.name: d for d in graph.params}
    # which forward op each kept op derives from: the backward of an op runs in its forward's precision
    origin = {rename.get(o, o): f for o, f in origin.items()}
    derived_from = {op.outputs[0]: origin[op.outputs[0]] for op in kept if op.outputs[0] in origin}
    # which forward tensors each kept op's output is the gradient of (torch gives it their dtype)
    primal = {rename.get(g, g): names for g, names in primal.items()}
    gradient_of = {o: tuple(sorted(primal[o])) for op in kept for o in op.outputs if o in primal}
    backward = Graph(
        f"{graph.name}_backward", inputs=loss_decls, outputs=outputs,
        params=tuple(pdecl[n] for n in used_params), ops=kept,
        metadata={"forward": graph.name, "grad_prefix": p, "derived_from": derived_from,
                  "gradient_of": gradient_of},
    )
    missing = [n for n in refs if n not in saves]
    if missing:
        raise AutodiffError(f"backward reads saved.{missing[0]}, but auto_save is off and it is not in "
                            "extra_saves", tensor=missing[0], code="E006",
                            hint=f"add {missing!r} to extra_saves or turn auto_save on")
    return BackwardResult(graph.evolve(save=saves), backward, saves, FrozenDict(grads))


def _types_through_calls(graph: Graph, registry: OpRegistry, modules: Mapping[str, Module]
                         ) -> dict[str, TensorType]:
    """Types of every tensor, with ``call`` outputs typed in the caller's symbols.

    A block's outputs feed the next layer's first inputs, so output ``k`` has the type of call input
    ``k``; the block's declared output types (in the block's own symbols, which the caller's config
    need not bind) are the fallback when that input is untyped. Shape rules run once per call, so
    the ops after a call see its outputs' types.
    """
    call_outs: list[TensorDecl] = []
    types = infer_types(graph, registry)
    for op in graph.ops:
        if op.type != "call":
            continue
        callee = _callee(op, modules)
        assert callee.forward is not None
        for k, (name, decl) in enumerate(zip(op.outputs, callee.forward.outputs, strict=True)):
            t = types.get(op.inputs[k]) if k < len(op.inputs) and op.inputs[k] else None
            call_outs.append(TensorDecl(name, *(t.shape, t.dtype) if t else (decl.shape, decl.dtype)))
        types = infer_types(graph.evolve(intermediates=(*graph.intermediates, *call_outs)), registry)
    return types


def _callee(op: Op, modules: Mapping[str, Module]) -> Module:
    name = op.attrs.get("module")
    callee = modules.get(name) if isinstance(name, str) else None
    if callee is None or callee.forward is None:
        raise AutodiffError(f"op 'call' names module {name!r}, which was not given to derive_backward",
                            op="call", code="E002",
                            hint="pass modules={name: Module} (e.g. a Bundle's modules)")
    return callee


def block_backward(module: Module, options: DeriveBackwardOptions, registry: OpRegistry,
                   modules: Mapping[str, Module]) -> BackwardResult:
    """The backward of a block body: every output is differentiated, every float input gets a gradient.

    Stop-gradients are scoped: of ``options.stop_gradients`` only names of the block's own graph
    apply, plus the block's frozen parameters."""
    assert module.forward is not None
    names = {*module.forward.decls(), *module.forward.producers()}
    stops = [s for s in options.stop_gradients if s in names]
    stops += [p.name for p in module.params if p.frozen and p.name in names]
    opts = attrs.evolve(options, loss_name=None, stop_gradients=tuple(dict.fromkeys(stops)))
    return derive_backward(module.forward, opts, registry=registry, modules=modules)


def _call_backward(op: Op, d_outs: list[str | None], needs: set[str], modules: Mapping[str, Module],
                   opts: DeriveBackwardOptions, registry: OpRegistry, emitted: list[Op],
                   namer: Any, types: Mapping[str, TensorType]) -> tuple[list[str | None], str]:
    """Emit one ``call_backward`` that runs the block's backward for every layer in reverse."""
    callee = _callee(op, modules)
    sub = block_backward(callee, opts, registry, modules)
    assert callee.forward is not None
    grads_of = dict(sub.grads)
    outs: list[str | None] = []
    out_names: list[str] = []
    for name, d in zip(op.inputs, callee.forward.inputs, strict=True):
        if name in needs and d.name in grads_of:
            g = namer(f"{opts.grad_prefix}{name}:call")
            outs.append(g)
            out_names.append(g)
        else:
            outs.append(None)
            out_names.append("")
    for k, d_out in enumerate(d_outs):
        if d_out is None:  # an output nobody differentiates still needs a zero gradient per layer
            t = types.get(op.outputs[k]) or callee.forward.outputs[k].type
            z = namer(f"{opts.grad_prefix}{op.outputs[k]}:zero")
            shape = [s.to_json() for s in t.shape]
            emitted.append(Op("zeros", (), (z,), {"shape": shape, "dtype": t.dtype}))
            d_outs[k] = z
    d_params = namer(f"{opts.grad_prefix}{op.attrs.get('params', 'blocks')}:call")
    call_inputs = (*[d or "" for d in d_outs], *[f"saved.{i}" if i else "" for i in op.inputs])
    emitted.append(Op("call_backward", call_inputs, (*out_names, d_params), {**op.attrs}, loc=op.loc))
    return outs, d_params


def registered_ops(registry: OpRegistry | None = None) -> list[str]:
    """Names of the ops that have a backward rule."""
    if registry is None:
        from kiln.core.ops.library import op_registry

        registry = op_registry()
    return sorted(name for name, d in registry.items() if d.backward is not None)


def has_rule(op_type: str, registry: OpRegistry | None = None) -> bool:
    if registry is None:
        from kiln.core.ops.library import op_registry

        registry = op_registry()
    return op_type in registry and registry[op_type].backward is not None


def verify_backward(forward: Graph, backward: Graph | None = None, *, bindings: Mapping[str, int],
                    registry: OpRegistry | None = None, seed: int = 0, eps: float = 1e-6,
                    loss_name: str = "loss", params: Sequence[str] | None = None,
                    grad_prefix: str | None = None) -> dict[str, float]:
    """The autograd oracle check: gradients of ``sum(loss * r)`` from the backward graph vs central
    finite differences, in float64 on small random inputs. Returns max relative error per parameter.

    Gradients are named ``grad_prefix + name`` (the seed ``grad_prefix + loss_name``): by default the
    prefix the backward graph records in its metadata (``derive_backward`` does), else ``d_``; a derived
    backward is derived with it. A parameter in ``params`` the backward gives no gradient, or none at all
    where some parameter is float, is an ``AutodiffError`` naming the gradients it looked for."""
    from kiln.core.autodiff._gradcheck import central_differences, max_rel_error
    from kiln.core.autodiff._interp import run_graph
    from kiln.core.ir._dims import evaluate_shape

    if registry is None:
        from kiln.core.ops.library import op_registry

        registry = op_registry()
    if backward is None:
        opts = DeriveBackwardOptions(loss_name=loss_name, grad_prefix=grad_prefix or "d_")
        backward = derive_backward(forward, opts, registry=registry).backward
    p = grad_prefix if grad_prefix is not None else str(backward.metadata.get("grad_prefix", "d_"))
    seeds = [d.name for d in backward.inputs]
    if seeds and f"{p}{loss_name}" not in seeds:
        raise AutodiffError(f"backward {backward.name!r} is seeded by {', '.join(map(repr, seeds))}, not "
                            f"{p + loss_name!r} (gradient prefix {p!r})",
                            hint="pass grad_prefix= as the backward names its gradients")
    unknown = [n for n in params or () if n not in {d.name for d in forward.params}]
    if unknown:
        raise AutodiffError(f"verify_backward: {', '.join(map(repr, unknown))} is not a parameter of "
                            f"{forward.name!r}")
    rng = np.random.default_rng(seed)
    values: dict[str, np.ndarray] = {}
    for d in (*forward.inputs, *forward.params):
        shape = evaluate_shape(d.shape, bindings)
        if is_float(d.dtype):
            values[d.name] = rng.standard_normal(shape) * 0.5
        else:
            hi = min(bindings.values()) if bindings else 2
            values[d.name] = rng.integers(0, max(hi, 1), size=shape).astype(np.int32)
    env = run_graph(forward, values, registry=registry, bindings=bindings, float_dtype=np.float64)
    r = rng.standard_normal(np.shape(env[loss_name]))
    bwd_in = {**env, **{f"saved.{k}": v for k, v in env.items()}, f"{p}{loss_name}": r}
    genv = run_graph(backward, bwd_in, registry=registry, bindings=bindings, float_dtype=np.float64)
    wanted = [d for d in forward.params if (params is None or d.name in params) and is_float(d.dtype)]
    missing = [d.name for d in wanted if f"{p}{d.name}" not in genv]
    if (params is not None and missing) or (wanted and len(missing) == len(wanted)):
        raise AutodiffError(f"backward {backward.name!r} computes no gradient "
                        f"{', '.join(repr(p + n) for n in missing)} (gradient prefix {p!r})",
                        hint="pass grad_prefix= as the backward names its gradients")
    report: dict[str, float] = {}
    for d in forward.params:
        if (params is not None and d.name not in params) or f"{p}{d.name}" not in genv:
            continue

        def loss(x: np.ndarray, name: str = d.name) -> float:
            env = run_graph(forward, {**values, name: x}, registry=registry, bindings=bindings,
                            float_dtype=np.float64)
            return float(np.sum(env[loss_name] * r))

        fd = central_differences(loss, values[d.name], eps)
        report[d.name] = max_rel_error(np.asarray(genv[f"{p}{d.name}"]).reshape(fd.shape), fd)
    return report
