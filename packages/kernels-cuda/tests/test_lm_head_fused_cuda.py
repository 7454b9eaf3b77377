"""The LM head's loss and gradient in one pass on ``cuda`` (the Program's fusion
``fused_lm_head_loss_and_grad``), on the CPU emulator: the same bits as the forward and backward steps it
replaces (the same kernels' sums, in the same order, one logits product fewer), the NumPy backend's fused
pass and the op's float64 reference within float32 rounding, and one tile of logits in its workspace."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.core import KilnError, Model, PluginSession, compile, get_registry
from kiln.core.ops.library._loss import fused_lm_head_loss_and_grad as numpy_fused
from kiln.cuda import EmulatedCuda, EmulatedDevice, _ops
from kiln.cuda._check import _to_device, _to_host
from kiln.cuda._ops import ALIGN, DeviceArray

FUSED = "fused_lm_head_loss_and_grad"
CONFIG = {"vocab_size": 64, "d_model": 32, "n_layers": 1, "num_query_heads": 4, "num_kv_heads": 2,
          "head_size": 8, "d_ff": 64, "max_seq": 16}


def _inputs(n: int, v: int, c: int, ignore_index: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c)).astype(np.float32)
    w = (rng.standard_normal((v, c)) * 0.5).astype(np.float32)
    t = rng.integers(0, v, n).astype(np.int32)
    t[::4] = ignore_index  # ignored rows: no loss, no gradient
    return rng.standard_normal(n).astype(np.float32), x, w, t


def _device(dev: EmulatedDevice, a: np.ndarray, dtype: str | None = None) -> DeviceArray:
    if dtype == "bfloat16":
        import ml_dtypes

        a = a.astype(ml_dtypes.bfloat16)
    out = _to_device(dev, a)
    assert out is not None
    return out


def _empty(dev: EmulatedDevice, *shape: int) -> DeviceArray:
    return _device(dev, np.full(shape, np.nan, np.float32))


def _fused(dev: EmulatedDevice, fn, dl, x, w, t, dtype=None, **attrs) -> list[np.ndarray]:
    (n, c), v = x.shape, w.shape[0]
    outs = [_empty(dev, n), _empty(dev, n), _empty(dev, n, c), _empty(dev, v, c)]
    fn(_device(dev, dl), _device(dev, x, dtype), _device(dev, w, dtype), _device(dev, t), loss=outs[0],
       lse=outs[1], d_x=outs[2], d_weight=outs[3], **attrs)
    return [_to_host(o) for o in outs]


def _two_steps(dev: EmulatedDevice, forward, backward, dl, x, w, t, dtype=None, **attrs) -> list[np.ndarray]:
    (n, c), v = x.shape, w.shape[0]
    xd, wd, td = _device(dev, x, dtype), _device(dev, w, dtype), _device(dev, t)
    fwd = [_empty(dev, n), _empty(dev, n)]
    forward(xd, wd, td, out=fwd, **attrs)
    bwd = [_empty(dev, n, c), _empty(dev, v, c)]
    backward(_device(dev, dl), xd, wd, td, fwd[1], None, out=bwd, **attrs)
    return [_to_host(o) for o in (*fwd, *bwd)]


def _reference(dl, x, w, t, ignore_index: int) -> list[np.ndarray]:
    """The ops' own NumPy kernels in float64: loss and lse, then the backward for ``d_loss``."""
    from kiln.core import op_registry

    ops = op_registry()
    a = {"ignore_index": ignore_index, "chunk_size": 64, "softcap": None}
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    loss, lse = ops.get_op("fused_lm_head_loss").kernel(x64, w64, t, **a)
    backward = ops.get_op("fused_lm_head_loss_backward").kernel
    d_x, d_w = backward(dl.astype(np.float64), x64, w64, t, lse, None, **a)
    return [loss, lse, d_x, d_w]


# one tile of 13 rows; four of 4, 4, 4 and 1 rows (the vocabulary 301, not a multiple of a warp or block)
@pytest.mark.parametrize("tile_rows", [13, 4])
@pytest.mark.parametrize("ignore_index", [-100, 7])
def test_fused_pass_gives_the_two_steps_bits(emulated: EmulatedDevice, monkeypatch: pytest.MonkeyPatch,
                                             tile_rows: int, ignore_index: int) -> None:
    n, v, c = 13, 301, 24
    monkeypatch.setattr(_ops, "LOGITS_TILE", tile_rows * v)
    assert len(_ops._head_tiles(n, v)) == -(-n // tile_rows)
    dl, x, w, t = _inputs(n, v, c, ignore_index)
    got = _fused(emulated, _ops.fused_lm_head_loss_and_grad, dl, x, w, t, ignore_index=ignore_index)
    plain = _two_steps(emulated, _ops.fused_lm_head_loss, _ops.fused_lm_head_loss_backward, dl, x, w, t,
                       ignore_index=ignore_index)
    for name, a, b in zip(("loss", "lse", "d_x", "d_weight"), got, plain, strict=True):
        assert np.array_equal(a, b), name
    assert np.all(got[0][t == ignore_index] == 0) and np.all(got[0][t != ignore_index] > 0)
    # the NumPy backend's fused pass (float32) and the ops' float64 kernels
    numpy = [np.full(n, np.nan, np.float32), np.full(n, np.nan, np.float32), np.zeros((n, c), np.float32),
             np.zeros((v, c), np.float32)]
    numpy_fused(dl, x, w, t, loss=numpy[0], lse=numpy[1], d_x=numpy[2], d_weight=numpy[3],
                ignore_index=ignore_index)
    want = _reference(dl, x, w, t, ignore_index)
    for name, a, b, r in zip(("loss", "lse", "d_x", "d_weight"), got, numpy, want, strict=True):
        assert np.abs(a - r).max() <= 2e-5 * max(1.0, float(np.abs(r).max())), name
        assert np.abs(a - b).max() <= 2e-5 * max(1.0, float(np.abs(r).max())), name


def test_without_d_loss_the_gradients_are_zero(emulated: EmulatedDevice) -> None:
    dl, x, w, t = _inputs(9, 70, 8, -100)
    n, c, v = 9, 8, 70
    outs = [_empty(emulated, n), _empty(emulated, n), _empty(emulated, n, c), _empty(emulated, v, c)]
    _ops.fused_lm_head_loss_and_grad(None, _device(emulated, x), _device(emulated, w), _device(emulated, t),
                                     loss=outs[0], lse=outs[1], d_x=outs[2], d_weight=outs[3],
                                     ignore_index=-100)
    loss, lse, d_x, d_w = (_to_host(o) for o in outs)
    want = _reference(dl, x, w, t, -100)
    assert np.abs(loss - want[0]).max() < 2e-5 and np.abs(lse - want[1]).max() < 2e-5
    assert not d_x.any() and not d_w.any()


@pytest.mark.parametrize("tile_rows", [37, 5])
def test_bf16_fused_pass_gives_the_bf16_steps_bits(emulated: EmulatedDevice, monkeypatch: pytest.MonkeyPatch,
                                                   tile_rows: int) -> None:
    """Under the bf16 recipe: bf16 x and weight, the rounding points of ``fused_lm_head_loss_bf16`` and its
    backward (the same bits), and NumPy's bf16 emulation of the two steps within its bf16 steps."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from kiln.core.backends.numpy import _precision as np_bf16

    n, v, c = 37, 53, 24
    monkeypatch.setattr(_ops, "LOGITS_TILE", tile_rows * v)
    dl, x, w, t = _inputs(n, v, c, -100, seed=1)
    dl *= 0.1
    got = _fused(emulated, _ops.fused_lm_head_loss_and_grad_bf16, dl, x, w, t, "bfloat16", ignore_index=-100)
    a = {"ignore_index": -100, "chunk_size": 16, "softcap": None}
    plain = _two_steps(emulated, _ops.fused_lm_head_loss_bf16, _ops.fused_lm_head_loss_backward_bf16, dl, x,
                       w, t, "bfloat16", **a)
    for name, g, p in zip(("loss", "lse", "d_x", "d_weight"), got, plain, strict=True):
        assert np.array_equal(g, p), name
    for g in got[2:]:  # the gradients are bf16 values
        assert np.array_equal(g, g.astype(ml_dtypes.bfloat16).astype(np.float32))
    xb, wb = (a_.astype(ml_dtypes.bfloat16).astype(np.float32) for a_ in (x, w))
    loss, lse = np_bf16.fused_lm_head_loss_bf16(xb, wb, t, **a)
    d_x, d_w = np_bf16.fused_lm_head_loss_backward_bf16(dl, xb, wb, t, lse, None, **a)
    assert np.abs(got[0] - loss).max() <= 1e-5 and np.abs(got[1] - lse).max() <= 1e-5
    for g, want in ((got[2], d_x), (got[3], d_w)):  # fp32 sums in another order: one bf16 step at most
        assert np.abs(g - want).max() <= 2 ** -7 * float(np.abs(want).max())


@pytest.mark.parametrize("fn", [_ops.fused_lm_head_loss_and_grad, _ops.fused_lm_head_loss_and_grad_bf16])
def test_attributes_beyond_numpys_fused_pass_are_refused(emulated: EmulatedDevice, fn) -> None:
    dl, x, w, t = _inputs(5, 11, 4, -100)
    with pytest.raises(KilnError, match=r"takes the attribute ignore_index alone .* found softcap"):
        _fused(emulated, fn, dl, x, w, t, ignore_index=-100, softcap=2.0)


def test_a_float64_operand_is_refused(emulated: EmulatedDevice) -> None:
    dl, x, w, t = _inputs(5, 11, 4, -100)
    with pytest.raises(KilnError, match="compute in float32; found a float64"):
        _fused(emulated, _ops.fused_lm_head_loss_and_grad, dl, x.astype(np.float64), w, t, ignore_index=-100)


@pytest.mark.gpu
@pytest.mark.parametrize("blas", [True, False], ids=["cublaslt", "simt"])
def test_fused_pass_on_a_gpu(monkeypatch: pytest.MonkeyPatch, blas: bool) -> None:
    """``nox -s gpu``: on the device (cuBLASLt's GEMMs, or the SIMT matmul), the pass against the two steps
    on the same device and the ops' float64 kernels, in four ragged tiles."""
    from kiln.cuda import _device

    ok, why = _device.device_status()
    if not ok:
        pytest.skip(f"needs a CUDA GPU: {why}")
    gpu = _device.CudaDevice()
    if not blas:
        monkeypatch.setattr(gpu, "blas", None)
    n, v, c = 301, 1000, 64
    monkeypatch.setattr(_ops, "LOGITS_TILE", 80 * v)
    dl, x, w, t = _inputs(n, v, c, -100)
    got = _fused(gpu, _ops.fused_lm_head_loss_and_grad, dl, x, w, t, ignore_index=-100)
    plain = _two_steps(gpu, _ops.fused_lm_head_loss, _ops.fused_lm_head_loss_backward, dl, x, w, t,
                       ignore_index=-100)
    for name, a, b, r in zip(("loss", "lse", "d_x", "d_weight"), got, plain, _reference(dl, x, w, t, -100),
                             strict=True):
        scale = max(1.0, float(np.abs(r).max()))
        assert np.abs(a - b).max() <= 1e-6 * scale and np.abs(a - r).max() <= 1e-4 * scale, name


# --- in a Program ---------------------------------------------------------------------------------


class Launches(EmulatedDevice):
    """The emulator, counting the launches of each kernel."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.counts: dict[str, int] = {}

    def launch(self, name: str, *args: object) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1
        super().launch(name, *args)


@pytest.fixture(scope="module")
def bundle():
    dsl = pytest.importorskip("kiln.dsl", reason="the Qwen3 model comes from kiln-dsl")
    from kiln.dsl.stdlib.models import Qwen3Model

    return dsl.build_bundle(Qwen3Model, CONFIG)


@pytest.fixture
def device(cache: Path):
    dev = Launches(cache=cache / "emulated")
    with PluginSession(autoload=False).activate() as s:
        s.register(EmulatedCuda(dev), "cuda-emulated")
        yield dev


def _executables(program, n: int) -> list:
    """``n`` Executables of ``program`` on arenas of the same random contents (valid targets)."""
    backend = get_registry("backends")["cuda"]
    exes = [backend.compile(program, backend.allocate(program.arena_bytes), None) for _ in range(n)]
    rng = np.random.default_rng(0)
    for name, t in program.tensors.items():
        if t.dtype.startswith("int"):
            value = rng.integers(0, 8, t.shape)
        else:
            value = rng.standard_normal(t.shape) * 0.1
        for exe in exes:
            exe.write(name, value)
    return exes


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_cuda_program_runs_the_fused_pass(bundle, device: Launches, precision: str) -> None:
    """``compile`` plans the fusion for ``cuda``; forward and backward run together run it (one kernel for
    the loss and the logits' gradient, one logits product fewer), a run of each phase alone runs the two
    steps, and both leave the same bits in every tensor."""
    if precision == "bf16":
        pytest.importorskip("ml_dtypes")
    program = compile(bundle, bindings={"B": 2, "T": 8}, backend="cuda", precision=precision)
    (fusion,) = program.fusions
    dtype = "bfloat16" if precision == "bf16" else "float32"  # the pass computes as the head's steps
    assert fusion.kind == FUSED and fusion.kernel == f"{FUSED}@cuda:{dtype}"
    fwd, bwd = (program.steps[i] for i in fusion.steps)
    assert (fwd.op.type, bwd.op.type) == ("fused_lm_head_loss", "fused_lm_head_loss_backward")
    fused, plain = _executables(program, 2)
    assert fused.train_runs is not None
    assert len(fused.train_runs) == len(fused.runs["forward"]) + len(fused.runs["backward"]) - 1
    before = dict(device.counts)
    fused.run(("forward", "backward"))
    ran = {k: n - before.get(k, 0) for k, n in device.counts.items()}
    before = dict(device.counts)
    plain.run(("forward",))
    plain.run(("backward",))
    apart = {k: n - before.get(k, 0) for k, n in device.counts.items()}
    kernel = "lm_head_loss_grad_bf16" if precision == "bf16" else "lm_head_loss_grad_f32"
    matmul = "matmul_bf16" if precision == "bf16" else "matmul_f32"
    assert ran.get(kernel) == 1
    assert not ran.get("cross_entropy_f32") and not ran.get("cross_entropy_backward_f32")
    assert not apart.get(kernel) and apart["cross_entropy_f32"] == apart["cross_entropy_backward_f32"] == 1
    assert apart[matmul] - ran[matmul] == 1  # the backward's recompute of the logits
    for name in program.tensors:  # the same bits
        assert fused.read(name).tobytes() == plain.read(name).tobytes(), name


def test_training_on_cuda_matches_the_numpy_fused_pass(bundle, device: Launches) -> None:
    """Ignored labels among them: the loss and every gradient equal NumPy's (which fuses the head too)."""
    labels = np.arange(1, 17).reshape(2, 8) % 64
    labels[:, -3:] = -100
    batch = (np.arange(16).reshape(2, 8) % 64, labels)
    want_loss, want = Model.from_ir(bundle, seed=0, backend="numpy").loss_and_grads(*batch)
    loss, got = Model.from_ir(bundle, seed=0, backend="cuda").loss_and_grads(*batch)
    assert device.counts.get("lm_head_loss_grad_f32") == 1
    assert loss == pytest.approx(want_loss, rel=1e-6)
    for name in want:
        assert np.abs(got[name] - want[name]).max() <= 1e-5 * max(1.0, float(np.abs(want[name]).max())), name


@pytest.mark.parametrize("tile_rows", [16, 3])
def test_the_fused_pass_workspace_is_one_tile(bundle, device: Launches, monkeypatch: pytest.MonkeyPatch,
                                              tile_rows: int) -> None:
    """The pass runs in the arena slot planned for it (the backward step's, live during that step alone),
    which holds one tile of logits, whatever the number of tiles: 16 rows of 64 logits in one tile, or
    in six of (at most) 3 rows; the run stays inside it and allocates nothing."""
    monkeypatch.setattr(_ops, "LOGITS_TILE", tile_rows * CONFIG["vocab_size"])
    program = compile(bundle, bindings={"B": 2, "T": 8}, backend="cuda")
    (fusion,) = program.fusions
    slots = {sl.name: sl for sl in program.slots}
    tile = tile_rows * CONFIG["vocab_size"] * 4  # float32 logits
    slot = slots[f"workspace.{fusion.steps[-1]}"]
    assert tile <= slot.nbytes < tile + 2 * ALIGN
    (exe,) = _executables(program, 1)
    ws = exe.planned[fusion.steps[-1]]
    allocs = device.allocs
    exe.run(("forward", "backward"))
    assert device.allocs == allocs and device.counts["lm_head_loss_grad_f32"] == -(-16 // tile_rows)
    assert tile <= ws.high <= ws.nbytes and ws.overflows == 0


def test_the_roofline_counts_one_logits_product_fewer(bundle, device: Launches) -> None:
    """``kiln plan --device h100``'s roofline runs the fusion as one step: its FLOPs are the two steps'
    less one product over the logits (2 N V C), and it predicts less time than the same Program unfused."""
    import attrs

    from kiln.cuda._roofline import roofline

    program = compile(bundle, bindings={"B": 2, "T": 8}, backend="cuda")
    apart = attrs.evolve(program, fusions=())
    for matmul in ("fp32", "bf16"):
        fused, plain = roofline(program, "h100", matmul), roofline(apart, "h100", matmul)
        n, v, c = 2 * 8, CONFIG["vocab_size"], CONFIG["d_model"]
        total = [sum(row[2] for row in r.by_op.values()) for r in (plain, fused)]
        assert total[0] - total[1] == pytest.approx(2.0 * n * v * c)
        assert fused.by_op[FUSED][1] == 1 and "fused_lm_head_loss" not in fused.by_op
        assert plain.by_op["fused_lm_head_loss"][1] == plain.by_op["fused_lm_head_loss_backward"][1] == 1
        assert fused.seconds < plain.seconds


def test_no_fusion_when_a_fused_op_runs_on_the_host(bundle, cache: Path) -> None:
    """With the LM head's backward kernel left out (it runs its reference on the host), no fused kernel is
    registered and ``compile`` plans the two steps."""
    with PluginSession(autoload=False).activate() as s:
        s.register(EmulatedCuda(EmulatedDevice(cache=cache / "emulated"),
                                without=("fused_lm_head_loss_backward",)), "cuda-emulated")
        assert f"{FUSED}@cuda:float32" not in get_registry("kernels")
        program = compile(bundle, bindings={"B": 2, "T": 8}, backend="cuda")
    assert program.fusions == ()
    assert [st.kernel for st in program.steps if st.op.type == "fused_lm_head_loss_backward"] == [""]
