"""The ``cuda`` backend: one device allocation per arena, each Program step a launch of its CUDA kernel.

It implements kiln-core's Backend and Executable protocols over a *device*: :class:`CudaDevice` (a GPU
through the driver API) or :class:`EmulatedDevice` (the same kernels on the CPU, for tests). An op
without a CUDA kernel runs its NumPy reference on the host (``reference = True``): its inputs are copied
to the host and its results back, visible in the Program as a step whose ``kernel`` is "" (the op's
reference). Everything else stays on the device; the host reads back only the gradient norm and
clipping factor, after a step.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from kiln.core import PHASES, KilnError, Program, Step, counter_offset, get_registry
from kiln.core.plan import rounded_reads
from kiln.core.runtime import optimizer_step
from kiln.cuda._ops import (
    ALIGN,
    BF16_KERNELS,
    BF16_MATMULS,
    BF16_OPERANDS,
    BF16_READS,
    SCALARS,
    AdamwGroup,
    DeviceArray,
    Scratch,
    Workspace,
    adamw_update,
    as_dtype,
    cast,
    check_id_errors,
    grad_norm,
    grad_norm_on_device,
    np_dtype,
    round_bf16,
    step_scalars,
)

FLOATS = ("float32", "bfloat16")


@attrs.frozen(eq=False)
class DeviceBuffer:
    """An arena in device memory."""

    device: Any
    ptr: int
    nbytes: int


class CudaBackend:
    """Registered as ``cuda`` when a GPU is present; ``CudaBackend(EmulatedDevice())`` runs on the CPU."""

    name = "cuda"
    device = "cuda"
    dtypes = ("float32",)
    #: precision recipes it runs: ``bf16`` keeps bf16 tensors in 2-byte device buffers (below)
    precisions = ("fp32", "bf16")
    #: offloaded activations wait in pinned host memory, copied on a second stream (below); the LM head's
    #: loss and gradient run as one pass in a training step (``kiln.cuda._ops.FUSIONS``)
    capabilities: frozenset[str] = frozenset({"host_offload", "fused_lm_head_loss_and_grad"})
    kernel_fallback: str | None = None
    reference = True  # ops without a CUDA kernel run their NumPy reference on the host

    def __init__(self, device: Any = None, *, ordinal: int = 0) -> None:
        #: ``device``: a device object to run on (an EmulatedDevice); else GPU ``ordinal``, opened when used
        self._device, self._given, self.ordinal = device, device is not None, ordinal
        self._others: dict[int, CudaBackend] = {}

    @property
    def gpu(self) -> Any:
        """The device it runs on, opened on first use."""
        if self._device is None:
            from kiln.cuda import _device

            self._device = _device.CudaDevice(self.ordinal)
        return self._device

    @property
    def device_count(self) -> int:
        """The GPUs it can run on: those this process sees, or the one device it was given."""
        from kiln.cuda import _device

        return 1 if self._given else _device.device_count()

    def on_device(self, index: int) -> CudaBackend:
        """This backend on GPU ``index`` (``backend="cuda:1"``), one backend per GPU; an index past the
        GPUs this process sees is a KilnError naming it and their number."""
        from kiln.cuda._device import check_ordinal

        check_ordinal(index, self.device_count)
        if index == self.ordinal:
            return self
        if index not in self._others:
            self._others[index] = CudaBackend(ordinal=index)
        return self._others[index]

    def allocate(self, nbytes: int) -> DeviceBuffer:
        """A zeroed arena, freed when the last Executable or Model holding it lets go of it."""
        buffer = DeviceBuffer(self.gpu, self.gpu.alloc(nbytes), nbytes)
        weakref.finalize(buffer, self.gpu.free, buffer.ptr)
        return buffer

    def copy(self, src: DeviceBuffer, dst: DeviceBuffer, nbytes: int) -> None:
        self.gpu.copy(dst.ptr, src.ptr, nbytes)

    def read(self, buffer: DeviceBuffer, offset: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        dt = np_dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        self.gpu.synchronize()
        return self.gpu.copy_to_host(buffer.ptr + offset, n).view(dt).reshape(shape)

    def write(self, buffer: DeviceBuffer, offset: int, value: np.ndarray) -> None:
        self.gpu.copy_to_device(buffer.ptr + offset, value)
        note_host_write(self.gpu)

    def compile(self, program: Program, buffer: DeviceBuffer, kernels: Any) -> CudaExecutable:
        return CudaExecutable(self, program, buffer, kernels)

    def workspace_bytes(self, program: Program, kernels: Any) -> dict[int, int]:
        """The bytes of kernel temporaries each step of ``program`` takes (a dry run of its launch
        function, :func:`step_scratch`), plus one alignment's slack: ``compile`` places them in the arena."""
        blas = getattr(self.gpu, "blas", None) is not None
        copies = {c.weight for c in weight_copies(program, kernels)} if blas else set()
        return {i: n + ALIGN for i, n in step_scratch(program, kernels, self.gpu, copies).items() if n}

    def held_bytes(self, program: Program, kernels: Any) -> dict[str, tuple[int, int, int]]:
        """The bf16 copies of float32 weights that ``program``'s bf16 matmuls read on cuBLASLt
        (:func:`weight_copies`; none on the SIMT kernels, which round on load): name -> (first reader,
        last reader, bytes), each an arena slot of kind ``held`` (``compile`` places them)."""
        if getattr(self.gpu, "blas", None) is None:
            return {}
        return {c.name: (c.steps[0], c.steps[-1], c.nbytes) for c in weight_copies(program, kernels)}

    def reserve_workspace(self, nbytes: int) -> Workspace:
        """The device's kernel workspace, grown to at least ``nbytes`` (one allocation, shared by the
        Programs on the device: they run one at a time on its stream)."""
        dev = self.gpu
        ws = getattr(dev, "workspace", None)
        if ws is None or ws.nbytes < nbytes:
            if ws is not None:
                dev.synchronize()
                dev.free(ws.base)
            dev.workspace = ws = Workspace(dev.alloc(nbytes), nbytes)
        return ws


def note_host_write(dev: Any) -> None:
    """Count a host write into a Program's tensors on ``dev`` (its ``host_writes``): kiln-dist's
    overlapped wait so knows, without reading anything back, whether the gradients a collective started
    with may have changed since (the Program's own steps never write them after the start)."""
    dev.host_writes = getattr(dev, "host_writes", 0) + 1


class UnavailableBackend:
    """Stands for ``cuda`` where kiln-kernels-cuda is installed but cannot run: using it is a KilnError
    that says why (no driver, no GPU), where an absent name would only say it is unknown."""

    name = "cuda"
    device = "cuda"
    capabilities: frozenset[str] = frozenset()
    kernel_fallback: str | None = None
    reference = True

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def _fail(self) -> KilnError:
        return KilnError(f"backend 'cuda' is unavailable: {self.reason}",
                         hint="train on backend 'numpy', or run on a machine with an NVIDIA GPU and driver")

    @property
    def dtypes(self) -> tuple[str, ...]:
        raise self._fail()

    @property
    def precisions(self) -> tuple[str, ...]:
        """Asking whether it runs a recipe (``bf16``) says why it runs nothing, not "does not run bf16"."""
        raise self._fail()

    def allocate(self, nbytes: int) -> Any:
        raise self._fail()

    def on_device(self, index: int) -> Any:
        """``cuda:1`` names a GPU; here there is none to run on."""
        raise self._fail()

    def compile(self, program: Program, buffer: Any, kernels: Any) -> Any:
        raise self._fail()


class CudaExecutable:
    """A Program bound to a device arena: one closure per step, built once."""

    def __init__(self, backend: CudaBackend, program: Program, arena: DeviceBuffer, kernels: Any) -> None:
        if arena.nbytes < program.arena_bytes:
            raise KilnError(f"the arena has {arena.nbytes} bytes; program {program.name!r} needs "
                            f"{program.arena_bytes}")
        self.program, self.arena, self.backend = program, arena, backend
        self.dev = arena.device
        self.kernels = kernels if kernels is not None else get_registry("kernels")
        self.ops = get_registry("ops")
        #: the host pool of offloaded activations: pinned host memory of the Executable's own
        self.host = self.dev.alloc_host(program.host_bytes) if program.host_bytes else 0
        if self.host:
            weakref.finalize(self, self.dev.free_host, self.host)
        self.arrays = {k: DeviceArray(self.dev, (self.host if t.pool == "host" else arena.ptr) + t.offset,
                                      tuple(t.shape), t.dtype)
                       for k, t in program.tensors.items()}
        self.on_host = {k for k, t in program.tensors.items() if t.pool == "host"}
        #: step index -> the copy-stream events the compute stream waits on before it (host offload)
        self.waits: dict[int, list[Any]] = {}
        self.copy_events: list[Any] = []
        self.hyper: dict[str, Any] = {"step": 1, "lr": 0.0, "scale": 1.0, "grad_norm": 0.0,
                                      "optimizer": program.optimizer}
        self.runs: dict[str, list[Callable[[], None]]] = {}
        #: the attributes of each AdamW group, in the order of their factors in ``scalars``
        self.adamw_groups: list[dict[str, Any]] = []
        #: the optimizer phase's run-time scalars on the device (``kiln.cuda._ops.step_scalars``): the
        #: gradient norm and clipping factor computed there, the step's learning rate and AdamW factors
        #: written before each run, so a captured optimizer phase reads them without the host
        self.scalars = DeviceArray(self.dev, 0, (0,), "float32")
        self.device_norm = False  # whether kiln's gradient norm computes the clipping factor there
        self.host_steps: dict[str, list[str]] = {}  # phase -> the steps that run on the host
        #: phase -> steps a CUDA graph cannot replay: random ops (their counters move per training step)
        #: and host offload's copies (a second stream, host memory)
        self.random_steps: dict[str, list[str]] = {}
        #: step index -> its planned workspace in the arena
        self.planned = {int(sl.name.split(".", 1)[1]): Workspace(arena.ptr + sl.offset, sl.nbytes)
                        for sl in program.slots if sl.kind == "workspace"}
        #: weight -> its bf16 copy (the ``held`` slot the plan gave it, :func:`weight_copies`) and the step
        #: that makes it; empty on the SIMT kernels or for a Program planned without them
        self.copies: dict[str, tuple[DeviceArray, int]] = {}
        held = {sl.name: sl for sl in program.slots if sl.kind == "held"}
        if held and getattr(self.dev, "blas", None) is not None:
            for c in weight_copies(program, self.kernels):
                if c.name in held:
                    array = DeviceArray(self.dev, arena.ptr + held[c.name].offset, c.shape, "bfloat16")
                    self.copies[c.weight] = (array, c.steps[0])
        self._weights = {sl.name for sl in program.slots if sl.kind == "weight"}
        group: list[Step] = []  # consecutive AdamW updates of one parameter group: one launch
        step_runs: dict[int, Callable[[], None]] = {}
        waited: set[int] = set()  # steps the compute stream waits before (for host offload's copies)
        for step in program.steps:
            if group and not self._joins(group, step):
                self.runs.setdefault("optimizer", []).append(self._adamw_group(group))
                group = []
            if self._joins(group, step):
                group.append(step)
                continue
            fn = self._in_workspace(self._closure(step), self.planned.get(step.index))
            for event in self.waits.pop(step.index, ()):
                self.runs.setdefault(step.phase, []).append(lambda e=event: self.dev.wait("compute", e))
                waited.add(step.index)
            if fn is not None:
                self.runs.setdefault(step.phase, []).append(fn)
                step_runs[step.index] = fn
                if step.how in ("offload", "fetch"):
                    self.random_steps.setdefault(step.phase, []).append(f"step {step.index} ({step.how})")
                elif not step.kernel and step.how != "copy":
                    self.host_steps.setdefault(step.phase, []).append(f"step {step.index} ({step.op.type})")
        if group:
            self.runs.setdefault("optimizer", []).append(self._adamw_group(group))
        n = SCALARS + 3 * len(self.adamw_groups)
        self.scalars = DeviceArray(self.dev, self.dev.alloc(4 * n), (n,), "float32")
        weakref.finalize(self, self.dev.free, self.scalars.ptr)
        for events in self.waits.values():  # read or overwritten in a later phase: waited for at the end
            self.copy_events.extend(events)
        self.waits.clear()
        #: bytes of the kernels' temporaries outside the arena: none when the Program has planned each
        #: step's in its arena (``workspace.<index>`` slots, from :meth:`CudaBackend.workspace_bytes`);
        #: else (a Program planned for another backend object) the deepest step's, reserved once in the
        #: device's workspace
        self.workspace_bytes = 0
        if not self.planned:
            self.workspace_bytes = scratch_bytes(program, self.kernels, self.dev, self.copies)
            backend.reserve_workspace(self.workspace_bytes)
        self.graphs: dict[tuple[str, ...], Callable[[], None]] = {}
        #: forward + backward with the Program's fusions in place of the steps they replace, run when both
        #: phases run together (a run of one phase runs its plain steps); None without a fusion to run
        self.train_runs = self._fused_runs(step_runs, waited)

    def run(self, phases: Iterable[str] = PHASES, *,
            hyper: Mapping[str, Any] | None = None) -> dict[str, float]:
        self.hyper.update(hyper or {})
        phases = tuple(phases)
        if "optimizer" in phases:  # the step's learning rate and AdamW factors, for the device to read
            values = step_scalars(self.hyper["optimizer"], int(self.hyper["step"]), self.adamw_groups,
                                  clip=self.device_norm)
            self.hyper["lr"] = float(values[2])
            self.dev.copy_to_device(self.scalars.ptr, values)
        i = 0
        while i < len(phases):  # a captured run of phases replays its graph
            span = next((p for p in self.graphs if phases[i:i + len(p)] == p), None)
            if span is not None:
                self.graphs[span]()
                i += len(span)
                continue
            n = 2 if self.train_runs is not None and phases[i:i + 2] == ("forward", "backward") else 1
            for fn in self._phase_runs(phases[i:i + n]):
                fn()
            i += n
        for event in self.copy_events:  # no copy of this run outlives it
            self.dev.wait("compute", event)
        if "optimizer" in phases:
            self._read_scalars()
        return {k: float(self.hyper[k]) for k in ("grad_norm", "lr", "scale")}

    def _read_scalars(self) -> None:
        """The gradient norm and clipping factor the device computed, into ``hyper``."""
        self.dev.synchronize()
        check_id_errors(self.dev)  # a token id a kernel found outside its vocabulary
        norm, scale = self.dev.copy_to_host(self.scalars.ptr, 8).view(np.float32)
        self.hyper["grad_norm"], self.hyper["scale"] = float(norm), float(scale)

    def capture(self, phases: Sequence[str] = ("forward", "backward")) -> None:
        """Record ``phases`` once as a CUDA graph (``device.capture``) that later runs of them replay: one
        launch instead of one per kernel; ``capture(PHASES)`` records the whole training step, the optimizer
        phase reading its learning rate and clipping factor from the device scalars (``scalars``) that
        each run writes before replaying. The phases must run on the device alone: no host steps, no
        allocation, no read back (an update kernel other than kiln's AdamW reads the clipping factor back).
        A ``KilnError`` names what keeps a phase off the graph. Capturing runs nothing."""
        phases = tuple(phases)
        host = [s for p in phases for s in self.host_steps.get(p, ())]
        if host:
            raise KilnError(f"phases {', '.join(phases)} of {self.program.name!r} cannot be captured: "
                            f"{', '.join(host[:4])} run on the host (no CUDA kernel)")
        rand = [s for p in phases for s in self.random_steps.get(p, ())]
        if rand:
            raise KilnError(f"phases {', '.join(phases)} of {self.program.name!r} cannot be captured: "
                            f"{', '.join(rand[:4])} draw a new mask each training step or copy to or "
                            "from the host")
        if not hasattr(self.dev, "capture"):
            raise KilnError(f"device {getattr(self.dev, 'name', '?')!r} cannot capture CUDA graphs")
        runs = self._phase_runs(phases)

        def body() -> None:
            for fn in runs:
                fn()

        self.graphs[phases] = self.dev.capture(body)

    def read(self, name: str) -> np.ndarray:
        a = self.arrays[name]
        self.dev.synchronize()
        check_id_errors(self.dev)  # a token id a kernel found outside its vocabulary
        if name in self.on_host:  # pinned host memory: read in place
            raw = np.empty(a.nbytes, np.uint8)
            ctypes.memmove(raw.ctypes.data, a.ptr, a.nbytes)
            return raw.view(np_dtype(a.dtype)).reshape(a.shape)
        return a.download()

    def write(self, name: str, value: Any) -> None:
        a = self.arrays[name]
        v = np.ascontiguousarray(np.asarray(value).astype(np_dtype(a.dtype)).reshape(a.shape))
        note_host_write(self.dev)
        if name in self.on_host:
            self.dev.synchronize()
            ctypes.memmove(a.ptr, v.ctypes.data, a.nbytes)
            return
        self.dev.copy_to_device(a.ptr, v)

    def _phase_runs(self, phases: Sequence[str]) -> list[Callable[[], None]]:
        """The closures that run ``phases`` in order: forward then backward with their fusions."""
        out: list[Callable[[], None]] = []
        i = 0
        while i < len(phases):
            if self.train_runs is not None and tuple(phases[i:i + 2]) == ("forward", "backward"):
                out += self.train_runs
                i += 2
            else:
                out += self.runs.get(phases[i], ())
                i += 1
        return out

    def _fused_runs(self, step_runs: Mapping[int, Callable[[], None]],
                    waited: set[int]) -> list[Callable[[], None]] | None:
        """The forward and backward runs with each fusion's pass at its first step (in the workspace
        planned for its last: live while the pass's outputs are, so it overlaps none of its tensors) and
        its other steps left out. A fusion is not run when a step of it runs on the host, waits for a
        host copy, or has no cuda kernel of the fusion for the Program's recipe (``fused_kernel``)."""
        passes: dict[int, Callable[[], None]] = {}  # id of a step's closure -> the pass in its place
        skipped: set[int] = set()
        for fusion in self.program.fusions:
            kernel = fused_kernel(self.program, fusion, self.kernels)
            if kernel is None or any(i not in step_runs or i in waited for i in fusion.steps):
                continue
            ins = [self.arrays[k] for k in fusion.inputs]
            loss, lse, d_x, d_w = (self.arrays[k] if k else None for k in fusion.outputs)
            kw = dict(fusion.attrs)

            def run(kernel: Callable[..., None] = kernel, ins: list[DeviceArray] = ins, loss: Any = loss,
                    lse: Any = lse, d_x: Any = d_x, d_w: Any = d_w, kw: dict[str, Any] = kw) -> None:
                kernel(*ins, loss=loss, lse=lse, d_x=d_x, d_weight=d_w, **kw)

            fn = self._in_workspace(run, self.planned.get(fusion.steps[-1]))
            assert fn is not None
            passes[id(step_runs[fusion.steps[0]])] = fn
            skipped.update(id(step_runs[i]) for i in fusion.steps[1:])
        if not passes:
            return None
        return [passes.get(id(fn), fn) for p in ("forward", "backward") for fn in self.runs.get(p, ())
                if id(fn) not in skipped]

    def _joins(self, group: Sequence[Step], step: Step) -> bool:
        """Whether ``step`` is an update by kiln's AdamW kernel with the attributes of ``group``'s."""
        if step.how != "optimizer" or not step.kernel or self.kernels[step.kernel].fn is not adamw_update:
            return False
        return not group or dict(group[0].attrs) == dict(step.attrs)

    def _adamw_group(self, steps: Sequence[Step]) -> Callable[[], None]:
        update = AdamwGroup([[self.arrays[k] for k in s.inputs if k] for s in steps])
        attrs_ = dict(steps[0].attrs)
        slot = SCALARS + 3 * len(self.adamw_groups)
        self.adamw_groups.append(attrs_)
        return lambda: update.on_device(self.scalars, slot, **attrs_)

    def _closure(self, step: Step) -> Callable[[], None] | None:
        ins = [self.arrays[k] if k else None for k in step.inputs]
        outs = [self.arrays[k] if k else None for k in step.outputs]
        kw = dict(step.attrs)
        if step.how == "alias":
            return None
        if step.how in ("offload", "fetch"):
            return self._host_copy(step, ins[0], outs[0])
        if step.how == "copy":
            src, dst = ins[0], outs[0]
            assert src is not None and dst is not None
            if src.dtype != dst.dtype:  # a bf16 tensor into a float32 slot, or back: the cast kernel
                return lambda: cast(src.reshape(dst.shape), out=[dst])
            return lambda: self.dev.copy(dst.ptr, src.ptr, dst.nbytes)
        if not step.kernel:
            return self._host_closure(step, ins, outs, kw)
        kernel = self.kernels[step.kernel].fn
        if step.how == "optimizer":
            return self._optimizer_closure(step, kernel, [a for a in ins if a is not None], kw)
        if self.ops.get_op(step.op.type).random and "offset" in kw:
            kernel = self._counters(step, kernel, int(kw["offset"]))
        if self.program.precision.lowers:
            made = self._read_copies(step, ins)
            fn = low_precision(self.program, step, self.ops.get_op(step.op.type), kernel, ins, outs, kw)
            if not made:
                return fn

            def make_then_run() -> None:
                for w, c in made:  # the weight's bf16 copy, once per step, read by its later products too
                    cast(w, out=[c])
                fn()

            return make_then_run
        return lambda: kernel(*ins, out=outs, **kw)

    def _read_copies(self, step: Step,
                     ins: list[DeviceArray | None]) -> list[tuple[DeviceArray, DeviceArray]]:
        """``ins`` with each float32 weight that ``step`` reads as a bf16 matmul operand replaced by its
        planned bf16 copy (in place); the (weight, copy) pairs ``step`` makes, as their first reader."""
        made: list[tuple[DeviceArray, DeviceArray]] = []
        if not self.copies:
            return made
        for i in copied_operands(self.program, step, self.kernels, self._weights):
            w = step.inputs[i]
            if w not in self.copies:
                continue
            copy, first = self.copies[w]
            if first == step.index and all(c is not copy for _, c in made):
                made.append((self.arrays[w], copy))
            ins[i] = copy
        return made

    def _in_workspace(self, fn: Callable[[], None] | None, ws: Workspace | None) -> Callable[[], None] | None:
        """``fn`` with its step's planned workspace as the device's while it runs."""
        if fn is None or ws is None:
            return fn
        dev, run = self.dev, fn

        def in_ws() -> None:
            prev, dev.workspace, ws.top = getattr(dev, "workspace", None), ws, 0
            try:
                run()
            finally:
                dev.workspace = prev

        return in_ws

    def _optimizer_closure(self, step: Step, kernel: Callable[..., Any], arrays: list[DeviceArray],
                           kw: dict[str, Any]) -> Callable[[], None]:
        """kiln's gradient norm writes the norm and clipping factor into the device scalars; any other
        update (SGD, a plugin's) gets them from the host, read back first (it cannot be captured)."""
        hyper = self.hyper
        if kernel is grad_norm:
            self.device_norm = True
            return lambda: grad_norm_on_device(self.scalars, arrays)
        update = optimizer_step(step.op.type, kernel, arrays, hyper, kw)
        if self.ops.get_op(step.op.type).collective:  # kiln-dist's collectives read no scalar
            self.random_steps.setdefault(step.phase, []).append(f"step {step.index} ({step.op.type}, "
                                                                 "a collective)")
            return update
        self.random_steps.setdefault(step.phase, []).append(
            f"step {step.index} ({step.op.type}, reads the clipping factor on the host)")

        def run() -> None:
            if step.op.type != "grad_norm":
                self._read_scalars()
            update()
            if step.op.type == "grad_norm":  # a plugin's norm on the host: where the device reads it
                self.dev.copy_to_device(self.scalars.ptr,
                                        np.array([hyper["grad_norm"], hyper["scale"]], np.float32))

        return run

    def _host_copy(self, step: Step, src: DeviceArray | None, dst: DeviceArray | None) -> Callable[[], None]:
        """An offload (device to the host pool) or a fetch (back) on the copy stream: it starts when the
        compute stream has reached this step (an event), and the compute stream waits for it (another
        event) right before the first later step that overwrites the offloaded storage or reads the
        fetched one, so the copy overlaps the kernels between."""
        assert src is not None and dst is not None
        if src.dtype != dst.dtype or src.nbytes != dst.nbytes:
            raise KilnError(f"step {step.index} ({step.how}): {src.dtype} {src.shape} to {dst.dtype} "
                            f"{dst.shape} is not a plain copy")
        dev, ready, done = self.dev, self.dev.event(), self.dev.event()
        watched = step.inputs[0] if step.how == "offload" else step.outputs[0]
        later = self._next_touch(step, watched, write=step.how == "offload")
        self.waits.setdefault(later, []).append(done)

        def run() -> None:
            dev.record(ready, "compute")
            dev.wait("copy", ready)
            dev.copy_async(dst.ptr, src.ptr, dst.nbytes, "copy")
            dev.record(done, "copy")

        return run

    def _next_touch(self, step: Step, key: str, *, write: bool) -> int:
        """The first step of the same phase after ``step`` that writes (``write``) or reads the arena bytes
        of tensor ``key``; -1 (the end of the run) if none does. A step writes its planned workspace (its
        kernels' temporaries, an arena slot that may reuse an offloaded tensor's bytes) and, where it makes
        a weight's bf16 copy (``copies``), that copy's ``held`` slot."""
        t = self.program.tensors[key]
        lo, hi = t.offset, t.offset + self.arrays[key].nbytes
        made: dict[int, list[tuple[int, int]]] = {}  # step -> (offset, bytes) it writes beside its outputs
        for copy, first in self.copies.values() if write else ():
            made.setdefault(first, []).append((copy.ptr - self.arena.ptr, copy.nbytes))
        for index, ws in self.planned.items() if write else ():
            made.setdefault(index, []).append((ws.base - self.arena.ptr, ws.nbytes))

        def touches(names: Sequence[str]) -> bool:
            for k in names:
                if k and k not in self.on_host:
                    u = self.program.tensors[k]
                    if u.offset < hi and lo < u.offset + self.arrays[k].nbytes:
                        return True
            return False

        for later in self.program.steps[step.index + 1:]:
            if later.phase != step.phase:
                break
            if later.how == "alias":
                continue
            names = (*later.outputs, *(later.inputs if later.how == "optimizer" else ())) if write \
                else later.inputs
            if touches(names) or any(at < hi and lo < at + n for at, n in made.get(later.index, ())):
                return later.index
        return -1

    def _counters(self, step: Step, kernel: Callable[..., Any], base: int) -> Callable[..., Any]:
        """A random op's kernel with the counter offset of the layer and training step it runs in (the
        NumPy backend's :func:`~kiln.core.counter_offset`), so its masks are the NumPy backend's. Read at
        run time, so such a step cannot be captured in a CUDA graph."""
        hyper, layer = self.hyper, step.layer or 0
        self.random_steps.setdefault(step.phase, []).append(f"step {step.index} ({step.op.type})")

        def run(*args: Any, **kw: Any) -> Any:
            return kernel(*args, **{**kw, "offset": counter_offset(base, layer, int(hyper["step"]))})

        return run

    def _host_closure(self, step: Step, ins: Sequence[DeviceArray | None], outs: Sequence[DeviceArray | None],
                      kw: dict[str, Any]) -> Callable[[], None]:
        """An op without a CUDA kernel: its reference kernel on host copies of its inputs."""
        opdef = self.ops.get_op(step.op.type)
        where = f"step {step.index} ({step.op.type}, on the host)"
        dev, hyper = self.dev, self.hyper
        if self.program.precision.lowers and step.how != "optimizer":
            return self._host_low_precision(step, opdef, ins, outs, kw, where)

        def host(a: DeviceArray | None) -> np.ndarray | None:
            return None if a is None else a.download()

        def run() -> None:
            dev.synchronize()
            attrs_ = dict(kw)
            if opdef.random and "offset" in attrs_:  # the NumPy backend's counters, so masks agree
                attrs_["offset"] = counter_offset(int(attrs_["offset"]), step.layer or 0, int(hyper["step"]))
            if step.how == "optimizer":  # the clipping factor the device computed
                self._read_scalars()
            arrays = [host(a) for a in ins]
            if step.how == "optimizer":
                opdef.kernel(*[a for a in arrays if a is not None], step=hyper["step"], lr=hyper["lr"],
                             scale=hyper["scale"], **attrs_)
                for a, h in zip(ins, arrays, strict=True):  # updates run in place: write them back
                    if a is not None and h is not None:
                        dev.copy_to_device(a.ptr, h)
                return
            res = opdef.kernel(*arrays, **attrs_)
            results = res if isinstance(res, (tuple, list)) else (res,)
            for o, r in zip(outs, results, strict=True):
                if o is None:
                    continue
                r = np.asarray(r)
                if r.shape != o.shape:
                    raise KilnError(f"{where}: the reference returned shape {r.shape}, the plan has "
                                    f"{o.shape}")
                dev.copy_to_device(o.ptr, r.astype(o.dtype, copy=False))

        return run

    def _host_low_precision(self, step: Step, opdef: Any, ins: Sequence[DeviceArray | None],
                            outs: Sequence[DeviceArray | None], kw: dict[str, Any],
                            where: str) -> Callable[[], None]:
        """A host step under the bf16 recipe, as the NumPy backend runs it: the op's NumPy bf16 kernel
        (``op@numpy:bfloat16``, whose rounding points lie inside the op) or its reference, on float32
        copies of the inputs (rounded to bf16 first for a ``lower`` op), the outputs rounded where the
        Program says and stored in their slots' dtypes."""
        program, dev, hyper = self.program, self.dev, self.hyper
        own = f"{step.op.type}@numpy:bfloat16"
        kernel = self.kernels[own].fn if own in self.kernels else opdef.kernel
        # a float32 statistic of the op (lse, rstd) is read as stored, as NumPy reads it
        rounds = rounded_reads(opdef, len(ins), _computes_low(program, step, opdef))
        rounded = [bool(k) and k in program.rounded for k in step.outputs]
        low = np_dtype("bfloat16")

        def host(a: DeviceArray | None, rnd: bool) -> np.ndarray | None:
            if a is None:
                return None
            x = a.download()
            if a.dtype not in FLOATS:
                return x
            return (x.astype(low) if rnd else x).astype(np.float32)

        def run() -> None:
            dev.synchronize()
            attrs_ = dict(kw)
            if opdef.random and "offset" in attrs_:
                attrs_["offset"] = counter_offset(int(attrs_["offset"]), step.layer or 0, int(hyper["step"]))
            res = kernel(*[host(a, rnd) for a, rnd in zip(ins, rounds, strict=True)], **attrs_)
            results = res if isinstance(res, (tuple, list)) else (res,)
            for o, r, rnd in zip(outs, results, rounded, strict=True):
                if o is None:
                    continue
                r = np.asarray(r)
                if r.shape != o.shape:
                    raise KilnError(f"{where}: the reference returned shape {r.shape}, the plan has "
                                    f"{o.shape}")
                r = r.astype(np.float32) if o.dtype in FLOATS else r  # through a float32 slot, as NumPy
                if rnd and o.dtype == "float32":
                    r = r.astype(np.float32).astype(low)
                dev.copy_to_device(o.ptr, np.ascontiguousarray(r.astype(np_dtype(o.dtype))))

        return run


def fused_kernel(program: Program, fusion: Any, kernels: Any) -> Callable[..., None] | None:
    """The kernel that runs ``fusion`` of ``program`` on cuda, or None where its steps must run apart: the
    fusion's own kernel (float32), under a low-precision recipe its ``bfloat16`` kernel when the fused
    steps run their bf16 kernels (an ``@precision`` that keeps them in fp32 keeps them apart); None when
    a fused step runs on the host (its op's kernels left out)."""
    steps = [program.steps[i] for i in fusion.steps]
    if not all(st.kernel for st in steps):
        return None
    key = fusion.kernel
    if program.precision.lowers:
        if not all(st.kernel.endswith(":bfloat16") for st in steps):
            return None
        key = f"{fusion.kind}@cuda:bfloat16"
    if key not in kernels or kernels[key].backend != "cuda":  # (a registry, not a dict: no .get)
        return None
    fn: Callable[..., None] = kernels[key].fn
    return fn


def _computes_low(program: Program, step: Step, opdef: Any) -> bool:
    """Whether ``step`` computes in bf16 under the Program's recipe (its float inputs rounded first): a
    ``lower`` op, or one an ``@precision`` annotation sends there (``Program.computes``)."""
    computes = getattr(program, "computes", {}).get(next((k for k in step.outputs if k), ""))
    return computes == "bf16" if computes else program.precision.default_class(opdef) == "lower"


@attrs.frozen
class WeightCopy:
    """The bf16 copy of a float32 weight (its master copy) that the bf16 matmuls of a Program read on
    cuBLASLt, which cannot round on load: made by the first of ``steps`` (the weight's readers, in order:
    the forward product, a recompute replay, ``d_x`` in the backward), before its product, and read by
    all of them; the same rounding (``cast_f32_bf16``, nearest even) as a copy per product, made once."""

    weight: str
    shape: tuple[int, ...]
    steps: tuple[int, ...]

    @property
    def name(self) -> str:
        """Its arena slot (kind ``held``)."""
        return f"bf16.{self.weight}"

    @property
    def nbytes(self) -> int:
        return 2 * int(np.prod(self.shape, dtype=np.int64))


def copied_operands(program: Program, step: Step, kernels: Any, weights: Collection[str]) -> tuple[int, ...]:
    """The operand positions (of a and b) of ``step`` that read a float32 weight (a tensor in one of the
    slots ``weights``) as a bf16 operand: a ``lower`` matmul step (``BF16_OPERANDS``) run by the recipe's
    matmul path, not a kernel of its own (``kernels`` None: a Program planned for another backend, as
    ``kiln plan`` plans for ``numpy``, read as the ``cuda`` backend would run it)."""
    if step.op.type not in BF16_OPERANDS:
        return ()
    if kernels is None:
        if step.how not in ("out", "kernel"):
            return ()
    elif not step.kernel or step.how != "out" or kernels[step.kernel].fn in (*BF16_KERNELS.values(),
                                                                              *BF16_READS):
        return ()
    if not _computes_low(program, step, get_registry("ops").get_op(step.op.type)):
        return ()
    found = []
    for i, k in enumerate(step.inputs[:2]):
        t = program.tensors.get(k) if k else None
        if t is not None and t.dtype == "float32" and t.slot in weights and t.pool == "arena":
            found.append(i)
    return tuple(found)


def weight_copies(program: Program, kernels: Any) -> tuple[WeightCopy, ...]:
    """The bf16 weight copies the ``cuda`` backend plans for ``program`` on a device with cuBLASLt: one per
    float32 weight read by a bf16-computing matmul, made once per run of its phases (a training step)
    instead of once per product (the SIMT kernels round on load and need none)."""
    if not program.precision.lowers:
        return ()
    readers: dict[str, list[int]] = {}
    weights = {sl.name for sl in program.slots if sl.kind == "weight"}
    for step in program.steps:
        for i in copied_operands(program, step, kernels, weights):
            readers.setdefault(step.inputs[i], []).append(step.index)
    return tuple(WeightCopy(k, tuple(program.tensors[k].shape), tuple(sorted(set(v))))
                 for k, v in readers.items())


def low_precision(program: Program, step: Step, opdef: Any, kernel: Callable[..., Any],
                  inputs: Sequence[DeviceArray | None], outputs: Sequence[DeviceArray | None],
                  kw: Mapping[str, Any]) -> Callable[[], None]:
    """A step of a bf16-recipe Program on the device, rounding where the NumPy backend's emulation does:
    bf16 tensors widened to float32 copies (exact), the float inputs of a ``lower`` op rounded to bf16
    first, the float32 kernel run, each output the Program lists in ``rounded`` rounded to bf16, and
    stored in its slot's dtype (a bf16 slot: the cast kernel, round to nearest even). A kernel of its
    own for bf16 (``kiln.cuda._ops.BF16_KERNELS``: attention on tensor cores) reads and writes the
    slots as they are; a float32 kernel with a twin that reads bf16 directly (``BF16_READS``: the
    norms, add and mul, gelu, the layout copies) runs the twin on the bf16 slots as they are, with no
    widened copies."""
    ins, outs = list(inputs), list(outputs)
    if kernel in BF16_KERNELS.values():
        return lambda: kernel(*ins, out=outs, **kw)
    direct = BF16_READS.get(kernel)
    if direct is not None:
        kernel = direct
    lower = _computes_low(program, step, opdef)
    rounded = [bool(k) and k in program.rounded for k in step.outputs]
    mm = BF16_MATMULS.get(kernel) if lower and step.op.type in BF16_OPERANDS else None
    if mm is not None:  # a matmul that rounds its operands and stores a bf16 output itself
        return lambda: mm(*ins, out=outs, round_out=rounded[0], **kw)
    dev = next(a.device for a in (*ins, *outs) if a is not None)
    operands = 2 if lower and step.op.type in BF16_OPERANDS else 0  # a matmul's a and b, as bf16
    rounds = rounded_reads(opdef, len(ins), lower)  # the op's float32 statistics read as stored

    def read(s: Scratch, i: int, a: DeviceArray | None) -> DeviceArray | None:
        if a is None or a.dtype not in FLOATS:
            return a
        if i < operands:
            return as_dtype(s, a, "bfloat16")
        if rounds[i] and a.dtype == "float32":
            return round_bf16(s, a)
        if direct is not None:  # it reads a bf16 tensor as it is
            return a
        return as_dtype(s, a, "float32")

    def run() -> None:
        with Scratch(dev) as s:
            xs = [read(s, i, a) for i, a in enumerate(ins)]
            ys = [o if o is None or o.dtype != "bfloat16" or direct is not None else s.array(o.shape)
                  for o in outs]
            kernel(*xs, out=ys, **kw)
            for o, y, rnd in zip(outs, ys, rounded, strict=True):
                if o is None or y is None:
                    continue
                if y is not o:
                    cast(y, out=[o])  # the store into bf16 is the rounding
                elif rnd and o.dtype == "float32":
                    round_bf16(s, o, into=o)

    return run


class _SizingDevice:
    """Stands for the device in a dry run of a Program's kernels: launches and copies nothing, reads back
    zeros, and records the deepest stack of scratch allocations (aligned as the workspace aligns)."""

    name = "sizing"
    workspace = None

    def __init__(self, real: Any) -> None:
        self.arch = getattr(real, "arch", "")
        self.blas = self if getattr(real, "blas", None) is not None else None  # the same path, run dry
        self.sizes: dict[int, int] = {}
        self.live = self.high = 0
        self._next = 1 << 40

    def alloc(self, nbytes: int) -> int:
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        ptr, self._next = self._next, self._next + size
        self.sizes[ptr] = size
        self.live += size
        self.high = max(self.high, self.live)
        return ptr

    def free(self, ptr: int) -> None:
        self.live -= self.sizes.pop(ptr)

    def copy_to_host(self, ptr: int, nbytes: int) -> np.ndarray:
        return np.zeros(nbytes, np.uint8)

    def launch(self, *args: Any) -> None:
        pass

    memset = copy = copy_to_device = gemm = launch

    def synchronize(self) -> None:
        pass


def scratch_bytes(program: Program, kernels: Any, device: Any, copies: Collection[str] = ()) -> int:
    """The largest scratch memory any step of ``program`` takes on ``device`` (:func:`step_scratch`)."""
    return max(step_scratch(program, kernels, device, copies).values(), default=0)


def step_scratch(program: Program, kernels: Any, device: Any, copies: Collection[str] = ()) -> dict[int, int]:
    """The scratch memory each step of ``program`` takes on ``device``, by step index: each step's kernel
    run dry (launching nothing) on a :class:`_SizingDevice` with the Program's shapes, the weights
    ``copies`` read as their bf16 copies (:func:`weight_copies`, no scratch copy per product)."""
    sizing, need = _SizingDevice(device), {}
    arrays = {k: DeviceArray(sizing, 0, tuple(t.shape), t.dtype) for k, t in program.tensors.items()}
    weights = {sl.name for sl in program.slots if sl.kind == "weight"} if copies else set()
    hyper = {"step": 1, "lr": 0.0, "scale": 1.0, "grad_norm": 0.0, "optimizer": program.optimizer}
    ops = get_registry("ops")
    for step in program.steps:
        if not step.kernel or step.how in ("alias", "copy"):
            continue
        ins = [arrays[k] if k else None for k in step.inputs]
        fn = kernels[step.kernel].fn
        sizing.high = sizing.live = 0
        try:
            if step.how == "optimizer":
                optimizer_step(step.op.type, fn, [a for a in ins if a is not None], hyper, dict(step.attrs))()
            elif program.precision.lowers:  # with the casts' temporaries
                for i in copied_operands(program, step, kernels, weights) if copies else ():
                    if step.inputs[i] in copies:  # its planned bf16 copy, no scratch
                        ins[i] = DeviceArray(sizing, 0, arrays[step.inputs[i]].shape, "bfloat16")
                low_precision(program, step, ops.get_op(step.op.type), fn, ins,
                              [arrays[k] if k else None for k in step.outputs], step.attrs)()
            else:
                fn(*ins, out=[arrays[k] if k else None for k in step.outputs], **step.attrs)
        except KilnError:
            raise
        except Exception:  # a plugin's kernel that needs more of a device than a dry run has:
            continue  # its temporaries, if any, are allocated when it runs (Workspace.overflows)
        need[step.index] = sizing.high
    for fusion in program.fusions:  # a fused pass runs in the workspace of its last step
        kernel = fused_kernel(program, fusion, kernels)
        if kernel is None:
            continue
        sizing.high = sizing.live = 0
        ins = [arrays[k] for k in fusion.inputs]
        loss, lse, d_x, d_w = (arrays[k] if k else None for k in fusion.outputs)
        kernel(*ins, loss=loss, lse=lse, d_x=d_x, d_weight=d_w, **fusion.attrs)
        need[fusion.steps[-1]] = max(need.get(fusion.steps[-1], 0), sizing.high)
    return need
