"""The MoE load-balancing loss against transformers: tiny random Mixtral and Qwen3-MoE checkpoints with
``output_router_logits=True`` (and a coefficient large enough to matter) load with kiln-hf; the loss
(cross entropy + ``router_aux_loss_coef`` * ``load_balancing_loss_func``) and every gradient agree with
transformers' within 1e-4, with and without padding (transformers' ``attention_mask`` leaves padding out of
the auxiliary loss)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy

from kiln.hf import from_pretrained, shift_labels

pytestmark = pytest.mark.parity
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 61
SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
         "tie_word_embeddings": False, "output_router_logits": True, "router_aux_loss_coef": 0.3}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", {**SMALL, "intermediate_size": 24, "num_local_experts": 4,
                                  "num_experts_per_tok": 2}),
    # a dense layer between MoE layers: only the MoE layers' router logits count
    "qwen3-moe": ("Qwen3MoeConfig", {**SMALL, "head_dim": 8, "intermediate_size": 40, "num_experts": 6,
                                     "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                     "norm_topk_prob": True, "mlp_only_layers": [1]}),
}


def make_checkpoint(case: str, folder: Path) -> Any:
    config_class, kwargs = CASES[case]
    config = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(sum(map(ord, case)))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model.save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["output_router_logits"] is True
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def assert_close(ours: np.ndarray, theirs: np.ndarray, what: str, rel: float = 1e-4) -> None:
    assert ours.shape == theirs.shape, what
    scale = float(np.abs(theirs).max())
    err = float(np.abs(ours.astype(np.float64) - theirs).max())
    assert err <= rel * scale, f"{what}: max error {err:.3g} exceeds {rel} x {scale:.3g}"


@pytest.mark.parametrize("padded", [False, True], ids=["dense-batch", "padded"])
@pytest.mark.parametrize("case", CASES)
def test_loss_with_the_aux_term_and_gradients_match_transformers(case: str, padded: bool,
                                                                 tmp_path: Path) -> None:
    hf = make_checkpoint(case, tmp_path / "hf")
    model = from_pretrained(tmp_path / "hf")
    rng = np.random.default_rng(3)
    ids = rng.integers(0, VOCAB, (2, 12))
    labels = ids.copy()
    labels[0, :3] = -100
    mask = np.ones_like(ids)
    if padded:
        mask[1, 8:] = 0
        labels[1, 8:] = -100
    kw = {"attention_mask": torch.tensor(mask)} if padded else {}
    out = hf(input_ids=torch.tensor(ids), labels=torch.tensor(labels), **kw)
    assert out.aux_loss is not None and hf.router_aux_loss_coef * out.aux_loss.item() > 1e-3 * out.loss.item()
    out.loss.backward()
    loss, grads = model.loss_and_grads(ids, shift_labels(labels), attention_mask=mask if padded else None)
    assert loss == pytest.approx(out.loss.item(), rel=1e-5)

    with torch.no_grad():  # transformers' gradients under the checkpoint's names
        for p in hf.parameters():
            p.copy_(p.grad)
    hf.save_pretrained(tmp_path / "grads")
    expected = safetensors.numpy.load_file(str(tmp_path / "grads" / "model.safetensors"))
    assert set(grads) == set(expected)
    for name, g in expected.items():
        assert_close(grads[name], g, name)
