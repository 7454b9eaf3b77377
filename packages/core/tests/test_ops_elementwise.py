"""Forward semantics of the elementwise, activation, reduction, creation and dropout ops, checked
against closed forms and naive loops (the gradients are covered by the generic registry check)."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest

from kiln.core._errors import OpError
from kiln.core.autodiff._gradcheck import check_op
from kiln.core.ir._ir import TensorType
from kiln.core.ops._ops import InferContext, OpRegistry
from kiln.core.ops.library import _elementwise, _linalg

OPS = {o.name: o for o in _elementwise.OPS}


def run(name: str, *inputs: Any, **attrs: Any) -> Any:
    outs = OPS[name].run([None if x is None else np.asarray(x) for x in inputs], attrs)
    return outs[0] if len(outs) == 1 else outs


def infer(name: str, *shapes: Any, **attrs: Any) -> list[TensorType]:
    op = OPS[name]
    types = [TensorType(s, "fp32") for s in shapes]
    return list(op.infer(InferContext(name, types, op.resolve_attrs(attrs))))


def sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


@pytest.fixture(scope="module")
def registry() -> OpRegistry:
    r = OpRegistry()
    for m in (_linalg, _elementwise):
        for o in m.OPS:
            r.register_op(o)
    return r


# ---------------------------------------------------------------------------------------------
# Arithmetic and broadcasting


def test_add_mul_broadcast_like_numpy_loops() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 3, 4)), rng.standard_normal((3, 1))
    s, p = run("add", a, b), run("mul", a, b)
    for i, j, k in itertools.product(range(2), range(3), range(4)):
        assert s[i, j, k] == a[i, j, k] + b[j, 0]
        assert p[i, j, k] == a[i, j, k] * b[j, 0]


@pytest.mark.parametrize(("a", "b"), [((3, 4), (4, 4)), ((3, 2), (3, 4)), ((2, 3, 4), (3, 1, 5)),
                                      (("B", "T"), ("T", "B"))])
def test_add_rejects_shapes_that_do_not_broadcast(a: Any, b: Any) -> None:
    with pytest.raises(OpError) as err:
        infer("add", a, b)
    assert err.value.code == "E004" and err.value.op == "add"
    for shape in (a, b):  # the message names both shapes
        assert f"[{', '.join(map(str, shape))}]" in err.value.message


def test_symbolic_broadcast_shapes() -> None:
    btc = infer("mul", ("B", "T", "C"), ("C",))[0].shape
    assert btc == infer("add", ("B", "T", "C"), (1, "T", 1))[0].shape
    assert [str(d) for d in btc] == ["B", "T", "C"]
    assert [str(d) for d in infer("bias_add", ("B", "C"), ("C",))[0].shape] == ["B", "C"]
    with pytest.raises(OpError):
        infer("bias_add", ("B", "C"), ("D",))


def test_scale_and_bias_add() -> None:
    x = np.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(run("scale", x, factor=0.5), [[0, 0.5, 1], [1.5, 2, 2.5]])
    y = run("bias_add", x, np.array([10.0, 20.0, 30.0]))
    np.testing.assert_array_equal(y, [[10, 21, 32], [13, 24, 35]])


def test_broadcast_to_with_and_without_new_axes() -> None:
    x = np.array([[1.0, 2.0], [3.0, 4.0]])
    y = run("broadcast_to", x, shape=(2, 3, 2), axes=(1,))
    for i, j, k in itertools.product(range(2), range(3), range(2)):
        assert y[i, j, k] == x[i, k]
    y = run("broadcast_to", x, shape=(3, 2, 2))
    assert all((y[i] == x).all() for i in range(3))
    assert [str(d) for d in infer("broadcast_to", ("T",), shape=("B", "T"))[0].shape] == ["B", "T"]
    with pytest.raises(OpError):
        infer("broadcast_to", (2, 2), shape=(2, 3, 2), axes=(0, 1))


# ---------------------------------------------------------------------------------------------
# Activations


POINTS = [-30.0, -3.0, -1.0, -0.25, 0.0, 0.5, 1.0, 2.5, 30.0]


def test_silu_relu_relu2_closed_forms() -> None:
    x = np.array(POINTS)
    np.testing.assert_allclose(run("silu", x), [v * sigmoid(v) for v in POINTS], rtol=1e-15, atol=1e-300)
    np.testing.assert_array_equal(run("relu", x), [max(v, 0.0) for v in POINTS])
    np.testing.assert_array_equal(run("relu2", x), [max(v, 0.0) ** 2 for v in POINTS])
    d = np.full(x.shape, 3.0)
    np.testing.assert_array_equal(run("relu_backward", d, x), [3.0 if v > 0 else 0.0 for v in POINTS])
    np.testing.assert_array_equal(run("relu2_backward", d, x), [6.0 * max(v, 0.0) for v in POINTS])


def test_silu_extreme_inputs_stay_finite() -> None:
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        y = run("silu", np.array([-1000.0, 1000.0]))
        g = run("silu_backward", np.ones(2), np.array([-1000.0, 1000.0]))
    np.testing.assert_array_equal(y, [-0.0, 1000.0])
    np.testing.assert_array_equal(g, [0.0, 1.0])


def test_gelu_exact_and_tanh_at_known_points() -> None:
    x = np.array([-1.0, 0.0, 1.0])
    # x * Phi(x) with Phi(1) = 0.8413447460685429 (standard normal table)
    np.testing.assert_allclose(run("gelu", x, approximate="none"),
                               [-0.15865525393145707, 0.0, 0.8413447460685429], rtol=1e-15)
    k = math.sqrt(2 / math.pi) * (1 + 0.044715)
    np.testing.assert_allclose(run("gelu", x), [-0.5 * (1 - math.tanh(k)), 0.0, 0.5 * (1 + math.tanh(k))],
                               rtol=1e-15)
    grid = np.linspace(-6, 6, 1201)
    diff = np.abs(run("gelu", grid, approximate="tanh") - run("gelu", grid, approximate="none"))
    assert 1e-4 < diff.max() < 5e-4  # the tanh form is an approximation, and a close one


def test_swiglu_layout_is_gate_then_up() -> None:
    rng = np.random.default_rng(1)
    gate, up = rng.standard_normal((2, 3)), rng.standard_normal((2, 3))
    x = np.concatenate([gate, up], axis=-1)
    y = run("swiglu", x)
    assert y.shape == (2, 3)
    for i, j in itertools.product(range(2), range(3)):
        assert y[i, j] == pytest.approx(gate[i, j] * sigmoid(gate[i, j]) * up[i, j], rel=1e-14)
    np.testing.assert_array_equal(y, run("silu_mul", gate, up))
    d = rng.standard_normal((2, 3))
    d_gate, d_up = run("silu_mul_backward", d, gate, up)
    np.testing.assert_array_equal(run("swiglu_backward", d, x), np.concatenate([d_gate, d_up], axis=-1))


def test_swiglu_shapes() -> None:
    assert [str(d) for d in infer("swiglu", ("B", "2 * F"))[0].shape] == ["B", "F"]
    assert infer("swiglu", (3, 8))[0].shape == infer("silu", (3, 4))[0].shape
    with pytest.raises(OpError, match="even"):
        infer("swiglu", (3, 7))


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_softmax_matches_a_naive_loop(axis: int) -> None:
    x = np.random.default_rng(2).standard_normal((2, 3, 4)) * 3
    y = run("softmax", x, axis=axis)
    ax = axis % 3
    np.testing.assert_allclose(y.sum(axis=ax), 1.0, rtol=1e-14)
    for idx in itertools.product(*(range(n) for k, n in enumerate(x.shape) if k != ax)):
        line = [x[(*idx[:ax], m, *idx[ax:])] for m in range(x.shape[ax])]
        total = sum(math.exp(v) for v in line)
        for m, v in enumerate(line):
            assert y[(*idx[:ax], m, *idx[ax:])] == pytest.approx(math.exp(v) / total, rel=1e-13)


def test_softmax_is_stable_for_large_logits() -> None:
    y = run("softmax", np.array([[1000.0, 1000.0, -1000.0]]))
    np.testing.assert_allclose(y, [[0.5, 0.5, 0.0]])
    with pytest.raises(OpError):
        infer("softmax", (2, 3), axis=2)


# ---------------------------------------------------------------------------------------------
# Reductions


def test_reductions_match_python_sums() -> None:
    x = np.arange(24.0).reshape(2, 3, 4) ** 1.5
    s = run("reduce_sum", x, axes=(0, 2))
    m = run("reduce_mean", x, axes=(-1,), keepdims=True)
    mx = run("reduce_max", x * np.cos(x), axes=(1,))
    assert s.shape == (3,) and m.shape == (2, 3, 1) and mx.shape == (2, 4)
    for j in range(3):
        assert s[j] == pytest.approx(sum(x[i, j, k] for i in range(2) for k in range(4)), rel=1e-15)
    for i, j in itertools.product(range(2), range(3)):
        assert m[i, j, 0] == pytest.approx(sum(x[i, j, k] for k in range(4)) / 4, rel=1e-15)
    for i, k in itertools.product(range(2), range(4)):
        assert mx[i, k] == max(x[i, j, k] * math.cos(x[i, j, k]) for j in range(3))
    assert run("reduce_sum", x, axes=(0, 1, 2)).shape == ()


def test_reduction_shapes_and_axis_errors() -> None:
    assert [str(d) for d in infer("reduce_sum", ("B", "T", "C"), axes=(0, 1))[0].shape] == ["C"]
    assert [str(d) for d in infer("reduce_max", ("B", "T"), axes=(-1,), keepdims=True)[0].shape] == ["B", "1"]
    for axes in ((), (3,), (0, -3)):
        with pytest.raises(OpError) as err:
            infer("reduce_mean", (2, 3, 4), axes=axes)
        assert err.value.code == "E004"
    with pytest.raises(OpError, match="missing required attribute 'axes'"):
        infer("reduce_sum", (2, 3))


def test_reduce_max_backward_routes_to_the_argmax() -> None:
    x = np.array([[1.0, 5.0, 2.0], [7.0, 0.0, 7.0]])
    y = run("reduce_max", x, axes=(1,))
    g = run("reduce_max_backward", np.array([10.0, 4.0]), x, y, axes=(1,), keepdims=False)
    np.testing.assert_array_equal(g, [[0.0, 10.0, 0.0], [2.0, 0.0, 2.0]])  # ties share evenly


def test_reduce_mean_backward_spreads_evenly() -> None:
    g = run("reduce_mean_backward", np.array([6.0, 12.0]), shape=(2, 3), axes=(1,), keepdims=False)
    np.testing.assert_array_equal(g, [[2.0, 2.0, 2.0], [4.0, 4.0, 4.0]])


def test_matmul_bias_backward_reduce_sum_is_valid(registry: OpRegistry) -> None:
    assert max(r.max_rel_error for r in check_op(registry.get_op("matmul_bias"), registry)) < 1e-6


# ---------------------------------------------------------------------------------------------
# Creation


def test_creation_ops() -> None:
    np.testing.assert_array_equal(run("zeros", shape=(2, 3)), np.zeros((2, 3)))
    np.testing.assert_array_equal(run("ones", shape=(4,)), np.ones(4))
    f = run("fill", shape=(2, 2), value=0.5)
    np.testing.assert_array_equal(f, np.full((2, 2), 0.5))
    assert f.dtype == np.float64  # float dtypes compute in the run's float dtype
    assert run("zeros", shape=(3,), dtype="int32").dtype == np.int32
    t = infer("fill", shape=("B", "T"), value=1.0, dtype="bf16")[0]
    assert t.dtype == "bf16" and [str(d) for d in t.shape] == ["B", "T"]
    z = run("zeros_like", np.ones((2, 3), np.float32))
    assert z.dtype == np.float32 and not z.any()
    with pytest.raises(OpError, match="missing required attribute 'shape'"):
        infer("ones")


# ---------------------------------------------------------------------------------------------
# Dropout


def test_dropout_keep_fraction_and_scaling() -> None:
    x = np.ones(200_000)
    for p in (0.1, 0.5, 0.9):
        y = run("dropout", x, p=p, seed=3)
        kept = y != 0
        assert abs(kept.mean() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / x.size)
        np.testing.assert_allclose(y[kept], 1 / (1 - p), rtol=1e-15)
    u = _elementwise.dropout_uniform(11, 0, 100_000)
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.005
    np.testing.assert_allclose(np.histogram(u, bins=10, range=(0, 1))[0] / u.size, 0.1, atol=0.005)


def test_dropout_replays_bit_for_bit_and_depends_only_on_the_counter() -> None:
    x = np.random.default_rng(4).standard_normal((64, 33))
    y = run("dropout", x, p=0.3, seed=42, offset=5)
    run("dropout", x, p=0.3, seed=7)  # other calls in between change nothing
    assert run("dropout", x, p=0.3, seed=42, offset=5).tobytes() == y.tobytes()
    # element j of the flat tensor uses counter offset + j, whatever slice it is drawn in
    flat = x.reshape(-1)
    tail = run("dropout", flat[100:], p=0.3, seed=42, offset=105)
    assert tail.tobytes() == y.reshape(-1)[100:].tobytes()
    keys = ((42, 5), (42, 6), (42, 5000), (43, 5))
    masks = [run("dropout", x, p=0.3, seed=s, offset=o) != 0 for s, o in keys]
    for a, b in itertools.combinations(masks, 2):
        assert (a != b).mean() > 0.3  # independent masks disagree on 2 p (1 - p) = 42% of elements


def test_dropout_p0_is_identity_and_p_is_checked() -> None:
    x = np.random.default_rng(5).standard_normal((3, 4))
    np.testing.assert_array_equal(run("dropout", x, p=0.0, seed=1), x)
    for p in (-0.1, 1.0):
        with pytest.raises(OpError):
            infer("dropout", (3, 4), p=p, seed=1)
    assert OPS["dropout"].random


# ---------------------------------------------------------------------------------------------
# Dtypes


def test_kernels_keep_float32() -> None:
    rng = np.random.default_rng(6)
    for op in _elementwise.OPS:
        if op.samples is None:
            continue
        for sample in op.samples(rng):
            ins = [x.astype(np.float32) if x is not None and x.dtype == np.float64 else x
                   for x in sample.inputs]
            for out in op.run(ins, sample.attrs, float_dtype=np.float32):
                assert out.dtype in (np.float32, np.int32), (op.name, sample.attrs, out.dtype)
    x32 = rng.standard_normal((2, 6)).astype(np.float32)
    backward_calls = {
        "silu_backward": (x32, x32), "relu_backward": (x32, x32), "relu2_backward": (x32, x32),
        "gelu_backward": (x32, x32), "softmax_backward": (x32, x32), "silu_mul_backward": (x32, x32, x32),
        "swiglu_backward": (x32[:, :3], x32),
    }
    for name, args in backward_calls.items():
        for approximate in ("tanh", "none") if name == "gelu_backward" else (None,):
            attrs = {"approximate": approximate} if approximate else {}
            outs = OPS[name].run(list(args), attrs, float_dtype=np.float32)
            assert all(o.dtype == np.float32 for o in outs), name
    assert run("gelu", x32, approximate="none").dtype == np.float32
    g = run("reduce_max_backward", x32[:, 0], x32, x32.max(1), axes=(1,), keepdims=False)
    assert g.dtype == np.float32
    assert run("reduce_mean_backward", x32[:, 0], shape=(2, 6), axes=(1,), keepdims=False).dtype == np.float32


def test_every_rule_passes_the_gradient_check(registry: OpRegistry) -> None:
    for op in _elementwise.OPS:
        if op.backward is not None:
            reports = check_op(op, registry)
            assert max((r.max_rel_error for r in reports), default=0.0) < 1e-7, op.name
