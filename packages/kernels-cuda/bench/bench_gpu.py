"""kiln's ``cuda`` backend against transformers eager and ``torch.compile`` on the same GPU.

    python packages/kernels-cuda/bench/bench_gpu.py [--layers N] [--seq T] [--batch B] [--rounds R]
        [--sides kiln-bf16,eager-bf16,...] [--json PATH] [--dry-run]

(``nox -s bench-gpu`` runs it.) One full training step (forward, backward, global-norm clipping at 1.0,
AdamW) of a Qwen3-0.6B-shaped model with random weights (hidden 1024, 28 layers, 16 query and 8 KV
heads of 128, MLP 3072, vocabulary 151936, tied embeddings), the same batch of token ids on every
side. Six sides, each in a process of its own (``gpu_sides.py``): kiln under the ``fp32`` and the
``bf16`` precision recipe, transformers' ``Qwen3ForCausalLM`` eager and through ``torch.compile``, each
in fp32 and in bf16 autocast (bf16 compute over fp32 weights, gradients and optimizer state: kiln's
``bf16`` recipe). Each side is compared with eager of the same precision.

The sides do not fit on one GPU together at this size, and a side's peak memory (and the driver's used
memory, the kiln sides' cross-check) must be its own, so one side holds the GPU at a time: a round
starts each side in turn in a fresh process, which builds its model, warms up (kernels compile then, and
``torch.compile`` compiles), then times its steps, reports and exits; the order of the sides rotates
from round to round. A side's speed against eager is the median over rounds of the per-round ratio of
median step times; the spread of those ratios and of each side's step times is printed, so that a
disturbed run shows. Tokens/s is tokens per step over the median of all of a side's timed steps; MFU is
kiln's roofline FLOPs of the step (``kiln.cuda._roofline``: the model's matmuls and attention, the same
work credited to every side) over that time, against the GPU's dense bf16 peak.

Prints a markdown table ready for docs/performance.md; ``--json PATH`` writes everything. Without a GPU
it says why and exits 0. ``--dry-run`` runs every code path on tiny shapes without a GPU: the kiln sides
on kiln.cuda's CPU emulator, the torch sides on the CPU (skipped when torch is not installed); its
figures mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
import shutil
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

SIDES_SCRIPT = Path(__file__).with_name("gpu_sides.py")
#: in the order of the first round: the goal's pair first, so that a run cut short has it
SIDES = ("kiln-bf16", "eager-bf16", "kiln-fp32", "eager-fp32", "compile-bf16", "compile-fp32")
NAMES = {"kiln": "kiln `cuda`", "eager": "transformers eager", "compile": "torch.compile"}
#: Qwen3-0.6B's shape; ``--layers``, ``--seq``, ``--batch`` change it
QWEN3_06B = {"hidden": 1024, "layers": 28, "heads": 16, "kv_heads": 8, "head_dim": 128, "intermediate": 3072,
             "vocab": 151936, "tied": 1, "seq": 2048, "batch": 4}
#: --dry-run's shape: every code path, in seconds on the CPU emulator
TINY = {"hidden": 32, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 8, "intermediate": 64, "vocab": 64,
        "tied": 1, "seq": 8, "batch": 2}
#: issue 17's goal for kiln against eager of the same precision, on an H100
GOAL_SPEED, GOAL_MEMORY = 1.3, 0.6


def precision_of(side: str) -> str:
    return side.split("-")[1]


def eager_of(side: str) -> str:
    return f"eager-{precision_of(side)}"


def model_flops(shape: dict[str, int]) -> dict[str, Any]:
    """The roofline of kiln's fp32 training Program for ``shape`` (compiled for ``numpy``: planning only,
    no weights): its FLOPs per step and its predicted H100 step time with matmuls in fp32 and in bf16."""
    from kiln.core import compile
    from kiln.cuda._roofline import roofline
    from kiln.dsl import build_bundle
    from kiln.dsl.stdlib.models import Qwen3Model

    bundle = build_bundle(Qwen3Model, {
        "vocab_size": shape["vocab"], "d_model": shape["hidden"], "n_layers": shape["layers"],
        "num_query_heads": shape["heads"], "num_kv_heads": shape["kv_heads"], "head_size": shape["head_dim"],
        "d_ff": shape["intermediate"], "max_seq": shape["seq"], "tie_word_embeddings": bool(shape["tied"]),
    })
    program = compile(bundle, bindings={"B": shape["batch"], "T": shape["seq"]}, backend="numpy")
    fp32, bf16 = (roofline(program, "h100", m) for m in ("fp32", "bf16"))
    return {"flops": fp32.model_flops, "h100_fp32_seconds": fp32.seconds, "h100_bf16_seconds": bf16.seconds}


def peak_flops(device_name: str) -> tuple[str, float] | None:
    """(roofline key, dense bf16 FLOP/s) of the GPU named ``device_name``, None for one kiln has no
    figures for."""
    from kiln.cuda._roofline import DEVICES

    for key, dev in DEVICES.items():
        if key in device_name.lower():
            return key, dev.tensor["bf16"]
    return None


def run_side(side: str, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One side in a fresh process: its JSON answer, or ``{"error": ...}`` saying why it has none."""
    try:
        done = subprocess.run([sys.executable, str(SIDES_SCRIPT), side, json.dumps(spec)],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"ran past --side-timeout ({timeout:.0f} s)"}
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        tail = done.stderr.strip().splitlines()[-15:]
        print(f"bench-gpu: {side} failed (exit code {done.returncode}):\n  " + "\n  ".join(tail),
              file=sys.stderr)
        return {"error": tail[-1] if tail else f"exit code {done.returncode}"}
    answer: dict[str, Any] = json.loads(lines[-1])
    return answer


def _spread(values: list[float]) -> list[float]:
    return [min(values), max(values)] if values else []


def summarise(rounds: list[dict[str, dict[str, Any]]], sides: list[str], shape: dict[str, int],
              flops: float, peak: float | None) -> dict[str, dict[str, Any]]:
    """Per side: its step times pooled over the rounds it ran in, tokens/s, per-round and overall ratios to
    eager of the same precision (speed: eager's median step time over the side's, per round where both
    ran; memory: the side's peak over eager's), MFU; a side that failed in any round keeps its errors."""
    tokens = shape["batch"] * shape["seq"]
    out: dict[str, dict[str, Any]] = {}
    for side in sides:
        runs = [r[side] for r in rounds if side in r]
        errors = [r["error"] for r in runs if "error" in r]
        if errors or not runs:
            out[side] = {"errors": errors or ["did not run"]}
            continue
        seconds = [s for r in runs for s in r["seconds"]]
        median = statistics.median(seconds)
        d: dict[str, Any] = {
            "seconds": [r["seconds"] for r in runs], "median_seconds": median,
            "tokens_per_second": tokens / median, "step_spread": (max(seconds) - min(seconds)) / median,
            "peak_bytes": max(r["peak_bytes"] for r in runs),
            "setup_peak_bytes": max(r["setup_peak_bytes"] for r in runs),
            "peak_source": runs[0]["peak_source"],
            "driver_used_bytes": runs[-1].get("driver_used_bytes"), "info": runs[0]["info"],
            "losses": [r["losses"] for r in runs], "mfu": flops / median / peak if peak else None,
        }
        for key in ("arena_bytes", "planned", "reserved_bytes", "torch_imported"):
            if key in runs[0]:
                d[key] = runs[0][key]
        both = [(r[side], r[eager_of(side)]) for r in rounds
                if side in r and "error" not in r.get(eager_of(side), {"error": ""})]
        if both:
            eager = [e for _, e in both]
            per_round = [statistics.median(e["seconds"]) / statistics.median(s["seconds"]) for s, e in both]
            eager_peak = max(e["peak_bytes"] for e in eager)
            eager_median = statistics.median(s for e in eager for s in e["seconds"])
            d.update(speed_vs_eager=statistics.median(per_round), speed_vs_eager_rounds=per_round,
                     speed_vs_eager_of_medians=eager_median / median,
                     memory_vs_eager=d["peak_bytes"] / eager_peak if eager_peak else None)
        out[side] = d
    return out


def size(nbytes: float) -> str:
    """``nbytes`` in GiB, or in MiB or KiB below a GiB (the dry run's sizes)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


def table(result: dict[str, Any]) -> str:
    """The markdown table (and its header lines) for docs/performance.md."""
    shape = result["shape"]
    lines = [
        f"{'Dry run (tiny shapes, CPU: the figures mean nothing), ' if result['dry_run'] else ''}"
        f"{result['date']}, {result['device']}; hidden {shape['hidden']}, {shape['layers']} layers, "
        f"{shape['heads']}/{shape['kv_heads']} heads of {shape['head_dim']}, MLP {shape['intermediate']}, "
        f"vocabulary {shape['vocab']}{', tied' if shape['tied'] else ''}; batch {shape['batch']} x seq "
        f"{shape['seq']}; {result['warmup']} warm-up + {result['steps']} timed steps per side per round, "
        f"{result['rounds']} rounds; {result['flops'] / 1e12:.3g} TFLOP per step (kiln's roofline)",
        "",
        "| side | precision | step (ms, median) | tokens/s | vs eager (speed) | per-round range | "
        "peak memory | vs eager (memory) | MFU |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for side, d in result["sides"].items():
        kind, precision = side.split("-")
        label = f"{NAMES[kind]} | {'bf16 autocast' if precision == 'bf16' and kind != 'kiln' else precision}"
        if "errors" in d:
            lines.append(f"| {label} | failed: {d['errors'][0]} | | | | | | |")
            continue
        rng = d.get("speed_vs_eager_rounds", [])
        lines.append(
            f"| {label} | {d['median_seconds'] * 1e3:.1f} | {d['tokens_per_second']:,.0f} | "
            + (f"{d['speed_vs_eager']:.2f}x | {min(rng):.2f}-{max(rng):.2f} | " if rng else "- | - | ")
            + f"{size(d['peak_bytes'])} | "
            + (f"{d['memory_vs_eager']:.2f}x | " if d.get("memory_vs_eager") is not None else "- | ")
            + (f"{d['mfu']:.1%} |" if d["mfu"] is not None else "- |"))
    lines.append("")
    for side in ("kiln-fp32", "kiln-bf16"):
        d = result["sides"].get(side, {})
        if d.get("speed_vs_eager") is not None and d.get("memory_vs_eager") is not None:
            met = d["speed_vs_eager"] >= GOAL_SPEED and d["memory_vs_eager"] <= GOAL_MEMORY
            dry = " (a dry run measures nothing)" if result["dry_run"] else ""
            lines.append(f"- {side}: {d['speed_vs_eager']:.2f}x eager's tokens/s, "
                         f"{d['memory_vs_eager']:.2f}x its peak memory: the goal (>= {GOAL_SPEED}x, "
                         f"<= {GOAL_MEMORY}x) is {'met' if met else 'not met'}{dry}")
        if "arena_bytes" in d:
            used = d["driver_used_bytes"]
            driver = (f"the driver counts {size(used)} more used than before the model" if used is not None
                      else "the driver is not asked on the emulator")
            lines.append(f"- {side}: arena {size(d['arena_bytes'])}, device allocations' peak "
                         f"{size(d['peak_bytes'])} (while building and warming up: "
                         f"{size(d['setup_peak_bytes'])}); {driver}")
    noisy = [f"{s} {d['step_spread']:.0%}" for s, d in result["sides"].items() if "step_spread" in d]
    lines.append(f"- spread of each side's timed steps ((max - min) / median): {', '.join(noisy)}")
    for s, why in result["skipped"].items():
        lines.append(f"- {s}: not run: {why}")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    found: dict[str, Any] = {"python": platform.python_version(), "host": platform.node()}
    smi = shutil.which("nvidia-smi")
    if smi:
        done = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                               "--format=csv,noheader"], capture_output=True, text=True)
        found["nvidia-smi"] = done.stdout.strip() or done.stderr.strip()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, help="transformer layers (default 28; --dry-run 2)")
    parser.add_argument("--seq", type=int, help="sequence length (default 2048; --dry-run 8)")
    parser.add_argument("--batch", type=int, help="sequences per step (default 4; --dry-run 2)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of all sides (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="warm-up steps per side per round (default %(default)s)")
    parser.add_argument("--steps", type=int, default=3,
                        help="timed steps per side per round (default %(default)s)")
    parser.add_argument("--sides", default=",".join(SIDES), help="comma-separated, of: " + ", ".join(SIDES))
    parser.add_argument("--side-timeout", type=float, default=900.0,
                        help="seconds one side may run (default %(default)s)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes without a GPU: kiln on the CPU emulator, torch on the CPU")
    args = parser.parse_args(argv)
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = [s for s in sides if s not in SIDES]
    if unknown or not sides:
        parser.error(f"--sides {args.sides!r}: unknown {', '.join(unknown) or 'none given'}; "
                     f"the sides are {', '.join(SIDES)}")
    for flag in ("layers", "seq", "batch", "rounds", "steps"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, found {getattr(args, flag)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, found {args.warmup}")

    if not args.dry_run:
        from kiln.cuda import _device

        ok, why = _device.device_status()
        if not ok:
            print(f"bench-gpu: skipped, no GPU here: {why}")
            if args.json:
                args.json.write_text(json.dumps({"skipped": why}, indent=1) + "\n")
            return 0
    shape = dict(TINY if args.dry_run else QWEN3_06B)
    shape.update({k: getattr(args, k) for k in ("layers", "seq", "batch") if getattr(args, k) is not None})
    skipped: dict[str, str] = {}
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        for s in sides:
            if not s.startswith("kiln"):
                skipped[s] = f"{' and '.join(missing)} not installed"
        sides = [s for s in sides if s not in skipped]
        if not sides:
            print(f"bench-gpu: nothing to run: {' and '.join(missing)} not installed, no kiln side asked for")
            return 0
    for s in sides:  # a ratio needs eager of the same precision
        if not s.startswith("eager") and eager_of(s) not in sides and eager_of(s) not in skipped:
            print(f"bench-gpu: {s} runs without {eager_of(s)}: no ratios to eager for it", file=sys.stderr)

    spec = {"shape": shape, "warmup": args.warmup, "steps": args.steps, "dry_run": args.dry_run}
    roof, where = model_flops(shape), machine()
    rounds: list[dict[str, dict[str, Any]]] = []
    result: dict[str, Any] = {}
    for r in range(args.rounds):
        order = sides[r % len(sides):] + sides[:r % len(sides)]  # the order rotates from round to round
        rounds.append({})
        for side in order:
            rounds[-1][side] = found = run_side(side, spec, args.side_timeout)
            print(f"bench-gpu: round {r + 1}/{args.rounds}: {side} "
                  + (f"{found['median_seconds'] * 1e3:.1f} ms/step" if "error" not in found else "failed"),
                  file=sys.stderr, flush=True)
            result = report(args, shape, sides, rounds, roof, where, skipped)
            if args.json:  # after every side: a run cut short leaves what it measured
                args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(result["table"])
    return 0


def report(args: argparse.Namespace, shape: dict[str, int], sides: list[str],
           rounds: list[dict[str, dict[str, Any]]], roof: dict[str, Any], where: dict[str, Any],
           skipped: dict[str, str]) -> dict[str, Any]:
    """Everything measured so far, its summary and its table."""
    names = [d["info"]["device"] for r in rounds for d in r.values() if "info" in d]
    device = names[0] if names else "no side ran"
    if args.dry_run:
        device = "dry run: " + ", ".join(sorted(set(names)))
    known = peak_flops("h100" if args.dry_run else device)  # the dry run's MFU: nominal, against an H100
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "dry_run": args.dry_run,
        "device": device, "machine": where, "shape": shape, "rounds": len(rounds), "warmup": args.warmup,
        "steps": args.steps, "tokens_per_step": shape["batch"] * shape["seq"], "flops": roof["flops"],
        "roofline": roof, "peak_device": known[0] if known else None,
        "peak_flops": known[1] if known else None, "skipped": skipped, "raw": rounds,
        "sides": summarise(rounds, sides, shape, roof["flops"], known[1] if known else None),
    }
    result["table"] = table(result)
    return result


if __name__ == "__main__":
    # a timeout's SIGTERM ends the side that is running too (subprocess.run kills it on the way out), and
    # the --json file keeps every side measured before it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
