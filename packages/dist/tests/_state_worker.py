"""One rank of the world-size-independent state tests: ``python _state_worker.py OUT KIND START``
(``KIND``: ``tp`` for tensor parallelism, ``zero`` for ZeRO-1) loads the whole state ``OUT/start.npz``
when ``START`` is ``load`` (else starts from the seed), trains the remaining steps of the tiny Qwen3
and saves its losses and the whole state (:func:`gather_state`) to ``OUT/rank<r>.npz``."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from kiln.core import Model, get_registry
from kiln.dist import DataParallel, TensorParallel, gather_state, scatter_state, shard
from kiln.dsl import build_bundle

CONFIG = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "num_query_heads": 4, "num_kv_heads": 2,
          "head_size": 8, "d_ff": 48, "max_seq": 16}
STEPS, SPLIT = 6, 3  # a run saved after SPLIT steps goes on to STEPS


def batches() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(5)
    ids = [rng.integers(0, CONFIG["vocab_size"], (4, 9)) for _ in range(STEPS)]
    return [{"input_ids": i[:, :-1], "labels": i[:, 1:]} for i in ids]


def model(kind: str | None) -> Model:
    """The tiny model as one process (``kind`` None) or as a rank of ``kind``, with the seed's weights."""
    bundle = build_bundle("Qwen3Model", CONFIG)
    optimizer = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1, "max_grad_norm": 0.5}
    options: dict[str, Any] = {"dtype": "float64", "optimizer": optimizer}
    whole = Model.from_ir(bundle, seed=0, **options)
    if kind is None:
        return whole
    if kind == "zero":
        return Model.from_ir(bundle, seed=0, data_parallel=DataParallel("mpi", zero=1, bucket_bytes=4096),
                             **options)
    tp = Model.from_ir(bundle, init=None, passes=[("tensor_parallel", {"communicator": "mpi"})],
                       data_parallel=TensorParallel("mpi"), **options)
    world = get_registry("communicators")["mpi"]
    tp.set_parameters(shard(whole.parameters(), bundle, world.rank, world.world_size))
    return tp


def as_arrays(state: dict[str, Any]) -> dict[str, np.ndarray]:
    out = {f"param:{k}": v for k, v in state["parameters"].items()}
    out["step"] = np.array(state["optimizer"]["step"])
    for s in ("exp_avg", "exp_avg_sq"):
        out.update({f"{s}:{k}": v for k, v in state["optimizer"][s].items()})
    return out


def from_arrays(arrays: Any) -> dict[str, Any]:
    state: dict[str, Any] = {"parameters": {}, "optimizer": {"name": "adamw", "step": int(arrays["step"])}}
    for key in arrays:
        kind, _, name = key.partition(":")
        if kind == "param":
            state["parameters"][name] = arrays[key]
        elif name and kind != "losses":
            state["optimizer"].setdefault(kind, {})[name] = arrays[key]
    return state


def train(m: Model, steps: list[dict[str, np.ndarray]]) -> list[float]:
    return [m.train_step(b)["loss"] for b in steps]


if __name__ == "__main__":
    out, kind, start = sys.argv[1:4]
    m = model(kind)
    rank = get_registry("communicators")["mpi"].rank
    todo = batches()
    if start == "load":
        scatter_state(m, from_arrays(np.load(f"{out}/start.npz")))
        todo = todo[SPLIT:]
    else:
        todo = todo[:SPLIT]
    losses = train(m, todo)
    np.savez(f"{out}/rank{rank}.npz", losses=np.array(losses), **as_arrays(gather_state(m)))
