"""The README gives a newcomer exactly two commands, and CI runs the same test command; its "use it"
section installs packages that are in this repository and runs configs that exist."""

import os
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).parents[1]
SHELL_INFO = {"", "bash", "sh", "shell", "console"}


def _readme_commands(section: str) -> list[str]:
    """The shell code blocks of the README's ``## section``."""
    text = (ROOT / "README.md").read_text()
    (body,) = re.findall(rf"^## {section}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    blocks = re.findall(r"^```([\w-]*)\n(.*?)^```", body, re.M | re.S)
    return [body.strip() for info, body in blocks if info in SHELL_INFO]


def _ci_commands() -> list[str]:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    return [s for s in map(str.strip, lines) if s and not s.startswith(("#", "set ", "cd "))]


def test_readme_has_a_demo_and_a_test_command() -> None:
    commands = _readme_commands("Try it")
    assert len(commands) == 2, commands
    assert all("\n" not in c for c in commands), "each code block holds one command"
    assert sorted(c.rsplit(" ", 1)[-1] for c in commands) == ["demo", "tests"]
    assert all(re.fullmatch(r"python -m pip install nox && nox -s \w+", c) for c in commands), commands
    readme = (ROOT / "README.md").read_text()
    assert readme.index("## Try it") < readme.index("## Use it"), "a newcomer's two commands come first"


def test_ci_runs_the_readme_test_command() -> None:
    (test_command,) = [c for c in _readme_commands("Try it") if c.endswith(" tests")]
    assert _ci_commands() == [test_command]
    assert os.access(ROOT / ".ci" / "run", os.X_OK)


def test_use_it_installs_this_repositorys_packages_and_runs_existing_configs() -> None:
    lines = [line for block in _readme_commands("Use it") for line in block.splitlines()]
    install = [shlex.split(line) for line in lines if "pip install" in line]
    assert install and all(w.startswith("-") or (ROOT / w / "pyproject.toml").is_file()
                           for cmd in install for w in cmd[cmd.index("install") + 1:]), install
    runs = [shlex.split(line) for line in lines if line.startswith("kiln ")]
    assert any(cmd[1] == "train" for cmd in runs), runs
    assert all((ROOT / cmd[2]).is_file() for cmd in runs if cmd[1] in ("train", "plan")), runs
