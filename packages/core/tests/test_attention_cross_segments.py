"""``segment_ids`` in cross attention (``Tq != Tk``): query ``i`` takes the segment of its key position
``p = i + Tk - Tq`` (queries aligned to the end of the keys, as the masks and the cuda kernels align them).
With fewer queries than keys that is checked against a dense float64 oracle written from that definition;
with more queries than keys the first queries have no key position, which is an ``OpError`` naming the op
and both lengths (in the shape rule once lengths are bound, and in the reference kernels), not a NumPy
broadcast error."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.core import KilnError, op_registry
from kiln.core._errors import OpError
from kiln.core.ir._dims import parse_shape
from kiln.core.ir._ir import TensorType
from kiln.core.ops._ops import InferContext

REGISTRY = op_registry()


def dense(q: np.ndarray, k: np.ndarray, v: np.ndarray, seg: np.ndarray,
          causal: bool) -> tuple[np.ndarray, ...]:
    """Softmax attention over a [B, H, Tq, Tk] mask: key j visible to query i when seg[p] == seg[j]
    (and j <= p when causal), p = i + Tk - Tq; one head group per kv head."""
    _, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    kk, vv = np.repeat(k, hq // hkv, axis=2), np.repeat(v, hq // hkv, axis=2)
    s = np.einsum("bihc,bjhc->bhij", q, kk) / np.sqrt(d)
    p = np.arange(tq)[:, None] + tk - tq
    j = np.arange(tk)[None, :]
    keep = seg[:, None, p[:, 0], None] == seg[:, None, None, :]
    if causal:
        keep = keep & (j <= p)
    s = np.where(keep, s, -np.inf)
    top = s.max(-1, keepdims=True)
    e = np.exp(s - top)
    lse = (top + np.log(e.sum(-1, keepdims=True)))[..., 0]
    return np.einsum("bhij,bjhc->bihc", e / e.sum(-1, keepdims=True), vv), lse


@pytest.mark.parametrize("causal", [True, False])
def test_fewer_queries_than_keys_take_their_key_positions_segment(causal: bool) -> None:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 3, 4, 5))
    k, v = rng.standard_normal((2, 6, 2, 5)), rng.standard_normal((2, 6, 2, 5))
    seg = np.array([[1, 1, 1, 2, 2, 2], [1, 2, 2, 3, 3, 3]])
    out, lse = REGISTRY.get_op("attention").run((q, k, v, seg), {"causal": causal})
    want_out, want_lse = dense(q, k, v, seg, causal)
    np.testing.assert_allclose(out, want_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-10)
    # the segments are visible: without them the first query of each sequence sees other segments' keys
    plain, _ = REGISTRY.get_op("attention").run((q, k, v), {"causal": causal})
    assert np.abs(plain - out).max() > 1e-3


def test_more_queries_than_keys_with_segment_ids_is_an_op_error() -> None:
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 6, 2, 4))
    k, v = rng.standard_normal((1, 4, 2, 4)), rng.standard_normal((1, 4, 2, 4))
    seg = np.array([[1, 1, 2, 2]])
    for causal in (True, False):
        with pytest.raises(OpError, match=r"op 'attention': segment_ids need Tq <= Tk .* Tq = 6 .* Tk = 4"):
            REGISTRY.get_op("attention").run((q, k, v, seg), {"causal": causal})
    # the backward kernel too (its inputs as a forward without segments gives them)
    out, lse = REGISTRY.get_op("attention").run((q, k, v), {"causal": False})
    with pytest.raises(OpError, match=r"op 'attention_backward': segment_ids need Tq <= Tk .* Tq = 6"):
        REGISTRY.get_op("attention_backward").run((np.ones_like(out), q, k, v, out, lse, None, seg),
                                                  {"causal": False})
    # without segment ids more queries than keys stay valid (the masks align them the same way)
    assert REGISTRY.get_op("attention").run((q, k, v), {"causal": False})[0].shape == q.shape


def test_the_shape_rule_refuses_bound_lengths_and_keeps_symbolic_ones() -> None:
    op = REGISTRY.get_op("attention")

    def infer(tq: object, tk: object) -> list[TensorType]:
        kv = TensorType(parse_shape(["B", tk, 2, 4]), "fp32")
        types = [TensorType(parse_shape(["B", tq, 2, 4]), "fp32"), kv, kv,
                 TensorType(parse_shape(["B", tk]), "int32")]
        return list(op.infer(InferContext("attention", types, op.resolve_attrs({}))))

    want = r"op 'attention': segment_ids need Tq <= Tk .* Tq = 8 and k with Tk = 5"
    with pytest.raises(KilnError, match=want):
        infer(8, 5)
    with pytest.raises(KilnError, match=r"segment_ids need Tq <= Tk"):
        infer("T + 2", "T")  # provably more queries, before binding
    assert len(infer(5, 8)) == 2 and len(infer("Tq", "Tk")) == 2  # symbolic: checked once bound
