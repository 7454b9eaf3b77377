"""Forward semantics of the MoE ops against naive loops (gradients are checked by the generic harness)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kiln.core._errors import OpError
from kiln.core.ir._dims import parse_shape, shape_to_json
from kiln.core.ir._ir import TensorType
from kiln.core.ops._ops import InferContext, OpRegistry
from kiln.core.ops.library import _moe

REG = OpRegistry()
for _op in _moe.OPS:
    REG.register_op(_op)


def run(name: str, *inputs: np.ndarray, **attrs: Any) -> Any:
    out = REG.get_op(name).run(inputs, attrs)
    return out if len(out) > 1 else out[0]


def infer(name: str, *types: tuple[list[Any], str], **attrs: Any) -> list[tuple[list[Any], str]]:
    opdef = REG.get_op(name)
    ins = [TensorType(parse_shape(s), dt) for s, dt in types]
    outs = opdef.infer(InferContext(name, ins, opdef.resolve_attrs(attrs)))
    return [(shape_to_json(t.shape), t.dtype) for t in outs]


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def hf_moe(x: np.ndarray, gate: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray, k: int,
           norm_topk_prob: bool) -> np.ndarray:
    """Qwen3MoeSparseMoeBlock, one token at a time; w_gate/w_up are [E, M, C], w_down [E, C, M]."""
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        logits = [float(gate[e] @ x[t]) for e in range(gate.shape[0])]
        z = sum(np.exp(v) for v in logits)
        probs = [np.exp(v) / z for v in logits]
        chosen = sorted(range(len(probs)), key=lambda e: -probs[e])[:k]
        total = sum(probs[e] for e in chosen) if norm_topk_prob else 1.0
        for e in chosen:
            hidden = silu(w_gate[e] @ x[t]) * (w_up[e] @ x[t])
            out[t] += probs[e] / total * (w_down[e] @ hidden)
    return out


def moe_layer(x: np.ndarray, gate: np.ndarray, gate_up: np.ndarray, w_down: np.ndarray, k: int,
              normalize: bool) -> np.ndarray:
    probs = run("moe_softmax", x @ gate.T)
    weights, indices = run("moe_topk", probs, k=k, normalize=normalize)
    x_perm, scatter_idx, offsets = run("moe_permute", x, indices, num_experts=gate.shape[0])
    h = run("moe_grouped_gemm_gate_up", x_perm, gate_up, offsets)
    m = h.shape[1] // 2
    act = silu(h[:, :m]) * h[:, m:]
    y = run("moe_grouped_gemm_down", act, w_down, offsets)
    return run("moe_unpermute", y, weights, scatter_idx, top_k=k)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_layer_matches_hf_loop(normalize: bool, k: int) -> None:
    rng = np.random.default_rng(k)
    n, c, m, e = 9, 6, 4, 5
    x = rng.standard_normal((n, c))
    gate = rng.standard_normal((e, c))
    w_gate, w_up = rng.standard_normal((e, m, c)), rng.standard_normal((e, m, c))
    w_down = rng.standard_normal((e, c, m))
    got = moe_layer(x, gate, np.concatenate([w_gate, w_up], axis=1), w_down, k, normalize)
    expected = hf_moe(x, gate, w_gate, w_up, w_down, k, normalize)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


def test_layer_keeps_float32() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3)).astype(np.float32)
    gate = rng.standard_normal((3, 3)).astype(np.float32)
    gate_up = rng.standard_normal((3, 4, 3)).astype(np.float32)
    w_down = rng.standard_normal((3, 3, 2)).astype(np.float32)
    assert moe_layer(x, gate, gate_up, w_down, 2, True).dtype == np.float32


def test_sigmoid() -> None:
    logits = np.array([[-800.0, 0.0, 2.0]])
    np.testing.assert_allclose(run("moe_sigmoid", logits), [[0.0, 0.5, 1 / (1 + np.exp(-2.0))]], rtol=1e-15)


def test_topk_order_ties_and_normalize() -> None:
    probs = np.array([[0.1, 0.3, 0.3, 0.2, 0.1], [0.25, 0.05, 0.25, 0.2, 0.25]])
    w, idx = run("moe_topk", probs, k=3)
    assert idx.dtype == np.int32
    assert idx.tolist() == [[1, 2, 3], [0, 2, 4]]
    np.testing.assert_allclose(w, [[0.3, 0.3, 0.2], [0.25, 0.25, 0.25]])
    wn, idx_n = run("moe_topk", probs, k=3, normalize=True)
    assert idx_n.tolist() == idx.tolist()
    np.testing.assert_allclose(wn, w / w.sum(axis=1, keepdims=True))
    np.testing.assert_allclose(wn.sum(axis=1), 1.0)
    with pytest.raises(OpError, match="k = 6"):
        run("moe_topk", probs, k=6)


def test_permute_layout_and_offsets() -> None:
    rng = np.random.default_rng(3)
    n, k, e = 8, 3, 6
    indices = np.stack([rng.choice(e - 1, k, replace=False) for _ in range(n)]).astype(np.int32)
    x = rng.standard_normal((n, 4))
    x_perm, scatter_idx, offsets = run("moe_permute", x, indices, num_experts=e)
    assert scatter_idx.dtype == offsets.dtype == np.int32
    assert offsets.shape == (e + 1,) and offsets[0] == 0 and offsets[-1] == n * k
    assert np.diff(offsets).tolist() == [int(np.sum(indices == j)) for j in range(e)]
    assert offsets[e] == offsets[e - 1]  # the unused last expert gets no rows
    assert sorted(scatter_idx.tolist()) == list(range(n * k))
    expected = [(t * k + s) for j in range(e) for t in range(n) for s in range(k) if indices[t, s] == j]
    assert scatter_idx.tolist() == expected  # ascending experts, (token, slot) order inside one
    for j in range(e):
        for r in range(offsets[j], offsets[j + 1]):
            t, s = divmod(int(scatter_idx[r]), k)
            assert indices[t, s] == j
            np.testing.assert_array_equal(x_perm[r], x[t])


def test_permute_unpermute_round_trip() -> None:
    rng = np.random.default_rng(4)
    n, k, e = 6, 2, 4
    indices = np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)
    x = rng.standard_normal((n, 5))
    x_perm, scatter_idx, _ = run("moe_permute", x, indices, num_experts=e)
    w = rng.random((n, k))
    w /= w.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(run("moe_unpermute", x_perm, w, scatter_idx, top_k=k), x, rtol=1e-13)
    np.testing.assert_allclose(run("moe_unpermute", x_perm, np.ones((n, k)), scatter_idx), k * x, rtol=1e-13)


def test_permute_rejects_bad_indices() -> None:
    with pytest.raises(OpError, match=r"0\.\.3"):
        run("moe_permute", np.zeros((2, 3)), np.array([[0, 4], [1, 2]], dtype=np.int32), num_experts=4)


def test_grouped_gemm_matches_per_row_loop() -> None:
    rng = np.random.default_rng(5)
    offsets = np.array([0, 3, 3, 7, 8], dtype=np.int32)
    x, w = rng.standard_normal((8, 3)), rng.standard_normal((4, 6, 3))
    expert = np.searchsorted(offsets, np.arange(8), side="right") - 1
    expected = np.stack([w[expert[r]] @ x[r] for r in range(8)])
    np.testing.assert_allclose(run("moe_grouped_gemm_gate_up", x, w, offsets), expected, rtol=1e-13)
    d = rng.standard_normal((8, 6))
    dw = run("moe_grouped_gemm_dw", d, x, offsets)
    assert not dw[1].any()  # expert 1 has no rows
    np.testing.assert_allclose(dw[2], sum(np.outer(d[r], x[r]) for r in range(3, 7)), rtol=1e-13)
    with pytest.raises(OpError, match="expert_offsets must rise"):
        run("moe_grouped_gemm_down", x, w, np.array([0, 3, 2, 7, 8], dtype=np.int32))


def test_symbolic_shape_rules() -> None:
    assert infer("moe_softmax", (["N", "E"], "bf16")) == [(["N", "E"], "fp32")]
    assert infer("moe_topk", (["N", "E"], "fp32"), k=4) == [(["N", 4], "fp32"), (["N", 4], "int32")]
    assert infer("moe_permute", (["B * T", "C"], "bf16"), (["B * T", "K"], "int32"), num_experts="E") == [
        (["B * T * K", "C"], "bf16"), (["B * T * K"], "int32"), (["E + 1"], "int32")]
    assert infer("moe_grouped_gemm_gate_up", (["R", "C"], "bf16"), (["E", "2 * M", "C"], "bf16"),
                 (["E + 1"], "int32")) == [(["R", "2 * M"], "bf16")]
    assert infer("moe_grouped_gemm_dw", (["R", "O"], "bf16"), (["R", "I"], "bf16"), (["E + 1"], "int32")) == [
        (["E", "O", "I"], "bf16")]
    assert infer("moe_unpermute", (["N * 8", "C"], "bf16"), (["N", 8], "fp32"), (["N * 8"], "int32"),
                 top_k=8) == [(["N", "C"], "bf16")]
    assert infer("moe_unpermute_dw", (["N", "C"], "bf16"), (["N * K", "C"], "bf16"), (["N * K"], "int32"),
                 top_k="K") == [(["N", "K"], "bf16")]
    with pytest.raises(OpError, match="integer"):
        infer("moe_permute", (["N", "C"], "bf16"), (["N", 2], "fp32"), num_experts=4)
    with pytest.raises(OpError, match="num_experts \\+ 1"):
        infer("moe_grouped_gemm_down", (["R", "M"], "bf16"), (["E", "C", "M"], "bf16"), (["E"], "int32"))
    with pytest.raises(OpError, match="2 \\* M"):
        infer("moe_grouped_gemm_gate_up", (["R", "C"], "bf16"), (["E", 5, "C"], "bf16"), (["E + 1"], "int32"))
    with pytest.raises(OpError, match="top_k"):
        infer("moe_unpermute", (["N * 8", "C"], "bf16"), (["N", 8], "fp32"), (["N * 8"], "int32"), top_k=4)


@pytest.mark.parametrize("name", [o.name for o in _moe.OPS if o.backward is None])
def test_backward_shape_rules_match_kernels(name: str) -> None:
    rng = np.random.default_rng(6)
    n, k, e, c = 4, 2, 3, 5
    scatter = rng.permutation(n * k).astype(np.int32)
    offsets = np.array([0, 5, 5, n * k], dtype=np.int32)
    inputs, attrs = {
        "moe_softmax_backward": ((rng.random((n, e)), rng.random((n, e))), {"dtype": "bf16"}),
        "moe_sigmoid_backward": ((rng.random((n, e)), rng.random((n, e))), {}),
        "moe_topk_backward": ((rng.random((n, k)), rng.random((n, e)), np.array([[0, 1]] * n, np.int32)), {}),
        "moe_permute_backward": ((rng.random((n * k, c)), scatter), {"num_tokens": n}),
        "moe_grouped_gemm_dx": ((rng.random((n * k, 2)), rng.random((e, 2, c)), offsets), {}),
        "moe_grouped_gemm_dw": ((rng.random((n * k, 2)), rng.random((n * k, c)), offsets), {}),
        "moe_unpermute_dy": ((rng.random((n, c)), rng.random((n, k)), scatter), {}),
        "moe_unpermute_dw": ((rng.random((n, c)), rng.random((n * k, c)), scatter), {"top_k": k}),
    }[name]
    types = [(list(a.shape), "fp32" if a.dtype.kind == "f" else "int32") for a in inputs]
    outs = REG.get_op(name).run(inputs, attrs)
    assert [tuple(s) for s, _ in infer(name, *types, **attrs)] == [o.shape for o in outs]
