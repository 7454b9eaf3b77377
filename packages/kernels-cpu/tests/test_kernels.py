"""Each native kernel against the NumPy kernel it replaces (the oracle: kiln-core's NumPy kernels,
themselves checked against float64 finite differences), on random shapes, ragged ones included."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from kiln.cpu import OPS

ROWS_COLS = [(1, 1), (3, 7), (37, 64), (100, 129), (2, 3, 257)]  # ragged: not multiples of a vector


def rand(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def both(tables: dict[str, Any], op: str, dtype: str = "float32") -> tuple[Any, Any]:
    native, numpy = tables["native"].find(op, "numpy", dtype), tables["numpy"].find(op, "numpy", "*")
    assert native.key == f"{op}@numpy:float32" and native.fn is not numpy.fn
    assert native.out == numpy.out and native.inplace == numpy.inplace
    return native, numpy


def run(kernel: Any, inputs: list[np.ndarray | None], shapes: list[tuple[int, ...]], **attrs: Any
        ) -> list[np.ndarray]:
    outs = [np.full(s, np.nan, np.float32) for s in shapes]
    kernel.fn(*[None if a is None else a.copy() for a in inputs], out=outs, **attrs)
    return outs


def close(got: list[np.ndarray], want: list[np.ndarray], rtol: float = 1e-5, atol: float = 1e-6) -> None:
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


def test_every_op_has_a_native_float32_kernel_and_float64_keeps_numpy(tables: dict[str, Any]) -> None:
    for op in OPS:
        both(tables, op)
        assert tables["native"].find(op, "numpy", "float64").key == f"{op}@numpy:*"


@pytest.mark.parametrize("shape", ROWS_COLS, ids=str)
def test_rmsnorm_forward_and_apply_saved(tables: dict[str, Any], shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(sum(shape))
    x, w = rand(rng, *shape, scale=3), rand(rng, shape[-1])
    native, numpy = both(tables, "rmsnorm")
    got = run(native, [x, w], [shape, shape[:-1]], eps=1e-6)
    close(got, run(numpy, [x, w], [shape, shape[:-1]], eps=1e-6))
    # the recompute variant rebuilds y from the saved rstd bit for bit
    native_apply, _ = both(tables, "rmsnorm_apply_saved")
    assert np.array_equal(run(native_apply, [x, got[1], w], [shape])[0], got[0])


@pytest.mark.parametrize("shape", ROWS_COLS, ids=str)
def test_fused_residual_rmsnorm_forward_and_apply_saved(tables: dict[str, Any],
                                                        shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(sum(shape) + 1)
    a, x, w = rand(rng, *shape), rand(rng, *shape), rand(rng, shape[-1])
    native, numpy = both(tables, "fused_residual_rmsnorm")
    shapes = [shape, shape, shape[:-1]]
    got = run(native, [a, x, w], shapes, eps=0.1)
    close(got, run(numpy, [a, x, w], shapes, eps=0.1))
    native_apply, numpy_apply = both(tables, "fused_residual_rmsnorm_apply_saved")
    replay = run(native_apply, [a, x, got[2], w], shapes[:2])
    assert all(np.array_equal(r, g) for r, g in zip(replay, got[:2], strict=True))
    assert all(np.array_equal(r, g) for r, g in zip(run(numpy_apply, [a, x, got[2], w], shapes[:2]), got[:2],
                                                    strict=True))


def test_fused_residual_rmsnorm_in_place(tables: dict[str, Any]) -> None:
    """residual_out may take over the residual's storage (the op's in-place input)."""
    rng = np.random.default_rng(5)
    a, x, w = rand(rng, 9, 33), rand(rng, 9, 33), rand(rng, 33)
    native, numpy = both(tables, "fused_residual_rmsnorm")
    want = run(numpy, [a, x, w], [a.shape, a.shape, a.shape[:-1]], eps=1e-6)
    res, y, rstd = a.copy(), np.empty_like(a), np.empty(9, np.float32)
    native.fn(res, x, w, out=[res, y, rstd], eps=1e-6)
    close([res, y, rstd], want)


@pytest.mark.parametrize("shape", ROWS_COLS, ids=str)
@pytest.mark.parametrize("has", ["dy", "dy+drstd", "drstd"])
def test_rmsnorm_backward(tables: dict[str, Any], shape: tuple[int, ...], has: str) -> None:
    rng = np.random.default_rng(sum(shape) + 2)
    x, w = rand(rng, *shape, scale=2), rand(rng, shape[-1])
    rstd = (1 / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1) + 1e-6)).astype(np.float32)
    d_y = rand(rng, *shape) if "dy" in has else None
    d_rstd = rand(rng, *shape[:-1]) if "drstd" in has else None
    native, numpy = both(tables, "rmsnorm_backward")
    shapes = [shape, w.shape]
    close(run(native, [d_y, x, rstd, w, d_rstd], shapes), run(numpy, [d_y, x, rstd, w, d_rstd], shapes),
          atol=1e-5)


@pytest.mark.parametrize("shape", ROWS_COLS, ids=str)
@pytest.mark.parametrize("has", ["dy+dres", "dy", "dres+drstd"])
def test_fused_residual_rmsnorm_backward(tables: dict[str, Any], shape: tuple[int, ...], has: str) -> None:
    rng = np.random.default_rng(sum(shape) + 3)
    res, w = rand(rng, *shape, scale=2), rand(rng, shape[-1])
    rstd = (1 / np.sqrt(np.mean(res.astype(np.float64) ** 2, axis=-1) + 1e-6)).astype(np.float32)
    d_y = rand(rng, *shape) if "dy" in has else None
    d_res = rand(rng, *shape) if "dres" in has else None
    d_rstd = rand(rng, *shape[:-1]) if "drstd" in has else None
    native, numpy = both(tables, "fused_residual_rmsnorm_backward")
    inputs, shapes = [d_y, d_res, res, rstd, w, d_rstd], [shape, shape, w.shape]
    got = run(native, inputs, shapes)
    close(got, run(numpy, inputs, shapes), atol=1e-5)
    assert np.array_equal(got[0], got[1])
    # an unused d_residual: d_x alone
    d_x, d_w = np.empty(shape, np.float32), np.empty(w.shape, np.float32)
    native.fn(*inputs, out=[None, d_x, d_w])
    assert np.array_equal(d_x, got[1]) and np.array_equal(d_w, got[2])


def test_backward_weight_gradient_does_not_depend_on_threads(tables: dict[str, Any],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(11)
    x, w, d_y = rand(rng, 300, 48), rand(rng, 48), rand(rng, 300, 48)
    rstd = (1 / np.sqrt(np.mean(x**2, axis=-1) + 1e-6)).astype(np.float32)
    native, _ = both(tables, "rmsnorm_backward")
    import kiln.cpu._kernels as k

    results = []
    for n in (1, 2, 3):
        monkeypatch.setattr(k, "threads", lambda n=n: n)
        results.append(run(native, [d_y, x, rstd, w, None], [x.shape, w.shape]))
    assert all(np.array_equal(a, b) for r in results[1:] for a, b in zip(r, results[0], strict=True))


def _silu_mul64(g: np.ndarray, u: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float64 oracle: silu(g) * u and its gradients."""
    g, u, d = (a.astype(np.float64) for a in (g, u, d))
    s = 1 / (1 + np.exp(-g))
    return g * s * u, d * u * s * (1 + g * (1 - s)), d * g * s


def close_scaled(got: np.ndarray, want: np.ndarray, oracle: np.ndarray) -> None:
    """Within 1e-5 of the float64 oracle (relative, or of the tensor's scale), and of the NumPy kernel
    (whose silu(g) = a (1 + tanh a), a = g / 2, loses digits to cancellation for negative g)."""
    scale = float(np.abs(oracle).max()) + 1e-30  # float32 flushes what is below its range to 0
    np.testing.assert_allclose(got, oracle, rtol=1e-5, atol=1e-6 * scale)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("shape", [(1, 2), (3, 14), (37, 130), (2, 5, 1538)], ids=str)
def test_swiglu(tables: dict[str, Any], shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(sum(shape) + 4)
    x, half = rand(rng, *shape, scale=4), (*shape[:-1], shape[-1] // 2)
    extremes = np.array([-100.0, 100.0, -30.0, 0.0], np.float32)[: x.shape[-1] // 2]
    x.reshape(-1, x.shape[-1])[0, : len(extremes)] = extremes
    d = rand(rng, *half)
    m = shape[-1] // 2
    out64, dg64, du64 = _silu_mul64(x[..., :m], x[..., m:], d)
    native, numpy = both(tables, "swiglu")
    close_scaled(run(native, [x], [half])[0], run(numpy, [x], [half])[0], out64)
    native_b, numpy_b = both(tables, "swiglu_backward")
    want = run(numpy_b, [d, x], [shape])[0]
    oracle = np.concatenate([dg64, du64], axis=-1)
    close_scaled(run(native_b, [d, x], [shape])[0], want, oracle)
    assert native_b.inplace == {1}  # d_x may take over x's storage
    x_in_place = x.copy()
    native_b.fn(d, x_in_place, out=[x_in_place])
    close_scaled(x_in_place, want, oracle)


@pytest.mark.parametrize("shape", [(1,), (3, 7), (33, 129)], ids=str)
def test_silu_mul(tables: dict[str, Any], shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(sum(shape) + 6)
    g, u, d = rand(rng, *shape, scale=4), rand(rng, *shape), rand(rng, *shape)
    out64, dg64, du64 = _silu_mul64(g, u, d)
    native, numpy = both(tables, "silu_mul")
    close_scaled(run(native, [g, u], [shape])[0], run(numpy, [g, u], [shape])[0], out64)
    native_b, numpy_b = both(tables, "silu_mul_backward")
    got, want = run(native_b, [d, g, u], [shape, shape]), run(numpy_b, [d, g, u], [shape, shape])
    for a, b, o in zip(got, want, (dg64, du64), strict=True):
        close_scaled(a, b, o)


@pytest.mark.parametrize("shape", [(1,), (3, 7), (33, 129), (2, 3, 1000)], ids=str)
def test_silu(tables: dict[str, Any], shape: tuple[int, ...]) -> None:
    """silu and its backward against the float64 oracle and the NumPy kernel, extremes included."""
    rng = np.random.default_rng(sum(shape) + 9)
    x, d = rand(rng, *shape, scale=4), rand(rng, *shape)
    extremes = np.array([-100.0, 100.0, -30.0, 0.0], np.float32)[: x.size]
    x.reshape(-1)[: len(extremes)] = extremes
    out64, dx64, _ = _silu_mul64(x, np.ones_like(x), d)
    native, numpy = both(tables, "silu")
    close_scaled(run(native, [x], [shape])[0], run(numpy, [x], [shape])[0], out64)
    native_b, numpy_b = both(tables, "silu_backward")
    close_scaled(run(native_b, [d, x], [shape])[0], run(numpy_b, [d, x], [shape])[0], dx64)


def _gelu64(x: np.ndarray, tanh_form: bool) -> tuple[np.ndarray, np.ndarray]:
    """float64 oracle: gelu(x) and its derivative (math.erf, or the tanh form)."""
    x = x.astype(np.float64)
    if tanh_form:
        c = math.sqrt(2 / math.pi)
        t = np.tanh(c * (x + 0.044715 * x**3))
        return 0.5 * x * (1 + t), 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)
    cdf = 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    return x * cdf, cdf + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


@pytest.mark.parametrize("shape", [(1,), (3, 7), (33, 129)], ids=str)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_geglu_and_backward(tables: dict[str, Any], shape: tuple[int, ...], approximate: str) -> None:
    """gelu, gelu_backward and geglu against the float64 oracle and the NumPy kernel, extremes included
    (the NumPy kernel's 1 + erf loses digits for negative x: the C kernel uses erfc)."""
    rng = np.random.default_rng(sum(shape) + 41)
    x, d, up = rand(rng, *shape, scale=3), rand(rng, *shape), rand(rng, *shape)
    extremes = np.array([-30.0, 30.0, -6.0, 0.0], np.float32)[: x.size]
    x.reshape(-1)[: len(extremes)] = extremes
    out64, grad64 = _gelu64(x, approximate == "tanh")
    native, numpy = both(tables, "gelu")
    close_scaled(native.fn(x, approximate=approximate), numpy.fn(x, approximate=approximate), out64)
    native_b, numpy_b = both(tables, "gelu_backward")
    close_scaled(native_b.fn(d, x, approximate=approximate), numpy_b.fn(d, x, approximate=approximate),
                 d * grad64)
    native_g, numpy_g = both(tables, "geglu")
    close_scaled(native_g.fn(x, up, approximate=approximate), numpy_g.fn(x, up, approximate=approximate),
                 out64 * up)


def test_exact_gelu_is_float32_accurate_over_a_dense_range(tables: dict[str, Any]) -> None:
    """The vectorised normal CDF behind exact gelu against float64 math.erfc on 400k points of [-13, 10]
    (below -13, x Phi(x) leaves float32's normal range): gelu within 6 ulp (the C code measures 4.1;
    the NumPy kernel's 1 + erf is off by millions of ulp for x < -5), its derivative within 6 ulp
    where |x| >= 2 and within 3e-7 nearer 0 (where Phi(x) + x phi(x) cancels, around x = -0.75)."""
    x = np.linspace(-13, 10, 400_001, dtype=np.float32)
    x64 = x.astype(np.float64)
    cdf = 0.5 * np.frompyfunc(math.erfc, 1, 1)(-x64 / math.sqrt(2)).astype(np.float64)
    want, want_grad = x64 * cdf, cdf + x64 * np.exp(-0.5 * x64 * x64) / math.sqrt(2 * math.pi)
    native, _ = both(tables, "gelu")
    native_b, _ = both(tables, "gelu_backward")
    got = native.fn(x, approximate="none").astype(np.float64)
    got_grad = native_b.fn(np.ones_like(x), x, approximate="none").astype(np.float64)

    def ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
        return np.abs(got - want) / np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)

    assert ulps(got, want).max() <= 6
    far = np.abs(x) >= 2
    assert ulps(got_grad[far], want_grad[far]).max() <= 6
    assert np.abs(got_grad - want_grad)[~far].max() <= 3e-7
    # the tails and the non-finite: gelu(inf) = inf, gelu(-inf) = nan (inf * 0, as the reference), 0 at 0
    edge = native.fn(np.array([np.inf, -np.inf, 0.0, -40.0, 40.0], np.float32), approximate="none")
    assert edge[0] == np.inf and np.isnan(edge[1]) and edge[2] == 0 and edge[3] == 0 and edge[4] == 40


@pytest.mark.parametrize("size", [1, 17, 100_003])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_equals_numpy_bit_for_bit(tables: dict[str, Any], size: int, weight_decay: float) -> None:
    rng = np.random.default_rng(size)
    native, numpy = both(tables, "adamw_update")
    state = [rand(rng, size), rand(rng, size), rand(rng, size) * 0.1, np.abs(rand(rng, size)) * 0.01]
    sides = [[a.copy() for a in state] for _ in range(2)]
    for step in (1, 2, 7):
        grad = rand(rng, size)
        for kernel, (p, _, m, v) in zip((native, numpy), sides, strict=True):
            kernel.fn(p, grad, m, v, np.empty(size, np.float32), step=step, lr=1e-3, scale=0.7, beta1=0.9,
                      beta2=0.999, eps=1e-8, weight_decay=weight_decay, lr_scale=0.5)
    for a, b in zip(sides[0], sides[1], strict=True):
        assert np.array_equal(a, b)


def test_other_layouts_run_the_numpy_kernel(tables: dict[str, Any]) -> None:
    """A strided input or float64 arrays: the native kernel hands them to the NumPy kernel."""
    rng = np.random.default_rng(8)
    x = rand(rng, 6, 20)[:, ::2]
    w = rand(rng, 10)
    native, numpy = both(tables, "rmsnorm")
    close(run(native, [x, w], [x.shape, x.shape[:-1]], eps=1e-6), run(numpy, [x, w], [x.shape, x.shape[:-1]],
                                                                        eps=1e-6))
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    outs = [np.empty(x.shape), np.empty(6)]
    native.fn(x64, w64, out=outs, eps=1e-6)
    want = [np.empty(x.shape), np.empty(6)]
    numpy.fn(x64, w64, out=want, eps=1e-6)
    assert all(np.array_equal(a, b) for a, b in zip(outs, want, strict=True))


ATTENTION = [(2, 37, 4, 2, 16), (1, 130, 6, 2, 20), (3, 70, 2, 2, 64), (1, 5, 8, 1, 8)]


@pytest.mark.parametrize("shape", ATTENTION, ids=str)
@pytest.mark.parametrize(("causal", "window", "packed"),
                         [(True, None, False), (False, None, False), (True, 9, False), (False, 9, True),
                          (True, None, True)],
                         ids=["causal", "full", "window", "full-window-packed", "packed"])
def test_flash_attention(tables: dict[str, Any], shape: tuple[int, ...], causal: bool, window: int | None,
                         packed: bool) -> None:
    """Forward (o, lse) and backward (d_qkv from d_out and d_lse) on ragged lengths, GQA groups, head
    dims that are no multiple of a vector, sliding windows and packed sequences (segment ids)."""
    b, t, hq, hkv, d = shape
    rng = np.random.default_rng(sum(shape) + 7)
    qkv = rand(rng, b, t, (hq + 2 * hkv) * d, scale=1.5)
    segments = np.sort(rng.integers(0, 3, (b, t)), axis=1) if packed else None
    attrs = {"Hq": hq, "Hkv": hkv, "D": d, "causal": causal, "softmax_scale": None, "window_size": window}
    native, numpy = both(tables, "flash_attention")
    shapes = [(b, t, hq * d), (b, hq, t)]
    got, want = (run(k, [qkv, segments], shapes, **attrs) for k in (native, numpy))
    close([got[0]], [want[0]])
    assert np.array_equal(np.isinf(got[1]), np.isinf(want[1]))  # +inf: a row that sees no key
    finite = np.isfinite(want[1])
    np.testing.assert_allclose(got[1][finite], want[1][finite], rtol=1e-5, atol=1e-6)
    d_out, d_lse = rand(rng, *shapes[0]), rand(rng, *shapes[1])
    native_b, numpy_b = both(tables, "flash_attention_backward")
    saved = [qkv, want[0], want[1]]
    for inputs in ([d_out, *saved, d_lse, segments], [d_out, *saved, None, segments],
                   [None, *saved, d_lse, segments]):
        close(run(native_b, inputs, [qkv.shape], **attrs), run(numpy_b, inputs, [qkv.shape], **attrs),
              atol=1e-5)


def test_flash_attention_does_not_depend_on_threads(tables: dict[str, Any],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Each (sequence, kv head) sums its dK and dV over query blocks in order, whatever the threads."""
    rng = np.random.default_rng(13)
    qkv, d_out = rand(rng, 3, 40, 8 * 16), rand(rng, 3, 40, 4 * 16)
    attrs = {"Hq": 4, "Hkv": 2, "D": 16, "causal": True, "softmax_scale": None, "window_size": None}
    native, _ = both(tables, "flash_attention")
    native_b, _ = both(tables, "flash_attention_backward")
    import kiln.cpu._kernels as k

    results = []
    for n in (1, 2, 5):
        monkeypatch.setattr(k, "threads", lambda n=n: n)
        o, lse = run(native, [qkv, None], [(3, 40, 64), (3, 4, 40)], **attrs)
        results.append([o, lse, *run(native_b, [d_out, qkv, o, lse, None, None], [qkv.shape], **attrs)])
    assert all(np.array_equal(a, b) for r in results[1:] for a, b in zip(r, results[0], strict=True))


def test_flash_attention_softmax_scale_and_fallbacks(tables: dict[str, Any]) -> None:
    """An explicit softmax_scale runs natively; softcap and ALiBi run the NumPy kernel (same results)."""
    rng = np.random.default_rng(21)
    qkv = rand(rng, 2, 19, 4 * 16)
    native, numpy = both(tables, "flash_attention")
    for extra in ({"softmax_scale": 0.3}, {"softmax_scale": None, "softcap": 5.0},
                  {"softmax_scale": None, "alibi": True}):
        attrs = {"Hq": 2, "Hkv": 1, "D": 16, "causal": True, "window_size": None, **extra}
        shapes = [(2, 19, 32), (2, 2, 19)]
        close(run(native, [qkv, None], shapes, **attrs), run(numpy, [qkv, None], shapes, **attrs))


SEPARATE = [(2, 37, 37, 4, 2, 16), (1, 130, 130, 6, 2, 20), (3, 21, 70, 2, 2, 64), (2, 5, 67, 8, 1, 8),
            (1, 90, 12, 2, 1, 24)]  # (B, Tq, Tk, Hq, Hkv, D): self and cross attention, Tq > Tk too


def attention_case(rng: np.random.Generator, shape: tuple[int, ...], layout: str
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q, k, v: three C-contiguous arrays, or (``views``) q from packed rows and k, v from one kv array
    (what a model that splits a projection hands the op)."""
    b, tq, tk, hq, hkv, d = shape
    if layout == "arrays":
        return (rand(rng, b, tq, hq, d, scale=1.5), rand(rng, b, tk, hkv, d, scale=1.5),
                rand(rng, b, tk, hkv, d))
    q = rand(rng, b, tq, hq + 3, d, scale=1.5)[:, :, 1:hq + 1]
    kv = rand(rng, b, tk, 2 * hkv, d, scale=1.5)
    return q, kv[:, :, :hkv], kv[:, :, hkv:]


@pytest.mark.parametrize("shape", SEPARATE, ids=str)
@pytest.mark.parametrize(("causal", "window", "packed", "layout"),
                         [(True, None, False, "arrays"), (False, None, False, "views"),
                          (True, 9, False, "views"), (False, 9, True, "arrays"),
                          (True, None, True, "arrays")],
                         ids=["causal", "full-views", "window-views", "full-window-segments", "segments"])
def test_attention_separate_qkv(tables: dict[str, Any], shape: tuple[int, ...], causal: bool,
                                window: int | None, packed: bool, layout: str) -> None:
    """attention on separate q, k, v against the NumPy kernel: forward (out, lse) and backward (dq, dk,
    dv from d_out and d_lse), GQA, ragged lengths and head dims, cross attention (Tq != Tk: queries at
    the last Tq key positions), windows, segment ids, strided q, k, v views."""
    b, tq, tk, hq, _, d = shape
    rng = np.random.default_rng(sum(shape) + 17)
    q, k, v = attention_case(rng, shape, layout)
    segments = np.sort(rng.integers(0, 3, (b, tk)), axis=1) if packed and tq <= tk else None
    attrs = {"causal": causal, "softmax_scale": None, "window_size": window}
    native, numpy = both(tables, "attention")
    shapes = [(b, tq, hq, d), (b, hq, tq)]
    got, want = (run(kernel, [q, k, v, segments], shapes, **attrs) for kernel in (native, numpy))
    close([got[0]], [want[0]])
    assert np.array_equal(np.isinf(got[1]), np.isinf(want[1]))  # +inf: a row that sees no key
    finite = np.isfinite(want[1])
    np.testing.assert_allclose(got[1][finite], want[1][finite], rtol=1e-5, atol=1e-6)
    d_out, d_lse = rand(rng, *shapes[0]), rand(rng, *shapes[1])
    native_b, numpy_b = both(tables, "attention_backward")
    saved = [q, k, v, want[0], want[1]]
    grads = [q.shape, k.shape, v.shape]
    for inputs in ([d_out, *saved, d_lse, segments], [d_out, *saved, None, segments],
                   [None, *saved, d_lse, segments]):
        close(run(native_b, inputs, grads, **attrs), run(numpy_b, inputs, grads, **attrs), atol=1e-5)


def test_attention_separate_qkv_runs_the_c_kernel(tables: dict[str, Any],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Strided views and cross attention reach the C code (not the NumPy fallback), and its results
    equal the packed kernel's on the same heads bit for bit (one set of inner loops)."""
    rng = np.random.default_rng(29)
    qkv = rand(rng, 2, 45, 8 * 16)
    q, kk, v = (qkv.reshape(2, 45, 8, 16)[:, :, s] for s in (slice(0, 4), slice(4, 6), slice(6, 8)))
    native, _ = both(tables, "attention")
    native_b, _ = both(tables, "attention_backward")
    flash, _ = both(tables, "flash_attention")
    flash_b, _ = both(tables, "flash_attention_backward")
    attrs = {"causal": True, "softmax_scale": None, "window_size": None}
    calls: list[str] = []

    def forbid(*args: Any, **kw: Any) -> None:
        calls.append("numpy")

    # the kernels' fallbacks: the dict of NumPy kernels their closures share
    fallback = next(c.cell_contents for c in native.fn.__closure__ or ()
                    if isinstance(c.cell_contents, dict) and "attention" in c.cell_contents)
    monkeypatch.setitem(fallback, "attention", forbid)
    monkeypatch.setitem(fallback, "attention_backward", forbid)
    o, lse = run(native, [q, kk, v, None], [(2, 45, 4, 16), (2, 4, 45)], **attrs)
    fo, flse = run(flash, [qkv, None], [(2, 45, 64), (2, 4, 45)], Hq=4, Hkv=2, D=16, **attrs)
    assert np.array_equal(o.reshape(2, 45, 64), fo) and np.array_equal(lse, flse)
    d_out = rand(rng, 2, 45, 4, 16)
    dq, dk, dv = run(native_b, [d_out, q, kk, v, o, lse, None, None], [q.shape, kk.shape, v.shape], **attrs)
    (d_qkv,) = run(flash_b, [d_out.reshape(2, 45, 64), qkv, fo, flse, None, None], [qkv.shape], Hq=4, Hkv=2,
                   D=16, **attrs)
    assert np.array_equal(np.concatenate([dq, dk, dv], axis=2).reshape(qkv.shape), d_qkv)
    cross = [rand(rng, 1, 7, 2, 8), rand(rng, 1, 33, 1, 8), rand(rng, 1, 33, 1, 8)]
    run(native, [*cross, None], [(1, 7, 2, 8), (1, 2, 7)], causal=False, softmax_scale=0.5, window_size=None)
    assert calls == []
    # softcap and ALiBi run the NumPy kernel
    run(native, [*cross, None], [(1, 7, 2, 8), (1, 2, 7)], causal=False, softmax_scale=None, window_size=None,
        softcap=3.0)
    assert calls == ["numpy"]


def test_attention_separate_qkv_does_not_depend_on_threads(tables: dict[str, Any],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import kiln.cpu._kernels as k

    rng = np.random.default_rng(31)
    q, kk, v = rand(rng, 3, 40, 4, 16), rand(rng, 3, 70, 2, 16), rand(rng, 3, 70, 2, 16)
    d_out = rand(rng, 3, 40, 4, 16)
    attrs = {"causal": True, "softmax_scale": None, "window_size": 30}
    native, _ = both(tables, "attention")
    native_b, _ = both(tables, "attention_backward")
    results = []
    for n in (1, 2, 5):
        monkeypatch.setattr(k, "threads", lambda n=n: n)
        o, lse = run(native, [q, kk, v, None], [q.shape, (3, 4, 40)], **attrs)
        grads = run(native_b, [d_out, q, kk, v, o, lse, None, None], [q.shape, kk.shape, v.shape], **attrs)
        results.append([o, lse, *grads])
    assert all(np.array_equal(a, b) for r in results[1:] for a, b in zip(r, results[0], strict=True))


ROPE = [  # (B, T, Hq, Hkv, D, rotary_dim, interleaved, weights, per-sequence positions, freqs table)
    (2, 5, 4, 2, 8, None, False, "qk", False, False),
    (1, 33, 6, 2, 12, 8, True, "q", True, False),
    (3, 7, 2, 2, 64, None, False, "", False, True),
    (2, 9, 2, 1, 6, 4, True, "k", True, True),
]


@pytest.mark.parametrize("case", ROPE, ids=str)
def test_qkv_qk_norm_rope(tables: dict[str, Any], case: tuple[Any, ...]) -> None:
    b, t, hq, hkv, d, rotary, interleaved, weights, per_seq, with_freqs = case
    rng = np.random.default_rng(t + d)
    qkv = rand(rng, b, t, (hq + 2 * hkv) * d, scale=2)
    qw = rand(rng, d) if "q" in weights else None
    kw = rand(rng, d) if "k" in weights else None
    rd = rotary or d
    freqs = rand(rng, t + 3, rd // 2, 2) if with_freqs else None
    pos = rng.integers(0, t + 3, (b, t) if per_seq else (t,))
    attrs = {"Hq": hq, "Hkv": hkv, "D": d, "eps": 1e-6, "theta": 500.0, "rotary_dim": rotary,
             "interleaved": interleaved}
    shapes = [qkv.shape, (b, t, hq), (b, t, hkv)]
    native, numpy = both(tables, "qkv_qk_norm_rope")
    want = run(numpy, [qkv, qw, kw, freqs, pos], shapes, **attrs)
    close(run(native, [qkv, qw, kw, freqs, pos], shapes, **attrs), want)
    native_b, numpy_b = both(tables, "qkv_qk_norm_rope_backward")
    d_out, d_qr, d_kr = rand(rng, *shapes[0]), rand(rng, *shapes[1]), rand(rng, *shapes[2])
    saved = [qkv, qw, kw, freqs, pos, want[1], want[2]]
    for grads in ([d_out, *saved, None, None], [d_out, *saved, d_qr, d_kr], [None, *saved, d_qr, None]):
        bwd_shapes = [qkv.shape, (d,), (d,)]
        close(run(native_b, grads, bwd_shapes, **attrs), run(numpy_b, grads, bwd_shapes, **attrs), atol=1e-5)


def test_qkv_rope_positions_outside_the_freqs_table_are_the_reference_error(tables: dict[str, Any]) -> None:
    from kiln.core import KilnError

    rng = np.random.default_rng(3)
    qkv, freqs = rand(rng, 1, 4, 4 * 8), rand(rng, 3, 4, 2)
    native, _ = both(tables, "qkv_qk_norm_rope")
    with pytest.raises(KilnError, match="position ids must lie in"):
        run(native, [qkv, None, None, freqs, np.arange(4)], [qkv.shape, (1, 4, 2), (1, 4, 1)], Hq=2, Hkv=1,
            D=8, eps=1e-6, theta=1e4, rotary_dim=None)


@pytest.mark.parametrize(("n", "v", "c"), [(1, 3, 4), (37, 1000, 24), (300, 30000, 16)], ids=str)
def test_lm_head_loss_and_grad(tables: dict[str, Any], n: int, v: int, c: int) -> None:
    """The LM head's fused training pass (loss, lse, d_x, d_weight), ignored rows included; the last
    shape takes several tiles of rows (more logits than one tile holds)."""
    rng = np.random.default_rng(n + v)
    x, w = rand(rng, n, c), rand(rng, v, c, scale=0.5)
    targets = rng.integers(0, v, n)
    targets[::3] = -100
    d_loss = np.abs(rand(rng, n))
    native, numpy = both(tables, "fused_lm_head_loss_and_grad")
    got, want = ([np.full(s, np.nan, np.float32) for s in ((n,), (n,), (n, c), (v, c))] for _ in range(2))
    for kernel, (loss, lse, d_x, d_w) in ((native, got), (numpy, want)):
        kernel.fn(d_loss, x, w, targets, loss=loss, lse=lse, d_x=d_x, d_weight=d_w, ignore_index=-100)
    close(got, want, atol=1e-5)


STANDALONE_ROPE = [  # (B, T, heads, head_dim, rotary_dim, interleaved, per-sequence positions, freqs table)
    (2, 5, 3, 8, None, False, False, False),
    (1, 33, 2, 12, 8, True, True, False),
    (3, 7, 5, 64, None, False, False, True),
    (2, 9, 1, 6, 4, True, True, True),
]


@pytest.mark.parametrize("case", STANDALONE_ROPE, ids=str)
@pytest.mark.parametrize("inverse", [False, True], ids=["rope", "inverse"])
def test_rope(tables: dict[str, Any], case: tuple[Any, ...], inverse: bool) -> None:
    """Standalone rope (and its backward: rope with inverse=True) on [B, T, H * head_dim], in place too,
    equals the NumPy kernel bit for bit; the inverse undoes the rotation."""
    b, t, heads, hd, rotary, interleaved, per_seq, with_freqs = case
    rng = np.random.default_rng(t + hd + heads)
    x = rand(rng, b, t, heads * hd, scale=2)
    rd = rotary or hd
    freqs = rand(rng, t + 3, rd // 2, 2) if with_freqs else None
    pos = rng.integers(0, t + 3, (b, t) if per_seq else (t,))
    attrs = {"head_dim": hd, "rotary_dim": rotary, "theta": 500.0, "inverse": inverse,
             "interleaved": interleaved}
    native, numpy = both(tables, "rope")
    assert native.inplace == {0}
    got, want = (run(k, [x, freqs, pos], [x.shape], **attrs) for k in (native, numpy))
    assert np.array_equal(got[0], want[0])  # the reference's products in its order: the same bits
    y = x.copy()
    native.fn(y, freqs, pos, out=[y], **attrs)
    assert np.array_equal(y, got[0])
    back = run(native, [got[0], freqs, pos], [x.shape], **{**attrs, "inverse": not inverse})[0]
    if not with_freqs:  # a rotation (cos^2 + sin^2 = 1): the inverse gives x back
        np.testing.assert_allclose(back, x, rtol=1e-5, atol=1e-5)


def test_rope_bad_input_is_the_reference_error(tables: dict[str, Any]) -> None:
    from kiln.core import KilnError

    rng = np.random.default_rng(2)
    x = rand(rng, 1, 4, 16)
    native, _ = both(tables, "rope")
    with pytest.raises(KilnError, match="rotary_dim must be even"):
        run(native, [x, None, np.arange(4)], [x.shape], head_dim=8, rotary_dim=3, theta=1e4, inverse=False)
    with pytest.raises(KilnError, match="position ids must lie in"):
        run(native, [x, rand(rng, 3, 4, 2), np.arange(4)], [x.shape], head_dim=8, rotary_dim=None, theta=1e4,
            inverse=False)


@pytest.mark.parametrize(("q_shape", "k_shape"), [((2, 5, 4, 8), (2, 5, 2, 8)), ((3, 7), (1, 7)),
                                                  ((1, 37, 6, 129), (1, 37, 3, 129))], ids=str)
def test_qk_norm(tables: dict[str, Any], q_shape: tuple[int, ...], k_shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(sum(q_shape))
    q, k = rand(rng, *q_shape, scale=2), rand(rng, *k_shape)
    qw, kw = rand(rng, q_shape[-1]), rand(rng, k_shape[-1])
    native, numpy = both(tables, "qk_norm")
    got, want = (kernel.fn(q, k, qw, kw, eps=1e-5) for kernel in (native, numpy))
    close(list(got), list(want))


@pytest.mark.parametrize("shape", ROWS_COLS, ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_layernorm_and_backward(tables: dict[str, Any], shape: tuple[int, ...], with_bias: bool) -> None:
    """layernorm (y, mean, rstd) and its backward from d_y, d_mean and d_rstd in turn and together."""
    rng = np.random.default_rng(sum(shape) + 23)
    x, w = rand(rng, *shape, scale=3) + 1.5, rand(rng, shape[-1])
    bias = rand(rng, shape[-1]) if with_bias else None
    native, numpy = both(tables, "layernorm")
    got, want = (kernel.fn(x, w, bias, eps=1e-5) for kernel in (native, numpy))
    close(list(got), list(want), atol=1e-5)
    native_b, numpy_b = both(tables, "layernorm_backward")
    d_y, d_mean, d_rstd = rand(rng, *shape), rand(rng, *shape[:-1]), rand(rng, *shape[:-1])
    _, mean, rstd = want
    for grads in ((d_y, None, None), (None, d_mean, None), (None, None, d_rstd), (d_y, d_mean, d_rstd)):
        args = (grads[0], x, mean, rstd, w, *grads[1:])
        close(list(native_b.fn(*args)), list(numpy_b.fn(*args)), atol=1e-5)


def test_layernorm_backward_does_not_depend_on_threads(tables: dict[str, Any],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import kiln.cpu._kernels as k

    rng = np.random.default_rng(12)
    x, w, d_y = rand(rng, 300, 48), rand(rng, 48), rand(rng, 300, 48)
    native, _ = both(tables, "layernorm")
    native_b, _ = both(tables, "layernorm_backward")
    results = []
    for n in (1, 2, 3):
        monkeypatch.setattr(k, "threads", lambda n=n: n)
        y, mean, rstd = native.fn(x, w, None, eps=1e-5)
        results.append([y, mean, rstd, *native_b.fn(d_y, x, mean, rstd, w, None, None)])
    assert all(np.array_equal(a, b) for r in results[1:] for a, b in zip(r, results[0], strict=True))


LM_HEAD = [(1, 3, 4, 4096), (37, 1000, 24, 300), (300, 30000, 16, 4096), (700, 333, 9, 7)]  # (N, V, C, chunk)


@pytest.mark.parametrize(("n", "v", "c", "chunk"), LM_HEAD, ids=str)
def test_lm_head_loss_and_backward(tables: dict[str, Any], n: int, v: int, c: int, chunk: int) -> None:
    """The LM head's forward-only loss (loss, lse over vocabulary chunks) and its separate backward
    (d_x, d_weight from d_loss, d_lse or both), ignored rows included; ragged chunks and several tiles
    of rows."""
    rng = np.random.default_rng(n + v + 1)
    x, w = rand(rng, n, c), rand(rng, v, c, scale=0.5)
    targets = rng.integers(0, v, n)
    targets[::3] = -100
    attrs = {"ignore_index": -100, "chunk_size": chunk, "softcap": None}
    native, numpy = both(tables, "fused_lm_head_loss")
    got, want = (run(k, [x, w, targets], [(n,), (n,)], **attrs) for k in (native, numpy))
    close(got, want)
    assert np.all(got[0][targets == -100] == 0)
    native_b, numpy_b = both(tables, "fused_lm_head_loss_backward")
    d_loss, d_lse = np.abs(rand(rng, n)), rand(rng, n)
    for dl, dlse in ((d_loss, None), (None, d_lse), (d_loss, d_lse)):
        inputs = [dl, x, w, targets, want[1], dlse]
        shapes = [x.shape, w.shape]
        close(run(native_b, inputs, shapes, **attrs), run(numpy_b, inputs, shapes, **attrs), atol=1e-5)


def test_lm_head_loss_softcap_and_bad_targets(tables: dict[str, Any]) -> None:
    """softcap runs the NumPy kernel (the same values); a target outside the vocabulary is the reference's
    error."""
    from kiln.core import KilnError

    rng = np.random.default_rng(4)
    x, w, targets = rand(rng, 9, 8), rand(rng, 50, 8), rng.integers(0, 50, 9)
    native, numpy = both(tables, "fused_lm_head_loss")
    native_b, numpy_b = both(tables, "fused_lm_head_loss_backward")
    attrs = {"ignore_index": -100, "chunk_size": 16, "softcap": 3.0}
    want = run(numpy, [x, w, targets], [(9,), (9,)], **attrs)
    close(run(native, [x, w, targets], [(9,), (9,)], **attrs), want)
    inputs = [rand(rng, 9), x, w, targets, want[1], None]
    shapes = [x.shape, w.shape]
    close(run(native_b, inputs, shapes, **attrs), run(numpy_b, inputs, shapes, **attrs))
    targets[4] = 50
    with pytest.raises(KilnError, match="50"):
        run(native, [x, w, targets], [(9,), (9,)], **{**attrs, "softcap": None})


def test_lm_head_loss_does_not_depend_on_threads(tables: dict[str, Any],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles of rows and vocabulary chunks are cut by the shapes alone, each product a BLAS call of its
    own: the same bits on 1, 2 or 3 threads (BLAS held to one thread, as a Program run holds it)."""
    import kiln.core._threads as kiln_threads

    rng = np.random.default_rng(6)
    n, v, c = 600, 3000, 32
    x, w, targets, d_loss = rand(rng, n, c), rand(rng, v, c, scale=0.5), rng.integers(0, v, n), rand(rng, n)
    attrs = {"ignore_index": -100, "chunk_size": 1000, "softcap": None}
    native, _ = both(tables, "fused_lm_head_loss")
    native_b, _ = both(tables, "fused_lm_head_loss_backward")
    results = []
    for k in (1, 2, 3):
        monkeypatch.setattr(kiln_threads, "_pool", kiln_threads._Pool(k))
        with kiln_threads.blas_held_to_one_thread():
            loss, lse = run(native, [x, w, targets], [(n,), (n,)], **attrs)
            grads = run(native_b, [d_loss, x, w, targets, lse, None], [x.shape, w.shape], **attrs)
        results.append([loss, lse, *grads])
    assert all(np.array_equal(a, b) for r in results[1:] for a, b in zip(r, results[0], strict=True))


@pytest.mark.parametrize(("shape", "v", "c", "padding_idx"),
                         [((1,), 1, 1, None), ((3, 7), 5, 33, None), ((8, 129), 1000, 17, 3),
                          ((4, 64), 257, 256, 0)],
                         ids=str)
def test_embedding_backward_equals_numpy_bit_for_bit(tables: dict[str, Any], shape: tuple[int, ...], v: int,
                                                     c: int, padding_idx: int | None) -> None:
    """Repeated ids sum in order of occurrence, as np.add.at does: the same bits, int32 and int64 ids."""
    rng = np.random.default_rng(v + c)
    d_out = rand(rng, *shape, c)
    native, numpy = both(tables, "embedding_backward")
    for dtype in (np.int32, np.int64):
        ids = rng.integers(0, min(v, 7), shape).astype(dtype)  # few distinct ids: many repeats
        ids.flat[-1] = v - 1
        got, want = (run(k, [d_out, ids], [(v, c)], num_embeddings=v, padding_idx=padding_idx)
                     for k in (native, numpy))
        assert np.array_equal(got[0], want[0])


def test_embedding_backward_does_not_depend_on_threads_and_bad_ids_are_the_reference_error(
        tables: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    import kiln.cpu._kernels as k
    from kiln.core import KilnError

    rng = np.random.default_rng(5)
    d_out, ids = rand(rng, 300, 24), rng.integers(0, 50, 300)
    native, _ = both(tables, "embedding_backward")
    results = []
    for n in (1, 2, 3, 7):
        monkeypatch.setattr(k, "threads", lambda n=n: n)
        results.append(run(native, [d_out, ids], [(50, 24)], num_embeddings=50)[0])
    assert all(np.array_equal(r, results[0]) for r in results[1:])
    ids[17] = 50
    with pytest.raises(KilnError, match="index 50 is outside"):
        run(native, [d_out, ids], [(50, 24)], num_embeddings=50)


@pytest.mark.parametrize(("n", "v"), [(1, 1), (5, 7), (37, 1000), (130, 8193)], ids=str)
def test_cross_entropy_and_backward(tables: dict[str, Any], n: int, v: int) -> None:
    """Loss and lse, and the logits' gradient from d_loss, d_lse or both, ignored rows included."""
    rng = np.random.default_rng(n * v)
    logits = rand(rng, n, v, scale=4)
    targets = rng.integers(0, v, n)
    targets[1::4] = -100
    native, numpy = both(tables, "cross_entropy")
    got, want = (k.fn(logits.copy(), targets, ignore_index=-100) for k in (native, numpy))
    close(list(got), list(want))
    assert np.all(got[0][targets == -100] == 0)
    native_b, numpy_b = both(tables, "cross_entropy_backward")
    d_loss, d_lse = np.abs(rand(rng, n)), rand(rng, n)
    for dl, dlse in ((d_loss, None), (None, d_lse), (d_loss, d_lse)):
        args = (dl, logits, targets, want[1], dlse)
        close([native_b.fn(*args, ignore_index=-100)], [numpy_b.fn(*args, ignore_index=-100)])


def test_cross_entropy_long_rows_against_float64(tables: dict[str, Any]) -> None:
    """A long row's log-sum-exp (float partial sums of 256 terms in vector lanes, then double) within
    2e-7 of float64's, whatever the scale of the logits."""
    rng = np.random.default_rng(11)
    logits = np.concatenate([rand(rng, 3, 50_001, scale=s) for s in (0.01, 3.0, 30.0)])
    targets = rng.integers(0, logits.shape[1], len(logits))
    native, _ = both(tables, "cross_entropy")
    loss, lse = native.fn(logits, targets, ignore_index=-100)
    z = logits.astype(np.float64)
    m = z.max(axis=1)
    want = m + np.log(np.exp(z - m[:, None]).sum(axis=1))
    np.testing.assert_allclose(lse, want, rtol=2e-7, atol=0)
    np.testing.assert_allclose(loss, want - z[np.arange(len(z)), targets], rtol=1e-6, atol=1e-6)


def test_cross_entropy_bad_targets_and_other_layouts(tables: dict[str, Any]) -> None:
    from kiln.core import KilnError

    rng = np.random.default_rng(3)
    logits = rand(rng, 6, 10)
    native, numpy = both(tables, "cross_entropy")
    with pytest.raises(KilnError, match="index 10 is outside"):
        native.fn(logits, np.array([0, 1, 2, 10, 3, 4]), ignore_index=-100)
    # a transposed view and float64 run the NumPy kernel: the same values
    wide = rand(rng, 10, 6).T
    for x in (wide, logits.astype(np.float64)):
        close(list(native.fn(x, np.arange(6), ignore_index=-100)),
              list(numpy.fn(x, np.arange(6), ignore_index=-100)))
