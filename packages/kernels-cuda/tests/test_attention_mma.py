"""The tiled bf16 attention (attention_mma.cu): the launch code's checks, and the emulator catching a
wrong mma fragment layout in the SIMT twin (the cases themselves run in test_emulated.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from kiln.core import KilnError
from kiln.cuda._check import CASES, run_case
from kiln.cuda._emulate import EmulatedDevice
from kiln.cuda._ops import DeviceArray, flash_attention_mma, tensor_cores_available

HEADS = {"Hq": 2, "Hkv": 1, "D": 16}


def _qkv(device: EmulatedDevice, dtype: str = "bfloat16", d: int = 16) -> DeviceArray:
    shape = (1, 5, 4 * d)
    return DeviceArray(device, device.alloc(int(np.prod(shape)) * 4), shape, dtype)


def test_tensor_cores_need_sm80() -> None:
    class Gpu:
        def __init__(self, arch: str) -> None:
            self.arch = arch

    assert [tensor_cores_available(Gpu(a)) for a in ("sm_75", "sm_80", "sm_90", "sm_100", "emulated")] == [
        False, True, True, True, False]


def test_tensor_core_kernels_do_not_run_on_the_emulator(emulated: EmulatedDevice) -> None:
    with pytest.raises(KilnError, match=r"need a GPU of sm_80 or newer; device 'emulated'.*SIMT twin"):
        flash_attention_mma(_qkv(emulated), out=(None, None), **HEADS)
    with pytest.raises(KilnError, match="runs on tensor cores, on a GPU only"):
        emulated.launch("flash_attention_tc64_bf16", (1,), (128,), (0,) * 13)


@pytest.mark.parametrize(("dtype", "d", "extra", "message"), [
    ("float32", 16, {}, "read and write bf16; found a float32 tensor"),
    ("bfloat16", 136, {}, "head dim 136 > 128, the limit of the tiled bf16 kernels"),
    ("bfloat16", 16, {"softcap": 0.0}, "softcap must be > 0"),
    ("bfloat16", 16, {"window_size": 0}, "window_size must be >= 1"),
])
def test_bad_input_is_named(emulated: EmulatedDevice, dtype: str, d: int, extra: dict, message: str) -> None:
    with pytest.raises(KilnError, match=message):
        flash_attention_mma(_qkv(emulated, dtype, d), out=(None, None), tensor_cores=False,
                            **{**HEADS, "D": d, **extra})


def test_a_wrong_fragment_layout_is_caught(emulated: EmulatedDevice, tmp_path: Path) -> None:
    """The twin's mma reading B's column 2t + 1 from the lanes of column 2t: every other score column is a
    copy of its neighbour, and attention comes out wrong."""
    src = tmp_path / "kernels"
    shutil.copytree(Path(emulated.kernel_dir), src)
    header = src / "bf16.cuh"
    text = header.read_text()
    right = "unsigned b01 = __shfl_sync(FULL_MASK, b[0], 8 * t + 4 + s);"
    assert text.count(right) == 1
    header.write_text(text.replace(right, right.replace("8 * t + 4 + s", "8 * t + s")))
    broken = EmulatedDevice(kernel_dir=src, cache=tmp_path / "emulated")
    case = CASES["flash_attention_twin-full-softcap-alibi"]
    assert run_case(case, emulated) <= case.atol
    assert run_case(case, broken) > 0.1
