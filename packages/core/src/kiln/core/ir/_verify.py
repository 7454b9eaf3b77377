"""Whole-IR verification: every problem found is reported at once, each naming its op and showing
a window of the surrounding ops."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kiln.core._errors import Diagnostic, DimError, IRError, KilnError
from kiln.core.ir._dims import Shape, dims_equal
from kiln.core.ir._infer import InferContext, infer_types
from kiln.core.ir._ir import Bundle, Graph, Module, Op, TensorDecl, TensorType, is_float


def _ops() -> Any:
    """The current plugin session's op registry."""
    from kiln.core.plugins import get_registry

    return get_registry("ops")

#: Ops the IR understands structurally rather than through the op registry.
#: ``call`` runs a block module ``n_layers`` times: its first outputs feed the next layer's first
#: inputs, the remaining inputs are passed unchanged to every layer.
STRUCTURAL_OPS = ("call", "call_backward")


def _where(graph: Graph, i: int) -> str:
    lo, hi = max(0, i - 2), min(len(graph.ops), i + 3)
    return f"graph {graph.name!r}, op %{i} ({graph.ops[i].type}):\n{graph.pretty(mark=i, window=(lo, hi))}"


def check_graph(
    graph: Graph,
    registry: Any,
    modules: Mapping[str, Module] | None = None,
    external: frozenset[str] = frozenset(),
) -> list[Diagnostic]:
    """All diagnostics for one graph. ``external`` names tensors defined outside (e.g. ``saved.x``)."""
    diags: list[Diagnostic] = []
    seen: set[str] = set()
    for d in (*graph.inputs, *graph.params):
        if d.name in seen:
            diags.append(
                Diagnostic(
                    "E009",
                    f"tensor {d.name!r} is declared twice as an input or parameter",
                    location=f"graph {graph.name!r}",
                )
            )
        seen.add(d.name)
    producers: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        for out in op.outputs:
            if not out:
                if op.type != "call_backward":  # "" there: an input of the call that gets no gradient
                    diags.append(
                        Diagnostic(
                            "E003", f"op {op.type!r} has an empty output name", location=_where(graph, i)
                        )
                    )
            elif out in seen or out in producers:
                first = f"op %{producers[out]}" if out in producers else "an input or parameter"
                diags.append(
                    Diagnostic(
                        "E017",
                        f"tensor {out!r} is defined again (first by {first})",
                        hint="every tensor is assigned exactly once (SSA); give it a new name",
                        location=_where(graph, i),
                    )
                )
            else:
                producers[out] = i

    # Definitions and order.
    late: list[tuple[int, str]] = []
    for i, op in enumerate(graph.ops):
        for name in op.inputs:
            if not name or name in seen or name in external or name.startswith("saved."):
                continue
            if name not in producers:
                diags.append(
                    Diagnostic(
                        "E002",
                        f"op {op.type!r} reads {name!r}, which is never defined",
                        hint="declare it as a graph input or parameter, or produce it by an op",
                        location=_where(graph, i),
                    )
                )
            elif producers[name] >= i:
                late.append((i, name))
    cycle = _find_cycle(graph, producers)
    if cycle:
        text = " -> ".join(f"%{k} ({graph.ops[k].type})" for k in (*cycle, cycle[0]))
        diags.append(Diagnostic("E007", f"circular dependency: {text}", location=_where(graph, cycle[0])))
    else:
        for i, name in late:
            diags.append(
                Diagnostic(
                    "E002",
                    f"op {graph.ops[i].type!r} reads {name!r} before op %{producers[name]} defines it",
                    hint="list ops in dependency order",
                    location=_where(graph, i),
                )
            )
    for d in graph.outputs:
        if d.name not in producers and d.name not in seen:
            diags.append(
                Diagnostic(
                    "E002", f"graph output {d.name!r} is never produced", location=f"graph {graph.name!r}"
                )
            )
    for kind, names in (("save", graph.save), ("recompute", graph.recompute)):
        for name in names:
            if name not in producers and name not in seen:
                diags.append(
                    Diagnostic(
                        "E002",
                        f"{kind} list names {name!r}, which is not a tensor of the graph",
                        location=f"graph {graph.name!r}",
                    )
                )

    # Op schemas and types.
    types: dict[str, TensorType] = {d.name: d.type for d in (*graph.inputs, *graph.params)}
    declared = graph.decls()
    for i, op in enumerate(graph.ops):
        if op.type in STRUCTURAL_OPS:
            diags.extend(_check_call(graph, i, op, modules))
            continue
        if op.type not in registry:
            diags.append(
                Diagnostic(
                    "E014",
                    f"unknown op {op.type!r}",
                    hint="is the plugin that provides it installed? `kiln plugins` lists them",
                    location=_where(graph, i),
                )
            )
            continue
        opdef = registry[op.type]
        bad = opdef.arity_ok(len(op.inputs), len(op.outputs))
        if bad:
            diags.append(
                Diagnostic(
                    "E003",
                    f"op {op.type!r} takes {bad}, found {len(op.inputs)} inputs and "
                    f"{len(op.outputs)} outputs",
                    hint=f"signature: ({', '.join(opdef.inputs)}) -> ({', '.join(opdef.outputs)})",
                    location=_where(graph, i),
                )
            )
            continue
        try:
            resolved = opdef.resolve_attrs(op.attrs)
        except KilnError as exc:
            diags.append(Diagnostic("E003", exc.message, location=_where(graph, i)))
            continue
        ins = [types.get(n.removeprefix("saved.")) if n else None for n in op.inputs]
        if any(t is None for t, n in zip(ins, op.inputs, strict=True) if n):
            continue  # an undefined input was reported above, or a saved tensor of unknown type
        try:
            outs = list(opdef.infer(InferContext(op.type, ins, resolved)))
        except KilnError as exc:
            diags.append(Diagnostic(exc.code or "E004", exc.message, location=_where(graph, i)))
            continue
        except Exception as exc:  # a shape rule tripping over hostile attrs must not escape
            diags.append(
                Diagnostic(
                    "E004",
                    f"op {op.type!r}: shape rule failed on these inputs: {type(exc).__name__}: {exc}",
                    location=_where(graph, i),
                )
            )
            continue
        for name, t in zip(op.outputs, outs, strict=False):
            decl = declared.get(name)
            if decl is not None and decl.dtype != t.dtype:
                diags.append(
                    Diagnostic(
                        "E003",
                        f"tensor {name!r} is declared {decl.dtype} but op {op.type!r} produces {t.dtype}",
                        location=_where(graph, i),
                    )
                )
            elif decl is not None and not _same_shape(decl.shape, t.shape):
                diags.append(
                    Diagnostic(
                        "E004",
                        f"tensor {name!r} is declared [{', '.join(map(str, decl.shape))}] "
                        f"but op {op.type!r} produces [{', '.join(map(str, t.shape))}]",
                        location=_where(graph, i),
                    )
                )
            types.setdefault(name, decl.type if decl is not None else t)
    return diags


def _same_shape(a: Shape, b: Shape) -> bool:
    try:
        return len(a) == len(b) and all(dims_equal(x, y) for x, y in zip(a, b, strict=True))
    except DimError:  # too large to simplify: report a mismatch rather than fail to report at all
        return False


def _check_call(graph: Graph, i: int, op: Op, modules: Mapping[str, Module] | None) -> list[Diagnostic]:
    target = op.attrs.get("module")
    if not isinstance(target, str):
        return [
            Diagnostic("E003", f"op {op.type!r} needs a string attribute 'module'", location=_where(graph, i))
        ]
    if modules is None:
        return []
    callee = modules.get(target)
    if callee is None or callee.forward is None:
        return [
            Diagnostic(
                "E002",
                f"op {op.type!r} names module {target!r}, which is not in this bundle",
                location=_where(graph, i),
            )
        ]
    n_in, n_out = len(callee.forward.inputs), len(callee.forward.outputs)
    if op.type == "call_backward":  # (d_outputs..., saved inputs...) -> (d_inputs..., d_params)
        n_in, n_out = n_out + n_in, n_in + 1
    if len(op.inputs) != n_in or len(op.outputs) != n_out:
        return [
            Diagnostic(
                "E003",
                f"{op.type} of module {target!r} takes {n_in} inputs and returns {n_out} "
                f"outputs; it passes {len(op.inputs)} and names {len(op.outputs)}",
                location=_where(graph, i),
            )
        ]
    return []


def _find_cycle(graph: Graph, producers: Mapping[str, int]) -> list[int]:
    deps = [[producers[n] for n in op.inputs if n in producers] for op in graph.ops]
    state = [0] * len(graph.ops)  # 0 new, 1 on stack, 2 done
    for root in range(len(graph.ops)):
        if state[root]:
            continue
        stack: list[tuple[int, int]] = [(root, 0)]
        path: list[int] = []
        while stack:
            node, k = stack.pop()
            if k == 0:
                state[node] = 1
                path.append(node)
            if k < len(deps[node]):
                stack.append((node, k + 1))
                nxt = deps[node][k]
                if state[nxt] == 1:
                    return list(reversed(path[path.index(nxt) :]))
                if state[nxt] == 0:
                    stack.append((nxt, 0))
            else:
                state[node] = 2
                path.pop()
    return []


def _check_annotations(module: Module) -> list[Diagnostic]:
    """E002 for an annotation (seed 004 §7) whose target is not in ``module``: a tensor of its forward
    graph, one of its parameters, or (``on="module"``) the module itself (``""``) or the prefix of an
    inlined submodule's tensors or parameters."""
    g = module.forward
    tensors = set() if g is None else {
        *(d.name for d in (*g.inputs, *g.outputs, *g.params, *g.intermediates)),
        *(o for op in g.ops for o in op.outputs if o)}
    params = {p.name for p in module.params}
    out = []
    for a in module.annotations:
        if a.on == "tensor":
            ok, what = a.target in tensors, f"a tensor of {module.name}'s forward graph"
        elif a.on == "param":
            ok, what = a.target in params, f"a parameter of {module.name}"
        else:
            ok = a.target == "" or any(n.startswith(a.target + ".") for n in (*tensors, *params))
            what = f"{module.name} ('') or the prefix of one of its inlined submodules"
        if not ok:
            out.append(Diagnostic("E002", f"@{a.kind} on {a.on} {a.target!r}: not {what}",
                                  hint="annotate a name the module defines", location=a.loc or
                                  f"module {module.name!r}"))
    return out


def diagnostics(
    obj: Graph | Module | Bundle, *, registry: Any = None, modules: Mapping[str, Module] | None = None
) -> list[Diagnostic]:
    """Every diagnostic for ``obj`` (errors and warnings), without raising."""
    if registry is None:
        registry = _ops()
    if isinstance(obj, Bundle):
        mods = {m.name: m for m in obj.modules}
        out = [
            Diagnostic("E009", f"module {name!r} appears twice in the bundle")
            for name in {m.name for m in obj.modules if sum(x.name == m.name for x in obj.modules) > 1}
        ]
        if obj.entry is not None and obj.entry not in mods:
            out.append(Diagnostic("E002", f"entry module {obj.entry!r} is not in the bundle"))
        for m in obj.modules:
            out.extend(diagnostics(m, registry=registry, modules=mods))
        return out
    if isinstance(obj, Module):
        out = []
        names = [p.name for p in obj.params]
        for name in sorted({n for n in names if names.count(n) > 1}):
            out.append(
                Diagnostic("E009", f"parameter {name!r} is declared twice", location=f"module {obj.name!r}")
            )
        for g in (obj.forward, obj.backward):
            if g is not None:
                out.extend(check_graph(g, registry, modules))
        out.extend(_check_annotations(obj))
        if obj.forward is not None and obj.backward is not None:  # an explicit backward graph
            frozen = [p.name for p in obj.params if p.frozen]
            out.extend(
                check_backward(
                    obj.forward, obj.backward, obj.forward.save, registry=registry, stop_gradients=frozen
                )
            )
        return out
    if not isinstance(obj, Graph):
        raise IRError(f"verify checks a Graph, Module or Bundle, found {type(obj).__name__}", code="E003")
    return check_graph(obj, registry, modules)


def verify(
    obj: Graph | Module | Bundle, *, registry: Any = None, modules: Mapping[str, Module] | None = None
) -> None:
    """Raise :class:`IRError` listing every error in ``obj``; warnings don't raise."""
    errors = [d for d in diagnostics(obj, registry=registry, modules=modules) if d.is_error]
    if errors:
        what = type(obj).__name__.lower()
        name = getattr(obj, "name", None) or getattr(obj, "entry", None) or ""
        raise IRError(f"{what} {name!r} failed verification with {len(errors)} error(s)", diagnostics=errors)


def nondiff_tensors(graph: Graph, registry: Any = None,
                    modules: Mapping[str, Module] | None = None) -> frozenset[str]:
    """Tensors of ``graph`` no op passes a gradient to, whatever their name and dtype: every op that
    reads one reads it at an input its ``nondiff_inputs`` trait lists (token ids, indices, offsets, a
    mask, ``rope``'s frequency table), or, for a ``call``, at a block input the block itself reads only
    so. A tensor another op reads at a differentiable input is differentiable."""
    if registry is None:
        registry = _ops()
    modules = modules or {}
    readers: dict[str, list[bool]] = {}
    for op in graph.ops:
        if op.type == "call":
            callee = modules.get(str(op.attrs.get("module")))
            g = callee.forward if callee is not None else None
            inner = nondiff_tensors(g, registry, modules) if g is not None else frozenset()
            nd = {k for k, d in enumerate(g.inputs) if d.name in inner} if g is not None else set()
        else:
            nd = set(registry.get_op(op.type).nondiff_inputs) if op.type in registry else set()
        for k, name in enumerate(op.inputs):
            if name:
                readers.setdefault(name, []).append(k in nd)
    return frozenset(n for n, r in readers.items() if all(r))


def check_backward(forward: Graph, backward: Graph, saves: Sequence[str], *,
                   registry: Any = None, stop_gradients: Sequence[str] = (),
                   grad_prefix: str = "d_", inputs: bool = False) -> list[Diagnostic]:
    """Validate an explicit backward graph against its forward graph (E005, E006, E018-E020).

    ``saved.x`` must name a tensor in ``saves`` or in the forward's ``recompute`` list. Every float
    parameter not in ``stop_gradients`` needs its gradient; with ``inputs``, every float input too
    (except those no op passes a gradient to, :func:`nondiff_tensors`).
    """
    if registry is None:
        registry = _ops()
    diags: list[Diagnostic] = []
    where = f"graph {backward.name!r}"
    fwd_types = infer_types(forward, registry)
    available = {*saves, *forward.recompute}
    for i, op in enumerate(backward.ops):
        for name in op.inputs:
            x = name.removeprefix("saved.")
            if name.startswith("saved.") and x not in available:
                known = x in fwd_types
                why = "is not in the forward save list" if known else "is not a tensor of the forward"
                diags.append(Diagnostic(
                    "E006", f"backward reads {name!r}, but {x!r} {why}",
                    hint=f"add it to the save list of {forward.name!r}" if known else
                    f"name a tensor of {forward.name!r}", location=_where(backward, i)))
    cycle = _find_cycle(backward, backward.producers())
    if cycle:
        text = " -> ".join(f"%{k} ({backward.ops[k].type})" for k in (*cycle, cycle[0]))
        diags.append(Diagnostic("E019", f"circular gradient dependency: {text}",
                                location=_where(backward, cycle[0])))
        return diags
    produced = {o for op in backward.ops for o in op.outputs}
    saved_decls = [TensorDecl(f"saved.{n}", fwd_types[n].shape, fwd_types[n].dtype)
                   for n in saves if n in fwd_types]
    bwd_types = infer_types(backward.evolve(inputs=(*backward.inputs, *saved_decls)), registry)
    leaves = [("parameter", d) for d in forward.params]
    nondiff = nondiff_tensors(forward, registry) if inputs else frozenset()
    leaves += [("input", d) for d in forward.inputs if inputs and d.name not in nondiff]
    for kind, d in leaves:
        if d.name in stop_gradients or not is_float(d.dtype):
            continue
        g = grad_prefix + d.name
        if g not in produced:
            diags.append(Diagnostic(
                "E005", f"{kind} {d.name!r} has no gradient: the backward graph never produces {g!r}",
                hint=f"add an op that computes it, or list the {kind} in stop_gradients", location=where))
            continue
        t = bwd_types.get(g)
        if t is None:
            continue
        same = len(t.shape) == len(d.shape) and all(
            dims_equal(a, b) for a, b in zip(t.shape, d.shape, strict=True))
        if not same:
            diags.append(Diagnostic("E018", f"gradient {g!r} has shape [{', '.join(map(str, t.shape))}] "
                                            f"but {d.name!r} is [{', '.join(map(str, d.shape))}]",
                                    location=where))
        elif not is_float(t.dtype):
            diags.append(Diagnostic("E020", f"gradient {g!r} is {t.dtype}; the gradient of float {kind} "
                                            f"{d.name!r} must be a float type", location=where))
    return diags
