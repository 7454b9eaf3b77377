"""Every kernel's launch, run through the CPU emulator (the same .cu source under g++, a fiber per CUDA
thread), against its op's NumPy reference on random shapes, ragged ones among them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kiln.core import KilnError
from kiln.cuda import _ops, _specs
from kiln.cuda._check import CASES, run_case
from kiln.cuda._emulate import EmulatedDevice
from kiln.cuda._ops import KERNELS


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
def test_kernel_matches_numpy_reference(emulated: EmulatedDevice, case) -> None:
    assert run_case(case, emulated) <= case.atol


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
