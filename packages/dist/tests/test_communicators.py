"""The communicators kiln-dist registers: ``local`` in-process, ``mpi`` across two ranks started by
``kiln.dist.launch`` (MPICH's mpiexec from the ``mpich`` wheel), ``nccl`` where nccl4py and GPUs are."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.core import KilnError, get_registry
from kiln.core.runtime import Communicator
from kiln.dist import DataParallel, LocalCommunicator, launch, launched, launcher, nccl_available

HERE = Path(__file__).parent
ENV = {"KILN_NUM_THREADS": "1"}


def test_the_plugin_registers_local_and_mpi_and_nccl_only_with_nccl4py() -> None:
    registry = get_registry("communicators")
    assert {"local", "mpi"} <= set(registry)
    assert ("nccl" in registry) == nccl_available()
    assert all(isinstance(registry[name], Communicator) for name in registry)
    assert registry.owner("mpi").distribution == "kiln-dist"


def test_local_is_one_rank() -> None:
    comm = LocalCommunicator()
    buf = np.arange(4.0)
    comm.all_reduce(buf)
    comm.broadcast(buf)
    comm.barrier()
    recv = np.empty(4)
    comm.reduce_scatter(buf * 2, recv)
    assert (comm.rank, comm.world_size) == (0, 1) and buf.tolist() == [0, 1, 2, 3]
    assert recv.tolist() == [0, 2, 4, 6]
    comm.all_gather(buf + 1, recv)
    assert recv.tolist() == [1, 2, 3, 4]


def test_local_names_the_buffers_that_do_not_fit() -> None:
    with pytest.raises(KilnError, match=r"reduce_scatter: .* float64 of 4 \(send\) and float64 of 3"):
        LocalCommunicator().reduce_scatter(np.zeros(4), np.zeros(3))
    with pytest.raises(KilnError, match="rank 0 only"):
        LocalCommunicator().broadcast(np.zeros(1), root=1)


def test_mpi_collectives_across_two_ranks(tmp_path: Path) -> None:
    assert launch(2, [str(HERE / "_collectives.py"), str(tmp_path)], env=ENV) == 0
    for rank in range(2):
        got = np.load(tmp_path / f"rank{rank}.npz")
        assert got["world"] == 2 and got["launched"]
        assert got["summed"].tolist() == (np.arange(6) * 3).tolist()  # rank 0's x 1 + rank 1's x 2
        assert got["scattered"].tolist() == [2 * (3 * rank + i) + 10 for i in range(3)]  # chunk `rank`
        assert got["gathered"].tolist() == [0, 0, 1, 1]
        assert got["cast"].tolist() == [1] * 4  # from the last rank


def test_launch_reports_a_failing_rank_and_checks_its_arguments(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ.get('PMI_RANK') == '1' else 0)\n")
    assert launch(2, [str(script)]) != 0
    with pytest.raises(KilnError, match="nproc=0"):
        launch(0, [str(script)])
    assert Path(launcher()).name == "mpiexec" and not launched()


@pytest.mark.skipif(nccl_available(), reason="nccl4py is installed here")
def test_asking_for_nccl_without_nccl4py_says_what_to_install() -> None:
    with pytest.raises(KilnError, match=r"no communicator 'nccl' is registered: it needs nccl4py"):
        DataParallel("nccl").communicator  # noqa: B018

