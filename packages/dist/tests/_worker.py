"""One rank of the multi-rank tests, and the one-process reference they are compared with.

``python _worker.py OUT COMM ZERO MICRO_BATCHES [BACKEND]`` trains the tiny model below for a few steps as one
rank of a data-parallel run (``DataParallel(COMM, zero=ZERO)``; ``ZERO`` = ``overlap``: plain data
parallelism with the all-reduces overlapped with the backward, ``overlap1``: ZeRO-1 with its
reduce-scatters overlapped) and saves its losses, gradient
norms, final parameters, optimizer-state bytes and collectives to ``OUT/rank<r>.npz``.
``train(None)`` is the reference: one process on the same global batches.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from kiln.core import Model
from kiln.dist import DataParallel, bind_gpu
from kiln.dsl import build_bundle
from kiln.dsl.stdlib.models import Qwen3Model

CONFIG = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "num_query_heads": 4, "num_kv_heads": 2,
          "head_size": 8, "d_ff": 64, "max_seq": 16}
STEPS, BATCH, SEQ = 20, 8, 8
#: small buckets, so that the gradients travel in several collectives
BUCKET_BYTES = 16 * 1024


def batches() -> list[dict[str, np.ndarray]]:
    """The global batches; the first sequences have more ignored labels than the last, so the
    ranks' shards hold different token counts."""
    rng = np.random.default_rng(1)
    out = []
    for _ in range(STEPS):
        ids = rng.integers(0, CONFIG["vocab_size"], (BATCH, SEQ + 1))
        labels = ids[:, 1:].copy()
        labels[0, 2:] = -100
        labels[1, -1] = -100
        out.append({"input_ids": ids[:, :-1], "labels": labels})
    return out


def train(data_parallel: DataParallel | None, micro_batches: int = 1,
          backend: str = "numpy") -> tuple[Model, np.ndarray]:
    """The model after training on every global batch, and each step's loss and gradient norm."""
    model = Model.from_ir(build_bundle(Qwen3Model, CONFIG), seed=0, data_parallel=data_parallel,
                          backend=backend, optimizer={"name": "adamw", "lr": 1e-3, "weight_decay": 0.1,
                                                      "max_grad_norm": 0.5})
    stats = [model.train_step(b, micro_batches=micro_batches) for b in batches()]
    return model, np.array([(s["loss"], s["grad_norm"]) for s in stats])


def main(out: str, comm: str, zero: str, micro_batches: int, backend: str = "numpy") -> None:
    if backend == "cuda":  # one GPU per rank, the same for the cuda backend and nccl
        bind_gpu()
    overlap = zero.startswith("overlap")  # "overlap": plain data parallelism, "overlap1": ZeRO-1
    stage = int(zero.removeprefix("overlap") or 0) if overlap else int(zero)
    dp = DataParallel(comm, zero=stage, overlap=overlap, bucket_bytes=BUCKET_BYTES)
    model, stats = train(dp, micro_batches, backend)
    arrays: dict[str, Any] = {f"param:{k}": v for k, v in model.parameters().items()}
    comm = dp.communicator
    program = model.program(BATCH // comm.world_size // micro_batches, SEQ)
    np.savez(f"{out}/rank{comm.rank}.npz", stats=stats,
             state_bytes=program.memory_report()["optimizer_state"],
             collectives=[s.op.type for s in program.steps if s.op.type.startswith(("bucket", "sharded"))],
             phases=[s.phase for s in program.steps if s.op.type.startswith(("bucket", "sharded"))],
             backward_left=[sum(t.phase == "backward" for t in program.steps[s.index:])
                            for s in program.steps if s.op.type.endswith("_start")],
             **arrays)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), *sys.argv[5:6])
