"""from_pretrained / save_pretrained against transformers on tiny random checkpoints saved by transformers.

Like is compared with like: transformers' ``labels`` are unshifted (position t is scored against
``labels[:, t + 1]``), kiln's are the targets themselves, so kiln gets ``shift_labels(labels)``; both
losses are then the mean over the same positions. Gradients are compared under the checkpoint's
tensor names: transformers' own are turned into those by saving them with ``save_pretrained`` (which
splits its fused 3-D expert tensors back into per-expert keys). "Within 1e-4 relative" is per tensor:
the largest difference is at most 1e-4 of the tensor's largest magnitude.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy

from kiln.hf import from_pretrained, open_checkpoint, shift_labels

pytestmark = pytest.mark.parity
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ = 97, 2, 24
SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64,
         "rms_norm_eps": 1e-6}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-tied": ("Qwen3Config", {**SMALL, "tie_word_embeddings": True}),
    "qwen3-untied": ("Qwen3Config", {**SMALL, "tie_word_embeddings": False}),
    "llama-attention-bias": ("LlamaConfig", {**SMALL, "attention_bias": True, "tie_word_embeddings": False}),
    "llama-llama3-rope": ("LlamaConfig", {**SMALL, "rope_parameters": LLAMA3, "tie_word_embeddings": False}),
    "qwen3-yarn-rope": ("Qwen3Config", {**SMALL, "tie_word_embeddings": True, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}}),
    # the pad id occurs in the input: transformers' embedding gives that row no gradient (padding_idx)
    "qwen3-pad-tied": ("Qwen3Config", {**SMALL, "tie_word_embeddings": True, "pad_token_id": 0}),
    "llama-pad": ("LlamaConfig", {**SMALL, "tie_word_embeddings": False, "pad_token_id": 0}),
    "qwen3-moe-dense-layer": ("Qwen3MoeConfig", {
        **SMALL, "num_hidden_layers": 3, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "moe_intermediate_size": 16, "mlp_only_layers": [0], "tie_word_embeddings": False}),
}


def make_checkpoint(case: str, folder: Path, dtype: Any = None) -> Any:
    """A transformers model of ``case`` with random weights (norms near 1), saved into ``folder`` (in
    ``dtype``), and that checkpoint loaded back by transformers in float32."""
    config_class, kwargs = CASES[case]
    config = getattr(transformers, config_class)(**json.loads(json.dumps(kwargs)))
    torch.manual_seed(sum(map(ord, case)))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model.to(dtype or torch.float32).save_pretrained(folder)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    ids = rng.integers(0, VOCAB, (BATCH, SEQ))
    ids[1, -4:] = 0  # the pad id of the *-pad cases
    labels = ids.copy()
    labels[0, :5] = -100  # ignored positions count in neither loss
    return ids, labels


def assert_close(ours: np.ndarray, theirs: np.ndarray, what: str, rel: float = 1e-4) -> None:
    assert ours.shape == theirs.shape, what
    scale = float(np.abs(theirs).max())
    err = float(np.abs(ours.astype(np.float64) - theirs).max())
    assert err <= rel * scale, f"{what}: max error {err:.3g} exceeds {rel} x {scale:.3g}"


def torch_grads_by_checkpoint_name(model: Any, folder: Path) -> dict[str, np.ndarray]:
    """transformers' gradients under the checkpoint's names: saved as if they were the weights."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad)
    model.save_pretrained(folder)
    return dict(safetensors.numpy.load_file(str(folder / "model.safetensors")))


@pytest.mark.parametrize("case", CASES)
def test_logits_loss_and_gradients_match_transformers(case: str, tmp_path: Path) -> None:
    hf = make_checkpoint(case, tmp_path / "hf")
    model = from_pretrained(tmp_path / "hf")
    ids, labels = batch()

    with torch.no_grad():
        logits = hf(torch.tensor(ids)).logits.numpy()
    assert_close(model.logits(ids), logits, "logits")

    out = hf(input_ids=torch.tensor(ids), labels=torch.tensor(labels))
    out.loss.backward()
    loss, grads = model.loss_and_grads(ids, shift_labels(labels))
    assert loss == pytest.approx(out.loss.item(), rel=1e-5)

    expected = torch_grads_by_checkpoint_name(hf, tmp_path / "grads")
    with open_checkpoint(tmp_path / "hf") as ckpt:
        assert set(grads) == set(expected) == set(ckpt.keys())  # every parameter, by the checkpoint's names
    for name, g in expected.items():
        assert_close(grads[name], g, name)


def same_tensors(a: Path, b: Path) -> None:
    with open_checkpoint(a) as x, open_checkpoint(b) as y:
        assert set(x.keys()) == set(y.keys())
        for k in x:
            assert x.info(k).dtype == y.info(k).dtype and x.shape(k) == y.shape(k), k
            assert x.get(k).tobytes() == y.get(k).tobytes(), k


@pytest.mark.parametrize("case", ["qwen3-tied", "llama-llama3-rope", "qwen3-moe-dense-layer"])
def test_save_pretrained_round_trips_and_loads_in_transformers(case: str, tmp_path: Path) -> None:
    hf = make_checkpoint(case, tmp_path / "hf")
    model = from_pretrained(tmp_path / "hf")
    files = model.save_pretrained(tmp_path / "kiln")
    assert [f.name for f in files] == ["model.safetensors", "config.json"]
    same_tensors(tmp_path / "hf", tmp_path / "kiln")  # bit for bit, dtypes and keys included
    with open(tmp_path / "kiln" / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["__metadata__"] == {"format": "pt"}
    original = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert json.loads((tmp_path / "kiln" / "config.json").read_text()) == original

    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "kiln", dtype=torch.float32)
    ids, _ = batch()
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
        np.testing.assert_array_equal(again(torch.tensor(ids)).logits.numpy(), expected)


def test_sharded_checkpoints_both_ways(tmp_path: Path) -> None:
    make_checkpoint("qwen3-untied", tmp_path / "hf")
    model = from_pretrained(tmp_path / "hf")
    files = model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json") in files and len(files) > 4
    same_tensors(tmp_path / "hf", tmp_path / "sharded")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sharded", dtype=torch.float32)
    ids, _ = batch()
    with torch.no_grad():
        logits = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_array_equal(from_pretrained(tmp_path / "sharded").logits(ids), model.logits(ids))
    assert_close(model.logits(ids), logits, "logits of the sharded copy")

    # transformers' own shards load too
    hf.save_pretrained(tmp_path / "hf-sharded", max_shard_size="20KB")
    assert (tmp_path / "hf-sharded" / "model.safetensors.index.json").exists()
    np.testing.assert_array_equal(from_pretrained(tmp_path / "hf-sharded").logits(ids), model.logits(ids))


def test_bf16_checkpoint(tmp_path: Path) -> None:
    hf = make_checkpoint("llama-attention-bias", tmp_path / "hf", dtype=torch.bfloat16)
    with open_checkpoint(tmp_path / "hf") as ckpt:
        assert {ckpt.info(k).dtype for k in ckpt} == {"BF16"}
    model = from_pretrained(tmp_path / "hf")  # upcast exactly to float32
    ids, _ = batch()
    with torch.no_grad():
        logits = hf(torch.tensor(ids)).logits.numpy()  # the same bf16 weights, upcast by transformers
    assert_close(model.logits(ids), logits, "logits")
    model.save_pretrained(tmp_path / "kiln")  # each tensor in the dtype it was loaded with: bf16
    same_tensors(tmp_path / "hf", tmp_path / "kiln")
    model.save_pretrained(tmp_path / "f32", dtype="float32")
    with open_checkpoint(tmp_path / "f32") as ckpt:
        w = ckpt.get("model.layers.0.self_attn.q_proj.weight")
    assert w.dtype == np.float32
    with open_checkpoint(tmp_path / "hf") as ckpt:
        assert ckpt.get("model.layers.0.self_attn.q_proj.weight").astype(np.float32).tobytes() == w.tobytes()
    assert json.loads((tmp_path / "f32" / "config.json").read_text())["dtype"] == "float32"
