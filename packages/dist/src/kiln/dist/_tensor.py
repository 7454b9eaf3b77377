"""Tensor parallelism (Megatron-LM's): each rank holds a slice of every layer's attention heads and MLP
columns, and two collectives per sublayer keep the ranks in step.

The ``tensor_parallel`` graph pass (stage ``shard``) rewrites each standard transformer block
(kiln-dsl's ``DenseTransformerBlock`` and ``MoETransformerBlock``: Llama, Qwen3, Mistral, Qwen3-MoE,
Mixtral) for one rank of ``world``:

- its config's query heads, KV heads and MLP width (each expert's, and the shared expert's, in a MoE
  block) become ``1/world`` of the model's: the packed ``qkv_weight`` holds the rank's query, key and
  value heads, ``out_weight`` their columns, ``mlp_up_weight`` (each expert's ``experts_gate_up``,
  the shared expert's ``shared_up_weight``) its rows of gate and of up, ``mlp_down_weight``
  (``experts_down``, ``shared_down_weight``) its columns (:func:`shard`); the router and the shared
  expert's gate stay whole;
- ``tp_copy`` (forward: identity; backward: all-reduce) feeds the column-parallel matmuls (QKV, MLP
  up, the experts' gate and up) and the tensors whose gradients are partial on each rank (the
  QK-norm weights, which see the rank's heads; the routing weights and the shared expert's gate,
  which scale its slice);
- ``tp_all_reduce`` (forward: all-reduce; backward: identity) sums the row-parallel partial outputs
  (attention output, MLP down, the experts' combined output, shared expert included); an output
  projection's bias (``out_bias``) is added after the sum, once.

The model's ``embedding`` and ``lm_head`` are split by rows of the vocabulary (``_vocab.py``): a
``vocab_parallel_embedding`` summed by ``tp_all_reduce``, and ``vocab_parallel_lm_head_loss`` fed
through ``tp_copy`` (a tied head is the embedding's rows). The norms stay whole on every rank, and
every rank runs the same batch; the loss and every weight match one process on the whole model.
What it does not do yet: recompute of the rewritten blocks. :class:`TensorParallel` makes the
optimizer clip by the norm of the whole model's gradients (each rank holds its slices' and the whole
tensors'), with ZeRO-1 over a grid's data-parallel axis too.

``@shard`` annotations (seed 004 §7.6.1) on a module's parameters take precedence: a custom block
is split as they say (``_shard.py``), and ``replicated`` keeps a standard block or the vocabulary
whole; annotations that contradict a standard block's layout are errors naming the parameter.
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
from kiln.core.ir import BinOp, Bundle, Const, Module, Op
from kiln.core.runtime import Communicator, SyncPlan
from kiln.dist._parallel import NORM, DataParallel
from kiln.dist._shard import _check_strategy, _fail, annotated_axes, lower_shards, shard_annotations
from kiln.dist._vocab import check_vocab

__all__ = ["TP_OPS", "TensorParallel", "grid", "shard", "tensor_parallel"]

_COMM = AttrSpec("communicator", "str")
#: by the output of the op that reads them: the inputs that go through ``tp_copy`` (column-parallel
#: inputs, and tensors whose gradient is partial on each rank)
COPIED_INPUTS = {"qkv_flat": ("ln1_flat",), "mlp_up_flat": ("ln2_flat",),
                 "qkv_rope": ("q_norm_weight", "k_norm_weight"), "expert_gate_up": ("moe_permuted",),
                 "moe_out": ("routing_weights",), "routed_out": ("routing_weights",),
                 "shared_up": ("ln2_flat",), "shared_out": ("shared_gate",)}
#: the row-parallel outputs, summed by ``tp_all_reduce``
REDUCED_OUTPUTS = ("att_out_flat", "mlp_down_flat", "moe_out")
#: the config entries divided among the ranks: (its dimension symbol, the constructor's name, what)
SPLIT = (("Hq", "num_query_heads", "query heads"), ("Hkv", "num_kv_heads", "KV heads (GQA)"),
         ("M", "d_ff", "MLP width"), ("MoeM", "moe_d_ff", "experts' MLP width"),
         ("SharedM", "shared_d_ff", "shared expert's MLP width"))


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


#: the model's parameters :func:`tensor_parallel` splits by rows of the vocabulary
VOCAB = ("embedding", "lm_head")
#: the parameters :func:`tensor_parallel` slices (the others are whole on every rank)
SLICED = ("qkv_weight", "qkv_bias", "out_weight", "mlp_up_weight", "mlp_down_weight", "experts_gate_up",
          "experts_down", "shared_up_weight", "shared_down_weight", *VOCAB)
#: the ``@shard`` strategy of each parameter of a standard block under the default layout
STANDARD = {"qkv_weight": "column", "qkv_bias": "column", "out_weight": "row", "mlp_up_weight": "column",
            "mlp_down_weight": "row", "experts_gate_up": "column", "experts_down": "row",
            "shared_up_weight": "column", "shared_down_weight": "row"}
#: the key of the entry module's ``metadata`` where the ``tensor_parallel`` pass records what it did:
#: ``{"communicator": ..., "sliced": (...)}``, the sliced parameters' keys (``embedding``,
#: ``blocks.*.qkv_weight``); :meth:`TensorParallel.plan` counts their gradients' norm on every rank,
#: the others' on rank 0 only
METADATA = "tensor_parallel"


def sliced_keys(module_ir: Bundle, comm: str) -> frozenset[str] | None:
    """The parameters (keys, ``blocks.*.qkv_weight`` for every layer) the ``tensor_parallel`` pass over
    ``comm`` sliced in ``module_ir``; None where no such pass ran over it."""
    record = module_ir.module(module_ir.entry).metadata.get(METADATA) if module_ir.entry else None
    if record is None or record.get("communicator") != comm:
        return None
    return frozenset(record.get("sliced", ()))


@attrs.frozen
class TensorParallel:
    """A Model as one rank of a tensor-parallel run (``Model(parallel=TensorParallel("mpi"))``, which
    adds the ``tensor_parallel`` pass; or, as before, ``Model(data_parallel=TensorParallel("mpi"),
    passes=[("tensor_parallel", {"communicator": "mpi"})])``): every rank trains the same batch (it
    is shared over no rank: ``communicator`` is ``local``), and the gradient norm the optimizer clips
    by is the whole model's: a ``sharded_grad_norm`` over each rank's slices, the whole tensors
    counted on the group's rank 0 only. With ``data_parallel`` (a :class:`DataParallel` over the other
    axis of a :func:`grid`), the batch is shared over its ranks and the gradients summed over them
    first."""

    comm: str = "mpi"
    data_parallel: DataParallel | None = None

    @property
    def passes(self) -> tuple[tuple[str, dict[str, str]], ...]:
        """The graph pass ``Model(parallel=...)`` adds: ``tensor_parallel`` over ``comm``."""
        return (("tensor_parallel", {"communicator": self.comm}),)

    @property
    def communicator(self) -> Communicator:
        """The ranks the batch is shared over: the data-parallel group's, else none (``local``)."""
        if self.data_parallel is not None:
            return self.data_parallel.communicator
        local: Communicator = get_registry("communicators")["local"]
        return local

    def rank_device(self, backend: object) -> int | None:
        """The GPU this rank trains on where ``backend`` has several: its node-local rank's."""
        from kiln.dist._communicators import rank_device

        return rank_device(get_registry("communicators")[self.comm], backend)

    def plan(self, trained: Sequence[tuple[str, tuple[int, ...]]],
             module_ir: Bundle | None = None) -> SyncPlan:
        """This rank's sync plan for the ``trained`` parameters of ``module_ir`` (the IR the Model
        trains, after its passes: the ``tensor_parallel`` pass recorded there which parameters it
        sliced; without it, those of the standard layout are taken as sliced)."""
        dp = self.data_parallel.plan(trained) if self.data_parallel is not None else SyncPlan()
        tp = get_registry("communicators")[self.comm]
        if tp.world_size == 1:
            return dp
        lowered = None if module_ir is None else sliced_keys(module_ir, self.comm) or frozenset()
        if lowered is None:  # no IR given: the standard layout's names
            sliced = {k for k, _ in trained if k.rsplit(".", 1)[-1] in SLICED}
        else:  # "blocks.3.qkv_weight" is sliced where the pass sliced "blocks.*.qkv_weight"
            sliced = {k for k, _ in trained if k in lowered or _pattern(k) in lowered}
        # the whole model's norm: each rank's slices, and the whole tensors once (on rank 0 of the group)
        counted = [k for k, _ in trained if k in sliced or tp.rank == 0]
        if dp.owned is not None:  # ZeRO-1 over the data-parallel axis: each rank's share of those
            assert self.data_parallel is not None
            norm = Op("sharded_grad_norm", [NORM, *(k for k in counted if k in dp.owned)], [],
                      {"communicator": self.data_parallel.comm, "over": self.comm})
            return attrs.evolve(dp, grad_sync=[*(op for op in dp.grad_sync if op.type != "sharded_grad_norm"),
                                               norm])
        norm = Op("sharded_grad_norm", [NORM, *counted], [], {"communicator": self.comm})
        return SyncPlan(grad_sync=[*dp.grad_sync, norm], in_backward=dp.in_backward, norm=(NORM,),
                        outputs=(NORM,))


def _pattern(key: str) -> str:
    """``blocks.3.qkv_weight`` as ``blocks.*.qkv_weight`` (a stacked block's parameter, any layer)."""
    stack, _, rest = key.partition(".")
    layer, _, name = rest.partition(".")
    return f"{stack}.*.{name}" if layer.isdigit() else key


def grid(tensor_parallel: int, *, communicator: str | None = None, backend: str | None = None,
         registry: Any = None) -> tuple[str, str]:
    """Cut the MPI job into groups of ``tensor_parallel`` consecutive ranks (a model's slices) and
    register two communicators: ``mpi-tp`` (this rank's group) and ``mpi-dp`` (the ranks holding the
    same slice in the other groups, which share the batch). Returns their names (dp, tp).

    ``communicator="nccl"`` (the default where ``backend`` is ``cuda`` or ``cuda:N`` and nccl4py is
    installed) registers ``nccl-tp`` and ``nccl-dp`` as well, over the same groups, and returns those:
    each an NCCL communicator on the rank's node-local GPU whose unique id the group's first rank
    makes and broadcasts over the group's MPI sub-communicator (``mpi-tp``/``mpi-dp``), when its first
    collective runs."""
    from kiln.dist._communicators import MpiCommunicator, NcclCommunicator, nccl_available
    from kiln.dist._parallel import NEEDS

    if communicator is None:
        gpu = backend is not None and backend.partition(":")[0] == "cuda"
        communicator = "nccl" if gpu and nccl_available() else "mpi"
    if communicator not in ("mpi", "nccl"):
        raise KilnError(f"grid(communicator={communicator!r}): expected 'mpi' (CPU ranks) or 'nccl' (GPUs)")
    if communicator == "nccl" and not nccl_available():
        raise KilnError(f"grid(communicator='nccl') needs {NEEDS['nccl']}")
    world = MpiCommunicator()
    size, rank = world.world_size, world.rank
    if tensor_parallel < 1 or size % tensor_parallel:
        raise KilnError(f"a tensor-parallel degree of {tensor_parallel} does not divide the {size} ranks")
    registry = registry if registry is not None else get_registry("communicators")
    tp = MpiCommunicator(world.comm.Split(rank // tensor_parallel, rank))
    dp = MpiCommunicator(world.comm.Split(rank % tensor_parallel, rank))
    registry.register("mpi-tp", tp)
    registry.register("mpi-dp", dp)
    if communicator == "mpi":
        return "mpi-dp", "mpi-tp"
    registry.register("nccl-tp", NcclCommunicator(tp))
    registry.register("nccl-dp", NcclCommunicator(dp))
    return "nccl-dp", "nccl-tp"


def _split(value: int, world: int, what: str, block: str) -> int:
    if value % world:
        raise KilnError(f"block {block!r}: {what} = {value} is not a multiple of the {world} "
                        "tensor-parallel ranks",
                        hint="choose a tensor-parallel degree that divides the heads and the MLP width")
    return value // world


def _shard_block(block: Module, world: int, comm: str) -> Module:
    cfg = dict(block.config)
    for sym, name, what in SPLIT:
        if cfg.get(sym):
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
        bias = ins.pop() if reduce and op.type == "matmul_bias" else None  # added once, to the sum
        if bias is not None:
            op = op.evolve(type="matmul")
        ops.append(op.evolve(inputs=tuple(ins), outputs=tuple(outs)))
        for o in reduce:
            summed = f"{o}:unbiased" if bias else o
            ops.append(Op("tp_all_reduce", (f"{o}:partial",), (summed,), {"communicator": comm}))
            if bias:
                ops.append(Op("bias_add", (summed, bias), (o,)))
    return block.evolve(config=cfg, forward=block.forward.evolve(ops=tuple(ops)))


def _standard(m: Module) -> bool:
    """A standard transformer block (the per-model default layout applies)."""
    names = {p.name for p in m.params}
    mlp = {"mlp_up_weight", "mlp_down_weight"} <= names or {"experts_gate_up", "experts_down"} <= names
    return m.kind == "block" and {"qkv_weight", "out_weight"} <= names and mlp


def _standard_whole(m: Module, world: int | None) -> bool:
    """Whether a standard block's ``@shard`` annotations keep it whole (every split parameter
    ``replicated``) rather than split by the default layout; annotations that fit neither are E008."""
    shards = shard_annotations(m)
    for name, (strategy, ann) in shards.items():
        _check_strategy(m, name, strategy, ann, world)
    split = [p.name for p in m.params if p.name in STANDARD]
    if split and all(shards.get(k, ("",))[0] == "replicated" for k in split):
        return True
    for name, (strategy, ann) in shards.items():
        want = STANDARD.get(name, "replicated")
        if strategy != want:
            raise _fail(m, ann, f"parameter {name!r}: @shard({strategy!r}) conflicts with the standard "
                        f"block's tensor-parallel layout, where it is {want!r} (Megatron-LM's heads and MLP "
                        "columns)", "E008", hint="annotate every split parameter of the block 'replicated' "
                        "to keep it whole, or follow the layout")
    return False


def _vocab_whole(model: Module, world: int | None) -> set[str]:
    """The vocabulary parameters ``@shard("replicated")`` keeps whole (``"column"``: split by rows,
    the default); another strategy on them is E008."""
    whole = set()
    for name, (strategy, ann) in shard_annotations(model).items():
        if name not in VOCAB:
            continue
        _check_strategy(model, name, strategy, ann, world)
        if strategy == "replicated":
            whole.add(name)
        elif strategy != "column":
            raise _fail(model, ann, f"parameter {name!r}: @shard({strategy!r}) on the vocabulary; it is "
                        "split by rows of the vocabulary ('column': the LM head's output features) or "
                        "'replicated'", "E008")
    return whole


def _without_vocab(model: Module) -> Module:
    return model.evolve(annotations=tuple(a for a in model.annotations
                                          if not (a.kind == "shard" and a.target in VOCAB)))


def _shard_vocab(model: Module, world: int, comm: str, whole: set[str] = frozenset()) -> Module:  # type: ignore[assignment]
    """The model's embedding and LM-head loss over the ranks' rows of the vocabulary (but for the
    parameters in ``whole``)."""
    vocab = tuple(v for v in VOCAB if v not in whole)
    if not any(p.name in vocab for p in model.params) or model.forward is None:
        return model
    on: dict[str, Any] = {"communicator": comm}
    sizes = {k: v for k, v in model.config.items() if isinstance(v, int) and not isinstance(v, bool)}
    whole = next((p.shape[0].evaluate(sizes) for p in model.params if p.name in vocab), 0)
    if whole % world:  # the last ranks' rows past the vocabulary are padding rows
        on["vocab_size"] = whole
    ops: list[Op] = []
    for op in model.forward.ops:
        weight = op.inputs[1] if len(op.inputs) > 1 else None
        if op.type == "embedding" and weight in vocab:
            out = op.outputs[0]
            pad = {"padding_idx": op.attrs["padding_idx"]} if op.attrs.get("padding_idx") is not None else {}
            ops += [Op("vocab_parallel_embedding", op.inputs, (f"{out}:partial",), {**on, **pad}, loc=op.loc),
                    Op("tp_all_reduce", (f"{out}:partial",), (out,), {"communicator": comm})]
        elif op.type == "fused_lm_head_loss" and weight in vocab:
            x = op.inputs[0]
            head = {k: op.attrs[k] for k in ("ignore_index", "softcap") if op.attrs.get(k) is not None}
            ops += [Op("tp_copy", (x,), (f"{x}:tp",), {"communicator": comm}),
                    op.evolve(type="vocab_parallel_lm_head_loss", inputs=(f"{x}:tp", *op.inputs[1:]),
                              attrs={**on, **head})]
        elif read := [i for i in op.inputs if i in vocab]:
            raise KilnError(f"model {model.name!r}: op {op.type!r} reads {read[0]!r}, which tensor "
                            "parallelism splits by rows of the vocabulary; only the embedding and "
                            "fused_lm_head_loss ops can read it")
        else:
            ops.append(op)

    def rows(p: Any) -> Any:  # a ParamSpec or the graph's TensorDecl of a parameter
        if p.name not in vocab:
            return p
        check_vocab(p.shape[0].evaluate(sizes), world, model.name)
        padded = p.shape[0] if "vocab_size" not in on else BinOp("+", p.shape[0], Const(world - 1))
        return p.evolve(shape=(BinOp("//", padded, Const(world)), *p.shape[1:]))

    graph = model.forward.evolve(ops=tuple(ops), params=tuple(map(rows, model.forward.params)))
    return model.evolve(params=tuple(map(rows, model.params)), forward=graph)


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
    lowered: set[str] = set()  # the sliced parameters' keys: "embedding", "blocks.*.qkv_weight"
    entry = bundle.module(bundle.entry)

    def keys(m: Module, names: set[str]) -> set[str]:  # the keys of a block's parameters, in every stack
        stacks = [p.name for p in entry.params if p.array_of == m.name]
        return {f"{stack}.*.{n}" for stack in stacks for n in names}

    for m in bundle.modules:
        if _standard(m):
            if not _standard_whole(m, world):
                m = _shard_block(m, world, comm)
                lowered |= keys(m, {p.name for p in m.params if p.name in STANDARD})
        elif m.name == bundle.entry:
            whole = _vocab_whole(m, world)
            lowered |= {p.name for p in m.params if p.name in VOCAB and p.name not in whole}
            if shard_annotations(_without_vocab(m)):  # the model's own @shard parameters
                m, mine = lower_shards(_without_vocab(m), world, comm)
                m = m.evolve(annotations=entry.annotations)
                lowered |= mine
            m = _shard_vocab(m, world, comm, whole)
        elif m.annotated("shard", "param"):
            m, mine = lower_shards(m, world, comm)
            lowered |= keys(m, mine)
        modules.append(m)
    record = {METADATA: {"communicator": comm, "sliced": sorted(lowered)}}
    return bundle.evolve(modules=tuple(m.evolve(metadata={**m.metadata, **record}) if m.name == bundle.entry
                                       else m for m in modules))


def split_axis(name: str, bundle: Bundle) -> int | None:
    """The axis along which :func:`shard` cuts the whole model's parameter ``name`` (kiln's name),
    None for a parameter every rank holds whole."""
    model = bundle.module(bundle.entry)
    if name in VOCAB:
        return None if name in _vocab_whole(model, None) else 0
    stack, _, rest = name.partition(".")
    if model.param(name) is not None:  # the model's own parameter
        return annotated_axes(_without_vocab(model)).get(name)
    spec = model.param(stack)
    if spec is None or spec.array_of is None:
        return None
    block, param = bundle.module(str(spec.array_of)), rest.partition(".")[2]
    if _standard(block):
        return None if _standard_whole(block, None) else _AXIS.get(param)
    return annotated_axes(block).get(param)


#: the axis along which :func:`shard` cuts each parameter of a standard block (by its name)
_AXIS = {"qkv_weight": 0, "qkv_bias": 0, "mlp_up_weight": 0, "experts_gate_up": 1, "experts_down": 2,
         "out_weight": 1, "mlp_down_weight": 1, "shared_up_weight": 0, "shared_down_weight": 1}


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
        axis = split_axis(name, bundle)
        if axis is None:  # whole on every rank
            out[name] = value
            continue
        if name in VOCAB:  # rows of the vocabulary, padded with zero rows to a multiple of the ranks
            rows = check_vocab(value.shape[0], world, bundle.entry)
            pad = rows * world - value.shape[0]
            if pad:
                value = np.concatenate([value, np.zeros((pad, *value.shape[1:]), value.dtype)])
            out[name] = value[rank * rows:(rank + 1) * rows]
            continue
        if block is None or not _standard(block):  # @shard: a contiguous slice of the axis
            size = value.shape[axis]
            if size % world:
                raise KilnError(f"parameter {name!r}: its @shard axis {axis} of size {size} is not a "
                                f"multiple of the {world} tensor-parallel ranks", code="E027")
            index = [slice(None)] * value.ndim
            index[axis] = slice(rank * size // world, (rank + 1) * size // world)
            out[name] = value[tuple(index)]
            continue
        cfg = block.config
        d, hq, hkv = (int(cfg[k]) for k in ("D", "Hq", "Hkv"))
        m = int(cfg.get("M", cfg.get("MoeM", 0)))
        shared = int(cfg.get("SharedM") or 0)

        def part(start: int, size: int, value: np.ndarray = value) -> np.ndarray:
            """This rank's share of rows ``[start, start + size)``."""
            return value[start + rank * size // world: start + (rank + 1) * size // world]

        if param in ("qkv_weight", "qkv_bias"):
            q, k = hq * d, hkv * d
            out[name] = np.concatenate([part(0, q), part(q, k), part(q + k, k)])
        elif param == "mlp_up_weight":
            out[name] = np.concatenate([part(0, m), part(m, m)])
        elif param == "shared_up_weight":
            out[name] = np.concatenate([part(0, shared), part(shared, shared)])
        elif param == "shared_down_weight":
            out[name] = value[:, rank * shared // world: (rank + 1) * shared // world]
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
