"""Forward semantics of geglu, add3, qk_norm, moe_router and grouped_gemm against naive loops written from
the seed's definitions, and the dtype rule (E015) of differentiable ops. Their gradients are checked by the
generic finite-difference harness (test_op_gradients.py)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from kiln.core import op_registry
from kiln.core._errors import OpError
from kiln.core.ir._dims import parse_shape
from kiln.core.ir._ir import TensorType
from kiln.core.ops._ops import InferContext

REGISTRY = op_registry()
RNG = np.random.default_rng(7)


def run(name: str, *inputs: np.ndarray | None, **attrs: Any) -> Any:
    out = REGISTRY.get_op(name).run(inputs, attrs)
    return out if len(out) > 1 else out[0]


def infer(name: str, *types: tuple[list[Any], str], **attrs: Any) -> list[TensorType]:
    opdef = REGISTRY.get_op(name)
    ins = [TensorType(parse_shape(s), dt) for s, dt in types]
    return list(opdef.infer(InferContext(name, ins, opdef.resolve_attrs(attrs))))


def test_geglu_is_exact_gelu_of_gate_times_up() -> None:
    gate, up = RNG.standard_normal((3, 4)) * 2, RNG.standard_normal((3, 4))
    want = np.array([[0.5 * g * (1 + math.erf(g / math.sqrt(2))) * u for g, u in zip(gr, ur, strict=True)]
                     for gr, ur in zip(gate, up, strict=True)])
    np.testing.assert_allclose(run("geglu", gate, up), want, rtol=1e-12)
    tanh = run("geglu", gate, up, approximate="tanh")
    np.testing.assert_allclose(tanh, run("gelu", gate, approximate="tanh") * up, rtol=1e-12)
    assert np.max(np.abs(tanh - want)) > 1e-6  # the two approximations are different ops
    with pytest.raises(OpError, match="input 1 must have input 0's shape"):
        infer("geglu", (["T", "D"], "fp32"), (["T", "M"], "fp32"))


def test_add3_adds_three_tensors_of_one_shape() -> None:
    a, b, c = (RNG.standard_normal((2, 3)) for _ in range(3))
    np.testing.assert_array_equal(run("add3", a, b, c), a + b + c)
    with pytest.raises(OpError):
        infer("add3", (["B", "C"], "fp32"), (["B", "C"], "fp32"), (["C"], "fp32"))


def test_qk_norm_normalizes_each_head_vector() -> None:
    q, k = RNG.standard_normal((2, 4, 3, 5)), RNG.standard_normal((2, 2, 3, 5))
    qw, kw = RNG.standard_normal(5), RNG.standard_normal(5)
    q_norm, k_norm, q_rstd, k_rstd = run("qk_norm", q, k, qw, kw, eps=1e-5)
    for x, w, y, rstd in ((q, qw, q_norm, q_rstd), (k, kw, k_norm, k_rstd)):
        for idx in np.ndindex(x.shape[:-1]):
            r = 1.0 / math.sqrt(sum(v * v for v in x[idx]) / len(x[idx]) + 1e-5)
            assert rstd[idx] == pytest.approx(r, rel=1e-12)
            want = [v * r * wj for v, wj in zip(x[idx], w, strict=True)]
            np.testing.assert_allclose(y[idx], want, rtol=1e-12)
    types = infer("qk_norm", (["B", "Hq", "T", "D"], "bf16"), (["B", "Hkv", "T", "D"], "bf16"),
                  (["D"], "fp32"), (["D"], "fp32"))
    assert [str(t) for t in types] == ["bf16[B, Hq, T, D]", "bf16[B, Hkv, T, D]", "fp32[B, Hq, T]",
                                       "fp32[B, Hkv, T]"]


def naive_router(x: np.ndarray, gate: np.ndarray, k: int, normalize: bool, coef: float,
                 use_sigmoid: bool) -> tuple[np.ndarray, np.ndarray, float]:
    """One token at a time, then transformers' load_balancing_loss_func on the one-hot expert mask."""
    n, e = x.shape[0], gate.shape[0]
    probs = np.zeros((n, e))
    weights, indices = np.zeros((n, k)), np.zeros((n, k), dtype=np.int64)
    for t in range(n):
        logits = [sum(x[t, c] * gate[j, c] for c in range(x.shape[1])) for j in range(e)]
        if use_sigmoid:
            p = [1 / (1 + math.exp(-v)) for v in logits]
        else:
            z = sum(math.exp(v) for v in logits)
            p = [math.exp(v) / z for v in logits]
        probs[t] = p
        top = sorted(range(e), key=lambda j: -p[j])[:k]
        w = [p[j] for j in top]
        if normalize:
            w = [v / sum(w) for v in w]
        weights[t], indices[t] = w, top
    mask = np.zeros((n, k, e))
    for t in range(n):
        for j in range(k):
            mask[t, j, indices[t, j]] = 1.0
    tokens_per_expert = mask.mean(axis=0)  # [k, E]
    router_prob_per_expert = probs.mean(axis=0)  # [E]
    aux = float(np.sum(tokens_per_expert * router_prob_per_expert[None, :]) * e)
    return weights, indices, coef * aux


@pytest.mark.parametrize(("k", "normalize", "use_sigmoid"),
                         [(2, True, False), (1, False, False), (3, False, True)])
def test_moe_router_matches_per_token_routing_and_the_load_balancing_loss(k: int, normalize: bool,
                                                                         use_sigmoid: bool) -> None:
    x, gate = RNG.standard_normal((7, 4)), RNG.standard_normal((5, 4))
    weights, indices, aux = run("moe_router", x, gate, top_k=k, normalize=normalize, use_sigmoid=use_sigmoid,
                                aux_loss_coef=0.02)
    w_ref, i_ref, aux_ref = naive_router(x, gate, k, normalize, 0.02, use_sigmoid)
    np.testing.assert_array_equal(indices, i_ref)
    np.testing.assert_allclose(weights, w_ref, rtol=1e-12)
    assert aux.shape == () and float(aux) == pytest.approx(aux_ref, rel=1e-12)
    types = infer("moe_router", (["N", "C"], "bf16"), (["E", "C"], "bf16"), top_k=k)
    assert [str(t) for t in types] == [f"fp32[N, {k}]", f"int32[N, {k}]", "fp32[]"]


def test_moe_router_aux_loss_is_the_only_gradient_path_when_weights_are_unused() -> None:
    # d aux / d logits alone (no d_weights): against central differences of the aux loss
    x, gate = RNG.standard_normal((6, 3)), RNG.standard_normal((4, 3))
    attrs = {"top_k": 2, "normalize": True, "aux_loss_coef": 0.5, "use_sigmoid": False}
    _, indices, _ = run("moe_router", x, gate, **attrs)
    attrs.pop("top_k")
    d_logits = run("moe_router_backward", None, np.array(1.0), x, gate, indices, **attrs)
    eps, fd = 1e-6, np.zeros_like(gate)
    for idx in np.ndindex(gate.shape):
        hi, lo = gate.copy(), gate.copy()
        hi[idx] += eps
        lo[idx] -= eps
        aux_hi, aux_lo = (run("moe_router", x, g, top_k=2, **attrs)[2] for g in (hi, lo))
        fd[idx] = (aux_hi - aux_lo) / (2 * eps)
    np.testing.assert_allclose(d_logits.T @ x, fd, rtol=1e-6, atol=1e-9)
    (t,) = infer("moe_router_backward", (["N", "K"], "fp32"), ([], "fp32"), (["N", "C"], "bf16"),
                 (["E", "C"], "bf16"), (["N", "K"], "int32"), dtype="bf16")
    assert str(t) == "bf16[N, E]" and d_logits.shape == (6, 4)


@pytest.mark.parametrize("transpose", ["NT", "NN"])
def test_grouped_gemm_multiplies_each_group_by_its_own_weight(transpose: str) -> None:
    offsets = np.array([0, 2, 2, 5], dtype=np.int32)
    x = RNG.standard_normal((5, 3))
    w = RNG.standard_normal((3, 4, 3) if transpose == "NT" else (3, 3, 4))
    out = run("grouped_gemm", x, w, offsets, transpose=transpose)
    want = np.zeros((5, 4))
    for g in range(3):
        for r in range(offsets[g], offsets[g + 1]):
            for o in range(4):
                weight = w[g] if transpose == "NT" else w[g].T
                want[r, o] = sum(x[r, i] * weight[o, i] for i in range(3))
    np.testing.assert_allclose(out, want, rtol=1e-12)
    shape = ["G", "O", "I"] if transpose == "NT" else ["G", "I", "O"]
    ins = (["R", "I"], "fp32"), (shape, "fp32"), (["G + 1"], "int32")
    (t,) = infer("grouped_gemm", *ins, transpose=transpose)
    assert str(t) == "fp32[R, O]"
    with pytest.raises(OpError, match="last dim and the weight's input dim differ"):
        infer("grouped_gemm", *ins, transpose="NN" if transpose == "NT" else "NT")
    with pytest.raises(OpError, match="must rise from 0"):
        run("grouped_gemm", x, w, np.array([0, 3, 2, 5], dtype=np.int32), transpose=transpose)


@pytest.mark.parametrize(("op", "inputs", "culprit"), [
    ("silu", [(["N"], "int32")], "'x' is int32"),
    ("matmul", [(["N", "C"], "fp32"), (["C", "O"], "int8")], "'b' is int8"),
    ("add", [(["N"], "fp32"), (["N"], "int32")], "'b' is int32, but it is combined with 'a' (fp32)"),
    ("geglu", [(["N"], "int32"), (["N"], "int32")], "'gate' is int32"),
])
def test_differentiable_float_inputs_reject_integer_tensors(op: str, inputs: list[Any], culprit: str) -> None:
    with pytest.raises(OpError) as err:
        infer(op, *inputs)
    assert err.value.code == "E015" and culprit in str(err.value), err.value


@pytest.mark.parametrize(("op", "inputs", "attrs"), [
    ("view", [(["B", "T"], "int32")], {"shape": ["B * T"]}),
    ("transpose", [(["B", "T"], "int32")], {"dim0": 0, "dim1": 1}),
    ("concat", [(["T"], "int32"), (["T"], "int32")], {"dim": 0}),
    ("add", [(["T"], "int32"), (["T"], "int32")], {}),
    ("reduce_max", [(["T"], "int32")], {"axes": [0]}),
    ("embedding", [(["T"], "int32"), (["V", "C"], "fp32")], {}),
])
def test_integer_tensors_still_move_index_and_add(op: str, inputs: list[Any], attrs: dict[str, Any]) -> None:
    assert infer(op, *inputs, **attrs)
