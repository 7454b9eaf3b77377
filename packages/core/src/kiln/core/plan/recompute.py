"""The recompute planner: which forward activations the backward reads saved, which it recomputes.

One plan type, :class:`RecomputePlan`, for every mode:

- ``"none"``: everything the backward reads is saved;
- ``"dsl"``: from the activation-slot hints of each block (seed 000 §4.1);
- ``"auto"``: from the forward and backward graphs under a memory budget, minimising the FLOPs
  recomputed (exact dynamic programs over the block's ops and the model's layers, see :func:`pareto`);
- ``"block"``: keep only each block's inputs and its persistent slots and replay the whole block
  when its output gradient arrives (seed 001);
- ``"offload"``: recompute nothing; copy every saved activation of each block that can move to a
  host pool after its last forward use and back before its first backward use (seed 000 §4.2).

Offload is a third choice beside keep and recompute in every mode: the dsl planner offloads the
slots whose ``memory_hint`` is ``"offload"``, and the auto planner weighs it against recompute by
the bytes it transfers when its option ``offload`` allows it.

A plugin may replace the planner through the ``kiln_plan_recompute`` hook (first result wins).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from attrs import field

from kiln.core._errors import KilnError, PluginError
from kiln.core.ir._ir import FrozenDict, Module, Op
from kiln.core.ops._ops import Cost, OpRegistry
from kiln.core.plan._calibrate import Calibration
from kiln.core.plan._calibrate import predict as predict_step

__all__ = [
    "MODES",
    "BlockContext",
    "BlockPlan",
    "Calibration",
    "ParetoPoint",
    "PlanContext",
    "RecomputeOp",
    "RecomputePlan",
    "layout_ops",
    "pareto",
    "parse_budget",
    "plan_context",
    "plan_recompute",
    "policy_active",
    "predict_step",
]

MODES = ("none", "dsl", "auto", "block", "offload")
#: the options kiln's planner takes per mode (``measure``, the placed peak of a plan, comes from ``compile``)
OPTIONS: dict[str, tuple[str, ...]] = {
    "none": (), "dsl": (), "offload": (),
    "auto": ("allow_matmul", "peak_budget", "layer_groups", "offload", "offload_cost", "cost"),
    "block": ("granularity", "include_layernorm", "include_bda"),
}
DEFAULT_AUTO_FRACTION = 0.5


def policy_active(policy: str, training: str) -> bool:
    """Whether a slot with recompute ``policy`` (``always``, ``lora_only``, ``fft_only``, ``never``) is
    recomputed when training in ``training`` mode (``full`` or ``lora``)."""
    return policy == "always" or (policy == "lora_only" and training == "lora") or (
        policy == "fft_only" and training == "full")


def _ops(v: Sequence[Op]) -> tuple[Op, ...]:
    return tuple(v)


def _rops(v: Sequence[RecomputeOp]) -> tuple[RecomputeOp, ...]:
    return tuple(v)


def _blocks(v: Sequence[BlockPlan]) -> tuple[BlockPlan, ...]:
    return tuple(v)


def _strs(v: Sequence[str]) -> tuple[str, ...]:
    return tuple(v)


def _ints(v: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(i) for i in v)


@attrs.frozen
class RecomputeOp:
    """One recompute step of a block: the op the plan declares and the forward ops replayed for it.

    ``op_type``, ``inputs``, ``outputs``, ``attrs``, ``policy`` and ``lora_targets`` are what the
    slots declare (dsl) or the forward op itself (auto, block). ``replay`` is what the runtime runs:
    forward IR ops of the block with their own kernels and attributes (a ``*_apply_saved`` variant
    where the plan keeps a statistic such as an rstd), in forward order, so a recomputed tensor is
    bitwise the forward one. LoRA contributions are forward ops, so they are replayed too.
    ``rng`` holds, per random op output, the counter state its replay reuses (``seed``, ``offset``).
    ``globals``: per ``@global:`` dependency, the block input that carries that tensor of the model's
    graph into each layer, where the replay reads it.
    """

    name: str
    op_type: str | None
    inputs: tuple[str, ...] = field(converter=_strs)
    outputs: tuple[str, ...] = field(converter=_strs)
    attrs: FrozenDict = field(factory=FrozenDict)
    policy: str = "always"
    lora_targets: tuple[str, ...] = field(default=(), converter=_strs)
    replay: tuple[Op, ...] = field(default=(), converter=_ops)
    rng: FrozenDict = field(factory=FrozenDict)
    flops: float = 0.0
    globals: FrozenDict = field(factory=FrozenDict)

    def __str__(self) -> str:
        return (f"{self.name}: {', '.join(self.outputs)} = {self.op_type or 'forward'}"
                f"({', '.join(self.inputs)}) [{self.policy}]")


@attrs.frozen
class BlockPlan:
    """The plan of a block module for ``layers`` of its layers: all of them, or those ``layer_ids`` lists
    (their positions among the model's block layers in forward order, 0 first), when the auto planner
    gives the module's layers different plans (one BlockPlan per layer group).

    ``ops`` are topologically ordered. ``saved`` and ``recomputed`` name the forward tensors (slot
    names where the block declares slots) that the backward reads saved and recomputed; ``bytes``
    gives the size of each of them per layer (when the plan was made for a shape). ``gated`` are
    slots marked recompute whose policy keeps them saved in this training mode. ``shared`` are
    recomputed slots whose buffer every layer shares (their share policy allows it).
    ``whole_block``: the whole replay runs when the layer's output gradient arrives (block mode)
    instead of each op right before its first consumer. ``offloaded``: the forward tensors the
    forward copies to the host pool after their last forward use and the backward copies back before
    its first use of them (a view of an offloaded tensor is listed too and moves with it, 0 bytes);
    they are neither saved nor recomputed. ``stack``: block mode at block granularity (seed 001): only
    the stack's first layer keeps its carried inputs, and every layer's replay runs, in forward order,
    when the stack's output gradient arrives, each reading the outputs the layer before replays.
    ``can_recompute(tensor)`` and ``dependencies(tensor)`` query the plan.
    """

    module: str
    layers: int
    ops: tuple[RecomputeOp, ...] = field(default=(), converter=_rops)
    saved: tuple[str, ...] = field(default=(), converter=_strs)
    recomputed: tuple[str, ...] = field(default=(), converter=_strs)
    bytes: FrozenDict = field(factory=FrozenDict)
    gated: tuple[str, ...] = field(default=(), converter=_strs)
    shared: tuple[str, ...] = field(default=(), converter=_strs)
    whole_block: bool = False
    layer_ids: tuple[int, ...] = field(default=(), converter=_ints)
    offloaded: tuple[str, ...] = field(default=(), converter=_strs)
    stack: bool = False

    def can_recompute(self, tensor: str) -> bool:
        """Whether the backward reads ``tensor`` (a forward tensor of the block) recomputed."""
        return tensor in self.recomputed

    def dependencies(self, tensor: str) -> tuple[str, ...]:
        """What the replay of recomputed ``tensor`` reads: kept tensors, parameters and the outputs of
        other recompute ops, in the order its replay reads them (a ``KilnError`` if it is not
        recomputed)."""
        for rop in self.ops:
            made: set[str] = set()
            reads: list[str] = []
            for op in rop.replay:
                reads += [i for i in op.inputs if i and i not in made and i not in reads]
                made.update(o for o in op.outputs if o)
            if tensor in made:
                return tuple(reads)
        raise KilnError(f"block {self.module!r}: {tensor!r} is not recomputed by this plan (it recomputes "
                        f"{', '.join(map(repr, self.recomputed)) or 'nothing'})")

    @property
    def saved_bytes(self) -> int:
        return sum(int(self.bytes.get(n, 0)) for n in self.saved)

    @property
    def recomputed_bytes(self) -> int:
        return sum(int(self.bytes.get(n, 0)) for n in self.recomputed)

    @property
    def offloaded_bytes(self) -> int:
        """Bytes per layer this plan copies to the host pool (and back)."""
        return sum(int(self.bytes.get(n, 0)) for n in self.offloaded)

    @property
    def extra_flops(self) -> float:
        return sum(op.flops for op in self.ops)

    def op(self, name: str) -> RecomputeOp:
        for op in self.ops:
            if op.name == name:
                return op
        raise KilnError(f"block {self.module!r} has no recompute op {name!r}; "
                        f"it has {', '.join(o.name for o in self.ops) or 'none'}")


@attrs.frozen
class RecomputePlan:
    """What the backward recomputes, per block. ``planner`` says who made it.

    ``budget`` is the activation budget in bytes the plan was made for (auto), ``reference_bytes``
    the saved activations without recompute and ``planned_bytes`` those of this plan, as the
    planner models them (the Program's ``memory_report()`` has the placed numbers). ``layers``: the
    block module of each model layer, in forward order (the positions ``BlockPlan.layer_ids`` name).
    """

    mode: str = "none"
    training: str = "full"
    planner: str = "kiln.core"
    blocks: tuple[BlockPlan, ...] = field(default=(), converter=_blocks)
    budget: int | None = None
    reference_bytes: int | None = None
    planned_bytes: int | None = None
    seconds: float = 0.0
    layers: tuple[str, ...] = field(default=(), converter=_strs)
    #: how the auto planner priced recompute: ``flops``, or ``measured`` (calibrated kernel times)
    cost: str = "flops"
    #: the step time the plan's recompute adds, as the measured cost model predicts it (auto, measured)
    predicted_seconds: float | None = None

    def block(self, module: str, layer: int | None = None) -> BlockPlan | None:
        """The plan of ``module``'s model layer ``layer`` (a position among the model's block layers in
        forward order); without ``layer``, of its first layer group."""
        return next((b for b in self.blocks if b.module == module
                     and (layer is None or not b.layer_ids or layer in b.layer_ids)), None)

    @property
    def extra_flops(self) -> float:
        """FLOPs recomputed per training step (every layer of every block)."""
        return sum(b.extra_flops * b.layers for b in self.blocks)

    @property
    def offloaded_bytes(self) -> int:
        """Bytes per training step the forward copies to the host pool (every layer of every block);
        the backward copies them back."""
        return sum(b.offloaded_bytes * b.layers for b in self.blocks)

    def layer_plans(self) -> list[BlockPlan | None]:
        """The plan of each model layer in forward order (per ``layers``; without it, each block's
        layers in turn)."""
        if not self.layers:
            return [b for b in self.blocks for _ in range(b.layers)]
        return [self.block(m, i) for i, m in enumerate(self.layers)]

    def table(self) -> str:
        """One row per layer: block, its layer group (1, 2, ... where a block's layers take different
        plans, in the order of ``blocks``), ops replayed, saved, recomputed and offloaded bytes, extra
        FLOPs."""
        group = {id(b): str(sum(c.module == b.module for c in self.blocks[:k]) + 1) if b.layer_ids else "-"
                 for k, b in enumerate(self.blocks)}
        rows = [("layer", "block", "group", "ops", "saved", "recomputed", "offloaded", "extra GFLOP")]
        for i, b in enumerate(self.layer_plans()):
            if b is not None:
                rows.append((str(i), b.module, group[id(b)], str(len(b.ops)), _size(b.saved_bytes),
                             _size(b.recomputed_bytes), _size(b.offloaded_bytes),
                             f"{b.extra_flops / 1e9:.3f}"))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        return "\n".join("  ".join(cell.rjust(w) if c != 1 else cell.ljust(w)
                                   for c, (cell, w) in enumerate(zip(r, widths, strict=True))) for r in rows)

    def pretty(self) -> str:
        """The plan: per block its ordered ops, then what is saved and what is recomputed."""
        lines = [f"recompute={self.mode!r} ({self.training} training) by {self.planner}"]
        if self.budget is not None:
            lines.append(f"budget {_size(self.budget)}, planned {_size(self.planned_bytes or 0)} of "
                         f"{_size(self.reference_bytes or 0)} saved without recompute")
        if self.predicted_seconds is not None:
            ms = self.predicted_seconds * 1e3
            lines.append(f"priced by measured kernel times: recompute adds {ms:.2f} ms per step (predicted)")
        for b in self.blocks:
            which = f" (layers {', '.join(map(str, b.layer_ids))})" if b.layer_ids else ""
            lines.append(f"block {b.module} x {b.layers}{which}{' (whole block)' if b.whole_block else ''}:")
            lines += [f"  {op}" for op in b.ops]
            lines.append(f"  saved: {', '.join(b.saved) or '-'}")
            lines.append(f"  recomputed: {', '.join(b.recomputed) or '-'}")
            if b.offloaded:
                lines.append(f"  offloaded: {', '.join(b.offloaded)}")
            if b.gated:
                lines.append(f"  saved by policy in {self.training} training: {', '.join(b.gated)}")
        return "\n".join(lines)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


@attrs.frozen
class BlockContext:
    """A repeated block as the planner sees it, for one shape.

    ``saves``: the forward tensors its backward reads. ``sizes``: bytes of every forward tensor
    (an alias of its input counts 0). ``costs``: per forward op index, its cost rule's FLOPs and
    bytes. ``carries``: (output, input) pairs, the block output that becomes the next layer's input.
    ``probes``: per forward op index, its step as the measured cost model times it
    (``kiln.core.plan._calibrate.Probe``), where ``compile`` made the context.
    """

    module: Module
    layers: int
    saves: tuple[str, ...]
    sizes: FrozenDict
    costs: tuple[Cost, ...]
    carries: tuple[tuple[str, str], ...] = ()
    probes: tuple[Any, ...] = ()

    @property
    def name(self) -> str:
        return self.module.name


@attrs.frozen
class PlanContext:
    """Everything a planner may look at: the model, its blocks, the training mode and the shape.

    ``fixed_bytes``: saved activations outside the blocks (the model's own graph), which no plan
    changes. ``globals``: tensor names of the model's graph (what ``@global:`` may name). ``chain``:
    per model layer in forward order, its block and, per carried input of that block (``carries``),
    the output of the layer before that it reads (an index into that layer's ``carries``), or -1
    when it reads another tensor; empty: each block's layers form one chain of their own.
    ``target``: what ``compile`` plans for (backend, kernel table, dtype), which the measured cost
    model times; None: recompute is priced by FLOPs.
    """

    model: Module
    blocks: tuple[BlockContext, ...]
    training: str = "full"
    registry: OpRegistry | None = None
    fixed_bytes: int = 0
    globals: frozenset[str] = frozenset()
    chain: tuple[tuple[str, tuple[int, ...]], ...] = ()
    target: Any = None

    def block(self, name: str) -> BlockContext:
        for b in self.blocks:
            if b.name == name:
                return b
        raise KilnError(f"the model has no repeated block {name!r}")

    def layer_chain(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """``chain``, or where it is empty each block's layers in turn, each reading the one before."""
        if self.chain:
            return self.chain
        return tuple((b.name, tuple(range(len(b.carries))) if i else (-1,) * len(b.carries))
                     for b in self.blocks for i in range(b.layers))


@attrs.frozen
class ParetoPoint:
    """One auto plan: saved activation bytes of the whole model and FLOPs recomputed per step.

    ``replayed`` and ``variants`` are per model layer (``PlanContext.layer_chain()``), so layers of one
    block may differ: the forward op indices replayed whole, and (forward op index, replay variant)
    pairs, an op rebuilt in part by that entry of ``kiln.core.plan._recompute.replay_variants`` from
    the rest of its outputs, which are kept. Where offload is allowed, ``flops`` also holds its price
    (FLOPs per byte moved times the bytes moved out and back)."""

    bytes: int
    flops: float
    cost_bytes: float
    replayed: tuple[frozenset[int], ...]
    matmul: bool  # whether it replays a matmul-class op
    peak: int | None = None  # the placed activation peak, when measured
    variants: tuple[tuple[tuple[int, int], ...], ...] = ()
    #: per model layer, the forward op indices whose outputs move to the host pool (offload allowed)
    offloaded: tuple[frozenset[int], ...] = ()


def plan_context(module_ir: Any, *, bindings: Mapping[str, int], mode: str = "full",
                 modules: Mapping[str, Module] | None = None, dtype: str = "float32",
                 registry: OpRegistry | None = None, precision: Any = "fp32") -> PlanContext:
    """The :class:`PlanContext` ``compile`` gives the planner for this model, shape, training mode and
    precision recipe."""
    from kiln.core.plan._program import _context

    return _context(module_ir, bindings=bindings, mode=mode, modules=modules, dtype=dtype, registry=registry,
                    precision=precision)


def layout_ops(block: Module, training: str = "full", *, globals: frozenset[str] = frozenset(),
               ) -> tuple[tuple[RecomputeOp, ...], tuple[str, ...]]:
    """The dsl plan of one block from its activation layout alone (seed 000 §4.1).

    Returns the active recompute ops in topological order and the slots saved by policy. Raises
    E021 (a slot that cannot be derived), E022 (a cycle), E017 (two producers of one slot) and
    E013 (a recompute group whose members disagree), naming the slots.
    """
    from kiln.core.plan._recompute import dsl_layout

    ops, gated = dsl_layout(block, training, globals)
    return tuple(ops), tuple(gated)


def pareto(context: PlanContext, *, allow_matmul: bool | None = None,
           measure: Callable[[RecomputePlan], int] | None = None,
           offload_cost: float | None = None) -> list[ParetoPoint]:
    """Every auto plan that no other plan beats on both saved bytes and recomputed FLOPs, its layers
    free to take different plans.

    Sorted by bytes, largest first (the no-recompute plan). ``allow_matmul``: None tries without
    replaying matmul-class ops first and adds the points that need them below the smallest budget
    reachable without; True or False forces either. With ``measure`` (plan -> placed activation
    peak), each point gets its ``peak``. ``offload_cost`` (FLOPs per byte moved) adds offload to the
    choices, at that price.
    """
    from kiln.core.plan._recompute_auto import model_front, to_plan

    points = model_front(context, allow_matmul, offload_cost)
    if measure is None:
        return points
    return [attrs.evolve(p, peak=int(measure(to_plan(context, p)))) for p in points]


def _resolve_budget(budget: float | None, reference: int) -> int:
    if budget is None:
        return int(DEFAULT_AUTO_FRACTION * reference)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0 or math.isnan(budget):
        raise KilnError(f"recompute budget {budget!r} is not valid; expected bytes (an int > 0) or a "
                        "fraction of the no-recompute saved activations (a float in (0, 1])")
    if isinstance(budget, float):
        if budget > 1:
            raise KilnError(f"recompute budget {budget} is a float above 1; give a fraction in (0, 1] "
                            "or bytes as an int")
        return int(budget * reference)
    return int(budget)


def plan_recompute(context: PlanContext, mode: str = "none", *, budget: float | None = None,
                   options: Mapping[str, Any] | None = None) -> RecomputePlan:
    """The recompute plan for ``context``: a plugin's (``kiln_plan_recompute``) or kiln's own.

    ``budget`` (auto mode): the saved activations allowed (what the forward keeps for the backward),
    in bytes (int) or as a fraction of the no-recompute ones (float); default 0.5. The auto plan is
    the one with the fewest recomputed FLOPs that fits. ``options`` (passed on to plugins as well):
    ``allow_matmul`` (None: only when the budget forces it), ``peak_budget``, the activation peak
    allowed in bytes (saved plus transient activations, as placed), and ``measure``, a function from a
    plan to that peak (``compile`` passes one); ``offload`` (True: the auto planner may also move
    activations to the host pool, priced at ``offload_cost`` FLOPs per byte moved, 1000 by default);
    ``cost`` (``"measured"``, the default where ``compile`` made the context, prices each replay by its
    kernel's calibrated time on this machine; ``"flops"`` by its FLOPs; ``$KILN_RECOMPUTE_COST`` sets
    the default).
    Block mode takes ``granularity`` (``"layer"`` or ``"block"``), ``include_layernorm`` and
    ``include_bda`` (see ``kiln.core.plan._recompute.BLOCK_OPTIONS``).
    """
    if mode not in MODES:
        raise KilnError(f"recompute={mode!r} is not valid; expected one of {', '.join(map(repr, MODES))}")
    t0 = time.perf_counter()
    opts = dict(options or {})
    plan = _from_plugins(context, mode, budget, opts)
    if plan is None:
        from kiln.core.plan import _recompute, _recompute_auto

        unknown = sorted(k for k in opts if k not in OPTIONS[mode] and k != "measure")
        if unknown:
            takes = ", ".join(OPTIONS[mode]) or "none"
            raise KilnError(f"recompute option {', '.join(map(repr, unknown))} is not one kiln's {mode!r} "
                            f"planner takes (it takes: {takes})")
        if mode == "auto":
            plan = _recompute_auto.plan_auto(context, budget, opts, _resolve_budget)
        else:
            plan = _recompute.plan_modes(context, mode, opts)
        plan = attrs.evolve(plan, seconds=time.perf_counter() - t0)
    return plan


def _from_plugins(context: PlanContext, mode: str, budget: float | None,
                  options: dict[str, Any]) -> RecomputePlan | None:
    """The ``kiln_plan_recompute`` result (pluggy's first non-None, wrappers included); checked here
    so that a bad plan names the plugin that made it."""
    from kiln.core.plugins._session import plugin_session

    session = plugin_session()
    result = session.hook.kiln_plan_recompute(
        graph=context.model.forward, layout=context, mode=mode, training=context.training, budget=budget,
        options=options)
    if result is None:
        return None
    info = session.answered_by("kiln_plan_recompute", result)
    who = info.describe() if info else "a kiln_plan_recompute hook wrapper"
    name, dist = (info.name, info.distribution) if info else (None, None)
    if not isinstance(result, RecomputePlan):
        raise PluginError(f"{who} returned {type(result).__name__} from kiln_plan_recompute; expected a "
                          "kiln.core.plan.recompute.RecomputePlan or None", plugin=name, distribution=dist)
    from kiln.core.plan._recompute import check_plan

    try:
        check_plan(result, context)
    except KilnError as exc:
        raise PluginError(f"{who} returned an invalid recompute plan: {exc.message}",
                          plugin=name, distribution=dist, code=exc.code) from None
    if result.planner == "kiln.core" and name is not None:
        result = attrs.evolve(result, planner=name)
    return result


_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}


def parse_budget(value: Any) -> int | float:
    """An auto-planner budget: bytes (``123456``, ``"64MiB"``) or a fraction of the saved activations
    without recompute (``0.5``, ``"50%"``); a ``KilnError`` for anything else (no bytes, a fraction
    outside (0, 1])."""
    given = value
    if isinstance(value, str):
        text = value.strip()
        unit = next((u for u in _UNITS if text.endswith(u)), None)
        try:
            if text.endswith("%"):
                value = float(text[:-1]) / 100
            elif unit is not None:
                value = int(float(text[:-len(unit)]) * _UNITS[unit])
            else:
                value = int(text) if text.isdigit() else float(text)
        except ValueError:
            value = None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise KilnError(f"{given!r} is not a budget; give bytes (123456, 64MiB) or a fraction (0.5, 50%)")
    if isinstance(value, int) and value < 1:
        raise KilnError(f"{given!r} is not a budget: {value} bytes")
    if isinstance(value, float) and not 0.0 < value <= 1.0:
        raise KilnError(f"{given!r} is not a budget: the fraction {value} is not in (0, 1]")
    return value
