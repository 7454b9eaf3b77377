"""One rank of the tensor-parallel test: a tiny Qwen3 whose blocks the ``tensor_parallel`` pass
shards over the ranks, trained for a few steps; ``python _tp_worker.py OUT MODEL`` saves the rank's losses,
gathered parameters and parameter bytes to ``OUT/rank<r>.npz``. ``train(None)`` is one process."""

# ruff: noqa: F821, UP037  (dimension names inside Tensor[...] annotations are not Python names)
from __future__ import annotations

import sys
from typing import Any

import numpy as np

from kiln.core import AdamW, Model, get_registry
from kiln.dist import DataParallel, TensorParallel, gather_state, grid, shard
from kiln.dsl import Array, B, Param, T, Tensor, block, build_bundle, forward, graph, model
from kiln.dsl import annotations as an


@block
class GatedMlp:
    """A custom block that says how it is sharded: gate and up column-parallel (the up projection
    with its bias), down row-parallel (its bias whole, added once), the norm whole."""

    def __init__(self, d_model: int, d_ff: int):
        self.d_model, self.d_ff = d_model, d_ff

    norm = Param(Tensor["d_model", "fp32"])
    gate = Param(Tensor["d_ff", "d_model", "fp32"]) @ an.shard("column")
    up = Param(Tensor["d_ff", "d_model", "fp32"]) @ an.shard("column", tp_size=2)
    up_bias = Param(Tensor["d_ff", "fp32"]) @ an.shard("column")
    down = Param(Tensor["d_model", "d_ff", "fp32"]) @ an.shard("row")
    down_bias = Param(Tensor["d_model", "fp32"]) @ an.shard("replicated")

    @forward
    def forward(self, x: Tensor["B", "T", "d_model", "fp32"]) -> Tensor["B", "T", "d_model", "fp32"]:
        with graph() as g:
            x_flat = g.view(x, shape=[B * T, "d_model"])
            y, _ = g.rmsnorm(x_flat, "norm")
            h = g.mul(g.silu(g.matmul(y, "gate", transpose="NT")), g.matmul_bias(y, "up", "up_bias"))
            out = g.matmul_bias(h, "down", "down_bias")
            return g.add(x, g.view(out, shape=[B, T, "d_model"]))


@block
class TwoBranchMlp:
    """Two MLPs side by side, each column- then row-parallel; their sum is all-reduced once, where
    ``@comm("all_reduce")`` puts it (instead of once per row-parallel matmul)."""

    def __init__(self, d_model: int, d_ff: int):
        self.d_model, self.d_ff = d_model, d_ff

    norm = Param(Tensor["d_model", "fp32"])
    up1 = Param(Tensor["d_ff", "d_model", "fp32"]) @ an.shard("column")
    down1 = Param(Tensor["d_model", "d_ff", "fp32"]) @ an.shard("row")
    up2 = Param(Tensor["d_ff", "d_model", "fp32"]) @ an.shard("column")
    down2 = Param(Tensor["d_model", "d_ff", "fp32"]) @ an.shard("row")

    @forward
    def forward(self, x: Tensor["B", "T", "d_model", "fp32"]) -> Tensor["B", "T", "d_model", "fp32"]:
        with graph() as g:
            y, _ = g.rmsnorm(g.view(x, shape=[B * T, "d_model"]), "norm")
            a = g.matmul(g.silu(g.matmul(y, "up1", transpose="NT")), "down1", transpose="NT")
            b = g.matmul(g.gelu(g.matmul(y, "up2", transpose="NT")), "down2", transpose="NT")
            both = g.add(a, b) @ an.comm("all_reduce", group="tp")
            return g.add(x, g.view(both, shape=[B, T, "d_model"]))


@model
class TwoBranchLM:
    def __init__(self, vocab_size: int = 64, d_model: int = 16, d_ff: int = 24, n_layers: int = 2):
        self.vocab_size, self.d_model, self.d_ff, self.n_layers = vocab_size, d_model, d_ff, n_layers

    embedding = Param(Tensor["vocab_size", "d_model", "fp32"])
    blocks = Param(Array["n_layers", "TwoBranchMlp"])

    @forward
    def forward(self, token_ids: Tensor["B", "T", "int32"], position_ids: Tensor["T", "int32"],
                targets: Tensor["B", "T", "int32"]) -> Tensor["B * T", "fp32"]:
        with graph() as g:
            xN = g.call("StackedBlocks", g.embedding(token_ids, "embedding"), num_outputs=1, blocks="blocks",
                        n_layers=self.n_layers)
            return g.fused_lm_head_loss(g.view(xN, shape=[B * T, "d_model"]), "embedding", targets)


@model
class ShardedMlpLM:
    """GatedMlp blocks between an embedding split by the default (rows of the vocabulary) and an LM
    head that ``@shard("replicated")`` keeps whole."""

    def __init__(self, vocab_size: int = 64, d_model: int = 16, d_ff: int = 24, n_layers: int = 2):
        self.vocab_size, self.d_model, self.d_ff, self.n_layers = vocab_size, d_model, d_ff, n_layers

    embedding = Param(Tensor["vocab_size", "d_model", "fp32"])
    blocks = Param(Array["n_layers", "GatedMlp"])
    final_norm = Param(Tensor["d_model", "fp32"])
    lm_head = Param(Tensor["vocab_size", "d_model", "fp32"]) @ an.shard("replicated")

    @forward
    def forward(self, token_ids: Tensor["B", "T", "int32"], position_ids: Tensor["T", "int32"],
                targets: Tensor["B", "T", "int32"]) -> Tensor["B * T", "fp32"]:
        with graph() as g:
            xN = g.call("StackedBlocks", g.embedding(token_ids, "embedding"), num_outputs=1, blocks="blocks",
                        n_layers=self.n_layers)
            y, _ = g.rmsnorm(g.view(xN, shape=[B * T, "d_model"]), "final_norm")
            return g.fused_lm_head_loss(y, "lm_head", targets)


CONFIG = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "num_query_heads": 4, "num_kv_heads": 2,
          "head_size": 8, "d_ff": 48, "max_seq": 16}
#: a MoE model whose layers are dense, MoE, MoE: both kinds of block sharded
MODELS = {"Qwen3Model": CONFIG,
          "Qwen3MoEModel": {**CONFIG, "n_layers": 3, "mlp_only_layers": [0], "num_experts": 4,
                            "num_experts_per_tok": 2, "moe_d_ff": 16},
          # the LM head is the embedding; the padding row (no gradient) lies in rank 1's half
          "Qwen3Model:tied": {**CONFIG, "tie_word_embeddings": True, "pad_token_id": 40},
          # biases on q, k, v and on the attention output (added once, after the ranks' sum)
          "Qwen3Model:bias": {**CONFIG, "use_qkv_bias": True},
          # a shared expert (Qwen2-MoE's) beside the routed ones, its MLP split as the others'
          "Qwen3MoEModel:shared": {**CONFIG, "n_layers": 2, "mlp_only_layers": [0], "num_experts": 4,
                                   "num_experts_per_tok": 2, "moe_d_ff": 16, "shared_d_ff": 24},
          # a custom block split as its @shard annotations say
          "ShardedMlpLM": {},
          # two row-parallel sums all-reduced once, where @comm("all_reduce") says
          "TwoBranchLM": {},
          # a vocabulary two ranks cannot share evenly: rank 1's last row pads it
          "Qwen3Model:odd": {**CONFIG, "vocab_size": 63},
          "Qwen3Model:odd-tied": {**CONFIG, "vocab_size": 63, "tie_word_embeddings": True}}
STEPS = 5


def tiny(name: str) -> Any:
    """The tiny model ``name`` (a kiln-dsl model class, ``:variant`` after it)."""
    base = name.partition(":")[0]
    custom = {"ShardedMlpLM": ShardedMlpLM, "TwoBranchLM": TwoBranchLM}
    return build_bundle(custom.get(base, base), MODELS[name])


def batches(vocab: int = CONFIG["vocab_size"]) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    out = []
    for _ in range(STEPS):
        ids = rng.integers(0, vocab, (2, 9))
        out.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    return out


def _stats(model: Model, vocab: int = CONFIG["vocab_size"]) -> list[tuple[float, float]]:
    """Each step's loss and gradient norm (what the clipping divides by)."""
    return [(s["loss"], s["grad_norm"]) for s in (model.train_step(b) for b in batches(vocab))]


def train(rank_world: tuple[int, int] | None, name: str = "Qwen3Model",
          parallel: TensorParallel | None = None,
          backend: str = "numpy") -> tuple[Model, list[tuple[float, float]]]:
    bundle = tiny(name)
    opt = AdamW(lr=1e-2, weight_decay=0.1, max_grad_norm=0.05)  # clipping at every step
    # float64 (on numpy): the order of the sums shows less
    dtype = "float64" if backend == "numpy" else "float32"
    full = Model.from_ir(bundle, seed=0, optimizer=opt, dtype=dtype, backend=backend)
    vocab = MODELS[name].get("vocab_size", CONFIG["vocab_size"])
    if rank_world is None:
        return full, _stats(full, vocab)
    if parallel is None:  # parallel= adds the tensor_parallel pass
        model = Model.from_ir(bundle, seed=0, optimizer=opt, dtype=dtype, init=None, backend=backend,
                              parallel=TensorParallel("mpi"))
    else:  # the older spelling: the pass given, the parallelism as data_parallel
        model = Model.from_ir(bundle, seed=0, optimizer=opt, dtype=dtype, init=None, backend=backend,
                              passes=[("tensor_parallel", {"communicator": parallel.comm})],
                              data_parallel=parallel)
    model.set_parameters(shard(full.parameters(), bundle, *rank_world))
    return model, _stats(model, vocab)


if __name__ == "__main__":
    comm = get_registry("communicators")["mpi"]
    extra: dict[str, Any] = {}
    if sys.argv[3:4] == ["grid"]:  # D x T: D data-parallel groups of T tensor-parallel ranks
        # grid [T] [zero] [cuda]: T tensor-parallel ranks (2 by default), ZeRO-1 over the data-parallel
        # axis; on the cuda backend over nccl-tp / nccl-dp, a GPU per rank
        degree = int(sys.argv[4]) if sys.argv[4:5] and sys.argv[4].isdigit() else 2
        backend = "cuda" if "cuda" in sys.argv else "numpy"
        dp, tp = grid(degree, communicator="nccl" if backend == "cuda" else "mpi")
        group = get_registry("communicators")[tp]
        zero = int("zero" in sys.argv)
        model, losses = train((group.rank, group.world_size), sys.argv[2],
                              TensorParallel(tp, DataParallel(dp, bucket_bytes=4096, zero=zero)), backend)
        state = gather_state(model)  # the whole model's, on every rank
        extra = {f"whole:{s}:{k}": v for s, d in state["optimizer"].items() if isinstance(d, dict)
                 for k, v in d.items()}
        extra.update({f"whole:param:{k}": v for k, v in state["parameters"].items()})
        extra["optimizer_bytes"] = model.memory_report()["optimizer_state"]
    else:
        model, losses = train((comm.rank, comm.world_size), sys.argv[2])
        vocab = MODELS[sys.argv[2]].get("vocab_size", CONFIG["vocab_size"])
        extra["logits"] = model.logits(batches(vocab)[0]["input_ids"])  # gathered: the whole vocabulary
    np.savez(f"{sys.argv[1]}/rank{comm.rank}.npz", stats=np.array(losses),
             param_bytes=sum(v.nbytes for v in model.parameters().values()),
             **{f"param:{k}": v for k, v in model.parameters().items()}, **extra)
