"""The auto planner: every (saved bytes, recomputed FLOPs) trade-off of a block, exactly.

Per block, tensors that share storage (a view and its input) are one *root*. The backward needs a
set of roots; each must be kept from the forward or rebuilt by replaying its producer, whose own
inputs then must be kept or rebuilt in turn. Walking the forward ops last to first, a root is
decided once every op that could read it has been: the state is the set of earlier roots a replay
still needs (plus which carried block outputs are kept), so a dynamic program over those states
with a Pareto list of (bytes, FLOPs) per state yields every optimal plan at once. A block input
carried from the previous layer's output is the same storage as that output: it is counted once.

Replaying a matmul-class op is considered only below the smallest budget reachable without one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kiln.core._errors import KilnError
from kiln.core.ops._ops import OpRegistry
from kiln.core.plan._recompute import _Forward, replay_plan, replay_variants, replayable
from kiln.core.plan.recompute import BlockContext, BlockPlan, ParetoPoint, PlanContext, RecomputePlan

# (bytes, FLOPs, cost bytes, replayed op positions as a bit mask)
_Pt = tuple[int, float, float, int]


class _Block:
    """One block as the dynamic program sees it: roots as bits, ops as bit masks."""

    def __init__(self, ctx: BlockContext, registry: OpRegistry | None) -> None:
        assert ctx.module.forward is not None
        fwd = _Forward(ctx.module.forward, registry)
        self.ctx, self.fwd = ctx, fwd
        roots = sorted({r for r in fwd.root.values() if r not in fwd.params},
                       key=lambda r: (r not in fwd.inputs, fwd.producer.get(r, -1), r))
        self.bit = {r: 1 << i for i, r in enumerate(roots)}
        self.size = [int(ctx.sizes.get(r, 0)) for r in roots]
        self.inputs = self.mask(fwd.inputs)
        self.needed = self.mask(fwd.root[t] for t in ctx.saves if t in fwd.root)
        self.ops: list[int] = []  # forward op index per position
        self.outs: list[int] = []
        self.ins: list[int] = []
        self.can: list[bool] = []
        self.matmul: list[bool] = []
        self.cost: list[tuple[float, float]] = []
        #: per position, (outputs rebuilt, roots read) of each replay variant of the op
        self.variants: list[list[tuple[int, int]]] = []
        for k, op in enumerate(fwd.g.ops):
            if fwd.alias[k]:
                continue
            self.ops.append(k)
            outs = self.mask(o for o in op.outputs if o)
            self.outs.append(outs)
            self.ins.append(self.mask(fwd.root[i] for i in op.inputs if i))
            self.can.append(registry is None or replayable(op, registry))
            # flop-heavy ops (matmuls, attention) are replayed only when the budget forces it
            self.matmul.append(registry is not None and op.type in registry
                               and registry.get_op(op.type).flop_heavy)
            self.cost.append((ctx.costs[k].flops, ctx.costs[k].bytes))
            self.variants.append([(self.mask(o for o in v.outputs if o) & outs,
                                   self.mask(fwd.root[i] for i in v.inputs if i))
                                  for v in replay_variants(op, registry)])
        self.n_variants = max((len(v) for v in self.variants), default=0)
        self.carry_out = [self.bit.get(fwd.root[out], 0) for out, _ in ctx.carries]
        self.carry_in = [self.bit.get(fwd.root[inp], 0) for _, inp in ctx.carries]
        self.carry_size = [int(ctx.sizes.get(inp, 0)) for _, inp in ctx.carries]
        self.outs_carried = sum(self.carry_out)
        self.ins_carried = sum(self.carry_in)

    def mask(self, names: Iterable[str]) -> int:
        m = 0
        for n in names:
            m |= self.bit.get(n, 0)  # parameters have no bit: they are always at hand
        return m

    def bytes_of(self, mask: int) -> int:
        total, i = 0, 0
        while mask:
            if mask & 1:
                total += self.size[i]
            mask >>= 1
            i += 1
        return total

    def carried(self, kept: int) -> tuple[int, int]:
        """(bytes per layer, bytes once) of the carried inputs in ``kept``: an input is the previous
        layer's output, so it costs nothing more when that output is kept too, except that the stack then
        holds one more of them (its first input and its last output)."""
        per_layer = once = 0
        for bit_in, bit_out, size in zip(self.carry_in, self.carry_out, self.carry_size, strict=True):
            if kept & bit_in:
                if kept & bit_out:
                    once += size
                else:
                    per_layer += size
        return per_layer, once

    def model_bytes(self, kept: int) -> int:
        """Saved bytes of all layers when each keeps the roots ``kept`` (other inputs are model inputs)."""
        per_layer, once = self.carried(kept)
        return self.ctx.layers * (self.bytes_of(kept & ~self.inputs) + per_layer) + once


def _prune(points: list[_Pt]) -> list[_Pt]:
    """The Pareto points: sorted by bytes, each strictly cheaper than all that keep fewer bytes."""
    points.sort()
    out: list[_Pt] = []
    for p in points:
        if not out or (p[1], p[2]) < (out[-1][1], out[-1][2]):
            out.append(p)
    return out


def block_front(b: _Block, allow_matmul: bool) -> list[_Pt]:
    """Every Pareto-optimal plan of a block: (saved bytes of its layers, FLOPs, cost bytes, replayed).

    ``replayed`` has bit ``pos`` for an op replayed whole and bit ``pos + (v + 1) * len(b.ops)`` for
    one rebuilt by its replay variant ``v`` (the outputs it does not rebuild, and those it reads, kept).
    """
    n = len(b.ops)
    # state: (roots a replay still needs, carried outputs kept) -> points (bytes per layer so far, ...)
    states: dict[tuple[int, int], list[_Pt]] = {(0, 0): [(0, 0.0, 0.0, 0)]}
    for pos in reversed(range(len(b.ops))):
        outs, ins = b.outs[pos], b.ins[pos]
        can = b.can[pos] and (allow_matmul or not b.matmul[pos])
        f0, c0 = b.cost[pos]
        new: dict[tuple[int, int], list[_Pt]] = {}
        for (req, kout), pts in states.items():
            q = outs & (b.needed | req)
            rest = req & ~outs
            if not q:
                new.setdefault((rest, kout), []).extend(pts)
                continue
            kb = b.bytes_of(q)  # keep the outputs needed
            kept = new.setdefault((rest, kout | q & b.outs_carried), [])
            kept.extend((m + kb, f, c, r) for m, f, c, r in pts)
            if can:  # or replay the op: its inputs are needed in turn
                bit = 1 << pos
                new.setdefault((rest | (ins & ~b.needed), kout), []).extend(
                    (m, f + f0, c + c0, r | bit) for m, f, c, r in pts)
                for v, (made, reads) in enumerate(b.variants[pos]):  # or rebuild part of them from the rest
                    if not q & made:
                        continue
                    held = (q & ~made) | (reads & outs)
                    vb, bit = b.bytes_of(held), 1 << (pos + (v + 1) * n)
                    state = (rest | (reads & ~outs & ~b.needed), kout | held & b.outs_carried)
                    new.setdefault(state, []).extend((m + vb, f + f0, c + c0, r | bit) for m, f, c, r in pts)
        states = {k: _prune(v) for k, v in new.items()}
    layers = b.ctx.layers
    out: list[_Pt] = []
    for (req, kout), pts in states.items():
        per_layer, once = b.carried(((b.needed | req) & b.ins_carried) | kout)
        out += [(layers * (m + per_layer) + once, layers * f, layers * c, r) for m, f, c, r in pts]
    return _prune(out)


def _combine(fronts: Sequence[list[_Pt]], fixed: int) -> list[tuple[int, float, float, tuple[int, ...]]]:
    """The Pareto points of the model: one point per block, bytes and costs added."""
    acc: list[tuple[int, float, float, tuple[int, ...]]] = [(fixed, 0.0, 0.0, ())]
    for front in fronts:
        merged = sorted(((m + m2, f + f2, c + c2, (*r, r2)) for m, f, c, r in acc
                         for m2, f2, c2, r2 in front), key=lambda p: (p[0], p[1], p[2]))
        acc = []
        for p in merged:
            if not acc or (p[1], p[2]) < (acc[-1][1], acc[-1][2]):
                acc.append(p)
    return acc


def _blocks(context: PlanContext) -> list[_Block]:
    return [_Block(c, context.registry) for c in context.blocks if c.module.forward is not None]


def model_front(context: PlanContext, allow_matmul: bool | None) -> list[ParetoPoint]:
    blocks = _blocks(context)

    def front(mm: bool) -> list[ParetoPoint]:
        out = []
        for m, f, c, masks in _combine([block_front(b, mm) for b in blocks], context.fixed_bytes):
            positions = [(b, [p for p in range(len(b.ops)) if r >> p & 1])
                         for b, r in zip(blocks, masks, strict=True)]
            replayed = tuple(frozenset(b.ops[p] for p in ps) for b, ps in positions)
            variants = tuple(tuple((b.ops[p], v) for v in range(b.n_variants) for p in range(len(b.ops))
                                   if r >> (p + (v + 1) * len(b.ops)) & 1)
                             for b, r in zip(blocks, masks, strict=True))
            out.append(ParetoPoint(m, f, c, replayed, any(b.matmul[p] for b, ps in positions for p in ps),
                                   variants=variants))
        return out

    if allow_matmul is not None:
        points = front(allow_matmul)
    else:
        base = front(False)
        floor = min(p.bytes for p in base)
        points = base + [p for p in front(True) if p.bytes < floor]
    return sorted(points, key=lambda p: (-p.bytes, p.flops))


def _rank(p: ParetoPoint) -> tuple[bool, float, float, int]:
    """Preference among plans that fit: no matmul replayed, then fewest FLOPs, then fewest bytes."""
    return (p.matmul, p.flops, p.cost_bytes, p.bytes)


def _monotone(points: Sequence[ParetoPoint], peak: Callable[[ParetoPoint], int]) -> list[ParetoPoint]:
    """The points whose activation peak is no higher than that of any point keeping more bytes (walked
    from the most bytes down, a running minimum): choosing only among them, a smaller budget never
    gets a larger peak."""
    out: list[ParetoPoint] = []
    low = math.inf
    for p in sorted(points, key=lambda p: (-p.bytes, p.flops)):
        if peak(p) <= low:
            out.append(p)
            low = peak(p)
    return out


def choose(points: Sequence[ParetoPoint], budget: int,
           peak: Callable[[ParetoPoint], int] | None = None) -> ParetoPoint | None:
    """The preferred point (:func:`_rank`) that keeps at most ``budget`` saved activation bytes.

    With ``peak`` (point -> placed activation peak), only points no higher than every point keeping
    more are eligible (:func:`_monotone`): the chosen peak then never rises as the budget falls,
    and never exceeds the no-recompute one (the point keeping most, preferred whenever it fits)."""
    eligible = _monotone(points, peak) if peak is not None else list(points)
    return next((p for p in sorted(eligible, key=_rank) if p.bytes <= budget), None)


def selectable(points: Sequence[ParetoPoint]) -> list[ParetoPoint]:
    """The measured points some budget selects: eligible (:func:`_monotone`), and no eligible point
    keeping as few bytes ranks before them."""
    eligible = _monotone(points, lambda p: p.peak if p.peak is not None else p.bytes)
    return [p for p in eligible
            if not any(q is not p and q.bytes <= p.bytes and _rank(q) < _rank(p) for q in eligible)]


def model_bytes(context: PlanContext, plans: Sequence[BlockPlan]) -> int:
    """Saved activation bytes of the model under block plans, as the planner models them."""
    by_name = {p.module: p for p in plans}
    total = context.fixed_bytes
    for b in _blocks(context):
        plan = by_name.get(b.ctx.name)
        if plan is not None:
            total += b.model_bytes(b.mask(b.fwd.root[t] for t in plan.saved if t in b.fwd.root))
    return total


def plan_auto(context: PlanContext, budget: float | None, options: dict[str, Any],
              resolve: Callable[[float | None, int], int]) -> RecomputePlan:
    """The auto plan: fewest FLOPs among the Pareto points whose saved activations fit the budget.

    With ``options["measure"]`` (plan -> placed activation peak, as ``compile`` passes), a point whose
    placed peak is above that of a point keeping more is passed over (:func:`choose`)."""
    points = model_front(context, options.get("allow_matmul"))
    measure = options.get("measure")
    seen: dict[int, int] = {}

    def peak(p: ParetoPoint) -> int:
        if measure is None:
            return p.bytes
        if id(p) not in seen:
            seen[id(p)] = int(measure(to_plan(context, p)))
        return seen[id(p)]

    none = max(points, key=lambda p: (p.bytes, -p.flops))
    target = resolve(budget, none.bytes)
    best = choose(points, target, peak if measure is not None else None)
    if best is None:
        lowest = min(p.bytes for p in points)
        raise KilnError(f"no recompute plan keeps the saved activations within {target} bytes; the lowest "
                        f"auto plan keeps {lowest} of {none.bytes} without recompute",
                        hint="raise the budget, or use recompute='block'")
    return to_plan(context, best, target, none.bytes)


def to_plan(context: PlanContext, point: ParetoPoint, budget: int | None = None,
            reference: int | None = None) -> RecomputePlan:
    """The RecomputePlan of one auto point."""
    contexts = [c for c in context.blocks if c.module.forward is not None]
    variants = point.variants or tuple(() for _ in contexts)
    blocks = [replay_plan(c, set(r), context.registry, context.training, variants=dict(v))
              for c, r, v in zip(contexts, point.replayed, variants, strict=True)]
    return RecomputePlan("auto", context.training, blocks=blocks, budget=budget, reference_bytes=reference,
                         planned_bytes=point.bytes)
