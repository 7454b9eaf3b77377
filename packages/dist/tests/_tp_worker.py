"""One rank of the tensor-parallel test: a tiny Qwen3 whose blocks the ``tensor_parallel`` pass
shards over the ranks, trained for a few steps; ``python _tp_worker.py OUT MODEL`` saves the rank's losses,
gathered parameters and parameter bytes to ``OUT/rank<r>.npz``. ``train(None)`` is one process."""

from __future__ import annotations

import sys

import numpy as np

from kiln.core import AdamW, Model, get_registry
from kiln.dist import DataParallel, TensorParallel, grid, shard
from kiln.dsl import build_bundle

CONFIG = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "num_query_heads": 4, "num_kv_heads": 2,
          "head_size": 8, "d_ff": 48, "max_seq": 16}
#: a MoE model whose layers are dense, MoE, MoE: both kinds of block sharded
MODELS = {"Qwen3Model": CONFIG,
          "Qwen3MoEModel": {**CONFIG, "n_layers": 3, "mlp_only_layers": [0], "num_experts": 4,
                            "num_experts_per_tok": 2, "moe_d_ff": 16}}
STEPS = 5


def batches() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    out = []
    for _ in range(STEPS):
        ids = rng.integers(0, CONFIG["vocab_size"], (2, 9))
        out.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    return out


def _stats(model: Model) -> list[tuple[float, float]]:
    """Each step's loss and gradient norm (what the clipping divides by)."""
    return [(s["loss"], s["grad_norm"]) for s in (model.train_step(b) for b in batches())]


def train(rank_world: tuple[int, int] | None, name: str = "Qwen3Model",
          parallel: TensorParallel | None = None) -> tuple[Model, list[tuple[float, float]]]:
    bundle = build_bundle(name, MODELS[name])
    opt = AdamW(lr=1e-2, weight_decay=0.1, max_grad_norm=0.05)  # clipping at every step
    # float64: the order of the sums shows less
    full = Model.from_ir(bundle, seed=0, optimizer=opt, dtype="float64")
    if rank_world is None:
        return full, _stats(full)
    parallel = parallel or TensorParallel("mpi")
    model = Model.from_ir(bundle, seed=0, optimizer=opt, dtype="float64", init=None,
                          passes=[("tensor_parallel", {"communicator": parallel.comm})],
                          data_parallel=parallel)
    model.set_parameters(shard(full.parameters(), bundle, *rank_world))
    return model, _stats(model)


if __name__ == "__main__":
    comm = get_registry("communicators")["mpi"]
    if sys.argv[3:] == ["grid"]:  # 2 x 2: two data-parallel groups of two tensor-parallel ranks
        dp, tp = grid(2)
        group = get_registry("communicators")[tp]
        model, losses = train((group.rank, group.world_size), sys.argv[2],
                              TensorParallel(tp, DataParallel(dp, bucket_bytes=4096)))
    else:
        model, losses = train((comm.rank, comm.world_size), sys.argv[2])
    np.savez(f"{sys.argv[1]}/rank{comm.rank}.npz", stats=np.array(losses),
             param_bytes=sum(v.nbytes for v in model.parameters().values()),
             **{f"param:{k}": v for k, v in model.parameters().items()})
