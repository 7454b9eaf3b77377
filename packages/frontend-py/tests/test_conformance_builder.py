"""Builder methods for the ops a model author calls directly: geglu, add3, qk_norm, moe_router, grouped_gemm
and the reductions. Each model is compiled, its forward run against a NumPy transcription of its
definition, and its derived backward checked against finite differences."""

# ruff: noqa: F821  (dimension names inside Tensor[...] annotations are not Python names)

from typing import Any

import numpy as np

from kiln.core.autodiff import verify_backward
from kiln.core.autodiff._interp import run_graph
from kiln.core.ir import Graph, thaw, verify
from kiln.dsl import Param, Tensor, build_bundle, compile_model, forward, graph, module

F = "fp32"


def _graph(cls: type) -> Graph:
    m = build_bundle(cls, {}).module(cls.__name__)
    verify(m)
    return m.forward


def _run(g: Graph, values: dict[str, np.ndarray]) -> dict[str, Any]:
    return run_graph(g, values, float_dtype=np.float64)


def _gelu(x: np.ndarray) -> np.ndarray:
    from math import erf, sqrt

    return np.vectorize(lambda v: 0.5 * v * (1 + erf(v / sqrt(2))))(x)


@module
class ParallelQKNorm:
    def __init__(self, H: int = 2, T: int = 3, D: int = 4):
        self.H, self.T, self.D = H, T, D

    q_weight = Param(Tensor["D", F])
    k_weight = Param(Tensor["D", F])

    @forward
    def forward(self, q: Tensor["H", "T", "D", F], k: Tensor["H", "T", "D", F]) -> Tensor["H", "T", F]:
        with graph() as g:
            q_norm, k_norm, _, _ = g.qk_norm(q, k, "q_weight", "k_weight", eps=1e-5)
            both = g.add3(q_norm, k_norm, q)
            return g.reduce_mean(g.geglu(both, k), dims=-1, out_name="loss")


def test_qk_norm_add3_geglu_and_reduce_mean_compile_and_compute_their_definitions() -> None:
    g = _graph(ParallelQKNorm)
    assert [(op.type, thaw(op.attrs)) for op in g.ops] == [
        ("qk_norm", {"eps": 1e-5}), ("add3", {}), ("geglu", {"approximate": "none"}),
        ("reduce_mean", {"axes": [-1], "keepdims": False})]
    rng = np.random.default_rng(0)
    q, k, qw, kw = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4)), rng.standard_normal(4), \
        rng.standard_normal(4)

    def rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5) * w

    want = np.mean(_gelu(rms(q, qw) + rms(k, kw) + q) * k, axis=-1)
    got = _run(g, {"q": q, "k": k, "q_weight": qw, "k_weight": kw})["loss"]
    np.testing.assert_allclose(got, want, rtol=1e-10)
    errors = verify_backward(g, bindings={"H": 2, "T": 3, "D": 4})
    assert errors and max(errors.values()) < 1e-6, errors


@module
class RoutedGeGLU:
    """A MoE layer from the generic ops: router, permute, grouped GEMMs (both layouts), GeGLU, combine."""

    def __init__(self, N: int = 5, C: int = 3, E: int = 4, M: int = 2):
        self.N, self.C, self.E, self.M = N, C, E, M

    gate = Param(Tensor["E", "C", F])
    w_gate = Param(Tensor["E", "M", "C", F])  # NT layout
    w_up = Param(Tensor["E", "C", "M", F])  # NN layout
    w_down = Param(Tensor["E", "C", "M", F])

    @forward
    def forward(self, x: Tensor["N", "C", F]) -> Tensor[F]:
        with graph() as g:
            weights, indices, aux = g.moe_router(x, "gate", top_k=2, aux_loss_coef=0.1)
            x_perm, scatter = g.moe_permute(x, indices)
            h = g.geglu(g.grouped_gemm(x_perm, "w_gate", scatter),
                        g.grouped_gemm(x_perm, "w_up", scatter, transpose="NN"), approximate="tanh")
            y = g.moe_unpermute(g.grouped_gemm(h, "w_down", scatter), weights, scatter)
            return g.add(g.reduce_sum(y, dims=[0, 1]), aux, out_name="loss")


def test_moe_router_and_grouped_gemm_compose_a_moe_layer() -> None:
    g = _graph(RoutedGeGLU)
    types = [op.type for op in g.ops]
    assert types == ["moe_router", "moe_permute", "grouped_gemm", "grouped_gemm", "geglu", "grouped_gemm",
                     "moe_unpermute", "reduce_sum", "add"]
    router, _, _, up, *_ = g.ops
    assert thaw(router.attrs) == {"top_k": 2, "normalize": True, "aux_loss_coef": 0.1, "use_sigmoid": False}
    assert thaw(up.attrs) == {"transpose": "NN"} and up.inputs[2] == g.ops[1].outputs[2]  # the offsets

    rng = np.random.default_rng(1)
    values = {"x": rng.standard_normal((5, 3)), "gate": rng.standard_normal((4, 3)),
              "w_gate": rng.standard_normal((4, 2, 3)), "w_up": rng.standard_normal((4, 3, 2)),
              "w_down": rng.standard_normal((4, 3, 2))}
    got = float(_run(g, values)["loss"])

    x = values["x"]
    logits = x @ values["gate"].T
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    total, counts = 0.0, np.zeros(4)
    for t in range(5):
        top = np.argsort(-probs[t])[:2]
        w = probs[t, top] / probs[t, top].sum()
        for e, we in zip(top, w, strict=True):
            counts[e] += 1
            gate_h = values["w_gate"][e] @ x[t]
            up_h = x[t] @ values["w_up"][e]
            act = 0.5 * gate_h * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate_h + 0.044715 * gate_h**3))) * up_h
            total += we * np.sum(values["w_down"][e] @ act)
    aux = 0.1 * 4 * np.sum(counts / 5 * probs.mean(axis=0))
    np.testing.assert_allclose(got, total + aux, rtol=1e-10)
    errors = verify_backward(g, bindings={"N": 5, "C": 3, "E": 4, "M": 2})
    assert set(errors) == {"gate", "w_gate", "w_up", "w_down"} and max(errors.values()) < 1e-5, errors


@module
class CappedAlibi:
    def __init__(self, T: int = 4, H: int = 2, D: int = 3):
        self.T, self.H, self.D = T, H, D

    @forward
    def forward(self, q: Tensor[1, "T", "H", "D", F], k: Tensor[1, "T", "H", "D", F],
                v: Tensor[1, "T", "H", "D", F]) -> Tensor[1, "T", "H", "D", F]:
        with graph() as g:
            out, _ = g.flash_attention_qkv(q, k, v, softcap=2.0, alibi=True, out_name="out")
            plain, _ = g.flash_attention_qkv(q, k, v)
            return g.add(out, g.scale(plain, factor=0.0))


def test_attention_takes_softcap_and_alibi_from_the_builder() -> None:
    g = _graph(CappedAlibi)
    capped, plain = (op for op in g.ops if op.type == "attention")
    assert thaw(capped.attrs) == {"causal": True, "softcap": 2.0, "alibi": True}
    assert thaw(plain.attrs) == {"causal": True}
    rng = np.random.default_rng(2)
    values = {n: rng.standard_normal((1, 4, 2, 3)) for n in ("q", "k", "v")}
    env = _run(g, values)
    reference = np.zeros((1, 4, 2, 3))
    slopes = [2.0 ** -4, 2.0 ** -8]  # ALiBi's slopes of two heads
    for i in range(4):
        for h in range(2):
            s = np.array([2.0 * np.tanh(values["q"][0, i, h] @ values["k"][0, j, h] / np.sqrt(3) / 2.0)
                          - slopes[h] * (i - j) for j in range(i + 1)])
            w = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
            reference[0, i, h] = w @ values["v"][0, : i + 1, h]
    np.testing.assert_allclose(env["out"], reference, rtol=1e-10)


@module
class PackedCappedAlibi:
    def __init__(self, T: int = 4, H: int = 2, D: int = 3):
        self.T, self.H, self.D = T, H, D

    @forward
    def forward(self, qkv: Tensor[1, "T", "3 * H * D", F]) -> Tensor[1, "T", "H * D", F]:
        with graph() as g:
            out, _ = g.flash_attention(qkv, softcap=2.0, alibi=True, Hq="H", Hkv="H", D="D", out_name="out")
            return out


def test_flash_attention_takes_softcap_and_alibi_from_the_builder() -> None:
    g = _graph(PackedCappedAlibi)
    (op,) = (op for op in g.ops if op.type == "flash_attention")
    assert thaw(op.attrs) == {"Hq": "H", "Hkv": "H", "D": "D", "causal": True, "softcap": 2.0, "alibi": True}
    qkv = np.random.default_rng(2).standard_normal((1, 4, 18))
    q, k, v = (qkv[..., i * 6:(i + 1) * 6].reshape(1, 4, 2, 3) for i in range(3))
    env = run_graph(g, {"qkv": qkv}, bindings={"T": 4, "H": 2, "D": 3}, float_dtype=np.float64)
    slopes = [2.0 ** -4, 2.0 ** -8]  # ALiBi's slopes of two heads
    reference = np.zeros((1, 4, 2, 3))
    for i in range(4):
        for h in range(2):
            s = np.array([2.0 * np.tanh(q[0, i, h] @ k[0, j, h] / np.sqrt(3) / 2.0) - slopes[h] * (i - j)
                          for j in range(i + 1)])
            w = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
            reference[0, i, h] = w @ v[0, : i + 1, h]
    np.testing.assert_allclose(env["out"], reference.reshape(1, 4, 6), rtol=1e-10)


@module
class Blocked:
    _constraints_ = (("sqrt(C) * sqrt(C) == C", "C must be a square"),
                     ("ceil_div(N, block) <= max(n_blocks, 1)", "too few blocks"))

    def __init__(self, N: int = 7, C: int = 4, block: int = 2, n_blocks: int = 4):
        self.N, self.C, self.block, self.n_blocks = N, C, block, n_blocks

    table = Param(Tensor["ceil_div(N, block)", "min(C, block)", F])

    @forward
    def forward(self, x: Tensor["ceil_div(N, block)", "min(C, block)", F]) -> Tensor["ceil_div(N, block)", F]:
        with graph() as g:
            return g.reduce_max(g.mul(x, "table"), dims=[1])


def test_constraints_and_shapes_use_min_max_ceil_div_and_sqrt() -> None:
    payload = compile_model(Blocked, {})
    assert payload["success"], payload["errors"]
    m = build_bundle(Blocked, {}).module("Blocked")
    assert [d.to_json() for d in m.param("table").shape] == ["ceil_div(N, block)", "min(C, block)"]
    values = {"x": np.ones((4, 2)), "table": np.arange(8.0).reshape(4, 2)}
    np.testing.assert_array_equal(_run(m.forward, values)["reduce_max_1"], [1, 3, 5, 7])
    assert compile_model(Blocked, {"C": 5})["errors"][0]["message"].startswith("Blocked: C must be a square")
    assert compile_model(Blocked, {"N": 9})["errors"][0]["code"] == "E027"
