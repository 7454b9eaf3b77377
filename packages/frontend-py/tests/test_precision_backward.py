"""``@precision`` in a stack of blocks moves the backward of the annotated op with it, in every layer.

Autograd runs an op's backward in the precision its forward ran in; kiln gives the backward steps
derived from an overridden op the override's compute (``Program.computes``). The oracle for where a
gradient was rounded is bfloat16 itself: a weight gradient that a bf16 matmul computes holds bf16
values (``r(g) == g``), one an fp32 matmul computes does not. kiln-core's ``test_precision_backward.py``
checks the values against float64 and torch's autocast.
"""

import numpy as np
import pytest

from kiln.core import Model
from kiln.dsl import build_bundle
from kiln.dsl.annotations import precision
from kiln.dsl.testing import V
from kiln.dsl.testing import lm as annotated_lm

ml_dtypes = pytest.importorskip("ml_dtypes", reason="the bf16 recipe needs ml_dtypes (kiln-core[bf16])")


def bf16_share(x: np.ndarray) -> float:
    """The share of ``x``'s elements that are bfloat16 values."""
    x = np.asarray(x, np.float32)
    return float(np.mean(x == x.astype(ml_dtypes.bfloat16).astype(np.float32)))


def grads(m: Model) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    m.set_parameters({k: rng.normal(0, 0.7, v.shape).astype(np.float32) for k, v in m.parameters().items()})
    ids = np.random.default_rng(1).integers(0, V, (2, 9))
    return m.loss_and_grads(ids[:, :-1], ids[:, 1:])[1]


@pytest.mark.parametrize("recompute", ["none", "block"])
def test_an_fp32_matmul_under_bf16_has_fp32_gradient_products_in_every_layer(recompute: str) -> None:
    kept = annotated_lm("KeptFp32", h_ann=(precision(policy="fp32"),), n_layers=2, head=True)
    bundle = build_bundle(kept, {})
    m = Model(bundle, precision="bf16", recompute=recompute)
    prog = m.program(2, 8)
    derived = {st.outputs[0]: st for st in prog.steps if st.phase == "backward" and not st.recompute}
    back = {k: v for k, v in prog.computes.items() if k in derived}
    # per layer, the two products of h's matmul: the gradient of its input (a product with w1), and w1's
    products = {k for k, st in derived.items() for i in (0, 1) if st.op.type == "matmul"
                and (f"blocks.{i}.w1" in st.inputs or k == f"blocks.{i}.d_w1")}
    assert len(products) == 4 and set(back) == products, back
    assert set(back.values()) == {"fp32"} and not products & prog.rounded
    replays = {k for k in prog.computes if k not in derived}  # h itself, and its replays under block
    assert {prog.computes[k] for k in replays} == {"fp32"}
    assert len(replays) == (4 if recompute == "block" else 2)
    g = grads(m)
    for i in (0, 1):
        assert bf16_share(g[f"blocks.{i}.w1"]) < 0.1  # fp32 products
        assert bf16_share(g[f"blocks.{i}.w2"]) == 1.0  # the recipe's bf16 matmul
    if recompute == "block":  # replays never change results
        plain = Model(bundle, precision="bf16")
        assert all(np.array_equal(g[k], v) for k, v in grads(plain).items())


def test_a_bf16_block_under_fp32_has_bf16_gradient_products() -> None:
    """``@precision(policy="bf16")`` on the block: its ops compute as the bf16 recipe would, their
    backward too (both matmuls' products bf16), the model around it in fp32 (the LM head's)."""
    bundle = build_bundle(annotated_lm("Bf16Block", cls_ann=(precision(policy="bf16"),), head=True), {})
    m = Model(bundle, precision="fp32")
    prog = m.program(2, 8)
    backward = {st.outputs[0] for st in prog.steps if st.phase == "backward" and st.op.type == "matmul"}
    assert backward <= set(prog.computes) and {prog.computes[k] for k in backward} == {"bf16"}
    g = grads(m)
    assert bf16_share(g["blocks.0.w1"]) == bf16_share(g["blocks.0.w2"]) == 1.0
    assert bf16_share(g["head"]) < 0.1
