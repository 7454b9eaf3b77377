"""The ``cuda`` backend: one device allocation per arena, each Program step a launch of its CUDA kernel.

It implements kiln-core's Backend and Executable protocols over a *device*: :class:`CudaDevice` (a GPU
through the driver API) or :class:`EmulatedDevice` (the same kernels on the CPU, for tests). An op
without a CUDA kernel runs its NumPy reference on the host (``reference = True``): its inputs are copied
to the host and its results back, visible in the Program as a step whose ``kernel`` is "" (the op's
reference). Everything else stays on the device; the host reads only the gradient norm each step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from kiln.core import PHASES, KilnError, Program, Step, counter_offset, get_registry
from kiln.core.runtime import optimizer_step
from kiln.cuda._ops import DeviceArray


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
    capabilities: frozenset[str] = frozenset()
    kernel_fallback: str | None = None
    reference = True  # ops without a CUDA kernel run their NumPy reference on the host

    def __init__(self, device: Any = None) -> None:
        self._device = device

    @property
    def gpu(self) -> Any:
        """The device it runs on, opened on first use."""
        if self._device is None:
            from kiln.cuda._device import CudaDevice

            self._device = CudaDevice()
        return self._device

    def allocate(self, nbytes: int) -> DeviceBuffer:
        """A zeroed arena, freed when the last Executable or Model holding it lets go of it."""
        buffer = DeviceBuffer(self.gpu, self.gpu.alloc(nbytes), nbytes)
        weakref.finalize(buffer, self.gpu.free, buffer.ptr)
        return buffer

    def copy(self, src: DeviceBuffer, dst: DeviceBuffer, nbytes: int) -> None:
        self.gpu.copy(dst.ptr, src.ptr, nbytes)

    def read(self, buffer: DeviceBuffer, offset: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        self.gpu.synchronize()
        return self.gpu.copy_to_host(buffer.ptr + offset, n).view(dt).reshape(shape)

    def write(self, buffer: DeviceBuffer, offset: int, value: np.ndarray) -> None:
        self.gpu.copy_to_device(buffer.ptr + offset, value)

    def compile(self, program: Program, buffer: DeviceBuffer, kernels: Any) -> CudaExecutable:
        return CudaExecutable(self, program, buffer, kernels)


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

    def allocate(self, nbytes: int) -> Any:
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
        self.arrays = {k: DeviceArray(self.dev, arena.ptr + t.offset, tuple(t.shape), t.dtype)
                       for k, t in program.tensors.items()}
        self.hyper: dict[str, Any] = {"step": 1, "lr": 0.0, "scale": 1.0, "grad_norm": 0.0,
                                      "optimizer": program.optimizer}
        self.runs: dict[str, list[Callable[[], None]]] = {}
        for step in program.steps:
            fn = self._closure(step)
            if fn is not None:
                self.runs.setdefault(step.phase, []).append(fn)

    def run(self, phases: Iterable[str] = PHASES, *,
            hyper: Mapping[str, Any] | None = None) -> dict[str, float]:
        self.hyper.update(hyper or {})
        for phase in phases:
            for fn in self.runs.get(phase, ()):
                fn()
        return {k: float(self.hyper[k]) for k in ("grad_norm", "lr", "scale")}

    def read(self, name: str) -> np.ndarray:
        a = self.arrays[name]
        self.dev.synchronize()
        return self.dev.copy_to_host(a.ptr, a.nbytes).view(a.dtype).reshape(a.shape)

    def write(self, name: str, value: Any) -> None:
        a = self.arrays[name]
        self.dev.copy_to_device(a.ptr, np.asarray(value).astype(a.dtype).reshape(a.shape))

    def _closure(self, step: Step) -> Callable[[], None] | None:
        ins = [self.arrays[k] if k else None for k in step.inputs]
        outs = [self.arrays[k] if k else None for k in step.outputs]
        kw = dict(step.attrs)
        if step.how == "alias":
            return None
        if step.how == "copy":
            src, dst = ins[0], outs[0]
            assert src is not None and dst is not None
            return lambda: self.dev.copy(dst.ptr, src.ptr, dst.nbytes)
        if not step.kernel:
            return self._host_closure(step, ins, outs, kw)
        kernel = self.kernels[step.kernel].fn
        if step.how == "optimizer":
            return optimizer_step(step.op.type, kernel, [a for a in ins if a is not None], self.hyper, kw)
        return lambda: kernel(*ins, out=outs, **kw)

    def _host_closure(self, step: Step, ins: Sequence[DeviceArray | None], outs: Sequence[DeviceArray | None],
                      kw: dict[str, Any]) -> Callable[[], None]:
        """An op without a CUDA kernel: its reference kernel on host copies of its inputs."""
        opdef = self.ops.get_op(step.op.type)
        where = f"step {step.index} ({step.op.type}, on the host)"
        dev, hyper = self.dev, self.hyper

        def host(a: DeviceArray | None) -> np.ndarray | None:
            return None if a is None else dev.copy_to_host(a.ptr, a.nbytes).view(a.dtype).reshape(a.shape)

        def run() -> None:
            dev.synchronize()
            attrs_ = dict(kw)
            if opdef.random and "offset" in attrs_:  # the NumPy backend's counters, so masks agree
                attrs_["offset"] = counter_offset(int(attrs_["offset"]), step.layer or 0, int(hyper["step"]))
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
