"""The ``kiln`` command line: a skeleton whose subcommands come from plugins (core included)."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from kiln.core._errors import KilnError
from kiln.core._plugins import contribute, env_flag, list_plugins
from kiln.core._registry import NamedRegistry

__all__ = ["main"]


Run = Callable[[argparse.Namespace], "int | None"]


def _version_text() -> str:
    core, *others = list_plugins()
    dists = {(p.distribution, p.version) for p in others if p.distribution not in (None, core.distribution)}
    return "\n".join([f"kiln {core.version or 'unknown'}"] + [f"  {d} {v}" for d, v in sorted(dists)])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln",
        description="kiln: an ahead-of-time training compiler for transformer models.",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keeps --version's line breaks
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands: NamedRegistry[Run] = NamedRegistry("cli_commands")

    # Runs inside ``contribute``, so a duplicate name or a failing ``configure`` names the plugin.
    def register(
        name: str, *, help: str, run: Run, configure: Callable[[argparse.ArgumentParser], None] | None = None
    ) -> None:
        commands.register(name, run)
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(_run=run)
        if configure is not None:
            configure(p)

    contribute("kiln_cli_commands", commands, arg=register)
    parser.add_argument("--version", action="version", version=_version_text())
    return parser


def run_plugins(args: argparse.Namespace) -> int:
    rows = [("name", "distribution", "version", "module")]
    rows += [(p.name, p.distribution or "(run time)", p.version or "-", p.module) for p in list_plugins()]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join([*(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[3]]))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kiln``; returns the exit code (2 for a ``KilnError``, printed without a traceback)."""
    try:
        parser = _parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help, --version, usage errors
            return int(exc.code or 0)
        run: Any = args._run
        return int(run(args) or 0)
    except KilnError as exc:
        if env_flag("KILN_DEBUG"):
            traceback.print_exc()
        print(f"kiln: error: {exc}", file=sys.stderr)
        return 2
