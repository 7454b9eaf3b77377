"""tools/gpu_bundle.py and tools/gpu_run.sh, the way to run kiln on a GPU machine without network
(docs/cuda.md, "Running on a GPU machine"), proved on this machine.

The runner runs in a fresh virtual environment standing in for the GPU image: it sees this
environment's third-party packages (numpy, pluggy, pytest, cuda-python, ...) through a folder of links,
minus every kiln package and minus whatever the bundle carries, so only the bundle can supply those.
The default run bundles kiln's own wheels (no network); `nox -s gpu-bundle-check` sets
KILN_GPU_BUNDLE_FULL=1 and also downloads the third-party wheels, for this interpreter's Python, and
runs the runner's three steps: `kiln cuda check`, `pytest -m gpu` (every test skipped, with its reason)
and the GPU benchmark.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import shlex
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from importlib.metadata import version
from pathlib import Path, PurePosixPath
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUNDLE_PY = ROOT / "tools" / "gpu_bundle.py"
RUNNER = ROOT / "tools" / "gpu_run.sh"
FULL = os.environ.get("KILN_GPU_BUNDLE_FULL") == "1"


def _load_bundle_module():
    spec = importlib.util.spec_from_file_location("kiln_gpu_bundle", BUNDLE_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _dist_name(wheel_or_dist_info: str) -> str:
    return _normal(wheel_or_dist_info.split("-")[0])


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundle") / ".gpu"
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    mode = ["--python-version", python] if FULL else ["--no-download"]
    done = subprocess.run([sys.executable, str(BUNDLE_PY), "--out", str(out), *mode],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "MiB of the 64 MiB a call carries" in done.stdout
    return out


def _image(tmp: Path, bundle: Path) -> Path:
    """A fresh venv whose Python sees this environment's packages, less kiln and less the bundle's."""
    carried = {_dist_name(w.name) for w in bundle.glob("*.whl")}
    files: set[PurePosixPath] = set()
    for wheel in bundle.glob("*.whl"):
        with zipfile.ZipFile(wheel) as z:
            files |= {PurePosixPath(n) for n in z.namelist() if ".data/" not in n and ".dist-info/" not in n}
    parents = {p for f in files for p in f.parents}

    def left_out(rel: PurePosixPath) -> bool:
        name = rel.name
        return (rel in files or name.startswith(("kiln", "_editable_impl_kiln", "__editable__"))
                or (name.endswith(".dist-info") and _dist_name(name) in carried))

    def mirror(source: Path, target: Path, rel: PurePosixPath) -> None:
        target.mkdir(exist_ok=True)
        for entry in source.iterdir():
            sub = rel / entry.name
            if left_out(sub):
                continue
            if sub in parents and entry.is_dir():
                mirror(entry, target / entry.name, sub)  # a folder shared with a carried wheel (nvidia/)
            else:
                (target / entry.name).symlink_to(entry)

    env = tmp / "image"
    venv.EnvBuilder(with_pip=False).create(env)
    # its own site-packages, as in the image: cuda-pathfinder looks for NVRTC in site-packages folders
    mirror(Path(site.getsitepackages()[0]), next(env.glob("lib/python3*/site-packages")), PurePosixPath())
    return env / "bin" / "python"


def _run(tmp: Path, bundle: Path, *steps: str, **settings: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OUT=str(out), KILN_GPU_PYTHON=str(_image(tmp, bundle)), KILN_GPU_BUNDLE=str(bundle),
               KILN_GPU_SITE=str(tmp / "site"), **settings)
    done = subprocess.run(["bash", str(RUNNER), *steps], capture_output=True, text=True, env=env,
                          timeout=900, cwd=tmp)
    return done, out


def test_bundle_holds_one_wheel_per_kiln_package(bundle):
    names = {_dist_name(w.name) for w in bundle.glob("*.whl")}
    folders = sorted(p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml"))
    kiln = {n for n in names if n.startswith("kiln-")}
    assert len(kiln) == len(folders) == 9
    with zipfile.ZipFile(next(bundle.glob("kiln_kernels_cuda-*.whl"))) as z:
        assert "kiln/cuda/kernels/common.cuh" in z.namelist()  # the kernels' sources travel too
        assert "kiln/cuda/emulate/emu.h" in z.namelist()
    if FULL:
        wanted = {_normal(r.split("==")[0]) for r in _load_bundle_module().MISSING}
        assert wanted <= names, wanted - names


def test_limit_and_duplicates_are_refused(bundle, tmp_path, monkeypatch, capsys):
    tool = _load_bundle_module()
    wheel = next(bundle.glob("kiln_core-*.whl"))
    monkeypatch.setattr(tool, "build_kiln_wheels", lambda out: shutil.copy(wheel, out))
    assert tool.main(["--out", str(tmp_path / "a"), "--no-download", "--limit-mib", "64"]) == 0
    size = wheel.stat().st_size / 2**20 + tool.tree_bytes() / 2**20
    assert tool.main(["--out", str(tmp_path / "a"), "--no-download", "--limit-mib", f"{size * 0.99}"]) == 1
    assert "over the" in capsys.readouterr().err
    twin = tmp_path / "b"
    twin.mkdir()
    shutil.copy(wheel, twin / wheel.name.replace("0.", "9.", 1))
    shutil.copy(wheel, twin)
    with pytest.raises(SystemExit, match="two wheels of kiln-core"):
        tool.check_wheels(twin)


def test_runner_refuses_no_wheels_and_unknown_steps(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), KILN_GPU_BUNDLE=str(tmp_path / "none"))
    done = subprocess.run(["bash", str(RUNNER)], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2
    assert "tools/gpu_bundle.py" in done.stdout
    done = subprocess.run(["bash", str(RUNNER), "tests", "bnech"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert done.returncode == 2 and "unknown step 'bnech'" in done.stdout  # before any install


@pytest.mark.skipif(platform.system() != "Linux", reason="the bundle is for Linux x86-64 (manylinux)")
def test_runner_installs_the_bundle_and_kiln_registers_its_plugins(bundle, tmp_path):
    from kiln.cuda import unavailable_reason

    done, out = _run(tmp_path, bundle, "install")
    assert done.returncode == 0, done.stdout + done.stderr
    found = (out / "env.txt").read_text()
    site_dir = str((tmp_path / "site").resolve())
    kiln_lines = [line for line in found.splitlines() if line.startswith("  kiln-") and "/" in line]
    assert len(kiln_lines) == 9 and all(site_dir in line for line in kiln_lines), found
    backends = re.search(r"^backends: (.*)$", found, re.M)[1].split(", ")
    assert {"numpy", "cuda"} <= set(backends)
    # the reason the runner printed is the one this process finds: no GPU here
    assert f"cuda: unavailable: {unavailable_reason()}" in found
    assert "local" in re.search(r"^communicators: (.*)$", found, re.M)[1].split(", ")
    assert f"install: {len(list(bundle.glob('*.whl')))} wheels" in (out / "summary.txt").read_text()


@pytest.mark.skipif(not FULL, reason="downloads wheels: nox -s gpu-bundle-check (KILN_GPU_BUNDLE_FULL=1)")
def test_runner_steps_run_and_gpu_tests_skip_with_reasons(bundle, tmp_path):
    from kiln.cuda import unavailable_reason

    done, out = _run(tmp_path, bundle, "check", "tests", "bench",
                     KILN_GPU_CHECK_S="400", KILN_GPU_TESTS_S="400", KILN_GPU_BENCH_S="60")
    summary = (out / "summary.txt").read_text()
    found = (out / "env.txt").read_text()
    # the bundle supplied what the stand-in image lacks: the nccl communicator registered from it
    assert "nccl" in re.search(r"^communicators: (.*)$", found, re.M)[1].split(", "), found
    assert "MISSING" not in found, found
    # mpi4py (the stand-in's) loads libmpi from the bundle's prefix: it has none of its own
    assert re.search(r"^mpi: MPICH Version:?\s+5\.0\.2", found, re.M), found
    check = (out / "check.log").read_text()
    assert re.search(r"^check: passed", summary, re.M), summary + check
    assert f"GPU not run: {unavailable_reason()}" in check, check
    assert re.search(r"^\d+ kernels compiled for sm_90; .*no failure", check, re.M), check
    tests = (out / "tests.log").read_text()
    assert re.search(r"^tests: passed", summary, re.M), summary + tests[-3000:]
    last = tests.strip().splitlines()[-1]
    assert re.search(r"\b(passed|failed|error)", last) is None, tests[-3000:]  # nothing ran, nothing broke
    # every skip gives its reason, and the GPU tests' reason is the one this process finds
    reasons = re.findall(r"^SKIPPED \[(\d+)\] ([^:]+):\d+: (.+)$", tests, re.M)
    assert sum(int(n) for n, _, _ in reasons) == int(re.search(r"(\d+) skipped", last)[1])
    gpu_tests = [(n, why) for n, path, why in reasons if path.endswith("kernels-cuda/tests/test_gpu.py")]
    assert sum(int(n) for n, _ in gpu_tests) > 100, tests[-3000:]
    assert all(unavailable_reason() in why for _, why in gpu_tests), tests[-3000:]
    # without a GPU the benchmark stops with kiln's reason, inside its limit
    assert re.search(r"^bench: (passed|FAILED \(exit \d+\)) in", summary, re.M), summary
    assert done.returncode in (0, 1), done.stdout + done.stderr


def test_docs_give_the_run_calls_the_tools_make():
    """docs/cuda.md's calls and step limits are the runner's, and each call's steps fit its seconds."""
    doc = (ROOT / "docs" / "cuda.md").read_text()
    calls = re.findall(r"^command:\s+(.+)\ncarry:\s+(.+)\ntimeout_s:\s+(\d+)$", doc, re.M)
    assert [c[0].split("bash ")[-1] for c in calls] == ["tools/gpu_run.sh", "tools/gpu_run.sh bench"], calls
    # the carried folder is where the bundle script writes by default, and the runner reads; git ignores it
    assert 'default=ROOT / ".gpu"' in BUNDLE_PY.read_text() and "/.gpu/" in (ROOT / ".gitignore").read_text()
    runner = RUNNER.read_text()
    assert "BUNDLE=${KILN_GPU_BUNDLE:-.gpu}" in runner
    limits = {}
    for step in ("check", "tests", "bench"):
        default = int(re.search(rf"\${{KILN_GPU_{step.upper()}_S:-(\d+)}}", runner)[1])
        documented = re.search(rf"^\| `{step}` \|.*\| (\d+) s \|", doc, re.M)
        assert documented and int(documented[1]) == default, step
        limits[step] = default
    grace = int(re.search(r"timeout -k (\d+)", runner)[1])  # after the limit, before the kill
    by_default = re.search(r"&& steps=\((.+)\)$", runner, re.M)[1].split()
    assert by_default == ["check", "tests"]
    for command, carry, timeout_s in calls:
        assert len(command) < 2000 and carry == '[".gpu"]' and int(timeout_s) <= 600
        words = shlex.split(command)
        settings = dict(w.split("=", 1) for w in words if re.match(r"KILN_GPU_\w+=", w))
        assert set(settings) <= {"KILN_GPU_BENCH_ARGS", "KILN_GPU_CHECK_ARGS"}  # limits stay the defaults
        run = words.index("tools/gpu_run.sh")
        assert words[run - 1] == "bash" and (ROOT / words[run]).is_file()
        steps = words[run + 1:] or by_default
        # 30 s: the install and the preflight
        assert sum(limits[s] + grace for s in steps) + 30 <= int(timeout_s), command


def test_preflight_names_missing_and_mismatched_requirements():
    spec = importlib.util.spec_from_file_location("kiln_gpu_preflight", ROOT / "tools" / "gpu_preflight.py")
    preflight = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(preflight)
    dist = SimpleNamespace(metadata={"Name": "kiln-x"}, requires=[
        "numpy>=99", "pluggy>=1.0", "no-such-package-kiln>=1", "kiln-core>=0.6",
        "torch>=2.3; extra == 'torch'", "nccl4py-nope[cu13]>=0.6; extra == 'nccl'"])
    lines = {line.split()[1]: line for line in preflight.requirements([dist])}
    assert "MISMATCH: needs >=99" in lines["numpy"] and version("numpy") in lines["numpy"]
    assert lines["pluggy"].endswith(" ok")
    assert lines["no-such-package-kiln"].endswith("MISSING")
    assert lines["nccl4py-nope"].endswith("MISSING")  # a GPU extra is checked
    assert "kiln-core" not in lines  # kiln's own packages come in the bundle
    assert "torch" not in lines  # an extra a GPU run does not use


def test_preflight_fails_when_kiln_is_not_the_bundles(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_preflight.py"), "--site", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"PREFLIGHT FAILED: kiln-core is not installed under {tmp_path.resolve()}" in done.stdout
