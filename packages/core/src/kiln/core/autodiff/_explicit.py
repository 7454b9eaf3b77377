"""Explicit backward graphs: a module's own ``Module.backward`` (kiln-dsl's ``@backward``).

``compile`` runs a module's explicit backward instead of deriving one, after
:func:`explicit_backward` has checked it: the validation of seed 004 §5.12.5 (every differentiable
input and parameter gets a gradient of its shape and a float dtype, forward tensors are read only
as ``saved.<name>`` of tensors the forward saves or recomputes, gradients flow without cycles,
every op's shape rule accepts its inputs), then the autograd oracle of §9.8.1: on random float64
inputs, run through the reference interpreter, its gradients must equal the derived backward's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kiln.core._errors import AutodiffError, Diagnostic, KilnError
from kiln.core.autodiff._autodiff import BackwardResult, DeriveBackwardOptions, derive_backward
from kiln.core.ir._dims import dims_equal, evaluate_shape
from kiln.core.ir._infer import infer_types
from kiln.core.ir._ir import FrozenDict, Graph, Module, TensorDecl, is_float
from kiln.core.ir._verify import check_backward, nondiff_tensors
from kiln.core.ops._ops import OpRegistry

#: Sizes the oracle gives the batch and sequence dims, and any other symbol the config leaves free.
ORACLE_DIMS = {"B": 2, "T": 3}
ORACLE_FREE_DIM = 2


def explicit_backward(module: Module, *, loss_name: str | None = None, registry: OpRegistry | None = None,
                      modules: Mapping[str, Module] | None = None, bindings: Mapping[str, int] | None = None,
                      seed: int = 0, tolerance: float = 1e-6) -> BackwardResult:
    """Check ``module.backward`` against its forward and return it as :func:`derive_backward` would.

    ``loss_name``: the tensor differentiated (None: every output, as for a block). ``bindings``
    sizes the oracle's inputs (default: the module's int config, ``B=2``, ``T=3``). An invalid graph
    raises :class:`AutodiffError` with one diagnostic per problem (E002-E007, E017-E020); gradients
    that differ from the derived backward's by more than ``tolerance`` (max relative error) raise
    one naming the module and the gradient. Gradients kiln never computes (of frozen parameters,
    integer tensors and those no op passes a gradient to, :func:`nondiff_tensors`) are not compared.
    """
    if registry is None:
        from kiln.core.ops.library import op_registry

        registry = op_registry()
    fwd, bwd = module.forward, module.backward
    where = f"module {module.name!r}"
    if fwd is None or bwd is None:
        raise AutodiffError(f"{where} has no {'forward' if fwd is None else 'backward'} graph", code="E002")
    if any(op.type in ("call", "call_backward") for op in (*fwd.ops, *bwd.ops)):
        raise AutodiffError(f"{where}: an explicit backward of a graph that calls blocks is not supported",
                            hint="give the called block its explicit backward instead")
    names = {*fwd.decls(), *fwd.producers()}
    frozen = tuple(p.name for p in module.params if p.frozen and p.name in names)
    derived = derive_backward(fwd, DeriveBackwardOptions(loss_name=loss_name, stop_gradients=frozen),
                              registry=registry, modules=modules)
    errors = [d for d in _diagnostics(fwd, bwd, frozen, registry) if d.is_error]
    if errors:
        raise AutodiffError(f"the explicit backward of {where} is invalid ({len(errors)} error(s))",
                            diagnostics=errors)
    p = str(bwd.metadata.get("grad_prefix", "d_"))
    produced = {o for op in bwd.ops for o in op.outputs}
    grads = {d.name: p + d.name for d in (*fwd.inputs, *fwd.params) if p + d.name in produced}
    nondiff = nondiff_tensors(fwd, registry, modules)
    compared = {d.name: grads[d.name] for d in (*fwd.inputs, *fwd.params) if d.name in grads
                and d.name not in frozen and is_float(d.dtype) and d.name not in nondiff}
    _oracle(module, derived, compared, registry, modules, bindings, seed, tolerance)
    saves = tuple(dict.fromkeys(i[6:] for op in bwd.ops for i in op.inputs if i.startswith("saved.")))
    return BackwardResult(fwd.evolve(save=saves), bwd, saves, FrozenDict(grads))


def _diagnostics(fwd: Graph, bwd: Graph, frozen: tuple[str, ...], registry: OpRegistry) -> list[Diagnostic]:
    from kiln.core.ir._verify import check_graph

    p = str(bwd.metadata.get("grad_prefix", "d_"))
    where = f"graph {bwd.name!r}"
    diags = check_graph(bwd, registry)  # a forward tensor read by its plain name is E002 here
    outputs = {p + d.name: d for d in fwd.outputs}
    for d in bwd.inputs:
        out = outputs.get(d.name)
        if out is None:
            diags.append(Diagnostic("E002", f"backward input {d.name!r} is not the gradient of a forward "
                                    "output", hint=f"name the inputs {', '.join(outputs)}", location=where))
        elif not (len(d.shape) == len(out.shape) and all(map(dims_equal, d.shape, out.shape))):
            diags.append(Diagnostic("E018", f"backward input {d.name!r} is [{', '.join(map(str, d.shape))}] "
                                    f"but {out.name!r} is [{', '.join(map(str, out.shape))}]",
                                    location=where))
    fwd_names = {*fwd.decls(), *fwd.producers()}
    for o in sorted({o for op in bwd.ops for o in op.outputs} & fwd_names):
        diags.append(Diagnostic("E017", f"backward tensor {o!r} has the name of a forward tensor",
                                hint="the runtime holds both graphs' tensors: rename it", location=where))
    leaves = {p + d.name for d in (*fwd.inputs, *fwd.params)}
    for d in bwd.outputs:
        if d.name not in leaves:
            diags.append(Diagnostic("E002", f"backward output {d.name!r} is not the gradient of a forward "
                                    "input or parameter", hint="name gradients d_<input> or d_<param>",
                                    location=where))
    if not any(d.is_error for d in diags):  # every op's shape rule, with the forward's types for saved.
        saved = [TensorDecl(f"saved.{n}", t.shape, t.dtype) for n, t in infer_types(fwd, registry).items()]
        try:
            infer_types(bwd.evolve(inputs=(*bwd.inputs, *saved)), registry, strict=True)
        except KilnError as exc:
            diags.append(Diagnostic(exc.code or "E004", exc.message, location=where))
    return diags + check_backward(fwd, bwd, fwd.save, registry=registry, stop_gradients=frozen, grad_prefix=p,
                                  inputs=True)


def _oracle_bindings(module: Module, bindings: Mapping[str, int] | None) -> dict[str, int]:
    assert module.forward is not None
    binds: dict[str, int] = {k: v for k, v in module.config.items() if type(v) is int}
    binds.update(bindings if bindings is not None else ORACLE_DIMS)
    for d in (*module.forward.inputs, *module.forward.params):
        for dim in d.shape:
            binds.update({s: ORACLE_FREE_DIM for s in dim.free_symbols() if s not in binds})
    return binds


def _random_values(decls: tuple[TensorDecl, ...], bindings: Mapping[str, int],
                  rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Float64 normal values (scaled by 0.5) for float tensors, ints below the smallest size for the rest."""
    hi = min((v for v in bindings.values() if v > 0), default=2)
    out: dict[str, np.ndarray] = {}
    for d in decls:
        shape = evaluate_shape(d.shape, bindings)
        out[d.name] = (rng.standard_normal(shape) * 0.5 if is_float(d.dtype)
                       else rng.integers(0, hi, size=shape).astype(np.int32))
    return out


def _oracle(module: Module, derived: BackwardResult, grads: Mapping[str, str], registry: OpRegistry,
            modules: Mapping[str, Module] | None, bindings: Mapping[str, int] | None, seed: int,
            tolerance: float) -> None:
    """Seed 004 §9.8.1: the explicit and the derived backward on the same random float64 values."""
    from kiln.core.autodiff._gradcheck import max_rel_error
    from kiln.core.autodiff._interp import run_graph

    fwd, bwd = module.forward, module.backward
    assert fwd is not None and bwd is not None
    where = f"module {module.name!r}"
    binds = _oracle_bindings(module, bindings)
    rng = np.random.default_rng(seed)
    values = _random_values((*fwd.inputs, *fwd.params), binds, rng)
    run: dict[str, Any] = {"registry": registry, "bindings": binds, "float_dtype": np.float64,
                           "modules": modules}
    env = run_graph(fwd, values, **run)
    p = str(bwd.metadata.get("grad_prefix", "d_"))
    seeds = {p + d.name: rng.standard_normal(np.shape(env[d.name])) for d in fwd.outputs
             if is_float(d.dtype)}
    feed = {**{d.name: values[d.name] for d in fwd.params}, **{f"saved.{k}": v for k, v in env.items()},
            **seeds}
    reference = run_graph(derived.backward, feed, **run)
    try:
        got = run_graph(bwd, feed, **run)
    except KilnError as exc:
        raise AutodiffError(f"{where}: its explicit backward failed on random inputs: {exc.message}",
                            code=exc.code) from None
    except Exception as exc:
        raise AutodiffError(f"{where}: its explicit backward failed on random inputs: "
                            f"{type(exc).__name__}: {exc}") from None
    for name, g in grads.items():
        want = reference.get(derived.grads[name]) if name in derived.grads else None  # None: no path
        have = np.asarray(got[g], dtype=np.float64)
        if want is None:  # the derived backward gives it none: its gradient is zero
            want = np.zeros_like(have)
        if np.shape(have) != np.shape(want):
            raise AutodiffError(f"{where}: explicit gradient {g!r} has shape {np.shape(have)}, the derived "
                                f"one {np.shape(want)}", tensor=g, code="E018")
        err = max_rel_error(have, want) if np.any(want) else float(np.max(np.abs(have), initial=0.0))
        if not err <= tolerance:
            raise AutodiffError(
                f"{where}: explicit gradient {g!r} differs from the derived backward's (max relative error "
                f"{err:.2e} > {tolerance:.0e}) on random float64 inputs", tensor=g,
                hint="fix the backward graph, or delete it to let kiln derive the backward")
