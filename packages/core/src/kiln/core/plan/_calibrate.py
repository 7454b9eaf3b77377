"""The measured cost model: what a step's kernel takes on this machine, for pricing recompute.

FLOPs alone misprice a CPU step: a norm or an activation does few FLOPs but streams its tensors
through memory, so a plan that recomputes "cheap" elementwise ops can cost more time than one that
replays a matmul. A :class:`Calibration` times the kernel each step actually runs (the one the kernel
table selects for the backend, native or NumPy) at the step's own shapes, once per machine, backend
and kernel set (the key hashes the kernels' source files, so a new native kernel invalidates it),
and keeps the times in a JSON file. Per op type it also fits ``seconds = a + b * FLOPs + c * bytes``
(non-negative least squares over the shapes timed so far), which prices a shape not timed yet.

The auto planner prices a replay in *FLOP-equivalents*: its measured seconds times the calibration's
matmul rate (so a matmul costs about its FLOPs and a norm what its memory traffic takes).
``KILN_RECOMPUTE_COST=flops`` (or the auto option ``cost="flops"``) prices by FLOPs alone.

Probes are timed cheapest first, and one that the times so far predict to take over
:data:`LONG_SECONDS` is priced by them instead of run: calibrating a large model at long sequences
(whose LM head alone runs for tens of seconds) takes a bounded time.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from attrs import field

from kiln.core._errors import KilnError
from kiln.core.ops._ops import Cost

__all__ = ["Calibration", "OpFit", "Probe", "cache_dir", "calibration_for", "cost_mode", "fit"]

#: ``flops`` prices recompute by FLOPs alone; ``measured`` (the default) by calibrated kernel times
COST_ENV = "KILN_RECOMPUTE_COST"
COST_MODES = ("measured", "flops")
#: a probe runs :data:`_REPEATS` times (more, up to :data:`_MAX_REPEATS`, while its runs total less
#: than :data:`_MIN_SECONDS`); the fastest counts
_MIN_SECONDS = 0.02
_REPEATS = 3
_MAX_REPEATS = 6
#: a probe whose warm-up run took longer is timed by that run alone; one the times so far predict to
#: take longer is not run (it is priced by its op's fit, else the rates): a large model's LM head
#: at 8192 tokens takes tens of seconds a run, and its price changes no plan
LONG_SECONDS = 1.0
#: FLOPs per byte from which a probe is compute-bound (an elementwise op, RoPE or a norm does about one
#: or less; a matmul about its smallest dimension / 6)
COMPUTE_BOUND = 16.0
#: bytes written before each timed run, so that its inputs come from memory as in a training step
#: (where the tensors a step reads were written long before) rather than from a warm cache
FLUSH_BYTES = 64 << 20
_scratch: list[np.ndarray] = []
_VERSION = 2


def cost_mode(option: Any = None) -> str:
    """The recompute cost model: the auto option ``cost`` if given, else ``$KILN_RECOMPUTE_COST``, else
    ``measured``."""
    value = option if option is not None else os.environ.get(COST_ENV, "measured").strip() or "measured"
    if value not in COST_MODES:
        source = "recompute option cost" if option is not None else f"${COST_ENV}"
        expected = ", ".join(map(repr, COST_MODES))
        raise KilnError(f"{source}={value!r} is not valid; expected one of {expected}")
    return str(value)


def cache_dir() -> Path:
    """``$KILN_CALIBRATION_CACHE``, else ``$XDG_CACHE_HOME/kiln/calibration``, else
    ``~/.cache/kiln/calibration``."""
    if os.environ.get("KILN_CALIBRATION_CACHE"):
        return Path(os.environ["KILN_CALIBRATION_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kiln" / "calibration"


_Spec = tuple[tuple[int, ...], str] | None


def _tensors(v: Iterable[_Spec]) -> tuple[_Spec, ...]:
    return tuple(None if t is None else (tuple(int(d) for d in t[0]), str(t[1])) for t in v)


@attrs.frozen
class Probe:
    """One step as the calibration times it: its op, the kernel-table key of its kernel ("" for the op's
    reference kernel), how it runs (``Step.how``), the (shape, NumPy dtype) of each input and output
    (None for an absent optional one) and its bound attributes; ``cost`` is its cost rule's."""

    op: str
    kernel: str
    how: str
    inputs: tuple[tuple[tuple[int, ...], str] | None, ...] = field(converter=_tensors)
    outputs: tuple[tuple[tuple[int, ...], str] | None, ...] = field(converter=_tensors)
    attrs: tuple[tuple[str, str], ...] = ()
    cost: Cost = field(factory=Cost)
    kwargs: Mapping[str, Any] = field(factory=dict, eq=False, repr=False)

    @classmethod
    def of(cls, step: Any, types: Callable[[str], tuple[tuple[int, ...], str]], cost: Cost) -> Probe:
        """The probe of a Program step, ``types`` giving a tensor key's (shape, NumPy dtype)."""
        kw = dict(step.attrs)
        return cls(step.op.type, step.kernel, step.how, [types(k) if k else None for k in step.inputs],
                   [types(k) if k else None for k in step.outputs],
                   tuple(sorted((k, repr(v)) for k, v in kw.items())), cost, kw)

    @property
    def key(self) -> str:
        return json.dumps([self.op, self.kernel, self.how, self.inputs, self.outputs, self.attrs])


@attrs.frozen
class OpFit:
    """``seconds = a + b * flops + c * bytes``, each coefficient >= 0."""

    a: float
    b: float
    c: float

    def seconds(self, cost: Cost) -> float:
        return self.a + self.b * cost.flops + self.c * cost.bytes


def fit(rows: Sequence[tuple[float, float, float]]) -> OpFit:
    """The non-negative least-squares :class:`OpFit` of ``(flops, bytes, seconds)`` rows (every subset of
    the three terms is solved and the best fit with no negative coefficient kept)."""
    if not rows:
        raise KilnError("a cost fit needs at least one timed (flops, bytes, seconds) row")
    data = np.asarray(rows, dtype=np.float64)
    cols = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
    scale = np.maximum(np.abs(cols).max(axis=0), 1e-300)
    best: tuple[float, np.ndarray] | None = None
    for n in range(1, 4):
        for subset in itertools.combinations(range(3), n):
            sol, *_ = np.linalg.lstsq(cols[:, subset] / scale[list(subset)], data[:, 2], rcond=None)
            if (sol < 0).any():
                continue
            coef = np.zeros(3)
            coef[list(subset)] = sol / scale[list(subset)]
            err = float(np.sum((cols @ coef - data[:, 2]) ** 2))
            if best is None or err < best[0] * (1 - 1e-9):
                best = (err, coef)
    coef = best[1] if best is not None else np.array([float(data[:, 2].mean()), 0.0, 0.0])
    return OpFit(float(coef[0]), float(coef[1]), float(coef[2]))


def _source_hash(fn: Callable[..., Any]) -> str:
    """A hash of the source files beside the module defining ``fn`` (its package's ``.py``, ``.c``,
    ``.cu``, ``.h``): a changed kernel changes it."""
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    path = getattr(module, "__file__", None)
    if not path:
        return getattr(fn, "__qualname__", repr(type(fn)))
    return _dir_hash(str(Path(path).parent))


_DIR_HASHES: dict[str, str] = {}


def _dir_hash(folder: str) -> str:
    if folder not in _DIR_HASHES:
        h = hashlib.sha256()
        for p in sorted(Path(folder).iterdir()):
            if p.suffix in (".py", ".c", ".cu", ".h"):
                h.update(p.name.encode() + p.read_bytes())
        _DIR_HASHES[folder] = h.hexdigest()[:16]
    return _DIR_HASHES[folder]


def machine() -> str:
    """This machine as the cache key names it: host, architecture, processor, CPU count, NumPy."""
    return f"{platform.node()}|{platform.machine()}|{platform.processor()}|{os.cpu_count()}|{np.__version__}"


class Calibration:
    """Measured kernel times of one machine, backend and float type (``key``), cached in ``path``.

    An entry is keyed by its probe and ``stamp(probe)`` (the hash of its kernel's source files, where
    :func:`calibration_for` made it), so a changed kernel is timed anew. :meth:`seconds` prices a probe:
    its timed seconds when the table has it, else the op's fit (:func:`fit`), else FLOPs at the matmul
    rate plus bytes at the memory rate seen so far.
    """

    def __init__(self, key: str, path: Path | None = None, table: Mapping[str, Any] | None = None,
                 stamp: Callable[[Probe], str] | None = None) -> None:
        self.key, self.path = key, path
        self.stamp = stamp or (lambda p: "")
        #: probe key -> (op, flops, bytes, seconds)
        self.table: dict[str, tuple[str, float, float, float]] = {
            k: (str(v[0]), float(v[1]), float(v[2]), float(v[3])) for k, v in (table or {}).items()}
        self._fits: dict[str, OpFit] = {}
        self._rates: tuple[float, float] | None = None
        self.timed = 0  # probes timed by this object (not read from the cache)

    @classmethod
    def load(cls, key: str, folder: Path | None = None, stamp: Callable[[Probe], str] | None = None
             ) -> Calibration:
        """The calibration cached for ``key`` (an empty one where none is, or the file does not parse)."""
        path = (folder or cache_dir()) / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
        try:
            data = json.loads(path.read_text())
            if data.get("version") == _VERSION and data.get("key") == key:
                return cls(key, path, data.get("table", {}), stamp)
        except (OSError, ValueError, AttributeError):
            pass
        return cls(key, path, stamp=stamp)

    def save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"version": _VERSION, "key": self.key, "table": self.table}))
            os.replace(tmp, self.path)
        except OSError:  # a read-only cache: the times stay in this process
            pass

    def entry(self, probe: Probe) -> str:
        return f"{probe.key}#{self.stamp(probe)}"

    def record(self, probe: Probe, seconds: float) -> None:
        self.table[self.entry(probe)] = (probe.op, probe.cost.flops, probe.cost.bytes, float(seconds))
        self._fits.pop(probe.op, None)
        self._rates = None

    def op_fit(self, op: str) -> OpFit | None:
        if op not in self._fits:
            rows = [(f, b, s) for o, f, b, s in self.table.values() if o == op]
            if not rows:
                return None
            self._fits[op] = fit(rows)
        return self._fits[op]

    def _best_rates(self) -> tuple[float, float]:
        if self._rates is None:
            rows = [(f, b, s) for _, f, b, s in self.table.values() if s > 0]
            self._rates = (max((f / s for f, _, s in rows if f > 0), default=1e10),
                           max((b / s for _, b, s in rows if b > 0), default=1e10))
        return self._rates

    def _rates_known(self) -> bool:
        """Whether a compute-bound probe (:data:`COMPUTE_BOUND` FLOPs per byte or more: a matmul,
        attention) has been timed, so that :attr:`rate` is such a kernel's rather than a memory-bound
        one's (far lower)."""
        return any(f >= COMPUTE_BOUND * b and f > 0 and sec > 0 for _, f, b, sec in self.table.values())

    @property
    def rate(self) -> float:
        """FLOPs per second: the best any timed probe reached (a matmul's, in practice)."""
        return self._best_rates()[0]

    @property
    def bandwidth(self) -> float:
        """Bytes per second: the best any timed probe reached."""
        return self._best_rates()[1]

    def seconds(self, probe: Probe) -> float:
        """What ``probe`` takes: timed, fitted for its op, or from the rates (see the class)."""
        if probe.how == "alias":
            return 0.0
        hit = self.table.get(self.entry(probe))
        if hit is not None:
            return hit[3]
        op_fit = self.op_fit(probe.op)
        if op_fit is not None:
            return op_fit.seconds(probe.cost)
        return probe.cost.flops / self.rate + probe.cost.bytes / self.bandwidth

    def measure(self, probes: Iterable[Probe], kernel: Callable[[Probe], Any]) -> None:
        """Time every probe not in the table yet with its kernel (``kernel(probe)``: the Kernel object,
        None for the op's reference), the cheapest first, and save the table when any was. A probe the
        times so far predict to take over :data:`LONG_SECONDS` (its op's fit, else the rates once a
        compute-bound probe has been timed) is left to that prediction."""
        new = False
        for p in sorted(probes, key=lambda p: (p.cost.flops, p.cost.bytes)):
            if p.how in ("alias", "optimizer") or self.entry(p) in self.table:
                continue
            if (self.op_fit(p.op) is not None or self._rates_known()) and self.seconds(p) > LONG_SECONDS:
                continue
            seconds = time_probe(p, kernel(p))
            if seconds is not None:
                self.record(p, seconds)
                self.timed += 1
                new = True
        if new:
            self.save()


def _array(rng: np.random.Generator, spec: tuple[tuple[int, ...], str] | None) -> Any:
    if spec is None:
        return None
    shape, dtype = spec
    dt = np.dtype(dtype) if dtype not in ("bfloat16",) else np.dtype(np.float32)
    if dt.kind == "f":
        return (rng.random(shape, dtype=np.float32) + 0.5).astype(dt)
    return np.zeros(shape, dt)  # ids, positions, segments: 0 is valid for every op


def time_probe(probe: Probe, kernel: Any) -> float | None:
    """The fastest of a few runs of ``kernel`` (a table Kernel; its ``fn`` and ``out``) on random inputs of
    the probe's shapes; None where the kernel cannot run on them (it is then priced by its fit)."""
    rng = np.random.default_rng(0)
    ins = [_array(rng, s) for s in probe.inputs]
    if probe.how in ("copy", "offload", "fetch"):
        src, dst = ins[0], _array(rng, probe.outputs[0])

        def run() -> Any:
            return np.copyto(dst, src.reshape(dst.shape), casting="unsafe")
    else:
        if kernel is None:
            return None
        outs = [_array(rng, s) for s in probe.outputs]
        fn, kw = kernel.fn, dict(probe.kwargs)

        def run() -> Any:
            return fn(*ins, out=outs, **kw) if kernel.out else fn(*ins, **kw)
    with warnings.catch_warnings(), np.errstate(all="ignore"):  # random values may overflow an exp
        warnings.simplefilter("ignore")
        try:
            t0 = time.perf_counter()
            run()  # warm: first-touch pages, lazily built tables
            warm = time.perf_counter() - t0
        except Exception:  # random inputs an op rejects (or a kernel needing the backend's context)
            return None
        if warm > LONG_SECONDS:  # the warm-up's extra work is small beside the run's
            return warm
        best, total, n = float("inf"), 0.0, 0
        while n < _REPEATS or (total < _MIN_SECONDS and n < _MAX_REPEATS):
            _flush(n)
            t0 = time.perf_counter()
            run()
            dt = time.perf_counter() - t0
            best, total, n = min(best, dt), total + dt, n + 1
    return best


def _flush(n: int) -> None:
    """Evict the caches: write :data:`FLUSH_BYTES` of scratch memory."""
    if not _scratch:
        _scratch.append(np.empty(FLUSH_BYTES // 8, np.float64))
    _scratch[0].fill(float(n))


@attrs.frozen
class _Reference:
    """An op's reference kernel as the table's kernels are called (results returned)."""

    fn: Callable[..., Any]
    out: bool = False


def calibration_for(probes: Sequence[Probe], *, backend: str, dtype: str, kernels: Any, registry: Any,
                    folder: Path | None = None) -> Calibration:
    """The calibration of ``backend`` and ``dtype`` on this machine, loaded from the cache and completed
    by timing the probes it lacks with the kernels they run (their ``Kernel.key`` in table ``kernels``;
    "" for the op's reference kernel in ``registry``), each entry stamped with its kernel's sources."""
    def kernel(p: Probe) -> Any:
        if p.kernel and kernels is not None and p.kernel in kernels:
            return kernels[p.kernel]
        if registry is not None and p.op in registry:
            return _Reference(registry.get_op(p.op).kernel)
        return None

    def stamp(p: Probe) -> str:
        k = kernel(p)
        return "" if k is None else _source_hash(k.fn)

    cal = Calibration.load(f"v{_VERSION}|{machine()}|{backend}|{dtype}", folder, stamp)
    cal.measure(probes, kernel)
    return cal


def program_probes(program: Any, registry: Any) -> list[tuple[Any, Probe]]:
    """(step, probe) for every step of ``program`` that runs something, its cost by the op's cost rule."""
    tensors = program.tensors

    def types(key: str) -> tuple[tuple[int, ...], str]:
        return tuple(tensors[key].shape), str(tensors[key].dtype)

    out = []
    for st in program.steps:
        if st.how == "alias":
            continue
        opdef = registry.get_op(st.op.type) if st.op.type in registry else None
        outs = [tensors[k] for k in st.outputs if k]
        if opdef is not None and opdef.cost is not None and st.how not in ("copy", "offload", "fetch"):
            cost = opdef.cost([tensors[k].shape if k else () for k in st.inputs], st.attrs)
        else:  # no cost rule: the bytes it touches
            touched = outs or [tensors[k] for k in st.inputs if k]
            cost = Cost(0.0, float(sum(t.nbytes for t in touched)))
        out.append((st, Probe.of(st, types, cost)))
    return out


def predict(program: Any, *, kernels: Any = None, registry: Any = None,
            folder: Path | None = None) -> dict[str, float]:
    """Seconds of one training step of ``program`` on this machine as its calibrated kernels predict them
    (the steps' own kernels timed once per machine and kernel set, then cached): ``step`` (forward,
    backward and optimizer), and ``recompute`` (its replayed steps), ``forward``, ``backward``,
    ``optimizer`` (each phase, replays counted in the backward). Per-step dispatch is not counted."""
    if registry is None or kernels is None:
        from kiln.core.plugins._session import get_registry

        registry = registry if registry is not None else get_registry("ops")
        kernels = kernels if kernels is not None else get_registry("kernels")
    pairs = program_probes(program, registry)
    cal = calibration_for([p for _, p in pairs if p.how != "optimizer"], backend=program.backend,
                          dtype=program.dtype, kernels=kernels, registry=registry, folder=folder)
    out = {"step": 0.0, "recompute": 0.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    for st, p in pairs:
        s = cal.seconds(p)
        out["step"] += s
        out[st.phase] = out.get(st.phase, 0.0) + s
        if st.recompute:
            out["recompute"] += s
    return out


def measure_step(programs: Sequence[Any], *, steps: int = 3, kernels: Any = None) -> list[float]:
    """The fastest of ``steps`` runs of the forward and backward of each Program (on its backend, the
    weights zero, the inputs ids 0), run interleaved: one of each per round."""
    from kiln.core.plugins._session import get_registry

    table = kernels if kernels is not None else get_registry("kernels")
    runs = []
    for prog in programs:
        backend = get_registry("backends")[prog.backend]
        runs.append(backend.compile(prog, backend.allocate(prog.arena_bytes), table))
    best = [float("inf")] * len(runs)
    for _ in range(max(steps, 1) + 1):  # the first round warms up and does not count
        for k, ex in enumerate(runs):
            t0 = time.perf_counter()
            ex.run(("forward", "backward"), hyper={})
            dt = time.perf_counter() - t0
            best[k] = min(best[k], dt) if _ else best[k]
    return best
