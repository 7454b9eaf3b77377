"""The installed kiln.cuda is this folder's package, registered as a plugin in the ``kiln`` group."""

import subprocess
import sys
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import kiln.cuda
from kiln.cuda import _plugin

PROJECT = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]


def test_version_matches_pyproject() -> None:
    assert kiln.cuda.__version__ == PROJECT["version"]


def test_entry_point_is_installed() -> None:
    for name, target in PROJECT["entry-points"]["kiln"].items():
        (ep,) = entry_points(group="kiln", name=name)
        assert (ep.value, ep.dist and ep.dist.name) == (target, PROJECT["name"])
        assert ep.load().hookimpl.project_name == "kiln"


def test_plugin_imports_no_cuda_module() -> None:
    code = (
        "import sys, kiln.cuda._plugin;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cuda', 'nvidia')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_cuda_unavailable_without_bindings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_plugin.importlib.util, "find_spec", lambda name: None)
    assert _plugin.cuda_available() is False
