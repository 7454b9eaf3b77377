"""Scaled RoPE: inverse frequencies as transformers' ``ROPE_INIT_FUNCTIONS``, and ``rope_freqs``, the op
that makes the ``freqs`` table the ``rope`` and ``qkv_qk_norm_rope`` ops take in place of ``theta``.

Kinds (transformers v5's ``rope_type``): ``default`` (``1 / theta ** (2i / d)``), ``linear`` (divided by
``factor``), ``dynamic`` (NTK-aware: the base grows to ``theta * (factor * L / M - (factor - 1)) **
(d / (d - 2))`` for a sequence of ``L > M = max_position_embeddings`` positions; the table is computed
for ``L`` = its row count), ``yarn`` (ramp between interpolated and extrapolated frequencies, and an
attention factor scaling cos and sin) and ``llama3`` (low frequencies divided by ``factor``, a smooth
ramp between ``low_freq_factor`` and ``high_freq_factor``).

Numerics. transformers computes inverse frequencies and angles in float32 (``position * inv_freq``)
and ``cos``/``sin`` of the float32 angle. Every float32 rounding step here is the one transformers
takes, in the same order; transcendental functions (``pow``, ``cos``, ``sin``) are evaluated in
float64 and rounded once, where torch's float32 kernels may be 1 ulp off that. kiln-hf reads a HF
config's RoPE settings into these same functions.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kiln.core._errors import OpError
from kiln.core.ir._dims import Const, parse_dim, simplify
from kiln.core.ir._ir import TensorType
from kiln.core.ops._ops import AttrSpec, Cost, InferContext, Sample, no_gradient
from kiln.core.ops.library._common import core_op

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
#: the values each kind needs (yarn's ``factor`` may be None: then max_position_embeddings /
#: original_max_position_embeddings, as transformers)
REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor", "max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
_F32 = np.float32
_OP = "rope_freqs"


def _fail(message: str) -> OpError:
    return OpError(f"op {_OP!r}: {message}", op=_OP)


def _pow32(base: float, exponents: np.ndarray) -> np.ndarray:
    """``float32(base) ** exponents`` rounded once to float32, as torch's float32 ``pow`` aims to."""
    return np.power(np.float64(_F32(base)), exponents.astype(np.float64)).astype(_F32)


def _exponents(dim: int) -> np.ndarray:
    return np.arange(0, dim, 2).astype(_F32) / _F32(dim)


def rope_inv_freq(rotary_dim: int, theta: float = 10000.0, rope_type: str = "default", *,
                  factor: float | None = None, low_freq_factor: float | None = None,
                  high_freq_factor: float | None = None, original_max_position_embeddings: int | None = None,
                  max_position_embeddings: int | None = None, beta_fast: float | None = None,
                  beta_slow: float | None = None, attention_factor: float | None = None,
                  mscale: float | None = None, mscale_all_dim: float | None = None, truncate: bool = True,
                  seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """Float32 inverse frequencies ``[rotary_dim // 2]`` and the attention scaling (yarn's; 1 for the
    others), as transformers' ``ROPE_INIT_FUNCTIONS[rope_type]`` computes them. ``seq_len`` is the
    sequence length ``dynamic`` scales for (default and at least ``max_position_embeddings``)."""
    if rope_type not in ROPE_TYPES:
        raise _fail(f"rope_type {rope_type!r} is not one of {', '.join(ROPE_TYPES)}")
    if rotary_dim <= 0 or rotary_dim % 2:
        raise _fail(f"rotary_dim must be even and > 0, found {rotary_dim}")
    given = {"factor": factor, "low_freq_factor": low_freq_factor, "high_freq_factor": high_freq_factor,
             "original_max_position_embeddings": original_max_position_embeddings,
             "max_position_embeddings": max_position_embeddings}
    for key in REQUIRED.get(rope_type, ()):
        value = given[key]
        if value is None and not (rope_type == "yarn" and key == "factor"):
            raise _fail(f"{rope_type} RoPE needs {key}")
        if value is not None and not value > 0:
            raise _fail(f"{key} must be > 0, found {value}")
    if not theta > 0:
        raise _fail(f"theta must be > 0, found {theta}")
    base, dim = float(theta), rotary_dim
    if rope_type == "dynamic":
        if dim <= 2:
            raise _fail(f"dynamic RoPE needs a rotary dim above 2, found {dim}")
        assert factor is not None and max_position_embeddings is not None
        seq = max(seq_len or max_position_embeddings, max_position_embeddings)
        base = base * ((factor * seq / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    if rope_type == "yarn":
        return _yarn(dim, base, factor, original_max_position_embeddings, max_position_embeddings, beta_fast,
                     beta_slow, attention_factor, mscale, mscale_all_dim, truncate)
    inv = _F32(1.0) / _pow32(base, _exponents(dim))
    if rope_type == "linear":
        assert factor is not None
        inv = inv / _F32(factor)
    elif rope_type == "llama3":
        assert factor and low_freq_factor and high_freq_factor and original_max_position_embeddings
        inv = _llama3(inv, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    return inv, 1.0


def _llama3(inv: np.ndarray, factor: float, low: float, high: float, old_len: float) -> np.ndarray:
    low_wavelen, high_wavelen = _F32(old_len / low), _F32(old_len / high)
    wavelen = (_F32(1.0) / inv) * _F32(2 * math.pi)  # torch evaluates ``c / t`` as ``t.reciprocal() * c``
    scaled = np.where(wavelen > low_wavelen, inv / _F32(factor), inv)
    smooth = ((_F32(1.0) / wavelen) * _F32(old_len) - _F32(low)) / _F32(high - low)
    smoothed = (_F32(1.0) - smooth) * scaled / _F32(factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    out: np.ndarray = np.where(medium, smoothed, scaled).astype(_F32)
    return out


def _yarn(dim: int, base: float, factor: float | None, original: int | None, max_positions: int | None,
          beta_fast: float | None, beta_slow: float | None, attention: float | None, m: float | None,
          m_all: float | None, truncate: bool) -> tuple[np.ndarray, float]:
    assert original is not None
    if factor is None:
        if max_positions is None:
            raise _fail("yarn RoPE without factor needs max_position_embeddings (factor = "
                        "max_position_embeddings / original_max_position_embeddings)")
        factor = max_positions / original

    def scale_of(scale: float, mul: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mul * math.log(scale) + 1.0

    if attention is None:
        attention = scale_of(factor, m) / scale_of(factor, m_all) if m and m_all else scale_of(factor)

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast or 32), correction_dim(beta_slow or 1)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoids a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=_F32) - _F32(low)) / _F32(high - low), 0, 1)
    extrapolation = _F32(1.0) - ramp
    pos_freqs = _pow32(base, _exponents(dim))
    inv = (_F32(1.0) / (_F32(factor) * pos_freqs)) * (_F32(1.0) - extrapolation) \
        + (_F32(1.0) / pos_freqs) * extrapolation
    return inv.astype(_F32), float(attention)


def rope_freqs_table(rows: int, inv_freq: np.ndarray, scaling: float = 1.0) -> np.ndarray:
    """Float32 ``[rows, len(inv_freq), 2]``: row ``p`` holds ``(cos, sin)`` of ``p * inv_freq`` (a float32
    product, as transformers), times ``scaling``."""
    angle = np.arange(rows, dtype=_F32)[:, None] * inv_freq[None, :].astype(_F32)
    table = np.stack([np.cos(angle.astype(np.float64)), np.sin(angle.astype(np.float64))], -1).astype(_F32)
    return table if scaling == 1.0 else table * _F32(scaling)


def _rope_freqs(*, rows: int, rotary_dim: int, theta: float, rope_type: str, **scaling: Any) -> np.ndarray:
    inv, attention = rope_inv_freq(rotary_dim, theta, rope_type, seq_len=rows, **scaling)
    return rope_freqs_table(rows, inv, attention)


def _rope_freqs_infer(ctx: InferContext) -> list[TensorType]:
    rows, rd = parse_dim(ctx.attrs["rows"]), simplify(parse_dim(ctx.attrs["rotary_dim"]))
    if isinstance(rd, Const) and (rd.value <= 0 or rd.value % 2):
        raise ctx.fail(f"rotary_dim must be even and > 0, found {rd.value}")
    kind = ctx.attrs["rope_type"]
    missing = [k for k in REQUIRED.get(kind, ()) if ctx.attrs.get(k) is None
               and not (kind == "yarn" and k == "factor")]
    if missing:
        raise ctx.fail(f"{kind} RoPE needs {', '.join(missing)}")
    return [TensorType((rows, rd // 2, Const(2)), "fp32")]


def _rope_freqs_samples(rng: np.random.Generator) -> Iterator[Sample]:
    yield Sample((), {"rows": 6, "rotary_dim": 4, "theta": 100.0})
    yield Sample((), {"rows": 6, "rotary_dim": 8, "rope_type": "llama3", "factor": 8.0,
                      "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 4})


def _rope_freqs_cost(shapes: Sequence[tuple[int, ...]], attrs: Any) -> Cost:
    return Cost(flops=0.0, bytes=0.0)


_FLOAT = ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor",
          "mscale", "mscale_all_dim")

CORE_OPS = [
    core_op(
        "rope_freqs", (), ("freqs",), _rope_freqs, _rope_freqs_infer, backward=no_gradient,
        attrs=(AttrSpec("rows", "dim"), AttrSpec("rotary_dim", "dim"), AttrSpec("theta", "float", 10000.0),
               AttrSpec("rope_type", "str", "default", choices=ROPE_TYPES),
               *(AttrSpec(k, "float", None) for k in _FLOAT),
               AttrSpec("original_max_position_embeddings", "int", None),
               AttrSpec("max_position_embeddings", "int", None), AttrSpec("truncate", "bool", True)),
        samples=_rope_freqs_samples, cost=_rope_freqs_cost,
        doc="The freqs table [rows, rotary_dim // 2, 2] of (cos, sin) by position of a RoPE kind (default, "
            "linear, dynamic, yarn, llama3; transformers' rope_type and parameters), for the freqs input of "
            "rope and qkv_qk_norm_rope.",
    ),
]

OPS = [c.opdef for c in CORE_OPS]
