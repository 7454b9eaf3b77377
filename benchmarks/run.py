"""kiln's NumPy backend against HF transformers: one full training step, side by side.

    python benchmarks/run.py [--quick] [--configs tiny,small] [--recompute tiny,small] [--json r.json]

(``nox -s bench`` installs torch, transformers and the kiln packages and runs this.) For each config
it starts one process per side (``sides.py``): kiln with kiln-kernels-cpu's native kernels, kiln
with its NumPy kernels only (``KILN_CPU_KERNELS=0``), transformers eager and transformers through
``torch.compile`` (inductor); warms them up (the compiled side compiles then), then times training
steps interleaved, one step of each side per round. It prints each side's step time as a ratio to
transformers eager's and to torch.compile's (medians of per-round ratios), its achieved model
GFLOP/s as a fraction of the sgemm floor (the machine's float32 matmul rate: the best of a large
NumPy and a large torch matmul, each measured in a fresh process before and after the timed rounds),
and each process's peak resident memory. Figures are ratios measured side by side; an absolute time
alone says nothing about another machine. Other work on the machine skews every side (and their
ratios): the share of the machine's CPU time that other processes used during the timed rounds is
printed, so that a disturbed run shows.

Then, on each ``--recompute`` config (``--recompute ''`` skips it), it runs kiln (native kernels)
without recompute, with ``recompute="auto"`` (its default budget, half the saved activations) and
with ``recompute="block"``, interleaved in the same way, and prints each mode's step-time overhead
over no recompute (median of per-round ratios) with its planned saved activations and activation
peak (saved + transient) as a share of no recompute's, and its peak RSS (as a multiple of
transformers eager's where the main rounds ran on that config too).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from sides import CONFIGS, MATMUL_N, training_flops

SIDES = ("kiln", "kiln-ref", "hf", "compile")
NAMES = {"kiln": "kiln (native kernels)", "kiln-ref": "kiln (NumPy kernels)", "hf": "transformers eager",
         "compile": "torch.compile (inductor)"}
LIBRARIES = {"kiln": "numpy", "hf": "torch"}
#: step-time targets of kiln (native kernels) as a ratio to these sides (issue 22's goals)
RATIO_TARGET = {"hf": 0.5, "compile": 0.8}
#: (warm-up steps, timed rounds) per config, and with --quick
ROUNDS = {"tiny": (2, 9), "small": (2, 7)}
QUICK_ROUNDS = {"tiny": (1, 3), "small": (1, 3)}
#: the recompute comparison's rounds: its step-time differences are small, so more of them
RECOMPUTE_ROUNDS = {"tiny": (2, 15), "small": (2, 9)}


def matmul_rate(library: str) -> float:
    """The float32 matmul rate of ``library`` (numpy or torch), measured in a process of its own."""
    found = subprocess.run([sys.executable, str(Path(__file__).parent / "sides.py"), "matmul", library],
                           check=True, capture_output=True, text=True).stdout
    return float(found.split()[-1])


RECOMPUTE = ("kiln:none", "kiln:auto", "kiln:block")
#: the step-time overhead over no recompute each mode should stay within (kiln's targets)
OVERHEAD_TARGET = {"kiln:auto": 0.10, "kiln:block": 0.35}


class Side:
    """A running ``sides.py`` process: one request, one JSON answer."""

    def __init__(self, side: str, config: str) -> None:
        self.side = side
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "sides.py"), side, config],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ask("")  # the "ready" line

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if command:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise SystemExit(f"the {self.side} process ended (exit code {code}); see its stderr above")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        self.proc.wait()


def _cpu_ticks(pids: list[int]) -> tuple[int, int, int]:
    """(busy, total) clock ticks of all CPUs since boot, and the CPU ticks the processes ``pids`` used."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    own = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        own += int(fields[11]) + int(fields[12])  # utime, stime
    return sum(ticks) - idle, sum(ticks), own


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    env = {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS",
                                      "OMP_NUM_THREADS") if k in os.environ}
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "env": env,
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}


def _warm(sides: dict[str, Side], steps: int) -> None:
    for _ in range(steps):
        for side in sides.values():
            side.ask("step")


def _timed(sides: dict[str, Side], rounds: int) -> tuple[dict[str, list[float]], float]:
    """Each side's step times, one step of each per round; and the share of the machine's CPU time
    that other processes used meanwhile."""
    pids = [side.proc.pid for side in sides.values()]
    times: dict[str, list[float]] = {s: [] for s in sides}
    before = _cpu_ticks(pids)
    for _ in range(rounds):
        for s, side in sides.items():
            times[s].append(side.ask("step")["seconds"])
    after = _cpu_ticks(pids)
    return times, ((after[0] - before[0]) - (after[2] - before[2])) / max(after[1] - before[1], 1)


def _ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))


def bench(config: str, warmup: int, rounds: int) -> dict[str, Any]:
    sides = {s: Side(s, config) for s in SIDES}
    try:
        _warm(sides, warmup)
        rates = {lib: [matmul_rate(lib)] for lib in LIBRARIES.values()}
        times, foreign = _timed(sides, rounds)
        memory = {s: sides[s].ask("memory") for s in SIDES}
        for lib, found in rates.items():
            found.append(matmul_rate(lib))
        info = {s: sides[s].ask("info") for s in SIDES}
    finally:
        for side in sides.values():
            side.close()
    flops = training_flops(CONFIGS[config])
    best = {lib: max(found) for lib, found in rates.items()}
    peak_rate = max(best.values())
    result: dict[str, Any] = {
        "config": config, "shape": CONFIGS[config], "rounds": rounds, "warmup": warmup,
        "foreign_cpu": foreign,
        "model_gflop_per_step": flops / 1e9, "matmul_gflops": best, "machine_gflops": peak_rate,
        "ratio": _ratio(times, "kiln", "hf"), "info": info, "sides": {},
    }
    for s in SIDES:
        median = statistics.median(times[s])
        result["sides"][s] = {
            "median_seconds": median, "seconds": times[s], "gflops": flops / median / 1e9,
            "fraction_of_machine": flops / median / 1e9 / peak_rate, **memory[s],
            "vs_hf": _ratio(times, s, "hf"), "vs_compile": _ratio(times, s, "compile"),
            "vs_kiln_ref": _ratio(times, s, "kiln-ref"),
        }
    return result


def bench_recompute(config: str, warmup: int, rounds: int) -> dict[str, Any]:
    """kiln's step time and planned activations per recompute mode, interleaved."""
    sides = {s: Side(s, config) for s in RECOMPUTE}
    try:
        _warm(sides, warmup)
        times, foreign = _timed(sides, rounds)
        memory = {s: sides[s].ask("memory") for s in RECOMPUTE}
    finally:
        for side in sides.values():
            side.close()
    planned = {s: memory[s]["planned"] for s in RECOMPUTE}
    base = planned["kiln:none"]

    def activations(p: dict[str, int]) -> int:
        return p["saved_activations"] + p["transient"]

    modes = {}
    for s in RECOMPUTE:
        modes[s] = {
            "median_seconds": statistics.median(times[s]), "seconds": times[s],
            "overhead": _ratio(times, s, "kiln:none") - 1,
            "saved_share": planned[s]["saved_activations"] / base["saved_activations"],
            "activation_share": activations(planned[s]) / activations(base), "planned": planned[s],
            "peak_rss": memory[s]["peak_rss"],
        }
    return {"config": config, "rounds": rounds, "warmup": warmup, "modes": modes, "foreign_cpu": foreign}


def report_recompute(r: dict[str, Any], eager_rss: int | None = None) -> list[str]:
    """The recompute rounds' lines; with ``eager_rss`` (transformers eager's peak RSS on the same config,
    from the main rounds of this run) each mode's peak RSS also as a multiple of it."""
    mib = 2**20
    lines = ["", f"== recompute on {r['config']}: {r['warmup']} warm-up + {r['rounds']} interleaved rounds; "
                 f"other processes used {r['foreign_cpu']:.0%} of the CPU time meanwhile"]
    for s, d in r["modes"].items():
        target = OVERHEAD_TARGET.get(s)
        lines.append(
            f"   {s.split(':')[1]:<6} step {d['median_seconds']:6.3f} s, overhead {d['overhead']:+6.1%}"
            f"{f' (target <= {target:.0%})' if target is not None else '                 '}   saved "
            f"{d['planned']['saved_activations'] / mib:6.1f} MiB ({d['saved_share']:6.1%})   activation peak "
            f"{(d['planned']['saved_activations'] + d['planned']['transient']) / mib:6.1f} MiB "
            f"({d['activation_share']:6.1%})   peak RSS {d['peak_rss'] / mib:6.0f} MiB"
            + (f" = {d['peak_rss'] / eager_rss:4.2f}x eager's" if eager_rss else ""))
    return lines


def report(results: list[dict[str, Any]], where: dict[str, Any]) -> str:
    mib = 2**20
    lines = [f"machine: {where['cpu']}, {where['cores']} cores, Python {where['python']}, {where['date']}",
             f"BLAS env: {where['env'] or 'none of OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE/OMP_NUM_THREADS set'}"]
    if results:
        info = results[0]["info"]
        for s in SIDES:
            libs = ", ".join(f"{b['internal_api']} {b['version']} {b.get('architecture') or ''} "
                             f"({b['num_threads']} threads)".replace("  ", " ")
                             for b in info[s]["blas"])
            versions = ", ".join(f"{k} {v}" for k, v in info[s].items() if isinstance(v, str))
            lines.append(f"{NAMES[s]}: {versions}; threadpools: {libs}")
        lines.append(f"kiln's native kernels: {info['kiln'].get('native kernels', 'unknown')}")
        if info["hf"].get("torch_blas"):
            lines.append("torch build: " + "; ".join(info["hf"]["torch_blas"]))
    for r in results:
        c = r["shape"]
        lines += [
            "",
            f"== {r['config']}: hidden {c['hidden']}, layers {c['layers']}, "
            f"heads {c['heads']}/{c['kv_heads']}, head_dim {c['head_dim']}, "
            f"intermediate {c['intermediate']}, vocab {c['vocab']}, "
            f"batch {c['batch']} x seq {c['seq']}",
            f"   {r['model_gflop_per_step']:.1f} model GFLOP per step; float32 matmul {MATMUL_N}^3: numpy "
            f"{r['matmul_gflops']['numpy']:.1f} GFLOP/s, torch {r['matmul_gflops']['torch']:.1f} GFLOP/s; "
            f"{r['warmup']} warm-up + {r['rounds']} interleaved rounds; other processes used "
            f"{r['foreign_cpu']:.0%} of the CPU time meanwhile",
            "   step time as a ratio to transformers eager / to torch.compile (medians of per-round ratios); "
            "share of the sgemm floor; peak RSS",
        ]
        hf_rss = r["sides"]["hf"]["peak_rss"]
        for s in SIDES:
            d = r["sides"][s]
            above = (d["peak_rss"] - d["import_rss"]) / mib
            lines.append(
                f"   {NAMES[s]:<25} {d['vs_hf']:5.2f} / {d['vs_compile']:5.2f}  "
                f"(median {d['median_seconds']:6.3f} s)  {d['fraction_of_machine']:5.1%} of the floor  "
                f"peak RSS {d['peak_rss'] / mib:6.0f} MiB = {d['peak_rss'] / hf_rss:4.2f}x eager's "
                f"({above:.0f} MiB above the imports)")
        k, sides = r["sides"]["kiln"], r["sides"]
        lines.append(f"   native / NumPy kernels: {k['vs_kiln_ref']:.2f}; targets: <= {RATIO_TARGET['hf']} "
                     f"of eager, <= {RATIO_TARGET['compile']} of torch.compile, RSS <= 0.5x eager's")
        medians = {s: sides[s]["median_seconds"] for s in SIDES}
        # far from the medians of per-round ratios when the rounds disagree (a busy machine)
        lines.append(f"   ratios of the median step times: kiln / eager "
                     f"{medians['kiln'] / medians['hf']:.2f}, kiln / torch.compile "
                     f"{medians['kiln'] / medians['compile']:.2f}, native / NumPy kernels "
                     f"{medians['kiln'] / medians['kiln-ref']:.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer warm-up steps and rounds")
    parser.add_argument("--configs", default="tiny,small", help="comma-separated: " + ", ".join(CONFIGS))
    parser.add_argument("--rounds", type=int, help="timed rounds per config (default: per config)")
    parser.add_argument("--recompute", default="tiny,small",
                        help="configs for the recompute modes' overhead, comma-separated ('' to skip)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    results = []
    for config in filter(None, args.configs.split(",")):
        warmup, rounds = (QUICK_ROUNDS if args.quick else ROUNDS)[config]
        results.append(bench(config, warmup, args.rounds or rounds))
        print(f"{config}: done", file=sys.stderr, flush=True)
    recompute = []
    for config in filter(None, args.recompute.split(",")):
        warmup, rounds = (QUICK_ROUNDS if args.quick else RECOMPUTE_ROUNDS)[config]
        recompute.append(bench_recompute(config, warmup, args.rounds or rounds))
        print(f"recompute on {config}: done", file=sys.stderr, flush=True)
    where = machine()
    print(report(results, where))
    eager_rss = {r["config"]: r["sides"]["hf"]["peak_rss"] for r in results}
    for r in recompute:
        print("\n".join(report_recompute(r, eager_rss.get(r["config"]))))
    if args.json:
        args.json.write_text(json.dumps({"machine": where, "results": results, "recompute": recompute},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
