"""Host offload on the ``cuda`` backend over the CPU emulator: activations the plan offloads wait in the
host pool (pinned host memory on a GPU), copied on a second stream that events order with the kernels.
The emulator runs the copy stream's copies as late as the events allow (when the compute stream waits for
them), so a missing wait shows as data copied too late. Oracle: the same backend keeping every activation
on the device; offload moves bytes and computes nothing, so the gradients are the same bits."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.core import KilnError, Model, PluginSession, compile, get_registry
from kiln.cuda import EmulatedCuda, EmulatedDevice
from kiln.cuda._backend import CudaExecutable

CONFIG = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "num_query_heads": 4, "num_kv_heads": 2,
          "head_size": 8, "d_ff": 64, "max_seq": 16}


@pytest.fixture(scope="module")
def bundle():
    dsl = pytest.importorskip("kiln.dsl", reason="the Qwen3 model comes from kiln-dsl")
    from kiln.dsl.stdlib.models import Qwen3Model

    return dsl.build_bundle(Qwen3Model, CONFIG)


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    return rng.integers(0, 64, (2, 8)), rng.integers(0, 64, (2, 8))


def _grads(bundle, batch, device: EmulatedDevice) -> tuple[tuple[float, dict], tuple[float, dict]]:
    session = PluginSession(autoload=False)
    session.register(EmulatedCuda(device), "cuda-emulated")
    with session.activate():
        models = [Model.from_ir(bundle, seed=0, backend="cuda", recompute=r) for r in ("none", "offload")]
        return models[0].loss_and_grads(*batch), models[1].loss_and_grads(*batch)


def test_offload_gives_the_gradients_of_keep_all(bundle, batch) -> None:
    device = EmulatedDevice()
    (want_loss, want), (loss, have) = _grads(bundle, batch, device)
    assert loss == want_loss
    for name in want:
        assert np.array_equal(have[name], want[name]), name
    assert device._ran > 0 and device._ran == len(device._copies)  # every copy went by the copy stream


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_offload_trains_as_keep_all(bundle, batch, precision: str) -> None:
    """Under bf16 the steps' planned workspaces (the casts' temporaries) may take an offloaded tensor's
    bytes: the offload must be done before such a step writes them (a bf16 run's second loss was NaN)."""
    if precision == "bf16":
        pytest.importorskip("ml_dtypes", reason="the bf16 recipe needs ml_dtypes")
    session = PluginSession(autoload=False)
    session.register(EmulatedCuda(), "cuda-emulated")
    step = {"input_ids": batch[0], "labels": batch[1]}
    with session.activate():
        keep, off = (Model.from_ir(bundle, seed=0, backend="cuda", recompute=r, precision=precision)
                     for r in ("none", "offload"))
        program = off.program(2, 8)
        for _ in range(2):
            assert off.train_step(step)["loss"] == keep.train_step(step)["loss"]
        want, have = keep.parameters(), off.parameters()
    assert program.host_bytes > 0 and any(s.how == "offload" for s in program.steps)
    for name in want:
        assert np.array_equal(have[name], want[name]), name


@pytest.mark.parametrize("which", ["offload", "fetch"])
def test_a_missing_wait_is_caught(bundle, batch, which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness can fail: with the compute stream waiting for the copies only at the end of the run
    (not before the step that overwrites an offloaded slot, or reads a fetched one), gradients change."""
    touch = CudaExecutable._next_touch

    def late(self, step, key, *, write):
        return -1 if step.how == which else touch(self, step, key, write=write)

    monkeypatch.setattr(CudaExecutable, "_next_touch", late)
    (_, want), (_, have) = _grads(bundle, batch, EmulatedDevice())
    assert not all(np.array_equal(have[k], want[k]) for k in want)


def test_offloading_phases_are_not_captured(bundle) -> None:
    session = PluginSession(autoload=False)
    session.register(EmulatedCuda(), "cuda-emulated")
    with session.activate():
        program = compile(bundle, bindings={"B": 2, "T": 8}, backend="cuda", recompute="offload")
        backend = get_registry("backends")["cuda"]
        exe = backend.compile(program, backend.allocate(program.arena_bytes), None)
        with pytest.raises(KilnError, match=r"cannot be captured: step \d+ \(offload\)"):
            exe.capture(("forward", "backward"))
