"""``@memory`` offload/temporary, tensor-level ``@gradient`` and annotations inside ``@backward``."""

# ruff: noqa: F821  (dimension names inside Tensor[...] annotations are not Python names)

import numpy as np
import pytest

from kiln.core import Model, compile
from kiln.dsl import (
    B,
    DSLError,
    Param,
    T,
    Tensor,
    backward,
    block,
    build_bundle,
    forward,
    graph,
)
from kiln.dsl.annotations import gradient, memory, probe
from kiln.dsl.testing import V, stack_lm
from kiln.dsl.testing import lm as annotated_lm


def lm(name: str, *h_ann: object) -> type:
    """``x + silu(x @ w1^T) @ w2^T`` in a two-layer stack; ``h_ann`` annotate ``h = x @ w1^T``."""
    return annotated_lm(name, h_ann=h_ann, n_layers=2)


def batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    ids = np.random.default_rng(seed).integers(0, V, (2, 6))
    return ids[:, :-1], ids[:, 1:]


def test_memory_offload_moves_the_tensor_to_the_host_pool_bit_for_bit() -> None:
    plain = build_bundle(lm("Kept"), {})
    offloaded = build_bundle(lm("Offloaded", memory("offload")), {})
    (slot,) = [s for s in offloaded.module("OffloadedBlock").activations.slots if s.name == "h"]
    assert slot.memory_hint == "offload"
    binds = {"B": 2, "T": 5}
    planned = compile(offloaded, bindings=binds, recompute="dsl").recompute
    assert planned.block("OffloadedBlock").offloaded == ("h",)
    kept = compile(plain, bindings=binds, recompute="dsl").recompute.block("KeptBlock")
    assert kept is None or not kept.offloaded
    a = Model(plain, recompute="dsl", seed=3)
    b = Model(offloaded, recompute="dsl", weights=a.parameters())
    prog = b.program(*batch()[0].shape)
    assert prog.host_bytes > 0 and any(st.how == "offload" for st in prog.steps)
    la, ga = a.loss_and_grads(*batch())
    lb, gb = b.loss_and_grads(*batch())
    assert la == lb and all(np.array_equal(ga[k], gb[k].reshape(ga[k].shape)) for k in ga)


def test_memory_temporary_is_replayed_in_the_backward() -> None:
    bundle = build_bundle(lm("Temporary", memory("temporary")), {})
    fwd = bundle.module("TemporaryBlock").forward
    assert "h" in fwd.recompute and "h" not in fwd.save
    plan = compile(bundle, bindings={"B": 2, "T": 5}, recompute="dsl").recompute.block("TemporaryBlock")
    assert "h" in plan.recomputed


@pytest.mark.parametrize(("ann", "factor"), [(gradient(scale=0.25), 0.25), (gradient("skip"), 0.0)])
def test_gradient_on_a_tensor_scales_what_flows_back_through_it(ann: object, factor: float) -> None:
    """``d_w1 = d_h^T x``: scaling ``d_h`` scales ``d_w1`` by the same factor and leaves ``d_w2``
    (computed before ``d_h``) as it was."""
    plain = Model(build_bundle(lm(f"Unscaled{int(factor * 100)}"), {}), seed=4)
    scaled = Model(build_bundle(lm(f"Scaled{int(factor * 100)}", ann), {}), weights=plain.parameters())
    _, g0 = plain.loss_and_grads(*batch(1))
    _, g1 = scaled.loss_and_grads(*batch(1))
    last = "blocks.1"  # the top layer: its d_h is computed from the loss alone
    np.testing.assert_allclose(g1[f"{last}.w1"], factor * g0[f"{last}.w1"], rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(g1[f"{last}.w2"], g0[f"{last}.w2"], rtol=1e-5, atol=1e-12)  # unfused: ulps
    assert not np.allclose(g1["embedding"], g0["embedding"])  # the change flows on down


def test_gradient_clip_on_a_tensor_bounds_its_norm() -> None:
    plain = Model(build_bundle(lm("Unclipped"), {}), seed=4)
    clipped = Model(build_bundle(lm("Clipped", gradient(clip=1e-9), probe("h", capture="grad_full")), {}),
                    weights=plain.parameters())
    clipped.probes.enable()
    _, g0 = plain.loss_and_grads(*batch(1))
    _, g1 = clipped.loss_and_grads(*batch(1))
    seen = clipped.probes["h"]
    assert len(seen) == 2 and all(np.linalg.norm(r.value) == pytest.approx(1e-9, rel=1e-5) for r in seen)
    ratio = g1["blocks.1.w1"] / g0["blocks.1.w1"]
    assert np.allclose(ratio, ratio.flat[0], rtol=1e-4) and ratio.flat[0] < 1e-2  # one factor: the clip


def test_an_annotation_inside_a_backward_method_is_refused() -> None:
    class ManualBackward:
        def __init__(self, d_model: int):
            self.d_model = d_model

        w = Param(Tensor["d_model", "d_model", "fp32"])

        @forward
        def forward(self, x: Tensor["B", "T", "d_model", "fp32"]) -> Tensor["B", "T", "d_model", "fp32"]:
            with graph() as g:
                h = g.matmul(g.view(x, shape=[B * T, "d_model"]), "w", transpose="NT")
                return g.add(x, g.view(g.silu(h), shape=[B, T, "d_model"]))

        @backward
        def backward(self, d_y):
            with graph() as g:
                d_y2 = g.view(d_y, shape=[B * T, "d_model"])
                d_h = g.custom("silu_backward", d_y2, g.saved("h")) @ probe("dh")
                d_w = g.matmul(d_h, g.saved("view_1"), transpose="TN")
                d_x = g.add(d_y, g.view(g.matmul(d_h, "w"), shape=[B, T, "d_model"]))
                return d_x, d_w

    block(ManualBackward)

    with pytest.raises(DSLError, match=r"E008.*@probe on 'd_h': annotations inside a @backward method"):
        build_bundle(stack_lm("ManualLM", "ManualBackward"), {})
