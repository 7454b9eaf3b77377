"""Where one training step's time goes: kiln's steps timed one by one, summed per op.

    python benchmarks/profile_step.py [--config tiny] [--steps 5] [--markdown]

One process, one Model (recompute none, the native kernels when kiln-kernels-cpu is installed and
builds; ``KILN_CPU_KERNELS=0`` for kiln-core's NumPy kernels). Every closure the Program runs in a
training step (the fused LM-head pass as one) is wrapped in two clocks, wall time and the CPU time of
all the process's threads; after a warm-up step, ``--steps`` steps are timed and each closure's
medians taken. Per op (matmuls per shape) it prints the wall and CPU time per step, the share of the
step's CPU time, its FLOPs where it has products (matmul, the LM head's three, attention's causal
half) and its GFLOP per CPU-second; and a 2048^3 NumPy matmul's rate per wall- and per CPU-second,
measured in the same process before and after, with the products' time at that rate (the floor).
Other work on the machine inflates wall times, much less CPU times: on a shared machine read the
CPU times, shares and rates. It needs kiln
only (no torch): the dev venv runs it.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from sides import CONFIGS, LR, MAX_GRAD_NORM, _batch, kiln_bundle


def _sgemm_rate() -> tuple[float, float]:
    """A 2048^3 NumPy matmul's GFLOP per second of wall time and per second of CPU time (every thread's
    CPU time summed: what one core does when it runs, however busy the machine)."""
    import numpy as np

    a = np.random.default_rng(0).standard_normal((2048, 2048), dtype=np.float32)
    a @ a
    wall = min(_timed(lambda: a @ a) for _ in range(3))
    cpu = min(_timed(lambda: a @ a, time.process_time) for _ in range(3))
    return 2 * 2048**3 / wall / 1e9, 2 * 2048**3 / cpu / 1e9


def _timed(fn: Callable[[], object], clock: Callable[[], float] = time.perf_counter) -> float:
    t = clock()
    fn()
    return clock() - t


def _flops(program: Any, step: Any) -> float:
    """The products of one step: 2 M N K for a matmul, the causal half of attention's."""
    t = program.tensors
    if step.op.type == "matmul":
        a, b = (t[k] for k in step.inputs[:2])
        out = t[step.outputs[0]]
        size = math.prod(out.shape)
        k = math.sqrt(math.prod(a.shape) * math.prod(b.shape) / size)
        return 2.0 * size * k
    if step.op.type in ("flash_attention", "flash_attention_backward"):
        qkv = t[step.inputs[0] if step.op.type == "flash_attention" else step.inputs[1]]
        hq, d = int(step.attrs["Hq"]), int(step.attrs["D"])
        b, s = qkv.shape[0], qkv.shape[1]
        causal = 0.5 if step.attrs.get("causal", True) else 1.0
        products = 2 if step.op.type == "flash_attention" else 5  # QK^T, PV / the backward's five
        return 2.0 * products * b * hq * s * s * d * causal
    return 0.0


def profile(config: str, steps: int) -> dict[str, Any]:
    from kiln.core import AdamW, Model

    c = CONFIGS[config]
    ids = _batch(c)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    model = Model.from_ir(kiln_bundle(c), seed=0, optimizer=AdamW(lr=LR, max_grad_norm=MAX_GRAD_NORM))
    model.train_step(batch)  # compiles, warms up
    # kiln-core's NumPy Executable, from the inside: its step closures in order, and the run lists
    # built from them (the fused LM-head pass in place of its two steps)
    program, ex = model._bind("train", ids.shape[0], ids.shape[1] - 1)
    if not all(hasattr(ex, a) for a in ("_closures", "train_runs", "runs")):
        raise SystemExit(f"profile_step.py reads the NumPy backend's Executable (its _closures, train_runs "
                         f"and runs); {type(ex).__name__} has changed: update the script")

    times: dict[int, list[float]] = defaultdict(list)
    cpu: dict[int, list[float]] = defaultdict(list)  # CPU time of all the process's threads
    labels: list[tuple[str, str, str, float]] = []  # (phase, op, kernel, flops) per closure

    def wrap(fn: Callable[[], None], label: tuple[str, str, str, float]) -> Callable[[], None]:
        i = len(labels)
        labels.append(label)

        def run() -> None:
            t, c = time.perf_counter(), time.process_time()
            fn()
            times[i].append(time.perf_counter() - t)
            cpu[i].append(time.process_time() - c)
        return run

    def label(step: Any) -> tuple[str, str, str, float]:
        native = step.kernel.endswith(":float32")
        op = step.op.type
        if op == "matmul":  # by shape: (M, K) x (K, N), the transposes and whether it accumulates
            a = program.tensors[step.inputs[0]].shape
            m, n = program.tensors[step.outputs[0]].shape
            k = a[0] if step.attrs["transpose"][0] == "T" else a[1]
            acc = " + c" if step.inputs[2:] and step.inputs[2] else ""
            op = f"matmul {m}x{k} @ {k}x{n} {step.attrs['transpose']}{acc}"
        return (step.phase, op, "native" if native else "numpy", _flops(program, step))

    fused = {i: f for f in program.fusions for i in f.steps}
    closures = ex._closures
    if ex.train_runs is not None:
        runs: list[Callable[[], None]] = []
        it = iter(ex.train_runs)
        for step, fn in closures:
            if step.phase not in ("forward", "backward"):
                continue
            f = fused.get(step.index)
            if f is None and fn is not None:
                runs.append(wrap(next(it), label(step)))
            elif f is not None and step.index == f.steps[0]:
                n, v, cdim = (*program.tensors[f.inputs[1]].shape, program.tensors[f.inputs[2]].shape[0])
                runs.append(wrap(next(it), ("forward+backward", f.kind, "native"
                                            if f.kernel.endswith(":float32") else "numpy",
                                            3 * 2.0 * n * v * cdim)))
        ex.train_runs = runs
    for phase, fns in ex.runs.items():
        if ex.train_runs is not None and phase in ("forward", "backward"):
            continue
        steps_of = [s for s, fn in closures if s.phase == phase and fn is not None]
        ex.runs[phase] = [wrap(fn, label(s)) for s, fn in zip(steps_of, fns, strict=True)]

    rate0 = _sgemm_rate()
    totals = []
    for _ in range(steps):
        totals.append(_timed(lambda: model.train_step(batch)))
    rate1 = _sgemm_rate()
    rows: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0, 0.0])
    for i, (phase, op, kernel, flops) in enumerate(labels):
        row = rows[(phase, op, kernel)]
        row[0] += statistics.median(times[i])
        row[1] += flops
        row[2] += 1
        row[3] += statistics.median(cpu[i])
    step = statistics.median(totals)
    flops = sum(r[1] for r in rows.values())
    rate = max(rate0[0], rate1[0])
    core = max(rate0[1], rate1[1])
    from kiln.core.backends.numpy import threads

    return {"config": config, "step": step, "rows": dict(rows), "flops": flops, "rate": rate,
            "rates": (rate0, rate1), "threads": threads(),
            "core": core}


def report(r: dict[str, Any], markdown: bool) -> None:
    step, rate, core = r["step"], r["rate"], r["core"]
    timed = sum(v[0] for v in r["rows"].values())
    cpu = sum(v[3] for v in r["rows"].values())
    floor, cpu_floor = r["flops"] / rate / 1e9, r["flops"] / core / 1e9
    (w0, c0), (w1, c1) = r["rates"]
    print(f"\n{r['config']}: median step {step * 1e3:.1f} ms, the timed ops {timed * 1e3:.1f} ms "
          f"({cpu * 1e3:.0f} ms of CPU time, {r['threads']} threads); "
          f"{r['flops'] / 1e9:.1f} GFLOP of products")
    print(f"sgemm 2048^3: {w0:.0f} / {w1:.0f} GFLOP/s before / after, {c0:.0f} / {c1:.0f} per CPU-second; "
          f"the products at the best: {floor * 1e3:.0f} ms ({floor / step:.0%} of the step), "
          f"{cpu_floor * 1e3:.0f} ms of CPU time ({cpu_floor / cpu:.0%} of the step's)")
    rows = sorted(r["rows"].items(), key=lambda kv: -kv[1][3])
    if markdown:
        print("| op | phase | kernel | calls | ms per step | CPU ms | share of CPU | GFLOP "
              "| GFLOP per CPU-s |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (phase, op, kernel), (t, flops, n, c) in rows:
        gf = f"{flops / 1e9:.1f}" if flops else "-"
        gfs = f"{flops / c / 1e9:.0f}" if flops and c else "-"  # what one core does while it runs the op
        if markdown:
            print(f"| `{op}` | {phase} | {kernel} | {n} | {t * 1e3:.1f} | {c * 1e3:.1f} | {c / cpu:.1%} "
                  f"| {gf} | {gfs} |")
        else:
            print(f"{op:<44} {phase:<16} {kernel:<6} {n:>3} {t * 1e3:8.1f} ms {c * 1e3:8.1f} CPU ms "
                  f"{c / cpu:6.1%} {gf:>6} GFLOP {gfs:>5} GFLOP per CPU-s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="tiny", choices=sorted(CONFIGS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    report(profile(args.config, args.steps), args.markdown)


if __name__ == "__main__":
    main()
