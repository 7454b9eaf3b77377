"""Logit soft-capping and ALiBi in ``attention`` against a per-query loop written from their definitions
(Gemma-2's ``c * tanh(s / c)``; ALiBi's ``-slope_h * |p - j|`` with the paper's slopes). Gradients go
through the generic finite-difference harness (test_op_gradients.py), whose attention samples use both."""

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
from kiln.core.ops.library._attention import alibi_slopes

REGISTRY = op_registry()


def paper_slopes(heads: int) -> list[float]:
    """Press et al.: for n a power of two, the geometric sequence starting at and with ratio 2^(-8/n); else
    those of the largest power of two below, then every other slope of twice that many heads."""
    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(heads).is_integer():
        return power_of_two(heads)
    below = 2 ** math.floor(math.log2(heads))
    return power_of_two(below) + power_of_two(2 * below)[0::2][: heads - below]


def oracle(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, causal: bool, window: int | None,
           softcap: float | None, alibi: bool, segments: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    slopes = paper_slopes(hq)
    out, lse = np.zeros_like(q), np.zeros((b, hq, tq))
    for bi in range(b):
        for i in range(tq):
            p = i + tk - tq
            for h in range(hq):
                logits: dict[int, float] = {}
                for j in range(tk):
                    if causal and j > p:
                        continue
                    if window is not None and (j <= p - window or (not causal and j >= p + window)):
                        continue
                    if segments is not None and segments[bi, p] != segments[bi, j]:
                        continue
                    s = sum(q[bi, i, h, c] * k[bi, j, h // (hq // hkv), c] for c in range(d)) / math.sqrt(d)
                    if softcap is not None:
                        s = softcap * math.tanh(s / softcap)
                    if alibi:
                        s -= slopes[h] * abs(p - j)
                    logits[j] = s
                top = max(logits.values())
                z = sum(math.exp(s - top) for s in logits.values())
                lse[bi, h, i] = top + math.log(z)
                for j, s in logits.items():
                    out[bi, i, h] += math.exp(s - top) / z * v[bi, j, h // (hq // hkv)]
    return out, lse


def test_alibi_slopes_are_the_papers() -> None:
    np.testing.assert_allclose(alibi_slopes(8), [2.0 ** -i for i in range(1, 9)], rtol=1e-15)
    for heads in (1, 3, 6, 12):
        np.testing.assert_allclose(alibi_slopes(heads), paper_slopes(heads), rtol=1e-15)


CASES = [
    ({"softcap": 1.5}, None),
    ({"softcap": 0.5, "causal": False}, None),
    ({"alibi": True}, None),
    ({"alibi": True, "causal": False, "window_size": 2}, None),
    ({"softcap": 2.0, "alibi": True}, np.array([[1, 1, 2, 2, 2], [0, 1, 1, 1, 1]])),
]


@pytest.mark.parametrize(("attrs", "segments"), CASES)
def test_softcap_and_alibi_match_a_per_query_loop(attrs: dict[str, Any], segments: np.ndarray | None) -> None:
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((2, 4, 6, 3)) * 3, rng.standard_normal((2, 5, 2, 3)) * 3, \
        rng.standard_normal((2, 5, 2, 3))
    inputs = (q, k, v) if segments is None else (q, k, v, segments)
    out, lse = REGISTRY.get_op("attention").run(inputs, attrs)
    want_out, want_lse = oracle(q, k, v, causal=attrs.get("causal", True), window=attrs.get("window_size"),
                                softcap=attrs.get("softcap"), alibi=attrs.get("alibi", False),
                                segments=segments)
    np.testing.assert_allclose(out, want_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-10)
    plain_out, _ = REGISTRY.get_op("attention").run(inputs, {k: a for k, a in attrs.items()
                                                              if k not in ("softcap", "alibi")})
    assert np.max(np.abs(out - plain_out)) > 1e-3  # the attributes change the result


def test_softcap_must_be_positive() -> None:
    opdef = REGISTRY.get_op("attention")
    ins = [TensorType(parse_shape(["B", "T", "H", "D"]), "fp32")] * 3
    with pytest.raises(OpError, match="softcap must be > 0"):
        opdef.infer(InferContext("attention", ins, opdef.resolve_attrs({"softcap": 0.0})))


@pytest.mark.parametrize(("attrs", "segments"), CASES)
def test_flash_attention_takes_softcap_and_alibi_as_attention_does(attrs: dict[str, Any],
                                                                   segments: np.ndarray | None) -> None:
    """Packed qkv through flash_attention equals its unpacked q, k, v through attention (itself checked
    against the per-query loop above), forward and backward."""
    rng = np.random.default_rng(5)
    b, t, hq, hkv, d = 2, 5, 6, 2, 3
    qkv = rng.standard_normal((b, t, (hq + 2 * hkv) * d)) * 3
    q = qkv[..., :hq * d].reshape(b, t, hq, d)
    k = qkv[..., hq * d:(hq + hkv) * d].reshape(b, t, hkv, d)
    v = qkv[..., (hq + hkv) * d:].reshape(b, t, hkv, d)
    heads = {"Hq": hq, "Hkv": hkv, "D": d}
    seg = () if segments is None else (segments,)
    out, lse = REGISTRY.get_op("flash_attention").run((qkv, *seg), {**heads, **attrs})
    want_out, want_lse = oracle(q, k, v, causal=attrs.get("causal", True), window=attrs.get("window_size"),
                                softcap=attrs.get("softcap"), alibi=attrs.get("alibi", False),
                                segments=segments)
    np.testing.assert_allclose(out, want_out.reshape(b, t, hq * d), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-10)
    d_out = rng.standard_normal(out.shape)
    (d_qkv,) = REGISTRY.get_op("flash_attention_backward").run((d_out, qkv, out, lse, None, *seg),
                                                               {**heads, **attrs})
    a_out, a_lse = REGISTRY.get_op("attention").run((q, k, v, *seg), attrs)
    dq, dk, dv = REGISTRY.get_op("attention_backward").run(
        (d_out.reshape(q.shape), q, k, v, a_out, a_lse, None, *seg), attrs)
    np.testing.assert_allclose(d_qkv, np.concatenate([g.reshape(b, t, -1) for g in (dq, dk, dv)], axis=-1),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("op", ["attention", "flash_attention"])
@pytest.mark.parametrize("softcap", [0.0, -1.0])
def test_softcap_must_be_positive_in_both_attention_ops(op: str, softcap: float) -> None:
    opdef = REGISTRY.get_op(op)
    if op == "attention":
        ins = [TensorType(parse_shape(["B", "T", "H", "D"]), "fp32")] * 3
        attrs: dict[str, Any] = {"softcap": softcap}
    else:
        ins = [TensorType(parse_shape(["B", "T", 12]), "fp32")]
        attrs = {"Hq": 2, "Hkv": 1, "D": 3, "softcap": softcap}
    with pytest.raises(OpError, match=f"softcap must be > 0, found {softcap}"):
        opdef.infer(InferContext(op, ins, opdef.resolve_attrs(attrs)))
    with pytest.raises(OpError, match="alibi"):
        opdef.resolve_attrs({**attrs, "softcap": None, "alibi": "yes"})
