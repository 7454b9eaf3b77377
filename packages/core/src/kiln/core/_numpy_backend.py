"""The NumPy backend: runs a Program as planned, every tensor a view into one preallocated arena.

Binding a Program to an arena makes one view per tensor and one closure per step, once. Running
it then allocates only what reference kernels allocate for their results (copied into the planned
slot and freed at once); ops with an ``out_kernel`` (matmuls through BLAS, elementwise ufuncs)
write into their slot directly, and views cost nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from kiln.core._errors import KilnError
from kiln.core._oplib._loss import fused_lm_head_loss_and_grad
from kiln.core._ops import OpDef, OpRegistry
from kiln.core._optim import AdamW, adamw_update, global_norm
from kiln.core._program import SEED, Program, Step
from kiln.core._threads import blas_held_to_one_thread

Arrays = Sequence[np.ndarray | None]


class NumpyBackend:
    """The embedded reference backend (registered as ``numpy``)."""

    name = "numpy"

    def allocate(self, nbytes: int) -> np.ndarray:
        """The arena: one zeroed byte buffer."""
        return np.zeros(nbytes, np.uint8)

    def bind(self, program: Program, arena: np.ndarray, registry: OpRegistry | None = None) -> Executable:
        return Executable(program, arena, registry)


class Executable:
    """A Program bound to an arena: views and step closures built once, run many times."""

    def __init__(self, program: Program, arena: np.ndarray, registry: OpRegistry | None = None) -> None:
        if arena.nbytes < program.arena_bytes:
            raise KilnError(f"the arena has {arena.nbytes} bytes; program {program.name!r} needs "
                            f"{program.arena_bytes}")
        if registry is None:
            from kiln.core._oplib import op_registry

            registry = op_registry()
        self.program, self.arena, self.registry = program, arena, registry
        self.views: dict[str, np.ndarray] = {
            k: arena[t.offset:t.offset + t.nbytes].view(t.dtype).reshape(t.shape)
            for k, t in program.tensors.items()
        }
        self.opt: AdamW = AdamW()
        self.hyper: dict[str, Any] = {"step": 1, "lr": 0.0, "scale": 1.0, "grad_norm": 0.0}
        closures = [(step, self._closure(step)) for step in program.steps]
        self.runs: dict[str, list[Callable[[], None]]] = {}
        for step, fn in closures:
            if fn is not None:
                self.runs.setdefault(step.phase, []).append(fn)
        #: forward + backward with the LM head's two steps run as one (see :meth:`_fused_head`)
        self.train_runs = self._fused_head(closures)

    def run(self, phases: Iterable[str] = ("forward", "backward", "optimizer"), *, opt: AdamW | None = None,
            step: int = 1) -> dict[str, float]:
        """Run the steps of ``phases`` in order; the optimizer phase applies update number ``step``."""
        if opt is not None:
            self.opt = opt
        self.hyper["step"] = step
        phases = list(phases)
        with blas_held_to_one_thread():  # kernels cut their work over kiln's threads instead
            if self.train_runs is not None and phases[:2] == ["forward", "backward"]:
                for fn in self.train_runs:
                    fn()
                phases = phases[2:]
            for phase in phases:
                for fn in self.runs.get(phase, ()):
                    fn()
        return {k: float(self.hyper[k]) for k in ("grad_norm", "lr", "scale")}

    def _fused_head(self, closures: Sequence[tuple[Step, Callable[[], None] | None]]
                    ) -> list[Callable[[], None]] | None:
        """The forward and backward closures with the LM-head loss and its backward fused, or None.

        The forward's last step is the LM-head loss and the backward's first is its backward, seeded
        by the Program input ``d_loss`` (set before the forward runs): one pass can compute the loss and
        the gradients (:func:`~kiln.core._oplib._loss.fused_lm_head_loss_and_grad`) without the
        backward's recompute of the logits. Only when the gradient slots overlap none of the forward
        step's tensors; runs of the forward alone keep the plain step.
        """
        steps = {ph: [s for s in self.program.steps if s.phase == ph and s.how != "alias"]
                 for ph in ("forward", "backward")}
        if not steps["forward"] or not steps["backward"]:
            return None
        fwd, bwd = steps["forward"][-1], steps["backward"][0]
        keys = ("ignore_index", "chunk_size", "softcap")
        same_attrs = {k: fwd.attrs.get(k) for k in keys} == {k: bwd.attrs.get(k) for k in keys}
        if (fwd.op.type, bwd.op.type) != ("fused_lm_head_loss", "fused_lm_head_loss_backward") \
                or fwd.how != "out" or bwd.how != "out" or not same_attrs \
                or fwd.attrs.get("softcap") is not None or bwd.inputs[0] != SEED \
                or tuple(bwd.inputs[1:4]) != tuple(fwd.inputs) or bwd.inputs[4] != fwd.outputs[1] \
                or bwd.inputs[5] or not all(fwd.outputs):
            return None
        read = self._ranges([*fwd.inputs, *fwd.outputs, SEED])
        if any(a < d and c < b for a, b in self._ranges(bwd.outputs) for c, d in read):
            return None
        v = self.views
        d_loss, x, weight, targets = (v[k] for k in bwd.inputs[:4])
        loss, lse = (v[k] for k in fwd.outputs)
        d_x, d_w = (v[k] if k else None for k in bwd.outputs)
        ignore = int(fwd.attrs.get("ignore_index", -100))

        def head() -> None:
            fused_lm_head_loss_and_grad(d_loss, x, weight, targets, loss=loss, lse=lse, d_x=d_x, d_weight=d_w,
                                        ignore_index=ignore)

        fused = [fn for s, fn in closures if s.phase == "forward" and s is not fwd]
        fused.append(head)
        fused += [fn for s, fn in closures if s.phase == "backward" and s is not bwd]
        return [fn for fn in fused if fn is not None]

    # -- closures

    def _ranges(self, keys: Iterable[str]) -> list[tuple[int, int]]:
        ts = [self.program.tensors[k] for k in keys if k]
        return [(t.offset, t.offset + t.nbytes) for t in ts]

    def _closure(self, step: Step) -> Callable[[], None] | None:
        v = self.views
        ins: Arrays = [v[k] if k else None for k in step.inputs]
        outs: Arrays = [v[k] if k else None for k in step.outputs]
        kw = dict(step.attrs)
        where = f"step {step.index} ({step.op.type} -> {', '.join(o for o in step.outputs if o)})"
        if step.how == "alias":
            return None
        if step.how == "copy":
            src, dst = ins[0], outs[0]
            assert src is not None and dst is not None
            return lambda: np.copyto(dst, src.reshape(dst.shape))
        if step.how == "optimizer":
            return self._optimizer_closure(step, ins)
        opdef = self.registry.get_op(step.op.type)
        if opdef.random and "offset" in kw:
            return self._random_closure(step, opdef, ins, outs, kw)
        if step.how == "out":
            out_kernel = opdef.out_kernel
            assert out_kernel is not None
            return lambda: out_kernel(*ins, out=outs, **kw)
        kernel, arena = opdef.kernel, self.arena
        # an output slot overlapping an input slot (reuse of an input that dies here): a kernel result
        # that is a view of that input must be copied before any output is written
        overlap = any(a < d and c < b for a, b in self._ranges(step.outputs)
                      for c, d in self._ranges(step.inputs))

        def run_kernel() -> None:
            res = kernel(*ins, **kw)
            results = res if isinstance(res, (tuple, list)) else (res,)
            if overlap:
                results = [r.copy() if np.may_share_memory(r, arena) else r for r in results]
            for o, r in zip(outs, results, strict=True):
                if o is None:
                    continue
                if np.shape(r) != o.shape:
                    raise KilnError(f"{where}: the kernel returned shape {np.shape(r)}, "
                                    f"the plan has {o.shape}")
                np.copyto(o, r)

        return run_kernel

    def _random_closure(self, step: Step, opdef: OpDef, ins: Arrays, outs: Arrays,
                        kw: dict[str, Any]) -> Callable[[], None]:
        """A random op (dropout) with its counter offset moved by layer and training step.

        One block body serves every layer and every step, so its ``seed``/``offset`` attrs alone would
        draw the same mask everywhere. Each (layer, step) gets a disjoint counter range
        (:func:`counter_offset`: 2**32 counters per layer, 2**12 layers per step); the forward, backward
        and recompute replays of one op in one layer and step read the same counters, so their masks
        agree bit for bit.
        """
        base, layer, hyper = int(kw["offset"]), step.layer or 0, self.hyper

        def run() -> None:
            offset = counter_offset(base, layer, int(hyper["step"]))
            res = opdef.kernel(*ins, **{**kw, "offset": offset})
            for o, r in zip(outs, res if isinstance(res, (tuple, list)) else (res,), strict=True):
                if o is not None:
                    np.copyto(o, r)

        return run

    def _optimizer_closure(self, step: Step, ins: Arrays) -> Callable[[], None]:
        hyper = self.hyper
        arrays = [a for a in ins if a is not None]
        if step.op.type == "grad_norm":
            def norm() -> None:
                hyper["grad_norm"] = global_norm(arrays)
                hyper["lr"] = self.opt.lr_at(hyper["step"])
                hyper["scale"] = self.opt.clip_scale(hyper["grad_norm"])

            return norm
        if step.op.type == "adamw":
            p, g, m, v, work = arrays
            return lambda: adamw_update(p, g, m, v, work, opt=self.opt, step=hyper["step"], lr=hyper["lr"],
                                        scale=hyper["scale"])
        raise KilnError(f"the numpy backend has no optimizer step {step.op.type!r}")


def counter_offset(base: int, layer: int, step: int) -> int:
    """The counter offset a random op (dropout) with attribute ``offset=base`` runs with in ``layer`` at
    training ``step``: 2**32 counters per layer, 2**12 layers per step, so every layer and step draws its
    own mask (the NumPy backend's rule; a replay of a step outside it must apply it too)."""
    return base + (layer << 32) + (step << 44)
