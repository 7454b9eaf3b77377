"""Forward semantics of the tensor-manipulation, embedding and loss ops against independent oracles."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

from kiln.core import KilnError, op_registry
from kiln.core.autodiff import derive_backward, verify_backward
from kiln.core.ir._dims import dims_equal, parse_dim
from kiln.core.ir._ir import Graph, Op, TensorDecl, TensorType
from kiln.core.ops._ops import InferContext, OpRegistry
from kiln.core.ops.library import register_core_ops

REG = OpRegistry()
register_core_ops(REG)


def run(op: str, *inputs: np.ndarray, **attrs: object) -> tuple[np.ndarray, ...]:
    return REG[op].run(inputs, attrs)


def infer(op: str, *inputs: tuple[list[object], str], **attrs: object) -> list[TensorType]:
    types = [TensorType(tuple(parse_dim(d) for d in shape), dtype) for shape, dtype in inputs]
    opdef = REG[op]
    return list(opdef.infer(InferContext(op, types, opdef.resolve_attrs(attrs))))


def same_dims(t: TensorType, expected: list[object]) -> bool:
    return len(t.shape) == len(expected) and all(map(dims_equal, t.shape, expected))


# --- tensor manipulation -------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["view", "reshape"])
@pytest.mark.parametrize(("shape", "expected"), [((6, 4), (6, 4)), ((4, -1, 2), (4, 3, 2)), ((-1,), (24,))])
def test_view_keeps_row_major_order_and_infers_minus_one(op: str, shape: tuple[int, ...],
                                                         expected: tuple[int, ...]) -> None:
    x = np.arange(24.0).reshape(2, 3, 4)
    (y,) = run(op, x, shape=shape)
    assert y.shape == expected
    assert list(y.flat) == list(range(24))
    (t,) = infer(op, ([2, 3, 4], "bf16"), shape=shape)
    assert t.dtype == "bf16" and same_dims(t, list(expected))


def test_view_shape_rule_is_symbolic() -> None:
    x = (["B", "T", "C"], "fp32")
    (t,) = infer("view", x, shape=["B * T", "C"])
    assert same_dims(t, ["T * B", "C"])
    (t,) = infer("view", x, shape=["B", -1])
    assert same_dims(t, ["B", "C * T"])
    (t,) = infer("view", x, shape=[-1, "C"])
    assert same_dims(t, ["B * T", "C"])
    (t,) = infer("view", (["B * T", "(Hq + 2 * Hkv) * D"], "fp32"), shape=["B", "T", -1, "D"])
    assert same_dims(t, ["B", "T", "Hq + 2 * Hkv", "D"])
    # (C // 2) * 2 equals C only for even C: not decidable, so accepted
    assert infer("view", x, shape=["B", "T", "C // 2", 2])


@pytest.mark.parametrize(("src", "shape"), [
    ([2, 3, 4], [5, 5]),
    ([2, 3, 4], [5, -1]),
    (["B", "T"], ["B * T + 1"]),
    (["B", 6], ["B", -1, -1]),
])
def test_view_of_a_provably_wrong_element_count_names_the_op(src: list[object], shape: list[object]) -> None:
    with pytest.raises(KilnError, match="'view'") as err:
        infer("view", (src, "fp32"), shape=shape)
    assert err.value.op == "view"  # type: ignore[attr-defined]


def test_transpose_and_permute_match_numpy_and_invert() -> None:
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 5))
    (y,) = run("transpose", x, dim0=1, dim1=-1)
    np.testing.assert_array_equal(y, np.swapaxes(x, 1, 3))
    (t,) = infer("transpose", (["B", "T", "H", "D"], "fp32"), dim0=1, dim1=2)
    assert same_dims(t, ["B", "H", "T", "D"])
    (y,) = run("permute", x, dims=(2, 0, 3, 1))
    assert y[1, 0, 4, 2] == x[0, 2, 1, 4]
    (back,) = run("permute", y, dims=tuple(int(i) for i in np.argsort((2, 0, 3, 1))))
    np.testing.assert_array_equal(back, x)
    (t,) = infer("permute", (["B", "T", "H", "D"], "fp32"), dims=(0, 2, 1, -1))
    assert same_dims(t, ["B", "H", "T", "D"])
    with pytest.raises(KilnError, match=r"'permute'.*not a permutation"):
        infer("permute", (["B", "T", "H"], "fp32"), dims=(0, 1, 1))
    with pytest.raises(KilnError, match=r"'transpose'.*out of range"):
        infer("transpose", (["B", "T"], "fp32"), dim0=0, dim1=2)


def test_split_slices_in_order_and_concat_restores() -> None:
    x = np.arange(3 * 7.0).reshape(3, 7)
    parts = run("split", x, sizes=(2, 4, 1))
    starts = [0, 2, 6]
    for p, s, n in zip(parts, starts, (2, 4, 1), strict=True):
        assert p.shape == (3, n)
        for i in range(3):
            for j in range(n):
                assert p[i, j] == x[i, s + j]
    (y,) = run("concat", *parts)
    np.testing.assert_array_equal(y, x)
    a, b = run("split", x, sizes=(1, 2), dim=0)
    np.testing.assert_array_equal(run("concat", a, b, dim=0)[0], x)
    with pytest.raises(KilnError, match="'split'"):
        run("split", x, sizes=(2, 2))


def test_split_and_concat_shape_rules_are_symbolic() -> None:
    qkv = (["B", "T", "(Hq + 2 * Hkv) * D"], "fp32")
    q, _, v = infer("split", qkv, sizes=["Hq * D", "Hkv * D", "Hkv * D"])
    assert same_dims(q, ["B", "T", "Hq * D"]) and same_dims(v, ["B", "T", "D * Hkv"])
    (t,) = infer("concat", (["B", "Hq * D"], "fp32"), (["B", "Hkv * D"], "fp32"), (["B", "Hkv * D"], "fp32"))
    assert same_dims(t, ["B", "(Hq + 2 * Hkv) * D"])
    assert len(infer("split", (["N", "X"], "fp32"), sizes=["Y", "Z"])) == 2  # undecidable: accepted
    with pytest.raises(KilnError, match=r"'split'.*sum to"):
        infer("split", (["B", "D + 1"], "fp32"), sizes=["D", 2])
    with pytest.raises(KilnError, match=r"'concat'.*outside dim"):
        infer("concat", (["B", "C"], "fp32"), (["T", "C"], "fp32"))


def test_split_backward_fills_parts_without_gradient_with_zeros() -> None:
    g = Graph("g", params=[TensorDecl("w", ["N", "C"], "fp32")],
              ops=[Op("split", ["w"], ["a", "b", "c"], {"sizes": [1, "C - 3", 2]}),
                   Op("concat", ["c", "a"], ["ca"]),
                   Op("reduce_sum", ["ca"], ["loss"], {"axes": [1]})],
              outputs=[TensorDecl("loss", ["N"], "fp32")])
    res = derive_backward(g, registry=REG)
    assert [op.type for op in res.backward.ops].count("zeros") == 1
    assert verify_backward(g, bindings={"N": 3, "C": 6}, registry=REG)["w"] <= 1e-6


@pytest.mark.parametrize("op", ["view", "transpose", "split", "copy", "contiguous"])
def test_outputs_never_alias_the_input(op: str) -> None:
    x = np.zeros((4, 6))
    attrs = {"view": {"shape": (24,)}, "transpose": {"dim0": 0, "dim1": 1}, "split": {"sizes": (6,)}}
    (y,) = run(op, x, **attrs.get(op, {}))
    assert not np.shares_memory(x, y) and y.flags.c_contiguous


# --- embedding -----------------------------------------------------------------------------------


def test_embedding_gathers_rows_and_scatter_adds_repeated_ids() -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((5, 3))
    ids = np.array([[4, 1, 1], [0, 4, 1]])
    (out,) = run("embedding", ids, w)
    assert out.shape == (2, 3, 3)
    for i in range(2):
        for j in range(3):
            np.testing.assert_array_equal(out[i, j], w[ids[i, j]])
    d = rng.standard_normal((2, 3, 3))
    (dw,) = run("embedding_backward", d, ids, num_embeddings=5)
    expected = np.zeros((5, 3))
    for i in range(2):
        for j in range(3):
            expected[ids[i, j]] += d[i, j]
    np.testing.assert_allclose(dw, expected, rtol=0, atol=1e-15)
    np.testing.assert_allclose(dw[1], d[0, 1] + d[0, 2] + d[1, 2])
    assert not dw[2].any() and not dw[3].any()
    (t,) = infer("embedding", (["B", "T"], "int32"), (["V", "C"], "bf16"))
    assert same_dims(t, ["B", "T", "C"]) and t.dtype == "bf16"
    with pytest.raises(KilnError, match=r"'embedding'.*integer"):
        infer("embedding", (["B", "T"], "fp32"), (["V", "C"], "fp32"))
    with pytest.raises(KilnError, match=r"'embedding'.*index 5"):
        run("embedding", np.array([0, 5]), w)


# --- losses --------------------------------------------------------------------------------------


def naive_cross_entropy(logits: np.ndarray, targets: np.ndarray,
                        ignore: int = -100) -> tuple[list[float], list[float]]:
    """Per-row loss and lse with plain Python floats, one row at a time."""
    loss, lse = [], []
    for row, t in zip(logits.tolist(), targets.tolist(), strict=True):
        top = max(row)
        z = top + math.log(math.fsum(math.exp(v - top) for v in row))
        lse.append(z)
        loss.append(0.0 if t == ignore else z - row[t])
    return loss, lse


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def test_cross_entropy_against_a_loop_and_ignore_index() -> None:
    rng = np.random.default_rng(2)
    logits, targets = rng.standard_normal((5, 7)) * 3, np.array([3, -100, 0, 6, 3])
    loss, lse = run("cross_entropy", logits, targets)
    ref_loss, ref_lse = naive_cross_entropy(logits, targets)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-13)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-13)
    assert loss[1] == 0.0
    (d,) = run("cross_entropy_backward", np.ones(5), logits, targets, lse, None)
    p = np.exp(logits - np.array(ref_lse)[:, None])
    expected = p - np.eye(7)[np.where(targets >= 0, targets, 0)]
    expected[1] = 0.0
    np.testing.assert_allclose(d, expected, atol=1e-14)
    loss2, _ = run("cross_entropy", logits, np.array([3, 2, 0, 6, 2]), ignore_index=2)
    assert loss2[1] == loss2[4] == 0.0 and loss2[0] == loss[0]
    lt, st = infer("cross_entropy", (["N", "V"], "bf16"), (["N"], "int32"))
    assert lt.dtype == st.dtype == "fp32" and same_dims(lt, ["N"])


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 11, 64])
def test_fused_lm_head_loss_equals_cross_entropy_of_the_full_logits(chunk_size: int) -> None:
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((6, 4)), rng.standard_normal((11, 4))
    targets = np.array([3, -100, 10, 0, 7, -100])
    loss, lse = run("fused_lm_head_loss", x, w, targets, chunk_size=chunk_size)
    ref_loss, ref_lse = naive_cross_entropy(x @ w.T, targets)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)
    d = rng.standard_normal(6)
    dx, dw = run("fused_lm_head_loss_backward", d, x, w, targets, lse, None, chunk_size=chunk_size)
    (dlogits,) = run("cross_entropy_backward", d, x @ w.T, targets, lse, None)
    np.testing.assert_allclose(dx, dlogits @ w, atol=1e-12)
    np.testing.assert_allclose(dw, dlogits.T @ x, atol=1e-12)


def test_fused_lm_head_loss_softcap_caps_the_logits() -> None:
    rng = np.random.default_rng(4)
    x, w, targets = rng.standard_normal((4, 3)) * 3, rng.standard_normal((9, 3)), np.array([0, 8, -100, 4])
    loss, lse = run("fused_lm_head_loss", x, w, targets, chunk_size=4, softcap=2.0)
    ref_loss, ref_lse = naive_cross_entropy(2.0 * np.tanh(x @ w.T / 2.0), targets)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)


def test_fused_lm_head_loss_shape_rule() -> None:
    loss, lse = infer("fused_lm_head_loss", (["B * T", "C"], "bf16"), (["V", "C"], "bf16"),
                      (["B * T"], "int32"))
    assert loss.dtype == lse.dtype == "fp32" and same_dims(loss, ["T * B"])
    with pytest.raises(KilnError, match=r"'fused_lm_head_loss'.*differ in C"):
        infer("fused_lm_head_loss", (["N", "C"], "fp32"), (["V", "D"], "fp32"), (["N"], "int32"))
    with pytest.raises(KilnError, match=r"'fused_lm_head_loss'.*targets"):
        infer("fused_lm_head_loss", (["N", "C"], "fp32"), (["V", "C"], "fp32"), (["M"], "int32"))


def _peak_extra(fn: object) -> tuple[tuple[np.ndarray, ...], int]:
    """The kernel's outputs and its peak traced allocation beyond those outputs."""
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        base = tracemalloc.get_traced_memory()[0]
        outs = fn()  # type: ignore[operator]
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        if not was_tracing:
            tracemalloc.stop()
    return outs, peak - sum(o.nbytes for o in outs)


def test_fused_lm_head_loss_never_holds_more_than_one_vocabulary_chunk_of_logits() -> None:
    n, c, v, chunk = 64, 32, 32000, 2048
    rng = np.random.default_rng(5)
    x = rng.standard_normal((n, c), dtype=np.float32)
    w = rng.standard_normal((v, c), dtype=np.float32) * np.float32(0.3)
    targets = rng.integers(0, v, n)
    targets[::9] = -100
    d_loss = rng.standard_normal(n, dtype=np.float32)
    attrs = {"ignore_index": -100, "chunk_size": chunk, "softcap": None}
    budget = 2 * n * chunk * np.dtype(np.float32).itemsize
    fwd, bwd = REG["fused_lm_head_loss"].kernel, REG["fused_lm_head_loss_backward"].kernel

    (loss, lse), extra = _peak_extra(lambda: fwd(x, w, targets, **attrs))
    assert extra < budget, f"forward held {extra / budget * 2:.2f} chunks of logits"
    (dx, dw), extra = _peak_extra(lambda: bwd(d_loss, x, w, targets, lse, None, **attrs))
    assert extra < budget, f"backward held {extra / budget * 2:.2f} chunks of logits"

    for a in (loss, lse, dx, dw):
        assert a.dtype == np.float32
    logits = x.astype(np.float64) @ w.T.astype(np.float64)  # the unchunked reference
    logp = log_softmax(logits)
    live = targets != -100
    rows = np.flatnonzero(live)
    ref_loss = np.zeros(n)
    ref_loss[rows] = -logp[rows, targets[rows]]
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, (logits - logp)[:, 0], rtol=2e-5)
    dlogits = np.exp(logp) * np.where(live, d_loss, 0)[:, None]
    dlogits[rows, targets[rows]] -= d_loss[rows]
    np.testing.assert_allclose(dx, dlogits @ w, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dw, dlogits.T @ x, rtol=1e-4, atol=1e-6)


def test_the_padding_row_of_an_embedding_gets_no_gradient() -> None:
    rng = np.random.default_rng(0)
    ids, weight = np.array([[3, 0, 1], [0, 0, 2]]), rng.standard_normal((5, 4))
    d_out = rng.standard_normal((2, 3, 4))
    bwd = op_registry()["embedding_backward"]
    (full,) = bwd.run([d_out, ids], {"num_embeddings": 5})
    (padded,) = bwd.run([d_out, ids], {"num_embeddings": 5, "padding_idx": 0})
    np.testing.assert_allclose(full[0], d_out[0, 1] + d_out[1, 0] + d_out[1, 1])  # the scatter-add oracle
    assert not padded[0].any() and np.array_equal(padded[1:], full[1:])
    fwd = op_registry()["embedding"]
    assert np.array_equal(fwd.run([ids, weight], {"padding_idx": 0})[0], weight[ids])  # forward unchanged
