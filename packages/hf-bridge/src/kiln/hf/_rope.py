"""RoPE from a HuggingFace config: both config layouts, and the scaled variants computed as transformers does.

Layouts. transformers v4 configs hold ``rope_theta`` and ``rope_scaling`` (kind under ``type`` or
``rope_type``); v5 configs hold one ``rope_parameters`` dict. :func:`rope_parameters` turns either
into the v5 dict the way transformers v5 standardizes a config, so a legacy and a v5 config of one
model give the same tables. Scaling semantics are transformers v5's; they differ from some v4
releases only for a yarn config that sets both ``factor`` and ``original_max_position_embeddings``
(v4.4x used ``max_position_embeddings / original_max_position_embeddings`` in place of ``factor``).

Numerics. transformers computes inverse frequencies and angles in float32 (``position * inv_freq``)
and ``cos``/``sin`` of the float32 angle. Every float32 rounding step here is the one transformers
takes, in the same order; transcendental functions (``pow``, ``cos``, ``sin``) are evaluated in
float64 and rounded once, where torch's float32 kernels may be 1 ulp off that. Angles grow with the
position, so such an ulp in ``inv_freq`` shows up as ~``position * 6e-8`` in the table.

Attention scaling. yarn scales cos and sin by its attention factor (mscale) in transformers; the
kiln ``rope``/``qkv_qk_norm_rope`` ops take a ``freqs`` table and no such factor, so
:func:`rope_table` folds it into the table exactly as transformers does (``cos * factor``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from kiln.hf._errors import HFConfigError

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
_NEEDS_ORIGINAL = ("llama3", "yarn", "longrope")
_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
_F32 = np.float32


def _number(value: Any, key: str, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or (positive and not value > 0):
        raise HFConfigError(f"must be a {'positive ' if positive else ''}number, found {value!r}", key=key)
    return float(value)


def rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config's RoPE settings as transformers v5's standardized ``rope_parameters`` dict (a new dict).

    Reads ``rope_scaling`` (v4) or ``rope_parameters`` (v5), then ``rope_theta`` (default 10000),
    ``partial_rotary_factor``, and for llama3/yarn ``original_max_position_embeddings`` (top level
    first, else inside the dict, else ``max_position_embeddings``). Raises :class:`HFConfigError`
    naming the key for an unsupported ``rope_type`` or a missing or malformed value.
    """
    legacy = config.get("rope_scaling")
    source = "rope_scaling" if legacy else "rope_parameters"
    found = legacy or config.get("rope_parameters") or {}
    if not isinstance(found, Mapping):
        raise HFConfigError(f"must be an object, found {found!r}", key=source)
    params = dict(found)
    layer_types = config.get("layer_types") or ()
    if any(key in layer_types for key in params):
        raise HFConfigError("per-layer-type RoPE settings are not supported", key=source)
    theta = config.get("rope_theta")
    params.setdefault("rope_theta", 10000.0 if theta is None else theta)
    if config.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    params["rope_type"] = params.get("rope_type", params.pop("type", "default"))
    params.pop("type", None)
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise HFConfigError(f"RoPE type {rope_type!r} is not supported; kiln supports "
                            f"{', '.join(ROPE_TYPES)}", key=f"{source}.rope_type")
    if rope_type in _NEEDS_ORIGINAL:
        if config.get("original_max_position_embeddings") is not None:  # Phi-3 style, wins as in HF
            params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        elif config.get("max_position_embeddings") is not None:
            params.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    for key in _REQUIRED.get(rope_type, ()):
        if key not in params:
            raise HFConfigError(f"{rope_type} RoPE needs this value", key=f"{source}.{key}")
        if not (key == "factor" and rope_type == "yarn" and params[key] is None):
            _number(params[key], f"{source}.{key}")
    for key in ("rope_theta", "partial_rotary_factor"):
        if key in params:
            _number(params[key], f"{source}.{key}" if key in found else key)
    return params


def _dims(config: Mapping[str, Any], params: Mapping[str, Any], head_dim: int | None,
          rotary_dim: int | None) -> int:
    if head_dim is None:
        head_dim = config.get("head_dim")
    if head_dim is None:
        hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
        if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0:
            raise HFConfigError("head_dim is not given and hidden_size // num_attention_heads cannot be "
                                "computed", key="head_dim")
        head_dim = hidden // heads
    if rotary_dim is None:
        rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise HFConfigError(f"rotary dim must be even and in (0, head_dim = {head_dim}], found {rotary_dim}",
                            key="partial_rotary_factor")
    return rotary_dim


def _pow32(base: float, exponents: np.ndarray) -> np.ndarray:
    """``float32(base) ** exponents`` rounded once to float32, as torch's float32 ``pow`` aims to."""
    return np.power(np.float64(_F32(base)), exponents.astype(np.float64)).astype(_F32)


def _exponents(dim: int) -> np.ndarray:
    return np.arange(0, dim, 2).astype(_F32) / _F32(dim)


def _max_positions(config: Mapping[str, Any]) -> int:
    value = config.get("max_position_embeddings")
    return int(_number(value, "max_position_embeddings"))


def rope_inv_freq(config: Mapping[str, Any], head_dim: int | None = None, rotary_dim: int | None = None, *,
                  seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """Float32 inverse frequencies ``[rotary_dim // 2]`` and attention scaling, as HF's ROPE_INIT_FUNCTIONS.

    ``head_dim`` defaults to the config's ``head_dim`` or ``hidden_size // num_attention_heads``;
    ``rotary_dim`` to ``int(head_dim * partial_rotary_factor)``. ``seq_len`` matters for ``dynamic``
    only: transformers rescales its base for the longest sequence seen beyond
    ``max_position_embeddings``.
    """
    p = rope_parameters(config)
    dim = _dims(config, p, head_dim, rotary_dim)
    kind, base = p["rope_type"], float(p["rope_theta"])
    one = _F32(1.0)
    if kind == "dynamic":
        if dim <= 2:
            raise HFConfigError(f"dynamic RoPE needs a rotary dim above 2, found {dim}", key="head_dim")
        mpe, factor = _max_positions(config), float(p["factor"])
        seq = max(seq_len or mpe, mpe)
        base = base * ((factor * seq / mpe) - (factor - 1)) ** (dim / (dim - 2))
    if kind != "yarn":
        inv = one / _pow32(base, _exponents(dim))
        if kind == "linear":
            inv = inv / _F32(p["factor"])
        elif kind == "llama3":
            inv = _llama3(inv, p)
        return inv, 1.0
    return _yarn(config, p, dim, base)


def _llama3(inv: np.ndarray, p: Mapping[str, Any]) -> np.ndarray:
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p["original_max_position_embeddings"])
    low_wavelen, high_wavelen = _F32(old_len / low), _F32(old_len / high)
    wavelen = (_F32(1.0) / inv) * _F32(2 * math.pi)  # torch evaluates ``c / t`` as ``t.reciprocal() * c``
    scaled = np.where(wavelen > low_wavelen, inv / _F32(factor), inv)
    smooth = ((_F32(1.0) / wavelen) * _F32(old_len) - _F32(low)) / _F32(high - low)
    smoothed = (_F32(1.0) - smooth) * scaled / _F32(factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(_F32)


def _yarn(config: Mapping[str, Any], p: Mapping[str, Any], dim: int, base: float) -> tuple[np.ndarray, float]:
    original = float(p["original_max_position_embeddings"])
    factor = p["factor"]
    factor = _max_positions(config) / original if factor is None else float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
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


def rope_table(config: Mapping[str, Any], max_seq: int, head_dim: int | None = None,
               rotary_dim: int | None = None) -> np.ndarray:
    """The ``freqs`` input of ops ``rope``/``qkv_qk_norm_rope``: float32 ``[max_seq, rotary_dim // 2, 2]``.

    Row ``p`` holds ``(cos, sin)`` of ``p * inv_freq``, times the attention scaling (yarn's mscale; 1
    otherwise), as transformers' rotary embedding returns them. ``dynamic`` is computed for
    ``seq_len = max_seq``: equal to transformers for sequences of ``max_seq`` tokens, and to plain
    RoPE whenever ``max_seq <= max_position_embeddings``.
    """
    if isinstance(max_seq, bool) or not isinstance(max_seq, int) or max_seq <= 0:
        raise HFConfigError(f"max_seq must be a positive int, found {max_seq!r}", key="max_seq")
    inv, scaling = rope_inv_freq(config, head_dim, rotary_dim, seq_len=max_seq)
    angle = np.arange(max_seq, dtype=_F32)[:, None] * inv[None, :]
    table = np.stack([np.cos(angle.astype(np.float64)), np.sin(angle.astype(np.float64))], -1).astype(_F32)
    return table if scaling == 1.0 else table * _F32(scaling)
