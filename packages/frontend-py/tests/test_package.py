"""The installed kiln.dsl is this folder's package, registered as a plugin in the ``kiln`` group."""

import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import kiln.dsl

PROJECT = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]


def test_version_matches_pyproject() -> None:
    assert kiln.dsl.__version__ == PROJECT["version"]


def test_entry_point_is_installed() -> None:
    for name, target in PROJECT["entry-points"]["kiln"].items():
        (ep,) = entry_points(group="kiln", name=name)
        assert (ep.value, ep.dist and ep.dist.name) == (target, PROJECT["name"])
        assert ep.load().hookimpl.project_name == "kiln"
