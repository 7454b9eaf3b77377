"""Every kernel source compiles with NVRTC to CUBIN for sm_80 and sm_90; the launch code's argument
packing matches each CUBIN's parameter layout (read back with cuobjdump) and the emulator's; the
on-disk cache hits and misses when it should."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from kiln.core import KilnError
from kiln.cuda import _cubin, _nvrtc, _specs
from kiln.cuda._specs import SPECS, KernelSpec, pack

ARCHS = ("sm_80", "sm_90")

FILES = [p.name for p in _specs.sources()]


def _declared(file: str) -> set[str]:
    return set(re.findall(r'extern "C" __global__ void (\w+)\(', (_specs.KERNEL_DIR / file).read_text()))


@pytest.mark.parametrize("file", FILES)
def test_every_kernel_has_a_launch_spec(file: str) -> None:
    assert _declared(file) == {name for name, s in SPECS.items() if s.file == file}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("file", FILES)
def test_compiles_to_cubin_with_the_launch_layout(cubins: dict, file: str, arch: str) -> None:
    cubin = cubins[file, arch]
    assert cubin[:4] == b"\x7fELF"  # machine code, not PTX text
    assert _cubin.arch_of(cubin) == arch
    layouts = _cubin.param_layouts(cubin)
    kernels = {name for name, s in SPECS.items() if s.file == file}
    assert set(layouts) == kernels
    for name in kernels:
        assert layouts[name] == SPECS[name].layout(), name
    spills = {name: r.local for name, r in _cubin.resources(cubin).items() if r.local}
    assert spills == {}  # no local memory: no register spills


def test_a_wrong_launch_spec_is_caught(cubins: dict) -> None:
    # rope_f32 with one int too many: the layout the launch code would pack no longer matches
    wrong = KernelSpec("rope_f32", "rope.cu", "ppppiiiiiifiii")
    assert _cubin.param_layouts(cubins["rope.cu", "sm_90"])["rope_f32"] != wrong.layout()


def test_emulator_parameter_sizes_match_the_specs(emulated) -> None:
    for name, s in SPECS.items():
        if s.emulated:
            assert emulated.param_sizes(name) == [size for _, size in s.layout()], name
    assert {s.emulated for s in SPECS.values()} == {True, False}  # tensor-core kernels are not emulated


def test_pack_checks_the_argument_count() -> None:
    with pytest.raises(KilnError, match="takes 3 arguments"):
        pack("fill_f32", (0, 1.0))
    packed = pack("fill_f32", (4096, 2.5, 7))
    assert [v.value for v in packed.values] == [4096, 2.5, 7]


def test_disk_cache_hits_and_misses(tmp_path: Path) -> None:
    pytest.importorskip("cuda.core")
    first = _nvrtc.compile_cubin("softmax.cu", "sm_90", cache=tmp_path)
    again = _nvrtc.compile_cubin("softmax.cu", "sm_90", cache=tmp_path)
    assert (first.cached, again.cached) == (False, True)
    assert again.cubin == first.cubin and again.path == first.path
    option = _nvrtc.compile_cubin("softmax.cu", "sm_90", {"lineinfo": True}, cache=tmp_path)
    arch = _nvrtc.compile_cubin("softmax.cu", "sm_80", cache=tmp_path)
    assert not option.cached and not arch.cached
    assert len({first.path, option.path, arch.path}) == 3
    assert _nvrtc.compile_cubin("softmax.cu", "sm_90", {"lineinfo": True}, cache=tmp_path).cached


def test_a_changed_header_compiles_again(tmp_path: Path) -> None:
    pytest.importorskip("cuda.core")
    src = tmp_path / "src"
    shutil.copytree(_specs.KERNEL_DIR, src)
    cache = tmp_path / "cache"
    assert not _nvrtc.compile_cubin(src / "softmax.cu", "sm_90", cache=cache).cached
    header = src / "common.cuh"
    header.write_text(header.read_text() + "\n// changed\n")
    assert not _nvrtc.compile_cubin(src / "softmax.cu", "sm_90", cache=cache).cached


def test_a_compile_error_names_the_file(tmp_path: Path) -> None:
    pytest.importorskip("cuda.core")
    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" __global__ void k(float* x) { x[0] = undefined_name; }\n')
    with pytest.raises(KilnError, match=r"NVRTC could not compile bad\.cu for sm_90"):
        _nvrtc.compile_cubin(bad, "sm_90", cache=tmp_path)


def test_tensor_core_kernels_compile_for_sm100_where_nvrtc_has_it(tmp_path: Path) -> None:
    """Blackwell still runs mma.sync: the tiled attention compiles for sm_100 with the launch layout."""
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    err, archs = nvrtc.nvrtcGetSupportedArchs()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS or 100 not in archs:
        pytest.skip(f"this NVRTC does not compile for sm_100 ({archs})")
    cubin = _nvrtc.compile_cubin("attention_mma.cu", "sm_100", cache=tmp_path).cubin
    assert _cubin.arch_of(cubin) == "sm_100"
    layouts = _cubin.param_layouts(cubin)
    tc = {name for name, s in SPECS.items() if s.file == "attention_mma.cu"}
    assert set(layouts) == tc and all(layouts[n] == SPECS[n].layout() for n in tc)
    assert not any(r.local for r in _cubin.resources(cubin).values())
