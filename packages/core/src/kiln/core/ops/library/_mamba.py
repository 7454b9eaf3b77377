"""Mamba (selective state space) primitives: the causal depthwise conv1d and the selective scan.

Both take the channels-first layout of Mamba's reference code and HF ``MambaMixer``: ``[B, D, T]``
(batch, channels, time). The scan is Mamba-1's ``selective_scan_ref``::

    dt  = softplus(delta + delta_bias)          (softplus only with delta_softplus)
    h_t = exp(dt_t * A) * h_{t-1} + dt_t * B_t * u_t        h_{-1} = ssm_state or 0, per channel d: [N]
    y_t = <h_t, C_t> + D * u_t,   out_t = y_t * silu(z_t)

Both carry the state of incremental inference across chunks of a sequence, as causal_conv1d's
``initial_states`` / ``return_final_states`` and selective_scan's ``return_last_state``: the conv's
optional ``conv_state`` [B, D, K-1] (the K-1 inputs before x) and the scan's ``ssm_state`` [B, D, N]
(h_{-1}); with ``return_final_states`` / ``return_last_state`` the op has a second output, the state
to pass to the next chunk. Running a sequence in chunks that pass the state on equals running it whole,
and the states are differentiable.

Its backward op replays the scan forward from the saved inputs and runs it in reverse for the state
gradients (what the fused CUDA kernels do chunk by chunk), so a training step keeps only the scan's
inputs, never its ``[B, D, T, N]`` states.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from kiln.core._errors import OpError
from kiln.core.ir._dims import DimExpr, parse_dim, simplify
from kiln.core.ir._ir import TensorType
from kiln.core.ops._ops import AttrSpec, BackwardContext, Cost, InferContext, Sample
from kiln.core.ops.library._common import check_same, core_op, float_dtype_of, randn


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free 1 / (1 + exp(-x))


def _silu_grad(x: np.ndarray, s: np.ndarray) -> np.ndarray:
    """d silu(x) / dx = s (1 + x (1 - s)), s = sigmoid(x)."""
    out: np.ndarray = s * (1.0 + x * (1.0 - s))
    return out


def _dims(ctx: InferContext, i: int) -> str:
    return f"[{', '.join(map(str, ctx.shape(i)))}]"


def _rank(ctx: InferContext, i: int, ranks: Sequence[int], what: str, layout: str) -> None:
    if len(ctx.shape(i)) not in ranks:
        raise ctx.fail(f"{what} must be {layout}, found {_dims(ctx, i)}")


def _nbytes(*shapes: Sequence[int]) -> float:
    return 4.0 * sum(float(np.prod(s)) for s in shapes)


# --- mamba_conv1d ---------------------------------------------------------------------------------


def _padded(x: np.ndarray, state: np.ndarray | None, k: int, dtype: np.dtype) -> np.ndarray:
    """[the K-1 inputs before x (the state, or zeros), x]: [B, D, K - 1 + T]."""
    head = np.zeros((*x.shape[:-1], k - 1), dtype) if state is None else state.astype(dtype, copy=False)
    return np.concatenate([head, x.astype(dtype, copy=False)], axis=-1)


def _conv_pre(xp: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """The convolution before its activation: bias[d] + sum_j w[d, 0, j] xp[b, d, t + j]."""
    k = weight.shape[-1]
    t = xp.shape[-1] - (k - 1)
    out = np.zeros((*xp.shape[:-1], t), xp.dtype)
    for j in range(k):
        out += weight[:, 0, j, None] * xp[..., j:j + t]
    if bias is not None:
        out += bias[:, None]
    return out


def _conv(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None,
          conv_state: np.ndarray | None = None, *, activation: str,
          return_final_states: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    xp = _padded(x, conv_state, weight.shape[-1], float_dtype_of(x, weight, bias, conv_state))
    pre = _conv_pre(xp, weight, bias)
    out: np.ndarray = pre * _sigmoid(pre) if activation == "silu" else pre
    # the last K-1 inputs, reaching into the state when T < K - 1
    return (out, xp[..., x.shape[-1]:].copy()) if return_final_states else out


def _conv_backward_kernel(d_y: np.ndarray | None, x: np.ndarray, weight: np.ndarray,
                          bias: np.ndarray | None = None, conv_state: np.ndarray | None = None,
                          d_final_states: np.ndarray | None = None, *,
                          activation: str) -> tuple[np.ndarray, ...]:
    k, t = weight.shape[-1], x.shape[-1]
    xp = _padded(x, conv_state, k, float_dtype_of(d_y, x, weight, bias, conv_state, d_final_states))
    if d_y is None:
        g = np.zeros(x.shape, xp.dtype)
    else:
        pre = _conv_pre(xp, weight, bias)  # recomputed: only the inputs are kept for the backward
        g = d_y * _silu_grad(pre, _sigmoid(pre)) if activation == "silu" else d_y
    pad = np.zeros((*g.shape[:-1], k - 1), g.dtype)
    gp = np.concatenate([pad, g, pad], axis=-1)
    d_xp = np.zeros(xp.shape, g.dtype)
    d_w = np.zeros(weight.shape, g.dtype)
    for j in range(k):  # xp[s] met w[j] at output s - j
        d_xp += weight[:, 0, j, None] * gp[..., k - 1 - j:2 * (k - 1) - j + t]
        d_w[:, 0, j] = np.sum(g * xp[..., j:j + t], axis=(0, 2))
    if d_final_states is not None:
        d_xp[..., t:] += d_final_states
    grads = (d_xp[..., k - 1:], d_w, np.sum(g, axis=(0, 2)))
    return (*grads, d_xp[..., :k - 1]) if conv_state is not None else grads


def _conv_check(ctx: InferContext, x: int) -> None:
    _rank(ctx, x, (3,), "x", "channels-first [B, D, T]")
    _rank(ctx, x + 1, (3,), "weight", "depthwise [D, 1, K]")
    d = ctx.shape(x)[1]
    dw, one, _ = ctx.shape(x + 1)
    check_same(ctx, (dw, one), (d, parse_dim(1)), "weight must be [D, 1, K] for x [B, D, T]")
    if _given(ctx, x + 2):
        check_same(ctx, ctx.shape(x + 2), (d,), "bias must be [D]")
    if _given(ctx, x + 3):
        check_same(ctx, ctx.shape(x + 3), _conv_state_shape(ctx, x),
                   "conv_state must be [B, D, K - 1]: the K - 1 inputs before x")


def _conv_state_shape(ctx: InferContext, x: int) -> tuple[DimExpr, ...]:
    bsz, d, _ = ctx.shape(x)
    return (bsz, d, simplify(ctx.shape(x + 1)[2] - 1))


def _conv_infer(ctx: InferContext) -> list[TensorType]:
    _conv_check(ctx, 0)
    y = TensorType(ctx.shape(0), ctx.dtype(0))
    if not ctx.attrs["return_final_states"]:
        return [y]
    return [y, TensorType(_conv_state_shape(ctx, 0), ctx.dtype(0))]


def _rule(backward_op: str, arity: int, attr: str,
          n_grads: int) -> Callable[[BackwardContext], list[str | None]]:
    """The rule of an op whose backward op reads (d_out?, the op's ``arity`` inputs, d_state_out?) and
    attribute ``attr``: ``n_grads`` gradients, then that of the initial state (the last input) if given."""
    def rule(ctx: BackwardContext) -> list[str | None]:
        n = len(ctx.inputs)
        if not any(ctx.needs_grad(i) for i in range(n)):
            return [None] * n
        ins: list[str | None] = [ctx.saved(i) if i < n and ctx.inputs[i] else None for i in range(arity)]
        d_state_out = ctx.d_outputs[1] if len(ctx.d_outputs) > 1 else None
        args = [ctx.d_outputs[0], *ins, d_state_out]
        while args[-1] is None:  # an op without state reads as before the states existed
            args.pop()
        n_out = n_grads + (ins[-1] is not None)
        grads = ctx.emit(backward_op, *args, n_out=n_out, **{attr: ctx.attrs[attr]})
        return [grads[i] if ctx.needs_grad(i) and ctx.inputs[i] else None for i in range(n)]
    return rule


def _conv_backward_infer(ctx: InferContext) -> list[TensorType]:
    _conv_check(ctx, 1)
    dt = next(t.dtype for t in ctx.inputs if t is not None)
    if _given(ctx, 0):
        check_same(ctx, ctx.shape(0), ctx.shape(1), "d_y and x differ")
    if _given(ctx, 5):
        check_same(ctx, ctx.shape(5), _conv_state_shape(ctx, 1), "d_final_states must be [B, D, K - 1]")
    grads = [TensorType(ctx.shape(1), dt), TensorType(ctx.shape(2), dt), TensorType(ctx.shape(1)[1:2], dt)]
    return [*grads, TensorType(ctx.shape(4), dt)] if _given(ctx, 4) else grads


def _conv_samples(rng: np.random.Generator) -> Iterator[Sample]:
    yield Sample((randn(rng, 2, 3, 6), randn(rng, 3, 1, 4), randn(rng, 3)), {"activation": "silu"})
    yield Sample((randn(rng, 1, 2, 5), randn(rng, 2, 1, 3)), {"activation": "none"})
    yield Sample((randn(rng, 2, 2, 2), randn(rng, 2, 1, 4), randn(rng, 2)), {"activation": "none"})  # K > T
    # the inference state: in, out, both; T < K - 1 puts part of the initial state in the final one
    yield Sample((randn(rng, 2, 3, 5), randn(rng, 3, 1, 4), randn(rng, 3), randn(rng, 2, 3, 3)),
                 {"activation": "silu"})
    yield Sample((randn(rng, 1, 2, 5), randn(rng, 2, 1, 3)),
                 {"activation": "none", "return_final_states": True})
    yield Sample((randn(rng, 2, 2, 2), randn(rng, 2, 1, 4), None, randn(rng, 2, 2, 3)),
                 {"activation": "silu", "return_final_states": True})


def _conv_cost(shapes: Sequence[tuple[int, ...]], attrs: Mapping[str, Any]) -> Cost:
    k = shapes[1][-1]
    return Cost(flops=2.0 * k * float(np.prod(shapes[0])), bytes=_nbytes(shapes[0], shapes[0], shapes[1]))


# --- mamba_selective_scan -------------------------------------------------------------------------


def _per_channel(m: np.ndarray, d: int) -> np.ndarray:
    """B or C ([B, N, T] or [B, G, N, T]) as [B, D or 1, T, N]: group g serves D / G consecutive channels."""
    if m.ndim == 3:
        return np.swapaxes(m, 1, 2)[:, None]
    return np.repeat(np.swapaxes(m, 2, 3), d // m.shape[1], axis=1)


def _per_group(g: np.ndarray, like: np.ndarray) -> np.ndarray:
    """The gradient [B, D, T, N] of a per-channel B or C summed back to its shape ``like``."""
    if like.ndim == 3:
        return np.swapaxes(g.sum(axis=1), 1, 2)
    b, d, t, n = g.shape
    groups = like.shape[1]
    return np.swapaxes(g.reshape(b, groups, d // groups, t, n).sum(axis=2), 2, 3)


def _dt(delta: np.ndarray, delta_bias: np.ndarray | None, softplus: bool) -> tuple[np.ndarray, np.ndarray]:
    """(delta + delta_bias, the step dt: its softplus if ``softplus``)."""
    pre = delta if delta_bias is None else delta + delta_bias[:, None]
    return pre, (np.logaddexp(0.0, pre).astype(pre.dtype) if softplus else pre)


def _check_groups(u: np.ndarray, B: np.ndarray) -> None:
    if B.ndim == 4 and u.shape[1] % B.shape[1]:
        raise OpError(f"op 'mamba_selective_scan': D = {u.shape[1]} channels do not split into "
                      f"G = {B.shape[1]} groups of B and C", op="mamba_selective_scan", code="E004")


def _states(u: np.ndarray, dt: np.ndarray, A: np.ndarray, Bc: np.ndarray,
            h0: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(h_{-1}: the initial state or zeros [B, D, N], every state h [B, D, T, N], the decays
    exp(dt * A) [B, D, T, N])."""
    decay = np.exp(dt[..., None] * A[None, :, None, :])
    drive = dt[..., None] * Bc * u[..., None]  # (dt * B) * u, in the reference's order
    h = np.empty(drive.shape, drive.dtype)
    first = np.zeros((drive.shape[0], drive.shape[1], drive.shape[3]), drive.dtype)
    if h0 is not None:
        first = first + h0
    state = first
    for t in range(drive.shape[2]):
        state = decay[:, :, t] * state + drive[:, :, t]
        h[:, :, t] = state
    return first, h, decay


def _last(first: np.ndarray, h: np.ndarray) -> np.ndarray:
    return h[:, :, -1].copy() if h.shape[2] else first


def _scan(u: np.ndarray, delta: np.ndarray, A: np.ndarray, B: np.ndarray, C: np.ndarray,
          D: np.ndarray | None = None, z: np.ndarray | None = None, delta_bias: np.ndarray | None = None,
          ssm_state: np.ndarray | None = None, *, delta_softplus: bool,
          return_last_state: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    _check_groups(u, B)
    _, dt = _dt(delta, delta_bias, delta_softplus)
    d = u.shape[1]
    first, h, _ = _states(u, dt, A, _per_channel(B, d), ssm_state)
    y: np.ndarray = np.sum(h * _per_channel(C, d), axis=-1)
    if D is not None:
        y = y + u * D[:, None]
    if z is not None:
        y = y * (z * _sigmoid(z))
    return (y, _last(first, h)) if return_last_state else y


def _scan_backward_kernel(d_out: np.ndarray | None, u: np.ndarray, delta: np.ndarray, A: np.ndarray,
                          B: np.ndarray, C: np.ndarray, D: np.ndarray | None = None,
                          z: np.ndarray | None = None, delta_bias: np.ndarray | None = None,
                          ssm_state: np.ndarray | None = None, d_last_state: np.ndarray | None = None, *,
                          delta_softplus: bool) -> tuple[np.ndarray, ...]:
    _check_groups(u, B)
    pre, dt = _dt(delta, delta_bias, delta_softplus)
    d = u.shape[1]
    Bc, Cc = _per_channel(B, d), _per_channel(C, d)
    first, h, decay = _states(u, dt, A, Bc, ssm_state)  # replayed: the forward keeps only the inputs
    if d_out is None:
        d_out = np.zeros(u.shape, h.dtype)
    y = np.sum(h * Cc, axis=-1)
    if D is not None:
        y = y + u * D[:, None]
    if z is not None:
        s = _sigmoid(z)
        g = d_out * (z * s)
        d_z = d_out * y * _silu_grad(z, s)
    else:
        g, d_z = d_out, np.zeros_like(u)
    d_D = np.sum(g * u, axis=(0, 2))
    d_u = g * D[:, None] if D is not None else np.zeros_like(g)
    d_Cc = g[..., None] * h
    # d_h[t] = g_t C_t + exp(dt_{t+1} A) d_h[t+1] (+ d_last_state at the last step): the scan run
    # backwards; what is left at the end flows into h_{-1}
    d_h = np.empty(h.shape, h.dtype)
    acc = np.zeros(first.shape, h.dtype)
    if d_last_state is not None:
        acc = acc + d_last_state
    for t in range(h.shape[2] - 1, -1, -1):
        acc = acc + g[:, :, t, None] * Cc[:, :, t]
        d_h[:, :, t] = acc
        acc = acc * decay[:, :, t]
    h_prev = np.concatenate([first[:, :, None], h[:, :, :-1]], axis=2)
    d_decay = d_h * h_prev * decay  # d / d(dt * A) of exp(dt * A) h_{t-1}
    d_u = d_u + np.sum(d_h * dt[..., None] * Bc, axis=-1)
    d_Bc = d_h * dt[..., None] * u[..., None]
    d_dt = np.sum(d_h * Bc * u[..., None] + d_decay * A[None, :, None, :], axis=-1)
    d_A = np.sum(d_decay * dt[..., None], axis=(0, 2))
    d_pre = d_dt * _sigmoid(pre) if delta_softplus else d_dt
    grads = (d_u, d_pre, d_A, _per_group(d_Bc, B), _per_group(d_Cc, C), d_D, d_z, np.sum(d_pre, axis=(0, 2)))
    return (*grads, acc) if ssm_state is not None else grads


_SCAN_INPUTS = ("u", "delta", "A", "B", "C", "D?", "z?", "delta_bias?", "ssm_state?")


def _given(ctx: InferContext, i: int) -> bool:
    return len(ctx.inputs) > i and ctx.inputs[i] is not None


def _scan_check(ctx: InferContext, o: int) -> None:
    """Checks the scan's inputs, which start at input ``o`` (0 for the op, 1 for its backward)."""
    _rank(ctx, o, (3,), "u", "channels-first [B, D, T]")
    bsz, d, t = ctx.shape(o)
    check_same(ctx, ctx.shape(o + 1), ctx.shape(o), "delta must have u's shape [B, D, T]")
    _rank(ctx, o + 2, (2,), "A", "[D, N]")
    check_same(ctx, ctx.shape(o + 2)[:1], (d,), "A must be [D, N] for u [B, D, T]")
    n = ctx.shape(o + 2)[1]
    _rank(ctx, o + 3, (3, 4), "B", "[B, N, T] or, in G groups, [B, G, N, T]")
    bm = ctx.shape(o + 3)
    check_same(ctx, (bm[0], *bm[-2:]), (bsz, n, t),
               "B must be [B, N, T] or [B, G, N, T] for u [B, D, T], A [D, N]")
    concrete = not (bm[1].free_symbols() or d.free_symbols())
    if len(bm) == 4 and concrete and d.evaluate({}) % bm[1].evaluate({}):
        raise ctx.fail(f"the D = {d} channels do not split into the G = {bm[1]} groups of B and C")
    check_same(ctx, ctx.shape(o + 4), bm, "C must have B's shape")
    for i, name in ((o + 5, "D"), (o + 7, "delta_bias")):
        if _given(ctx, i):
            check_same(ctx, ctx.shape(i), (d,), f"{name} must be [D]")
    if _given(ctx, o + 6):
        check_same(ctx, ctx.shape(o + 6), ctx.shape(o), "z must have u's shape [B, D, T]")
    if _given(ctx, o + 8):
        check_same(ctx, ctx.shape(o + 8), (bsz, d, n),
                   "ssm_state must be [B, D, N] for u [B, D, T], A [D, N]")


def _ssm_state_type(ctx: InferContext, o: int, dtype: str) -> TensorType:
    bsz, d, _ = ctx.shape(o)
    return TensorType((bsz, d, ctx.shape(o + 2)[1]), dtype)


def _scan_infer(ctx: InferContext) -> list[TensorType]:
    _scan_check(ctx, 0)
    y = TensorType(ctx.shape(0), ctx.dtype(0))
    return [y, _ssm_state_type(ctx, 0, ctx.dtype(0))] if ctx.attrs["return_last_state"] else [y]


def _scan_backward_infer(ctx: InferContext) -> list[TensorType]:
    _scan_check(ctx, 1)
    dt = next(t.dtype for t in ctx.inputs if t is not None)
    if _given(ctx, 0):
        check_same(ctx, ctx.shape(0), ctx.shape(1), "d_out and u differ")
    if _given(ctx, 10):
        check_same(ctx, ctx.shape(10), _ssm_state_type(ctx, 1, dt).shape, "d_last_state must be [B, D, N]")
    d = ctx.shape(1)[1:2]
    grads = [TensorType(ctx.shape(i), dt) for i in (1, 2, 3, 4, 5)] + [
        TensorType(d, dt), TensorType(ctx.shape(1), dt), TensorType(d, dt)]
    return [*grads, _ssm_state_type(ctx, 1, dt)] if _given(ctx, 9) else grads


def _scan_samples(rng: np.random.Generator) -> Iterator[Sample]:
    def a(d: int, n: int) -> np.ndarray:
        return -np.exp(0.5 * randn(rng, d, n))  # negative, as -exp(A_log): the states decay

    b, d, t, n = 2, 3, 5, 4
    yield Sample((randn(rng, b, d, t), 0.5 * randn(rng, b, d, t), a(d, n), randn(rng, b, n, t),
                  randn(rng, b, n, t), randn(rng, d), randn(rng, b, d, t), randn(rng, d)),
                 {"delta_softplus": True})
    yield Sample((randn(rng, b, d, t), rng.uniform(0.1, 1.0, (b, d, t)), a(d, n), randn(rng, b, n, t),
                  randn(rng, b, n, t)), {"delta_softplus": False})
    # groups: 4 channels in 2 groups of B and C; no D, a z gate, a bias
    yield Sample((randn(rng, 1, 4, 6), 0.5 * randn(rng, 1, 4, 6), a(4, 2), randn(rng, 1, 2, 2, 6),
                  randn(rng, 1, 2, 2, 6), None, randn(rng, 1, 4, 6), randn(rng, 4)), {"delta_softplus": True})
    # the inference state: an initial state in, the last one out, both
    yield Sample((randn(rng, b, d, t), 0.5 * randn(rng, b, d, t), a(d, n), randn(rng, b, n, t),
                  randn(rng, b, n, t), randn(rng, d), None, randn(rng, d), randn(rng, b, d, n)),
                 {"delta_softplus": True})
    yield Sample((randn(rng, b, d, t), 0.5 * randn(rng, b, d, t), a(d, n), randn(rng, b, n, t),
                  randn(rng, b, n, t), randn(rng, d), randn(rng, b, d, t)),
                 {"delta_softplus": True, "return_last_state": True})
    yield Sample((randn(rng, 1, 4, 3), 0.5 * randn(rng, 1, 4, 3), a(4, 2), randn(rng, 1, 2, 2, 3),
                  randn(rng, 1, 2, 2, 3), randn(rng, 4), None, randn(rng, 4), randn(rng, 1, 4, 2)),
                 {"delta_softplus": True, "return_last_state": True})


def _scan_cost(shapes: Sequence[tuple[int, ...]], attrs: Mapping[str, Any]) -> Cost:
    bdt, n = float(np.prod(shapes[0])), shapes[2][1]
    return Cost(flops=8.0 * bdt * n, bytes=_nbytes(*shapes, shapes[0]))


def _scan_backward_cost(shapes: Sequence[tuple[int, ...]], attrs: Mapping[str, Any]) -> Cost:
    """Inputs read and gradients written, plus d_B's and d_C's parts per channel ([B, D, N, T] each, before
    their sum over a group's channels: B and C serve every channel of a group) written and read back once."""
    bdtn = float(np.prod(shapes[1])) * shapes[3][1]
    return Cost(flops=20.0 * bdtn, bytes=_nbytes(*shapes, *shapes[1:]) + 2 * 2 * 4.0 * bdtn)


_ACTIVATION = (AttrSpec("activation", "str", "silu", ("silu", "none")),)
_SOFTPLUS = (AttrSpec("delta_softplus", "bool", False),)
_FINAL_STATES = (AttrSpec("return_final_states", "bool", False),)
_LAST_STATE = (AttrSpec("return_last_state", "bool", False),)


CORE_OPS = [
    core_op(
        "mamba_conv1d", ("x", "weight", "bias?", "conv_state?"), ("y", "*conv_state_out"), _conv, _conv_infer,
        backward=_rule("mamba_conv1d_backward", 4, "activation", 3),
        attrs=_ACTIVATION + _FINAL_STATES, samples=_conv_samples, cost=_conv_cost,
        doc="Causal depthwise conv1d of x [B, D, T] with weight [D, 1, K] (PyTorch's Conv1d(groups=D, "
            "padding=K - 1) cut to the first T steps) plus bias [D], then silu unless activation='none'; "
            "conv_state [B, D, K - 1] holds the inputs before x (zeros without it); with "
            "return_final_states=True a second output conv_state_out is the last K - 1 inputs.",
    ),
    core_op(
        "mamba_conv1d_backward", ("d_y?", "x", "weight", "bias?", "conv_state?", "d_conv_state_out?"),
        ("d_x", "d_weight", "d_bias", "*d_conv_state"),
        _conv_backward_kernel, _conv_backward_infer, attrs=_ACTIVATION,
        cost=lambda s, a: Cost(flops=6.0 * s[2][-1] * float(np.prod(s[1])), bytes=_nbytes(s[1], s[1], s[1])),
        doc="Gradients of mamba_conv1d; recomputes the convolution from x (d_bias is [D] even without bias; "
            "d_conv_state only when conv_state is given).",
    ),
    core_op(
        "mamba_selective_scan", _SCAN_INPUTS, ("out", "*last_state"), _scan, _scan_infer,
        backward=_rule("mamba_selective_scan_backward", len(_SCAN_INPUTS), "delta_softplus", 8),
        attrs=_SOFTPLUS + _LAST_STATE, samples=_scan_samples, cost=_scan_cost, autocast="fp32",
        statistics={"ssm_state", "last_state"},
        doc="Mamba-1's selective scan (selective_scan_ref): u, delta, z [B, D, T], A [D, N], B and C "
            "[B, N, T] or [B, G, N, T], D and delta_bias [D], the initial state ssm_state [B, D, N] "
            "(zeros without it); out [B, D, T] and, with return_last_state=True, last_state [B, D, N].",
    ),
    core_op(
        "mamba_selective_scan_backward", ("d_out?", *_SCAN_INPUTS, "d_last_state?"),
        ("d_u", "d_delta", "d_A", "d_B", "d_C", "d_D", "d_z", "d_delta_bias", "*d_ssm_state"),
        _scan_backward_kernel, _scan_backward_infer, attrs=_SOFTPLUS, autocast="fp32",
        cost=_scan_backward_cost,
        statistics={"ssm_state", "d_last_state", "d_ssm_state"},
        doc="Gradients of mamba_selective_scan: replays the scan from its inputs, then runs it in reverse "
            "(d_D, d_z, d_delta_bias are computed whether or not D, z, delta_bias were given; d_ssm_state "
            "only when ssm_state is).",
    ),
]

OPS = [c.opdef for c in CORE_OPS]
