"""``kiln demo``, shortened: both phases run to the end, the eval loss drops by at least 30%, and
everything lands where the demo says. (The full demo is what ``nox -s demo`` runs.)"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from kiln.hf import from_pretrained, load_train_config
from kiln.hf._demo import builtins_docstrings, demo, greedy, pydoc_topics

pytestmark = pytest.mark.slow


def test_a_shortened_demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    result = demo(steps=300, lora_steps=8, stream=out)
    text = out.getvalue()
    root = tmp_path / "kiln-demo"
    first = result["pretrain"]
    assert first["eval_loss_after"] <= 0.7 * first["eval_loss_before"], text
    assert "recompute 'auto' (full training)" in text and "planned memory" in text
    assert "eval loss before training" in text and "greedy continuation" in text
    assert first["model"] == root / "pretrain" / "model" and (first["model"] / "model.safetensors").is_file()
    assert result["continuation"] and result["continuation"].replace("\n", "\n  ") in text
    load_train_config(root / "pretrain.toml")  # the configs left behind are valid
    lora = result["lora"]
    if lora is None:
        assert "skipped: LoRA needs kiln-peft" in text
    else:  # kiln-peft is installed
        load_train_config(root / "lora.toml")
        from kiln.peft import PeftModel

        assert lora["adapter"] == root / "lora" / "adapter"
        adapted = PeftModel.from_pretrained(from_pretrained(first["model"]), lora["adapter"])
        assert adapted.logits(np.zeros((1, 8), np.int64)).shape == (1, 8, 1024)
        assert lora["eval_loss_after"] < lora["eval_loss_before"]
    assert f"everything is in {Path('kiln-demo')}/" in text


def test_the_texts_ship_with_python() -> None:
    topics, docs = pydoc_topics(), builtins_docstrings()
    assert len(topics) > 300_000 and "The \"for\" statement" in topics
    assert len(docs) > 20_000 and "str.join" in docs


def test_greedy_decoding_uses_one_program(tmp_path: Path) -> None:
    class Tok:
        def encode(self, text: str) -> object:
            return type("E", (), {"ids": [1, 2, 3]})()

        def decode(self, ids: list[int]) -> str:
            return " ".join(map(str, ids))

    class Stub:
        def __init__(self) -> None:
            self.shapes: list[tuple[int, ...]] = []

        def logits(self, x: np.ndarray) -> np.ndarray:
            self.shapes.append(x.shape)
            out = np.zeros((*x.shape, 10))
            last = int(np.count_nonzero(x[0]))  # the context is left-aligned, padded with zeros
            out[0, last - 1, (x[0, last - 1] + 1) % 10] = 1.0  # predicts the next integer
            return out

    stub = Stub()
    assert greedy(stub, Tok(), "x", tokens=5, window=6) == "4 5 6 7 8"
    assert set(stub.shapes) == {(1, 6)}
