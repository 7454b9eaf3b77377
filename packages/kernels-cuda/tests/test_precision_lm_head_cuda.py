"""``@precision`` on the LM head's loss on ``cuda`` (over the CPU emulator): as on NumPy, a head the
annotation moves off the recipe keeps its two steps (the fused pass computes as the recipe computes the
head), so it trains as NumPy's emulation of the override (the oracle; kiln-dsl's
``test_precision_lm_head.py`` checks that one against float64), and the roofline does not count a
fusion that is not run. Under the ``bf16`` recipe alone the Program names the bf16 pass it runs."""

import numpy as np
import pytest

from kiln.core import Model, PluginSession, compile
from kiln.cuda import EmulatedCuda, EmulatedDevice

pytest.importorskip("ml_dtypes", reason="the bf16 recipe needs ml_dtypes")
dsl = pytest.importorskip("kiln.dsl", reason="the annotated model is written in kiln-dsl")
from kiln.dsl import build_bundle  # noqa: E402
from kiln.dsl.annotations import precision  # noqa: E402
from kiln.dsl.testing import V, head_lm  # noqa: E402

FUSED = "fused_lm_head_loss_and_grad"


CASES = {  # id: (recipe, annotation on the loss, where the head computes)
    "bf16-head-under-fp32": ("fp32", precision(policy="bf16"), "bf16"),
    "fp32-head-under-bf16": ("bf16", precision(compute="fp32"), "fp32"),
}


@pytest.fixture(scope="module")
def session(cache):
    s = PluginSession(autoload=False)
    s.register(EmulatedCuda(EmulatedDevice(cache=cache / "emulated")), "cuda-emulated")
    with s.activate():
        yield s


@pytest.mark.parametrize("case", list(CASES))
def test_an_overridden_head_is_not_fused_and_trains_as_on_numpy(case: str, session) -> None:
    from kiln.cuda._roofline import roofline

    recipe, ann, head = CASES[case]
    bundle = build_bundle(head_lm(f"CudaHead{case.replace('-', '')}", ann), {})
    program = compile(bundle, bindings={"B": 2, "T": 8}, backend="cuda", precision=recipe)
    assert program.computes["loss"] == head
    assert program.fusions == ()
    costs = roofline(program, "h100", "bf16").by_op
    assert FUSED not in costs
    assert costs["fused_lm_head_loss"][1] == costs["fused_lm_head_loss_backward"][1] == 1

    ref, got = (Model.from_ir(bundle, seed=0, backend=b, precision=recipe) for b in ("numpy", "cuda"))
    w = {k: np.random.default_rng(5).normal(0, 0.7, v.shape).astype(np.float32)
         for k, v in ref.parameters().items()}
    ids = np.random.default_rng(1).integers(0, V, (2, 9))
    for m in (ref, got):
        m.set_parameters(w)
    (want_loss, want), (loss, grads) = (m.loss_and_grads(ids[:, :-1], ids[:, 1:]) for m in (ref, got))
    assert loss == pytest.approx(want_loss, rel=2e-6)
    for k in want:
        assert np.abs(grads[k] - want[k]).max() <= 2e-6 * float(np.abs(want[k]).max()), k


def test_the_bf16_recipe_names_the_bf16_pass(session) -> None:
    """Without an annotation, the head under ``bf16`` fuses, and the Program names the kernel it runs."""
    bundle = build_bundle(head_lm("CudaHeadPlain"), {})
    (fusion,) = compile(bundle, bindings={"B": 2, "T": 8}, backend="cuda", precision="bf16").fusions
    assert fusion.kernel == f"{FUSED}@cuda:bfloat16"
