"""A training step allocates nothing (the kernels' temporaries live in a workspace sized when the
Program is compiled), and its forward and backward phases replay as one captured CUDA graph: on the
emulator, whose capture records instead of running and refuses what a graph cannot hold."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.core import PHASES, AdamW, KilnError, Model, PluginSession, compile, get_registry
from kiln.cuda import EmulatedCuda, EmulatedDevice

CONFIG = {"vocab_size": 64, "d_model": 32, "n_layers": 1, "num_query_heads": 4, "num_kv_heads": 2,
          "head_size": 8, "d_ff": 64, "max_seq": 16}
BATCH = {"input_ids": np.arange(16).reshape(2, 8) % 64, "labels": np.arange(1, 17).reshape(2, 8) % 64}


@pytest.fixture(scope="module")
def bundle():
    dsl = pytest.importorskip("kiln.dsl", reason="the Qwen3 model comes from kiln-dsl")
    from kiln.dsl.stdlib.models import Qwen3Model

    return dsl.build_bundle(Qwen3Model, CONFIG)


@pytest.fixture
def session(cache: Path):
    device = EmulatedDevice(cache=cache / "emulated")
    with PluginSession(autoload=False).activate() as s:
        s.register(EmulatedCuda(device), "cuda-emulated")
        yield device


def test_a_training_step_allocates_nothing(bundle, session: EmulatedDevice) -> None:
    model = Model.from_ir(bundle, seed=0, backend="cuda")
    reference = Model.from_ir(bundle, seed=0, backend="numpy")
    model.train_step(BATCH)  # compiles the step: its kernels' temporaries planned in the arena
    reference.train_step(BATCH)
    assert session.workspace is None  # no workspace of the device's own
    before = session.allocs
    for _ in range(2):
        got, want = model.train_step(BATCH), reference.train_step(BATCH)
    assert session.allocs == before
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)


class Sizes(EmulatedDevice):
    """The emulator, recording the size of every allocation."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.sizes: list[int] = []

    def alloc(self, nbytes: int) -> int:
        self.sizes.append(nbytes)
        return super().alloc(nbytes)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_planned_peak_is_the_device_allocation(bundle, cache: Path, precision: str) -> None:
    """The kernels' temporaries are slots of the arena (``workspace.<step>``, live in their step alone):
    the planned peak is the one arena allocation, nothing else is allocated but the Executable's fixed
    scalar and pointer tables, and each step's temporaries fit its slot."""
    device = Sizes(cache=cache / "emulated")
    with PluginSession(autoload=False).activate() as s:
        s.register(EmulatedCuda(device), "cuda-emulated")
        program = compile(bundle, bindings={"B": 2, "T": 8}, backend="cuda", precision=precision)
        plain = compile(bundle, bindings={"B": 2, "T": 8}, backend="numpy", precision=precision)
        ws = [sl for sl in program.slots if sl.kind == "workspace"]
        assert ws and all(sl.first == sl.last and not sl.tensors for sl in ws)
        assert not any(sl.kind == "workspace" for sl in plain.slots)  # NumPy declares none
        backend = get_registry("backends")["cuda"]
        start = len(device.sizes)
        exe = backend.compile(program, backend.allocate(program.arena_bytes), None)
        assert device.sizes[start] == program.arena_bytes
        tables = device.sizes[start + 1:]
        assert device.workspace is None and exe.workspace_bytes == 0 and sum(tables) < 4096
        for name, t in program.tensors.items():
            if name.startswith("adamw.exp_avg_sq."):
                exe.write(name, np.zeros(t.shape, np.float32))
        inputs = {"token_ids": BATCH["input_ids"], "targets": BATCH["labels"], "segment_ids": 0,
                  "position_ids": np.arange(8), "d_loss": 1 / 16}
        for name, value in inputs.items():
            t = program.tensors[name]
            exe.write(name, np.broadcast_to(np.asarray(value), t.shape).astype(t.dtype))
        n = len(device.sizes)
        for step in (1, 2):
            exe.run(PHASES, hyper={"step": step})
    assert len(device.sizes) == n
    used = [w for w in exe.planned.values() if w.high]
    assert used and all(w.overflows == 0 and w.high <= w.nbytes for w in exe.planned.values())


def _executables(bundle, n: int, without: tuple[str, ...] = ()) -> tuple[list, object]:
    program = compile(bundle, bindings={"B": 2, "T": 8}, backend="cuda")
    backend = get_registry("backends")["cuda"]
    exes = [backend.compile(program, backend.allocate(program.arena_bytes), None) for _ in range(n)]
    rng = np.random.default_rng(0)
    values = {}
    for name, t in program.tensors.items():  # the same random arena for each
        if t.dtype.startswith("int"):
            values[name] = rng.integers(0, 8, t.shape).astype(t.dtype)
        else:
            values[name] = (rng.standard_normal(t.shape) * 0.1).astype(t.dtype)
    for exe in exes:
        for name, v in values.items():
            exe.write(name, v)
    return exes, program


def test_forward_and_backward_replay_as_one_graph(bundle, session: EmulatedDevice) -> None:
    (eager, graphed), program = _executables(bundle, 2)
    launches = session.launches
    graphed.capture(("forward", "backward"))
    assert session.launches == launches  # capturing runs nothing
    for _ in range(2):  # the graph replays every time, on the same arena
        eager.run(("forward", "backward"))
        graphed.run(("forward", "backward"))
    for name in program.tensors:
        assert np.array_equal(eager.read(name), graphed.read(name), equal_nan=True), name
    assert session.launches > launches


def test_what_a_graph_cannot_hold_is_named(bundle, cache: Path) -> None:
    device = EmulatedDevice(cache=cache / "emulated")
    with PluginSession(autoload=False).activate() as s:
        s.register(EmulatedCuda(device, without=("swiglu",)), "cuda-emulated")
        (exe,), _ = _executables(bundle, 1)
        with pytest.raises(KilnError, match=r"cannot be captured: step \d+ \(swiglu\) run on the host"):
            exe.capture(("forward", "backward"))
        exe.capture(("optimizer",))  # the norm, the clipping factor and the rates stay on the device


def test_the_whole_step_replays_as_one_graph(bundle, session: EmulatedDevice) -> None:
    """``capture(PHASES)``: forward, backward and the optimizer (the gradient norm, clipping factor and
    learning rate in device scalars the AdamW kernel reads) as one graph; three replayed steps give the
    eager steps' bits, with a warmup schedule and clipping active, and the scalars the host's formulas."""
    (eager, graphed), program = _executables(bundle, 2)
    for exe in (eager, graphed):  # second moments are non-negative
        for name in program.tensors:
            if name.startswith("adamw.exp_avg_sq."):
                exe.write(name, np.abs(exe.read(name)))
    opt = AdamW(lr=1e-2, warmup_steps=2, total_steps=5, max_grad_norm=1e-3)
    graphed.capture(PHASES)
    for step in (1, 2, 3):
        hyper = {"step": step, "optimizer": opt}
        want, got = eager.run(PHASES, hyper=hyper), graphed.run(PHASES, hyper=hyper)
        assert got == want
        assert want["lr"] == pytest.approx(opt.lr_at(step), rel=1e-7)
        assert want["scale"] == pytest.approx(opt.clip_scale(want["grad_norm"]), rel=1e-6)
        assert want["scale"] < 1
    for name in program.tensors:
        value = eager.read(name)
        assert np.array_equal(value, graphed.read(name)), name
    assert np.isfinite(eager.read("lm_head")).all()
    assert not np.array_equal(eager.read("lm_head"), _executables(bundle, 1)[0][0].read("lm_head"))
