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
    p.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                   help="precision recipe (default fp32, or the train config's): bf16 plans bf16 activations "
                        "at 2 bytes, with fp32 master weights, gradients and optimizer state")
    p.add_argument("--offload", action="store_true",
                   help="with --recompute auto, the planner may also move activations to the host pool")
    p.add_argument("--recompute-option", dest="recompute_options", action="append", default=[],
                   metavar="NAME=VALUE",
                   help="an option of the recompute planner (repeatable; VALUE is JSON, else a string), e.g. "
                        "--recompute-option granularity=block, --recompute-option include_layernorm=false")
    p.add_argument("--ranks", type=_at_least_one, default=None,
                   help="plan one rank of a run on this many ranks (kiln-dist): data parallel, --batch being "
                        "the global batch; prints the bytes each rank holds (default: a train config's "
                        "[parallel] section)")
    p.add_argument("--zero", action="store_true", help="with --ranks, ZeRO-1: the optimizer state split over "
                                                       "the data-parallel ranks")
    p.add_argument("--tensor", type=_at_least_one, default=None,
                   help="with --ranks, the tensor-parallel degree: groups of this many ranks hold the model "
                        "in slices")
    p.add_argument("--measure", action="store_true",
                   help="also run a few steps of the Program and of one without recompute, interleaved, and "
                        "show the measured recompute overhead beside the predicted one")
    p.add_argument("--device", default=None, metavar="NAME",
                   help="also predict the step time on this device (e.g. h100, a100, h200), as a plugin "
                        "that knows it says (kiln-kernels-cuda: a roofline from kiln's op costs)")


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


def parse_recompute_option(text: str) -> tuple[str, Any]:
    """``NAME=VALUE`` of ``--recompute-option``: VALUE as JSON (``true``, ``0.5``), else the string."""
    import json

    name, sep, value = text.partition("=")
    if not sep or not name:
        raise KilnError(f"--recompute-option {text!r}: expected NAME=VALUE (granularity=block)")
    try:
        return name, json.loads(value)
    except ValueError:
        return name, value


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
    if getattr(args, "precision", None) is not None:
        s["precision"] = args.precision
    options: dict[str, Any] = {k: s[k] for k in ("backend", "optimizer", "precision") if k in s}
    recompute_options = dict(parse_recompute_option(o) for o in getattr(args, "recompute_options", ()))
    if getattr(args, "offload", False):
        if s["recompute"] != "auto":
            raise KilnError(f"--offload applies only with --recompute auto (recompute is "
                            f"{s['recompute']!r}); "
                            "--recompute offload offloads every activation it can")
        recompute_options["offload"] = True
    if recompute_options:
        options["recompute_options"] = recompute_options
    ranks = _rank_programs(args, bundle, binds, s, options)
    prog = ranks[0][1] if ranks else compile(bundle, bindings=binds, mode=s["mode"], recompute=s["recompute"],
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
    if prog.precision.lowers:
        print(f"precision {prog.precision.name!r}: {len(prog.rounded)} tensors hold {prog.precision.low} "
              f"values (weights, gradients and optimizer state stay {prog.precision.master})")
    print(plan.table())
    stages = [(m.name, a) for m in getattr(bundle, "modules", ()) for a in m.annotated("partition")]
    if stages:  # seed 004 @partition: verified and carried; a run refuses it
        print("pipeline stages (@partition; not executed yet: kiln runs no pipeline parallelism):")
        for owner, a in sorted(stages, key=lambda x: int(x[1].args["stage"])):
            print(f"  stage {a.args['stage']}: {a.on} {a.target or owner!r} of {owner}")
    _print_kernel_choices(bundle, prog)
    for b in plan.blocks:
        if b.offloaded:
            which = f" (layers {', '.join(map(str, b.layer_ids))})" if b.layer_ids else ""
            print(f"offloaded to the host pool in {b.module}{which}: {', '.join(b.offloaded)}")
    print()
    print("planned peak" + (" of rank 0:" if ranks else ":"))
    print(textwrap.indent(prog.memory_table(), "  "))
    if ranks:
        print()
        print(_rank_table(args, ranks))
    # the host's calibrated kernels time a whole step (minutes for a large model): not with --device,
    # whose prediction prices the replayed steps on that device
    if plan.mode != "none" and getattr(prog, "task", "train") == "train" and not ranks \
            and not getattr(args, "device", None):
        print()
        print(_recompute_overhead(prog, bundle, binds, s, options, getattr(args, "measure", False)))
    if getattr(args, "device", None):
        print()
        print(_step_time(prog, args.device))
    if args.pareto:
        report = prog.memory_report()
        fixed = sum(report[k] for k in ("weights", "gradients", "optimizer_state", "inputs", "outputs"))
        if s["passes"]:  # the auto plans of the model the passes made
            from kiln.core.plan._passes import run_passes
            from kiln.core.plan._program import _as_bundle
            from kiln.core.plugins._session import get_registry

            bundle = run_passes(_as_bundle(bundle, None), s["passes"], get_registry("graph_passes"))[0]
        _print_pareto(bundle, binds, s["mode"], fixed, prog.precision)
    return 0


def _print_kernel_choices(bundle: Any, prog: Any) -> None:
    """What ``@kernel`` and ``@nofuse`` (seed 004 §7.5; ``compile`` applies them) chose in the Program,
    and the steps ``@precision``/``@dtype`` move off the recipe: one line per annotated tensor."""
    modules = {m.name: m for m in getattr(bundle, "modules", ())}
    model = modules.get(getattr(bundle, "entry", None) or "") or next(iter(modules.values()), None)
    wanted = [(m.name, a) for m in modules.values() for a in m.annotations
              if a.on == "tensor" and a.kind in ("kernel", "nofuse", "precision", "dtype")]
    if model is None or not wanted:
        return
    print("annotated kernels and precision (@kernel, @nofuse, @precision, @dtype):")
    stacks = {f"{p.name}.": p.array_of for p in model.params if p.array_of}

    def module_of(st: Any) -> str:
        first = next((k for k in st.outputs if k), "")
        return str(model.name if st.layer is None else next(
            (m for pre, m in stacks.items() if first.startswith(pre)), model.name))

    for owner, a in wanted:
        steps = [st for st in prog.steps if st.phase == "forward" and st.op.outputs[:1] == (a.target,)
                 and module_of(st) == owner]
        if a.kind == "kernel":
            got = sorted({st.kernel or "reference" for st in steps})
            what = f"runs {', '.join(got) or 'nothing'} (asked {a.args['name']!r})"
        elif a.kind == "nofuse":  # compile drops every fusion of these steps
            what = "not fused" + (f": {a.args['reason']}" if "reason" in a.args else "")
        else:
            got = sorted({prog.computes.get(st.outputs[0], "recipe") for st in steps})
            low = sum(1 for st in steps if st.outputs[0] in prog.rounded)
            what = f"@{a.kind}{dict(a.args)}: computes in {', '.join(got)}, {low}/{len(steps)} bf16 output(s)"
        print(f"  tensor {a.target!r} of {owner} ({len(steps)} step(s)): {what}")


def _recompute_overhead(prog: Any, bundle: Any, binds: dict[str, int], s: dict[str, Any],
                        options: dict[str, Any], measure: bool) -> str:
    """``kiln plan``: the step time the plan's recompute adds, as this machine's calibrated kernels
    predict it (backends that run on the host) and, with ``--measure``, as a few steps measure it."""
    from kiln.core.plan._calibrate import measure_step, predict
    from kiln.core.plan._program import compile
    from kiln.core.plugins._session import get_registry

    if getattr(get_registry("backends")[prog.backend], "device", "cpu") != "cpu":
        return f"recompute overhead: not predicted here (backend {prog.backend!r} does not run on this host)"
    ours = predict(prog)
    extra = ours["recompute"]  # the replayed steps; the step without them is the one without recompute
    step = ours["step"] - extra
    line = (f"recompute overhead: predicted {extra * 1e3:+.1f} ms per step ({extra / step:+.1%} of "
            f"{step * 1e3:.1f} ms without recompute: the replayed steps)")
    if prog.recompute.mode == "auto":
        line += f"; the planner priced recompute by {prog.recompute.cost}"
    if measure:
        base = compile(bundle, bindings=binds, mode=s["mode"], passes=s["passes"],
                       **{k: v for k, v in options.items() if k != "recompute_options"})
        t_base, t_ours = measure_step([base, prog])
        line += (f"\n                    measured  {(t_ours - t_base) * 1e3:+.1f} ms per step "
                 f"({t_ours / t_base - 1:+.1%} of {t_base * 1e3:.1f} ms; forward and backward, fastest of 3)")
    return line


def _step_time(program: Any, device: str) -> str:
    """``kiln plan --device``: the step time the first plugin that knows ``device`` predicts."""
    found = plugin_manager().hook.kiln_step_time(program=program, device=device.lower())
    if found is None:
        raise KilnError(f"--device {device!r}: no installed plugin predicts step times on it",
                        hint="kiln-kernels-cuda knows NVIDIA GPUs (pip install kiln-kernels-cuda)")
    return f"predicted step time on {device}:\n" + textwrap.indent(found.table(), "  ")


def _rank_programs(args: argparse.Namespace, bundle: Any, binds: dict[str, int], s: dict[str, Any],
                   options: dict[str, Any]) -> list[tuple[int, Any]]:
    """``--ranks``: kiln-dist's Programs of the ranks that differ (rank 0's first); [] without it."""
    ranks, tensor = getattr(args, "ranks", None), getattr(args, "tensor", None)
    zero = getattr(args, "zero", False)
    if s.get("ranks"):  # a train config's [parallel] section, where no flag says otherwise
        ranks = args.ranks = ranks if ranks is not None else s["ranks"]
        tensor = args.tensor = tensor if tensor is not None else s.get("tensor")
        zero = args.zero = zero or bool(s.get("zero"))
    if ranks is None:
        if tensor is not None or zero:
            raise KilnError(f"{'--tensor' if tensor is not None else '--zero'} applies with --ranks N (the "
                            "number of ranks of the run)")
        return []
    try:
        from kiln.dist import rank_programs  # type: ignore[import-untyped]  # a plugin, maybe absent
    except ImportError:
        raise KilnError("--ranks needs kiln-dist, which is not installed",
                        hint="pip install kiln-dist") from None
    programs: list[tuple[int, Any]] = rank_programs(
        bundle, ranks=ranks, tensor=tensor or 1, zero=zero, bindings=binds, mode=s["mode"],
        recompute=s["recompute"], recompute_budget=s["budget"], passes=s["passes"], **options)
    return programs


def _rank_table(args: argparse.Namespace, ranks: list[tuple[int, Any]]) -> str:
    """Bytes per rank by kind, a row per rank whose Program differs from the others'."""
    from kiln.core.plan.recompute import _size

    tensor = args.tensor or 1
    how = f"{args.ranks // tensor} data-parallel" + (f" x {tensor} tensor-parallel" if tensor > 1 else "")
    rows = [f"bytes per rank ({args.ranks} ranks: {how}{', ZeRO-1' if args.zero else ''}; "
            + ("each rank's" if args.zero else "the same on every rank") + "):",
            f"  {'rank':<6}" + "".join(f"{h:>14}" for h in ("parameters", "gradients", "optimizer",
                                                           "activations", "peak"))]
    for r, prog in ranks:
        m = prog.memory_report()
        act = m["saved_activations"] + m["transient"] + m["inputs"] + m["outputs"]
        cells = (m["weights"], m["gradients"], m["optimizer_state"], act, m["peak"])
        rows.append(f"  {r:<6}" + "".join(f"{_size(c):>14}" for c in cells))
    return "\n".join(rows)


def _budget(n: int) -> str:
    """``n`` bytes as a ``--budget`` in binary units, rounded up to 0.01 of the unit: passed back, it
    admits a plan that keeps ``n`` bytes."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{math.ceil(n * 100 / scale) / 100:.2f}{unit}"
    return str(n)


def _print_pareto(bundle: Any, binds: dict[str, int], mode: str, fixed: int, precision: Any = "fp32") -> None:
    from kiln.core.plan._program import measure
    from kiln.core.plan.recompute import _size, pareto, plan_context

    points = pareto(plan_context(bundle, bindings=binds, mode=mode, precision=precision),
                    measure=measure(bundle, binds, mode, precision=precision))
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
