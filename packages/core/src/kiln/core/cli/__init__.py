"""The ``kiln`` command line: a skeleton whose subcommands come from plugins (core included)."""

from kiln.core.cli._cli import load_model, main

__all__ = ["load_model", "main"]
