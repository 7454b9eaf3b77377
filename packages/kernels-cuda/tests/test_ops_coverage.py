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
    d = DeviceArray(device, device.alloc(max(a.nbytes, 4)), a.shape, str(a.dtype))
    device.copy_to_device(d.ptr, np.ascontiguousarray(a))
    return d


def _host(d: DeviceArray) -> np.ndarray:
    d.device.synchronize()
    return d.device.copy_to_host(d.ptr, d.nbytes).view(d.dtype).reshape(d.shape)


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


def test_bad_layout_input_names_the_culprit(emulated: EmulatedDevice) -> None:
    x = _on_device(emulated, np.zeros((3, 4), np.float32))
    with pytest.raises(KilnError, match=r"'split' on cuda: sizes \[1, 2\] do not split dim -1 of \(3, 4\)"):
        _ops.split(x, out=(x, x), sizes=(1, 2))
    half = DeviceArray(emulated, x.ptr, (3, 4), "bfloat16")
    with pytest.raises(KilnError, match=r"copy 32-bit elements .* found a bfloat16 tensor"):
        _ops.transpose(half, out=(DeviceArray(emulated, x.ptr, (4, 3), "bfloat16"),), dim0=0, dim1=1)
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
