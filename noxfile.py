"""Developer and CI entry points: `nox` runs the tests; `nox -l` lists every session."""

import tomllib
from pathlib import Path

import nox
from packaging.requirements import Requirement

nox.needs_version = ">=2024.3.2"  # first release that understands "uv|virtualenv"
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["tests"]

ROOT = Path(__file__).parent
PYPROJECTS = {p.parent.name: tomllib.loads(p.read_text()) for p in ROOT.glob("packages/*/pyproject.toml")}
PACKAGES = {folder: data["project"] for folder, data in PYPROJECTS.items()}
BUILD_REQUIRES = sorted({r for data in PYPROJECTS.values() for r in data["build-system"]["requires"]})
FOLDER_OF = {project["name"]: folder for folder, project in PACKAGES.items()}
FIXTURE_PLUGIN = "tests/plugins/kiln_fixture_plugin"
#: scipy: the exact recompute solver the planner is proven against; pyarrow, tensorboardX and
#: tensorboard: kiln-hf's optional Parquet and TensorBoard paths (tensorboard reads the event files back);
#: ml-dtypes: kiln-core's bf16 extra (the bf16 precision recipe's tests, kiln-core alone included)
TEST_TOOLS = ("pytest", "hypothesis", "import-linter", "scipy", "pyarrow", "tensorboardX", "tensorboard",
              "ml-dtypes")


def _with_kiln_dependencies(folder: str) -> list[str]:
    """`folder` and the folders of every kiln package it depends on, transitively, dependencies first."""
    found: list[str] = []

    def visit(name: str) -> None:
        for requirement in PACKAGES[name].get("dependencies", []):
            dependency = FOLDER_OF.get(Requirement(requirement).name)
            if dependency and dependency not in found:
                visit(dependency)
        found.append(name)

    visit(folder)
    return [f"packages/{name}" for name in found]


def _install_editable(session: nox.Session, *extra: str) -> None:
    """Every package editable, plus `extra` requirements and editable folders given as ("-e", path)."""
    # Building in this venv instead of one isolated build env per package: ~25 s less per run.
    session.install(*BUILD_REQUIRES, "editables")  # hatchling needs editables for editable wheels
    packages = [arg for folder in sorted(PACKAGES) for arg in ("-e", f"packages/{folder}")]
    session.install("--no-build-isolation", *packages, *extra)


@nox.session(reuse_venv=True)
def tests(session: nox.Session) -> None:
    """Every package and the fixture plugin installed editable; pytest over all test folders."""
    _install_editable(session, "-e", FIXTURE_PLUGIN, *TEST_TOOLS)
    # testpaths and addopts (--import-mode=importlib -p no:cacheprovider) come from pyproject.toml.
    session.run("pytest", *session.posargs)


@nox.session
@nox.parametrize("folder", sorted(PACKAGES), ids=sorted(PACKAGES))
def tests_package(session: nox.Session, folder: str) -> None:
    """One package with only its declared kiln dependencies, in a fresh venv: installing a subset works."""
    session.install(*_with_kiln_dependencies(folder), *TEST_TOOLS)
    tests = ROOT / "packages" / folder / "tests"
    has_tests = any(tests.rglob("test_*.py")) or any(tests.rglob("*_test.py"))
    # pytest exits 5 when it collects nothing: fine for a package without tests yet, not otherwise.
    session.run("pytest", str(tests), *session.posargs, success_codes=[0] if has_tests else [0, 5])


@nox.session(reuse_venv=True, venv_backend="venv")
def parity(session: nox.Session) -> None:
    """Tests marked `parity`: kiln against PyTorch/transformers/peft on tiny models made in the tests.

    pip (the venv backend) because the CPU build of torch==2.13.0 is found by pip only; uv would
    download a multi-GB CUDA build.
    """
    _install_editable(session, "-e", FIXTURE_PLUGIN, *TEST_TOOLS, "torch==2.13.0", "transformers", "peft")
    session.run("pytest", "-m", "parity", *session.posargs)


@nox.session(reuse_venv=True, venv_backend="venv")
def bench(session: nox.Session) -> None:
    """One training step of kiln's NumPy backend (with kiln-kernels-cpu's native kernels, and without)
    against transformers eager and torch.compile, interleaved (benchmarks/run.py).

    Arguments go to run.py (`nox -s bench -- --quick`). pip for the CPU build of torch, as in `parity`.
    """
    _install_editable(session, "torch==2.13.0", "transformers", "threadpoolctl")
    session.run("python", "benchmarks/run.py", *session.posargs)


@nox.session(reuse_venv=True)
def lint(session: nox.Session) -> None:
    """ruff over all code; mypy --strict over kiln.core and kiln.cpu; import-linter's layers (pyproject)."""
    # bf16: kiln.core's bf16 paths import ml_dtypes; types-cffi: kiln.cpu builds its kernels through
    # cffi, which ships no types of its own
    session.install("ruff", "mypy", "import-linter", "types-cffi", "-e", "packages/core[bf16]",
                    "-e", "packages/kernels-cpu")
    session.run("ruff", "check", *session.posargs)
    session.run("mypy", "--strict", "-p", "kiln.core")
    session.run("mypy", "--strict", "-p", "kiln.cpu")
    session.run("lint-imports")


@nox.session(reuse_venv=True)
def demo(session: nox.Session) -> None:
    """Install every package and run kiln's main job on the NumPy backend (no GPU needed)."""
    _install_editable(session)
    session.run("kiln", "demo")


@nox.session(reuse_venv=True)
def gpu(session: nox.Session) -> None:
    """The GPU tests (`-m gpu`): kiln-kernels-cuda's kernels against the NumPy reference on the device and
    training on `cuda` against `numpy`; skipped with the reason where there is no GPU."""
    _install_editable(session, *TEST_TOOLS)
    session.install("nvmath-python[cu13]>=1.0", "ml-dtypes")  # kiln-kernels-cuda's cuBLASLt path, bf16 cases
    # kiln-dist's nccl tests: nccl4py (the `nccl` extra) and CuPy for CUDA 13, their device buffers
    session.install("--no-build-isolation", "-e", "packages/dist[nccl]", "cupy-cuda13x>=14")
    session.run("pytest", "-m", "gpu", "-rs", *session.posargs)


@nox.session(name="bench-gpu", reuse_venv=True)
def bench_gpu(session: nox.Session) -> None:
    """A training step of a Qwen3-0.6B-shaped model on kiln's `cuda` backend (fp32 and bf16 recipes)
    against transformers eager and torch.compile on the same GPU (packages/kernels-cuda/bench/bench_gpu.py;
    docs/performance.md, "GPU (bench-gpu)"). Arguments go to the script (`-- --dry-run`: no GPU needed)."""
    _install_editable(session, "torch", "transformers", "nvmath-python[cu13]>=1.0", "ml-dtypes")
    session.run("python", "packages/kernels-cuda/bench/bench_gpu.py", *session.posargs)


@nox.session(name="bench-dist", reuse_venv=True)
def bench_dist(session: nox.Session) -> None:
    """Two data-parallel MPI ranks against one process on this machine's cores (benchmarks/dist.py)."""
    _install_editable(session)
    session.run("python", "benchmarks/dist.py", *session.posargs)


@nox.session(reuse_venv=True)
def dist(session: nox.Session) -> None:
    """kiln-dist's multi-rank tests on 4 MPI ranks (the default run uses 2)."""
    _install_editable(session, *TEST_TOOLS)
    session.run("pytest", "packages/dist/tests", *session.posargs, env={"KILN_DIST_RANKS": "4"})


@nox.session(name="gpu-bundle", reuse_venv=True)
def gpu_bundle(session: nox.Session) -> None:
    """Fill .gpu/ with the wheels a GPU machine without network needs (tools/gpu_bundle.py): kiln's own,
    built here, and the third-party ones its image lacks, for CPython 3.12. Carry .gpu there and run
    tools/gpu_run.sh (docs/cuda.md, "Running on a GPU machine"). Arguments go to the script."""
    # pip: the script's builder and downloader (uv's venvs have none); hatchling: no isolated build env
    session.install("pip", *BUILD_REQUIRES)
    session.run("python", "tools/gpu_bundle.py", *session.posargs)


@nox.session(name="gpu-bundle-check", reuse_venv=True)
def gpu_bundle_check(session: nox.Session) -> None:
    """tests/test_gpu_bundle.py in full: a bundle for this Python (downloads), installed with --no-index
    beside a stand-in for the GPU image, and the runner's steps there (every GPU test skips, saying why)."""
    _install_editable(session, "pip", *TEST_TOOLS)  # pip: the bundle's builder, and the runner's installer
    session.run("pytest", "tests/test_gpu_bundle.py", "-rs", *session.posargs,
                env={"KILN_GPU_BUNDLE_FULL": "1"})
