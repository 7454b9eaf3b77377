"""A device that runs kiln's CUDA kernels on the CPU: the same ``.cu`` sources, built with g++ behind
``emulate/emu.h`` (each CUDA thread a fiber, ``__syncthreads`` and warp shuffles as barriers), memory in
host arrays whose addresses stand for device pointers. It proves the kernels' indexing, blocking and
synchronisation, and the launch code's packing and geometry, on a machine without a GPU; speed means
nothing here.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kiln.core import KilnError, hookimpl
from kiln.cuda._nvrtc import cache_dir, source_hash
from kiln.cuda._specs import KERNEL_DIR, SPECS, pack, spec

HEADER = Path(__file__).parent / "emulate" / "emu.h"
_FLAGS = ("-std=c++20", "-O1", "-fPIC", "-shared", "-w")


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++")


def build(file: str, *, kernel_dir: Path = KERNEL_DIR, cache: Path | None = None) -> ctypes.CDLL:
    """The emulation library of one kernel source: ``emu_launch_<kernel>`` and ``emu_sizes_<kernel>`` per
    kernel of that file in the spec table (built with g++ once per source, header and flags)."""
    cxx = compiler()
    if cxx is None:
        raise KilnError("the CUDA emulator needs a C++20 compiler: install g++ (or set CXX)")
    src = kernel_dir / file
    names = sorted(n for n, s in SPECS.items() if s.file == file and s.emulated)
    wrapper = [f'#include "{HEADER}"', f'#include "{src}"']
    for n in names:
        wrapper += [f'extern "C" int emu_launch_{n}(const unsigned* g, void** a) {{',
                    f'    return emu::run({n}, g, a);', '}',
                    f'extern "C" void emu_sizes_{n}(int* out) {{ emu::sizes({n}, out); }}']
    text = "\n".join(wrapper) + "\n"
    key = hashlib.sha256("\0".join([source_hash(src, kernel_dir), HEADER.read_text(), text, cxx, *_FLAGS])
                         .encode()).hexdigest()[:24]
    lib = (cache or cache_dir() / "emulated") / f"{src.stem}-{key}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        cpp = lib.with_suffix(".cpp")
        cpp.write_text(text)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        done = subprocess.run([cxx, *_FLAGS, f"-I{kernel_dir}", "-o", str(tmp), str(cpp)],
                              capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise KilnError(f"g++ could not build the emulation of {file}:\n{done.stderr[-4000:]}")
        tmp.replace(lib)
    return ctypes.CDLL(str(lib))


class EmulatedDevice:
    """The device protocol of :class:`kiln.cuda.CudaBackend` on the CPU."""

    name = "emulated"
    arch = "emulated"

    def __init__(self, *, kernel_dir: Path = KERNEL_DIR, cache: Path | None = None) -> None:
        self.kernel_dir, self.cache = kernel_dir, cache
        self._libs: dict[str, ctypes.CDLL] = {}
        self._memory: dict[int, np.ndarray] = {}
        self.launches = self.allocs = 0
        self.workspace: Any = None  # the kernels' workspace, reserved by the backend
        self._tape: list[Callable[[], None]] | None = None
        #: the copy stream: its copies wait here, run as late as the stream order allows (when the compute
        #: stream waits on an event recorded after them, or at a synchronisation), so a missing wait shows
        #: as data copied too late
        self._copies: list[Callable[[], None]] = []
        self._events: dict[int, int] = {}  # event -> the copies queued before it was recorded on "copy"
        self._ran = 0  # copies of the queue run so far

    # CUDA graphs: what a stream capture records, replayed

    def capture(self, body: Callable[[], None]) -> Callable[[], None]:
        """Records the launches, memsets and device copies ``body`` makes instead of running them (as a
        stream capture does) and returns their replay. What a CUDA graph cannot hold (an allocation, a
        free, a copy to or from the host, a synchronisation) is a ``KilnError``."""
        tape: list[Callable[[], None]] = []
        self._tape = tape
        try:
            body()
        finally:
            self._tape = None

        def replay() -> None:
            for op in tape:
                op()

        return replay

    def _not_captured(self, what: str) -> None:
        if self._tape is not None:
            raise KilnError(f"{what} while capturing a CUDA graph: a graph holds only kernel launches, "
                            "memsets and device-to-device copies")

    def library(self, file: str) -> ctypes.CDLL:
        if file not in self._libs:
            self._libs[file] = build(file, kernel_dir=self.kernel_dir, cache=self.cache)
        return self._libs[file]

    # memory: host arrays, their addresses as device pointers

    def alloc(self, nbytes: int) -> int:
        self._not_captured("an allocation")
        self.allocs += 1
        block = np.zeros(max(nbytes, 1) + 256, np.uint8)
        ptr = -(-block.ctypes.data // 256) * 256  # device allocations are 256-byte aligned
        self._memory[ptr] = block
        return ptr

    def free(self, ptr: int) -> None:
        self._not_captured("a free")
        self._memory.pop(ptr, None)

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        if self._tape is not None:
            self._tape.append(lambda: ctypes.memset(ptr, value, nbytes))
            return
        ctypes.memset(ptr, value, nbytes)

    def copy_to_device(self, ptr: int, value: np.ndarray) -> None:
        self._not_captured("a copy from the host")
        value = np.ascontiguousarray(value)
        ctypes.memmove(ptr, value.ctypes.data, value.nbytes)

    def copy_to_host(self, ptr: int, nbytes: int) -> np.ndarray:
        self._not_captured("a copy to the host")
        out = np.empty(nbytes, np.uint8)
        ctypes.memmove(out.ctypes.data, ptr, nbytes)
        return out

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        if self._tape is not None:
            self._tape.append(lambda: ctypes.memmove(dst, src, nbytes))
            return
        ctypes.memmove(dst, src, nbytes)

    def synchronize(self) -> None:
        self._not_captured("a synchronisation")
        self._flush(len(self._copies))

    # the copy stream and events (host offload): kernels run at once (the compute stream), copies later

    def alloc_host(self, nbytes: int) -> int:
        """Pinned host memory on a GPU; here host memory like every allocation."""
        return self.alloc(nbytes)

    def free_host(self, ptr: int) -> None:
        self.free(ptr)

    def event(self) -> int:
        event = len(self._events) + 1
        self._events[event] = -1
        return event

    def record(self, event: int, stream: str) -> None:
        """Marks ``event`` on ``stream`` ("compute" or "copy") after what was queued on it so far."""
        self._not_captured("an event on the copy stream")
        self._events[event] = len(self._copies) if stream == "copy" else -1

    def wait(self, stream: str, event: int) -> None:
        """``stream`` waits for ``event``: the compute stream for copies queued before it (run now); the
        copy stream for compute work before it (already done: the compute stream runs at once)."""
        at = self._events.get(event, -1)
        if stream == "compute" and at >= 0:
            self._flush(at)

    def copy_async(self, dst: int, src: int, nbytes: int, stream: str = "copy") -> None:
        self._not_captured("a copy to or from the host")
        if stream != "copy":
            self.copy(dst, src, nbytes)
            return
        self._copies.append(lambda: ctypes.memmove(dst, src, nbytes))

    def _flush(self, upto: int) -> None:
        while self._ran < upto:
            self._copies[self._ran]()
            self._ran += 1

    def launch(self, name: str, grid: Sequence[int], block: Sequence[int], args: Sequence[object]) -> None:
        kernel = spec(name)
        if not kernel.emulated:
            raise KilnError(f"kernel {name!r} runs on tensor cores, on a GPU only; the emulator runs its "
                            "SIMT twin")
        packed = pack(name, args)  # the arguments' values now, as cuLaunchKernel copies them
        geom = (ctypes.c_uint * 6)(*_dim3(grid), *_dim3(block))
        fn = getattr(self.library(kernel.file), f"emu_launch_{name}")
        if self._tape is not None:
            self._tape.append(lambda: self._check_launch(name, grid, block, fn(geom, packed.array)))
            return
        self._check_launch(name, grid, block, fn(geom, packed.array))

    def _check_launch(self, name: str, grid: Sequence[int], block: Sequence[int], rc: int) -> None:
        self.launches += 1
        if rc == 1:
            raise KilnError(f"kernel {name!r}: a barrier that not every thread reaches (deadlock) "
                            f"with grid {tuple(grid)}, block {tuple(block)}")
        if rc:
            raise KilnError(f"kernel {name!r}: block {tuple(block)} has no or too many threads")

    def param_sizes(self, name: str) -> list[int]:
        """``sizeof`` of each parameter of kernel ``name`` as g++ compiled it."""
        n = len(spec(name).params)
        out = (ctypes.c_int * max(n, 1))()
        getattr(self.library(spec(name).file), f"emu_sizes_{name}")(out)
        return list(out[:n])


def _dim3(d: Sequence[int]) -> tuple[int, int, int]:
    x = (*d, 1, 1, 1)
    return int(x[0]), int(x[1]), int(x[2])


class EmulatedCuda:
    """A plugin: kiln's CUDA kernels and the backend ``cuda`` over :class:`EmulatedDevice`, to run the
    backend without a GPU (register it in a ``PluginSession(autoload=False)``, where the installed
    plugin's own ``cuda`` is not loaded). Kernels of the ops in ``without`` are left out: those ops run
    their NumPy reference on the host."""

    def __init__(self, device: EmulatedDevice | None = None, *, without: Sequence[str] = ()) -> None:
        self.device, self.without = device or EmulatedDevice(), frozenset(without)

    @hookimpl
    def kiln_register_backends(self, registry: Any) -> None:
        from kiln.cuda._backend import CudaBackend

        registry.register("cuda", CudaBackend(self.device))

    @hookimpl
    def kiln_register_kernels(self, registry: Any) -> None:
        from kiln.cuda._plugin import register_kernels

        register_kernels(registry, without=self.without)
