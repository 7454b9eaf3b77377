"""Every op of kiln-core's library runs on ``cuda`` without the host: a CUDA kernel, or a composition that
docs/cuda.md names; the norms' recompute variants replay their forward kernels' bits, so recompute plans
run on the device and give the gradients of keeping every activation."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from kiln.core import KilnError, Model, PluginSession, compile, get_registry, op_registry
from kiln.core.ops.library import core_ops
from kiln.cuda import EmulatedCuda, EmulatedDevice, _ops
from kiln.cuda._ops import COMPOSITIONS, KERNELS, DeviceArray

DOCS = Path(__file__).resolve().parents[3] / "docs" / "cuda.md"


def _uncovered(ops: set[str]) -> set[str]:
    return ops - set(KERNELS) - set(COMPOSITIONS)


def _core() -> set[str]:
    return {op.opdef.name for op in core_ops()}


def test_every_core_op_has_a_kernel_or_a_documented_composition() -> None:
    assert _uncovered(_core()) == set()
    assert _uncovered({*_core(), "a_new_core_op"}) == {"a_new_core_op"}  # a new op without a kernel fails


def test_the_compositions_are_aliases_the_planner_places_in_the_arena() -> None:
    """reshape, view and contiguous have no kernel: the planner makes their output a view of the input's
    storage (or a device copy into a slot of its own), which only an op of the alias trait gets."""
    assert not set(COMPOSITIONS) & set(KERNELS)
    assert all(op_registry().get_op(name).alias for name in COMPOSITIONS)


def _documented() -> set[str]:
    """The ops docs/cuda.md's kernel table names: ``op`` (and ``op_backward`` in a row that says "and
    backward" or "their backwards"), ``_down`` after ``moe_grouped_gemm_gate_up`` standing for
    ``moe_grouped_gemm_down``."""
    text = DOCS.read_text()
    section = text[text.index("## Ops: kernels and compositions"):]
    named: set[str] = set()
    for row in section[:section.index("\n## ", 1)].splitlines():
        if not row.startswith("| `"):
            continue
        first = row.split(" | ")[0]
        full = re.findall(r"`([a-z]\w*)`", first)
        named.update(full)
        if "backward" in first:
            named.update(f"{n}_backward" for n in full)
        for suffix in re.findall(r"`(_\w+)`", first):
            named.update(f"{n[:i]}{suffix}" for n in full for i in range(len(n)) if n[i] == "_")
    return named


def test_docs_name_every_core_op_in_the_kernel_table() -> None:
    assert _core() - _documented() == set()


def _on_device(device: EmulatedDevice, a: np.ndarray) -> DeviceArray:
    return DeviceArray.upload(device, a)


def _host(d: DeviceArray) -> np.ndarray:
    d.device.synchronize()
    return d.download()


@pytest.mark.parametrize("shape", [(2, 3, 77), (4, 300), (3, 1000)])
def test_the_apply_saved_variants_replay_the_forward_bit_for_bit(emulated: EmulatedDevice,
                                                                  shape: tuple[int, ...]) -> None:
    """The NumPy contract of recompute on ``cuda``: ``rmsnorm_apply_saved`` of the saved rstd gives the bits
    of ``rmsnorm``'s y, and ``fused_residual_rmsnorm_apply_saved`` those of the fused forward's sum and y
    (rows of 77: ragged warps; 300 and 1000: more columns than threads)."""
    rng = np.random.default_rng(sum(shape))
    res, x = (_on_device(emulated, rng.standard_normal(shape).astype(np.float32) * 3) for _ in range(2))
    w = _on_device(emulated, rng.standard_normal(shape[-1]).astype(np.float32))
    y, rstd, y2 = (_on_device(emulated, np.full(s, np.nan, np.float32)) for s in (shape, shape[:-1], shape))
    _ops.rmsnorm(x, w, out=(y, rstd), eps=1e-6)
    _ops.rmsnorm_apply_saved(x, rstd, w, out=(y2,))
    assert np.array_equal(_host(y2).view(np.uint32), _host(y).view(np.uint32))

    fwd = [_on_device(emulated, np.full(s, np.nan, np.float32)) for s in (shape, shape, shape[:-1])]
    _ops.fused_residual_rmsnorm(res, x, w, out=fwd, eps=1e-6)
    replay = [_on_device(emulated, np.full(shape, np.nan, np.float32)) for _ in range(2)]
    _ops.fused_residual_rmsnorm_apply_saved(res, x, fwd[2], w, out=replay)
    for got, want in zip(replay, fwd[:2], strict=True):
        assert np.array_equal(_host(got).view(np.uint32), _host(want).view(np.uint32))


CONFIG = {"vocab_size": 64, "d_model": 32, "n_layers": 1, "num_query_heads": 4, "num_kv_heads": 2,
          "head_size": 8, "d_ff": 64, "max_seq": 16}


@pytest.fixture(scope="module")
def bundle():
    dsl = pytest.importorskip("kiln.dsl", reason="the Qwen3 model comes from kiln-dsl")
    from kiln.dsl.stdlib.models import Qwen3Model

    return dsl.build_bundle(Qwen3Model, CONFIG)


def test_recompute_plans_run_on_the_device_with_the_gradients_of_keeping_all(bundle, cache: Path) -> None:
    """``block`` replays the fused residual norm (``fused_residual_rmsnorm_apply_saved``) and ``auto`` the
    norm of the kept sum (``rmsnorm_apply_saved``): both on their kernels, no step on the host (so the
    phases can be captured as a CUDA graph), and the gradients of keeping every activation, bit for bit."""
    rng = np.random.default_rng(0)
    batch = rng.integers(0, 64, (2, 8)), rng.integers(0, 64, (2, 8))
    with PluginSession(autoload=False).activate() as session:
        session.register(EmulatedCuda(EmulatedDevice(cache=cache / "emulated")), "cuda-emulated")
        want_loss, want = Model.from_ir(bundle, seed=0, backend="cuda").loss_and_grads(*batch)
        for recompute, variant in (("block", "fused_residual_rmsnorm_apply_saved"),
                                   ("auto", "rmsnorm_apply_saved")):
            program = compile(bundle, bindings={"B": 2, "T": 8}, backend="cuda", recompute=recompute)
            replayed = [s for s in program.steps if s.recompute and s.op.type == variant]
            assert replayed and all(s.kernel == f"{variant}@cuda:float32" for s in replayed)
            backend = get_registry("backends")["cuda"]
            exe = backend.compile(program, backend.allocate(program.arena_bytes), None)
            assert exe.host_steps == {}  # what keeps a phase out of a CUDA graph
            loss, grads = Model.from_ir(bundle, seed=0, backend="cuda",
                                        recompute=recompute).loss_and_grads(*batch)
            assert loss == want_loss
            for name in want:
                assert np.array_equal(grads[name], want[name]), (recompute, name)


def _launches(device: EmulatedDevice, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    names: list[str] = []
    launch = device.launch

    def record(name: str, *args: object) -> None:
        names.append(name)
        launch(name, *args)

    monkeypatch.setattr(device, "launch", record)
    return names


@pytest.mark.parametrize(("shape", "dims", "kernel"), [
    ((70, 45), (1, 0), "transpose_tiled_b32"),  # ragged tiles both ways
    ((5, 70, 33), (0, 2, 1), "transpose_tiled_b32"),  # a batch, more tiles than the grid holds (below)
    ((2, 3, 37, 5), (0, 1, 3, 2), "transpose_tiled_b32"),  # the batch dims merged into one
    ((2, 5, 7, 11), (0, 2, 3, 1), "transpose_tiled_b32"),  # channels last: a swap of two merged blocks
    ((3, 37, 5), (2, 1, 0), "strided_copy_b32"),  # the first and last axes: no tile (strided copy)
    ((2, 3, 37, 5), (0, 2, 1, 3), "strided_copy_b32"),  # rows kept contiguous
])
def test_a_swap_of_the_last_two_axes_runs_the_tiled_transpose(emulated: EmulatedDevice,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               shape: tuple[int, ...], dims: tuple[int, ...],
                                                               kernel: str) -> None:
    """The kernel chosen for a permutation, and its bits against NumPy's transpose (float32 and bf16: a
    copy, exact), with a grid of at most 2 blocks along y and z so that the tiled kernel's blocks loop over
    the rest."""
    monkeypatch.setattr(_ops, "GRID_YZ", 2)
    names = _launches(emulated, monkeypatch)
    x = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32)
    half = (x.view(np.uint32) >> 16).astype(np.uint16)  # bf16 bit patterns
    for dtype, bits in (("float32", x.view(np.uint32)), ("bfloat16", half)):
        names.clear()
        xd = _on_device(emulated, bits)
        o = _on_device(emulated, np.zeros(tuple(shape[d] for d in dims), bits.dtype))
        xd, o = (DeviceArray(emulated, a.ptr, a.shape, dtype) for a in (xd, o))
        _ops.permute(xd, out=(o,), dims=dims)
        assert names == [kernel.replace("b32", "b32" if dtype == "float32" else "b16")]
        emulated.synchronize()
        got = emulated.copy_to_host(o.ptr, o.nbytes).view(bits.dtype).reshape(o.shape)
        assert np.array_equal(got, np.transpose(bits, dims))


def test_bf16_layout_copies_take_no_widened_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the bf16 recipe the backend hands the layout kernels their bf16 slots as they are
    (``BF16_READS``): a bf16 transpose, concat, split or broadcast runs the 16-bit copy and takes no
    workspace; a float32 input into a bf16 output is cast first (its scratch: a bf16 copy of the input)."""
    from kiln.cuda._backend import _SizingDevice

    for fn in (_ops.transpose, _ops.permute, _ops.concat, _ops.split, _ops.broadcast_to):
        assert _ops.BF16_READS[fn] is fn
    sizing = _SizingDevice(None)
    names: list[str] = []
    monkeypatch.setattr(sizing, "launch", lambda name, *a: names.append(name))

    def t(shape: tuple[int, ...], dtype: str = "bfloat16") -> DeviceArray:
        return DeviceArray(sizing, 0, shape, dtype)

    _ops.transpose(t((64, 96)), out=(t((96, 64)),), dim0=0, dim1=1)
    _ops.concat(t((4, 3)), t((4, 5)), out=(t((4, 8)),), dim=1)
    _ops.split(t((4, 8)), out=(t((4, 3)), t((4, 5))), sizes=(3, 5), dim=1)
    _ops.broadcast_to(t((8,)), out=(t((4, 8)),), shape=(4, 8))
    assert sizing.high == 0
    assert names == ["transpose_tiled_b16", *["strided_copy_b16"] * 5]  # concat and split: a copy per part
    names.clear()
    _ops.concat(t((4, 3), "float32"), t((4, 5)), out=(t((4, 8)),), dim=1)
    assert names == ["cast_f32_bf16", "strided_copy_b16", "strided_copy_b16"]
    assert sizing.high == _ops._align(4 * 3 * 2)


def test_a_float32_input_concatenated_into_bf16_is_rounded_to_nearest_even(emulated: EmulatedDevice) -> None:
    """A bf16 slot of concat fed a float32 tensor and a bf16 one: the float32 values rounded as ml_dtypes
    rounds them (the store into bf16 of the widened path), the bf16 ones copied."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(3)
    a = (rng.standard_normal((3, 5)) * 100).astype(np.float32)
    b = rng.standard_normal((3, 2)).astype(ml_dtypes.bfloat16)
    ad, bd = _on_device(emulated, a), _on_device(emulated, b.view(np.uint16))
    o = _on_device(emulated, np.zeros((3, 7), np.uint16))
    bd, o = (DeviceArray(emulated, d.ptr, d.shape, "bfloat16") for d in (bd, o))
    _ops.concat(ad, bd, out=(o,), dim=1)
    emulated.synchronize()
    got = emulated.copy_to_host(o.ptr, o.nbytes).view(np.uint16).reshape(3, 7)
    want = np.concatenate([a.astype(ml_dtypes.bfloat16), b], axis=1).view(np.uint16)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_layout_and_reduce_kernels_compile_with_the_launch_layout_and_no_spills(cubins: dict,
                                                                                arch: str) -> None:
    from kiln.cuda import _cubin
    from kiln.cuda._specs import SPECS

    for file in ("layout.cu", "reduce.cu"):
        cubin = cubins[file, arch]
        layouts, resources = _cubin.param_layouts(cubin), _cubin.resources(cubin)
        names = [name for name, spec in SPECS.items() if spec.file == file]
        assert names
        for name in names:
            assert layouts[name] == SPECS[name].layout(), name
            assert resources[name].local == 0, name


@pytest.mark.parametrize(("shape", "axes"), [
    ((5000, 3), (0,)),  # three columns of 5000: 4 columns a block, 64 rows of threads
    ((2, 3001, 45), (1,)),  # a ragged second block of columns, two outer indices
    ((700, 4, 9), (0, 1)),  # two leading axes merged into R = 2800
])
@pytest.mark.parametrize("op", ["reduce_sum", "reduce_mean", "reduce_max"])
def test_long_columns_of_few_outputs_split_over_a_block(emulated: EmulatedDevice,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        shape: tuple[int, ...], axes: tuple[int, ...],
                                                        op: str) -> None:
    """A reduction over leading axes with few outputs and long columns runs ``reduce_cols_split_f32`` (rows of
    threads each folding every ``blockDim.y``-th row of its column, then a fixed tree), against NumPy in
    float64: the max exactly; the sum (and the mean, the sum over R) within the float32 bound of the order it
    runs, (R / rows + log2(rows) + 1) * 2^-24 * sum |x| per column (rows: the block's rows of threads), with
    the same bits on a second run; and with an outer index looped over by a grid of at most 2 blocks in y."""
    monkeypatch.setattr(_ops, "GRID_YZ", 2)
    names = _launches(emulated, monkeypatch)
    x = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
    r = int(np.prod([shape[a] for a in axes]))
    out_shape = tuple(n for i, n in enumerate(shape) if i not in axes)
    xd = _on_device(emulated, x)
    runs = []
    for _ in range(2):
        o = _on_device(emulated, np.full(out_shape, np.nan, np.float32))
        KERNELS[op][0](xd, out=(o,), axes=axes)
        runs.append(_host(o))
    assert names == ["reduce_cols_split_f32"] * 2
    assert np.array_equal(runs[0].view(np.uint32), runs[1].view(np.uint32))
    x64 = x.astype(np.float64)
    if op == "reduce_max":
        assert np.array_equal(runs[0], x.max(axis=axes))
        return
    inner = int(np.prod(shape[axes[-1] + 1:]))
    rows = _ops.COL_THREADS // min(32, 1 << (inner - 1).bit_length())
    bound = (r / rows + np.log2(rows) + 1) * 2.0 ** -24 * np.abs(x64).sum(axis=axes)
    want = x64.sum(axis=axes)
    if op == "reduce_mean":
        want, bound = want / r, bound / r + np.abs(want / r) * 2.0 ** -24  # and the division's rounding
    assert np.all(np.abs(runs[0] - want) <= bound)


def test_short_or_many_columns_keep_a_thread_per_output(emulated: EmulatedDevice,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Columns shorter than COL_SPLIT_R, or as many outputs as COL_SPLIT_OUTPUTS, run a thread per output."""
    names = _launches(emulated, monkeypatch)
    monkeypatch.setattr(_ops, "COL_SPLIT_OUTPUTS", 64)
    for shape in ((_ops.COL_SPLIT_R - 1, 3), (300, 64), (300, 63)):
        x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        o = _on_device(emulated, np.zeros(shape[1], np.float32))
        KERNELS["reduce_sum"][0](_on_device(emulated, x), out=(o,), axes=(0,))
        assert np.allclose(_host(o), x.astype(np.float64).sum(0), rtol=0, atol=1e-4)
    assert names == ["reduce_cols_f32", "reduce_cols_f32", "reduce_cols_split_f32"]


def test_bad_layout_input_names_the_culprit(emulated: EmulatedDevice) -> None:
    x = _on_device(emulated, np.zeros((3, 4), np.float32))
    with pytest.raises(KilnError, match=r"'split' on cuda: sizes \[1, 2\] do not split dim -1 of \(3, 4\)"):
        _ops.split(x, out=(x, x), sizes=(1, 2))
    double = DeviceArray(emulated, x.ptr, (3, 2), "float64")
    with pytest.raises(KilnError, match=r"copy 32-bit elements .* or 16-bit ones .*; found a float64 tensor"):
        _ops.transpose(double, out=(DeviceArray(emulated, x.ptr, (2, 3), "float64"),), dim0=0, dim1=1)
    half = DeviceArray(emulated, x.ptr, (4, 3), "bfloat16")
    with pytest.raises(KilnError, match=r"found a int32 tensor \(3, 4\) copied to a bfloat16 tensor"):
        _ops.transpose(DeviceArray(emulated, x.ptr, (3, 4), "int32"), out=(half,), dim0=0, dim1=1)
    wide = DeviceArray(emulated, x.ptr, (2, 3, 5), "float32")
    culprit = r"op 'broadcast_to' on cuda: \(3, 4\) does not broadcast to \(2, 3, 5\)"
    with pytest.raises(KilnError, match=culprit):
        _ops.broadcast_to(x, out=(wide,))
    empty = DeviceArray(emulated, x.ptr, (3, 0), "float32")
    with pytest.raises(KilnError, match="reduction over an empty axis has no max"):
        _ops.KERNELS["reduce_max"][0](empty, out=(DeviceArray(emulated, x.ptr, (3,), "float32"),), axes=(1,))


@pytest.mark.parametrize("model", ["GPTNeoXModel", "HyperConnectionModel"])
def test_models_of_the_former_host_ops_train_on_the_device_as_on_numpy(model: str, cache: Path) -> None:
    """GPT-NeoX (a parallel residual: ``add3``; biased linears: ``matmul_bias`` and the bias gradient's
    ``reduce_sum``; ``permute``) and hyper-connections (``broadcast_to``, ``concat``, ``split``, ``div``,
    ``sigmoid``): every step on a CUDA kernel, the loss and gradients of the NumPy backend."""
    dsl = pytest.importorskip("kiln.dsl", reason="the models come from kiln-dsl")
    from kiln.dsl.stdlib import models

    bundle = dsl.build_bundle(getattr(models, model), {**CONFIG, "n_layers": 1})
    rng = np.random.default_rng(1)
    batch = rng.integers(0, 64, (2, 8)), rng.integers(0, 64, (2, 8))
    with PluginSession(autoload=False).activate() as session:
        session.register(EmulatedCuda(EmulatedDevice(cache=cache / "emulated")), "cuda-emulated")
        ref, got = (Model.from_ir(bundle, seed=0, backend=b) for b in ("numpy", "cuda"))
        steps = [s for s in got.program(2, 8).steps if s.how not in ("alias", "copy")]
        assert all(s.kernel for s in steps), [s.op.type for s in steps if not s.kernel]
        (want_loss, want), (loss, have) = ref.loss_and_grads(*batch), got.loss_and_grads(*batch)
    assert loss == pytest.approx(want_loss, rel=1e-6)
    for name in want:
        assert np.abs(have[name] - want[name]).max() <= 1e-5 * max(1.0, np.abs(want[name]).max()), name


def test_gpt_neox_under_the_bf16_recipe_gives_the_numpy_emulations_loss(cache: Path) -> None:
    """Under ``bf16``, ``matmul_bias`` takes bf16 ``x`` and ``w`` (as ``matmul`` does) and the other new
    kernels run on float32 copies rounded where the recipe says: the NumPy backend's emulation gives the
    same loss bits, and gradients within a bf16 rounding step (summation orders differ)."""
    dsl = pytest.importorskip("kiln.dsl", reason="the model comes from kiln-dsl")
    pytest.importorskip("ml_dtypes")
    from kiln.dsl.stdlib.models import GPTNeoXModel

    bundle = dsl.build_bundle(GPTNeoXModel, {**CONFIG, "n_layers": 1})
    rng = np.random.default_rng(2)
    batch = rng.integers(0, 64, (2, 8)), rng.integers(0, 64, (2, 8))
    with PluginSession(autoload=False).activate() as session:
        session.register(EmulatedCuda(EmulatedDevice(cache=cache / "emulated")), "cuda-emulated")
        ref, got = (Model.from_ir(bundle, seed=0, backend=b, precision="bf16") for b in ("numpy", "cuda"))
        kernels = {s.kernel for s in got.program(2, 8).steps if s.op.type == "matmul_bias"}
        assert kernels == {"matmul_bias@cuda:bfloat16"}
        (want_loss, want), (loss, have) = ref.loss_and_grads(*batch), got.loss_and_grads(*batch)
    assert loss == want_loss
    for name in want:
        w, h = (np.asarray(a, np.float32) for a in (want[name], have[name]))
        assert np.abs(h - w).max() <= 2**-8 * np.abs(w).max(), name
