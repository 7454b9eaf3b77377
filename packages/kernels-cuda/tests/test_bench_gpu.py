"""``nox -s bench-gpu`` (bench/bench_gpu.py): its dry run drives the kiln sides on the CPU emulator and
reports numbers consistent with the steps it timed; ratios are medians of per-round ratios to eager of
the same precision; without a GPU it says why and exits 0. The whole dry run with the torch sides (CPU)
is a ``parity`` test."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from kiln.cuda import _device
from kiln.cuda._emulate import compiler

BENCH = Path(__file__).parents[1] / "bench"
TINY_ARGS = ["--dry-run", "--layers", "1", "--seq", "4", "--batch", "1", "--warmup", "1", "--steps", "2",
             "--rounds", "1"]


def _load(name: str) -> ModuleType:
    path = BENCH / f"{name}.py"
    if not path.exists():
        pytest.skip(f"{path} is not here (an installed-only environment)")
    spec = importlib.util.spec_from_file_location(f"kiln_bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return _load("bench_gpu")


def _fake(seconds: list[float], peak: int) -> dict[str, object]:
    """A side's answer as gpu_sides.py gives it, with chosen step times and peak memory."""
    return {"seconds": seconds, "median_seconds": statistics.median(seconds), "losses": [4.0],
            "peak_bytes": peak, "setup_peak_bytes": peak + 1, "peak_source": "test",
            "driver_used_bytes": None, "info": {"device": "NVIDIA H100 80GB HBM3"}}


def test_ratios_are_medians_of_per_round_ratios_to_eager_of_the_same_precision(bench: ModuleType) -> None:
    shape = {**bench.QWEN3_06B, "batch": 2, "seq": 1024}
    rounds = [  # eager 1.0 s / kiln 0.5 s, then 1.2 / 0.8, then 0.9 / 0.45: per-round speed 2.0, 1.5, 2.0
        {"kiln-bf16": _fake([0.5, 0.5, 0.6], 30 * 2**30), "eager-bf16": _fake([1.0, 0.9, 1.1], 60 * 2**30),
         "kiln-fp32": {"error": "CUDA_ERROR_OUT_OF_MEMORY"}, "eager-fp32": _fake([2.0], 70 * 2**30)},
        {"kiln-bf16": _fake([0.8, 0.8, 0.7], 30 * 2**30), "eager-bf16": _fake([1.2, 1.2, 1.3], 61 * 2**30),
         "kiln-fp32": _fake([3.0], 40 * 2**30), "eager-fp32": _fake([2.0], 70 * 2**30)},
        {"kiln-bf16": _fake([0.45, 0.4, 0.5], 30 * 2**30), "eager-bf16": _fake([0.9, 0.8, 1.0], 60 * 2**30),
         "kiln-fp32": _fake([3.0], 40 * 2**30), "eager-fp32": _fake([2.0], 70 * 2**30)},
    ]
    flops = 3e13
    sides = ["kiln-fp32", "kiln-bf16", "eager-fp32", "eager-bf16"]
    out = bench.summarise(rounds, sides, shape, flops, 989.4e12)
    k = out["kiln-bf16"]
    assert k["speed_vs_eager_rounds"] == pytest.approx([2.0, 1.5, 2.0])
    assert k["speed_vs_eager"] == pytest.approx(2.0)
    pooled = [0.5, 0.5, 0.6, 0.8, 0.8, 0.7, 0.45, 0.4, 0.5]
    assert k["median_seconds"] == pytest.approx(0.5)
    assert k["tokens_per_second"] == pytest.approx(2 * 1024 / 0.5)
    assert k["step_spread"] == pytest.approx((0.8 - 0.4) / 0.5)
    assert k["speed_vs_eager_of_medians"] == pytest.approx(1.0 / statistics.median(pooled))  # eager's: 1.0
    assert k["memory_vs_eager"] == pytest.approx(30 / 61)  # the largest peak of each over the rounds
    assert k["mfu"] == pytest.approx(3e13 / 0.5 / 989.4e12)
    assert out["eager-bf16"]["speed_vs_eager"] == pytest.approx(1.0)
    assert out["eager-bf16"]["memory_vs_eager"] == pytest.approx(1.0)
    assert out["kiln-fp32"] == {"errors": ["CUDA_ERROR_OUT_OF_MEMORY"]}  # failed in one round: no figures

    result = {"date": "today", "dry_run": False, "device": "NVIDIA H100 80GB HBM3", "shape": shape,
              "warmup": 2, "steps": 3, "rounds": 3, "flops": flops, "sides": out, "skipped": {}}
    text = bench.table(result)
    row = next(line for line in text.splitlines() if line.startswith("| kiln `cuda` | bf16 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    mfu = f"{3e13 / 0.5 / 989.4e12:.1%}"
    assert cells[2:] == ["500.0", "4,096", "2.00x", "1.50-2.00", "30.00 GiB", "0.49x", mfu]
    assert all(line.count("|") == row.count("|") for line in text.splitlines() if line.startswith("| "))
    assert "| kiln `cuda` | fp32 | failed: CUDA_ERROR_OUT_OF_MEMORY |" in text
    assert ("kiln-bf16: 2.00x eager's tokens/s, 0.49x its peak memory: the goal (>= 1.3x, <= 0.6x) is met"
            in text)


def test_the_mfu_basis_is_the_models_flops(bench: ModuleType) -> None:
    """The roofline's FLOPs of a Qwen3-0.6B step are the model's: 3x a forward of every matmul (the LM
    head's included) and the causal half of attention's two products, within a few percent (the rest:
    norms, RoPE, softmax)."""
    s = bench.QWEN3_06B
    tokens, q, kv, d = s["batch"] * s["seq"], s["heads"], s["kv_heads"], s["head_dim"]
    per_layer = s["hidden"] * ((q + 2 * kv) * d + q * d + 3 * s["intermediate"])
    dense = 2.0 * tokens * (s["layers"] * per_layer + s["hidden"] * s["vocab"])
    attention = 2.0 * 2.0 * s["batch"] * s["seq"] ** 2 * q * d * s["layers"] * 0.5
    found = bench.model_flops(s)
    assert found["flops"] == pytest.approx(3.0 * (dense + attention), rel=0.05)
    assert found["h100_bf16_seconds"] < found["h100_fp32_seconds"]
    assert bench.peak_flops("NVIDIA H100 80GB HBM3") == ("h100", 989.4e12)
    assert bench.peak_flops("Tesla T4") is None


@pytest.mark.skipif(compiler() is None, reason="the CUDA emulator needs g++")
def test_the_dry_run_times_kiln_on_the_emulator(bench: ModuleType, cache: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_CUDA_CACHE", str(cache))  # the session's emulator builds (conftest)
    out = tmp_path / "r.json"
    assert bench.main([*TINY_ARGS, "--sides", "kiln-fp32", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["dry_run"] and r["shape"]["layers"] == 1 and r["tokens_per_step"] == 4
    d = r["sides"]["kiln-fp32"]
    seconds = [s for rnd in d["seconds"] for s in rnd]
    assert len(seconds) == 2 and d["median_seconds"] == statistics.median(seconds)
    assert d["tokens_per_second"] == pytest.approx(4 / statistics.median(seconds))
    assert d["mfu"] == pytest.approx(r["flops"] / d["median_seconds"] / 989.4e12)
    assert d["torch_imported"] is False  # kiln's process never imports torch
    # the device allocations: the planned arena (weights, gradients and optimizer state at its head) and the
    # Executable's small tables; while building, the first arena (the persistent head alone) too
    assert d["arena_bytes"] == d["planned"]["peak"] <= d["peak_bytes"] < d["arena_bytes"] + 4096
    persistent = sum(d["planned"][k] for k in ("weights", "gradients", "optimizer_state"))
    assert d["setup_peak_bytes"] >= d["arena_bytes"] + persistent
    assert "speed_vs_eager" not in d  # no eager side ran
    assert "| kiln `cuda` | fp32 |" in r["table"]

    # the kiln side trains the model NumPy's backend trains: same weights, batch, clipping and AdamW
    from kiln.core import AdamW, Model
    from kiln.dsl import build_bundle
    from kiln.dsl.stdlib.models import Qwen3Model

    sides = _load("gpu_sides")
    shape = r["shape"]
    bundle = build_bundle(Qwen3Model, {
        "vocab_size": shape["vocab"], "d_model": shape["hidden"], "n_layers": shape["layers"],
        "num_query_heads": shape["heads"], "num_kv_heads": shape["kv_heads"], "head_size": shape["head_dim"],
        "d_ff": shape["intermediate"], "max_seq": shape["seq"], "rope_theta": 1e6,
        "tie_word_embeddings": True})
    model = Model.from_ir(bundle, seed=0, backend="numpy", optimizer=AdamW(lr=1e-3, max_grad_norm=1.0))
    ids = np.random.default_rng(0).integers(0, shape["vocab"], (1, 5)).astype(np.int32)
    assert np.array_equal(ids, sides.batch_ids(shape))
    losses = [model.train_step({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})["loss"] for _ in range(3)]
    assert d["losses"][0] == pytest.approx(losses, abs=1e-5)


@pytest.mark.skipif(_device.device_status()[0], reason="a GPU is present here")
def test_without_a_gpu_it_says_why_and_exits_0(bench: ModuleType, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    assert bench.main(["--json", str(out)]) == 0
    said = capsys.readouterr().out
    assert said.startswith("bench-gpu: skipped, no GPU here: ")
    assert json.loads(out.read_text())["skipped"] in said


def test_an_unknown_side_is_named(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--dry-run", "--sides", "kiln-fp32,eager-fp16"])
    assert "unknown eager-fp16" in capsys.readouterr().err


@pytest.mark.parity
@pytest.mark.skipif(compiler() is None, reason="the CUDA emulator needs g++")
def test_the_whole_dry_run_with_the_torch_sides(bench: ModuleType, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / "r.json"
    assert bench.main([*TINY_ARGS, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert list(r["sides"]) == list(bench.SIDES) and not r["skipped"]
    for side, d in r["sides"].items():
        assert "errors" not in d, (side, d)
        eager = r["sides"][bench.eager_of(side)]
        per_round = [statistics.median(e) / statistics.median(s)
                     for s, e in zip(d["seconds"], eager["seconds"], strict=True)]
        assert d["speed_vs_eager"] == pytest.approx(statistics.median(per_round))
        assert d["memory_vs_eager"] == pytest.approx(d["peak_bytes"] / eager["peak_bytes"])
        # every side trains the same task from random weights of the same shapes: its first loss is near
        # ln(vocabulary), and it learns
        first = d["losses"][0]
        assert abs(first[0] - math.log(r["shape"]["vocab"])) < 0.3, side
        assert first[-1] < first[0], side
    assert r["sides"]["eager-bf16"]["info"]["device"] == "cpu"
    assert r["sides"]["kiln-bf16"]["torch_imported"] is False
