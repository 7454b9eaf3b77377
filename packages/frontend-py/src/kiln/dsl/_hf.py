"""HuggingFace weight-mapping specs: ``fuse``, ``split``, ``transform``, ``tied_to``, ``stack_experts``.

Each spec remembers where it was written and serialises to JSON data (``{"type": ..., ...}``) that
kiln-hf reads. Specs are checked when a model is compiled: a bad spec is E013 (fuse/split) or
E010 (anything else), pointing at the line that built it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from kiln.dsl._errors import diag, user_location

__all__ = [
    "Fuse",
    "HFMapping",
    "Split",
    "StackExperts",
    "TiedTo",
    "Transform",
    "fuse",
    "hf_tied_to",
    "split",
    "stack_experts",
    "tied_to",
    "transform",
]

MAPPING_TYPES = ("fuse", "split", "transform", "tied_to", "stack_experts")
_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")


class HFMapping:
    """Base of the mapping specs: a location, ``to_json()`` and ``problems()``."""

    type: str = ""

    def __init__(self) -> None:
        self.loc = user_location()

    def to_json(self) -> dict[str, Any]:
        raise NotImplementedError

    def problems(self) -> list[tuple[str, str, str]]:
        """(code, message, hint) for each thing wrong with this spec."""
        return []

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HFMapping) and self.to_json() == other.to_json()

    def __hash__(self) -> int:
        return hash(repr(self.to_json()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.to_json()!r})"


def _source_problems(source: Any, what: str) -> list[tuple[str, str, str]]:
    if isinstance(source, HFMapping):
        return source.problems()
    if not isinstance(source, str) or not source:
        return [
            (
                "E010",
                f"{what}: a source must be a checkpoint key (non-empty str), found {source!r}",
                "write the tensor's name in the HuggingFace checkpoint, e.g. 'model.norm.weight'",
            )
        ]
    return []


def _source_json(source: Any) -> Any:
    return source.to_json() if isinstance(source, HFMapping) else source


class Fuse(HFMapping):
    type = "fuse"

    def __init__(self, sources: tuple[Any, ...], dim: Any) -> None:
        super().__init__()
        self.sources, self.dim = sources, dim

    def to_json(self) -> dict[str, Any]:
        return {"type": "fuse", "sources": [_source_json(s) for s in self.sources], "dim": self.dim}

    def problems(self) -> list[tuple[str, str, str]]:
        out = []
        if len(self.sources) < 2:
            out.append(
                (
                    "E013",
                    f"fuse(...) needs at least two source tensors, found {len(self.sources)}",
                    "fuse concatenates several checkpoint tensors; map a single tensor by its key",
                )
            )
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            out.append(
                (
                    "E013",
                    f"fuse(...): dim must be an int axis, found {self.dim!r}",
                    "dim=0 concatenates rows (e.g. q, k, v projections)",
                )
            )
        for s in self.sources:
            out += _source_problems(s, "fuse(...)")
        return out


class Split(HFMapping):
    type = "split"

    def __init__(self, source: Any, ranges: Any, dim: Any) -> None:
        super().__init__()
        self.source, self.ranges, self.dim = source, ranges, dim

    def to_json(self) -> dict[str, Any]:
        ranges = [list(r) if isinstance(r, (list, tuple)) else r for r in (self.ranges or ())]
        return {"type": "split", "source": _source_json(self.source), "ranges": ranges, "dim": self.dim}

    def problems(self) -> list[tuple[str, str, str]]:
        hint = "ranges are (start, end) row pairs with 0 <= start < end, e.g. ranges=[(0, 2048)]"
        out = _source_problems(self.source, "split(...)")
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            out.append(("E013", f"split(...): dim must be an int axis, found {self.dim!r}", hint))
        if not isinstance(self.ranges, (list, tuple)) or not self.ranges:
            return [
                *out,
                ("E013", f"split(...) needs a non-empty list of ranges, found {self.ranges!r}", hint),
            ]
        for r in self.ranges:
            ok = isinstance(r, (list, tuple)) and len(r) == 2 and all(isinstance(v, (int, str)) for v in r)
            if ok and all(isinstance(v, int) and not isinstance(v, bool) for v in r):
                ok = 0 <= r[0] < r[1]
            if not ok:
                out.append(("E013", f"split(...): bad range {r!r}", hint))
        return out


class Transform(HFMapping):
    type = "transform"

    def __init__(self, source: Any, fn: Any) -> None:
        super().__init__()
        self.source, self.fn = source, fn

    def to_json(self) -> dict[str, Any]:
        return {"type": "transform", "source": _source_json(self.source), "fn": self.fn}

    def problems(self) -> list[tuple[str, str, str]]:
        out = _source_problems(self.source, "transform(...)")
        if not isinstance(self.fn, str) or not self.fn:
            out.append(
                (
                    "E010",
                    f"transform(...): fn must name a transformation, found {self.fn!r}",
                    "e.g. fn='transpose' or fn='permute_qkv'",
                )
            )
        return out


class TiedTo(HFMapping):
    """``tied_to("embedding")``: as a mapping, the weight is another parameter's; as a decorator on a
    method-style ``@param``, the parameter shares that parameter's storage."""

    type = "tied_to"

    def __init__(self, target: Any, when: Any = None) -> None:
        super().__init__()
        self.target, self.when = target, when

    def to_json(self) -> dict[str, Any]:
        return {"type": "tied_to", "target": self.target}

    def problems(self) -> list[tuple[str, str, str]]:
        if not isinstance(self.target, str) or not self.target:
            return [
                (
                    "E010",
                    f"tied_to(...) needs a parameter name, found {self.target!r}",
                    "e.g. tied_to('embedding')",
                )
            ]
        return []

    def __call__(self, fn: Callable[..., Any]) -> Any:
        from kiln.dsl._decorators import _ParamMethod

        if isinstance(fn, _ParamMethod):
            fn.tied = self
        else:
            fn.__kiln_tied_to__ = self  # type: ignore[attr-defined]  # read by a later @param
        return fn


class StackExperts(HFMapping):
    type = "stack_experts"

    def __init__(self, pattern: Any, num_experts: Any, fuse_gate_up: bool, up_pattern: Any) -> None:
        super().__init__()
        self.pattern, self.num_experts, self.fuse_gate_up = pattern, num_experts, fuse_gate_up
        self.up_pattern = up_pattern
        if fuse_gate_up and up_pattern is None and isinstance(pattern, str) and "{expert}" in pattern:
            self.up_pattern = pattern.replace("gate_proj", "up_proj") if "gate_proj" in pattern else None

    @property
    def layout(self) -> str:
        """``per_expert`` (one checkpoint tensor per expert) or ``stacked`` (one tensor for all)."""
        return "per_expert" if isinstance(self.pattern, str) and "{expert}" in self.pattern else "stacked"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "stack_experts", "pattern": self.pattern, "layout": self.layout}
        if self.num_experts is not None:
            out["num_experts"] = self.num_experts
        if self.fuse_gate_up:
            out["fuse_gate_up"] = True
            if self.up_pattern is not None:
                out["up_pattern"] = self.up_pattern
        return out

    def problems(self) -> list[tuple[str, str, str]]:
        hint = (
            "a per-expert pattern names '{expert}' (and usually '{layer}'), e.g. "
            "'model.layers.{layer}.mlp.experts.{expert}.down_proj.weight'; a pattern without "
            "'{expert}' names one tensor that already stacks every expert"
        )
        if not isinstance(self.pattern, str) or not self.pattern:
            return [("E010", f"stack_experts(...) needs a key pattern, found {self.pattern!r}", hint)]
        out = []
        for p in (self.pattern, self.up_pattern):
            bad = [m for m in _PLACEHOLDER.findall(p or "") if m not in ("layer", "expert")]
            if bad:
                out.append(
                    ("E010", f"stack_experts pattern {p!r} has unknown placeholder {{{bad[0]}}}", hint)
                )
        if self.num_experts is not None and (not isinstance(self.num_experts, int) or self.num_experts < 1):
            out.append(
                (
                    "E010",
                    f"stack_experts(...): num_experts must be a positive int, found {self.num_experts!r}",
                    hint,
                )
            )
        if self.fuse_gate_up and self.layout == "per_expert" and self.up_pattern is None:
            out.append(
                (
                    "E010",
                    f"stack_experts({self.pattern!r}, fuse_gate_up=True) cannot find the up "
                    "projection: the pattern has no 'gate_proj' to replace",
                    "pass up_pattern='...up_proj...' explicitly",
                )
            )
        return out


def fuse(*sources: Any, dim: int = 0) -> Fuse:
    """Concatenate several checkpoint tensors along ``dim`` into one weight (e.g. q, k, v -> qkv)."""
    return Fuse(sources, dim)


def split(source: Any, ranges: Any = None, dim: int = 0) -> Split:
    """Take row ranges ``[(start, end), ...]`` of a fused checkpoint tensor along ``dim``."""
    return Split(source, ranges, dim)


def transform(source: Any, fn: str = "transpose") -> Transform:
    """Apply a named transformation (``transpose``, ``permute_qkv``, ...) to a checkpoint tensor."""
    return Transform(source, fn)


def tied_to(target: str, *, when: Any = None) -> TiedTo:
    """Tie a weight to parameter ``target``: a decorator for method-style ``@param`` and a mapping spec.

    ``when`` (a config flag name or a callable on the module) makes the tie conditional, e.g.
    ``@tied_to("embedding", when="tie_word_embeddings")``.
    """
    return TiedTo(target, when)


def hf_tied_to(target: str) -> TiedTo:
    """Mapping spec: this weight is parameter ``target``'s (serialised ``{"type": "tied_to", ...}``)."""
    return TiedTo(target)


def stack_experts(
    pattern: str, num_experts: int | None = None, *, fuse_gate_up: bool = False, up_pattern: str | None = None
) -> StackExperts:
    """Stack per-expert checkpoint tensors (``{expert}`` in the pattern) into one batched weight, or read
    a checkpoint tensor that already stacks them (no ``{expert}``). ``fuse_gate_up`` also reads the up
    projection (``gate_proj`` -> ``up_proj`` unless ``up_pattern`` is given) and stacks [gate | up]."""
    return StackExperts(pattern, num_experts, fuse_gate_up, up_pattern)


def mapping_json(
    value: Any, where: str, loc: str | None, diags: list[Any], index_var: str | None = None
) -> Any:
    """Serialise one mapping value, appending E010/E013 diagnostics to ``diags``."""
    if isinstance(value, HFMapping):
        for code, message, hint in value.problems():
            diags.append(diag(code, f"{where}: {message}", hint, value.loc or loc))
        out = value.to_json()
    elif isinstance(value, str) and value:
        out = value
    elif isinstance(value, Mapping) and value.get("type") in MAPPING_TYPES:
        out = dict(value)
    else:
        kinds = ", ".join(MAPPING_TYPES)
        diags.append(
            diag(
                "E010",
                f"{where}: invalid weight mapping {value!r}",
                f"use a checkpoint key (str) or one of {kinds}",
                loc,
            )
        )
        return None
    if index_var is not None and index_var not in repr(out):
        diags.append(
            diag(
                "E010",
                f"{where}: indexed mapping {out!r} does not use the index {index_var}",
                f"write the layer index into the key, e.g. 'model.layers.{index_var}.mlp...'",
                getattr(value, "loc", None) or loc,
            )
        )
    return out
