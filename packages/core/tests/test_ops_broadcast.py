"""Broadcasting both ways (NumPy/torch rules) for add, mul, div and batched_matmul's batch dims: shapes from
``np.broadcast_shapes``, values from NumPy, gradients from float64 finite differences on samples built
here (not the ops' own samples), and shape errors that name both operands."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kiln.core import op_registry
from kiln.core._errors import OpError
from kiln.core.autodiff._gradcheck import check_sample
from kiln.core.ir import Const
from kiln.core.ir._ir import TensorType
from kiln.core.ops._ops import InferContext, Sample

REGISTRY = op_registry()
NUMPY = {"add": np.add, "mul": np.multiply, "div": np.divide}
BOTH_WAYS = [((4,), (3, 4)), ((3, 1), (3, 4)), ((2, 1, 4), (3, 1)), ((1,), (2, 3)), ((5, 1, 1), (1, 2, 3))]


def infer(name: str, *shapes: Any, **attrs: Any) -> list[TensorType]:
    op = REGISTRY[name]
    types = [TensorType(s, "fp32") for s in shapes]
    return list(op.infer(InferContext(name, types, op.resolve_attrs(attrs))))


def _worst(name: str, inputs: tuple[np.ndarray, ...], attrs: dict[str, Any]) -> float:
    reports = list(check_sample(REGISTRY[name], Sample(inputs, attrs), REGISTRY))
    assert len(reports) == len(inputs)
    return max(r.max_rel_error for r in reports)


@pytest.mark.parametrize("op", ["add", "mul", "div"])
@pytest.mark.parametrize(("a", "b"), BOTH_WAYS)
def test_binary_ops_broadcast_both_ways(op: str, a: tuple[int, ...], b: tuple[int, ...]) -> None:
    assert infer(op, a, b)[0].shape == tuple(Const(n) for n in np.broadcast_shapes(a, b))
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal(a), rng.uniform(0.5, 2.0, b) * rng.choice([-1.0, 1.0], b)
    (out,) = REGISTRY[op].run([x, y], {})
    np.testing.assert_array_equal(out, NUMPY[op](x, y))
    assert _worst(op, (x, y), {}) <= 1e-6  # each gradient summed back over its broadcast dims
    assert _worst(op, (y, x), {}) <= 1e-6


def test_symbolic_dims_broadcast_against_ones() -> None:
    out = infer("add", (1, "T", 1), ("B", 1, "C"))[0].shape
    assert [str(d) for d in out] == ["B", "T", "C"]
    assert [str(d) for d in infer("mul", ("C",), ("B", "T", "C"))[0].shape] == ["B", "T", "C"]


@pytest.mark.parametrize("op", ["add", "mul", "div"])
def test_shapes_that_do_not_broadcast_name_both(op: str) -> None:
    with pytest.raises(OpError) as err:
        infer(op, ("B", "T", 4), (3, 1))
    assert err.value.code == "E004" and err.value.op == op
    assert "[B, T, 4]" in err.value.message and "[3, 1]" in err.value.message


@pytest.mark.parametrize(("a", "b", "transpose"), [
    ((2, 1, 3, 4), (3, 4, 5), "NN"),
    ((3, 4), (2, 5, 4), "NT"),
    ((1, 2, 4, 3), (3, 1, 4, 5), "TN"),
    ((2, 3, 4), (1, 5, 4), "NT"),
])
def test_batched_matmul_broadcasts_batch_dims_like_torch(a: tuple[int, ...], b: tuple[int, ...],
                                                         transpose: str) -> None:
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal(a), rng.standard_normal(b)
    xs = np.swapaxes(x, -1, -2) if transpose[0] == "T" else x
    ys = np.swapaxes(y, -1, -2) if transpose[1] == "T" else y
    expected = np.matmul(xs, ys)  # NumPy's matmul broadcasts the batch dims as torch.matmul does
    shape = infer("batched_matmul", a, b, transpose=transpose)[0].shape
    assert shape == tuple(Const(n) for n in expected.shape)
    (out,) = REGISTRY["batched_matmul"].run([x, y], {"transpose": transpose})
    np.testing.assert_allclose(out, expected, rtol=1e-12)
    assert _worst("batched_matmul", (x, y), {"transpose": transpose}) <= 1e-6


def test_batched_matmul_batch_dims_that_do_not_broadcast_name_both_shapes() -> None:
    with pytest.raises(OpError) as err:
        infer("batched_matmul", ("H", 3, 4), (2, 4, 5))
    assert err.value.code == "E004"
    assert "[H, 3, 4]" in err.value.message and "[2, 4, 5]" in err.value.message


@pytest.mark.parity
def test_broadcast_gradients_match_torch_autograd() -> None:
    """add, mul, div and batched_matmul with both operands broadcast: results and both gradients as
    torch computes them (the derived rules, run through derive_backward, on one small graph)."""
    torch = pytest.importorskip("torch")
    from kiln.core.autodiff import DeriveBackwardOptions, derive_backward
    from kiln.core.autodiff._interp import run_graph
    from kiln.core.ir import Graph, Op, TensorDecl

    shapes = {"a": (2, 1, 3, 4), "b": (5, 4, 3), "c": (5, 1, 1), "d": (3, 1)}
    g = Graph("bcast", inputs=[TensorDecl(n, s, "fp32") for n, s in shapes.items()],
              ops=[Op("batched_matmul", ["a", "b"], ["ab"]),  # [2, 5, 3, 3]
                   Op("mul", ["c", "ab"], ["m"]),
                   Op("div", ["m", "d"], ["q"]),
                   Op("add", ["d", "q"], ["loss"])],
              outputs=[TensorDecl("loss", (2, 5, 3, 3), "fp32")])
    rng = np.random.default_rng(3)
    values = {n: rng.uniform(0.5, 1.5, s) for n, s in shapes.items()}
    seed = rng.standard_normal((2, 5, 3, 3))
    bwd = derive_backward(g, DeriveBackwardOptions()).backward
    fwd = run_graph(g, values, float_dtype=np.float64)
    env = run_graph(bwd, {**{f"saved.{k}": v for k, v in fwd.items()}, **values, "d_loss": seed},
                    float_dtype=np.float64)
    t = {n: torch.tensor(v, requires_grad=True) for n, v in values.items()}
    loss = t["d"] + (t["c"] * torch.matmul(t["a"], t["b"])) / t["d"]
    loss.backward(torch.tensor(seed))
    np.testing.assert_allclose(fwd["loss"], loss.detach().numpy(), rtol=1e-12)
    for n in shapes:
        np.testing.assert_allclose(env[f"d_{n}"], t[n].grad.numpy(), rtol=1e-10, err_msg=n)
