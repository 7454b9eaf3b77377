"""The ``kiln`` entry point of kiln-embed: ``kiln embed build``."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import pluggy

hookimpl = pluggy.HookimplMarker("kiln")


def _configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    build = sub.add_parser("build", help="build libkiln and kiln.h (the C ABI) into a folder")
    build.add_argument("--out", default="build/libkiln", help="the folder (default: build/libkiln)")


def _run(args: argparse.Namespace) -> int:
    from kiln.embed._build import build_library

    path = build_library(args.out)
    print(f"built {path} and {path.parent / 'kiln.h'}")
    print(f"compile a C host with: cc host.c -I{path.parent} -L{path.parent} -lkiln -Wl,-rpath,{path.parent}")
    return 0


@hookimpl
def kiln_cli_commands(register: Callable[..., Any]) -> None:
    register("embed", help="kiln inside other programs: build the C library libkiln (see docs/embedding.md)",
             run=_run, configure=_configure)
