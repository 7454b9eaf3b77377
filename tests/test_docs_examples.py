"""Every ```python block in docs/*.md runs, and every IR object shown as ```json loads exactly.

Each block runs in a fresh namespace. A block whose first line is ``# doc-test: skip`` is not run;
use that only for examples that need packages which may not be installed.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

DOCS = Path(__file__).parents[1] / "docs"
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[\w-]*)[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                   re.M | re.S)
SKIP = "# doc-test: skip"


def _blocks(lang: str) -> list[tuple[str, int, str]]:
    """(file name, line of the opening fence, dedented body) of every ```lang block in docs/."""
    out = []
    for path in sorted(DOCS.glob("*.md")):
        text = path.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            if m["info"] == lang:
                out.append((path.name, text.count("\n", 0, m.start()) + 1, textwrap.dedent(m["body"])))
    return out


PYTHON = _blocks("python")
JSON = [b for b in _blocks("json") if '"kiln_ir"' in b[2]]


def _id(block: tuple[str, int, str]) -> str:
    return f"{block[0]}:{block[1]}"


def test_the_ir_reference_has_runnable_examples() -> None:
    assert sum(name == "ir.md" for name, _, _ in PYTHON) >= 2
    assert any(name == "ir.md" for name, _, _ in JSON)


@pytest.mark.parametrize("block", PYTHON, ids=_id)
def test_python_example_runs(block: tuple[str, int, str]) -> None:
    name, line, body = block
    if body.lstrip().startswith(SKIP):
        pytest.skip(f"{name}:{line} opts out of doc tests")
    # Pad with blank lines so that tracebacks give the line number in the .md file.
    code = compile("\n" * line + body, str(DOCS / name), "exec")
    exec(code, {"__name__": f"docs.{name}:{line}"})


@pytest.mark.parametrize("block", JSON, ids=_id)
def test_json_example_loads_exactly(block: tuple[str, int, str]) -> None:
    from kiln.core.ir import from_json, verify

    data = json.loads(block[2])
    obj = from_json(block[2])
    assert obj.to_dict() == data  # nothing lost, nothing added: the example is the canonical form
    verify(obj)
