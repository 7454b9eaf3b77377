"""kiln-kernels-cpu reports the version its pyproject.toml declares."""

import tomllib
from pathlib import Path

import kiln.cpu

PROJECT = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]


def test_version_matches_pyproject() -> None:
    assert kiln.cpu.__version__ == PROJECT["version"]
