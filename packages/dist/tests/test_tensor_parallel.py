"""Tensor parallelism on two MPI ranks against one process training the whole model, gradient
clipping included (the norm is the whole model's)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from kiln.core import KilnError, Model, PluginSession, get_registry
from kiln.dist import launch, shard

pytest.importorskip("kiln.dsl", reason="the tiny model is built with kiln-dsl")

HERE = Path(__file__).parent
if "kiln_dist_tp_worker" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("kiln_dist_tp_worker", HERE / "_tp_worker.py")
    assert _spec is not None and _spec.loader is not None
    sys.modules["kiln_dist_tp_worker"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["kiln_dist_tp_worker"])
worker = sys.modules["kiln_dist_tp_worker"]


@pytest.mark.parametrize("name", ["Qwen3Model", "Qwen3MoEModel"])
def test_two_tensor_parallel_ranks_train_as_one_process(tmp_path: Path, name: str) -> None:
    full, losses = worker.train(None, name)
    assert launch(2, [str(HERE / "_tp_worker.py"), str(tmp_path), name], env={"KILN_NUM_THREADS": "1"}) == 0
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    bundle = worker.build_bundle(name, worker.MODELS[name])
    expected = [shard(full.parameters(), bundle, r, 2) for r in range(2)]
    for rank, want in zip(ranks, expected, strict=True):
        np.testing.assert_allclose(rank["stats"], losses, rtol=1e-10)  # losses and clipped-by norms
        for k, v in want.items():  # float64: equal but for the order of the sums
            np.testing.assert_allclose(rank[f"param:{k}"], v, rtol=1e-8, atol=1e-10, err_msg=k)
    # the sharded layers' weights: half on each rank (norms, embedding and head stay whole)
    sharded = ("qkv_weight", "out_weight", "mlp_up_weight", "mlp_down_weight", "experts_gate_up",
               "experts_down")
    whole = sum(v.nbytes for k, v in full.parameters().items() if k.endswith(sharded))
    for rank in ranks:
        assert sum(rank[f"param:{k}"].nbytes for k in expected[0] if k.endswith(sharded)) == whole // 2


def test_a_grid_of_data_and_tensor_parallel_ranks_trains_as_one_process(tmp_path: Path) -> None:
    full, stats = worker.train(None, "Qwen3MoEModel")
    assert launch(4, [str(HERE / "_tp_worker.py"), str(tmp_path), "Qwen3MoEModel", "grid"],
                  env={"KILN_NUM_THREADS": "1"}) == 0
    bundle = worker.build_bundle("Qwen3MoEModel", worker.MODELS["Qwen3MoEModel"])
    for r in range(4):  # ranks 0, 1 hold slices 0, 1 and share the batch with ranks 2, 3
        rank, want = np.load(tmp_path / f"rank{r}.npz"), shard(full.parameters(), bundle, r % 2, 2)
        np.testing.assert_allclose(rank["stats"], stats, rtol=1e-10)
        for k, v in want.items():
            np.testing.assert_allclose(rank[f"param:{k}"], v, rtol=1e-8, atol=1e-10, err_msg=k)


class SecondOfThree:
    name, rank, world_size = "third", 1, 3


class FirstOfFour:
    name, rank, world_size = "fourth", 0, 4


def test_heads_the_ranks_cannot_share_are_refused() -> None:
    with PluginSession().activate():
        get_registry("communicators").register("third", SecondOfThree())
        bundle = worker.build_bundle("Qwen3Model", worker.CONFIG)
        with pytest.raises(KilnError, match="query heads = 4 is not a multiple of the 3 tensor-parallel"):
            Model.from_ir(bundle, passes=[("tensor_parallel", {"communicator": "third"})])


def test_kv_heads_the_ranks_cannot_share_are_refused() -> None:
    with PluginSession().activate():
        get_registry("communicators").register("fourth", FirstOfFour())  # 4 query heads, 2 KV heads
        bundle = worker.build_bundle("Qwen3Model", worker.CONFIG)
        with pytest.raises(KilnError, match=r"KV heads \(GQA\) = 2 is not a multiple of the 4 "):
            Model.from_ir(bundle, passes=[("tensor_parallel", {"communicator": "fourth"})])
