"""Tensor parallelism on two MPI ranks against one process training the whole model, gradient
clipping included (the norm is the whole model's)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.core import KilnError, Model, PluginSession, check_op, get_registry, op_registry
from kiln.dist import launch, shard

pytest.importorskip("kiln.dsl", reason="the tiny model is built with kiln-dsl")

HERE = Path(__file__).parent
if "kiln_dist_tp_worker" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("kiln_dist_tp_worker", HERE / "_tp_worker.py")
    assert _spec is not None and _spec.loader is not None
    sys.modules["kiln_dist_tp_worker"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["kiln_dist_tp_worker"])
worker = sys.modules["kiln_dist_tp_worker"]


@pytest.mark.parametrize("name", ["Qwen3Model", "Qwen3MoEModel", "Qwen3Model:tied", "Qwen3Model:bias",
                                  "Qwen3MoEModel:shared"])
def test_two_tensor_parallel_ranks_train_as_one_process(tmp_path: Path, name: str) -> None:
    full, losses = worker.train(None, name)
    assert launch(2, [str(HERE / "_tp_worker.py"), str(tmp_path), name], env={"KILN_NUM_THREADS": "1"}) == 0
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    expected = [shard(full.parameters(), worker.tiny(name), r, 2) for r in range(2)]
    ids = worker.batches()[0]["input_ids"]
    for rank, want in zip(ranks, expected, strict=True):
        np.testing.assert_allclose(rank["stats"], losses, rtol=1e-10)  # losses and clipped-by norms
        np.testing.assert_allclose(rank["logits"], full.logits(ids), rtol=1e-8, atol=1e-10)  # every rank
        for k, v in want.items():  # float64: equal but for the order of the sums
            np.testing.assert_allclose(rank[f"param:{k}"], v, rtol=1e-8, atol=1e-10, err_msg=k)
    # the sharded layers' weights, the embedding and the LM head: half on each rank (norms whole)
    sharded = ("qkv_weight", "qkv_bias", "out_weight", "mlp_up_weight", "mlp_down_weight", "experts_gate_up",
               "experts_down", "shared_up_weight", "shared_down_weight")
    for names in (sharded, ("embedding", "lm_head")):
        whole = sum(v.nbytes for k, v in full.parameters().items() if k.endswith(names))
        for rank in ranks:
            assert sum(rank[f"param:{k}"].nbytes for k in expected[0] if k.endswith(names)) == whole // 2
    # each rank's rows of the vocabulary are the whole model's
    vocab = full.parameters()["embedding"]
    for r, rank in enumerate(ranks):
        assert rank["param:embedding"].shape == (vocab.shape[0] // 2, vocab.shape[1])
        np.testing.assert_allclose(rank["param:embedding"], vocab[r * 32:(r + 1) * 32], rtol=1e-8, atol=1e-10)
    if name.endswith(":tied"):  # one matrix, split once
        assert "lm_head" not in full.parameters() and "param:lm_head" not in ranks[0]


def test_a_grid_of_data_and_tensor_parallel_ranks_trains_as_one_process(tmp_path: Path) -> None:
    full, stats = worker.train(None, "Qwen3MoEModel")
    assert launch(4, [str(HERE / "_tp_worker.py"), str(tmp_path), "Qwen3MoEModel", "grid"],
                  env={"KILN_NUM_THREADS": "1"}) == 0
    bundle = worker.tiny("Qwen3MoEModel")
    for r in range(4):  # ranks 0, 1 hold slices 0, 1 and share the batch with ranks 2, 3
        rank, want = np.load(tmp_path / f"rank{r}.npz"), shard(full.parameters(), bundle, r % 2, 2)
        np.testing.assert_allclose(rank["stats"], stats, rtol=1e-10)
        for k, v in want.items():
            np.testing.assert_allclose(rank[f"param:{k}"], v, rtol=1e-8, atol=1e-10, err_msg=k)


class SecondOfThree:
    name, rank, world_size = "third", 1, 3


class SecondOfTwo:
    name, rank, world_size = "second", 1, 2


def test_the_vocabulary_ops_on_one_rank_are_the_plain_ones_and_their_gradients_hold() -> None:
    registry = op_registry()
    rng = np.random.default_rng(0)
    x, w, t = rng.standard_normal((6, 4)), rng.standard_normal((11, 4)), np.array([3, -100, 10, 0, 7, 1])
    for softcap in (None, 2.0):
        got = registry["vocab_parallel_lm_head_loss"].run([x, w, t], {"communicator": "local",
                                                                      "softcap": softcap})
        np.testing.assert_allclose(got, registry["fused_lm_head_loss"].run([x, w, t], {"softcap": softcap}),
                                   rtol=1e-12)
    ids = np.array([[1, 4, 2], [2, 0, 10]])
    got = registry["vocab_parallel_embedding"].run([ids, w], {"communicator": "local"})
    np.testing.assert_array_equal(got, registry["embedding"].run([ids, w], {}))
    for name in ("vocab_parallel_embedding", "vocab_parallel_lm_head_loss"):  # float64 finite differences
        assert max(r.max_rel_error for r in check_op(registry[name], registry)) <= 1e-6


def test_rank_one_of_two_holds_the_upper_rows_of_the_vocabulary() -> None:
    """Forward of the embedding on rank 1 of 2 (no collective): its rows, zeros for the others."""
    with PluginSession().activate():
        get_registry("communicators").register("second", SecondOfTwo())
        w = np.arange(12.0).reshape(6, 2)  # rows 6..11 of a vocabulary of 12
        embed = op_registry()["vocab_parallel_embedding"]
        out = embed.run([np.array([0, 7, 11, 5]), w], {"communicator": "second"})
        np.testing.assert_array_equal(out[0], [[0, 0], w[1], w[5], [0, 0]])
        with pytest.raises(KilnError, match=r"index 12 is outside \[0, 12\)"):
            embed.run([np.array([12]), w], {"communicator": "second"})


@pytest.mark.parametrize("name", ["Qwen3Model:odd", "Qwen3Model:odd-tied"])
def test_a_vocabulary_the_ranks_cannot_share_is_padded_and_trains_as_one_process(tmp_path: Path,
                                                                                 name: str) -> None:
    """63 rows over 2 ranks: 32 each, rank 1's last a padding row (no probability, no gradient)."""
    full, losses = worker.train(None, name)
    assert launch(2, [str(HERE / "_tp_worker.py"), str(tmp_path), name], env={"KILN_NUM_THREADS": "1"}) == 0
    whole = full.parameters()
    assert whole["embedding"].shape == (63, 32)
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    logits = full.logits(worker.batches(63)[0]["input_ids"])
    assert logits.shape == (2, 8, 63)
    for r, rank in enumerate(ranks):
        np.testing.assert_allclose(rank["stats"], losses, rtol=1e-10)
        np.testing.assert_allclose(rank["logits"], logits, rtol=1e-8, atol=1e-10)  # gathered, padding dropped
        for k in [k for k in ("embedding", "lm_head") if k in whole]:
            got = rank[f"param:{k}"]
            assert got.shape == (32, 32)
            np.testing.assert_allclose(got[:32 if r == 0 else 31], whole[k][r * 32:(r + 1) * 32], rtol=1e-8,
                                       atol=1e-10, err_msg=k)
            if r == 1:  # the padding row: zeros it started as, no gradient since
                np.testing.assert_array_equal(got[31], 0)
    np.testing.assert_allclose(shard(whole, worker.tiny(name), 1, 2)["embedding"][31], 0)


def test_a_vocabulary_smaller_than_the_ranks_is_refused() -> None:
    with PluginSession().activate():
        get_registry("communicators").register("fourth", FirstOfFour())
        bundle = worker.build_bundle("Qwen3Model", {**worker.CONFIG, "vocab_size": 3, "num_kv_heads": 4})
        with pytest.raises(KilnError, match="vocab_size = 3 is smaller than the 4 tensor-parallel ranks"):
            Model.from_ir(bundle, passes=[("tensor_parallel", {"communicator": "fourth"})])


def test_the_padding_rows_of_the_lm_head_take_no_probability() -> None:
    """vocab_parallel_lm_head_loss with vocab_size = 9 on 11 rows: fused_lm_head_loss of the first 9."""
    registry = op_registry()
    rng = np.random.default_rng(1)
    x, w, t = rng.standard_normal((6, 4)), rng.standard_normal((11, 4)), np.array([3, -100, 8, 0, 7, 1])
    got = registry["vocab_parallel_lm_head_loss"].run([x, w, t], {"communicator": "local", "vocab_size": 9})
    np.testing.assert_allclose(got, registry["fused_lm_head_loss"].run([x, w[:9], t], {}), rtol=1e-12)
    with pytest.raises(KilnError, match=r"index 9 is outside \[0, 9\)"):
        registry["vocab_parallel_lm_head_loss"].run([x, w, np.array([9, 0, 0, 0, 0, 0])],
                                                    {"communicator": "local", "vocab_size": 9})


class FirstOfFour:
    name, rank, world_size = "fourth", 0, 4


def test_parallel_adds_the_tensor_parallel_pass_and_data_parallel_still_works() -> None:
    from kiln.dist import PlanRank, TensorParallel

    with PluginSession().activate():
        get_registry("communicators").register("half", PlanRank("half", 1, 2))
        bundle = worker.build_bundle("Qwen3Model", worker.CONFIG)
        model = Model.from_ir(bundle, init=None, parallel=TensorParallel("half"))
        assert model.passes == (("tensor_parallel", {"communicator": "half"}),)
        assert model.parameters()["embedding"].shape == (32, 32)  # rank 1's half of the vocabulary
        old = Model.from_ir(bundle, init=None, data_parallel=TensorParallel("half"))  # adds no pass
        assert old.passes == () and old.parameters()["embedding"].shape == (64, 32)
        with pytest.raises(KilnError, match="give parallel= or data_parallel="):
            Model.from_ir(bundle, parallel=TensorParallel("half"), data_parallel=TensorParallel("half"))


def test_heads_the_ranks_cannot_share_are_refused() -> None:
    with PluginSession().activate():
        get_registry("communicators").register("third", SecondOfThree())
        bundle = worker.build_bundle("Qwen3Model", {**worker.CONFIG, "vocab_size": 96})
        with pytest.raises(KilnError, match="query heads = 4 is not a multiple of the 3 tensor-parallel"):
            Model.from_ir(bundle, passes=[("tensor_parallel", {"communicator": "third"})])


def test_kv_heads_the_ranks_cannot_share_are_refused() -> None:
    with PluginSession().activate():
        get_registry("communicators").register("fourth", FirstOfFour())  # 4 query heads, 2 KV heads
        bundle = worker.build_bundle("Qwen3Model", worker.CONFIG)
        with pytest.raises(KilnError, match=r"KV heads \(GQA\) = 2 is not a multiple of the 4 "):
            Model.from_ir(bundle, passes=[("tensor_parallel", {"communicator": "fourth"})])


def test_a_custom_block_trains_on_two_ranks_as_its_shard_annotations_say(tmp_path: Path) -> None:
    """GatedMlp's gate, up and up_bias are @shard("column"), down @shard("row"); the model's LM head
    is @shard("replicated"): two ranks equal one process, and each holds what the annotations say."""
    full, losses = worker.train(None, "ShardedMlpLM")
    assert launch(2, [str(HERE / "_tp_worker.py"), str(tmp_path), "ShardedMlpLM"],
                  env={"KILN_NUM_THREADS": "1"}) == 0
    whole = full.parameters()
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    for r, rank in enumerate(ranks):
        np.testing.assert_allclose(rank["stats"], losses, rtol=1e-10)
        for layer in range(2):  # the rank's contiguous half of the features, cut here by hand
            p = f"blocks.{layer}."
            for k, cut in (("gate", np.s_[r * 12:(r + 1) * 12]), ("up", np.s_[r * 12:(r + 1) * 12]),
                           ("up_bias", np.s_[r * 12:(r + 1) * 12]), ("down", np.s_[:, r * 12:(r + 1) * 12]),
                           ("down_bias", np.s_[:]), ("norm", np.s_[:])):
                np.testing.assert_allclose(rank[f"param:{p}{k}"], whole[p + k][cut], rtol=1e-8, atol=1e-10,
                                           err_msg=p + k)
        np.testing.assert_allclose(rank["param:lm_head"], whole["lm_head"], rtol=1e-8, atol=1e-10)  # whole
        np.testing.assert_allclose(rank["param:embedding"], whole["embedding"][r * 32:(r + 1) * 32],
                                   rtol=1e-8, atol=1e-10)
    assert ranks[0]["param:lm_head"].shape == (64, 16) and ranks[0]["param:blocks.0.gate"].shape == (12, 16)


def _annotate(bundle: Any, module: str, shards: dict[str, dict[str, Any]]) -> Any:
    """``bundle`` with module ``module``'s @shard annotations replaced by ``shards`` (param: args)."""
    from kiln.core.ir import Annotation

    m = bundle.module(module)
    kept = tuple(a for a in m.annotations if a.kind != "shard")
    new = tuple(Annotation("shard", "param", k, args, loc=f"model.py:{i}") for i, (k, args) in
                enumerate(shards.items()))
    return bundle.evolve(modules=tuple(x.evolve(annotations=kept + new) if x.name == module else x
                                       for x in bundle.modules))


def _tp2(bundle: Any) -> Model:
    from kiln.dist import PlanRank, TensorParallel

    registry = get_registry("communicators")
    if "half" not in registry:
        registry.register("half", PlanRank("half", 1, 2))
    return Model.from_ir(bundle, init=None, parallel=TensorParallel("half"))


COL, ROW = {"strategy": "column"}, {"strategy": "row"}


@pytest.mark.parametrize(("shards", "code", "message"), [
    ({"gate": COL, "up": COL, "up_bias": COL, "down": {"strategy": "row", "tp_size": 4}}, "E027",
     r"parameter 'down': @shard\('row', tp_size=4\) but the run has 2 tensor-parallel ranks"),
    ({"gate": COL, "up": ROW, "up_bias": COL, "down": ROW}, "E008",
     r"parameter 'up': @shard\('row'\) reads 'y', which is whole on every rank"),
    ({"gate": COL}, "E008", r"parameter 'gate': op 'mul' \('h'\) mixes a rank's slice of the features "
                            r"with the whole 'matmul_bias_1'"),
    ({"gate": COL, "up": COL, "up_bias": COL}, "E008",
     r"parameter 'gate': op 'matmul_bias' \('out'\) reads a rank's slice"),
    ({"norm": COL, "gate": COL}, "E008", r"parameter 'norm': op 'rmsnorm' \('y'\) reads a rank's slice"),
    ({"gate": {"strategy": "expert"}}, "E008", r"parameter 'gate': @shard\('expert'\) is not lowered"),
    ({"gate": COL, "up": COL, "down": ROW}, "E008",
     r"parameter 'up': @shard\('column'\) but its bias 'up_bias' is not @shard\('column'\)"),
    ({"down_bias": ROW}, "E008", r"parameter 'down_bias': @shard\('row'\) on a 1-D parameter"),
])
def test_shardings_that_cannot_be_lowered_are_errors_naming_the_parameter(
        shards: dict[str, dict[str, Any]], code: str, message: str) -> None:
    bundle = _annotate(worker.tiny("ShardedMlpLM"), "GatedMlp", shards)
    with PluginSession().activate(), pytest.raises(KilnError, match=message) as err:
        _tp2(bundle)
    assert err.value.code == code and str(err.value.location).startswith("model.py:")


def test_a_size_the_ranks_cannot_share_and_two_shardings_of_one_parameter_are_errors() -> None:
    bundle = worker.build_bundle(worker.ShardedMlpLM, {"d_ff": 25})
    size = r"parameter 'gate': @shard\('column'\) splits its axis 0 of size 25, which is not a multiple"
    with PluginSession().activate(), pytest.raises(KilnError, match=size):
        _tp2(bundle)
    from kiln.core.ir import Annotation

    twice = worker.tiny("ShardedMlpLM")
    m = twice.module("GatedMlp")
    m = m.evolve(annotations=(*m.annotations, Annotation("shard", "param", "gate", {"strategy": "row"})))
    twice = twice.evolve(modules=tuple(m if x.name == m.name else x for x in twice.modules))
    with PluginSession().activate(), pytest.raises(KilnError, match="'gate' has two shardings") as e:
        _tp2(twice)
    assert e.value.code == "E008"


def test_shard_annotations_on_a_standard_block_keep_it_whole_or_must_follow_its_layout() -> None:
    bundle = worker.tiny("Qwen3Model")
    block = next(m.name for m in bundle.modules if m.kind == "block")
    names = ("qkv_weight", "out_weight", "mlp_up_weight", "mlp_down_weight")
    rep = {"strategy": "replicated"}
    with PluginSession().activate():
        whole = _tp2(_annotate(bundle, block, dict.fromkeys(names, rep))).parameters()
        assert whole["blocks.0.qkv_weight"].shape == Model.from_ir(bundle, init=None).parameters()[
            "blocks.0.qkv_weight"].shape  # kept whole
        assert whole["embedding"].shape == (32, 32)  # the vocabulary still split by default
        layout = _tp2(_annotate(bundle, block, {"qkv_weight": COL, "out_weight": ROW})).parameters()
        assert layout["blocks.0.qkv_weight"].shape[0] * 2 == whole["blocks.0.qkv_weight"].shape[0]
        with pytest.raises(KilnError, match=r"parameter 'out_weight': @shard\('column'\) conflicts with the "
                                            "standard block's tensor-parallel layout, where it is 'row'"):
            _tp2(_annotate(bundle, block, {"out_weight": COL}))
        with pytest.raises(KilnError, match=r"parameter 'qkv_weight': @shard\('replicated'\) conflicts"):
            _tp2(_annotate(bundle, block, {"qkv_weight": rep}))
        kept = _tp2(_annotate(bundle, "Qwen3Model", {"embedding": rep})).parameters()
        assert kept["embedding"].shape == (64, 32)
    # shard() follows the annotations too: a replicated block whole, a tp_size= checked only by the pass
    params = Model.from_ir(bundle, seed=0).parameters()
    rep_bundle = _annotate(bundle, block, dict.fromkeys(names, rep))
    assert shard(params, rep_bundle, 1, 2)["blocks.0.qkv_weight"].shape == params["blocks.0.qkv_weight"].shape
    sized = _annotate(bundle, block, {"qkv_weight": {"strategy": "column", "tp_size": 2}, "out_weight": ROW})
    assert shard(params, sized, 1, 2)["blocks.0.out_weight"].shape == (32, 16)


def test_unshard_puts_a_custom_blocks_slices_back_as_its_annotations_cut_them() -> None:
    from kiln.dist import unshard

    bundle = worker.tiny("ShardedMlpLM")
    whole = Model.from_ir(bundle, seed=0).parameters()
    parts = [shard(whole, bundle, r, 2) for r in range(2)]
    assert parts[1]["blocks.1.down"].shape == (16, 12) and parts[1]["lm_head"].shape == (64, 16)
    np.testing.assert_array_equal(parts[1]["blocks.1.down"], whole["blocks.1.down"][:, 12:])
    back = unshard(parts, bundle)
    assert back.keys() == whole.keys()
    for k, v in whole.items():
        np.testing.assert_array_equal(back[k], v, err_msg=k)


@pytest.mark.parametrize(("ranks", "degree"), [(4, 2), (2, 1), (2, 2)], ids=["2x2", "2x1", "1x2"])
def test_zero_1_on_a_grid_trains_as_one_process_and_splits_the_optimizer_state(
        tmp_path: Path, ranks: int, degree: int) -> None:
    """ZeRO-1 over the data-parallel axis of a (ranks / degree) x degree grid: each tensor-parallel
    rank's optimizer state split over the data-parallel ranks holding the same slices."""
    full, stats = worker.train(None, "Qwen3MoEModel")
    assert launch(ranks, [str(HERE / "_tp_worker.py"), str(tmp_path), "Qwen3MoEModel", "grid", str(degree),
                          "zero"], env={"KILN_NUM_THREADS": "1"}) == 0
    bundle, state = worker.tiny("Qwen3MoEModel"), full.state_dict()
    out = [np.load(tmp_path / f"rank{r}.npz") for r in range(ranks)]
    for r, rank in enumerate(out):
        want = shard(full.parameters(), bundle, r % degree, degree)
        np.testing.assert_allclose(rank["stats"], stats, rtol=1e-10)  # losses and the whole model's norms
        for k, v in want.items():
            np.testing.assert_allclose(rank[f"param:{k}"], v, rtol=1e-8, atol=1e-10, err_msg=k)
        for s, moments in state["optimizer"].items():  # gather_state: the whole optimizer state
            if isinstance(moments, dict):
                for k, v in moments.items():
                    np.testing.assert_allclose(rank[f"whole:{s}:{k}"], v, rtol=1e-8, atol=1e-12, err_msg=k)
    groups = ranks // degree
    for r in range(ranks):  # AdamW's two moments of the rank's slices, shared by its data-parallel group
        slices = 2 * int(out[r]["param_bytes"])
        share = int(out[r]["optimizer_bytes"])
        together = sum(int(out[q]["optimizer_bytes"]) for q in range(r % degree, ranks, degree))
        assert abs(together - slices) <= 0.02 * slices, (r, together, slices)
        if groups > 1:
            assert share < 0.8 * slices


def test_the_gathered_logits_on_one_rank_are_the_plain_matmul_less_the_padding_rows() -> None:
    registry = op_registry()
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((5, 4)), rng.standard_normal((7, 4))
    op = registry["vocab_parallel_logits"]
    np.testing.assert_allclose(op.run([x, w], {"communicator": "local"})[0], x @ w.T, rtol=1e-12)
    padded = op.run([x, w], {"communicator": "local", "vocab_size": 6})[0]
    np.testing.assert_allclose(padded, (x @ w.T)[:, :6], rtol=1e-12)
    assert registry["vocab_parallel_lm_head_loss"].logits == "vocab_parallel_logits"


def _lowered(bundle: Any, block: str) -> list[str]:
    from kiln.dist import PlanRank, tensor_parallel

    with PluginSession().activate():
        get_registry("communicators").register("half", PlanRank("half", 0, 2))
        ops = tensor_parallel(bundle, {"communicator": "half"}).module(block).forward.ops
    return [op.type for op in ops]


def test_comm_all_reduce_places_one_all_reduce_for_two_row_parallel_sums(tmp_path: Path) -> None:
    """TwoBranchMlp's @comm("all_reduce") on a + b: one all-reduce per block (two without it), and
    two ranks still train as one process."""
    bundle = worker.tiny("TwoBranchLM")
    assert _lowered(bundle, "TwoBranchMlp").count("tp_all_reduce") == 1
    block = bundle.module("TwoBranchMlp")
    block = block.evolve(annotations=tuple(a for a in block.annotations if a.kind != "comm"))
    bare = bundle.evolve(modules=tuple(block if m.name == block.name else m for m in bundle.modules))
    assert _lowered(bare, "TwoBranchMlp").count("tp_all_reduce") == 2
    full, losses = worker.train(None, "TwoBranchLM")
    assert launch(2, [str(HERE / "_tp_worker.py"), str(tmp_path), "TwoBranchLM"],
                  env={"KILN_NUM_THREADS": "1"}) == 0
    for r in range(2):
        rank = np.load(tmp_path / f"rank{r}.npz")
        np.testing.assert_allclose(rank["stats"], losses, rtol=1e-10)
        for k, v in shard(full.parameters(), bundle, r, 2).items():
            np.testing.assert_allclose(rank[f"param:{k}"], v, rtol=1e-8, atol=1e-10, err_msg=k)


def _with_comm(target: str, op: str = "all_reduce") -> Any:
    from kiln.core.ir import Annotation

    bundle = worker.tiny("TwoBranchLM")
    m = bundle.module("TwoBranchMlp")
    m = m.evolve(annotations=(*(a for a in m.annotations if a.kind != "comm"),
                              Annotation("comm", "tensor", target, {"op": op}, loc="model.py:7")))
    return bundle.evolve(modules=tuple(m if x.name == m.name else x for x in bundle.modules))


@pytest.mark.parametrize(("target", "op", "message"), [
    ("both", "all_gather", r"tensor 'both': @comm\('all_gather'\) in a tensor-parallel block"),
    ("y", "all_reduce", r"tensor 'y': @comm\('all_reduce'\) on a tensor that is not a sum of row-parallel"),
    ("add_1", "all_reduce", r"op 'add' \('add_1'\) reads 'view_2', this rank's part of the sum of the "
                            r"row-parallel 'down1', before its all-reduce"),
])
def test_a_comm_the_lowering_cannot_honour_is_an_error_naming_the_tensor(target: str, op: str,
                                                                         message: str) -> None:
    with PluginSession().activate(), pytest.raises(KilnError, match=message) as err:
        _tp2(_with_comm(target, op))
    assert err.value.code == "E008"


def _norm_inputs(model: Model) -> set[str]:
    sync = model._sync
    assert sync is not None
    (norm,) = [op for op in sync.grad_sync if op.type == "sharded_grad_norm"]
    return set(norm.inputs[1:])


def test_the_gradient_norm_counts_the_slices_the_models_own_pass_made() -> None:
    """Which parameters are sliced (their norm counted on every rank) is read from the IR each Model
    trains, so a later pass over the same communicator, for another model, changes nothing: on
    rank 1 of 2, the custom model counts exactly its @shard-split weights and its embedding (the
    vocabulary is split), the standard one its attention/MLP weights and its embedding and head."""
    from kiln.dist import TensorParallel

    with PluginSession().activate():
        custom = _tp2(worker.tiny("ShardedMlpLM"))
        standard = _tp2(worker.tiny("Qwen3Model"))
        assert _norm_inputs(custom) == {"embedding", *(f"blocks.{i}.{k}" for i in range(2)
                                                       for k in ("gate", "up", "up_bias", "down"))}
        assert _norm_inputs(standard) == {"embedding", "lm_head", *(
            f"blocks.{i}.{k}" for i in range(2) for k in ("qkv_weight", "out_weight", "mlp_up_weight",
                                                           "mlp_down_weight"))}
        # the custom model's plan again, after the standard model's pass ran over "half"
        trained = [(k, v.shape) for k, v in custom.parameters().items() if custom.trainable[k]]
        again = TensorParallel("half").plan(trained, module_ir=_as_trained(custom))
        (norm,) = [op for op in again.grad_sync if op.type == "sharded_grad_norm"]
        assert set(norm.inputs[1:]) == _norm_inputs(custom)
        # with the IR of no tensor_parallel pass over "half", nothing is sliced: rank 1 counts nothing
        whole = Model.from_ir(worker.tiny("ShardedMlpLM"), init=None, data_parallel=TensorParallel("half"))
        assert _norm_inputs(whole) == set()


def _as_trained(model: Model) -> Any:
    from kiln.core.plan._passes import run_passes

    return run_passes(model.ir, model.passes, get_registry("graph_passes"))[0]
