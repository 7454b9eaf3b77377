"""The measured recompute cost model (issue 22): calibrated kernel times price the auto planner's replays.

The planner's choices are checked with synthetic calibrations (no timing involved); the fit against a
known cost function; the cache against its keys; and the predicted step time against a measured one
only within a loose factor.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kiln_core_tiny import tiny_qwen3_bundle

from kiln.core import Cost, KilnError, compile, op_registry
from kiln.core.plan import _calibrate
from kiln.core.plan._calibrate import Calibration, Probe, calibration_for, fit, measure_step, predict
from kiln.core.recompute import PlanContext, RecomputePlan, pareto, plan_context, plan_recompute
from kiln.core.runtime._kernels import KernelTable

BINDS = {"B": 2, "T": 8}


@pytest.fixture(scope="module")
def ctx() -> PlanContext:
    return plan_context(tiny_qwen3_bundle(num_layers=2), bindings=BINDS)


def synthetic(ctx: PlanContext, heavy: float, light: float) -> Calibration:
    """A calibration in which every matmul-class op takes ``heavy`` seconds and every other ``light``
    (growing a little with FLOPs), with no kernel run."""
    reg = op_registry()
    cal = Calibration("synthetic")
    for c in ctx.blocks:
        for p in c.probes:
            if p.how != "alias":
                cal.record(p, (heavy if reg.get_op(p.op).flop_heavy else light) * (1 + p.cost.flops * 1e-6))
    return cal


def replayed(plan: RecomputePlan) -> set[str]:
    return {op.type for b in plan.blocks for r in b.ops for op in r.replay if op.type != "view"}


def flop_heavy(types: set[str]) -> set[str]:
    reg = op_registry()
    return {t for t in types if reg.get_op(t).flop_heavy}


def test_cheap_norms_are_recomputed_and_matmul_outputs_kept(ctx: PlanContext) -> None:
    # the least saved activations any plan reaches without replaying a matmul: a tight budget
    budget = min(p.bytes for p in pareto(ctx, allow_matmul=False))
    plan = plan_recompute(ctx, "auto", budget=budget,
                          options={"cost": synthetic(ctx, heavy=1.0, light=1e-3), "allow_matmul": True})
    ops = replayed(plan)
    assert plan.cost == "measured" and plan.planned_bytes is not None and plan.planned_bytes <= budget
    assert not flop_heavy(ops), f"matmul-class ops replayed although they are dear: {ops}"
    assert {"swiglu", "qkv_qk_norm_rope"} <= ops and ops & {"rmsnorm", "rmsnorm_apply_saved",
                                                            "fused_residual_rmsnorm"}


def test_the_reverse_calibration_replays_matmuls_and_keeps_norms(ctx: PlanContext) -> None:
    budget = min(p.bytes for p in pareto(ctx, allow_matmul=False))
    plan = plan_recompute(ctx, "auto", budget=budget,
                          options={"cost": synthetic(ctx, heavy=1e-3, light=1.0), "allow_matmul": True})
    ops = replayed(plan)
    assert "matmul" in ops
    assert not ops & {"swiglu", "rmsnorm", "rmsnorm_apply_saved", "fused_residual_rmsnorm"}
    # the plan's predicted overhead is what the calibration says its replays take
    assert plan.predicted_seconds is not None and 0 < plan.predicted_seconds < 1.0


def test_flops_pricing_stays_the_default_in_tests_and_an_option(ctx: PlanContext) -> None:
    plan = plan_recompute(ctx, "auto", budget=0.5)  # the root conftest pins KILN_RECOMPUTE_COST=flops
    assert plan.cost == "flops" and plan.predicted_seconds is None
    cal = synthetic(ctx, heavy=1.0, light=1e-3)
    forced = plan_recompute(ctx, "auto", budget=0.5, options={"cost": "flops"})
    assert forced.cost == "flops" and replayed(forced) == replayed(plan)
    assert plan_recompute(ctx, "auto", budget=0.5, options={"cost": cal}).cost == "measured"
    with pytest.raises(KilnError, match=r"recompute option cost='time'.*'measured', 'flops'"):
        plan_recompute(ctx, "auto", budget=0.5, options={"cost": "time"})


def test_an_unknown_cost_setting_in_the_environment_is_named(ctx: PlanContext,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_RECOMPUTE_COST", "fast")
    with pytest.raises(KilnError, match=r"\$KILN_RECOMPUTE_COST='fast'"):
        plan_recompute(ctx, "auto", budget=0.5)


def test_the_fit_recovers_a_known_cost_function() -> None:
    a, b, c = 2e-5, 1e-11, 5e-10  # launch, seconds per FLOP, seconds per byte
    rows = [(f, n, a + b * f + c * n) for f, n in itertools.product((1e6, 3e7, 2e8), (1e4, 5e5, 4e6))]
    got = fit(rows)
    assert got.a == pytest.approx(a, rel=1e-6) and got.b == pytest.approx(b, rel=1e-6)
    assert got.c == pytest.approx(c, rel=1e-6)
    assert got.seconds(Cost(1e9, 1e7)) == pytest.approx(a + b * 1e9 + c * 1e7, rel=1e-6)


def test_the_fit_keeps_every_coefficient_non_negative() -> None:
    # times falling with bytes: unconstrained least squares would give a negative per-byte cost
    rows = [(1e6, 1e3, 3e-3), (2e6, 5e5, 4e-3), (4e6, 9e5, 7e-3), (8e6, 2e6, 1.2e-2)]
    free = np.linalg.lstsq(np.array([[1, f, n] for f, n, _ in rows]), np.array([s for *_, s in rows]),
                           rcond=None)[0]
    assert free.min() < 0
    got = fit(rows)
    assert min(got.a, got.b, got.c) >= 0
    with pytest.raises(KilnError, match="at least one timed"):
        fit([])


def _kernel_module(folder: Path, body: str) -> Any:
    pkg = folder / "kiln_calib_kernels"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("import numpy as np\n\n\ndef relu(x):\n    " + body + "\n")
    sys.modules.pop("kiln_calib_kernels", None)
    import kiln_calib_kernels  # written just above

    return kiln_calib_kernels


def test_the_cache_is_keyed_by_machine_backend_and_kernel_source(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    module = _kernel_module(tmp_path, "return np.maximum(x, 0)")
    table = KernelTable()
    table.register_kernel("relu", "numpy", "float32", module.relu)
    probe = Probe("relu", "relu@numpy:float32", "kernel", [((32, 32), "float32")], [((32, 32), "float32")],
                  cost=Cost(1024.0, 8192.0))
    cache = tmp_path / "cache"

    def calibrate(backend: str = "numpy") -> Calibration:
        return calibration_for([probe], backend=backend, dtype="float32", kernels=table,
                               registry=op_registry(), folder=cache)

    first = calibrate()
    assert first.timed == 1 and first.seconds(probe) > 0
    saved = json.loads(next(cache.glob("*.json")).read_text())
    assert saved["key"] == first.key and len(saved["table"]) == 1
    again = calibrate()  # read from the file: nothing timed
    assert again.timed == 0 and again.seconds(probe) == first.seconds(probe)
    assert calibrate("another-backend").timed == 1  # another key, another file
    assert len(list(cache.glob("*.json"))) == 2
    # a changed kernel source: its times are stale, so it is timed anew
    module = _kernel_module(tmp_path, "return np.where(x > 0, x, 0)")
    table = KernelTable()
    table.register_kernel("relu", "numpy", "float32", module.relu)
    monkeypatch.setattr(_calibrate, "_DIR_HASHES", {})
    assert calibrate().timed == 1


def test_a_probe_the_times_so_far_call_long_is_priced_and_not_run(tmp_path: Path) -> None:
    """Probes are timed cheapest first; one the fit of those predicts to take over LONG_SECONDS is priced
    by that fit, never run (a large model's LM head took minutes); one whose warm-up alone takes that
    long is timed by it, without repeats."""
    import time

    runs: list[int] = []

    def slow(x: np.ndarray) -> np.ndarray:  # 1 microsecond per element
        runs.append(x.size)
        time.sleep(x.size * 1e-6)
        return x

    table = KernelTable()
    table.register_kernel("relu", "numpy", "float32", slow)

    def probe(n: int) -> Probe:
        shape = [((n, 1000), "float32")]
        return Probe("relu", "relu@numpy:float32", "kernel", shape, shape, cost=Cost(1000.0 * n, 8000.0 * n))

    big, small = probe(3000), [probe(2), probe(4)]
    cal = calibration_for([big, *small], backend="numpy", dtype="float32", kernels=table,
                          registry=op_registry(), folder=tmp_path)
    assert cal.timed == 2 and 3_000_000 not in runs
    assert cal.entry(big) not in cal.table
    assert 3.0 * 0.5 < cal.seconds(big) < 3.0 * 2  # the fit's 1 us per element, give or take overheads
    runs.clear()
    long = probe(1100)
    cal = calibration_for([long], backend="numpy", dtype="float32", kernels=table, registry=op_registry(),
                          folder=tmp_path / "fresh")
    assert runs == [1_100_000] and cal.seconds(long) >= 1.1
    # an op never timed is priced by the rates, once a compute-bound probe has set the FLOP rate: an
    # elementwise op's (a FLOP per byte) would make a large matmul look a hundred times dearer
    head = Probe("fused_lm_head_loss", "", "out", [((8192, 1024), "float32")], [((8192,), "float32")],
                 cost=Cost(2.5e12, 6e8))
    def run(p: Probe) -> Any:
        raise RuntimeError(f"{p.op} ran")

    cal = Calibration("rates")
    cal.record(probe(64), 0.064)  # 1 GFLOP/s, memory-bound: not a rate to price a matmul by
    with pytest.raises(RuntimeError, match="fused_lm_head_loss ran"):
        cal.measure([head], run)
    cal.record(attrs_evolve(probe(64), op="matmul", cost=Cost(1e10, 1e7)), 0.05)  # 200 GFLOP/s
    cal.measure([head], run)
    assert cal.seconds(head) == pytest.approx(2.5e12 / 2e11 + 6e8 / cal.bandwidth)


def test_a_corrupt_cache_file_is_ignored(tmp_path: Path) -> None:
    cal = Calibration.load("k", tmp_path)
    assert cal.path is not None
    cal.path.write_text("{not json")
    assert Calibration.load("k", tmp_path).table == {}


def test_untimed_shapes_are_priced_by_the_ops_fit() -> None:
    cal = Calibration("synthetic")
    small = Probe("silu", "", "out", [((8, 8), "float32")], [((8, 8), "float32")], cost=Cost(320.0, 512.0))
    big = attrs_evolve(small, inputs=[((64, 64), "float32")], cost=Cost(20480.0, 32768.0))
    cal.record(small, 1e-6 + 1e-9 * 512)
    cal.record(big, 1e-6 + 1e-9 * 32768)
    mid = attrs_evolve(small, inputs=[((32, 32), "float32")], cost=Cost(5120.0, 8192.0))
    assert cal.seconds(mid) == pytest.approx(1e-6 + 1e-9 * 8192, rel=1e-3)
    assert cal.seconds(attrs_evolve(small, how="alias")) == 0.0


def attrs_evolve(p: Probe, **changes: Any) -> Probe:
    import attrs

    return attrs.evolve(p, **changes)


def test_measured_pricing_in_compile_calibrates_once_and_predicts_the_overhead(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_CALIBRATION_CACHE", str(tmp_path))
    bundle = tiny_qwen3_bundle(num_layers=2)
    prog = compile(bundle, bindings=BINDS, recompute="auto", recompute_options={"cost": "measured"})
    plan = prog.recompute
    assert plan.cost == "measured" and plan.predicted_seconds is not None and plan.predicted_seconds > 0
    assert "recompute adds" in plan.pretty()
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1
    stamp = files[0].stat().st_mtime_ns
    again = compile(bundle, bindings=BINDS, recompute="auto", recompute_options={"cost": "measured"})
    assert files[0].stat().st_mtime_ns == stamp  # every time came from the cache
    assert again.recompute.predicted_seconds == plan.predicted_seconds
    # the planner's prediction and the Program's replayed steps, priced by the same calibration
    replays = predict(prog)["recompute"]
    assert replays > 0 and 0.1 < plan.predicted_seconds / replays < 10


def test_the_predicted_step_is_the_measured_one_within_a_loose_factor(tmp_path: Path) -> None:
    bundle = tiny_qwen3_bundle(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                               intermediate_size=384, vocab_size=512)
    prog = compile(bundle, bindings={"B": 4, "T": 128})
    predicted = predict(prog, folder=tmp_path)
    ours = predicted["forward"] + predicted["backward"]
    assert predicted["step"] == pytest.approx(ours + predicted["optimizer"])
    # per-step dispatch is not predicted and other work on the machine skews both: a loose factor (a
    # wrong unit or a missing phase is far outside it), and a few tries, each measuring anew
    ratios = []
    for _ in range(3):
        (measured,) = measure_step([prog])
        ratios.append(ours / measured)
        if 1 / 8 < ratios[-1] < 8:
            break
    else:
        raise AssertionError(f"predicted {ours:.4f} s; predicted / measured: {ratios}")


def test_kiln_plan_shows_the_predicted_and_measured_overhead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from kiln.core.cli._cli import main

    monkeypatch.setenv("KILN_CALIBRATION_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.json"
    path.write_text(tiny_qwen3_bundle(num_layers=2).to_json())
    args = ["plan", str(path), "--recompute", "auto", "--batch", "2", "--seq", "8",
            "--recompute-option", "cost=measured"]
    assert main(args) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("recompute overhead: predicted"))
    assert "ms per step" in line and "% of" in line and "priced recompute by measured" in line
    assert "measured  " not in out
    assert main([*args, "--measure"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"measured +[+-]\d+\.\d ms per step \([+-]\d+\.\d%", out), out
    assert main(["plan", str(path), "--recompute", "none", "--batch", "2", "--seq", "8"]) == 0
    assert "recompute overhead" not in capsys.readouterr().out  # nothing recomputed, nothing to show
