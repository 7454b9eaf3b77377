"""Tensor parallelism (Megatron-LM's): each rank holds a slice of every layer's attention heads and MLP
columns, and two collectives per sublayer keep the ranks in step.

The ``tensor_parallel`` graph pass (stage ``shard``) rewrites each standard transformer block
(kiln-dsl's ``DenseTransformerBlock`` and ``MoETransformerBlock``: Llama, Qwen3, Mistral, Qwen3-MoE,
Mixtral) for one rank of ``world``:

- its config's query heads, KV heads and MLP width (each expert's, in a MoE block) become
  ``1/world`` of the model's: the packed ``qkv_weight`` holds the rank's query, key and value heads,
  ``out_weight`` their columns, ``mlp_up_weight`` (each expert's ``experts_gate_up``) its rows of
  gate and of up, ``mlp_down_weight`` (``experts_down``) its columns (:func:`shard`); the router
  stays whole;
- ``tp_copy`` (forward: identity; backward: all-reduce) feeds the column-parallel matmuls (QKV, MLP
  up, the experts' gate and up) and the tensors whose gradients are partial on each rank (the
  QK-norm weights, which see the rank's heads; the routing weights, which scale its slice);
- ``tp_all_reduce`` (forward: all-reduce; backward: identity) sums the row-parallel partial outputs
  (attention output, MLP down, the experts' combined output).

The embedding, norms and LM head stay whole on every rank, and every rank runs the same batch; the
loss and every weight match one process on the whole model. What it does not do yet: shared
experts, biases of the output projections (they would be added once per rank),
vocabulary-parallel embedding and cross-entropy, a grid of data- and tensor-parallel ranks, and
recompute of the rewritten blocks. :class:`TensorParallel` makes the optimizer clip by the norm of the
whole model's gradients (each rank holds its slices' and the whole tensors').
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from kiln.core import (
    AttrSpec,
    BackwardContext,
    InferContext,
    KilnError,
    OpDef,
    Sample,
    TensorType,
    get_registry,
)
from kiln.core.ir import Bundle, Module, Op
from kiln.core.runtime import Communicator, SyncPlan
from kiln.dist._parallel import NORM, DataParallel

__all__ = ["TP_OPS", "TensorParallel", "grid", "shard", "tensor_parallel"]

_COMM = AttrSpec("communicator", "str")
#: by the output of the op that reads them: the inputs that go through ``tp_copy`` (column-parallel
#: inputs, and tensors whose gradient is partial on each rank)
COPIED_INPUTS = {"qkv_flat": ("ln1_flat",), "mlp_up_flat": ("ln2_flat",),
                 "qkv_rope": ("q_norm_weight", "k_norm_weight"), "expert_gate_up": ("moe_permuted",),
                 "moe_out": ("routing_weights",)}
#: the row-parallel outputs, summed by ``tp_all_reduce``
REDUCED_OUTPUTS = ("att_out_flat", "mlp_down_flat", "moe_out")
#: the config entries divided among the ranks: (its dimension symbol, the constructor's name, what)
SPLIT = (("Hq", "num_query_heads", "query heads"), ("Hkv", "num_kv_heads", "KV heads (GQA)"),
         ("M", "d_ff", "MLP width"), ("MoeM", "moe_d_ff", "experts' MLP width"))


def _tp_copy(x: np.ndarray, *, communicator: str) -> np.ndarray:
    out: np.ndarray = x.copy()
    return out


def _tp_all_reduce(x: np.ndarray, *, communicator: str) -> np.ndarray:
    out: np.ndarray = np.array(x, copy=True)
    get_registry("communicators")[communicator].all_reduce(out)
    return out


def _same(ctx: InferContext) -> list[TensorType]:
    return [TensorType(ctx.shape(0), ctx.dtype(0))]


def _copy_backward(ctx: BackwardContext) -> list[str | None]:
    if ctx.d_out is None:
        return [None]
    return [ctx.emit("tp_all_reduce", ctx.d_out, communicator=ctx.attrs["communicator"])]


def _all_reduce_backward(ctx: BackwardContext) -> list[str | None]:
    if ctx.d_out is None:
        return [None]
    return [ctx.emit("copy", ctx.d_out)]


def _samples(rng: np.random.Generator) -> Iterator[Sample]:
    """On the ``local`` communicator (one rank) both ops are the identity, forward and backward."""
    yield Sample((rng.standard_normal((3, 4)),), {"communicator": "local"})


TP_OPS = [
    OpDef("tp_copy", ("x",), ("out",), _tp_copy, _same, backward=_copy_backward, attrs=(_COMM,),
          collective=True, samples=_samples,
          doc="Tensor parallelism's f: the input as it is; its gradient summed over the ranks."),
    OpDef("tp_all_reduce", ("x",), ("out",), _tp_all_reduce, _same, backward=_all_reduce_backward,
          attrs=(_COMM,), collective=True, samples=_samples,
          doc="Tensor parallelism's g: the input summed over the ranks; its gradient as it is."),
]


#: the block parameters :func:`tensor_parallel` slices (the others are whole on every rank)
SLICED = ("qkv_weight", "qkv_bias", "out_weight", "mlp_up_weight", "mlp_down_weight", "experts_gate_up",
          "experts_down")


@attrs.frozen
class TensorParallel:
    """A Model as one rank of a tensor-parallel run (``Model(data_parallel=TensorParallel("mpi"),
    passes=[("tensor_parallel", {"communicator": "mpi"})])``): every rank trains the same batch (it
    is shared over no rank: ``communicator`` is ``local``), and the gradient norm the optimizer clips
    by is the whole model's: a ``sharded_grad_norm`` over each rank's slices, the whole tensors
    counted on the group's rank 0 only. With ``data_parallel`` (a :class:`DataParallel` over the other
    axis of a :func:`grid`), the batch is shared over its ranks and the gradients summed over them
    first."""

    comm: str = "mpi"
    data_parallel: DataParallel | None = None

    @property
    def communicator(self) -> Communicator:
        """The ranks the batch is shared over: the data-parallel group's, else none (``local``)."""
        if self.data_parallel is not None:
            return self.data_parallel.communicator
        local: Communicator = get_registry("communicators")["local"]
        return local

    def plan(self, trained: Sequence[tuple[str, tuple[int, ...]]]) -> SyncPlan:
        if self.data_parallel is not None and self.data_parallel.zero:
            raise KilnError("ZeRO-1 does not combine with tensor parallelism yet; use zero=0")
        first = self.data_parallel.plan(trained).grad_sync if self.data_parallel is not None else ()
        tp = get_registry("communicators")[self.comm]
        if tp.world_size == 1:
            return SyncPlan(grad_sync=first)
        sliced = [k for k, _ in trained if k.rsplit(".", 1)[-1] in SLICED]
        whole = [k for k, _ in trained if k not in set(sliced)]
        mine = [*sliced, *(whole if tp.rank == 0 else [])]
        norm = Op("sharded_grad_norm", [NORM, *mine], [], {"communicator": self.comm})
        return SyncPlan(grad_sync=[*first, norm], norm=(NORM,), outputs=(NORM,))


def grid(tensor_parallel: int, *, registry: Any = None) -> tuple[str, str]:
    """Cut the MPI job into groups of ``tensor_parallel`` consecutive ranks (a model's slices) and
    register two communicators: ``mpi-tp`` (this rank's group) and ``mpi-dp`` (the ranks holding the
    same slice in the other groups, which share the batch). Returns their names (dp, tp)."""
    from kiln.dist._communicators import MpiCommunicator

    world = MpiCommunicator()
    size, rank = world.world_size, world.rank
    if tensor_parallel < 1 or size % tensor_parallel:
        raise KilnError(f"a tensor-parallel degree of {tensor_parallel} does not divide the {size} ranks")
    registry = registry if registry is not None else get_registry("communicators")
    registry.register("mpi-tp", MpiCommunicator(world.comm.Split(rank // tensor_parallel, rank)))
    registry.register("mpi-dp", MpiCommunicator(world.comm.Split(rank % tensor_parallel, rank)))
    return "mpi-dp", "mpi-tp"


def _split(value: int, world: int, what: str, block: str) -> int:
    if value % world:
        raise KilnError(f"block {block!r}: {what} = {value} is not a multiple of the {world} "
                        "tensor-parallel ranks",
                        hint="choose a tensor-parallel degree that divides the heads and the MLP width")
    return value // world


def _shard_block(block: Module, world: int, comm: str) -> Module:
    cfg = dict(block.config)
    for flag, what in (("use_out_bias", "output-projection biases"), ("shared_d_ff", "shared experts")):
        if cfg.get(flag):
            raise KilnError(f"block {block.name!r}: tensor parallelism does not support {what} yet")
    for sym, name, what in SPLIT:
        if sym in cfg:
            cfg[sym] = cfg[name] = _split(int(cfg[sym]), world, what, block.name)
    assert block.forward is not None
    ops: list[Op] = []
    for op in block.forward.ops:
        ins = list(op.inputs)
        for src in (s for out in op.outputs for s in COPIED_INPUTS.get(out, ()) if s in ins):
            ops.append(Op("tp_copy", (src,), (f"{src}:tp",), {"communicator": comm}))
            ins[ins.index(src)] = f"{src}:tp"
        outs = list(op.outputs)
        reduce = [o for o in outs if o in REDUCED_OUTPUTS]
        outs = [f"{o}:partial" if o in REDUCED_OUTPUTS else o for o in outs]
        ops.append(op.evolve(inputs=tuple(ins), outputs=tuple(outs)))
        ops += [Op("tp_all_reduce", (f"{o}:partial",), (o,), {"communicator": comm}) for o in reduce]
    return block.evolve(config=cfg, forward=block.forward.evolve(ops=tuple(ops)))


def tensor_parallel(bundle: Bundle, options: Mapping[str, Any]) -> Bundle:
    """The ``tensor_parallel`` pass: ``{"communicator": "mpi"}`` (its world size is the degree)."""
    unknown = set(options) - {"communicator"}
    if unknown:
        raise KilnError("graph pass 'tensor_parallel' takes 'communicator', not "
                        f"{', '.join(sorted(unknown))}")
    comm = str(options.get("communicator", "mpi"))
    world = get_registry("communicators")[comm].world_size
    if world == 1:
        return bundle
    modules = []
    for m in bundle.modules:
        names = {p.name for p in m.params}
        mlp = {"mlp_up_weight", "mlp_down_weight"} <= names or {"experts_gate_up", "experts_down"} <= names
        if m.kind == "block" and {"qkv_weight", "out_weight"} <= names and mlp:
            m = _shard_block(m, world, comm)
        modules.append(m)
    return bundle.evolve(modules=tuple(modules))


def shard(parameters: Mapping[str, np.ndarray], bundle: Bundle, rank: int,
          world: int) -> dict[str, np.ndarray]:
    """A rank's slices of the whole model's ``parameters`` (kiln names), as :func:`tensor_parallel`
    lays them out for that rank: what ``Model.set_parameters`` takes on it."""
    blocks = {m.name: m for m in bundle.modules if m.kind == "block"}
    model = bundle.module(bundle.entry)
    stacks = {p.name: blocks.get(str(p.array_of)) for p in model.params if p.array_of is not None}
    out: dict[str, np.ndarray] = {}
    for name, value in parameters.items():
        stack, _, rest = name.partition(".")
        block = stacks.get(stack)
        param = rest.partition(".")[2]
        if block is None:
            out[name] = value
            continue
        cfg = block.config
        d, hq, hkv = (int(cfg[k]) for k in ("D", "Hq", "Hkv"))
        m = int(cfg.get("M", cfg.get("MoeM", 0)))

        def part(start: int, size: int, value: np.ndarray = value) -> np.ndarray:
            """This rank's share of rows ``[start, start + size)``."""
            return value[start + rank * size // world: start + (rank + 1) * size // world]

        if param in ("qkv_weight", "qkv_bias"):
            q, k = hq * d, hkv * d
            out[name] = np.concatenate([part(0, q), part(q, k), part(q + k, k)])
        elif param == "mlp_up_weight":
            out[name] = np.concatenate([part(0, m), part(m, m)])
        elif param == "experts_gate_up":  # [experts, gate | up, C]
            lo, hi = rank * m // world, (rank + 1) * m // world
            out[name] = np.concatenate([value[:, lo:hi], value[:, m + lo:m + hi]], axis=1)
        elif param == "experts_down":  # [experts, C, its MLP width]
            out[name] = value[:, :, rank * m // world: (rank + 1) * m // world]
        elif param == "out_weight":
            out[name] = value[:, rank * hq * d // world: (rank + 1) * hq * d // world]
        elif param == "mlp_down_weight":
            out[name] = value[:, rank * m // world: (rank + 1) * m // world]
        else:
            out[name] = value
    return out
