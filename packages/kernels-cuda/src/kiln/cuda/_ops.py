"""The CUDA kernels of kiln's ops: for each op, the launch of its kernel(s) with the geometry beside it.

Each function follows the kernel table's ``out=`` convention (``fn(*inputs, out=(...), **attrs)``) on
:class:`DeviceArray` views of the arena; optimizer updates take the run-time ``step``, ``lr``, ``scale``.
The math of each kernel is the op's NumPy reference (named in each ``.cu`` file); the tests run every
launch here through the CPU emulator against that reference.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from kiln.core import KilnError, OpError, dropout_key

THREADS = 256
#: at most this many blocks of grad-norm partial sums per gradient; their number depends only on the
#: gradient's size, so the sum's order (and result) never changes
NORM_BLOCKS = 64
MATMUL_TILE = 16


@attrs.frozen
class DeviceArray:
    """A Program tensor in device memory: ``ptr`` into the arena of ``device``."""

    device: Any
    ptr: int
    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def upload(cls, device: Any, a: np.ndarray) -> DeviceArray:
        """A new allocation on ``device`` holding a copy of the host array ``a`` (its dtype: ``bfloat16``
        for ml_dtypes' bf16): how checks and tests put their inputs on a device."""
        a = np.ascontiguousarray(a)
        ptr = device.alloc(max(a.nbytes, 4))
        device.copy_to_device(ptr, a)
        return cls(device, ptr, a.shape, str(a.dtype))

    def download(self) -> np.ndarray:
        """A host copy of its contents, of its dtype (:func:`np_dtype`: ml_dtypes' bfloat16 for bf16):
        what :meth:`upload` put there, once the device's work on it is done (synchronise first)."""
        return self.device.copy_to_host(self.ptr, self.nbytes).view(np_dtype(self.dtype)).reshape(self.shape)

    def reshape(self, shape: Sequence[int]) -> DeviceArray:
        """The same memory with another shape of as many elements."""
        if math.prod(shape) != self.size:
            raise KilnError(f"cannot view {self.shape} as {tuple(shape)}")
        return attrs.evolve(self, shape=tuple(shape))

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * itemsize(self.dtype)


def np_dtype(dtype: str) -> np.dtype[Any]:
    """The NumPy dtype of a Program tensor's dtype (``bfloat16`` through ml_dtypes)."""
    if dtype == "bfloat16":
        from kiln.core.plan import require_ml_dtypes

        return np.dtype(require_ml_dtypes().bfloat16)
    return np.dtype(dtype)


def itemsize(dtype: str) -> int:
    """Bytes per element; ``bfloat16`` (its 16 bits, as the kernels read it) without importing ml_dtypes."""
    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def ew_grid(n: int) -> tuple[int]:
    """Blocks of an elementwise (grid-stride) kernel over n elements."""
    return (max(1, min(cdiv(n, THREADS), 4096)),)


def row_block(c: int) -> tuple[int]:
    """Threads of a row kernel for rows of c elements: whole warps, at most 256."""
    return (min(THREADS, max(32, cdiv(c, 32) * 32)),)


def _ptr(a: DeviceArray | None) -> int:
    return 0 if a is None else a.ptr


def _f32(*arrays: DeviceArray | None) -> None:
    for a in arrays:
        if a is not None and a.dtype != "float32":
            raise KilnError(f"kiln.cuda's kernels compute in float32; found a {a.dtype} tensor {a.shape}")


def _i32(a: DeviceArray, what: str) -> None:
    if a.dtype != "int32":
        raise KilnError(f"kiln.cuda's kernels read {what} as int32; found {a.dtype}")


#: alignment of every device allocation and workspace slice
ALIGN = 256


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Workspace:
    """One device allocation the kernels' temporaries are carved from (a stack: :class:`Scratch` takes
    slices and gives them back on exit). The backend sizes it when it compiles a Program, by a dry run of
    every step (:func:`kiln.cuda._backend.scratch_bytes`), so a training step allocates no memory (and a
    CUDA graph can capture it). A slice that does not fit falls back to an allocation, counted in
    ``overflows``."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.base, self.nbytes, self.top, self.high, self.overflows = ptr, nbytes, 0, 0, 0

    def take(self, nbytes: int) -> int | None:
        start = _align(self.base + self.top) - self.base  # ALIGN-aligned addresses, wherever the base is
        if start + nbytes > self.nbytes:
            self.overflows += 1
            return None
        self.top = start + nbytes
        self.high = max(self.high, self.top)
        return self.base + start


class Scratch:
    """Device memory standing in for outputs nothing reads (None in ``out``) and kernels' temporaries:
    slices of the device's workspace when it has one, else allocations; released on exit."""

    def __init__(self, device: Any) -> None:
        self.device, self.ptrs = device, []
        self.workspace: Workspace | None = getattr(device, "workspace", None)
        self.mark = self.workspace.top if self.workspace is not None else 0

    def __enter__(self) -> Scratch:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.workspace is not None:
            self.workspace.top = self.mark
        for p in self.ptrs:
            self.device.free(p)

    def array(self, shape: Sequence[int], dtype: str = "float32") -> DeviceArray:
        shape = tuple(shape)
        nbytes = math.prod(shape) * itemsize(dtype)
        p = self.workspace.take(nbytes) if self.workspace is not None else None
        if p is None:
            p = self.device.alloc(nbytes)
            self.ptrs.append(p)
        return DeviceArray(self.device, p, shape, dtype)

    def out(self, o: DeviceArray | None, shape: Sequence[int], dtype: str = "float32") -> DeviceArray:
        return self.array(shape, dtype) if o is None else o


# --- elementwise ----------------------------------------------------------------------------------


def _fill(value: float) -> Callable[..., None]:
    def kernel(*, out: Sequence[DeviceArray], shape: Any = None, dtype: Any = None, **_: Any) -> None:
        o = out[0]
        if value == 0.0:
            o.device.memset(o.ptr, 0, o.nbytes)
        elif o.dtype == "float32":
            o.device.launch("fill_f32", ew_grid(o.size), (THREADS,), (o.ptr, value, o.size))
        else:
            o.device.copy_to_device(o.ptr, np.full(o.shape, value, o.dtype))

    return kernel


def fill(*, out: Sequence[DeviceArray], value: float, **_: Any) -> None:
    _fill(value)(out=out)


def zeros_like(x: DeviceArray, *, out: Sequence[DeviceArray]) -> None:
    _fill(0.0)(out=out)


def copy(x: DeviceArray, *, out: Sequence[DeviceArray]) -> None:
    if out[0].ptr != x.ptr:
        x.device.copy(out[0].ptr, x.ptr, x.nbytes)


def scale(x: DeviceArray, *, out: Sequence[DeviceArray], factor: float) -> None:
    _f32(x)
    x.device.launch("scale_f32", ew_grid(x.size), (THREADS,), (x.ptr, out[0].ptr, factor, x.size))


def _trailing(a: DeviceArray, b: DeviceArray, op: str) -> int:
    """b's element count where b has a's shape or a's trailing shape (leading 1s allowed)."""
    bs = list(b.shape)
    while bs and bs[0] == 1:
        bs.pop(0)
    if tuple(bs) != a.shape[len(a.shape) - len(bs):]:
        raise KilnError(f"op {op!r} on cuda: b {b.shape} must have a's {a.shape} trailing shape; other "
                        "broadcasts have no CUDA kernel yet")
    return max(b.size, 1)


def _binary(kernel: str, op: str) -> Callable[..., None]:
    def fn(a: DeviceArray, b: DeviceArray, *, out: Sequence[DeviceArray]) -> None:
        _f32(a, b)
        a.device.launch(kernel, ew_grid(a.size), (THREADS,), (a.ptr, b.ptr, out[0].ptr, a.size,
                                                               _trailing(a, b, op)))

    return fn


def _unary(kernel: str, **flags: Callable[[Any], int]) -> Callable[..., None]:
    def fn(x: DeviceArray, *, out: Sequence[DeviceArray], **attrs: Any) -> None:
        _f32(x)
        extra = [f(attrs[k]) for k, f in flags.items()]
        x.device.launch(kernel, ew_grid(x.size), (THREADS,), (x.ptr, out[0].ptr, x.size, *extra))

    return fn


def _unary_backward(kernel: str, **flags: Callable[[Any], int]) -> Callable[..., None]:
    def fn(d: DeviceArray, x: DeviceArray, *, out: Sequence[DeviceArray], **attrs: Any) -> None:
        _f32(d, x)
        extra = [f(attrs[k]) for k, f in flags.items()]
        x.device.launch(kernel, ew_grid(x.size), (THREADS,), (d.ptr, x.ptr, out[0].ptr, x.size, *extra))

    return fn


#: (from, to) dtypes -> the cast kernel
CASTS = {("float32", "bfloat16"): "cast_f32_bf16", ("bfloat16", "float32"): "cast_bf16_f32"}


def cast(x: DeviceArray, *, out: Sequence[DeviceArray]) -> None:
    """``out = x`` in ``out``'s dtype: float32 to bfloat16 rounds to nearest even, bfloat16 to float32 is
    exact; a cast to the same dtype is a copy."""
    o = out[0]
    if o.shape != x.shape:
        raise KilnError(f"cast on cuda: out {o.shape} must have x's shape {x.shape}")
    if o.dtype == x.dtype:
        x.device.copy(o.ptr, x.ptr, x.nbytes)
        return
    kernel = CASTS.get((x.dtype, o.dtype))
    if kernel is None:
        raise KilnError(f"cast on cuda: no kernel from {x.dtype} to {o.dtype}; kiln.cuda casts "
                        + ", ".join(f"{a} -> {b}" for a, b in CASTS))
    x.device.launch(kernel, ew_grid(x.size), (THREADS,), (x.ptr, o.ptr, x.size))


def cast_op(x: DeviceArray, *, out: Sequence[DeviceArray], dtype: str) -> None:
    """The op ``cast``: ``x``'s values rounded to ``dtype`` (``bf16``: nearest even; ``fp32``: as they
    are), held in ``out``'s own type (a float32 slot keeps the bf16 values as float32)."""
    o = out[0]
    if dtype == "fp32" or o.dtype == "bfloat16" or x.dtype == "bfloat16":
        if dtype not in ("fp32", "bf16"):
            raise KilnError(f"op 'cast' to {dtype!r} on cuda: kiln.cuda casts to fp32 and bf16")
        cast(x, out=[o])  # a copy, a widening (exact) or the rounding into a bf16 slot
        return
    if dtype != "bf16":
        raise KilnError(f"op 'cast' to {dtype!r} on cuda: kiln.cuda casts to fp32 and bf16",
                        hint="fp16, fp8 and fp4 casts run on the numpy backend")
    with Scratch(x.device) as s:
        round_bf16(s, x, into=o)


def _signed(u: int) -> int:
    """A 64-bit pattern as the signed value a ``long long`` argument carries."""
    u &= (1 << 64) - 1
    return u - (1 << 64) if u >= 1 << 63 else u


def dropout(x: DeviceArray, *, out: Sequence[DeviceArray], p: float, seed: int, offset: int) -> None:
    """The counter-based mask of kiln-core's ``dropout`` (the same splitmix64 stream keyed by core's
    :func:`~kiln.core.dropout_key`, so the same mask as the NumPy backend for the same seed and
    counters); ``offset`` is the step's counter offset."""
    _f32(x, out[0])
    if not 0.0 <= p < 1.0:
        raise KilnError(f"op 'dropout': p = {p} is not a drop probability in [0, 1)")
    key = dropout_key(seed)
    threshold = math.ceil(p * 2.0**53)
    if x.size:
        x.device.launch("dropout_f32", ew_grid(x.size), (THREADS,),
                        (x.ptr, out[0].ptr, x.size, _signed(key), _signed(offset), threshold,
                         float(np.float32(1.0 / (1.0 - p)))))


def _is_tanh(approximate: str) -> int:
    return int(approximate == "tanh")


def swiglu(x: DeviceArray, *, out: Sequence[DeviceArray]) -> None:
    _f32(x)
    m = x.shape[-1] // 2
    rows = x.size // max(x.shape[-1], 1)
    x.device.launch("swiglu_f32", ew_grid(rows * m), (THREADS,), (x.ptr, out[0].ptr, rows, m))


def swiglu_backward(d: DeviceArray, x: DeviceArray, *, out: Sequence[DeviceArray]) -> None:
    _f32(d, x)
    m = x.shape[-1] // 2
    rows = x.size // max(x.shape[-1], 1)
    x.device.launch("swiglu_backward_f32", ew_grid(rows * m), (THREADS,), (d.ptr, x.ptr, out[0].ptr, rows, m))


def swiglu_bf16(x: DeviceArray, *, out: Sequence[DeviceArray]) -> None:
    """``swiglu`` under the bf16 recipe (``swiglu@cuda:bfloat16``), rounding inside the op where NumPy's
    ``swiglu@numpy:bfloat16`` does: a bf16 ``x`` read and ``out`` written as bf16 directly
    (``swiglu_rp_bf16io``), a float32 one through ``swiglu_rp_bf16``; ``out`` stored in its slot's dtype."""
    m = x.shape[-1] // 2
    rows = x.size // max(x.shape[-1], 1)
    io = x.dtype == "bfloat16"
    with Scratch(x.device) as s:
        xs = as_dtype(s, x, x.dtype if io else "float32")
        ys, store = _bf16_outputs(s, out, (x.dtype if io else "float32",))
        assert xs is not None and ys[0] is not None
        x.device.launch("swiglu_rp_bf16io" if io else "swiglu_rp_bf16", ew_grid(rows * m), (THREADS,),
                        (xs.ptr, ys[0].ptr, rows, m))
        store()


def swiglu_backward_bf16(d: DeviceArray, x: DeviceArray, *, out: Sequence[DeviceArray]) -> None:
    """Its backward with NumPy's ``swiglu_backward@numpy:bfloat16`` rounding points: bf16 ``d`` and ``x``
    read and ``d_x`` written as bf16 directly (``swiglu_backward_rp_bf16io``); a bf16 ``x`` with a float32
    ``d`` read as they are, ``d_x`` in float32 (``swiglu_backward_rp_bf16x``); else all as float32."""
    m = x.shape[-1] // 2
    rows = x.size // max(x.shape[-1], 1)
    bx = x.dtype == "bfloat16"
    kernel, dt, xt = ("swiglu_backward_rp_bf16", "float32", "float32")
    if bx and d.dtype == "bfloat16":
        kernel, dt, xt = "swiglu_backward_rp_bf16io", "bfloat16", "bfloat16"
    elif bx and d.dtype == "float32":
        kernel, xt = "swiglu_backward_rp_bf16x", "bfloat16"
    with Scratch(x.device) as s:
        ds, xs = as_dtype(s, d, dt), as_dtype(s, x, xt)
        ys, store = _bf16_outputs(s, out, (dt,))
        assert ds is not None and xs is not None and ys[0] is not None
        x.device.launch(kernel, ew_grid(rows * m), (THREADS,), (ds.ptr, xs.ptr, ys[0].ptr, rows, m))
        store()


def silu_mul(gate: DeviceArray, up: DeviceArray, *, out: Sequence[DeviceArray]) -> None:
    _f32(gate, up)
    gate.device.launch("silu_mul_f32", ew_grid(gate.size), (THREADS,),
                       (gate.ptr, up.ptr, out[0].ptr, gate.size))


def silu_mul_backward(d: DeviceArray, gate: DeviceArray, up: DeviceArray, *,
                      out: Sequence[DeviceArray | None]) -> None:
    _f32(d, gate, up)
    gate.device.launch("silu_mul_backward_f32", ew_grid(gate.size), (THREADS,),
                       (d.ptr, gate.ptr, up.ptr, _ptr(out[0]), _ptr(out[1]), gate.size))


def _lines(shape: tuple[int, ...], axis: int) -> tuple[int, int, int]:
    axis = axis % len(shape)
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])


def softmax(x: DeviceArray, *, out: Sequence[DeviceArray], axis: int) -> None:
    _f32(x)
    outer, c, inner = _lines(x.shape, axis)
    if outer * inner:
        x.device.launch("softmax_f32", (outer * inner,), row_block(c), (x.ptr, out[0].ptr, c, inner))


def softmax_backward(d: DeviceArray, y: DeviceArray, *, out: Sequence[DeviceArray], axis: int) -> None:
    _f32(d, y)
    outer, c, inner = _lines(y.shape, axis)
    if outer * inner:
        y.device.launch("softmax_backward_f32", (outer * inner,), row_block(c),
                        (d.ptr, y.ptr, out[0].ptr, c, inner))


# --- normalization --------------------------------------------------------------------------------


def rmsnorm(x: DeviceArray, weight: DeviceArray, *, out: Sequence[DeviceArray | None], eps: float) -> None:
    _f32(x, weight)
    c = x.shape[-1]
    rows = x.size // c
    with Scratch(x.device) as s:
        y, rstd = s.out(out[0], x.shape), s.out(out[1], x.shape[:-1])
        if rows:
            x.device.launch("rmsnorm_f32", (rows,), row_block(c),
                            (x.ptr, weight.ptr, y.ptr, rstd.ptr, c, eps))


def fused_residual_rmsnorm(residual: DeviceArray, x: DeviceArray, weight: DeviceArray, *,
                           out: Sequence[DeviceArray | None], eps: float) -> None:
    _f32(residual, x, weight)
    c = x.shape[-1]
    rows = x.size // c
    with Scratch(x.device) as s:
        res, y, rstd = s.out(out[0], x.shape), s.out(out[1], x.shape), s.out(out[2], x.shape[:-1])
        if rows:
            x.device.launch("fused_residual_rmsnorm_f32", (rows,), row_block(c),
                            (residual.ptr, x.ptr, weight.ptr, res.ptr, y.ptr, rstd.ptr, c, eps))


def _rms_grads(d_y: DeviceArray | None, x: DeviceArray, rstd: DeviceArray, weight: DeviceArray,
               d_rstd: DeviceArray | None, d_extra: DeviceArray | None, d_x: DeviceArray,
               d_w: DeviceArray | None) -> None:
    """d_weight (column kernel, first: d_x may take over d_y's storage), then d_x (row kernel)."""
    _f32(d_y, x, rstd, weight, d_rstd, d_extra)
    dev, c = x.device, x.shape[-1]
    rows = x.size // c
    if d_w is not None:
        if d_y is None or not rows:
            dev.memset(d_w.ptr, 0, d_w.nbytes)
        else:
            dev.launch("rmsnorm_backward_dw_f32", (cdiv(c, THREADS),), (THREADS,),
                       (d_y.ptr, x.ptr, rstd.ptr, d_w.ptr, rows, c))
    if rows:
        dev.launch("rmsnorm_backward_dx_f32", (rows,), row_block(c),
                   (_ptr(d_y), x.ptr, rstd.ptr, weight.ptr, _ptr(d_rstd), _ptr(d_extra), d_x.ptr, c))


def rmsnorm_backward(d_y: DeviceArray | None, x: DeviceArray, rstd: DeviceArray, weight: DeviceArray,
                     d_rstd: DeviceArray | None = None, *, out: Sequence[DeviceArray | None]) -> None:
    with Scratch(x.device) as s:
        _rms_grads(d_y, x, rstd, weight, d_rstd, None, s.out(out[0], x.shape), out[1])


def fused_residual_rmsnorm_backward(d_y: DeviceArray | None, d_residual_out: DeviceArray | None,
                                    residual_out: DeviceArray, rstd: DeviceArray, weight: DeviceArray,
                                    d_rstd: DeviceArray | None = None, *,
                                    out: Sequence[DeviceArray | None]) -> None:
    d_residual, d_x, d_w = out
    with Scratch(residual_out.device) as s:
        first = d_residual if d_residual is not None else s.out(d_x, residual_out.shape)
        _rms_grads(d_y, residual_out, rstd, weight, d_rstd, d_residual_out, first, d_w)
        if d_residual is not None and d_x is not None:
            d_x.device.copy(d_x.ptr, d_residual.ptr, d_x.nbytes)


# --- loss, embedding, rope ------------------------------------------------------------------------


def cross_entropy(logits: DeviceArray, targets: DeviceArray, *, out: Sequence[DeviceArray | None],
                  ignore_index: int) -> None:
    _f32(logits)
    _i32(targets, "targets")
    n, v = logits.shape
    with Scratch(logits.device) as s:
        loss, lse = s.out(out[0], (n,)), s.out(out[1], (n,))
        if n:
            logits.device.launch("cross_entropy_f32", (n,), row_block(v),
                                 (logits.ptr, targets.ptr, loss.ptr, lse.ptr, v, ignore_index))


def cross_entropy_backward(d_loss: DeviceArray | None, logits: DeviceArray, targets: DeviceArray,
                           lse: DeviceArray, d_lse: DeviceArray | None = None, *,
                           out: Sequence[DeviceArray], ignore_index: int) -> None:
    _f32(d_loss, logits, lse, d_lse)
    _i32(targets, "targets")
    n, v = logits.shape
    if n:
        logits.device.launch("cross_entropy_backward_f32", (n,), row_block(v),
                             (_ptr(d_loss), logits.ptr, targets.ptr, lse.ptr, _ptr(d_lse), out[0].ptr, v,
                              ignore_index))


def embedding(ids: DeviceArray, weight: DeviceArray, *, out: Sequence[DeviceArray],
              padding_idx: int | None = None) -> None:
    _f32(weight)
    _i32(ids, "token ids")
    c = weight.shape[1]
    weight.device.launch("embedding_f32", ew_grid(ids.size * c), (THREADS,),
                         (ids.ptr, weight.ptr, out[0].ptr, ids.size, c))


#: vocabulary parts of the embedding backward: each thread scans every token for its part's rows
EMBEDDING_PARTS = 128


def embedding_backward(d_out: DeviceArray, ids: DeviceArray, *, out: Sequence[DeviceArray],
                       num_embeddings: int, padding_idx: int | None = None) -> None:
    _f32(d_out)
    _i32(ids, "token ids")
    c, v = d_out.shape[-1], num_embeddings
    rows_per_part = max(1, cdiv(v, EMBEDDING_PARTS))
    d_out.device.launch("embedding_backward_f32", (cdiv(c, THREADS), cdiv(v, rows_per_part)), (THREADS,),
                        (d_out.ptr, ids.ptr, out[0].ptr, ids.size, c, v, rows_per_part,
                         -1 if padding_idx is None else padding_idx))


#: error slots of :func:`vocab_local_ids` per device: one per (op, vocabulary size) mapping ids there
ID_SLOTS = 64


class _IdErrors:
    """A device's error slots (two int64 words each: set, the id found), allocated at its first
    :func:`vocab_local_ids`, and what each slot checks: (op, size)."""

    def __init__(self, device: Any) -> None:
        self.ptr = device.alloc(16 * ID_SLOTS)
        device.memset(self.ptr, 0, 16 * ID_SLOTS)  # freed with the device (its context, its memory)
        self.slots: dict[tuple[str, int], int] = {}

    def slot(self, op: str, size: int) -> int:
        i = self.slots.setdefault((op, size), len(self.slots) % ID_SLOTS)  # past 64 ops: shared, still caught
        return self.ptr + 16 * i


_ID_ERRORS: weakref.WeakKeyDictionary[Any, _IdErrors] = weakref.WeakKeyDictionary()


def vocab_local_ids(ids: DeviceArray, *, out: Sequence[DeviceArray | None], rank: int, rows: int, size: int,
                    fill: int, ignore_index: int | None = None, op: str = "vocab_local_ids") -> None:
    """Token ids (or targets) mapped into rank ``rank``'s rows ``[rank * rows, (rank + 1) * rows)`` of a
    vocabulary of ``size`` on the device (kiln-dist's ``_local``), ``out = (rel, mine, owner)``, each int32
    of the ids' shape or None: ``rel`` the id relative to the rank's first row where the rank holds it,
    -1 for an ``ignore_index`` id, else ``fill``; ``mine`` 1 where the rank holds it, else 0; ``owner``
    the rank holding it, -1 for an ignored id. An id (not ignored) outside ``[0, size)`` cannot raise on
    the device: :func:`check_id_errors` raises the ``OpError`` naming ``op`` after the next
    synchronisation (the backend checks when it reads a tensor back)."""
    _i32(ids, "token ids")
    for o in out:
        if o is not None and (o.dtype != "int32" or o.size != ids.size):
            raise KilnError(f"vocab_local_ids writes int32 of the ids' {ids.size} elements; found {o.dtype} "
                            f"{o.shape}")
    if rows < 1 or rank < 0 or size < 0:
        raise KilnError(f"vocab_local_ids: rank {rank} of {rows} rows (a vocabulary of {size}) is no split")
    rel, mine, owner = (*out, None, None, None)[:3]
    dev = ids.device
    err = 0 if getattr(dev, "name", "") == "sizing" else _id_errors(dev).slot(op, size)
    if ids.size:
        dev.launch("vocab_local_ids_i32", ew_grid(ids.size), (THREADS,),
                   (ids.ptr, _ptr(rel), _ptr(mine), _ptr(owner), err, ids.size, rows, rank, size, fill,
                    (1 << 40) if ignore_index is None else ignore_index))


def _id_errors(device: Any) -> _IdErrors:
    if device not in _ID_ERRORS:
        _ID_ERRORS[device] = _IdErrors(device)
    return _ID_ERRORS[device]


def check_id_errors(device: Any) -> None:
    """After a synchronisation of ``device``: the ``OpError`` of the first op whose
    :func:`vocab_local_ids` found an id outside its vocabulary since the last check (the slots then
    reset); nothing to read where no ids were mapped on ``device``."""
    errors = _ID_ERRORS.get(device)
    if errors is None or not errors.slots:
        return
    used = min(len(errors.slots), ID_SLOTS)
    words = device.copy_to_host(errors.ptr, 16 * used).view(np.int64).reshape(used, 2)
    if not words[:, 0].any():
        return
    device.memset(errors.ptr, 0, 16 * used)
    for (op, size), i in errors.slots.items():
        if words[i, 0]:
            raise OpError(f"op {op!r}: index {int(words[i, 1])} is outside [0, {size})", op=op)


def rope(x: DeviceArray, freqs: DeviceArray | None, position_ids: DeviceArray, *, out: Sequence[DeviceArray],
         head_dim: int, rotary_dim: int | None = None, theta: float = 10000.0, inverse: bool = False,
         interleaved: bool = False) -> None:
    _f32(x, freqs)
    _i32(position_ids, "position ids")
    b, t, f = x.shape
    rd = head_dim if rotary_dim is None else rotary_dim
    if f % head_dim or rd % 2 or not 0 < rd <= head_dim:
        raise KilnError(f"op 'rope' on cuda: head_dim {head_dim} must divide {f}, rotary_dim {rd} even "
                        f"and in (0, head_dim]")
    n = b * t * (f // head_dim) * (head_dim - rd // 2)
    x.device.launch("rope_f32", ew_grid(n), (THREADS,),
                    (x.ptr, _ptr(freqs), position_ids.ptr, out[0].ptr, b, t, f // head_dim, head_dim, rd,
                     int(len(position_ids.shape) == 2), theta, int(inverse), int(interleaved)))


# --- matmul ---------------------------------------------------------------------------------------


def rope_freqs(*, out: Sequence[DeviceArray], rows: int, rotary_dim: int, theta: float, rope_type: str,
               **scaling: Any) -> None:
    """The (cos, sin) table of a RoPE kind: its inverse frequencies by kiln-core's own function on the
    host (``rotary_dim // 2`` values, from the attributes alone) copied to the workspace, then a thread
    per (position, frequency)."""
    from kiln.core.ops import rope_inv_freq

    o = out[0]
    _f32(o)
    inv, attention = rope_inv_freq(rotary_dim, theta, rope_type, seq_len=rows, **scaling)
    half = rotary_dim // 2
    with Scratch(o.device) as s:
        table = s.array((half,))
        o.device.copy_to_device(table.ptr, np.ascontiguousarray(inv, np.float32))
        if rows and half:
            o.device.launch("rope_freqs_f32", ew_grid(rows * half), (THREADS,),
                            (table.ptr, o.ptr, rows, half, attention))


def matmul(a: DeviceArray, b: DeviceArray, c: DeviceArray | None = None, *, out: Sequence[DeviceArray],
           transpose: str = "NN", accumulate: bool = False, alpha: float = 1.0, beta: float = 1.0) -> None:
    """out = alpha op(a) op(b) (+ c, or beta c), batched over leading dims: cuBLASLt where the device has
    it (``device.blas``, nvmath-python on a GPU), else the tiled SIMT kernel. ``a`` and ``b`` both
    bfloat16 (the bf16 recipe): bf16 in, fp32 accumulate, a float32 ``out``."""
    eff_beta = 1.0 if (beta == 1.0 or accumulate) else beta
    blas = getattr(a.device, "blas", None)
    if blas is not None:
        from kiln.cuda._blas import gemm_plan

        o = out[0]
        if c is not None and (c.shape != o.shape or c.dtype != o.dtype):
            raise KilnError(f"matmul on cuBLASLt: c {c.shape} {c.dtype} must be out's {o.shape} {o.dtype}")
        plan = gemm_plan(a.shape, b.shape, o.shape, (a.dtype, b.dtype, o.dtype), transpose=transpose,
                         alpha=alpha, beta=eff_beta if c is not None else 0.0)
        if plan.m and plan.n and plan.batch:
            blas.gemm(plan, b.ptr, a.ptr, _ptr(c), o.ptr)
        return
    low = a.dtype == b.dtype == "bfloat16"  # the bf16 recipe: bf16 in, fp32 accumulate and out
    _f32(*(() if low else (a, b)), c, out[0])
    _matmul_simt("matmul_bf16" if low else "matmul_f32", a, b, c, out[0], transpose, alpha, eff_beta)


def _matmul_simt(kernel: str, a: DeviceArray, b: DeviceArray, c: DeviceArray | None, o: DeviceArray,
                 transpose: str, alpha: float, beta: float) -> None:
    """One launch of the SIMT matmul kernel ``kernel`` (any of matmul.cu's, one parameter list)."""
    if a.shape[:-2] != b.shape[:-2]:  # the kernel strides both operands by one batch index
        raise KilnError(f"matmul on cuda: a {a.shape} and b {b.shape} have different batch dims; broadcast "
                        "batch dims have no CUDA kernel yet")
    ta, tb = transpose[0] == "T", transpose[1] == "T"
    m, k = (a.shape[-1], a.shape[-2]) if ta else (a.shape[-2], a.shape[-1])
    n = b.shape[-2] if tb else b.shape[-1]
    batch = math.prod(a.shape[:-2])
    if not (m and n and batch):
        return
    grid = (cdiv(n, MATMUL_TILE), cdiv(m, MATMUL_TILE), batch)
    a.device.launch(kernel, grid, (MATMUL_TILE, MATMUL_TILE),
                    (a.ptr, b.ptr, _ptr(c), o.ptr, m, n, k, int(ta), int(tb), m * k, k * n, m * n, alpha,
                     beta))


def layernorm(x: DeviceArray, weight: DeviceArray, bias: DeviceArray | None = None, *,
              out: Sequence[DeviceArray | None], eps: float) -> None:
    """A block per row: the mean, then the biased variance around it (two passes), then y."""
    _f32(x, weight, bias)
    c = x.shape[-1]
    rows = x.size // c
    with Scratch(x.device) as s:
        y, mean, rstd = s.out(out[0], x.shape), s.out(out[1], x.shape[:-1]), s.out(out[2], x.shape[:-1])
        if rows:
            x.device.launch("layernorm_f32", (rows,), row_block(c),
                            (x.ptr, weight.ptr, _ptr(bias), y.ptr, mean.ptr, rstd.ptr, c, eps))


def layernorm_backward(d_y: DeviceArray | None, x: DeviceArray, mean: DeviceArray, rstd: DeviceArray,
                       weight: DeviceArray, d_mean: DeviceArray | None = None,
                       d_rstd: DeviceArray | None = None, *, out: Sequence[DeviceArray | None]) -> None:
    """d_weight and d_bias (column kernel, first: d_x may take over d_y's storage), then d_x (rows)."""
    _f32(d_y, x, mean, rstd, weight, d_mean, d_rstd)
    dev, c = x.device, x.shape[-1]
    rows = x.size // c
    with Scratch(dev) as s:
        d_x, d_w = s.out(out[0], x.shape), s.out(out[1], weight.shape)
        d_b = out[2]
        if d_y is None or not rows:
            for a in (d_w, d_b):
                if a is not None:
                    dev.memset(a.ptr, 0, a.nbytes)
        else:
            dev.launch("layernorm_backward_dw_f32", (cdiv(c, THREADS),), (THREADS,),
                       (d_y.ptr, x.ptr, mean.ptr, rstd.ptr, d_w.ptr, _ptr(d_b), rows, c))
        if rows:
            dev.launch("layernorm_backward_dx_f32", (rows,), row_block(c),
                       (_ptr(d_y), x.ptr, mean.ptr, rstd.ptr, weight.ptr, _ptr(d_mean), _ptr(d_rstd), d_x.ptr,
                        c))


# --- the LM head's loss: a composition, and the fused training pass ------------------------------

#: bound on the logits ([rows, vocabulary]) the LM head holds at once (16 MiB in float32): its tile
LOGITS_TILE = 1 << 22


def _rows_of(a: DeviceArray, r0: int, r1: int) -> DeviceArray:
    row = math.prod(a.shape[1:]) * itemsize(a.dtype)
    return DeviceArray(a.device, a.ptr + r0 * row, (r1 - r0, *a.shape[1:]), a.dtype)


def _head_tiles(n: int, v: int) -> list[tuple[int, int]]:
    rows = max(1, min(n, LOGITS_TILE // max(v, 1)))
    return [(r0, min(r0 + rows, n)) for r0 in range(0, n, rows)]


def _head_plan(n: int, v: int, c: int, matmul: str) -> tuple[int, int]:
    """The fused LM-head pass's row block and vocabulary chunk (``chunk >= v``: the one-pass tiling of
    :func:`_head_tiles`), at most :data:`LOGITS_TILE` logits: whichever ``kiln.cuda._roofline.lm_head_plan``
    predicts faster on an H100 with products at ``matmul``'s rate (``fp32``: CUDA cores, as the SIMT
    kernel and cuBLASLt's float32 GEMM run; ``bf16``: tensor cores)."""
    from kiln.cuda._roofline import lm_head_plan

    return lm_head_plan(n, v, c, LOGITS_TILE, "h100", matmul)


def _vocab_tiled_pass(d_loss: DeviceArray | None, x: DeviceArray, weight: DeviceArray, targets: DeviceArray,
                      loss: DeviceArray, lse: DeviceArray, d_x: DeviceArray | None, d_w: DeviceArray | None,
                      rows: int, chunk: int, ignore_index: int, bf16: bool) -> None:
    """The fused LM-head pass tiled over rows and vocabulary (``chunk < V``): per block of ``rows`` rows,
    pass 1 computes the logits chunk by chunk (``z = x w_chunk^T``) into the one tile buffer and folds each
    into a running maximum and sum (``lm_head_lse_chunk``; the maximum in ``lse``, the target's logit in
    ``loss``), then ``lm_head_lse_done`` gives lse and the loss; pass 2 computes each chunk again, turns it
    into its gradient (``lm_head_grad_chunk``) and adds ``g w_chunk`` to ``d_x`` and ``g^T x`` to
    ``d_w``'s chunk (row blocks in order). ``bf16``: x and w are bf16, the logits read rounded to bf16,
    the gradient written as bf16 (``lm_head_loss_grad_bf16``'s rounding points); the caller rounds d_x and
    d_w. Holds one tile of float32 logits (and, bf16, one of their bf16 gradient) and one row of sums."""
    dev = x.device
    n, v = x.shape[0], weight.shape[0]
    kind = "bf16" if bf16 else "f32"
    with Scratch(dev) as s:
        zbuf, sums = s.array((rows, chunk)), s.array((rows,))
        gbuf = s.array((rows, chunk), "bfloat16") if bf16 else zbuf
        chunks = [(v0, min(v0 + chunk, v)) for v0 in range(0, v, chunk)]
        for i, r0 in enumerate(range(0, n, rows)):
            r1 = min(r0 + rows, n)
            xr, tr, lr, sr = (_rows_of(a, r0, r1) for a in (x, targets, loss, lse))
            dl = 0 if d_loss is None else _rows_of(d_loss, r0, r1).ptr
            for v0, v1 in chunks:  # pass 1: the online log-sum-exp
                z = DeviceArray(dev, zbuf.ptr, (r1 - r0, v1 - v0), "float32")
                matmul(xr, _rows_of(weight, v0, v1), out=(z,), transpose="NT")
                dev.launch(f"lm_head_lse_chunk_{kind}", (r1 - r0,), row_block(v1 - v0),
                           (z.ptr, tr.ptr, sr.ptr, sums.ptr, lr.ptr, v1 - v0, v0, int(v0 == 0)))
            dev.launch("lm_head_lse_done_f32", ew_grid(r1 - r0), (THREADS,),
                       (sums.ptr, lr.ptr, tr.ptr, lr.ptr, sr.ptr, r1 - r0, v, ignore_index))
            for j, (v0, v1) in enumerate(chunks):  # pass 2: the logits again, their gradient, d_x and d_w
                z = DeviceArray(dev, zbuf.ptr, (r1 - r0, v1 - v0), "float32")
                g = DeviceArray(dev, gbuf.ptr, z.shape, gbuf.dtype)
                wc = _rows_of(weight, v0, v1)
                matmul(xr, wc, out=(z,), transpose="NT")
                args = (dl, z.ptr, tr.ptr, sr.ptr) + ((g.ptr,) if bf16 else ()) + (v1 - v0, v0, ignore_index)
                dev.launch(f"lm_head_grad_chunk_{kind}", (r1 - r0,), row_block(v1 - v0), args)
                if d_x is not None:
                    dxr = _rows_of(d_x, r0, r1)
                    matmul(g, wc, dxr if j else None, out=(dxr,))
                if d_w is not None:
                    dwc = _rows_of(d_w, v0, v1)
                    matmul(g, xr, dwc if i else None, out=(dwc,), transpose="TN")


def _tile(buf: DeviceArray, r0: int, r1: int) -> DeviceArray:
    """The first ``r1 - r0`` rows of the one tile buffer ``buf``: every tile of rows reuses it."""
    return DeviceArray(buf.device, buf.ptr, (r1 - r0, *buf.shape[1:]), buf.dtype)


def _logits(x: DeviceArray, weight: DeviceArray, z: DeviceArray, softcap: float | None) -> None:
    matmul(x, weight, out=(z,), transpose="NT")
    if softcap is not None:
        z.device.launch("softcap_f32", ew_grid(z.size), (THREADS,), (z.ptr, z.size, softcap))


def fused_lm_head_loss(x: DeviceArray, weight: DeviceArray, targets: DeviceArray, *,
                       out: Sequence[DeviceArray | None], ignore_index: int, chunk_size: int = 0,
                       softcap: float | None = None) -> None:
    """Per tile of rows: logits = x w^T (matmul kernel, softcapped), then the cross-entropy kernel. One
    tile of logits is held (``chunk_size``, the NumPy kernel's vocabulary chunk, is not needed: the
    cross-entropy kernel reduces whole rows)."""
    _f32(x, weight)
    n, v = x.shape[0], weight.shape[0]
    with Scratch(x.device) as s:
        loss, lse = s.out(out[0], (n,)), s.out(out[1], (n,))
        tiles = _head_tiles(n, v)
        buf = s.array((tiles[0][1], v)) if n else None
        for r0, r1 in tiles:
            assert buf is not None
            z = _tile(buf, r0, r1)
            _logits(_rows_of(x, r0, r1), weight, z, softcap)
            cross_entropy(z, _rows_of(targets, r0, r1), out=(_rows_of(loss, r0, r1), _rows_of(lse, r0, r1)),
                          ignore_index=ignore_index)


def fused_lm_head_loss_backward(d_loss: DeviceArray | None, x: DeviceArray, weight: DeviceArray,
                                targets: DeviceArray, lse: DeviceArray, d_lse: DeviceArray | None = None, *,
                                out: Sequence[DeviceArray | None], ignore_index: int, chunk_size: int = 0,
                                softcap: float | None = None) -> None:
    """Per tile of rows: the logits again, their gradient g (cross-entropy backward kernel, in place of
    the logits; with a softcap beside them, times its derivative), d_x = g w and d_weight += g^T x
    (matmul kernels; tiles in order). One tile of logits is held, two with a softcap."""
    _f32(d_loss, x, weight, lse, d_lse)
    n, v = x.shape[0], weight.shape[0]
    d_x, d_w = out
    with Scratch(x.device) as s:
        tiles = _head_tiles(n, v)
        zbuf = s.array((tiles[0][1], v)) if n else None
        gbuf = s.array((tiles[0][1], v)) if n and softcap is not None else zbuf
        for i, (r0, r1) in enumerate(tiles):
            assert zbuf is not None and gbuf is not None
            xr = _rows_of(x, r0, r1)
            z, g = _tile(zbuf, r0, r1), _tile(gbuf, r0, r1)
            _logits(xr, weight, z, softcap)
            cross_entropy_backward(None if d_loss is None else _rows_of(d_loss, r0, r1), z,
                                   _rows_of(targets, r0, r1), _rows_of(lse, r0, r1),
                                   None if d_lse is None else _rows_of(d_lse, r0, r1), out=(g,),
                                   ignore_index=ignore_index)
            if softcap is not None:
                z.device.launch("softcap_backward_f32", ew_grid(g.size), (THREADS,),
                                (g.ptr, z.ptr, g.size, softcap))
            if d_x is not None:
                matmul(g, weight, out=(_rows_of(d_x, r0, r1),))
            if d_w is not None:
                matmul(g, xr, d_w if i else None, out=(d_w,), transpose="TN")
        if d_w is not None and not n:
            d_w.device.memset(d_w.ptr, 0, d_w.nbytes)


def _fused_attrs(unsupported: Mapping[str, Any]) -> None:
    if unsupported:
        raise KilnError(f"fused_lm_head_loss_and_grad on cuda takes the attribute ignore_index alone (as the "
                        f"NumPy backend's fused pass); found {', '.join(sorted(unsupported))}",
                        hint="a softcapped LM head runs as two steps: kiln plans no fusion for it")


def fused_lm_head_loss_and_grad(d_loss: DeviceArray | None, x: DeviceArray, weight: DeviceArray,
                                targets: DeviceArray, *, loss: DeviceArray | None, lse: DeviceArray | None,
                                d_x: DeviceArray | None, d_weight: DeviceArray | None,
                                ignore_index: int = -100, plan: tuple[int, int] | None = None,
                                **unsupported: Any) -> None:
    """``fused_lm_head_loss`` and its backward for ``d_loss`` in one pass (the Program's fusion
    ``fused_lm_head_loss_and_grad``, NumPy's ``fused_lm_head_loss_and_grad``): per tile of rows, the logits
    ``z = x w^T`` (matmul kernel, into the one tile buffer), then one kernel per row takes their maximum,
    log-sum-exp and loss and turns them in place into their gradient ``(softmax - onehot) * d_loss``, then
    ``d_x = g w`` and ``d_weight += g^T x`` (matmul kernels, tiles in order). One product over the logits
    fewer than the forward and backward steps, one tile of logits held, and the same bits as those steps.
    ``plan``: (rows, vocabulary chunk) of the tiles, else the roofline's pick (``kiln cuda check`` forces
    the vocabulary-tiled pass with it)."""
    _fused_attrs(unsupported)
    _f32(d_loss, x, weight, loss, lse, d_x, d_weight)
    _i32(targets, "targets")
    n, v = x.shape[0], weight.shape[0]
    dev = x.device
    rows, chunk = plan or _head_plan(n, v, x.shape[1], "fp32")
    with Scratch(dev) as s:
        loss_, lse_ = s.out(loss, (n,)), s.out(lse, (n,))
        if n and chunk < v:
            _vocab_tiled_pass(d_loss, x, weight, targets, loss_, lse_, d_x, d_weight, rows, chunk,
                              ignore_index, bf16=False)
            return
        tiles = [(r0, min(r0 + rows, n)) for r0 in range(0, n, rows)]
        buf = s.array((tiles[0][1], v)) if n else None
        for i, (r0, r1) in enumerate(tiles):
            assert buf is not None
            xr, z = _rows_of(x, r0, r1), _tile(buf, r0, r1)
            matmul(xr, weight, out=(z,), transpose="NT")
            dl = 0 if d_loss is None else _rows_of(d_loss, r0, r1).ptr
            dev.launch("lm_head_loss_grad_f32", (r1 - r0,), row_block(v),
                       (dl, z.ptr, _rows_of(targets, r0, r1).ptr, _rows_of(loss_, r0, r1).ptr,
                        _rows_of(lse_, r0, r1).ptr, v, ignore_index))
            if d_x is not None:
                matmul(z, weight, out=(_rows_of(d_x, r0, r1),))
            if d_weight is not None:
                matmul(z, xr, d_weight if i else None, out=(d_weight,), transpose="TN")
        if d_weight is not None and not n:
            dev.memset(d_weight.ptr, 0, d_weight.nbytes)


# --- attention ------------------------------------------------------------------------------------

#: head dims a lane of the attention kernels holds (PER_LANE in attention.cu): D <= 32 * ATTN_PER_LANE
ATTN_PER_LANE = 8


def _heads(qkv: DeviceArray, hq: int, hkv: int, d: int, op: str, limit: int = 32 * ATTN_PER_LANE,
           kernel: str = "the SIMT kernel") -> tuple[int, int]:
    b, t, f = qkv.shape
    if f != (hq + 2 * hkv) * d or hkv <= 0 or hq % hkv:
        raise KilnError(f"op {op!r} on cuda: packed qkv [{b}, {t}, {f}] does not hold Hq = {hq} and "
                        f"Hkv = {hkv} heads of D = {d} (Hq a multiple of Hkv)")
    if d > limit:
        raise KilnError(f"op {op!r} on cuda: head dim {d} > {limit}, the limit of {kernel}")
    return b, t


def _window(window_size: int | None, op: str) -> int:
    if window_size is not None and window_size < 1:
        raise KilnError(f"op {op!r}: window_size must be >= 1, found {window_size}")
    return window_size or 0


def _segments(segment_ids: DeviceArray | None) -> int:
    if segment_ids is not None:
        _i32(segment_ids, "segment ids")
    return _ptr(segment_ids)


def _softcap(softcap: float | None, op: str) -> float:
    if softcap is not None and softcap <= 0:
        raise KilnError(f"op {op!r}: softcap must be > 0, found {softcap}")
    return softcap or 0.0


def flash_attention(qkv: DeviceArray, segment_ids: DeviceArray | None = None, *,
                    out: Sequence[DeviceArray | None], Hq: int, Hkv: int, D: int, causal: bool = True,
                    softmax_scale: float | None = None, window_size: int | None = None,
                    softcap: float | None = None, alibi: bool = False) -> None:
    op = "flash_attention"
    _f32(qkv)
    b, t = _heads(qkv, Hq, Hkv, D, op)
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    with Scratch(qkv.device) as s:
        o, lse = s.out(out[0], (b, t, Hq * D)), s.out(out[1], (b, Hq, t))
        if b and t:
            qkv.device.launch("flash_attention_f32", (t, Hq, b), (32,),
                              (qkv.ptr, _segments(segment_ids), o.ptr, lse.ptr, t, Hq, Hkv, D, int(causal),
                               _window(window_size, op), scale, _softcap(softcap, op), int(alibi)))


def flash_attention_backward(d_out: DeviceArray | None, qkv: DeviceArray, o: DeviceArray, lse: DeviceArray,
                             d_lse: DeviceArray | None = None, segment_ids: DeviceArray | None = None, *,
                             out: Sequence[DeviceArray | None], Hq: int, Hkv: int, D: int,
                             causal: bool = True, softmax_scale: float | None = None,
                             window_size: int | None = None, softcap: float | None = None,
                             alibi: bool = False) -> None:
    """The query kernel (dq, and each row's shift), then the key kernel (dk, dv)."""
    _f32(d_out, qkv, o, lse, d_lse)
    op = "flash_attention_backward"
    b, t = _heads(qkv, Hq, Hkv, D, op)
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    geometry = (t, Hq, Hkv, D, int(causal), _window(window_size, op), scale, _softcap(softcap, op),
                int(alibi))
    with Scratch(qkv.device) as s:
        d_qkv, shift = s.out(out[0], qkv.shape), s.array((b, Hq, t))
        if b and t:
            seg = _segments(segment_ids)
            qkv.device.launch("flash_attention_backward_dq_f32", (t, Hq, b), (32,),
                              (_ptr(d_out), qkv.ptr, o.ptr, lse.ptr, _ptr(d_lse), seg, d_qkv.ptr, shift.ptr,
                               *geometry))
            qkv.device.launch("flash_attention_backward_dkv_f32", (t, Hkv, b), (32,),
                              (_ptr(d_out), qkv.ptr, lse.ptr, shift.ptr, seg, d_qkv.ptr, *geometry))


def _separate_heads(q: DeviceArray, k: DeviceArray, v: DeviceArray, segment_ids: DeviceArray | None,
                    op: str) -> tuple[int, int, int, int, int, int]:
    """(B, Tq, Tk, Hq, Hkv, D) of ``attention`` on q [B, Tq, Hq, D], k and v [B, Tk, Hkv, D]."""
    if len(q.shape) != 4 or len(k.shape) != 4 or v.shape != k.shape:
        raise KilnError(f"op {op!r} on cuda: q [B, Tq, Hq, D], k and v [B, Tk, Hkv, D] expected, found "
                        f"{q.shape}, {k.shape} and {v.shape}")
    (b, tq, hq, d), (_, tk, hkv, _) = q.shape, k.shape
    if k.shape[0] != b or k.shape[3] != d or hkv <= 0 or hq % hkv:
        raise KilnError(f"op {op!r} on cuda: q {q.shape} and k {k.shape} differ in batch or head dim, or "
                        f"Hq = {hq} is not a multiple of Hkv = {hkv}")
    if d > 32 * ATTN_PER_LANE:
        raise KilnError(f"op {op!r} on cuda: head dim {d} > {32 * ATTN_PER_LANE}, the limit of the SIMT "
                        "kernel")
    if segment_ids is not None:
        if segment_ids.shape != (b, tk):
            raise KilnError(f"op {op!r} on cuda: segment_ids must be [B, Tk] = [{b}, {tk}], found "
                            f"{list(segment_ids.shape)}")
        if tq > tk:  # a query's segment is that of its key position i + Tk - Tq, which must exist
            raise KilnError(f"op {op!r} on cuda: segment ids need Tq <= Tk (a query's segment is that of its "
                            f"key position i + Tk - Tq), found Tq = {tq} > Tk = {tk}")
    return b, tq, tk, hq, hkv, d


def _attention_geometry(op: str, tq: int, tk: int, hq: int, hkv: int, d: int, causal: bool = True,
                        softmax_scale: float | None = None, window_size: int | None = None,
                        softcap: float | None = None, alibi: bool = False) -> tuple[Any, ...]:
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    return (tq, tk, hq, hkv, d, int(causal), _window(window_size, op), scale, _softcap(softcap, op),
            int(alibi))


def attention(q: DeviceArray, k: DeviceArray, v: DeviceArray, segment_ids: DeviceArray | None = None, *,
              out: Sequence[DeviceArray | None], **attrs: Any) -> None:
    """``attention`` on separate q [B, Tq, Hq, D], k and v [B, Tk, Hkv, D], Tq and Tk equal or not (cross
    attention: query i at key position i + Tk - Tq): a warp per query row, as ``flash_attention``."""
    _f32(q, k, v)
    op = "attention"
    b, tq, tk, hq, hkv, d = _separate_heads(q, k, v, segment_ids, op)
    with Scratch(q.device) as s:
        o, lse = s.out(out[0], q.shape), s.out(out[1], (b, hq, tq))
        if b and tq:
            q.device.launch("attention_f32", (tq, hq, b), (32,),
                            (q.ptr, k.ptr, v.ptr, _segments(segment_ids), o.ptr, lse.ptr,
                             *_attention_geometry(op, tq, tk, hq, hkv, d, **attrs)))


def attention_backward(d_out: DeviceArray | None, q: DeviceArray, k: DeviceArray, v: DeviceArray,
                       o: DeviceArray, lse: DeviceArray, d_lse: DeviceArray | None = None,
                       segment_ids: DeviceArray | None = None, *, out: Sequence[DeviceArray | None],
                       **attrs: Any) -> None:
    """Its gradient: the query kernel (dq, and each row's shift), then the key kernel (dk, dv)."""
    _f32(d_out, q, k, v, o, lse, d_lse)
    op = "attention_backward"
    b, tq, tk, hq, hkv, d = _separate_heads(q, k, v, segment_ids, op)
    geometry = _attention_geometry(op, tq, tk, hq, hkv, d, **attrs)
    with Scratch(q.device) as s:
        dq, dk, dv = s.out(out[0], q.shape), s.out(out[1], k.shape), s.out(out[2], v.shape)
        shift = s.array((b, hq, tq))
        seg = _segments(segment_ids)
        if b and tq:
            q.device.launch("attention_backward_dq_f32", (tq, hq, b), (32,),
                            (_ptr(d_out), q.ptr, k.ptr, v.ptr, o.ptr, lse.ptr, _ptr(d_lse), seg, dq.ptr,
                             shift.ptr, *geometry))
        if b and tk:  # keys no query sees (Tq = 0 among them) get zero gradients
            q.device.launch("attention_backward_dkv_f32", (tk, hkv, b), (32,),
                            (_ptr(d_out), q.ptr, k.ptr, v.ptr, lse.ptr, shift.ptr, seg, dk.ptr, dv.ptr,
                             *geometry))


# --- attention on tensor cores: bf16 in, fp32 accumulate (attention_mma.cu) ------------------------

#: head dims of the tiled bf16 attention kernels, one kernel each (D is padded with zeros up to it)
MMA_HEAD_DIMS = (64, 128)
#: query (or key) rows of a block of the tiled attention kernels, and its threads (4 warps)
MMA_ROWS, MMA_THREADS = 64, 128


def _bf16(*arrays: DeviceArray | None) -> None:
    for a in arrays:
        if a is not None and a.dtype != "bfloat16":
            raise KilnError(f"the tiled attention kernels read and write bf16; found a {a.dtype} tensor "
                            f"{a.shape}")


def tensor_cores_available(device: Any) -> bool:
    """Whether ``device`` runs mma.sync's bf16 tensor-core instructions: a GPU of sm_80 or newer."""
    arch = str(getattr(device, "arch", ""))
    return arch.startswith("sm_") and arch[3:].isdigit() and int(arch[3:]) >= 80


def _mma_geometry(qkv: DeviceArray, segment_ids: DeviceArray | None, op: str, Hq: int, Hkv: int, D: int,
                  causal: bool, softmax_scale: float | None, window_size: int | None, softcap: float | None,
                  alibi: bool, tensor_cores: bool) -> tuple[str, tuple[int, int], tuple[Any, ...]]:
    """The kernels' name suffix (variant and head dim), (B, T) and the trailing launch arguments."""
    b, t = _heads(qkv, Hq, Hkv, D, op, MMA_HEAD_DIMS[-1], "the tiled bf16 kernels")
    if tensor_cores and not tensor_cores_available(qkv.device):
        raise KilnError(f"op {op!r}: the tensor-core kernels need a GPU of sm_80 or newer; device "
                        f"{getattr(qkv.device, 'name', '?')!r} is {getattr(qkv.device, 'arch', '?')!r} "
                        "(tensor_cores=False runs the SIMT twin)")
    hd = next(h for h in MMA_HEAD_DIMS if h >= D)
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    tail = (t, Hq, Hkv, D, int(causal), _window(window_size, op), scale, _softcap(softcap, op), int(alibi))
    return f"{'tc' if tensor_cores else 'twin'}{hd}_bf16", (b, t), tail


def flash_attention_mma(qkv: DeviceArray, segment_ids: DeviceArray | None = None, *,
                        out: Sequence[DeviceArray | None], Hq: int, Hkv: int, D: int, causal: bool = True,
                        softmax_scale: float | None = None, window_size: int | None = None,
                        softcap: float | None = None, alibi: bool = False, tensor_cores: bool = True) -> None:
    """``flash_attention`` (with ``attention``'s ``softcap`` and ``alibi``) on bf16 ``qkv``: ``out`` in bf16,
    ``lse`` in fp32, on tensor cores (sm_80+) or, with ``tensor_cores=False``, their SIMT twin."""
    _bf16(qkv, out[0])
    _flash_mma(qkv, segment_ids, out, Hq, Hkv, D, causal, softmax_scale, window_size, softcap, alibi,
               tensor_cores)


def _flash_mma(qkv: DeviceArray, segment_ids: DeviceArray | None, out: Sequence[DeviceArray | None], Hq: int,
               Hkv: int, D: int, causal: bool = True, softmax_scale: float | None = None,
               window_size: int | None = None, softcap: float | None = None, alibi: bool = False,
               tensor_cores: bool = True) -> None:
    """:func:`flash_attention_mma` on a bf16 ``qkv``, or a float32 one rounded to bf16 on load
    (``_bf16_f``)."""
    if qkv.dtype != "float32":
        _bf16(qkv)
    _bf16(out[0])
    _f32(out[1])
    suffix, (b, t), tail = _mma_geometry(qkv, segment_ids, "flash_attention", Hq, Hkv, D, causal,
                                         softmax_scale, window_size, softcap, alibi, tensor_cores)
    if qkv.dtype == "float32":
        suffix += "_f"
    with Scratch(qkv.device) as s:
        o, lse = s.out(out[0], (b, t, Hq * D), "bfloat16"), s.out(out[1], (b, Hq, t))
        if b and t:
            qkv.device.launch(f"flash_attention_{suffix}", (cdiv(t, MMA_ROWS), Hq, b), (MMA_THREADS,),
                              (qkv.ptr, _segments(segment_ids), o.ptr, lse.ptr, *tail))


def flash_attention_mma_backward(d_out: DeviceArray | None, qkv: DeviceArray, o: DeviceArray,
                                 lse: DeviceArray, d_lse: DeviceArray | None = None,
                                 segment_ids: DeviceArray | None = None, *,
                                 out: Sequence[DeviceArray | None], Hq: int, Hkv: int, D: int,
                                 causal: bool = True, softmax_scale: float | None = None,
                                 window_size: int | None = None, softcap: float | None = None,
                                 alibi: bool = False, tensor_cores: bool = True) -> None:
    """The gradient of :func:`flash_attention_mma`: the query kernel (dq, and each row's shift), then the
    key kernel (dk, dv); ``d_qkv`` in bf16."""
    _bf16(d_out, qkv, o, out[0])
    _flash_mma_backward(d_out, qkv, o, lse, d_lse, segment_ids, out, Hq, Hkv, D, causal, softmax_scale,
                        window_size, softcap, alibi, tensor_cores)


def _flash_mma_backward(d_out: DeviceArray | None, qkv: DeviceArray, o: DeviceArray, lse: DeviceArray,
                        d_lse: DeviceArray | None, segment_ids: DeviceArray | None,
                        out: Sequence[DeviceArray | None], Hq: int, Hkv: int, D: int, causal: bool = True,
                        softmax_scale: float | None = None, window_size: int | None = None,
                        softcap: float | None = None, alibi: bool = False, tensor_cores: bool = True) -> None:
    """:func:`flash_attention_mma_backward` on a bf16 or float32 ``qkv`` (rounded on load) with a float32
    ``d_qkv`` holding bf16 values (``_bf16_hf``, ``_bf16_ff``), or both bf16."""
    op = "flash_attention_backward"
    _bf16(d_out, o)
    _f32(lse, d_lse)
    suffix, (b, t), tail = _mma_geometry(qkv, segment_ids, op, Hq, Hkv, D, causal, softmax_scale, window_size,
                                         softcap, alibi, tensor_cores)
    g = out[0].dtype if out[0] is not None else "bfloat16" if qkv.dtype == "bfloat16" else "float32"
    if (qkv.dtype, g) != ("bfloat16", "bfloat16"):
        if g != "float32" or qkv.dtype not in ("bfloat16", "float32"):
            raise KilnError(f"op {op!r} on the tiled bf16 kernels: qkv {qkv.dtype} and d_qkv {g}; they "
                            "read qkv as bfloat16 or float32 and write d_qkv as bfloat16, or float32 beside "
                            "either")
        suffix += "_hf" if qkv.dtype == "bfloat16" else "_ff"
    with Scratch(qkv.device) as s:
        d_qkv, shift = s.out(out[0], qkv.shape, g), s.array((b, Hq, t))
        if b and t:
            seg = _segments(segment_ids)
            qkv.device.launch(f"flash_attention_backward_dq_{suffix}", (cdiv(t, MMA_ROWS), Hq, b),
                              (MMA_THREADS,), (_ptr(d_out), qkv.ptr, o.ptr, lse.ptr, _ptr(d_lse), seg,
                                               d_qkv.ptr, shift.ptr, *tail))
            qkv.device.launch(f"flash_attention_backward_dkv_{suffix}", (cdiv(t, MMA_ROWS), Hkv, b),
                              (MMA_THREADS,),
                              (_ptr(d_out), qkv.ptr, lse.ptr, shift.ptr, seg, d_qkv.ptr, *tail))


# --- Mamba ----------------------------------------------------------------------------------------


def _conv_dims(x: DeviceArray, weight: DeviceArray, op: str) -> tuple[int, int, int, int]:
    if len(x.shape) != 3 or len(weight.shape) != 3:
        raise KilnError(f"op {op!r} on cuda: x must be [B, D, T] and weight [D, 1, K], found {x.shape} and "
                        f"{weight.shape}")
    return (*x.shape, weight.shape[-1])  # type: ignore[return-value]


def mamba_conv1d(x: DeviceArray, weight: DeviceArray, bias: DeviceArray | None = None,
                 conv_state: DeviceArray | None = None, *, out: Sequence[DeviceArray | None],
                 activation: str = "silu", return_final_states: bool = False) -> None:
    """The causal depthwise conv (a thread per output element), after ``conv_state`` when given; with
    ``return_final_states`` the last K - 1 inputs as the second output (the next chunk's state)."""
    _f32(x, weight, bias, conv_state)
    b, d, t, k = _conv_dims(x, weight, "mamba_conv1d")
    if return_final_states and len(out) > 1 and out[1] is not None and b * d * (k - 1):
        x.device.launch("mamba_conv1d_state_f32", ew_grid(b * d * (k - 1)), (THREADS,),
                        (x.ptr, _ptr(conv_state), out[1].ptr, b * d, t, k))
    if b * d * t:
        x.device.launch("mamba_conv1d_f32", ew_grid(b * d * t), (THREADS,),
                        (x.ptr, weight.ptr, _ptr(bias), _ptr(conv_state), _ptr(out[0]), b * d, d, t, k,
                         int(activation == "silu")))


def mamba_conv1d_backward(d_y: DeviceArray | None, x: DeviceArray, weight: DeviceArray,
                          bias: DeviceArray | None = None, conv_state: DeviceArray | None = None,
                          d_final_states: DeviceArray | None = None, *, out: Sequence[DeviceArray | None],
                          activation: str = "silu") -> None:
    """g = d_y times the activation's derivative (recomputed), then d_x (and d_conv_state) as a transposed
    conv, then d_weight and d_bias as ordered column sums."""
    _f32(d_y, x, weight, bias, conv_state, d_final_states)
    b, d, t, k = _conv_dims(x, weight, "mamba_conv1d_backward")
    dev = x.device
    with Scratch(dev) as s:
        g = s.array(x.shape)
        d_x, d_w = s.out(out[0], x.shape), s.out(out[1], weight.shape)
        d_b = out[2] if len(out) > 2 else None
        d_state = out[3] if len(out) > 3 else None
        if d_y is None or not b * d * t:
            dev.memset(g.ptr, 0, g.nbytes)
        else:
            dev.launch("mamba_conv1d_grad_f32", ew_grid(b * d * t), (THREADS,),
                       (d_y.ptr, x.ptr, weight.ptr, _ptr(bias), _ptr(conv_state), g.ptr, b * d, d, t, k,
                        int(activation == "silu")))
        if b * d:
            dev.launch("mamba_conv1d_backward_dx_f32", ew_grid(b * d * (t + k - 1)), (THREADS,),
                       (g.ptr, weight.ptr, _ptr(d_final_states), d_x.ptr, _ptr(d_state), b * d, d, t, k))
        if d:
            dev.launch("mamba_conv1d_backward_dw_f32", (cdiv(d * (k + 1), THREADS),), (THREADS,),
                       (g.ptr, x.ptr, _ptr(conv_state), d_w.ptr, _ptr(d_b), b, d, t, k))


#: warps (channels) per block of the sequential scan kernels
SCAN_WARPS = 4
#: the chunked scan (long sequences): steps per thread (SCAN_ITEMS in mamba.cu), at most this many threads per
#: block (a chunk of at most SCAN_ITEMS * SCAN_CHUNK_THREADS steps), and N up to SCAN_MAX_N (shared memory)
SCAN_ITEMS = 8
SCAN_CHUNK_THREADS = 128
SCAN_MAX_N = 256
#: the chunked backward's blocks run several channels of a group one after another (summing their parts of d_B
#: and d_C in the block, so the scratch for those parts shrinks by that factor) while at least this many
#: blocks remain: four blocks of 128 threads on each of an H100's 132 SMs (an estimate, untimed)
SCAN_MIN_BLOCKS = 512
#: sequences shorter than this (with N <= 32) run the sequential kernel, a warp per channel: below a chunk
#: of a single warp its T steps cost less than the chunked kernel's N block scans (an estimate, untimed)
SCAN_CHUNKED_MIN_T = 128


def _scan_dims(u: DeviceArray, A: DeviceArray, B: DeviceArray, op: str) -> tuple[int, int, int, int, int]:
    """(batch, channels D, T, state size N, groups G: 0 for B of [B, N, T])."""
    if len(u.shape) != 3 or len(A.shape) != 2 or len(B.shape) not in (3, 4):
        raise KilnError(f"op {op!r} on cuda: u [B, D, T], A [D, N], B [B, N, T] or [B, G, N, T]; found "
                        f"{u.shape}, {A.shape}, {B.shape}")
    b, d, t = u.shape
    n = A.shape[1]
    g = B.shape[1] if len(B.shape) == 4 else 0
    if n > SCAN_MAX_N:
        raise KilnError(f"op {op!r} on cuda: the scan kernels hold a state of N <= {SCAN_MAX_N} per channel "
                        f"(in shared memory); found N = {n}", hint="run this model on the numpy backend")
    if g and d % g:
        raise KilnError(f"op {op!r}: D = {d} channels do not split into G = {g} groups of B and C")
    return b, d, t, n, g


def scan_chunked(t: int, n: int) -> bool:
    """Whether a scan of ``t`` steps and ``n`` states takes the chunked kernels, not the sequential one."""
    return n > 32 or t >= SCAN_CHUNKED_MIN_T


def scan_threads(t: int) -> int:
    """Threads of a block of the chunked scan for T = ``t``: whole warps, enough for T in one chunk, at most
    SCAN_CHUNK_THREADS (then the block runs several chunks)."""
    return min(SCAN_CHUNK_THREADS, max(32, cdiv(cdiv(t, SCAN_ITEMS), 32) * 32))


def scan_channels_per_block(b: int, d: int, g: int) -> int:
    """Channels a block of the chunked backward runs one after another, for B = ``b``, D = ``d`` and G = ``g``
    groups (0: one): the largest divisor of a group's channels that leaves at least SCAN_MIN_BLOCKS blocks (at
    least 1). Its parts of d_B and d_C take ``2 * b * (d // per_block) * n * t`` floats of scratch, none when
    a block runs a whole group (its slices are d_B and d_C)."""
    per, most = d // (g or 1), max(1, b * d // SCAN_MIN_BLOCKS)
    return max(p for p in range(1, min(per, most) + 1) if per % p == 0)


def mamba_selective_scan(u: DeviceArray, delta: DeviceArray, A: DeviceArray, B: DeviceArray, C: DeviceArray,
                         D: DeviceArray | None = None, z: DeviceArray | None = None,
                         delta_bias: DeviceArray | None = None, ssm_state: DeviceArray | None = None, *,
                         out: Sequence[DeviceArray | None], delta_softplus: bool = False,
                         return_last_state: bool = False) -> None:
    """Short T: a warp per channel, a lane per state, sequential over time. Long T (or N > 32): the chunked
    scan, a block per channel, its threads along time (:func:`scan_chunked`). The last state as the second
    output."""
    _f32(u, delta, A, B, C, D, z, delta_bias, ssm_state)
    b, d, t, n, g = _scan_dims(u, A, B, "mamba_selective_scan")
    last = out[1] if return_last_state and len(out) > 1 else None
    with Scratch(u.device) as s:
        y = s.out(out[0], u.shape)
        ins = (u.ptr, delta.ptr, A.ptr, B.ptr, C.ptr, _ptr(D), _ptr(z), _ptr(delta_bias), _ptr(ssm_state),
               y.ptr, _ptr(last))
        if not b * d:
            return
        if scan_chunked(t, n):
            u.device.launch("mamba_scan_chunked_f32", (b * d,), (scan_threads(t),),
                            (*ins, 0, b, d, t, n, g, int(delta_softplus)))
        else:
            u.device.launch("mamba_scan_f32", (cdiv(b * d, SCAN_WARPS),), (32 * SCAN_WARPS,),
                            (*ins, b, d, t, n, g, int(delta_softplus)))


def mamba_selective_scan_backward(d_out: DeviceArray | None, u: DeviceArray, delta: DeviceArray,
                                  A: DeviceArray, B: DeviceArray, C: DeviceArray,
                                  D: DeviceArray | None = None, z: DeviceArray | None = None,
                                  delta_bias: DeviceArray | None = None, ssm_state: DeviceArray | None = None,
                                  d_last_state: DeviceArray | None = None, *,
                                  out: Sequence[DeviceArray | None], delta_softplus: bool = False) -> None:
    """Sequential (short T): the forward replayed per channel (its states in the workspace: [B, D, T, N]),
    the scan in reverse. Chunked (long T): the chunked forward keeps only each chunk's first state ([B, D,
    chunks, N]); the backward kernel replays a chunk from it and scans it in reverse, from the last chunk, a
    block running :func:`scan_channels_per_block` channels and summing their parts of d_B and d_C in order
    ([B, D / per_block, N, T]). Then ordered sums: d_A, d_D, d_delta_bias over the batch, d_B and d_C over a
    group's channels (or its blocks' slices; none when a block ran the whole group)."""
    _f32(d_out, u, delta, A, B, C, D, z, delta_bias, ssm_state, d_last_state)
    b, d, t, n, g = _scan_dims(u, A, B, "mamba_selective_scan_backward")
    dev, chunked = u.device, scan_chunked(t, n)
    with Scratch(dev) as s:
        d_u, d_delta, d_a, d_b, d_c = (s.out(out[0], u.shape), s.out(out[1], u.shape), s.out(out[2], A.shape),
                                       s.out(out[3], B.shape), s.out(out[4], C.shape))
        per_block = scan_channels_per_block(b, d, g) if chunked else 1
        slots = d // per_block  # d_B's and d_C's parts per batch row
        if chunked and slots == (g or 1):  # a block per group: its slices are the gradients
            p_b, p_c = d_b, d_c
        else:
            p_b, p_c = (s.array((b, slots, n, t) if chunked else (b, d, t, n)) for _ in "bc")
        p_a, p_d, p_db = s.array((b, d, n)), s.array((b, d)), s.array((b, d))
        d_dv, d_z, d_db = (s.out(out[i], shape) for i, shape in ((5, (d,)), (6, u.shape), (7, (d,))))
        d_state = out[8] if len(out) > 8 else None
        if not b * d:
            return
        ins = (u.ptr, delta.ptr, A.ptr, B.ptr, C.ptr, _ptr(D), _ptr(z), _ptr(delta_bias))
        grads = (d_u.ptr, d_delta.ptr, d_z.ptr, p_b.ptr, p_c.ptr, p_a.ptr, p_d.ptr, p_db.ptr, _ptr(d_state))
        dims = (b, d, t, n, g, int(delta_softplus))
        if chunked:
            threads = scan_threads(t)
            states = s.array((b, d, cdiv(t, threads * SCAN_ITEMS), n))
            dev.launch("mamba_scan_chunked_f32", (b * d,), (threads,),
                       (*ins, _ptr(ssm_state), 0, 0, states.ptr, *dims))
            dev.launch("mamba_scan_chunked_backward_f32", (b * slots,), (threads,),
                       (_ptr(d_out), *ins, states.ptr, _ptr(d_last_state), *grads, *dims, per_block))
        else:
            h, y = s.array((b, d, t, n)), s.array(u.shape)
            dev.launch("mamba_scan_backward_f32", (cdiv(b * d, SCAN_WARPS),), (32 * SCAN_WARPS,),
                       (_ptr(d_out), *ins, _ptr(ssm_state), _ptr(d_last_state), h.ptr, y.ptr, *grads, *dims))
        for part, dst, size in ((p_a, d_a, d * n), (p_d, d_dv, d), (p_db, d_db, d)):
            dev.launch("mamba_sum_batch_f32", ew_grid(size), (THREADS,), (part.ptr, dst.ptr, b, size))
        for part, dst in ((p_b, d_b), (p_c, d_c)):
            if dst.size and part is not dst:
                dev.launch("mamba_sum_group_f32", ew_grid(dst.size), (THREADS,),
                           (part.ptr, dst.ptr, b, slots, t, n, g, int(chunked)))


# --- the bf16 precision recipe ---------------------------------------------------------------------


def as_dtype(s: Scratch, a: DeviceArray | None, dtype: str) -> DeviceArray | None:
    """``a`` as ``dtype`` (``float32`` or ``bfloat16``): itself, or a cast of it in scratch (float32 to
    bfloat16 rounds to nearest even: the rounding of a ``lower`` op's input)."""
    if a is None or a.dtype == dtype:
        return a
    t = s.array(a.shape, dtype)
    cast(a, out=[t])
    return t


def round_bf16(s: Scratch, a: DeviceArray, into: DeviceArray | None = None) -> DeviceArray:
    """float32 ``a`` rounded to bfloat16 values, kept as float32 (in ``into``, else in scratch): one kernel,
    no bf16 copy in between."""
    _f32(a)
    f = into if into is not None else s.array(a.shape)
    if a.size:
        a.device.launch("round_f32_bf16", ew_grid(a.size), (THREADS,), (a.ptr, f.ptr, a.size))
    return f


def _bf16_outputs(s: Scratch, outs: Sequence[DeviceArray | None],
                  dtypes: Sequence[str]) -> tuple[list[DeviceArray | None], Callable[[], None]]:
    """Outputs of the kernel's ``dtypes`` for the slots ``outs`` (scratch where the slot's dtype differs),
    and the function that stores them into their slots afterwards."""
    ys = [None if o is None else o if o.dtype == d else s.array(o.shape, d)
          for o, d in zip(outs, dtypes, strict=True)]

    def store() -> None:
        for o, y in zip(outs, ys, strict=True):
            if o is not None and y is not None and y is not o:
                cast(y, out=[o])

    return ys, store


def matmul_lowp(a: DeviceArray, b: DeviceArray, c: DeviceArray | None = None, *, out: Sequence[DeviceArray],
                round_out: bool = False, transpose: str = "NN", accumulate: bool = False, alpha: float = 1.0,
                beta: float = 1.0) -> None:
    """``matmul`` and ``batched_matmul`` under the bf16 recipe, rounding where NumPy's emulation does (``a``
    and ``b`` rounded to bf16, ``c`` too when float32, ``out`` stored rounded to bf16 when its slot is bf16
    or ``round_out``) with the fewest temporaries. On CUDA cores one kernel reads each operand as its slot
    holds it, rounding a float32 one on its load (no bf16 copy), and writes a bf16 ``out`` directly
    (``matmul_bf16_<a><b><out>``, h: bf16, f: float32); cuBLASLt takes bf16 copies of float32 operands (it
    cannot round on load) and writes a bf16 ``out`` as its D type (a float32 temporary only beside a
    float32 ``c``)."""
    o = out[0]
    eff_beta = 1.0 if (beta == 1.0 or accumulate) else beta
    for name, x in (("a", a), ("b", b), ("c", c), ("out", o)):
        if x is not None and x.dtype not in ("float32", "bfloat16"):
            raise KilnError(f"matmul under the bf16 recipe on cuda: {name} is {x.dtype}; kiln.cuda reads "
                            "float32 and bfloat16")
    with Scratch(o.device) as s:
        if c is not None:  # the recipe rounds a float32 c as it rounds every float input of a lowered op
            c = round_bf16(s, c) if c.dtype == "float32" else as_dtype(s, c, "float32")
        _matmul_rounding(s, a, b, c, o, transpose, alpha, eff_beta, round_out)


def _lowp_operand(s: Scratch, a: DeviceArray) -> DeviceArray:
    """A matmul operand of the bf16 recipe for :func:`_matmul_rounding`: ``a`` itself on CUDA cores (the
    kernel rounds a float32 one on load), a bf16 copy of a float32 one for cuBLASLt (taken once, for all of
    a caller's products)."""
    if getattr(a.device, "blas", None) is None or a.dtype == "bfloat16":
        return a
    t = s.array(a.shape, "bfloat16")
    cast(a, out=[t])
    return t


def _matmul_rounding(s: Scratch, a: DeviceArray, b: DeviceArray, c: DeviceArray | None, o: DeviceArray,
                     transpose: str, alpha: float, beta: float, round_out: bool) -> None:
    """``o = alpha op(a) op(b) (+ beta c)`` on ``a`` and ``b`` rounded to bf16 (``c`` a float32 as it is),
    fp32 accumulate, ``o`` stored in its dtype (a bf16 ``o`` rounded; a float32 one rounded in place when
    ``round_out``): :func:`matmul_lowp`'s kernels, or cuBLASLt on bf16 copies of float32 operands."""
    if getattr(a.device, "blas", None) is not None:
        y = o if c is None or o.dtype == "float32" else s.array(o.shape)
        matmul(_lowp_operand(s, a), _lowp_operand(s, b), c, out=(y,), transpose=transpose, alpha=alpha,
               beta=beta)
        if y is not o:
            cast(y, out=[o])
    else:
        _f32(c)
        code = "".join("h" if x.dtype == "bfloat16" else "f" for x in (a, b, o))
        _matmul_simt("matmul_bf16" if code == "hhf" else f"matmul_bf16_{code}", a, b, c, o, transpose, alpha,
                     beta)
    if round_out and o.dtype == "float32":
        round_bf16(s, o, into=o)


def flash_attention_bf16(qkv: DeviceArray, segment_ids: DeviceArray | None = None, *,
                         out: Sequence[DeviceArray | None], **attrs: Any) -> None:
    """``flash_attention`` under the bf16 recipe (``flash_attention@cuda:bfloat16``): ``qkv`` read as
    bf16 (rounded when its slot is float32), the tiled kernel of :func:`flash_attention_mma` on tensor
    cores where the device has them (sm_80+), else its SIMT twin (the emulator), ``out`` in bf16 and
    ``lse`` in fp32, stored in their slots' dtypes."""
    with Scratch(qkv.device) as s:  # a float32 qkv is rounded on load by the kernel (no rounded copy)
        ys, store = _bf16_outputs(s, out, ("bfloat16", "float32"))
        _flash_mma(qkv, segment_ids, ys, tensor_cores=tensor_cores_available(qkv.device), **attrs)
        store()


def flash_attention_backward_bf16(d_out: DeviceArray | None, qkv: DeviceArray, o: DeviceArray,
                                  lse: DeviceArray, d_lse: DeviceArray | None = None,
                                  segment_ids: DeviceArray | None = None, *,
                                  out: Sequence[DeviceArray | None], **attrs: Any) -> None:
    """Its backward: ``d_out``, ``qkv`` and ``o`` read as bf16, ``lse`` and ``d_lse`` as fp32, ``d_qkv``
    in bf16 (the gradient of a bf16 tensor) stored in its slot's dtype."""
    with Scratch(qkv.device) as s:  # qkv read as it is (a float32 one rounded on load), d_qkv written in
        # its slot's dtype: float32 (bf16 values) or bf16; a bf16 d_qkv beside a float32 qkv through a copy
        d, o16 = as_dtype(s, d_out, "bfloat16"), as_dtype(s, o, "bfloat16")
        lse32, dlse32 = as_dtype(s, lse, "float32"), as_dtype(s, d_lse, "float32")
        q = qkv if qkv.dtype == "bfloat16" or out[0] is None or out[0].dtype == "float32" \
            else as_dtype(s, qkv, "bfloat16")
        assert o16 is not None and lse32 is not None and q is not None
        _flash_mma_backward(d, q, o16, lse32, dlse32, segment_ids, out,
                            tensor_cores=tensor_cores_available(qkv.device), **attrs)


def qkv_qk_norm_rope_bf16(qkv: DeviceArray, q_norm_weight: DeviceArray | None,
                          k_norm_weight: DeviceArray | None, freqs: DeviceArray | None,
                          position_ids: DeviceArray, *, out: Sequence[DeviceArray | None],
                          **attrs: Any) -> None:
    """``qkv_qk_norm_rope`` under the bf16 recipe with NumPy's ``qkv_qk_norm_rope@numpy:bfloat16``
    rounding point: the normalised heads rounded to bf16 before their fp32 weight (``qk_norm_rp_bf16``),
    then rope in fp32 (:func:`qkv_qk_norm_rope` without weights); ``out`` stored in its slot's dtype."""
    hq, hkv, d = attrs["Hq"], attrs["Hkv"], attrs["D"]
    b, t = _heads(qkv, hq, hkv, d, "qkv_qk_norm_rope")
    if qkv.dtype == "bfloat16":
        _qkv_norm_rope_bf16in(qkv, q_norm_weight, k_norm_weight, freqs, position_ids, out, b, t, attrs)
        return
    with Scratch(qkv.device) as s:
        x = as_dtype(s, qkv, "float32")
        ws = [as_dtype(s, w, "float32") for w in (q_norm_weight, k_norm_weight)]
        ys, store = _bf16_outputs(s, out, ("float32", "float32", "float32"))
        q_rstd, k_rstd = s.out(ys[1], (b, t, hq)), s.out(ys[2], (b, t, hkv))
        normed = s.array(qkv.shape)
        if b and t:
            qkv.device.launch("qk_norm_rp_bf16", (hq + 2 * hkv, t, b), (32,),
                              (x.ptr, _ptr(ws[0]), _ptr(ws[1]), normed.ptr, q_rstd.ptr, k_rstd.ptr, t, hq,
                               hkv, d, attrs["eps"]))
        rope_out = [ys[0], s.array((b, t, hq)), s.array((b, t, hkv))]
        qkv_qk_norm_rope(normed, None, None, as_dtype(s, freqs, "float32"), position_ids, out=rope_out,
                         **attrs)
        store()


def qkv_qk_norm_rope_backward_bf16(d_out: DeviceArray | None, qkv: DeviceArray,
                                   q_norm_weight: DeviceArray | None, k_norm_weight: DeviceArray | None,
                                   freqs: DeviceArray | None, position_ids: DeviceArray, q_rstd: DeviceArray,
                                   k_rstd: DeviceArray, d_q_rstd: DeviceArray | None = None,
                                   d_k_rstd: DeviceArray | None = None, *, out: Sequence[DeviceArray | None],
                                   **attrs: Any) -> None:
    """Its backward (NumPy's ``qkv_qk_norm_rope_backward@numpy:bfloat16``): rope's transpose in fp32 (the
    fp32 kernel without weights), the weights' gradients against the bf16 normalised heads, the heads'
    gradient rounded to bf16 through the norm in fp32, and ``d_qkv`` rounded to bf16."""
    hq, hkv, d = attrs["Hq"], attrs["Hkv"], attrs["D"]
    b, t = _heads(qkv, hq, hkv, d, "qkv_qk_norm_rope_backward")
    if qkv.dtype == "bfloat16":
        _qkv_norm_rope_backward_bf16in(d_out, qkv, q_norm_weight, k_norm_weight, freqs, position_ids,
                                       (q_rstd, k_rstd, d_q_rstd, d_k_rstd), out, b, t, attrs)
        return
    dev = qkv.device
    with Scratch(dev) as s:
        x, dy = as_dtype(s, qkv, "float32"), as_dtype(s, d_out, "float32")
        ws = [as_dtype(s, w, "float32") for w in (q_norm_weight, k_norm_weight)]
        rs = [as_dtype(s, r, "float32") for r in (q_rstd, k_rstd, d_q_rstd, d_k_rstd)]
        ys, store = _bf16_outputs(s, out, ("float32", "float32", "float32"))
        g = s.array(qkv.shape)
        ones = [s.array(r.shape) for r in (q_rstd, k_rstd)]
        for one in ones:
            dev.launch("fill_f32", ew_grid(one.size), (THREADS,), (one.ptr, 1.0, one.size))
        qkv_qk_norm_rope_backward(dy, x, None, None, as_dtype(s, freqs, "float32"), position_ids, *ones,
                                  out=[g, None, None], **attrs)
        if ys[1] is not None or ys[2] is not None:
            for w, dw in zip(ws, ys[1:], strict=True):
                if w is None and dw is not None:  # no norm: its weight has no gradient
                    dev.launch("fill_f32", ew_grid(dw.size), (THREADS,), (dw.ptr, 0.0, dw.size))
            dws = [dw if w is not None else None for w, dw in zip(ws, ys[1:], strict=True)]
            dev.launch("qk_norm_backward_dw_rp_bf16", (cdiv(d, 32), 2), (32,),
                       (g.ptr, x.ptr, rs[0].ptr, rs[1].ptr, _ptr(dws[0]), _ptr(dws[1]), b, t, hq, hkv, d))
        d_qkv = s.out(ys[0], qkv.shape)
        if b and t:
            dev.launch("qk_norm_backward_rp_bf16", (hq + 2 * hkv, t, b), (32,),
                       (g.ptr, x.ptr, _ptr(ws[0]), _ptr(ws[1]), rs[0].ptr, rs[1].ptr, _ptr(rs[2]),
                        _ptr(rs[3]), d_qkv.ptr, t, hq, hkv, d))
        store()


def _qkv_norm_rope_bf16in(qkv: DeviceArray, q_norm_weight: DeviceArray | None,
                          k_norm_weight: DeviceArray | None, freqs: DeviceArray | None,
                          position_ids: DeviceArray, out: Sequence[DeviceArray | None], b: int, t: int,
                          attrs: Mapping[str, Any]) -> None:
    """:func:`qkv_qk_norm_rope_bf16` on a bf16 ``qkv``: norm, rounding point and rope in one kernel that reads
    the bf16 heads directly: no widened copy, no normalised-heads buffer. A bf16 ``out`` slot is written as
    bf16 (``qkv_norm_rope_rp_bf16io``), a float32 one as float32 (``..._bf16in``); the rstds, float32
    statistics, as float32 either way."""
    hq, hkv, d = attrs["Hq"], attrs["Hkv"], attrs["D"]
    rd, batched = _rope_geometry(qkv, position_ids, d, attrs.get("rotary_dim"), "qkv_qk_norm_rope")
    io = out[0] is not None and out[0].dtype == "bfloat16"
    dt = "bfloat16" if io else "float32"
    with Scratch(qkv.device) as s:
        ws = [as_dtype(s, w, "float32") for w in (q_norm_weight, k_norm_weight, freqs)]
        ys, store = _bf16_outputs(s, out, (dt, "float32", "float32"))
        o = s.out(ys[0], qkv.shape, dt)
        if b and t:  # (a null rstd is not written)
            qkv.device.launch("qkv_norm_rope_rp_bf16io" if io else "qkv_norm_rope_rp_bf16in",
                              (hq + 2 * hkv, t, b), (32,),
                              (qkv.ptr, *map(_ptr, ws), position_ids.ptr, o.ptr, _ptr(ys[1]), _ptr(ys[2]), t,
                               hq, hkv, d, rd, batched, attrs["eps"], attrs["theta"],
                               int(attrs.get("interleaved", False))))
        store()


def _qkv_norm_rope_backward_bf16in(d_out: DeviceArray | None, qkv: DeviceArray,
                                   q_norm_weight: DeviceArray | None, k_norm_weight: DeviceArray | None,
                                   freqs: DeviceArray | None,
                                   position_ids: DeviceArray, rstds: Sequence[DeviceArray | None],
                                   out: Sequence[DeviceArray | None], b: int, t: int,
                                   attrs: Mapping[str, Any]) -> None:
    """:func:`qkv_qk_norm_rope_backward_bf16` on a bf16 ``qkv``: rope's transpose fused into the norm's
    backward kernels, which read the bf16 heads directly (``qkv_norm_rope_backward_rp_bf16in`` and its
    ``_dw_`` twin): no widened copy, no unrotated-gradient buffer."""
    hq, hkv, d = attrs["Hq"], attrs["Hkv"], attrs["D"]
    op = "qkv_qk_norm_rope_backward"
    rd, batched = _rope_geometry(qkv, position_ids, d, attrs.get("rotary_dim"), op)
    tail = (rd, batched, attrs["theta"], int(attrs.get("interleaved", False)))
    dev = qkv.device
    with Scratch(dev) as s:
        dy, fr = as_dtype(s, d_out, "float32"), as_dtype(s, freqs, "float32")
        ws = [as_dtype(s, w, "float32") for w in (q_norm_weight, k_norm_weight)]
        # a head's statistics are read only under its norm's weight (none of them without a q/k norm)
        rs = [as_dtype(s, r, "float32") if w is not None else None
              for r, w in zip(rstds, ws * 2, strict=True)]
        ys, store = _bf16_outputs(s, out, ("float32", "float32", "float32"))
        if ys[1] is not None or ys[2] is not None:
            for w, dw in zip(ws, ys[1:], strict=True):
                if w is None and dw is not None:  # no norm: its weight has no gradient
                    dev.launch("fill_f32", ew_grid(dw.size), (THREADS,), (dw.ptr, 0.0, dw.size))
            dws = [dw if w is not None else None for w, dw in zip(ws, ys[1:], strict=True)]
            dev.launch("qkv_norm_rope_backward_dw_rp_bf16in", (cdiv(d, 32), 2), (32,),
                       (_ptr(dy), qkv.ptr, _ptr(fr), position_ids.ptr, _ptr(rs[0]), _ptr(rs[1]), _ptr(dws[0]),
                        _ptr(dws[1]), b, t, hq, hkv, d, *tail))
        d_qkv = s.out(ys[0], qkv.shape)
        if b and t:
            dev.launch("qkv_norm_rope_backward_rp_bf16in", (hq + 2 * hkv, t, b), (32,),
                       (_ptr(dy), qkv.ptr, *map(_ptr, ws), _ptr(fr), position_ids.ptr, *map(_ptr, rs),
                        d_qkv.ptr, t, hq, hkv, d, *tail))
        store()


def _bf16in(base: str, a: DeviceArray | None) -> str:
    """The kernel ``base`` that reads ``a`` as it is: ``<base>_bf16in`` for bf16, else ``<base>_f32``."""
    return f"{base}_bf16in" if a is not None and a.dtype == "bfloat16" else f"{base}_f32"


def rmsnorm_bf16in(x: DeviceArray, weight: DeviceArray, *, out: Sequence[DeviceArray | None],
                   eps: float) -> None:
    """:func:`rmsnorm` reading a bf16 ``x`` directly (``rmsnorm_bf16in``: float32 math, no widened copy)."""
    c = x.shape[-1]
    rows = x.size // c
    with Scratch(x.device) as s:
        w = as_dtype(s, weight, "float32")
        xs = x if x.dtype == "bfloat16" else as_dtype(s, x, "float32")
        assert w is not None and xs is not None
        ys, store = _bf16_outputs(s, out, ("float32", "float32"))
        y, rstd = s.out(ys[0], x.shape), s.out(ys[1], x.shape[:-1])
        if rows:
            x.device.launch(_bf16in("rmsnorm", xs), (rows,), row_block(c),
                            (xs.ptr, w.ptr, y.ptr, rstd.ptr, c, eps))
        store()


def fused_residual_rmsnorm_bf16in(residual: DeviceArray, x: DeviceArray, weight: DeviceArray, *,
                                  out: Sequence[DeviceArray | None], eps: float) -> None:
    """:func:`fused_residual_rmsnorm` reading a bf16 ``x`` (a projection's output) directly; the residual
    stream and the outputs stay float32."""
    c = x.shape[-1]
    rows = x.size // c
    with Scratch(x.device) as s:
        r32, w = as_dtype(s, residual, "float32"), as_dtype(s, weight, "float32")
        xs = x if x.dtype == "bfloat16" else as_dtype(s, x, "float32")
        assert r32 is not None and w is not None and xs is not None
        ys, store = _bf16_outputs(s, out, ("float32", "float32", "float32"))
        res, y, rstd = s.out(ys[0], x.shape), s.out(ys[1], x.shape), s.out(ys[2], x.shape[:-1])
        if rows:
            x.device.launch(_bf16in("fused_residual_rmsnorm", xs), (rows,), row_block(c),
                            (r32.ptr, xs.ptr, w.ptr, res.ptr, y.ptr, rstd.ptr, c, eps))
        store()


def _rms_grads_bf16in(s: Scratch, d_y: DeviceArray | None, x: DeviceArray, rstd: DeviceArray,
                      weight: DeviceArray, d_rstd: DeviceArray | None, d_extra: DeviceArray | None,
                      d_x: DeviceArray, d_w: DeviceArray | None) -> None:
    """:func:`_rms_grads` reading a bf16 ``d_y`` directly (the ``_bf16in`` kernels); the other inputs as
    float32."""
    x32, r32, w32, dr32, de32 = (as_dtype(s, a, "float32") for a in (x, rstd, weight, d_rstd, d_extra))
    assert x32 is not None and r32 is not None and w32 is not None
    dy = d_y if d_y is None or d_y.dtype == "bfloat16" else as_dtype(s, d_y, "float32")
    dev, c = x.device, x.shape[-1]
    rows = x.size // c
    if d_w is not None:
        if dy is None or not rows:
            dev.memset(d_w.ptr, 0, d_w.nbytes)
        else:
            dev.launch(_bf16in("rmsnorm_backward_dw", dy), (cdiv(c, THREADS),), (THREADS,),
                       (dy.ptr, x32.ptr, r32.ptr, d_w.ptr, rows, c))
    if rows:
        dev.launch(_bf16in("rmsnorm_backward_dx", dy), (rows,), row_block(c),
                   (_ptr(dy), x32.ptr, r32.ptr, w32.ptr, _ptr(dr32), _ptr(de32), d_x.ptr, c))


def rmsnorm_backward_bf16in(d_y: DeviceArray | None, x: DeviceArray, rstd: DeviceArray, weight: DeviceArray,
                            d_rstd: DeviceArray | None = None, *, out: Sequence[DeviceArray | None]) -> None:
    """:func:`rmsnorm_backward` reading a bf16 ``d_y`` directly."""
    with Scratch(x.device) as s:
        ys, store = _bf16_outputs(s, out, ("float32", "float32"))
        _rms_grads_bf16in(s, d_y, x, rstd, weight, d_rstd, None, s.out(ys[0], x.shape), ys[1])
        store()


def fused_residual_rmsnorm_backward_bf16in(d_y: DeviceArray | None, d_residual_out: DeviceArray | None,
                                           residual_out: DeviceArray, rstd: DeviceArray, weight: DeviceArray,
                                           d_rstd: DeviceArray | None = None, *,
                                           out: Sequence[DeviceArray | None]) -> None:
    """:func:`fused_residual_rmsnorm_backward` reading a bf16 ``d_y`` (a projection's input gradient)
    directly."""
    with Scratch(residual_out.device) as s:
        ys, store = _bf16_outputs(s, out, ("float32", "float32", "float32"))
        d_residual, d_x, d_w = ys
        first = d_residual if d_residual is not None else s.out(d_x, residual_out.shape)
        _rms_grads_bf16in(s, d_y, residual_out, rstd, weight, d_rstd, d_residual_out, first, d_w)
        if d_residual is not None and d_x is not None:
            d_x.device.copy(d_x.ptr, d_residual.ptr, d_x.nbytes)
        store()


def layernorm_backward_bf16in(d_y: DeviceArray | None, x: DeviceArray, mean: DeviceArray,
                              rstd: DeviceArray, weight: DeviceArray, d_mean: DeviceArray | None = None,
                              d_rstd: DeviceArray | None = None, *,
                              out: Sequence[DeviceArray | None]) -> None:
    """:func:`layernorm_backward` reading a bf16 ``d_y`` directly (``layernorm_backward_dx_bf16in``,
    ``_dw_bf16in``); the other inputs and the outputs as float32."""
    dev, c = x.device, x.shape[-1]
    rows = x.size // c
    with Scratch(dev) as s:
        x32, m32, r32, w32, dm32, dr32 = (as_dtype(s, a, "float32")
                                          for a in (x, mean, rstd, weight, d_mean, d_rstd))
        assert x32 is not None and m32 is not None and r32 is not None and w32 is not None
        dy = d_y if d_y is None or d_y.dtype == "bfloat16" else as_dtype(s, d_y, "float32")
        ys, store = _bf16_outputs(s, out, ("float32", "float32", "float32"))
        d_x, d_w, d_b = s.out(ys[0], x.shape), s.out(ys[1], weight.shape), ys[2]
        if dy is None or not rows:
            for a in (d_w, d_b):
                if a is not None:
                    dev.memset(a.ptr, 0, a.nbytes)
        else:
            dev.launch(_bf16in("layernorm_backward_dw", dy), (cdiv(c, THREADS),), (THREADS,),
                       (dy.ptr, x32.ptr, m32.ptr, r32.ptr, d_w.ptr, _ptr(d_b), rows, c))
        if rows:
            dev.launch(_bf16in("layernorm_backward_dx", dy), (rows,), row_block(c),
                       (_ptr(dy), x32.ptr, m32.ptr, r32.ptr, w32.ptr, _ptr(dm32), _ptr(dr32), d_x.ptr, c))
        store()


def _logits_bf16(s: Scratch, xb: DeviceArray, wb: DeviceArray, softcap: float | None) -> DeviceArray:
    """One tile's logits under the bf16 recipe: bf16 x w^T (fp32 accumulate; float32 ``xb`` or ``wb``
    rounded to bf16 on load, :func:`_lowp_operand`) rounded to bf16, then capped in fp32 (NumPy's
    ``_head_logits``)."""
    z = s.array((xb.shape[0], wb.shape[0]))
    _matmul_rounding(s, xb, wb, None, z, "NT", 1.0, 1.0, True)
    if softcap is not None:
        z.device.launch("softcap_f32", ew_grid(z.size), (THREADS,), (z.ptr, z.size, softcap))
    return z


def fused_lm_head_loss_bf16(x: DeviceArray, weight: DeviceArray, targets: DeviceArray, *,
                            out: Sequence[DeviceArray | None], ignore_index: int, chunk_size: int = 0,
                            softcap: float | None = None) -> None:
    """``fused_lm_head_loss`` under the bf16 recipe (NumPy's ``fused_lm_head_loss@numpy:bfloat16``): x and
    the weight as bf16, each tile's logits rounded to bf16, the loss and log-sum-exp over them in fp32. One
    tile of logits lives at a time, as in :func:`fused_lm_head_loss`."""
    n, v = x.shape[0], weight.shape[0]
    with Scratch(x.device) as s:  # float32 x and weight rounded on load (bf16 copies only for cuBLASLt)
        _f32(*(a for a in (x, weight) if a.dtype != "bfloat16"))
        xb, wb = _lowp_operand(s, x), _lowp_operand(s, weight)
        ys, store = _bf16_outputs(s, out, ("float32", "float32"))
        loss, lse = s.out(ys[0], (n,)), s.out(ys[1], (n,))
        for r0, r1 in _head_tiles(n, v):
            with Scratch(x.device) as tile:
                z = _logits_bf16(tile, _rows_of(xb, r0, r1), wb, softcap)
                cross_entropy(z, _rows_of(targets, r0, r1),
                              out=(_rows_of(loss, r0, r1), _rows_of(lse, r0, r1)), ignore_index=ignore_index)
        store()


def fused_lm_head_loss_backward_bf16(d_loss: DeviceArray | None, x: DeviceArray, weight: DeviceArray,
                                     targets: DeviceArray, lse: DeviceArray, d_lse: DeviceArray | None = None,
                                     *, out: Sequence[DeviceArray | None], ignore_index: int,
                                     chunk_size: int = 0, softcap: float | None = None) -> None:
    """Its backward: per tile, the logits again, their gradient in fp32 rounded to bf16 (the gradient of a
    bf16 tensor), ``d_x = g w`` on bf16 operands rounded to bf16; ``d_weight = g^T x`` summed over the tiles
    in fp32 and rounded once at the end (NumPy's one product over all rows, up to the fp32 order)."""
    n, v = x.shape[0], weight.shape[0]
    dev = x.device
    with Scratch(dev) as s:  # float32 x and weight rounded on load (bf16 copies only for cuBLASLt)
        _f32(*(a for a in (x, weight) if a.dtype != "bfloat16"))
        xb, wb = _lowp_operand(s, x), _lowp_operand(s, weight)
        dl, l32, dlse = (as_dtype(s, a, "float32") for a in (d_loss, lse, d_lse))
        ys, store = _bf16_outputs(s, out, ("float32", "float32"))
        d_x, d_w = ys
        for i, (r0, r1) in enumerate(_head_tiles(n, v)):
            with Scratch(dev) as tile:
                xr = _rows_of(xb, r0, r1)
                z, g = _logits_bf16(tile, xr, wb, softcap), tile.array((r1 - r0, v))
                assert l32 is not None
                cross_entropy_backward(None if dl is None else _rows_of(dl, r0, r1), z,
                                       _rows_of(targets, r0, r1), _rows_of(l32, r0, r1),
                                       None if dlse is None else _rows_of(dlse, r0, r1), out=(g,),
                                       ignore_index=ignore_index)
                if softcap is not None:
                    dev.launch("softcap_backward_f32", ew_grid(g.size), (THREADS,),
                               (g.ptr, z.ptr, g.size, softcap))
                gb = _lowp_operand(tile, g)  # g's bf16 values: rounded on load, or a bf16 copy
                if d_x is not None:
                    _matmul_rounding(tile, gb, wb, None, _rows_of(d_x, r0, r1), "NN", 1.0, 1.0, True)
                if d_w is not None:
                    _matmul_rounding(tile, gb, xr, d_w if i else None, d_w, "TN", 1.0, 1.0, False)
        if d_w is not None:
            if not n:
                dev.memset(d_w.ptr, 0, d_w.nbytes)
            round_bf16(s, d_w, into=d_w)
        store()


def fused_lm_head_loss_and_grad_bf16(d_loss: DeviceArray | None, x: DeviceArray, weight: DeviceArray,
                                     targets: DeviceArray, *, loss: DeviceArray | None,
                                     lse: DeviceArray | None, d_x: DeviceArray | None,
                                     d_weight: DeviceArray | None, ignore_index: int = -100,
                                     plan: tuple[int, int] | None = None, **unsupported: Any) -> None:
    """:func:`fused_lm_head_loss_and_grad` under the bf16 recipe, rounding where
    :func:`fused_lm_head_loss_bf16` and its backward round (so their bits): x and the weight as bf16; per
    tile, the logits of their product (fp32 accumulate) read rounded to bf16 by one kernel per row that
    writes the loss, the log-sum-exp and the logits' gradient rounded to bf16; then ``d_x = g w`` on bf16
    operands rounded to bf16, and ``d_weight = g^T x`` summed over the tiles in fp32 and rounded once.
    One tile of float32 logits and one of their bf16 gradient are held."""
    _fused_attrs(unsupported)
    _i32(targets, "targets")
    n, v = x.shape[0], weight.shape[0]
    dev = x.device
    with Scratch(dev) as s:
        xb, wb = as_dtype(s, x, "bfloat16"), as_dtype(s, weight, "bfloat16")
        dl = as_dtype(s, d_loss, "float32")
        assert xb is not None and wb is not None
        ys, store = _bf16_outputs(s, (loss, lse, d_x, d_weight), ("float32",) * 4)
        loss_, lse_, dx, dw = s.out(ys[0], (n,)), s.out(ys[1], (n,)), ys[2], ys[3]
        tensor_cores = getattr(dev, "blas", None) is not None  # cuBLASLt's bf16 GEMM; the SIMT kernel: not
        rows, chunk = plan or _head_plan(n, v, x.shape[1], "bf16" if tensor_cores else "fp32")
        if n and chunk < v:
            _vocab_tiled_pass(dl, xb, wb, targets, loss_, lse_, dx, dw, rows, chunk, ignore_index, bf16=True)
            if dx is not None:
                round_bf16(s, dx, into=dx)
            if dw is not None:
                round_bf16(s, dw, into=dw)
            store()
            return
        tiles = [(r0, min(r0 + rows, n)) for r0 in range(0, n, rows)]
        zbuf = s.array((tiles[0][1], v)) if n else None
        gbuf = s.array((tiles[0][1], v), "bfloat16") if n else None
        for i, (r0, r1) in enumerate(tiles):
            assert zbuf is not None and gbuf is not None
            xr, z, g = _rows_of(xb, r0, r1), _tile(zbuf, r0, r1), _tile(gbuf, r0, r1)
            matmul(xr, wb, out=(z,), transpose="NT")
            dev.launch("lm_head_loss_grad_bf16", (r1 - r0,), row_block(v),
                       (0 if dl is None else _rows_of(dl, r0, r1).ptr, z.ptr, _rows_of(targets, r0, r1).ptr,
                        _rows_of(loss_, r0, r1).ptr, _rows_of(lse_, r0, r1).ptr, g.ptr, v, ignore_index))
            if dx is not None:
                dxr = _rows_of(dx, r0, r1)
                matmul(g, wb, out=(dxr,))
                with Scratch(dev) as t:
                    round_bf16(t, dxr, into=dxr)
            if dw is not None:
                matmul(g, xr, dw if i else None, out=(dw,), transpose="TN")
        if dw is not None:
            if not n:
                dev.memset(dw.ptr, 0, dw.nbytes)
            round_bf16(s, dw, into=dw)
        store()


#: kernels of the bf16 recipe that read and write their slots' dtypes themselves (the backend runs every
#: other kernel on float32 copies of bf16 tensors, rounding where the recipe says, but those of BF16_READS)
BF16_KERNELS: dict[str, Callable[..., None]] = {
    "flash_attention": flash_attention_bf16,
    "flash_attention_backward": flash_attention_backward_bf16,
    "swiglu": swiglu_bf16,
    "swiglu_backward": swiglu_backward_bf16,
    "qkv_qk_norm_rope": qkv_qk_norm_rope_bf16,
    "qkv_qk_norm_rope_backward": qkv_qk_norm_rope_backward_bf16,
    "fused_lm_head_loss": fused_lm_head_loss_bf16,
    "fused_lm_head_loss_backward": fused_lm_head_loss_backward_bf16,
}
#: the Program fusions the backend runs (its ``capabilities``): fusion -> (its float32 kernel, its kernel
#: under the bf16 recipe, the ops whose steps it replaces)
FUSIONS: dict[str, tuple[Callable[..., None], Callable[..., None], tuple[str, ...]]] = {
    "fused_lm_head_loss_and_grad": (fused_lm_head_loss_and_grad, fused_lm_head_loss_and_grad_bf16,
                                    ("fused_lm_head_loss", "fused_lm_head_loss_backward")),
}
def _binary_bf16(op: str, base: str) -> Callable[..., None]:
    """``op`` (``add``, ``bias_add``, ``mul``) on float32 and bf16 tensors as they lie: the kernel
    ``<base>_<a><b><out>`` of their element types (``f`` float32, ``h`` bf16), a bf16 ``out`` rounded as it
    is stored; all float32: the float32 kernel."""
    def fn(a: DeviceArray, b: DeviceArray, *, out: Sequence[DeviceArray]) -> None:
        o = out[0]
        types = "".join("h" if t.dtype == "bfloat16" else "f" for t in (a, b, o))
        if types == "fff" or any(t.dtype not in ("float32", "bfloat16") for t in (a, b, o)):
            _f32(a, b, o)
            types = "f32"
        a.device.launch(f"{base}_{types}", ew_grid(a.size), (THREADS,),
                        (a.ptr, b.ptr, o.ptr, a.size, _trailing(a, b, op)))

    fn.__name__ = f"{op}_bf16"
    return fn


def _gelu_bf16(backward: bool) -> Callable[..., None]:
    """``gelu`` (or its backward) on float32 and bf16 tensors as they lie: the kernel ``gelu_<x><out>``
    (``gelu_backward_<d><x><out>``) of their element types (``f`` float32, ``h`` bf16); all float32: the
    float32 kernel."""
    def fn(*args: DeviceArray, out: Sequence[DeviceArray], approximate: str = "none") -> None:
        o, x = out[0], args[-1]
        types = "".join("h" if t.dtype == "bfloat16" else "f" for t in (*args, o))
        if "h" not in types or any(t.dtype not in ("float32", "bfloat16") for t in (*args, o)):
            _f32(*args, o)
            types = "f32"
        kernel = f"gelu_backward_{types}" if backward else f"gelu_{types}"
        x.device.launch(kernel, ew_grid(x.size), (THREADS,),
                        (*(a.ptr for a in args), o.ptr, x.size, _is_tanh(approximate)))

    fn.__name__ = "gelu_backward_bf16" if backward else "gelu_bf16"
    return fn


#: float32 kernels and their twins that read bf16 tensors directly (float32 math inside, no widened copies):
#: under the bf16 recipe the backend hands the twin its steps' bf16 slots as they are
#: (:func:`kiln.cuda._backend.low_precision`), rounding the float inputs of a ``lower`` step and the
#: ``rounded`` outputs as before
BF16_READS: dict[Callable[..., None], Callable[..., None]] = {
    rmsnorm: rmsnorm_bf16in,
    fused_residual_rmsnorm: fused_residual_rmsnorm_bf16in,
    rmsnorm_backward: rmsnorm_backward_bf16in,
    fused_residual_rmsnorm_backward: fused_residual_rmsnorm_backward_bf16in,
    layernorm_backward: layernorm_backward_bf16in,
}
#: ops whose kernels take bf16 operands (the backend hands a ``lower`` step of them its float inputs as
#: bf16, rounded where they are float32, instead of float32 copies of bf16 values): cuBLASLt's bf16 GEMM
#: on a GPU, ``matmul_bf16`` elsewhere
BF16_OPERANDS = frozenset({"matmul", "batched_matmul"})
#: a matmul step of those ops under the bf16 recipe runs this launch function on its slots as they are: the
#: operands rounded on load (CUDA cores) and a bf16 output written directly (:func:`matmul_lowp`)
BF16_MATMULS: dict[Callable[..., None], Callable[..., None]] = {matmul: matmul_lowp}


def _rope_geometry(qkv: DeviceArray, position_ids: DeviceArray, D: int, rotary_dim: int | None,
                   op: str) -> tuple[int, int]:
    _i32(position_ids, "position ids")
    rd = D if rotary_dim is None else rotary_dim
    if rd % 2 or not 0 < rd <= D:
        raise KilnError(f"op {op!r}: rotary_dim must be even and in (0, {D}], found {rd}")
    return rd, int(len(position_ids.shape) == 2)


def qkv_qk_norm_rope(qkv: DeviceArray, q_norm_weight: DeviceArray | None, k_norm_weight: DeviceArray | None,
                     freqs: DeviceArray | None, position_ids: DeviceArray, *,
                     out: Sequence[DeviceArray | None], Hq: int, Hkv: int, D: int, eps: float, theta: float,
                     rotary_dim: int | None, interleaved: bool = False) -> None:
    op = "qkv_qk_norm_rope"
    _f32(qkv, q_norm_weight, k_norm_weight, freqs)
    b, t = _heads(qkv, Hq, Hkv, D, op)
    rd, batched = _rope_geometry(qkv, position_ids, D, rotary_dim, op)
    with Scratch(qkv.device) as s:
        o, q_rstd, k_rstd = s.out(out[0], qkv.shape), s.out(out[1], (b, t, Hq)), s.out(out[2], (b, t, Hkv))
        if b and t:
            qkv.device.launch("qkv_norm_rope_f32", (Hq + 2 * Hkv, t, b), (32,),
                              (qkv.ptr, _ptr(q_norm_weight), _ptr(k_norm_weight), _ptr(freqs),
                               position_ids.ptr, o.ptr, q_rstd.ptr, k_rstd.ptr, t, Hq, Hkv, D, rd, batched,
                               eps, theta, int(interleaved)))


def qkv_qk_norm_rope_backward(d_qkv_out: DeviceArray | None, qkv: DeviceArray,
                              q_norm_weight: DeviceArray | None, k_norm_weight: DeviceArray | None,
                              freqs: DeviceArray | None,
                              position_ids: DeviceArray, q_rstd: DeviceArray, k_rstd: DeviceArray,
                              d_q_rstd: DeviceArray | None = None, d_k_rstd: DeviceArray | None = None, *,
                              out: Sequence[DeviceArray | None], Hq: int, Hkv: int, D: int, eps: float,
                              theta: float, rotary_dim: int | None, interleaved: bool = False) -> None:
    """The norm weights' gradients (column kernel), then d_qkv (row kernel)."""
    op = "qkv_qk_norm_rope_backward"
    _f32(d_qkv_out, qkv, q_norm_weight, k_norm_weight, freqs, q_rstd, k_rstd, d_q_rstd, d_k_rstd)
    b, t = _heads(qkv, Hq, Hkv, D, op)
    rd, batched = _rope_geometry(qkv, position_ids, D, rotary_dim, op)
    weights = (_ptr(d_qkv_out), qkv.ptr, _ptr(q_norm_weight), _ptr(k_norm_weight), _ptr(freqs),
               position_ids.ptr, q_rstd.ptr, k_rstd.ptr)
    d_qkv, d_qw, d_kw = out
    with Scratch(qkv.device) as s:
        d_qkv = s.out(d_qkv, qkv.shape)
        if d_qw is not None or d_kw is not None:
            qkv.device.launch("qkv_norm_rope_backward_dw_f32", (cdiv(D, 32), 2), (32,),
                              (*weights, _ptr(d_qw), _ptr(d_kw), b, t, Hq, Hkv, D, rd, batched, theta,
                               int(interleaved)))
        if b and t:
            qkv.device.launch("qkv_norm_rope_backward_dx_f32", (Hq + 2 * Hkv, t, b), (32,),
                              (*weights, _ptr(d_q_rstd), _ptr(d_k_rstd), d_qkv.ptr, t, Hq, Hkv, D, rd,
                               batched, theta, int(interleaved)))


# --- mixture of experts (moe.cu) ------------------------------------------------------------------


def moe_softmax(logits: DeviceArray, *, out: Sequence[DeviceArray]) -> None:
    softmax(logits, out=out, axis=-1)


def moe_softmax_backward(d: DeviceArray, probs: DeviceArray, *, out: Sequence[DeviceArray],
                         dtype: Any = None) -> None:
    softmax_backward(d, probs, out=out, axis=-1)


def moe_sigmoid(logits: DeviceArray, *, out: Sequence[DeviceArray]) -> None:
    _f32(logits)
    logits.device.launch("moe_sigmoid_f32", ew_grid(logits.size), (THREADS,),
                         (logits.ptr, out[0].ptr, logits.size))


def moe_sigmoid_backward(d: DeviceArray, probs: DeviceArray, *, out: Sequence[DeviceArray],
                         dtype: Any = None) -> None:
    _f32(d, probs)
    d.device.launch("moe_sigmoid_backward_f32", ew_grid(d.size), (THREADS,),
                    (d.ptr, probs.ptr, out[0].ptr, d.size))


def moe_topk(probs: DeviceArray, *, out: Sequence[DeviceArray | None], k: int, normalize: bool) -> None:
    _f32(probs)
    n, e = probs.shape
    if not 1 <= k <= e:
        raise KilnError(f"op 'moe_topk': k = {k} is not in 1..{e} (the number of experts)")
    with Scratch(probs.device) as s:
        w, idx = s.out(out[0], (n, k)), s.out(out[1], (n, k), "int32")
        if n:
            probs.device.launch("moe_topk_f32", (cdiv(n, THREADS),), (THREADS,),
                                (probs.ptr, w.ptr, idx.ptr, n, e, k, int(normalize)))


def moe_topk_backward(d: DeviceArray, probs: DeviceArray, indices: DeviceArray, *, out: Sequence[DeviceArray],
                      normalize: bool) -> None:
    _f32(d, probs)
    _i32(indices, "expert indices")
    (n, e), k = probs.shape, d.shape[1]
    if n:
        d.device.launch("moe_topk_backward_f32", (cdiv(n, THREADS),), (THREADS,),
                        (d.ptr, probs.ptr, indices.ptr, out[0].ptr, n, e, k, int(normalize)))


def moe_permute(x: DeviceArray, indices: DeviceArray, *, out: Sequence[DeviceArray | None],
                num_experts: int) -> None:
    """The routing kernel (offsets, scatter_idx: a stable sort by expert), then the row gather. Expert
    indices outside 0..num_experts-1 are in no expert (the NumPy kernel raises; this one cannot look)."""
    _f32(x)
    _i32(indices, "expert indices")
    (n, c), k = x.shape, indices.shape[1]
    dev, r = x.device, n * k
    with Scratch(dev) as s:
        x_perm, scatter = s.out(out[0], (r, c)), s.out(out[1], (r,), "int32")
        offsets = s.out(out[2], (num_experts + 1,), "int32")
        dev.launch("moe_route_f32", (1,), (THREADS,), (indices.ptr, scatter.ptr, offsets.ptr, r, num_experts))
        if r * c:
            dev.launch("moe_gather_rows_f32", ew_grid(r * c), (THREADS,),
                       (x.ptr, scatter.ptr, x_perm.ptr, r, c, k))


def _combine(y: DeviceArray, weights: DeviceArray | None, scatter_idx: DeviceArray, out: DeviceArray,
             n: int, k: int) -> None:
    """out[t] = sum over slots j of w[t, j] y[row of (t, j)]: the inverse permutation, then the rows."""
    _i32(scatter_idx, "scatter_idx")
    dev, r, c = y.device, y.shape[0], y.shape[1]
    if r != n * k:
        raise KilnError(f"moe rows on cuda: {r} rows of y_perm for {n} tokens x {k} slots")
    with Scratch(dev) as s:
        row_of = s.array((max(r, 1),), "int32")
        if r:
            dev.launch("moe_invert_f32", ew_grid(r), (THREADS,), (scatter_idx.ptr, row_of.ptr, r))
        if n * c:
            dev.launch("moe_combine_rows_f32", ew_grid(n * c), (THREADS,),
                       (y.ptr, _ptr(weights), row_of.ptr, out.ptr, n, c, k))


def moe_permute_backward(d: DeviceArray, scatter_idx: DeviceArray, *, out: Sequence[DeviceArray],
                         num_tokens: int) -> None:
    _f32(d)
    k = d.shape[0] // num_tokens if num_tokens else 1
    _combine(d, None, scatter_idx, out[0], num_tokens, k)


def moe_unpermute(y: DeviceArray, weights: DeviceArray, scatter_idx: DeviceArray, *,
                  out: Sequence[DeviceArray], top_k: int | None = None) -> None:
    _f32(y, weights)
    n, k = weights.shape
    if top_k is not None and top_k != k:
        raise KilnError(f"op 'moe_unpermute': weights' last dim {k} is not top_k = {top_k}")
    _combine(y, weights, scatter_idx, out[0], n, k)


def moe_unpermute_dy(d: DeviceArray, weights: DeviceArray, scatter_idx: DeviceArray, *,
                     out: Sequence[DeviceArray]) -> None:
    _f32(d, weights)
    _i32(scatter_idx, "scatter_idx")
    r, c, k = scatter_idx.shape[0], d.shape[1], weights.shape[1]
    if r * c:
        d.device.launch("moe_unpermute_dy_f32", ew_grid(r * c), (THREADS,),
                        (d.ptr, weights.ptr, scatter_idx.ptr, out[0].ptr, r, c, k))


def moe_unpermute_dw(d: DeviceArray, y: DeviceArray, scatter_idx: DeviceArray, *, out: Sequence[DeviceArray],
                     top_k: int) -> None:
    _f32(d, y)
    _i32(scatter_idx, "scatter_idx")
    dw, r = out[0], y.shape[0]
    d.device.memset(dw.ptr, 0, dw.nbytes)
    if r:
        d.device.launch("moe_unpermute_dw_f32", (r,), (32,),
                        (d.ptr, y.ptr, scatter_idx.ptr, dw.ptr, y.shape[1], top_k))


def moe_load_stats(probs: DeviceArray, indices: DeviceArray, segment_ids: DeviceArray | None = None, *,
                   out: Sequence[DeviceArray | None]) -> None:
    """A block per expert: its assignments and summed probabilities over the rows that count."""
    _f32(probs)
    _i32(indices, "expert indices")
    n, e = probs.shape
    with Scratch(probs.device) as s:
        load, mean = s.out(out[0], (e,)), s.out(out[1], (e,))
        if e:
            probs.device.launch("moe_load_stats_f32", (e,), (THREADS,),
                                (probs.ptr, indices.ptr, _ptr(segment_ids), load.ptr, mean.ptr, n, e,
                                 indices.shape[-1]))


def moe_load_stats_backward(d_mean: DeviceArray, probs: DeviceArray,
                            segment_ids: DeviceArray | None = None, *, out: Sequence[DeviceArray]) -> None:
    _f32(d_mean, probs)
    n, e = probs.shape
    probs.device.launch("moe_load_stats_backward_f32", (1,), (THREADS,),
                        (d_mean.ptr, _ptr(segment_ids), out[0].ptr, n, e))


def moe_aux_loss(loss: DeviceArray, targets: DeviceArray, load: DeviceArray, mean_probs: DeviceArray, *,
                 out: Sequence[DeviceArray | None], coef: float, num_layers: int, ignore_index: int) -> None:
    """One block: the auxiliary loss (a fixed-order sum over the experts), added to the counted tokens."""
    _f32(loss, load, mean_probs)
    _i32(targets, "targets")
    if num_layers < 1:
        raise KilnError(f"op 'moe_aux_loss': num_layers must be >= 1, found {num_layers}")
    with Scratch(loss.device) as s:
        loss_out, aux = s.out(out[0], loss.shape), s.out(out[1], ())
        loss.device.launch("moe_aux_loss_f32", (1,), (THREADS,),
                           (loss.ptr, targets.ptr, load.ptr, mean_probs.ptr, loss_out.ptr, aux.ptr, loss.size,
                            load.size, coef, num_layers, ignore_index))


def moe_aux_loss_backward(d_loss: DeviceArray | None, d_aux: DeviceArray | None, targets: DeviceArray,
                          load: DeviceArray, *, out: Sequence[DeviceArray], coef: float, num_layers: int,
                          ignore_index: int) -> None:
    _f32(d_loss, d_aux, load)
    load.device.launch("moe_aux_loss_backward_f32", (1,), (THREADS,),
                       (_ptr(d_loss), _ptr(d_aux), targets.ptr, load.ptr, out[0].ptr, targets.size, load.size,
                        coef, num_layers, ignore_index))


def _router_probs(s: Scratch, x: DeviceArray, gate: DeviceArray, use_sigmoid: bool, op: str) -> DeviceArray:
    """moe_router's probs [N, E] in the workspace: the matmul x @ gate^T, then softmax (or sigmoid) in place
    (each thread reads an element before it writes it)."""
    _f32(x, gate)
    if len(x.shape) != 2 or len(gate.shape) != 2 or x.shape[1] != gate.shape[1]:
        raise KilnError(f"op {op!r} on cuda: x [N, C] and gate [E, C] expected, found {x.shape} and "
                        f"{gate.shape}")
    probs = s.array((x.shape[0], gate.shape[0]))
    matmul(x, gate, out=(probs,), transpose="NT")
    if probs.size:
        (moe_sigmoid if use_sigmoid else moe_softmax)(probs, out=(probs,))
    return probs


def moe_router(x: DeviceArray, gate: DeviceArray, *, out: Sequence[DeviceArray | None], top_k: int,
               normalize: bool, aux_loss_coef: float, use_sigmoid: bool) -> None:
    """A composition: the router's probs, the top-k kernel, the load statistics of all rows (a block per
    expert), then one block sums the loss over the experts in order."""
    n, e = x.shape[0], gate.shape[0]
    if not 1 <= top_k <= e:
        raise KilnError(f"op 'moe_router': top_k = {top_k} is not in 1..{e} (the number of experts)")
    with Scratch(x.device) as s:
        probs = _router_probs(s, x, gate, use_sigmoid, "moe_router")
        w, idx, aux = s.out(out[0], (n, top_k)), s.out(out[1], (n, top_k), "int32"), s.out(out[2], ())
        moe_topk(probs, out=(w, idx), k=top_k, normalize=normalize)
        load, mean = s.array((e,)), s.array((e,))
        moe_load_stats(probs, idx, out=(load, mean))
        x.device.launch("moe_router_aux_f32", (1,), (THREADS,),
                        (load.ptr, mean.ptr, aux.ptr, e, aux_loss_coef))


def moe_router_backward(d_weights: DeviceArray | None, d_aux_loss: DeviceArray | None, x: DeviceArray,
                        gate: DeviceArray, indices: DeviceArray, *, out: Sequence[DeviceArray],
                        normalize: bool, aux_loss_coef: float, use_sigmoid: bool, dtype: Any = None) -> None:
    """d_logits: the probs recomputed, the top-k kernel's backward (zeros without d_weights), the loss's
    share added from the assignment counts, then the softmax (or sigmoid) backward."""
    _f32(d_weights, d_aux_loss)
    _i32(indices, "expert indices")
    n, e = x.shape[0], gate.shape[0]
    dev = x.device
    with Scratch(dev) as s:
        probs = _router_probs(s, x, gate, use_sigmoid, "moe_router_backward")
        d_probs = s.array((n, e))
        if d_weights is not None:
            moe_topk_backward(d_weights, probs, indices, out=(d_probs,), normalize=normalize)
        else:
            dev.memset(d_probs.ptr, 0, d_probs.nbytes)
        if d_aux_loss is not None and n * e:
            load, mean = s.array((e,)), s.array((e,))
            moe_load_stats(probs, indices, out=(load, mean))
            dev.launch("moe_router_aux_backward_f32", ew_grid(n * e), (THREADS,),
                       (d_aux_loss.ptr, load.ptr, d_probs.ptr, n, e, aux_loss_coef))
        if n * e:
            (moe_sigmoid_backward if use_sigmoid else moe_softmax_backward)(d_probs, probs, out=out)


def _expert_rows(offsets: DeviceArray) -> list[tuple[int, int]]:
    """Each expert's rows [r0, r1), read from the device (a synchronisation: the cuBLASLt path needs the
    row counts on the host to size its GEMMs)."""
    offsets.device.synchronize()
    host = offsets.download().ravel()
    return [(int(a), int(b)) for a, b in itertools.pairwise(host)]


def _grouped(x: DeviceArray, w: DeviceArray, offsets: DeviceArray, out: DeviceArray, nt: bool,
             op: str) -> None:
    """out [R, O] = x [R, I] rows of expert e times w[e]: [O, I] transposed (nt) or [I, O]."""
    _f32(x, w)
    _i32(offsets, "expert offsets")
    (r, i), e = x.shape, w.shape[0]
    o = w.shape[1] if nt else w.shape[2]
    if (w.shape[2] if nt else w.shape[1]) != i or offsets.shape != (e + 1,):
        raise KilnError(f"op {op!r} on cuda: x {x.shape}, weight {w.shape} and offsets {offsets.shape} do "
                        "not fit together")
    if getattr(x.device, "blas", None) is not None:
        for ex, (r0, r1) in enumerate(_expert_rows(offsets)):  # one cuBLASLt GEMM per expert
            weight = _rows_of(w, ex, ex + 1).reshape(w.shape[1:])
            matmul(_rows_of(x, r0, r1), weight, out=(_rows_of(out, r0, r1),), transpose="NT" if nt else "NN")
        return
    if r and o:
        x.device.launch("grouped_gemm_f32", (cdiv(o, MATMUL_TILE), cdiv(r, MATMUL_TILE)),
                        (MATMUL_TILE, MATMUL_TILE), (x.ptr, w.ptr, offsets.ptr, out.ptr, r, e, o, i, int(nt)))


def grouped_gemm(x: DeviceArray, w: DeviceArray, offsets: DeviceArray, *, out: Sequence[DeviceArray],
                 transpose: str = "NT") -> None:
    _grouped(x, w, offsets, out[0], transpose == "NT", "grouped_gemm")


def _moe_gemm(op: str, nt: bool) -> Callable[..., None]:
    def fn(x: DeviceArray, w: DeviceArray, offsets: DeviceArray, *, out: Sequence[DeviceArray]) -> None:
        _grouped(x, w, offsets, out[0], nt, op)

    return fn


def moe_grouped_gemm_dw(d: DeviceArray, x: DeviceArray, offsets: DeviceArray, *,
                        out: Sequence[DeviceArray]) -> None:
    _f32(d, x)
    _i32(offsets, "expert offsets")
    e, o, i = offsets.shape[0] - 1, d.shape[1], x.shape[1]
    if getattr(d.device, "blas", None) is not None:
        dw = out[0]
        for ex, (r0, r1) in enumerate(_expert_rows(offsets)):
            target = _rows_of(dw, ex, ex + 1).reshape(dw.shape[1:])
            if r1 > r0:
                matmul(_rows_of(d, r0, r1), _rows_of(x, r0, r1), out=(target,), transpose="TN")
            else:
                d.device.memset(target.ptr, 0, target.nbytes)
        return
    if e and o and i:
        d.device.launch("grouped_gemm_dw_f32", (cdiv(i, MATMUL_TILE), cdiv(o, MATMUL_TILE), e),
                        (MATMUL_TILE, MATMUL_TILE), (d.ptr, x.ptr, offsets.ptr, out[0].ptr, o, i))


# --- optimizer ------------------------------------------------------------------------------------


def norm_into(s: Scratch, grads: Sequence[DeviceArray], total: int) -> None:
    """Launches the global L2 norm of ``grads`` into the float at device address ``total``."""
    dev = grads[0].device
    partial = s.array((len(grads) * NORM_BLOCKS,))
    dev.memset(partial.ptr, 0, partial.nbytes)
    for i, g in enumerate(grads):
        blocks = max(1, min(NORM_BLOCKS, cdiv(g.size, THREADS)))  # the rest of its partials stay 0
        dev.launch("sumsq_partial_f32", (blocks,), (THREADS,),
                   (g.ptr, g.size, partial.ptr + 4 * i * NORM_BLOCKS))
    dev.launch("sqrt_sum_f32", (1,), (THREADS,), (partial.ptr, len(grads) * NORM_BLOCKS, total))


def grad_norm(*grads: DeviceArray) -> float:
    """The global L2 norm: fixed-grid partial sums per gradient, then one block sums them in order."""
    _f32(*grads)
    if not grads:
        return 0.0
    dev = grads[0].device
    with Scratch(dev) as s:
        total = s.array((1,))
        norm_into(s, grads, total.ptr)
        dev.synchronize()
        return float(dev.copy_to_host(total.ptr, 4).view(np.float32)[0])


#: the optimizer phase's scalars on the device (optimizer.cu): the gradient norm, the clipping factor, the
#: learning rate, then three factors per AdamW group
SCALARS = 3


def grad_norm_on_device(scalars: DeviceArray, grads: Sequence[DeviceArray]) -> None:
    """The global norm of ``grads`` into ``scalars[0]`` and the clipping factor into ``scalars[1]`` (from
    the threshold :func:`step_scalars` put there), on the device: nothing read back, a graph can hold it."""
    _f32(*grads)
    dev = scalars.device
    with Scratch(dev) as s:
        if grads:
            norm_into(s, grads, scalars.ptr)
        else:
            dev.memset(scalars.ptr, 0, 4)
        dev.launch("clip_scale_f32", (1,), (1,), (scalars.ptr,))


def step_scalars(optimizer: Any, step: int, groups: Sequence[Mapping[str, Any]], *, clip: bool) -> np.ndarray:
    """The host's part of the device scalars for update ``step``: norm 0; the clipping threshold (-1: none)
    when ``clip`` (a :func:`grad_norm_on_device` turns it into the factor), else the factor 1; the
    scheduled learning rate; each AdamW group's factors in float64 as :func:`adamw_update` computes them,
    rounded once to float32."""
    lr = optimizer.lr_at(step) if optimizer is not None else 0.0
    max_norm = getattr(optimizer, "max_grad_norm", None)
    out = [0.0, (-1.0 if max_norm is None else max_norm) if clip else 1.0, lr]
    for g in groups:
        lr_g = lr * g["lr_scale"]
        decay = 1 - lr_g * g["weight_decay"] if g["weight_decay"] else 1.0
        out += [lr_g / (1 - g["beta1"] ** step), 1 / math.sqrt(1 - g["beta2"] ** step), decay]
    return np.array(out, np.float32)


def adamw_update(p: DeviceArray, g: DeviceArray, m: DeviceArray, v: DeviceArray,
                 work: DeviceArray | None = None, *, step: int, lr: float, scale: float, beta1: float,
                 beta2: float, eps: float, weight_decay: float, lr_scale: float) -> None:
    """One AdamW update in place (``work`` is not needed: the kernel keeps its temporaries in registers)."""
    _f32(p, g, m, v)
    lr = lr * lr_scale
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    decay = 1 - lr * weight_decay if weight_decay else 1.0
    p.device.launch("adamw_f32", ew_grid(p.size), (THREADS,),
                    (p.ptr, g.ptr, m.ptr, v.ptr, p.size, beta1, beta2, scale * (1 - beta1),
                     (1 - beta2) * scale * scale, 1 / math.sqrt(bc2), eps, lr / bc1, decay))


class AdamwGroup:
    """``adamw_update`` of many parameters with the same attributes in one launch (``adamw_multi_f32``):
    their pointer table and element offsets go to the device once, when the group is made."""

    def __init__(self, updates: Sequence[Sequence[DeviceArray]]) -> None:
        for p, g, m, v, *_ in updates:
            _f32(p, g, m, v)
        self.device = updates[0][0].device
        ptrs = np.array([[a.ptr for a in u[:4]] for u in updates], np.uint64)
        offsets = np.concatenate([[0], np.cumsum([u[0].size for u in updates])]).astype(np.int64)
        self.k, self.total = len(updates), int(offsets[-1])
        self.table = self.device.alloc(ptrs.nbytes + offsets.nbytes)
        self.device.copy_to_device(self.table, ptrs)
        self.device.copy_to_device(self.table + ptrs.nbytes, offsets)
        self.offsets = self.table + ptrs.nbytes
        weakref.finalize(self, self.device.free, self.table)

    def on_device(self, scalars: DeviceArray, slot: int, *, beta1: float, beta2: float, eps: float,
                  **_: Any) -> None:
        """The update with its factors read from the device scalars (:func:`step_scalars`, the clipping
        factor from :func:`grad_norm_on_device`): launch arguments that do not change from step to step."""
        if self.total:
            self.device.launch("adamw_multi_dev_f32", ew_grid(self.total), (THREADS,),
                               (self.table, self.offsets, self.k, scalars.ptr, slot, beta1, beta2, 1 - beta1,
                                1 - beta2, eps))

    def __call__(self, *, step: int, lr: float, scale: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, lr_scale: float) -> None:
        lr = lr * lr_scale
        bc1, bc2 = 1 - beta1**step, 1 - beta2**step
        decay = 1 - lr * weight_decay if weight_decay else 1.0
        if self.total:
            self.device.launch("adamw_multi_f32", ew_grid(self.total), (THREADS,),
                               (self.table, self.offsets, self.k, beta1, beta2, scale * (1 - beta1),
                                (1 - beta2) * scale * scale, 1 / math.sqrt(bc2), eps, lr / bc1, decay))


def sgd_update(p: DeviceArray, g: DeviceArray, *rest: DeviceArray, step: int, lr: float, scale: float,
               momentum: float, dampening: float, nesterov: bool, weight_decay: float,
               lr_scale: float) -> None:
    _f32(p, g, *rest)
    lr = lr * lr_scale
    decay = 1 - lr * weight_decay if weight_decay else 1.0
    buf = rest[0] if momentum else None
    p.device.launch("sgd_f32", ew_grid(p.size), (THREADS,),
                    (p.ptr, g.ptr, _ptr(buf), p.size, scale, momentum, 1 - dampening, int(nesterov),
                     int(step == 1), lr, decay))


#: op -> (launch function, inputs whose storage the first output may take over)
KERNELS: dict[str, tuple[Callable[..., Any], frozenset[int]]] = {
    "zeros": (_fill(0.0), frozenset()),
    "ones": (_fill(1.0), frozenset()),
    "fill": (fill, frozenset()),
    "zeros_like": (zeros_like, frozenset()),
    "copy": (copy, frozenset()),
    "cast": (cast_op, frozenset()),
    "dropout": (dropout, frozenset({0})),
    "scale": (scale, frozenset({0})),
    "add": (_binary("add_f32", "add"), frozenset({0})),
    "bias_add": (_binary("add_f32", "bias_add"), frozenset({0})),
    "mul": (_binary("mul_f32", "mul"), frozenset({0})),
    "silu": (_unary("silu_f32"), frozenset()),
    "silu_backward": (_unary_backward("silu_backward_f32"), frozenset()),
    "relu": (_unary("relu_f32"), frozenset()),
    "relu_backward": (_unary_backward("relu_backward_f32"), frozenset()),
    "gelu": (_unary("gelu_f32", approximate=_is_tanh), frozenset()),
    "gelu_backward": (_unary_backward("gelu_backward_f32", approximate=_is_tanh), frozenset()),
    "swiglu": (swiglu, frozenset()),
    "swiglu_backward": (swiglu_backward, frozenset({1})),
    "silu_mul": (silu_mul, frozenset()),
    "silu_mul_backward": (silu_mul_backward, frozenset()),
    "softmax": (softmax, frozenset()),
    "softmax_backward": (softmax_backward, frozenset()),
    "rmsnorm": (rmsnorm, frozenset()),
    "rmsnorm_backward": (rmsnorm_backward, frozenset()),
    "layernorm": (layernorm, frozenset()),
    "layernorm_backward": (layernorm_backward, frozenset()),
    "fused_residual_rmsnorm": (fused_residual_rmsnorm, frozenset({0, 1})),
    "fused_residual_rmsnorm_backward": (fused_residual_rmsnorm_backward, frozenset()),
    "cross_entropy": (cross_entropy, frozenset()),
    "cross_entropy_backward": (cross_entropy_backward, frozenset()),
    "embedding": (embedding, frozenset()),
    "embedding_backward": (embedding_backward, frozenset()),
    "rope": (rope, frozenset()),
    "rope_freqs": (rope_freqs, frozenset()),
    "mamba_conv1d": (mamba_conv1d, frozenset()),
    "mamba_conv1d_backward": (mamba_conv1d_backward, frozenset()),
    "mamba_selective_scan": (mamba_selective_scan, frozenset()),
    "mamba_selective_scan_backward": (mamba_selective_scan_backward, frozenset()),
    "matmul": (matmul, frozenset()),
    "fused_lm_head_loss": (fused_lm_head_loss, frozenset()),
    "fused_lm_head_loss_backward": (fused_lm_head_loss_backward, frozenset()),
    "flash_attention": (flash_attention, frozenset()),
    "flash_attention_backward": (flash_attention_backward, frozenset()),
    "attention": (attention, frozenset()),
    "attention_backward": (attention_backward, frozenset()),
    "qkv_qk_norm_rope": (qkv_qk_norm_rope, frozenset()),
    "qkv_qk_norm_rope_backward": (qkv_qk_norm_rope_backward, frozenset()),
    "batched_matmul": (matmul, frozenset()),
    "moe_softmax": (moe_softmax, frozenset()),
    "moe_softmax_backward": (moe_softmax_backward, frozenset()),
    "moe_sigmoid": (moe_sigmoid, frozenset()),
    "moe_sigmoid_backward": (moe_sigmoid_backward, frozenset()),
    "moe_topk": (moe_topk, frozenset()),
    "moe_topk_backward": (moe_topk_backward, frozenset()),
    "moe_load_stats": (moe_load_stats, frozenset()),
    "moe_load_stats_backward": (moe_load_stats_backward, frozenset()),
    "moe_aux_loss": (moe_aux_loss, frozenset({0})),
    "moe_aux_loss_backward": (moe_aux_loss_backward, frozenset()),
    "moe_router": (moe_router, frozenset()),
    "moe_router_backward": (moe_router_backward, frozenset()),
    "moe_permute": (moe_permute, frozenset()),
    "moe_permute_backward": (moe_permute_backward, frozenset()),
    "moe_unpermute": (moe_unpermute, frozenset()),
    "moe_unpermute_dy": (moe_unpermute_dy, frozenset()),
    "moe_unpermute_dw": (moe_unpermute_dw, frozenset()),
    "grouped_gemm": (grouped_gemm, frozenset()),
    "moe_grouped_gemm_gate_up": (_moe_gemm("moe_grouped_gemm_gate_up", True), frozenset()),
    "moe_grouped_gemm_down": (_moe_gemm("moe_grouped_gemm_down", True), frozenset()),
    "moe_grouped_gemm_dx": (_moe_gemm("moe_grouped_gemm_dx", False), frozenset()),
    "moe_grouped_gemm_dw": (moe_grouped_gemm_dw, frozenset()),
    "grad_norm": (grad_norm, frozenset()),
    "adamw_update": (adamw_update, frozenset()),
    "sgd_update": (sgd_update, frozenset()),
}


# --- issue 17: the norms' recompute variants, the remaining pointwise ops, reductions and layout ----------


def rmsnorm_apply_saved(x: DeviceArray, rstd: DeviceArray, weight: DeviceArray, *,
                        out: Sequence[DeviceArray]) -> None:
    """The recompute variant of ``rmsnorm``: y from the saved rstd, the forward kernel's products in its
    order (a replay gives the forward's bits)."""
    _f32(x, rstd, weight, out[0])
    c = x.shape[-1]
    if x.size:
        x.device.launch("rmsnorm_apply_saved_f32", ew_grid(x.size), (THREADS,),
                        (x.ptr, rstd.ptr, weight.ptr, out[0].ptr, x.size, c))


def fused_residual_rmsnorm_apply_saved(residual: DeviceArray, x: DeviceArray, rstd: DeviceArray,
                                       weight: DeviceArray, *, out: Sequence[DeviceArray | None]) -> None:
    """The recompute variant of ``fused_residual_rmsnorm``: the residual sum again and y from the saved
    rstd, as the forward kernel computes them (bit for bit)."""
    _f32(residual, x, rstd, weight)
    c = x.shape[-1]
    with Scratch(x.device) as s:
        res, y = s.out(out[0], x.shape), s.out(out[1], x.shape)
        if x.size:
            x.device.launch("fused_residual_rmsnorm_apply_saved_f32", ew_grid(x.size), (THREADS,),
                            (residual.ptr, x.ptr, rstd.ptr, weight.ptr, res.ptr, y.ptr, x.size, c))


def _contiguous(shape: Sequence[int]) -> list[int]:
    """Element strides of a row-major array of ``shape``."""
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= d
    return out[::-1]


#: dims of the strided copy kernel (layout.cu); more, once contiguous ones are merged, is a KilnError
COPY_DIMS = 6
#: element size -> the layout kernels that copy its bits (layout.cu): strided copy, tiled transpose
COPY_KERNELS = {4: ("strided_copy_b32", "transpose_tiled_b32"),
                2: ("strided_copy_b16", "transpose_tiled_b16")}
#: the tiled transpose's tile (TILE x TILE elements) and its block (TILE x TILE_ROWS threads), as in layout.cu
TILE, TILE_ROWS = 32, 8
#: the largest y and z of a grid (the tiled transpose's blocks loop over more)
GRID_YZ = 65535


def _merged(shape: Sequence[int], src_strides: Sequence[int],
            dst_strides: Sequence[int]) -> list[tuple[int, int, int]]:
    """(size, source stride, destination stride) of each dim, the dims of size 1 dropped and each dim merged
    into the one before where both sides continue it."""
    dims: list[tuple[int, int, int]] = []
    for d, s_, t in zip(shape, src_strides, dst_strides, strict=True):
        if d == 1:
            continue
        if dims and dims[-1][1] == d * s_ and dims[-1][2] == d * t:
            dims[-1] = (dims[-1][0] * d, s_, t)
        else:
            dims.append((d, s_, t))
    return dims


def strided_copy(src: DeviceArray, dst: DeviceArray, shape: Sequence[int], src_strides: Sequence[int],
                 dst_strides: Sequence[int], src_off: int = 0, dst_off: int = 0) -> None:
    """``dst[dst_off + sum k_i t_i] = src[src_off + sum k_i s_i]`` for every index ``k`` of ``shape``
    (strides and offsets in elements), the bits of 32-bit or 16-bit elements copied: the dims of size 1
    dropped and dims contiguous on both sides merged, then one launch of ``strided_copy_b32`` (``_b16``), or
    of the tiled transpose (``transpose_tiled_b32``, ``_b16``) when the copy is at most one batch dim around a
    swap of the last two (the output's last dim contiguous there, running across the source's rows)."""
    size = itemsize(src.dtype)
    if size != itemsize(dst.dtype) or size not in COPY_KERNELS:
        raise KilnError(f"kiln.cuda's layout kernels copy 32-bit elements (float32, int32) or 16-bit ones "
                        f"(bfloat16), the same size on both sides; found a {src.dtype} tensor {src.shape} "
                        f"copied to a {dst.dtype} tensor {dst.shape}")
    n = math.prod(shape)
    if not n:
        return
    copy_kernel, tiled = COPY_KERNELS[size]
    dims = _merged(shape, src_strides, dst_strides)
    src_ptr, dst_ptr = src.ptr + size * src_off, dst.ptr + size * dst_off
    if 2 <= len(dims) <= 3 and dims[-2][1] == 1 and dims[-1][2] == 1:
        (batch, sz, tz), (c, _, ld), (r, ls, _) = [(1, 0, 0)] * (3 - len(dims)) + dims
        grid = (cdiv(c, TILE), min(cdiv(r, TILE), GRID_YZ), min(batch, GRID_YZ))
        src.device.launch(tiled, grid, (TILE, TILE_ROWS), (src_ptr, dst_ptr, batch, r, c, ls, ld, sz, tz))
        return
    if len(dims) > COPY_DIMS:
        raise KilnError(f"a layout op on cuda: {tuple(shape)} needs {len(dims)} dims after merging, the copy "
                        f"kernel takes {COPY_DIMS}")
    dims = [(1, 0, 0)] * (COPY_DIMS - len(dims)) + dims
    sizes, ss, ts = zip(*dims, strict=True)
    src.device.launch(copy_kernel, ew_grid(n), (THREADS,), (src_ptr, dst_ptr, n, *sizes[1:], *ss, *ts))


def _like(s: Scratch, x: DeviceArray, o: DeviceArray) -> DeviceArray:
    """``x`` in ``o``'s float dtype where the two differ (float32 and bfloat16 under the bf16 recipe: a cast
    into scratch, rounding to nearest even towards bf16, exact the other way), else ``x`` itself."""
    if x.dtype != o.dtype and {x.dtype, o.dtype} <= {"float32", "bfloat16"}:
        y = as_dtype(s, x, o.dtype)
        assert y is not None
        return y
    return x


def _permute_into(x: DeviceArray, o: DeviceArray, perm: Sequence[int], op: str) -> None:
    """``o`` = ``x`` with its axes reordered: axis k of ``o`` is axis ``perm[k]`` of ``x``."""
    shape = tuple(x.shape[p] for p in perm)
    if o.shape != shape:
        raise KilnError(f"op {op!r} on cuda: out {o.shape} is not x {x.shape} permuted by {tuple(perm)}")
    xs = _contiguous(x.shape)
    with Scratch(x.device) as s:
        strided_copy(_like(s, x, o), o, shape, [xs[p] for p in perm], _contiguous(shape))


def transpose(x: DeviceArray, *, out: Sequence[DeviceArray], dim0: int, dim1: int) -> None:
    rank = len(x.shape)
    perm = list(range(rank))
    a, b = dim0 % rank, dim1 % rank
    perm[a], perm[b] = perm[b], perm[a]
    _permute_into(x, out[0], perm, "transpose")


def permute(x: DeviceArray, *, out: Sequence[DeviceArray], dims: Sequence[int]) -> None:
    rank = len(x.shape)
    _permute_into(x, out[0], [d % rank for d in dims], "permute")


def concat(*xs: DeviceArray, out: Sequence[DeviceArray], dim: int = -1) -> None:
    """A strided copy of each input into its slice of ``out`` along ``dim``."""
    o = out[0]
    axis, strides, at = dim % len(o.shape), _contiguous(o.shape), 0
    for x in xs:
        with Scratch(o.device) as s:
            strided_copy(_like(s, x, o), o, x.shape, _contiguous(x.shape), strides, 0, at * strides[axis])
        at += x.shape[axis]
    if at != o.shape[axis]:
        raise KilnError(f"op 'concat' on cuda: inputs of {at} along dim {dim} for out {o.shape}")


def split(x: DeviceArray, *, out: Sequence[DeviceArray | None], sizes: Sequence[int], dim: int = -1) -> None:
    """A strided copy of each slice of ``x`` along ``dim`` into its part (parts nothing reads are skipped)."""
    axis, strides = dim % len(x.shape), _contiguous(x.shape)
    if sum(sizes) != x.shape[axis] or len(sizes) != len(out):
        raise KilnError(f"op 'split' on cuda: sizes {list(sizes)} do not split dim {dim} of {x.shape} into "
                        f"{len(out)} parts")
    at, src = 0, {x.dtype: x}  # x in each of the parts' dtypes, cast once
    with Scratch(x.device) as s:
        for part, size in zip(out, sizes, strict=True):
            if part is not None:
                if part.dtype not in src:
                    src[part.dtype] = _like(s, x, part)
                strided_copy(src[part.dtype], part, part.shape, strides, _contiguous(part.shape),
                             at * strides[axis])
            at += size


def _expanded_strides(x: tuple[int, ...], shape: tuple[int, ...], new: Sequence[int], op: str) -> list[int]:
    """Element strides that read ``x`` broadcast to ``shape``: 0 along ``new`` axes (those ``x`` lacks) and
    along ``x``'s dims of size 1."""
    kept = [i for i in range(len(shape)) if i not in new]
    if len(kept) != len(x) or any(d not in (1, shape[i]) for d, i in zip(x, kept, strict=True)):
        raise KilnError(f"op {op!r} on cuda: {x} does not broadcast to {shape}"
                        + (f" with new axes {list(new)}" if new else ""))
    xs, strides = _contiguous(x), [0] * len(shape)
    for j, i in enumerate(kept):
        strides[i] = xs[j] if x[j] != 1 else 0
    return strides


def broadcast_to(x: DeviceArray, *, out: Sequence[DeviceArray], shape: Any = None,
                 axes: Sequence[int] = ()) -> None:
    """One strided copy reading ``x`` with stride 0 along the broadcast axes."""
    o = out[0]
    rank = len(o.shape)
    new = sorted(a % rank for a in axes) if axes else list(range(rank - len(x.shape)))
    with Scratch(o.device) as s:
        strided_copy(_like(s, x, o), o, o.shape, _expanded_strides(x.shape, o.shape, new, "broadcast_to"),
                     _contiguous(o.shape))


def _trailing_size(a: tuple[int, ...], b: tuple[int, ...]) -> int | None:
    """b's element count where b has a's shape or a's trailing shape (leading 1s allowed), else None."""
    bs = list(b)
    while bs and bs[0] == 1:
        bs.pop(0)
    return max(math.prod(bs), 1) if tuple(bs) == a[len(a) - len(bs):] else None


def div(a: DeviceArray, b: DeviceArray, *, out: Sequence[DeviceArray]) -> None:
    """``div_f32``: b of a's shape or its trailing shape; other broadcasts (either way) copy the operands
    broadcast to out's shape into the workspace first (:func:`broadcast_to`)."""
    _f32(a, b, out[0])
    o = out[0]
    with Scratch(a.device) as s:
        if a.shape != o.shape:
            a_full = s.array(o.shape)
            broadcast_to(a, out=(a_full,))
            a = a_full
        nb = _trailing_size(a.shape, b.shape)
        if nb is None:
            b_full = s.array(o.shape)
            broadcast_to(b, out=(b_full,))
            b, nb = b_full, o.size
        if o.size:
            a.device.launch("div_f32", ew_grid(o.size), (THREADS,), (a.ptr, b.ptr, o.ptr, o.size, nb))


def geglu(gate: DeviceArray, up: DeviceArray, *, out: Sequence[DeviceArray],
          approximate: str = "none") -> None:
    _f32(gate, up)
    if gate.size:
        gate.device.launch("geglu_f32", ew_grid(gate.size), (THREADS,),
                           (gate.ptr, up.ptr, out[0].ptr, gate.size, _is_tanh(approximate)))


def add3(a: DeviceArray, b: DeviceArray, c: DeviceArray, *, out: Sequence[DeviceArray]) -> None:
    _f32(a, b, c, out[0])
    if a.size:
        a.device.launch("add3_f32", ew_grid(a.size), (THREADS,), (a.ptr, b.ptr, c.ptr, out[0].ptr, a.size))


def matmul_bias(x: DeviceArray, w: DeviceArray, bias: DeviceArray, *, out: Sequence[DeviceArray],
                transpose: str = "NT") -> None:
    """The ``matmul`` path (cuBLASLt or the SIMT kernel; bf16 ``x`` and ``w`` under the bf16 recipe), then the
    bias added over the last dim in place (``add_f32``)."""
    o = out[0]
    _f32(bias, o)
    matmul(x, w, out=(o,), transpose=transpose)
    if o.size:
        o.device.launch("add_f32", ew_grid(o.size), (THREADS,),
                        (o.ptr, bias.ptr, o.ptr, o.size, max(bias.size, 1)))


def qk_norm(q: DeviceArray, k: DeviceArray, q_weight: DeviceArray, k_weight: DeviceArray, *,
            out: Sequence[DeviceArray | None], eps: float) -> None:
    """Two launches of the rmsnorm row kernel: q with its weight, k with its own."""
    rmsnorm(q, q_weight, out=(out[0], out[2]), eps=eps)
    rmsnorm(k, k_weight, out=(out[1], out[3]), eps=eps)


#: reduce.cu's op codes
_REDUCE_OPS = {"reduce_sum": 0, "reduce_mean": 1, "reduce_max": 2}
#: reduced lengths from which a contiguous row gets a block of its own; shorter rows, and columns, a thread
ROW_REDUCE = 128
#: columns at least this long, with fewer outputs than COL_SPLIT_OUTPUTS (too few threads to fill a GPU: an
#: H100 holds 270,000), are split over the rows of threads of a block (``reduce_cols_split_f32``, COL_THREADS
#: threads a block as in reduce.cu); the thresholds are estimates, untimed
COL_SPLIT_R = 256
COL_SPLIT_OUTPUTS = 1 << 18
COL_THREADS = 256


def _reduced(shape: tuple[int, ...], axes: Sequence[int], op: str) -> tuple[list[int], list[int], bool]:
    """(kept axes, reduced axes, whether the reduced axes are adjacent)."""
    rank = len(shape)
    red = sorted({a % rank for a in axes})
    if not red:
        raise KilnError(f"op {op!r}: axes must name at least one axis of {shape}")
    return [i for i in range(rank) if i not in red], red, red[-1] - red[0] == len(red) - 1


def _reduce_launch(x: DeviceArray, o: DeviceArray, outer: int, r: int, inner: int, code: int,
                   op: str) -> None:
    if not outer * inner:
        return
    if not r:
        if code:
            raise KilnError(f"op {op!r} on cuda: a reduction over an empty axis has no {op[7:]}")
        o.device.memset(o.ptr, 0, o.nbytes)
    elif inner == 1 and r >= ROW_REDUCE:
        x.device.launch("reduce_rows_f32", (outer,), row_block(r), (x.ptr, o.ptr, r, code))
    elif r >= COL_SPLIT_R and outer * inner < COL_SPLIT_OUTPUTS:
        cols = min(32, 1 << (inner - 1).bit_length())  # adjacent columns a block (a power of two)
        x.device.launch("reduce_cols_split_f32", (cdiv(inner, cols), min(outer, GRID_YZ)),
                        (cols, COL_THREADS // cols), (x.ptr, o.ptr, outer, r, inner, code))
    else:
        x.device.launch("reduce_cols_f32", (cdiv(outer * inner, THREADS),), (THREADS,),
                        (x.ptr, o.ptr, outer, r, inner, code))


def _reduce(op: str) -> Callable[..., None]:
    """``reduce_sum`` / ``reduce_mean`` / ``reduce_max``: x as [outer, R, inner] around adjacent reduced
    axes (a block per row when inner is 1 and R at least ``ROW_REDUCE``; long columns of few outputs split
    over a block's rows of threads, ``COL_SPLIT_R``; else a thread per output), other axis sets gathered to
    the end first."""
    code = _REDUCE_OPS[op]

    def fn(x: DeviceArray, *, out: Sequence[DeviceArray], axes: Sequence[int],
           keepdims: bool = False) -> None:
        _f32(x, out[0])
        kept, red, adjacent = _reduced(x.shape, axes, op)
        r = math.prod(x.shape[i] for i in red)
        with Scratch(x.device) as s:
            if adjacent:
                outer, inner = math.prod(x.shape[:red[0]]), math.prod(x.shape[red[-1] + 1:])
            else:
                moved = s.array(tuple(x.shape[i] for i in kept + red))
                _permute_into(x, moved, kept + red, op)
                x, outer, inner = moved, math.prod(x.shape[i] for i in kept), 1
            _reduce_launch(x, out[0], outer, r, inner, code, op)

    return fn


def reduce_mean_backward(d: DeviceArray, *, out: Sequence[DeviceArray], shape: Any = None,
                         axes: Sequence[int] = (), keepdims: bool = False) -> None:
    """d broadcast back over the reduced axes (:func:`strided_copy`), then divided by count in place (as
    the reference divides, not times 1 / count, which can be an ulp off: the reference's bits)."""
    _f32(d, out[0])
    o = out[0]
    rank = len(o.shape)
    red = sorted({a % rank for a in axes})
    count = math.prod(o.shape[i] for i in red)
    src = tuple(n for i, n in enumerate(o.shape) if i not in red)  # d's elements, with or without keepdims
    if d.size != math.prod(src):
        raise KilnError(f"op 'reduce_mean_backward' on cuda: d_out {d.shape} is not d_x {o.shape} reduced "
                        f"over axes {list(axes)}")
    strided_copy(d, o, o.shape, _expanded_strides(src, o.shape, red, "reduce_mean_backward"),
                 _contiguous(o.shape))
    if o.size:
        with Scratch(o.device) as s:
            c = s.array((1,))  # count as a float32 (exact below 2^24), broadcast by div_f32
            o.device.launch("fill_f32", ew_grid(1), (THREADS,), (c.ptr, float(count), 1))
            o.device.launch("div_f32", ew_grid(o.size), (THREADS,), (o.ptr, c.ptr, o.ptr, o.size, 1))


def reduce_max_backward(d: DeviceArray, x: DeviceArray, y: DeviceArray, *, out: Sequence[DeviceArray],
                        axes: Sequence[int], keepdims: bool = False) -> None:
    """A thread per reduced group counts its maxima (ties share d evenly) and writes its part of d_x; other
    axis sets than adjacent ones run on x with the reduced axes moved to the end, d_x moved back."""
    op = "reduce_max_backward"
    _f32(d, x, y, out[0])
    kept, red, adjacent = _reduced(x.shape, axes, op)
    r = math.prod(x.shape[i] for i in red)
    dev = x.device
    with Scratch(dev) as s:
        d_x = out[0]
        if adjacent:
            outer, inner = math.prod(x.shape[:red[0]]), math.prod(x.shape[red[-1] + 1:])
        else:
            perm = kept + red
            moved = s.array(tuple(x.shape[i] for i in perm))
            _permute_into(x, moved, perm, op)
            x, d_x, outer, inner = moved, s.array(moved.shape), math.prod(x.shape[i] for i in kept), 1
        if outer * inner * r:
            dev.launch("reduce_max_backward_f32", (cdiv(outer * inner, THREADS),), (THREADS,),
                       (d.ptr, x.ptr, y.ptr, d_x.ptr, outer, r, inner))
        if d_x is not out[0]:
            _permute_into(d_x, out[0], [int(i) for i in np.argsort(perm)], op)


#: core ops that have no kernel of their own on ``cuda``, and what runs instead: the planner makes an alias
#: op's output a view of its input's storage in the arena (``Step.how == "alias"``: nothing runs), or a
#: device copy where the output has a slot of its own (a gradient: ``how == "copy"``)
COMPOSITIONS: dict[str, str] = {
    "reshape": "an alias of its input in the arena (a device copy into a slot of its own)",
    "view": "an alias of its input in the arena (a device copy into a slot of its own)",
    "contiguous": "an alias of its input in the arena (a device copy into a slot of its own)",
}

KERNELS.update({
    "rmsnorm_apply_saved": (rmsnorm_apply_saved, frozenset({0})),
    "fused_residual_rmsnorm_apply_saved": (fused_residual_rmsnorm_apply_saved, frozenset({0, 1})),
    "div": (div, frozenset({0})),
    "exp": (_unary("exp_f32"), frozenset({0})),
    "reciprocal": (_unary("reciprocal_f32"), frozenset({0})),
    "sigmoid": (_unary("sigmoid_f32"), frozenset({0})),
    "sigmoid_backward": (_unary_backward("sigmoid_backward_f32"), frozenset()),
    "relu2": (_unary("relu2_f32"), frozenset()),
    "relu2_backward": (_unary_backward("relu2_backward_f32"), frozenset()),
    "geglu": (geglu, frozenset()),
    "add3": (add3, frozenset()),
    "matmul_bias": (matmul_bias, frozenset()),
    "qk_norm": (qk_norm, frozenset()),
    "reduce_sum": (_reduce("reduce_sum"), frozenset()),
    "reduce_mean": (_reduce("reduce_mean"), frozenset()),
    "reduce_max": (_reduce("reduce_max"), frozenset()),
    "reduce_mean_backward": (reduce_mean_backward, frozenset()),
    "reduce_max_backward": (reduce_max_backward, frozenset()),
    "transpose": (transpose, frozenset()),
    "permute": (permute, frozenset()),
    "concat": (concat, frozenset()),
    "split": (split, frozenset()),
    "broadcast_to": (broadcast_to, frozenset()),
})
#: matmul_bias takes bf16 x and w under the bf16 recipe, as matmul does (cuBLASLt's bf16 GEMM on a GPU)
BF16_OPERANDS = BF16_OPERANDS | {"matmul_bias"}
#: the layout copies read and write bf16 slots as they are under the bf16 recipe (16-bit copies, no widened
#: float32 copies; a float32 slot on one side and bf16 on the other: a cast of the input first)
BF16_READS.update({fn: fn for fn in (transpose, permute, concat, split, broadcast_to)})
#: add and mul read and write bf16 slots as they lie under the bf16 recipe (kernels of mixed element types)
BF16_READS.update({KERNELS[op][0]: _binary_bf16(op, base)
                   for op, base in (("add", "add"), ("bias_add", "add"), ("mul", "mul"))})
BF16_READS.update({KERNELS["gelu"][0]: _gelu_bf16(False), KERNELS["gelu_backward"][0]: _gelu_bf16(True)})
