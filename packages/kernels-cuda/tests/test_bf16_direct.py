"""Kernels of the ``bf16`` recipe that read bf16 tensors directly (float32 math inside, bf16 widened on load
and rounded on store), so the recipe plans no widened float32 copies for them: RMSNorm and its fused
residual form (forward and backward), SwiGLU (bf16 in and out) and the q/k norm with rope (forward and
backward in one pass each).

Oracles: NumPy's kernels of the recipe (``op@numpy:bfloat16``, ml_dtypes rounding at autocast's points) and
NumPy's float32 reference on the bf16 values, with the tolerances of tests/test_bf16.py and ``kiln cuda
check`` (float32 summation order; ``tanh``'s last bit); the planned workspace against a backend that still
widens every bf16 input of those steps (the behaviour before these kernels)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from kiln.core import Model, PluginSession, compile, get_registry
from kiln.cuda import EmulatedCuda, EmulatedDevice, _backend
from kiln.cuda._ops import DeviceArray, Scratch, as_dtype, cast

ml_dtypes = pytest.importorskip("ml_dtypes", reason="the bf16 recipe needs ml_dtypes")

CONFIG = {"vocab_size": 64, "d_model": 32, "n_layers": 1, "num_query_heads": 4, "num_kv_heads": 2,
          "head_size": 8, "d_ff": 64, "max_seq": 16}
#: the ops whose steps read their bf16 tensors directly under the recipe
DIRECT = ("fused_residual_rmsnorm", "fused_residual_rmsnorm_backward", "swiglu", "swiglu_backward",
          "qkv_qk_norm_rope", "qkv_qk_norm_rope_backward")
#: and those of other models (LayerNorm, GELU, the MoE router's sums)
DIRECT_MORE = ("layernorm_backward", "gelu", "gelu_backward", "add", "bias_add", "mul")
DIRECT_KERNELS = {"fused_residual_rmsnorm_bf16in", "rmsnorm_backward_dx_bf16in", "rmsnorm_backward_dw_bf16in",
                  "swiglu_rp_bf16io", "swiglu_backward_rp_bf16io", "qkv_norm_rope_rp_bf16in",
                  "qkv_norm_rope_backward_rp_bf16in", "qkv_norm_rope_backward_dw_rp_bf16in"}


def _bf16(rng: np.random.Generator, *shape: int, s: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * s).astype(ml_dtypes.bfloat16)


def _f32(rng: np.random.Generator, *shape: int, s: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * s).astype(np.float32)


def _dev(device: EmulatedDevice, a: np.ndarray | None) -> DeviceArray | None:
    return None if a is None else DeviceArray.upload(device, a)


def _empty(device: EmulatedDevice, shape: Sequence[int], dtype: str = "float32") -> DeviceArray:
    a = DeviceArray(device, 0, tuple(shape), dtype)
    return DeviceArray(device, device.alloc(max(a.nbytes, 1)), a.shape, dtype)


def _host(a: DeviceArray) -> np.ndarray:
    return a.download().astype(np.float32)  # a bf16 one widened exactly


def _numpy(op: str) -> Any:
    """NumPy's kernel of ``op`` under the bf16 recipe (the emulation's rounding points)."""
    return get_registry("kernels").find(op, "numpy", "bfloat16").fn


def _reference(op: str) -> Any:
    """The op's NumPy reference, in float64 on float64 copies of its float inputs."""
    kernel = get_registry("ops").get_op(op).kernel

    def run(*args: Any, **kw: Any) -> Any:
        return kernel(*[a.astype(np.float64) if isinstance(a, np.ndarray) and a.dtype.kind == "f" else a
                        for a in args], **kw)

    return run


def _run(device: EmulatedDevice, fn: Any, args: Sequence[DeviceArray | None],
         outs: Sequence[DeviceArray | None], **kw: Any) -> None:
    """``fn`` on the emulator, asserting it took no temporary device memory (no widened copies)."""
    before = device.allocs
    fn(*args, out=list(outs), **kw)
    assert device.allocs == before, f"{getattr(fn, '__name__', fn)} allocated temporaries"


def test_swiglu_reads_and_writes_bf16(emulated: EmulatedDevice) -> None:
    """SwiGLU and its backward on bf16 slots (ragged sizes): NumPy's bf16 kernels' values (within 1e-6, where
    ``1 + tanh`` cancels), bf16 outputs, no temporaries."""
    from kiln.cuda._ops import swiglu_backward_bf16, swiglu_bf16

    rng = np.random.default_rng(1)
    x, d = _bf16(rng, 3, 5, 94, s=3), _bf16(rng, 3, 5, 47)
    y = _empty(emulated, (3, 5, 47), "bfloat16")
    _run(emulated, swiglu_bf16, [_dev(emulated, x)], [y])
    want = _numpy("swiglu")(x.astype(np.float32))
    assert np.abs(_host(y) - want).max() <= 1e-6
    dx = _empty(emulated, x.shape, "bfloat16")
    _run(emulated, swiglu_backward_bf16, [_dev(emulated, d), _dev(emulated, x)], [dx])
    want = _numpy("swiglu_backward")(d.astype(np.float32), x.astype(np.float32))
    assert np.abs(_host(dx) - want).max() <= 1e-6
    assert np.abs(want - _reference("swiglu_backward")(d, x)).max() > 1e-3  # the recipe's rounding is live


@pytest.mark.parametrize("rows, c", [(7, 33), (5, 300)])
def test_rmsnorms_read_bf16(emulated: EmulatedDevice, rows: int, c: int) -> None:
    """RMSNorm, the fused residual form and their backwards with bf16 ``x`` / ``d_y``: NumPy's float32
    kernels on the same (widened) values, to float32 summation order; no temporaries."""
    from kiln.cuda._ops import (
        fused_residual_rmsnorm_backward_bf16in,
        fused_residual_rmsnorm_bf16in,
        rmsnorm_backward_bf16in,
        rmsnorm_bf16in,
    )

    rng = np.random.default_rng(2)
    res, x, w = _f32(rng, rows, c), _bf16(rng, rows, c), _f32(rng, c)
    wide = x.astype(np.float32)
    out = [_empty(emulated, (rows, c)), _empty(emulated, (rows, c)), _empty(emulated, (rows,))]
    _run(emulated, fused_residual_rmsnorm_bf16in, [_dev(emulated, res), _dev(emulated, x), _dev(emulated, w)],
         out, eps=1e-6)
    want = _reference("fused_residual_rmsnorm")(res, wide, w, eps=1e-6)
    for got, ref in zip(out, want, strict=True):
        np.testing.assert_allclose(_host(got), ref, rtol=1e-5, atol=1e-6)
    y, rstd = _empty(emulated, (rows, c)), _empty(emulated, (rows,))
    _run(emulated, rmsnorm_bf16in, [_dev(emulated, x), _dev(emulated, w)], [y, rstd], eps=1e-6)
    want = _reference("rmsnorm")(wide, w, eps=1e-6)
    np.testing.assert_allclose(_host(y), want[0], rtol=1e-5, atol=1e-6)

    d_y, d_extra, r_out = _bf16(rng, rows, c), _f32(rng, rows, c), _f32(rng, rows, c)
    r_stats = _reference("rmsnorm")(r_out, w, eps=1e-6)[1].astype(np.float32)
    out = [_empty(emulated, (rows, c)), _empty(emulated, (rows, c)), _empty(emulated, (c,))]
    _run(emulated, fused_residual_rmsnorm_backward_bf16in,
         [_dev(emulated, a) for a in (d_y, d_extra, r_out, r_stats, w)], out)
    want = _reference("fused_residual_rmsnorm_backward")(d_y.astype(np.float32), d_extra, r_out, r_stats, w)
    for got, ref in zip(out, want, strict=True):
        np.testing.assert_allclose(_host(got), ref, rtol=1e-5, atol=2e-5 * float(np.abs(ref).max()))
    out = [_empty(emulated, (rows, c)), _empty(emulated, (c,))]
    _run(emulated, rmsnorm_backward_bf16in, [_dev(emulated, a) for a in (d_y, r_out, r_stats, w)], out)
    want = _reference("rmsnorm_backward")(d_y.astype(np.float32), r_out, r_stats, w)
    for got, ref in zip(out, want, strict=True):
        np.testing.assert_allclose(_host(got), ref, rtol=1e-5, atol=2e-5 * float(np.abs(ref).max()))


HEADS = {"Hq": 4, "Hkv": 2, "D": 40, "theta": 50.0, "eps": 1e-6, "rotary_dim": None, "interleaved": False}
PARTIAL = {**HEADS, "rotary_dim": 16, "interleaved": True}


@pytest.mark.parametrize("attrs, q_weight, d_rstd", [(HEADS, True, False), (HEADS, False, True),
                                                     (PARTIAL, True, True)])
def test_qk_norm_rope_reads_bf16(emulated: EmulatedDevice, attrs: dict[str, Any], q_weight: bool,
                                 d_rstd: bool) -> None:
    """The q/k norm with rope, forward and backward, on a bf16 ``qkv`` (each one kernel pass): NumPy's
    ``qkv_qk_norm_rope@numpy:bfloat16`` and its backward, within the float32 summation order of the norm
    (2e-5, as ``kiln cuda check``); no temporaries."""
    from kiln.cuda._ops import qkv_qk_norm_rope_backward_bf16, qkv_qk_norm_rope_bf16

    rng = np.random.default_rng(3)
    x = _bf16(rng, 2, 7, 320, s=2)
    w = (_f32(rng, 40) if q_weight else None, _f32(rng, 40))
    pos = rng.integers(0, 9, (2, 7)).astype(np.int32)
    out = [_empty(emulated, x.shape), _empty(emulated, (2, 7, 4)), _empty(emulated, (2, 7, 2))]
    args = [_dev(emulated, a) for a in (x, *w, None, pos)]
    _run(emulated, qkv_qk_norm_rope_bf16, args, out, **attrs)
    want = _numpy("qkv_qk_norm_rope")(x.astype(np.float32), *w, None, pos, **attrs)
    for got, ref in zip(out, want, strict=True):
        assert np.abs(_host(got) - ref).max() <= 2e-5 * max(1.0, float(np.abs(ref).max()))

    d_out = _f32(rng, *x.shape)
    extra = (_f32(rng, 2, 7, 4), _f32(rng, 2, 7, 2)) if d_rstd else (None, None)
    q_rstd, k_rstd = want[1], want[2]
    out = [_empty(emulated, x.shape), _empty(emulated, (40,)), _empty(emulated, (40,))]
    args = [_dev(emulated, a) for a in (d_out, x, *w, None, pos, q_rstd, k_rstd, *extra)]
    _run(emulated, qkv_qk_norm_rope_backward_bf16, args, out, **attrs)
    want = _numpy("qkv_qk_norm_rope_backward")(d_out, x.astype(np.float32), *w, None, pos, q_rstd, k_rstd,
                                               *extra, **attrs)
    for got, ref in zip(out, want, strict=True):
        ref = np.zeros(got.shape, np.float32) if ref is None else ref
        assert np.abs(_host(got) - ref).max() <= 2e-5 * max(1.0, float(np.abs(ref).max()))


def test_qk_norm_rope_writes_bf16(emulated: EmulatedDevice) -> None:
    """Into a bf16 slot (as Llama's plan stores rope's output) and float32 statistics (the rstds are never
    rounded), with and without the norms' weights: NumPy's bf16 kernel's values rounded to bf16, within one
    bf16 step where its rope tables' fp32 bits differ from ``cosf``/``sinf``, its rstds to float32 rounding;
    the backward without norms reads no statistics (no widened copies of bf16 ones). No temporaries."""
    from kiln.cuda._ops import qkv_qk_norm_rope_backward_bf16, qkv_qk_norm_rope_bf16

    rng = np.random.default_rng(4)
    x, pos = _bf16(rng, 2, 7, 320, s=2), rng.integers(0, 9, (2, 7)).astype(np.int32)
    for w in ((_f32(rng, 40), _f32(rng, 40)), (None, None)):
        out = [_empty(emulated, x.shape, "bfloat16"), *(_empty(emulated, (2, 7, h)) for h in (4, 2))]
        _run(emulated, qkv_qk_norm_rope_bf16, [_dev(emulated, a) for a in (x, *w, None, pos)], out, **HEADS)
        want = _numpy("qkv_qk_norm_rope")(x.astype(np.float32), *w, None, pos, **HEADS)
        ref = want[0].astype(ml_dtypes.bfloat16).astype(np.float32)
        assert np.all(np.abs(_host(out[0]) - ref) <= 2 ** -8 * np.abs(ref) + 1e-6)
        for got, ref in zip(out[1:], want[1:], strict=True):  # float32, not rounded to bf16
            assert np.all(np.abs(_host(got) - ref) <= 1e-6 * np.abs(ref))
    # no norms (the last w): the statistics are all 1 and the backward never reads them
    d_out = _f32(rng, *x.shape)
    ones = [np.ones(sh, ml_dtypes.bfloat16) for sh in ((2, 7, 4), (2, 7, 2))]
    out = [_empty(emulated, x.shape), _empty(emulated, (40,)), _empty(emulated, (40,))]
    args = [_dev(emulated, a) for a in (d_out, x, None, None, None, pos, *ones)]
    _run(emulated, qkv_qk_norm_rope_backward_bf16, args, out, **HEADS)
    want = _numpy("qkv_qk_norm_rope_backward")(d_out, x.astype(np.float32), None, None, None, pos,
                                               *(o.astype(np.float32) for o in ones), **HEADS)
    assert np.abs(_host(out[0]) - want[0]).max() <= 2e-5 * float(np.abs(want[0]).max())
    assert not _host(out[1]).any() and not _host(out[2]).any()  # no norm: its weights get no gradient


def test_swiglu_backward_of_a_float32_gradient(emulated: EmulatedDevice) -> None:
    """A float32 ``d`` (an expert's gradient) with a bf16 ``x``: read as they are, ``d_x`` in float32,
    NumPy's bf16 kernel's values; no temporaries."""
    from kiln.cuda._ops import swiglu_backward_bf16

    rng = np.random.default_rng(5)
    x, d = _bf16(rng, 9, 86, s=3), _f32(rng, 9, 43)
    dx = _empty(emulated, x.shape)
    _run(emulated, swiglu_backward_bf16, [_dev(emulated, d), _dev(emulated, x)], [dx])
    want = _numpy("swiglu_backward")(d, x.astype(np.float32))
    assert np.abs(_host(dx) - want).max() <= 1e-6


def test_layernorm_backward_reads_bf16(emulated: EmulatedDevice) -> None:
    """LayerNorm's backward with a bf16 ``d_y``: the float64 reference on the same values, to float32
    summation order; no temporaries."""
    from kiln.cuda._ops import layernorm_backward_bf16in

    rng = np.random.default_rng(6)
    rows, c = 6, 130
    x, w, d_y = _f32(rng, rows, c), _f32(rng, c), _bf16(rng, rows, c)
    _, mean, rstd = (a.astype(np.float32) for a in _reference("layernorm")(x, w, None, eps=1e-5))
    out = [_empty(emulated, (rows, c)), _empty(emulated, (c,)), _empty(emulated, (c,))]
    _run(emulated, layernorm_backward_bf16in, [_dev(emulated, a) for a in (d_y, x, mean, rstd, w)], out)
    want = _reference("layernorm_backward")(d_y.astype(np.float32), x, mean, rstd, w)
    for got, ref in zip(out, want, strict=True):
        np.testing.assert_allclose(_host(got), ref, rtol=1e-5, atol=2e-5 * float(np.abs(ref).max()))


@pytest.mark.parametrize("op", ["add", "bias_add", "mul"])
def test_add_and_mul_on_bf16_slots(emulated: EmulatedDevice, op: str) -> None:
    """``add``, ``bias_add`` and ``mul`` under the recipe (their ``BF16_READS`` twins) on every mix of float32
    and bf16 operands and output, ``b`` broadcast over ``a``'s rows for ``bias_add``: NumPy's float32 result
    on the same values, rounded to nearest even where the output is bf16: the same bits. No temporaries."""
    from kiln.cuda._ops import BF16_READS, KERNELS

    twin = BF16_READS[KERNELS[op][0]]
    rng = np.random.default_rng(7)
    for types in ("ffh", "fhf", "fhh", "hff", "hfh", "hhf", "hhh", "fff"):
        dt = [ml_dtypes.bfloat16 if t == "h" else np.float32 for t in types]
        a = _f32(rng, 5, 67).astype(dt[0])
        b = _f32(rng, 67 if op == "bias_add" else 5 * 67).reshape((67,) if op == "bias_add" else (5, 67))
        b = b.astype(dt[1])
        o = _empty(emulated, (5, 67), "bfloat16" if types[2] == "h" else "float32")
        _run(emulated, twin, [_dev(emulated, a), _dev(emulated, b)], [o])
        f = np.multiply if op == "mul" else np.add
        want = f(a.astype(np.float32), b.astype(np.float32)).astype(dt[2]).astype(np.float32)
        assert np.array_equal(_host(o), want), types


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_on_bf16_slots(emulated: EmulatedDevice, approximate: str) -> None:
    """``gelu`` and its backward (their ``BF16_READS`` twins) on every mix of float32 and bf16 tensors: the
    float64 reference on the same values (float32 accuracy: 1e-5, ``1 + erf`` cancelling for very negative
    x), rounded to bf16 where the output is bf16 (one bf16 step at most, where the float32 value lies next to
    a rounding boundary). No temporaries."""
    from kiln.cuda._ops import BF16_READS, KERNELS

    rng = np.random.default_rng(8)

    def typed(t: str, *shape: int) -> np.ndarray:
        return _f32(rng, *shape, s=2).astype(ml_dtypes.bfloat16 if t == "h" else np.float32)

    def check(got: DeviceArray, want: np.ndarray, bf16_out: bool) -> None:
        if bf16_out:
            want = want.astype(ml_dtypes.bfloat16).astype(np.float64)
            bad = np.abs(_host(got) - want) > 2 ** -7 * np.abs(want) + 1e-5
            assert not bad.any(), (_host(got)[bad], want[bad])
        else:
            assert np.abs(_host(got) - want).max() <= 1e-5

    for types in ("fh", "hf", "hh"):
        x = typed(types[0], 4, 77)
        o = _empty(emulated, x.shape, "bfloat16" if types[1] == "h" else "float32")
        _run(emulated, BF16_READS[KERNELS["gelu"][0]], [_dev(emulated, x)], [o], approximate=approximate)
        check(o, _reference("gelu")(x.astype(np.float32), approximate=approximate), types[1] == "h")
    for types in ("ffh", "fhf", "fhh", "hff", "hfh", "hhf", "hhh"):
        d, x = typed(types[0], 4, 77), typed(types[1], 4, 77)
        o = _empty(emulated, x.shape, "bfloat16" if types[2] == "h" else "float32")
        _run(emulated, BF16_READS[KERNELS["gelu_backward"][0]], [_dev(emulated, d), _dev(emulated, x)], [o],
             approximate=approximate)
        want = _reference("gelu_backward")(d.astype(np.float32), x.astype(np.float32),
                                           approximate=approximate)
        check(o, want, types[2] == "h")


def _bundle(model: str) -> Any:
    dsl = pytest.importorskip("kiln.dsl", reason="the models come from kiln-dsl")
    from kiln.dsl.stdlib import models

    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_d_ff": 48} if "MoE" in model else {}
    return dsl.build_bundle(getattr(models, model), {**CONFIG, **moe})


@pytest.fixture(scope="module")
def bundle() -> Any:
    return _bundle("Qwen3Model")


def _widening(low_precision: Any) -> Any:
    """``low_precision`` as it ran before the direct kernels: the steps of ``DIRECT`` get float32 copies of
    their bf16 inputs and float32 temporaries for their bf16 outputs (then cast into their slots)."""
    def widened(program: Any, step: Any, opdef: Any, kernel: Any, inputs: Sequence[DeviceArray | None],
                outputs: Sequence[DeviceArray | None], kw: Any) -> Any:
        if step.op.type not in (*DIRECT, *DIRECT_MORE):
            return low_precision(program, step, opdef, kernel, inputs, outputs, kw)

        def run() -> None:
            dev = next(a.device for a in (*inputs, *outputs) if a is not None)
            with Scratch(dev) as s:
                ins = [as_dtype(s, a, "float32") if a is not None and a.dtype == "bfloat16" else a
                       for a in inputs]
                outs = [s.array(o.shape) if o is not None and o.dtype == "bfloat16" else o for o in outputs]
                low_precision(program, step, opdef, kernel, ins, outs, kw)()
                for o, y in zip(outputs, outs, strict=True):
                    if o is not None and y is not o:
                        cast(y, out=[o])

        return run

    return widened


@pytest.mark.parametrize("model", ["Qwen3Model", "LlamaModel"])
def test_the_bf16_step_plans_no_widened_copies(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The steps of the norms, SwiGLU and the q/k norm with rope (Llama's: rope alone, into bf16) plan no
    workspace under the recipe (their bf16 tensors are read where they lie), and the Program's planned peak
    is below that of a backend that widens them."""
    bundle = _bundle(model)
    session = PluginSession(autoload=False)
    session.register(EmulatedCuda(), "cuda-emulated")
    with session.activate():
        kernels = get_registry("kernels")
        program = compile(bundle, bindings={"B": 2, "T": 8}, backend="cuda", precision="bf16")
        need = _backend.step_scratch(program, kernels, EmulatedDevice())
        monkeypatch.setattr(_backend, "low_precision", _widening(_backend.low_precision))
        widened = compile(bundle, bindings={"B": 2, "T": 8}, backend="cuda", precision="bf16")
        before = _backend.step_scratch(widened, kernels, EmulatedDevice())
    steps = [st for st in program.steps if st.op.type in DIRECT and st.how == "out"  # (not the first norm's:
             and any(program.tensors[k].dtype == "bfloat16" for k in st.inputs if k)]  # no bf16 input)
    assert {st.op.type for st in steps} == set(DIRECT)
    assert {st.index: need.get(st.index, 0) for st in steps} == {st.index: 0 for st in steps}
    assert all(before[st.index] > 0 for st in steps)  # the widening backend plans copies there
    assert program.arena_bytes < widened.arena_bytes
    assert sum(need.values()) < sum(before.values())


class Launches(EmulatedDevice):
    """The emulator, recording the name of every kernel it launches."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def launch(self, name: str, *args: object) -> None:
        self.names.add(name)
        super().launch(name, *args)


def test_the_model_trains_on_the_direct_kernels(bundle, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Qwen3 under the recipe (attention on the host's NumPy bf16 kernel, as in tests/test_bf16.py)
    runs the direct kernels, with every matmul gradient NumPy's emulation's bits and the rest within fp32
    summation order, and the same bits as a backend that widens their bf16 inputs."""
    rng = np.random.default_rng(0)
    batch = rng.integers(0, 64, (2, 8)), rng.integers(0, 64, (2, 8))
    device = Launches()
    session = PluginSession(autoload=False)
    session.register(EmulatedCuda(device, without=("flash_attention", "flash_attention_backward")), "cuda")
    with session.activate():
        ref, got = (Model.from_ir(bundle, seed=0, backend=b, precision="bf16") for b in ("numpy", "cuda"))
        (want_loss, want), (loss, have) = (m.loss_and_grads(*batch) for m in (ref, got))
        launched = set(device.names)
        monkeypatch.setattr(_backend, "low_precision", _widening(_backend.low_precision))
        old_loss, old = Model.from_ir(bundle, seed=0, backend="cuda", precision="bf16").loss_and_grads(*batch)
    assert loss == old_loss
    assert all(np.array_equal(have[name], old[name]) for name in old)
    assert loss == pytest.approx(want_loss, rel=1e-6)
    for name in want:
        if name.endswith(("lm_head", "qkv_weight", "out_weight", "mlp_up_weight", "mlp_down_weight")):
            assert np.array_equal(have[name], want[name]), name
        else:
            assert np.abs(have[name] - want[name]).max() <= 1e-6 * float(np.abs(want[name]).max()), name
    assert launched >= DIRECT_KERNELS
    assert not launched & {"swiglu_rp_bf16", "swiglu_backward_rp_bf16", "qk_norm_rp_bf16"}


@pytest.mark.parametrize("model", ["LlamaModel", "GPTNeoXModel", "Qwen3MoEModel"])
def test_other_models_read_bf16_directly(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama (rope into bf16), GPT-NeoX (LayerNorm, GELU, biases) and Qwen3-MoE (the expert SwiGLU's float32
    gradient, the router's sums) under the recipe: every step of the direct kernels' ops with a bf16 input
    plans no workspace, and the loss and gradients are the bits of a backend that widens those inputs."""
    bundle = _bundle(model)
    rng = np.random.default_rng(0)
    batch = rng.integers(0, 64, (2, 8)), rng.integers(0, 64, (2, 8))
    session = PluginSession(autoload=False)
    session.register(EmulatedCuda(), "cuda-emulated")
    with session.activate():
        program = compile(bundle, bindings={"B": 2, "T": 8}, backend="cuda", precision="bf16")
        need = _backend.step_scratch(program, get_registry("kernels"), EmulatedDevice())
        loss, grads = Model.from_ir(bundle, seed=0, backend="cuda", precision="bf16").loss_and_grads(*batch)
        monkeypatch.setattr(_backend, "low_precision", _widening(_backend.low_precision))
        old_loss, old = Model.from_ir(bundle, seed=0, backend="cuda", precision="bf16").loss_and_grads(*batch)
    steps = [st for st in program.steps if st.op.type in (*DIRECT, *DIRECT_MORE) and st.how == "out"
             and any(program.tensors[k].dtype == "bfloat16" for k in st.inputs if k)]
    assert steps and {st.index: need.get(st.index, 0) for st in steps} == {st.index: 0 for st in steps}
    ops = {"LlamaModel": {"qkv_qk_norm_rope"}, "Qwen3MoEModel": {"swiglu_backward", "add"},
           "GPTNeoXModel": {"gelu", "gelu_backward", "layernorm_backward"}}
    assert {st.op.type for st in steps} >= ops[model]
    assert loss == old_loss
    assert all(np.array_equal(grads[name], old[name]) for name in old)

