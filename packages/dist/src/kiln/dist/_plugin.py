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

hookimpl = pluggy.HookimplMarker("kiln")


@hookimpl
def kiln_register_ops(registry: Any) -> None:
    for opdef in OPS:
        registry.register_op(opdef)


@hookimpl
def kiln_register_communicators(registry: Any) -> None:
    registry.register("local", LocalCommunicator())
    if mpi_available():
        registry.register("mpi", MpiCommunicator())
    if nccl_available():
        registry.register("nccl", NcclCommunicator())
