"""Finding a CUDA device without hanging, and the device kiln's CUDA backend runs on.

Detection loads ``libcuda.so.1`` with ctypes and asks the driver for its devices through that handle
alone; cuda-python is imported only once a device is known to exist (a failed module load without a
driver leaves cuda-python's next driver call hanging).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kiln.core import KilnError
from kiln.cuda._specs import pack, spec


@functools.cache
def device_status() -> tuple[bool, str]:
    """(True, "") when the driver loads and sees a device, else (False, why)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return False, f"the CUDA driver library libcuda.so.1 does not load ({e}): no NVIDIA driver here"
    rc = lib.cuInit(0)
    if rc:
        return False, f"the CUDA driver does not initialise (cuInit returned error {rc})"
    count = ctypes.c_int(0)
    rc = lib.cuDeviceGetCount(ctypes.byref(count))
    if rc or count.value == 0:
        return False, "the CUDA driver sees no GPU"
    return True, ""


def device_count() -> int:
    """The GPUs this process sees (``CUDA_VISIBLE_DEVICES`` applies), 0 without a driver or a GPU."""
    if not device_status()[0]:
        return 0
    count = ctypes.c_int(0)
    return count.value if not ctypes.CDLL("libcuda.so.1").cuDeviceGetCount(ctypes.byref(count)) else 0


def check_ordinal(ordinal: int, count: int) -> None:
    """A KilnError unless ``ordinal`` is one of the ``count`` GPUs this process sees."""
    if not isinstance(ordinal, int) or isinstance(ordinal, bool) or not 0 <= ordinal < count:
        seen = f"{count} GPU{'s' if count != 1 else ''} (cuda:0 to cuda:{count - 1})" if count else "no GPU"
        raise KilnError(f"backend 'cuda:{ordinal}': there is no GPU {ordinal!r}; this process sees {seen}",
                        hint="CUDA_VISIBLE_DEVICES sets which GPUs a process sees, renumbered from 0")


def _check(result: Any, what: str) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err):
        raise KilnError(f"CUDA: {what} failed with {err!r}")
    return rest[0] if len(rest) == 1 else rest


class CudaDevice:
    """GPU ``ordinal`` (of those this process sees) through the driver API: its primary context, the
    default stream, one module per kernel source compiled to CUBIN for its architecture
    (``kiln.cuda._nvrtc``, cached on disk)."""

    name = "cuda"

    def __init__(self, ordinal: int = 0) -> None:
        ok, why = device_status()
        if not ok:
            raise KilnError(f"backend 'cuda' is unavailable: {why}")
        check_ordinal(ordinal, device_count())
        from cuda.bindings import driver

        self.driver, self.ordinal = driver, ordinal
        _check(driver.cuInit(0), "cuInit")
        self.handle = _check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
        self.context = _check(driver.cuDevicePrimaryCtxRetain(self.handle), "cuDevicePrimaryCtxRetain")
        _check(driver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        attr = driver.CUdevice_attribute
        major = _check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                                                   self.handle), "cuDeviceGetAttribute")
        minor = _check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                                                   self.handle), "cuDeviceGetAttribute")
        self.arch = f"sm_{major}{minor}"
        #: every launch, memset and device copy goes to this stream (capturable, unlike the legacy default
        #: stream); host copies on the legacy stream wait for it (a blocking stream)
        self.stream = _check(driver.cuStreamCreate(0), "cuStreamCreate")
        #: host offload's copies (device <-> pinned host memory) overlap the kernels on a second stream,
        #: ordered with the compute stream by events
        self.copy_stream = _check(driver.cuStreamCreate(1), "cuStreamCreate")  # CU_STREAM_NON_BLOCKING
        self._comm_stream: Any = None  # a third stream, made when a collective first overlaps
        self.workspace: Any = None  # the kernels' workspace, reserved by the backend
        self._modules: dict[str, Any] = {}
        self._functions: dict[str, Any] = {}
        from kiln.cuda._blas import Blas, nvmath_installed

        #: cuBLASLt for matmuls when nvmath-python (with its cuBLAS libraries) loads, else None: the SIMT
        #: kernels, and ``blas_error`` says why
        self.blas: Blas | None = None
        self.blas_error = "nvmath-python is not installed (pip install kiln-kernels-cuda[blas])"
        if nvmath_installed():
            try:
                self.blas = Blas(self)
            except Exception as e:  # a missing cuBLAS library, an old driver: the SIMT kernels still run
                self.blas_error = f"cuBLASLt does not load: {e}"

    def function(self, name: str) -> Any:
        if name not in self._functions:
            from kiln.cuda._nvrtc import compile_cubin

            file = spec(name).file
            if file not in self._modules:
                cubin = compile_cubin(file, self.arch).cubin
                self._modules[file] = _check(self.driver.cuModuleLoadData(cubin), f"loading {file}")
            found = self.driver.cuModuleGetFunction(self._modules[file], name.encode())
            self._functions[name] = _check(found, f"finding kernel {name}")
        return self._functions[name]

    def launch(self, name: str, grid: Sequence[int], block: Sequence[int], args: Sequence[object]) -> None:
        packed = pack(name, args)
        g, b = (*grid, 1, 1)[:3], (*block, 1, 1)[:3]
        _check(self.driver.cuLaunchKernel(self.function(name), *g, *b, 0, self.stream, packed.address, 0),
               f"launching {name}")

    def capture(self, body: Callable[[], None]) -> Callable[[], None]:
        """``body``'s launches on the stream captured as a CUDA graph (not run); returns its replay."""
        d = self.driver
        mode = d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        _check(d.cuStreamBeginCapture(self.stream, mode), "cuStreamBeginCapture")
        try:
            body()
        except BaseException:
            d.cuStreamEndCapture(self.stream)
            raise
        graph = _check(d.cuStreamEndCapture(self.stream), "cuStreamEndCapture")
        executable = _check(d.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        return lambda: _check(d.cuGraphLaunch(executable, self.stream), "cuGraphLaunch")

    def alloc(self, nbytes: int) -> int:
        ptr = _check(self.driver.cuMemAlloc(max(nbytes, 1)), "cuMemAlloc")
        self.memset(int(ptr), 0, nbytes)
        return int(ptr)

    def free(self, ptr: int) -> None:
        _check(self.driver.cuMemFree(ptr), "cuMemFree")

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        if nbytes:
            _check(self.driver.cuMemsetD8Async(ptr, value, nbytes, self.stream), "cuMemsetD8Async")

    def copy_to_device(self, ptr: int, value: np.ndarray) -> None:
        value = np.ascontiguousarray(value)
        if value.nbytes:
            _check(self.driver.cuMemcpyHtoD(ptr, value.ctypes.data, value.nbytes), "cuMemcpyHtoD")

    def copy_to_host(self, ptr: int, nbytes: int) -> np.ndarray:
        out = np.empty(nbytes, np.uint8)
        if nbytes:
            _check(self.driver.cuMemcpyDtoH(out.ctypes.data, ptr, nbytes), "cuMemcpyDtoH")
        return out

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        if nbytes:
            _check(self.driver.cuMemcpyDtoDAsync(dst, src, nbytes, self.stream), "cuMemcpyDtoDAsync")

    def synchronize(self) -> None:
        _check(self.driver.cuCtxSynchronize(), "cuCtxSynchronize")

    # host offload: pinned host memory, the copy stream and events

    def alloc_host(self, nbytes: int) -> int:
        """Page-locked host memory (``cuMemHostAlloc``), so copies to and from it run asynchronously."""
        return int(_check(self.driver.cuMemHostAlloc(max(nbytes, 1), 0), "cuMemHostAlloc"))

    def free_host(self, ptr: int) -> None:
        _check(self.driver.cuMemFreeHost(ptr), "cuMemFreeHost")

    def _stream(self, name: str) -> Any:
        if name == "comm":
            if self._comm_stream is None:  # kiln-dist's collectives overlapped with the kernels
                self._comm_stream = _check(self.driver.cuStreamCreate(1), "cuStreamCreate")
            return self._comm_stream
        return self.copy_stream if name == "copy" else self.stream

    def stream_handle(self, name: str = "compute") -> int:
        """The ``CUstream`` of ``name`` (``compute``, ``copy``, ``comm``) as an integer, for a library that
        enqueues its own work (NCCL)."""
        return int(self._stream(name))

    def destroy(self, event: Any) -> None:
        _check(self.driver.cuEventDestroy(event), "cuEventDestroy")

    def event(self) -> Any:
        return _check(self.driver.cuEventCreate(2), "cuEventCreate")  # CU_EVENT_DISABLE_TIMING

    def record(self, event: Any, stream: str) -> None:
        _check(self.driver.cuEventRecord(event, self._stream(stream)), "cuEventRecord")

    def wait(self, stream: str, event: Any) -> None:
        _check(self.driver.cuStreamWaitEvent(self._stream(stream), event, 0), "cuStreamWaitEvent")

    def copy_async(self, dst: int, src: int, nbytes: int, stream: str = "copy") -> None:
        """A copy between device and pinned host memory (unified addressing) on ``stream``."""
        if nbytes:
            _check(self.driver.cuMemcpyAsync(dst, src, nbytes, self._stream(stream)), "cuMemcpyAsync")
