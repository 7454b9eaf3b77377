"""The Communicator protocol and the data-parallel hook of Model: a SyncPlan's collectives run as
steps of the grad_sync and optimizer phases, on the gradients and parameters they name."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from kiln_core_tiny import random_batch, tiny_qwen3_bundle

from kiln.core import SGD, KilnError, Model, OpDef, PluginSession, get_registry, hookimpl, no_gradient
from kiln.core.ir import Op
from kiln.core.runtime import Communicator, DataParallel, SyncPlan

NORM = "test.norm"


class OneRank:
    name = "one"
    rank, world_size = 0, 1

    def all_reduce(self, buf: Any) -> None: ...
    def reduce_scatter(self, send: Any, recv: Any) -> None: ...
    def all_gather(self, send: Any, recv: Any) -> None: ...
    def broadcast(self, buf: Any, root: int = 0) -> None: ...
    def barrier(self) -> None: ...


class TwoRanks(OneRank):
    world_size = 2


class Fixed:
    """A data-parallel plan given in full (what kiln-dist computes per rank)."""

    def __init__(self, sync: SyncPlan, communicator: Communicator | None = None) -> None:
        self.sync, self.communicator, self.asked = sync, communicator or OneRank(), []

    def plan(self, trained: Sequence[tuple[str, tuple[int, ...]]]) -> SyncPlan:
        self.asked.append(list(trained))
        return self.sync


def double(*grads: np.ndarray, **_: Any) -> None:
    for g in grads:
        g *= 2


def zero(*params: np.ndarray, **_: Any) -> None:
    for p in params:
        p[...] = 0


def fill(norm: np.ndarray, **_: Any) -> None:
    norm[...] = 3.0


class Collectives:
    """Stand-ins for collectives: in-place ops on the tensors a SyncPlan names."""

    @hookimpl
    def kiln_register_ops(self, registry: Any) -> None:
        for name, fn, inputs in (("test_double", double, ("*t",)), ("test_zero", zero, ("*t",)),
                                 ("test_fill", fill, ("norm",))):
            registry.register_op(OpDef(name, inputs, (), fn, lambda ctx: [], backward=no_gradient,
                                       collective=True))


@pytest.fixture
def session() -> Iterator[PluginSession]:
    with PluginSession(autoload=False).activate() as s:
        s.register(Collectives(), "collectives")
        yield s


BUNDLE = tiny_qwen3_bundle()
BATCH = random_batch(32, 2, 6)


def sgd() -> SGD:
    return SGD(lr=0.1, max_grad_norm=None)


def test_a_minimal_class_is_a_communicator_and_a_plan_holder() -> None:
    assert isinstance(OneRank(), Communicator)
    assert isinstance(Fixed(SyncPlan()), DataParallel)
    assert not isinstance(object(), Communicator)


class Reading(Fixed):
    """A plan that also takes the IR the model trains."""

    def plan(self, trained: Sequence[tuple[str, tuple[int, ...]]], module_ir: Any = None) -> SyncPlan:
        self.asked.append(module_ir)
        return self.sync


def test_a_plan_taking_module_ir_gets_the_ir_after_the_models_passes(session: PluginSession) -> None:
    def mark(bundle: Any, options: Any) -> Any:
        return bundle.evolve(modules=tuple(m.evolve(metadata={**m.metadata, "test.mark": options["v"]})
                                           for m in bundle.modules))

    get_registry("graph_passes").register("test_mark", mark)
    reading = Reading(SyncPlan())
    Model.from_ir(BUNDLE, init=None, passes=[("test_mark", {"v": 7})], data_parallel=reading)
    (ir,) = reading.asked
    assert ir.module(ir.entry).metadata["test.mark"] == 7  # the passes ran before the plan
    plain = Reading(SyncPlan())
    Model.from_ir(BUNDLE, init=None, data_parallel=plain)
    assert plain.asked[0].module(plain.asked[0].entry) == BUNDLE.module(BUNDLE.entry)
    older = Fixed(SyncPlan())  # plan(trained) only: called as it is
    Model.from_ir(BUNDLE, init=None, data_parallel=older)
    assert len(older.asked) == 1 and isinstance(older.asked[0], list)


def test_grad_sync_ops_run_on_the_gradients_between_backward_and_update(session: PluginSession) -> None:
    plain = Model.from_ir(BUNDLE, seed=0, optimizer=sgd())
    trained = [k for k, t in plain.trainable.items() if t]
    dp = Fixed(SyncPlan(grad_sync=[Op("test_double", trained, [])]))
    synced = Model.from_ir(BUNDLE, seed=0, optimizer=sgd(), data_parallel=dp)
    assert dp.asked == [[(k, plain.parameter_specs()[k][1]) for k in trained]]
    before = plain.parameters()
    plain.train_step(BATCH)
    synced.train_step(BATCH)
    grad_sync = synced.program(2, 6).phase("grad_sync")
    assert [s.op.type for s in grad_sync] == ["test_double"]
    assert grad_sync[0].inputs == tuple(p.grad for p in synced.program(2, 6).params if p.trainable)
    for k in trained:  # SGD: twice the gradient, twice the step
        np.testing.assert_allclose(synced.parameter(k) - before[k], 2 * (plain.parameter(k) - before[k]),
                                   rtol=1e-4, atol=1e-6)  # p - before: rounding of p near 1


def test_a_rank_keeps_state_and_updates_only_for_the_parameters_it_owns(session: PluginSession) -> None:
    plain = Model.from_ir(BUNDLE, seed=0)
    owned = frozenset({"lm_head", "blocks.1.mlp.up_weight"})
    dp = Fixed(SyncPlan(owned=owned, norm=(NORM,), outputs=(NORM,), grad_sync=[Op("test_fill", [NORM], [])],
                        after_update=[Op("test_zero", ["embedding"], [])]))
    ranked = Model.from_ir(BUNDLE, seed=0, data_parallel=dp)
    before = ranked.parameters()
    stats = ranked.train_step(BATCH)
    assert stats["grad_norm"] == pytest.approx(3.0)  # the norm the grad_sync op wrote, not the local one
    after = ranked.parameters()
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert changed == owned | {"embedding"} and not after["embedding"].any()  # zeroed after the update
    state = ranked.state_dict()["optimizer"]
    assert set(state["exp_avg"]) == set(state["exp_avg_sq"]) == owned
    sizes = {k: 4 * int(np.prod(v.shape)) for k, v in before.items()}
    report, full = ranked.memory_report(), plain.memory_report(2, 6)
    assert report["optimizer_state"] == sum(2 * -(-sizes[k] // 64) * 64 for k in owned)
    assert full["optimizer_state"] > report["optimizer_state"]
    plain.train_step(BATCH)
    ranked.load_state_dict(plain.state_dict())  # one process's whole state: the rank takes its share
    for k in owned:
        np.testing.assert_array_equal(ranked.state_dict()["optimizer"]["exp_avg"][k],
                                      plain.state_dict()["optimizer"]["exp_avg"][k])


def test_a_sync_plans_buffers_are_arena_slots_live_through_the_program(session: PluginSession) -> None:
    """A collective in flight from the backward to grad_sync keeps its bucket in a planned buffer: a
    slot of kind ``buffer`` that no other tensor shares, live from the first step to the last."""
    plain = Model.from_ir(BUNDLE, seed=0, optimizer=sgd())
    trained = [k for k, t in plain.trainable.items() if t]
    dp = Fixed(SyncPlan(in_backward=[Op("test_double", [trained[-1], "test.bucket"], [])],
                        grad_sync=[Op("test_double", [trained[-1], "test.bucket"], [])],
                        buffers=[("test.bucket", 10)]))
    program = Model.from_ir(BUNDLE, seed=0, optimizer=sgd(), data_parallel=dp).program(2, 6)
    (slot,) = [sl for sl in program.slots if sl.kind == "buffer"]
    assert (slot.name, slot.tensors, slot.first, slot.last) == ("test.bucket", ("test.bucket",), 0,
                                                                 len(program.steps) - 1)
    assert slot.nbytes >= 40 and program.tensors["test.bucket"].shape == (10,)
    assert all(sl.offset + sl.nbytes <= slot.offset or slot.offset + slot.nbytes <= sl.offset
               for sl in program.slots if sl is not slot)  # its own bytes, whatever runs meanwhile
    assert slot.offset + slot.nbytes <= program.arena_bytes
    users = [s for s in program.steps if "test.bucket" in s.inputs]
    assert [s.phase for s in users] == ["backward", "grad_sync"]


def test_the_global_batch_must_split_evenly_over_the_ranks(session: PluginSession) -> None:
    model = Model.from_ir(BUNDLE, seed=0, data_parallel=Fixed(SyncPlan(), TwoRanks()))
    batch = random_batch(32, 3, 6)
    with pytest.raises(KilnError, match=r"times the 2 data-parallel ranks must .* dividing the batch of 3"):
        model.train_step(batch)
