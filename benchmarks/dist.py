"""Data parallelism on this machine's cores: two MPI ranks against one process, side by side.

    python benchmarks/dist.py [--config tiny] [--rounds 3] [--steps 4] [--json results.json]

(``nox -s bench-dist`` installs the kiln packages with kiln-dist and runs this.) Each round times, in
turn, kiln's training step of the config's global batch

- ``one``: in one process with all the cores (``KILN_NUM_THREADS`` = cores);
- ``dp2``: on two data-parallel ranks (``kiln.dist``, MPI) with half the cores each;
- ``dp2-overlap``: the same, each bucket's all-reduce started in the backward as soon as its
  gradients are final (``DataParallel(overlap=True)``) and waited for after it;
- ``half``: in one process with half the cores on half the batch: one rank's share of the work
  without any communication.

It prints the medians over rounds of ``dp2 / one`` tokens per second (above 1: data parallelism is
the faster way to use the cores) and of ``1 - half / dp2`` step time: the share of a data-parallel
step not spent computing the rank's share (the gradient all-reduce and waiting for the other rank),
without and with overlap. Buckets of ``--bucket-mib`` (default 1 MiB, so that the tiny model's
gradients travel in several all-reduces).
Ratios measured side by side; an absolute time alone says nothing about another machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from sides import CONFIGS, LR, MAX_GRAD_NORM, _batch, kiln_bundle


def step_times(config: str, steps: int, *, half: bool = False, ranks: int = 1, overlap: bool = False,
               bucket_mib: float = 1.0) -> list[float]:
    """Seconds of each timed training step (after one warm-up step), on rank 0."""
    from kiln.core import AdamW, Model

    c = CONFIGS[config]
    dp = None
    if ranks > 1:
        from kiln.dist import DataParallel

        dp = DataParallel("mpi", overlap=overlap, bucket_bytes=int(bucket_mib * 2**20))
    model = Model.from_ir(kiln_bundle(c), seed=0, optimizer=AdamW(lr=LR, max_grad_norm=MAX_GRAD_NORM),
                          data_parallel=dp)
    ids = _batch(c)
    if half:
        ids = ids[: len(ids) // 2]
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    model.train_step(batch)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        model.train_step(batch)
        times.append(time.perf_counter() - t0)
    return times


def measure(kind: str, config: str, steps: int, cores: int, bucket_mib: float) -> float:
    """The median step time of one ``kind`` (one, half, dp2, dp2-overlap), each in fresh processes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        args = [__file__, "--worker", kind, "--config", config, "--steps", str(steps), "--out", str(out),
                "--bucket-mib", str(bucket_mib)]
        threads = cores if kind == "one" else max(1, cores // 2)
        env = {**os.environ, "KILN_NUM_THREADS": str(threads)}
        if kind.startswith("dp2"):
            from kiln.dist import launch

            status = launch(2, args, env=env)
        else:
            status = subprocess.call([sys.executable, *args], env=env)
        if status != 0:
            raise SystemExit(f"the {kind} run failed (exit status {status})")
        return statistics.median(json.loads(out.read_text()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny", choices=sorted(CONFIGS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--json", type=Path)
    p.add_argument("--bucket-mib", type=float, default=1.0)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        times = step_times(args.config, args.steps, half=args.worker == "half",
                           ranks=2 if args.worker.startswith("dp2") else 1,
                           overlap=args.worker == "dp2-overlap", bucket_mib=args.bucket_mib)
        from kiln.dist import launched

        rank = int(os.environ.get("PMI_RANK", "0")) if launched() else 0
        if rank == 0:
            args.out.write_text(json.dumps(times))
        return
    cores = os.cpu_count() or 1
    rounds: list[dict[str, float]] = []
    for r in range(args.rounds):
        times = {kind: measure(kind, args.config, args.steps, cores, args.bucket_mib)
                 for kind in ("one", "dp2", "dp2-overlap", "half")}
        rounds.append(times)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in times.items()), flush=True)
    speedup = statistics.median(t["one"] / t["dp2"] for t in rounds)
    comm = statistics.median(1 - t["half"] / t["dp2"] for t in rounds)
    overlapped = statistics.median(1 - t["half"] / t["dp2-overlap"] for t in rounds)
    print(f"\n{args.config} on {cores} cores: two data-parallel ranks give {speedup:.2f}x one process's "
          f"tokens/s; {comm:.0%} of a data-parallel step is not the rank's share of the compute "
          f"(all-reduce and waiting), {overlapped:.0%} with the all-reduces overlapped with the backward")
    if args.json:
        result: dict[str, Any] = {"config": args.config, "cores": cores, "rounds": rounds,
                                  "dp2_over_one_tokens_per_s": speedup, "communication_share": comm,
                                  "communication_share_overlapped": overlapped}
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
