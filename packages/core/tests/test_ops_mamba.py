"""The Mamba ops: forward semantics against naive per-element loops, shape rules, and (``parity``) values and
gradients against PyTorch's conv1d and transformers' ``mamba_selective_scan``. Their backward rules are
also checked against finite differences by the generic harness (test_op_gradients.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kiln.core import KilnError, check_op, op_registry
from kiln.core.ir._dims import parse_shape, shape_to_json
from kiln.core.ir._ir import TensorType
from kiln.core.ops._ops import InferContext

REG = op_registry()


def run(name: str, *inputs: np.ndarray | None, **attrs: Any) -> Any:
    out = REG.get_op(name).run(inputs, attrs)
    return out if len(out) > 1 else out[0]


def infer(name: str, *types: tuple[list[Any], str] | None, **attrs: Any) -> list[tuple[list[Any], str]]:
    opdef = REG.get_op(name)
    ins = [None if t is None else TensorType(parse_shape(t[0]), t[1]) for t in types]
    outs = opdef.infer(InferContext(name, ins, opdef.resolve_attrs(attrs)))
    return [(shape_to_json(t.shape), t.dtype) for t in outs]


def silu(x: float) -> float:
    return x / (1.0 + np.exp(-x))


def naive_conv(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, act: bool,
               state: np.ndarray | None = None) -> np.ndarray:
    b, d, t = x.shape
    k = w.shape[-1]
    out = np.zeros_like(x)
    for i in range(b):
        for c in range(d):
            for s in range(t):
                acc = 0.0 if bias is None else bias[c]
                for j in range(k):  # tap j reads step s - (k - 1) + j; earlier steps: the state, or zero
                    at = s - (k - 1) + j
                    if at >= 0:
                        acc += w[c, 0, j] * x[i, c, at]
                    elif state is not None:
                        acc += w[c, 0, j] * state[i, c, k - 1 + at]
                out[i, c, s] = silu(acc) if act else acc
    return out


def naive_scan(u: np.ndarray, delta: np.ndarray, A: np.ndarray, B: np.ndarray, C: np.ndarray,
               D: np.ndarray | None, z: np.ndarray | None, bias: np.ndarray | None,
               softplus: bool, h0: np.ndarray | None = None, last: np.ndarray | None = None) -> np.ndarray:
    """The recurrence of the Mamba paper, one channel and one step at a time, from the state ``h0``
    (zeros without it); writes the last state into ``last`` if given."""
    bsz, d, t = u.shape
    n = A.shape[1]
    out = np.zeros_like(u)
    for i in range(bsz):
        for c in range(d):
            g = 0 if B.ndim == 3 else c // (d // B.shape[1])
            h = np.zeros(n) if h0 is None else h0[i, c].copy()
            for s in range(t):
                dt = delta[i, c, s] + (0.0 if bias is None else bias[c])
                if softplus:
                    dt = np.log1p(np.exp(dt))
                bs = B[i, :, s] if B.ndim == 3 else B[i, g, :, s]
                cs = C[i, :, s] if C.ndim == 3 else C[i, g, :, s]
                h = np.exp(dt * A[c]) * h + dt * bs * u[i, c, s]
                y = float(h @ cs) + (0.0 if D is None else D[c] * u[i, c, s])
                out[i, c, s] = y * silu(z[i, c, s]) if z is not None else y
            if last is not None:
                last[i, c] = h
    return out


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


@pytest.mark.parametrize(("k", "t", "bias", "act"),
                         [(4, 7, True, "silu"), (2, 5, False, "none"), (5, 3, True, "none")])
def test_conv1d_matches_the_naive_loop(rng: np.random.Generator, k: int, t: int, bias: bool,
                                       act: str) -> None:
    x, w = rng.standard_normal((2, 3, t)), rng.standard_normal((3, 1, k))
    b = rng.standard_normal(3) if bias else None
    got = run("mamba_conv1d", x, w, b, activation=act)
    np.testing.assert_allclose(got, naive_conv(x, w, b, act == "silu"), rtol=1e-12, atol=1e-12)


def test_conv1d_is_causal(rng: np.random.Generator) -> None:
    x, w = rng.standard_normal((1, 2, 8)), rng.standard_normal((2, 1, 4))
    changed = x.copy()
    changed[..., 5:] += 1.0
    a, b = run("mamba_conv1d", x, w), run("mamba_conv1d", changed, w)
    np.testing.assert_array_equal(a[..., :5], b[..., :5])
    assert not np.allclose(a[..., 5:], b[..., 5:])


@pytest.mark.parametrize("variant", ["full", "plain", "groups"])
def test_scan_matches_the_naive_recurrence(rng: np.random.Generator, variant: str) -> None:
    b, d, t, n = 2, 4, 6, 3
    u, delta = rng.standard_normal((b, d, t)), rng.standard_normal((b, d, t))
    A = -np.exp(rng.standard_normal((d, n)))
    g = (b, 2, n, t) if variant == "groups" else (b, n, t)
    B, C = rng.standard_normal(g), rng.standard_normal(g)
    full = variant != "plain"
    D = rng.standard_normal(d) if full else None
    z = rng.standard_normal((b, d, t)) if full else None
    bias = rng.standard_normal(d) if full else None
    if not full:
        delta = np.abs(delta)  # no softplus: a positive step as given
    got = run("mamba_selective_scan", u, delta, A, B, C, D, z, bias, delta_softplus=full)
    np.testing.assert_allclose(got, naive_scan(u, delta, A, B, C, D, z, bias, full), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("k", "t"), [(4, 7), (4, 2), (1, 3)])
def test_conv1d_with_its_state_matches_the_naive_loop(rng: np.random.Generator, k: int, t: int) -> None:
    x, w, b = rng.standard_normal((2, 3, t)), rng.standard_normal((3, 1, k)), rng.standard_normal(3)
    state = rng.standard_normal((2, 3, k - 1))
    y, final = run("mamba_conv1d", x, w, b, state, return_final_states=True)
    np.testing.assert_allclose(y, naive_conv(x, w, b, True, state), rtol=1e-12, atol=1e-12)
    # the final state is the last K - 1 inputs: from the state too when T < K - 1
    history = [state[..., s] for s in range(k - 1)] + [x[..., s] for s in range(t)]
    want = np.stack(history[len(history) - (k - 1):], axis=-1) if k > 1 else np.zeros((2, 3, 0))
    np.testing.assert_array_equal(final, want)
    # without a state the final state still is the last K - 1 inputs, zeros before the sequence
    _, fresh = run("mamba_conv1d", x, w, b, return_final_states=True)
    zeros = [np.zeros((2, 3))] * (k - 1) + [x[..., s] for s in range(t)]
    np.testing.assert_array_equal(fresh, np.stack(zeros[len(zeros) - (k - 1):], axis=-1) if k > 1 else want)


def test_scan_with_its_state_matches_the_naive_recurrence(rng: np.random.Generator) -> None:
    b, d, t, n = 2, 4, 5, 3
    u, delta, z = (rng.standard_normal((b, d, t)) for _ in range(3))
    A = -np.exp(rng.standard_normal((d, n)))
    B, C = rng.standard_normal((b, 2, n, t)), rng.standard_normal((b, 2, n, t))
    D, bias, h0 = rng.standard_normal(d), rng.standard_normal(d), rng.standard_normal((b, d, n))
    out, last = run("mamba_selective_scan", u, delta, A, B, C, D, z, bias, h0, delta_softplus=True,
                    return_last_state=True)
    want_last = np.zeros((b, d, n))
    want = naive_scan(u, delta, A, B, C, D, z, bias, True, h0=h0, last=want_last)
    np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(last, want_last, rtol=1e-10, atol=1e-12)
    # an initial state of zeros is no initial state
    ins = (u, delta, A, B, C, D, z, bias)
    np.testing.assert_array_equal(run("mamba_selective_scan", *ins, np.zeros_like(h0), delta_softplus=True),
                                  run("mamba_selective_scan", *ins, delta_softplus=True))


def _scan_inputs(rng: np.random.Generator, b: int, d: int, t: int, n: int) -> dict[str, np.ndarray]:
    return {"u": rng.standard_normal((b, d, t)), "delta": 0.5 * rng.standard_normal((b, d, t)),
            "A": -np.exp(0.5 * rng.standard_normal((d, n))), "B": rng.standard_normal((b, 2, n, t)),
            "C": rng.standard_normal((b, 2, n, t)), "D": rng.standard_normal(d),
            "z": rng.standard_normal((b, d, t)), "bias": rng.standard_normal(d)}


TIME = {"u": -1, "delta": -1, "B": -1, "C": -1, "z": -1}


def _chunk(v: dict[str, np.ndarray], cut: slice) -> dict[str, np.ndarray]:
    return {k: a[..., cut] if k in TIME else a for k, a in v.items()}


@pytest.mark.parametrize("cut", [1, 3, 6])
def test_two_chunks_passing_the_states_are_the_whole_sequence(rng: np.random.Generator, cut: int) -> None:
    """Forward and backward: the conv's and the scan's states carry a sequence across a cut."""
    b, d, t, n, k = 2, 4, 7, 3, 4
    x, w, cb = rng.standard_normal((b, d, t)), rng.standard_normal((d, 1, k)), rng.standard_normal(d)
    v = _scan_inputs(rng, b, d, t, n)
    whole_y, whole_conv = run("mamba_conv1d", x, w, cb, return_final_states=True)
    y1, s1 = run("mamba_conv1d", x[..., :cut], w, cb, return_final_states=True)
    y2, s2 = run("mamba_conv1d", x[..., cut:], w, cb, s1, return_final_states=True)
    np.testing.assert_allclose(np.concatenate([y1, y2], axis=-1), whole_y, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s2, whole_conv, rtol=0, atol=0)

    names = ("u", "delta", "A", "B", "C", "D", "z", "bias")

    def scan(part: dict[str, np.ndarray], h0: np.ndarray | None = None) -> Any:
        return run("mamba_selective_scan", *(part[k_] for k_ in names), h0, delta_softplus=True,
                   return_last_state=True)

    whole, whole_h = scan(v)
    o1, h1 = scan(_chunk(v, slice(None, cut)))
    o2, h2 = scan(_chunk(v, slice(cut, None)), h1)
    np.testing.assert_allclose(np.concatenate([o1, o2], axis=-1), whole, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(h2, whole_h, rtol=1e-10, atol=1e-12)

    # backward: the second chunk's state gradients, fed to the first chunk as its final states'
    # gradients, give the whole sequence's gradients
    cot, cot_h = rng.standard_normal((b, d, t)), rng.standard_normal((b, d, n))
    whole_g = run("mamba_selective_scan_backward", cot, *(v[k_] for k_ in names), None, cot_h,
                  delta_softplus=True)
    p1, p2 = _chunk(v, slice(None, cut)), _chunk(v, slice(cut, None))
    g2 = run("mamba_selective_scan_backward", cot[..., cut:], *(p2[k_] for k_ in names), h1, cot_h,
             delta_softplus=True)
    g1 = run("mamba_selective_scan_backward", cot[..., :cut], *(p1[k_] for k_ in names), None, g2[8],
             delta_softplus=True)
    assert len(g1) == 8 and len(g2) == 9  # d_ssm_state only where an initial state was given
    for i, name in enumerate(names):
        got = np.concatenate([g1[i], g2[i]], axis=-1) if name in TIME else g1[i] + g2[i]
        np.testing.assert_allclose(got, whole_g[i], rtol=1e-9, atol=1e-11, err_msg=name)
    cot_y, cot_s = rng.standard_normal((b, d, t)), rng.standard_normal((b, d, k - 1))
    dx, dw, db = run("mamba_conv1d_backward", cot_y, x, w, cb, None, cot_s, activation="silu")
    c2 = run("mamba_conv1d_backward", cot_y[..., cut:], x[..., cut:], w, cb, s1, cot_s, activation="silu")
    c1 = run("mamba_conv1d_backward", cot_y[..., :cut], x[..., :cut], w, cb, None, c2[3], activation="silu")
    np.testing.assert_allclose(np.concatenate([c1[0], c2[0]], axis=-1), dx, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(c1[1] + c2[1], dw, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(c1[2] + c2[2], db, rtol=1e-10, atol=1e-12)


def test_the_gradient_check_covers_the_states() -> None:
    conv = check_op(REG["mamba_conv1d"], REG, seed=5)
    scan = check_op(REG["mamba_selective_scan"], REG, seed=5)
    assert "conv_state?" in {r.input for r in conv} and "ssm_state?" in {r.input for r in scan}
    assert max(r.max_rel_error for r in conv + scan) <= 1e-6
    # the final states' cotangents reach the inputs: a sample with return_*_state has two outputs
    assert any(r.attrs.get("return_final_states") for r in conv)
    assert any(r.attrs.get("return_last_state") for r in scan)


def test_scan_keeps_float32(rng: np.random.Generator) -> None:
    f = np.float32
    u, delta = rng.standard_normal((1, 2, 4)).astype(f), rng.standard_normal((1, 2, 4)).astype(f)
    A, B = -np.ones((2, 3), f), rng.standard_normal((1, 3, 4)).astype(f)
    out = REG.get_op("mamba_selective_scan").run([u, delta, A, B, B, None, u, None], {"delta_softplus": True},
                                                   float_dtype=np.float32)
    assert out[0].dtype == np.float32


def test_backward_rules_pass_the_gradient_check() -> None:
    for name in ("mamba_conv1d", "mamba_selective_scan"):
        reports = check_op(REG[name], REG, seed=11)
        # every float input of every sample is checked: x, weight, bias / u, delta, A, B, C, D, z, bias
        assert {r.input for r in reports} >= ({"x", "weight", "bias?"} if name == "mamba_conv1d" else
                                              {"u", "delta", "A", "B", "C", "D?", "z?", "delta_bias?"})
        assert max(r.max_rel_error for r in reports) <= 1e-6, name


def f(*shape: Any, dtype: str = "fp32") -> tuple[list[Any], str]:
    return list(shape), dtype


BDT, DN, BNT = f("B", "D", "T"), f("D", "N"), f("B", "N", "T")


def test_shape_rules() -> None:
    assert infer("mamba_conv1d", BDT, f("D", 1, 4), f("D")) == [BDT]
    assert infer("mamba_selective_scan", BDT, BDT, DN, f("B", 2, "N", "T"), f("B", 2, "N", "T"), None, BDT,
                 f("D"), delta_softplus=True) == [BDT]
    back = infer("mamba_selective_scan_backward", BDT, BDT, BDT, DN, BNT, BNT)
    assert back == [BDT, BDT, DN, BNT, BNT, f("D"), BDT, f("D")]
    # the inference states: [B, D, K - 1] and [B, D, N], out with return_*, their gradients when given
    state = f("B", "D", "K - 1")
    assert infer("mamba_conv1d", BDT, f("D", 1, "K"), None, state, return_final_states=True) == [BDT, state]
    assert infer("mamba_conv1d", BDT, f("D", 1, 4), return_final_states=True) == [BDT, f("B", "D", 3)]
    assert infer("mamba_conv1d_backward", None, BDT, f("D", 1, "K"), None, state, state) == [
        BDT, f("D", 1, "K"), f("D"), state]
    # a call that asks for no count gets y alone, as before the states existed
    for op in ("mamba_conv1d", "mamba_selective_scan", "split"):
        assert REG.get_op(op).default_outputs == 1, op
    assert REG.get_op("mamba_selective_scan_backward").default_outputs == 8
    bdn = f("B", "D", "N")
    assert infer("mamba_selective_scan", BDT, BDT, DN, BNT, BNT, None, None, None, bdn,
                 return_last_state=True) == [BDT, bdn]
    back = infer("mamba_selective_scan_backward", None, BDT, BDT, DN, BNT, BNT, None, None, None, bdn, bdn)
    assert back[8:] == [bdn]


@pytest.mark.parametrize(("op", "types", "message"), [
    ("mamba_conv1d", [f("B", "T", "D"), f("D", 4)], "weight"),
    ("mamba_conv1d", [BDT, f("E", 1, 4)], "weight must be [D, 1, K]"),
    ("mamba_conv1d", [BDT, f("D", 1, 4), f("E")], "bias must be [D]"),
    ("mamba_conv1d", [f("B", "D"), f("D", 1, 4)], "channels-first"),
    ("mamba_conv1d", [BDT, f("D", 1, 4), None, f("B", "D", 4)], "conv_state must be [B, D, K - 1]"),
    ("mamba_selective_scan", [BDT, BDT, DN, BNT, BNT, None, None, None, f("B", "N", "D")],
     "ssm_state must be"),
    ("mamba_selective_scan", [BDT, f("B", "T", "D"), DN, BNT, BNT], "delta"),
    ("mamba_selective_scan", [BDT, BDT, f("N", "D"), BNT, BNT], "A must be [D, N]"),
    ("mamba_selective_scan", [BDT, BDT, DN, f("B", "T", "N"), f("B", "T", "N")], "B must be"),
    ("mamba_selective_scan", [f(2, 6, 5), f(2, 6, 5), f(6, 3), f(2, 4, 3, 5), f(2, 4, 3, 5)], "groups"),
    ("mamba_selective_scan", [BDT, BDT, DN, BNT, BNT, f("N")], "D must be [D]"),
    ("mamba_selective_scan", [f("B", "D", "T", dtype="int32"), BDT, DN, BNT, BNT], "'u' is int32"),
])
def test_shape_rules_name_the_culprit(op: str, types: list[Any], message: str) -> None:
    with pytest.raises(KilnError, match=message.replace("[", r"\[")) as info:
        infer(op, *types)
    assert op in str(info.value)


def test_bad_attributes_and_groups_at_run_time(rng: np.random.Generator) -> None:
    x, w = rng.standard_normal((1, 2, 3)), rng.standard_normal((2, 1, 2))
    with pytest.raises(KilnError, match="activation"):
        run("mamba_conv1d", x, w, activation="relu")
    u = rng.standard_normal((1, 6, 3))
    B = rng.standard_normal((1, 4, 2, 3))
    with pytest.raises(KilnError, match="groups"):
        run("mamba_selective_scan", u, u, -np.ones((6, 2)), B, B)


def close(ours: np.ndarray, theirs: np.ndarray, what: str, rel: float = 1e-5) -> None:
    assert ours.shape == theirs.shape, what
    err, scale = float(np.abs(ours - theirs).max()), float(np.abs(theirs).max())
    assert err <= rel * scale, f"{what}: max error {err:.3g} exceeds {rel} x {scale:.3g}"


@pytest.mark.parity
def test_values_and_gradients_match_torch_and_transformers(rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch")
    mamba = pytest.importorskip("transformers.models.mamba.modeling_mamba")
    b, d, t, n, k = 2, 5, 9, 3, 4
    shapes = {"x": (b, d, t), "w": (d, 1, k), "cb": (d,), "delta": (b, d, t), "A_log": (d, n), "B": (b, n, t),
              "C": (b, n, t), "D": (d,), "z": (b, d, t), "bias": (d,)}
    arrays = {name: rng.standard_normal(shape) for name, shape in shapes.items()}
    cot = rng.standard_normal((b, d, t))
    tv = {k_: torch.tensor(v, requires_grad=True) for k_, v in arrays.items()}
    u_t = torch.nn.functional.silu(torch.nn.functional.conv1d(tv["x"], tv["w"], tv["cb"], padding=k - 1,
                                                                groups=d)[..., :t])
    out_t = mamba.mamba_selective_scan(u_t, tv["delta"], -torch.exp(tv["A_log"]), tv["B"], tv["C"], D=tv["D"],
                                       z=tv["z"], delta_bias=tv["bias"], delta_softplus=True)
    (out_t * torch.tensor(cot)).sum().backward()

    a = arrays
    u = run("mamba_conv1d", a["x"], a["w"], a["cb"])
    A = -np.exp(a["A_log"])
    out = run("mamba_selective_scan", u, a["delta"], A, a["B"], a["C"], a["D"], a["z"], a["bias"],
              delta_softplus=True)
    # transformers runs the discretisation in float32 (`.float()`), so float64 agrees to float32 rounding
    close(out, out_t.detach().numpy(), "out")
    d_u, d_delta, d_A, d_B, d_C, d_D, d_z, d_bias = run(
        "mamba_selective_scan_backward", cot, u, a["delta"], A, a["B"], a["C"], a["D"], a["z"], a["bias"],
        delta_softplus=True)
    d_x, d_w, d_cb = run("mamba_conv1d_backward", d_u, a["x"], a["w"], a["cb"], activation="silu")
    ours = {"x": d_x, "w": d_w, "cb": d_cb, "delta": d_delta, "A_log": d_A * A, "B": d_B, "C": d_C, "D": d_D,
            "z": d_z, "bias": d_bias}
    for name, g in ours.items():
        close(g, tv[name].grad.numpy(), name)


@pytest.mark.parity
def test_the_last_state_and_its_gradient_match_transformers(rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch")
    mamba = pytest.importorskip("transformers.models.mamba.modeling_mamba")
    b, d, t, n = 2, 4, 6, 3
    shapes = {"u": (b, d, t), "delta": (b, d, t), "A_log": (d, n), "B": (b, n, t), "C": (b, n, t), "D": (d,),
              "bias": (d,)}
    a = {name: rng.standard_normal(shape) for name, shape in shapes.items()}
    cot, cot_h = rng.standard_normal((b, d, t)), rng.standard_normal((b, d, n))
    tv = {k: torch.tensor(v, requires_grad=True) for k, v in a.items()}
    out_t, last_t = mamba.mamba_selective_scan(
        tv["u"], tv["delta"], -torch.exp(tv["A_log"]), tv["B"], tv["C"], D=tv["D"], delta_bias=tv["bias"],
        delta_softplus=True, return_last_state=True)
    ((out_t * torch.tensor(cot)).sum() + (last_t * torch.tensor(cot_h)).sum()).backward()
    A = -np.exp(a["A_log"])
    ins = (a["u"], a["delta"], A, a["B"], a["C"], a["D"], None, a["bias"])
    out, last = run("mamba_selective_scan", *ins, delta_softplus=True, return_last_state=True)
    close(out, out_t.detach().numpy(), "out")
    close(last, last_t.detach().numpy(), "last_state")
    d_u, d_delta, d_A, d_B, d_C, d_D, _, d_bias = run("mamba_selective_scan_backward", cot, *ins, None, cot_h,
                                                       delta_softplus=True)
    ours = {"u": d_u, "delta": d_delta, "A_log": d_A * A, "B": d_B, "C": d_C, "D": d_D, "bias": d_bias}
    for name, g in ours.items():
        close(g, tv[name].grad.numpy(), name)
