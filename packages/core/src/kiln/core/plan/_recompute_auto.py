"""The auto planner: fewest recomputed FLOPs under a saved-activation budget, per layer, exactly.

Per block, tensors that share storage (a view and its input) are one *root*. The backward needs a
set of roots; each must be kept from the forward or rebuilt by replaying its producer, whose own
inputs then must be kept or rebuilt in turn. Walking the forward ops last to first, a root is
decided once every op that could read it has been: the state is the set of earlier roots a replay
still needs (plus which carried block outputs are kept), so a dynamic program over those states
with a Pareto list of (bytes, FLOPs) per state yields every optimal plan of one layer at once.

The model's layers then each take a point of their block's front: a second dynamic program walks
them in forward order, its state the carried outputs the layer before keeps, since a layer's carried
input is that same storage (counted once). Layers of one block may so take different plans; those
that take the same form one layer group of the plan.

Replaying a matmul-class op is considered only below the smallest budget reachable without one.

An op's price is its FLOPs, or under the measured cost model (:mod:`kiln.core.plan._calibrate`, the
default when ``compile`` made the context) its kernel's calibrated seconds on this machine in
FLOP-equivalents (times the calibration's matmul rate): a norm or an activation then costs what its
memory traffic takes, not its few FLOPs.

With offload allowed (a price per byte moved), a root may also be copied to the host pool instead of
kept: it costs no saved bytes and ``price * 2 * bytes`` (out and back) on the FLOPs axis.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import attrs
import numpy as np

from kiln.core._errors import KilnError
from kiln.core.ops._ops import OpRegistry
from kiln.core.plan._calibrate import Calibration, calibration_for, cost_mode
from kiln.core.plan._recompute import _Forward, offload, offloadable, replay_plan, replay_variants, replayable
from kiln.core.plan.recompute import BlockContext, ParetoPoint, PlanContext, RecomputePlan

# (bytes, FLOPs, cost bytes, replayed op positions as a bit mask)
_Pt = tuple[int, float, float, int]
#: per block, the price of each forward op (FLOP-equivalents); None: its FLOPs
Prices = Mapping[str, Sequence[float]] | None


class _Block:
    """One block as the dynamic program sees it: roots as bits, ops as bit masks."""

    def __init__(self, ctx: BlockContext, registry: OpRegistry | None,
                 prices: Sequence[float] | None = None) -> None:
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
            self.cost.append((ctx.costs[k].flops if prices is None else prices[k], ctx.costs[k].bytes))
            self.variants.append([(self.mask(o for o in v.outputs if o) & outs,
                                   self.mask(fwd.root[i] for i in v.inputs if i))
                                  for v in replay_variants(op, registry)])
        self.n_variants = max((len(v) for v in self.variants), default=0)
        #: per position, whether the op's outputs may move to the host pool
        can_move = offloadable(ctx, fwd)
        self.movable = [all(fwd.root[o] in can_move for o in fwd.g.ops[k].outputs if o) for k in self.ops]
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

    def signature(self, kept: int) -> tuple[int, int]:
        """(carried inputs, carried outputs) among the roots ``kept``, as masks over ``ctx.carries``."""
        kin = sum(1 << j for j, bit in enumerate(self.carry_in) if kept & bit)
        return kin, sum(1 << j for j, bit in enumerate(self.carry_out) if kept & bit)

    def input_bytes(self, kin: int, sources: Sequence[int], before: int) -> int:
        """Bytes of the carried inputs ``kin`` a layer keeps, less those the layer before keeps as its
        outputs (``before``; ``sources``: which of its outputs each input is, -1 for none): one storage."""
        return sum(size for j, size in enumerate(self.carry_size)
                   if kin >> j & 1 and not (sources[j] >= 0 and before >> sources[j] & 1))


def _prune(points: list[_Pt]) -> list[_Pt]:
    """The Pareto points: sorted by bytes, each strictly cheaper than all that keep fewer bytes."""
    points.sort(key=lambda p: (p[0], p[1], p[2]))
    out: list[_Pt] = []
    for p in points:
        if not out or (p[1], p[2]) < (out[-1][1], out[-1][2]):
            out.append(p)
    return out


def block_front(b: _Block, allow_matmul: bool, offload_cost: float | None = None
                ) -> dict[tuple[int, int], list[_Pt]]:
    """Every Pareto-optimal plan of one layer of a block, per signature (:meth:`_Block.signature`: the
    carried inputs and outputs it keeps, whose bytes depend on its neighbours): (bytes of the other
    roots it keeps, FLOPs, cost bytes, replayed).

    ``replayed`` has bit ``pos`` for an op replayed whole and bit ``pos + (v + 1) * len(b.ops)`` for
    one rebuilt by its replay variant ``v`` (the outputs it does not rebuild, and those it reads, kept),
    and bit ``pos + (b.n_variants + 1) * len(b.ops)`` for one whose outputs are offloaded (with
    ``offload_cost``, FLOPs per byte moved: they cost no bytes, and that price for the copy out and back).
    """
    n = len(b.ops)
    # state: (roots a replay still needs, carried outputs kept) -> points (bytes so far, ...)
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
            if offload_cost is not None and b.movable[pos]:  # or move them to the host and back
                moved, bit = 2 * kb, 1 << (pos + (b.n_variants + 1) * n)
                new.setdefault((rest, kout), []).extend(
                    (m, f + offload_cost * moved, c + moved, r | bit) for m, f, c, r in pts)
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
    out: dict[tuple[int, int], list[_Pt]] = {}
    for (req, kout), pts in states.items():
        out.setdefault(b.signature(((b.needed | req) & b.ins_carried) | kout), []).extend(pts)
    return {sig: _prune(pts) for sig, pts in out.items()}


#: model plans kept per state and layer by the walk along the layers: a longer Pareto list is thinned
#: evenly by rank, its ends kept (so the fewest bytes stay exact; the walk is exact while no list is longer)
_MAX_POINTS = 256
#: the most plans the layers of one block take by default (option ``layer_groups``)
LAYER_GROUPS = 3


def _pareto(nbytes: np.ndarray, flops: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """Indices of the Pareto points, by bytes: each with fewer FLOPs than every point keeping fewer bytes;
    thinned to :data:`_MAX_POINTS`."""
    order = np.lexsort((cost, flops, nbytes))
    f = flops[order]
    keep = order[f < np.minimum.accumulate(np.concatenate(([np.inf], f[:-1])))]
    if len(keep) > _MAX_POINTS:
        keep = keep[np.unique(np.linspace(0, len(keep) - 1, _MAX_POINTS).round().astype(np.int64))]
    return keep


def _blocks(context: PlanContext, prices: Prices = None) -> dict[str, _Block]:
    return {c.name: _Block(c, context.registry, None if prices is None else prices.get(c.name))
            for c in context.blocks if c.module.forward is not None}


#: a layer's plan as a point names it: (forward ops replayed whole, (op, replay variant) pairs, forward
#: ops whose outputs are offloaded)
_Choice = tuple[frozenset[int], tuple[tuple[int, int], ...], frozenset[int]]


def _front(context: PlanContext, blocks: Mapping[str, _Block], allow_matmul: bool,
           only: Mapping[str, AbstractSet[_Choice]] | None = None,
           offload_cost: float | None = None) -> list[ParetoPoint]:
    """The model's Pareto points, each layer taking its own point of its block's front (of those in
    ``only``, where given): a dynamic program along the layers in forward order whose state is the
    carried outputs the layer before keeps (a layer's carried input is that storage, counted once)."""
    chain = context.layer_chain()
    # per block, every plan of one layer: (bytes of the roots it keeps but its inputs, FLOPs, cost bytes,
    # carried inputs kept, carried outputs kept, replayed)
    options = {name: [(m, f, c, kin, kout, r)
                      for (kin, kout), pts in block_front(b, allow_matmul, offload_cost).items()
                      for m, f, c, r in pts] for name, b in blocks.items()}
    decoded = {name: [_decode(blocks[name], o[5]) for o in opts] for name, opts in options.items()}
    if only is not None:
        for name in options:
            pick = [k for k, d in enumerate(decoded[name]) if d[:3] in only.get(name, ())]
            options[name], decoded[name] = [options[name][k] for k in pick], [decoded[name][k] for k in pick]
    cols = {name: [np.array(col) for col in zip(*opts, strict=True)] for name, opts in options.items()}
    nbytes, flops, cost = np.array([float(context.fixed_bytes)]), np.zeros(1), np.zeros(1)
    kout = np.zeros(1, dtype=np.int64)
    steps: list[tuple[np.ndarray, np.ndarray]] = []  # per layer: (row of the layer before, option) per row
    for name, sources in chain:
        b = blocks[name]
        m, f, c, kin, out, _ = cols[name]
        extra = np.zeros((len(nbytes), len(m)))
        for j, size in enumerate(b.carry_size):
            shared = (kout[:, None] >> sources[j]) & 1 if sources[j] >= 0 else 0
            extra += size * ((kin[None, :] >> j) & 1) * (1 - shared)
        rows, opt = (x.ravel() for x in np.meshgrid(np.arange(len(nbytes)), np.arange(len(m)), indexing="ij"))
        cand = (nbytes[rows] + m[opt] + extra.ravel(), flops[rows] + f[opt], cost[rows] + c[opt])
        keep = np.concatenate([sel[_pareto(*(x[sel] for x in cand))]
                               for state in np.unique(out) for sel in [np.flatnonzero(out[opt] == state)]])
        nbytes, flops, cost = (x[keep] for x in cand)
        kout = out[opt[keep]]
        steps.append((rows[keep], opt[keep]))
    final = _pareto(nbytes, flops, cost)
    picks = np.zeros((len(final), len(chain)), dtype=np.int64)
    at = final
    for p in reversed(range(len(chain))):
        picks[:, p] = steps[p][1][at]
        at = steps[p][0][at]
    out_points = []
    for x, row in zip(final, picks, strict=True):
        layers = [decoded[name][o] for (name, _), o in zip(chain, row, strict=True)]
        out_points.append(ParetoPoint(int(nbytes[x]), float(flops[x]), float(cost[x]),
                                      tuple(r for r, _, _, _ in layers), any(mm for *_, mm in layers),
                                      variants=tuple(v for _, v, _, _ in layers),
                                      offloaded=tuple(o for _, _, o, _ in layers)))
    return out_points


def _decode(b: _Block, r: int) -> tuple[frozenset[int], tuple[tuple[int, int], ...], frozenset[int], bool]:
    """A layer's replayed bit mask as (forward ops replayed whole, (op, variant) pairs, forward ops whose
    outputs are offloaded, whether any replayed op is matmul-class)."""
    n = len(b.ops)
    whole = frozenset(b.ops[p] for p in range(n) if r >> p & 1)
    variants = tuple((b.ops[p], v) for v in range(b.n_variants) for p in range(n)
                     if r >> (p + (v + 1) * n) & 1)
    moved = frozenset(b.ops[p] for p in range(n) if r >> (p + (b.n_variants + 1) * n) & 1)
    matmul = any(b.matmul[p] for p in range(n) if any(r >> (p + v * n) & 1 for v in range(b.n_variants + 1)))
    return whole, variants, moved, matmul


def model_front(context: PlanContext, allow_matmul: bool | None,
                offload_cost: float | None = None, prices: Prices = None) -> list[ParetoPoint]:
    blocks = _blocks(context, prices)
    if allow_matmul is not None:
        points = _front(context, blocks, allow_matmul, offload_cost=offload_cost)
    else:
        base = _front(context, blocks, False, offload_cost=offload_cost)
        floor = min(p.bytes for p in base)
        points = base + [p for p in _front(context, blocks, True, offload_cost=offload_cost)
                         if p.bytes < floor]
    return sorted(points, key=lambda p: (-p.bytes, p.flops))


def _grouped(context: PlanContext, point: ParetoPoint, budget: int, groups: int,
             offload_cost: float | None = None, prices: Prices = None) -> ParetoPoint:
    """``point`` where each block's layers take at most ``groups`` plans; else the plan with the fewest
    FLOPs within ``budget`` whose blocks' layers take at most ``groups`` of the plans ``point`` gives
    them: those it gives most layers, or the ones recomputing most and least with those it gives most
    layers, or the one recomputing most alone (``point`` itself if none fits)."""
    blocks = _blocks(context, prices)
    used: dict[str, Counter[_Choice]] = {}
    variants = point.variants or tuple(() for _ in point.replayed)
    moved = point.offloaded or tuple(frozenset() for _ in point.replayed)
    for (name, _), r, v, o in zip(context.layer_chain(), point.replayed, variants, moved, strict=True):
        used.setdefault(name, Counter())[(r, v, o)] += 1
    if all(len(c) <= groups for c in used.values()):
        return point

    def most(c: Counter[_Choice], n: int) -> set[_Choice]:
        return {k for k, _ in c.most_common(max(n, 0))}

    def by_flops(name: str) -> list[_Choice]:  # the plans recomputing least first
        costs = blocks[name].ctx.costs
        return sorted(used[name], key=lambda ch: sum(costs[k].flops for k in {*ch[0], *dict(ch[1])}))

    tries = [{name: most(c, groups) for name, c in used.items()},
             {name: {by_flops(name)[-1], *by_flops(name)[:min(groups - 1, 1)], *most(c, groups - 2)}
              for name, c in used.items()},
             {name: {by_flops(name)[-1]} for name in used}]
    for only in tries:
        fits = [p for p in _front(context, blocks, point.matmul, only, offload_cost) if p.bytes <= budget]
        if fits:
            return min(fits, key=_rank)
    return point


def model_bytes(context: PlanContext, plan: RecomputePlan) -> int:
    """Saved activation bytes of the model under ``plan``, as the planner models them."""
    blocks = _blocks(context)
    total, before = context.fixed_bytes, 0
    for i, (name, sources) in enumerate(context.layer_chain()):
        b, bp = blocks[name], plan.block(name, i)
        kept = b.mask(b.fwd.root[t] for t in bp.saved if t in b.fwd.root) if bp is not None else 0
        kin, kout = b.signature(kept)
        total += b.bytes_of(kept & ~b.inputs) + b.input_bytes(kin, sources, before)
        before = kout
    return total


def _rank(p: ParetoPoint) -> tuple[float, float, int]:
    """Preference among plans that fit: fewest FLOPs, then fewest bytes moved, then fewest kept."""
    return (p.flops, p.cost_bytes, p.bytes)


def plan_auto(context: PlanContext, budget: float | None, options: dict[str, Any],
              resolve: Callable[[float | None, int], int]) -> RecomputePlan:
    """The auto plan: fewest FLOPs among the points whose saved activations fit the budget and, with
    ``options["peak_budget"]``, whose activation peak (``options["measure"]``, plan -> placed peak, as
    ``compile`` passes) fits that; a block's layers take at most ``options["layer_groups"]`` plans."""
    allow = options.get("allow_matmul")
    price = offload_price(options)
    prices, calibration = measured_prices(context, options)
    points = model_front(context, allow, price, prices)
    # without recompute (nor offload, which may make keeping everything a dominated point)
    keep_all = [replay_plan(c, set(), None, context.training) for c in context.blocks
                if c.module.forward is not None]
    none_bytes = model_bytes(context, RecomputePlan(blocks=keep_all,
                                                    layers=tuple(name for name, _ in context.layer_chain())))
    target = resolve(budget, none_bytes)
    # by default a plan replaying matmul-class ops is taken only where no plan without them fits
    fits = sorted((p for p in points if p.bytes <= target),
                  key=lambda p: (allow is None and p.matmul, *_rank(p)))
    if not fits:
        lowest = min(p.bytes for p in points)
        how = " without replaying matmul-class ops" if allow is False else ""
        raise KilnError(f"no recompute plan keeps the saved activations within {target} bytes: the least any "
                        f"plan keeps{how} is {lowest} bytes ({none_bytes} without recompute)",
                        hint=f"raise the budget to at least {lowest} bytes, or use recompute='block'")
    groups = int(options.get("layer_groups", LAYER_GROUPS))
    if groups < 1:
        raise KilnError(f"recompute option layer_groups={groups} is not valid; expected at least 1 (1: every "
                        "layer of a block takes the same plan)")
    best = _grouped(context, fits[0], target, groups, price, prices)
    peak_budget = options.get("peak_budget")
    if peak_budget is not None:
        measure = options.get("measure")
        if measure is None:
            raise KilnError(f"recompute option peak_budget={peak_budget!r} needs option 'measure' (plan -> "
                            "activation peak), which compile passes")
        peaks: list[int] = []
        for p in fits:  # fewest FLOPs first: the first whose placed peak fits
            p = _grouped(context, p, target, groups, price, prices)
            peaks.append(int(measure(to_plan(context, p))))
            if peaks[-1] <= peak_budget:
                best = p
                break
        else:
            raise KilnError(f"no recompute plan within {target} saved bytes keeps the activation peak within "
                            f"{peak_budget} bytes; the lowest peak among them is {min(peaks)} bytes",
                            hint="raise peak_budget or lower the saved-activation budget")
    plan = to_plan(context, best, target, none_bytes)
    if calibration is None:
        return plan
    return attrs.evolve(plan, cost="measured", predicted_seconds=best.flops / calibration.rate)


def measured_prices(context: PlanContext, options: Mapping[str, Any]) -> tuple[Prices, Calibration | None]:
    """Per block, the price of each forward op under the measured cost model (:mod:`._calibrate`): its
    calibrated seconds times the calibration's matmul rate, in FLOP-equivalents; (None, None) where
    recompute is priced by FLOPs (option ``cost="flops"``, ``$KILN_RECOMPUTE_COST=flops``, or a context
    made without a compile target, or one for a backend not on the host, such as ``cuda``). Option
    ``cost`` may also be a :class:`Calibration` itself."""
    given = options.get("cost")
    cal = given if isinstance(given, Calibration) else None
    mode = "measured" if cal is not None else cost_mode(given)
    target = context.target
    if mode == "flops" or not any(c.probes for c in context.blocks) or (cal is None and target is None):
        return None, None
    if cal is None and getattr(target.backend, "device", "cpu") != "cpu":
        return None, None  # its kernels do not run on this host's arrays: FLOPs it is
    if cal is None:
        probes = [p for c in context.blocks for p in c.probes]
        cal = calibration_for(probes, backend=target.backend.name, dtype=target.dtype, kernels=target.kernels,
                              registry=context.registry)
    return {c.name: [cal.seconds(p) * cal.rate for p in c.probes] for c in context.blocks if c.probes}, cal


def to_plan(context: PlanContext, point: ParetoPoint, budget: int | None = None,
            reference: int | None = None) -> RecomputePlan:
    """The RecomputePlan of one auto point: one BlockPlan per block, or per layer group where the
    block's layers take different plans."""
    chain = context.layer_chain()
    variants = point.variants or tuple(() for _ in chain)
    moved = point.offloaded or tuple(frozenset() for _ in chain)
    groups: dict[tuple[str, frozenset[int], tuple[tuple[int, int], ...], frozenset[int]], list[int]] = {}
    for i, ((name, _), r, v, o) in enumerate(zip(chain, point.replayed, variants, moved, strict=True)):
        groups.setdefault((name, r, v, o), []).append(i)
    blocks = []
    for c in context.blocks:
        mine = [(r, v, o, ids) for (name, r, v, o), ids in groups.items() if name == c.name]
        for r, v, o, ids in mine:
            plan = replay_plan(c, set(r), context.registry, context.training, variants=dict(v))
            if o:
                assert c.module.forward is not None
                ops = c.module.forward.ops
                plan = offload(c, plan, context.registry, {t for k in o for t in ops[k].outputs if t})
            blocks.append(attrs.evolve(plan, layers=len(ids), layer_ids=ids if len(mine) > 1 else ()))
    return RecomputePlan("auto", context.training, blocks=blocks, budget=budget, reference_bytes=reference,
                         planned_bytes=point.bytes, layers=tuple(name for name, _ in chain))


#: the default price of offload in the auto planner, in FLOPs per byte moved (out and back each count):
#: a device computing about 1000 times more FLOPs per second than bytes it moves to the host
OFFLOAD_COST = 1000.0


def offload_price(options: Mapping[str, Any]) -> float | None:
    """The auto planner's price of offload (FLOPs per byte moved) from ``options``: ``offload`` (False by
    default; True allows it) and ``offload_cost`` (a number >= 0, :data:`OFFLOAD_COST` by default).
    None: offload is not allowed."""
    allow, cost = options.get("offload", False), options.get("offload_cost")
    if not isinstance(allow, bool):
        raise KilnError(f"recompute option offload={allow!r} is not valid; expected True or False")
    if cost is not None and (isinstance(cost, bool) or not isinstance(cost, (int, float)) or not cost >= 0):
        raise KilnError(f"recompute option offload_cost={cost!r} is not valid; expected FLOPs per byte "
                        "moved, a number >= 0")
    if not allow:
        if cost is not None:
            raise KilnError("recompute option offload_cost is given but offload is not allowed",
                            hint="add recompute option offload=True")
        return None
    return float(OFFLOAD_COST if cost is None else cost)
