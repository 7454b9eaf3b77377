"""``kiln train`` configs: every error class names the key at fault before any work starts; the
documented keys are the schema's; the example config is valid."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from kiln.core import PluginSession
from kiln.core.recompute import parse_budget
from kiln.hf import TrainConfigError, load_train_config
from kiln.hf._train import PRESETS, SCHEMA

ROOT = Path(__file__).parents[3]
QWEN3 = json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 300,
                    "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
                    "max_position_embeddings": 64, "tie_word_embeddings": True})
BASE = """\
[model]
name = "Qwen3Model"
[data]
files = ["text.txt"]
"""


def config(tmp_path: Path, text: str, *, base: str = BASE) -> Path:
    (tmp_path / "text.txt").write_text("hello world\n" * 50, encoding="utf-8")
    head = text.partition("\n")[0]
    if head.startswith("[") and head + "\n" in base:  # a section the base has: add to it
        base, text = base.replace(head + "\n", text, 1), ""
    path = tmp_path / "run.toml"
    path.write_text(base + text, encoding="utf-8")
    return path


def error(tmp_path: Path, text: str, key: str | None, *, base: str = BASE) -> str:
    path = config(tmp_path, text, base=base)
    with pytest.raises(TrainConfigError) as info:
        load_train_config(path)
    assert info.value.key == key
    message = str(info.value)
    if key is not None:
        assert key in message, message
    assert str(path) in message
    assert not (tmp_path / "runs").exists()  # nothing was done
    return message


def test_defaults_fill_every_key(tmp_path: Path) -> None:
    cfg = load_train_config(config(tmp_path, ""))
    assert {s: set(cfg[s]) for s in SCHEMA} == {s: set(keys) for s, keys in SCHEMA.items()}
    assert cfg["train"]["output_dir"] == tmp_path / "runs" / "run"
    assert cfg["data"]["files"] == [tmp_path / "text.txt"]
    assert cfg["train"]["steps"] == 100 and cfg["optimizer"]["lr"] == 1e-3


@pytest.mark.parametrize(("text", "key", "words"), [
    ("[trian]\nsteps = 3\n", "trian", ["unknown section", "'train'", "valid sections"]),
    ("[train]\nstepz = 3\n", "train.stepz", ["unknown key", "did you mean 'steps'", "batch_size"]),
    ("[optimizer]\nlearning_rate = 3\n", "optimizer.learning_rate", ["unknown key", "lr"]),
    ("[lora]\nrank = 4\n", "lora.rank", ["unknown key"]),
], ids=["section", "key", "key-no-match", "lora-key"])
def test_unknown_keys(tmp_path: Path, text: str, key: str, words: list[str]) -> None:
    message = error(tmp_path, text, key)
    for w in words:
        assert w in message, message


def test_section_that_is_not_a_table(tmp_path: Path) -> None:
    assert "must be a table" in error(tmp_path, "", "train", base="train = 3\n" + BASE)


@pytest.mark.parametrize(("text", "key", "expected"), [
    ("[train]\nsteps = \"100\"\n", "train.steps", "an int"),
    ("[train]\nsteps = 10.0\n", "train.steps", "an int"),
    ("[train]\nsteps = true\n", "train.steps", "an int"),
    ("[optimizer]\nlr = \"fast\"\n", "optimizer.lr", "a number"),
    ("[optimizer]\nlr = nan\n", "optimizer.lr", "finite"),
    ("[data]\nseparator = 2\n", "data.separator", "a string"),
    ("[model]\nconfig = 3\n", "model.config", "a table"),
    ("[lora]\nuse_rslora = 1\n", "lora.use_rslora", "true or false"),
    ("[parallel]\noverlap = \"yes\"\n", "parallel.overlap", "true or false"),
    ("[lora]\ntarget_modules = [1, 2]\n", "lora.target_modules", "a list of strings"),
    ("[train]\nmemory_budget = [1]\n", "train.memory_budget", "not a budget"),
])
def test_wrong_types(tmp_path: Path, text: str, key: str, expected: str) -> None:
    assert expected in error(tmp_path, text, key)


@pytest.mark.parametrize(("text", "key", "expected"), [
    ("[train]\nsteps = 0\n", "train.steps", ">= 1"),
    ("[train]\neval_every = -1\n", "train.eval_every", ">= 0"),
    ("[data]\nvalidation_fraction = 1.5\n", "data.validation_fraction", "in (0.0, 1.0)"),
    ("[data]\nvalidation_fraction = 0\n", "data.validation_fraction", "in (0.0, 1.0)"),
    ("[data]\nvocab_size = 100\n", "data.vocab_size", ">= 257"),
    ("[optimizer]\nlr = 0\n", "optimizer.lr", "> 0"),
    ("[optimizer]\nbeta2 = 1.0\n", "optimizer.beta2", "in [0.0, 1.0)"),
    ("[optimizer]\nmin_lr_ratio = 2\n", "optimizer.min_lr_ratio", "in [0.0, 1.0]"),
    ("[train]\nmemory_budget = 1.5\n", "train.memory_budget", "not in (0, 1]"),
    ("[train]\nmemory_budget = 0\n", "train.memory_budget", "not a budget"),
    ("[train]\nmemory_budget = \"12 parsecs\"\n", "train.memory_budget", "not a budget"),
    ("[model]\nconfig = {max_seq = 8}\n", "model.config.max_seq", "below train.seq_len"),
])
def test_out_of_range(tmp_path: Path, text: str, key: str, expected: str) -> None:
    assert expected in error(tmp_path, text, key)


@pytest.mark.parametrize(("text", "key", "valid"), [
    ("[train]\nmode = \"qlora\"\n", "train.mode", "'full', 'lora'"),
    ("[train]\nrecompute = \"auto-ish\"\n", "train.recompute", "'none', 'dsl', 'auto', 'block'"),
    ("[train]\nbackend = \"tpu\"\n", "train.backend", "'numpy'"),
    ("[optimizer]\nschedule = \"step\"\n", "optimizer.schedule", "'cosine', 'linear', 'constant'"),
    ("[model]\nsize = \"huge\"\n", "model.size", "'tiny', 'small', 'base'"),
    ("[train]\nprecision = \"fp16\"\n", "train.precision", "'fp32', 'bf16'"),
], ids=["mode", "recompute", "backend", "schedule", "size", "precision"])
def test_invalid_choices_list_the_valid_ones(tmp_path: Path, text: str, key: str, valid: str) -> None:
    assert valid in error(tmp_path, text, key)


def test_unknown_model_lists_the_models(tmp_path: Path) -> None:
    message = error(tmp_path, "", "model.name", base=BASE.replace("Qwen3Model", "Qwen4Model"))
    assert "did you mean 'Qwen3Model'" in message and "LlamaModel" in message
    # a DSL model without a HF architecture cannot be exported, so it is not offered
    assert "HyperConnectionModel" not in message


@pytest.mark.parametrize(("text", "key"), [
    ("", "data.files"),
    ("[data]\ntokenizer = \"no-such-tokenizer\"\n", "data.tokenizer"),
])
def test_missing_files(tmp_path: Path, text: str, key: str) -> None:
    base = BASE.replace("text.txt", "missing.txt") if not text else BASE
    message = error(tmp_path, text, key, base=base)
    assert "missing.txt" in message or "no-such-tokenizer" in message


def test_missing_checkpoint_folder(tmp_path: Path) -> None:
    message = error(tmp_path, "", "model.checkpoint",
                    base="[model]\ncheckpoint = \"nowhere\"\n[data]\nfiles = [\"text.txt\"]\n")
    assert "nowhere" in message and "config.json" in message


def test_required_key_missing(tmp_path: Path) -> None:
    assert "missing" in error(tmp_path, "", "data.files", base="[model]\nname = \"Qwen3Model\"\n")


def test_name_or_checkpoint(tmp_path: Path) -> None:
    assert "either" in error(tmp_path, "", "model.name", base="[data]\nfiles = [\"text.txt\"]\n")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(QWEN3)
    assert "not both" in error(tmp_path, "", "model.checkpoint",
                               base=BASE.replace("[model]\n", "[model]\ncheckpoint = \"ckpt\"\n"))


def test_size_applies_to_named_models_only(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(QWEN3)
    base = "[model]\ncheckpoint = \"ckpt\"\nsize = \"small\"\n[data]\nfiles = [\"text.txt\"]\n"
    assert "model.name only" in error(tmp_path, "", "model.size", base=base)


@pytest.mark.parametrize(("config", "words"), [
    ("{}", "architectures"), ('{"architectures": ["GPT2LMHeadModel"]}', "GPT2LMHeadModel"),
    ("not json", "cannot read")])
def test_a_checkpoint_config_kiln_cannot_build(tmp_path: Path, config: str, words: str) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(config)
    base = "[model]\ncheckpoint = \"ckpt\"\n[data]\nfiles = [\"text.txt\"]\ntokenizer = \"ckpt\"\n"
    (tmp_path / "ckpt" / "tokenizer.json").write_text("{}")
    assert words in error(tmp_path, "", "model.checkpoint", base=base)


def test_a_checkpoint_without_tokenizer_needs_one(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(QWEN3)
    base = "[model]\ncheckpoint = \"ckpt\"\n[data]\nfiles = [\"text.txt\"]\n"
    assert "no tokenizer.json" in error(tmp_path, "", "data.tokenizer", base=base)


def test_model_config_that_does_not_compile(tmp_path: Path) -> None:
    message = error(tmp_path, "", "model.config",
                    base=BASE.replace("[model]\n", "[model]\nconfig = {d_model = 0}\n"))
    assert "Qwen3Model" in message


def test_lora_section_needs_lora_mode(tmp_path: Path) -> None:
    assert "train.mode" in error(tmp_path, "[lora]\nr = 4\n", "lora")


def test_lora_mode_without_kiln_peft_names_it(tmp_path: Path) -> None:
    with PluginSession(autoload=False).activate():  # no kiln-peft: no "lora" adapter
        message = error(tmp_path, "[train]\nmode = \"lora\"\n", "train.mode")
    assert "kiln-peft" in message


def test_not_toml(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[train\nsteps = 3\n")
    with pytest.raises(TrainConfigError, match="not valid TOML") as info:
        load_train_config(path)
    assert info.value.key is None and str(path) in str(info.value)
    with pytest.raises(TrainConfigError, match="does not exist"):
        load_train_config(tmp_path / "absent.toml")


def test_a_dict_config_and_paths(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x")
    cfg = load_train_config({"model": {"name": "LlamaModel", "size": "small"}, "data": {"files": "a.txt"},
                             "train": {"recompute": "auto", "memory_budget": "64MiB", "output_dir": "out"}},
                            base=tmp_path)
    assert cfg["data"]["files"] == [tmp_path / "a.txt"]
    assert cfg["train"]["output_dir"] == tmp_path / "out" and cfg["train"]["memory_budget"] == 64 << 20


@pytest.mark.parametrize(("text", "value"), [
    ("123456", 123456), (123456, 123456), ("64MiB", 64 << 20), ("1.5GB", 1_500_000_000), (0.5, 0.5),
    ("50%", 0.5), ("0.25", 0.25), (1, 1)])
def test_budgets(text: Any, value: float) -> None:
    assert parse_budget(text) == value


def test_docs_describe_every_key_with_its_default() -> None:
    doc = (ROOT / "docs" / "training.md").read_text(encoding="utf-8")
    for section, keys in SCHEMA.items():
        assert f"[{section}]" in doc, section
        for key in keys:
            assert re.search(rf"^\| `{key}` \|", doc, re.M), f"{section}.{key} is not documented"
    assert all(size in doc for size in PRESETS)


def test_examples_are_valid_configs() -> None:
    examples = sorted((ROOT / "examples").glob("*.toml"))
    assert examples
    for path in examples:
        try:
            load_train_config(path)
        except TrainConfigError as e:  # a LoRA example: another example trains its base; it needs kiln-peft
            assert e.key in ("model.checkpoint", "train.mode"), e
    doc = (ROOT / "docs" / "training.md").read_text(encoding="utf-8")
    for block in re.findall(r"```toml\n(.*?)```", doc, re.S):
        if "[data]" in block and "files" in block:  # a complete example: it must load
            import tomllib

            data = tomllib.loads(block)
            data["data"]["files"] = [str(ROOT / "README.md")]
            data["data"].pop("tokenizer", None)
            load_train_config(data, base=ROOT)


def test_a_moe_model_from_scratch_is_accepted(tmp_path: Path) -> None:
    """Its stacked experts export to per-expert HF tensors (test_train checks the round trip)."""
    load_train_config(config(tmp_path, "", base=BASE.replace("Qwen3Model", "Qwen3MoEModel")))


def test_a_model_config_key_the_model_does_not_take_names_it_and_the_closest(tmp_path: Path) -> None:
    message = error(tmp_path, "", "model.config.n_layerz",
                    base=BASE.replace("[model]\n", "[model]\nconfig = {n_layerz = 2}\n"))
    assert "did you mean 'n_layers'" in message and "Qwen3Model takes" in message


def test_a_key_of_the_model_section_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    message = error(tmp_path, "", "model.n_layerz", base=BASE.replace("[model]\n", "[model]\nn_layerz = 2\n"))
    assert "n_layerz" in message


def test_optimizer_parameter_groups_come_from_the_toml(tmp_path: Path) -> None:
    from kiln.core import ParamGroup

    groups = ('[[optimizer.groups]]\nparams = "blocks.*.attn*"\nlr_scale = 0.5\n'
              '[[optimizer.groups]]\nroles = ["bias", "norm"]\nweight_decay = 0.0\n')
    path = config(tmp_path, "[optimizer]\nweight_decay = 0.1\n" + groups)
    c = load_train_config(path)
    assert c["optimizer"]["groups"] == [ParamGroup(params="blocks.*.attn*", lr_scale=0.5),
                                        ParamGroup(roles=("bias", "norm"), weight_decay=0.0)]
    json.dumps(c.fingerprint())  # a resumed run compares them
    message = error(tmp_path, "[optimizer]\n[[optimizer.groups]]\nroles = \"norms\"\n", "optimizer.groups")
    assert "parameter role 'norms' is not one of" in message
    unknown = error(tmp_path, "[optimizer]\n[[optimizer.groups]]\nrate = 1\n", "optimizer.groups")
    assert "params, roles" in unknown
