"""The communicators kiln-dist registers: ``local`` (one process), ``mpi`` (mpi4py on NumPy
buffers) and ``nccl`` (nccl4py on device buffers). Each is created cheaply; the MPI world and the
NCCL communicator start on first use."""

from __future__ import annotations

import functools
import importlib.util
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.core import KilnError
from kiln.dist._launch import note_collective, note_stop, ranks_behind, timeout

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["LocalCommunicator", "MpiCommunicator", "NcclCommunicator", "bind_gpu", "local_rank",
           "mpi_available", "nccl_available"]


def mpi_available() -> bool:
    """Whether mpi4py is installed (kiln-dist depends on it and on the ``mpich`` wheel)."""
    return importlib.util.find_spec("mpi4py") is not None


def nccl_available() -> bool:
    """Whether nccl4py is installed (``pip install 'kiln-dist[nccl]'``, on a machine with GPUs)."""
    return importlib.util.find_spec("nccl") is not None


def local_rank(comm: Any = None) -> int:
    """This rank's index among the ranks of its node (MPI's shared-memory split of ``comm``, the world
    by default)."""
    from mpi4py import MPI

    world = comm if comm is not None else MPI.COMM_WORLD
    return int(world.Split_type(MPI.COMM_TYPE_SHARED).Get_rank())


@functools.cache
def node_rank() -> int:
    """This process's index among the ranks of the MPI job on its node: what the launcher says
    (MPICH's ``MPI_LOCALRANKID``, Open MPI's ``OMPI_COMM_WORLD_LOCAL_RANK``), else MPI's
    shared-memory split of the world (a collective: every rank asks once, at its first parallel
    Model on a GPU backend)."""
    import os

    for name in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return local_rank()


def rank_device(comm: Any, backend: Any) -> int | None:
    """The device of ``backend`` a rank of ``comm`` trains on: its node-local rank's GPU, counted
    among the GPUs the process sees (so one GPU left visible by :func:`bind_gpu` is every rank's
    GPU 0); None where ``comm`` has no ranks on nodes (``local``, a planning stand-in)."""
    local = getattr(comm, "local_rank", None)
    if local is None:
        return None
    count = int(getattr(backend, "device_count", 0) or 0)
    return int(local) % count if count else int(local)


def bind_gpu() -> str:
    """Optional: show this rank only its GPU, the one of its node-local rank: ``CUDA_VISIBLE_DEVICES``
    set to that GPU (of the list already there, as Slurm sets it, else of the node's GPUs). Not
    needed for kiln: a parallel Model on the ``cuda`` backend and the ``nccl`` communicator already
    take that GPU; it keeps other CUDA libraries of the process on it too. Call it before anything
    starts CUDA. Returns the value set."""
    import os

    rank = local_rank()
    listed = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    chosen = listed[rank % len(listed)] if listed else str(rank)
    os.environ["CUDA_VISIBLE_DEVICES"] = chosen
    return chosen


def gpu_count() -> int:
    """The GPUs this process sees (``CUDA_VISIBLE_DEVICES`` applies); 0 without a driver."""
    from cuda.bindings import driver

    driver.cuInit(0)
    _, count = driver.cuDeviceGetCount()
    return int(count)


def use_gpu(index: int) -> None:
    """Make GPU ``index`` the process's current device (where NCCL makes its communicator)."""
    from cuda.core import Device

    Device(index).set_current()


class Done:
    """A collective that finished when it was started: waiting does nothing."""

    def wait(self) -> None:
        """Nothing to wait for."""


class Pending:
    """An MPI collective in flight on ``buf`` (kept alive until then: MPI writes into it): :meth:`wait`
    returns once it is done (or names the ranks that never reached it, past ``KILN_DIST_TIMEOUT``)."""

    def __init__(self, comm: MpiCommunicator, request: Any, what: str, buf: Any) -> None:
        self.comm, self.request, self.what, self.buf = comm, request, what, buf

    def wait(self) -> None:
        self.comm._wait(self.request, self.what)


def _check_chunks(op: str, send: Any, recv: Any, world: int, whole: Any) -> None:
    """``whole`` (``send`` or ``recv``) must hold ``world`` chunks the size of the other buffer."""
    part = recv if whole is send else send
    if whole.size != world * part.size or send.dtype != recv.dtype:
        raise KilnError(f"{op}: the buffers are {send.dtype} of {send.size} (send) and {recv.dtype} of "
                        f"{recv.size} (recv) elements; expected one dtype and {world} equal chunks")


class LocalCommunicator:
    """One process, rank 0 of 1: a reduction leaves its buffer as it is, a gather copies."""

    name = "local"
    rank = 0
    world_size = 1

    def all_reduce(self, buf: Any) -> None:
        """The sum over one rank is the buffer itself."""

    def all_reduce_start(self, buf: Any) -> Done:
        """The sum over one rank, done at once."""
        return Done()

    def reduce_scatter(self, send: Any, recv: Any) -> None:
        _check_chunks("reduce_scatter", send, recv, 1, send)
        recv[...] = send.reshape(recv.shape)

    def reduce_scatter_start(self, send: Any, recv: Any) -> Done:
        """The reduce-scatter over one rank, done at once."""
        self.reduce_scatter(send, recv)
        return Done()

    def all_gather(self, send: Any, recv: Any) -> None:
        _check_chunks("all_gather", send, recv, 1, recv)
        recv[...] = send.reshape(recv.shape)

    def broadcast(self, buf: Any, root: int = 0) -> None:
        if root != 0:
            raise KilnError(f"broadcast from rank {root}: the local communicator has rank 0 only")

    def barrier(self) -> None:
        """Nothing to wait for."""


class MpiCommunicator:
    """The ranks of an MPI job (``MPI.COMM_WORLD`` unless ``comm`` is given), collectives on NumPy
    arrays (contiguous, of one dtype on every rank) through mpi4py's buffer interface."""

    name = "mpi"

    def __init__(self, comm: MPI.Comm | None = None) -> None:
        self._comm = comm

    @property
    def comm(self) -> MPI.Comm:
        """The MPI communicator; importing mpi4py initialises MPI (a lone process is a world of 1)."""
        if self._comm is None:
            from mpi4py import MPI

            from kiln.dist._launch import note_rank

            self._comm = MPI.COMM_WORLD
            note_rank(int(self._comm.Get_rank()))
        return self._comm

    @property
    def rank(self) -> int:
        return int(self.comm.Get_rank())

    @property
    def local_rank(self) -> int:
        """This process's index among the job's ranks on its node (:func:`node_rank`)."""
        return node_rank()

    @property
    def world_size(self) -> int:
        return int(self.comm.Get_size())

    def all_reduce(self, buf: Any) -> None:
        from mpi4py import MPI

        self._wait(self.comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM), "an all-reduce")

    def all_reduce_start(self, buf: Any) -> Pending:
        """Start summing ``buf`` over the ranks, in place, and return at once: ``buf`` holds the sum
        after the returned handle's ``wait()``, and must not be touched before it."""
        from mpi4py import MPI

        return Pending(self, self.comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM), "an all-reduce", buf)

    def reduce_scatter(self, send: Any, recv: Any) -> None:
        from mpi4py import MPI

        _check_chunks("reduce_scatter", send, recv, self.world_size, send)
        self._wait(self.comm.Ireduce_scatter_block(send, recv, op=MPI.SUM), "a reduce-scatter")

    def reduce_scatter_start(self, send: Any, recv: Any) -> Pending:
        """Start the reduce-scatter of ``send`` into ``recv`` and return at once: ``recv`` holds this
        rank's chunk of the sum after the returned handle's ``wait()``; neither buffer may be touched
        before it."""
        from mpi4py import MPI

        _check_chunks("reduce_scatter", send, recv, self.world_size, send)
        return Pending(self, self.comm.Ireduce_scatter_block(send, recv, op=MPI.SUM), "a reduce-scatter",
                       (send, recv))

    def all_gather(self, send: Any, recv: Any) -> None:
        _check_chunks("all_gather", send, recv, self.world_size, recv)
        self._wait(self.comm.Iallgather(send, recv), "an all-gather")

    def broadcast(self, buf: Any, root: int = 0) -> None:
        self._wait(self.comm.Ibcast(buf, root=root), "a broadcast")

    def barrier(self) -> None:
        self._wait(self.comm.Ibarrier(), "a barrier")

    def _wait(self, request: Any, what: str) -> None:
        """Wait for a collective; past :func:`timeout` seconds, name the ranks that did not reach it
        (as far as their notes in the launch's rank folder tell) and abort the whole job."""
        number = note_collective()
        if request.Test():
            return
        limit, start, pause = timeout(), time.monotonic(), 0.0
        while not request.Test():
            waited = time.monotonic() - start
            if waited > limit:  # the ranks' notes are by their rank in the job (this may be a group)
                from mpi4py import MPI

                behind = ranks_behind(number, MPI.COMM_WORLD.Get_size())
                who = (f"rank(s) {', '.join(map(str, behind))} did not reach it (hung, or too slow)"
                       if behind else "the rank(s) that did not reach it are unknown (start the job with "
                                      "kiln.dist.launch to have them named)")
                rank = MPI.COMM_WORLD.Get_rank()
                note_stop(f"kiln: rank {rank}: {what} waited {waited:.0f} s for the other ranks "
                          f"(KILN_DIST_TIMEOUT = {limit:g}); {who}; stopping the job")
                self.comm.Abort(1)
            time.sleep(pause)
            pause = min(0.001, pause + 1e-5)  # spin first: most collectives finish in microseconds


class NcclCommunicator:
    """NCCL across the ranks of an MPI job, one GPU per rank (:attr:`device`: the rank's node-local
    GPU), on device arrays (anything nccl4py takes: DLPack or CUDA array interface). Rank 0 makes the
    NCCL unique id and broadcasts it over MPI when the first collective runs. Host NumPy arrays (a
    step's loss) go through MPI. A device collective runs on ``stream`` (a CUDA stream handle; the
    ``cuda`` backend passes its communication stream), else on the device's default stream."""

    name = "nccl"
    #: the collective ops' kernels on the ``cuda`` backend hand it device buffers (kiln.dist._cuda)
    device_buffers = True

    def __init__(self, mpi: MpiCommunicator | None = None) -> None:
        self.mpi = mpi or MpiCommunicator()
        self._nccl: Any = None

    @property
    def rank(self) -> int:
        return self.mpi.rank

    @property
    def world_size(self) -> int:
        return self.mpi.world_size

    @property
    def local_rank(self) -> int:
        """This process's index among the job's ranks on its node."""
        return self.mpi.local_rank

    @property
    def device(self) -> int:
        """The GPU (among those the process sees) NCCL runs on: the node-local rank's, as a parallel
        Model on the ``cuda`` backend picks it (:func:`rank_device`)."""
        return self.local_rank % max(1, gpu_count())

    @property
    def nccl(self) -> Any:
        """The nccl4py communicator of this rank's GPU, made on first use: rank 0 of :attr:`mpi` (the
        world, or a group's MPI sub-communicator, :func:`kiln.dist.grid`) makes the unique id and
        broadcasts it over it, so each group's NCCL communicator joins that group's ranks alone."""
        if self._nccl is None:
            from nccl import core as nccl

            use_gpu(self.device)
            uid = bytearray(bytes(nccl.get_unique_id() if self.rank == 0 else nccl.get_unique_id(empty=True)))
            self.mpi.broadcast(np.frombuffer(uid, np.uint8))
            self._nccl = nccl.Communicator.init(self.world_size, self.rank, nccl.UniqueId.from_bytes(uid))
        return self._nccl

    def all_reduce(self, buf: Any, *, stream: Any = None) -> None:
        if isinstance(buf, np.ndarray):
            self.mpi.all_reduce(buf)
            return
        from nccl import core as nccl

        self.nccl.allreduce(buf, buf, nccl.SUM, stream=stream)

    def reduce_scatter(self, send: Any, recv: Any, *, stream: Any = None) -> None:
        if isinstance(send, np.ndarray):
            self.mpi.reduce_scatter(send, recv)
            return
        from nccl import core as nccl

        _check_chunks("reduce_scatter", send, recv, self.world_size, send)
        self.nccl.reduce_scatter(send, recv, nccl.SUM, stream=stream)

    def all_gather(self, send: Any, recv: Any, *, stream: Any = None) -> None:
        if isinstance(send, np.ndarray):
            self.mpi.all_gather(send, recv)
            return
        _check_chunks("all_gather", send, recv, self.world_size, recv)
        self.nccl.allgather(send, recv, stream=stream)

    def broadcast(self, buf: Any, root: int = 0, *, stream: Any = None) -> None:
        if isinstance(buf, np.ndarray):
            self.mpi.broadcast(buf, root)
            return
        self.nccl.broadcast(buf, buf, root, stream=stream)

    def barrier(self) -> None:
        self.mpi.barrier()
