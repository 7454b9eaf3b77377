"""The ``kiln`` entry point of kiln-dsl-text: ``kiln compile`` and ``.kiln`` files as a model source."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pluggy

hookimpl = pluggy.HookimplMarker("kiln")

SUFFIXES = (".kiln", ".module")


class TextFiles:
    """Text-DSL files as a model source: ``FILE.kiln`` (its only model) or ``FILE.kiln:Model``."""

    what = "text-DSL files (.kiln, FILE.kiln:Model)"

    def claims(self, arg: str) -> bool:
        return Path(arg.rpartition(":")[0] if _has_model(arg) else arg).suffix in SUFFIXES

    def load(self, arg: str, config: dict[str, Any] | None) -> tuple[Any, dict[str, Any]]:
        from kiln.dsl_text import compile_file

        path, model = arg.rsplit(":", 1) if _has_model(arg) else (arg, None)
        return compile_file(path, model, config), {}

    def model_class(self, arg: str, base: Path | None = None) -> Any:
        """The kiln-dsl class of the model ``arg`` names (``kiln train``'s ``model.name``); a relative
        path is relative to ``base``."""
        from kiln.dsl_text import load_program

        path, model = arg.rsplit(":", 1) if _has_model(arg) else (arg, None)
        program = load_program(Path(base or ".") / path)
        return program.classes[program.entry(model)]


def _has_model(arg: str) -> bool:
    head, sep, tail = arg.rpartition(":")
    return bool(sep) and tail.isidentifier() and Path(head).suffix in SUFFIXES


def configure_compile(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="a text-DSL file (.kiln) or a Python module file (.py) of kiln-dsl classes")
    p.add_argument(
        "--model", default=None, help="the model (or block/module) to compile; default: the file's only model"
    )
    p.add_argument(
        "--config", default=None, help="the model's config: a JSON object, or a .json file holding one"
    )
    p.add_argument(
        "-o", "--output", default=None, help="where to write the IR JSON (default: FILE with .json)"
    )


def run_compile(args: argparse.Namespace) -> int:
    import json

    from kiln.core import KilnError
    from kiln.core.ir import verify

    path = Path(args.file)
    if not path.is_file():
        raise KilnError(f"no such file: {args.file}")
    config = None
    if args.config:
        text = Path(args.config).read_text(encoding="utf-8") if Path(args.config).is_file() else args.config
        try:
            config = json.loads(text)
        except ValueError as exc:
            raise KilnError(f"--config is neither a JSON object nor a JSON file: {exc}") from None
        if not isinstance(config, dict):
            raise KilnError("--config must be a JSON object")
    bundle = (
        _python_bundle(path, args.model, config)
        if path.suffix == ".py"
        else _text_bundle(path, args.model, config)
    )
    verify(bundle)
    out = Path(args.output) if args.output else path.with_suffix(".json")
    out.write_text(bundle.to_json(), encoding="utf-8")
    for m in bundle.modules:
        ops = len(m.forward.ops) if m.forward is not None else 0
        print(f"{m.kind} {m.name}: {len(m.params)} params, {ops} forward ops")
    print(f"wrote {out}")
    return 0


def _text_bundle(path: Path, model: str | None, config: dict[str, Any] | None) -> Any:
    import sys

    from kiln.dsl_text import load_program

    program = load_program(path)
    for warning in program.warnings:
        print(f"kiln: warning: {warning}", file=sys.stderr)
    shown = len(program.warnings)
    bundle = program.bundle(model, config)
    for warning in program.warnings[shown:]:  # kiln-dsl's, from the compile
        print(f"kiln: warning: {warning}", file=sys.stderr)
    return bundle


def _python_bundle(path: Path, model: str | None, config: dict[str, Any] | None) -> Any:
    """A Python module file of kiln-dsl classes: its only @model, or ``--model``."""
    import importlib.util
    import sys

    from kiln.core import KilnError
    from kiln.dsl import build_bundle, kind_of

    name = f"_kiln_compile_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise KilnError(f"cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except KilnError:
        raise
    except Exception as exc:  # the user's module failed to import: say where, not how deep
        raise KilnError(f"importing {path} failed: {type(exc).__name__}: {exc}") from None
    found = {k: v for k, v in vars(module).items() if isinstance(v, type) and kind_of(v) is not None}
    if model is None:
        models = [k for k, v in found.items() if kind_of(v) == "model" and v.__module__ == name]
        if len(models) != 1:
            raise KilnError(
                f"{path} defines {len(models)} @model classes ({', '.join(models) or 'none'}): pass "
                "--model NAME"
            )
        model = models[0]
    if model not in found:
        raise KilnError(f"{path} defines no kiln-dsl class {model!r}", hint=f"it defines {', '.join(found)}")
    warnings: list[Any] = []
    bundle = build_bundle(found[model], config or {}, warnings=warnings)
    for warning in warnings:
        print(f"kiln: warning: {warning}", file=sys.stderr)
    return bundle


@hookimpl
def kiln_cli_commands(register: Callable[..., None]) -> None:
    register(
        "compile",
        help="compile a model file (text DSL .kiln, or a Python DSL module .py) to IR JSON and "
        "print a summary",
        run=run_compile,
        configure=configure_compile,
    )


@hookimpl
def kiln_register_model_sources(registry: Any) -> None:
    registry.register("dsl-text", TextFiles())
