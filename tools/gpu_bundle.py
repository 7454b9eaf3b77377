"""Fill `.gpu/` with what kiln needs on a GPU machine that has no network: every kiln package as a wheel,
built here from the source tree, and the third-party wheels that machine's image lacks.

The GPU machines lent to a session (see docs/cuda.md, "Running on a GPU machine") run Python 3.12 with
PyTorch, CuPy, cuda-python, NVRTC, NCCL, mpi4py, numpy, attrs, pluggy, pytest, ... already installed,
and reach no package index: whatever else kiln imports travels as wheels in a folder named in the
call's `carry`, together with the working tree, at most 64 MiB. `tools/gpu_run.sh` installs them there.

    python tools/gpu_bundle.py                         # for the GPU machine (CPython 3.12, manylinux x86-64)
    python tools/gpu_bundle.py --python-version 3.11   # for this interpreter (tests/test_gpu_bundle.py)
    python tools/gpu_bundle.py --no-download           # kiln's own wheels only: no network
    python tools/gpu_bundle.py --extra cuda-core==1.2.2  # and one more wheel (repeatable)

Standard library only, and pip; the kiln wheels are built by hatchling in this interpreter where it is
installed (`nox -s gpu-bundle` installs it), else by pip in an isolated build environment (network).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The carry limit of one call: the working tree that travels plus the carried folders.
LIMIT_MIB = 64.0

#: Wheels the GPU machines' image lacks (checked against its package list, docs/cuda.md), with the kiln
#: package that needs each. Pinned, so a bundle made on another day installs the same code.
#: Present there and so not carried: numpy, attrs, pluggy, threadpoolctl, ml-dtypes, mpi4py,
#: cuda-bindings, cuda-core, cuda-pathfinder, nvidia-cuda-nvrtc, nvidia-cublas, nvidia-nccl-cu13, cupy,
#: jinja2, safetensors, tokenizers, setuptools, packaging, pytest, pytest-timeout, hypothesis, scipy.
MISSING = {
    "lark==1.3.1": "kiln-dsl-text: the text model language's parser",
    "cffi==2.1.1": "kiln-embed, kiln-kernels-cpu: compile their C through cffi",
    "pycparser==3.12": "cffi's C parser",
    "mpich==5.0.2": "kiln-dist: mpiexec and libmpi for mpi4py (the pin of kiln-dist's pyproject)",
    "nvidia-cuda-cuobjdump==13.5.37": "kiln-kernels-cuda: CUBIN parameter layouts (`kiln cuda check`)",
    "nvmath-python==1.0.0": "kiln-kernels-cuda[blas]: matmuls and grouped GEMMs on cuBLASLt",
    "nccl4py==0.6.0": "kiln-dist[nccl]: the `nccl` communicator",
}
#: Platform tags pip must match exactly for a binary wheel (pip download --platform), newest first.
MANYLINUX = ("manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


def kiln_packages() -> list[Path]:
    """Every folder under packages/ with a pyproject.toml: one wheel each."""
    return sorted(p.parent for p in (ROOT / "packages").glob("*/pyproject.toml"))


def _pip(*args: str) -> None:
    command = [sys.executable, "-m", "pip", *args]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"gpu_bundle: {' '.join(command)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")


def build_kiln_wheels(out: Path) -> None:
    """Wheels of every kiln package (pure Python, hatchling) into `out`: through hatchling's PEP 517 hook
    in this process where hatchling is installed (no network; a second instead of a subprocess per
    package), else through `pip wheel` and an isolated build environment."""
    try:
        from hatchling.build import build_wheel
    except ImportError:
        _pip("wheel", "-q", "--no-deps", "-w", str(out), *map(str, kiln_packages()))
        return
    here = Path.cwd()
    try:
        for folder in kiln_packages():
            os.chdir(folder)  # the hook builds the project in the working directory
            build_wheel(str(out))
    finally:
        os.chdir(here)


def download_missing(out: Path, python_version: str, extra: list[str]) -> None:
    """The pinned third-party wheels of MISSING, and `extra`, for CPython `python_version` on manylinux
    x86-64."""
    platforms = [arg for tag in MANYLINUX for arg in ("--platform", tag)]
    _pip("download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", python_version,
         "--implementation", "cp", *platforms, "-d", str(out), *MISSING, *extra)


def tree_bytes() -> int:
    """Bytes of the working tree that travels with every call: tracked and untracked, not ignored."""
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    return sum(f.stat().st_size for name in listed.split("\0") if name and (f := ROOT / name).is_file())


def check_wheels(out: Path) -> list[Path]:
    """The bundle's wheels, refusing two versions of one distribution (pip would refuse to install)."""
    wheels = sorted(out.glob("*.whl"))
    seen: dict[str, str] = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            z.testzip()  # a truncated download fails here, not on the GPU machine
        name = wheel.name.split("-")[0].lower().replace("_", "-").replace(".", "-")
        if name in seen:
            sys.exit(f"gpu_bundle: {out} holds two wheels of {name}: {seen[name]} and {wheel.name}")
        seen[name] = wheel.name
    return wheels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu", help="the folder to fill (default .gpu)")
    parser.add_argument("--python-version", default="3.12",
                        help="CPython of the machine that installs it (default 3.12, the GPU image's)")
    parser.add_argument("--no-download", action="store_true",
                        help="build kiln's own wheels only, download nothing")
    parser.add_argument("--extra", action="append", default=[], metavar="NAME==VERSION",
                        help="one more wheel to carry (repeatable): what env.txt there calls MISSING "
                             "or MISMATCH")
    parser.add_argument("--limit-mib", type=float, default=LIMIT_MIB,
                        help="what the working tree and the bundle may weigh together (default 64)")
    args = parser.parse_args(argv)

    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):  # one version of each distribution: start empty
        old.unlink()
    start = time.perf_counter()
    build_kiln_wheels(out)
    if not args.no_download:
        download_missing(out, args.python_version, args.extra)
    wheels = check_wheels(out)

    bundle = sum(w.stat().st_size for w in wheels)
    tree = tree_bytes()  # .gpu/ itself is ignored by git, so not counted twice
    mib = 1024 * 1024
    width = max(len(w.name) for w in wheels)
    for wheel in wheels:
        print(f"{wheel.name:<{width}}  {wheel.stat().st_size / mib:7.2f} MiB")
    total = (bundle + tree) / mib
    print(f"{len(wheels)} wheels, {bundle / mib:.2f} MiB in {out}; with the working tree "
          f"({tree / mib:.2f} MiB) {total:.2f} MiB of the {args.limit_mib:g} MiB a call carries "
          f"({time.perf_counter() - start:.0f} s)")
    if total > args.limit_mib:
        print(f"gpu_bundle: {total:.2f} MiB is over the {args.limit_mib:g} MiB limit", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
