"""``Model.backward_from_logits`` under tensor parallelism: each rank holds a slice of the vocabulary's
logits (and of every block), so a seed of the whole logits is refused with an error naming the pass;
under data parallelism (no pass) it runs as on one process."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.core import KilnError, Model, PluginSession, get_registry
from kiln.dist import DataParallel, PlanRank, TensorParallel

dsl = pytest.importorskip("kiln.dsl", reason="the Qwen3 model comes from kiln-dsl")
from kiln.dsl.stdlib.models import Qwen3Model  # noqa: E402

CONFIG = {"vocab_size": 64, "d_model": 32, "n_layers": 1, "num_query_heads": 4, "num_kv_heads": 2,
          "head_size": 8, "d_ff": 64, "max_seq": 16}


@pytest.mark.parametrize("tied", [False, True], ids=["lm-head", "tied-head"])
def test_backward_from_logits_is_refused_under_tensor_parallelism(tied: bool) -> None:
    bundle = dsl.build_bundle(Qwen3Model, {**CONFIG, "tie_word_embeddings": tied})
    ids = np.arange(16).reshape(2, 8) % 64
    d_logits = np.ones((2, 8, 64), np.float32)
    with PluginSession().activate():
        get_registry("communicators").register("rank1", PlanRank("rank1", 1, 2))
        for parallel in ({"parallel": TensorParallel("rank1")},
                         {"data_parallel": TensorParallel("rank1"),  # the older spelling
                          "passes": [("tensor_parallel", {"communicator": "rank1"})]}):
            model = Model.from_ir(bundle, init=None, **parallel)
            with pytest.raises(KilnError, match=r"backward_from_logits: the graph pass 'tensor_parallel' "
                                                r"\(stage 'shard'\) splits the model over ranks") as info:
                model.backward_from_logits(ids, d_logits)
            assert "data parallelism" in str(info.value.hint)


def test_backward_from_logits_under_data_parallelism_is_one_process_backward() -> None:
    """No pass splits a data-parallel model: each rank's backward of its own logits' seed, as one
    process's (no gradient synchronisation either way)."""
    bundle = dsl.build_bundle(Qwen3Model, CONFIG)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 64, (2, 8))
    d_logits = rng.standard_normal((2, 8, 64)).astype(np.float32)
    with PluginSession().activate():
        get_registry("communicators").register("rank1", PlanRank("rank1", 1, 2))
        alone = Model.from_ir(bundle, seed=0)
        rank = Model.from_ir(bundle, seed=0, parallel=DataParallel("rank1"))
        for m in (alone, rank):
            m.backward_from_logits(ids, d_logits)
        want, got = alone.gradients(), rank.gradients()
        assert want.keys() == got.keys() and any(np.abs(g).max() > 0 for g in want.values())
        for k, v in want.items():
            np.testing.assert_array_equal(got[k], v)
