"""from_pretrained / save_pretrained without torch: checkpoints written by kiln's own writer in HF's
layout. Round trips, gradients under the checkpoint's names, every mapping kind, precise errors on
bad files with no model returned, and loading within one tensor of the model's own memory."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from kiln.core import KilnError, Model
from kiln.hf import (
    CheckpointError,
    HFConfigError,
    PretrainedModel,
    from_pretrained,
    open_checkpoint,
    save_checkpoint,
    shift_labels,
)
from kiln.hf._mapping import Entry, resolve

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 61, "hidden_size": 16,
         "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 8, "max_position_embeddings": 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
         "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu"}
QWEN3 = {**LLAMA, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "tie_word_embeddings": True}
QWEN3_MOE = {**LLAMA, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
             "num_hidden_layers": 3, "num_local_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
             "moe_intermediate_size": 8, "mlp_only_layers": [0], "decoder_sparse_step": 1}


def hf_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a HF Llama / Qwen3 / Qwen3-MoE checkpoint (per-expert layout)."""
    v, c, f = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]
    h, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    out = {"model.embed_tokens.weight": (v, c), "model.norm.weight": (c,)}
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = (v, c)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": (c,), p + "post_attention_layernorm.weight": (c,),
                p + "self_attn.q_proj.weight": (h * d, c), p + "self_attn.k_proj.weight": (kv * d, c),
                p + "self_attn.v_proj.weight": (kv * d, c), p + "self_attn.o_proj.weight": (c, h * d)}
        if cfg["attention_bias"]:
            out |= {p + "self_attn.q_proj.bias": (h * d,), p + "self_attn.k_proj.bias": (kv * d,),
                    p + "self_attn.v_proj.bias": (kv * d,), p + "self_attn.o_proj.bias": (c,)}
        if cfg["model_type"] != "llama":
            out |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        if "num_local_experts" in cfg and i not in cfg["mlp_only_layers"]:
            m = cfg["moe_intermediate_size"]
            out[p + "mlp.gate.weight"] = (cfg["num_local_experts"], c)
            for e in range(cfg["num_local_experts"]):
                q = f"{p}mlp.experts.{e}."
                out |= {q + "gate_proj.weight": (m, c), q + "up_proj.weight": (m, c),
                        q + "down_proj.weight": (c, m)}
        else:
            out |= {p + "mlp.gate_proj.weight": (f, c), p + "mlp.up_proj.weight": (f, c),
                    p + "mlp.down_proj.weight": (c, f)}
    return out


def write(folder: Path, cfg: dict[str, Any], *, dtype: Any = np.float32, seed: int = 0,
          edit: Any = None, **save: Any) -> dict[str, np.ndarray]:
    """A random HF checkpoint of ``cfg`` in ``folder``, written by kiln; ``edit`` may change the tensors."""
    rng = np.random.default_rng(seed)
    tensors = {k: ((1 if "norm" in k else 0) + 0.2 * rng.standard_normal(s)).astype(dtype)
               for k, s in hf_shapes(cfg).items()}
    if edit is not None:
        edit(tensors)
    save_checkpoint(folder, tensors, **save)
    (folder / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return tensors


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k


@pytest.mark.parametrize("cfg", [LLAMA, QWEN3, QWEN3_MOE, {**LLAMA, "attention_bias": True}],
                         ids=["llama", "qwen3-tied", "qwen3-moe", "llama-bias"])
def test_round_trip_is_bit_exact(cfg: dict[str, Any], tmp_path: Path) -> None:
    tensors = write(tmp_path / "in", cfg, dtype=ml_dtypes.bfloat16)
    model = from_pretrained(tmp_path / "in")
    assert isinstance(model, Model) and model.architecture == cfg["architectures"][0]
    same(model.hf_state_dict(), tensors)
    files = model.save_pretrained(tmp_path / "out")
    assert {f.name for f in files} == {"model.safetensors", "config.json"}
    with open_checkpoint(tmp_path / "out") as ckpt:
        assert ckpt.metadata == {"format": "pt"}
        same({k: ckpt.get(k) for k in ckpt}, tensors)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == cfg


def test_trained_weights_are_saved(tmp_path: Path) -> None:
    write(tmp_path / "in", QWEN3_MOE)
    model = from_pretrained(tmp_path / "in", seed=3)
    ids = np.random.default_rng(0).integers(0, 61, (2, 9))
    before = model.parameters()
    losses = [model.train_step({"input_ids": ids, "labels": shift_labels(ids)})["loss"] for _ in range(5)]
    assert losses[-1] < losses[0]
    model.save_pretrained(tmp_path / "out", dtype="float32", max_shard_size="8KB")
    again = from_pretrained(tmp_path / "out").parameters()
    after = model.parameters()
    assert not np.array_equal(after["blocks.1.experts_down"], before["blocks.1.experts_down"])
    same(again, after)


def test_omitted_keys_default_as_in_transformers(tmp_path: Path) -> None:
    short = {k: v for k, v in QWEN3_MOE.items() if k not in ("rope_theta", "norm_topk_prob")}
    write(tmp_path, short)
    config = from_pretrained(tmp_path).ir.module("Qwen3MoEModel").config
    assert config["rope_theta"] == 10000.0 and config["norm_topk_prob"] is False  # the DSL's: 1e6, True


def test_moe_stacks_continue_the_layer_numbering(tmp_path: Path) -> None:
    tensors = write(tmp_path / "in", QWEN3_MOE)
    model = from_pretrained(tmp_path / "in")
    params = model.parameters()
    assert {k.split(".")[0] for k in params} == {"embedding", "final_norm", "lm_head", "dense_blocks",
                                                 "blocks"}
    np.testing.assert_array_equal(params["dense_blocks.0.mlp_down_weight"],
                                  tensors["model.layers.0.mlp.down_proj.weight"])
    # blocks.0 is HF layer 1 (after the one dense layer); experts stack as [gate | up] rows
    gate_up = params["blocks.0.experts_gate_up"]
    np.testing.assert_array_equal(gate_up[2, :8], tensors["model.layers.1.mlp.experts.2.gate_proj.weight"])
    np.testing.assert_array_equal(gate_up[2, 8:], tensors["model.layers.1.mlp.experts.2.up_proj.weight"])
    np.testing.assert_array_equal(params["blocks.1.router_weight"], tensors["model.layers.2.mlp.gate.weight"])


def test_gradients_are_keyed_by_checkpoint_names(tmp_path: Path) -> None:
    write(tmp_path / "in", QWEN3)
    model = from_pretrained(tmp_path / "in")
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 61, (2, 6))
    loss, grads = model.loss_and_grads(ids, shift_labels(ids))
    kloss, kgrads = model.loss_and_grads(ids, shift_labels(ids), names="kiln")
    assert loss == kloss
    with open_checkpoint(tmp_path / "in") as ckpt:
        assert set(grads) == set(ckpt.keys())  # tied: no lm_head.weight; its gradient is the embedding's
    qkv = kgrads["blocks.1.qkv_weight"]  # [q | k | v] rows, split back
    np.testing.assert_array_equal(grads["model.layers.1.self_attn.q_proj.weight"], qkv[:32])
    np.testing.assert_array_equal(grads["model.layers.1.self_attn.k_proj.weight"], qkv[32:48])
    np.testing.assert_array_equal(grads["model.layers.1.self_attn.v_proj.weight"], qkv[48:])
    np.testing.assert_array_equal(grads["model.embed_tokens.weight"], kgrads["embedding"])
    assert shift_labels(np.array([[5, 6, 7]])).tolist() == [[6, 7, -100]]
    with pytest.raises(KilnError, match="names='torch'"):
        model.loss_and_grads(ids, ids, names="torch")
    with pytest.raises(KilnError, match="dtype='int8' is not valid"):
        model.save_pretrained(tmp_path / "out", dtype="int8")


def test_sharded_and_scaled_rope(tmp_path: Path) -> None:
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
    cfg = {**LLAMA, "rope_scaling": yarn}
    tensors = write(tmp_path / "in", cfg, max_shard_size="4KB")
    assert (tmp_path / "in" / "model.safetensors.index.json").exists()
    model = from_pretrained(tmp_path / "in")
    assert "rope_freqs" in model.parameters()  # the scaled table, a frozen parameter kiln fills
    ids = np.arange(12).reshape(1, 12)
    _, grads = model.loss_and_grads(ids, shift_labels(ids))
    assert set(grads) == set(tensors)
    plain = from_pretrained(_with(tmp_path, "plain", tensors, LLAMA))
    assert not np.allclose(model.logits(ids), plain.logits(ids))  # the scaling reaches the attention
    same(model.hf_state_dict(), tensors)


@pytest.mark.parametrize("recompute", ["dsl", "block"])
def test_recompute_keeps_gradients_bit_for_bit(recompute: str, tmp_path: Path) -> None:
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8}
    ids = np.arange(24).reshape(2, 12) % 61
    labels = shift_labels(ids)
    for name, cfg in {"moe": QWEN3_MOE, "llama3": {**LLAMA, "rope_scaling": llama3}}.items():
        write(tmp_path / name, cfg)
        loss, grads = from_pretrained(tmp_path / name).loss_and_grads(ids, labels)
        loss2, grads2 = from_pretrained(tmp_path / name, recompute=recompute).loss_and_grads(ids, labels)
        assert loss == loss2
        same(grads, grads2)


def _with(tmp_path: Path, name: str, tensors: dict[str, np.ndarray], cfg: dict[str, Any]) -> Path:
    save_checkpoint(tmp_path / name, tensors)
    (tmp_path / name / "config.json").write_text(json.dumps(cfg))
    return tmp_path / name


# -- bad files: each names the file and the tensor or key, and no model is made --------------------


def _header(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _rewrite(path: Path, header: dict[str, Any], data: bytes) -> None:
    h = json.dumps(header).encode()
    path.write_bytes(len(h).to_bytes(8, "little") + h + data)


def _unknown_dtype(f: Path) -> None:
    h, data = _header(f)
    h["model.norm.weight"]["dtype"] = "F7"
    _rewrite(f, h, data)


def _overlap(f: Path) -> None:
    h, data = _header(f)
    start = h["model.embed_tokens.weight"]["data_offsets"][0]
    h["model.norm.weight"]["data_offsets"] = [start, start + 64]  # 16 floats inside the embedding's bytes
    _rewrite(f, h, data)


BAD_FILES = {
    "truncated": (lambda f: f.write_bytes(f.read_bytes()[:-100]), "model.safetensors", "truncated"),
    "header past the end": (lambda f: f.write_bytes((10**6).to_bytes(8, "little") + f.read_bytes()[8:]),
                            "model.safetensors", "past the end"),
    "overlapping offsets": (_overlap, "model.norm.weight", "overlaps"),
    "unknown dtype": (_unknown_dtype, "model.norm.weight", "unknown dtype"),
}


@pytest.fixture
def no_model_made(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    made: list[Any] = []
    init = PretrainedModel.__init__

    def spy(self: Any, *a: Any, **k: Any) -> None:
        made.append(self)
        init(self, *a, **k)

    monkeypatch.setattr(PretrainedModel, "__init__", spy)
    return made


@pytest.mark.parametrize("case", BAD_FILES)
def test_bad_files(case: str, tmp_path: Path, no_model_made: list[Any]) -> None:
    write(tmp_path, LLAMA)
    corrupt, culprit, what = BAD_FILES[case]
    corrupt(tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=what) as e:
        from_pretrained(tmp_path)
    assert str(tmp_path / "model.safetensors") in str(e.value) and culprit in str(e.value)
    assert e.value.file == str(tmp_path / "model.safetensors")
    assert not no_model_made


def test_missing_tensor_and_wrong_shape(tmp_path: Path, no_model_made: list[Any]) -> None:
    write(tmp_path / "a", LLAMA, edit=lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match="missing") as e:
        from_pretrained(tmp_path / "a")
    assert e.value.tensor == "model.layers.1.self_attn.k_proj.weight"
    assert e.value.file == str(tmp_path / "a" / "model.safetensors")
    assert "blocks.1.qkv_weight" in str(e.value)

    def reshape(t: dict[str, np.ndarray]) -> None:
        t["model.layers.0.mlp.down_proj.weight"] = np.zeros((24, 16), np.float32)

    write(tmp_path / "b", LLAMA, edit=reshape, max_shard_size="4KB")  # sharded: the shard is named
    with pytest.raises(CheckpointError, match=r"shape \[24, 16\] differs from \[16, 24\]") as e:
        from_pretrained(tmp_path / "b")
    assert e.value.tensor == "model.layers.0.mlp.down_proj.weight"
    assert e.value.file is not None and e.value.file.endswith(".safetensors") and "-of-" in e.value.file

    write(tmp_path / "c", LLAMA, edit=lambda t: t.update({"model.norm.weight": np.zeros(16, np.int32)}))
    with pytest.raises(CheckpointError, match="not a float type") as e:
        from_pretrained(tmp_path / "c")
    assert not no_model_made


def test_config_errors(tmp_path: Path, no_model_made: list[Any]) -> None:
    write(tmp_path, {**LLAMA, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(HFConfigError, match=r"map .*LlamaForCausalLM.*MixtralForCausalLM") as e:
        from_pretrained(tmp_path)
    assert e.value.key == "architectures" and e.value.file == str(tmp_path / "config.json")
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "hidden_act": "gelu"}))
    with pytest.raises(HFConfigError, match="hidden_act"):
        from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "rope_scaling": {"rope_type": "longrope"}}))
    with pytest.raises(HFConfigError, match="rope_type") as e:
        from_pretrained(tmp_path)
    assert e.value.file == str(tmp_path / "config.json")
    mixtral = {**LLAMA, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
               "router_jitter_noise": 0.1}
    (tmp_path / "config.json").write_text(json.dumps(mixtral))
    with pytest.raises(HFConfigError, match="jitter") as e:
        from_pretrained(tmp_path)
    assert e.value.key == "router_jitter_noise"
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "mlp_bias": True}))
    with pytest.raises(HFConfigError, match=r"E027.*mlp_bias"):
        from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(HFConfigError, match=r"config\.json: cannot read"):
        from_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(KilnError, match=r"no config\.json"):
        from_pretrained(tmp_path)
    assert not no_model_made


# -- every mapping kind, on the resolver itself ---------------------------------------------------


def test_every_mapping_kind_loads_and_exports(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    t = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in {
        "a": (4, 3), "b": (2, 3), "gate_up": (6, 3), "t": (3, 5), "x.0.g": (2, 3), "x.0.u": (2, 3),
        "x.1.g": (2, 3), "x.1.u": (2, 3), "stacked": (2, 4, 3)}.items()}
    save_checkpoint(tmp_path, t)
    entries = [
        Entry("fused", (6, 3), {"type": "fuse", "sources": ["a", "b"], "dim": 0}),
        Entry("gate", (2, 3), {"type": "split", "source": "gate_up", "ranges": [[0, 2]], "dim": 0}),
        Entry("up", (4, 3), {"type": "split", "source": "gate_up", "ranges": [["M", "3 * M"]], "dim": 0},
              ints={"M": 2}),
        Entry("tt", (5, 3), {"type": "transform", "source": "t", "fn": "transpose"}),
        Entry("copy", (5, 3), {"type": "tied_to", "target": "tt"}),
        Entry("experts", (2, 4, 3), {"type": "stack_experts", "pattern": "x.{expert}.g", "fuse_gate_up": True,
                                     "layout": "per_expert", "up_pattern": "x.{expert}.u"}),
        Entry("stacked", (2, 4, 3), {"type": "stack_experts", "pattern": "stacked", "layout": "stacked"}),
        Entry("opt", (3,), "?not.there", init={"kind": "ones"}),
    ]
    with open_checkpoint(tmp_path) as ckpt:
        wm = resolve(ckpt, entries)
        arrays = {e.param: np.zeros(e.shape, np.float32) for e in entries}
        wm.load(ckpt, arrays)
    np.testing.assert_array_equal(arrays["fused"], np.concatenate([t["a"], t["b"]]))
    np.testing.assert_array_equal(arrays["gate"], t["gate_up"][:2])
    np.testing.assert_array_equal(arrays["up"], t["gate_up"][2:])
    np.testing.assert_array_equal(arrays["tt"], t["t"].T)
    np.testing.assert_array_equal(arrays["copy"], t["t"].T)
    np.testing.assert_array_equal(arrays["experts"][1], np.concatenate([t["x.1.g"], t["x.1.u"]]))
    np.testing.assert_array_equal(arrays["stacked"], t["stacked"])
    assert wm.absent == {"opt"}
    arrays["opt"][...] = 3.0
    out = {k: np.asarray(v) for k, v in wm.export(arrays).items()}
    assert set(out) == {*t, "not.there"}
    for k in t:
        np.testing.assert_array_equal(out[k], t[k])
    np.testing.assert_array_equal(out["not.there"], [3.0, 3.0, 3.0])  # saved all the same

    with open_checkpoint(tmp_path) as ckpt:  # a split that leaves rows out cannot be written back
        with pytest.warns(UserWarning, match="8 checkpoint tensor"):  # those no parameter reads
            wm = resolve(ckpt, [Entry("gate", (2, 3), {"type": "split", "source": "gate_up",
                                                       "ranges": [[0, 2]]})])
        with pytest.raises(KilnError, match="fill 6 of its 18 elements"):
            np.asarray(wm.export({"gate": arrays["gate"]})["gate_up"])
        with pytest.raises(CheckpointError, match="a, b hold 4 \\+ 2 = 6, but kiln parameter 'f' has 5"):
            resolve(ckpt, [Entry("f", (5, 3), {"type": "fuse", "sources": ["a", "b"], "dim": 0})])


# -- memory -----------------------------------------------------------------------------------------


def test_loading_peaks_within_one_tensor_of_the_model(tmp_path: Path) -> None:
    cfg = {**LLAMA, "vocab_size": 4096, "hidden_size": 128, "intermediate_size": 256,
           "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 32}
    tensors = write(tmp_path, cfg, dtype=ml_dtypes.bfloat16)
    largest = max(v.size for v in tensors.values()) * 4  # as float32
    from_pretrained(tmp_path)  # compile once: the DSL's caches are not the loader's memory
    tracemalloc.start()
    try:
        model = from_pretrained(tmp_path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    weights = sum(v.nbytes for v in model.parameters().values())
    # the arena holds the weights, their gradients and AdamW's two moments: kiln's own, allocated by Model
    assert model.arena_bytes >= 4 * weights
    assert peak <= model.arena_bytes + largest, (peak - model.arena_bytes, largest)


class NpzFormat:
    """A weight format from a plugin: the tensors of ``weights.npz`` (float32)."""

    def detect(self, path: Path) -> bool:
        return (Path(path) / "weights.npz").is_file()

    def open(self, path: Path) -> Any:
        return _NpzReader(Path(path) / "weights.npz")

    def save(self, folder: Path, tensors: Any, **options: Any) -> list[Path]:
        np.savez(Path(folder) / "weights.npz", **{k: np.asarray(v) for k, v in tensors.items()})
        return [Path(folder) / "weights.npz"]


class _NpzReader:
    def __init__(self, path: Path) -> None:
        self.path, self.arrays = path, dict(np.load(path))

    def __enter__(self) -> _NpzReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def __contains__(self, key: object) -> bool:
        return key in self.arrays

    def __iter__(self) -> Any:
        return iter(self.arrays)

    def info(self, key: str) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(file=self.path, dtype="F32", shape=self.arrays[key].shape)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.arrays[key].shape)

    def read_into(self, key: str, out: np.ndarray, index: Any = None) -> None:
        out[...] = self.arrays[key] if index is None else self.arrays[key][index]


def test_checkpoints_are_read_through_the_registered_weight_formats(tmp_path: Path) -> None:
    from kiln.core import PluginSession, get_registry, hookimpl

    tensors = write(tmp_path / "st", LLAMA)
    (tmp_path / "npz").mkdir()
    (tmp_path / "npz" / "config.json").write_text(json.dumps(LLAMA), encoding="utf-8")
    NpzFormat().save(tmp_path / "npz", tensors)
    assert get_registry("weight_formats").owner("safetensors").distribution == "kiln-hf"
    with pytest.raises(KilnError, match=r"no registered weight format reads this \(safetensors registered\)"):
        from_pretrained(tmp_path / "npz")

    class Plugin:
        @hookimpl
        def kiln_register_weight_formats(self, registry: Any) -> None:
            registry.register("npz", NpzFormat())

    with PluginSession().activate() as session:
        session.register(Plugin(), "npz")
        same(from_pretrained(tmp_path / "npz").hf_state_dict(), tensors)
        same(from_pretrained(tmp_path / "st").hf_state_dict(), tensors)  # still safetensors


def test_an_absent_head_dim_defaults_as_in_transformers(tmp_path: Path) -> None:
    """Without head_dim, Qwen3-MoE has hidden_size // num_attention_heads (as transformers), Qwen3 128."""
    moe = {**QWEN3_MOE, "head_dim": QWEN3_MOE["hidden_size"] // QWEN3_MOE["num_attention_heads"]}
    tensors = write(tmp_path / "moe", moe)
    config = json.loads((tmp_path / "moe" / "config.json").read_text())
    del config["head_dim"]
    (tmp_path / "moe" / "config.json").write_text(json.dumps(config))
    same(from_pretrained(tmp_path / "moe").hf_state_dict(), tensors)
    dense = {**QWEN3, "hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128}
    write(tmp_path / "dense", dense)
    config = json.loads((tmp_path / "dense" / "config.json").read_text())
    del config["head_dim"]
    (tmp_path / "dense" / "config.json").write_text(json.dumps(config))
    assert from_pretrained(tmp_path / "dense").parameters()["blocks.0.q_norm_weight"].shape == (128,)


def test_the_pad_token_row_gets_no_gradient(tmp_path: Path) -> None:
    """HF's pad_token_id is the embedding's padding_idx (torch.nn.Embedding): when the pad id occurs in
    the input, its row gets no gradient from the lookup; every other gradient is unchanged."""
    write(tmp_path / "pad", {**LLAMA, "pad_token_id": 0})
    write(tmp_path / "none", LLAMA)
    ids = np.array([[0, 5, 7, 0, 9, 3], [4, 0, 0, 2, 8, 1]])
    labels = np.roll(ids, -1, axis=1)
    grads = {k: from_pretrained(tmp_path / k).loss_and_grads(ids, labels, names="kiln")[1]
             for k in ("pad", "none")}
    assert not grads["pad"]["embedding"][0].any() and grads["none"]["embedding"][0].any()
    np.testing.assert_array_equal(grads["pad"]["embedding"][1:], grads["none"]["embedding"][1:])
    assert all(np.array_equal(grads["pad"][k], grads["none"][k]) for k in grads["pad"] if k != "embedding")
    with pytest.raises(KilnError, match="pad_token_id must be a row of the embedding"):
        write(tmp_path / "bad", {**LLAMA, "pad_token_id": LLAMA["vocab_size"]})
        from_pretrained(tmp_path / "bad")


def test_a_model_made_from_scratch_starts_with_a_zero_padding_row() -> None:
    from kiln.dsl import build_bundle

    config = {"vocab_size": 64, "d_model": 32, "n_layers": 1, "num_query_heads": 4, "num_kv_heads": 2,
              "head_size": 8, "d_ff": 64, "max_seq": 16}
    padded = Model.from_ir(build_bundle("Qwen3Model", {**config, "pad_token_id": 3}), seed=0)
    padded = padded.parameter("embedding")
    plain = Model.from_ir(build_bundle("Qwen3Model", config), seed=0).parameter("embedding")
    assert not padded[3].any() and plain[3].any()  # as transformers' _init_weights for padding_idx
    assert np.array_equal(np.delete(padded, 3, axis=0), np.delete(plain, 3, axis=0))


def test_kiln_plan_plans_a_hf_checkpoint_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kiln.core.cli import main

    write(tmp_path / "ckpt", LLAMA)
    assert main(["plan", str(tmp_path / "ckpt"), "--batch", "2", "--seq", "8", "--recompute", "none"]) == 0
    out = capsys.readouterr().out
    assert "LlamaModel" in out and out.count("DenseTransformerBlock") == LLAMA["num_hidden_layers"]
    saved = next(line for line in out.splitlines() if line.strip().startswith("saved_activations"))
    assert saved.split()[1] != "0", saved  # a real plan: activations are saved
    assert main(["plan", str(tmp_path / "ckpt"), "--config", "{}"]) == 2
    assert "a checkpoint's config.json sets its model" in capsys.readouterr().err
