"""Every kernel's launch, run through the CPU emulator (the same .cu source under g++, a fiber per CUDA
thread), against its op's NumPy reference on random shapes, ragged ones among them."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.core import KilnError
from kiln.cuda import _ops, _specs
from kiln.cuda._check import CASES, run_case
from kiln.cuda._emulate import EmulatedDevice
from kiln.cuda._ops import KERNELS, DeviceArray

EMULATED = {name: case for name, case in CASES.items() if not case.gpu_only}


@pytest.mark.parametrize("case", EMULATED.values(), ids=list(EMULATED))
def test_kernel_matches_numpy_reference(emulated: EmulatedDevice, case) -> None:
    assert run_case(case, emulated) <= case.atol


def test_every_tensor_core_case_has_an_emulated_twin() -> None:
    gpu_only = [name for name, case in CASES.items() if case.gpu_only]
    assert gpu_only and all(name.replace("_tc-", "_twin-") in EMULATED for name in gpu_only)


def test_every_kernel_op_has_a_case() -> None:
    assert {c.op for c in CASES.values()} >= set(KERNELS) - {"ones", "zeros_like"}


def test_the_harness_catches_a_missing_syncthreads(emulated: EmulatedDevice, tmp_path: Path) -> None:
    """block_sum without the barrier between writing the per-warp parts and reading them: the emulator
    runs warp 0 on before the other warps wrote their parts, so the row sums (and rmsnorm) go wrong."""
    src = tmp_path / "kernels"
    shutil.copytree(Path(emulated.kernel_dir), src)
    header = src / "common.cuh"
    text = header.read_text()
    barrier = "    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;\n    __syncthreads();\n"
    assert text.count(barrier) == 2
    header.write_text(text.replace(barrier, barrier.replace("    __syncthreads();\n", ""), 1))
    broken = EmulatedDevice(kernel_dir=src, cache=tmp_path / "emulated")
    case = CASES["rmsnorm-wide"]  # 300 columns: 256 threads, 8 warps
    assert run_case(case, emulated) <= case.atol
    assert run_case(case, broken) > 1e-2


def test_lm_head_loss_in_many_row_tiles(emulated: EmulatedDevice, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four rows of logits per tile: 13 rows in four tiles, the last one ragged; d_weight sums them."""
    monkeypatch.setattr(_ops, "LOGITS_TILE", 4 * 301)
    assert _ops._head_tiles(13, 301) == [(0, 4), (4, 8), (8, 12), (12, 13)]
    for name in ("fused_lm_head_loss-capNone", "fused_lm_head_loss_backward-cap5.0"):
        assert run_case(CASES[name], emulated) <= CASES[name].atol


def _launches(device: EmulatedDevice, monkeypatch: pytest.MonkeyPatch,
              wrong: dict[str, tuple[int, Any]] | None = None) -> dict[str, int]:
    """Counts ``device``'s launches by kernel name; ``wrong`` maps a kernel name's prefix to (an argument's
    index, a function that spoils it) for every launch of it."""
    counts: dict[str, int] = {}
    launch = device.launch

    def counted(name: str, grid: Any, block: Any, args: Any) -> None:
        counts[name] = counts.get(name, 0) + 1
        for prefix, (i, spoil) in (wrong or {}).items():
            if name.startswith(prefix):
                args = [*args[:i], spoil(args[i]), *args[i + 1:]]
        launch(name, grid, block, args)

    monkeypatch.setattr(device, "launch", counted)
    return counts


#: the check's cases of the kernel variants that read their slots as they lie, and the kernels each runs
DIRECT = {
    # 13 rows in blocks of 5, 150 words in chunks of 64; one block of 13 rows, chunks of 40
    "fused_lm_head_loss_and_grad-vocab-tiled": {"lm_head_lse_chunk_f32": 3 * 3,
                                                "lm_head_grad_chunk_f32": 3 * 3, "lm_head_lse_done_f32": 3},
    "fused_lm_head_loss_and_grad-vocab-tiled-ignore7": {"lm_head_lse_chunk_f32": 4,
                                                        "lm_head_lse_done_f32": 1},
    # 21 rows in blocks of 8, 53 words in chunks of 16
    "fused_lm_head_loss_and_grad-vocab-tiled-bf16": {"lm_head_lse_chunk_bf16": 3 * 4,
                                                     "lm_head_grad_chunk_bf16": 3 * 4},
    **{f"matmul_bf16_{types}-{t}": {f"matmul_bf16_{types}": 1}
       for types in ("hhh", "hff", "hfh", "fhf", "fhh", "fff", "ffh") for t in ("NN", "NT", "TN", "TT")},
    "flash_attention_twin-f32-qkv-causal-gqa": {"flash_attention_twin64_bf16_f": 1},
    # (the bf16-qkv case's _hf kernels differ from these in qkv's load alone: not run again here)
    "flash_attention_backward_twin-f32-qkv-f32-grad-causal-gqa": {
        f"flash_attention_backward_{k}_twin64_bf16_ff": 1 for k in ("dq", "dkv")},
}


#: a spoiled launch of each kind: a vocabulary chunk one word narrower, K one short, the softmax scale doubled
SPOILED = {"lm_head_lse_chunk": (5, lambda w: w - 1), "matmul_bf16_": (6, lambda k: k - 1),
           "flash_attention_twin": (10, lambda s: 2 * s),
           "flash_attention_backward_dkv": (12, lambda s: 2 * s)}


@pytest.mark.parametrize("name", list(DIRECT))
def test_direct_cases_run_their_variant_and_can_fail(emulated: EmulatedDevice,
                                                     monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Each case runs the variant it stands for, as many times as its tiling says (the LM head's vocabulary
    really split into chunks: no one-pass kernel), and no cast (float32 operands are read as they lie); the
    case passes in ``test_kernel_matches_numpy_reference`` and fails here, where one argument of the
    variant's launch is wrong (a NaN, a value never written, fails too)."""
    counts = _launches(emulated, monkeypatch, SPOILED)
    assert not run_case(CASES[name], emulated) <= CASES[name].atol
    assert {k: counts.get(k) for k in DIRECT[name]} == DIRECT[name]
    assert not any(k.startswith(("lm_head_loss_grad", "cast_")) for k in counts), counts


def test_a_float32_operand_read_unrounded_fails_the_case(emulated: EmulatedDevice,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The float32-output matmul cases see whether the kernel rounds on load: the float32 kernel in its place
    (the same parameters, no rounding) is off by more than the case allows."""
    case = CASES["matmul_bf16_fff-NN"]
    launch = emulated.launch
    monkeypatch.setattr(emulated, "launch", lambda name, *a: launch(
        "matmul_f32" if name == "matmul_bf16_fff" else name, *a))
    assert run_case(case, emulated) > 100 * case.atol


def test_a_barrier_not_every_thread_reaches_is_reported(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Half a warp waits at __syncthreads while the other half waits at a shuffle: no barrier can open."""
    (tmp_path / "stuck.cu").write_text(
        'extern "C" __global__ void stuck_f32(float* x) {\n'
        "    if (threadIdx.x < 16) __syncthreads();\n"
        "    else x[threadIdx.x] = __shfl_xor_sync(0xffffffffu, x[threadIdx.x], 1);\n"
        "}\n")
    monkeypatch.setitem(_specs.SPECS, "stuck_f32", _specs.KernelSpec("stuck_f32", "stuck.cu", "p"))
    device = EmulatedDevice(kernel_dir=tmp_path, cache=tmp_path / "emulated")
    x = device.alloc(4 * 32)
    with pytest.raises(KilnError, match="'stuck_f32': a barrier that not every thread reaches"):
        device.launch("stuck_f32", (1,), (32,), (x,))


def test_casts_round_like_ml_dtypes(emulated: EmulatedDevice) -> None:
    """float32 -> bf16 -> float32 on the emulator, bit for bit against ml_dtypes' astype: random values and
    the hard ones (ties to even both ways, subnormals, the largest finite values, overflow, inf, NaN)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x00008000, 0x00018000, 0x7F7F8000, 0x7F7F7FFF,
                     0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0x00000001, 0x80000000],
                    np.uint32).view(np.float32)
    spread = (rng.standard_normal(997) * 10.0 ** rng.integers(-40, 38, 997)).astype(np.float32)
    bits = rng.integers(0, 2**32, 1000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([ties, spread, bits])
    dev = [DeviceArray(emulated, emulated.alloc(x.size * n), x.shape, t) for n, t in ((4, "float32"),
                                                                                     (2, "bfloat16"),
                                                                                     (4, "float32"))]
    emulated.copy_to_device(dev[0].ptr, x)
    _ops.cast(dev[0], out=(dev[1],))
    _ops.cast(dev[1], out=(dev[2],))
    half = emulated.copy_to_host(dev[1].ptr, x.size * 2).view(np.uint16)
    with np.errstate(invalid="ignore"):  # NaN inputs
        want = x.astype(ml_dtypes.bfloat16)
    nan = np.isnan(x)
    assert np.array_equal(half[~nan], want.view(np.uint16)[~nan])
    assert np.isnan(want.view(ml_dtypes.bfloat16)[nan].astype(np.float32)).all()
    assert np.isnan((half[nan].astype(np.uint32) << 16).view(np.float32)).all()
    back = emulated.copy_to_host(dev[2].ptr, x.size * 4).view(np.float32)
    assert np.array_equal(back[~nan], want.astype(np.float32)[~nan]) and np.isnan(back[nan]).all()


def test_cast_names_what_it_cannot_do(emulated: EmulatedDevice) -> None:
    x = DeviceArray(emulated, emulated.alloc(16), (4,), "float32")
    with pytest.raises(KilnError, match=r"no kernel from float32 to int32; kiln\.cuda casts float32 -> bf"):
        _ops.cast(x, out=(DeviceArray(emulated, emulated.alloc(16), (4,), "int32"),))
    with pytest.raises(KilnError, match=r"out \(2, 2\) must have x's shape \(4,\)"):
        _ops.cast(x, out=(DeviceArray(emulated, emulated.alloc(8), (2, 2), "bfloat16"),))


def test_multi_tensor_adamw_equals_one_launch_per_tensor(emulated: EmulatedDevice) -> None:
    """One launch over three tensors of ragged sizes gives the per-tensor kernel's bits (which the adamw
    case checks against NumPy)."""
    rng = np.random.default_rng(0)
    sizes = (301, 1, 77)
    state = [[(rng.standard_normal(n) * s).astype(np.float32) for s in (1.0, 1.0, 0.1, 0.1)] for n in sizes]
    for t in state:
        t[3] = np.abs(t[3])

    def on_device() -> list[list[DeviceArray]]:
        out = []
        for t in state:
            arrays = []
            for a in t:
                arrays.append(DeviceArray(emulated, emulated.alloc(a.nbytes), a.shape, "float32"))
                emulated.copy_to_device(arrays[-1].ptr, a)
            out.append(arrays)
        return out

    hyper = {"step": 3, "lr": 1e-2, "scale": 0.7, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
             "weight_decay": 0.1, "lr_scale": 0.5}
    one, many = on_device(), on_device()
    for p, g, m, v in one:
        _ops.adamw_update(p, g, m, v, **hyper)
    _ops.AdamwGroup(many)(**hyper)
    for a, b in zip([x for t in one for x in t], [x for t in many for x in t], strict=True):
        assert np.array_equal(emulated.copy_to_host(a.ptr, a.nbytes), emulated.copy_to_host(b.ptr, b.nbytes))


@pytest.mark.parametrize("name", ["swiglu_backward-bf16", "fused_lm_head_loss_backward-bf16-None",
                                  "fused_lm_head_loss_backward-bf16-3.0"])
def test_rounding_kernels_give_numpys_bits(emulated: EmulatedDevice, name: str) -> None:
    """The bf16 recipe's kernels that round inside the op, where no libm function or reduction order
    differs from NumPy's kernels: the same bits on the emulator (their cases allow a GPU's GEMM order)."""
    for seed in range(3):
        assert run_case(CASES[name], emulated, seed) == 0.0
