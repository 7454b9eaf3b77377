"""The ``kiln`` command line: a skeleton whose subcommands come from plugins (core included)."""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kiln.core._errors import KilnError, KilnWarning
from kiln.core.plugins._registry import KINDS, NamedRegistry, PluginInfo
from kiln.core.plugins._session import env_flag, failed_plugins, get_registry, list_plugins, plugin_manager

__all__ = ["main"]


Run = Callable[[argparse.Namespace], "int | None"]
Configure = Callable[[argparse.ArgumentParser], None]


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
    commands: NamedRegistry[tuple[str, Run, Configure | None]] = NamedRegistry("cli_commands")

    # Runs inside each plugin's hook, so a duplicate name or a failing ``configure`` drops that
    # plugin (named in a warning) and its commands; ``configure`` runs again on the real parser.
    def register(name: str, *, help: str, run: Run, configure: Configure | None = None) -> None:
        commands.register(name, (help, run, configure))
        if configure is not None:
            configure(argparse.ArgumentParser(prog=f"kiln {name}"))

    plugin_manager().hook.kiln_cli_commands(register=register)
    loaded = list_plugins()
    for name, (help, run, configure) in commands.items():
        owner = commands.owner(name)
        if isinstance(owner, PluginInfo) and owner not in loaded:
            continue  # its plugin failed after registering it
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(_run=run)
        if configure is not None:
            configure(p)
        p.add_argument("--traceback", action="store_true", help="show the Python traceback of an error")
    parser.add_argument("--version", action="version", version=_version_text())
    return parser


def run_plugins(args: argparse.Namespace) -> int:
    for kind in sorted(KINDS):  # runs every contribution hook, so that a plugin failing in one shows
        get_registry(kind)
    rows = [("name", "distribution", "version", "module", "status")]
    rows += [(p.name, p.distribution or "(run time)", p.version or "-", p.module, p.status)
             for p in [*list_plugins(), *failed_plugins()]]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join([*(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[4]]))
    return 0


def _show_warning(show: Callable[..., None]) -> Callable[..., None]:
    """``warnings.showwarning`` that prints a :class:`KilnWarning` as ``kiln: warning: ...``."""

    def shown(message: Warning | str, category: type[Warning], filename: str, lineno: int,
              file: Any = None, line: str | None = None) -> None:
        if issubclass(category, KilnWarning):
            print(f"kiln: warning: {message}", file=sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)

    return shown


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kiln``; returns the exit code. A :class:`KilnError` is printed without a traceback (each
    command's ``--traceback`` shows one) and exits with its ``exit_code`` attribute, 2 when it has none
    (docs/training.md lists the codes); Ctrl-C outside a command that handles it exits 130.

    A plugin that fails is skipped with a ``kiln: warning: ...`` line; the rest of kiln works.
    """
    with warnings.catch_warnings():  # restores warnings.showwarning
        warnings.showwarning = _show_warning(warnings.showwarning)
        show = env_flag("KILN_DEBUG")
        try:
            parser = _parser()
            try:
                args = parser.parse_args(argv)
            except SystemExit as exc:  # --help, --version, usage errors
                return int(exc.code or 0)
            show = show or args.traceback
            run: Any = args._run
            return int(run(args) or 0)
        except KilnError as exc:
            if show:
                traceback.print_exc()
            print(f"kiln: error: {_without_kiln_source(str(exc))}", file=sys.stderr)
            return int(getattr(exc, "exit_code", 2))
        except KeyboardInterrupt:
            print("\nkiln: interrupted", file=sys.stderr)
            return 130


def _without_kiln_source(text: str) -> str:
    """``text`` without the ``at: FILE:LINE`` lines that point into kiln's own source (a user's model
    file is kept): they say where kiln noticed the error, not where the user made it."""
    import kiln

    roots = tuple(str(Path(p)) for p in kiln.__path__)
    return "\n".join(line for line in text.splitlines()
                     if not (line.strip().startswith("at: ") and line.strip()[4:].startswith(roots)))


# ---------------------------------------------------------------------------------------------
# kiln plan


def configure_plan(p: argparse.ArgumentParser) -> None:
    from kiln.core.plan.recompute import MODES

    p.add_argument("model", help="a kiln-dsl model name (e.g. Qwen3Model), an IR Bundle .json file, or, with "
                                 "kiln-hf, a HF checkpoint folder or a kiln train config (.toml)")
    p.add_argument("--config", default=None,
                   help="the model's config: a JSON object, or a .json file holding one (DSL models)")
    p.add_argument("--mode", choices=("full", "lora"), default=None,
                   help="training mode (default full, or the train config's)")
    p.add_argument("--recompute", choices=MODES, default=None,
                   help="recompute mode (default dsl, or the train config's)")
    p.add_argument("--budget", default=None,
                   help="with --recompute auto, the saved activations allowed: bytes (123456, 64MiB) or a "
                        "fraction of those without recompute (0.5, 50%%)")
    p.add_argument("--batch", type=_at_least_one, default=None,
                   help="batch size B (default 8, or the train config's batch_size)")
    p.add_argument("--seq", type=_at_least_one, default=None,
                   help="sequence length T (default 256, or the train config's seq_len)")
    p.add_argument("--pass", dest="passes", action="append", default=[], metavar="NAME[=OPTIONS]",
                   help="run a registered graph pass first (repeatable); OPTIONS is a JSON object, "
                        "e.g. --pass 'lora={\"r\": 8}'")
    p.add_argument("--pareto", action="store_true",
                   help="print every auto plan: saved activations, planned peak and extra FLOPs")


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, found {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, found {value}")
    return value


#: what ``kiln plan`` plans when neither a flag nor a train config says otherwise
PLAN_DEFAULTS: dict[str, Any] = {"mode": "full", "recompute": "dsl", "batch": 8, "seq": 256, "budget": None,
                                 "passes": ()}


class IRFileSource:
    """kiln-core's model source (``kiln_register_model_sources``): an IR Bundle ``.json`` file."""

    what = "IR Bundle .json files"

    def claims(self, arg: str) -> bool:
        return Path(arg).suffix == ".json"

    def load(self, arg: str, config: dict[str, Any] | None) -> tuple[Any, dict[str, Any]]:
        from kiln.core.ir._ir import from_json

        if config is not None:
            raise KilnError("--config applies to model names; an IR file holds its model's config")
        path = Path(arg)
        if not path.is_file():
            raise KilnError(f"no such IR file: {arg}")
        return from_json(path.read_text(encoding="utf-8")), {}


def load_model(name: str, config: str | None = None) -> tuple[Any, dict[str, Any]]:
    """The IR of the model ``name`` names, as ``kiln plan MODEL [--config CONFIG]`` reads it, and the
    settings its source gives (a train config gives them all): from the first registered model
    source that claims ``name``. ``config`` is a JSON object or a .json file holding one."""
    cfg = None
    if config:
        text = Path(config).read_text(encoding="utf-8") if Path(config).is_file() else config
        cfg = _json_object(text, "--config is neither a JSON object nor a JSON file")
    sources = get_registry("model_sources")
    for key in sources:
        if sources[key].claims(name):
            loaded: tuple[Any, dict[str, Any]] = sources[key].load(name, cfg)
            return loaded
    read = "; ".join(sources[key].what for key in sources)
    raise KilnError(f"no installed model source reads {name!r} (they read: {read})",
                    hint="pip install kiln-dsl for model names, kiln-hf for checkpoint folders and train "
                         "configs")


def parse_pass(text: str) -> str | tuple[str, dict[str, Any]]:
    """``NAME`` or ``NAME=JSON-OBJECT`` (a graph pass and its options)."""
    name, sep, options = text.partition("=")
    if not sep:
        return name
    return name, _json_object(options, f"--pass {text!r}: the options after '=' are not a JSON object")


def _json_object(text: str, what: str) -> dict[str, Any]:
    import json

    try:
        parsed = json.loads(text)
    except ValueError as exc:
        raise KilnError(f"{what}: {exc}") from None
    if not isinstance(parsed, dict):
        raise KilnError(f"{what}: found {type(parsed).__name__}")
    return parsed


def _settings(args: argparse.Namespace, given: dict[str, Any]) -> dict[str, Any]:
    """The plan's settings: the flags given, else the train config's, else ``PLAN_DEFAULTS``."""
    from kiln.core.plan.recompute import parse_budget

    s = {**PLAN_DEFAULTS, **given}
    flags = {k: getattr(args, k) for k in ("mode", "recompute", "batch", "seq")}
    s.update({k: v for k, v in flags.items() if v is not None})
    if args.budget is not None:
        try:
            s["budget"] = parse_budget(args.budget)
        except KilnError as e:
            raise KilnError(f"--budget {e.message}") from None
        if s["recompute"] != "auto":
            raise KilnError(f"--budget {args.budget!r} applies only with --recompute auto (recompute is "
                            f"{s['recompute']!r}): the other planners take no budget")
    elif s["recompute"] != "auto":
        s["budget"] = None  # a train config's budget, for the auto planner a flag replaced
    s["passes"] = [*s["passes"], *(parse_pass(p) for p in args.passes)]
    return s


def run_plan(args: argparse.Namespace) -> int:
    from kiln.core.plan._program import compile

    bundle, given = load_model(args.model, args.config)
    s = _settings(args, given)
    binds = {"B": s["batch"], "T": s["seq"]}
    options = {k: s[k] for k in ("backend", "optimizer") if k in s}
    prog = compile(bundle, bindings=binds, mode=s["mode"], recompute=s["recompute"],
                   recompute_budget=s["budget"], passes=s["passes"], **options)
    plan = prog.recompute
    print("passes:")
    for run in prog.passes:
        print(f"  {run.stage:<18} {run.name:<24} {run.seconds * 1e3:8.1f} ms")
    print()
    print(f"{prog.name}: recompute={plan.mode!r}, {plan.training} training, B={s['batch']} T={s['seq']}, "
          f"planned by {plan.planner} in {plan.seconds * 1e3:.1f} ms")
    if not any(p.trainable for p in prog.params):
        print(f"note: no parameter trains in {s['mode']} mode (LoRA adapters come from --pass lora, or a "
              "train config in LoRA mode)")
    print()
    print(plan.table())
    print()
    print("planned peak:")
    print(textwrap.indent(prog.memory_table(), "  "))
    if args.pareto:
        report = prog.memory_report()
        fixed = sum(report[k] for k in ("weights", "gradients", "optimizer_state", "inputs", "outputs"))
        if s["passes"]:  # the auto plans of the model the passes made
            from kiln.core.plan._passes import run_passes
            from kiln.core.plan._program import _as_bundle
            from kiln.core.plugins._session import get_registry

            bundle = run_passes(_as_bundle(bundle, None), s["passes"], get_registry("graph_passes"))[0]
        _print_pareto(bundle, binds, s["mode"], fixed)
    return 0


def _budget(n: int) -> str:
    """``n`` bytes as a ``--budget`` in binary units, rounded up to 0.01 of the unit: passed back, it
    admits a plan that keeps ``n`` bytes."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{math.ceil(n * 100 / scale) / 100:.2f}{unit}"
    return str(n)


def _print_pareto(bundle: Any, binds: dict[str, int], mode: str, fixed: int) -> None:
    from kiln.core.plan._program import measure
    from kiln.core.plan.recompute import _size, pareto, plan_context

    points = pareto(plan_context(bundle, bindings=binds, mode=mode), measure=measure(bundle, binds, mode))
    rows = [("budget", "saved", "activations", "peak", "extra GFLOP", "matmul")]
    for pt in points:
        act = pt.peak or 0
        rows.append((_budget(pt.bytes), _size(pt.bytes), _size(act), _size(act + fixed),
                     f"{pt.flops / 1e9:.3f}", "yes" if pt.matmul else ""))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    print()
    print("auto plans (a --budget that picks the plan -> saved, activation peak, planned peak, extra FLOPs "
          "per step):")
    for r in rows:
        print("  " + "  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)))
