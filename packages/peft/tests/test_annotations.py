"""``@adapter("lora")`` annotations of the DSL drive the LoRA pass (seed 004 §7.3.2)."""

# ruff: noqa: F821  (dimension names inside Tensor[...] annotations are not Python names)

import numpy as np
import pytest

from kiln.core import Model
from kiln.dsl import Array, B, Param, T, Tensor, block, build_bundle, forward, graph, model
from kiln.dsl.annotations import adapter, frozen
from kiln.peft import AdapterError, PeftModel, annotated_ia3_config, annotated_lora_config, get_peft_model


@block
class AdaptedMlp:
    def __init__(self, d_model: int):
        self.d_model = d_model

    up = Param(Tensor["d_model", "d_model", "fp32"]) @ adapter("lora", rank=2, alpha=4.0)
    down = Param(Tensor["d_model", "d_model", "fp32"]) @ adapter("lora", rank=4, alpha=4.0)
    gate = Param(Tensor["d_model", "d_model", "fp32"])

    @forward
    def forward(self, x: Tensor["B", "T", "d_model", "fp32"]) -> Tensor["B", "T", "d_model", "fp32"]:
        with graph() as g:
            x_flat = g.view(x, shape=[B * T, "d_model"])
            h = g.mul(
                g.silu(g.matmul(x_flat, "gate", transpose="NT")), g.matmul(x_flat, "up", transpose="NT")
            )
            return g.add(x, g.view(g.matmul(h, "down", transpose="NT"), shape=[B, T, "d_model"]))


@model
class AdaptedLM:
    def __init__(self, vocab_size: int = 16, d_model: int = 8, n_layers: int = 2):
        self.vocab_size, self.d_model, self.n_layers = vocab_size, d_model, n_layers

    embedding = Param(Tensor["vocab_size", "d_model", "fp32"])
    blocks = Param(Array["n_layers", "AdaptedMlp"])

    @forward
    def forward(
        self,
        token_ids: Tensor["B", "T", "int32"],
        position_ids: Tensor["T", "int32"],
        targets: Tensor["B", "T", "int32"],
    ) -> Tensor["B * T", "fp32"]:
        with graph() as g:
            xN = g.call(
                "StackedBlocks",
                g.embedding(token_ids, "embedding"),
                num_outputs=1,
                blocks="blocks",
                n_layers=self.n_layers,
            )
            return g.fused_lm_head_loss(g.view(xN, shape=[B * T, "d_model"]), "embedding", targets)


def test_adapter_annotations_choose_the_lora_sites_and_ranks(tmp_path) -> None:
    bundle = build_bundle(AdaptedLM, {})
    layer = bundle.module("AdaptedMlp")
    assert [t.name for t in layer.param("up").lora_targets] == ["up"] and not layer.param("gate").lora_targets
    config = annotated_lora_config(bundle)
    rng = np.random.default_rng(1)
    weights = {k: rng.normal(0, 0.5, v.shape) for k, v in Model(bundle).parameters().items()}
    model = get_peft_model(Model(bundle, weights=weights), config, optimizer={"name": "adamw", "lr": 1e-2})
    shapes = {k: v.shape for k, v in model.parameters().items() if "lora" in k}
    assert shapes == {
        f"blocks.{i}.{w}.{w}.lora_{ab}": shape
        for i in (0, 1)
        for w, r in (("up", 2), ("down", 4))
        for ab, shape in (("A", (r, 8)), ("B", (8, r)))
    }
    ids = np.random.default_rng(0).integers(0, 16, (2, 7))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    _, grads = model.loss_and_grads(batch["input_ids"], batch["labels"], names="kiln")
    assert set(grads) == set(shapes)  # only the annotated weights are adapted, only adapters train
    losses = [model.train_step(batch)["loss"] for _ in range(20)]
    assert losses[-1] < losses[0]
    model.save_pretrained(tmp_path)
    again = PeftModel.from_pretrained(Model(bundle, weights=weights), tmp_path)
    np.testing.assert_array_equal(again.logits(batch["input_ids"]), model.logits(batch["input_ids"]))


def test_no_adapter_annotation_is_a_named_error() -> None:
    from kiln.dsl.stdlib.models import Qwen3Model

    bundle = build_bundle(
        Qwen3Model,
        {
            "vocab_size": 16,
            "d_model": 8,
            "n_layers": 1,
            "num_query_heads": 2,
            "num_kv_heads": 1,
            "d_ff": 8,
            "max_seq": 8,
            "head_size": 4,
        },
    )
    with pytest.raises(AdapterError, match="no @adapter"):
        annotated_lora_config(bundle)


@pytest.mark.parity
def test_an_annotated_adapter_saves_in_a_format_peft_loads(tmp_path) -> None:
    """The annotations of an HF model's IR pick q and v of the fused QKV weight; PEFT loads what kiln
    saves and gives the same logits."""
    import attrs

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    kiln_hf = pytest.importorskip("kiln.hf")
    from kiln.core.ir import Annotation

    torch.manual_seed(0)
    config = transformers.Qwen3Config(
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
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "base")
    base = kiln_hf.from_pretrained(tmp_path / "base")
    bundle = base.ir
    stack = next(p for p in bundle.module(bundle.entry).params if p.array_of)
    layer = bundle.module(stack.array_of)
    annotated = layer.evolve(
        annotations=[
            Annotation(
                "adapter",
                "param",
                "qkv_weight",
                {"type": "lora", "rank": 4, "alpha": 8.0, "targets": ["q", "v"]},
            ),
            Annotation("adapter", "param", "mlp_down_weight", {"type": "lora", "rank": 2, "alpha": 8.0}),
        ]
    )
    bundle = bundle.evolve(modules=[annotated if m is layer else m for m in bundle.modules])
    lora_config = attrs.evolve(annotated_lora_config(bundle), init_lora_weights=False)
    ours = get_peft_model(base, lora_config, seed=3)
    ours.save_pretrained(tmp_path / "adapter")
    theirs = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32),
        tmp_path / "adapter",
    )
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in theirs.named_parameters() if ".lora_A" in n}
    assert {n.split("layers.")[1] for n in adapted} == {
        f"{i}.{m}" for i in (0, 1) for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
    }
    ids = np.random.default_rng(7).integers(0, 61, (2, 12))
    with torch.no_grad():
        expected = theirs(torch.tensor(ids)).logits.numpy()
    got = ours.logits(ids)
    assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max()


@block
class Ia3Mlp:
    def __init__(self, d_model: int):
        self.d_model = d_model

    up = Param(Tensor["d_model", "d_model", "fp32"]) @ adapter("ia3")
    down = Param(Tensor["d_model", "d_model", "fp32"])

    @forward
    def forward(self, x: Tensor["B", "T", "d_model", "fp32"]) -> Tensor["B", "T", "d_model", "fp32"]:
        with graph() as g:
            x_flat = g.view(x, shape=[B * T, "d_model"])
            h = g.silu(g.matmul(x_flat, "up", transpose="NT"))
            return g.add(x, g.view(g.matmul(h, "down", transpose="NT"), shape=[B, T, "d_model"]))


def test_ia3_adapter_annotation_scales_the_annotated_weight() -> None:
    @model
    class Ia3LM:
        def __init__(self, vocab_size: int = 16, d_model: int = 8, n_layers: int = 2):
            self.vocab_size, self.d_model, self.n_layers = vocab_size, d_model, n_layers

        embedding = Param(Tensor["vocab_size", "d_model", "fp32"]) @ frozen
        blocks = Param(Array["n_layers", "Ia3Mlp"])

        @forward
        def forward(
            self,
            token_ids: Tensor["B", "T", "int32"],
            position_ids: Tensor["T", "int32"],
            targets: Tensor["B", "T", "int32"],
        ) -> Tensor["B * T", "fp32"]:
            with graph() as g:
                xN = g.call(
                    "StackedBlocks",
                    g.embedding(token_ids, "embedding"),
                    num_outputs=1,
                    blocks="blocks",
                    n_layers=self.n_layers,
                )
                return g.fused_lm_head_loss(g.view(xN, shape=[B * T, "d_model"]), "embedding", targets)

    bundle = build_bundle(Ia3LM, {})
    adapted = get_peft_model(Model(bundle), annotated_ia3_config(bundle))
    assert sorted(k for k in adapted.parameters() if "ia3" in k) == [
        "blocks.0.up.up.ia3_l",
        "blocks.1.up.up.ia3_l",
    ]
    ids = np.random.default_rng(0).integers(0, 16, (2, 7))
    _, grads = adapted.loss_and_grads(ids[:, :-1], ids[:, 1:], names="kiln")
    assert set(grads) == {"blocks.0.up.up.ia3_l", "blocks.1.up.up.ia3_l"}
