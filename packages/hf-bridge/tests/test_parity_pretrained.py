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

import ml_dtypes
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
NO_HEAD_DIM = {k: v for k, v in SMALL.items() if k != "head_dim"}
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
    # dense and MoE layers interleaved (decoder_sparse_step and mlp_only_layers); no head_dim in the
    # config: transformers takes hidden_size // num_attention_heads
    "qwen3-moe-interleaved": ("Qwen3MoeConfig", {
        **NO_HEAD_DIM, "num_hidden_layers": 5, "num_experts": 4,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "moe_intermediate_size": 16,
        "decoder_sparse_step": 2, "mlp_only_layers": [3], "tie_word_embeddings": False}),
    # a window shorter than the sequence, so that it masks; no head_dim: hidden_size // heads
    "mistral-window": ("MistralConfig", {**NO_HEAD_DIM, "sliding_window": 7, "tie_word_embeddings": False}),
    "mixtral": ("MixtralConfig", {**NO_HEAD_DIM, "num_local_experts": 4, "num_experts_per_tok": 2,
                                  "sliding_window": 9, "tie_word_embeddings": False}),
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


def _grads_after(hf: Any, loss: Any, folder: Path) -> dict[str, np.ndarray]:
    """The gradients of ``loss`` by checkpoint name (``hf``'s weights are overwritten with them)."""
    hf.zero_grad()
    loss.backward()
    return torch_grads_by_checkpoint_name(hf, folder)


@pytest.mark.parametrize("case", ["qwen3-untied", "llama-pad"])
def test_a_left_padded_batch_with_attention_mask_matches_transformers(case: str, tmp_path: Path) -> None:
    hf = make_checkpoint(case, tmp_path / "hf")
    model = from_pretrained(tmp_path / "hf")
    ids, _ = batch()
    mask = np.ones_like(ids)
    mask[0, :7], mask[1, :3] = 0, 0  # left padding of different lengths
    ids[mask == 0] = 0
    # The last padding position would be scored against the first real token; what it predicts
    # depends on how an attention treats a row that sees no real key (transformers' eager, sdpa and
    # kiln differ), so, as a collator should, nothing is scored there.
    labels = np.where(mask == 1, ids, -100)
    labels[0, 7], labels[1, 3] = -100, -100

    with torch.no_grad():
        logits = hf(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    real = mask == 1  # what a padding position computes is nobody's business
    assert_close(model.logits(ids, attention_mask=mask)[real], logits[real], "logits")
    # without the mask the real tokens would see the padding: the mask is what makes them agree
    assert not np.allclose(model.logits(ids)[real], logits[real], atol=1e-3)

    out = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    expected = _grads_after(hf, out.loss, tmp_path / "grads")
    loss, grads = model.loss_and_grads(ids, shift_labels(labels), attention_mask=mask)
    assert loss == pytest.approx(out.loss.item(), rel=1e-5)
    for name, g in expected.items():
        assert_close(grads[name], g, name)


def test_a_packed_sequence_equals_its_documents_unpacked(tmp_path: Path) -> None:
    # Oracle: transformers on each document alone; the packed row's loss is the mean over all
    # documents' positions, so its gradient is the sum of the documents' summed-loss gradients / count.
    hf = make_checkpoint("qwen3-untied", tmp_path / "hf")
    model = from_pretrained(tmp_path / "hf")
    rng = np.random.default_rng(3)
    docs = [rng.integers(1, VOCAB, n) for n in (9, 5, 7, 3)]
    ids = np.concatenate(docs)[None]
    positions = np.concatenate([np.arange(len(d)) for d in docs])[None]
    labels = ids.copy()
    labels[0, np.cumsum([len(d) for d in docs])[:-1]] = -100  # a document's first token is not predicted

    # (transformers' eager and sdpa attention do not keep packed documents apart: only restarting
    # positions, so its packed forward is no oracle; its flash-attention-2 path is, on a GPU)
    with torch.no_grad():
        alone = np.concatenate([hf(torch.tensor(d[None])).logits.numpy() for d in docs], axis=1)
    assert_close(model.logits(ids, position_ids=positions), alone, "packed logits")

    count = sum(len(d) - 1 for d in docs)
    ce = torch.nn.functional.cross_entropy
    total = sum(ce(hf(torch.tensor(d[None])).logits[0, :-1], torch.tensor(d[1:]), reduction="sum")
                for d in docs) / count
    expected = _grads_after(hf, total, tmp_path / "grads")
    loss, grads = model.loss_and_grads(ids, shift_labels(labels), position_ids=positions)
    assert loss == pytest.approx(total.item(), rel=1e-5)
    for name, g in expected.items():
        assert_close(grads[name], g, name)


ARCH_CONFIGS = {"LlamaForCausalLM": "LlamaConfig", "Qwen3ForCausalLM": "Qwen3Config",
                "Qwen3MoeForCausalLM": "Qwen3MoeConfig", "MistralForCausalLM": "MistralConfig",
                "MixtralForCausalLM": "MixtralConfig"}


@pytest.mark.parametrize("arch", ARCH_CONFIGS)
def test_kiln_defaults_are_the_transformers_config_defaults(arch: str) -> None:
    from kiln.hf._pretrained import HF_DEFAULTS

    theirs = getattr(transformers, ARCH_CONFIGS[arch])()
    derived = {"num_key_value_heads": theirs.num_attention_heads,
               "head_dim": theirs.hidden_size // theirs.num_attention_heads}
    for key, ours in HF_DEFAULTS[arch].items():
        value = theirs.rope_parameters["rope_theta"] if key == "rope_theta" else getattr(theirs, key, None)
        if ours is None and key in derived:  # transformers derives it, as kiln's models do
            assert value in (None, derived[key]), key
        else:
            assert value == ours, key


@pytest.mark.parametrize("case", ["llama-attention-bias", "qwen3-untied", "qwen3-moe-interleaved", "mixtral"])
def test_a_config_without_its_default_keys_loads_as_transformers_reads_it(case: str,
                                                                          tmp_path: Path) -> None:
    make_checkpoint(case, tmp_path)
    config_file = tmp_path / "config.json"
    config = json.loads(config_file.read_text())
    defaults = getattr(transformers, CASES[case][0])().to_dict()
    kept = {k: v for k, v in config.items()
            if k in ("architectures", "model_type") or defaults.get(k, k) != v}
    assert len(kept) < len(config)
    config_file.write_text(json.dumps(kept))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids, _ = batch()
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
    assert_close(from_pretrained(tmp_path).logits(ids), expected, "logits")


@pytest.mark.parametrize("case", ["qwen3-tied", "qwen3-untied"])
def test_the_bf16_recipe_tracks_transformers_under_cpu_autocast(case: str, tmp_path: Path) -> None:
    """A Qwen3 checkpoint loaded with ``precision="bf16"`` against transformers under
    ``torch.autocast("cpu", dtype=torch.bfloat16)``. The recipe's rounding points are autocast's
    (kiln-core's test_precision proves them exact on an op chain), including the three inside kiln's
    fused ops (SDPA's bf16 probabilities, the q/k norms' bf16 output before their weight, silu's bf16
    output before the gate product: their ``@numpy:bfloat16`` kernels, test_precision_fused). What
    remains is fp32 noise (torch's vectorised exp and accumulation order) that flips a bf16 rounding
    now and then and spreads through the layers: over a third of the logits agree bit for bit (a
    fifth without the fused points) and the rest within a bf16 step or two of the logits' scale."""
    hf = make_checkpoint(case, tmp_path / "hf")
    model = from_pretrained(tmp_path / "hf", precision="bf16")
    ids, labels = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = hf(input_ids=torch.tensor(ids), labels=torch.tensor(labels))
    assert out.logits.dtype == torch.bfloat16
    logits = model.logits(ids)
    assert np.array_equal(logits, logits.astype(ml_dtypes.bfloat16).astype(np.float32))
    theirs = out.logits.float().detach().numpy()
    assert_close(logits, theirs, "logits", rel=2 ** -5)
    assert np.mean(logits == theirs) > 0.3, np.mean(logits == theirs)
    out.loss.backward()
    loss, grads = model.loss_and_grads(ids, shift_labels(labels))
    assert loss == pytest.approx(out.loss.item(), rel=1e-3)
    for name, g in torch_grads_by_checkpoint_name(hf, tmp_path / "grads").items():
        assert_close(grads[name], g, name, rel=2 ** -4)
