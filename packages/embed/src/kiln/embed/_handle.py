"""Program handles: a model compiled for one batch shape, the arena it runs in, and what a host does
with it (read the plan, bind memory, train, run phases, read and write tensors by name)."""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import numpy as np

from kiln.core import PHASES, KilnError, Model, NumpyBackend, Program, Tensor
from kiln.core.ir import Bundle, Module, from_json

#: the codes of structured errors; a code's index is its C status (``KILN_ERR_*`` in kiln.h)
CODES = ("ok", "init", "json", "argument", "handle", "tensor", "size", "model", "internal")
#: what a compile spec may hold, and the defaults of what ``Model`` takes
SPEC_KEYS = ("ir", "model", "config", "batch", "seq", "seed", "optimizer", "recompute", "dtype", "mode")
MODEL_KEYS = ("seed", "optimizer", "recompute", "dtype", "mode")
ALIGNMENT = 64  # the planner's offsets are multiples of 64 bytes
T = TypeVar("T")


class EmbedError(KilnError):
    """Bad input from a host. ``kind`` is one of :data:`CODES`; ``culprit`` names what is at fault (a
    spec key, a tensor, the buffer, a handle)."""

    def __init__(self, kind: str, message: str, culprit: str) -> None:
        self.kind, self.culprit = kind, culprit
        super().__init__(message)

    def to_dict(self) -> dict[str, str]:
        return {"code": self.kind, "message": self.message, "culprit": self.culprit}


def _culprit(exc: KilnError) -> str:
    """The thing a kiln error names: its tensor, op, plugin or dimension, else its location."""
    found = (getattr(exc, a, None) for a in ("tensor", "op", "plugin", "expr"))
    return next((str(v) for v in found if v), exc.location or "")


def error_dict(exc: BaseException) -> dict[str, str]:
    """Any exception as the structured error a host reads: ``{"code", "message", "culprit"}``."""
    if isinstance(exc, EmbedError):
        return exc.to_dict()
    if isinstance(exc, KilnError):
        return {"code": "model", "message": str(exc), "culprit": _culprit(exc)}
    return {"code": "internal", "message": f"{type(exc).__name__}: {exc}", "culprit": ""}


def _model_error(exc: KilnError, culprit: str) -> EmbedError:
    return EmbedError("model", str(exc), _culprit(exc) or culprit)


class _Arena(NumpyBackend):
    """The NumPy backend with the arena where the handle says: arrays of its own (each larger Program
    gets a new one, the model copies its weights over), or a host's buffer once bound."""

    def __init__(self, host: np.ndarray | None = None) -> None:
        self.host = host
        self.memory: np.ndarray | None = None

    def allocate(self, nbytes: int) -> np.ndarray:
        if self.host is None:
            self.memory = super().allocate(nbytes)
        elif nbytes > self.host.nbytes:
            raise EmbedError("size", f"the bound buffer has {self.host.nbytes} bytes; the program needs "
                             f"{nbytes}", "buffer")
        else:
            self.host[:nbytes] = 0
            self.memory = self.host
        return self.memory


def _load(spec: str | bytes | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(spec, (str, bytes)):
        try:
            spec = json.loads(spec)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise EmbedError("json", f"the spec is not valid JSON: {exc}", "spec") from None
    if not isinstance(spec, Mapping):
        raise EmbedError("argument", f"the spec must be a JSON object, found {type(spec).__name__}", "spec")
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise EmbedError("argument", f"unknown spec key {unknown[0]!r}; a spec holds {', '.join(SPEC_KEYS)}",
                         unknown[0])
    for key in ("batch", "seq"):
        value = spec.get(key)
        if type(value) is not int or value < 1:
            raise EmbedError("argument", f"spec key {key!r} must be a positive integer, found {value!r}", key)
    if ("ir" in spec) == ("model" in spec):
        raise EmbedError("argument", "the spec needs exactly one of 'ir' (kiln IR JSON) and 'model' (a DSL "
                         "model name with its 'config')", "ir" if "ir" in spec else "model")
    return dict(spec)


def _bundle(spec: Mapping[str, Any]) -> Bundle | Module:
    if "ir" in spec:
        ir = spec["ir"]
        try:
            return from_json(ir if isinstance(ir, str) else json.dumps(ir))
        except KilnError as exc:
            raise _model_error(exc, "ir") from None
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise EmbedError("model", f"'ir' is not kiln IR JSON: {type(exc).__name__}: {exc}",
                             "ir") from None
    from kiln.dsl import build_bundle, unknown_config_keys

    name, config = spec["model"], spec.get("config", {})
    if not isinstance(name, str) or not isinstance(config, Mapping):
        raise EmbedError("argument", "'model' must be a DSL model name and 'config' an object, found "
                         f"{type(name).__name__} and {type(config).__name__}",
                         "model" if not isinstance(name, str) else "config")
    try:
        for key, close in unknown_config_keys(name, config):
            hint = f"; did you mean {close!r}?" if close else ""
            raise EmbedError("argument", f"model {name!r} takes no config key {key!r}{hint}", f"config.{key}")
        return build_bundle(name, dict(config))
    except EmbedError:
        raise
    except KilnError as exc:  # the DSL's diagnostics, without their location: this file's call
        text = "; ".join(f"[{d.code}] {d.message}" + (f" ({d.hint})" if d.hint else "")
                         for d in exc.diagnostics) or exc.message
        raise EmbedError("model", text, f"model {name!r}") from None


def compile(spec: str | bytes | Mapping[str, Any]) -> ProgramHandle:
    """A program handle from a spec (a JSON object, as text or a dict): ``ir`` (kiln IR JSON, a Bundle)
    or ``model`` (a DSL model name, e.g. ``"Qwen3Model"``) with its ``config``; ``batch`` and ``seq``,
    the shape of its training Program; and optionally ``seed``, ``optimizer`` (a name or
    ``{"name": ..., **settings}``), ``recompute``, ``dtype`` and ``mode``, as :class:`kiln.core.Model`
    takes them. Bad input raises :class:`EmbedError`."""
    data = _load(spec)
    return ProgramHandle(_bundle(data), data["batch"], data["seq"],
                         {k: data[k] for k in MODEL_KEYS if k in data})


def _host_bytes(buffer: Any) -> np.ndarray:
    """A host buffer (buffer protocol or DLPack, on the CPU) as writable, aligned bytes, without a copy."""
    try:
        arr = np.from_dlpack(buffer) if hasattr(buffer, "__dlpack__") else np.frombuffer(buffer, np.uint8)
    except (TypeError, ValueError, BufferError, RuntimeError) as exc:
        raise EmbedError("argument", f"cannot use {type(buffer).__name__} as host memory: {exc}",
                         "buffer") from None
    if not arr.flags.c_contiguous or not arr.flags.writeable:
        raise EmbedError("argument", "the buffer must be contiguous and writable", "buffer")
    if arr.ctypes.data % ALIGNMENT:
        raise EmbedError("argument", f"the buffer must start at a multiple of {ALIGNMENT} bytes "
                         f"(address {arr.ctypes.data:#x})", "buffer")
    out: np.ndarray = arr.reshape(-1).view(np.uint8)
    return out


class ProgramHandle:
    """A model compiled for one batch shape (``batch`` x ``seq`` tokens), its weights and optimizer
    state in one arena: kiln's memory, or a host's once :meth:`bind` is called.

    ``model`` is the :class:`kiln.core.Model` that trains in that arena; ``program`` its training
    Program, whose tensors :meth:`get`, :meth:`set` and :meth:`view` reach by name; ``arena_bytes``
    what :meth:`bind` needs, the largest peak of the training, the logits and the logits' backward
    Program.
    """

    def __init__(self, bundle: Bundle | Module, batch: int, seq: int, options: Mapping[str, Any]) -> None:
        self.batch, self.seq = batch, seq
        self._bundle, self._options = bundle, dict(options)
        self._arena = _Arena()
        self.model, self.program, self.arena_bytes = self._compile(self._arena, {})
        self._pending: int | None = None  # the loss() whose activations the arena holds
        self._forwards = 0

    def _compile(self, arena: _Arena, extra: Mapping[str, Any]) -> tuple[Model, Program, int]:
        """The model in ``arena``, its training Program, and the bytes of the arena: the largest peak of
        the training, the logits and the logits' backward Program."""
        try:
            model = Model.from_ir(self._bundle, backend=arena, **{**self._options, **extra})
            progs = [model.program(self.batch, self.seq, task) for task in ("logits", "logits_grad", "train")]
            return model, progs[-1], max(int(p.arena_bytes) for p in progs)
        except EmbedError:
            raise
        except KilnError as exc:
            raise _model_error(exc, "spec") from None

    # -- the plan and memory

    def plan(self) -> dict[str, Any]:
        """The plan as JSON data: shape, arena bytes, parameters, every tensor's place in the arena, the
        steps per phase and the memory report (bytes by kind)."""
        prog = self.program
        return {
            "batch": self.batch, "seq": self.seq, "dtype": self.model.dtype,
            "arena_bytes": self.arena_bytes, "persistent_bytes": int(prog.persistent_bytes),
            "optimizer": None if self.model.optimizer is None else self.model.optimizer.name,
            "step": self.model.step,
            "parameters": [{"name": p.name, "shape": list(p.shape), "trainable": bool(p.trainable),
                            "grad": p.grad or None, "state": list(p.state)} for p in prog.params],
            "tensors": {k: {"shape": list(t.shape), "dtype": t.dtype, "offset": int(t.offset),
                            "nbytes": int(t.nbytes)} for k, t in prog.tensors.items()},
            "phases": {phase: len(prog.phase(phase)) for phase in PHASES},
            "memory": {k: int(v) for k, v in prog.memory_report().items() if k != "slots"},
        }

    def bind(self, buffer: Any) -> None:
        """Run in host memory from now on: a writable, contiguous CPU buffer (buffer protocol or DLPack)
        of at least :attr:`arena_bytes`, starting at a multiple of 64 bytes. Weights, gradients,
        optimizer state and step carry over; the host keeps the buffer alive and leaves it alone while
        a call runs."""
        host = _host_bytes(buffer)
        if host.nbytes < self.arena_bytes:
            raise EmbedError("size", f"the buffer has {host.nbytes} bytes; the arena needs "
                             f"{self.arena_bytes}", "buffer")
        assert self._arena.memory is not None
        head = self._arena.memory[:self.program.persistent_bytes].copy()  # the host may pass the same memory
        arena = _Arena(host)
        model, program, _ = self._compile(arena, {"init": None})
        host[:head.nbytes] = head
        model.step = self.model.step
        self._arena, self.model, self.program = arena, model, program

    # -- tensors

    def tensor(self, name: str) -> Tensor:
        """The Program tensor ``name`` (its shape, dtype, offset and bytes)."""
        tensors = self.program.tensors
        if not isinstance(name, str) or name not in tensors:
            close = difflib.get_close_matches(str(name), list(tensors), n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else \
                "; the plan's 'tensors' lists every name"
            raise EmbedError("tensor", f"the program has no tensor {name!r}{hint}", str(name))
        out: Tensor = tensors[name]
        return out

    def view(self, name: str) -> np.ndarray:
        """A writable NumPy view of tensor ``name`` in the arena (no copy). Activations are reused within
        a step: a view shows what the last phase run left there."""
        t = self.tensor(name)
        assert self._arena.memory is not None
        return NumpyBackend.view(self._arena.memory, t.offset, t.shape, t.dtype)

    def _train(self) -> Model:
        """The model, its training Program for the handle's shape the current one (what
        :meth:`kiln.core.Model.read`, ``write`` and ``run`` reach)."""
        self.model.program(self.batch, self.seq)
        return self.model

    def get(self, name: str) -> np.ndarray:
        """A copy of tensor ``name``."""
        self.tensor(name)
        return self._train().read(name)

    def set(self, name: str, value: Any) -> None:
        """Write ``value`` (same number of elements, cast to the tensor's dtype) into tensor ``name``."""
        t = self.tensor(name)
        arr = np.asarray(value)
        if arr.size != math.prod(t.shape):
            raise EmbedError("size", f"tensor {name!r} is {list(t.shape)} ({math.prod(t.shape)} values); the "
                             f"value has {arr.size}", name)
        self._train().write(name, arr.reshape(t.shape))

    # -- running

    def _batch(self, input_ids: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
        shape = (self.batch, self.seq)
        out = []
        for name, value in (("input_ids", input_ids), ("labels", labels)):
            arr = np.asarray(value)
            if arr.shape != shape or not np.issubdtype(arr.dtype, np.integer):
                raise EmbedError("size", f"{name} must be integers shaped {list(shape)}, found {arr.dtype} "
                                 f"{list(arr.shape)}", name)
            out.append(arr)
        return out[0], out[1]

    @staticmethod
    def _ids(call: Callable[[], T]) -> T:
        """``call()``, the model's refusal of a batch (an id outside the vocabulary) as an argument error,
        any other as a model error."""
        try:
            return call()
        except EmbedError:
            raise
        except KilnError as exc:
            culprit = getattr(exc, "tensor", None)
            if culprit in ("input_ids", "labels"):
                raise EmbedError("argument", exc.message, culprit) from None
            raise _model_error(exc, "model") from None

    def train_step(self, input_ids: Any, labels: Any) -> dict[str, float]:
        """One training step (forward, backward, grad_sync, optimizer) on a batch of the handle's shape,
        as :meth:`kiln.core.Model.train_step`: returns loss, grad_norm, lr, step and tokens."""
        ids, labels = self._batch(input_ids, labels)
        self._pending = None
        return self._ids(lambda: self.model.train_step({"input_ids": ids, "labels": labels}))

    def logits(self, input_ids: Any) -> np.ndarray:
        """Logits ``[batch, seq, vocab]`` in eval mode (a copy), as :meth:`kiln.core.Model.logits`."""
        ids, _ = self._batch(input_ids, np.zeros((self.batch, self.seq), np.int32))
        self._pending = None
        return self._ids(lambda: self.model.logits(ids))

    def loss(self, input_ids: Any, labels: Any) -> tuple[float, int]:
        """The forward of the training Program (dropout on): the mean loss, and the number of this
        forward, which :meth:`backward` checks. The activations the backward reads stay in the arena
        until the next run."""
        ids, labels = self._batch(input_ids, labels)
        loss = self._ids(lambda: self.model.loss(ids, labels, training=True))
        self._forwards += 1
        self._pending = self._forwards
        return loss, self._forwards

    def backward(self, forward: int, scale: float = 1.0) -> dict[str, np.ndarray]:
        """The backward of :meth:`loss`'s ``forward``, seeded with ``scale`` times the gradient of the
        mean loss: per trained parameter, a view of its gradient in the arena (no copy). Only the last
        run's activations are in the arena: a forward with another run after it cannot be
        differentiated."""
        if forward != self._pending:
            raise EmbedError("argument", f"forward {forward} cannot be differentiated: the arena holds "
                             f"the activations of the last run only (forward {self._pending})", "backward")
        self._pending = None
        model = self._train()
        model.write("d_loss", model.read("d_loss") * scale)
        model.run(("backward",))
        return {p.name: self.view(p.grad) for p in self.program.params if p.grad}

    def logits_backward(self, input_ids: Any, d_logits: Any) -> dict[str, np.ndarray]:
        """The backward seeded with a gradient ``d_logits`` ``[batch, seq, vocab]`` of the logits, as
        :meth:`kiln.core.Model.backward_from_logits` (its forward runs again, dropout on): per trained
        parameter, a view of its gradient in the arena (no copy)."""
        ids, _ = self._batch(input_ids, np.zeros((self.batch, self.seq), np.int32))
        self._pending = None
        g = np.asarray(d_logits)
        self._ids(lambda: self.model.backward_from_logits(ids, g))
        return {p.name: self.view(p.grad) for p in self.program.params if p.grad}

    def run(self, phases: Iterable[str]) -> dict[str, float]:
        """Run phases of the training Program in order (``forward``, ``backward``, ``grad_sync``,
        ``optimizer``) on the tensors as they are: the host writes ``token_ids``, ``targets`` and
        ``d_loss`` first. An ``optimizer`` phase is an update: the step count goes up by one and the
        result holds its ``grad_norm``, ``lr`` and clipping ``scale``."""
        phases = list(phases) if not isinstance(phases, str) else [phases]
        for phase in phases:
            if phase not in PHASES:
                raise EmbedError("argument", f"unknown phase {phase!r}; expected {', '.join(PHASES)}",
                                 str(phase))
        self._pending = None
        try:
            return self._train().run(phases)
        except KilnError as exc:  # an update of a model without an optimizer
            raise _model_error(exc, "run") from None
