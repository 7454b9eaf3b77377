"""Reading a CUBIN with ``cuobjdump`` (pip package ``nvidia-cuda-cuobjdump``): each kernel's parameter
layout and its resource use (registers, local memory: spills)."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import attrs

from kiln.core import KilnError

_WHEEL_FOLDERS = ("nvidia.cu13", "nvidia.cuda_cuobjdump")


def cuobjdump() -> Path | None:
    """The ``cuobjdump`` executable of NVIDIA's wheel, else one on PATH, else None."""
    for name in _WHEEL_FOLDERS:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        for folder in (spec and spec.submodule_search_locations) or ():
            exe = Path(folder) / "bin" / "cuobjdump"
            if exe.exists():
                return exe
    found = shutil.which("cuobjdump")
    return Path(found) if found else None


def _run(cubin: bytes, *flags: str) -> str:
    exe = cuobjdump()
    if exe is None:
        raise KilnError("cuobjdump is not installed: pip install nvidia-cuda-cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        done = subprocess.run([str(exe), *flags, f.name], capture_output=True, text=True, timeout=60)
    if done.returncode:
        raise KilnError(f"cuobjdump {' '.join(flags)} failed: {done.stderr.strip()}")
    return done.stdout


_SECTION = re.compile(r"^\.nv\.info\.(\w+)\s*$", re.M)
_KPARAM = re.compile(r"EIATTR_KPARAM_INFO.*?Ordinal\s*:\s*0x([0-9a-f]+)\s+Offset\s*:\s*0x([0-9a-f]+)\s+"
                     r"Size\s*:\s*0x([0-9a-f]+)", re.S)


def param_layouts(cubin: bytes) -> dict[str, list[tuple[int, int]]]:
    """Per kernel, (offset, size) of each parameter by ordinal, from the ELF's ``.nv.info.<kernel>``."""
    text = _run(cubin, "-elf")
    marks = list(_SECTION.finditer(text))
    out: dict[str, list[tuple[int, int]]] = {}
    for m, nxt in zip(marks, [*marks[1:], None], strict=True):
        body = text[m.end():nxt.start() if nxt else len(text)]
        params = {int(o, 16): (int(off, 16), int(size, 16)) for o, off, size in _KPARAM.findall(body)}
        out[m.group(1)] = [params[i] for i in sorted(params)]
    return out


@attrs.frozen
class Resources:
    registers: int
    stack: int
    local: int  # spills and local arrays: 0 in a kernel without spills
    shared: int


_RES = re.compile(r"Function (\w+):\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def resources(cubin: bytes) -> dict[str, Resources]:
    return {name: Resources(int(reg), int(stack), int(local), int(shared))
            for name, reg, stack, shared, local in _RES.findall(_run(cubin, "-res-usage"))}


def arch_of(cubin: bytes) -> str:
    """The architecture a CUBIN holds machine code for (``"sm_90"``)."""
    found = re.search(r"\bsm=(\d+)", _run(cubin, "-elf"))
    if found is None:
        raise KilnError("cuobjdump names no architecture for this CUBIN")
    return f"sm_{found.group(1)}"
