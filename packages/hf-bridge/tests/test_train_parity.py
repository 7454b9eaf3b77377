"""What ``kiln train`` exports loads in the HuggingFace stack: the model and tokenizer in transformers,
with the logits kiln computes; the LoRA adapter in PEFT, with the logits of kiln's PeftModel."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pytest

from kiln.hf import from_pretrained, load_tokenizer, train

sys.path.insert(0, str(Path(__file__).parent))
from test_train import make_corpus, write_config

pytestmark = pytest.mark.parity
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def close(a: np.ndarray, b: np.ndarray) -> None:
    """Within 1e-4 of the largest magnitude (float32 sums in another order)."""
    assert a.shape == b.shape
    assert np.max(np.abs(a - b)) <= 1e-4 * np.max(np.abs(b)), np.max(np.abs(a - b))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> tuple[Path, Path]:
    """A full run, then a LoRA run on its model: (model folder, adapter folder)."""
    pytest.importorskip("kiln.peft")
    folder = tmp_path_factory.mktemp("runs")
    full = train(write_config(folder / "full", corpus, train={"steps": 8}), stream=io.StringIO())
    lora = train(write_config(folder / "lora", corpus, model={"checkpoint": str(full["model"])},
                              train={"steps": 6, "mode": "lora"}, optimizer={"lr": 5e-2},
                              lora={"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}),
                 stream=io.StringIO())
    return full["model"], lora["adapter"]


def test_the_model_loads_in_transformers_with_kiln_logits(runs: tuple[Path, Path]) -> None:
    model_dir, _ = runs
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    text = "The for statement is used to iterate over the elements of a sequence"
    ids = np.array([load_tokenizer(model_dir).encode(text).ids])
    assert tok(text)["input_ids"] == ids[0].tolist()
    with torch.no_grad():
        expected = hf(torch.from_numpy(ids)).logits.numpy()
    close(from_pretrained(model_dir).logits(ids), expected)


def test_the_adapter_loads_in_peft_with_kiln_logits(runs: tuple[Path, Path]) -> None:
    peft = pytest.importorskip("peft")
    from kiln.peft import PeftModel

    model_dir, adapter_dir = runs
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    ids = np.random.default_rng(0).integers(0, 300, (2, 16))
    with torch.no_grad():
        expected = hf(torch.from_numpy(ids)).logits.numpy()
    kiln_model = PeftModel.from_pretrained(from_pretrained(model_dir), adapter_dir)
    got = kiln_model.logits(ids)
    close(got, expected)
    # the adapter was trained: it changes the logits
    assert not np.allclose(got, from_pretrained(model_dir).logits(ids), atol=1e-5)
