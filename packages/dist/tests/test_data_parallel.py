"""Data parallelism and ZeRO-1 on two MPI ranks against one process training on the whole global
batch (``_worker.py`` runs both)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.core import KilnError, Model, PluginSession, get_registry
from kiln.dist import DataParallel, launch

pytest.importorskip("kiln.dsl", reason="the tiny model is built with kiln-dsl")

HERE = Path(__file__).parent
if "kiln_dist_worker" not in sys.modules:  # tests run in importlib mode: load the worker by path
    _spec = importlib.util.spec_from_file_location("kiln_dist_worker", HERE / "_worker.py")
    assert _spec is not None and _spec.loader is not None
    sys.modules["kiln_dist_worker"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["kiln_dist_worker"])
worker = sys.modules["kiln_dist_worker"]


@pytest.fixture(scope="module")
def one_process() -> tuple[dict[str, np.ndarray], np.ndarray]:
    model, stats = worker.train(None)
    return model.parameters(), stats


#: ranks of the multi-rank runs: 2 in the default test run, 4 in ``nox -s dist``
RANKS = int(os.environ.get("KILN_DIST_RANKS", "2"))


def ranks(tmp_path: Path, zero: int, micro_batches: int) -> list[Any]:
    status = launch(RANKS, [str(HERE / "_worker.py"), str(tmp_path), "mpi", str(zero), str(micro_batches)],
                    env={"KILN_NUM_THREADS": "1"})
    assert status == 0
    return [np.load(tmp_path / f"rank{r}.npz") for r in range(RANKS)]


def assert_same_training(rank: Any, params: dict[str, np.ndarray], stats: np.ndarray) -> None:
    """Losses and gradient norms (whose scale AdamW's update would hide) to 1e-6, weights after 20
    steps to 1e-5 of their norm: float32 rounding of sums taken in another order."""
    np.testing.assert_allclose(rank["stats"], stats, rtol=1e-6)
    for k, v in params.items():
        assert np.linalg.norm(rank[f"param:{k}"] - v) <= 1e-5 * np.linalg.norm(v), k


def test_data_parallel_on_two_ranks_equals_one_process(tmp_path: Path, one_process: Any) -> None:
    params, stats = one_process
    for rank in ranks(tmp_path, zero=0, micro_batches=1):
        assert_same_training(rank, params, stats)
        assert set(rank["collectives"]) == {"bucket_all_reduce"} and len(rank["collectives"]) > 1
    if RANKS == 2:  # each rank's half is one process's micro-batch: a + b either way, bit for bit
        model, mb_stats = worker.train(None, micro_batches=2)
        assert (rank["stats"] == mb_stats).all()
        assert all((rank[f"param:{k}"] == v).all() for k, v in model.parameters().items())


def test_zero1_on_two_ranks_equals_one_process_with_half_the_optimizer_state(tmp_path: Path,
                                                                           one_process: Any) -> None:
    params, stats = one_process
    both = ranks(tmp_path, zero=1, micro_batches=2)
    for rank in both:
        assert_same_training(rank, params, stats)
        kinds = list(rank["collectives"])
        assert kinds[-1] == "bucket_all_gather"
        assert {"bucket_reduce_scatter", "sharded_grad_norm"} <= set(kinds)
    full = worker.train(None)[0].memory_report(worker.BATCH, worker.SEQ)["optimizer_state"]
    shares = [int(rank["state_bytes"]) for rank in both]
    # greedy by size: a share exceeds 1/RANKS by less than the largest tensor's state (AdamW: 2 x)
    biggest = 2 * max(v.nbytes for v in params.values())
    assert sum(shares) == full and max(shares) <= full / RANKS + biggest, (shares, full)
    if RANKS == 2:
        assert max(shares) <= 0.51 * full


class ThirdOfThree:
    name, rank, world_size = "third", 2, 3


def test_a_global_batch_the_ranks_do_not_divide_is_refused() -> None:
    with PluginSession().activate():
        get_registry("communicators").register("third", ThirdOfThree())
        bundle = worker.build_bundle(worker.Qwen3Model, worker.CONFIG)
        model = Model.from_ir(bundle, data_parallel=DataParallel("third"))
        with pytest.raises(KilnError, match=r"times the 3 data-parallel ranks .* dividing the batch of 8"):
            model.train_step(worker.batches()[0])
