"""Scaled RoPE declared in the DSL (a from-scratch ``LlamaModel(rope_parameters=...)``: each block computes
its table with the ``rope_freqs`` op) equals kiln-hf's loading of the same HF config (a frozen
``rope_freqs`` parameter filled from ``rope_table``, itself checked against transformers in
test_rope.py and test_parity_pretrained.py): losses and gradients, float64."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kiln.core import Model
from kiln.dsl import build_bundle
from kiln.hf import rope_table
from kiln.hf._pretrained import ROPE_PARAM, compile_config

HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 40, "hidden_size": 32,
      "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "head_dim": 8, "max_position_embeddings": 16, "rms_norm_eps": 1e-6}
DSL = {"vocab_size": 40, "d_model": 32, "d_ff": 24, "n_layers": 2, "num_query_heads": 4, "num_kv_heads": 2,
       "head_size": 8, "max_seq": 16, "eps": 1e-6}
KINDS: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 3.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 4},
    # no original_max_position_embeddings: max_position_embeddings, as transformers
    "yarn": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0},
}


@pytest.mark.parametrize("kind", KINDS)
def test_dsl_scaled_rope_equals_the_hf_table(kind: str) -> None:
    rope = {"rope_theta": 50.0, **KINDS[kind]}
    hf_config = {**HF, "rope_parameters": rope}
    loaded, _ = compile_config(hf_config)
    reference = Model.from_ir(loaded, dtype="float64", seed=4)
    shape = next(p.shape for p in loaded.module(loaded.entry).params if p.name == ROPE_PARAM)
    reference.set_parameters({ROPE_PARAM: rope_table(hf_config, shape[0].evaluate({}))})

    bundle = build_bundle("LlamaModel", {**DSL, "rope_parameters": rope})
    assert [op.type for op in bundle.module("DenseTransformerBlock").forward.ops].count("rope_freqs") == 1
    scratch = Model.from_ir(bundle, dtype="float64")
    scratch.set_parameters({k: v for k, v in reference.parameters().items() if k != ROPE_PARAM})

    rng = np.random.default_rng(2)
    ids, targets = rng.integers(0, 40, (2, 12)), rng.integers(0, 40, (2, 12))
    loss, grads = scratch.loss_and_grads(ids, targets)
    want, want_grads = reference.loss_and_grads(ids, targets)
    assert loss == pytest.approx(want, rel=1e-12)
    assert set(grads) == set(want_grads)
    for name, g in grads.items():
        np.testing.assert_allclose(g, want_grads[name], rtol=1e-10, atol=1e-13, err_msg=name)
    plain = Model.from_ir(build_bundle("LlamaModel", {**DSL, "rope_theta": 50.0}), dtype="float64")
    plain.set_parameters(scratch.parameters())
    assert abs(plain.loss(ids, targets) - loss) > 1e-6  # the scaling matters at these positions
