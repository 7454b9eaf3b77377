"""The ``kiln`` command line: a skeleton whose subcommands come from plugins (core included)."""

from kiln.core.cli._cli import main

__all__ = ["main"]
