"""``kiln train`` end to end on a tiny Qwen3: outputs, resuming bit for bit, Ctrl-C, non-finite losses,
checkpoint files, the progress display and the CLI."""

from __future__ import annotations

import io
import json
import re
import signal
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.core import KilnError, Model
from kiln.hf import (
    DataError,
    TrainConfigError,
    TrainingError,
    _checkpoint,
    from_pretrained,
    load_tokenizer,
    load_train_config,
    save_pretrained,
    save_tokenizer,
    train,
    train_bpe_tokenizer,
)
from kiln.hf._progress import Progress
from kiln.hf._train import _scratch_bundle, replay_step

TINY = {"d_model": 16, "n_layers": 1, "num_query_heads": 2, "num_kv_heads": 1, "head_size": 8, "d_ff": 32}


def make_corpus(folder: Path) -> Path:
    """``folder`` with a text and a 300-token tokenizer trained on it."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))[:60_000]
    (folder / "text.txt").write_text(text, encoding="utf-8")
    save_tokenizer(train_bpe_tokenizer([folder / "text.txt"], 300), folder / "tokenizer")
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def write_config(folder: Path, corpus: Path, **sections: dict[str, Any]) -> Path:
    """A TOML config for a tiny run in ``folder``; ``sections`` override keys (``model`` replaces the
    whole section)."""
    cfg: dict[str, dict[str, Any]] = {
        "model": {"name": "Qwen3Model", "size": "tiny", "config": TINY},
        "data": {"files": [str(corpus / "text.txt")], "tokenizer": str(corpus / "tokenizer")},
        "train": {"output_dir": str(folder / "out"), "steps": 12, "batch_size": 4, "seq_len": 16,
                  "eval_every": 4, "eval_batches": 2, "checkpoint_every": 4, "recompute": "none"},
        "optimizer": {"lr": 1e-2, "warmup_steps": 2},
    }
    for name, keys in sections.items():
        cfg[name] = keys if name == "model" else {**cfg.get(name, {}), **keys}
    lines = []
    for name, keys in cfg.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {_inline(v) if isinstance(v, dict) else json.dumps(v)}" for k, v in keys.items()]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "run.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _inline(table: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in table.items()) + "}"


def metrics(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / "out" / "metrics.jsonl").read_text().splitlines()]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, tag = struct.unpack(">I4s", data[8:16])
    (crc,) = struct.unpack(">I", data[16 + length:20 + length])
    assert tag == b"IHDR" and zlib.crc32(data[12:16 + length]) == crc
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_a_run_writes_every_output(tmp_path: Path, corpus: Path) -> None:
    path = write_config(tmp_path, corpus)
    out = io.StringIO()
    summary = train(path, stream=out)
    text = out.getvalue()
    assert "eval loss before training" in text and "planned memory" in text and "step 12/12" in text
    records = metrics(tmp_path)
    assert records[0].keys() == {"step", "eval_loss"} and records[0]["step"] == 0
    assert [r["step"] for r in records[1:]] == list(range(1, 13))
    assert [r["step"] for r in records if "eval_loss" in r] == [0, 4, 8, 12]
    assert summary["losses"] == [r["loss"] for r in records[1:]]
    assert summary["eval_loss_after"] < summary["eval_loss_before"]
    assert png_size(summary["loss_curve"]) == (720, 420)
    # keep_last = 2: the two newest remain, complete
    assert [p.name for p in _checkpoint.checkpoints(tmp_path / "out" / "checkpoints")] == \
        ["step-00000008", "step-00000012"]
    weights, _, state = _checkpoint.load(summary["checkpoint"])
    assert state["step"] == 12 and state["optimizer_step"] == 12
    # the HF model: the trained weights, the same logits as the model the config describes
    model_dir = summary["model"]
    assert {p.name for p in model_dir.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                                    "tokenizer_config.json", "generation_config.json"}
    eos_id = load_tokenizer(model_dir).token_to_id("<|endoftext|>")
    assert eos_id is not None
    assert json.loads((model_dir / "config.json").read_text())["eos_token_id"] == eos_id
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == eos_id
    # the model's own positions (the documented default), not the training sequence length
    assert json.loads((model_dir / "config.json").read_text())["max_position_embeddings"] == 2048
    loaded = from_pretrained(model_dir)
    assert loaded.architecture == "Qwen3ForCausalLM"
    got = loaded.parameters()
    assert got.keys() == weights.keys() and all(np.array_equal(got[k], weights[k]) for k in weights)
    reference = Model.from_ir(_scratch_bundle(load_train_config(path), 300))
    reference.set_parameters(weights)
    ids = np.random.default_rng(0).integers(0, 300, (2, 16))
    assert np.array_equal(loaded.logits(ids), reference.logits(ids))
    assert load_tokenizer(model_dir).get_vocab_size() == 300


def interrupt_at(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """Press Ctrl-C (a real SIGINT to this process) during optimizer step ``step``."""
    original = Model.train_step

    def train_step(self: Model, batch: Any, **options: Any) -> dict[str, float]:
        stats = original(self, batch, **options)
        if stats["step"] == step:
            signal.raise_signal(signal.SIGINT)
        return stats

    monkeypatch.setattr(Model, "train_step", train_step)


def test_ctrl_c_then_resume_is_bit_identical(tmp_path: Path, corpus: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """20 steps straight vs 10, Ctrl-C, --resume, 10 more: the same losses and weights, bit for bit."""
    keys = {"train": {"steps": 20, "eval_every": 5, "checkpoint_every": 3}}
    straight = train(write_config(tmp_path / "a", corpus, **keys), stream=io.StringIO())
    config = write_config(tmp_path / "b", corpus, **keys)
    interrupt_at(monkeypatch, 10)
    out = io.StringIO()
    first = train(config, stream=out)
    assert first["interrupted"] and "Ctrl-C" in out.getvalue() and "model" not in first
    assert first["checkpoint"].name == "step-00000010"  # saved at the step Ctrl-C came in, off the schedule
    assert [r["step"] for r in metrics(tmp_path / "b")][-1] == 10
    monkeypatch.undo()
    second = train(config, resume=True, stream=io.StringIO())
    assert second["losses"] == straight["losses"] and len(straight["losses"]) == 20
    assert [r.get("eval_loss") for r in metrics(tmp_path / "a")] == \
        [r.get("eval_loss") for r in metrics(tmp_path / "b")]
    wa, oa, sa = _checkpoint.load(straight["checkpoint"])
    wb, ob, sb = _checkpoint.load(second["checkpoint"])
    for a, b in ((wa, wb), (oa, ob)):  # weights and AdamW moments
        assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)
    assert sa["data"] == sb["data"] and sa["optimizer_step"] == sb["optimizer_step"] == 20
    exported = [(run["model"] / "model.safetensors").read_bytes() for run in (straight, second)]
    assert exported[0] == exported[1]


def test_resume_with_no_checkpoint_starts_over_and_a_finished_run_stays_finished(tmp_path: Path,
                                                                                  corpus: Path) -> None:
    config = write_config(tmp_path, corpus, train={"steps": 4})
    out = io.StringIO()
    first = train(config, resume=True, stream=out)
    assert "starting at step 0" in out.getvalue() and len(first["losses"]) == 4
    again = train(config, resume=True, stream=io.StringIO())
    assert again["losses"] == first["losses"] and again["checkpoint"] == first["checkpoint"]


def test_an_earlier_run_needs_resume(tmp_path: Path, corpus: Path) -> None:
    config = write_config(tmp_path, corpus, train={"steps": 4})
    train(config, stream=io.StringIO())
    with pytest.raises(TrainConfigError, match="--resume") as info:
        train(config, stream=io.StringIO())
    assert info.value.key == "train.output_dir" and "step-00000004" in str(info.value)


def test_resume_refuses_a_changed_config(tmp_path: Path, corpus: Path) -> None:
    train(write_config(tmp_path, corpus, train={"steps": 4}), stream=io.StringIO())
    changed = write_config(tmp_path, corpus, train={"steps": 8}, optimizer={"lr": 5e-3})
    with pytest.raises(TrainConfigError) as info:
        train(changed, resume=True, stream=io.StringIO())
    assert info.value.key == "optimizer.lr" and "optimizer.lr" in str(info.value)
    # steps may change: the run goes on to step 8
    longer = train(write_config(tmp_path, corpus, train={"steps": 8}), resume=True, stream=io.StringIO())
    assert len(longer["losses"]) == 8


def test_a_corrupt_checkpoint_is_skipped(tmp_path: Path, corpus: Path) -> None:
    config = write_config(tmp_path, corpus, train={"steps": 8})
    train(config, stream=io.StringIO())
    newest = tmp_path / "out" / "checkpoints" / "step-00000008" / "weights.safetensors"
    newest.write_bytes(newest.read_bytes()[:-10])
    out = io.StringIO()
    summary = train(config, resume=True, stream=out)
    assert "skipping checkpoint step-00000008" in out.getvalue() and "step-00000004" in out.getvalue()
    assert len(summary["losses"]) == 8 and summary["checkpoint"].name == "step-00000008"
    _checkpoint.load(summary["checkpoint"])  # written anew, intact
    assert (tmp_path / "out" / "checkpoints" / "corrupt-step-00000008").is_dir()


def test_non_finite_loss_stops_and_debug_nans_names_the_op(tmp_path: Path, corpus: Path) -> None:
    config = write_config(tmp_path, corpus, train={"checkpoint_every": 1, "steps": 6},
                          optimizer={"lr": 1e30, "max_grad_norm": 0, "warmup_steps": 0})
    with pytest.raises(TrainingError) as info:
        train(config, stream=io.StringIO())
    message = str(info.value)
    step = int(message.split(" at step ")[1].split(";")[0])
    kept = _checkpoint.checkpoints(tmp_path / "out" / "checkpoints")
    assert kept[-1].name == f"step-{step - 1:08d}" and str(kept[-1]) in message
    assert "--debug-nans" in message and not (tmp_path / "out" / "model").exists()
    with pytest.raises(TrainingError) as info:
        train(config, resume=True, debug_nans=True, stream=io.StringIO())
    message = str(info.value)
    assert f"at step {step};" in message
    assert "the first non-finite value comes from op '" in message and "program step" in message, message


def test_a_moe_model_built_from_the_dsl_round_trips_through_a_hf_checkpoint(tmp_path: Path) -> None:
    """kiln train saves a model it trained from scratch as a HF checkpoint: the DSL's weight mappings
    inverted (stacked experts become one tensor per expert, [gate | up] split); from_pretrained,
    which applies them forwards, must read back the same parameters and logits."""
    from kiln.dsl import build_bundle

    bundle = build_bundle("Qwen3MoEModel", {
        "vocab_size": 48, "d_model": 16, "n_layers": 3, "num_query_heads": 2, "num_kv_heads": 1,
        "head_size": 8, "d_ff": 24, "max_seq": 8, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_d_ff": 12, "mlp_only_layers": [0]})
    model = Model.from_ir(bundle, seed=3)
    written = save_pretrained(model, tmp_path / "model")
    assert sorted(p.name for p in written) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_experts"] == 4
    loaded = from_pretrained(tmp_path / "model")
    mine, theirs = model.parameters(), loaded.parameters()
    assert mine.keys() == theirs.keys()
    for name in mine:
        np.testing.assert_array_equal(theirs[name], mine[name], err_msg=name)
    ids = np.random.default_rng(0).integers(0, 48, (2, 8))
    np.testing.assert_array_equal(loaded.logits(ids), model.logits(ids))


def test_save_pretrained_names_a_model_without_a_hf_layout(tmp_path: Path) -> None:
    """A model with no @hf_config (the DSL's Qwen3 with its HF declaration removed) has no layout."""
    from kiln.dsl import build_bundle

    bundle = build_bundle("Qwen3Model", {"vocab_size": 32, "d_model": 16, "n_layers": 1, "num_query_heads": 2,
                                         "num_kv_heads": 1, "head_size": 8, "d_ff": 24, "max_seq": 8})
    entry = bundle.module(bundle.entry).evolve(hf_config=None)
    bundle = bundle.evolve(modules=[entry if m.name == entry.name else m for m in bundle.modules])
    with pytest.raises(KilnError, match="'Qwen3Model' declares no HF architecture"):
        save_pretrained(Model.from_ir(bundle), tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written


def _with_dropout(bundle: Any) -> Any:
    """Dropout (counter-based) on each layer's attention output, before the residual add."""
    from kiln.core.ir import Op

    block = bundle.module("DenseTransformerBlock")
    ops = []
    for op in block.forward.ops:
        if op.type == "fused_residual_rmsnorm" and op.inputs[1] == "att_out":
            ops.append(Op("dropout", ["att_out"], ["att_out_drop"], {"p": 0.4, "seed": 11, "offset": 3}))
            op = op.evolve(inputs=(op.inputs[0], "att_out_drop", op.inputs[2]))
        ops.append(op)
    block = block.evolve(forward=block.forward.evolve(ops=ops))
    return bundle.evolve(modules=[block if m.name == block.name else m for m in bundle.modules])


def test_the_debug_replay_draws_the_dropout_masks_of_its_step() -> None:
    """--debug-nans replays the failing step with reference kernels: its dropout masks must be that
    step's (moved by layer and step), or a NaN that one mask produced would not show up again."""
    from kiln.dsl import build_bundle

    bundle = _with_dropout(build_bundle("Qwen3Model", {
        "vocab_size": 32, "d_model": 16, "n_layers": 2, "num_query_heads": 2, "num_kv_heads": 1,
        "head_size": 8, "d_ff": 24, "max_seq": 8}))
    model = Model.from_ir(bundle, seed=0, dtype="float64")
    rng = np.random.default_rng(0)
    batch = {"input_ids": rng.integers(0, 32, (2, 6)), "labels": rng.integers(0, 32, (2, 6))}
    for _ in range(2):
        model.train_step(batch)
    before = model.parameters()
    third = model.train_step(batch)["loss"]  # training step 3, from `before`

    def replayed(step: int) -> float:
        loss = next(v for _, k, v in replay_step(model, batch, before, step) if k == "loss")
        return float(np.sum(loss)) / batch["labels"].size

    assert replayed(3) == pytest.approx(third, rel=1e-9)
    assert replayed(2) != pytest.approx(third, rel=1e-6)  # another step's masks: another loss


def test_a_data_set_too_small_for_one_batch(tmp_path: Path, corpus: Path) -> None:
    with pytest.raises(DataError, match=r"train\.batch_size"):
        train(write_config(tmp_path, corpus, train={"batch_size": 4096}), stream=io.StringIO())


def test_checkpoints_are_complete_or_absent(tmp_path: Path) -> None:
    w = {"a": np.arange(6, dtype=np.float32).reshape(2, 3)}
    m = {"exp_avg.a": np.ones(3, np.float32)}
    for step in (1, 2, 3):
        _checkpoint.save(tmp_path, step, w, m, {"data": {"epoch": 0}}, keep=2)
    # leftovers of interrupted writes and removals are ignored, then cleaned
    (tmp_path / ".tmp-00000004-1").mkdir()
    (tmp_path / ".old-step-00000001-1").mkdir()
    assert [p.name for p in _checkpoint.checkpoints(tmp_path)] == ["step-00000002", "step-00000003"]
    _checkpoint.clean(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003"]
    weights, _, state = _checkpoint.load(tmp_path / "step-00000003")
    assert np.array_equal(weights["a"], w["a"]) and state["step"] == 3 and state["data"] == {"epoch": 0}
    (tmp_path / "step-00000003" / "state.json").write_text("{")
    with pytest.raises(KilnError, match="step-00000003"):
        _checkpoint.load(tmp_path / "step-00000003")


def test_progress_on_a_terminal_and_in_a_log() -> None:
    tty = io.StringIO()
    bar = Progress(100, stream=tty, tty=True)
    for step in range(1, 4):
        bar.update(step, 2.5, 128, eval_loss=3.0 if step == 2 else None)
    bar.message("a note")
    bar.close()
    shown = tty.getvalue()
    assert shown.count("\r") >= 3 and "eval 3.0000" in shown and "a note\n" in shown
    assert "tok/s" in tty.getvalue() and "ETA" in tty.getvalue()
    log = io.StringIO()
    plain = Progress(30, stream=log, tty=False, every=10)
    for step in range(1, 31):
        plain.update(step, 1.0, 64, eval_loss=0.5 if step == 15 else None)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert [line.split()[1] for line in lines] == ["10/30", "15/30", "20/30", "30/30"]


def test_cli(tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kiln.core.cli._cli import main

    assert main(["--help"]) == 0
    usage = capsys.readouterr().out
    assert "train" in usage and "demo" in usage
    bad = write_config(tmp_path, corpus, train={"steps": 0})
    assert main(["train", str(bad)]) == 2
    assert "train.steps: must be >= 1, found 0" in capsys.readouterr().err
    good = write_config(tmp_path, corpus, train={"steps": 2})
    assert main(["train", str(good)]) == 0
    assert "step 2/2" in capsys.readouterr().out


def test_a_memory_budget_no_plan_meets(tmp_path: Path, corpus: Path) -> None:
    config = write_config(tmp_path, corpus, train={"recompute": "auto", "memory_budget": 0.01})
    with pytest.raises(TrainConfigError, match="budget") as info:
        train(config, stream=io.StringIO())
    assert info.value.key == "train.memory_budget" and "train.memory_budget" in str(info.value)


def test_gradient_accumulation_trains_as_the_whole_batch(tmp_path: Path, corpus: Path) -> None:
    """Two micro-batches of 2 per step give the losses of steps on batches of 4 (the same data)."""
    runs = {}
    for name, train_keys in (("whole", {"batch_size": 4}), ("accumulated", {"batch_size": 2,
                                                                            "grad_accum_steps": 2})):
        path = write_config(tmp_path / name, corpus, train={"steps": 4, "eval_every": 0,
                                                            "checkpoint_every": 0, **train_keys})
        runs[name] = train(path, stream=io.StringIO())["losses"]
    np.testing.assert_allclose(runs["accumulated"], runs["whole"], rtol=1e-5)


@pytest.mark.parity
def test_a_model_trained_from_scratch_generates_in_transformers(tmp_path: Path, corpus: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = write_config(tmp_path, corpus, train={"steps": 2, "eval_every": 0, "checkpoint_every": 0})
    summary = train(config, stream=io.StringIO())
    folder = summary["model"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    ids = tokenizer("def f(x):", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 5 or int(out[0, -1]) == model.generation_config.eos_token_id
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    kiln_logits = from_pretrained(folder).logits(ids.numpy())
    with torch.no_grad():
        np.testing.assert_allclose(kiln_logits, model(ids).logits.numpy(), rtol=1e-4, atol=1e-4)


def _efficiency(text: str) -> float:
    found = re.search(r"(documents packed|one document per sequence): ([0-9.]+)% of the positions hold "
                      r"tokens", text)
    assert found, text
    return float(found[2]) / 100


def test_packing_is_on_by_default_and_reports_its_efficiency(tmp_path: Path, corpus: Path) -> None:
    packed, single = io.StringIO(), io.StringIO()
    data = {"separator": "\n\n"}
    train(write_config(tmp_path / "a", corpus, train={"steps": 2}, data=data), stream=packed)
    train(write_config(tmp_path / "b", corpus, train={"steps": 2}, data={**data, "packing": False}),
          stream=single)
    assert "documents packed" in packed.getvalue() and "one document per sequence" in single.getvalue()
    assert _efficiency(single.getvalue()) < _efficiency(packed.getvalue())
    assert _efficiency(packed.getvalue()) > 0.99


def test_another_ignore_index_trains_the_same(tmp_path: Path, corpus: Path) -> None:
    # the data's padding and document ends carry the label, and the model's losses ignore it
    base = train(write_config(tmp_path / "a", corpus, train={"steps": 3}), stream=io.StringIO())
    moved = train(write_config(tmp_path / "b", corpus, train={"steps": 3}, data={"ignore_index": -1}),
                  stream=io.StringIO())
    assert moved["losses"] == base["losses"] and moved["eval_loss_after"] == base["eval_loss_after"]


def test_a_bf16_run_tracks_the_fp32_run(tmp_path: Path, corpus: Path) -> None:
    """``train.precision = "bf16"``: the model trains under the bf16 recipe (its Programs say so), and its
    losses follow the fp32 run's within bf16's precision."""
    runs = {}
    for recipe in ("fp32", "bf16"):
        keys = {"steps": 6, "eval_every": 0, "checkpoint_every": 0, "precision": recipe}
        path = write_config(tmp_path / recipe, corpus, train=keys)
        out = io.StringIO()
        runs[recipe] = train(path, stream=out)["losses"]
    assert runs["bf16"] != runs["fp32"]
    np.testing.assert_allclose(runs["bf16"], runs["fp32"], rtol=0.02)
    assert runs["bf16"][-1] < runs["bf16"][0]
