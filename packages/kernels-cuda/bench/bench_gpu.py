"""Side by side: one training step of a Qwen3-shaped model on kiln's ``cuda`` backend and on ``numpy``.

Runs the two alternately (warm-up first) and prints the median step time of each, tokens per second
and the ratio. Without a GPU it prints why and exits 0. ``nox -s bench-gpu -- --layers 4 --seq 256``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)

    from kiln.cuda import _device

    ok, why = _device.device_status()
    if not ok:
        print(f"bench-gpu: skipped, no GPU here: {why}")
        return 0
    from kiln.core import Model
    from kiln.dsl import build_bundle
    from kiln.dsl.stdlib.models import Qwen3Model

    heads = max(args.d_model // 64, 2)
    config = {"vocab_size": 4096, "d_model": args.d_model, "n_layers": args.layers, "num_query_heads": heads,
              "num_kv_heads": max(heads // 2, 1), "head_size": 64, "d_ff": 3 * args.d_model,
              "max_seq": args.seq}
    bundle = build_bundle(Qwen3Model, config)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, config["vocab_size"], (args.batch, args.seq + 1))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    models = {b: Model.from_ir(bundle, seed=0, backend=b) for b in ("cuda", "numpy")}
    times: dict[str, list[float]] = {b: [] for b in models}
    for step in range(args.steps + 1):
        for name, model in models.items():
            start = time.perf_counter()
            model.train_step(batch)
            if step:  # the first step compiles kernels and Programs
                times[name].append(time.perf_counter() - start)
    tokens = args.batch * args.seq
    print(f"config {config}, batch {args.batch} x {args.seq}")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"{name:>6}: {t * 1e3:9.1f} ms/step  {tokens / t:10.0f} tokens/s")
    ratio = statistics.median(times["numpy"]) / statistics.median(times["cuda"])
    print(f"cuda is {ratio:.2f}x the NumPy backend's speed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
