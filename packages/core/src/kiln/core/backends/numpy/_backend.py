"""The NumPy backend: runs a Program as planned, every tensor a view into one preallocated arena.

Compiling a Program for an arena makes one view per tensor and one closure per step, once. Running
it then allocates only what reference kernels allocate for their results (copied into the planned
slot and freed at once); steps with an ``out=`` kernel from the kernel table (matmuls through BLAS,
elementwise ufuncs) write into their slot directly, and views cost nothing. Fusions the Program
planned (the LM head's loss and backward as one pass) replace their steps when the steps run
together. Offloaded activations live in a host pool of the Executable's own, apart from the arena:
the forward copies them out after their last use there, the backward copies them back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from kiln.core._errors import KilnError
from kiln.core._threads import blas_held_to_one_thread
from kiln.core.ops._ops import OpDef, OpRegistry
from kiln.core.plan._program import FUSED_HEAD, PHASES, Fusion, Program, Step
from kiln.core.runtime._backend import optimizer_step

Arrays = Sequence[np.ndarray | None]


class NumpyBackend:
    """The embedded reference backend (registered as ``numpy``): host memory, float32 and float64,
    and the reference kernel of every op that has no NumPy kernel in the table."""

    name = "numpy"
    device = "cpu"
    dtypes = ("float32", "float64")
    capabilities = frozenset({FUSED_HEAD, "host_offload"})
    #: precision recipes it runs (``bf16`` emulated with ml_dtypes: :mod:`._precision`)
    precisions = ("fp32", "bf16")
    kernel_fallback: str | None = None
    reference = True

    def allocate(self, nbytes: int) -> np.ndarray:
        """The arena: one zeroed byte buffer."""
        return np.zeros(nbytes, np.uint8)

    def copy(self, src: np.ndarray, dst: np.ndarray, nbytes: int) -> None:
        dst[:nbytes] = src[:nbytes]

    def read(self, buffer: np.ndarray, offset: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return self.view(buffer, offset, shape, dtype).copy()

    def write(self, buffer: np.ndarray, offset: int, value: np.ndarray) -> None:
        view = self.view(buffer, offset, value.shape, str(value.dtype))
        np.copyto(view, value)

    @staticmethod
    def view(buffer: np.ndarray, offset: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        return buffer[offset:offset + n].view(dt).reshape(shape)

    def compile(self, program: Program, buffer: np.ndarray, kernels: Any,
                registry: OpRegistry | None = None) -> Executable:
        return Executable(program, buffer, kernels, registry)


class Executable:
    """A Program bound to an arena: views and step closures built once, run many times."""

    def __init__(self, program: Program, arena: np.ndarray, kernels: Any = None,
                 registry: OpRegistry | None = None) -> None:
        if arena.nbytes < program.arena_bytes:
            raise KilnError(f"the arena has {arena.nbytes} bytes; program {program.name!r} needs "
                            f"{program.arena_bytes}")
        from kiln.core.plugins._session import get_registry

        self.program, self.arena = program, arena
        #: offloaded activations wait here for the backward: host memory outside the arena (the device)
        self.host = np.zeros(program.host_bytes, np.uint8)
        self.registry: OpRegistry = registry if registry is not None else get_registry("ops")  # type: ignore[assignment]
        self.kernels = kernels if kernels is not None else get_registry("kernels")
        self.views: dict[str, np.ndarray] = {
            k: NumpyBackend.view(self.host if t.pool == "host" else arena, t.offset, t.shape, t.dtype)
            for k, t in program.tensors.items()
        }
        self.hyper: dict[str, Any] = {"step": 1, "lr": 0.0, "scale": 1.0, "grad_norm": 0.0,
                                      "optimizer": program.optimizer}
        closures = [(step, self._closure(step)) for step in program.steps]
        self.runs: dict[str, list[Callable[[], None]]] = {}
        for step, fn in closures:
            if fn is not None:
                self.runs.setdefault(step.phase, []).append(fn)
        #: forward + backward with the Program's fusions in place of the steps they replace (the
        #: fused LM-head pass computes in float32: a low-precision recipe runs its two steps)
        self.train_runs = None if program.precision.lowers else self._fused(closures)
        self._closures = closures
        #: ``watch(step, seconds)``, called after every step when set (a Model's run-time annotations:
        #: hooks, probes, asserts, trace); the steps then run one by one, unfused
        self.watch: Callable[[Step, float], None] | None = None

    def _run_watched(self, phases: Sequence[str]) -> None:
        import time

        watch = self.watch
        assert watch is not None
        with blas_held_to_one_thread():
            for phase in phases:
                for step, fn in self._closures:
                    if step.phase != phase:
                        continue
                    start = time.perf_counter()
                    if fn is not None:
                        fn()
                    watch(step, time.perf_counter() - start)

    # -- the Executable protocol

    def run(self, phases: Iterable[str] = PHASES, *,
            hyper: Mapping[str, Any] | None = None) -> dict[str, float]:
        """Run the steps of ``phases`` in order. ``hyper``: ``step`` (the update's number, 1-based) and
        ``optimizer`` (its schedule and clipping; default: the Program's)."""
        self.hyper.update(hyper or {})
        phases = list(phases)
        if self.watch is not None:
            self._run_watched(phases)
            return {k: float(self.hyper[k]) for k in ("grad_norm", "lr", "scale")}
        with blas_held_to_one_thread():  # kernels cut their work over kiln's threads instead
            if self.train_runs is not None and phases[:2] == ["forward", "backward"]:
                for fn in self.train_runs:
                    fn()
                phases = phases[2:]
            for phase in phases:
                for fn in self.runs.get(phase, ()):
                    fn()
        return {k: float(self.hyper[k]) for k in ("grad_norm", "lr", "scale")}

    def read(self, name: str) -> np.ndarray:
        out: np.ndarray = self.views[name].copy()
        return out

    def write(self, name: str, value: Any) -> None:
        view = self.views[name]
        np.copyto(view, np.reshape(np.asarray(value), view.shape), casting="unsafe")

    # -- closures

    def _fused(self, closures: Sequence[tuple[Step, Callable[[], None] | None]]
               ) -> list[Callable[[], None]] | None:
        if not self.program.fusions:
            return None
        replaced = {i: f for f in self.program.fusions for i in f.steps}
        out: list[Callable[[], None]] = []
        for step, fn in closures:
            if step.phase not in ("forward", "backward"):
                continue
            fusion = replaced.get(step.index)
            if fusion is None:
                if fn is not None:
                    out.append(fn)
            elif step.index == fusion.steps[0]:
                out.append(self._fusion_closure(fusion))
        return out

    def _fusion_closure(self, fusion: Fusion) -> Callable[[], None]:
        """The LM head's loss and backward in one pass (the only fusion the NumPy backend plans)."""
        kernel = self.kernels[fusion.kernel].fn
        v = self.views
        ins = [v[k] for k in fusion.inputs]
        loss, lse, d_x, d_w = (v[k] if k else None for k in fusion.outputs)
        kw = dict(fusion.attrs)
        return lambda: kernel(*ins, loss=loss, lse=lse, d_x=d_x, d_weight=d_w, **kw)

    def _ranges(self, keys: Iterable[str]) -> list[tuple[int, int]]:
        ts = [self.program.tensors[k] for k in keys if k]
        return [(t.offset, t.offset + t.nbytes) for t in ts]

    def _kernel(self, step: Step, opdef: OpDef) -> Callable[..., Any]:
        fn: Callable[..., Any] = self.kernels[step.kernel].fn if step.kernel else opdef.kernel
        return fn

    def _closure(self, step: Step) -> Callable[[], None] | None:
        v = self.views
        ins: Arrays = [v[k] if k else None for k in step.inputs]
        outs: Arrays = [v[k] if k else None for k in step.outputs]
        kw = dict(step.attrs)
        where = f"step {step.index} ({step.op.type} -> {', '.join(o for o in step.outputs if o)})"
        if step.how == "alias":
            return None
        if step.how in ("copy", "offload", "fetch"):
            src, dst = ins[0], outs[0]
            assert src is not None and dst is not None
            return lambda: np.copyto(dst, src.reshape(dst.shape), casting="unsafe")  # bf16 <-> fp32 too
        opdef = self.registry.get_op(step.op.type)
        kernel = self._kernel(step, opdef)
        if step.how == "optimizer":
            return optimizer_step(step.op.type, kernel, [a for a in ins if a is not None], self.hyper, kw)
        if self.program.precision.lowers:
            return self._emulated(step, opdef, kernel, ins, outs, kw, where)
        if opdef.random and "offset" in kw:
            return self._random_closure(step, kernel, ins, outs, kw)
        if step.how == "out":
            return lambda: kernel(*ins, out=outs, **kw)
        arena = self.arena
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

    def _emulated(self, step: Step, opdef: OpDef, kernel: Callable[..., Any], ins: Arrays, outs: Arrays,
                  kw: dict[str, Any], where: str) -> Callable[[], None]:
        """The step under a low-precision recipe, its rounding emulated (:func:`._precision.emulated`)."""
        from kiln.core.backends.numpy._precision import emulated

        hyper, layer = self.hyper, step.layer or 0

        def attrs() -> dict[str, Any]:
            if opdef.random and "offset" in kw:
                return {**kw, "offset": counter_offset(int(kw["offset"]), layer, int(hyper["step"]))}
            return kw

        overlap = any(a < d and c < b for a, b in self._ranges(step.outputs)
                      for c, d in self._ranges(step.inputs))
        return emulated(self.program, step, opdef, kernel, ins, outs, attrs, overlap, self.arena, where)

    def _random_closure(self, step: Step, kernel: Callable[..., Any], ins: Arrays, outs: Arrays,
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
            if step.how == "out":
                kernel(*ins, out=outs, **{**kw, "offset": offset})
                return
            res = kernel(*ins, **{**kw, "offset": offset})
            for o, r in zip(outs, res if isinstance(res, (tuple, list)) else (res,), strict=True):
                if o is not None:
                    np.copyto(o, r)

        return run


def counter_offset(base: int, layer: int, step: int) -> int:
    """The counter offset a random op (dropout) with attribute ``offset=base`` runs with in ``layer`` at
    training ``step``: 2**32 counters per layer, 2**12 layers per step, so every layer and step draws its
    own mask (the NumPy backend's rule; a replay of a step outside it must apply it too)."""
    return base + (layer << 32) + (step << 44)
