"""The explicit ``cast`` op (seed 004 §7.4.4): reference kernel, shape rule, backward (cast back).

Oracles: ml_dtypes' and NumPy's own conversions (round to nearest, ties to even), and for the
gradient the straight-through rule checked by central float64 finite differences of a smooth
function of the cast's input where the cast is exact, plus the derived backward graph's ops.
"""

from __future__ import annotations

import numpy as np
import pytest

from kiln.core import KilnError, Model, op_registry
from kiln.core.autodiff import DeriveBackwardOptions, derive_backward
from kiln.core.ir import Bundle, Graph, Module, Op, ParamSpec, TensorDecl, TensorType
from kiln.core.ops import InferContext

ml_dtypes = pytest.importorskip("ml_dtypes", reason="casts to bf16/fp8 need ml_dtypes (kiln-core[bf16])")
CAST = op_registry().get_op("cast")


@pytest.mark.parametrize(("dtype", "np_type"), [("bf16", ml_dtypes.bfloat16), ("fp16", np.float16),
                                                ("fp8_e5m2", ml_dtypes.float8_e5m2)])
def test_the_kernel_rounds_to_nearest_even(dtype: str, np_type: object) -> None:
    x = np.random.default_rng(0).normal(0, 3, (64, 33)).astype(np.float32)
    got = CAST.kernel(x, dtype=dtype)
    assert got.dtype == np.float32 and got.shape == x.shape
    assert np.array_equal(got, x.astype(np_type).astype(np.float32))
    assert not np.array_equal(got, x)  # it does round
    assert np.array_equal(CAST.kernel(got, dtype=dtype), got)  # idempotent


def test_fp32_is_the_identity_and_fp8_e4m3_saturates() -> None:
    x = np.array([1.0 + 2.0 ** -20, -1000.0, 1000.0, 3.3], np.float32)
    assert np.array_equal(CAST.kernel(x, dtype="fp32"), x)
    assert CAST.kernel(x, dtype="fp8_e4m3").tolist() == [1.0, -448.0, 448.0, 3.25]


def test_the_shape_rule_names_the_dtype_and_refuses_integers() -> None:
    t = TensorType(("B", 8), "fp32")
    (out,) = CAST.infer(InferContext("cast", [t], {"dtype": "bf16"}))
    assert out == TensorType(("B", 8), "bf16")
    with pytest.raises(KilnError, match="int32"):
        CAST.infer(InferContext("cast", [TensorType(("B",), "int32")], {"dtype": "bf16"}))
    with pytest.raises(KilnError, match="dtype"):
        CAST.resolve_attrs({"dtype": "fp64"})


def test_the_backward_casts_the_gradient_back() -> None:
    g = Graph("G", inputs=[TensorDecl("x", ["N"], "fp32")], outputs=[TensorDecl("loss", ["N"], "fp32")],
              ops=[Op("cast", ["x"], ["h"], {"dtype": "bf16"}), Op("silu", ["h"], ["loss"])])
    res = derive_backward(g, DeriveBackwardOptions(loss_name="loss"))
    casts = [op for op in res.backward.ops if op.type == "cast"]
    assert len(casts) == 1 and casts[0].attrs["dtype"] == "fp32"
    assert res.grads["x"] in {o for op in res.backward.ops for o in op.outputs}


def test_a_model_with_a_cast_trains_on_straight_through_gradients() -> None:
    """loss = CE(head(cast(x @ w^T, bf16))): the cast's output holds bf16 values (2 bytes an element
    in the plan), the gradient flows through it unchanged (the head's gradient at the cast values by
    float64 finite differences, chained to ``w`` by hand)."""
    n = ["B * T"]
    model = Module(
        "CastChain", kind="model", config={"V": 12, "C": 8},
        params=[ParamSpec("embedding", ["V", "C"], "fp32", init={"kind": "normal", "std": 1.0}),
                ParamSpec("w", ["C", "C"], "fp32", init={"kind": "normal", "std": 0.5})],
        forward=Graph(
            "CastChain",
            inputs=[TensorDecl("token_ids", ["B", "T"], "int32"), TensorDecl("targets", ["B", "T"], "int32")],
            params=[TensorDecl("embedding", ["V", "C"], "fp32"), TensorDecl("w", ["C", "C"], "fp32")],
            ops=[Op("embedding", ["token_ids", "embedding"], ["x3"]),
                 Op("view", ["x3"], ["x"], {"shape": [*n, "C"]}),
                 Op("matmul", ["x", "w"], ["h"], {"transpose": "NT"}),
                 Op("cast", ["h"], ["hb"], {"dtype": "bf16"}),
                 Op("view", ["targets"], ["t"], {"shape": n}),
                 Op("fused_lm_head_loss", ["hb", "embedding", "t"], ["loss", "lse"])],
            outputs=[TensorDecl("loss", n, "fp32")]))
    m = Model.from_ir(Bundle([model], entry="CastChain"), seed=0)
    ids = np.random.default_rng(1).integers(0, 12, (2, 6))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    prog = m.program(*inputs.shape)
    assert "hb" in prog.rounded and prog.tensors["hb"].dtype == "bfloat16"
    assert "h" not in prog.rounded

    p = {k: v.astype(np.float64) for k, v in m.parameters().items()}
    t = labels.reshape(-1)

    x = p["embedding"][inputs.reshape(-1)]

    def head(h: np.ndarray) -> float:
        z = h @ p["embedding"].T
        lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
        return float(np.mean(lse - z[np.arange(len(t)), t]))

    h = x @ p["w"].T
    hb = h.astype(ml_dtypes.bfloat16).astype(np.float64)
    got, grads = m.loss_and_grads(inputs, labels)
    assert got == pytest.approx(head(hb), rel=1e-6)
    assert abs(head(hb) - head(h)) > 1e-5  # the cast is not ignored
    eps, d_hb = 1e-6, np.zeros_like(hb)
    for i in np.ndindex(*hb.shape):
        d = np.zeros_like(hb)
        d[i] = eps
        d_hb[i] = (head(hb + d) - head(hb - d)) / (2 * eps)
    # straight through: the cast passes d_hb to h unchanged, and d_w = d_h^T x
    np.testing.assert_allclose(grads["w"], d_hb.T @ x, rtol=1e-4, atol=1e-6)
