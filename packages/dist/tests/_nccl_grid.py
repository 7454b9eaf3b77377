"""One rank of the NCCL grid test without GPUs (``standin/`` on ``PYTHONPATH`` stands for nccl4py):
``python _nccl_grid.py OUT DEGREE`` cuts the job with ``grid(DEGREE, communicator="nccl")``, sums a
"device" buffer (host memory behind the CUDA array interface) over each of ``nccl-tp`` and
``nccl-dp``, and writes to ``OUT/rank<r>.npz`` what each communicator is: its rank and size, NCCL's,
the id it was made from (which world rank made it), the GPU it took and the sum.

``python _nccl_grid.py OUT DEGREE train`` trains ``_tp_worker.py``'s tiny Qwen3-MoE data x tensor
parallel over that grid on kiln-kernels-cuda's emulated ``cuda`` backend (its memory is host memory,
which the stand-in's collectives read) and writes the losses and the gathered whole parameters.

``python _nccl_grid.py OUT DEGREE tp`` trains a tiny Qwen3 tensor parallel over ``nccl-tp`` alone, on
the emulated ``cuda`` backend, counting what tensor parallelism's kernels copy to the host."""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI
from nccl import core

from kiln.core import get_registry
from kiln.dist import _communicators, grid
from kiln.dist._cuda import CudaBuffer

GPUS = 2  # the GPUs each node pretends to have: ranks 0 and 2 share GPU 0 (of their own groups)
chosen: list[int] = []
_communicators.gpu_count = lambda: GPUS
_communicators.use_gpu = chosen.append


def main(out: str, degree: int) -> None:
    world = MPI.COMM_WORLD.Get_rank()
    dp, tp = grid(degree, backend="cuda")  # nccl: "installed" (the stand-in)
    found: dict[str, np.ndarray] = {"names": np.array([dp, tp])}
    for name in (tp, dp):  # every rank in the same order: the ids' broadcasts are collectives
        comm = get_registry("communicators")[name]
        host = np.full(3, world + 1.0, np.float32)
        comm.all_reduce(CudaBuffer(host.ctypes.data, host.size, "float32"))
        nranks, rank, maker, number = core.JOINED[-1]  # the NCCL communicator it just made
        found[name] = np.array([comm.rank, comm.world_size, rank, nranks, maker, number, chosen[-1],
                                host[0]])
    np.savez(f"{out}/rank{world}.npz", **found)


def train(out: str, degree: int) -> None:
    from pathlib import Path

    from kiln.core import PluginSession
    from kiln.cuda import EmulatedCuda
    from kiln.dist import DataParallel, TensorParallel, _plugin, gather_state

    sys.path.insert(0, str(Path(__file__).parent))
    import _tp_worker as worker

    session = PluginSession(autoload=False)
    session.register(_plugin, "kiln-dist")
    session.register(EmulatedCuda(), "cuda-emulated")
    with session.activate():
        dp, tp = grid(degree, backend="cuda")
        group = get_registry("communicators")[tp]
        model, stats = worker.train((group.rank, group.world_size), "Qwen3MoEModel",
                                    TensorParallel(tp, DataParallel(dp, bucket_bytes=4096)), "cuda")
        whole = gather_state(model)["parameters"]
        np.savez(f"{out}/rank{MPI.COMM_WORLD.Get_rank()}.npz", stats=np.array(stats),
                 **{f"param:{k}": v for k, v in whole.items()})


def tensor_parallel(out: str, degree: int) -> None:
    """A tiny Qwen3 tensor parallel over ``nccl-tp`` on the emulated ``cuda`` backend; besides its losses
    and gathered parameters, what tensor parallelism's kernels read back to the host (bytes: none, not
    even a token id or target) and how often they synchronised the device (never), how many ran, and
    what the group's collectives were handed."""
    from pathlib import Path
    from typing import Any

    from kiln.core import PluginSession
    from kiln.cuda import EmulatedCuda, EmulatedDevice
    from kiln.dist import TensorParallel, _cuda, _plugin, gather_state

    sys.path.insert(0, str(Path(__file__).parent))
    import _tp_worker as worker

    class Counting(EmulatedDevice):
        """Counts the bytes read back to the host, and the synchronisations, while a tensor-parallel
        kernel runs."""

        def __init__(self) -> None:
            super().__init__()
            self.active, self.activations, self.syncs = False, 0, 0

        def synchronize(self) -> None:
            self.syncs += self.active
            super().synchronize()

        def copy_to_host(self, ptr: int, nbytes: int) -> np.ndarray:
            if self.active:
                self.activations += nbytes
            return super().copy_to_host(ptr, nbytes)

    device, calls = Counting(), {}

    def counted(op: str, fn: Any) -> Any:
        def run(*args: Any, **kw: Any) -> None:
            device.active, calls[op] = True, calls.get(op, 0) + 1
            try:
                fn(*args, **kw)
            finally:
                device.active = False
        return run

    _cuda.CUDA_TP_KERNELS = tuple((op, counted(op, fn)) for op, fn in _cuda.CUDA_TP_KERNELS)
    session = PluginSession(autoload=False)
    session.register(_plugin, "kiln-dist")
    session.register(EmulatedCuda(device), "cuda-emulated")
    with session.activate():
        _, tp = grid(degree, backend="cuda")
        group = get_registry("communicators")[tp]
        handed: set[str] = set()
        def spying(fn: Any) -> Any:
            def spy(*args: Any, **kw: Any) -> Any:
                if device.active:  # in a tensor-parallel kernel (the step's loss and norm are others')
                    handed.add(type(args[0]).__name__)
                return fn(*args, **kw)
            return spy

        for name in ("all_reduce", "all_gather"):
            setattr(group, name, spying(getattr(group, name)))
        model, stats = worker.train((group.rank, group.world_size), "Qwen3Model", TensorParallel(tp), "cuda")
        whole = gather_state(model)["parameters"]
        np.savez(f"{out}/rank{MPI.COMM_WORLD.Get_rank()}.npz", stats=np.array(stats),
                 activations=device.activations, syncs=device.syncs, handed=np.array(sorted(handed)),
                 ops=np.array(sorted(calls)), **{f"param:{k}": v for k, v in whole.items()})


if __name__ == "__main__":
    if sys.argv[3:4] == ["tp"]:
        tensor_parallel(sys.argv[1], int(sys.argv[2]))
    elif sys.argv[3:4] == ["train"]:
        train(sys.argv[1], int(sys.argv[2]))
    else:
        main(sys.argv[1], int(sys.argv[2]))
