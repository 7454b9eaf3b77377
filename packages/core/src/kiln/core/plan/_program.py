"""Programs: what a backend runs. ``compile`` lowers a model's IR to ordered steps and one arena.

Lowering (seed 004 §9.7.3) is three passes, each a function of the previous result:

1. **schedule**: the forward graph, its backward (from ``derive_backward``; a repeated block's
   backward is derived once and scheduled once per layer, last layer first) and the optimizer
   update become one list of :class:`Step`, every tensor named by a unique key
   (``blocks.3.attn.qkv`` for block tensor ``attn.qkv`` of layer 3) with a concrete shape;
2. **lifetimes**: each tensor's first and last step; views and reshapes join the slot of their
   input (free), and an op whose ``out=`` kernel allows it writes over an input that dies there;
   ``@lifetime`` keeps a buffer longer (:mod:`kiln.core.plan._lifetime`);
3. **placement**: weights, gradients and optimizer state first, at offsets that depend on the
   model only (every Program of a model shares them), then the inputs, then every other slot
   packed by lifetime (greedy by size, first fit).

Between the forward and the backward, the recompute planner (:mod:`kiln.core.plan.recompute`) decides per
block what the backward reads saved and what it recomputes; the scheduler places each recompute op
right before the first backward step that reads one of its outputs (block mode: the whole block
before the layer's backward), replaying the forward ops with their kernels and attributes.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from kiln.core._errors import KilnError, OpError
from kiln.core.autodiff._autodiff import DeriveBackwardOptions, derive_backward
from kiln.core.ir._dims import dim_bindings, evaluate_shape, parse_dim
from kiln.core.ir._ir import Bundle, FrozenDict, Graph, Module, Op, ParamSpec, TensorType, _strs, is_float
from kiln.core.ops._ops import Cost, InferContext, OpRegistry
from kiln.core.plan._calibrate import Probe
from kiln.core.plan._kernel_choice import annotated_kernels
from kiln.core.plan._lifetime import lifetime_spans
from kiln.core.plan._optim import Optimizer, make_optimizer
from kiln.core.plan._passes import PassRun, PassSpec, run_passes
from kiln.core.plan._precision import (
    FP32_RECIPE,
    RECIPES,
    Override,
    Precision,
    precision_overrides,
    precision_recipe,
    with_overrides,
)
from kiln.core.plan.recompute import (
    BlockContext,
    BlockPlan,
    PlanContext,
    RecomputePlan,
    _ops,
    _size,
    plan_recompute,
)

TRAINING_MODES = ("full", "lora")
TASKS = ("train", "eval", "logits")
#: the float types the NumPy backend computes in (other backends declare their own ``dtypes``)
DTYPES = ("float32", "float64")
#: bytes per element of every dtype a Program may hold
ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int32": 4, "int8": 1}
ALIGN = 64  # bytes; every slot starts at a multiple
#: a training step's phases in order; ``grad_sync`` is empty on one process (kiln-dist fills it)
PHASES = ("forward", "backward", "grad_sync", "optimizer")
WORKSPACE = "optimizer.workspace"
FUSED_HEAD = "fused_lm_head_loss_and_grad"
INPUTS = ("token_ids", "position_ids", "targets")
SEED = "d_loss"  # the backward's seed, an input of every training Program


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# ---------------------------------------------------------------------------------------------
# Plan objects


@attrs.frozen
class Tensor:
    """A tensor of a Program: concrete shape, NumPy dtype, and where it lives: at ``offset`` in the
    arena, or in the host pool (``pool="host"``: an offloaded activation's copy, outside the device
    peak)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    slot: str
    offset: int
    pool: str = "arena"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


@attrs.frozen
class Slot:
    """A range of the arena and the tensors that use it in turn (or share it, as views)."""

    name: str
    #: weight | gradient | optimizer_state | input | output | buffer | saved | transient | host | workspace
    #: | held
    kind: str
    nbytes: int
    offset: int
    first: int
    last: int
    tensors: tuple[str, ...]


@attrs.frozen
class Step:
    """One scheduled op. ``how``: ``kernel`` (the kernel returns its results, copied into the slots),
    ``out`` (an ``out=`` kernel writes the slots), ``alias`` (nothing to run: the output shares its
    input's storage), ``copy`` (a view that must land in its own slot), ``optimizer`` (an update in
    place, with the step's run-time scalars: an optimizer update, or a collective of a SyncPlan),
    ``offload`` (a forward copy of an activation to its host-pool tensor), ``fetch`` (a backward copy
    of it back to the device). ``recompute``: a forward op replayed in the backward (its outputs are
    ``<key>:recompute``)."""

    index: int
    phase: str
    op: Op
    layer: int | None
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    how: str
    attrs: FrozenDict = attrs.field(factory=FrozenDict)
    recompute: bool = False
    #: the kernel-table key of the kernel that runs the step, or "" for the op's reference kernel
    kernel: str = ""

    def __str__(self) -> str:
        where = f" [layer {self.layer}]" if self.layer is not None else ""
        phase = "rec" if self.recompute else self.phase[:3]
        return (f"{self.index:>4} {phase} {self.how:<5} {', '.join(self.outputs)} = "
                f"{self.op.type}({', '.join(i or '_' for i in self.inputs)}){where}")


@attrs.frozen
class ParamInfo:
    """A parameter of the Program: its key, shape, init spec and (if trained) gradient and state keys."""

    name: str
    shape: tuple[int, ...]
    init: FrozenDict
    trainable: bool
    grad: str | None = None
    state: tuple[str, ...] = ()


def _sized(items: Iterable[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    return tuple((str(k), int(n)) for k, n in items)


@attrs.frozen
class SyncPlan:
    """What data parallelism adds to one rank's training Program (kiln-dist's ``DataParallel`` makes
    it; see ``compile``). Ops are collectives that update their inputs in place:

    - ``grad_sync``: run after the backward; an input that names a trained parameter reads its
      gradient (an all-reduce of a bucket of gradients; ZeRO-1: a reduce-scatter to their owners);
    - ``in_backward``: run in the backward, each right after the last step that writes a gradient
      it reads (a bucket's non-blocking all-reduce starts there, and a ``grad_sync`` op waits for it);
    - ``owned``: the trained parameters whose update and optimizer state this rank holds (None: all);
    - ``norm``: the tensors the global gradient norm is taken over (None: every gradient; ZeRO-1: a
      tensor of ``outputs`` that a ``grad_sync`` op fills with the norm over every rank's share);
    - ``after_update``: run after the updates, on the parameters themselves (ZeRO-1's all-gather);
    - ``outputs``: 1-element tensors of the Program's float type that the ops write, read by the host;
    - ``buffers``: (name, elements) flat tensors of the gradients' type the ops pack buckets into (a
      collective started in the backward and waited for in ``grad_sync`` keeps its bucket there), each
      a slot of kind ``buffer`` live through the whole Program: planned in the arena, not allocated
      by a kernel.
    """

    grad_sync: tuple[Op, ...] = attrs.field(default=(), converter=_ops)
    in_backward: tuple[Op, ...] = attrs.field(default=(), converter=_ops)
    owned: frozenset[str] | None = None
    norm: tuple[str, ...] | None = None
    after_update: tuple[Op, ...] = attrs.field(default=(), converter=_ops)
    outputs: tuple[str, ...] = attrs.field(default=(), converter=_strs)
    buffers: tuple[tuple[str, int], ...] = attrs.field(default=(), converter=_sized)


@attrs.frozen
class Fusion:
    """Steps a backend runs as one kernel when it runs them together (forward and backward in one
    training step): ``kind`` names the backend capability and the kernel, ``steps`` the indices of the
    steps it replaces, ``inputs``/``outputs`` the tensors it reads and writes, ``attrs`` its attributes."""

    kind: str
    steps: tuple[int, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: FrozenDict = attrs.field(factory=FrozenDict)
    kernel: str = ""


@attrs.frozen(eq=False)
class Program:
    """Ordered steps (forward, backward, optimizer) and one arena plan; a backend runs it as planned."""

    name: str
    backend: str
    task: str
    mode: str
    dtype: str
    bindings: FrozenDict
    steps: tuple[Step, ...]
    tensors: FrozenDict  # key -> Tensor
    slots: tuple[Slot, ...]
    params: tuple[ParamInfo, ...]
    persistent_bytes: int  # weights, gradients and optimizer state: the same for every Program of a model
    arena_bytes: int
    output: str  # "loss" (per token) or "logits"
    recompute: RecomputePlan
    passes: tuple[PassRun, ...]  # every pass compile ran: stage, name, seconds
    fusions: tuple[Fusion, ...] = ()
    optimizer: Optimizer | None = None
    #: bytes of the host pool, where offloaded activations wait for the backward (not in the arena)
    host_bytes: int = 0
    #: the precision recipe the Program follows (``fp32``, ``bf16``): what a backend honours
    precision: Precision = FP32_RECIPE
    #: the tensors whose values the recipe rounds to ``precision.low`` when they are written (stored
    #: in that type, ``Tensor.dtype``, unless their slot is a fp32 one: a gradient)
    rounded: frozenset[str] = frozenset()
    #: steps whose op an ``@precision``/``@dtype`` annotation moves off the recipe, by their first
    #: output key: ``"bf16"`` (float inputs rounded to bf16) or ``"fp32"`` (read as fp32)
    computes: FrozenDict = attrs.field(factory=FrozenDict)

    def phase(self, name: str) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if s.phase == name)

    def memory_report(self) -> dict[str, Any]:
        """Planned bytes by kind; the kinds add up to ``peak``, the size of the arena. ``held``: the
        backend's buffers kept across steps (``Backend.held_bytes``); ``host``: the host pool of offloaded
        activations, outside the peak."""
        kinds = ("weight", "gradient", "optimizer_state", "input", "output", "saved", "held")
        by_kind = {k: 0 for k in kinds}
        for s in self.slots:
            if s.kind in by_kind:
                by_kind[s.kind] += s.nbytes
        fixed = sum(by_kind.values())
        return {
            "weights": by_kind["weight"], "gradients": by_kind["gradient"],
            "optimizer_state": by_kind["optimizer_state"], "inputs": by_kind["input"],
            "outputs": by_kind["output"],
            "saved_activations": by_kind["saved"], "held": by_kind["held"],
            "transient": self.arena_bytes - fixed,
            "peak": self.arena_bytes, "host": self.host_bytes,
            "slots": [{"name": s.name, "kind": s.kind, "bytes": s.nbytes, "offset": s.offset,
                       "lifetime": (s.first, s.last), "tensors": list(s.tensors)} for s in self.slots],
        }

    def memory_table(self) -> str:
        """The memory report as text, one kind a row (``kiln plan`` prints it): the saved activations
        also as a share of those without recompute and, under an auto budget, within it; the host
        pool where the plan offloads activations to it."""
        report, plan = self.memory_report(), self.recompute
        rows = []
        for k in ("weights", "gradients", "optimizer_state", "inputs", "outputs", "saved_activations",
                  "transient", "peak"):
            extra = ""
            if k == "saved_activations" and plan.reference_bytes:
                extra = (f"  ({100 * report[k] / plan.reference_bytes:.1f}% of {_size(plan.reference_bytes)} "
                         "without recompute)")
            rows.append(f"{k:<18} {_size(report[k]):>12}{extra}")
        held = [sl.name for sl in self.slots if sl.kind == "held"]
        if held:  # the backend's buffers kept across steps (kiln.cuda: bf16 copies of weights), in the peak
            rows.insert(-2, f"{'held':<18} {_size(report['held']):>12}  ({len(held)} buffers of the backend "
                            f"kept across steps: {', '.join(held[:3])}{', ...' if len(held) > 3 else ''})")
        n = sum(1 for sl in self.slots if sl.kind == "host")
        if n:  # a plan that offloads: the host pool it fills
            rows.append(f"{'host':<18} {_size(report['host']):>12}  (pool of {n} offloaded tensors, outside "
                        "the peak)")
        if plan.budget is not None:
            act = report["saved_activations"] + report["transient"]
            rows.append(f"saved activations {_size(report['saved_activations'])} within the budget of "
                        f"{_size(plan.budget)} (activation peak {_size(act)})")
        return "\n".join(rows)

    def pretty(self) -> str:
        return "\n".join(str(s) for s in self.steps)


# ---------------------------------------------------------------------------------------------
# compile


def _resolve(module_ir: Bundle | Module,
             modules: Mapping[str, Module] | None) -> tuple[Module, dict[str, Module]]:
    if isinstance(module_ir, Bundle):
        if module_ir.entry is None:
            raise KilnError("the Bundle has no entry module; set Bundle(entry=<model name>)", code="E002")
        mods = {m.name: m for m in module_ir.modules}
        model = module_ir.module(module_ir.entry)
    elif isinstance(module_ir, Module):
        model, mods = module_ir, {}
    else:
        raise KilnError(f"compile expects a Bundle or a model Module, found {type(module_ir).__name__}")
    mods.update(modules or {})
    if model.forward is None:
        raise KilnError(f"module {model.name!r} has no forward graph", code="E002")
    return model, mods


def _inference(module: Module) -> Module:
    """``module`` as inference runs it (a model in eval mode): each dropout op passes its input on, as
    an alias of the same storage (``contiguous``), so it costs nothing."""
    g = module.forward
    if g is None or not any(op.type == "dropout" for op in g.ops):
        return module
    ops = [Op("contiguous", op.inputs[:1], op.outputs[:1], loc=op.loc) if op.type == "dropout" else op
           for op in g.ops]
    return attrs.evolve(module, forward=attrs.evolve(g, ops=ops))


def _choice(what: str, value: str, valid: Sequence[str]) -> None:
    if value not in valid:
        raise KilnError(f"{what}={value!r} is not valid; expected one of {', '.join(map(repr, valid))}")


def _trains(spec: ParamSpec, mode: str) -> bool:
    """Full fine-tuning trains every unfrozen parameter; LoRA only parameters whose role is ``adapter``."""
    return not spec.frozen and (mode == "full" or spec.inferred_role() == "adapter")


def model_params(model: Module, modules: Mapping[str, Module], bindings: Mapping[str, int],
                 mode: str) -> list[tuple[str, ParamSpec, tuple[int, ...], bool]]:
    """Every stored parameter as (key, spec, shape, trainable): model params in order, then stacks
    expanded per layer as ``<stack>.<i>.<name>``. Tied parameters have no storage of their own."""
    out: list[tuple[str, ParamSpec, tuple[int, ...], bool]] = []
    binds = {**dim_bindings(model.config), **bindings}
    for spec in model.params:
        if spec.tied_to is not None:
            continue
        if spec.array_of is None:
            out.append((spec.name, spec, evaluate_shape(spec.shape, binds), _trains(spec, mode)))
            continue
        block = modules.get(spec.array_of)
        if block is None or spec.count is None:
            raise KilnError(f"parameter {spec.name!r} stacks module {spec.array_of!r}, "
                            "which is not in the bundle",
                            code="E002")
        bbinds = {**binds, **dim_bindings(block.config)}
        for i in range(spec.count.evaluate(binds)):
            for bspec in block.params:
                out.append((f"{spec.name}.{i}.{bspec.name}", bspec, evaluate_shape(bspec.shape, bbinds),
                            _trains(bspec, mode) and not spec.frozen))
    return out


def backend_named(name: str) -> Any:
    """The registered backend ``name``; ``name:index`` (``cuda:1``, as ``torch.device`` spells it) is
    that backend on its device ``index``, where it has several (its optional ``on_device``)."""
    from kiln.core.plugins._session import get_registry

    registry = get_registry("backends")
    base, colon, index = name.partition(":")
    if not colon or name in registry:
        return registry[name]
    backend = registry[base]
    if not index.isdigit():
        raise KilnError(f"backend {name!r}: the device index {index!r} is not a non-negative integer",
                        hint=f"write {base!r} for the default device, or {base + ':1'!r} for device 1")
    on_device = getattr(backend, "on_device", None)
    if on_device is None:
        raise KilnError(f"backend {base!r} has no devices to choose from, so {name!r} names none",
                        hint=f"write {base!r}")
    return on_device(int(index))


@attrs.frozen
class Target:
    """What a Program is planned for: the backend (by registry name or object), its kernel table, the
    optimizer whose update the optimizer phase runs, and the float type of compute."""

    backend: Any
    kernels: Any
    optimizer: Optimizer | None
    dtype: str = "float32"
    precision: Precision = FP32_RECIPE

    @classmethod
    def of(cls, backend: Any = "numpy", optimizer: Any = "adamw", dtype: str = "float32",
           kernels: Any = None, precision: Any = "fp32") -> Target:
        """Backend, kernel table and optimizer looked up in the current plugin session when given by name
        (an optimizer may also be a dict ``{"name": ..., **settings}``); ``precision``: a recipe
        (``"fp32"``, ``"bf16"``) the backend runs (its ``precisions``; ``fp32`` only if it has none)."""
        from kiln.core.plugins._session import get_registry

        if isinstance(backend, str):
            backend = backend_named(backend)  # an unknown backend names the plugin to install
        valid = tuple(getattr(backend, "dtypes", DTYPES))
        if dtype not in valid or dtype not in ITEMSIZE:
            raise KilnError(f"dtype={dtype!r} is not valid for backend {backend.name!r}; expected one of "
                            f"{', '.join(map(repr, valid))}")
        opt = make_optimizer(get_registry("optimizers"), optimizer) if not (
            optimizer is None or isinstance(optimizer, Optimizer)) else optimizer
        name = precision.name if isinstance(precision, Precision) else precision or "fp32"
        runs = tuple(getattr(backend, "precisions", ("fp32",)))
        if name in RECIPES and name not in runs:
            raise KilnError(f"backend {backend.name!r} does not run the {name!r} precision recipe; it "
                            f"runs {', '.join(map(repr, runs))}")
        recipe = precision_recipe(precision, dtype)
        return cls(backend, kernels if kernels is not None else get_registry("kernels"), opt, dtype, recipe)


def compile(module_ir: Bundle | Module, *, bindings: Mapping[str, int], backend: Any = "numpy",
            mode: str = "full", recompute: str = "none", recompute_budget: float | None = None,
            recompute_options: Mapping[str, Any] | None = None, memory_budget: int | None = None,
            modules: Mapping[str, Module] | None = None, task: str = "train", optimizer: Any = "adamw",
            dtype: str = "float32", registry: OpRegistry | None = None, kernels: Any = None,
            passes: Sequence[PassSpec] = (), sync: SyncPlan | None = None,
            precision: Any = "fp32") -> Program:
    """Lower a model to a :class:`Program` for one shape binding (``{"B": batch, "T": seq}``), planned
    for ``backend`` (a registered name or a backend object): every op runs the kernel the kernel table
    has for it there (an op without one is an error naming both), and fusions the backend implements
    are planned.

    ``task="train"`` schedules forward, backward, ``grad_sync`` (empty on one process) and the
    ``optimizer``'s update (an :class:`~kiln.core.Optimizer`, a registered name such as ``"adamw"`` or
    ``"sgd"``, a dict ``{"name": ..., **settings}``, or None for no update); ``task="eval"`` the
    forward and its loss, ``task="logits"`` the forward with the LM-head loss replaced by its logits;
    both are inference, as a model in eval mode: dropout is off. ``dtype`` is the float type float
    tensors compute in. Weights, gradients and optimizer state are laid out the same way for every task
    and binding, so all Programs of a model can share one arena.
    ``recompute``: ``none``, ``dsl``, ``auto`` or ``block`` (see :mod:`kiln.core.plan.recompute`);
    ``recompute_budget``: the auto planner's budget, the saved activations allowed in bytes (int) or
    as a fraction of the no-recompute ones (float), 0.5 by default. ``passes``: graph passes from the
    ``graph_passes`` registry to run first, each a name or ``(name, options)`` (``("lora", {"r": 8})``),
    by stage (``adapt``, then ``shard``); every pass run is recorded in ``Program.passes``.
    ``sync``: one data-parallel rank's :class:`SyncPlan` (its collectives, visible as steps of the
    ``grad_sync`` and ``optimizer`` phases; its share of the optimizer state).
    ``precision``: the precision recipe, ``"fp32"`` or ``"bf16"`` (:mod:`kiln.core.plan._precision`):
    bf16 activations are planned at 2 bytes an element (``Program.precision``, ``Program.rounded``).
    """
    _choice("mode", mode, TRAINING_MODES)
    _choice("task", task, TASKS)
    target = Target.of(backend, optimizer, dtype, kernels, precision)
    runs: list[PassRun] = []
    if passes:
        from kiln.core.plugins._session import get_registry

        module_ir, runs = run_passes(_as_bundle(module_ir, modules), passes, get_registry("graph_passes"))
        modules = None
    t0 = time.perf_counter()
    model, mods = _resolve(module_ir, modules)
    if task != "train":
        model, mods = _inference(model), {k: _inference(m) for k, m in mods.items()}
    s = _Scheduler(model, mods, _ops_registry(registry), target, _binds(model, bindings), mode, sync)
    s.schedule_forward(task)
    plan = RecomputePlan("none", mode)
    if task == "train":
        plan = plan_recompute(s.plan_context(), recompute, budget=recompute_budget,
                              options={"measure": _measure(s), **(recompute_options or {})})
    if any(b.offloaded for b in plan.blocks) and "host_offload" not in getattr(target.backend, "capabilities",
                                                                                 ()):
        raise KilnError(f"the recompute plan offloads activations to the host, which backend "
                        f"{target.backend.name!r} does not implement (capability 'host_offload')",
                        hint="use recompute='none', 'dsl' without offload hints, 'auto' or 'block' there")
    s.schedule_rest(task, plan)
    t1 = time.perf_counter()
    slots, tensors, persistent, arena = _place(s)
    fusions = _fusions(s, tensors) if task == "train" else ()
    t2 = time.perf_counter()
    program = _program(s, model, target, task, mode, dtype, plan, runs, slots, tensors, persistent, arena,
                       fusions, (t0, t1, t2))
    # the backend's kernel temporaries per step (optional ``Backend.workspace_bytes``): placed in the arena
    # as slots live during their step alone, so the planned peak is what the backend allocates
    sizing = getattr(target.backend, "workspace_bytes", None)
    need = {int(i): int(n) for i, n in (sizing(program, target.kernels) if sizing else {}).items() if n > 0}
    # and its buffers held across steps (optional ``Backend.held_bytes``): slots live from first to last
    holding = getattr(target.backend, "held_bytes", None)
    held = {str(k): (int(a), int(b), int(n)) for k, (a, b, n) in
            (holding(program, target.kernels) if holding else {}).items() if n > 0}
    if need or held:
        slots, tensors, persistent, arena = _place(s, need, held)
        fusions = _fusions(s, tensors) if task == "train" else ()
        program = _program(s, model, target, task, mode, dtype, plan, runs, slots, tensors, persistent, arena,
                           fusions, (t0, t1, t2))
    if memory_budget is not None and arena > memory_budget:
        raise KilnError(f"the planned peak of {arena} bytes exceeds memory_budget={memory_budget}",
                        hint="recompute='block' or recompute='auto' trade compute for memory")
    return program


def _program(s: _Scheduler, model: Module, target: Target, task: str, mode: str, dtype: str,
             plan: RecomputePlan, runs: list[PassRun], slots: list[Slot], tensors: dict[str, Tensor],
             persistent: int, arena: int, fusions: Any, times: tuple[float, float, float]) -> Program:
    t0, t1, t2 = times
    program = Program(
        name=model.name, backend=target.backend.name, task=task, mode=mode, dtype=dtype,
        bindings=FrozenDict(s.binds), steps=tuple(s.steps), tensors=FrozenDict(tensors), slots=tuple(slots),
        params=tuple(s.param_infos()), persistent_bytes=persistent, arena_bytes=arena,
        output="logits" if task == "logits" else "loss", recompute=plan,
        passes=(*runs, PassRun("autodiff+schedule", "schedule", t1 - t0 - plan.seconds),
                PassRun("recompute", plan.planner or plan.mode, plan.seconds),
                PassRun("memory", "place", t2 - t1)),
        fusions=fusions, optimizer=target.optimizer if task == "train" else None,
        host_bytes=sum(sl.nbytes for sl in slots if sl.kind == "host"),
        precision=s.target.precision, rounded=frozenset(k for k in s.low if k in tensors),
        computes=FrozenDict({k: v for k, v in s.computes.items() if k in tensors}),
    )
    # @kernel and @nofuse: the step kernels of the annotated tensors, once the plan places them
    return annotated_kernels(program, model, s.modules, target.kernels, target.backend)


def _as_bundle(module_ir: Bundle | Module, modules: Mapping[str, Module] | None) -> Bundle:
    model, mods = _resolve(module_ir, modules)
    return Bundle((model, *(m for name, m in mods.items() if name != model.name)), entry=model.name)


def _ops_registry(registry: OpRegistry | None) -> OpRegistry:
    if registry is not None:
        return registry
    from kiln.core.plugins._session import get_registry

    ops: OpRegistry = get_registry("ops")  # type: ignore[assignment]
    return ops


def _binds(model: Module, bindings: Mapping[str, int]) -> dict[str, int]:
    return {**dim_bindings(model.config), **{k: int(v) for k, v in bindings.items()}}


def _context(module_ir: Bundle | Module, *, bindings: Mapping[str, int], mode: str,
             modules: Mapping[str, Module] | None, dtype: str, registry: OpRegistry | None,
             precision: Any = "fp32") -> PlanContext:
    _choice("mode", mode, TRAINING_MODES)
    model, mods = _resolve(module_ir, modules)
    s = _Scheduler(model, mods, _ops_registry(registry), Target.of(dtype=dtype, precision=precision),
                   _binds(model, bindings), mode)
    s.schedule_forward("train")
    return s.plan_context()


def measure(module_ir: Bundle | Module, bindings: Mapping[str, int], mode: str = "full", *,
            modules: Mapping[str, Module] | None = None, dtype: str = "float32",
            optimizer: Any = "adamw", backend: Any = "numpy",
            precision: Any = "fp32") -> Callable[[RecomputePlan], int]:
    """plan -> the activation peak (arena minus weights, gradients, optimizer state, inputs and outputs)
    of the training Program compiled with that plan (under the ``precision`` recipe)."""
    _choice("mode", mode, TRAINING_MODES)
    model, mods = _resolve(module_ir, modules)
    target = Target.of(backend, optimizer, dtype, precision=precision)
    s = _Scheduler(model, mods, _ops_registry(None), target, _binds(model, bindings), mode)
    s.schedule_forward("train")
    return _measure(s)


FIXED_KINDS = ("weight", "gradient", "optimizer_state", "input", "output", "buffer")


def _measure(s: _Scheduler) -> Callable[[RecomputePlan], int]:
    def peak(plan: RecomputePlan) -> int:
        trial = s.fork()
        trial.schedule_rest("train", plan)
        slots, _, _, arena = _place(trial)
        return arena - sum(sl.nbytes for sl in slots if sl.kind in FIXED_KINDS)

    return peak


# ---------------------------------------------------------------------------------------------
# Pass 1: schedule


@attrs.define
class _Call:
    callee: Module
    prefix: str
    layers: list[dict[str, str]]  # per layer: block tensor name -> key
    first: int  # the stack's layer the call starts at (layers first .. first + len(layers) - 1)
    binds: dict[str, int]
    inputs: list[str] = attrs.Factory(list)  # keys the stack reads and returns
    outputs: list[str] = attrs.Factory(list)
    first_steps: list[int] = attrs.Factory(list)  # the step of each op of layer 0


class _Scheduler:
    def __init__(self, model: Module, modules: dict[str, Module], registry: OpRegistry, target: Target,
                 binds: dict[str, int], mode: str, sync: SyncPlan | None = None) -> None:
        self.model, self.modules, self.registry, self.binds = model, modules, registry, binds
        self.target, self.mode = target, mode
        self.float_dtype = _kernel_dtype(target.dtype)
        self.steps: list[Step] = []
        self.types: dict[str, tuple[tuple[int, ...], str]] = {}  # key -> (shape, IR dtype)
        self.kinds: dict[str, str] = {}  # pinned keys: weight, gradient, optimizer_state, input
        self.params = model_params(model, modules, binds, mode)
        self.trainable = {key for key, _, _, t in self.params if t}
        self.sync = sync or SyncPlan()
        #: the trained parameters this rank updates and keeps optimizer state for
        self.owned = self.trainable if self.sync.owned is None else self.trainable & self.sync.owned
        self.grads: dict[str, str] = {}  # param key -> key of its gradient tensor
        self.calls: dict[tuple[str, ...], _Call] = {}
        self.optimizer: Optimizer | None = target.optimizer
        self.update = False  # whether the optimizer phase is scheduled
        self._derived: dict[tuple[str, DeriveBackwardOptions], Any] = {}
        self._added: dict[Any, Any] = {}
        self.plan = RecomputePlan()
        self.shared: dict[tuple[str, str, str], list[str]] = {}  # (block, stack, tensor) -> each layer's copy
        self.host: dict[str, str] = {}  # offloaded key -> its host-pool copy
        self.low: set[str] = set()  # keys whose values the precision recipe rounds to its low type
        #: @precision/@dtype per (module, tensor), and per first output key the compute they chose
        self.overrides = precision_overrides((model, *modules.values()))
        self.computes: dict[str, str] = {}
        self._stacks = {f"{p.name}.": p.array_of for p in model.params if p.array_of}
        casts = any(str(o.attrs.get("dtype", "")) == "bf16" for m in (model, *modules.values())
                    if m.forward is not None for o in m.forward.ops)  # an explicit cast to bf16
        if self.overrides or casts:
            recipe = with_overrides(target.precision, self.overrides, target.dtype, casts)
            if recipe.lowers and "bf16" not in tuple(getattr(target.backend, "precisions", ("fp32",))):
                where = next((o.where for o in self.overrides.values() if o.low), "a cast to bf16")
                raise KilnError(f"@precision/@dtype on {where} asks for bf16, which backend "
                                f"{getattr(target.backend, 'name', target.backend)!r} does not run",
                                hint="run the model on the numpy backend, or drop the annotation")
            self.target = attrs.evolve(target, precision=recipe)
        for key, _, shape, _ in self.params:
            self.types[key] = (shape, "fp32")
            self.kinds[key] = "weight"

    # -- helpers

    def np_dtype(self, ir_dtype: str) -> str:
        """The dtype a tensor of IR type ``ir_dtype`` has in the Program: floats compute in the
        Program's float type."""
        return self.target.dtype if is_float(ir_dtype) else ir_dtype

    def add(self, phase: str, op: Op, ins: Sequence[str], outs: Sequence[str], binds: Mapping[str, int],
            layer: int | None = None, recompute: bool = False, source: str | None = None,
            float32_reads: frozenset[int] = frozenset()) -> None:
        """Schedule ``op`` on the keys ``ins`` -> ``outs``; ``source``: the first output of the forward op
        whose backward rule emitted ``op`` (its ``@precision``/``@dtype`` compute applies);
        ``float32_reads``: positions of inputs that are float32 tensors holding bf16 values (the gradient
        of a float32 forward tensor, :func:`_float32_reads`)."""
        in_types = tuple(self.types[k] if k else None for k in ins)
        override = self.override(op, outs, layer, phase, recompute, source)
        memo = (op, in_types, tuple(sorted(binds.items())), override)  # a block op runs per layer
        if memo not in self._added:
            opdef = self.registry.get_op(op.type)
            resolved = opdef.resolve_attrs(op.attrs)
            types = [TensorType(t[0], t[1]) if t else None for t in in_types]
            kinds = {a.name: a.kind for a in opdef.attrs}
            concrete = {k: opdef.kernel_attrs({k: v}, binds)[k] if kinds.get(k) in ("dim", "dims") else v
                        for k, v in resolved.items()}  # shape rules then see numbers, not symbols
            try:
                inferred = [(evaluate_shape(t.shape, binds), t.dtype)
                            for t in opdef.infer(InferContext(op.type, types, concrete))]
                if len(inferred) != len(outs):
                    raise KilnError(f"its shape rule gives {len(inferred)} outputs, the op names {len(outs)}")
            except KilnError as exc:
                raise KilnError(f"op {op.type!r} producing {', '.join(o for o in outs if o)!r}"
                                f"{f' in layer {layer}' if layer is not None else ''}: {exc.message}",
                                code=exc.code or "E004") from None
            kattrs = FrozenDict(opdef.kernel_attrs(resolved, binds, self.float_dtype))
            if opdef.alias:
                how, kernel = "alias", ""
            else:
                found = self.kernel(opdef, override)
                how, kernel = ("out" if found.out else "kernel"), found.key
            self._added[memo] = (inferred, kattrs, how, kernel)
        inferred, kattrs, how, kernel = self._added[memo]
        for k, t in zip(outs, inferred, strict=True):
            if k:
                self.types[k] = t
        if self.target.precision.lowers:
            if self.registry.get_op(op.type).alias:  # a view holds its input's values, as stored
                float32_reads = frozenset()
            floats = [None if t is None or not is_float(t[1]) else k in self.low and i not in float32_reads
                      for i, (k, t) in enumerate(zip(ins, in_types, strict=True))]
            low = self.target.precision.rounded_outputs(self.registry.get_op(op.type), floats,
                                                        [is_float(t[1]) for t in inferred], override)
            typed = {t[1] for t in in_types if t is not None}
            # an op whose type rule makes bf16 of non-bf16 inputs (an explicit cast) writes bf16 values
            low = tuple(r or (t[1] == "bf16" and "bf16" not in typed)
                        for r, t in zip(low, inferred, strict=True))
            self.low.update(k for k, r in zip(outs, low, strict=True) if k and r)
            if override is not None:  # where it computes: "bf16" (inputs rounded) or "fp32"
                low_in = self.target.precision.rounds_inputs(self.registry.get_op(op.type), override)
                self.computes[next(k for k in outs if k)] = "bf16" if low_in else "fp32"
        self.steps.append(Step(len(self.steps), phase, op, layer, tuple(ins), tuple(outs), how, kattrs,
                               recompute, kernel))

    def declare(self, key: str, shape: Sequence[Any], dtype: str, binds: Mapping[str, int],
                kind: str) -> None:
        self.types[key] = (evaluate_shape(tuple(parse_dim(d) for d in shape), binds), dtype)
        self.kinds[key] = kind

    def param_infos(self) -> list[ParamInfo]:
        return [ParamInfo(key, shape, spec.init, trainable, self.grads.get(key), self.state(key))
                for key, spec, shape, trainable in self.params]

    def state(self, key: str) -> tuple[str, ...]:
        opt = self.optimizer
        return tuple(f"{opt.name}.{m}.{key}" for m in opt.state) if opt and key in self.owned else ()

    # -- the passes over the graphs

    def schedule_forward(self, task: str) -> None:
        self.task = task
        graph = self.model.forward
        assert graph is not None
        if task == "logits":
            graph = _logits_graph(graph, self.registry)
        self.graph = graph
        env: dict[str, str] = {}
        used = {i for op in graph.ops for i in op.inputs}
        for d in graph.inputs:
            if d.name in used:
                self.declare(d.name, d.shape, d.dtype, self.binds, "input")
                env[d.name] = d.name
        stored = {key for key, *_ in self.params}
        for d in graph.params:
            if d.name in stored:
                env[d.name] = d.name
        for op in graph.ops:
            if op.type == "call":
                self.forward_call(op, env)
            elif op.type == "call_backward":
                raise KilnError("a forward graph cannot hold call_backward", code="E003")
            else:
                self.add("forward", op, [env[i] if i else "" for i in op.inputs], self.own(op.outputs, env),
                         self.binds)
        out = "logits" if task == "logits" else "loss"
        self.kinds[env[out]] = "output"  # read by the caller after the run: live to the end
        self.env = env

    def fork(self) -> _Scheduler:
        """A copy of this scheduler after its forward, to schedule a backward on (caches shared)."""
        new = copy.copy(self)
        new.steps, new.types, new.kinds = list(self.steps), dict(self.types), dict(self.kinds)
        new.grads = dict(self.grads)
        new.shared, new.host = {}, {}
        new.low = set(self.low)
        return new

    def schedule_rest(self, task: str, plan: RecomputePlan) -> None:
        self.plan = plan
        if task == "train":
            self.offload_steps()
            self.backward(self.graph, self.env)
        # gradients and optimizer state exist for every task, so that all Programs share one layout
        for key, _, shape, _ in self.params:
            missing = key in self.trainable and key not in self.grads
            for k in [*([f"grad.{key}"] if missing else []), *self.state(key)]:
                self.types[k] = (shape, "fp32")
                self.kinds[k] = "gradient" if k == f"grad.{key}" else "optimizer_state"
            if key in self.trainable:
                self.grads.setdefault(key, f"grad.{key}")
        if task != "train":
            return
        for name in self.sync.outputs:
            self.types[name], self.kinds[name] = ((1,), "fp32"), "output"
        for name, n in self.sync.buffers:
            self.types[name], self.kinds[name] = ((n,), "fp32"), "buffer"
        self.sync_in_backward()
        for op in self.sync.grad_sync:
            self.add_update(attrs.evolve(op, inputs=[self.grads.get(i, i) for i in op.inputs]), op.attrs,
                            "grad_sync")
        if self.optimizer is not None:
            self.optimizer_steps(self.optimizer)

    # -- what the recompute planner sees

    def slot_sharing(self) -> list[tuple[list[str], list[str], str]]:
        """Per layer of every stack, (keys of a slot, keys of the slot it ``shares_with``, what to call the
        pair): the slot and its aliases, as the layer names them."""
        out = []
        for call in self.calls.values():
            layout = call.callee.activations
            for sl in layout.slots:
                if not sl.shares_with:
                    continue
                other = layout.get(sl.shares_with)
                if other is None:
                    raise KilnError(f"block {call.callee.name!r}: slot {sl.name!r} shares_with "
                                    f"{sl.shares_with!r}, which is not a slot of the block", code="E002")
                for i in range(call.first, call.first + len(call.layers)):
                    pre = f"{call.prefix}.{i}."
                    out.append(([pre + n for n in (sl.name, *sl.aliases)],
                                [pre + n for n in (other.name, *other.aliases)],
                                f"block {call.callee.name!r}, layer {i}: slot {sl.name!r} shares_with "
                                f"{other.name!r}"))
        return out

    def nbytes(self, key: str) -> int:
        shape, _ = self.types[key]
        return _align(math.prod(shape) * ITEMSIZE[self.storage(key)])

    def storage(self, key: str) -> str:
        """The dtype ``key`` is stored in: the recipe's low type for a rounded tensor outside the fp32
        slots (weights, gradients, optimizer state, inputs), else its float (or integer) type."""
        if key in self.low and self.kinds.get(key) in (None, "output"):
            return str(self.target.precision.low)
        return self.np_dtype(self.types[key][1])

    def derived(self, graph: Graph, opts: DeriveBackwardOptions) -> Any:
        """The backward of ``graph``: its module's explicit ``backward`` (validated, and checked against
        the derived one by :func:`kiln.core.autodiff.explicit_backward`), else the derived one."""
        key = (graph.name, opts)
        if key not in self._derived:
            owner = next((m for m in (self.model, *self.modules.values()) if m.forward is graph), None)
            if owner is not None and owner.backward is not None:
                from kiln.core.autodiff._explicit import explicit_backward

                res = explicit_backward(owner, loss_name=opts.loss_name, registry=self.registry,
                                        modules=self.modules)
            else:
                res = derive_backward(graph, opts, registry=self.registry, modules=self.modules)
            self._derived[key] = res
        return self._derived[key]

    def block_options(self, call: _Call) -> DeriveBackwardOptions:
        assert call.callee.forward is not None
        stops = self.stops(call.callee.forward, f"{call.prefix}.{call.first}.")
        return DeriveBackwardOptions(stop_gradients=stops, loss_name=None)

    def plan_context(self) -> PlanContext:
        """The blocks of the forward just scheduled, sized and costed for this shape."""
        blocks: dict[str, BlockContext] = {}
        call_keys: set[str] = set()
        chain: list[tuple[str, tuple[int, ...]]] = []
        before: list[str] = []  # the keys the layer before returns
        for call in self.calls.values():
            g = call.callee.forward
            assert g is not None
            lenv = call.layers[0]
            call_keys.update(call.inputs + call.outputs)
            n = min(len(g.inputs), len(g.outputs))  # carried: output j becomes the next layer's input j
            chain.append((call.callee.name,
                          tuple(before.index(k) if k in before else -1 for k in call.inputs[:n])))
            chain += [(call.callee.name, tuple(range(n)))] * (len(call.layers) - 1)
            before = call.outputs
            if call.callee.name in blocks:  # one block in two stacks: one context, its layers in both
                b = blocks[call.callee.name]
                blocks[call.callee.name] = attrs.evolve(b, layers=b.layers + len(call.layers))
                continue
            sizes = {n: self.nbytes(k) for n, k in lenv.items() if k in self.types}
            costs = [self.cost(self.steps[i]) for i in call.first_steps]
            # no gradient reaches the stack (nothing trains through it): its backward never runs
            runs = call.prefix in self.differentiated()
            saves = self.derived(g, self.block_options(call)).saves if runs else ()
            carries = tuple((o.name, i.name) for o, i in zip(g.outputs, g.inputs, strict=False))
            probes = tuple(Probe.of(self.steps[i], self.probe_type, c)
                           for i, c in zip(call.first_steps, costs, strict=True))
            blocks[call.callee.name] = BlockContext(call.callee, len(call.layers), saves, FrozenDict(sizes),
                                                    tuple(costs), carries, probes)
        fixed = 0
        if self.task == "train":
            root: dict[str, str] = {}
            for st in self.steps:
                for o in st.outputs:
                    if o:
                        root[o] = root.get(st.inputs[0], st.inputs[0]) if st.how == "alias" else o
            saves = self.derived(self.graph, DeriveBackwardOptions(
                loss_name="loss", stop_gradients=self.stops(self.graph))).saves
            keys = {root.get(self.env[n], self.env[n]) for n in saves if n in self.env}
            stacks = {root.get(k, k) for k in call_keys}  # the blocks' plans count these (a view's storage)
            fixed = sum(self.nbytes(k) for k in keys - stacks if k not in self.kinds)
        return PlanContext(self.model, tuple(blocks.values()), self.mode, self.registry, fixed,
                           frozenset(self.env), tuple(chain), self.target)

    def probe_type(self, key: str) -> tuple[tuple[int, ...], str]:
        """A tensor key's (shape, NumPy dtype), as the measured cost model times it."""
        shape, ir_dtype = self.types[key]
        return shape, self.np_dtype(ir_dtype)

    def layer_index(self, call: _Call, layer: int) -> int:
        """The position of ``call``'s stack layer ``layer`` among the model's block layers in forward
        order (what ``BlockPlan.layer_ids`` name)."""
        calls = list(self.calls.values())
        k = next(k for k, c in enumerate(calls) if c is call)
        return sum(len(c.layers) for c in calls[:k]) + layer - call.first

    def differentiated(self) -> set[str]:
        """The stacks (by parameter prefix) whose backward the model's backward runs."""
        opts = DeriveBackwardOptions(loss_name="loss", stop_gradients=self.stops(self.graph))
        ops = self.derived(self.graph, opts).backward.ops
        return {str(op.attrs.get("params", "blocks")) for op in ops if op.type == "call_backward"}

    def cost(self, step: Step) -> Cost:
        opdef = self.registry.get_op(step.op.type)
        if step.how == "alias":
            return Cost()
        if opdef.cost is None:
            return Cost(0.0, float(sum(self.nbytes(k) for k in step.outputs if k)))
        shapes = [self.types[k][0] if k else () for k in step.inputs]
        return opdef.cost(shapes, step.attrs)

    def own(self, names: Sequence[str], env: dict[str, str], prefix: str = "") -> list[str]:
        """Keys for the outputs of an op (``prefix + name``), recorded in ``env``."""
        keys = []
        for n in names:
            if not n:
                keys.append("")
                continue
            key = prefix + n
            if key in self.types:
                raise KilnError(f"tensor {key!r} is defined twice in the lowered program", code="E017")
            env[n] = key
            keys.append(key)
        return keys

    def forward_call(self, op: Op, env: dict[str, str]) -> None:
        callee = self.modules.get(str(op.attrs.get("module")))
        if callee is None or callee.forward is None:
            raise KilnError(f"op 'call' names module {op.attrs.get('module')!r}, which is not in the bundle",
                            code="E002")
        g = callee.forward
        if any(o.type in ("call", "call_backward") for o in g.ops):
            raise KilnError(f"block {callee.name!r} calls another block; nested stacks are not supported")
        prefix, first = _stack(op)
        binds = {**self.binds, **dim_bindings(callee.config)}
        n_layers = parse_dim(op.attrs["n_layers"]).evaluate(self.binds)
        carry = [env[i] for i in op.inputs]
        if len(carry) != len(g.inputs) or len(op.outputs) != len(g.outputs):
            raise KilnError(f"call of {callee.name!r} passes {len(carry)} inputs and names {len(op.outputs)} "
                            f"outputs; the block takes {len(g.inputs)} and returns {len(g.outputs)}",
                            code="E003")
        layers: list[dict[str, str]] = []
        first_steps: list[int] = []
        call_inputs = list(carry)
        for i in range(first, first + n_layers):
            lenv: dict[str, str] = {}
            for d, key in zip(g.inputs, carry, strict=True):
                want = evaluate_shape(d.shape, binds)
                if self.types[key][0] != want:
                    raise KilnError(f"layer {i} of {callee.name!r}: input {d.name!r} is "
                                    f"{list(self.types[key][0])} "
                                    f"but the block declares {list(want)}", code="E004")
                lenv[d.name] = key
            for d in g.params:
                lenv[d.name] = f"{prefix}.{i}.{d.name}"
                if lenv[d.name] not in self.types:
                    raise KilnError(f"block parameter {d.name!r} has no ParamSpec in {callee.name!r}",
                                    code="E002")
            for bop in g.ops:
                if i == first:
                    first_steps.append(len(self.steps))
                self.add("forward", bop, [lenv[n] if n else "" for n in bop.inputs],
                         self.own(bop.outputs, lenv, f"{prefix}.{i}."), binds, i)
            carry[:len(g.outputs)] = [lenv[d.name] for d in g.outputs]
            layers.append(lenv)
        for name, key in zip(op.outputs, carry, strict=False):
            env[name] = key
        self.calls[(callee.name, prefix, str(first))] = _Call(
            callee, prefix, layers, first, binds, call_inputs, carry[:len(g.outputs)], first_steps)

    def stops(self, graph: Graph, prefix: str = "") -> tuple[str, ...]:
        """Parameters of ``graph`` that get no gradient; a stack trains if any of its parameters does."""
        return tuple(d.name for d in graph.params if prefix + d.name not in self.trainable
                     and not any(k.startswith(f"{d.name}.") for k in self.trainable))

    def backward(self, graph: Graph, env: dict[str, str]) -> None:
        res = self.derived(graph, DeriveBackwardOptions(loss_name="loss", stop_gradients=self.stops(graph)))
        benv: dict[str, str] = {}
        for d in res.backward.inputs:
            if d.name != SEED:
                raise KilnError(f"the backward of {graph.name!r} is seeded by {d.name!r}; "
                                "kiln trains on 'loss'")
            self.declare(SEED, d.shape, d.dtype, self.binds, "input")
            benv[SEED] = SEED
        stack_grads: set[str] = set()
        for op in res.backward.ops:
            if any(n in stack_grads for n in op.inputs):  # the per-layer gradients are pinned already
                if op.type != "copy":
                    raise KilnError(f"op {op.type!r} reads the stacked gradient {op.inputs[0]!r}; only the "
                                    "runtime may consume it")
                stack_grads.update(op.outputs)
                continue
            ins = [self.read(n, benv, env) for n in op.inputs]
            if op.type == "call_backward":
                stack_grads.add(op.outputs[-1])
                self.backward_call(op, ins, benv)
            else:
                self.add("backward", op, ins, self.own(op.outputs, benv), self.binds,
                         source=_derived_from(res.backward, op),
                         float32_reads=_float32_reads(op, res.backward, graph, env, self.low))
        for name, g in res.grads.items():
            if name in self.trainable:
                self.pin_grad(name, benv[g])

    def offload_steps(self) -> None:
        """Copy each offloaded tensor of every layer to its host-pool tensor (``<key>:host``) right after
        the last forward step that reads its storage (or makes it), so its device slot ends there."""
        want: set[str] = set()
        for call in self.calls.values():
            for i, lenv in enumerate(call.layers, call.first):
                bp = self.plan.block(call.callee.name, self.layer_index(call, i))
                if bp is not None:
                    g = call.callee.forward
                    assert g is not None
                    views = {o for k, op in enumerate(g.ops) if self.registry.get_op(op.type).alias
                             for o in op.outputs}
                    want.update(lenv[n] for n in bp.offloaded if n not in views)
        if not want:
            return
        root: dict[str, str] = {}
        last: dict[str, int] = {}
        for st in self.steps:
            for o in st.outputs:
                if o:
                    root[o] = root.get(st.inputs[0], st.inputs[0]) if st.how == "alias" else o
            for k in (*st.inputs, *st.outputs):
                if k and root.get(k, k) in want:
                    last[root.get(k, k)] = st.index
        after: dict[int, list[str]] = {}
        for k in sorted(want):
            after.setdefault(last[k], []).append(k)
        steps: list[Step] = []
        for st in self.steps:
            steps.append(attrs.evolve(st, index=len(steps)))
            for k in after.get(st.index, ()):
                host = self.host[k] = f"{k}:host"
                self.types[host] = self.types[k]
                if k in self.low:  # the copy keeps the stored type (bf16 under that recipe)
                    self.low.add(host)
                steps.append(Step(len(steps), "forward", Op("copy", (k,), (host,)), st.layer, (k,), (host,),
                                  "offload"))
        self.steps = steps

    def read(self, name: str, benv: Mapping[str, str], env: Mapping[str, str]) -> str:
        if not name:
            return ""
        if name.startswith("saved."):
            return env[name.removeprefix("saved.")]
        if name in benv:
            return benv[name]
        if name in env:  # a parameter, read by its plain name
            return env[name]
        raise KilnError(f"the backward reads {name!r}, which nothing defines", code="E002")

    def pin_grad(self, param: str, key: str) -> None:
        """Make ``key`` the gradient slot of ``param`` (a copy when it is taken or cannot be pinned)."""
        if key in self.kinds:  # already pinned (another parameter's gradient, an input)
            new = f"grad.{param}"
            step = self.steps[-1]
            self.add(step.phase, Op("copy", (key,), (new,)), [key], self.own([new], {}), self.binds,
                     step.layer)
            key = new
        self.grads[param] = key
        self.kinds[key] = "gradient"

    def backward_call(self, op: Op, ins: list[str], benv: dict[str, str]) -> None:
        callee = self.modules[str(op.attrs["module"])]
        prefix, first = _stack(op)
        call = self.calls[(callee.name, prefix, str(first))]
        g = callee.forward
        assert g is not None
        n_out = len(g.outputs)
        res = self.derived(g, self.block_options(call))
        p = str(res.backward.metadata.get("grad_prefix", "d_"))
        grads = dict(res.grads)
        fed = {d.name for d in res.backward.inputs}
        d_chain = list(ins[:n_out])
        d_rest: list[str | None] = [None] * (len(g.inputs) - n_out)
        layers = range(first, first + len(call.layers))
        plans = {i: self.plan.block(callee.name, self.layer_index(call, i)) for i in layers}
        stack: dict[int, _Replay] = {}
        if any(bp is not None and bp.stack for bp in plans.values()):
            # block granularity: every layer's replay, in forward order, before the stack's backward
            for i in layers:
                bp = plans[i]
                if bp is None or not bp.stack:
                    raise KilnError(f"stack {call.prefix!r}: block granularity needs every layer of the "
                                    "stack to take the block plan")
                stack[i] = _Replay(self, bp, call, i, stack.get(i - 1))
                stack[i].all()
        for i in reversed(layers):
            lenv = call.layers[i - first]
            e = {p + d.name: k for d, k in zip(g.outputs, d_chain, strict=True) if p + d.name in fed}
            pre = f"{call.prefix}.{i}."
            bplan = plans[i]
            rc = stack.get(i) or (_Replay(self, bplan, call, i) if bplan is not None and (
                bplan.recomputed or bplan.offloaded) else None)
            if rc is not None and bplan is not None and bplan.whole_block and not stack:
                rc.all()
            for bop in res.backward.ops:
                moved = rc.moved if rc is not None else set()
                bins = [rc.source(n[6:], {}) if rc is not None and n.startswith("saved.") and n[6:] in moved
                        else self.read(n, e, lenv) for n in bop.inputs]
                self.add("backward", bop, bins, self.own(bop.outputs, e, pre), call.binds, i,
                         source=_derived_from(res.backward, bop),
                         float32_reads=_float32_reads(bop, res.backward, g, lenv, self.low))
            for d in g.params:
                if d.name in grads and lenv[d.name] in self.trainable:
                    self.pin_grad(lenv[d.name], e[grads[d.name]])
            new_chain = []
            for d in g.inputs[:n_out]:
                if d.name in grads:
                    new_chain.append(e[grads[d.name]])
                else:  # no gradient flows into this input: the layer below gets zeros
                    z = f"{pre}{p}{d.name}:zero"
                    self.add("backward", Op("zeros", (), (z,), {"shape": list(self.types[lenv[d.name]][0]),
                                                                "dtype": d.dtype}), [], self.own([z], {}),
                             call.binds, i)
                    new_chain.append(z)
            for k, d in enumerate(g.inputs[n_out:]):
                if d.name not in grads or not op.outputs[n_out + k]:
                    continue
                cur = e[grads[d.name]]
                if d_rest[k] is not None:  # an input every layer reads: its gradients add up
                    acc = f"{pre}{p}{d.name}:acc"
                    self.add("backward", Op("add", (str(d_rest[k]), cur), (acc,)), [str(d_rest[k]), cur],
                             self.own([acc], {}), call.binds, i)
                    cur = acc
                d_rest[k] = cur
            d_chain = new_chain
        for name, key in zip(op.outputs[:-1], [*d_chain, *d_rest], strict=True):
            if name and key is not None:
                benv[name] = key

    def optimizer_steps(self, opt: Optimizer) -> None:
        """The global gradient norm, then one ``opt.update_op`` per trained parameter with the attributes
        of its parameter group; they read one scratch buffer (``optimizer.workspace``)."""
        trained = [(key, spec, shape) for key, spec, shape, t in self.params if t]
        if not trained:
            return
        self.update = True
        self.types[WORKSPACE] = ((max(math.prod(s) for _, _, s in trained),), "fp32")
        norm = self.sync.norm if self.sync.norm is not None else tuple(self.grads[k] for k, _, _ in trained)
        self.add_update(Op("grad_norm", norm, ()), {})
        for key, spec, _ in trained:
            if key in self.owned:
                ins = (key, self.grads[key], *self.state(key), WORKSPACE)
                self.add_update(Op(opt.update_op, ins, ()), opt.update_attrs(key, spec.inferred_role()))
        for op in self.sync.after_update:
            self.add_update(op, op.attrs)

    def sync_in_backward(self) -> None:
        """Each op of ``SyncPlan.in_backward`` right after the last backward step that writes one of the
        gradients it reads, in the order given where several follow one step."""
        if not self.sync.in_backward:
            return
        last: dict[str, int] = {}
        for st in self.steps:
            if st.phase == "backward":
                last.update((o, st.index) for o in st.outputs if o)
        after: dict[int, list[Op]] = {}
        for op in self.sync.in_backward:
            ins = tuple(self.grads.get(i, i) for i in op.inputs)
            at = max((last[k] for k in ins if k in last), default=len(self.steps) - 1)
            after.setdefault(at, []).append(op.evolve(inputs=ins))
        steps, self.steps = self.steps, []
        for st in steps:
            self.steps.append(attrs.evolve(st, index=len(self.steps)))
            for op in after.get(st.index, ()):
                self.add_update(op, op.attrs, "backward")

    def add_update(self, op: Op, attrs_: Mapping[str, Any], phase: str = "optimizer") -> None:
        """An op updating its inputs in place: an optimizer update, or a collective of a SyncPlan."""
        opdef = self.registry.get_op(op.type)
        self.steps.append(Step(len(self.steps), phase, op, None, op.inputs, (), "optimizer",
                               FrozenDict(opdef.resolve_attrs(attrs_)), kernel=self.kernel(opdef).key))

    def kernel(self, opdef: Any, override: Override | None = None) -> Any:
        """The kernel the target backend runs for ``opdef`` (an error naming both if it has none); under a
        low-precision recipe its kernel for that type (``op@backend:bfloat16``) where it has one."""
        recipe = self.target.precision
        low = recipe.name != "fp32"
        if override is not None and (override.compute or override.region) is not None:
            low = (override.compute or override.region) == "bf16"
        return self.target.kernels.resolve(opdef, self.target.backend,
                                           (recipe.low if low else None) or self.target.dtype)

    def override(self, op: Op, outs: Sequence[str], layer: int | None, phase: str,
                 recompute: bool, source: str | None = None) -> Override | None:
        """The ``@precision``/``@dtype`` override of a forward op (or its replay), found by the module
        that computes it and its first output's name; for a backward op derived from a forward op
        (``source``: that op's first output), the forward's compute (as autograd runs an op's backward
        in the precision its forward ran in), not its output type, which names the forward's tensor."""
        forward = phase == "forward" or recompute
        if not self.overrides or not op.outputs or not (forward or source):
            return None
        module = self.model.name
        if layer is not None:
            first = next((k for k in outs if k), "")
            module = next((m for pre, m in self._stacks.items() if first.startswith(pre)), module)
        name = op.outputs[0] if forward else str(source)
        regions = [(pre, o) for (m, pre), o in self.overrides.items() if m == module and pre.startswith("@")
                   and (pre == "@" or name.startswith(pre[1:] + "."))]
        region = max(regions, key=lambda x: len(x[0]))[1] if regions else None  # the innermost module
        own = self.overrides.get((module, name))
        if own is not None and region is not None:
            own = attrs.evolve(own, region=region.region)
        found = own or region
        if found is None or forward:
            return found
        return None if found.compute is None and found.region is None else attrs.evolve(found, output=None)


def _derived_from(backward: Graph, op: Op) -> str | None:
    """The first output of the forward op whose backward rule emitted ``op`` (a derived backward
    records it in its metadata), or None."""
    found = backward.metadata.get("derived_from", {}).get(op.outputs[0]) if op.outputs else None
    return None if found is None else str(found)


def _float32_reads(op: Op, backward: Graph, forward: Graph, keys: Mapping[str, str],
                   low: set[str]) -> frozenset[int]:
    """Positions of the inputs of backward ``op`` that are float32 tensors under the precision recipe's
    type promotion although their values may be bf16: the gradient of a forward tensor that is not bf16
    (``keys``: forward name -> key; ``low``: the keys holding bf16). torch's autograd gives a gradient its
    tensor's dtype (a bf16 op's gradient reaching a float32 tensor is cast back to float32), so a
    ``promote`` op reading it writes float32. A gradient shared by several tensors (an add's passes it
    on to both operands) is typed as the output of the forward op ``op`` derives from, when it is one."""
    primal = backward.metadata.get("gradient_of", {})
    source = _derived_from(backward, op)
    outputs = next((set(f.outputs) for f in forward.ops if source and f.outputs and f.outputs[0] == source),
                   set())
    found = set()
    for i, name in enumerate(op.inputs):
        of = set(primal.get(name, ()))
        of = (of & outputs) or of
        if of and any(n in keys and keys[n] not in low for n in of):
            found.add(i)
    return frozenset(found)


def _stack(op: Op) -> tuple[str, int]:
    """The stack (parameter prefix) a ``call`` or ``call_backward`` runs, and its first layer."""
    return str(op.attrs.get("params", "blocks")), int(op.attrs.get("first", 0))


def _kernel_dtype(dtype: str) -> Any:
    """The float type kernels get for ``dtype`` attributes: a NumPy dtype where NumPy has one (bfloat16
    needs ml_dtypes), else the name."""
    try:
        return np.dtype(dtype)
    except TypeError:
        return dtype


class _Replay:
    """The recompute ops of one layer, emitted on demand: right before the first backward step that
    reads one of their outputs (after what they read themselves). Outputs are ``<key>:recompute``.
    An offloaded tensor is fetched from the host pool the same way, on first read (``<key>:fetch``;
    a view of it is taken again from the fetched storage)."""

    def __init__(self, s: _Scheduler, plan: BlockPlan, call: _Call, layer: int,
                 before: _Replay | None = None) -> None:
        self.s, self.plan, self.call, self.layer = s, plan, call, layer  # layer: the stack's index
        self.lenv = call.layers[layer - call.first]
        self.recomputed = set(plan.recomputed)
        # an offloaded storage and every view of it (a chain of views too) come back from the host
        self.offloaded = set(plan.offloaded)
        g = call.callee.forward
        assert g is not None
        for op in g.ops:
            if op.inputs and op.inputs[0] in self.offloaded and s.registry.get_op(op.type).alias:
                self.offloaded.add(op.outputs[0])
        #: block granularity: the layer before's replay, whose outputs are this layer's carried inputs
        self.before = before
        self.carried = {i.name: o.name for i, o in zip(g.inputs, g.outputs, strict=False)} if before else {}
        self.moved = self.recomputed | self.offloaded | set(self.carried)  # not read from the forward
        self.unit = {o: u for u, rop in reversed(list(enumerate(plan.ops))) for op in rop.replay
                     for o in op.outputs if o}
        self.keys: dict[str, str] = {}
        self.busy: set[int] = set()

    def key(self, name: str) -> str:
        if name not in self.keys:
            u = self.unit.get(name)
            if u is None:
                raise KilnError(f"block {self.plan.module!r}: {name!r} is marked recomputed but no recompute "
                                "op produces it", code="E021")
            self.emit(u)
        return self.keys[name]

    def source(self, name: str, local: dict[str, str]) -> str:
        """The key a replayed op reads: made earlier in its recompute op, recomputed, or the forward's."""
        if not name:
            return ""
        if name in local:
            return local[name]
        if self.before is not None and name in self.carried:  # replayed by the layer before, or kept there
            out = self.carried[name]
            return self.before.key(out) if out in self.before.unit else self.before.lenv[out]
        if name in self.offloaded:
            return self.fetch(name)
        return self.key(name) if name in self.recomputed else self.lenv[name]

    def fetch(self, name: str) -> str:
        """The device copy of offloaded ``name``: copied back from the host pool (a view: taken again)."""
        if name not in self.keys:
            g = self.call.callee.forward
            assert g is not None
            k = g.producers()[name]
            op = g.ops[k]
            pre = f"{self.call.prefix}.{self.layer}."
            out = self.s.own([f"{name}:fetch"], {}, pre)[0]
            if self.s.registry.get_op(op.type).alias:
                ins = [self.source(i, {}) for i in op.inputs]
                self.s.add("backward", op, ins, [out, *[""] * (len(op.outputs) - 1)], self.call.binds,
                           self.layer)
            else:
                src = self.lenv[name]
                self.s.types[out] = self.s.types[src]
                host = self.s.host[src]
                if host in self.s.low:
                    self.s.low.add(out)
                self.s.steps.append(Step(len(self.s.steps), "backward", Op("copy", (host,), (out,)),
                                         self.layer, (host,), (out,), "fetch"))
            self.keys[name] = out
        return self.keys[name]

    def all(self) -> None:
        for u in range(len(self.plan.ops)):
            if not any(o in self.keys for op in self.plan.ops[u].replay for o in op.outputs if o):
                self.emit(u)

    def emit(self, u: int) -> None:
        rop = self.plan.ops[u]
        if u in self.busy:
            raise KilnError(f"block {self.plan.module!r}: recompute op {rop.name!r} depends on itself",
                            code="E022")
        self.busy.add(u)
        pre = f"{self.call.prefix}.{self.layer}."
        local: dict[str, str] = {}
        for op in rop.replay:
            ins = [self.source(n, local) for n in op.inputs]
            outs = self.s.own([f"{o}:recompute" if o else "" for o in op.outputs], {}, pre)
            self.s.add("backward", op, ins, outs, self.call.binds, self.layer, recompute=True)
            local.update({o: k for o, k in zip(op.outputs, outs, strict=True) if o})
        self.keys.update(local)
        for name in self.plan.shared:
            if name in local:
                self.s.shared.setdefault((self.plan.module, self.call.prefix, name), []).append(local[name])
        self.busy.discard(u)


def _logits_graph(graph: Graph, registry: OpRegistry | None = None) -> Graph:
    """The forward with its LM-head loss replaced by the logits ``x @ weight^T`` (or by the op its
    :attr:`OpDef.logits` names), dead ops removed."""
    ops: list[Op] = []
    for op in graph.ops:
        if op.type == "fused_lm_head_loss":
            if op.attrs.get("softcap") is not None:
                raise OpError("logits of a soft-capped LM head are not supported yet", op=op.type)
            ops.append(Op("matmul", op.inputs[:2], ("logits",), {"transpose": "NT"}, loc=op.loc))
            break
        head = registry.get_op(op.type).logits if registry is not None and op.type in registry else None
        if head is not None:
            takes = {a.name for a in registry.get_op(head).attrs} if registry is not None else set()
            ops.append(Op(head, op.inputs[:2], ("logits",), {k: v for k, v in op.attrs.items() if k in takes},
                          loc=op.loc))
            break
        ops.append(op)
    else:
        raise KilnError(f"graph {graph.name!r} has no fused_lm_head_loss op to turn into logits", code="E002")
    live, kept = {"logits"}, []
    for op in reversed(ops):
        if any(o in live for o in op.outputs):
            kept.append(op)
            live.update(i for i in op.inputs if i)
    return graph.evolve(ops=tuple(reversed(kept)), outputs=())


# ---------------------------------------------------------------------------------------------
# Passes 2 and 3: lifetimes and placement


Layout = list[tuple[str, str, str, tuple[int, ...], int, int]]


def persistent_layout(params: Sequence[tuple[str, ParamSpec, tuple[int, ...], bool]],
                      optimizer: Optimizer | None, float_dtype: str,
                      owned: frozenset[str] | None = None) -> tuple[Layout, int]:
    """The head of every arena of a model: (slot, kind, parameter, shape, offset, bytes) for each
    weight, then each trained parameter's gradient, then its optimizer state (only for the parameters
    in ``owned``, a data-parallel rank's share, when given); and the total bytes."""
    entries = [(k, "weight", k, shape) for k, _, shape, _ in params]
    entries += [(f"grad.{k}", "gradient", k, shape) for k, _, shape, t in params if t]
    if optimizer is not None:
        entries += [(f"{optimizer.name}.{m}.{k}", "optimizer_state", k, shape) for k, _, shape, t in params
                    if t and (owned is None or k in owned) for m in optimizer.state]
    out: Layout = []
    offset = 0
    for name, kind, param, shape in entries:
        size = _align(math.prod(shape) * ITEMSIZE[float_dtype])
        out.append((name, kind, param, shape, offset, size))
        offset += size
    return out, offset


def head_pair(steps: Sequence[Step], computes: Mapping[str, str]) -> tuple[Step, Step] | None:
    """The LM head's two steps one fused pass can run: the forward's last step ``fused_lm_head_loss`` and
    the backward's first ``fused_lm_head_loss_backward``, seeded by ``d_loss``, on the forward's inputs and
    log-sum-exp, with the same attributes and no softcap, neither moved off the recipe by an annotation
    (``computes``); None where the steps are not such a pair. ``compile`` plans the fusion from it where
    the backend can run it; a step-time model prices a Program for another backend with it."""
    fwds = [st for st in steps if st.phase == "forward" and st.how != "alias"]
    bwds = [st for st in steps if st.phase == "backward" and st.how != "alias"]
    if not fwds or not bwds:
        return None
    fwd, bwd = fwds[-1], bwds[0]
    keys = ("ignore_index", "chunk_size", "softcap")
    if (fwd.op.type, bwd.op.type) != ("fused_lm_head_loss", "fused_lm_head_loss_backward") \
            or any(k in computes for st in (fwd, bwd) for k in st.outputs[:1]) \
            or {k: fwd.attrs.get(k) for k in keys} != {k: bwd.attrs.get(k) for k in keys} \
            or fwd.attrs.get("softcap") is not None or bwd.inputs[0] != SEED \
            or tuple(bwd.inputs[1:4]) != tuple(fwd.inputs) or bwd.inputs[4] != fwd.outputs[1] \
            or bwd.inputs[5] or not all(fwd.outputs):
        return None
    return fwd, bwd


def _fusions(s: _Scheduler, tensors: Mapping[str, Tensor]) -> tuple[Fusion, ...]:
    """The LM-head loss and its backward as one pass, where the backend implements it.

    The forward's last step is the LM-head loss and the backward's first is its backward, seeded by the
    Program input ``d_loss`` (set before the forward runs): one pass can compute the loss and the
    gradients without the backward's recompute of the logits. Only when the gradient slots overlap
    none of the forward step's tensors; a run of the forward alone keeps the plain step.

    The pass computes as the recipe computes the head: the Program's float type, or under a
    low-precision recipe (one an ``@precision``/``@dtype`` brings in too) the low type, with the
    backend's fused kernel for that type itself (an any-type kernel computes in the float type), where
    the two steps run their low-type kernels. A head an ``@precision``/``@dtype`` moves off the recipe
    (``computes``: it then reads its float inputs as that annotation says) keeps its two steps, on
    every backend.
    """
    backend = s.target.backend
    if FUSED_HEAD not in getattr(backend, "capabilities", ()):
        return ()
    recipe = s.target.precision
    dtype = str(recipe.low) if recipe.lowers else s.target.dtype
    kernel = s.target.kernels.lookup(FUSED_HEAD, backend, dtype)
    pair = head_pair(s.steps, s.computes) if kernel is not None else None
    if pair is None:
        return ()
    fwd, bwd = pair
    if recipe.lowers and (kernel.dtype != dtype or not all(
            st.kernel and s.target.kernels[st.kernel].dtype == dtype for st in (fwd, bwd))):
        return ()

    def ranges(names: Sequence[str]) -> list[tuple[int, int]]:
        return [(tensors[k].offset, tensors[k].offset + tensors[k].nbytes) for k in names if k]

    read = ranges([*fwd.inputs, *fwd.outputs, SEED])
    if any(a < d and c < b for a, b in ranges(bwd.outputs) for c, d in read):
        return ()
    return (Fusion(FUSED_HEAD, (fwd.index, bwd.index), (SEED, *fwd.inputs), (*fwd.outputs, *bwd.outputs[:2]),
                   FrozenDict({"ignore_index": int(fwd.attrs.get("ignore_index", -100))}),
                   kernel.key),)


def _storage(s: _Scheduler) -> dict[str, str]:
    """Each tensor's storage dtype (:meth:`_Scheduler.storage`); a view, and an offloaded tensor's host
    and fetched copies, keep the dtype of the storage they come from."""
    out = {k: s.storage(k) for k in s.types}
    for st in s.steps:
        if st.how in ("alias", "offload", "fetch") and st.inputs and st.inputs[0]:
            for k in st.outputs:
                if k and k not in s.kinds:
                    out[k] = out[st.inputs[0]]
    return out


def _place(s: _Scheduler, workspace: Mapping[int, int] | None = None,
           held: Mapping[str, tuple[int, int, int]] | None = None
           ) -> tuple[list[Slot], dict[str, Tensor], int, int]:
    """The arena plan; ``workspace``: step index -> bytes of the backend's temporaries in that step, each
    placed as a slot ``workspace.<index>`` (kind ``workspace``) live during its step alone; ``held``: name
    -> (first step, last step, bytes) of the backend's buffers kept across steps, each a slot of that name
    (kind ``held``) live from its first step to its last."""
    dtypes = _storage(s)
    nbytes = {k: math.prod(shape) * ITEMSIZE[dtypes[k]] for k, (shape, _) in s.types.items()}
    steps = s.steps
    last: dict[str, int] = {}
    for st in steps:
        for k in st.inputs:
            if k:
                last[k] = st.index
    # @lifetime: buffers kept longer than their last reader (seed 004 §7.2.3)
    replayed = {k.removesuffix(":recompute") for st in steps if st.recompute for k in st.outputs if k}
    kept = lifetime_spans(steps, s.model, s.modules, s._stacks, replayed | set(s.host))
    for k, (_, end) in kept.items():
        last[k] = max(last.get(k, -1), end)
    shared = {k for keys in s.shared.values() for k in keys}
    root = {k: k for k in s.kinds}  # tensor -> the tensor whose slot it uses
    members = {k: [k] for k in s.kinds}
    birth: dict[str, int] = {}
    for st in steps:
        if st.how == "optimizer":
            continue
        inplace = s.target.kernels[st.kernel].inplace if st.how == "out" and st.kernel else frozenset()
        taken: set[str] = set()
        for k_out, out in enumerate(st.outputs):
            if not out:
                continue
            if out in s.kinds:  # pinned (a gradient): its own slot; a view into it must copy
                if st.how == "alias":
                    steps[st.index] = attrs.evolve(st, how="copy")
                continue
            r = None
            if st.how == "alias":
                r = root[st.inputs[0]]
            elif st.how == "out" and k_out == 0:
                for j in sorted(inplace):
                    cand = root.get(st.inputs[j]) if j < len(st.inputs) and st.inputs[j] else None
                    if (cand is not None and cand not in s.kinds and cand not in taken
                            and max(last.get(m, -1) for m in members[cand]) == st.index
                            and nbytes[cand] == nbytes[out]):
                        r = cand
                        break
            if r is None or out in shared:
                root[out] = out
                members[out] = [out]
                # a reference kernel returns fresh arrays before any output is written, so its outputs
                # may reuse the inputs that die at this step: they are born half a step later
                birth[out] = 2 * st.index + (1 if st.how == "kernel" else 0)
            else:
                root[out] = r
                members[r].append(out)
                taken.add(r)

    for k, (start, _) in kept.items():
        if start is not None and root.get(k) in birth:
            birth[root[k]] = min(birth[root[k]], 2 * start)

    # a recomputed slot whose share policy allows it: one buffer for the copies of every layer
    for keys in s.shared.values():
        head = root[keys[0]]
        for k in keys[1:]:
            r = root[k]
            if r == head:
                continue
            for m in members.pop(r):
                root[m] = head
                members[head].append(m)
            birth[head] = min(birth[head], birth.pop(r))

    # a slot that shares_with another (seed 003 §10.1) is placed in that slot's storage, per layer
    for mine, theirs, what in s.slot_sharing():
        ra = next((root[k] for k in mine if k in root and root[k] in birth), None)
        rx = next((root[k] for k in theirs if k in root and root[k] in birth), None)
        if ra is None or rx is None or ra == rx:
            continue
        spans = [(birth[r], max([birth[r], *(2 * last[m] for m in members[r] if m in last)]))
                 for r in (ra, rx)]
        if spans[0][0] <= spans[1][1] and spans[1][0] <= spans[0][1]:
            raise KilnError(f"{what}, but their lifetimes overlap (steps {spans[0][0] // 2}-"
                            f"{spans[0][1] // 2} and {spans[1][0] // 2}-{spans[1][1] // 2}): one storage "
                            "cannot hold both",
                            code="E017", hint="drop shares_with, or share with a slot that is dead by then")
        for m in members.pop(ra):
            root[m] = rx
            members[rx].append(m)
        birth[rx] = min(birth[rx], birth.pop(ra))

    # fixed region: weights, gradients and optimizer state (the same for every Program of a model),
    # then the inputs and the output
    slots: list[Slot] = []
    n = len(steps)
    layout, persistent = persistent_layout(s.params, s.optimizer, s.target.dtype, s.sync.owned)
    for name, kind, param, _, offset, size in layout:
        k = param if kind == "weight" else s.grads[param] if kind == "gradient" else name
        slots.append(Slot(name, kind, size, offset, 0, n - 1, tuple(members[k])))
    offset = persistent
    for k, kind in [*((k, kd) for k, kd in s.kinds.items() if kd == "input"),
                    *((k, kd) for k, kd in s.kinds.items() if kd in ("output", "buffer"))]:
        size = _align(nbytes[k])
        slots.append(Slot(k, kind, size, offset, 0, n - 1, tuple(members[k])))
        offset += size
    ws = WORKSPACE
    if ws in s.types and s.update:  # the optimizer's scratch: lives through the optimizer phase
        first_opt = next(st.index for st in steps if st.phase == "optimizer")
        root[ws], members[ws], birth[ws], last[ws] = ws, [ws], 2 * first_opt, n - 1

    # packed region: every other slot by lifetime
    base = offset
    fwd_end = max((st.index for st in steps if st.phase == "forward"), default=-1)
    intervals = []
    hosted = set(s.host.values())
    for r, ms in members.items():
        if r in s.kinds or r not in birth or r in hosted:
            continue
        end = max([birth[r], *(2 * last[m] for m in ms if m in last)])
        intervals.append((r, birth[r], end, _align(max(nbytes[m] for m in ms))))
    for i, size in (workspace or {}).items():
        intervals.append((f"workspace.{i}", 2 * i, 2 * i, _align(size)))
    for name, (first, end, size) in (held or {}).items():
        intervals.append((name, 2 * first, 2 * end, _align(size)))
    intervals.sort(key=lambda iv: (-iv[3], iv[1], iv[0]))
    placed: list[tuple[int, int, int, int]] = []  # (start, end, offset, size)
    top = 0
    for r, b, e, size in intervals:
        busy = sorted((o, o + sz) for (b2, e2, o, sz) in placed if b2 <= e and b <= e2)
        at = 0
        for lo, hi in busy:
            if at + size <= lo:
                break
            at = max(at, hi)
        placed.append((b, e, at, size))
        top = max(top, at + size)
        kind = "saved" if b // 2 <= fwd_end < e // 2 else "transient"
        if r not in members:  # a step's workspace, or a held buffer: no tensor of the Program lives there
            kind = "held" if held and r in held else "workspace"
        slots.append(Slot(r, kind, size, base + at, b // 2, e // 2, tuple(members.get(r, ()))))
    arena = base + top
    # the host pool: offloaded activations, each its own range (they all wait for the backward)
    at = 0
    for k in sorted(hosted):
        size = _align(nbytes[k])
        slots.append(Slot(k, "host", size, at, birth[k] // 2, max(2 * last.get(k, 0), birth[k]) // 2, (k,)))
        at += size
    slot_of = {m: sl for sl in slots for m in sl.tensors}
    tensors = {k: Tensor(k, shape, dtypes[k], slot_of[k].name, slot_of[k].offset,
                         "host" if k in hosted else "arena")
               for k, (shape, _) in s.types.items() if k in slot_of}
    return slots, tensors, persistent, arena
