"""IA³, the second adapter kind: a graph pass scaling projections, saved and loaded as PEFT does."""

import numpy as np
import pytest

from kiln.core import Model, get_registry
from kiln.dsl import build_bundle
from kiln.dsl.stdlib.models import Qwen3Model
from kiln.peft import AdapterError, IA3Config, PeftModel, get_peft_model

CONFIG = {
    "vocab_size": 40,
    "d_model": 16,
    "n_layers": 2,
    "num_query_heads": 2,
    "num_kv_heads": 1,
    "d_ff": 24,
    "max_seq": 32,
    "head_size": 8,
}


def base_model() -> Model:
    m = Model(build_bundle(Qwen3Model, CONFIG))
    rng = np.random.default_rng(0)
    m.set_parameters(
        {
            k: (1 + 0.1 * rng.standard_normal(v.shape)) if "norm" in k else 0.3 * rng.standard_normal(v.shape)
            for k, v in m.parameters().items()
        }
    )
    return m


def test_ia3_scales_outputs_and_feedforward_inputs_as_merging_does(tmp_path) -> None:
    base = base_model()
    config = IA3Config(
        target_modules=["k_proj", "v_proj", "down_proj"],
        feedforward_modules=["down_proj"],
        init_ia3_weights=False,
    )
    model = get_peft_model(base, config, seed=2)
    vectors = {k: v.shape for k, v in model.parameters().items() if "ia3" in k}
    assert vectors == {
        f"blocks.{i}.{k}": s
        for i in (0, 1)
        for k, s in (
            ("qkv_weight.k.ia3_l", (8,)),
            ("qkv_weight.v.ia3_l", (8,)),
            ("mlp_down_weight.down.ia3_l", (24,)),
        )
    }
    ids = np.random.default_rng(1).integers(0, 40, (2, 9))
    logits = model.logits(ids[:, :-1])
    assert not np.allclose(logits, base.logits(ids[:, :-1]), atol=1e-3)  # random vectors change the model
    # the oracle: the base model with W scaled as the vectors say (rows of k and v; columns of down)
    w = base.parameters()
    for i in (0, 1):
        qkv = w[f"blocks.{i}.qkv_weight"].copy()
        qkv[16:24] *= model.parameter(f"blocks.{i}.qkv_weight.k.ia3_l")[:, None]
        qkv[24:32] *= model.parameter(f"blocks.{i}.qkv_weight.v.ia3_l")[:, None]
        w[f"blocks.{i}.qkv_weight"] = qkv
        w[f"blocks.{i}.mlp_down_weight"] = (
            w[f"blocks.{i}.mlp_down_weight"]
            * model.parameter(f"blocks.{i}.mlp_down_weight.down.ia3_l")[None, :]
        )
    scaled = Model(build_bundle(Qwen3Model, CONFIG), weights=w)
    np.testing.assert_allclose(logits, scaled.logits(ids[:, :-1]), rtol=1e-4, atol=1e-5)

    _, grads = model.loss_and_grads(ids[:, :-1], ids[:, 1:], names="kiln")
    assert set(grads) == set(vectors)  # only the vectors train
    stats = [model.train_step({"input_ids": ids[:, :-1], "labels": ids[:, 1:]}) for _ in range(10)]
    assert stats[-1]["loss"] < stats[0]["loss"]
    model.save_pretrained(tmp_path)
    again = PeftModel.from_pretrained(base_model(), tmp_path)
    np.testing.assert_array_equal(again.logits(ids[:, :-1]), model.logits(ids[:, :-1]))
    assert again.adapter_state_dict()["base_model.model.model.layers.0.mlp.down_proj.ia3_l"].shape == (1, 24)
    merged = model.merge_and_unload()
    np.testing.assert_allclose(merged.logits(ids[:, :-1]), again.logits(ids[:, :-1]), rtol=1e-4, atol=1e-5)


def test_ia3_is_a_registered_pass_and_adapter() -> None:
    adapted = get_registry("graph_passes")["ia3"](
        build_bundle(Qwen3Model, CONFIG),
        {"peft_type": "IA3", "target_modules": ["v_proj"], "feedforward_modules": []},
    )
    block = adapted.module("DenseTransformerBlock")
    assert [p.name for p in block.params if p.role == "adapter"] == ["qkv_weight.v.ia3_l"]
    assert get_registry("adapters")["ia3"].config(target_modules=["v_proj"]) == IA3Config(
        target_modules=["v_proj"]
    )


def test_bad_ia3_configs_name_the_culprit() -> None:
    with pytest.raises(AdapterError, match="feedforward_modules"):
        get_peft_model(base_model(), IA3Config(target_modules=["k_proj"], feedforward_modules=["down_proj"]))
    with pytest.raises(AdapterError, match="slice of the fused weight"):
        get_peft_model(base_model(), IA3Config(target_modules=["up_proj"], feedforward_modules=["up_proj"]))


@pytest.mark.parity
def test_ia3_adapters_round_trip_with_peft(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    kiln_hf = pytest.importorskip("kiln.hf")

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "base")
    ids = np.random.default_rng(7).integers(0, 61, (2, 12))

    def hf_logits(m):
        with torch.no_grad():
            return m(torch.tensor(ids)).logits.numpy()

    def close(a, b):
        assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()

    # kiln -> peft
    config = IA3Config(
        target_modules=["k_proj", "v_proj", "down_proj"],
        feedforward_modules=["down_proj"],
        init_ia3_weights=False,
    )
    ours = get_peft_model(kiln_hf.from_pretrained(tmp_path / "base"), config, seed=3)
    ours.save_pretrained(tmp_path / "ours")
    theirs = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32),
        tmp_path / "ours",
    )
    close(ours.logits(ids), hf_logits(theirs))
    # peft -> kiln
    torch.manual_seed(1)
    made = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32),
        peft.IA3Config(
            target_modules=["q_proj", "up_proj", "down_proj"],
            feedforward_modules=["down_proj"],
            init_ia3_weights=False,
        ),
    )
    made.save_pretrained(tmp_path / "theirs")
    loaded = PeftModel.from_pretrained(kiln_hf.from_pretrained(tmp_path / "base"), tmp_path / "theirs")
    close(loaded.logits(ids), hf_logits(made))
