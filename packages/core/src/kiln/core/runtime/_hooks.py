"""Run-time annotations (seed 004 §7.3, §7.7): hooks, probes, asserts, trace and profile.

A backend's Executable calls ``watch(step, seconds)`` after each step it runs when its ``watch``
attribute is set (the NumPy backend does); :class:`Runtime` is that watcher for one Model. It finds
the steps that produce annotated tensors once per Program and, after such a step:

- calls the Python callbacks registered for a ``@hook`` point (``Model.hooks.add``), like
  ``torch.nn.Module.register_forward_hook``: ``fn(tensor, info)``. ``observe`` hooks get a read-only
  copy; ``modify`` hooks get the tensor itself and change it in place; ``replace`` hooks return the
  new value. A modify or replace hook also runs where the backward replays (recomputes) the tensor,
  so the backward sees what the forward saw; it treats the hook as the identity (the gradient flows
  through it unchanged);
- records ``@probe`` statistics (``Model.probes``);
- checks ``@assert`` conditions, stopping the run with a :class:`KilnError` that names the tensor;
- prints ``@trace`` lines and collects ``@profile`` times.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TextIO

import attrs
import numpy as np

from kiln.core._errors import KilnError
from kiln.core.ir._ir import Annotation, Module

__all__ = ["HookHandle", "HookInfo", "Hooks", "ProbeRecord", "Probes", "Runtime", "check_expression"]

HOOK_MODES = ("observe", "modify", "replace")
_FUNCS: Mapping[str, Callable[..., Any]] = {
    "has_nan": lambda x: bool(np.isnan(x).any()),
    "has_inf": lambda x: bool(np.isinf(x).any()),
    "has_nan_or_inf": lambda x: not bool(np.isfinite(x).all()),
    "isfinite": lambda x: bool(np.isfinite(x).all()),
    "all": lambda x: bool(np.all(x)),
    "any": lambda x: bool(np.any(x)),
    "abs": np.abs,
    "max": np.max,
    "min": np.min,
    "mean": np.mean,
    "sum": np.sum,
}
_NODES = (
    ast.Expression,
    ast.BoolOp,
    ast.And,
    ast.Or,
    ast.UnaryOp,
    ast.Not,
    ast.USub,
    ast.Compare,
    ast.Eq,
    ast.NotEq,
    ast.Lt,
    ast.LtE,
    ast.Gt,
    ast.GtE,
    ast.Name,
    ast.Load,
    ast.Constant,
    ast.Call,
    ast.Attribute,
    ast.Subscript,
    ast.BinOp,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.Div,
)


def check_expression(text: str) -> ast.Expression:
    """An ``@assert`` condition in the seed's syntax (``!has_nan(out) && all(out <= 1)``) as a checked
    expression tree: the tensor's name, numbers, ``.shape[i]``, comparisons, ``! && ||``, ``+ - * /`` and
    the functions has_nan, has_inf, has_nan_or_inf, isfinite, all, any, abs, max, min, mean, sum.
    Anything else is a KilnError E026."""
    py = text.replace("&&", " and ").replace("||", " or ").replace("!=", "\0").replace("!", " not ").strip()
    try:
        tree = ast.parse(py.replace("\0", "!="), mode="eval")
    except SyntaxError as exc:
        raise KilnError(
            f"@assert condition {text!r} cannot be read: {exc.msg}",
            code="E026",
            hint="e.g. '!has_nan(out) && all(out <= 1)'",
        ) from None
    for node in ast.walk(tree):
        if not isinstance(node, _NODES):
            raise KilnError(
                f"@assert condition {text!r}: {type(node).__name__} is not allowed",
                code="E026",
                hint="use comparisons, ! && ||, + - * /, .shape[i] and " + ", ".join(_FUNCS),
            )
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in _FUNCS):
            raise KilnError(
                f"@assert condition {text!r}: unknown function {ast.unparse(node.func)!r}",
                code="E026",
                hint="functions: " + ", ".join(_FUNCS),
            )
        if isinstance(node, ast.Attribute) and node.attr != "shape":
            raise KilnError(
                f"@assert condition {text!r}: only .shape may be read from a tensor",
                code="E026",
                hint="e.g. out.shape[-1] == 64",
            )
    return tree


def expression_names(tree: ast.Expression) -> set[str]:
    """The names an expression reads, other than its functions."""
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} - calls


def _evaluate(tree: ast.Expression, env: Mapping[str, Any]) -> Any:
    code = compile(tree, "<@assert>", "eval")
    return eval(code, {"__builtins__": {}}, {**_FUNCS, **env})  # checked by check_expression


@attrs.frozen
class HookInfo:
    """Where a hook runs: its point, the tensor (its IR name and its Program key), the layer (None in
    the model's own graph), the phase (``forward``, or ``backward`` for a replay) and the training
    step."""

    point: str
    tensor: str
    key: str
    layer: int | None
    phase: str
    step: int
    recompute: bool = False


class HookHandle:
    """What ``Hooks.add`` returns: ``remove()`` unregisters the hook (as torch's RemovableHandle)."""

    def __init__(self, hooks: Hooks, entry: tuple[str, Callable[..., Any], str, int, int]) -> None:
        self._hooks, self._entry = hooks, entry

    def remove(self) -> None:
        if self._entry in self._hooks._entries:
            self._hooks._entries.remove(self._entry)

    def __enter__(self) -> HookHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


class Hooks:
    """The Python callbacks of a model's ``@hook`` points (``Model.hooks``)."""

    def __init__(self, points: Mapping[str, str]) -> None:
        self._points = dict(points)  # point -> the mode its annotation declares
        self._entries: list[tuple[str, Callable[..., Any], str, int, int]] = []
        self._count = 0

    @property
    def points(self) -> dict[str, str]:
        """Every hook point of the model and the mode its ``@hook`` declares."""
        return dict(self._points)

    def add(
        self, point: str, fn: Callable[..., Any], *, mode: str | None = None, priority: int = 0
    ) -> HookHandle:
        """Call ``fn(tensor, info)`` after the op that computes the tensor annotated ``@hook(point)``,
        in every layer. ``mode`` (default: the annotation's) may narrow the annotation's, never widen
        it: an ``observe`` point takes observe hooks only. Hooks of one point run by ``priority``
        (lower first), then in the order added."""
        if point not in self._points:
            known = ", ".join(sorted(self._points)) or "none (annotate a tensor with @hook(...))"
            raise KilnError(f"the model has no hook point {point!r}", hint=f"hook points: {known}")
        declared = self._points[point]
        mode = declared if mode is None else mode
        if mode not in HOOK_MODES:
            raise KilnError(f"hook mode {mode!r} is not one of {', '.join(HOOK_MODES)}")
        if HOOK_MODES.index(mode) > HOOK_MODES.index(declared):
            raise KilnError(
                f"hook point {point!r} is declared @hook(mode={declared!r}); a {mode!r} hook "
                "needs the annotation to allow it",
                hint=f"annotate the tensor @hook({point!r}, mode={mode!r})",
            )
        if not callable(fn):
            raise KilnError(f"hook for {point!r}: expected a callable, found {type(fn).__name__}")
        self._count += 1
        entry = (point, fn, mode, priority, self._count)
        self._entries.append(entry)
        return HookHandle(self, entry)

    def clear(self) -> None:
        self._entries.clear()

    def of(self, point: str) -> list[tuple[Callable[..., Any], str]]:
        return [
            (fn, mode)
            for p, fn, mode, _, _ in sorted(self._entries, key=lambda e: (e[3], e[4]))
            if p == point
        ]

    def __len__(self) -> int:
        return len(self._entries)


@attrs.frozen
class ProbeRecord:
    """One capture of a ``@probe``: the step and layer, and what its ``capture`` asks for (``stats``:
    mean, std, min, max, norm; ``full``: ``value``; ``histogram``: ``histogram`` counts and ``edges``;
    ``sample``: up to 16 values in ``value``)."""

    name: str
    tensor: str
    step: int
    layer: int | None
    mean: float = 0.0
    std: float = 0.0
    min: float = 0.0
    max: float = 0.0
    norm: float = 0.0
    value: Any = None
    histogram: Any = None
    edges: Any = None


class Probes:
    """The captures of a model's ``@probe`` annotations (``Model.probes``), on once enabled."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = tuple(dict.fromkeys(names))
        self.enabled = False
        self._records: dict[str, list[ProbeRecord]] = {n: [] for n in self.names}

    def enable(self) -> None:
        self.enabled = True

    def disable(self) -> None:
        self.enabled = False

    def clear(self) -> None:
        for v in self._records.values():
            v.clear()

    def __getitem__(self, name: str) -> list[ProbeRecord]:
        if name not in self._records:
            raise KilnError(
                f"the model has no probe {name!r}", hint=f"probes: {', '.join(self.names) or 'none'}"
            )
        return list(self._records[name])

    def latest(self, name: str) -> ProbeRecord:
        records = self[name]
        if not records:
            raise KilnError(
                f"probe {name!r} has captured nothing yet",
                hint="call model.probes.enable() and run a step first",
            )
        return records[-1]

    def capture(self, ann: Annotation, value: np.ndarray, step: int, layer: int | None) -> None:
        args = ann.args
        if step % int(args.get("frequency", 1)):
            return
        v = np.asarray(value, dtype=np.float64)
        rec = ProbeRecord(str(args["name"]), ann.target, step, layer)
        capture = args.get("capture", "stats")
        condition = args.get("condition")
        if condition is not None:
            tree = check_expression(str(condition))
            if not _evaluate(tree, {n: v for n in expression_names(tree)}):
                return
        if capture in ("stats", "grad_stats") and v.size:
            rec = attrs.evolve(
                rec,
                mean=float(v.mean()),
                std=float(v.std()),
                min=float(v.min()),
                max=float(v.max()),
                norm=float(np.linalg.norm(v.ravel())),
            )
        elif capture in ("full", "grad_full"):
            rec = attrs.evolve(rec, value=v.copy())
        elif capture == "histogram":
            counts, edges = np.histogram(v, bins=16)
            rec = attrs.evolve(rec, histogram=counts, edges=edges)
        elif capture == "sample":
            rec = attrs.evolve(rec, value=v.ravel()[:: max(1, v.size // 16)][:16].copy())
        self._records[rec.name].append(rec)


class Runtime:
    """The run-time annotations of one model: its hooks, probes, asserts, trace and profile."""

    def __init__(self, model: Module, modules: Mapping[str, Module], stream: TextIO | None = None) -> None:
        self.modules = {model.name: model, **modules}
        self.model = model
        self.by_tensor: dict[tuple[str, str], list[Annotation]] = {}
        self.traced: dict[str, str] = {}  # module -> trace level
        self.profiled: dict[str, str] = {}  # module -> profile region name
        points: dict[str, str] = {}
        probes: list[str] = []
        for m in self.modules.values():
            for a in m.annotations:
                if a.on == "tensor" and a.kind in ("hook", "probe", "assert", "trace", "profile", "gradient"):
                    self.by_tensor.setdefault((m.name, a.target), []).append(a)
                    if a.kind == "assert":
                        check_expression(str(a.args["condition"]))
                if a.on == "module" and a.target == "" and a.kind == "trace":
                    self.traced[m.name] = str(a.args.get("level", "ops"))
                if a.on == "module" and a.target == "" and a.kind == "profile":
                    self.profiled[m.name] = str(a.args["name"])
                if a.kind == "hook":
                    point, mode = str(a.args["point"]), str(a.args.get("mode", "observe"))
                    if points.get(point, mode) != mode:
                        raise KilnError(
                            f"hook point {point!r} is declared with modes {points[point]!r} and {mode!r}",
                            hint="one hook point has one mode",
                        )
                    points[point] = mode
                if a.kind == "probe":
                    probes.append(str(a.args["name"]))
        self.hooks = Hooks(points)
        self.probes = Probes(probes)
        self.stream = stream
        #: per profile region: [calls, seconds]
        self.profile: dict[str, list[float]] = {}
        self._plans: dict[int, dict[int, list[tuple[str, str, Annotation | None]]]] = {}

    @property
    def active(self) -> bool:
        """Whether a run needs the watcher at all (no annotation that acts: zero overhead)."""
        return bool(self.by_tensor or self.traced or self.profiled)

    def _out(self) -> TextIO:
        return self.stream if self.stream is not None else sys.stdout

    def plan(self, program: Any) -> dict[int, list[tuple[str, str, Annotation | None]]]:
        """Step index -> (Program key, module, annotation) for the steps the watcher acts on."""
        cached = self._plans.get(id(program))
        if cached is not None:
            return cached
        stacks = {f"{p.name}.": p.array_of for p in self.model.params if p.array_of}
        out: dict[int, list[tuple[str, str, Annotation | None]]] = {}
        for step in program.steps:
            if step.phase not in ("forward", "backward"):
                continue
            gradient = step.phase == "backward" and not step.recompute  # a gradient, not a replay
            first = next((k for k in step.outputs if k), "")
            module = (
                self.model.name
                if step.layer is None
                else next((m for prefix, m in stacks.items() if first.startswith(prefix)), self.model.name)
            )
            for ir_name, key in zip(step.op.outputs, step.outputs, strict=False):
                if not key or (gradient and not ir_name.startswith("d_")):
                    continue
                for a in self.by_tensor.get((module, ir_name[2:] if gradient else ir_name), ()):
                    grad_probe = a.kind == "probe" and str(a.args.get("capture", "stats")).startswith("grad_")
                    grad_probe = grad_probe or a.kind == "gradient"  # @gradient acts on d_<tensor>
                    if gradient != grad_probe:
                        continue  # a grad_* probe captures d_<tensor> in the backward, the rest the forward
                    if step.recompute and not (
                        a.kind == "hook" and a.args.get("mode", "observe") != "observe"
                    ):
                        continue
                    out.setdefault(step.index, []).append((key, module, a))
            if step.phase == "forward" and (module in self.traced or module in self.profiled):
                out.setdefault(step.index, []).append(("", module, None))
        self._plans[id(program)] = out
        return out

    def watcher(self, executable: Any, step_number: Callable[[], int]) -> Callable[[Any, float], None]:
        """The ``watch(step, seconds)`` callback of ``executable`` (its Program's annotated steps)."""
        plan = self.plan(executable.program)

        def watch(step: Any, seconds: float) -> None:
            for key, module, ann in plan.get(step.index, ()):
                if ann is None:
                    self._module_wide(executable, step, module, seconds)
                else:
                    self._act(executable, step, key, ann, seconds, step_number())

        return watch

    def _line(self, executable: Any, step: Any, seconds: float, level: str) -> str:
        ins = ", ".join(f"{k}={list(executable.program.tensors[k].shape)}" for k in step.inputs if k)
        outs = ", ".join(f"{k}={list(executable.program.tensors[k].shape)}" for k in step.outputs if k)
        where = f" [layer {step.layer}]" if step.layer is not None else ""
        text = (
            f"{step.op.type}{where}: {ins} -> {outs}"
            if level != "ops"
            else f"{step.op.type}{where} -> " + ", ".join(k for k in step.outputs if k)
        )
        if level == "values":
            text += " " + "; ".join(
                f"{k}={np.array2string(executable.read(k), threshold=8)}" for k in step.outputs if k
            )
        return f"{text} ({seconds * 1e3:.3f} ms)"

    def _module_wide(self, executable: Any, step: Any, module: str, seconds: float) -> None:
        if module in self.traced:
            print(f"[TRACE] {self._line(executable, step, seconds, self.traced[module])}", file=self._out())
        if module in self.profiled:
            self._record(self.profiled[module], executable, step, seconds)

    def _record(self, region: str, executable: Any, step: Any, seconds: float) -> None:
        entry = self.profile.setdefault(region, [0.0, 0.0])
        entry[0] += 1
        entry[1] += seconds
        print(f"[PROFILE] {region}: {self._line(executable, step, seconds, 'tensors')}", file=self._out())

    def _act(
        self, executable: Any, step: Any, key: str, ann: Annotation, seconds: float, number: int
    ) -> None:
        args = ann.args
        if ann.kind == "hook":
            point = str(args["point"])
            info = HookInfo(point, ann.target, key, step.layer, step.phase, number, step.recompute)
            for fn, mode in self.hooks.of(point):
                if step.recompute and mode == "observe":
                    continue
                view = executable.views[key] if hasattr(executable, "views") else None
                if mode == "observe" or view is None:
                    value = executable.read(key)
                    value.setflags(write=False)
                    result = fn(value, info)
                    if mode == "replace" and result is not None:
                        self._replace(executable, key, result, point)
                elif mode == "modify":
                    fn(view, info)
                else:
                    result = fn(executable.read(key), info)
                    if result is not None:
                        self._replace(executable, key, result, point)
        elif ann.kind == "probe":
            if self.probes.enabled:
                self.probes.capture(ann, executable.read(key), number, step.layer)
        elif ann.kind == "assert":
            if not args.get("enabled", True):
                return
            tree = check_expression(str(args["condition"]))
            value = executable.read(key)
            env = {n: value for n in expression_names(tree)}
            ok = _evaluate(tree, env)
            if not ok:
                where = f" in layer {step.layer}" if step.layer is not None else ""
                msg = args.get("message")
                raise KilnError(
                    f"@assert failed on tensor {ann.target!r}{where} ({key}): {args['condition']}"
                    + (f": {msg}" if msg else ""),
                    code="E027",
                    hint=f"annotated at {ann.loc}" if ann.loc else None,
                )
        elif ann.kind == "trace":
            print(
                f"[TRACE] {self._line(executable, step, seconds, str(args.get('level', 'ops')))}",
                file=self._out(),
            )
        elif ann.kind == "profile":
            self._record(str(args["name"]), executable, step, seconds)
        elif ann.kind == "gradient":
            _scale_gradient(executable, key, args)

    @staticmethod
    def _replace(executable: Any, key: str, result: Any, point: str) -> None:
        want = executable.program.tensors[key].shape
        if np.shape(result) != tuple(want):
            raise KilnError(
                f"the replace hook of {point!r} returned shape {list(np.shape(result))}; the tensor "
                f"{key!r} is {list(want)}"
            )
        executable.write(key, result)


def _scale_gradient(executable: Any, key: str, args: Mapping[str, Any]) -> None:
    """``@gradient`` on a tensor (seed 004 §7.8.3): its gradient ``key``, right after the backward step
    that makes it and before any step reads it, is zeroed (``mode="skip"``), multiplied by ``scale``
    and its L2 norm clipped to ``clip``."""
    mode, scale, clip = args.get("mode", "compute"), float(args.get("scale", 1.0)), args.get("clip")
    if mode not in ("compute", "skip") or (mode == "compute" and scale == 1.0 and clip is None):
        return
    g = executable.read(key).astype(np.float64)
    if mode == "skip":
        g[...] = 0
    g *= scale
    if clip is not None:
        norm = float(np.linalg.norm(g.ravel()))
        if norm > float(clip):
            g *= float(clip) / norm
    executable.write(key, g)

