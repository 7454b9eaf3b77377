"""``grid(..., communicator="nccl")`` without GPUs: a stand-in for nccl4py (``standin/nccl``, its
collectives run by MPI on host memory) under 2 and 4 MPI ranks. Each ``nccl-tp`` / ``nccl-dp``
communicator joins the ranks of its group alone (NCCL's rank and size are the group's), from a unique
id that the group's first rank made and broadcast over the group's MPI sub-communicator (an id sent
over the world would join every rank: the stand-in refuses it), on the rank's node-local GPU; a sum
over each is the group's sum. Under ``nox -s dist`` (``KILN_DIST_RANKS``; half a minute), a tiny
Qwen3-MoE trains data x tensor parallel over that grid on the emulated ``cuda`` backend as one
process."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

from kiln.core import KilnError, PluginSession
from kiln.dist import grid, launch

HERE = Path(__file__).parent
#: the ranks import the stand-in for nccl4py
ENV = {"PYTHONPATH": os.pathsep.join(p for p in (str(HERE / "standin"), os.environ.get("PYTHONPATH")) if p),
       "KILN_NUM_THREADS": "1"}


@pytest.mark.parametrize(("ranks", "degree"), [(2, 2), (4, 2)], ids=["2-ranks-1x2", "4-ranks-2x2"])
def test_the_nccl_grid_joins_each_groups_ranks_from_an_id_sent_over_the_group(tmp_path: Path, ranks: int,
                                                                               degree: int) -> None:
    assert launch(ranks, [str(HERE / "_nccl_grid.py"), str(tmp_path), str(degree)], env=ENV) == 0
    got = [np.load(tmp_path / f"rank{r}.npz") for r in range(ranks)]
    for world, rank in enumerate(got):
        assert list(rank["names"]) == ["nccl-dp", "nccl-tp"]
        # groups of `degree` consecutive ranks (tp); the ranks holding the same slice (dp)
        tp = [r for r in range(ranks) if r // degree == world // degree]
        dp = [r for r in range(ranks) if r % degree == world % degree]
        for name, group in (("nccl-tp", tp), ("nccl-dp", dp)):
            mine, size, nccl_rank, nccl_size, maker, _, gpu, total = rank[name]
            assert (mine, size) == (group.index(world), len(group)), name
            assert (nccl_rank, nccl_size) == (mine, size), name  # NCCL's ranks are the group's
            assert maker == group[0], name  # the group's first rank made the id it joined
            assert gpu == world % 2, name  # the node-local rank's GPU (of 2)
            assert total == sum(r + 1 for r in group), name  # summed over the group alone
    # one id per group: the ranks of a group joined the same one, other groups another
    ids = {(name, tuple(rank[name][4:6])) for rank in got for name in ("nccl-tp", "nccl-dp")}
    assert len(ids) == ranks // degree + degree


def test_nccl_without_nccl4py_and_an_unknown_communicator_are_errors() -> None:
    with PluginSession().activate():
        with pytest.raises(KilnError, match="grid\\(communicator='nccl'\\) needs nccl4py"):
            grid(1, communicator="nccl")
        with pytest.raises(KilnError, match="grid\\(communicator='gloo'\\): expected 'mpi'"):
            grid(1, communicator="gloo")


def test_data_by_tensor_parallel_on_the_nccl_grid_on_emulated_cuda_equals_one_process(tmp_path: Path) -> None:
    """The gradient buckets (over ``nccl-dp``, 4 ranks), the clipping norm (over both) and tensor
    parallelism's ops (over ``nccl-tp``) as device collectives: one process's losses,
    clipped-by norms and weights (float32 sums in another order)."""
    if "KILN_DIST_RANKS" not in os.environ:
        pytest.skip("half a minute of emulated kernels on every rank: nox -s dist runs it")
    pytest.importorskip("kiln.cuda", reason="the cuda backend is kiln-kernels-cuda's")
    from kiln.cuda import EmulatedCuda
    from kiln.dist import _plugin

    ranks = 4 if int(os.environ["KILN_DIST_RANKS"]) >= 4 else 2
    assert launch(ranks, [str(HERE / "_nccl_grid.py"), str(tmp_path), "2", "train"], env=ENV) == 0
    spec = importlib.util.spec_from_file_location("kiln_dist_tp_worker_emulated", HERE / "_tp_worker.py")
    assert spec is not None and spec.loader is not None
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    session = PluginSession(autoload=False)
    session.register(_plugin, "kiln-dist")
    session.register(EmulatedCuda(), "cuda-emulated")
    with session.activate():
        full, stats = worker.train(None, "Qwen3MoEModel", backend="cuda")
    for r in range(ranks):
        rank = np.load(tmp_path / f"rank{r}.npz")
        np.testing.assert_allclose(rank["stats"], stats, rtol=1e-4)
        for k, v in full.parameters().items():
            assert np.linalg.norm(rank[f"param:{k}"] - v) <= 1e-4 * np.linalg.norm(v), k


PICK = """
import json, sys
from mpi4py import MPI
from kiln.core import PluginSession
from kiln.dist import _communicators
from kiln.hf._train import TrainConfig, _data_parallel

_communicators.gpu_count = lambda: 2
_communicators.use_gpu = lambda gpu: None
picked = []
for backend, tensor in (("cuda", 2), ("cuda:0", 1), ("numpy", 2), ("numpy", 1)):
    with PluginSession().activate():
        config = TrainConfig({"parallel": {"tensor": tensor, "ranks": None, "zero": False, "overlap": False},
                              "train": {"backend": backend, "mode": "full", "batch_size": 2}})
        par = _data_parallel(config)
        dp = getattr(par, "data_parallel", None)
        picked.append([backend, tensor, par.comm, None if dp is None else dp.comm])
if MPI.COMM_WORLD.Get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(picked, f)
"""


def test_kiln_train_picks_the_nccl_communicators_on_the_cuda_backend(tmp_path: Path) -> None:
    """``kiln train``'s ``[parallel]`` under 2 MPI ranks with nccl4py installed (the stand-in): a run on
    the ``cuda`` backend shares the batch over ``nccl`` and slices the model over the ``nccl`` grid; on
    ``numpy`` both stay MPI's."""
    pytest.importorskip("kiln.hf", reason="kiln train is kiln-hf's")
    import json

    script = tmp_path / "pick.py"
    script.write_text(PICK)
    assert launch(2, [str(script), str(tmp_path / "picked.json")], env=ENV) == 0
    assert json.loads((tmp_path / "picked.json").read_text()) == [
        ["cuda", 2, "nccl-tp", None], ["cuda:0", 1, "nccl", None],
        ["numpy", 2, "mpi-tp", None], ["numpy", 1, "mpi", None]]
