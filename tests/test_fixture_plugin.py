"""Real plugin packages found through their entry points: kiln-fixture-plugin (installed in the test
environment) and two broken ones that each test pip-installs into a private directory."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kiln.core._cli import main
from kiln.core._plugins import get_registry, list_plugins, reset_plugins
from kiln.core._registry import PluginInfo

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
    assert ["fixture", "kiln-fixture-plugin", FIXTURE_VERSION, "kiln_fixture_plugin"] in rows
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
    assert passes["fixture_identity"](graph) is graph
    owner = passes.owner("fixture_identity")
    assert isinstance(owner, PluginInfo) and owner.distribution == "kiln-fixture-plugin"


def _install_command() -> list[str]:
    if importlib.util.find_spec("pip"):
        return [sys.executable, "-m", "pip", "install"]
    if shutil.which("uv"):
        return ["uv", "pip", "install", "--python", sys.executable]
    pytest.skip("neither pip nor uv is available to install the broken test plugins")


def _install_to(target: Path, plugin: str) -> None:
    install = _install_command()
    # --no-build-isolation builds with this environment's hatchling, so make sure there is one.
    missing = importlib.util.find_spec("hatchling") is None
    if missing and subprocess.run([*install, "hatchling"], capture_output=True).returncode != 0:
        pytest.skip("hatchling is needed to build the broken test plugins and could not be installed")
    cmd = [*install, "--no-deps", "--no-build-isolation", "--target", str(target), str(PLUGINS / plugin)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("plugin", "expected"),
    [
        (
            "kiln_broken_plugin",
            "from kiln-broken-plugin 0.1.0 failed to import: ImportError: kiln_broken_plugin",
        ),
        ("kiln_badhook_plugin", "(kiln-badhook-plugin 0.1.0) declares an invalid hook"),
    ],
)
def test_bad_plugins_name_their_distribution(tmp_path: Path, plugin: str, expected: str) -> None:
    _install_to(tmp_path, plugin)
    env = {k: v for k, v in os.environ.items() if k not in (AUTOLOAD, "KILN_DEBUG")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "kiln.core", "plugins"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("kiln: error: ") and expected in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    if plugin == "kiln_badhook_plugin":
        assert "kiln_register_opz" in done.stderr
    env[AUTOLOAD] = "1"  # the way out that the error message suggests
    assert subprocess.run(cmd, capture_output=True, env=env).returncode == 0
