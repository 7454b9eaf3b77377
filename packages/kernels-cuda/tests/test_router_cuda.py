"""moe_router and its backward on the CUDA kernels (the matmul, softmax or sigmoid, top-k, load statistics
and the loss's one-block sum), run through the CPU emulator: exact ties broken as kiln-core's reference
breaks them, ragged expert counts, and the gradient against float64 finite differences."""

# ruff: noqa: F821  (dimension names inside Tensor[...] annotations are not Python names)

from typing import Any

import numpy as np
import pytest

from kiln.core import KilnError, op_registry
from kiln.cuda import _ops
from kiln.cuda._check import CASES, _to_device, _to_host, run_case
from kiln.cuda._emulate import EmulatedDevice


def _router_on_device(dev: EmulatedDevice, x: np.ndarray, gate: np.ndarray, **attrs: Any) -> list[np.ndarray]:
    n, k = x.shape[0], attrs["top_k"]
    outs = [_to_device(dev, np.full(shape, fill, dtype)) for shape, fill, dtype in
            (((n, k), np.nan, np.float32), ((n, k), -1, np.int32), ((), np.nan, np.float32))]
    _ops.moe_router(_to_device(dev, x), _to_device(dev, gate), out=outs, **attrs)
    return [_to_host(o) for o in outs]  # type: ignore[arg-type]


@pytest.mark.parametrize("top_k", [2, 3])
def test_ties_go_to_the_lower_expert_as_in_the_reference(emulated: EmulatedDevice, top_k: int) -> None:
    """Experts 2 and 5 share expert 0's gate row, so their scores tie exactly; expert 6 is never chosen.
    The device picks the same experts in the same slots as the reference, for every row."""
    attrs = {"top_k": top_k, "normalize": True, "aux_loss_coef": 0.3, "use_sigmoid": False}
    (x, gate), _ = CASES["moe_router-210"].build(np.random.default_rng(7))
    weights, indices, aux = _router_on_device(emulated, x, gate, **attrs)
    want_w, want_i, want_aux = op_registry().get_op("moe_router").kernel(x.astype(np.float64),
                                                                        gate.astype(np.float64), **attrs)
    assert np.array_equal(indices, want_i)
    counts = np.bincount(indices.ravel(), minlength=7)
    assert counts[6] == 0 and counts[0] > counts[2] > 0  # an empty expert; ties in the top-k and at its cut
    assert np.abs(weights - want_w).max() < 1e-6
    assert abs(aux.item() - float(want_aux)) < 1e-6


def test_every_router_case_matches_the_reference_on_another_seed(emulated: EmulatedDevice) -> None:
    for name in [n for n in CASES if n.startswith("moe_router")]:
        assert run_case(CASES[name], emulated, seed=3) <= CASES[name].atol, name


@pytest.mark.parametrize("use_sigmoid", [False, True])
def test_router_gradient_matches_finite_differences(emulated: EmulatedDevice, use_sigmoid: bool) -> None:
    """d_logits from the device, carried to x (d_logits @ gate), against central differences in float64 of
    sum(d_weights * weights) + d_aux * aux_loss over x, the routing (top-k choice and counts) held fixed:
    both are piecewise constant, so their derivative is zero."""
    rng = np.random.default_rng(0)
    n, c, e, k, coef = 37, 5, 6, 2, 0.4
    x, gate = rng.standard_normal((n, c)).astype(np.float32), rng.standard_normal((e, c)).astype(np.float32)
    attrs = {"normalize": True, "aux_loss_coef": coef, "use_sigmoid": use_sigmoid}
    _, idx, _ = op_registry().get_op("moe_router").kernel(x.astype(np.float64), gate.astype(np.float64),
                                                          top_k=k, **attrs)
    d_w, d_aux = rng.standard_normal((n, k)).astype(np.float32), np.float32(1.7)
    counts = np.bincount(idx.ravel(), minlength=e)

    def objective(xs: np.ndarray) -> float:
        logits = xs @ gate.astype(np.float64).T
        if use_sigmoid:
            probs = 1 / (1 + np.exp(-logits))
        else:
            probs = np.exp(logits - logits.max(1, keepdims=True))
            probs /= probs.sum(1, keepdims=True)
        chosen = np.take_along_axis(probs, idx, 1)
        weights = chosen / chosen.sum(1, keepdims=True)
        aux = coef * e * np.sum(counts / n * probs.mean(0))
        return float(np.sum(d_w * weights) + d_aux * aux)

    h, x64 = 1e-6, x.astype(np.float64)
    want = np.zeros_like(x64)
    for i in np.ndindex(x.shape):
        step = np.zeros_like(x64)
        step[i] = h
        want[i] = (objective(x64 + step) - objective(x64 - step)) / (2 * h)
    d_logits = _to_device(emulated, np.full((n, e), np.nan, np.float32))
    _ops.moe_router_backward(_to_device(emulated, d_w), _to_device(emulated, np.asarray(d_aux)),
                             _to_device(emulated, x), _to_device(emulated, gate), _to_device(emulated, idx),
                             out=(d_logits,), **attrs)
    got = _to_host(d_logits).astype(np.float64) @ gate.astype(np.float64)  # type: ignore[arg-type]
    assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max())


def test_router_names_what_it_cannot_route(emulated: EmulatedDevice) -> None:
    x, gate = np.ones((4, 3), np.float32), np.ones((5, 3), np.float32)
    with pytest.raises(KilnError, match=r"'moe_router': top_k = 6 is not in 1\.\.5"):
        _router_on_device(emulated, x, gate, top_k=6, normalize=True, aux_loss_coef=0.1, use_sigmoid=False)
    with pytest.raises(KilnError, match=r"'moe_router' on cuda: x \[N, C\] and gate \[E, C\] expected"):
        _router_on_device(emulated, x, np.ones((5, 2), np.float32), top_k=2, normalize=True,
                          aux_loss_coef=0.1, use_sigmoid=False)


def test_a_routed_model_trains_on_the_device_as_on_numpy() -> None:
    """A tiny LM whose tokens go through moe_router (with its loss added), the expert permutation and a
    grouped GEMM: two training steps on the emulated ``cuda`` equal the NumPy backend's to 1e-5, with
    moe_router and its backward on their CUDA kernels (no host step). Its annotations are evaluated here,
    as objects: this module has no ``from __future__ import annotations``."""
    pytest.importorskip("kiln.dsl", reason="the model is written in kiln-dsl")
    from kiln.core import Model, PluginSession
    from kiln.cuda import EmulatedCuda
    from kiln.dsl import B, Param, T, Tensor, build_bundle, graph, model
    from kiln.dsl import forward as dsl_forward  # the class body defines its own forward

    v, c, e = 16, 8, 4

    class RoutedLM:
        def __init__(self, vocab_size: int = v, d_model: int = c, num_experts: int = e):
            self.vocab_size, self.d_model, self.num_experts = vocab_size, d_model, num_experts

        embedding = Param(Tensor["vocab_size", "d_model", "fp32"])
        gate = Param(Tensor["num_experts", "d_model", "fp32"])
        experts = Param(Tensor["num_experts", "d_model", "d_model", "fp32"])
        head = Param(Tensor["vocab_size", "d_model", "fp32"])

        @dsl_forward
        def forward(self, token_ids: Tensor["B", "T", "int32"], position_ids: Tensor["T", "int32"],
                    targets: Tensor["B", "T", "int32"]) -> Tensor["B * T", "fp32"]:
            with graph() as g:
                x = g.view(g.embedding(token_ids, "embedding"), shape=[B * T, "d_model"])
                weights, indices, aux = g.moe_router(x, "gate", top_k=2, aux_loss_coef=0.5)
                x_perm, scatter = g.moe_permute(x, indices, num_experts=self.num_experts)
                y = g.moe_unpermute(g.grouped_gemm(x_perm, "experts", scatter), weights, scatter)
                return g.add(g.fused_lm_head_loss(g.add(x, y), "head", targets), aux)

    bundle = build_bundle(model(RoutedLM), {})
    ids = np.random.default_rng(1).integers(0, v, (2, 9))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    with PluginSession(autoload=False).activate() as session:
        session.register(EmulatedCuda(), "cuda-emulated")
        ref, got = (Model.from_ir(bundle, seed=0, backend=b) for b in ("numpy", "cuda"))
        kernels = {s.op.type: s.kernel for s in got.program(2, 8).steps}
        assert kernels["moe_router"] == "moe_router@cuda:float32"
        assert kernels["moe_router_backward"] == "moe_router_backward@cuda:float32"
        for _ in range(2):
            want, have = ref.train_step(batch)["loss"], got.train_step(batch)["loss"]
            assert have == pytest.approx(want, abs=1e-5)
        w, h = ref.parameters(), got.parameters()
        assert max(float(np.abs(w[k] - h[k]).max()) for k in w) < 1e-5
