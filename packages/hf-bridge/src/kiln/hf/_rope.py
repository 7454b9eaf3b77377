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

from collections.abc import Mapping
from typing import Any

import numpy as np

from kiln.core.ops import ROPE_TYPES, rope_freqs_table
from kiln.core.ops import rope_inv_freq as core_inv_freq
from kiln.hf._errors import HFConfigError

_NEEDS_ORIGINAL = ("llama3", "yarn", "longrope")
_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


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


def _max_positions(config: Mapping[str, Any]) -> int:
    value = config.get("max_position_embeddings")
    return int(_number(value, "max_position_embeddings"))


def rope_inv_freq(config: Mapping[str, Any], head_dim: int | None = None, rotary_dim: int | None = None, *,
                  seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """Float32 inverse frequencies ``[rotary_dim // 2]`` and attention scaling, as HF's ROPE_INIT_FUNCTIONS
    (computed by kiln-core's :func:`kiln.core.ops.rope_inv_freq`, which DSL models use too).

    ``head_dim`` defaults to the config's ``head_dim`` or ``hidden_size // num_attention_heads``;
    ``rotary_dim`` to ``int(head_dim * partial_rotary_factor)``. ``seq_len`` matters for ``dynamic``
    only: transformers rescales its base for the longest sequence seen beyond
    ``max_position_embeddings``.
    """
    p = rope_parameters(config)
    dim = _dims(config, p, head_dim, rotary_dim)
    kind = p["rope_type"]
    if kind == "dynamic" and dim <= 2:
        raise HFConfigError(f"dynamic RoPE needs a rotary dim above 2, found {dim}", key="head_dim")
    needs_max = kind == "dynamic" or (kind == "yarn" and p.get("factor") is None)
    scaling = {k: p.get(k) for k in ("factor", "low_freq_factor", "high_freq_factor",
                                     "original_max_position_embeddings", "beta_fast", "beta_slow",
                                     "attention_factor", "mscale", "mscale_all_dim")}
    max_positions = _max_positions(config) if needs_max else None
    return core_inv_freq(dim, float(p["rope_theta"]), kind, **scaling, truncate=p.get("truncate", True),
                         max_position_embeddings=max_positions, seq_len=seq_len)


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
    return rope_freqs_table(max_seq, inv, scaling)
