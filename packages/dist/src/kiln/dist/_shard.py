"""``@shard`` (seed 004 §7.6.1) lowered by the ``tensor_parallel`` pass.

A module whose parameters carry ``@shard`` annotations is split the way they say, instead of by
the pass's per-model default:

- ``@shard("column")`` on the weight of a ``matmul``/``matmul_bias`` (``transpose="NT"``: a
  ``[O, C]`` weight; ``"NN"``: ``[C, O]``) keeps the rank's ``1/n`` of the output features; the
  matmul's input goes through ``tp_copy``. On a 1-D parameter (a bias of those features), its
  ``1/n`` too.
- ``@shard("row")`` on a weight keeps the rank's ``1/n`` of the input features; the matmul's
  partial output is summed by ``tp_all_reduce`` (a ``matmul_bias``'s bias is added after the sum,
  once).
- ``@shard("replicated")``: whole on every rank (also how a standard block, or the model's
  embedding and LM head, opt out of the default split).

Between a column- and a row-parallel matmul only elementwise ops may run on the rank's slice of the
features (:data:`ELEMENTWISE`); anything else (a norm over the features, a reshape, the slice
reaching the module's output) would compute something else than one process, so it is an error
naming the parameter, as are a size the ranks cannot share, a ``tp_size`` that is not the degree,
two strategies for one parameter and the strategies kiln-dist does not lower (expert, sequence,
batch, head). The rank's slice is the contiguous ``[r n/w, (r+1) n/w)`` of the split axis
(:func:`annotated_axes`, which :func:`kiln.dist.shard` and :func:`kiln.dist.unshard` follow).

``@comm("all_reduce")`` (seed 004 §7.6.3) on a tensor of such a module moves the all-reduce of a
row-parallel matmul's partial output there: the partial sums travel through ops linear in them
(:data:`PARTIAL_LINEAR`), so two branches added take one all-reduce; a ``@comm`` it cannot honour is
an error naming the tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kiln.core import KilnError
from kiln.core.ir import Annotation, BinOp, Const, Module, Op

__all__ = ["ELEMENTWISE", "LOWERED", "PARTIAL_LINEAR", "annotated_axes", "lower_shards", "shard_annotations"]

#: the strategies the pass lowers
LOWERED = ("column", "row", "replicated")
#: ops that act on each feature alone, so they may run on a rank's slice of the features
ELEMENTWISE = frozenset({"add", "mul", "scale", "bias_add", "silu", "relu", "gelu", "silu_mul", "copy",
                         "cast", "sigmoid", "tanh", "neg", "sub", "square", "tp_copy"})
_MATMULS = ("matmul", "matmul_bias")
#: ops linear in their inputs, through which a row-parallel sum may travel before a ``@comm``
#: all-reduce sums it (``add``/``sub`` of two such parts: one all-reduce for both)
PARTIAL_LINEAR = frozenset({"view", "reshape", "copy", "scale", "add", "sub"})


def _fail(module: Module, ann: Annotation | None, message: str, code: str,
          hint: str | None = None) -> KilnError:
    where = f"{module.kind} {module.name!r}"
    return KilnError(f"{where}: {message}", code=code, hint=hint, location=None if ann is None else ann.loc)


def shard_annotations(module: Module) -> dict[str, tuple[str, Annotation]]:
    """Each ``@shard``-annotated parameter of ``module``: its strategy and annotation. Two
    different strategies for one parameter are E008; an unknown parameter E002."""
    out: dict[str, tuple[str, Annotation]] = {}
    names = {p.name for p in module.params}
    for ann in module.annotated("shard", "param"):
        strategy = str(ann.args.get("strategy"))
        if ann.target not in names:
            raise _fail(module, ann, f"@shard on {ann.target!r}, which is not one of its parameters", "E002")
        if ann.target in out and out[ann.target][0] != strategy:
            first = out[ann.target][0]
            raise _fail(module, ann, f"parameter {ann.target!r} has two shardings: @shard({first!r}) and "
                        f"@shard({strategy!r})", "E008", hint="keep one @shard per parameter")
        out[ann.target] = (strategy, ann)
    return out


def _check_strategy(module: Module, name: str, strategy: str, ann: Annotation, world: int | None) -> None:
    """A strategy the pass lowers, and ``tp_size`` (when given) the degree ``world`` (None: unchecked)."""
    if strategy not in LOWERED:
        raise _fail(module, ann, f"parameter {name!r}: @shard({strategy!r}) is not lowered by kiln-dist's "
                    "tensor_parallel pass yet (it lowers column, row and replicated)", "E008")
    size = ann.args.get("tp_size")
    if size is not None and world is not None and int(size) != world:
        raise _fail(module, ann, f"parameter {name!r}: @shard({strategy!r}, tp_size={size}) but the run has "
                    f"{world} tensor-parallel ranks", "E027", hint="drop tp_size= or run on that many ranks")


def _uses(module: Module, name: str) -> list[Op]:
    assert module.forward is not None
    return [op for op in module.forward.ops if name in op.inputs]


def annotated_axes(module: Module) -> dict[str, int]:
    """The axis each column- or row-sharded parameter of ``module`` is split along (from how its
    matmuls read it), without checking that the module can be lowered."""
    out: dict[str, int] = {}
    if module.forward is None:
        return out
    for name, (strategy, _) in shard_annotations(module).items():
        if strategy not in ("column", "row"):
            continue
        spec = module.param(name)
        assert spec is not None
        if len(spec.shape) == 1:
            out[name] = 0
            continue
        mm = next((op for op in _uses(module, name) if op.type in _MATMULS and op.inputs[1:2] == (name,)),
                  None)
        default = "NT" if mm is not None and mm.type == "matmul_bias" else "NN"
        out_first = mm is None or str(mm.attrs.get("transpose", default))[1] == "T"
        column_axis, row_axis = (0, 1) if out_first else (1, 0)
        out[name] = column_axis if strategy == "column" else row_axis
    return out


def lower_shards(module: Module, world: int, comm: str) -> tuple[Module, set[str]]:
    """``module`` as one of ``world`` ranks lays it out under its ``@shard`` annotations; returns it
    and the names of the parameters it splits."""
    shards = shard_annotations(module)
    for name, (strategy, ann) in shards.items():
        _check_strategy(module, name, strategy, ann, world)
    if module.forward is None:
        return module, set()
    axes = annotated_axes(module)
    sizes = {k: v for k, v in module.config.items() if isinstance(v, int) and not isinstance(v, bool)}
    on = {"communicator": comm}
    strategy = {k: s for k, (s, _) in shards.items()}
    ann = {k: a for k, (_, a) in shards.items()}
    for name, axis in axes.items():  # every split size must be shared evenly
        spec = module.param(name)
        assert spec is not None
        if strategy[name] == "row" and len(spec.shape) == 1:
            raise _fail(module, ann[name], f"parameter {name!r}: @shard('row') on a 1-D parameter; a "
                        "row-parallel matmul's bias is added once, after the sum: annotate it "
                        "@shard('replicated')", "E008")
        n = spec.shape[axis].evaluate(sizes)
        if n % world:
            raise _fail(module, ann[name], f"parameter {name!r}: @shard({strategy[name]!r}) splits its axis "
                        f"{axis} of size {n}, which is not a multiple of the {world} tensor-parallel ranks",
                        "E027",
                        hint="choose a tensor-parallel degree that divides it")
    sliced: dict[str, str] = {}  # a tensor holding the rank's slice of the features -> the parameter why
    copied: dict[str, str] = {}
    comms = _comms(module)
    partial: dict[str, str] = {}  # a tensor holding this rank's part of a sum -> the row-parallel parameter
    reduced: set[str] = set()  # the @comm tensors the all-reduces were placed at
    ops: list[Op] = []
    for op in module.forward.ops:
        ins = list(op.inputs)
        if held := [i for i in ins if i in partial]:  # a row-parallel sum not reduced yet (@comm below)
            mixed = op.type in ("add", "sub") and any(i not in partial for i in ins if i)
            if op.type not in PARTIAL_LINEAR or mixed:
                raise _fail(module, comms.get(op.outputs[0]), f"op {op.type!r} ({op.outputs[0]!r}) reads "
                            f"{held[0]!r}, this rank's part of the sum of the row-parallel "
                            f"{partial[held[0]]!r}, before its all-reduce", "E008",
                            hint="annotate an earlier tensor @comm('all_reduce'), or none (the all-reduce "
                            "then follows the row-parallel matmul)")
            out = op.outputs[0]
            if out in comms:
                ops += [op.evolve(outputs=(f"{out}:partial",)),
                        Op("tp_all_reduce", (f"{out}:partial",), (out,), on)]
                reduced.add(out)
            else:
                ops.append(op)
                partial[out] = partial[held[0]]
            continue
        weight = op.inputs[1] if op.type in _MATMULS and len(op.inputs) > 1 else None
        kind = strategy.get(weight) if weight is not None else None
        why = next((sliced[i] for i in ins if i in sliced), None)
        if kind in ("column", "row"):
            assert weight is not None
            if str(op.attrs.get("transpose", "NN"))[0] != "N" or (op.type == "matmul" and len(ins) > 2):
                raise _fail(module, ann[weight], f"parameter {weight!r}: @shard({kind!r}) lowers a matmul of "
                            f"an untransposed input without an accumulator; op {op.outputs[0]!r} is not one",
                            "E008")
            if kind == "column":
                if ins[0] in sliced:
                    raise _fail(module, ann[weight], f"parameter {weight!r}: @shard('column') reads "
                                f"{ins[0]!r}, already a slice of the features (from {sliced[ins[0]]!r}); "
                                "a column-parallel matmul needs the whole input", "E008",
                                hint="put a @shard('row') matmul between them")
                if op.type == "matmul_bias" and strategy.get(ins[2]) != "column":
                    raise _fail(module, ann[weight], f"parameter {weight!r}: @shard('column') but its bias "
                                f"{ins[2]!r} is not @shard('column')", "E008")
                if ins[0] not in copied:
                    ops.append(Op("tp_copy", (ins[0],), (f"{ins[0]}:tp",), on))
                    copied[ins[0]] = f"{ins[0]}:tp"
                ins[0] = copied[ins[0]]
                ops.append(op.evolve(inputs=tuple(ins)))
                sliced[op.outputs[0]] = weight
                continue
            if ins[0] not in sliced:
                raise _fail(module, ann[weight], f"parameter {weight!r}: @shard('row') reads {ins[0]!r}, "
                            "which is whole on every rank (no @shard('column') matmul computes it)", "E008",
                            hint="annotate the matmul before it @shard('column'), or this one 'replicated'")
            bias = ins.pop() if op.type == "matmul_bias" else None
            if bias is not None and strategy.get(bias) in ("column", "row"):
                raise _fail(module, ann[weight], f"parameter {bias!r}: the bias of the row-parallel "
                            f"{weight!r} is added once, after the sum: it cannot be split", "E008")
            out = op.outputs[0]
            if out not in comms and _reaches(module, out, comms):  # @comm places the all-reduce later
                if bias is not None:
                    raise _fail(module, ann[weight], f"parameter {weight!r}: a @comm('all_reduce') after the "
                                f"row-parallel matmul {out!r} would sum its bias {bias!r} once per rank",
                                "E008",
                                hint="add the bias after the annotated tensor, or drop the @comm")
                ops.append(op)
                partial[out] = weight
                continue
            reduced.update({out} & set(comms))
            ops.append(op.evolve(type="matmul", inputs=tuple(ins), outputs=(f"{out}:partial",),
                                 attrs={"transpose": op.attrs.get("transpose", "NT")} if bias else op.attrs))
            summed = f"{out}:unbiased" if bias else out
            ops.append(Op("tp_all_reduce", (f"{out}:partial",), (summed,), on))
            if bias:
                ops.append(Op("bias_add", (summed, bias), (out,)))
            continue
        split_params = [i for i in ins if strategy.get(i) in ("column", "row")]
        if why is not None or split_params:
            culprit = why or split_params[0]
            if op.type not in ELEMENTWISE:
                raise _fail(module, ann[culprit], f"parameter {culprit!r}: op {op.type!r} "
                            f"({op.outputs[0]!r}) reads a rank's slice of the features, and only "
                            "elementwise ops can (a norm, softmax or reshape over them would differ from "
                            "one process)", "E008",
                            hint="end the sharded region with a @shard('row') matmul before it")
            whole = [i for i in ins if i not in sliced and strategy.get(i) != "column"]
            if whole:
                raise _fail(module, ann[culprit], f"parameter {culprit!r}: op {op.type!r} "
                            f"({op.outputs[0]!r}) mixes a rank's slice of the features with the whole "
                            f"{whole[0]!r}", "E008")
            sliced.update(dict.fromkeys(op.outputs, culprit))
        ops.append(op)
    stray = [t for t in comms if t not in reduced]
    if stray:
        raise _fail(module, comms[stray[0]], f"tensor {stray[0]!r}: @comm('all_reduce') on a tensor that is "
                    "not a sum of row-parallel parts: every rank already holds it whole", "E008")
    leaked = [o.name for o in module.forward.outputs if o.name in sliced]
    if leaked:
        why = sliced[leaked[0]]
        raise _fail(module, ann[why], f"parameter {why!r}: output {leaked[0]!r} is a rank's slice of the "
                    "features: @shard('column') needs a @shard('row') matmul after it", "E008")

    def cut(p: Any) -> Any:  # a ParamSpec or the graph's TensorDecl of a parameter
        if p.name not in axes:
            return p
        shape = list(p.shape)
        shape[axes[p.name]] = BinOp("//", shape[axes[p.name]], Const(world))
        return p.evolve(shape=tuple(shape))

    graph = module.forward.evolve(ops=tuple(ops), params=tuple(map(cut, module.forward.params)))
    return module.evolve(params=tuple(map(cut, module.params)), forward=graph), set(axes)


def _comms(module: Module) -> dict[str, Annotation]:
    """The ``@comm`` tensors of a module the pass lowers: each must be an all-reduce."""
    out = {}
    for a in module.annotated("comm", "tensor"):
        if a.args.get("op") != "all_reduce":
            raise _fail(module, a, f"tensor {a.target!r}: @comm({a.args.get('op')!r}) in a tensor-parallel "
                        "block; kiln-dist's lowering places all-reduces only (the sums of row-parallel "
                        "parts)", "E008")
        out[a.target] = a
    return out


def _reaches(module: Module, start: str, targets: Mapping[str, Any]) -> bool:
    """Whether ``start`` flows into one of ``targets`` through ops linear in it (:data:`PARTIAL_LINEAR`)."""
    assert module.forward is not None
    todo, seen = [start], {start}
    while todo:
        t = todo.pop()
        if t in targets:
            return True
        for op in module.forward.ops:
            if t in op.inputs and op.type in PARTIAL_LINEAR:
                todo += [o for o in op.outputs if o not in seen]
                seen.update(op.outputs)
    return False
