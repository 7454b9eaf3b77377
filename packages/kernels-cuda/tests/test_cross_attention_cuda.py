"""``attention`` on separate q [B, Tq, Hq, D], k and v [B, Tk, Hkv, D] with Tq != Tk (cross attention), and
its backward, on the CUDA kernels through the CPU emulator against kiln-core's reference in float64: ragged
lengths either way, GQA, causal alignment to the end of the keys, windows, segments, soft-capping, ALiBi."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kiln.core import KilnError, op_registry
from kiln.cuda import _ops
from kiln.cuda._check import _to_device, _to_host
from kiln.cuda._emulate import EmulatedDevice

ATTRS = ("causal", "softmax_scale", "window_size", "softcap", "alibi")


def _inputs(rng: np.random.Generator, b: int, tq: int, tk: int, hq: int, hkv: int,
            d: int) -> list[np.ndarray]:
    shapes = ((b, tq, hq, d), (b, tk, hkv, d), (b, tk, hkv, d))
    return [rng.standard_normal(shape).astype(np.float32) for shape in shapes]


def _close(got: np.ndarray, want: np.ndarray, atol: float) -> None:
    """Equal within atol; infinite where the reference is (a query that sees no key: lse = +inf)."""
    inf = np.isinf(want)
    assert np.array_equal(np.isinf(got), inf) and np.array_equal(got[inf], want[inf])
    assert np.abs(got[~inf] - want[~inf]).max(initial=0.0) <= atol


def _check(dev: EmulatedDevice, b: int, tq: int, tk: int, hq: int, hkv: int, d: int, segments: Any = None,
           d_lse: bool = False, **attrs: Any) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(tq * 100 + tk)
    q, k, v = _inputs(rng, b, tq, tk, hq, hkv, d)
    seg = None if segments is None else np.asarray(segments, np.int32)
    full = {a: attrs.get(a, {"causal": True, "alibi": False}.get(a)) for a in ATTRS}
    ref = op_registry().get_op("attention").kernel
    want_o, want_lse = ref(*(x.astype(np.float64) for x in (q, k, v)), seg, **full)
    ins = [_to_device(dev, x) for x in (q, k, v, seg)]
    outs = [_to_device(dev, np.full(s, np.nan, np.float32)) for s in (q.shape, (b, hq, tq))]
    launches = dev.launches
    _ops.attention(*ins, out=outs, **attrs)
    assert dev.launches == launches + (1 if b * tq else 0)  # one kernel, nothing on the host
    o, lse = (_to_host(x) for x in outs)  # type: ignore[arg-type]
    _close(o, want_o, 2e-5)
    _close(lse, want_lse, 2e-5)

    d_out = rng.standard_normal(q.shape).astype(np.float32)
    dl = rng.standard_normal(lse.shape).astype(np.float32) if d_lse else None
    want = op_registry().get_op("attention_backward").kernel(
        d_out.astype(np.float64), *(x.astype(np.float64) for x in (q, k, v)), want_o, want_lse,
        None if dl is None else dl.astype(np.float64), seg, **full)
    grads = [_to_device(dev, np.full(x.shape, np.nan, np.float32)) for x in (q, k, v)]
    _ops.attention_backward(_to_device(dev, d_out), *ins[:3], outs[0], outs[1], _to_device(dev, dl), ins[3],
                            out=grads, **attrs)
    got = [_to_host(g) for g in grads]  # type: ignore[arg-type]
    for g, w in zip(got, want, strict=True):
        assert np.abs(g - w).max(initial=0.0) <= 5e-5
    return o, lse, *got


@pytest.mark.parametrize(("tq", "tk", "attrs"), [
    (5, 13, {}),  # causal: query i sees keys up to i + 8
    (5, 13, {"causal": False}),
    (13, 5, {"causal": False}),  # more queries than keys
    (7, 33, {"window_size": 4, "softmax_scale": 0.3}),  # 33 keys: past a warp
    (9, 4, {"causal": False, "window_size": 3}),
    (6, 11, {"softcap": 1.5, "alibi": True}),
    (11, 6, {"causal": False, "softcap": 0.8, "alibi": True}),
], ids=["causal", "full", "longer-q", "window", "longer-q-window", "softcap-alibi", "longer-q-softcap-alibi"])
def test_cross_attention_matches_the_reference(emulated: EmulatedDevice, tq: int, tk: int,
                                               attrs: dict[str, Any]) -> None:
    """GQA (6 query heads over 2 kv heads, so ALiBi has slopes past a power of two), D = 40 (two dims per
    lane for some lanes), two sequences."""
    _check(emulated, 2, tq, tk, 6, 2, 40, d_lse=True, **attrs)


def test_causal_queries_before_every_key_see_nothing(emulated: EmulatedDevice) -> None:
    """Tq = 9 > Tk = 4, causal: queries 0..4 sit before key 0 (out 0, lse +inf, no gradient), as the
    reference defines it; the rest see keys 0..i - 5. A head dim past one lane's share (D = 72)."""
    o, lse, dq, dk, dv = _check(emulated, 1, 9, 4, 2, 1, 72)
    assert np.isinf(lse[..., :5]).all() and np.isfinite(lse[..., 5:]).all()
    assert not o[:, :5].any() and not dq[:, :5].any()
    assert dk.any() and dv.any()


def test_segments_restrict_cross_attention_to_the_querys_document(emulated: EmulatedDevice) -> None:
    """Segment ids [B, Tk]: query i belongs to the segment of key position i + Tk - Tq; padding (0) is its
    own segment. Without the segments the result differs (the mask is live)."""
    seg = [[1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3], [0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2]]
    for attrs in ({}, {"causal": False}, {"causal": False, "window_size": 5, "alibi": True}):
        with_seg = _check(emulated, 2, 6, 11, 4, 2, 24, segments=seg, d_lse=True, **attrs)
        without = _check(emulated, 2, 6, 11, 4, 2, 24, **attrs)
        assert np.abs(with_seg[0] - without[0]).max() > 1e-2


def test_same_length_attention_runs_the_same_kernels(emulated: EmulatedDevice) -> None:
    """Tq == Tk is the flash kernels' case: the same results as the reference, segments and all."""
    _check(emulated, 2, 7, 7, 4, 2, 40, segments=[[1, 1, 1, 2, 2, 2, 2], [0, 0, 1, 1, 1, 1, 1]], d_lse=True)


def test_what_the_kernels_cannot_do_is_a_kiln_error(emulated: EmulatedDevice) -> None:
    rng = np.random.default_rng(0)

    def run(tq: int, tk: int, hq: int = 2, hkv: int = 1, d: int = 8, seg: Any = None, **attrs: Any) -> None:
        ins = [_to_device(emulated, x) for x in _inputs(rng, 1, tq, tk, hq, hkv, d)]
        s = None if seg is None else _to_device(emulated, np.asarray(seg, np.int32))
        outs = [_to_device(emulated, np.zeros(sh, np.float32)) for sh in ((1, tq, hq, d), (1, hq, tq))]
        _ops.attention(*ins, s, out=outs, **attrs)

    with pytest.raises(KilnError, match=r"segment ids need Tq <= Tk .* found Tq = 5 > Tk = 3"):
        run(5, 3, seg=[[1, 1, 2]], causal=False)
    with pytest.raises(KilnError, match=r"segment_ids must be \[B, Tk\] = \[1, 3\], found \[1, 2\]"):
        run(2, 3, seg=[[1, 1]])
    with pytest.raises(KilnError, match=r"Hq = 3 is not a multiple of Hkv = 2"):
        run(2, 3, hq=3, hkv=2)
    with pytest.raises(KilnError, match=r"head dim 264 > 256, the limit of the SIMT kernel"):
        run(2, 3, d=264)
    with pytest.raises(KilnError, match=r"window_size must be >= 1, found 0"):
        run(2, 3, window_size=0)
