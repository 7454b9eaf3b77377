"""Real plugin packages found through their entry points: kiln-fixture-plugin (installed in the test
environment) and four broken ones that the tests pip-install into a private directory."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.core import KilnWarning
from kiln.core.cli._cli import main
from kiln.core.plugins._registry import PluginInfo
from kiln.core.plugins._session import failed_plugins, get_registry, list_plugins, reset_plugins

AUTOLOAD = "KILN_DISABLE_PLUGIN_AUTOLOAD"
PLUGINS = Path(__file__).parent / "plugins"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


FIXTURE_VERSION = _version("kiln-fixture-plugin")
requires_fixture = pytest.mark.skipif(
    FIXTURE_VERSION is None,
    reason="kiln-fixture-plugin is not installed: pip install -e tests/plugins/kiln_fixture_plugin "
    "(nox -s tests installs it)",
)


@pytest.fixture(autouse=True)
def fresh_plugins(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.delenv(AUTOLOAD, raising=False)
    monkeypatch.delenv("KILN_DEBUG", raising=False)
    reset_plugins()
    yield
    reset_plugins()


@requires_fixture
def test_kiln_plugins_lists_the_fixture(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        PluginInfo("fixture", "kiln-fixture-plugin", FIXTURE_VERSION, "kiln_fixture_plugin") in list_plugins()
    )
    assert main(["plugins"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert rows[1][:2] == ["core", "kiln-core"]
    assert ["fixture", "kiln-fixture-plugin", FIXTURE_VERSION, "kiln_fixture_plugin", "ok"] in rows
    assert main(["--version"]) == 0
    assert f"  kiln-fixture-plugin {FIXTURE_VERSION}\n" in capsys.readouterr().out


@requires_fixture
def test_autoload_can_be_disabled(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(AUTOLOAD, "1")
    assert [p.name for p in list_plugins()] == ["core"]
    assert main(["plugins"]) == 0
    assert "kiln-fixture-plugin" not in capsys.readouterr().out
    assert "fixture_identity" not in get_registry("graph_passes")


@requires_fixture
def test_fixture_cli_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fixture-hello", "--name", "tests"]) == 0
    assert capsys.readouterr().out == "hello from kiln-fixture-plugin, tests\n"
    out = subprocess.run(["kiln", "fixture-hello"], capture_output=True, text=True, check=True).stdout
    assert out == "hello from kiln-fixture-plugin, kiln\n"


@requires_fixture
def test_fixture_graph_pass_is_attributed() -> None:
    passes = get_registry("graph_passes")
    graph = object()
    assert passes["fixture_identity"].fn(graph, {}) is graph
    owner = passes.owner("fixture_identity")
    assert isinstance(owner, PluginInfo) and owner.distribution == "kiln-fixture-plugin"


def _install_command() -> list[str]:
    if importlib.util.find_spec("pip"):
        return [sys.executable, "-m", "pip", "install"]
    if shutil.which("uv"):
        return ["uv", "pip", "install", "--python", sys.executable]
    pytest.skip("neither pip nor uv is available to install the broken test plugins")


#: the broken plugins under tests/plugins: entry-point name, distribution, why kiln skips it
BROKEN = {
    "kiln_broken_plugin": ("broken", "kiln-broken-plugin",
                           "import error: ImportError: kiln_broken_plugin is broken on purpose"),
    "kiln_badhook_plugin": ("badhook", "kiln-badhook-plugin",
                            "declares an invalid hook: unknown hook 'kiln_register_opz'"),
    "kiln_clash_plugin": ("clash", "kiln-clash-plugin",
                          "error in kiln_register_ops: 'matmul' is registered twice in the ops registry: "
                          "by plugin 'core' (kiln-core "),
    "kiln_midway_plugin": ("midway", "kiln-midway-plugin",
                           "error in kiln_register_graph_passes: RuntimeError: kiln_midway_plugin fails "
                           "midway on purpose"),
}


@pytest.fixture(scope="module")
def broken_plugins(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding every broken plugin, installed for real (put it on the path to use them)."""
    target = tmp_path_factory.mktemp("broken_plugins")
    install = _install_command()
    # --no-build-isolation builds with this environment's hatchling, so make sure there is one.
    missing = importlib.util.find_spec("hatchling") is None
    if missing and subprocess.run([*install, "hatchling"], capture_output=True).returncode != 0:
        pytest.skip("hatchling is needed to build the broken test plugins and could not be installed")
    cmd = [*install, "--no-deps", "--no-build-isolation", "--target", str(target),
           *(str(PLUGINS / plugin) for plugin in BROKEN)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return target


def test_broken_plugins_are_skipped_by_the_cli(broken_plugins: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in (AUTOLOAD, "KILN_DEBUG")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(broken_plugins), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "kiln.core", "plugins"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    warnings = done.stderr.splitlines()
    assert len(warnings) == len(BROKEN), done.stderr
    rows = {line.split()[0]: line for line in done.stdout.splitlines()[1:]}
    assert rows["core"].split()[-1] == "ok"
    for name, dist, reason in BROKEN.values():
        describe = f"plugin {name!r} ({dist} 0.1.0): {reason}"
        assert any(w.startswith(f"kiln: warning: {describe}") and f"pip uninstall {dist}" in w
                   for w in warnings), (describe, done.stderr)
        assert rows[name].split()[1] == dist and f"failed: {reason}" in rows[name], rows[name]
    version = subprocess.run([sys.executable, "-m", "kiln.core", "--version"], capture_output=True, text=True,
                             env=env)
    assert version.returncode == 0 and version.stdout.startswith("kiln "), version.stdout + version.stderr
    env[AUTOLOAD] = "1"  # the way to load none, which the warnings suggest
    quiet = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert quiet.returncode == 0 and quiet.stderr == "" and "broken" not in quiet.stdout


def test_broken_plugins_leave_nothing_behind(broken_plugins: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(broken_plugins))
    reset_plugins()
    with pytest.warns(KilnWarning) as caught:
        ops, passes = get_registry("ops"), get_registry("graph_passes")
    assert len(caught) == len(BROKEN)
    owner = ops.owner("matmul")
    assert isinstance(owner, PluginInfo) and owner.name == "core"
    assert "clash_identity" not in ops  # registered before the clash: removed with its plugin
    assert "midway_identity" not in passes  # registered before the hook raised: removed
    assert {p.name for p in failed_plugins()} == {name for name, _, _ in BROKEN.values()}
    assert not {p.name for p in list_plugins()} & {name for name, _, _ in BROKEN.values()}


# -- what the fixture plugin adds through each interface (acceptance of the platform issue)

TINY_QWEN3 = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "num_query_heads": 4, "num_kv_heads": 2,
              "head_size": 8, "d_ff": 64, "max_seq": 16, "use_qk_norm": True}


def _tiny_bundle() -> Any:
    pytest.importorskip("kiln.dsl")
    from kiln.dsl import build_bundle
    from kiln.dsl.stdlib.models import Qwen3Model

    return build_bundle(Qwen3Model, TINY_QWEN3)


def _batches(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [{"input_ids": rng.integers(0, 64, (2, 8)), "labels": rng.integers(0, 64, (2, 8))}
            for _ in range(n)]


@requires_fixture
def test_the_plugins_op_backward_matches_finite_differences() -> None:
    from kiln.core import check_op, op_registry

    reports = check_op(op_registry()["fixture_softsign"], op_registry())
    assert reports and max(r.max_rel_error for r in reports) <= 1e-6
    assert op_registry().owner("fixture_softsign").distribution == "kiln-fixture-plugin"


@requires_fixture
def test_training_on_the_plugins_backend_equals_numpy_bit_for_bit_with_its_own_matmul() -> None:
    from kiln_fixture_plugin import CALLS

    from kiln.core import Model

    bundle = _tiny_bundle()
    models = {b: Model.from_ir(bundle, seed=0, backend=b) for b in ("numpy", "fixture_counting")}
    CALLS.clear()
    for batch in _batches(3):
        stats = {b: m.train_step(batch) for b, m in models.items()}
        assert stats["numpy"] == stats["fixture_counting"]
    ref, got = (models[b].parameters() for b in ("numpy", "fixture_counting"))
    assert all(np.array_equal(ref[k], got[k]) for k in ref)
    program = models["fixture_counting"].program(2, 8)
    assert program.backend == "fixture_counting"
    matmuls = [s for s in program.steps if s.op.type == "matmul"]
    assert matmuls and {s.kernel for s in matmuls} == {"matmul@fixture_counting:*"}
    assert CALLS["kernel:matmul"] == 3 * len(matmuls)  # the plugin's kernel ran every matmul step
    assert CALLS["step:matmul"] == 3 * len(matmuls) and CALLS["step:adamw_update"] > 0


@requires_fixture
def test_compile_applies_the_plugins_graph_pass_and_kiln_plan_lists_it(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from kiln_fixture_plugin import CALLS

    from kiln.core import compile

    bundle = _tiny_bundle()
    CALLS.clear()
    program = compile(bundle, bindings={"B": 2, "T": 8}, passes=["fixture_identity"])
    assert CALLS["fixture_identity"] == 1
    assert (program.passes[0].stage, program.passes[0].name) == ("adapt", "fixture_identity")
    path = tmp_path / "model.json"
    path.write_text(bundle.to_json(), encoding="utf-8")
    assert main(["plan", str(path), "--batch", "2", "--seq", "8", "--pass", "fixture_identity"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  adapt +fixture_identity +[0-9.]+ ms$", out, re.MULTILINE), out
    assert CALLS["fixture_identity"] == 2


@requires_fixture
def test_the_plugins_optimizer_is_chosen_in_the_toml_config(tmp_path: Path) -> None:
    pytest.importorskip("kiln.hf")
    from kiln.hf import _checkpoint, train

    (tmp_path / "text.txt").write_text(Path(__file__).read_text(encoding="utf-8") * 4, encoding="utf-8")
    (tmp_path / "run.toml").write_text(f"""
[model]
name = "Qwen3Model"
size = "tiny"
config = {{ d_model = 16, n_layers = 1, num_query_heads = 2, num_kv_heads = 1, head_size = 8, d_ff = 32 }}
[data]
files = ["{tmp_path / 'text.txt'}"]
[train]
output_dir = "{tmp_path / 'out'}"
steps = 2
batch_size = 2
seq_len = 16
eval_every = 0
checkpoint_every = 1
recompute = "none"
[optimizer]
name = "fixture_signsgd"
lr = 0.001
schedule = "constant"
""", encoding="utf-8")
    summary = train(tmp_path / "run.toml", stream=io.StringIO())
    saved = _checkpoint.checkpoints(tmp_path / "out" / "checkpoints")
    first, second = (_checkpoint.load(p)[0] for p in saved)
    assert summary["checkpoint"].name == "step-00000002"
    moved = np.concatenate([(second[k].astype(np.float64) - first[k]).ravel() for k in first])
    # signSGD moves every weight by exactly lr (or not at all where its gradient is 0)
    assert np.all(np.isclose(np.abs(moved), 1e-3, rtol=1e-3) | (moved == 0)), np.abs(moved).max()
    assert np.mean(moved != 0) > 0.9
