"""The LM head's loss and gradient in one pass on ``cuda`` (the Program's fusion
``fused_lm_head_loss_and_grad``), on the CPU emulator: the same bits as the forward and backward steps it
replaces (the same kernels' sums, in the same order, one logits product fewer), the NumPy backend's fused
pass and the op's float64 reference within float32 rounding, and one tile of logits in its workspace; tiled
over the vocabulary too (two passes: an online log-sum-exp, then the logits again and their gradient),
the same within float32 rounding; and the roofline model that picks the tiling."""

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


# --- tiled over the vocabulary too -------------------------------------------------------------------


def _plan(monkeypatch: pytest.MonkeyPatch, rows: int, chunk: int) -> None:
    monkeypatch.setattr(_ops, "_head_plan", lambda n, v, c, matmul: (rows, chunk))


class _Counting:
    """Counts an emulated device's kernel launches (wrapping its ``launch``)."""

    def __init__(self, dev: EmulatedDevice, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: dict[str, int] = {}
        launch = dev.launch

        def counted(name: str, *args: object) -> None:
            self.counts[name] = self.counts.get(name, 0) + 1
            launch(name, *args)

        monkeypatch.setattr(dev, "launch", counted)


# 13 rows in blocks of 5 (the last of 3) or 13; 301 words in chunks of 64 (the last of 45) or 100 (the last 1)
@pytest.mark.parametrize(("rows", "chunk"), [(5, 64), (13, 100)])
@pytest.mark.parametrize("ignore_index", [-100, 7])
def test_vocab_tiled_pass_matches_numpy_and_the_one_pass(emulated: EmulatedDevice,
                                                         monkeypatch: pytest.MonkeyPatch, rows: int,
                                                         chunk: int, ignore_index: int) -> None:
    """Two passes over row blocks and vocabulary chunks (online log-sum-exp, then the logits again and their
    gradient): NumPy's fused pass and the ops' float64 kernels within float32 rounding, today's one-pass
    tiling within float32 rounding, targets at the chunks' edges and in the ragged last chunk."""
    n, v, c = 13, 301, 24
    dl, x, w, t = _inputs(n, v, c, ignore_index, seed=3)
    t[1], t[2], t[3], t[5] = chunk - 1, chunk, v - 1, 2 * chunk
    _plan(monkeypatch, n, v)
    one = _fused(emulated, _ops.fused_lm_head_loss_and_grad, dl, x, w, t, ignore_index=ignore_index)
    _plan(monkeypatch, rows, chunk)
    counting = _Counting(emulated, monkeypatch)
    got = _fused(emulated, _ops.fused_lm_head_loss_and_grad, dl, x, w, t, ignore_index=ignore_index)
    blocks, chunks = -(-n // rows), -(-v // chunk)
    counts = counting.counts
    assert counts["lm_head_lse_chunk_f32"] == counts["lm_head_grad_chunk_f32"] == blocks * chunks
    assert counts["lm_head_lse_done_f32"] == blocks and "lm_head_loss_grad_f32" not in counts
    assert np.all(got[0][t == ignore_index] == 0) and np.all(got[0][t != ignore_index] > 0)
    numpy = [np.full(n, np.nan, np.float32), np.full(n, np.nan, np.float32), np.zeros((n, c), np.float32),
             np.zeros((v, c), np.float32)]
    numpy_fused(dl, x, w, t, loss=numpy[0], lse=numpy[1], d_x=numpy[2], d_weight=numpy[3],
                ignore_index=ignore_index)
    want = _reference(dl, x, w, t, ignore_index)
    for name, a, b, o, r in zip(("loss", "lse", "d_x", "d_weight"), got, numpy, one, want, strict=True):
        scale = max(1.0, float(np.abs(r).max()))
        assert np.abs(a - r).max() <= 2e-5 * scale, name
        assert np.abs(a - b).max() <= 2e-5 * scale, name
        assert np.abs(a - o).max() <= 2e-5 * scale, name


def test_vocab_tiled_pass_target_outside_the_vocabulary_is_nan(emulated: EmulatedDevice,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """As the one-pass kernel: a target outside [0, V) (and not ignore_index) gives a NaN loss."""
    dl, x, w, t = _inputs(6, 50, 8, -100)
    t[2], t[4] = 50, -3
    _plan(monkeypatch, 4, 16)
    loss = _fused(emulated, _ops.fused_lm_head_loss_and_grad, dl, x, w, t, ignore_index=-100)[0]
    assert np.isnan(loss[[2, 4]]).all() and np.isfinite(np.delete(loss, [2, 4])).all()


@pytest.mark.parametrize(("rows", "chunk"), [(37, 53), (8, 16)])
def test_bf16_vocab_tiled_pass_keeps_the_rounding_points(emulated: EmulatedDevice,
                                                         monkeypatch: pytest.MonkeyPatch, rows: int,
                                                         chunk: int) -> None:
    """Under the bf16 recipe the two-pass tiling rounds where the one pass rounds: the plan (37, 53) is the
    one pass itself (the same bits as the recipe's two steps); in blocks of 8 rows and chunks of 16 words
    (53 = 3 x 16 + 5) the gradients are bf16 values within one bf16 step of the one pass's and of NumPy's
    bf16 emulation of the two steps (the log-sum-exp's float32 sums run in another order)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from kiln.core.backends.numpy import _precision as np_bf16

    n, v, c = 37, 53, 24
    dl, x, w, t = _inputs(n, v, c, -100, seed=1)
    dl *= 0.1
    a = {"ignore_index": -100, "chunk_size": 16, "softcap": None}
    plain = _two_steps(emulated, _ops.fused_lm_head_loss_bf16, _ops.fused_lm_head_loss_backward_bf16, dl, x,
                       w, t, "bfloat16", **a)
    _plan(monkeypatch, rows, chunk)
    got = _fused(emulated, _ops.fused_lm_head_loss_and_grad_bf16, dl, x, w, t, "bfloat16", ignore_index=-100)
    if chunk >= v:
        for name, g, p in zip(("loss", "lse", "d_x", "d_weight"), got, plain, strict=True):
            assert np.array_equal(g, p), name
    for g in got[2:]:
        assert np.array_equal(g, g.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert np.abs(got[0] - plain[0]).max() <= 1e-5 and np.abs(got[1] - plain[1]).max() <= 1e-5
    xb, wb = (a_.astype(ml_dtypes.bfloat16).astype(np.float32) for a_ in (x, w))
    loss, lse = np_bf16.fused_lm_head_loss_bf16(xb, wb, t, **a)
    d_x, d_w = np_bf16.fused_lm_head_loss_backward_bf16(dl, xb, wb, t, lse, None, **a)
    assert np.abs(got[0] - loss).max() <= 1e-5 and np.abs(got[1] - lse).max() <= 1e-5
    for g, p, want in ((got[2], plain[2], d_x), (got[3], plain[3], d_w)):
        assert np.abs(g - want).max() <= 2 ** -7 * float(np.abs(want).max())
        assert np.abs(g - p).max() <= 2 ** -7 * float(np.abs(p).max())


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
@pytest.mark.parametrize("tiled", [False, True], ids=["one-pass", "vocab-tiled"])
@pytest.mark.parametrize("blas", [True, False], ids=["cublaslt", "simt"])
def test_fused_pass_on_a_gpu(monkeypatch: pytest.MonkeyPatch, blas: bool, tiled: bool) -> None:
    """``nox -s gpu``: on the device (cuBLASLt's GEMMs, or the SIMT matmul), the pass against the two steps
    on the same device and the ops' float64 kernels, in four ragged tiles (or, tiled over the vocabulary,
    row blocks of 80 and chunks of 256 words: the two steps within float32 rounding)."""
    from kiln.cuda import _device

    ok, why = _device.device_status()
    if not ok:
        pytest.skip(f"needs a CUDA GPU: {why}")
    gpu = _device.CudaDevice()
    if not blas:
        monkeypatch.setattr(gpu, "blas", None)
    n, v, c = 301, 1000, 64
    monkeypatch.setattr(_ops, "LOGITS_TILE", 80 * v)
    if tiled:
        _plan(monkeypatch, 80, 256)
    dl, x, w, t = _inputs(n, v, c, -100)
    got = _fused(gpu, _ops.fused_lm_head_loss_and_grad, dl, x, w, t, ignore_index=-100)
    plain = _two_steps(gpu, _ops.fused_lm_head_loss, _ops.fused_lm_head_loss_backward, dl, x, w, t,
                       ignore_index=-100)
    for name, a, b, r in zip(("loss", "lse", "d_x", "d_weight"), got, plain, _reference(dl, x, w, t, -100),
                             strict=True):
        scale = max(1.0, float(np.abs(r).max()))
        assert np.abs(a - b).max() <= (2e-5 if tiled else 1e-6) * scale, name
        assert np.abs(a - r).max() <= 1e-4 * scale, name


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

    def products(counts: dict[str, int]) -> int:  # the matmul kernel and its variants (operand and out types)
        return sum(n for k, n in counts.items() if k == matmul or k.startswith(matmul + "_"))

    assert products(apart) - products(ran) == 1  # the backward's recompute of the logits
    # the same bits; the optimizer's scratch (live in the optimizer phase alone) shares the arena with the
    # steps' temporaries, which differ between the fused pass and the two steps
    for name in (n for n in program.tensors if n != "optimizer.workspace"):
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


def test_the_vocab_tiled_pass_workspace_is_one_tile(bundle, device: Launches,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiled over the vocabulary too (16 rows in blocks of 3, 64 words in chunks of 16), the pass runs in its
    planned slot (sized for it and for the two steps it stands for) using one tile of 3 x 16 logits and
    one row of running sums, and allocates nothing: six row blocks of four chunks, each chunk's logits
    computed in each of the two passes; the loss and gradients those of the one-pass tiling within float32
    rounding."""
    _plan(monkeypatch, 3, 16)
    monkeypatch.setattr(_ops, "LOGITS_TILE", 3 * 16)  # the two steps' tiles (of one row) no larger
    program = compile(bundle, bindings={"B": 2, "T": 8}, backend="cuda")
    (fusion,) = program.fusions
    slot = {sl.name: sl for sl in program.slots}[f"workspace.{fusion.steps[-1]}"]
    tile, sums = 3 * 16 * 4, 3 * 4
    (exe,) = _executables(program, 1)
    ws = exe.planned[fusion.steps[-1]]
    allocs = device.allocs
    exe.run(("forward", "backward"))
    assert device.allocs == allocs and ws.overflows == 0
    assert tile + sums <= ws.high < tile + sums + 2 * ALIGN and ws.high <= slot.nbytes
    assert device.counts["lm_head_lse_chunk_f32"] == device.counts["lm_head_grad_chunk_f32"] == 6 * 4
    assert "lm_head_loss_grad_f32" not in device.counts
    tiled = {name: exe.read(name) for name in program.tensors if name.startswith(("grad", "d_", "loss"))}
    assert tiled
    _plan(monkeypatch, 16, 64)
    (one,) = _executables(program, 1)
    one.run(("forward", "backward"))
    for name, got in tiled.items():
        want = one.read(name)
        assert np.abs(got - want).max() <= 2e-5 * max(1.0, float(np.abs(want).max())), name


def test_the_roofline_counts_one_logits_product_fewer(bundle, device: Launches) -> None:
    """``kiln plan --device h100``'s roofline runs the fusion as one step, priced kernel by kernel in the
    tiling the pass runs (a vocabulary of 64: one pass): three products over the logits (2 N V C FLOPs
    each: the logits, d_x, d_w) where the two steps run four, and less time than the same Program unfused."""
    import attrs

    from kiln.cuda._roofline import roofline

    program = compile(bundle, bindings={"B": 2, "T": 8}, backend="cuda")
    apart = attrs.evolve(program, fusions=())
    n, v, c = 2 * 8, CONFIG["vocab_size"], CONFIG["d_model"]
    for matmul in ("fp32", "bf16"):
        fused, plain = roofline(program, "h100", matmul), roofline(apart, "h100", matmul)
        assert fused.by_op[FUSED][1] == 1 and "fused_lm_head_loss" not in fused.by_op
        assert fused.by_op[FUSED][2] == 3 * 2.0 * n * v * c
        steps = plain.by_op["fused_lm_head_loss"][2] + plain.by_op["fused_lm_head_loss_backward"][2]
        assert steps >= 4 * 2.0 * n * v * c
        assert plain.by_op["fused_lm_head_loss"][1] == plain.by_op["fused_lm_head_loss_backward"][1] == 1
        assert fused.seconds < plain.seconds


def test_the_lm_head_cost_counts_every_kernel() -> None:
    """:func:`lm_head_cost` against a count by hand (float32 bytes; all memory-bound at these sizes): N = 2,
    V = 4, C = 3 in one pass (the logits, the loss-and-gradient kernel, d_x, d_w: 4 launches), and in
    two passes over chunks of 2 words (per chunk the logits twice, the two row kernels, d_x, d_w; then the
    log-sum-exp's finish: 13 launches, one product more)."""
    from kiln.cuda._roofline import DEVICES, lm_head_cost

    h100 = DEVICES["h100"]
    # one pass: z = x w^T 4 (6 + 12 + 8); the kernel reads and writes z 8 * 8; d_x 4 (8 + 12 + 6);
    # d_w 4 (8 + 6 + 12)
    one = 104 + 64 + 104 + 104
    assert lm_head_cost(2, 4, 3, 2, 4) == pytest.approx((one / h100.bandwidth + 4 * h100.launch, 144.0, one))
    # per chunk: logits twice 2 * 4 (6 + 6 + 4), lse reads z 4 * 4, the gradient 8 * 4, d_w 4 (4 + 6 + 6);
    # d_x 4 (4 + 6 + 6) for the first chunk, + 4 * 6 (read d_x) for the second; the finish 16 * 2
    chunk = 128 + 16 + 32 + 64
    two = 2 * chunk + 64 + 88 + 32
    assert lm_head_cost(2, 4, 3, 2, 2) == pytest.approx((two / h100.bandwidth + 13 * h100.launch, 192.0, two))
    # a second row block accumulates into d_w: it reads d_w (4 x 3 floats) as well
    assert lm_head_cost(4, 4, 3, 2, 4)[2] == pytest.approx(2 * one + 4 * 12)


def test_the_plan_tiles_the_vocabulary_where_it_is_predicted_faster() -> None:
    """A small vocabulary keeps the one pass; Qwen3-0.6B's LM head (151936 words, hidden 1024, 8192 rows)
    runs two passes over row blocks of at least 1024 rows under bf16 tensor cores, predicted several times
    faster than the one pass of 27 rows (whose products sweep w and d_w about 300 times)."""
    from kiln.cuda._roofline import lm_head_cost, lm_head_plan

    assert lm_head_plan(16, 64, 32, 1 << 22) == (16, 64)
    assert lm_head_plan(8192, 32000, 1024, 1 << 25, "h100", "bf16") == ((1 << 25) // 32000, 32000)
    n, v, c, tile = 8192, 151936, 1024, 1 << 22
    rows, chunk = lm_head_plan(n, v, c, tile, "h100", "bf16")
    assert chunk < v and rows >= 1024 and rows * chunk <= tile
    two = lm_head_cost(n, v, c, rows, chunk, "h100", "bf16")
    one = lm_head_cost(n, v, c, 27, v, "h100", "bf16")
    assert two[0] * 4 < one[0] and two[1] == pytest.approx(4 / 3 * one[1])  # one product over the logits more
    assert two[2] * 8 < one[2]


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
