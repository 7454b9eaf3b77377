"""The dsl and block planners, and the binding of a plan to the forward ops the runtime replays.

dsl (seed 000 §4.1): the slots of a block whose condition holds and that are marked recompute
become ops, merged by ``recompute_group`` (one leader carries the op) or by identical (op,
inputs, attrs); aliases expand to their slot; ``@input:``, ``@param:``, ``@global:`` and optional
``?`` dependencies resolve against the block; outputs absent by condition are dropped; the ops are
ordered topologically. Each active op is then bound to the forward ops that compute its outputs
from its declared inputs: those are what the backward replays. The block's forward graph adds its
own hints: a tensor its ``recompute`` list names is replayed by the op that produces it, and one its
``save`` list names is kept, whatever the slots say.

block (seed 001): keep each block's inputs and its persistent slots (``save=True`` and not
recompute); everything else the backward reads is replayed, the whole block at once.

offload (seed 000 §4.2): nothing is replayed; what the backward reads moves to the host pool between
the forward and the backward (:func:`offload`), as do the slots a dsl plan marks ``memory_hint="offload"``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import attrs

from kiln.core._errors import KilnError
from kiln.core.ir._condition import ConditionError, parse_condition
from kiln.core.ir._ir import ActivationSlot, FrozenDict, Graph, Module, Op
from kiln.core.ops._ops import OpRegistry
from kiln.core.plan.recompute import (
    BlockContext,
    BlockPlan,
    PlanContext,
    RecomputeOp,
    RecomputePlan,
    policy_active,
)


def is_alias(op: Op, registry: OpRegistry | None) -> bool:
    """Whether ``op``'s output shares its input's storage (the op's ``alias`` trait)."""
    return registry is not None and op.type in registry and registry.get_op(op.type).alias
SHARING = {"per_layer": (), "when_recomputed": ("full", "lora"), "always_share": ("full", "lora"),
           "fft_share": ("full",), "lora_share": ("lora",)}

# ---------------------------------------------------------------------------------------------
# Conditions: ``use_qk_norm``, ``not use_qkv_bias``, ``n_dense_layers > 0`` over the block config


def condition_holds(expr: str, config: Mapping[str, Any], what: str) -> bool:
    """Whether a slot's or parameter's ``condition`` holds under the block config (E026 names ``what``)."""
    try:
        return parse_condition(expr).evaluate(config)
    except ConditionError as exc:
        raise KilnError(f"{what}: {exc.message}", code="E026", hint=exc.hint) from None


# ---------------------------------------------------------------------------------------------
# dsl: the layout's ops


class _Unit:
    """A recompute op while it is being built from slots."""

    def __init__(self, name: str, leader: ActivationSlot, members: list[ActivationSlot], rank: int) -> None:
        self.name, self.leader, self.members, self.rank = name, leader, members, rank
        self.outputs: list[str] = []
        self.inputs: list[str] = []

    @property
    def slots(self) -> str:
        return ", ".join(repr(m.name) for m in self.members)


def _declares(s: ActivationSlot) -> bool:
    return bool(s.recompute_op or s.recompute_from or s.recompute_outputs or s.recompute_attrs)


def dsl_layout(block: Module, training: str, globals_: frozenset[str]) -> tuple[list[RecomputeOp], list[str]]:
    where = f"block {block.name!r}"
    present: dict[str, ActivationSlot] = {}
    absent: dict[str, str] = {}  # slot or alias -> the condition that removed it
    for s in block.activations.slots:
        if s.condition is None or condition_holds(s.condition, block.config, f"{where}, slot {s.name!r}"):
            present[s.name] = s
        else:
            absent.update({n: s.condition for n in (s.name, *s.aliases)})
    alias = {n: s.name for s in present.values() for n in (s.name, *s.aliases)}
    rank = {name: i for i, name in enumerate(present)}
    g = block.forward
    inputs = {d.name for d in g.inputs} if g is not None else None
    params = {d.name for d in g.params} if g is not None else {
        p.name for p in block.params
        if p.condition is None or condition_holds(p.condition, block.config, f"{where}, param {p.name!r}")}

    # units: one per recompute group, one per other recompute slot
    groups: dict[str, list[ActivationSlot]] = {}
    units: list[_Unit] = []
    for s in present.values():
        if not s.recompute:
            continue
        if s.recompute_group is not None:
            groups.setdefault(s.recompute_group, []).append(s)
        elif not (s.recompute_op or s.recompute_from):
            raise KilnError(f"{where}: slot {s.name!r} is marked recompute but declares neither "
                            "recompute_from nor recompute_op, and is in no recompute_group", code="E021",
                            hint="say what it is recomputed from, or set recompute=False to save it")
        else:
            units.append(_Unit(s.name, s, [s], rank[s.name]))
    for name, members in groups.items():
        leaders = [m for m in members if _declares(m)]
        decls = {(m.recompute_op, m.recompute_from, m.recompute_attrs, m.recompute_outputs) for m in leaders}
        if not leaders:
            raise KilnError(f"{where}: recompute_group {name!r} (slots {_names(members)}) has no member that "
                            "declares recompute_from or recompute_op", code="E021",
                            hint="one member, the leader, carries the group's op")
        if len(decls) > 1:
            raise KilnError(f"{where}: recompute_group {name!r}: slots {_names(leaders)} declare different "
                            "ops; one leader carries the op, the other members only join", code="E013")
        policies = {m.recompute_policy for m in members}
        if len(policies) > 1:
            raise KilnError(f"{where}: recompute_group {name!r}: members disagree on recompute_policy ("
                            + ", ".join(f"{m.name!r}: {m.recompute_policy}" for m in members) + ")",
                            code="E013", hint="a group is one op: every member needs the same policy")
        units.append(_Unit(name, leaders[0], members, rank[leaders[0].name]))

    for u in units:
        u.outputs = _outputs(u, alias, absent, where)
        u.inputs = [r for d in u.leader.recompute_from
                    if (r := _dependency(d, u, alias, absent, inputs, params, globals_, where)) is not None]
    units = _merge_identical(units)
    units.sort(key=lambda u: u.rank)

    producer: dict[str, _Unit] = {}
    for u in units:
        for o in u.outputs:
            if o in producer:
                raise KilnError(f"{where}: slot {o!r} is produced by two recompute ops, {producer[o].name!r} "
                                f"and {u.name!r}", code="E017",
                                hint="a slot has one producer; merge them in a group")
            producer[o] = u
    _check_cycles(units, producer, where)

    active = [u for u in units if policy_active(u.leader.recompute_policy, training)]
    made = {o for u in active for o in u.outputs}
    gated = [m.name for u in units if u not in active for m in u.members]
    for u in active:
        for d in u.inputs:
            dep = present.get(d)
            if dep is not None and d not in made and dep.memory_hint == "temporary":
                raise KilnError(f"{where}: slot {u.leader.name!r} is recomputed from {d!r}, a temporary slot "
                                "that is neither saved nor recomputed", code="E021",
                                hint=f"save {d!r}, or mark it recompute")
    ops = [RecomputeOp(u.name, u.leader.recompute_op, u.inputs, u.outputs, u.leader.recompute_attrs,
                       u.leader.recompute_policy, _unique(t for m in u.members for t in m.lora_targets))
           for u in _topological(active, producer)]
    return ops, gated


def _outputs(u: _Unit, alias: Mapping[str, str], absent: Mapping[str, str], where: str) -> list[str]:
    out = []
    for o in u.leader.recompute_outputs:
        if o in alias:
            out.append(alias[o])
        elif o not in absent:  # absent by condition: dropped
            raise KilnError(f"{where}: recompute op {u.name!r} lists output {o!r}, which is not a slot",
                            code="E002", hint=f"outputs are slot names; this op's slots are {u.slots}")
    return _unique([*out, *(m.name for m in u.members)])


def _dependency(dep: str, u: _Unit, alias: Mapping[str, str], absent: Mapping[str, str],
                inputs: set[str] | None, params: set[str], globals_: frozenset[str],
                where: str) -> str | None:
    optional, ref = dep.startswith("?"), dep.removeprefix("?")
    what = f"{where}: slot {u.leader.name!r} is recomputed from {dep!r}"
    kinds = {"@input:": ("input", inputs), "@param:": ("parameter", params), "@global:": ("global", globals_)}
    for prefix, (kind, known) in kinds.items():
        if ref.startswith(prefix):
            name = ref.removeprefix(prefix)
            if known is None or name in known:
                return ref
            if optional:
                return None
            raise KilnError(f"{what}, but the block has no {kind} {name!r}", code="E021",
                            hint=f"mark it optional ('?{ref}') if it may be absent" if kind != "global" else
                            "a block reads only its inputs and parameters; pass the tensor as an input")
    if ref.startswith("@"):
        raise KilnError(f"{what}: unknown prefix; use @input:, @param: or @global:", code="E021")
    if ref in alias:
        return alias[ref]
    if optional:
        return None
    if ref in absent:
        raise KilnError(f"{what}, a slot absent because its condition {absent[ref]!r} is false", code="E021",
                        hint=f"mark the dependency optional ('?{ref}')")
    raise KilnError(f"{what}, which is not a slot of the block", code="E021",
                    hint="name a slot (or one of its aliases), @input:, @param: or @global:")


def _merge_identical(units: list[_Unit]) -> list[_Unit]:
    """Ops with identical (op, inputs, attrs, policy) are one op with several outputs."""
    by_key: dict[tuple[Any, ...], _Unit] = {}
    out = []
    for u in units:
        s = u.leader
        key = (s.recompute_op, tuple(u.inputs), s.recompute_attrs, s.recompute_policy)
        if s.recompute_op is not None and s.recompute_group is None and key in by_key:
            first = by_key[key]
            first.outputs = _unique([*first.outputs, *u.outputs])
            first.members = [*first.members, *u.members]
            continue
        by_key.setdefault(key, u)
        out.append(u)
    return out


def _check_cycles(units: Sequence[_Unit], producer: Mapping[str, _Unit], where: str) -> None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[_Unit] = []

    def visit(u: _Unit) -> None:
        state[u.name] = 1
        stack.append(u)
        for d in u.inputs:
            v = producer.get(d)
            if v is None:
                continue
            if state.get(v.name) == 1:
                cycle = stack[stack.index(v):]
                names = " -> ".join(x.name for x in [*cycle, v])
                slots = _unique(m.name for x in cycle for m in x.members)
                raise KilnError(f"{where}: circular recompute dependency {names} (slots "
                                f"{', '.join(map(repr, slots))})", code="E022",
                                hint="one of them must be saved, not recomputed from the others")
            if v.name not in state:
                visit(v)
        stack.pop()
        state[u.name] = 2

    for u in units:
        if u.name not in state:
            visit(u)


def _topological(units: Sequence[_Unit], producer: Mapping[str, _Unit]) -> list[_Unit]:
    """Kahn's order; among ready ops the one declared first."""
    names = {u.name for u in units}
    deps = {u.name: {producer[d].name for d in u.inputs if d in producer} & names - {u.name} for u in units}
    out: list[_Unit] = []
    ready = sorted((u for u in units if not deps[u.name]), key=lambda u: u.rank)
    while ready:
        u = ready.pop(0)
        out.append(u)
        for v in units:
            if u.name in deps[v.name]:
                deps[v.name].discard(u.name)
                if not deps[v.name]:
                    ready.append(v)
                    ready.sort(key=lambda x: x.rank)
    return out


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _names(slots: Iterable[ActivationSlot]) -> str:
    return ", ".join(repr(s.name) for s in slots)


# ---------------------------------------------------------------------------------------------
# Binding: forward ops per recompute op


class _Forward:
    """The forward graph of a block: producers, roots of aliases, inputs and parameters."""

    def __init__(self, g: Graph, registry: OpRegistry | None) -> None:
        self.g = g
        self.alias = [is_alias(op, registry) for op in g.ops]
        self.producer = g.producers()
        self.params = {d.name for d in g.params}
        self.inputs = {d.name for d in g.inputs}
        self.root: dict[str, str] = {}
        for name in (*self.inputs, *self.params):
            self.root[name] = name
        for op, alias in zip(g.ops, self.alias, strict=True):
            for o in op.outputs:
                if o:
                    self.root[o] = self.root[op.inputs[0]] if alias else o
        self.tensors = set(self.root)

    def viewed(self, t: str, names: set[str]) -> bool:
        """Whether ``t`` is one of ``names`` or a chain of views of one."""
        while t not in names:
            k = self.producer.get(t)
            if k is None or not self.alias[k]:
                return False
            t = self.g.ops[k].inputs[0]
        return True

    def reads(self, ops: Iterable[Op]) -> list[str]:
        return _unique(i for op in ops for i in op.inputs if i)


def saved_variant(op: Op, registry: OpRegistry | None) -> Op | None:
    """``<op>_apply_saved``, if registered, reading the statistics ``op`` outputs instead of computing them.
    Its inputs and outputs are matched to the forward op's by schema name."""
    if registry is None or f"{op.type}_apply_saved" not in registry:
        return None
    fwd, var = registry.get_op(op.type), registry.get_op(f"{op.type}_apply_saved")
    names = {n.strip("?*"): t for n, t in zip(fwd.inputs, op.inputs, strict=False)}
    outs = {n.strip("?*"): t for n, t in zip(fwd.outputs, op.outputs, strict=False)}
    try:
        ins = [{**names, **outs}[n.strip("?*")] for n in var.inputs]
        produced = [outs[n.strip("?*")] for n in var.outputs]
    except KeyError:
        return None
    keep = {a.name for a in var.attrs}
    return Op(var.name, ins, produced, {k: v for k, v in op.attrs.items() if k in keep}, loc=op.loc)


#: Replays that rebuild some of an op's outputs from others it produced (kept) besides
def replay_variants(op: Op, registry: OpRegistry | None) -> list[Op]:
    """Ops that rebuild part of ``op``'s outputs from its inputs and the rest of its outputs (kept):
    its ``<op>_apply_saved`` variant, then those of its ``variants`` trait."""
    found = [v for v in (saved_variant(op, registry),) if v is not None]
    if registry is None or op.type not in registry:
        return found
    fwd = registry.get_op(op.type)
    names = {n.strip("?*"): t for n, t in zip(fwd.inputs, op.inputs, strict=False)}
    names |= {n.strip("?*"): t for n, t in zip(fwd.outputs, op.outputs, strict=False)}
    for kind, ins, outs in fwd.variants:
        if kind not in registry:
            continue
        var = registry.get_op(kind)
        try:
            inputs = [names[ins[n.strip("?*")]] for n in var.inputs]
            outputs = [names[outs[n.strip("?*")]] for n in var.outputs]
        except KeyError:
            continue
        if all(inputs) and all(outputs):
            keep = {a.name for a in var.attrs}
            attrs_kept = {k: v for k, v in op.attrs.items() if k in keep}
            found.append(Op(kind, inputs, outputs, attrs_kept, loc=op.loc))
    return found


def _replay_op(op: Op, fwd: _Forward, keep: AbstractSet[str], registry: OpRegistry | None) -> Op:
    """The forward op, or its ``_apply_saved`` variant when the statistics it would recompute are kept."""
    if any(o in keep for o in op.outputs if o):
        var = saved_variant(op, registry)
        if var is not None and set(op.outputs) - set(var.outputs) <= keep | {""}:
            return var
    return op


def _rng(ops: Iterable[Op], registry: OpRegistry | None, where: str) -> FrozenDict:
    """Counter state of the random ops replayed; a random op without one cannot be replayed."""
    out: dict[str, Any] = {}
    for op in ops:
        if registry is None or op.type not in registry or not registry.get_op(op.type).random:
            continue
        if not replayable(op, registry):
            raise KilnError(f"{where}: op {op.type!r} producing {', '.join(op.outputs)!r} is random and "
                            "keeps no counter state (a 'seed' attribute), so it cannot be replayed exactly",
                            code="E021", hint="save its outputs instead of recomputing them")
        out[op.outputs[0]] = {k: op.attrs.get(k, 0) for k in ("seed", "offset")}
    return FrozenDict(out)


def replayable(op: Op, registry: OpRegistry) -> bool:
    """Collectives never; random ops only with their counter state (dropout: seed and offset attrs)."""
    d = registry.get_op(op.type)
    return not d.collective and (not d.random or any(a.name == "seed" for a in d.attrs))


def _bytes(names: Iterable[str], fwd: _Forward, ctx: BlockContext) -> dict[str, int]:
    """Storage per tensor: a root's own bytes, 0 for an alias of another tensor."""
    return {n: int(ctx.sizes.get(n, 0)) if fwd.root.get(n, n) == n else 0 for n in names}


def bind(ctx: BlockContext, ops: Sequence[RecomputeOp], gated: Sequence[str], training: str,
         registry: OpRegistry | None) -> BlockPlan:
    """Attach to each dsl op the forward ops that compute its outputs from its inputs (E021 if they
    read a slot the op does not declare), then work out what the backward reads saved or recomputed."""
    block = ctx.module
    where = f"block {block.name!r}"
    if block.forward is None:
        return BlockPlan(block.name, ctx.layers, ops, gated=gated)
    fwd = _Forward(block.forward, registry)
    slots = {s.name: s for s in block.activations.slots}
    alias = {n: s.name for s in slots.values() for n in (s.name, *s.aliases)}

    def tensors(slot: str) -> list[str]:
        s = slots[slot]
        return [n for n in (s.name, *s.aliases) if n in fwd.tensors]

    for rop in ops:
        _check_attrs(rop, registry, where)
    forced = _save_list(fwd, where)  # kept, whatever the slots say
    by_slot = {n for s in slots.values() if s.recompute for n in (s.name, *s.aliases)}  # their slot rules
    hinted = [t for t in block.forward.recompute if t not in forced and t not in by_slot]
    ops = [rop for rop in ops if not all(set(tensors(o)) & forced for o in rop.outputs)]
    made = {o for op in ops for o in op.outputs}
    keep = {t for s in slots.values() if s.name not in made for t in tensors(s.name)} - set(hinted) | forced
    owner: dict[int, str] = {}
    bound = []
    for rop in ops:
        stop = set(fwd.params) | fwd.inputs
        for d in rop.inputs:
            if not d.startswith("@"):
                stop.update(tensors(d))
        stop.update(rop.globals.values())  # a global is read from the block input that carries it
        targets = [t for o in rop.outputs for t in tensors(o)]
        for o in rop.outputs:
            if not tensors(o):
                raise KilnError(f"{where}: slot {o!r} is recomputed, but the forward graph computes no "
                                f"tensor named {o!r} or one of its aliases", code="E021")
        segment: set[int] = set()
        todo = list(targets)
        while todo:
            t = todo.pop()
            if t in stop or (k := fwd.producer.get(t)) is None or k in segment:
                continue
            if t not in targets and fwd.viewed(t, stop):  # a view of what is at hand: read, not replayed
                continue
            if k in owner:
                raise KilnError(f"{where}: recompute ops {owner[k]!r} and {rop.name!r} both replay forward "
                                f"op #{k} ({block.forward.ops[k]}); one must name the other's output in "
                                "recompute_from", code="E021")
            segment.add(k)
            for i in block.forward.ops[k].inputs:
                s = alias.get(i)
                if i and i not in stop and s is not None and s not in rop.outputs:
                    raise KilnError(f"{where}: slot {rop.outputs[0]!r} is not derivable from its "
                                    f"recompute_from ({', '.join(rop.inputs) or 'nothing'}): its forward "
                                    f"computation reads slot {s!r}", code="E021",
                                    hint=f"add {s!r} to recompute_from")
                todo.append(i)
        owner.update({k: rop.name for k in segment})
        replay = [_replay_op(block.forward.ops[k], fwd, keep, registry) if
                  rop.op_type == f"{block.forward.ops[k].type}_apply_saved" else block.forward.ops[k]
                  for k in sorted(segment)]
        bound.append(attrs.evolve(rop, replay=tuple(replay), rng=_rng(replay, registry, where),
                                  flops=sum(ctx.costs[k].flops for k in segment)))
    bound = _in_order([*bound, *_hinted(ctx, fwd, hinted, bound, keep, registry, where)])
    produced = {o for rop in bound for op in rop.replay for o in op.outputs if o}
    recomputed = produced - keep
    # a view of a recomputed tensor is recomputed too (for free): reading the forward one would keep it
    unit = {o: u for u, rop in enumerate(bound) for op in rop.replay for o in op.outputs if o}
    for op in block.forward.ops:
        if is_alias(op, registry) and op.inputs[0] in recomputed and op.outputs[0] not in produced | keep:
            u = unit[op.inputs[0]]
            bound[u] = attrs.evolve(bound[u], replay=(*bound[u].replay, op))
            unit[op.outputs[0]] = u
            recomputed.add(op.outputs[0])
    plan = _finish(ctx, fwd, bound, recomputed, gated, training, whole_block=False)
    hinted_off = {t for s in slots.values() if s.memory_hint == "offload" for t in tensors(s.name)}
    return offload(ctx, plan, registry, hinted_off, strict=True) if hinted_off else plan


def _check_attrs(rop: RecomputeOp, registry: OpRegistry | None, where: str) -> None:
    """``recompute_attrs`` are attributes of the recompute op (or annotations, named ``_*``)."""
    if registry is None or rop.op_type is None:
        return
    takes = {a.name for a in registry.get_op(rop.op_type).attrs}
    bad = [k for k in rop.attrs if k not in takes and not k.startswith("_")]
    if bad:
        raise KilnError(f"{where}: recompute op {rop.name!r} declares recompute_attrs "
                        f"{', '.join(map(repr, bad))}, which op {rop.op_type!r} does not take (it takes "
                        f"{', '.join(sorted(takes)) or 'none'})", code="E003",
                        hint="drop it; a note kiln should keep but not use is named '_<key>'")


def _save_list(fwd: _Forward, where: str) -> set[str]:
    """The forward graph's ``save`` list, after checking it and the ``recompute`` list name its tensors."""
    for kind, names in (("save", fwd.g.save), ("recompute", fwd.g.recompute)):
        for n in names:
            if n not in fwd.tensors:
                raise KilnError(f"{where}: its forward graph's {kind} list names {n!r}, which is not a "
                                "tensor of the block", code="E002", hint="name a tensor the block computes")
    return set(fwd.g.save)


def _hinted(ctx: BlockContext, fwd: _Forward, hinted: Sequence[str], bound: Sequence[RecomputeOp],
            keep: AbstractSet[str], registry: OpRegistry | None, where: str) -> list[RecomputeOp]:
    """Ops for the tensors ``hinted`` by the forward graph's ``recompute`` list (``@recompute``,
    ``mark_recompute``; less those of its ``save`` list and those a slot marks recompute, which
    follow their slot's op and policy): each is replayed by the forward op that produces it, from what
    that op reads (kept, or recomputed in turn). One the backward never reads needs nothing."""
    g = fwd.g
    produced = {o for rop in bound for op in rop.replay for o in op.outputs if o}
    wanted: dict[int, list[str]] = {}
    for t in hinted:
        k = fwd.producer.get(t)
        if k is None:
            raise KilnError(f"{where}: its forward graph's recompute list names {t!r}, a block input or "
                            "parameter, which no op of the block computes", code="E021",
                            hint="list tensors the block's ops produce")
        if t not in produced:
            wanted.setdefault(k, []).append(t)
    need: set[str] = set()

    def read(t: str) -> None:  # reading a view reads the tensor it views
        while t and t not in need:
            need.add(t)
            k = fwd.producer.get(t)
            t = g.ops[k].inputs[0] if k is not None and fwd.alias[k] else ""

    for t in (*ctx.saves, *fwd.reads(op for rop in bound for op in rop.replay)):
        read(t)
    out = []
    for k in sorted(wanted, reverse=True):  # consumers first: what a replay reads is needed in turn
        op = g.ops[k]
        if not any(o in need for o in op.outputs if o):
            continue
        if registry is not None and registry.get_op(op.type).collective:
            raise KilnError(f"{where}: {wanted[k][0]!r} is listed for recompute, but op {op.type!r} that "
                            "produces it is a collective, never replayed", code="E021",
                            hint="save it instead")
        rep = _replay_op(op, fwd, keep, registry)
        for i in rep.inputs:
            read(i)
        out.append(RecomputeOp(wanted[k][0], rep.type, [i for i in rep.inputs if i],
                               [o for o in rep.outputs if o], rep.attrs, replay=(rep,),
                               rng=_rng((rep,), registry, where), flops=ctx.costs[k].flops))
    return out[::-1]


def _in_order(ops: Sequence[RecomputeOp]) -> list[RecomputeOp]:
    """``ops`` with each after the ops whose outputs it replays from (otherwise in the given order)."""
    unit = {o: u for u, rop in enumerate(ops) for op in rop.replay for o in op.outputs if o}
    out: list[RecomputeOp] = []
    seen: set[int] = set()

    def visit(u: int) -> None:
        seen.add(u)
        for d in sorted({unit[i] for op in ops[u].replay for i in op.inputs if i in unit}):
            if d not in seen:
                visit(d)
        out.append(ops[u])

    for u in range(len(ops)):
        if u not in seen:
            visit(u)
    return out


def _finish(ctx: BlockContext, fwd: _Forward, ops: Sequence[RecomputeOp], recomputed: set[str],
            gated: Sequence[str], training: str, *, whole_block: bool) -> BlockPlan:
    """Saved and recomputed tensors (in forward order), their bytes and the shared buffers."""
    order = {n: i for i, n in enumerate(fwd.g.decls())}
    for op in fwd.g.ops:
        for o in op.outputs:
            order.setdefault(o, len(order))
    replay_reads = fwd.reads(op for rop in ops for op in rop.replay)
    reads = set(ctx.saves) | set(replay_reads)
    kept = {t for t in reads - recomputed if t in fwd.tensors and t not in fwd.params}
    saved = sorted(kept | {fwd.root[t] for t in kept}, key=lambda t: order.get(t, 0))  # with their storage
    rec = sorted(recomputed, key=lambda t: order.get(t, 0))
    slots = {s.name: s for s in ctx.module.activations.slots}
    # the storage of a recomputed slot (a view's is its input's) is what the layers share; a slot that
    # shares_with another uses that one's storage instead (seed 000 §7)
    shared = _unique(fwd.root[t] for t in rec if t in slots and not slots[t].shares_with
                     and training in SHARING[slots[t].share_policy])
    return BlockPlan(ctx.name, ctx.layers, ops, saved, rec, FrozenDict(_bytes([*saved, *rec], fwd, ctx)),
                     gated=gated, shared=shared, whole_block=whole_block)


# ---------------------------------------------------------------------------------------------
# block and none


def closure(fwd: _Forward, need: Iterable[str], kept: set[str]) -> set[int]:
    """Indices of the forward ops to replay so that ``need`` is available from ``kept`` tensors."""
    free = kept | fwd.params | fwd.inputs
    ops: set[int] = set()
    todo = [t for t in need if t not in free]
    while todo:
        t = todo.pop()
        k = fwd.producer.get(t)
        if k is None or k in ops:
            continue
        ops.add(k)
        todo.extend(i for i in fwd.g.ops[k].inputs if i and i not in free)
    return ops


def replay_plan(ctx: BlockContext, replayed: set[int], registry: OpRegistry | None, training: str, *,
                keep: set[str] | frozenset[str] = frozenset(), whole_block: bool = False,
                variants: Mapping[int, int] | None = None) -> BlockPlan:
    """A plan replaying the forward ops ``replayed`` (and the views of what they produce), one op each;
    ``variants`` maps more forward ops to the :func:`replay_variants` entry that rebuilds part of their
    outputs (the rest are kept)."""
    assert ctx.module.forward is not None
    fwd = _Forward(ctx.module.forward, registry)
    g = fwd.g
    partial = {k: replay_variants(g.ops[k], registry)[v] for k, v in (variants or {}).items()}
    roots = {o for k in replayed for o in g.ops[k].outputs if o} - keep
    roots |= {o for op in partial.values() for o in op.outputs if o}
    recomputed = {t for t, r in fwd.root.items() if r in roots}
    where = f"block {ctx.name!r}"
    ops = []
    for k, op in enumerate(g.ops):
        if k in partial:
            rep = partial[k]
            ops.append(RecomputeOp(rep.outputs[0], rep.type, [i for i in rep.inputs if i],
                                   [o for o in rep.outputs if o], rep.attrs, replay=(rep,),
                                   rng=_rng((rep,), registry, where), flops=ctx.costs[k].flops))
        elif k in replayed or (fwd.alias[k] and op.outputs[0] in recomputed):
            rep = _replay_op(op, fwd, keep, registry)
            ops.append(RecomputeOp(op.outputs[0], op.type, [i for i in op.inputs if i],
                                   [o for o in op.outputs if o], op.attrs, replay=(rep,),
                                   rng=_rng((rep,), registry, where), flops=ctx.costs[k].flops))
    return _finish(ctx, fwd, ops, recomputed, (), training, whole_block=whole_block)


#: the options of block mode (seed 001 §2.5): granularity ``layer`` (each layer keeps its inputs) or
#: ``block`` (the stack keeps only its first layer's inputs), and whether normalizations and
#: bias-dropout-adds are replayed (True) or keep their outputs (False)
BLOCK_OPTIONS = {"granularity": ("layer", "block"), "include_layernorm": (True, False),
                 "include_bda": (True, False)}


def block_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Block mode's options from ``options`` (defaults: layer granularity, everything replayed); a bad
    value is an error naming the option and the values it takes."""
    out = {k: v[0] for k, v in BLOCK_OPTIONS.items()}
    for k, valid in BLOCK_OPTIONS.items():
        if k in options:
            v = options[k]
            if not any(v is x or (isinstance(x, str) and v == x) for x in valid):
                raise KilnError(f"recompute option {k}={v!r} is not valid in block mode; expected one of "
                                f"{', '.join(map(repr, valid))}")
            out[k] = v
    return out


def _kept_ops(fwd: _Forward, registry: OpRegistry | None, include_layernorm: bool,
              include_bda: bool) -> set[int]:
    """Forward ops whose outputs block mode keeps instead of replaying: normalizations (ops whose schema
    outputs an ``rstd``) unless ``include_layernorm``, and bias-dropout-adds (random ops and the ops that
    read their outputs) unless ``include_bda``."""
    if registry is None:
        return set()
    out: set[int] = set()
    for k, op in enumerate(fwd.g.ops):
        d = registry.get_op(op.type)
        if not include_layernorm and "rstd" in (o.strip("?*") for o in d.outputs):
            out.add(k)
        if not include_bda and d.random:  # the op and those reading its outputs (or views of them)
            out.add(k)
            made = {fwd.root[o] for o in op.outputs if o}
            out.update(j for j, other in enumerate(fwd.g.ops)
                       if not fwd.alias[j] and any(fwd.root.get(i) in made for i in other.inputs if i))
    return out


def plan_block(ctx: BlockContext, registry: OpRegistry | None, training: str,
               options: Mapping[str, Any] | None = None) -> BlockPlan:
    """Seed 001: keep the block inputs and persistent slots, replay all the rest, whole block at once.

    ``options`` (:data:`BLOCK_OPTIONS`): with granularity ``block`` the layers of a stack keep no
    carried input but the first layer's; their replays run in forward order when the stack's output
    gradient arrives, each layer's carried inputs the outputs the layer before replays. The slots'
    hints mix in: ``save=True`` slots and the forward graph's ``save`` list are kept, slots hinted
    ``memory_hint="offload"`` are offloaded."""
    assert ctx.module.forward is not None
    opts = block_options(options or {})
    fwd = _Forward(ctx.module.forward, registry)
    where = f"block {ctx.name!r}"
    cfg = ctx.module.config
    present = [s for s in ctx.module.activations.slots
               if s.condition is None or condition_holds(s.condition, cfg, f"{where}, slot {s.name!r}")]
    persistent = {n for s in present if s.save and not s.recompute
                  for n in (s.name, *s.aliases) if n in fwd.tensors} | _save_list(fwd, where)
    persistent |= {o for k in _kept_ops(fwd, registry, opts["include_layernorm"], opts["include_bda"])
                   for o in fwd.g.ops[k].outputs if o}
    kept_roots = {fwd.root[p] for p in persistent} | fwd.inputs
    stack = opts["granularity"] == "block"
    carried_out = [o for o, _ in ctx.carries]
    need = [*ctx.saves, *carried_out] if stack else list(ctx.saves)  # the next layer reads the outputs
    # ops that cannot be replayed (collectives, random ops without counter state) keep their outputs
    while True:
        keep = {t for t in fwd.tensors if fwd.root[t] in kept_roots}  # with the views of what is kept
        ops = closure(fwd, need, keep)
        stuck = {o for k in ops if registry is not None and not replayable(fwd.g.ops[k], registry)
                 for o in fwd.g.ops[k].outputs if o}
        if stuck <= kept_roots:
            break
        kept_roots |= stuck
    # the dependency graph: every replayed op reads only kept tensors, parameters or replayed outputs
    made = {o for k in ops for o in fwd.g.ops[k].outputs}
    for k in ops:
        for i in fwd.g.ops[k].inputs:
            if i and i not in made | keep | fwd.params | fwd.inputs:
                raise KilnError(f"{where}: block recompute of op #{k} ({fwd.g.ops[k]}) reads {i!r}, which is "
                                "neither kept nor replayed", code="E021")
    plan = replay_plan(ctx, ops, registry, training, keep=keep, whole_block=True)
    if stack:  # a carried input is the layer before's replayed output (the first layer's: kept)
        carried_in = {i for _, i in ctx.carries}
        plan = attrs.evolve(plan, stack=True, saved=[t for t in plan.saved if t not in carried_in])
    hinted = {n for s in present if s.memory_hint == "offload"
              for n in (s.name, *s.aliases) if n in fwd.tensors}
    return offload(ctx, plan, registry, hinted, strict=True) if hinted else plan


def offloadable(ctx: BlockContext, fwd: _Forward) -> set[str]:
    """The tensors of a block that can move to the host pool: storage an op of the block produces
    that is neither a block input nor a block output (those the layers before and after read)."""
    carried = {fwd.root[d.name] for d in fwd.g.outputs} | fwd.inputs
    return {r for r in set(fwd.root.values())
            if r in fwd.producer and r not in carried and r not in fwd.params}


def offload(ctx: BlockContext, plan: BlockPlan, registry: OpRegistry | None,
            wanted: AbstractSet[str] | None = None, *, strict: bool = False) -> BlockPlan:
    """``plan`` with the saved tensors of ``wanted`` (all that can move, when None) offloaded: each
    storage moves to the host pool with the views of it the backward reads. ``strict``: a wanted
    tensor that cannot move (a block input or output) is an error naming it."""
    assert ctx.module.forward is not None
    fwd = _Forward(ctx.module.forward, registry)
    can = offloadable(ctx, fwd)
    if strict and wanted:
        stuck = sorted(t for t in wanted if fwd.root.get(t, t) not in can and t in plan.saved)
        if stuck:
            raise KilnError(f"block {ctx.name!r}: {', '.join(map(repr, stuck))} asks for offload, but it is "
                            "the block's input or output, which the next layer reads on the device",
                            code="E021", hint="offload the tensors the block computes inside")
    roots = {fwd.root[t] for t in plan.saved if t in fwd.root and fwd.root[t] in can
             and (wanted is None or t in wanted or fwd.root[t] in wanted)}
    if not roots:
        return plan
    moved = [t for t in plan.saved if fwd.root.get(t) in roots]
    return attrs.evolve(plan, saved=[t for t in plan.saved if t not in moved], offloaded=moved)


def plan_modes(context: PlanContext, mode: str, options: Mapping[str, Any] | None = None) -> RecomputePlan:
    """The none, dsl, block and offload plans (``options``: block mode's, :data:`BLOCK_OPTIONS`)."""
    from kiln.core.plan._recompute_auto import model_bytes

    blocks = []
    hints = context.model.forward.recompute if context.model.forward is not None else ()
    if mode == "dsl" and hints:
        raise KilnError(f"model {context.model.name!r}: its forward graph's recompute list names "
                        f"{', '.join(map(repr, hints))}, but the dsl planner recomputes tensors of repeated "
                        "blocks only", code="E021", hint="list them in the block's recompute list instead")
    for ctx in context.blocks:
        if ctx.module.forward is None:
            continue
        if not ctx.saves:  # no backward reads anything of this block (nothing trains through it)
            blocks.append(BlockPlan(ctx.name, ctx.layers))
        elif mode == "dsl":
            ops, gated = dsl_layout(ctx.module, context.training, context.globals)
            ops = _globals_read(context, ctx, ops)
            blocks.append(bind(ctx, ops, gated, context.training, context.registry))
        elif mode == "block":
            blocks.append(plan_block(ctx, context.registry, context.training, options))
        elif mode == "offload":
            blocks.append(offload(ctx, replay_plan(ctx, set(), context.registry, context.training),
                                  context.registry))
        else:
            blocks.append(replay_plan(ctx, set(), context.registry, context.training))
    layers = tuple(name for name, _ in context.layer_chain())
    none = RecomputePlan(blocks=[replay_plan(c, set(), None, context.training) for c in context.blocks
                                 if c.module.forward is not None], layers=layers)
    plan = RecomputePlan(mode, context.training, blocks=blocks, layers=layers)
    return attrs.evolve(plan, reference_bytes=model_bytes(context, none),
                        planned_bytes=model_bytes(context, plan))


def global_inputs(context: PlanContext, block: str) -> dict[str, str]:
    """Tensors of the model's graph that every layer of ``block`` reads, and the block input each reaches
    it as: what a ``call`` of the block passes past its carried inputs (those the layer before returns)."""
    g, callee = context.model.forward, context.block(block).module.forward
    out: dict[str, str] = {}
    if g is None or callee is None:
        return out
    carried = min(len(callee.inputs), len(callee.outputs))
    for op in g.ops:
        if op.type == "call" and op.attrs.get("module") == block:
            for d, t in zip(callee.inputs[carried:], op.inputs[carried:], strict=False):
                out.setdefault(t, d.name)
    return out


def _globals_read(context: PlanContext, ctx: BlockContext, ops: Sequence[RecomputeOp]) -> list[RecomputeOp]:
    """Each ``@global:g`` dependency resolved to the block input that carries the model's tensor ``g`` into
    every layer (recorded in ``RecomputeOp.globals``): the replay reads it there. A global the block does
    not receive cannot be read by a replay: E021, naming it."""
    reach = global_inputs(context, ctx.name)
    optional = {d[9:] for s in ctx.module.activations.slots for d in s.recompute_from
                if d.startswith("?@global:")}
    out = []
    for rop in ops:
        wanted = [g for i in rop.inputs if i.startswith("@global:")
                  and ((g := i.removeprefix("@global:")) in reach or g not in optional)]
        rop = attrs.evolve(rop, inputs=[i for i in rop.inputs
                                        if not i.startswith("@global:") or i[8:] in wanted])
        missing = [g for g in wanted if g not in reach]
        if missing:
            raise KilnError(f"block {ctx.name!r}: recompute op {rop.name!r} is recomputed from "
                            f"{', '.join(repr('@global:' + g) for g in missing)}, a tensor of the model's "
                            "graph that the block does not receive, so its replay cannot read it",
                            code="E021", hint="pass it to the block (an input of its call), or drop it")
        out.append(attrs.evolve(rop, globals=FrozenDict({g: reach[g] for g in wanted})) if wanted else rop)
    return out


def check_plan(plan: RecomputePlan, context: PlanContext) -> None:
    """A plan from a plugin must name known blocks and replay only what a block's forward can compute."""
    for b in plan.blocks:
        ctx = context.block(b.module)
        assert ctx.module.forward is not None
        fwd = _Forward(ctx.module.forward, context.registry)
        made: set[str] = set()
        for rop in b.ops:
            for op in rop.replay:
                if context.registry is not None:
                    context.registry.get_op(op.type)
                for i in op.inputs:
                    if i and i not in fwd.tensors and i not in made:
                        raise KilnError(f"block {b.module!r}: recompute op {rop.name!r} replays {op.type!r} "
                                        f"reading {i!r}, which is not a tensor of the block", code="E021")
                made.update(o for o in op.outputs if o)
        can = offloadable(ctx, fwd)
        stuck = [t for t in b.offloaded if fwd.root.get(t) not in can]
        if stuck:
            raise KilnError(f"block {b.module!r}: {', '.join(map(repr, stuck))} marked offloaded, but only "
                            "tensors the block computes that are not its output can move to the host",
                            code="E021")
        missing = [t for t in b.recomputed if t not in made]
        if missing:
            raise KilnError(f"block {b.module!r}: {', '.join(map(repr, missing))} marked recomputed but no "
                            "op of the plan produces them", code="E021")
