"""One rank of the NCCL grid test without GPUs (``standin/`` on ``PYTHONPATH`` stands for nccl4py):
``python _nccl_grid.py OUT DEGREE`` cuts the job with ``grid(DEGREE, communicator="nccl")``, sums a
"device" buffer (host memory behind the CUDA array interface) over each of ``nccl-tp`` and
``nccl-dp``, and writes to ``OUT/rank<r>.npz`` what each communicator is: its rank and size, NCCL's,
the id it was made from (which world rank made it), the GPU it took and the sum.

``python _nccl_grid.py OUT DEGREE train`` trains ``_tp_worker.py``'s tiny Qwen3-MoE data x tensor
parallel over that grid on kiln-kernels-cuda's emulated ``cuda`` backend (its memory is host memory,
which the stand-in's collectives read) and writes the losses and the gathered whole parameters."""

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


if __name__ == "__main__":
    if sys.argv[3:4] == ["train"]:
        train(sys.argv[1], int(sys.argv[2]))
    else:
        main(sys.argv[1], int(sys.argv[2]))
