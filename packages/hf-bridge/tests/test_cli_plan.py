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
from test_train import TINY, make_corpus, write_config

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


def test_a_bf16_training_config_plans_the_lower_peak(tmp_path: Path, corpus: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    def peak(out: str) -> str:
        return next(" ".join(line.split()[1:3]) for line in out.splitlines()
                    if line.strip().startswith("peak"))

    config = write_config(tmp_path, corpus, train={"recompute": "none", "precision": "bf16"})
    code, bf16, _ = plan(capsys, str(config))
    assert code == 0 and "precision 'bf16'" in bf16 and "stay float32" in bf16
    code, fp32, _ = plan(capsys, str(config), "--precision", "fp32")  # the flag overrides the config
    assert code == 0 and "precision 'bf16'" not in fp32
    assert saved_activations(bf16) != saved_activations(fp32) and peak(bf16) != peak(fp32)


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


def _bytes(cell: str) -> float:
    value, unit = cell.split()
    return float(value) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


def _rank_rows(out: str) -> dict[int, list[float]]:
    """``kiln plan``'s bytes per rank: rank -> parameters, gradients, optimizer, activations, peak."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("bytes per rank"))
    rows = {}
    for line in lines[at + 2:]:
        cells = line.split()
        if not cells or not cells[0].isdigit():
            break
        rows[int(cells[0])] = [_bytes(" ".join(cells[i:i + 2])) for i in range(1, 11, 2)]
    return rows


def test_a_training_configs_parallel_section_plans_its_ranks(tmp_path: Path, corpus: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """[parallel] ranks/zero/tensor plan the ranks without --ranks; the flags take precedence."""
    pytest.importorskip("kiln.dist")
    one = write_config(tmp_path / "one", corpus)
    code, out, err = plan(capsys, str(one))
    assert code == 0, err
    assert "bytes per rank" not in out
    whole = next(line for line in out.splitlines() if line.strip().startswith("optimizer_state"))
    whole_opt = _bytes(" ".join(whole.split()[1:3]))
    zero = write_config(tmp_path / "zero", corpus, parallel={"ranks": 2, "zero": True})
    code, out, err = plan(capsys, str(zero))
    assert code == 0, err
    assert "bytes per rank (2 ranks: 2 data-parallel, ZeRO-1; each rank's)" in out
    rows = _rank_rows(out)
    assert sorted(rows) == [0, 1]  # each rank keeps its share of the optimizer state: together, the whole
    assert abs(rows[0][2] + rows[1][2] - whole_opt) <= 0.02 * whole_opt
    assert all(0 < r[2] < 0.8 * whole_opt for r in rows.values()) and rows[0][0] == rows[1][0]
    two_kv = {"name": "Qwen3Model", "size": "tiny", "config": {**TINY, "num_kv_heads": 2}}
    tensor = write_config(tmp_path / "tensor", corpus, parallel={"tensor": 2}, model=two_kv)  # one group of 2
    code, out, err = plan(capsys, str(tensor))
    assert code == 0, err
    assert "bytes per rank (2 ranks: 1 data-parallel x 2 tensor-parallel; the same on every rank)" in out
    tp = _rank_rows(out)[0]
    code, out, err = plan(capsys, str(tensor), "--ranks", "2", "--tensor", "1")  # the same model, whole
    assert code == 0, err
    assert tp[0] < 0.75 * _rank_rows(out)[0][0]  # the sharded layers and the vocabulary: half on each rank
    code, out, err = plan(capsys, str(zero), "--ranks", "4")  # a flag wins over the config
    assert code == 0, err
    assert "bytes per rank (4 ranks: 4 data-parallel, ZeRO-1" in out
    assert sorted(_rank_rows(out)) == [0, 1, 2, 3]


def test_a_parallel_section_that_cannot_be_planned_exits_2_naming_the_key(
        tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("kiln.dist")
    config = write_config(tmp_path, corpus, parallel={"zero": True})
    code, _, err = plan(capsys, str(config))
    assert code == 2 and "parallel.zero" in err and "parallel.ranks" in err
    config = write_config(tmp_path / "b", corpus, parallel={"ranks": 3})  # batch_size 4
    code, _, err = plan(capsys, str(config))
    assert code == 2 and "train.batch_size" in err and "3 data-parallel ranks" in err


def test_kiln_train_refuses_a_number_of_ranks_other_than_parallel_ranks(
        tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("kiln.dist")
    config = write_config(tmp_path, corpus, parallel={"ranks": 2})
    code = main(["train", str(config)])  # one process
    err = capsys.readouterr().err
    assert code == 2 and "parallel.ranks" in err and "2 ranks, but the run has 1" in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
