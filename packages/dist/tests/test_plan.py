"""``kiln plan --ranks N [--zero] [--tensor T]``: the bytes one rank of a parallel run holds, planned in
one process, against what the whole model holds."""

from __future__ import annotations

import json

import pytest

from kiln.core import KilnError, Model
from kiln.core.cli import main
from kiln.dist import rank_programs

dsl = pytest.importorskip("kiln.dsl", reason="the tiny model is built with kiln-dsl")

CONFIG = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "num_query_heads": 4, "num_kv_heads": 2,
          "head_size": 8, "d_ff": 48, "max_seq": 16}
BINDINGS = {"B": 4, "T": 8}


def report(**parallel: int) -> list[dict[str, int]]:
    bundle = dsl.build_bundle("Qwen3Model", CONFIG)
    return [prog.memory_report() for _, prog in rank_programs(bundle, bindings=BINDINGS, **parallel)]


def test_each_rank_holds_its_share() -> None:
    one = report(ranks=1)[0]
    whole = Model.from_ir(dsl.build_bundle("Qwen3Model", CONFIG)).parameters()
    # tensor parallelism: half of the sliced weights (heads, MLP, vocabulary), the norms whole
    sliced = sum(v.nbytes for k, v in whole.items() if "norm" not in k)
    [tp] = report(ranks=2, tensor=2)
    assert tp["weights"] == pytest.approx(one["weights"] - sliced / 2, rel=0.01)
    assert tp["optimizer_state"] == pytest.approx(2 * tp["weights"], rel=0.01)  # AdamW: two moments
    # data parallelism: the whole model, half the batch's activations
    [dp] = report(ranks=2)
    assert dp["weights"] == one["weights"] and dp["optimizer_state"] == one["optimizer_state"]
    assert dp["saved_activations"] == pytest.approx(one["saved_activations"] / 2, rel=0.01)
    # ZeRO-1: the optimizer state split, each rank's share about half
    shares = [r["optimizer_state"] for r in report(ranks=2, zero=True)]
    assert len(shares) == 2 and sum(shares) == pytest.approx(one["optimizer_state"], rel=0.01)
    assert max(shares) <= 0.51 * one["optimizer_state"]
    # ZeRO-1 on a 2 x 2 grid: a tensor-parallel rank's optimizer state split over its 2 data-parallel ranks
    bundle = dsl.build_bundle("Qwen3Model", CONFIG)
    grid = rank_programs(bundle, bindings=BINDINGS, ranks=4, tensor=2, zero=True)
    assert [r for r, _ in grid] == [0, 2]
    shares = [prog.memory_report()["optimizer_state"] for _, prog in grid]
    assert sum(shares) == pytest.approx(tp["optimizer_state"], rel=0.01) and max(shares) <= 0.6 * sum(shares)
    assert all(prog.memory_report()["weights"] == tp["weights"] for _, prog in grid)


def test_kiln_plan_prints_the_bytes_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "Qwen3Model", "--config", json.dumps(CONFIG), "--batch", "4", "--seq", "8"]
    assert main([*args, "--ranks", "2", "--zero"]) == 0
    out = capsys.readouterr().out
    assert "bytes per rank (2 ranks: 2 data-parallel, ZeRO-1; each rank's):" in out
    table = out.split("bytes per rank", 1)[1].splitlines()
    assert table[1].split() == ["rank", "parameters", "gradients", "optimizer", "activations", "peak"]
    assert [row.split()[0] for row in table[2:4]] == ["0", "1"]
    assert main([*args, "--ranks", "4", "--tensor", "2"]) == 0
    assert "(4 ranks: 2 data-parallel x 2 tensor-parallel; the same on every rank)" in capsys.readouterr().out


@pytest.mark.parametrize(("extra", "message"), [
    (["--zero"], "--zero applies with --ranks N"),
    (["--ranks", "3", "--tensor", "2"], "tensor-parallel degree of 2 does not divide 3 ranks"),
    (["--ranks", "3"], "global batch of 4 is not a multiple of the 3 data-parallel ranks")])
def test_ranks_that_cannot_share_the_work_are_refused(capsys: pytest.CaptureFixture[str], extra: list[str],
                                                      message: str) -> None:
    assert main(["plan", "Qwen3Model", "--config", json.dumps(CONFIG), "--batch", "4", *extra]) == 2
    assert message in capsys.readouterr().err


def test_a_stand_in_rank_cannot_run_collectives() -> None:
    from kiln.dist import PlanRank

    with pytest.raises(KilnError, match="stands in for rank 1 of 2"):
        PlanRank("plan", 1, 2).all_reduce(None)
