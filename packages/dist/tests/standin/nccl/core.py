"""nccl4py's ``nccl.core`` as far as kiln-dist uses it, without a GPU: a unique id says which world rank
made it; ``Communicator.init`` joins the ranks given the same id (an MPI split of the world, which
every rank of the job enters in the same order) and checks that ``nranks`` and ``rank`` are what that
group is, as NCCL would hang or fail otherwise; collectives run by MPI on the host memory a buffer's
``__cuda_array_interface__`` points at."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
from mpi4py import MPI

SUM = "sum"
SIZE = 128  # bytes of an NCCL unique id
#: every id this process made, and every communicator it joined: (nranks, rank, id's maker, its number)
MADE: list[bytes] = []
JOINED: list[tuple[int, int, int, int]] = []


class UniqueId:
    def __init__(self, raw: bytes) -> None:
        self.raw = bytes(raw).ljust(SIZE, b"\0")

    @classmethod
    def from_bytes(cls, raw: Any) -> UniqueId:
        return cls(bytes(raw))

    def __bytes__(self) -> bytes:
        return self.raw

    def maker(self) -> tuple[int, int]:
        """The world rank that made it and its number among that rank's ids."""
        rank, number = self.raw.rstrip(b"\0").decode().split(":")
        return int(rank), int(number)


def get_unique_id(empty: bool = False) -> UniqueId:
    if empty:
        return UniqueId(b"")
    uid = UniqueId(f"{MPI.COMM_WORLD.Get_rank()}:{len(MADE)}".encode())
    MADE.append(uid.raw)
    return uid


def _view(buf: Any) -> np.ndarray:
    face = buf.__cuda_array_interface__
    dtype = np.dtype(face["typestr"])
    n = int(np.prod(face["shape"]))
    raw = (ctypes.c_char * (n * dtype.itemsize)).from_address(face["data"][0])
    return np.frombuffer(raw, dtype)


class Communicator:
    def __init__(self, comm: Any, nranks: int, rank: int) -> None:
        self.comm, self.nranks, self.rank = comm, nranks, rank

    @classmethod
    def init(cls, nranks: int, rank: int, unique_id: UniqueId) -> Communicator:
        maker, number = unique_id.maker()
        comm = MPI.COMM_WORLD.Split(maker * 1000 + number, MPI.COMM_WORLD.Get_rank())
        if (comm.Get_size(), comm.Get_rank()) != (nranks, rank):
            raise RuntimeError(f"ncclCommInitRank: rank {rank} of {nranks} given, but {comm.Get_size()} "
                               f"ranks share the id (this one is rank {comm.Get_rank()} of them)")
        JOINED.append((nranks, rank, maker, number))
        return cls(comm, nranks, rank)

    def allreduce(self, send: Any, recv: Any, op: str, stream: Any = None) -> None:
        assert op == SUM
        out = _view(recv)
        self.comm.Allreduce(MPI.IN_PLACE if send is recv else _view(send).copy(), out, op=MPI.SUM)

    def allgather(self, send: Any, recv: Any, stream: Any = None) -> None:
        """Each rank's ``send`` in rank order into ``recv`` (nccl4py: ``recv`` is ``nranks`` times
        ``send``)."""
        self.comm.Allgather(_view(send).copy(), _view(recv))

    def reduce_scatter(self, send: Any, recv: Any, op: str, stream: Any = None) -> None:
        assert op == SUM
        self.comm.Reduce_scatter_block(_view(send).copy(), _view(recv), op=MPI.SUM)
