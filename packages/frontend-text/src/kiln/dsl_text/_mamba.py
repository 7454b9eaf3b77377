"""Seed 004's Mamba primitives (§6.10) and the helpers of its §11.3 block, lowered to kiln's ops.

kiln's ``mamba_conv1d`` and ``mamba_selective_scan`` (kiln-core) take the channels-first layout
``[B, D, T]``; the seed writes §6.10 channels-first and §11.3 channels-last ``[B, T, D]``. A call in
either layout lowers to kiln's op with the transposes around it; a call in kiln's own signature is
passed through unchanged. The inference state of both (an initial ``conv_state`` / ``ssm_state``
input, a ``conv_state_out`` / ``ssm_state_out`` result) lowers to the ops' state input and output;
a ``conv_state`` as wide as the kernel (§11.3's ``[B, D, d_conv]``: the last K inputs, as
transformers' cache keeps them) is cut to kiln's last K - 1 and its result widened back. The mapping
is documented in docs/dsl-text.md.
"""

from __future__ import annotations

from typing import Any

from kiln.core import KilnError
from kiln.core.ir import parse_dim


def _same(a: Any, b: Any) -> bool:
    return str(a) == str(b)


def _dim(d: Any) -> Any:
    return parse_dim(str(d))


def time_major(g: Any, x: Any) -> bool:
    """Whether ``x`` is channels-last ``[B, T, D]`` (§11.3) rather than ``[B, D, T]`` (§6.10)."""
    shape = g.resolve(x).shape
    return len(shape) == 3 and str(shape[1]) == "T" and str(shape[2]) != "T"


def conv1d(g: Any, tensors: list[Any], consts: list[Any], kw: dict[str, Any], n_out: int | None) -> list[Any]:
    """``(x, weight, bias?, conv_state?) -> mamba_conv1d(kernel_size, activation=silu | silu=true)
    -> (y, conv_state_out?)``: x is ``[B, D, T]`` (§6.10) or ``[B, T, D]`` (§11.3, y in the same
    layout); the kernel size is the weight's ``[D, 1, K]``. ``conv_state`` is ``[B, D, K - 1]``, the
    inputs before x (§6.10), or ``[B, D, K]``, the last K (§11.3); ``conv_state_out`` has its width
    (K - 1 without one): the state to pass with the next chunk. Without a bias, ``(x, weight,
    conv_state)``: a third input of rank 3 is the state (a bias is ``[D]``)."""
    if not 2 <= len(tensors) <= 4:
        raise KilnError(
            f"mamba_conv1d takes (x, weight, bias?, conv_state?), found {len(tensors)} inputs", code="E003"
        )
    x, w, bias, state = [*tensors, None, None][:4]
    if len(tensors) == 3 and len(g.resolve(bias).shape) == 3:
        bias, state = None, bias
    kw.pop("kernel_size", None)  # the weight's last dimension: kiln reads it from there
    kw.pop("return_final_states", None)  # a second result asks for it
    consts = consts[1:] if consts and isinstance(consts[0], int) else consts
    if consts:
        raise KilnError(f"mamba_conv1d: unexpected arguments {consts!r}", code="E003")
    silu = kw.pop("silu", None)
    activation = kw.pop("activation", "silu" if silu in (None, True) else "none")
    if kw:
        raise KilnError(
            f"mamba_conv1d has no argument {next(iter(kw))!r}",
            code="E003",
            hint="kernel_size, activation (silu | none) or silu=true|false",
        )
    last = time_major(g, x)
    if last:
        x = g.transpose(x, 1, 2)
    wshape, sshape = g.resolve(w).shape, () if state is None else g.resolve(state).shape
    k = wshape[-1] if len(wshape) == 3 else None  # a malformed weight: the op's shape rule says so
    wide = k is not None and len(sshape) == 3 and _same(sshape[2], k)
    own = n_out == 2 and not wide  # the op's own final state: the last K - 1 inputs
    y = g.custom("mamba_conv1d", x, w, bias, g.split(state, [1, k - 1], dim=2)[1] if wide else state,
                 activation=activation, num_outputs=2 if own else 1,
                 **({"return_final_states": True} if own else {}))
    y, final = y if isinstance(y, tuple) else (y, None)
    if wide and n_out == 2:  # the last K inputs: [state, x] cut after its first T steps
        t = g.resolve(x).shape[2]
        final = g.split(g.concat(state, x, dim=2), [t, k], dim=2)[1]
    if last:
        y = g.transpose(y, 1, 2)
    return [y, final] if n_out == 2 else [y]


def is_seed_scan(g: Any, tensors: list[Any], kw: dict[str, Any], n_out: int | None) -> bool:
    """The seed's ``(u, delta, A, B, C, D, dt_bias, ssm_state?)`` rather than kiln's
    ``(u, delta, A, B, C, D?, z?, delta_bias?, ssm_state?)``: its 7th input is the ``[D]`` bias, not
    the gate z."""
    if "chunk_size" in kw or (n_out == 2 and "return_last_state" not in kw):
        return True
    return len(tensors) >= 7 and tensors[6] is not None and len(g.resolve(tensors[6]).shape) == 1


def selective_scan(g: Any, tensors: list[Any], kw: dict[str, Any], n_out: int | None) -> list[Any]:
    """The seed's scan: u ``[B, D, T]`` or ``[B, T, D]``, delta the same or one per group ``[B, T, G]``,
    A ``[D, N]`` (already ``-exp(A_log)``), B and C ``[B, G, N, T]``, D and dt_bias ``[D]``; kiln's
    scan with ``delta_softplus=True`` and dt_bias as its delta_bias. Its y has u's layout; the initial
    ``ssm_state`` and the result ``ssm_state_out`` are ``[B, D, N]``."""
    if not 7 <= len(tensors) <= 8:
        raise KilnError(
            f"mamba_selective_scan takes (u, delta, A, B, C, D, dt_bias, ssm_state?), found {len(tensors)}",
            code="E003",
        )
    u, delta, a, b, c, d, dt_bias, state = [*tensors, None][:8]
    kw.pop("chunk_size", None)  # a kernel's tiling: the reference scans the whole sequence
    kw.pop("return_last_state", None)  # a second result asks for it
    softplus = kw.pop("delta_softplus", True)
    if kw:
        raise KilnError(f"mamba_selective_scan has no argument {next(iter(kw))!r}", code="E003")
    channels = g.resolve(a).shape[0]
    last = time_major(g, u)
    if last:
        u = g.transpose(u, 1, 2)
    bsz, _, t = g.resolve(u).shape
    ds = g.resolve(delta).shape
    if time_major(g, delta):
        delta = g.transpose(delta, 1, 2)
        ds = g.resolve(delta).shape
    if len(ds) == 3 and not _same(ds[1], channels):  # one step size per group: each group's channels
        bs = g.resolve(b).shape
        if len(bs) != 4:
            raise KilnError(
                f"mamba_selective_scan: delta has {ds[1]} channels, not A's {channels}; one step size per "
                "group needs B and C in groups [B, G, N, T]",
                code="E004",
            )
        groups = bs[1]
        per = channels // groups
        one = g.view(delta, shape=[bsz, groups, 1, t])
        spread = g.custom("broadcast_to", one, shape=[bsz, groups, per, t])
        delta = g.view(spread, shape=[bsz, channels, t])
    kw_state = {"return_last_state": True} if n_out == 2 else {}
    y = g.custom("mamba_selective_scan", u, delta, a, b, c, d, None, dt_bias, state, delta_softplus=softplus,
                 num_outputs=n_out or 1, **kw_state)
    y, final = y if isinstance(y, tuple) else (y, None)
    if last:
        y = g.transpose(y, 1, 2)
    return [y, final] if n_out == 2 else [y]


def split_proj(g: Any, x: Any, d_inner: Any, d_conv_dim: Any) -> list[Any]:
    """§11.3 ``proj -> mamba_split_proj(d_inner, d_conv_dim) -> (gate, conv_in, delta)``: the last
    dimension split into ``d_inner``, ``d_conv_dim`` and the rest (delta: one step size per group)."""
    shape = g.resolve(x).shape
    d_inner, d_conv_dim = _dim(d_inner), _dim(d_conv_dim)
    return list(g.split(x, [d_inner, d_conv_dim, shape[-1] - d_inner - d_conv_dim], dim=len(shape) - 1))


def split_conv(g: Any, x: Any, d_inner: Any, n_groups: Any, d_state: Any) -> list[Any]:
    """§11.3 ``conv_out -> mamba_split_conv(d_inner, n_groups, d_state) -> (u, B_ssm, C_ssm)``: u is
    ``[B, T, d_inner]``; B and C come out in the scan's layout ``[B, G, N, T]``."""
    shape = g.resolve(x).shape
    if len(shape) != 3:
        raise KilnError(
            f"mamba_split_conv takes [B, T, channels], found {list(map(str, shape))}", code="E004"
        )
    bsz, t, _ = shape
    d_inner, n_groups, d_state = _dim(d_inner), _dim(n_groups), _dim(d_state)
    u, bm, cm = g.split(x, [d_inner, n_groups * d_state, n_groups * d_state], dim=2)
    grouped = [g.permute(g.view(m, shape=[bsz, t, n_groups, d_state]), [0, 2, 3, 1]) for m in (bm, cm)]
    return [u, *grouped]


def exp_neg(g: Any, x: Any) -> Any:
    """§6.10 ``A_log -> exp_neg() -> A``: ``-exp(x)``."""
    return g.scale(g.exp(x), -1.0)


def group_rmsnorm(g: Any, x: Any, weight: Any, n_groups: Any = 1, eps: float = 1e-6) -> Any:
    """§11.3 ``group_rmsnorm(weight, n_groups, eps)``: RMSNorm over each of ``n_groups`` equal parts
    of the last dimension, times ``weight``."""
    if n_groups == 1:
        return g.rmsnorm(x, weight, eps=eps)[0]
    *lead, width = g.resolve(x).shape
    part = width // n_groups
    parts = g.view(x, shape=[*lead, n_groups, part])
    normed = g.rmsnorm(parts, g.ones(shape=[part], dtype="fp32"), eps=eps)[0]
    return g.mul(g.view(normed, shape=[*lead, width]), weight)
