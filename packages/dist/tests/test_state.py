"""State dicts that do not depend on the number of ranks: a tensor-parallel or ZeRO-1 run on two
ranks saved half-way and resumed in one process (and the reverse) trains as one process does."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from kiln.dist import launch, shard, unshard

pytest.importorskip("kiln.dsl", reason="the tiny model is built with kiln-dsl")

HERE = Path(__file__).parent
if "kiln_dist_state_worker" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("kiln_dist_state_worker", HERE / "_state_worker.py")
    assert _spec is not None and _spec.loader is not None
    sys.modules["kiln_dist_state_worker"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["kiln_dist_state_worker"])
worker = sys.modules["kiln_dist_state_worker"]


@pytest.fixture(scope="module")
def one_process() -> tuple[list[float], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The losses of every step, and the whole state after SPLIT steps and after the last."""
    m = worker.model(None)
    first = worker.train(m, worker.batches()[:worker.SPLIT])
    half = worker.as_arrays(m.state_dict())
    rest = worker.train(m, worker.batches()[worker.SPLIT:])
    return first + rest, half, worker.as_arrays(m.state_dict())


def run(tmp_path: Path, kind: str, start: str) -> list[dict[str, np.ndarray]]:
    assert launch(2, [str(HERE / "_state_worker.py"), str(tmp_path), kind, start],
                  env={"KILN_NUM_THREADS": "1"}) == 0
    return [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(2)]


def assert_state(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) - {"losses"} == set(want)
    for k, v in want.items():  # float64: equal but for the order of the sums
        np.testing.assert_allclose(got[k], v, rtol=1e-8, atol=1e-12, err_msg=k)


@pytest.mark.parametrize("kind", ["tp", "zero"])
def test_a_two_rank_run_saved_half_way_resumes_in_one_process(tmp_path: Path, kind: str, one_process) -> None:
    losses, half, _ = one_process
    for rank in run(tmp_path, kind, "seed"):  # each rank's whole state is one process's
        np.testing.assert_allclose(rank["losses"], losses[:worker.SPLIT], rtol=1e-6)
        assert_state(rank, half)
    m = worker.model(None)  # rank 0's state goes on in one process
    m.load_state_dict(worker.from_arrays(rank))
    rest = worker.train(m, worker.batches()[worker.SPLIT:])
    np.testing.assert_allclose(rest, losses[worker.SPLIT:], rtol=1e-6)


@pytest.mark.parametrize("kind", ["tp", "zero"])
def test_a_one_process_state_resumes_on_two_ranks(tmp_path: Path, kind: str, one_process) -> None:
    losses, half, end = one_process
    np.savez(tmp_path / "start.npz", **half)
    for rank in run(tmp_path, kind, "load"):
        np.testing.assert_allclose(rank["losses"], losses[worker.SPLIT:], rtol=1e-6)
        assert_state(rank, end)


def test_unshard_puts_every_rank_slice_back() -> None:
    bundle = worker.build_bundle("Qwen3Model", worker.CONFIG)
    whole = worker.model(None).parameters()
    for world in (1, 2, 4):
        parts = [shard(whole, bundle, r, world) for r in range(world)]
        np.testing.assert_equal(unshard(parts, bundle), whole)
