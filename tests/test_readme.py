"""The README gives a newcomer exactly two commands, and CI runs the same test command."""

import os
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
SHELL_INFO = {"", "bash", "sh", "shell", "console"}


def _readme_commands() -> list[str]:
    blocks = re.findall(r"^```([\w-]*)\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)
    return [body.strip() for info, body in blocks if info in SHELL_INFO]


def _ci_commands() -> list[str]:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    return [s for s in map(str.strip, lines) if s and not s.startswith(("#", "set ", "cd "))]


def test_readme_has_a_demo_and_a_test_command() -> None:
    commands = _readme_commands()
    assert len(commands) == 2, commands
    assert all("\n" not in c for c in commands), "each code block holds one command"
    assert sorted(c.rsplit(" ", 1)[-1] for c in commands) == ["demo", "tests"]
    assert all(re.fullmatch(r"python -m pip install nox && nox -s \w+", c) for c in commands), commands


def test_ci_runs_the_readme_test_command() -> None:
    (test_command,) = [c for c in _readme_commands() if c.endswith(" tests")]
    assert _ci_commands() == [test_command]
    assert os.access(ROOT / ".ci" / "run", os.X_OK)
