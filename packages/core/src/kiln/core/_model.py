"""A trainable model: Programs per shape binding (cached), one arena, weights and optimizer state."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from kiln.core._errors import KilnError
from kiln.core._ir import Bundle, Module
from kiln.core._optim import AdamW
from kiln.core._program import (
    DTYPES,
    Program,
    _choice,
    _int_config,
    _resolve,
    compile,
    model_params,
    persistent_layout,
)

IGNORE_INDEX = -100


class Model:
    """A model compiled from IR, its weights and its AdamW state, all in one arena.

    ``labels[b, t]`` is the target of position ``t`` (already shifted: the next token), or -100 to
    ignore the position. The loss is the mean over the positions not ignored. ``recompute`` and
    ``recompute_budget`` choose the recompute plan of every training Program (see ``compile``).
    """

    def __init__(self, module_ir: Bundle | Module, *, seed: int = 0, dtype: str = "float32",
                 optimizer: AdamW | None = None, mode: str = "full", backend: str = "numpy",
                 modules: Mapping[str, Module] | None = None, recompute: str = "none",
                 recompute_budget: float | None = None) -> None:
        from kiln.core._plugins import get_registry
        from kiln.core.recompute import MODES

        _choice("dtype", dtype, DTYPES)
        _choice("recompute", recompute, MODES)
        self.ir, self.modules, self.dtype, self.mode = module_ir, modules, dtype, mode
        self.recompute, self.recompute_budget = recompute, recompute_budget
        self.optimizer = optimizer or AdamW()
        self.backend = get_registry("backends")[backend]
        self.backend_name = backend
        self.step = 0
        self._model, mods = _resolve(module_ir, modules)
        self._params = model_params(self._model, mods, _int_config(self._model), mode)
        self._layout, self._persistent = persistent_layout(self._params, "adamw", np.dtype(dtype))
        self._programs: dict[tuple[str, int, int], Program] = {}
        self._bound: dict[tuple[str, int, int], Any] = {}
        self._last: tuple[str, int, int] | None = None  # the last training Program run
        self._arena = self.backend.allocate(self._persistent)
        self._views()
        self._tied = {spec.name: spec.tied_to for spec in self._model.params if spec.tied_to is not None}
        self._init(seed)

    @classmethod
    def from_ir(cls, module_ir: Bundle | Module, **options: Any) -> Model:
        """A Model from a Bundle (its entry is the model) or a model Module; options as for ``Model``."""
        return cls(module_ir, **options)

    # -- weights and state

    def _views(self) -> None:
        """Views of the persistent head by slot name: ``<param>``, ``grad.<param>``, ``adamw.m.<param>``..."""
        dt = np.dtype(self.dtype)
        arena = self._arena
        self._state = {name: arena[offset:offset + math.prod(shape) * dt.itemsize].view(dt).reshape(shape)
                       for name, _, _, shape, offset, _ in self._layout}

    def _init(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        default_std = float(self._model.config.get("initializer_range", 0.02))
        for key, spec, shape, _ in self._params:
            kind = spec.init.get("kind", "normal")
            view = self._state[key]
            if kind == "normal":
                view[...] = rng.standard_normal(shape) * float(spec.init.get("std", default_std))
            elif kind == "uniform":
                view[...] = rng.uniform(float(spec.init["low"]), float(spec.init["high"]), shape)
            elif kind in ("ones", "zeros"):
                view[...] = 1.0 if kind == "ones" else 0.0
            else:
                raise KilnError(f"parameter {key!r}: unknown init kind {kind!r}; "
                                "expected normal, uniform, ones or zeros")

    def parameters(self) -> dict[str, np.ndarray]:
        """Copies of every stored parameter (tied ones appear once, under the name they are tied to)."""
        return {key: self._state[key].copy() for key, *_ in self._params}

    def set_parameters(self, values: Mapping[str, Any]) -> None:
        """Copy arrays into the named parameters (shapes must match)."""
        known = {key: shape for key, _, shape, _ in self._params}
        for name, value in values.items():
            if name in self._tied:
                raise KilnError(f"parameter {name!r} is tied to {self._tied[name]!r}; set that one instead")
            if name not in known:
                raise KilnError(f"the model has no parameter {name!r}",
                                hint=f"parameters are named like {', '.join(list(known)[:4])}, ...")
            arr = np.asarray(value)
            if arr.shape != known[name]:
                raise KilnError(f"parameter {name!r} is {list(known[name])}, "
                                f"the value given is {list(arr.shape)}")
            self._state[name][...] = arr

    def state_dict(self) -> dict[str, Any]:
        """Copies of the parameters and of the AdamW state (step and both moments)."""
        trained = [key for key, _, _, t in self._params if t]
        return {"parameters": self.parameters(), "optimizer": {
            "step": self.step,
            "exp_avg": {k: self._state[f"adamw.m.{k}"].copy() for k in trained},
            "exp_avg_sq": {k: self._state[f"adamw.v.{k}"].copy() for k in trained}}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.set_parameters(state["parameters"])
        opt = state.get("optimizer", {})
        self.step = int(opt.get("step", 0))
        for m, which in (("m", "exp_avg"), ("v", "exp_avg_sq")):
            for k, v in opt.get(which, {}).items():
                self._state[f"adamw.{m}.{k}"][...] = v

    # -- programs

    def program(self, batch: int, seq: int, task: str = "train") -> Program:
        """The Program for this shape (compiled once, then cached)."""
        return self._bind(task, batch, seq)[0]

    def _bind(self, task: str, batch: int, seq: int) -> tuple[Program, Any]:
        key = (task, int(batch), int(seq))
        if key not in self._programs:
            prog = compile(self.ir, bindings={"B": key[1], "T": key[2]}, backend=self.backend_name,
                           mode=self.mode, modules=self.modules, task=task, optimizer="adamw",
                           dtype=self.dtype, recompute=self.recompute, recompute_budget=self.recompute_budget)
            assert prog.persistent_bytes == self._persistent
            self._programs[key] = prog
        prog = self._programs[key]
        if prog.arena_bytes > self._arena.nbytes:  # grow: the persistent head moves to the new arena
            arena = self.backend.allocate(prog.arena_bytes)
            arena[:self._persistent] = self._arena[:self._persistent]
            self._arena = arena
            self._bound.clear()
            self._views()
        if key not in self._bound:
            ex = self.backend.bind(prog, self._arena)
            if "position_ids" in ex.views:  # the same for every batch of this shape
                ex.views["position_ids"][...] = np.arange(key[2])
            self._bound[key] = ex
        if task == "train":
            self._last = key
        return prog, self._bound[key]

    def _feed(self, task: str, input_ids: Any, labels: Any = None) -> tuple[Any, int]:
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise KilnError("input_ids must be an integer array [batch, seq], "
                            f"found {ids.dtype} {list(ids.shape)}")
        _, ex = self._bind(task, *ids.shape)
        np.copyto(ex.views["token_ids"], ids, casting="unsafe")
        count = 0
        if labels is not None:
            lab = np.asarray(labels)
            if lab.shape != ids.shape or not np.issubdtype(lab.dtype, np.integer):
                raise KilnError(f"labels must be an integer array shaped like input_ids {list(ids.shape)}, "
                                f"found {lab.dtype} {list(lab.shape)}")
            if "targets" in ex.views:
                np.copyto(ex.views["targets"], lab, casting="unsafe")
            count = int(np.count_nonzero(lab != IGNORE_INDEX))
            seed = ex.views.get("d_loss")
            if seed is not None:  # d(mean loss)/d(per-token loss) = mask / count
                np.not_equal(lab.reshape(seed.shape), IGNORE_INDEX, out=seed, casting="unsafe")
                seed /= max(count, 1)
        return ex, count

    def _loss(self, ex: Any, count: int) -> float:
        return float(np.sum(ex.views["loss"])) / count if count else 0.0

    # -- running

    def logits(self, input_ids: Any) -> np.ndarray:
        """Logits ``[batch, seq, vocab]`` (the LM-head loss replaced by a matmul with its weight), in
        eval mode: dropout is off."""
        ex, _ = self._feed("logits", input_ids)
        ex.run(("forward",))
        out: np.ndarray = ex.views["logits"].reshape(*np.shape(input_ids), -1).copy()
        return out

    def loss(self, input_ids: Any, labels: Any, *, training: bool = False) -> float:
        """The mean loss over the positions not ignored (forward only). In eval mode, as HF's
        ``model.eval()``: dropout is off. ``training=True`` gives the loss that :meth:`loss_and_grads`
        differentiates, dropout on, with the same masks."""
        ex, count = self._feed("train" if training else "eval", input_ids, labels)
        ex.run(("forward",))
        return self._loss(ex, count)

    def loss_and_grads(self, input_ids: Any, labels: Any) -> tuple[float, dict[str, np.ndarray]]:
        """The loss and a copy of the gradient of every trained parameter."""
        ex, count = self._feed("train", input_ids, labels)
        ex.run(("forward", "backward"))
        prog = ex.program
        return self._loss(ex, count), {p.name: ex.views[p.grad].copy() for p in prog.params if p.grad}

    def train_step(self, batch: Mapping[str, Any]) -> dict[str, float]:
        """Forward, backward and one AdamW update.

        Returns loss, grad_norm (before clipping), lr, step and tokens (positions not ignored)."""
        ex, count = self._feed("train", batch["input_ids"], batch["labels"])
        self.step += 1
        stats = ex.run(("forward", "backward", "optimizer"), opt=self.optimizer, step=self.step)
        return {"loss": self._loss(ex, count), "grad_norm": stats["grad_norm"], "lr": stats["lr"],
                "step": float(self.step), "tokens": float(count)}

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
