"""The collective ops' kernels on the ``cuda`` backend, on kiln-kernels-cuda's emulated device (its
memory is host memory whose addresses stand for device pointers): a communicator that takes device
buffers (as ``nccl`` does) gets one flat device buffer per bucket, never a host array, and the
gradients and parameters end as the NumPy reference leaves them; any other communicator runs the
reference on host copies. A stand-in communicator plays this rank and another rank whose buffers
are derived from this rank's, so the sums are known without a second process."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.core import PluginSession, get_registry
from kiln.dist import launcher
from kiln.dist._cuda import (
    CudaBuffer,
    cuda_bucket_all_gather,
    cuda_bucket_all_reduce,
    cuda_bucket_reduce_scatter,
)
from kiln.dist._ops import bucket_all_gather, bucket_all_reduce, bucket_reduce_scatter

pytest.importorskip("kiln.cuda", reason="the cuda backend is kiln-kernels-cuda's")
from kiln.cuda import EmulatedDevice
from kiln.cuda._ops import DeviceArray


def _view(buf: Any) -> np.ndarray:
    """A NumPy view of a host array or of an emulated device buffer (its address is host memory)."""
    if isinstance(buf, np.ndarray):
        return buf
    assert isinstance(buf, CudaBuffer) and buf.__cuda_array_interface__["data"][0] == buf.ptr
    raw = (ctypes.c_char * buf.nbytes).from_address(buf.ptr)
    return np.frombuffer(raw, buf.dtype)


class Pair:
    """Rank ``rank`` of two; the other rank's buffers are this rank's times 3 (sums) or plus 100
    (gathers). ``got`` records the type of every buffer handed to a collective."""

    name, world_size = "pair", 2

    def __init__(self, rank: int, device_buffers: bool) -> None:
        self.rank, self.device_buffers, self.got = rank, device_buffers, []

    def all_reduce(self, buf: Any) -> None:
        self.got.append(type(buf))
        v = _view(buf)
        v += 3 * v

    def reduce_scatter(self, send: Any, recv: Any) -> None:
        self.got += [type(send), type(recv)]
        s, r = _view(send), _view(recv)
        chunk = r.size
        r[...] = 4 * s[self.rank * chunk:(self.rank + 1) * chunk]

    def all_gather(self, send: Any, recv: Any) -> None:
        self.got += [type(send), type(recv)]
        s, r = _view(send), _view(recv)
        chunk = s.size
        for q in range(2):
            r[q * chunk:(q + 1) * chunk] = s if q == self.rank else s + 100

    def broadcast(self, buf: Any, root: int = 0) -> None: ...
    def barrier(self) -> None: ...


SHAPES = [(3, 4), (5,), (2, 2, 2)]
OWNERS = (1, 0, 1)


def _tensors(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def _on_device(dev: EmulatedDevice, arrays: list[np.ndarray]) -> list[DeviceArray]:
    out = []
    for a in arrays:
        ptr = dev.alloc(a.nbytes)
        dev.copy_to_device(ptr, a)
        out.append(DeviceArray(dev, ptr, a.shape, str(a.dtype)))
    return out


def _read(dev: EmulatedDevice, arrays: list[DeviceArray]) -> list[np.ndarray]:
    return [dev.copy_to_host(a.ptr, a.nbytes).view(a.dtype).reshape(a.shape) for a in arrays]


CASES = [(cuda_bucket_all_reduce, bucket_all_reduce, {}),
         (cuda_bucket_reduce_scatter, bucket_reduce_scatter, {"owners": OWNERS}),
         (cuda_bucket_all_gather, bucket_all_gather, {"owners": OWNERS})]


@pytest.mark.parametrize("device_buffers", [True, False], ids=["device-buffers", "host-copies"])
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize(("kernel", "reference", "attrs"), CASES,
                         ids=["all_reduce", "reduce_scatter", "all_gather"])
def test_bucket_collectives_on_the_cuda_backend_leave_what_the_reference_leaves(
        kernel: Any, reference: Any, attrs: dict[str, Any], rank: int, device_buffers: bool) -> None:
    with PluginSession().activate():
        comm = Pair(rank, device_buffers)
        get_registry("communicators").register("pair", comm)
        host = _tensors(rank)
        expected = [a.copy() for a in host]
        reference(*expected, communicator="pair", **attrs)  # the NumPy reference, on host arrays
        dev = EmulatedDevice()
        arrays = _on_device(dev, host)
        comm.got.clear()
        kernel(*arrays, communicator="pair", step=1, lr=0.0, scale=1.0, **attrs)  # as a Program calls it
        for got, want in zip(_read(dev, arrays), expected, strict=True):
            np.testing.assert_array_equal(got, want)
        assert any(not np.array_equal(g, h) for g, h in zip(expected, host, strict=True))  # it did something
        # one collective per bucket, on device buffers only where the communicator takes them
        assert comm.got and set(comm.got) == ({CudaBuffer} if device_buffers else {np.ndarray})


def test_a_bucket_of_bf16_gradients_goes_through_host_copies() -> None:
    """A dtype a device collective does not take as it is (bfloat16) runs the reference on host
    copies, even where the communicator takes device buffers."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    with PluginSession().activate():
        comm = Pair(0, device_buffers=True)
        get_registry("communicators").register("pair", comm)
        host = [a.astype(ml_dtypes.bfloat16) for a in _tensors(0)]
        dev = EmulatedDevice()
        arrays = []
        for a in host:
            ptr = dev.alloc(a.nbytes)
            dev.copy_to_device(ptr, a)
            arrays.append(DeviceArray(dev, ptr, a.shape, "bfloat16"))
        cuda_bucket_all_reduce(*arrays, communicator="pair")
        got = [dev.copy_to_host(a.ptr, a.nbytes).view(ml_dtypes.bfloat16).reshape(a.shape) for a in arrays]
        for g, h in zip(got, host, strict=True):
            np.testing.assert_array_equal(g.astype(np.float32), 4 * h.astype(np.float32))
        assert set(comm.got) == {np.ndarray}


def test_the_cuda_backend_runs_these_kernels_for_the_bucket_ops() -> None:
    with PluginSession().activate():
        kernels = get_registry("kernels")
        for op, fn in (("bucket_all_reduce", cuda_bucket_all_reduce),
                       ("bucket_reduce_scatter", cuda_bucket_reduce_scatter),
                       ("bucket_all_gather", cuda_bucket_all_gather)):
            for dtype in ("float32", "bfloat16"):
                found = kernels.find(op, "cuda", dtype)
                assert found is not None and found.fn is fn, (op, dtype)
        assert kernels.find("bucket_all_reduce_start", "cuda", "float32") is None  # the host path


BIND = """
import os, sys
from kiln.dist import bind_gpu
from mpi4py import MPI
chosen = bind_gpu()
with open(os.path.join(sys.argv[1], f"rank{MPI.COMM_WORLD.Get_rank()}"), "w") as f:
    f.write(chosen + " " + os.environ["CUDA_VISIBLE_DEVICES"])
"""


@pytest.mark.parametrize(("visible", "expected"),
                         [(None, ["0", "1"]), ("5,7", ["5", "7"]), ("3", ["3", "3"])])
def test_bind_gpu_gives_each_rank_of_a_node_its_own_gpu(tmp_path: Path, visible: str | None,
                                                        expected: list[str]) -> None:
    """Two ranks on this node: each sees one GPU, the one of its node-local rank (of the list Slurm
    gives, where it gives one); no GPU is needed to check it."""
    script = tmp_path / "bind.py"
    script.write_text(BIND)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    done = subprocess.run([launcher(), "-n", "2", sys.executable, str(script), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == [f"{e} {e}" for e in expected]
