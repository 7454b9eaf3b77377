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


def ranks(tmp_path: Path, zero: int | str, micro_batches: int) -> list[Any]:
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


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_all_reduces_overlapped_with_the_backward_give_the_same_bits(tmp_path: Path,
                                                                     micro_batches: int) -> None:
    """Each bucket's all-reduce starts in the backward once its gradients are final and is waited
    for in grad_sync: the same sums as after the backward (with micro-batches, whose accumulated
    gradients change after the first start, the wait sums them again)."""
    (tmp_path / "plain").mkdir()
    (tmp_path / "overlap").mkdir()
    plain = ranks(tmp_path / "plain", zero=0, micro_batches=micro_batches)
    overlapped = ranks(tmp_path / "overlap", zero="overlap", micro_batches=micro_batches)
    for a, b in zip(plain, overlapped, strict=True):
        assert (a["stats"] == b["stats"]).all()
        assert all((a[k] == b[k]).all() for k in a.files if k.startswith("param:"))
        steps = list(zip(b["collectives"], b["phases"], strict=True))
        starts = [p for k, p in steps if k == "bucket_all_reduce_start"]
        waits = [p for k, p in steps if k == "bucket_all_reduce_wait"]
        assert len(starts) == len(waits) == len(a["collectives"]) > 1
        assert set(starts) == {"backward"} and set(waits) == {"grad_sync"}
        # the first buckets (the last layers' gradients) start while most of the backward is still to run
        left = list(b["backward_left"])
        assert left[0] > 10 and left == sorted(left, reverse=True)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_zero1_reduce_scatters_overlapped_with_the_backward_give_the_same_bits(tmp_path: Path,
                                                                             micro_batches: int) -> None:
    """ZeRO-1 with overlap=True: each bucket's reduce-scatter starts in the backward once its
    gradients are final and is waited for in grad_sync; the results are the plain ZeRO-1 run's bit
    for bit (with micro-batches too, whose accumulated gradients the wait reduce-scatters again)."""
    (tmp_path / "plain").mkdir()
    (tmp_path / "overlap").mkdir()
    plain = ranks(tmp_path / "plain", zero=1, micro_batches=micro_batches)
    overlapped = ranks(tmp_path / "overlap", zero="overlap1", micro_batches=micro_batches)
    for a, b in zip(plain, overlapped, strict=True):
        assert (a["stats"] == b["stats"]).all()
        assert all((a[k] == b[k]).all() for k in a.files if k.startswith("param:"))
        assert int(a["state_bytes"]) == int(b["state_bytes"])  # the same 1/N of the optimizer state
        steps = list(zip(b["collectives"], b["phases"], strict=True))
        starts = [p for k, p in steps if k == "bucket_reduce_scatter_start"]
        waits = [p for k, p in steps if k == "bucket_reduce_scatter_wait"]
        scatters = [k for k in a["collectives"] if k == "bucket_reduce_scatter"]
        assert len(starts) == len(waits) == len(scatters) > 1
        assert set(starts) == {"backward"} and set(waits) == {"grad_sync"}
        assert "bucket_reduce_scatter" not in set(b["collectives"])
        left = list(b["backward_left"])
        assert left[0] > 10 and left == sorted(left, reverse=True)


def test_overlapped_reduce_scatter_on_one_rank_and_its_attributes() -> None:
    """The local communicator's reduce-scatter completes when started; a wait without its start is
    an error naming the bucket (a KeyError would say nothing)."""
    from kiln.dist._ops import PENDING, bucket_reduce_scatter_start, bucket_reduce_scatter_wait

    with PluginSession().activate():
        grads = [np.arange(6.0).reshape(2, 3), np.ones(4)]
        want = [g.copy() for g in grads]
        bucket_reduce_scatter_start(*grads, communicator="local", owners=(0, 0), bucket=7)
        grads[1] += 1  # changed after the start: summed again, as it is now
        bucket_reduce_scatter_wait(*grads, communicator="local", owners=(0, 0), bucket=7)
        np.testing.assert_array_equal(grads[0], want[0])
        np.testing.assert_array_equal(grads[1], want[1] + 1)
        assert not PENDING
        with pytest.raises(KilnError, match=r"bucket_reduce_scatter_wait of bucket 7 over 'local': no "):
            bucket_reduce_scatter_wait(*grads, communicator="local", owners=(0, 0), bucket=7)


class ThirdOfThree:
    name, rank, world_size = "third", 2, 3


def test_a_global_batch_the_ranks_do_not_divide_is_refused() -> None:
    with PluginSession().activate():
        get_registry("communicators").register("third", ThirdOfThree())
        bundle = worker.build_bundle(worker.Qwen3Model, worker.CONFIG)
        model = Model.from_ir(bundle, data_parallel=DataParallel("third"))
        with pytest.raises(KilnError, match=r"times the 3 data-parallel ranks .* dividing the batch of 8"):
            model.train_step(worker.batches()[0])
