"""A trainable model: Programs per shape binding (cached), one arena, weights and optimizer state.

``Model`` talks to its backend only through the Backend / Executable protocols
(:mod:`kiln.core.runtime._backend`): it allocates and grows the arena, copies parameters and
optimizer state to and from the host, and writes inputs and reads outputs of a Program by name. Any
registered backend trains a model the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kiln.core._errors import KilnError
from kiln.core.ir._dims import dim_bindings
from kiln.core.ir._ir import Bundle, Module, ParamSpec
from kiln.core.plan._optim import Optimizer
from kiln.core.plan._passes import run_passes
from kiln.core.plan._program import (
    PHASES,
    Program,
    SyncPlan,
    Target,
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
    ``recompute_budget`` choose the recompute plan of every training Program (see ``compile``).
    ``optimizer``: an :class:`~kiln.core.Optimizer` (default ``AdamW()``), a registered name or a dict
    ``{"name": ..., **settings}``. ``init``: ``"random"`` (each parameter's init spec, from ``seed``)
    or ``None`` (zeros); ``weights``: values for some or all parameters, set after ``init`` (as
    :meth:`set_parameters`).
    ``passes``: graph passes every Program runs first (see ``compile``).
    ``data_parallel``: train as one rank of a data-parallel run (kiln-dist's ``DataParallel``): every
    rank passes the same global batch to :meth:`train_step` and runs its own shard of it.
    """

    def __init__(self, module_ir: Bundle | Module, *, seed: int = 0, dtype: str = "float32",
                 optimizer: Any = None, mode: str = "full", backend: Any = "numpy",
                 modules: Mapping[str, Module] | None = None, recompute: str = "none",
                 recompute_budget: float | None = None, init: str | None = "random",
                 weights: Mapping[str, Any] | None = None, passes: Sequence[Any] = (),
                 data_parallel: DataParallel | None = None) -> None:
        from kiln.core.plan.recompute import MODES

        _choice("recompute", recompute, MODES)
        if init not in ("random", None):
            raise KilnError(f"init={init!r} is not valid; expected 'random' or None")
        self.ir, self.modules, self.dtype, self.mode = module_ir, modules, dtype, mode
        self.passes = tuple(passes)
        self.recompute, self.recompute_budget = recompute, recompute_budget
        self.target = Target.of(backend, "adamw" if optimizer is None else optimizer, dtype)
        self.optimizer: Optimizer = self.target.optimizer  # type: ignore[assignment]
        self.backend = self.target.backend
        self.backend_name: str = self.backend.name
        self.step = 0
        if self.passes:  # the parameters are those of the IR the passes make (as compile runs them)
            from kiln.core.plugins._session import get_registry

            module_ir, modules = run_passes(_as_bundle(module_ir, modules), self.passes,
                                            get_registry("graph_passes"))[0], None
        self._model, mods = _resolve(module_ir, modules)
        self._params = model_params(self._model, mods, dim_bindings(self._model.config), mode)
        self.data_parallel = data_parallel
        self._sync: SyncPlan | None = None if data_parallel is None else data_parallel.plan(
            [(key, shape) for key, _, shape, t in self._params if t])
        owned = None if self._sync is None else self._sync.owned
        self._layout, self._persistent = persistent_layout(self._params, self.optimizer, dtype, owned)
        self._where = {name: (offset, shape) for name, _, _, shape, offset, _ in self._layout}
        self._programs: dict[tuple[str, int, int], Program] = {}
        self._bound: dict[tuple[str, int, int], Any] = {}
        self._last: tuple[str, int, int] | None = None  # the last training Program run
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
        state: dict[str, Any] = {"name": opt.name, "step": self.step}
        for s in opt.state:
            state[s] = {k: self._read(f"{opt.name}.{s}.{k}") for k, *_ in self._params
                        if f"{opt.name}.{s}.{k}" in self._where}
        return {"parameters": self.parameters(), "optimizer": state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (parameters, optimizer step and state; a ZeRO-1 rank
        takes its share of the state)."""
        self.set_parameters(state["parameters"])
        opt = dict(state.get("optimizer", {}))
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
            prog = compile(self.ir, bindings={"B": key[1], "T": key[2]}, backend=self.backend, mode=self.mode,
                           modules=self.modules, task=task, optimizer=self.optimizer, dtype=self.dtype,
                           recompute=self.recompute, recompute_budget=self.recompute_budget,
                           kernels=self.target.kernels, passes=self.passes, sync=self._sync)
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
        return prog, self._bound[key]

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
        return float(np.sum(ex.read("loss"))) / count if count else 0.0

    # -- running

    def logits(self, input_ids: Any, *, attention_mask: Any = None, position_ids: Any = None) -> np.ndarray:
        """Logits ``[batch, seq, vocab]`` (the LM-head loss replaced by a matmul with its weight), in
        eval mode: dropout is off."""
        ex, _ = self._feed("logits", input_ids, attention_mask=attention_mask, position_ids=position_ids)
        ex.run(("forward",), hyper={})
        out: np.ndarray = ex.read("logits").reshape(*np.shape(input_ids), -1)
        return out

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
        extra = {k: batch[k] for k in ("attention_mask", "position_ids") if batch.get(k) is not None}
        comm = None if self.data_parallel is None else self.data_parallel.communicator
        world, rank = (1, 0) if comm is None else (comm.world_size, comm.rank)
        if micro_batches == 1 and world == 1:
            ex, count = self._feed("train", batch["input_ids"], batch["labels"], **extra)
            self.step += 1
            stats = ex.run(PHASES, hyper={"step": self.step, "optimizer": self.optimizer})
            return {"loss": self._loss(ex, count), "grad_norm": stats["grad_norm"], "lr": stats["lr"],
                    "step": float(self.step), "tokens": float(count)}
        ids, labels = np.asarray(batch["input_ids"]), np.asarray(batch["labels"])
        if not isinstance(micro_batches, int) or micro_batches < 1 or ids.ndim != 2 \
                or ids.shape[0] % (micro_batches * world):
            ranks = f" times the {world} data-parallel ranks" if world > 1 else ""
            raise KilnError(f"micro_batches={micro_batches!r}{ranks} must be a positive int dividing the "
                            f"batch of {ids.shape[0] if ids.ndim else 0} sequences")
        tokens = int(np.count_nonzero(labels != self.ignore_index))
        self.step += 1
        hyper = {"step": self.step, "optimizer": self.optimizer}
        loss, total = 0.0, None
        shards = {k: np.split(np.broadcast_to(np.asarray(v), ids.shape), world)[rank]  # this rank's rows
                  for k, v in {"input_ids": ids, "labels": labels, **extra}.items()}
        parts = {k: np.split(v, micro_batches) for k, v in shards.items()}
        for i in range(micro_batches):
            ex, _ = self._feed("train", parts["input_ids"][i], parts["labels"][i], tokens=tokens,
                               **{k: parts[k][i] for k in extra})
            ex.run(("forward", "backward"), hyper=hyper)
            loss += float(np.sum(ex.read("loss")))
            if micro_batches > 1:
                grads = {p.grad: ex.read(p.grad) for p in ex.program.params if p.grad}
                total = grads if total is None else {k: total[k] + g for k, g in grads.items()}
        for key, g in (total or {}).items():
            ex.write(key, g)
        stats = ex.run(("grad_sync", "optimizer"), hyper=hyper)
        if comm is not None:  # the global batch's loss: every rank's sum
            summed = np.array([loss])
            comm.all_reduce(summed)
            loss = float(summed[0])
        return {"loss": loss / tokens if tokens else 0.0, "grad_norm": stats["grad_norm"], "lr": stats["lr"],
                "step": float(self.step), "tokens": float(tokens)}

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
