"""``@precision`` on the LM head's loss: the head computes in the annotated precision in a training step
(forward and backward run together, where a backend may fuse the head's two steps into one pass).

The oracle is a float64 NumPy computation of the tiny model below, written from the recipe's definition
(an annotated op computes and writes as its annotation says, the rest as the recipe says; the bf16 head
rounds its operands, its logits and their gradient, not its log-sum-exp) and rounded to bfloat16 with
ml_dtypes there. The fused pass computes as the recipe computes the head, so ``compile`` keeps the two
steps of a head an annotation moves off the recipe (on every backend) rather than fusing it in the
recipe's type."""

import numpy as np
import pytest

from kiln.core import Model
from kiln.dsl import build_bundle
from kiln.dsl.annotations import precision
from kiln.dsl.testing import V, head_lm

ml_dtypes = pytest.importorskip("ml_dtypes", reason="the bf16 recipe needs ml_dtypes (kiln-core[bf16])")



def r(x: np.ndarray) -> np.ndarray:
    """Round to bfloat16 (float64 values)."""
    return np.asarray(x, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def oracle(p: dict[str, np.ndarray], ids: np.ndarray, labels: np.ndarray, recipe: str,
           head: str) -> tuple[float, np.ndarray]:
    """The mean loss and the head's gradient in float64: ``y`` as the recipe computes it, the head's
    loss and backward in ``head`` (``"bf16"``: ``@precision(policy="bf16")``, its per-token loss
    written as bf16 too)."""
    p = {k: v.astype(np.float64) for k, v in p.items()}
    x = p["embedding"][ids.reshape(-1)]
    y = r(r(x) @ r(p["w"]).T) if recipe == "bf16" else x @ p["w"].T
    t = labels.reshape(-1)
    yh, wh = (r(y), r(p["head"])) if head == "bf16" else (y, p["head"])
    z = yh @ wh.T
    z = r(z) if head == "bf16" else z
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    per_token = lse - z[np.arange(len(t)), t]
    loss = float(np.mean(r(per_token) if head == "bf16" else per_token))
    g = np.exp(z - lse[:, None])  # the head's own bf16 kernels round x, weight, z and g, not its lse
    g[np.arange(len(t)), t] -= 1
    g /= len(t)  # d_loss of the mean
    d_head = r(r(g).T @ yh) if head == "bf16" else g.T @ yh
    return loss, d_head


CASES = [  # (recipe, annotation on the loss, where the head computes)
    ("fp32", precision(policy="bf16"), "bf16"),  # one head in bf16 under fp32
    ("bf16", precision(compute="fp32"), "fp32"),  # the head kept in fp32 under bf16
]


@pytest.mark.parametrize(("recipe", "ann", "head"), CASES)
def test_the_head_of_a_training_step_computes_in_its_annotated_precision(recipe, ann, head) -> None:
    i = [c[0] for c in CASES].index(recipe)
    m = Model(build_bundle(head_lm(f"HeadOverride{i}", ann), {}), precision=recipe)
    rng = np.random.default_rng(5)
    weights = {k: rng.normal(0, 0.7, v.shape).astype(np.float32) for k, v in m.parameters().items()}
    m.set_parameters(weights)
    ids = np.random.default_rng(1).integers(0, V, (2, 9))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    want, want_d_head = oracle(weights, inputs, labels, recipe, head)
    ignored = oracle(weights, inputs, labels, recipe, recipe)[0]  # the head as the recipe computes it
    assert abs(want - ignored) > 20 * 1e-6 * abs(want)  # the annotation is visible in the loss

    program = m.program(*inputs.shape)
    assert program.computes["loss"] == head
    assert program.fusions == ()  # the fused pass computes as the recipe does: not for this head
    loss, grads = m.loss_and_grads(inputs, labels)  # forward and backward together, as in training
    assert loss == pytest.approx(want, rel=1e-6)
    assert m.loss(inputs, labels, training=True) == loss  # the forward alone: the same head
    scale = float(np.abs(want_d_head).max())
    tol = 2 ** -8 * scale if head == "bf16" else 1e-5 * scale  # one bf16 rounding either side
    np.testing.assert_allclose(grads["head"], want_d_head, rtol=0, atol=tol)


def test_an_unannotated_fp32_head_is_fused() -> None:
    """The control: the same model without the annotation plans (and runs) the fused pass on NumPy, its
    loss and head gradient the float64 oracle's."""
    m = Model(build_bundle(head_lm("HeadPlain"), {}))
    rng = np.random.default_rng(5)
    weights = {k: rng.normal(0, 0.7, v.shape).astype(np.float32) for k, v in m.parameters().items()}
    m.set_parameters(weights)
    ids = np.random.default_rng(1).integers(0, V, (2, 9))
    (fusion,) = m.program(2, 8).fusions
    assert fusion.kernel == "fused_lm_head_loss_and_grad@numpy:float32"
    loss, grads = m.loss_and_grads(ids[:, :-1], ids[:, 1:])
    want, want_d_head = oracle(weights, ids[:, :-1], ids[:, 1:], "fp32", "fp32")
    assert loss == pytest.approx(want, rel=1e-6)
    np.testing.assert_allclose(grads["head"], want_d_head, rtol=0, atol=1e-5 * np.abs(want_d_head).max())
