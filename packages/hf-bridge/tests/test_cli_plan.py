"""``kiln plan`` on what kiln-hf reads: a saved HF checkpoint folder and ``kiln train`` configs (the
LoRA example included) give real plans in human units; bad flags and inputs exit 2 naming them."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

import kiln
from kiln.core.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from test_cli_train import checkpoint_folder
from test_train import make_corpus, write_config

ROOT = Path(__file__).parents[3]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, err
    return code, out, err


def saved_activations(out: str) -> str:
    """The planned saved activations, as printed (a size with its unit)."""
    line = next(line for line in out.splitlines() if line.strip().startswith("saved_activations"))
    return " ".join(line.split()[1:3])


def test_a_saved_hf_checkpoint(tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = checkpoint_folder(tmp_path / "ckpt", corpus)
    code, out, _ = plan(capsys, str(ckpt), "--batch", "2", "--seq", "16", "--recompute", "none")
    assert code == 0 and "B=2 T=16" in out
    size = saved_activations(out)
    assert size.split()[1] in ("KiB", "MiB", "GiB") and float(size.split()[0]) > 0, size


def test_the_lora_example(tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """examples/lora.toml in a copy of the repository's layout, its base model in place."""
    pytest.importorskip("kiln.peft")
    config = tmp_path / "examples" / "lora.toml"
    config.parent.mkdir()
    shutil.copy(ROOT / "examples" / "lora.toml", config)
    for doc in ("README.md", "docs/plugins.md", "docs/peft.md"):
        (tmp_path / doc).parent.mkdir(exist_ok=True)
        (tmp_path / doc).write_text("some text\n")
    checkpoint_folder(tmp_path / "examples" / "runs" / "tiny-qwen3" / "model", corpus)
    code, out, err = plan(capsys, str(config))
    assert code == 0, err
    assert "lora training" in out and "recompute='auto'" in out and "no parameter trains" not in out
    assert "adapt" in out and "lora" in out.split("passes:")[1].split("\n\n")[0]  # the lora pass ran
    assert "B=8 T=64" in out  # the config's shape (its defaults)
    size = saved_activations(out)
    assert float(size.split()[0]) > 0 and size.split()[1] in ("KiB", "MiB", "GiB"), size
    # the flags override the config's settings
    code, out, _ = plan(capsys, str(config), "--batch", "2", "--recompute", "none")
    assert code == 0 and "B=2 T=64" in out and "recompute='none'" in out


def test_a_training_config_from_scratch(tmp_path: Path, corpus: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, corpus, train={"recompute": "auto", "memory_budget": "50%"})
    code, out, _ = plan(capsys, str(config))
    assert code == 0 and "Qwen3Model" in out and "B=4 T=16" in out and "recompute='auto'" in out
    assert not (tmp_path / "out").exists()  # planning writes nothing
    bad = write_config(tmp_path, corpus, train={"seq_len": 0})
    code, _, err = plan(capsys, str(bad))
    assert code == 2 and "train.seq_len: must be >= 1, found 0" in err


@pytest.mark.parametrize(("argv", "words"), [
    (["Qwen3Model", "--batch", "0"], ["--batch", "must be >= 1, found 0"]),
    (["Qwen3Model", "--seq", "-5"], ["--seq", "must be >= 1, found -5"]),
    (["Qwen3Model", "--seq", "many"], ["--seq", "expected a whole number >= 1, found 'many'"]),
    (["Qwen3Model", "--budget", "50%"], ["--budget '50%' applies only with --recompute auto"]),
], ids=["batch", "seq", "seq-text", "budget-without-auto"])
def test_bad_flags_exit_2_naming_them(capsys: pytest.CaptureFixture[str], argv: list[str],
                                      words: list[str]) -> None:
    code, _, err = plan(capsys, *argv)
    assert code == 2 and all(w in err for w in words), err


def test_errors_do_not_point_at_kilns_source(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = plan(capsys, "Qwen3Model", "--config", '{"d_model": "wide"}')
    assert code == 2 and "config value d_model of Qwen3Model: expected int, found str 'wide'" in err, err
    assert "undefined dimension" not in err
    assert not any(root in err for root in kiln.__path__), err


def test_what_no_model_source_reads_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = plan(capsys, "Qwen3Modle")
    assert code == 2 and "no kiln-dsl model is named 'Qwen3Modle' (did you mean 'Qwen3Model'?)" in err, err
    code, _, err = plan(capsys, str(tmp_path / "weights.bin"))
    assert code == 2 and "no installed model source reads" in err, err
    sources = ("IR Bundle .json files", "kiln-dsl model names", "HF checkpoint folders", "kiln train configs")
    assert all(what in err for what in sources), err
