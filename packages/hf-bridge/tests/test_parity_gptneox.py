"""GPT-NeoX (``GPTNeoXForCausalLM``, kiln's ``GPTNeoXModel`` of GPTNeoXBlocks) against transformers on tiny
random checkpoints saved by transformers: logits, loss and every gradient within 1e-4, for the parallel
residual (GPT-NeoX's default, two LayerNorms on one input) and the sequential one, with and without
attention biases, partial RoPE (``rotary_pct``) included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy

from kiln.hf import from_pretrained, shift_labels

pytestmark = pytest.mark.parity
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 53
SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 2,
         "num_attention_heads": 4, "max_position_embeddings": 32, "layer_norm_eps": 1e-5}
CASES: dict[str, dict[str, Any]] = {
    "parallel": {**SMALL, "rope_parameters": {"rope_type": "default", "rope_theta": 100.0,
                                              "partial_rotary_factor": 0.5}},
    "sequential-no-bias": {**SMALL, "use_parallel_residual": False, "attention_bias": False},
}


def make_checkpoint(case: str, folder: Path) -> Any:
    config = transformers.GPTNeoXConfig(**CASES[case])
    torch.manual_seed(sum(map(ord, case)))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name and name.endswith("weight")
                    else 0.2 * torch.randn_like(p))
    model.save_pretrained(folder)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def assert_close(ours: np.ndarray, theirs: np.ndarray, what: str, rel: float = 1e-4) -> None:
    assert ours.shape == theirs.shape, what
    scale = float(np.abs(theirs).max())
    err = float(np.abs(ours.astype(np.float64) - theirs).max())
    assert err <= rel * scale, f"{what}: max error {err:.3g} exceeds {rel} x {scale:.3g}"


@pytest.mark.parametrize("case", CASES)
def test_gptneox_logits_loss_and_gradients_match_transformers(case: str, tmp_path: Path) -> None:
    hf = make_checkpoint(case, tmp_path / "hf")
    model = from_pretrained(tmp_path / "hf")
    assert model.architecture == "GPTNeoXForCausalLM"
    rng = np.random.default_rng(5)
    ids = rng.integers(0, VOCAB, (2, 14))
    labels = ids.copy()
    labels[0, :3] = -100
    with torch.no_grad():
        logits = hf(torch.tensor(ids)).logits.numpy()
    assert_close(model.logits(ids), logits, "logits")

    out = hf(input_ids=torch.tensor(ids), labels=torch.tensor(labels))
    out.loss.backward()
    loss, grads = model.loss_and_grads(ids, shift_labels(labels))
    assert loss == pytest.approx(out.loss.item(), rel=1e-5)
    with torch.no_grad():  # transformers' gradients under the checkpoint's names
        for p in hf.parameters():
            p.copy_(p.grad)
    hf.save_pretrained(tmp_path / "grads")
    expected = safetensors.numpy.load_file(str(tmp_path / "grads" / "model.safetensors"))
    assert set(grads) == set(expected)
    for name, g in expected.items():
        assert_close(grads[name], g, name)


def test_gptneox_save_pretrained_round_trips(tmp_path: Path) -> None:
    make_checkpoint("parallel", tmp_path / "hf")
    from_pretrained(tmp_path / "hf").save_pretrained(tmp_path / "kiln")
    theirs = safetensors.numpy.load_file(str(tmp_path / "hf" / "model.safetensors"))
    ours = safetensors.numpy.load_file(str(tmp_path / "kiln" / "model.safetensors"))
    assert set(ours) == set(theirs)
    for name, value in theirs.items():
        assert ours[name].tobytes() == value.tobytes(), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "kiln", dtype=torch.float32)
    assert isinstance(reloaded, transformers.GPTNeoXForCausalLM)
