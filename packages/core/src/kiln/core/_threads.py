"""Threads for the NumPy backend's kernels.

NumPy's ufuncs run on one core, and BLAS spreads only a large product over its threads. A kernel
with independent pieces of work (tiles of the LM head, batches and heads of attention, blocks of
rows of an elementwise chain) hands them to :func:`parallel`, which runs them on
``KILN_NUM_THREADS`` threads (default: the cores this process may use), the calling thread
included. NumPy releases the GIL inside ufunc loops and BLAS calls, so the pieces run side by
side. BLAS is held to one thread meanwhile (:func:`blas_held_to_one_thread`; the backend holds it
for a whole Program run), and a large product is cut into one piece per thread
(:func:`matmul_into`): BLAS's own workers, once woken, spin for a while after every product and
would compete with kiln's threads for the same cores.

Results do not depend on the number of threads, except for the last bits of large products (cut
into one piece per thread): every other cut depends on the shapes only, and every piece writes its
own part of the outputs (nothing is summed across pieces in a varying order).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from kiln.core._errors import KilnError

T = TypeVar("T")


def _thread_count() -> int:
    raw = os.environ.get("KILN_NUM_THREADS")
    if raw is not None:
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise KilnError(f"KILN_NUM_THREADS must be a positive integer, found {raw!r}")
        return n
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class _Pool:
    """Worker threads that take part in :meth:`run` calls; idle workers block (no spinning)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers: list[threading.Thread] = []
        self._local = threading.local()

    def _start(self) -> None:
        with self._lock:
            while len(self._workers) < self.n - 1:
                name = f"kiln-worker-{len(self._workers)}"
                t = threading.Thread(target=self._serve, name=name, daemon=True)
                t.start()
                self._workers.append(t)

    def _serve(self) -> None:
        self._local.inside = True
        while True:
            self._inbox.get()()

    def run(self, fn: Callable[[T], None], items: Sequence[T]) -> None:
        """``fn(item)`` for every item, spread over the pool; returns when all are done. An exception
        in any piece is raised here (the other pieces still finish first)."""
        helpers = min(self.n - 1, len(items) - 1)
        if helpers <= 0 or getattr(self._local, "inside", False):
            for item in items:
                fn(item)
            return
        if len(self._workers) < self.n - 1:
            self._start()
        counter = itertools.count()  # next() on it is atomic under the GIL
        errors: list[BaseException] = []
        done = threading.Semaphore(0)

        def work() -> None:
            try:
                for i in iter(counter.__next__, None):
                    if i >= len(items):
                        return
                    fn(items[i])
            except BaseException as e:
                errors.append(e)

        def helper() -> None:
            try:
                work()
            finally:
                done.release()

        with blas_held_to_one_thread():
            for _ in range(helpers):
                self._inbox.put(helper)
            self._local.inside = True
            try:
                work()
            finally:
                self._local.inside = False
                for _ in range(helpers):
                    done.acquire()
        if errors:
            raise errors[0]


_pool: _Pool | None = None


def threads() -> int:
    """The number of threads the NumPy backend's kernels use (``KILN_NUM_THREADS``, else the cores)."""
    return _get_pool().n


def _get_pool() -> _Pool:
    global _pool
    if _pool is None:
        _pool = _Pool(_thread_count())
    return _pool


def parallel(fn: Callable[[T], None], items: Sequence[T]) -> None:
    """Run ``fn(item)`` for each of ``items`` on the backend's threads; the pieces must be independent
    (each writes its own part of the outputs). Called from inside a piece, it runs serially."""
    _get_pool().run(fn, items)


def chunks(n: int, grain: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges that cover ``range(n)`` with about ``grain`` each (the last may be longer,
    never shorter than half a grain): a cut that depends on ``n`` and ``grain`` only."""
    grain = max(1, grain)
    count = max(1, round(n / grain))
    bounds = [n * i // count for i in range(count + 1)]
    return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]


#: elements per piece of an elementwise kernel: big enough to pay for a hand-off, small enough to
#: stay in cache
GRAIN = 1 << 17


def row_blocks(rows: int, width: int) -> list[slice]:
    """Blocks of whole rows (``rows`` of ``width`` elements), about :data:`GRAIN` elements each."""
    return [slice(a, b) for a, b in chunks(rows, max(1, GRAIN // max(width, 1)))]


def flat_blocks(n: int) -> list[slice]:
    """Blocks of about :data:`GRAIN` elements covering ``range(n)``."""
    return [slice(a, b) for a, b in chunks(n, GRAIN)]


def parallel_sum(fn: Callable[[T, np.ndarray], None], items: Sequence[T], out: np.ndarray) -> None:
    """``out = sum over items of fn(item, part)``, where ``fn`` writes its part into ``part`` (``out``'s
    shape): the parts are summed in the items' order, so the result does not depend on the threads."""
    if len(items) == 1:
        fn(items[0], out)
        return
    parts = np.empty((len(items), *out.shape), out.dtype)
    parallel(lambda i: fn(items[i], parts[i]), range(len(items)))
    np.copyto(out, parts[0])
    for part in parts[1:]:
        out += part


_local = threading.local()


def scratch(key: str, size: int, dtype: Any) -> np.ndarray:
    """A 1-D scratch array of ``size`` elements owned by the calling thread, kept for the next call
    with the same ``key`` (grown when too small): kernels' temporaries stop costing allocations."""
    bufs: dict[tuple[str, str], np.ndarray] = _local.__dict__.setdefault("bufs", {})
    name = (key, np.dtype(dtype).str)
    buf = bufs.get(name)
    if buf is None or buf.size < size:
        buf = bufs[name] = np.empty(size, dtype)
    return buf[:size]


_blas: Any = None
_scanned = -1  # len(sys.modules) when _blas scanned the loaded libraries
_held = 0  # how many blas_held_to_one_thread() blocks are open, in any thread
_limiter: Any = None  # the limit they share, restored when the last one closes
_hold_lock = threading.Lock()


def _controller() -> Any:
    """threadpoolctl's view of the loaded BLAS libraries, scanned again whenever modules were imported
    since the last scan: an import (scipy, torch) may load a BLAS of its own, which a view taken
    before it would leave running on all its threads."""
    global _blas, _scanned
    if _blas is None or _scanned != len(sys.modules):
        from threadpoolctl import ThreadpoolController  # type: ignore[import-untyped]

        _blas, _scanned = ThreadpoolController(), len(sys.modules)
    return _blas


@contextlib.contextmanager
def blas_held_to_one_thread() -> Iterator[None]:
    """BLAS held to one thread inside the block (through threadpoolctl), restored when the last open
    such block ends, in whichever thread. The NumPy backend holds it for a whole Program run: BLAS's
    own workers, once woken, keep spinning for a while after each product and would take the cores
    from kiln's."""
    global _held, _limiter
    with _hold_lock:
        if _held == 0:
            _limiter = _controller().limit(limits=1, user_api="blas")
        _held += 1
    try:
        yield
    finally:
        with _hold_lock:
            _held -= 1
            if _held == 0:
                _limiter.restore_original_limits()
                _limiter = None


#: products smaller than this (multiply-adds) run in one BLAS call; larger ones are cut across threads
PARALLEL_MACS = 1 << 22


def matmul_into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out = a @ b`` (2-D, or batched with equal batch dims): a large product is cut into one piece
    per thread along the output's rows (or columns, if it has fewer rows), in multiples of 64, each
    piece a single-threaded BLAS call. Operands may be strided views (transposes): BLAS reads them
    without a copy."""
    m, n = out.shape[-2:]
    pieces = threads()
    if pieces == 1 or out.size * a.shape[-1] < PARALLEL_MACS or max(m, n) < 128:
        np.matmul(a, b, out=out)
        return out
    along_rows = m >= n
    size = m if along_rows else n
    step = -(-size // pieces // 64) * 64
    cuts = [(lo, min(lo + step, size)) for lo in range(0, size, step)]

    def piece(c: tuple[int, int]) -> None:
        if along_rows:
            np.matmul(a[..., c[0]:c[1], :], b, out=out[..., c[0]:c[1], :])
        else:
            np.matmul(a, b[..., c[0]:c[1]], out=out[..., c[0]:c[1]])

    parallel(piece, cuts)
    return out
