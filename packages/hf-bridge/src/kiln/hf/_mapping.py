"""HF weight mappings (as kiln-dsl serialises them into the IR) resolved against one checkpoint.

A parameter's mapping resolves into :class:`Piece` s: each is one checkpoint tensor, or a range of
one (``split``), together with the *view* of a kiln parameter it fills, a chain of index and
transpose steps. Loading copies every piece from the memory map into its view; export and
gradients read the same views back out, so the two directions cannot disagree.

Mapping kinds (seed 003 §9): a key (``"?key"``: optional, the parameter keeps its init when the
checkpoint lacks it), ``fuse`` (concatenation of sources along ``dim``), ``split`` (ranges of one
tensor along ``dim``), ``transform`` (``fn="transpose"``: the last two axes swapped),
``tied_to`` (read from another parameter's tensors; written through that parameter only) and
``stack_experts`` (one tensor per expert, ``{expert}`` in the pattern, or one stacked tensor; with
``fuse_gate_up`` each expert's rows are ``[gate | up]``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import numpy as np

from kiln.core import KilnError
from kiln.core.ir import parse_dim
from kiln.hf._errors import CheckpointError
from kiln.hf._safetensors import _DTYPES, Checkpoint

_FLOATS = ("F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2")
Path = tuple[tuple[Any, ...], ...]  # ("index", idx) | ("swap",) steps applied to a parameter array


def view(array: np.ndarray, path: Path) -> np.ndarray:
    """The part of ``array`` a piece fills: ``path`` applied step by step (always a view)."""
    for step in path:
        array = array[step[1]] if step[0] == "index" else array.swapaxes(-1, -2)
    return array


def _shape_of(shape: tuple[int, ...], path: Path) -> tuple[int, ...]:
    return view(np.broadcast_to(np.empty((), np.uint8), shape), path).shape


@attrs.frozen
class Piece:
    """Checkpoint tensor ``key`` (its part ``source``, or all of it) is the view ``path`` of ``param``."""

    key: str
    param: str
    path: Path
    source: tuple[slice, ...] | None = None
    load_only: bool = False  # through tied_to: the target parameter writes this tensor
    absent: bool = False  # an optional weight the checkpoint lacks: keeps its init, saved all the same


@attrs.frozen
class Entry:
    """A stored kiln parameter: its key, shape, mapping (JSON, placeholders filled) and init."""

    param: str
    shape: tuple[int, ...]
    mapping: Any
    init: Mapping[str, Any] = attrs.field(factory=dict)
    ints: Mapping[str, int] = attrs.field(factory=dict)  # config values a split range may name


class _Resolver:
    def __init__(self, ckpt: Checkpoint, entries: Mapping[str, Entry]) -> None:
        self.ckpt, self.entries = ckpt, entries

    def fail(self, message: str, key: str, file: Any = None) -> CheckpointError:
        if file is None:
            file = self.ckpt.info(key).file if key in self.ckpt else self.ckpt.path
        return CheckpointError(message, file=file, tensor=key)

    def hf_shape(self, key: str, param: str) -> tuple[int, ...]:
        if key not in self.ckpt:
            raise self.fail(f"tensor is missing; kiln parameter {param!r} reads it", key, self.ckpt.path)
        info = self.ckpt.info(key)
        if info.dtype not in _FLOATS:
            raise self.fail(f"dtype {info.dtype} is not a float type; kiln parameter {param!r} is float", key)
        return info.shape

    def source_shape(self, spec: Any, param: str) -> tuple[int, ...]:
        """The shape a (sub)mapping produces, from the checkpoint's headers."""
        if isinstance(spec, str):
            return self.hf_shape(spec.removeprefix("?"), param)
        kind = spec.get("type")
        if kind == "transform":
            s = self.source_shape(spec["source"], param)
            return (*s[:-2], s[-1], s[-2])
        if kind == "fuse":
            shapes = [self.source_shape(s, param) for s in spec["sources"]]
            dim = _axis(spec.get("dim", 0), len(shapes[0]), param)
            return (*shapes[0][:dim], sum(s[dim] for s in shapes), *shapes[0][dim + 1:])
        raise KilnError(f"kiln parameter {param!r}: a {kind!r} mapping cannot be a fuse or transform source",
                        hint="fuse and transform take checkpoint keys, transforms or fuses")

    def pieces(self, spec: Any, e: Entry, path: Path, load_only: bool = False) -> list[Piece]:
        shape = _shape_of(e.shape, path)
        if isinstance(spec, str):
            key = spec.removeprefix("?")
            if key not in self.ckpt and spec.startswith("?"):
                return [Piece(key, e.param, path, load_only=load_only, absent=True)]
            found = self.hf_shape(key, e.param)
            if found != shape:
                raise self.fail(f"shape {list(found)} differs from {list(shape)}, the shape kiln parameter "
                                f"{e.param!r} expects here", key)
            return [Piece(key, e.param, path, load_only=load_only)]
        if not isinstance(spec, Mapping):
            raise KilnError(f"kiln parameter {e.param!r}: invalid HF mapping {spec!r}")
        kind = spec.get("type")
        if kind == "transform":
            if spec.get("fn") != "transpose":
                raise KilnError(f"kiln parameter {e.param!r}: transform fn {spec.get('fn')!r} is not "
                                "supported", hint="kiln-hf applies fn='transpose' (swaps the last two axes)")
            return self.pieces(spec["source"], e, (*path, ("swap",)), load_only)
        if kind == "fuse":
            return self.fuse(spec, e, path, shape, load_only)
        if kind == "split":
            return self.split(spec, e, path, shape, load_only)
        if kind == "stack_experts":
            return self.stack(spec, e, path, shape, load_only)
        if kind == "tied_to":
            target = self.entries.get(_sibling(e.param, spec["target"])) or self.entries.get(spec["target"])
            if target is None:
                raise KilnError(f"kiln parameter {e.param!r} is tied to {spec['target']!r}, which is not a "
                                "stored parameter")
            return self.pieces(target.mapping, attrs.evolve(target, param=e.param, shape=e.shape), path, True)
        raise KilnError(f"kiln parameter {e.param!r}: unknown HF mapping type {kind!r}",
                        hint="kiln-hf reads keys, fuse, split, transform, tied_to and stack_experts")

    def fuse(self, spec: Mapping[str, Any], e: Entry, path: Path, shape: tuple[int, ...],
             load_only: bool) -> list[Piece]:
        dim = _axis(spec.get("dim", 0), len(shape), e.param)
        out, offset = [], 0
        sizes = []
        for s in spec["sources"]:
            if isinstance(s, str) and s.startswith("?") and s[1:] not in self.ckpt:
                raise self.fail(f"tensor is missing; kiln parameter {e.param!r} fuses it with others, so it "
                                "cannot be optional", s[1:], self.ckpt.path)
            sizes.append(self.source_shape(s, e.param)[dim])
        if sum(sizes) != shape[dim]:
            keys = [_first_key(s) for s in spec["sources"]]
            raise self.fail(f"fused along dim {dim}, {', '.join(keys)} hold {' + '.join(map(str, sizes))} = "
                            f"{sum(sizes)}, but kiln parameter {e.param!r} has {shape[dim]}", keys[0])
        for s, n in zip(spec["sources"], sizes, strict=True):
            idx = (*(slice(None),) * dim, slice(offset, offset + n))
            out += self.pieces(s, e, (*path, ("index", idx)), load_only)
            offset += n
        return out

    def split(self, spec: Mapping[str, Any], e: Entry, path: Path, shape: tuple[int, ...],
              load_only: bool) -> list[Piece]:
        key = spec["source"]
        if not isinstance(key, str):
            raise KilnError(f"kiln parameter {e.param!r}: split reads one checkpoint key, found {key!r}")
        key = key.removeprefix("?")
        found = self.hf_shape(key, e.param)
        dim = _axis(spec.get("dim", 0), len(found), e.param)
        ranges = [tuple(parse_dim(v).evaluate(e.ints) if isinstance(v, str) else int(v) for v in r)
                  for r in spec["ranges"]]
        rest = (*found[:dim], *found[dim + 1:]) == (*shape[:dim], *shape[dim + 1:])
        if not rest or any(not 0 <= a < b <= found[dim] for a, b in ranges) or \
                sum(b - a for a, b in ranges) != shape[dim]:
            raise self.fail(f"shape {list(found)}: ranges {ranges} along dim {dim} do not make the shape "
                            f"{list(shape)} kiln parameter {e.param!r} expects", key)
        out, offset = [], 0
        for a, b in ranges:
            lead = (slice(None),) * dim
            out.append(Piece(key, e.param, (*path, ("index", (*lead, slice(offset, offset + b - a)))),
                             (*lead, slice(a, b)), load_only))
            offset += b - a
        return out

    def stack(self, spec: Mapping[str, Any], e: Entry, path: Path, shape: tuple[int, ...],
              load_only: bool) -> list[Piece]:
        pattern, experts = spec["pattern"], shape[0]
        if spec.get("num_experts") not in (None, experts):
            raise KilnError(f"kiln parameter {e.param!r} holds {experts} experts, its mapping declares "
                            f"{spec['num_experts']}")
        up = spec.get("up_pattern")
        gate_up = bool(spec.get("fuse_gate_up")) and up is not None
        half = shape[-2] // 2
        if gate_up and shape[-2] % 2:
            raise KilnError(f"kiln parameter {e.param!r}: fuse_gate_up needs an even number of rows, "
                            f"found {shape[-2]}")

        def place(gate: str, upk: str, where: tuple[Any, ...]) -> list[Piece]:
            if not gate_up:
                return self.pieces(gate, e, (*path, ("index", where)), load_only)
            rows = (*where, *(slice(None),) * (len(shape) - 2 - len(where)))
            return [*self.pieces(gate, e, (*path, ("index", (*rows, slice(0, half)))), load_only),
                    *self.pieces(upk, e, (*path, ("index", (*rows, slice(half, 2 * half)))), load_only)]

        if "{expert}" not in pattern:
            return place(pattern, up or "", ())
        up = up or ""
        return [p for i in range(experts)
                for p in place(pattern.replace("{expert}", str(i)), up.replace("{expert}", str(i)), (i,))]


def _axis(dim: Any, rank: int, param: str) -> int:
    if not isinstance(dim, int) or not -rank <= dim < rank:
        raise KilnError(f"kiln parameter {param!r}: mapping dim {dim!r} is not an axis of a rank-{rank} "
                        "tensor")
    return dim % rank


def _sibling(param: str, target: str) -> str:
    return param.rsplit(".", 1)[0] + "." + target if "." in param else target


def _first_key(spec: Any) -> str:
    if isinstance(spec, str):
        return spec.removeprefix("?")
    for k in ("sources", "source", "pattern"):
        if k in spec:
            v = spec[k]
            return _first_key(v[0] if k == "sources" else v)
    return "?"


class _Deferred:
    """An array made when asked for (``np.asarray``): save_checkpoint holds one at a time."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype[Any], make: Callable[[], np.ndarray]) -> None:
        self.shape, self.dtype, self._make = shape, dtype, make

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self._make()
        return out if dtype is None else out.astype(dtype, copy=False)


@attrs.frozen
class WeightMap:
    """Every piece of every stored parameter, with the shape and dtype of each checkpoint tensor."""

    pieces: tuple[Piece, ...]
    shapes: Mapping[str, tuple[int, ...]]
    dtypes: Mapping[str, str]  # safetensors dtype names, as loaded
    absent: frozenset[str]  # parameters whose optional weights the checkpoint lacks

    def load(self, ckpt: Checkpoint, arrays: Mapping[str, np.ndarray], *, only: str | None = None) -> None:
        """Copy every piece (of parameter ``only``, if given) from the checkpoint into its view of
        ``arrays`` (parameter -> array)."""
        for p in self.pieces:
            if not p.absent and (only is None or p.param == only):
                ckpt.read_into(p.key, view(arrays[p.param], p.path), p.source)

    def keys(self) -> list[str]:
        """The checkpoint tensors export writes, in parameter order."""
        return list(dict.fromkeys(p.key for p in self.pieces if not p.load_only))

    def export(self, arrays: Mapping[str, np.ndarray], dtype: Any = None) -> dict[str, Any]:
        """Checkpoint tensors made from ``arrays`` (parameter -> array), each when asked for.

        ``dtype``: one NumPy dtype for all, or ``None`` for the dtype each tensor was loaded with.
        A tensor whose parameters are not all in ``arrays`` is left out.
        """
        by_key: dict[str, list[Piece]] = {}
        for p in self.pieces:
            if not p.load_only:
                by_key.setdefault(p.key, []).append(p)
        out: dict[str, Any] = {}
        for key, pieces in by_key.items():
            if all(p.param in arrays for p in pieces):
                dt = np.dtype(dtype) if dtype is not None else _DTYPES[self.dtypes.get(key, "F32")]
                shape = self.shapes[key]
                out[key] = _Deferred(shape, dt, _assemble(key, shape, dt, pieces, arrays))
        return out


def _assemble(key: str, shape: tuple[int, ...], dtype: np.dtype[Any], pieces: list[Piece],
              arrays: Mapping[str, np.ndarray]) -> Callable[[], np.ndarray]:
    def make() -> np.ndarray:
        if len(pieces) == 1 and pieces[0].source is None:
            return np.array(view(arrays[pieces[0].param], pieces[0].path), dtype)
        out = np.empty(shape, dtype)
        filled = 0
        for p in pieces:
            part = out if p.source is None else out[p.source]
            part[...] = view(arrays[p.param], p.path)
            filled += part.size
        if filled != out.size:
            raise KilnError(f"checkpoint tensor {key!r}: kiln parameters fill {filled} of its {out.size} "
                            "elements, so it cannot be written",
                            hint="split ranges must cover the whole tensor for export")
        return out

    return make


def resolve(ckpt: Checkpoint, entries: Iterable[Entry]) -> WeightMap:
    """Resolve every parameter's mapping against the checkpoint's headers (no tensor is read).

    Raises :class:`CheckpointError` naming the file and tensor for a missing tensor, a wrong shape or
    a non-float dtype; warns about checkpoint tensors no parameter reads.
    """
    table = {e.param: e for e in entries}
    r = _Resolver(ckpt, table)
    pieces = [p for e in table.values() for p in r.pieces(e.mapping, e, ())]
    absent = {p.param for p in pieces if p.absent}
    for p in pieces:
        if p.param in absent and not p.absent:
            other = next(q.key for q in pieces if q.param == p.param and q.absent)
            raise r.fail(f"tensor is missing, while kiln parameter {p.param!r}'s other tensors are present",
                         other, ckpt.path)
    shapes = {p.key: ckpt.shape(p.key) for p in pieces if not p.absent}
    shapes.update({p.key: _shape_of(table[p.param].shape, p.path) for p in pieces if p.absent})
    dtypes = {k: ckpt.info(k).dtype for k in shapes if k in ckpt}
    unused = [k for k in ckpt if k not in shapes]
    if unused:
        warnings.warn(f"{ckpt.path}: {len(unused)} checkpoint tensor(s) no kiln parameter reads: "
                      f"{', '.join(unused[:5])}{', ...' if len(unused) > 5 else ''}", stacklevel=3)
    return WeightMap(tuple(pieces), shapes, dtypes, frozenset(absent))
