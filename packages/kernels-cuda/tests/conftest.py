"""Session fixtures: every kernel source compiled once per architecture, the CPU emulator built once."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.cuda import _nvrtc, _specs
from kiln.cuda._emulate import EmulatedDevice, compiler

ARCHS = ("sm_80", "sm_90")


def _nvrtc_or_skip() -> None:
    try:
        _nvrtc.nvrtc_version()
    except Exception as e:  # pragma: no cover - NVRTC installs from PyPI with the package
        pytest.skip(f"NVRTC cannot be loaded here: {e}")


@pytest.fixture(scope="session")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kiln-cuda-cache")


@pytest.fixture(scope="session")
def cubins(cache: Path) -> dict[tuple[str, str], bytes]:
    """(source file, arch) -> CUBIN, compiled by NVRTC into a fresh cache."""
    _nvrtc_or_skip()
    return {(src.name, arch): _nvrtc.compile_cubin(src.name, arch, cache=cache).cubin
            for src in _specs.sources() for arch in ARCHS}


@pytest.fixture(scope="session")
def emulated(cache: Path) -> EmulatedDevice:
    if compiler() is None:
        pytest.skip("the CUDA emulator needs g++")
    return EmulatedDevice(cache=cache / "emulated")
