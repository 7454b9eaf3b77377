"""The bf16 recipe's matmuls, attention and LM head on their slots as they lie: a float32 operand rounded to
bf16 on its load by the kernel (no bf16 copy), a bf16 output written by the kernel (no float32 temporary),
attention reading a float32 ``qkv`` and writing a float32 ``d_qkv`` (bf16 values) directly.

Oracles: the same kernels' inputs rounded on the host by ml_dtypes (round to nearest even, as the NumPy
emulation rounds) and outputs rounded by ml_dtypes: the same bits; NumPy's float64 product of the rounded
operands; the plan of a backend that takes the copies (the behaviour before these kernels): the same loss
and gradient bits, more planned workspace; the fp32 Program's plan of the same steps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import pytest

from kiln.core import Model, PluginSession, compile, get_registry
from kiln.cuda import EmulatedCuda, EmulatedDevice, _backend
from kiln.cuda._ops import (
    DeviceArray,
    Scratch,
    as_dtype,
    cast,
    flash_attention_backward_bf16,
    flash_attention_bf16,
    fused_lm_head_loss_backward_bf16,
    fused_lm_head_loss_bf16,
    matmul,
    matmul_lowp,
)

ml_dtypes = pytest.importorskip("ml_dtypes", reason="the bf16 recipe needs ml_dtypes")

CONFIG = {"vocab_size": 64, "d_model": 32, "n_layers": 1, "num_query_heads": 4, "num_kv_heads": 2,
          "head_size": 8, "d_ff": 64, "max_seq": 16}
BF16 = ml_dtypes.bfloat16


def _dev(device: EmulatedDevice, a: np.ndarray | None) -> DeviceArray | None:
    return None if a is None else DeviceArray.upload(device, a)


def _empty(device: EmulatedDevice, shape: Sequence[int], dtype: str = "float32") -> DeviceArray:
    a = DeviceArray(device, 0, tuple(shape), dtype)
    return DeviceArray(device, device.alloc(max(a.nbytes, 1)), a.shape, dtype)


def _host(a: DeviceArray) -> np.ndarray:
    return a.download().astype(np.float32)  # a bf16 one widened exactly


def _rounded(a: np.ndarray) -> np.ndarray:
    """float32 ``a`` rounded to bf16 values (ml_dtypes), as float32."""
    return a.astype(BF16).astype(np.float32)


def _no_temporaries(device: EmulatedDevice, fn: Any, *args: Any, **kw: Any) -> None:
    before = device.allocs
    fn(*args, **kw)
    assert device.allocs == before, f"{getattr(fn, '__name__', fn)} allocated temporaries"


@pytest.mark.parametrize("transpose", ["NN", "NT", "TN", "TT"])
@pytest.mark.parametrize("types", ["fff", "ffh", "fhf", "fhh", "hff", "hfh", "hhh", "hhf"])
def test_matmul_rounds_operands_on_load_and_writes_bf16(emulated: EmulatedDevice, types: str,
                                                        transpose: str) -> None:
    """Every mix of float32 (f) and bf16 (h) a, b and out, every transpose, ragged shapes: no temporary, and
    the bits of the bf16-input kernel on host-rounded operands with its float32 output rounded on the host;
    within fp32 summation order of NumPy's float64 product of the rounded operands."""
    rng = np.random.default_rng(len(transpose) + sum(map(ord, types + transpose)))
    m, k, n = 37, 45, 21
    a = rng.standard_normal((k, m) if transpose[0] == "T" else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if transpose[1] == "T" else (k, n)).astype(np.float32)
    ins = [_dev(emulated, x.astype(BF16) if t == "h" else x) for x, t in zip((a, b), types, strict=False)]
    out = _empty(emulated, (m, n), "bfloat16" if types[2] == "h" else "float32")
    _no_temporaries(emulated, matmul_lowp, *ins, out=[out], transpose=transpose)
    ref32 = _empty(emulated, (m, n))
    matmul(_dev(emulated, a.astype(BF16)), _dev(emulated, b.astype(BF16)), out=[ref32], transpose=transpose)
    want = _host(ref32)
    if types[2] == "h":
        want = _rounded(want)
    assert np.array_equal(_host(out), want)
    ar, br = _rounded(a).astype(np.float64), _rounded(b).astype(np.float64)
    exact = (ar.T if transpose[0] == "T" else ar) @ (br.T if transpose[1] == "T" else br)
    assert np.abs(_host(out) - exact).max() <= (2 ** -8 if types[2] == "h" else 1e-5) * np.abs(exact).max()


@pytest.mark.parametrize("c_type", ["float32", "bfloat16"])
def test_matmul_rounds_c_and_a_flagged_output(emulated: EmulatedDevice, c_type: str) -> None:
    """``c`` as the recipe rounds any float input of a lowered op (a float32 c rounded to bf16, a bf16 one
    as it is), ``alpha`` and ``beta``; ``round_out`` rounds a float32 output in place."""
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal((20, 18)).astype(np.float32) for _ in range(2))
    c = rng.standard_normal((20, 20)).astype(np.float32)
    cd = _dev(emulated, c.astype(BF16) if c_type == "bfloat16" else c)
    out = _empty(emulated, (20, 20))
    matmul_lowp(_dev(emulated, a), _dev(emulated, b), cd, out=[out], transpose="NT", alpha=0.5, beta=-2.0,
                round_out=True)
    ref = _empty(emulated, (20, 20))
    matmul(_dev(emulated, a.astype(BF16)), _dev(emulated, b.astype(BF16)), _dev(emulated, _rounded(c)),
           out=[ref], transpose="NT", alpha=0.5, beta=-2.0)
    assert np.array_equal(_host(out), _rounded(_host(ref)))


def test_matmul_names_a_wrong_dtype(emulated: EmulatedDevice) -> None:
    a = _dev(emulated, np.zeros((4, 4), np.int32))
    b = _dev(emulated, np.zeros((4, 4), np.float32))
    with pytest.raises(Exception, match="a is int32"):
        matmul_lowp(a, b, out=[_empty(emulated, (4, 4))])


ATTN = {"Hq": 4, "Hkv": 2, "D": 8, "causal": True, "softmax_scale": None, "window_size": None,
        "softcap": None, "alibi": False}


def test_attention_reads_float32_qkv_and_writes_float32_d_qkv(emulated: EmulatedDevice) -> None:
    """Attention under the recipe on a float32 ``qkv`` (rope's output) reads it rounded on load and its
    backward writes a float32 ``d_qkv``, with no copy of ``qkv`` and no bf16 temporary of ``d_qkv``: the bits
    of the same kernels on the host-rounded bf16 ``qkv`` and of their bf16 ``d_qkv`` widened."""
    rng = np.random.default_rng(7)
    b, t, f = 2, 70, (4 + 2 * 2) * 8
    qkv = rng.standard_normal((b, t, f)).astype(np.float32)
    d_out = rng.standard_normal((b, t, 32)).astype(BF16)
    results = []
    for q in (_dev(emulated, qkv), _dev(emulated, qkv.astype(BF16))):
        o, lse = _empty(emulated, (b, t, 32), "bfloat16"), _empty(emulated, (b, 4, t))
        fwd = _no_temporaries if q.dtype == "float32" else (lambda dev, fn, *a, **k: fn(*a, **k))
        fwd(emulated, flash_attention_bf16, q, None, out=[o, lse], **ATTN)
        grads = []
        for g_type in ("float32", "bfloat16"):
            d_qkv = _empty(emulated, (b, t, f), g_type)
            flash_attention_backward_bf16(_dev(emulated, d_out), q, o, lse, None, None, out=[d_qkv], **ATTN)
            grads.append(_host(d_qkv))
        results.append((_host(o), _host(lse), *grads))
    for have, want in zip(results[0], results[1], strict=True):
        assert np.array_equal(have, want)
    assert np.array_equal(results[0][2], results[0][3])  # float32 d_qkv holds the bf16 values
    assert np.array_equal(results[0][2], _rounded(results[0][2]))


@pytest.mark.parametrize("softcap", [None, 20.0])
def test_lm_head_reads_float32_operands(emulated: EmulatedDevice, softcap: float | None) -> None:
    """The LM head under the recipe on float32 ``x`` and weight takes no bf16 copies of them (nor of the
    logits' gradient): the loss, log-sum-exp and both gradients are the bits of the same passes on
    host-rounded bf16 operands."""
    rng = np.random.default_rng(11)
    n, v, h = 37, 50, 24
    x = rng.standard_normal((n, h)).astype(np.float32)
    w = (rng.standard_normal((v, h)) * 0.3).astype(np.float32)
    targets = rng.integers(0, v, n).astype(np.int32)
    targets[3] = -100
    d_loss = rng.standard_normal(n).astype(np.float32)
    kw = {"ignore_index": -100, "softcap": softcap}
    results = []
    for xs, ws in ((x, w), (x.astype(BF16), w.astype(BF16))):
        xd, wd, td = _dev(emulated, xs), _dev(emulated, ws), _dev(emulated, targets)
        loss, lse = _empty(emulated, (n,)), _empty(emulated, (n,))
        fused_lm_head_loss_bf16(xd, wd, td, out=[loss, lse], **kw)
        d_x, d_w = _empty(emulated, (n, h)), _empty(emulated, (v, h))
        fused_lm_head_loss_backward_bf16(_dev(emulated, d_loss), xd, wd, td, lse, out=[d_x, d_w], **kw)
        results.append([_host(a) for a in (loss, lse, d_x, d_w)])
    for have, want in zip(*results, strict=True):
        assert np.array_equal(have, want)


# --- the whole step ---------------------------------------------------------------------------------------


def _bundle() -> Any:
    dsl = pytest.importorskip("kiln.dsl", reason="the models come from kiln-dsl")
    from kiln.dsl.stdlib import models

    return dsl.build_bundle(models.Qwen3Model, CONFIG)


#: the inputs the recipe's attention and LM head took bf16 copies of when float32 (and d_qkv's bf16 temporary)
COPIED = {"flash_attention": (0,), "flash_attention_backward": (1,), "fused_lm_head_loss": (0, 1),
          "fused_lm_head_loss_backward": (1, 2)}


def _copying(low_precision: Any) -> Any:
    """``low_precision`` as it ran before: attention's and the LM head's float32 inputs rounded into bf16
    copies and attention's float32 ``d_qkv`` through a bf16 temporary (matmuls: ``BF16_MATMULS`` emptied)."""
    def copied(program: Any, step: Any, opdef: Any, kernel: Any, inputs: Sequence[DeviceArray | None],
               outputs: Sequence[DeviceArray | None], kw: Any) -> Any:
        if step.op.type not in COPIED:
            return low_precision(program, step, opdef, kernel, inputs, outputs, kw)

        def run() -> None:
            dev = next(a.device for a in (*inputs, *outputs) if a is not None)
            with Scratch(dev) as s:
                ins = [as_dtype(s, a, "bfloat16") if i in COPIED[step.op.type] else a
                       for i, a in enumerate(inputs)]
                outs = list(outputs)
                if step.op.type == "flash_attention_backward" and outs[0] is not None:
                    outs[0] = s.array(outs[0].shape, "bfloat16")
                low_precision(program, step, opdef, kernel, ins, outs, kw)()
                for o, y in zip(outputs, outs, strict=True):
                    if o is not None and y is not o:
                        cast(y, out=[o])

        return run

    return copied


def test_the_bf16_step_plans_no_operand_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Qwen3 under the recipe: its matmul steps and attention's forward plan no workspace, attention's
    backward and the LM head's forward what the fp32 Program's steps plan (row shifts, a logits tile), the
    LM head's backward two tiles (the logits and their gradient); a backend taking the copies plans more
    for each; the loss and every gradient are its bits."""
    bundle = _bundle()
    rng = np.random.default_rng(0)
    batch = rng.integers(0, 64, (2, 8)), rng.integers(0, 64, (2, 8))
    session = PluginSession(autoload=False)
    session.register(EmulatedCuda(), "cuda-emulated")
    with session.activate():
        kernels = get_registry("kernels")
        # the two LM-head steps as steps (a fused pass, when the backend runs one, plans its own temporaries)
        plans = {p: attrs.evolve(compile(bundle, bindings={"B": 2, "T": 8}, backend="cuda", precision=p),
                                 fusions=()) for p in ("fp32", "bf16")}
        need = {p: _backend.step_scratch(plans[p], kernels, EmulatedDevice()) for p in plans}
        loss, grads = Model.from_ir(bundle, seed=0, backend="cuda", precision="bf16").loss_and_grads(*batch)
        monkeypatch.setattr(_backend, "BF16_MATMULS", {})
        monkeypatch.setattr(_backend, "low_precision", _copying(_backend.low_precision))
        copies = attrs.evolve(compile(bundle, bindings={"B": 2, "T": 8}, backend="cuda", precision="bf16"),
                              fusions=())
        before = _backend.step_scratch(copies, kernels, EmulatedDevice())
        old_loss, old = Model.from_ir(bundle, seed=0, backend="cuda", precision="bf16").loss_and_grads(*batch)
    program = plans["bf16"]
    by_op: dict[str, list[int]] = {}
    for st in program.steps:
        by_op.setdefault(st.op.type, []).append(st.index)
    fp32_index = {(st.op.type, tuple(st.outputs)): st.index for st in plans["fp32"].steps}
    matmuls = by_op["matmul"]
    assert len(matmuls) >= 10 and all(need["bf16"].get(i, 0) == 0 for i in matmuls)
    assert all(before[i] > 0 for i in matmuls)
    assert all(need["bf16"].get(i, 0) == 0 for i in by_op["flash_attention"])
    fp32_need = {op: [need["fp32"].get(fp32_index[(op, tuple(program.steps[i].outputs))], 0)
                      for i in by_op[op]] for op in COPIED}
    for op, tiles in (("flash_attention_backward", 1), ("fused_lm_head_loss", 1),
                      ("fused_lm_head_loss_backward", 2)):  # the backward: the logits and their gradient
        pairs = zip(by_op[op], fp32_need[op], strict=True)
        assert all(0 < need["bf16"].get(i, 0) <= tiles * f for i, f in pairs), op
    for op in COPIED:
        assert all(before[i] > need["bf16"].get(i, 0) for i in by_op[op]), op
    assert sum(need["bf16"].values()) < sum(before.values())
    assert program.arena_bytes <= copies.arena_bytes
    assert loss == old_loss
    assert all(np.array_equal(grads[name], old[name]) for name in old)
