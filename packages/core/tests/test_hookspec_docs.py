"""docs/hookspecs.md is generated from the hookspec docstrings and must not go stale."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
GENERATOR = ROOT / "docs" / "gen_hookspecs.py"


def test_hookspec_reference_is_up_to_date() -> None:
    if not GENERATOR.exists():
        pytest.skip("docs/ is not here (installed-only environment)")
    spec = importlib.util.spec_from_file_location("gen_hookspecs", GENERATOR)
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    current = gen.OUT.read_text() if gen.OUT.exists() else ""
    assert current == gen.render(), "docs/hookspecs.md is stale: run python docs/gen_hookspecs.py"
