"""A trainable model: Programs per shape binding (cached), one arena, weights and optimizer state.

``Model`` talks to its backend only through the Backend / Executable protocols
(:mod:`kiln.core.runtime._backend`): it allocates and grows the arena, copies parameters and
optimizer state to and from the host, and writes inputs and reads outputs of a Program by name. Any
registered backend trains a model the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from kiln.core._errors import KilnError
from kiln.core.ir._dims import dim_bindings, evaluate_shape
from kiln.core.ir._ir import Bundle, Module, Op, ParamSpec, TensorDecl
from kiln.core.plan._optim import Optimizer
from kiln.core.plan._passes import run_passes
from kiln.core.plan._program import (
    PHASES,
    Program,
    SyncPlan,
    Target,
    Tensor,
    _as_bundle,
    _choice,
    _resolve,
    compile,
    model_params,
    persistent_layout,
)
from kiln.core.runtime._communicator import DataParallel

#: the label of a position the loss ignores, unless the model's loss op says otherwise
IGNORE_INDEX = -100
#: the task of the Programs :meth:`Model.backward_from_logits` runs
LOGITS_GRAD = "logits_grad"
INITS = ("normal", "uniform", "ones", "zeros")


def segment_ids(attention_mask: Any, position_ids: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Each token's segment ``[B, T]`` from HF-style inputs, as attention reads it: a packed sequence's
    documents are 1, 2, ... (a new one starts wherever ``position_ids`` do not go up by one, as
    transformers' packed-sequence detection decides), and padding (``attention_mask == 0``) is 0."""
    seg = np.ones(shape, np.int32)
    if position_ids is not None:
        pos = np.broadcast_to(np.asarray(position_ids), shape)
        starts = np.diff(pos, axis=1) != 1
        seg[:, 1:] += np.cumsum(starts, axis=1, dtype=np.int32)
    if attention_mask is not None:
        seg[np.asarray(attention_mask) == 0] = 0
    return seg


def _int_array(value: Any, name: str, shape: tuple[int, ...], *, rank1: bool = False) -> np.ndarray:
    arr = np.asarray(value)
    if not np.issubdtype(arr.dtype, np.integer) and arr.dtype != np.bool_:
        raise KilnError(f"{name} must be an integer array shaped like input_ids {list(shape)}, "
                        f"found {arr.dtype}")
    if arr.shape != shape and not (rank1 and arr.shape == shape[1:]):
        raise KilnError(f"{name} must be shaped like input_ids {list(shape)}"
                        f"{' (or [seq])' if rank1 else ''}, found {list(arr.shape)}")
    return arr


def _rank_device(target: Target, parallel: Any) -> Target:
    """``target`` on the device the parallel object picks for this rank (``parallel.rank_device(backend)``:
    kiln-dist's node-local GPU), where the backend has devices to choose from (``on_device``)."""
    pick: Any = getattr(parallel, "rank_device", None)
    on_device: Any = getattr(target.backend, "on_device", None)
    index = None if pick is None or on_device is None else pick(target.backend)
    return target if index is None else attrs.evolve(target, backend=on_device(index))


def _sync_plan(parallel: DataParallel, trained: list[tuple[str, tuple[int, ...]]],
               module_ir: Bundle) -> SyncPlan:
    """``parallel.plan(trained, module_ir=...)``: the IR the model trains (after its passes) where the
    plan takes ``module_ir`` (a tensor-parallel plan reads which parameters a pass sliced), else
    ``parallel.plan(trained)``."""
    import inspect

    try:
        takes = "module_ir" in inspect.signature(parallel.plan).parameters
    except (TypeError, ValueError):  # a plan without a signature (a builtin): the older form
        takes = False
    plan: Any = parallel.plan  # the Protocol spells the older form
    sync: SyncPlan = plan(trained, module_ir=module_ir) if takes else plan(trained)
    return sync


def _vocab_sizes(model: Module) -> tuple[int | None, int | None]:
    """The ranges of the input ids and of the labels: the rows of the embedding that reads
    ``token_ids`` and of the LM head's weight (the embedding's where the loss op has no weight); None
    where the model has no such op."""
    specs = {s.name: s for s in model.params}
    binds = dim_bindings(model.config)

    def rows(name: str) -> int | None:
        spec = specs.get(name)
        return evaluate_shape(spec.shape, binds)[0] if spec is not None and spec.shape else None

    ids = head = None
    for op in model.forward.ops if model.forward else ():
        if op.type == "embedding" and op.inputs[0] == "token_ids" and ids is None:
            ids = rows(op.inputs[1])
        elif op.type == "fused_lm_head_loss" and head is None:
            head = rows(op.inputs[1])
    return ids, head if head is not None else ids


def _check_range(name: str, arr: np.ndarray, n: int | None, ignore: int | None = None) -> None:
    """A :class:`KilnError` naming ``name``, the first id outside ``[0, n)`` (but ``ignore``) and its
    position."""
    if n is None or arr.size == 0:
        return
    bad = (arr < 0) | (arr >= n)
    if ignore is not None:
        bad &= arr != ignore
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        also = "" if ignore is None else f" and is not the ignored label {ignore}"
        err = KilnError(f"{name}{list(at)} is {int(arr[at])}, outside the vocabulary [0, {n}){also}",
                        hint=f"{int(np.count_nonzero(bad))} value(s) of {name} are out of range")
        err.tensor = name  # type: ignore[attr-defined]
        raise err


def _logits_grad_bundle(bundle: Bundle) -> Bundle:
    """The model with its LM-head loss replaced by ``sum(logits * logits_seed)`` per position: a training
    Program of it, seeded with ones, runs the backward of an external gradient of the logits (the new
    input ``logits_seed``, ``[N, vocab]``)."""
    model = bundle.module(bundle.entry or "")
    graph = model.forward
    head = next((op for op in graph.ops if op.type == "fused_lm_head_loss"), None) if graph else None
    if graph is None or head is None or head.attrs.get("softcap") is not None:
        raise KilnError(f"model {model.name!r} has no fused_lm_head_loss op without softcap: its logits "
                        "have no gradient kiln can seed")
    n = next(d.shape for d in graph.outputs if d.name == "loss")
    vocab = next(p.shape[0] for p in model.params if p.name == head.inputs[1])
    x, weight = head.inputs[:2]
    ops = [*graph.ops[:graph.ops.index(head)],
           Op("matmul", [x, weight], ["logits"], {"transpose": "NT"}, loc=head.loc),
           Op("mul", ["logits", "logits_seed"], ["logits:weighted"]),
           Op("reduce_sum", ["logits:weighted"], ["loss"], {"axes": [1]})]
    live, kept = {"loss"}, []
    for op in reversed(ops):  # the ops the loss needs
        if any(o in live for o in op.outputs):
            kept.append(op)
            live.update(i for i in op.inputs if i)
    forward = graph.evolve(
        inputs=(*(d for d in graph.inputs if d.name in live), TensorDecl("logits_seed", [*n, vocab], "fp32")),
        ops=tuple(reversed(kept)), outputs=(TensorDecl("loss", n, "fp32"),))
    return attrs.evolve(bundle, modules=tuple(m.evolve(forward=forward) if m is model else m
                                              for m in bundle.modules))


def init_value(init: Mapping[str, Any], shape: tuple[int, ...], rng: np.random.Generator, default_std: float,
               name: str, config: Mapping[str, Any] | None = None) -> np.ndarray:
    """Parameter ``name``'s initial value from its init spec (``ParamSpec.init``): ``normal`` (``std``,
    default ``default_std``), ``uniform`` (``low``, ``high``), ``ones`` or ``zeros``; float64.
    ``zero_row`` (a row index, or the name of a ``config`` entry holding one or None) starts at zero:
    an embedding's padding row, as ``torch.nn.Embedding(padding_idx=...)`` initialises it."""
    kind = init.get("kind", "normal")
    try:
        if kind == "normal":
            value = rng.standard_normal(shape) * float(init.get("std", default_std))
        elif kind == "uniform":
            value = rng.uniform(float(init["low"]), float(init["high"]), shape)
        elif kind in ("ones", "zeros"):
            value = np.full(shape, 1.0 if kind == "ones" else 0.0)
        else:
            raise KilnError(f"parameter {name!r}: unknown init kind {kind!r}; expected {', '.join(INITS)}")
    except (KeyError, TypeError, ValueError) as exc:
        raise KilnError(f"parameter {name!r}: init {dict(init)!r} is not valid ({type(exc).__name__}: "
                        f"{exc}); normal takes a float std, uniform a float low and high") from None
    row = init.get("zero_row")
    if isinstance(row, str):
        row = (config or {}).get(row)
    if row is not None:
        value[int(row)] = 0.0
    return value


class Model:
    """A model compiled from IR, its weights and its optimizer state, all in one arena on ``backend``.

    ``labels[b, t]`` is the target of position ``t`` (already shifted: the next token), or the loss
    op's ``ignore_index`` (``Model.ignore_index``, -100 by default) to ignore the position. The loss
    is the mean over the positions not ignored. ``recompute`` and
    ``recompute_budget`` (and ``recompute_options``) choose the recompute plan of every training Program
    (see ``compile``).
    ``optimizer``: an :class:`~kiln.core.Optimizer`, a registered name (default ``"adamw"``) or a dict
    ``{"name": ..., **settings}``; ``None`` for no optimizer: no state is planned or allocated,
    :meth:`train_step` is refused, and :meth:`forward_backward` leaves the gradients to an external
    one. ``init``: ``"random"`` (each parameter's init spec, from ``seed``)
    or ``None`` (zeros); ``weights``: values for some or all parameters, set after ``init`` (as
    :meth:`set_parameters`).
    ``passes``: graph passes every Program runs first (see ``compile``).
    ``parallel``: train as one rank of a parallel run (kiln-dist's ``DataParallel`` or
    ``TensorParallel``): every rank passes the same global batch to :meth:`train_step` and runs its
    own shard of it; the graph passes the parallelism names (its ``passes``, e.g. kiln-dist's
    ``tensor_parallel``) run after ``passes``. ``data_parallel``: the older spelling, which adds no
    pass.
    ``precision``: the precision recipe, ``"fp32"`` or ``"bf16"`` (bf16 compute as torch's autocast
    does, fp32 master weights, gradients and optimizer state; see ``Program.precision``).
    ``hooks``: ``{point: fn}`` (or ``{point: [fn, ...]}``) for the model's ``@hook`` points, as
    :attr:`hooks` ``.add`` takes them; ``trace_stream``: where ``@trace``/``@profile`` print (stdout).
    The model's run-time annotations (seed 004 §7.3, §7.7) act through :attr:`hooks`,
    :attr:`probes` and :attr:`profile` (see ``kiln.core.runtime``).
    """

    def __init__(self, module_ir: Bundle | Module, *, seed: int = 0, dtype: str = "float32",
                 optimizer: Any = "adamw", mode: str = "full", backend: Any = "numpy",
                 modules: Mapping[str, Module] | None = None, recompute: str = "none",
                 recompute_budget: float | None = None, init: str | None = "random",
                 weights: Mapping[str, Any] | None = None, passes: Sequence[Any] = (),
                 data_parallel: DataParallel | None = None, parallel: DataParallel | None = None,
                 recompute_options: Mapping[str, Any] | None = None, precision: str = "fp32",
                 hooks: Mapping[str, Any] | None = None, trace_stream: Any = None) -> None:
        from kiln.core.plan.recompute import MODES

        _choice("recompute", recompute, MODES)
        if init not in ("random", None):
            raise KilnError(f"init={init!r} is not valid; expected 'random' or None")
        self.ir, self.modules, self.dtype, self.mode = module_ir, modules, dtype, mode
        if parallel is not None:
            if data_parallel is not None:
                raise KilnError("give parallel= or data_parallel= (its older spelling), not both")
            data_parallel = parallel
            passes = [*passes, *getattr(parallel, "passes", ())]
        self.passes = tuple(passes)
        self.recompute, self.recompute_budget = recompute, recompute_budget
        self.recompute_options = dict(recompute_options or {})
        self.target = Target.of(backend, optimizer, dtype, precision=precision)
        if isinstance(backend, str) and ":" not in backend:  # no device named: the parallel rank's own
            self.target = _rank_device(self.target, data_parallel)
        #: the precision recipe every Program of the model follows
        self.precision: str = self.target.precision.name
        #: None: no optimizer (no state; :meth:`forward_backward` for an external one)
        self.optimizer: Optimizer | None = self.target.optimizer
        self.backend = self.target.backend
        self.backend_name: str = self.backend.name
        self.step = 0
        if self.passes:  # the parameters are those of the IR the passes make (as compile runs them)
            from kiln.core.plugins._session import get_registry

            module_ir, modules = run_passes(_as_bundle(module_ir, modules), self.passes,
                                            get_registry("graph_passes"))[0], None
        self._model, mods = _resolve(module_ir, modules)
        #: the ranges [0, n) of input ids and labels (None: unchecked), of the whole vocabulary (before
        #: a pass may shard it)
        self._vocab = _vocab_sizes(_resolve(self.ir, self.modules)[0] if self.passes else self._model)
        self._annotations(mods, hooks, trace_stream)
        self._params = model_params(self._model, mods, dim_bindings(self._model.config), mode)
        self.data_parallel = data_parallel
        self._sync: SyncPlan | None = None if data_parallel is None else _sync_plan(
            data_parallel, [(key, shape) for key, _, shape, t in self._params if t],
            _as_bundle(module_ir, modules))
        owned = None if self._sync is None else self._sync.owned
        self._layout, self._persistent = persistent_layout(self._params, self.optimizer, dtype, owned)
        self._where = {name: (offset, shape) for name, _, _, shape, offset, _ in self._layout}
        self._programs: dict[tuple[str, int, int], Program] = {}
        self._bound: dict[tuple[str, int, int], Any] = {}
        self._last: tuple[str, int, int] | None = None  # the last training Program run
        self._current: tuple[str, int, int] | None = None  # the last Program bound: what read/write reach
        self._arena = self.backend.allocate(self._persistent)
        self._tied = {spec.name: spec.tied_to for spec in self._model.params if spec.tied_to is not None}
        #: the label the model's loss op ignores (its ``ignore_index`` attribute)
        self.ignore_index = next((int(op.attrs.get("ignore_index", IGNORE_INDEX))
                                  for op in (self._model.forward.ops if self._model.forward else ())
                                  if "loss" in op.outputs), IGNORE_INDEX)
        if init == "random":
            self.init_parameters(seed)
        if weights is not None:
            self.set_parameters(weights)

    @classmethod
    def from_ir(cls, module_ir: Bundle | Module, **options: Any) -> Model:
        """A Model from a Bundle (its entry is the model) or a model Module; options as for ``Model``."""
        return cls(module_ir, **options)

    # -- weights and state

    def init_parameters(self, seed: int = 0) -> None:
        """(Re)initialise every parameter from its init spec, drawing from one generator seeded ``seed``."""
        rng = np.random.default_rng(seed)
        default_std = float(self._model.config.get("initializer_range", 0.02))
        for key, spec, shape, _ in self._params:
            self._write(key, init_value(spec.init, shape, rng, default_std, key, self._model.config))

    def _read(self, name: str) -> np.ndarray:
        offset, shape = self._where[name]
        out: np.ndarray = self.backend.read(self._arena, offset, shape, self.dtype)
        return out

    def _write(self, name: str, value: Any) -> None:
        offset, shape = self._where[name]
        self.backend.write(self._arena, offset, np.asarray(value, dtype=self.dtype).reshape(shape))

    @property
    def trainable(self) -> dict[str, bool]:
        """Per stored parameter, whether this model's training mode updates it."""
        return {key: t for key, _, _, t in self._params}

    def parameter_specs(self) -> dict[str, tuple[ParamSpec, tuple[int, ...]]]:
        """Per stored parameter, its IR spec and concrete shape."""
        return {key: (spec, shape) for key, spec, shape, _ in self._params}

    def parameters(self) -> dict[str, np.ndarray]:
        """Host copies of every stored parameter (tied ones appear once, under the name they are tied to)."""
        return {key: self._read(key) for key, *_ in self._params}

    def parameter(self, name: str) -> np.ndarray:
        """A host copy of one stored parameter."""
        self._check_name(name)
        return self._read(name)

    def host_view(self, name: str) -> np.ndarray | None:
        """A writable view of a stored parameter or optimizer state tensor when the backend's memory is
        host memory (the ``numpy`` backend: loading a checkpoint straight into it needs no copy), else
        None. Views die with the arena: take a new one after a Program that grows it was compiled."""
        view = getattr(self.backend, "view", None)
        if view is None or getattr(self.backend, "device", None) != "cpu" or name not in self._where:
            return None
        offset, shape = self._where[name]
        out: np.ndarray = view(self._arena, offset, shape, self.dtype)
        return out

    def _check_name(self, name: str) -> tuple[int, ...]:
        known = {key: shape for key, _, shape, _ in self._params}
        if name in self._tied:
            raise KilnError(f"parameter {name!r} is tied to {self._tied[name]!r}; set that one instead")
        if name not in known:
            raise KilnError(f"the model has no parameter {name!r}",
                            hint=f"parameters are named like {', '.join(list(known)[:4])}, ...")
        return known[name]

    def set_parameters(self, values: Mapping[str, Any]) -> None:
        """Copy arrays into the named parameters (shapes must match)."""
        for name, value in values.items():
            shape = self._check_name(name)
            arr = np.asarray(value)
            if arr.shape != shape:
                raise KilnError(f"parameter {name!r} is {list(shape)}, the value given is {list(arr.shape)}")
            self._write(name, arr)

    def state_dict(self) -> dict[str, Any]:
        """Copies of the parameters and of the optimizer state: ``{"parameters": {name: array},
        "optimizer": {"name": ..., "step": n, <state>: {name: array}}}`` with the optimizer's state
        names (AdamW: ``exp_avg``, ``exp_avg_sq`` as in torch). A ZeRO-1 rank holds the state of its
        share of the parameters only."""
        opt = self.optimizer
        state: dict[str, Any] = {"name": None if opt is None else opt.name, "step": self.step}
        prefix = "" if opt is None else opt.name
        for s in () if opt is None else opt.state:
            state[s] = {k: self._read(f"{prefix}.{s}.{k}") for k, *_ in self._params
                        if f"{prefix}.{s}.{k}" in self._where}
        return {"parameters": self.parameters(), "optimizer": state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (parameters, optimizer step and state; a ZeRO-1 rank
        takes its share of the state)."""
        self.set_parameters(state["parameters"])
        opt = dict(state.get("optimizer", {}))
        if self.optimizer is None:
            if opt.get("name") is not None:
                raise KilnError(f"the state holds optimizer {opt['name']!r}; this model has none "
                                "(optimizer=None)", hint="load state['parameters'] with set_parameters()")
            self.step = int(opt.get("step", 0))
            return
        if opt.get("name", self.optimizer.name) != self.optimizer.name:
            raise KilnError(f"the state is of optimizer {opt['name']!r}; this model trains with "
                            f"{self.optimizer.name!r}")
        self.step = int(opt.get("step", 0))
        unknown = sorted(set(opt) - {"name", "step", *self.optimizer.state})
        if unknown:
            raise KilnError(f"optimizer state {', '.join(unknown)} is not state of {self.optimizer.name!r} "
                            f"(it keeps {', '.join(self.optimizer.state) or 'none'})")
        trained = {key for key, *_, t in self._params if t}
        for s in self.optimizer.state:
            for k, v in opt.get(s, {}).items():
                name = f"{self.optimizer.name}.{s}.{k}"
                if k not in trained:
                    raise KilnError(f"optimizer state {s!r} names {k!r}, which is not a trained parameter")
                if name in self._where:
                    self._write(name, v)

    # -- programs

    def program(self, batch: int, seq: int, task: str = "train") -> Program:
        """The Program for this shape (compiled once, then cached)."""
        return self._bind(task, batch, seq)[0]

    def _bind(self, task: str, batch: int, seq: int) -> tuple[Program, Any]:
        key = (task, int(batch), int(seq))
        if key not in self._programs:
            seeded = task == LOGITS_GRAD  # a training Program of the model seeded at its logits
            prog = compile(_logits_grad_bundle(_as_bundle(self.ir, self.modules)) if seeded else self.ir,
                           bindings={"B": key[1], "T": key[2]}, backend=self.backend, mode=self.mode,
                           modules=None if seeded else self.modules, task="train" if seeded else task,
                           optimizer=self.optimizer, dtype=self.dtype,
                           recompute=self.recompute, recompute_budget=self.recompute_budget,
                           recompute_options=self.recompute_options, kernels=self.target.kernels,
                           passes=self.passes, sync=self._sync, precision=self.target.precision)
            assert prog.persistent_bytes == self._persistent
            self._programs[key] = prog
        prog = self._programs[key]
        if prog.arena_bytes > self._arena.nbytes:  # grow: the persistent head moves to the new arena
            arena = self.backend.allocate(prog.arena_bytes)
            self.backend.copy(self._arena, arena, self._persistent)
            self._arena = arena
            self._bound.clear()
        if key not in self._bound:
            self._bound[key] = self.backend.compile(prog, self._arena, self.target.kernels)
        if task == "train":
            self._last = key
        self._current = key
        self._watch(self._bound[key])
        return prog, self._bound[key]

    # -- run-time annotations (seed 004 §7)

    def _annotations(self, mods: Mapping[str, Module], hooks: Mapping[str, Any] | None, stream: Any) -> None:
        """The run-time annotations of the model: hooks, probes, asserts, trace and profile; ``@trainable``
        learning-rate and weight-decay scales as parameter groups of the optimizer; ``@partition`` refused."""
        import attrs as _attrs

        from kiln.core.plan._optim import ParamGroup
        from kiln.core.runtime._hooks import Runtime

        used = {self._model.name, *(s.array_of for s in self._model.params if s.array_of)}
        modules = {n: m for n, m in mods.items() if n in used}
        for m in (self._model, *modules.values()):
            staged = m.annotated("partition")
            if staged:
                a = staged[0]
                raise KilnError(f"@partition (pipeline stage {a.args['stage']}) on {a.on} "
                                f"{a.target or m.name!r} of {m.name!r} is not executed yet: kiln runs no "
                                "pipeline parallelism",
                                hint="drop @partition to train the model on one process"
                                + (f" (annotated at {a.loc})" if a.loc else ""))
        groups = []
        #: (parameter pattern, scale, clip) of ``@gradient`` and ``@trainable(grad_clip=)``
        self._grad_rules: list[tuple[str, float, float | None]] = []
        for m in (self._model, *modules.values()):
            stacks = [s.name for s in self._model.params if s.array_of == m.name]
            for a in (*m.annotated("gradient", "param"), *m.annotated("trainable", "param")):
                scale = float(a.args.get("scale", 1.0))
                clip = a.args.get("clip" if a.kind == "gradient" else "grad_clip")
                if scale != 1.0 or clip is not None:
                    self._grad_rules += [(n, scale, None if clip is None else float(clip)) for n in (
                        [a.target] if m is self._model else [f"{s}.*.{a.target}" for s in stacks])]
            for a in m.annotated("trainable", "param"):
                lr, wd = float(a.args.get("lr_scale", 1.0)), float(a.args.get("wd_scale", 1.0))
                if lr == 1.0 and wd == 1.0:
                    continue
                names = [a.target] if m is self._model else [f"{s}.*.{a.target}" for s in stacks]
                if self.optimizer is not None:
                    groups.append(ParamGroup(params=tuple(names), lr_scale=lr,
                                             weight_decay=self.optimizer.weight_decay * wd))
        if groups and self.optimizer is not None:
            self.optimizer = _attrs.evolve(self.optimizer, groups=(*groups, *self.optimizer.groups))
            self.target = _attrs.evolve(self.target, optimizer=self.optimizer)
        self._runtime = Runtime(self._model, modules, stream)
        for point, fns in (hooks or {}).items():
            for fn in fns if isinstance(fns, (list, tuple)) else (fns,):
                self._runtime.hooks.add(point, fn)

    @property
    def hooks(self) -> Any:
        """The model's ``@hook`` points: ``model.hooks.add(point, fn, mode=None, priority=0)`` returns a
        handle whose ``remove()`` unregisters ``fn``; ``fn(tensor, info)`` runs after the op computing
        the annotated tensor (see ``kiln.core.runtime.Hooks``)."""
        return self._runtime.hooks

    @property
    def probes(self) -> Any:
        """The captures of the model's ``@probe`` annotations: ``enable()``, then ``probes[name]`` lists
        a ``ProbeRecord`` per capture (``latest(name)`` the last)."""
        return self._runtime.probes

    @property
    def profile(self) -> dict[str, tuple[int, float]]:
        """Per ``@profile`` region: (op runs, seconds) so far."""
        return {k: (int(v[0]), v[1]) for k, v in self._runtime.profile.items()}

    def _apply_grad_rules(self, ex: Any) -> None:
        """``@gradient(scale=, clip=)``: each matching parameter's gradient times ``scale``, then its L2
        norm clipped to ``clip`` (this process's gradient, before grad_sync and the global clipping)."""
        import fnmatch

        for p in ex.program.params:
            rules = [r for r in self._grad_rules if p.grad and fnmatch.fnmatchcase(p.name, r[0])]
            if not rules:
                continue
            g = ex.read(p.grad)
            for _, scale, clip in rules:
                g = g * scale
                norm = float(np.linalg.norm(g.ravel()))
                if clip is not None and norm > clip:
                    g = g * (clip / norm)
            ex.write(p.grad, g)

    def _watch(self, ex: Any) -> None:
        rt = self._runtime
        needed = rt.active and (len(rt.hooks) or rt.probes.enabled or rt.traced or rt.profiled or any(
            a.kind in ("assert", "trace", "profile", "gradient")
            for anns in rt.by_tensor.values() for a in anns))
        if not needed:
            if getattr(ex, "watch", None) is not None:
                ex.watch = None
            return
        if not hasattr(ex, "watch"):
            raise KilnError(f"backend {self.backend_name!r} does not run hooks, probes, asserts or traces",
                            hint="run the model on the numpy backend, or remove the run-time annotations")
        ex.watch = rt.watcher(ex, lambda: self.step if self.step else 1)

    def _feed(self, task: str, input_ids: Any, labels: Any = None, tokens: int | None = None, *,
              attention_mask: Any = None, position_ids: Any = None) -> tuple[Any, int]:
        """Write a batch into the Program of its shape; ``tokens``: the positions the loss is a mean
        over (default: this batch's; a micro-batch's share of a larger batch otherwise).
        ``attention_mask`` and ``position_ids`` are HF's (:func:`segment_ids`); positions default to
        ``0 .. seq - 1`` in every sequence, as in transformers."""
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise KilnError("input_ids must be an integer array [batch, seq], "
                            f"found {ids.dtype} {list(ids.shape)}")
        shape: tuple[int, ...] = ids.shape
        _check_range("input_ids", ids, self._vocab[0])
        lab = None if labels is None else np.asarray(labels)
        if lab is not None and lab.shape == shape and np.issubdtype(lab.dtype, np.integer):
            _check_range("labels", lab, self._vocab[1], self.ignore_index)
        mask = None if attention_mask is None else _int_array(attention_mask, "attention_mask", shape)
        pos = None if position_ids is None else _int_array(position_ids, "position_ids", shape, rank1=True)
        segments = segment_ids(mask, pos, shape)
        prog, ex = self._bind(task, *shape)
        ex.write("token_ids", ids)
        # every time, also the defaults: another shape's Program may use those bytes
        positions = np.broadcast_to(np.arange(shape[1]) if pos is None else pos, shape)
        if "position_ids" in prog.tensors:
            slot = prog.tensors["position_ids"].shape
            if len(slot) == 1 and (positions != positions[:1]).any():
                raise KilnError("this model's position_ids input is [seq], shared by the batch: it cannot "
                                "take different positions per sequence")
            ex.write("position_ids", positions[0] if len(slot) == 1 else positions)
        if "segment_ids" in prog.tensors:
            ex.write("segment_ids", segments)
        elif (segments != 1).any():
            raise KilnError("this model has no segment_ids input: it cannot mask padding (attention_mask) or "
                            "keep packed documents apart (position_ids restarting)")
        count = 0
        if labels is not None:
            lab = np.asarray(labels)
            if lab.shape != ids.shape or not np.issubdtype(lab.dtype, np.integer):
                raise KilnError(f"labels must be an integer array shaped like input_ids {list(ids.shape)}, "
                                f"found {lab.dtype} {list(lab.shape)}")
            if "targets" in prog.tensors:
                ex.write("targets", lab)
            mask = lab != self.ignore_index
            count = int(np.count_nonzero(mask))
            if "d_loss" in prog.tensors:  # d(mean loss)/d(per-token loss) = mask / count
                dt = np.dtype(prog.tensors["d_loss"].dtype)
                ex.write("d_loss", mask.astype(dt) / dt.type(max(count if tokens is None else tokens, 1)))
        return ex, count

    def _loss(self, ex: Any, count: int) -> float:
        loss = ex.read("loss")
        if loss.dtype.itemsize < 4:  # a loss an annotation writes as bf16: summed in float32, not bf16
            loss = loss.astype(np.float32)
        return float(np.sum(loss)) / count if count else 0.0

    # -- running

    def logits(self, input_ids: Any, *, attention_mask: Any = None, position_ids: Any = None) -> np.ndarray:
        """Logits ``[batch, seq, vocab]`` (the LM-head loss replaced by a matmul with its weight), in
        eval mode: dropout is off. Under the ``bf16`` recipe their values are bf16, returned as float32."""
        ex, _ = self._feed("logits", input_ids, attention_mask=attention_mask, position_ids=position_ids)
        ex.run(("forward",), hyper={})
        out: np.ndarray = ex.read("logits").reshape(*np.shape(input_ids), -1)
        return out if out.dtype.kind == "f" else out.astype(np.float32)  # bf16 logits: their exact values

    def loss(self, input_ids: Any, labels: Any, *, training: bool = False, attention_mask: Any = None,
             position_ids: Any = None) -> float:
        """The mean loss over the positions not ignored (forward only). In eval mode, as HF's
        ``model.eval()``: dropout is off. ``training=True`` gives the loss that :meth:`loss_and_grads`
        differentiates, dropout on, with the same masks."""
        ex, count = self._feed("train" if training else "eval", input_ids, labels,
                               attention_mask=attention_mask, position_ids=position_ids)
        ex.run(("forward",), hyper={"step": self.step + 1})
        return self._loss(ex, count)

    def loss_and_grads(self, input_ids: Any, labels: Any, *, attention_mask: Any = None,
                       position_ids: Any = None) -> tuple[float, dict[str, np.ndarray]]:
        """The loss and a copy of the gradient of every trained parameter (of this process's batch:
        no gradient synchronisation)."""
        ex, count = self._feed("train", input_ids, labels, attention_mask=attention_mask,
                               position_ids=position_ids)
        ex.run(("forward", "backward"), hyper={"step": self.step + 1})
        prog = ex.program
        return self._loss(ex, count), {p.name: ex.read(p.grad) for p in prog.params if p.grad}

    def train_step(self, batch: Mapping[str, Any], *, micro_batches: int = 1) -> dict[str, float]:
        """Forward, backward, gradient synchronisation and one optimizer update.

        ``micro_batches`` > 1 accumulates gradients: the batch is cut into that many equal parts along
        its first dimension, each runs forward and backward on the Program of its size (memory as for
        one part), and the update applies the gradient of the whole batch's mean loss (as HF's
        ``gradient_accumulation_steps``, up to the order of the float sums). ``batch`` holds
        ``input_ids`` and ``labels``, and may hold HF's ``attention_mask`` and ``position_ids``. Returns
        loss, grad_norm (before clipping), lr, step and tokens (positions not ignored).

        Under ``data_parallel`` every rank passes the same global batch: rank ``r`` of ``N`` runs part
        ``r`` of ``N`` equal parts along the first dimension, its loss divided by the global batch's
        token count, so the gradients summed in ``grad_sync`` are those of the global batch's mean
        loss; the loss returned is the global batch's."""
        if self.optimizer is None:
            raise KilnError("this model has no optimizer (optimizer=None): train_step cannot update it",
                            hint="run forward_backward(batch), read gradients() and write the new values "
                                 "with set_parameters(); or build the Model with an optimizer")
        ex, loss, tokens, hyper = self._forward_backward(batch, micro_batches, update=True)
        stats = ex.run(("optimizer",), hyper=hyper)
        return {"loss": loss, "grad_norm": stats["grad_norm"], "lr": stats["lr"], "step": float(self.step),
                "tokens": float(tokens)}

    def forward_backward(self, batch: Mapping[str, Any], *, micro_batches: int = 1) -> dict[str, float]:
        """:meth:`train_step` without the optimizer update, as ``loss.backward()`` in PyTorch: the forward,
        the backward and the gradient synchronisation of ``batch``, the gradient of every trained
        parameter left in the model for :meth:`gradients` (or :meth:`read` ``("grad.<name>")``) to read.
        Each call overwrites the gradients (``zero_grad`` included); ``micro_batches`` accumulates as in
        :meth:`train_step`. Parameters and ``step`` stay as they are: an external optimizer writes the
        new values with :meth:`set_parameters` (dropout masks are drawn for update ``step + 1``, so a
        loop that updates outside kiln also counts ``model.step += 1``). Returns loss and tokens."""
        _, loss, tokens, _ = self._forward_backward(batch, micro_batches, update=False)
        return {"loss": loss, "tokens": float(tokens)}

    def backward_from_logits(self, input_ids: Any, d_logits: Any, *, attention_mask: Any = None,
                             position_ids: Any = None) -> None:
        """The backward of the model seeded with an external gradient of its logits, as torch's
        ``logits.backward(d_logits)`` where kiln's model is part of a larger graph: the gradient of
        ``sum(logits * d_logits)`` for every trained parameter, left for :meth:`gradients` (each call
        overwrites them; of this process's batch: no gradient synchronisation). ``d_logits`` is
        ``[batch, seq, vocab]``. The forward runs again, in training mode (dropout masks of update
        ``step + 1``): its logits are :meth:`logits`'s where the model has no dropout. A model split
        over ranks by a ``shard``-stage pass (tensor parallelism) is refused with a KilnError."""
        sharded = self._sharding_pass()
        if sharded is not None:
            raise KilnError(f"backward_from_logits: the graph pass {sharded!r} (stage 'shard') splits the "
                            "model over ranks, so each rank's logits and LM head are a slice (or its blocks "
                            "a part of a sum); a seed of the whole logits has no backward kiln runs there",
                            hint="call it on a model without tensor parallelism (data parallelism is fine: "
                                 "each rank seeds its own batch's logits)")
        ids = np.asarray(input_ids)
        g = np.asarray(d_logits)
        vocab = self._vocab[1]
        if vocab is None:  # no LM head: the error of the Program that would need one
            _logits_grad_bundle(_as_bundle(self.ir, self.modules))
        if ids.ndim == 2 and (g.shape != (*ids.shape, vocab) or g.dtype.kind not in "fiu"):
            err = KilnError(f"d_logits must be a float array [batch, seq, vocab] = {[*ids.shape, vocab]}, "
                            f"found {g.dtype} {list(g.shape)}")
            err.tensor = "d_logits"  # type: ignore[attr-defined]
            raise err
        ex, _ = self._feed(LOGITS_GRAD, ids, attention_mask=attention_mask, position_ids=position_ids)
        ex.write("logits_seed", g.reshape(-1, g.shape[-1]))
        ex.write("d_loss", np.ones(ids.size))
        ex.run(("forward", "backward"), hyper={"step": self.step + 1})
        self._apply_grad_rules(ex)

    def _sharding_pass(self) -> str | None:
        """The first of the model's graph passes that splits it over ranks (stage ``shard``), or None."""
        from kiln.core.plugins._session import get_registry

        registry = get_registry("graph_passes")
        for spec in self.passes:
            name = spec if isinstance(spec, str) else spec[0]
            if name in registry and getattr(registry[name], "stage", "adapt") == "shard":
                return str(name)
        return None

    def gradients(self) -> dict[str, np.ndarray]:
        """Host copies of the gradient of every trained parameter, as the last backward left them."""
        return {key: self._read(f"grad.{key}") for key, *_, t in self._params
                if t and f"grad.{key}" in self._where}

    # -- tensors by name, a batch feed and phases: what an embedder drives

    def tensors(self) -> dict[str, Tensor]:
        """Every tensor :meth:`read` and :meth:`write` reach, by name: those of the current Program (the
        one last fed, run or asked for with :meth:`program`), with shape, dtype and place in the arena,
        and, always, the weights, gradients (``grad.<name>``) and optimizer state every Program shares
        (``<optimizer>.<state>.<name>``, as :meth:`state_dict` names them). Each slot is listed once: a
        training Program's own name ``d_<name>`` for a parameter's gradient (the same slot as
        ``grad.<name>``) is left out, though :meth:`read` and :meth:`write` still take it."""
        every = self._every_tensor()
        return {name: t for name, t in every.items()
                if not (t.slot != name and t.slot.startswith("grad.") and t.slot in self._where)}

    def _every_tensor(self) -> dict[str, Tensor]:
        """The persistent head's tensors and the current Program's, aliases (``d_<name>``) included."""
        head = {name: Tensor(name, shape, self.dtype, name, offset)
                for name, _, _, shape, offset, _ in self._layout}
        return head if self._current is None else {**head, **self._programs[self._current].tensors}

    def _tensor(self, name: str) -> tuple[Tensor, Any]:
        """Tensor ``name`` and the Executable that reaches it (None: the persistent head, no Program)."""
        tensors = self._every_tensor()
        if not isinstance(name, str) or name not in tensors:
            tensors = self.tensors()  # suggest listed names only
            import difflib

            close = difflib.get_close_matches(str(name), list(tensors), n=3)
            err = KilnError(f"the model has no tensor {name!r}" + (
                            "" if self._current is None else f" in its current Program {self._current}"),
                            hint=f"did you mean {', '.join(map(repr, close))}?" if close
                            else "tensors() lists every name")
            err.tensor = str(name)  # type: ignore[attr-defined]
            raise err
        if self._current is None or name in self._where:  # the persistent head: the same in every Program
            return tensors[name], None
        return tensors[name], self._bind(*self._current)[1]

    def read(self, name: str) -> np.ndarray:
        """A host copy of tensor ``name`` of the current Program (see :meth:`tensors`): a parameter, its
        gradient ``grad.<name>``, optimizer state, an input, ``loss`` or ``logits``, or an activation
        (what the last phase run left in its slot: slots are reused within a step)."""
        _, ex = self._tensor(name)
        if ex is None:
            return self._read(name)
        out: np.ndarray = ex.read(name)
        return out

    def write(self, name: str, value: Any) -> None:
        """Copy ``value`` (its shape that of the tensor; cast to its dtype) into tensor ``name`` of the
        current Program, as :meth:`read` reaches it."""
        t, ex = self._tensor(name)
        arr = np.asarray(value)
        if arr.shape != t.shape:
            err = KilnError(f"tensor {name!r} is {list(t.shape)}, the value given is {list(arr.shape)}")
            err.tensor = name  # type: ignore[attr-defined]
            raise err
        if ex is None:
            self._write(name, arr)
        else:
            ex.write(name, arr)

    def feed(self, batch: Mapping[str, Any], task: str = "train") -> Program:
        """Write a batch into the Program of its shape and ``task`` (``train``, ``eval``, ``logits``) and
        make that Program the current one: ``input_ids``, ``labels`` (but for ``logits``; ``d_loss``, the
        seed of the mean loss's backward, with them) and the optional ``attention_mask`` and
        ``position_ids``, checked as :meth:`train_step` checks them. Nothing runs: :meth:`run` does."""
        if "input_ids" not in batch or (task != "logits" and "labels" not in batch):
            raise KilnError(f"a batch for task {task!r} holds input_ids" +
                            ("" if task == "logits" else " and labels") + f"; found {', '.join(batch)}")
        extra = {k: batch[k] for k in ("attention_mask", "position_ids") if batch.get(k) is not None}
        self._feed(task, batch["input_ids"], None if task == "logits" else batch["labels"], **extra)
        assert self._current is not None
        return self._programs[self._current]

    def run(self, phases: Sequence[str] = ("forward", "backward")) -> dict[str, float]:
        """Run phases of the current Program in order (``forward``, ``backward``, ``grad_sync``,
        ``optimizer``) on its tensors as they are: what :meth:`feed` and :meth:`write` left there. An
        ``optimizer`` phase is an update: ``step`` goes up by one, and its ``grad_norm``, ``lr`` and
        clipping ``scale`` are returned (else ``{}``). No ``@gradient`` rules, no micro-batches: the
        steps of the Program, as planned."""
        names = [phases] if isinstance(phases, str) else list(phases)
        for phase in names:
            if phase not in PHASES:
                raise KilnError(f"unknown phase {phase!r}; expected {', '.join(PHASES)}")
        if self._current is None:
            raise KilnError("no Program is current: feed() a batch first")
        update = "optimizer" in names
        if update and self.optimizer is None:
            raise KilnError("this model has no optimizer (optimizer=None): it cannot run the optimizer phase")
        _, ex = self._bind(*self._current)
        stats = ex.run(names, hyper={"step": self.step + 1, "optimizer": self.optimizer})
        if not update:
            return {}
        self.step += 1
        return {k: float(stats[k]) for k in ("grad_norm", "lr", "scale") if k in stats}

    def _forward_backward(self, batch: Mapping[str, Any], micro_batches: int, *,
                          update: bool) -> tuple[Any, float, int, dict[str, Any]]:
        """Forward, backward (``@gradient`` rules applied) and grad_sync of the batch, this rank's part of
        it in ``micro_batches`` parts whose gradients add up: the Executable run last, the mean loss
        of the whole batch, its token count and the phases' ``hyper``. ``update``: for the update that
        follows, ``step`` counted once the batch is checked (hooks and probes see the update's number)."""

        def hyper() -> dict[str, Any]:
            if not update:
                return {"step": self.step + 1}
            self.step += 1
            return {"step": self.step, "optimizer": self.optimizer}

        extra = {k: batch[k] for k in ("attention_mask", "position_ids") if batch.get(k) is not None}
        comm = None if self.data_parallel is None else self.data_parallel.communicator
        world, rank = (1, 0) if comm is None else (comm.world_size, comm.rank)
        if micro_batches == 1 and world == 1:
            ex, count = self._feed("train", batch["input_ids"], batch["labels"], **extra)
            run = hyper()
            ex.run(("forward", "backward"), hyper=run)
            self._apply_grad_rules(ex)
            ex.run(("grad_sync",), hyper=run)
            return ex, self._loss(ex, count), count, run
        ids, labels = np.asarray(batch["input_ids"]), np.asarray(batch["labels"])
        if not isinstance(micro_batches, int) or micro_batches < 1 or ids.ndim != 2 \
                or ids.shape[0] % (micro_batches * world):
            ranks = f" times the {world} data-parallel ranks" if world > 1 else ""
            raise KilnError(f"micro_batches={micro_batches!r}{ranks} must be a positive int dividing the "
                            f"batch of {ids.shape[0] if ids.ndim else 0} sequences")
        _check_range("input_ids", ids, self._vocab[0])  # the whole batch's positions, before any part runs
        if labels.shape == ids.shape and np.issubdtype(labels.dtype, np.integer):
            _check_range("labels", labels, self._vocab[1], self.ignore_index)
        tokens = int(np.count_nonzero(labels != self.ignore_index))
        run = hyper()
        loss, total = 0.0, None
        shards = {k: np.split(np.broadcast_to(np.asarray(v), ids.shape), world)[rank]  # this rank's rows
                  for k, v in {"input_ids": ids, "labels": labels, **extra}.items()}
        parts = {k: np.split(v, micro_batches) for k, v in shards.items()}
        for i in range(micro_batches):
            ex, _ = self._feed("train", parts["input_ids"][i], parts["labels"][i], tokens=tokens,
                               **{k: parts[k][i] for k in extra})
            ex.run(("forward", "backward"), hyper=run)
            loss += float(np.sum(ex.read("loss")))
            if micro_batches > 1:
                grads = {p.grad: ex.read(p.grad) for p in ex.program.params if p.grad}
                total = grads if total is None else {k: total[k] + g for k, g in grads.items()}
        for key, g in (total or {}).items():
            ex.write(key, g)
        self._apply_grad_rules(ex)
        ex.run(("grad_sync",), hyper=run)
        if comm is not None:  # the global batch's loss: every rank's sum
            summed = np.array([loss])
            comm.all_reduce(summed)
            loss = float(summed[0])
        return ex, loss / tokens if tokens else 0.0, tokens, run

    def memory_report(self, batch: int | None = None, seq: int | None = None) -> dict[str, Any]:
        """The planned memory of the training Program for (batch, seq), by default the last one run."""
        if batch is not None and seq is not None:
            return self.program(batch, seq).memory_report()
        if self._last is None:
            raise KilnError("no Program has run yet; pass batch and seq")
        return self._programs[self._last].memory_report()

    @property
    def arena_bytes(self) -> int:
        """Bytes of the arena the backend allocated (the largest planned peak so far)."""
        return int(self._arena.nbytes)
