"""The recompute cost model, measured: kiln's step time with ``recompute="auto"`` at half the saved
activations, priced by FLOPs and by calibrated kernel times, against no recompute.

    python benchmarks/recompute_cost.py [--config tiny] [--rounds 9] [--budget 0.5]

One process, one Model per side, steps interleaved (one step of each side per round); it prints each
auto side's step-time overhead over none (median of per-round ratios), the overhead the measured cost
model predicts, and the saved activations as a share of none's. Other work on the machine skews every
side alike; the ratios are what to read.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from sides import CONFIGS, LR, MAX_GRAD_NORM, _batch, kiln_bundle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="tiny", choices=sorted(CONFIGS))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--budget", type=float, default=0.5)
    args = parser.parse_args()

    from kiln.core import AdamW, Model

    c = CONFIGS[args.config]
    bundle = kiln_bundle(c)
    ids = _batch(c)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    sides = {"none": ("none", {}), "auto (FLOPs)": ("auto", {"cost": "flops"}),
             "auto (measured)": ("auto", {"cost": "measured"})}
    models = {}
    for name, (mode, options) in sides.items():
        t0 = time.perf_counter()
        models[name] = Model.from_ir(bundle, seed=0, optimizer=AdamW(lr=LR, max_grad_norm=MAX_GRAD_NORM),
                                     recompute=mode, recompute_budget=args.budget if mode == "auto" else None,
                                     recompute_options=options)
        models[name].train_step(batch)  # compiles (and calibrates) and warms up
        print(f"{name}: first step {time.perf_counter() - t0:.2f} s", flush=True)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            t0 = time.perf_counter()
            model.train_step(batch)
            times[name].append(time.perf_counter() - t0)
    none = times["none"]
    load = os.getloadavg()[0]
    print(f"\n{args.config}, auto at {args.budget:.0%} of the saved activations, "
          f"{args.rounds} interleaved rounds")
    print(f"none: median step {statistics.median(none) * 1e3:.1f} ms (load average {load:.1f} on "
          f"{os.cpu_count()} CPUs at the end: other work skews every side)")
    for name in list(models)[1:]:
        ratio = statistics.median(t / n for t, n in zip(times[name], none, strict=True))
        plan = models[name].program(ids.shape[0], ids.shape[1] - 1).recompute
        saved = plan.planned_bytes / plan.reference_bytes if plan.reference_bytes else float("nan")
        predicted = (f", predicted +{plan.predicted_seconds / statistics.median(none):.1%}"
                     if plan.predicted_seconds is not None else "")
        print(f"{name}: step {ratio:.3f}x none (+{ratio - 1:.1%}){predicted}; saved activations "
              f"{saved:.2f}x none's; recomputes {plan.extra_flops / 1e9:.2f} GFLOP")


if __name__ == "__main__":
    main()
