"""Checks an op's backward rule (and shape rule) against float64 central finite differences.

The generic test walks the op registry and calls :func:`check_op` on every op with a rule, so a
newly registered op is covered by being registered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import attrs
import numpy as np

from kiln.core._errors import KilnError
from kiln.core.autodiff._interp import run_graph
from kiln.core.ir._dims import evaluate_shape
from kiln.core.ir._ir import Graph, Op, TensorDecl, TensorType
from kiln.core.ops._ops import BackwardContext, InferContext, OpDef, OpRegistry, Sample


@attrs.frozen
class GradReport:
    op: str
    sample: int
    attrs: dict[str, Any]
    input: str
    max_rel_error: float


def central_differences(f: Callable[[np.ndarray], float], x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """d f / d x by central differences, one element at a time (float64)."""
    out = np.zeros(x.size)
    for j in range(x.size):
        xp, xm = x.copy(), x.copy()
        xp.reshape(-1)[j] += eps
        xm.reshape(-1)[j] -= eps
        out[j] = (f(xp) - f(xm)) / (2 * eps)
    return out.reshape(x.shape)


def max_rel_error(grad: np.ndarray, reference: np.ndarray) -> float:
    """Largest absolute difference, relative to the largest reference entry."""
    scale = max(float(np.max(np.abs(reference), initial=0.0)), 1e-8)
    return float(np.max(np.abs(grad - reference), initial=0.0)) / scale


def _decl(name: str, arr: np.ndarray) -> TensorDecl:
    dtype = "fp32" if np.issubdtype(arr.dtype, np.floating) else "int32"
    return TensorDecl(name, list(arr.shape), dtype)


def check_sample(opdef: OpDef, sample: Sample, registry: OpRegistry, *, index: int = 0, eps: float = 1e-6,
                 rng: np.random.Generator | None = None) -> Iterator[GradReport]:
    """Compare the rule's gradients with finite differences on one sample; yields one report per input."""
    rng = rng or np.random.default_rng(index)
    inputs = [None if x is None else np.asarray(x) for x in sample.inputs]
    names = [f"in{i}" if x is not None else "" for i, x in enumerate(inputs)]
    outs = opdef.run(inputs, sample.attrs)
    resolved = opdef.resolve_attrs(sample.attrs)

    # The shape rule must agree with what the kernel really produced.
    in_types = [None if x is None else _decl("x", x).type for x in inputs]
    inferred = opdef.infer(InferContext(opdef.name, in_types, resolved))
    for k, (t, arr) in enumerate(zip(inferred, outs, strict=True)):
        if evaluate_shape(t.shape, {}) != arr.shape:
            raise KilnError(f"op {opdef.name!r}: shape rule says output {k} is {t}, kernel made {arr.shape}")

    float_out = [np.issubdtype(o.dtype, np.floating) for o in outs]
    cots = [rng.standard_normal(o.shape) if f else None for o, f in zip(outs, float_out, strict=True)]

    def loss(xs: list[np.ndarray | None]) -> float:
        ys = opdef.run(xs, sample.attrs)
        return float(sum(np.sum(c * y) for c, y in zip(cots, ys, strict=True) if c is not None))

    checked = sample.check if sample.check is not None else tuple(
        i for i, x in enumerate(inputs) if x is not None and np.issubdtype(x.dtype, np.floating)
        and i not in opdef.nondiff_inputs)
    out_names = [f"out{k}" for k in range(len(outs))]
    types: dict[str, TensorType] = {
        n: _decl(n, x).type for n, x in zip(names, inputs, strict=True) if x is not None
    }
    types.update({n: TensorType(t.shape, t.dtype) for n, t in zip(out_names, inferred, strict=True)})
    counter = iter(range(10**9))
    assert opdef.backward is not None
    ctx = BackwardContext(
        Op(opdef.name, names, out_names, sample.attrs), opdef, resolved,
        [f"d_out{k}" if f else None for k, f in enumerate(float_out)],
        [i in checked for i in range(len(inputs))], types, frozenset(), frozenset(n for n in names if n),
        registry, lambda base: f"t{next(counter)}.{base}")
    grads = list(opdef.backward(ctx))
    if len(grads) != len(inputs):
        raise KilnError(
            f"op {opdef.name!r}: backward rule returned {len(grads)} gradients for {len(inputs)} inputs"
        )
    env: dict[str, Any] = {n: x for n, x in zip(names, inputs, strict=True) if n}
    env.update(zip(out_names, outs, strict=True))
    env.update({f"d_out{k}": c for k, c in enumerate(cots) if c is not None})
    env = run_graph(Graph("backward", ops=ctx.emitted), env, registry=registry, float_dtype=np.float64)

    for i in checked:
        grad, x = grads[i], inputs[i]
        if grad is None:
            raise KilnError(f"op {opdef.name!r}: backward rule gives no gradient for input {i}")
        assert x is not None
        g = np.broadcast_to(env[grad], x.shape)

        def loss_of(xi: np.ndarray, i: int = i) -> float:
            return loss([xi if k == i else v for k, v in enumerate(inputs)])

        fd = central_differences(loss_of, x, eps)
        err = max_rel_error(g, fd)
        yield GradReport(opdef.name, index, dict(sample.attrs), opdef.inputs[i] if i < len(opdef.inputs)
                         else f"input {i}", err)


def check_op(opdef: OpDef, registry: OpRegistry, *, seed: int = 0) -> list[GradReport]:
    """Every sample of ``opdef`` through :func:`check_sample`; raises if the op has no samples."""
    if opdef.samples is None:
        raise KilnError(f"op {opdef.name!r} has a backward rule but no samples for the gradient check",
                        hint="give its OpDef samples=... (a function of a numpy Generator)")
    rng = np.random.default_rng(seed)
    return [r for k, s in enumerate(opdef.samples(rng))
            for r in check_sample(opdef, s, registry, index=k, rng=rng)]
