"""The Programs of the ranks of a parallel run, planned in one process (``kiln plan --ranks N``):
stand-in communicators give each rank its rank and world size, so the ``tensor_parallel`` pass and
:class:`DataParallel`'s sync plan lay out that rank's Program as a real run would."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kiln.core import KilnError, PluginSession, get_registry
from kiln.dist._parallel import DataParallel

__all__ = ["PlanRank", "rank_programs"]


@attrs.frozen
class PlanRank:
    """A communicator that only says which rank of ``world_size`` this is: for planning, its
    collectives never run."""

    name: str
    rank: int
    world_size: int

    def _never(self, *_: Any, **__: Any) -> None:
        raise KilnError(f"communicator {self.name!r} stands in for rank {self.rank} of {self.world_size} to "
                        "plan its Program; it cannot run collectives")

    all_reduce = reduce_scatter = all_gather = broadcast = barrier = _never


def rank_programs(bundle: Any, *, ranks: int, bindings: Mapping[str, int], tensor: int = 1,
                  zero: bool = False, passes: Sequence[Any] = (), mode: str = "full",
                  **options: Any) -> list[tuple[int, Any]]:
    """The training Programs of a run on ``ranks`` ranks: groups of ``tensor`` consecutive ranks
    hold the model in slices, the ``ranks // tensor`` groups share the batch (``bindings["B"]`` is the
    global batch), ZeRO-1 over them when ``zero``. Returns (rank, Program) for each rank whose
    Program differs from the others' (ZeRO-1's shares of the optimizer state differ by rank; the
    other ranks' Programs are rank 0's). ``options`` go to :func:`kiln.core.compile`."""
    from kiln.core import compile

    if ranks < 1 or tensor < 1 or ranks % tensor:
        raise KilnError(f"a tensor-parallel degree of {tensor} does not divide {ranks} ranks")
    groups = ranks // tensor
    batch = int(bindings["B"])
    if batch % groups:
        raise KilnError(f"a global batch of {batch} is not a multiple of the {groups} data-parallel ranks")
    out = []
    for r in range(groups if zero else 1):
        with PluginSession().activate():
            registry = get_registry("communicators")
            registry.register("plan-dp", PlanRank("plan-dp", r, groups))
            registry.register("plan-tp", PlanRank("plan-tp", 0, tensor))
            tp = [("tensor_parallel", {"communicator": "plan-tp"})] if tensor > 1 else []
            local = {**bindings, "B": batch // groups}
            sync = None
            if groups > 1:
                first = compile(bundle, bindings=local, mode=mode, passes=[*passes, *tp], **options)
                trained = [(p.name, p.shape) for p in first.params if p.trainable]
                sync = DataParallel("plan-dp", zero=int(zero)).plan(trained)
            out.append((r * tensor, compile(bundle, bindings=local, mode=mode, passes=[*passes, *tp],
                                            sync=sync, **options)))
    return out
