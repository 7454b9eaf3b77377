"""``kiln train`` reads a text-DSL model file in ``[model] name``: the text Qwen3 trains to the Python
Qwen3Model's losses bit for bit (needs kiln-hf)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from kiln.dsl_text import model_path

hf = pytest.importorskip("kiln.hf", reason="kiln train comes with kiln-hf")

TINY = {"d_model": 16, "n_layers": 1, "num_query_heads": 2, "num_kv_heads": 1, "head_size": 8, "d_ff": 32}


def _config(folder: Path, corpus: Path, name: str) -> Path:
    model = "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in TINY.items()) + "}"
    text = f"""[model]
name = {json.dumps(name)}
size = "tiny"
config = {model}
[data]
files = [{json.dumps(str(corpus / "text.txt"))}]
tokenizer = {json.dumps(str(corpus / "tokenizer"))}
[train]
output_dir = {json.dumps(str(folder / "out"))}
steps = 3
batch_size = 2
seq_len = 16
eval_every = 0
checkpoint_every = 0
recompute = "none"
"""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run.toml").write_text(text, encoding="utf-8")
    return folder / "run.toml"


def _corpus(folder: Path, text: str, vocab: int) -> Path:
    """``folder`` with ``text.txt`` and a BPE tokenizer of ``vocab`` tokens trained on it."""
    folder.mkdir()
    (folder / "text.txt").write_text(text, encoding="utf-8")
    hf.save_tokenizer(hf.train_bpe_tokenizer([folder / "text.txt"], vocab), folder / "tokenizer")
    return folder


def test_kiln_train_trains_a_text_model_file_like_the_python_model(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "corpus", "the quick brown fox jumps over the lazy dog. " * 400, 300)
    text_run = tmp_path / "text"
    text_run.mkdir()
    (text_run / "qwen3.kiln").write_text(model_path("qwen3").read_text(), encoding="utf-8")
    text = hf.train(_config(text_run, corpus, "qwen3.kiln"), stream=io.StringIO())  # relative to the config
    python = hf.train(_config(tmp_path / "python", corpus, "Qwen3Model"), stream=io.StringIO())
    assert len(text["losses"]) == 3 and text["losses"] == python["losses"]


def test_a_broken_model_file_is_a_config_error_with_its_line(tmp_path: Path) -> None:
    (tmp_path / "bad.kiln").write_text("model M(d: int):\n  params:\n    w: [d d]\n", encoding="utf-8")
    corpus = _corpus(tmp_path / "c", "hello world " * 50, 260)
    with pytest.raises(hf.TrainConfigError) as info:
        hf.train(_config(tmp_path, corpus, "bad.kiln"), stream=io.StringIO())
    assert info.value.key == "model.name" and "bad.kiln:3:11" in str(info.value)


def test_a_missing_model_file_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "c", "hello world " * 50, 260)
    with pytest.raises(hf.TrainConfigError) as info:
        hf.train(_config(tmp_path, corpus, "nowhere.kiln"), stream=io.StringIO())
    assert info.value.key == "model.name" and "nowhere.kiln" in str(info.value)
