"""Shape inference: what a shape rule sees (:class:`InferContext`) and the types of a whole graph.

The op registry is an argument (any object with ``get_op`` and ``in``), so the IR layer needs no op
layer: the registry comes from the caller, or from the current plugin session.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kiln.core._errors import KilnError, OpError
from kiln.core.ir._dims import Shape, parse_shape
from kiln.core.ir._ir import Graph, TensorType

__all__ = ["InferContext", "infer_types"]


class InferContext:
    """What a shape rule sees: symbolic input types (``None`` for an omitted optional input) and attrs."""

    def __init__(self, op: str, inputs: Sequence[TensorType | None], attrs: Mapping[str, Any]) -> None:
        self.op = op
        self.inputs = tuple(inputs)
        self.attrs = attrs

    def fail(self, message: str) -> OpError:
        return OpError(f"op {self.op!r}: {message}", op=self.op, code="E004")

    def shape(self, i: int) -> Shape:
        t = self.inputs[i]
        if t is None:
            raise self.fail(f"input {i} is required")
        return t.shape

    def dtype(self, i: int) -> str:
        t = self.inputs[i]
        if t is None:
            raise self.fail(f"input {i} is required")
        return t.dtype

    def dims(self, name: str) -> Shape:
        return parse_shape(self.attrs[name])


def infer_types(graph: Graph, registry: Any, *, strict: bool = False) -> dict[str, TensorType]:
    """Symbolic types of every tensor of ``graph``: declarations first, then the shape rules.

    With ``strict`` a failing shape rule raises; otherwise the op's outputs are left untyped.
    """
    types: dict[str, TensorType] = {name: d.type for name, d in graph.decls().items()}
    for op in graph.ops:
        if op.type not in registry:
            continue
        opdef = registry.get_op(op.type)
        ins = [types.get(i, types.get(i.removeprefix("saved."))) if i else None for i in op.inputs]
        if any(t is None for t, i in zip(ins, op.inputs, strict=True) if i):
            continue
        try:
            out = opdef.infer(InferContext(op.type, ins, opdef.resolve_attrs(op.attrs)))
        except KilnError:
            if strict:
                raise
            continue
        for name, t in zip(op.outputs, out, strict=False):
            types.setdefault(name, t)
    return types
