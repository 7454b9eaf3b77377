"""RoPE from HF configs: both layouts, each scaling variant against values worked out by hand from the
published formulas (float64, plain ``math``), the table layout against kiln's ``rope`` op, and (marked
``parity``) against transformers itself when torch and transformers are importable."""

import copy
import math

import numpy as np
import pytest

from kiln.core import KilnError, op_registry
from kiln.hf import HFConfigError, rope_inv_freq, rope_parameters, rope_table

LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


def plain(theta: float, dim: int) -> list[float]:
    return [1.0 / theta ** (2 * i / dim) for i in range(dim // 2)]


def close(ours: np.ndarray, expected: list[float], rtol: float = 2e-6) -> None:
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours.astype(np.float64), expected, rtol=rtol, atol=0)


def test_default_and_linear_by_hand() -> None:
    inv, scale = rope_inv_freq({"rope_theta": 10000.0, "head_dim": 4})
    close(inv, [1.0, 0.01])
    assert scale == 1.0
    inv, _ = rope_inv_freq({"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 4.0},
                            "hidden_size": 32, "num_attention_heads": 8})  # head_dim 32 // 8 = 4
    close(inv, [0.25, 0.0025])


def test_dynamic_by_hand() -> None:
    cfg = {"rope_theta": 10000.0, "head_dim": 4, "max_position_embeddings": 16,
           "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    close(rope_inv_freq(cfg)[0], [1.0, 0.01])  # up to max_position_embeddings: plain RoPE
    close(rope_inv_freq(cfg, seq_len=8)[0], [1.0, 0.01])
    # seq_len 32: base 10000 * (2 * 32 / 16 - 1) ** (4 / 2) = 90000, so inv_freq[1] = 1 / 300
    close(rope_inv_freq(cfg, seq_len=32)[0], [1.0, 1 / 300])
    table = rope_table(cfg, 32)
    np.testing.assert_allclose(table[31, 1], [math.cos(31 / 300), math.sin(31 / 300)], rtol=1e-6)


def test_llama3_by_hand() -> None:
    cfg = {"rope_theta": 500000.0, "head_dim": 128, "rope_scaling": dict(LLAMA31),
           "max_position_embeddings": 131072}
    inv, scale = rope_inv_freq(cfg)
    base = plain(500000.0, 128)
    # wavelength 2π·500000^(i/64) against 8192/4 = 2048 and 8192/1: i <= 28 keep, i >= 35 divide by 8
    expected = []
    for i, f in enumerate(base):
        wavelen = 2 * math.pi / f
        if wavelen < 2048:
            expected.append(f)
        elif wavelen > 8192:
            expected.append(f / 8)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            expected.append((1 - smooth) * f / 8 + smooth * f)
        assert (wavelen < 2048) == (i <= 28) and (wavelen > 8192) == (i >= 35)
    close(inv, expected)
    assert scale == 1.0


def yarn_by_hand(theta: float, dim: int, factor: float, original: int, beta_fast: float = 32,
                 beta_slow: float = 1, truncate: bool = True) -> list[float]:
    def dim_of(rotations: float) -> float:  # YaRN paper, eq. 23: the dim turning `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    out = []
    for i, f in enumerate(plain(theta, dim)):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(f / factor * ramp + f * (1 - ramp))
    return out


def test_yarn_by_hand() -> None:
    params = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "rope_theta": 1e4}
    cfg = {"head_dim": 64, "max_position_embeddings": 8192, "rope_parameters": params}
    inv, scale = rope_inv_freq(cfg)
    # correction range: floor(64 ln(2048 / 64π) / 2 ln 1e4) = 8, ceil(64 ln(2048 / 2π) / 2 ln 1e4) = 21
    close(inv, yarn_by_hand(1e4, 64, 4.0, 2048))
    close(inv[:9], plain(1e4, 64)[:9])
    close(inv[21:], [f / 4 for f in plain(1e4, 64)[21:]])
    assert scale == pytest.approx(0.1 * math.log(4.0) + 1)
    table = rope_table(cfg, 8)  # the attention factor multiplies cos and sin, as transformers does
    np.testing.assert_allclose(table[5, 3], [scale * math.cos(5 * inv[3]), scale * math.sin(5 * inv[3])],
                               rtol=1e-6)

    untruncated = {**params, "truncate": False, "beta_fast": 16, "beta_slow": 2}
    inv, _ = rope_inv_freq({**cfg, "rope_parameters": untruncated})
    close(inv, yarn_by_hand(1e4, 64, 4.0, 2048, 16, 2, truncate=False))

    mscaled = {**params, "mscale": 0.707, "mscale_all_dim": 1.0}
    assert rope_inv_freq({**cfg, "rope_parameters": mscaled})[1] == pytest.approx(
        (0.1 * 0.707 * math.log(4) + 1) / (0.1 * math.log(4) + 1))
    assert rope_inv_freq({**cfg, "rope_parameters": {**params, "attention_factor": 1.5}})[1] == 1.5
    # factor left out: max_position_embeddings / original_max_position_embeddings = 4
    implicit = rope_inv_freq({**cfg, "rope_parameters": {**params, "factor": None}})
    np.testing.assert_array_equal(implicit[0], rope_inv_freq(cfg)[0])


def test_legacy_and_v5_layouts_agree() -> None:
    legacy = {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **LLAMA31}, "head_dim": 16,
              "max_position_embeddings": 32768}
    del legacy["rope_scaling"]["rope_type"]
    v5 = {"rope_parameters": {**LLAMA31, "rope_theta": 500000.0}, "head_dim": 16,
          "max_position_embeddings": 32768}
    assert rope_parameters(legacy) == rope_parameters(v5) == {**LLAMA31, "rope_theta": 500000.0}
    np.testing.assert_array_equal(rope_table(legacy, 64), rope_table(v5, 64))


def test_translation_fills_in_like_transformers() -> None:
    assert rope_parameters({}) == {"rope_type": "default", "rope_theta": 10000.0}
    legacy_default = {"rope_theta": 1e6, "rope_scaling": None}
    assert rope_parameters(legacy_default) == {"rope_type": "default", "rope_theta": 1e6}
    yarn = {"rope_type": "yarn", "factor": 2.0}
    assert rope_parameters({"rope_scaling": yarn, "max_position_embeddings": 4096}) == {
        **yarn, "rope_theta": 10000.0, "original_max_position_embeddings": 4096}
    inner = {**yarn, "original_max_position_embeddings": 1}
    top = rope_parameters({"rope_scaling": inner, "original_max_position_embeddings": 2048,
                           "max_position_embeddings": 4096})
    assert top["original_max_position_embeddings"] == 2048  # the top-level value wins, as in Phi-3
    partial = {"rope_theta": 100.0, "partial_rotary_factor": 0.5, "head_dim": 8}
    assert rope_parameters(partial)["partial_rotary_factor"] == 0.5
    assert rope_table(partial, 3).shape == (3, 2, 2)
    close(rope_inv_freq(partial)[0], [1.0, 0.1])  # rotary dim 4 of head_dim 8: 100^(-2/4)


@pytest.mark.parametrize(("config", "key"), [
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1]}}, "rope_scaling.rope_type"),
    ({"rope_parameters": {"rope_type": "linear"}}, "rope_parameters.factor"),
    ({"rope_scaling": {"type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor"),
    ({"rope_parameters": {"rope_type": "linear", "factor": "2"}}, "rope_parameters.factor"),
    ({"rope_theta": -1.0}, "rope_theta"),
    ({"rope_parameters": {"rope_theta": "1e4"}}, "rope_parameters.rope_theta"),
    ({"rope_scaling": [1, 2]}, "rope_scaling"),
])
def test_bad_configs_name_the_key(config: dict, key: str) -> None:
    with pytest.raises(HFConfigError) as info:
        rope_parameters(config)
    assert isinstance(info.value, KilnError) and info.value.key == key and repr(key) in str(info.value)


def test_unknown_type_lists_the_supported_ones() -> None:
    with pytest.raises(HFConfigError, match="default, linear, dynamic, yarn, llama3"):
        rope_parameters({"rope_parameters": {"rope_type": "su"}})
    with pytest.raises(HFConfigError, match="head_dim"):
        rope_table({"rope_theta": 10.0}, 4)
    with pytest.raises(HFConfigError, match="max_seq"):
        rope_table({"head_dim": 4}, 0)


def test_table_is_the_freqs_input_of_the_rope_op() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 7, 3 * 8)).astype(np.float32)
    pos = rng.integers(0, 7, (2, 7))
    rope = op_registry()["rope"].kernel
    formula = rope(x, None, pos, head_dim=8, rotary_dim=6, theta=500.0, inverse=False)
    table = rope_table({"rope_theta": 500.0, "head_dim": 8}, 7, rotary_dim=6)
    assert table.shape == (7, 3, 2)
    tabled = rope(x, table, pos, head_dim=8, rotary_dim=6, theta=0.0, inverse=False)
    np.testing.assert_allclose(tabled, formula, rtol=1e-5, atol=1e-6)


CASES = {
    "default": {},
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 3.0}},
    "dynamic": {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
    "yarn-mscale": {"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "mscale": 0.707,
                                     "mscale_all_dim": 1.0, "beta_fast": 16,
                                     "original_max_position_embeddings": 8}},
    "llama3": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
}


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_parity_with_transformers(case: str) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = {"hidden_size": 96, "num_attention_heads": 2, "head_dim": 48, "max_position_embeddings": 64,
              "rope_theta": 10000.0, **CASES[case]}
    hf = transformers.LlamaConfig(**copy.deepcopy(config))  # transformers edits the dicts it is given
    max_seq = 64 if case != "dynamic" else 128
    rotary = LlamaRotaryEmbedding(hf)
    inv = rope_inv_freq(config)[0]
    if case != "dynamic":  # dynamic rescales only when the forward sees a longer sequence
        np.testing.assert_array_max_ulp(inv, rotary.inv_freq.numpy(), maxulp=2)
    x = torch.zeros(1, max_seq, 48)
    cos, sin = rotary(x, torch.arange(max_seq)[None])
    table = rope_table(config, max_seq)
    np.testing.assert_allclose(table[..., 0], cos[0, :, :24].numpy(), rtol=0, atol=2e-5)
    np.testing.assert_allclose(table[..., 1], sin[0, :, :24].numpy(), rtol=0, atol=2e-5)
