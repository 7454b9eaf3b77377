"""The collectives a rank plans: buckets, ZeRO-1's ownership, and the settings it refuses (no MPI
needed: fake ranks stand in for a communicator)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kiln.core import KilnError, PluginSession, get_registry
from kiln.dist import DataParallel


class FakeRanks:
    """Rank ``rank`` of ``world``, to see the plan a rank makes without starting MPI."""

    name = "fake"

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world_size = rank, world


@pytest.fixture
def fake() -> Iterator[PluginSession]:
    with PluginSession().activate() as session:
        for r in range(3):
            get_registry("communicators").register(f"fake{r}", FakeRanks(r, 3))
        yield session


TRAINED = [("a", (64, 32)), ("b", (32,)), ("c", (1024,)), ("d", (8, 8)), ("e", (2048,))]


def test_buckets_hold_the_last_parameters_first_within_the_limit() -> None:
    buckets = DataParallel("fake0", bucket_bytes=4 * 2048).buckets(TRAINED)
    assert [[k for k, _ in b] for b in buckets] == [["e"], ["d", "c", "b"], ["a"]]


def test_zero1_ranks_own_disjoint_balanced_shares(fake: PluginSession) -> None:
    plans = [DataParallel(f"fake{r}", zero=1).plan(TRAINED) for r in range(3)]
    owned = [p.owned or frozenset() for p in plans]
    assert set().union(*owned) == {k for k, _ in TRAINED} and sum(map(len, owned)) == len(TRAINED)
    assert [p.norm for p in plans] == [("grad_sync.norm",)] * 3
    assert plans[0].grad_sync[0].attrs["owners"] == plans[2].grad_sync[0].attrs["owners"]  # one assignment
    plain = DataParallel("fake1").plan(TRAINED)
    assert plain.owned is None and [op.type for op in plain.grad_sync] == ["bucket_all_reduce"]


def test_bad_settings_name_the_culprit() -> None:
    with pytest.raises(KilnError, match="zero=2"):
        DataParallel(zero=2)
    with pytest.raises(KilnError, match="bucket_bytes=0"):
        DataParallel(bucket_bytes=0)
    with pytest.raises(KilnError, match="no communicator 'nope' is registered; registered: "):
        DataParallel("nope").plan([])
