"""Compiling kernel sources to CUBIN with NVRTC (through ``cuda.core``), cached on disk.

A CUBIN is machine code for one architecture (``sm_80``, ``sm_90``): NVRTC produces it directly, so
no PTX goes through the driver's JIT (a newer NVRTC's PTX is rejected by an older driver). The cache
key is the SHA-256 of the source and the headers it may include, the architecture, the NVRTC version
and the compile options; a change of any of them compiles again.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from kiln.core import KilnError
from kiln.cuda._specs import KERNEL_DIR

#: options every kernel is compiled with (cuda.core ProgramOptions keywords)
BASE_OPTIONS: dict[str, Any] = {"std": "c++17"}


@attrs.frozen
class Compiled:
    """A CUBIN: its bytes, where the cache keeps it, and whether it came from the cache."""

    cubin: bytes
    path: Path
    cached: bool


def cache_dir() -> Path:
    """``$KILN_CUDA_CACHE``, else ``$XDG_CACHE_HOME/kiln/cuda``, else ``~/.cache/kiln/cuda``."""
    if os.environ.get("KILN_CUDA_CACHE"):
        return Path(os.environ["KILN_CUDA_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kiln" / "cuda"


def nvrtc_version() -> tuple[int, int]:
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:
        raise KilnError("NVRTC is not installed: pip install kiln-kernels-cuda brings cuda-python and "
                        f"nvidia-cuda-nvrtc ({e})") from e
    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise KilnError(f"NVRTC does not load: {err!r}")
    return int(major), int(minor)


def source_hash(path: Path, include_dir: Path | None = None) -> str:
    """SHA-256 of the source and every header beside it (``*.cuh``) it may include."""
    folder = include_dir or path.parent
    h = hashlib.sha256(path.read_bytes())
    for header in sorted(folder.glob("*.cuh")):
        h.update(header.name.encode() + b"\0" + header.read_bytes())
    return h.hexdigest()


def compile_cubin(path: Path | str, arch: str, options: Mapping[str, Any] | None = None, *,
                  cache: Path | None = None, include_dir: Path | None = None) -> Compiled:
    """The CUBIN of kernel source ``path`` (a name in the package's kernel folder, or a path) for
    ``arch`` (``"sm_90"``), from the cache when it has it."""
    path = Path(path) if Path(path).is_absolute() else KERNEL_DIR / path
    include_dir = include_dir or path.parent
    opts = {**BASE_OPTIONS, **(options or {})}
    key = hashlib.sha256(json.dumps({"source": source_hash(path, include_dir), "arch": arch,
                                     "nvrtc": nvrtc_version(), "options": sorted(opts.items())},
                                    default=str).encode()).hexdigest()[:24]
    target = (cache or cache_dir()) / f"{path.stem}-{arch}-{key}.cubin"
    if target.exists():
        return Compiled(target.read_bytes(), target, True)
    from cuda.core import Program, ProgramOptions

    program = Program(path.read_text(), "c++", ProgramOptions(
        arch=arch, include_path=[str(include_dir)], name=path.name, **opts))
    try:
        code = program.compile("cubin")
    except Exception as e:  # NVRTC's compile log comes with the exception
        raise KilnError(f"NVRTC could not compile {path.name} for {arch}: {e}") from e
    cubin = bytes(code.code)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(cubin)
    tmp.replace(target)  # atomic: a concurrent reader sees the whole file or none
    return Compiled(cubin, target, False)
