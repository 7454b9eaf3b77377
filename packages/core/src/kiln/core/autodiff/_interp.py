"""A direct interpreter of graphs on the ops' NumPy reference kernels.

This is the numerical oracle the planned NumPy backend is checked against: no planning, one
fresh array per tensor. ``saved.x`` reads ``x``.

A ``call`` runs its block module (from ``modules``) once per layer; layer ``i`` reads parameter
``p`` of the block as ``values["<params>.<i>.<p>"]``. A ``call_backward`` recomputes the layers
from the saved call inputs, then runs the block's backward (derived once) from the last layer to
the first; its stacked-parameter gradient is a dict ``{"<params>.<i>.<p>": array}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kiln.core._errors import KilnError
from kiln.core.ir._dims import Const, Sym, dim_bindings, parse_dim
from kiln.core.ir._ir import Graph, Module, Op, TensorDecl
from kiln.core.ops._ops import OpRegistry


def bind_dims(decls: tuple[TensorDecl, ...], values: Mapping[str, np.ndarray],
              bindings: Mapping[str, int] | None = None) -> dict[str, int]:
    """Bind the plain symbolic dims of ``decls`` from the shapes of the arrays given for them."""
    out = dict(bindings or {})
    for d in decls:
        arr = values.get(d.name)
        if arr is None:
            continue
        if len(d.shape) != np.ndim(arr):
            raise KilnError(f"tensor {d.name!r}: expected rank {len(d.shape)} "
                            f"({', '.join(map(str, d.shape))}), found shape {np.shape(arr)}")
        for dim, size in zip(d.shape, np.shape(arr), strict=True):
            if isinstance(dim, Sym):
                if out.setdefault(dim.name, size) != size:
                    raise KilnError(f"tensor {d.name!r}: dim {dim.name} is {out[dim.name]} elsewhere "
                                    f"but {size} here")
            elif isinstance(dim, Const) and dim.value != size:
                raise KilnError(f"tensor {d.name!r}: expected size {dim.value}, found {size}")
    return out


def run_graph(graph: Graph, values: Mapping[str, Any], *, registry: OpRegistry | None = None,
              bindings: Mapping[str, int] | None = None, float_dtype: Any = np.float32,
              modules: Mapping[str, Module] | None = None) -> dict[str, Any]:
    """Run every op of ``graph`` in order; returns all tensors by name (inputs included)."""
    if registry is None:
        from kiln.core.ops.library import op_registry

        registry = op_registry()
    env: dict[str, Any] = dict(values)
    binds = bind_dims((*graph.inputs, *graph.params), env, bindings)
    for op in graph.ops:
        ins: list[Any] = []
        for name in op.inputs:
            if not name:
                ins.append(None)
                continue
            key = name if name in env else name.removeprefix("saved.")
            if key not in env:
                raise KilnError(f"op {op.type!r} reads {name!r}, which has no value", code="E002")
            ins.append(env[key])
        if op.type in ("call", "call_backward"):
            callee = _callee(op, modules)
            run = _call if op.type == "call" else _call_backward
            outs: tuple[Any, ...] = run(op, callee, ins, env, registry, binds, float_dtype, modules or {})
        else:
            outs = registry.get_op(op.type).run(ins, op.attrs, binds, float_dtype)
        if len(outs) != len(op.outputs):
            raise KilnError(f"op {op.type!r} returned {len(outs)} outputs, the graph names {len(op.outputs)}")
        env.update((k, v) for k, v in zip(op.outputs, outs, strict=True) if k)
    return env


def _callee(op: Op, modules: Mapping[str, Module] | None) -> Module:
    name = op.attrs.get("module")
    callee = (modules or {}).get(name) if isinstance(name, str) else None
    if callee is None or callee.forward is None:
        raise KilnError(f"op {op.type!r} calls module {name!r}, which was not given to run_graph",
                        code="E002",
                        hint="pass modules={name: Module} (e.g. a Bundle's modules)")
    return callee


def _layers(op: Op, callee: Module, binds: Mapping[str, int]) -> tuple[str, range, dict[str, int]]:
    """The stack a call runs (its parameter prefix), the indices of its layers, the block's bindings."""
    first = int(op.attrs.get("first", 0))
    n_layers = parse_dim(op.attrs["n_layers"]).evaluate(binds)
    return (str(op.attrs.get("params", "blocks")), range(first, first + n_layers),
            {**binds, **dim_bindings(callee.config)})


def _layer_envs(op: Op, callee: Module, ins: list[Any], env: Mapping[str, Any], registry: OpRegistry,
                binds: Mapping[str, int], float_dtype: Any,
                modules: Mapping[str, Module]) -> tuple[list[dict[str, Any]], list[Any]]:
    """Run the block once per layer; returns each layer's environment and the last layer's carry."""
    g = callee.forward
    assert g is not None
    prefix, layers, sub_binds = _layers(op, callee, binds)
    carry, envs = list(ins), []
    for i in layers:
        layer = {d.name: v for d, v in zip(g.inputs, carry, strict=True)}
        for d in g.params:
            key = f"{prefix}.{i}.{d.name}"
            if key not in env:
                raise KilnError(f"layer {i} of {callee.name!r} needs parameter {key!r}, which has no value",
                                code="E002")
            layer[d.name] = env[key]
        out = run_graph(g, layer, registry=registry, bindings=sub_binds, float_dtype=float_dtype,
                        modules=modules)
        envs.append(out)
        carry[:len(g.outputs)] = [out[d.name] for d in g.outputs]
    return envs, carry


def _call(op: Op, callee: Module, ins: list[Any], env: Mapping[str, Any], registry: OpRegistry,
          binds: Mapping[str, int], float_dtype: Any, modules: Mapping[str, Module]) -> tuple[Any, ...]:
    assert callee.forward is not None
    _, carry = _layer_envs(op, callee, ins, env, registry, binds, float_dtype, modules)
    return tuple(carry[:len(callee.forward.outputs)])


def _call_backward(op: Op, callee: Module, ins: list[Any], env: Mapping[str, Any], registry: OpRegistry,
                   binds: Mapping[str, int], float_dtype: Any,
                   modules: Mapping[str, Module]) -> tuple[Any, ...]:
    from kiln.core.autodiff._autodiff import DeriveBackwardOptions, block_backward

    g = callee.forward
    assert g is not None
    n_out, n_in = len(g.outputs), len(g.inputs)
    prefix, layers, sub_binds = _layers(op, callee, binds)
    envs, _ = _layer_envs(op, callee, ins[n_out:], env, registry, binds, float_dtype, modules)
    res = block_backward(callee, DeriveBackwardOptions(), registry, modules)
    p = str(res.backward.metadata.get("grad_prefix", "d_"))
    grads = dict(res.grads)
    fed = {d.name for d in res.backward.inputs}
    d_carry: list[Any] = list(ins[:n_out])
    d_rest: list[Any] = [None] * (n_in - n_out)  # inputs passed to every layer: their gradients add up
    d_params: dict[str, Any] = {}
    for i in reversed(range(len(envs))):
        layer = {**envs[i], **{f"saved.{k}": v for k, v in envs[i].items()}}  # the stack's layers[i]
        layer.update({p + d.name: dc for d, dc in zip(g.outputs, d_carry, strict=True) if p + d.name in fed})
        out = run_graph(res.backward, layer, registry=registry, bindings=sub_binds, float_dtype=float_dtype,
                        modules=modules)
        for d in g.params:
            if d.name in grads:
                d_params[f"{prefix}.{layers[i]}.{d.name}"] = out[grads[d.name]]
        d_in = [out.get(grads[d.name]) if d.name in grads else None for d in g.inputs]
        d_carry = [dc if dc is not None else np.zeros_like(envs[i][d.name])
                   for d, dc in zip(g.inputs[:n_out], d_in[:n_out], strict=True)]
        d_rest = [r if dc is None else (dc if r is None else r + dc)
                  for r, dc in zip(d_rest, d_in[n_out:], strict=True)]
    d_inputs = [*d_carry, *d_rest]
    return (*[d if name else None for d, name in zip(d_inputs, op.outputs, strict=False)], d_params)
