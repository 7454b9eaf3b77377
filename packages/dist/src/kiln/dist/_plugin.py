"""The ``kiln`` entry point of kiln-dist: its hook implementations, found by kiln's plugin manager."""

from __future__ import annotations

from typing import Any

import pluggy

from kiln.dist._communicators import (
    LocalCommunicator,
    MpiCommunicator,
    NcclCommunicator,
    mpi_available,
    nccl_available,
)
from kiln.dist._ops import OPS
from kiln.dist._tensor import TP_OPS, tensor_parallel
from kiln.dist._vocab import VOCAB_OPS

hookimpl = pluggy.HookimplMarker("kiln")


@hookimpl
def kiln_register_ops(registry: Any) -> None:
    for opdef in (*OPS, *TP_OPS, *VOCAB_OPS):
        registry.register_op(opdef)


@hookimpl
def kiln_register_kernels(registry: Any) -> None:
    """The bucket collectives and tensor parallelism's ops on the ``cuda`` backend (kiln-kernels-cuda):
    device buffers through a communicator that takes them (``nccl``), host copies through another."""
    from kiln.dist._cuda import CUDA_KERNELS, CUDA_TP_KERNELS

    for op, fn in CUDA_KERNELS:
        registry.register_kernel(op, "cuda", "*", fn)
    for op, fn in CUDA_TP_KERNELS:  # tensor parallelism's: float32 (bf16 runs the host path)
        registry.register_kernel(op, "cuda", "float32", fn, out=True)


@hookimpl
def kiln_register_graph_passes(registry: Any) -> None:
    from kiln.core import GraphPass

    registry.register("tensor_parallel", GraphPass("tensor_parallel", tensor_parallel, stage="shard",
                                                   doc="Megatron-LM tensor parallelism of the blocks and the "
                                                       "vocabulary: {'communicator': 'mpi'}"))


@hookimpl
def kiln_register_communicators(registry: Any) -> None:
    registry.register("local", LocalCommunicator())
    if mpi_available():
        registry.register("mpi", MpiCommunicator())
    if nccl_available():
        registry.register("nccl", NcclCommunicator())
