"""What `tools/gpu_run.sh` found after installing the bundle: the Python, the GPU, where each kiln
package was imported from, kiln's requirements against what the machine has, and the plugins that
registered. Exits 1 when kiln is not the bundle's or its `cuda` backend or `nccl` communicator did not
register through their entry points, so the runner stops before spending device time on tests.

    python tools/gpu_preflight.py --site /tmp/site
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

#: Extras of kiln packages that a GPU run uses; the others (torch, parquet, ...) are not checked.
GPU_EXTRAS = {"blas", "nccl", "bf16"}


def _installed(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _within(dist: md.Distribution, folder: Path) -> bool:
    return Path(str(dist.locate_file(""))).resolve().is_relative_to(folder)


def requirements(dists: list[md.Distribution]) -> list[str]:
    """One line per third-party requirement of the kiln packages: what is installed, and whether it fits."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # the GPU image has packaging; without it, versions are shown unchecked
        Requirement = None  # type: ignore[assignment,misc]
    lines = []
    for dist in dists:
        for text in dist.requires or ():
            extra = re.search(r"""extra\s*==\s*["']([\w-]+)["']""", text)
            if extra and extra[1] not in GPU_EXTRAS:
                continue
            name = re.split(r"[\s\[<>=!~;(]", text, maxsplit=1)[0]
            if name.startswith("kiln-"):
                continue
            version = _installed(name)
            if version is None:
                verdict = "MISSING"
            elif Requirement is None:
                verdict = "unchecked"
            else:
                spec = Requirement(text.split(";")[0]).specifier
                verdict = "ok" if spec.contains(version, prereleases=True) else f"MISMATCH: needs {spec}"
            lines.append(f"  {dist.metadata['Name']:<18} {name:<24} {version or '-':<12} {verdict}")
    return lines


def mpi_library() -> str:
    """The MPI library mpi4py loads (the bundle's MPICH, through LD_LIBRARY_PATH), or why none loads.
    Not a failure of the preflight: only kiln-dist's tests need it."""
    try:
        import mpi4py

        mpi4py.rc.initialize = False  # the library's name needs no MPI_Init
        from mpi4py import MPI

        return str(MPI.Get_library_version()).strip().splitlines()[0]
    except Exception as e:  # ImportError, or mpi4py's own error when no libmpi loads
        return f"FAILED: {type(e).__name__}: {e}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, required=True, help="the prefix the bundle was installed into")
    site = parser.parse_args(argv).site.resolve()
    failures: list[str] = []

    print(f"python {platform.python_version()} at {sys.executable}")
    smi = shutil.which("nvidia-smi")
    gpus = subprocess.run([smi, "-L"], capture_output=True, text=True).stdout.strip() if smi else ""
    print(f"GPUs: {gpus or 'none (nvidia-smi: ' + ('no GPU listed' if smi else 'not found') + ')'}")

    first: dict[str, md.Distribution] = {}  # the copy Python uses: the first on sys.path
    shadowed: list[md.Distribution] = []
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name.startswith("kiln-") and name in first:
            shadowed.append(dist)
        elif name.startswith("kiln-"):
            first[name] = dist
    dists = [first[name] for name in sorted(first)]
    bundled = {d.metadata["Name"] for d in (*dists, *shadowed) if _within(d, site)}
    print("kiln packages:")
    for dist in dists:
        where = Path(str(dist.locate_file(""))).resolve()
        print(f"  {dist.metadata['Name']:<18} {dist.version:<8} {where}")
        if dist.metadata["Name"] in bundled and not where.is_relative_to(site):
            failures.append(f"{dist.metadata['Name']} is found at {where} before the bundle's in {site}")
    for dist in shadowed:
        where = dist.locate_file("")
        print(f"  (unused, later on sys.path: {dist.metadata['Name']} {dist.version} at {where})")
    if "kiln-core" not in bundled:
        failures.append(f"kiln-core is not installed under {site} (PYTHONPATH should name the bundle's "
                        f"site-packages there)")
    print("requirements (installed version; the bundle carries only what the image lacks):")
    print("\n".join(requirements(dists)))

    if "kiln-core" in bundled:
        import kiln.core
        from kiln.core import get_registry

        if not Path(kiln.core.__file__).resolve().is_relative_to(site):
            failures.append(f"kiln.core is imported from {kiln.core.__file__}, not from the bundle")
        backends = get_registry("backends")
        communicators = get_registry("communicators")
        print(f"backends: {', '.join(sorted(backends))}")
        print(f"communicators: {', '.join(sorted(communicators))}")
        if "cuda" not in backends:
            failures.append("the cuda backend did not register (is kiln-kernels-cuda's entry point seen?)")
        else:
            from kiln.cuda import unavailable_reason

            reason = unavailable_reason()
            print(f"cuda: {'available' if reason is None else 'unavailable: ' + reason}")
        if importlib.util.find_spec("nccl") is not None and "nccl" not in communicators:
            failures.append("nccl4py is installed but the nccl communicator did not register")
        print(f"mpi: {mpi_library()}")

    for failure in failures:
        print(f"PREFLIGHT FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
