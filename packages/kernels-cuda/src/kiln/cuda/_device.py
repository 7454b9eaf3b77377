"""Finding a CUDA device without hanging, and the device kiln's CUDA backend runs on.

Detection loads ``libcuda.so.1`` with ctypes and asks the driver for its devices through that handle
alone; cuda-python is imported only once a device is known to exist (a failed module load without a
driver leaves cuda-python's next driver call hanging).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
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


def _check(result: Any, what: str) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err):
        raise KilnError(f"CUDA: {what} failed with {err!r}")
    return rest[0] if len(rest) == 1 else rest


class CudaDevice:
    """One GPU through the driver API: its primary context, the default stream, one module per kernel
    source compiled to CUBIN for its architecture (``kiln.cuda._nvrtc``, cached on disk)."""

    name = "cuda"

    def __init__(self, ordinal: int = 0) -> None:
        ok, why = device_status()
        if not ok:
            raise KilnError(f"backend 'cuda' is unavailable: {why}")
        from cuda.bindings import driver

        self.driver = driver
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
        self._modules: dict[str, Any] = {}
        self._functions: dict[str, Any] = {}

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
        _check(self.driver.cuLaunchKernel(self.function(name), *g, *b, 0, 0, packed.address, 0),
               f"launching {name}")

    def alloc(self, nbytes: int) -> int:
        ptr = _check(self.driver.cuMemAlloc(max(nbytes, 1)), "cuMemAlloc")
        self.memset(int(ptr), 0, nbytes)
        return int(ptr)

    def free(self, ptr: int) -> None:
        _check(self.driver.cuMemFree(ptr), "cuMemFree")

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        if nbytes:
            _check(self.driver.cuMemsetD8(ptr, value, nbytes), "cuMemsetD8")

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
            _check(self.driver.cuMemcpyDtoD(dst, src, nbytes), "cuMemcpyDtoD")

    def synchronize(self) -> None:
        _check(self.driver.cuCtxSynchronize(), "cuCtxSynchronize")
