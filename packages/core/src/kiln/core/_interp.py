"""A direct interpreter of graphs on the ops' NumPy reference kernels.

This is the numerical oracle the planned NumPy backend is checked against: no planning, one
fresh array per tensor. ``saved.x`` reads ``x``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kiln.core._dims import Const, Sym
from kiln.core._errors import KilnError
from kiln.core._ir import Graph, TensorDecl
from kiln.core._ops import OpRegistry


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
              bindings: Mapping[str, int] | None = None,
              float_dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """Run every op of ``graph`` in order; returns all tensors by name (inputs included)."""
    if registry is None:
        from kiln.core._oplib import op_registry

        registry = op_registry()
    env: dict[str, Any] = dict(values)
    binds = bind_dims((*graph.inputs, *graph.params), env, bindings)
    for op in graph.ops:
        opdef = registry.get_op(op.type)
        ins: list[np.ndarray | None] = []
        for name in op.inputs:
            if not name:
                ins.append(None)
                continue
            key = name if name in env else name.removeprefix("saved.")
            if key not in env:
                raise KilnError(f"op {op.type!r} reads {name!r}, which has no value", code="E002")
            ins.append(env[key])
        outs = opdef.run(ins, op.attrs, binds, float_dtype)
        if len(outs) != len(op.outputs):
            raise KilnError(f"op {op.type!r} returned {len(outs)} outputs, the graph names {len(op.outputs)}")
        env.update(zip(op.outputs, outs, strict=True))
    return env
