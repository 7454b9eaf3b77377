"""GPT-NeoX configs in kiln-hf (no torch needed): the keys read with transformers' defaults and legacy names
(``rotary_pct``, ``rotary_emb_base``), and each architecture's activation checked against its MLP."""

from __future__ import annotations

import pytest

from kiln.hf import HFConfigError
from kiln.hf._pretrained import ROPE_PARAM, compile_config

NEOX = {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "vocab_size": 40,
        "hidden_size": 32, "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
        "max_position_embeddings": 16}
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 40, "hidden_size": 32,
         "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4}


def _table_width(config: dict) -> int:
    bundle, arch = compile_config(config)
    assert arch == "GPTNeoXForCausalLM"
    (spec,) = [p for p in bundle.module(bundle.entry).params if p.name == ROPE_PARAM]
    return int(spec.shape[1].evaluate({}))


def test_gptneox_defaults_and_legacy_rope_names() -> None:
    assert _table_width(NEOX) == 1  # transformers' default rotary_pct 0.25 of head 8: 2 dims, one pair
    assert _table_width({**NEOX, "rotary_pct": 0.5, "rotary_emb_base": 500.0}) == 2
    bundle, _ = compile_config({**NEOX, "rotary_pct": 1.0})
    block = bundle.module("GPTNeoXBlock").config
    assert (block["use_parallel_residual"], block["use_qkv_bias"], block["eps"]) == (True, True, 1e-5)


@pytest.mark.parametrize(("config", "message"), [
    ({**NEOX, "hidden_act": "gelu_new"}, "GELU"),
    ({**LLAMA, "hidden_act": "gelu"}, "SwiGLU"),
])
def test_the_activation_must_be_the_architectures(config: dict, message: str) -> None:
    with pytest.raises(HFConfigError, match=message) as e:
        compile_config(config)
    assert e.value.key == "hidden_act"
