"""The shape of the code: kiln-core's layers import only downward (import-linter's contract in
pyproject.toml), and no package reaches into another package's private names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"


def test_core_layers_import_only_downward() -> None:
    cli = pytest.importorskip("importlinter.cli", reason="import-linter is installed by nox -s tests")
    assert cli.lint_imports(config_filename=str(ROOT / "pyproject.toml")) == 0


def _own_prefix(path: Path) -> str:
    """``kiln.core`` for a file of packages/core/src/kiln/core, and so on."""
    src = next(p for p in path.parents if p.name == "src")
    return ".".join(path.relative_to(src).parts[:2])


def _private_uses(path: Path) -> list[str]:
    """Imports of another kiln package's ``_`` modules or names, and attribute reads ``x._name`` on
    objects that are not this module's own (``self``/``cls``)."""
    own = _own_prefix(path)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kiln."):
            if node.module.startswith(own):
                continue
            parts = node.module.split(".")
            names = [a.name for a in node.names]
            if any(p.startswith("_") for p in parts) or any(n.startswith("_") for n in names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import "
                             f"{', '.join(names)}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("kiln.") and not a.name.startswith(own) and \
                        any(p.startswith("_") for p in a.name.split(".")):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: import {a.name}")
    return found


def _privates(paths: list[Path]) -> set[str]:
    """Private attribute and method names the classes of ``paths`` define (``self._x = ...``, ``def _x``)."""
    out: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        out.add(sub.name)
                    elif isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and \
                            isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        out.add(sub.attr)
    return {n for n in out if n.startswith("_") and not n.startswith("__")}


def _foreign_attributes(path: Path, foreign: set[str], own: set[str]) -> list[str]:
    """Reads, writes and overrides of private names that another package's classes define and this
    package's do not."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    methods = [f for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body
               if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    uses = [(n.attr, n.lineno) for n in ast.walk(tree) if isinstance(n, ast.Attribute)]
    return [f"{path.relative_to(ROOT)}:{line}: {name}" for name, line in [*uses, *((f.name, f.lineno)
            for f in methods)] if name in foreign and name not in own]


def test_no_package_reaches_into_another_packages_private_names() -> None:
    by_package = {p.name: sorted(p.glob("src/kiln/**/*.py")) for p in PACKAGES.iterdir()
                  if (p / "src").is_dir()}
    assert sum(map(len, by_package.values())) > 50
    privates = {name: _privates(paths) for name, paths in by_package.items()}
    bad = [use for paths in by_package.values() for path in paths for use in _private_uses(path)]
    for name, paths in by_package.items():
        foreign = set().union(*(v for k, v in privates.items() if k != name))
        bad += [use for path in paths for use in _foreign_attributes(path, foreign, privates[name])]
    assert not bad, "\n".join(bad)


def test_the_private_name_check_catches_an_offender(tmp_path: Path) -> None:
    module = tmp_path / "src" / "kiln" / "peft" / "_x.py"
    module.parent.mkdir(parents=True)
    module.write_text("from kiln.core.plan._program import compile\nfrom kiln.core import _errors\n"
                      "from kiln.peft._lora import apply\nfrom kiln.core import Model\n", encoding="utf-8")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert [u.split(": ", 1)[1] for u in _private_uses(module)] == [
            "from kiln.core.plan._program import compile", "from kiln.core import _errors"]
    finally:
        ROOT = saved
