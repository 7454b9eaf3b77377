"""Forward semantics of ``exp``, ``sigmoid``, ``reciprocal`` and ``div`` (their gradients are checked by
the generic registry harness, which picks up their samples)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kiln.core import get_registry, op_registry
from kiln.core._errors import OpError
from kiln.core.autodiff import DeriveBackwardOptions, derive_backward, verify_backward
from kiln.core.ir import Graph, Op, TensorDecl
from kiln.core.ir._ir import TensorType
from kiln.core.ops._ops import InferContext
from kiln.core.ops.library import _math

OPS = {o.name: o for o in _math.OPS}


def run(name: str, *inputs: Any) -> Any:
    (out,) = OPS[name].run([np.asarray(x) for x in inputs], {})
    return out


def infer(name: str, *shapes: Any) -> list[TensorType]:
    types = [TensorType(s, "fp32") for s in shapes]
    return list(OPS[name].infer(InferContext(name, types, {})))


def test_the_ops_are_registered_with_rules() -> None:
    registry = op_registry()
    for name in ("exp", "sigmoid", "reciprocal", "div"):
        assert registry[name].backward is not None and registry[name].samples is not None, name
    assert "sigmoid_backward" in registry


def test_forward_values() -> None:
    x = np.array([[-2.0, -0.5, 0.25, 3.0]])
    np.testing.assert_allclose(run("exp", x), np.exp(x))
    np.testing.assert_allclose(run("reciprocal", x), 1 / x)
    np.testing.assert_allclose(run("sigmoid", x), 1 / (1 + np.exp(-x)), rtol=1e-15)
    np.testing.assert_allclose(run("div", x, x[:, ::-1]), x / x[:, ::-1])
    np.testing.assert_allclose(run("sigmoid_backward", np.ones_like(x), run("sigmoid", x)),
                               np.exp(-x) / (1 + np.exp(-x)) ** 2, rtol=1e-14)


def test_sigmoid_does_not_overflow() -> None:
    with np.errstate(over="raise"):
        out = run("sigmoid", np.array([-1000.0, 0.0, 1000.0], np.float32))
    np.testing.assert_array_equal(out, [0.0, 0.5, 1.0])


@pytest.mark.parametrize("name", ["exp", "sigmoid", "reciprocal"])
def test_kernels_compute_in_the_input_dtype(name: str) -> None:
    x = np.array([0.5, -1.5, 2.0], np.float32)
    assert run(name, x).dtype == np.float32
    assert run(name, x.astype(np.float64)).dtype == np.float64


def test_div_broadcasts_like_add() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 3, 4)), rng.uniform(1.0, 2.0, (3, 1))
    np.testing.assert_allclose(run("div", a, b), a / b)
    assert run("div", a.astype(np.float32), b.astype(np.float32)).dtype == np.float32
    assert infer("div", ["N", "S", "S"], ["N", 1, "S"]) == [TensorType(["N", "S", "S"], "fp32")]
    assert infer("div", ["N", "C"], ["C"]) == [TensorType(["N", "C"], "fp32")]
    with pytest.raises(OpError, match="broadcast"):
        infer("div", ["N", "C"], ["N"])


@pytest.mark.parametrize("name", ["exp", "sigmoid", "reciprocal", "div"])
def test_out_kernels_match_the_reference_kernels_in_place(name: str) -> None:
    rng = np.random.default_rng(1)
    op = OPS[name]
    for sample in op.samples(rng):  # type: ignore[misc]
        ref = op.kernel(*sample.inputs)
        if ref.shape != sample.inputs[0].shape:
            continue  # a broadcast first input is too small to write the result over
        first = sample.inputs[0].copy()
        kernel = get_registry("kernels").find(name, "numpy", "float64")
        assert kernel is not None and kernel.inplace == {0}
        kernel.fn(first, *sample.inputs[1:], out=(first,))  # writes over its input
        np.testing.assert_array_equal(first, ref)


def test_sinkhorn_normalisation_differentiates() -> None:
    """Row and column sums divided out, as the Hyper-Connection block's Sinkhorn steps do."""
    graph = Graph(
        "sinkhorn",
        inputs=[TensorDecl("x", ["N", "S", "S"], "fp32")],
        params=[TensorDecl("w", ["S", "S"], "fp32")],
        ops=[
            Op("mul", ["x", "w"], ["xw"]),
            Op("exp", ["xw"], ["e"]),
            Op("reduce_sum", ["e"], ["cols"], {"axes": [1], "keepdims": True}),
            Op("div", ["e", "cols"], ["m"]),
            Op("reduce_sum", ["m"], ["rows"], {"axes": [2], "keepdims": True}),
            Op("reciprocal", ["rows"], ["inv"]),
            Op("mul", ["m", "inv"], ["p"]),
            Op("sigmoid", ["p"], ["loss"]),
        ],
        outputs=[TensorDecl("loss", ["N", "S", "S"], "fp32")],
    )
    result = derive_backward(graph, DeriveBackwardOptions())
    assert {op.type for op in result.backward.ops} >= {"div", "sigmoid_backward"}
    errors = verify_backward(graph, result.backward, bindings={"N": 2, "S": 3})
    assert errors["w"] < 1e-7, errors
