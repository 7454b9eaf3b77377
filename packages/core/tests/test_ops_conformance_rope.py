"""RoPE layouts and scaled RoPE. The interleaved (GPT-J) and the half (HF) layouts of ``rope`` and
``qkv_qk_norm_rope`` against a rotation written with complex numbers: each rotated pair is one complex
number turned by ``exp(i * position * inv_freq)``. The ``rope_freqs`` tables of each kind against the
published formulas worked out here in float64 (and, marked ``parity``, against transformers'
``ROPE_INIT_FUNCTIONS``). Gradients go through the generic harness (test_op_gradients.py), whose rope
samples include the interleaved layout."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from kiln.core import KilnError, op_registry
from kiln.core.ir._dims import parse_shape
from kiln.core.ir._ir import TensorType
from kiln.core.ops._ops import InferContext

REGISTRY = op_registry()


def complex_rope(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray, head_dim: int,
                 interleaved: bool) -> np.ndarray:
    """``x [B, T, H * head_dim]`` rotated: pair ``j`` of each head (dims ``(2j, 2j + 1)`` interleaved, else
    ``(j, j + rd / 2)``) as ``a + i b``, times ``exp(i * pos * inv_freq[j])``."""
    b, t, f = x.shape
    rd = 2 * inv_freq.size
    heads = x.reshape(b, t, f // head_dim, head_dim).copy()
    first = np.arange(0, rd, 2) if interleaved else np.arange(rd // 2)
    second = first + 1 if interleaved else first + rd // 2
    z = heads[..., first] + 1j * heads[..., second]
    angle = np.broadcast_to(pos, (b, t))[..., None, None] * inv_freq  # [B, T, 1, rd / 2]
    z = z * np.exp(1j * angle)
    heads[..., first], heads[..., second] = z.real, z.imag
    return heads.reshape(b, t, f)


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [8, 4])
def test_rope_is_a_complex_rotation_of_its_pairs(interleaved: bool, rotary_dim: int) -> None:
    rng = np.random.default_rng(0)
    x, pos = rng.standard_normal((2, 5, 3 * 8)), rng.integers(0, 40, (2, 5))
    attrs = {"head_dim": 8, "rotary_dim": rotary_dim, "theta": 50.0, "interleaved": interleaved}
    (out,) = REGISTRY["rope"].run((x, None, pos), attrs)
    inv_freq = 1 / 50.0 ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    np.testing.assert_allclose(out, complex_rope(x, pos, inv_freq, 8, interleaved), rtol=1e-12, atol=1e-12)
    (back,) = REGISTRY["rope"].run((out, None, pos), {**attrs, "inverse": True})
    np.testing.assert_allclose(back, x, rtol=1e-12, atol=1e-12)
    # a freqs table replaces theta the same way in both layouts
    angles = np.arange(40)[:, None] * inv_freq
    table = np.stack([np.cos(angles), np.sin(angles)], -1)
    (tabled,) = REGISTRY["rope"].run((x, table, pos), {**attrs, "theta": 1.0})
    np.testing.assert_allclose(tabled, out, rtol=1e-12, atol=1e-12)
    if rotary_dim == 8:  # the layouts differ
        (other,) = REGISTRY["rope"].run((x, None, pos), {**attrs, "interleaved": not interleaved})
        assert np.abs(other - out).max() > 1e-3


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_qkv_qk_norm_rope_rotates_q_and_k_as_rope(interleaved: bool) -> None:
    rng = np.random.default_rng(1)
    hq, hkv, d = 4, 2, 6
    qkv, pos = rng.standard_normal((2, 3, (hq + 2 * hkv) * d)), np.array([0, 7, 3])
    qw, kw = 1 + 0.1 * rng.standard_normal(d), 1 + 0.1 * rng.standard_normal(d)
    attrs = {"Hq": hq, "Hkv": hkv, "D": d, "theta": 20.0, "rotary_dim": 4, "interleaved": interleaved,
             "eps": 1e-6}
    out, _, _ = REGISTRY["qkv_qk_norm_rope"].run((qkv, qw, kw, None, pos), attrs)
    inv_freq = 1 / 20.0 ** (np.arange(0, 4, 2) / 4)

    def normed(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        h = x.reshape(*x.shape[:2], -1, d)
        return (h / np.sqrt(np.mean(h * h, -1, keepdims=True) + 1e-6) * w).reshape(x.shape)

    q, k, v = qkv[..., :hq * d], qkv[..., hq * d:(hq + hkv) * d], qkv[..., (hq + hkv) * d:]
    want = np.concatenate([complex_rope(normed(q, qw), pos, inv_freq, d, interleaved),
                           complex_rope(normed(k, kw), pos, inv_freq, d, interleaved), v], axis=-1)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


# --- rope_freqs: each kind against its published formula ------------------------------------------


def plain(theta: float, dim: int) -> np.ndarray:
    return np.array([1.0 / theta ** (2 * i / dim) for i in range(dim // 2)])


def llama3(theta: float, dim: int, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """Llama 3.1: wavelengths above original / low are divided by factor, those below original / high
    kept, a linear ramp in original / wavelength between."""
    out = []
    for f in plain(theta, dim):
        wavelen = 2 * math.pi / f
        if wavelen < original / high:
            out.append(f)
        elif wavelen > original / low:
            out.append(f / factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


def yarn(theta: float, dim: int, factor: float, original: int) -> tuple[np.ndarray, float]:
    """YaRN (Peng et al.): frequencies whose wavelength turns more than beta_fast = 32 times over the
    original context kept, fewer than beta_slow = 1 times interpolated (/ factor), a ramp over the dims
    between (bounds floored and ceiled); cos and sin scaled by 0.1 ln(factor) + 1."""
    def dim_of(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(dim_of(32)), 0), min(math.ceil(dim_of(1)), dim - 1)
    out = []
    for i, f in enumerate(plain(theta, dim)):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(f / factor * ramp + f * (1 - ramp))
    return np.array(out), 0.1 * math.log(factor) + 1


KINDS: dict[str, tuple[dict[str, Any], Any]] = {
    "default": ({}, lambda: (plain(500.0, 16), 1.0)),
    "linear": ({"rope_type": "linear", "factor": 4.0}, lambda: (plain(500.0, 16) / 4, 1.0)),
    # 48 rows > max_position_embeddings 16: base 500 * (2 * 48 / 16 - 1) ** (16 / 14)
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 16},
                lambda: (plain(500.0 * 5.0 ** (16 / 14), 16), 1.0)),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}, lambda: (llama3(500.0, 16, 8.0, 1.0, 4.0, 32), 1.0)),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 24},
             lambda: yarn(500.0, 16, 4.0, 24)),
}


@pytest.mark.parametrize("kind", KINDS)
def test_rope_freqs_tables_follow_the_published_formulas(kind: str) -> None:
    params, formula = KINDS[kind]
    (table,) = REGISTRY["rope_freqs"].run((), {"rows": 48, "rotary_dim": 16, "theta": 500.0, **params})
    inv_freq, scale = formula()
    angle = np.arange(48)[:, None] * inv_freq
    assert table.shape == (48, 8, 2)
    # float32 as transformers computes it: the angle's rounding grows with the position
    np.testing.assert_allclose(table[..., 0], scale * np.cos(angle), rtol=0, atol=2e-5)
    np.testing.assert_allclose(table[..., 1], scale * np.sin(angle), rtol=0, atol=2e-5)


@pytest.mark.parametrize(("attrs", "match"), [
    ({"rope_type": "llama3", "factor": 8.0}, "llama3 RoPE needs low_freq_factor, high_freq_factor"),
    ({"rope_type": "dynamic", "factor": 2.0}, "dynamic RoPE needs max_position_embeddings"),
    ({"rotary_dim": 5}, "rotary_dim must be even"),
])
def test_rope_freqs_names_what_is_missing(attrs: dict[str, Any], match: str) -> None:
    opdef = REGISTRY["rope_freqs"]
    with pytest.raises(KilnError, match=match):
        opdef.infer(InferContext("rope_freqs", [],
                                 opdef.resolve_attrs({"rows": 8, "rotary_dim": 4, **attrs})))
    with pytest.raises(KilnError, match="rope_type"):
        opdef.resolve_attrs({"rows": 8, "rotary_dim": 4, "rope_type": "longrope"})


def test_rope_freqs_feeds_rope() -> None:
    opdef = REGISTRY["rope"]
    x = TensorType(parse_shape(["B", "T", 16]), "fp32")
    freqs = REGISTRY["rope_freqs"].infer(InferContext("rope_freqs", [], REGISTRY["rope_freqs"].resolve_attrs(
        {"rows": "S", "rotary_dim": 4})))[0]
    pos = TensorType(parse_shape(["T"]), "int32")
    (out,) = opdef.infer(InferContext("rope", [x, freqs, pos], opdef.resolve_attrs({"head_dim": 8,
                                                                                    "rotary_dim": 4})))
    assert out.shape == x.shape


PARITY = {k: v for k, v in KINDS.items() if k != "default"}


@pytest.mark.parity
@pytest.mark.parametrize("kind", PARITY)
def test_rope_freqs_inv_freq_matches_transformers(kind: str) -> None:
    """The inverse frequencies and attention factor of ``ROPE_INIT_FUNCTIONS[kind]`` for a config holding
    the same parameters."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kiln.core.ops import rope_inv_freq

    params, _ = KINDS[kind]
    mpe = params.get("max_position_embeddings", 16)
    scaling = {k: v for k, v in params.items() if k not in ("rope_type", "max_position_embeddings")}
    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=2, head_dim=16,
                                      max_position_embeddings=mpe,
                                      rope_parameters={"rope_type": kind, "rope_theta": 500.0, **scaling})
    seq = 48 if kind == "dynamic" else None
    theirs, their_scale = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"), seq_len=seq)
    ours, our_scale = rope_inv_freq(16, 500.0, kind, **scaling,
                                    max_position_embeddings=mpe if kind == "dynamic" else None, seq_len=seq)
    np.testing.assert_array_max_ulp(ours, theirs.numpy().astype(np.float32), maxulp=2)
    assert our_scale == pytest.approx(their_scale, rel=1e-12)
    table_attrs = {"rows": seq or mpe, "rotary_dim": 16, "theta": 500.0, **params}
    (table,) = REGISTRY["rope_freqs"].run((), table_attrs)
    np.testing.assert_allclose(table[1, :, 1], our_scale * np.sin(ours.astype(np.float64)), rtol=1e-6)
