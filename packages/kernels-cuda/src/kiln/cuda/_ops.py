"""The CUDA kernels of kiln's ops: for each op, the launch of its kernel(s) with the geometry beside it.

Each function follows the kernel table's ``out=`` convention (``fn(*inputs, out=(...), **attrs)``) on
:class:`DeviceArray` views of the arena; optimizer updates take the run-time ``step``, ``lr``, ``scale``.
The math of each kernel is the op's NumPy reference (named in each ``.cu`` file); the tests run every
launch here through the CPU emulator against that reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from kiln.core import KilnError

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

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize


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


class _Scratch:
    """Device memory standing in for outputs nothing reads (None in ``out``), freed on exit."""

    def __init__(self, device: Any) -> None:
        self.device, self.ptrs = device, []

    def __enter__(self) -> _Scratch:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.ptrs:
            self.device.free(p)

    def array(self, shape: Sequence[int], dtype: str = "float32") -> DeviceArray:
        shape = tuple(shape)
        p = self.device.alloc(math.prod(shape) * np.dtype(dtype).itemsize)
        self.ptrs.append(p)
        return DeviceArray(self.device, p, shape, dtype)

    def out(self, o: DeviceArray | None, shape: Sequence[int]) -> DeviceArray:
        return self.array(shape) if o is None else o


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
    with _Scratch(x.device) as s:
        y, rstd = s.out(out[0], x.shape), s.out(out[1], x.shape[:-1])
        if rows:
            x.device.launch("rmsnorm_f32", (rows,), row_block(c),
                            (x.ptr, weight.ptr, y.ptr, rstd.ptr, c, eps))


def fused_residual_rmsnorm(residual: DeviceArray, x: DeviceArray, weight: DeviceArray, *,
                           out: Sequence[DeviceArray | None], eps: float) -> None:
    _f32(residual, x, weight)
    c = x.shape[-1]
    rows = x.size // c
    with _Scratch(x.device) as s:
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
    with _Scratch(x.device) as s:
        _rms_grads(d_y, x, rstd, weight, d_rstd, None, s.out(out[0], x.shape), out[1])


def fused_residual_rmsnorm_backward(d_y: DeviceArray | None, d_residual_out: DeviceArray | None,
                                    residual_out: DeviceArray, rstd: DeviceArray, weight: DeviceArray,
                                    d_rstd: DeviceArray | None = None, *,
                                    out: Sequence[DeviceArray | None]) -> None:
    d_residual, d_x, d_w = out
    with _Scratch(residual_out.device) as s:
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
    with _Scratch(logits.device) as s:
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


def rope(x: DeviceArray, freqs: DeviceArray | None, position_ids: DeviceArray, *, out: Sequence[DeviceArray],
         head_dim: int, rotary_dim: int | None = None, theta: float = 10000.0, inverse: bool = False) -> None:
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
                     int(len(position_ids.shape) == 2), theta, int(inverse)))


# --- matmul ---------------------------------------------------------------------------------------


def matmul(a: DeviceArray, b: DeviceArray, c: DeviceArray | None = None, *, out: Sequence[DeviceArray],
           transpose: str = "NN", accumulate: bool = False, alpha: float = 1.0, beta: float = 1.0) -> None:
    """out = alpha op(a) op(b) (+ c, or beta c): the tiled SIMT kernel, batched over leading dims."""
    _f32(a, b, c)
    ta, tb = transpose[0] == "T", transpose[1] == "T"
    m, k = (a.shape[-1], a.shape[-2]) if ta else (a.shape[-2], a.shape[-1])
    n = b.shape[-2] if tb else b.shape[-1]
    batch = math.prod(a.shape[:-2])
    if not (m and n and batch):
        return
    eff_beta = 1.0 if (beta == 1.0 or accumulate) else beta
    grid = (cdiv(n, MATMUL_TILE), cdiv(m, MATMUL_TILE), batch)
    a.device.launch("matmul_f32", grid, (MATMUL_TILE, MATMUL_TILE),
                    (a.ptr, b.ptr, _ptr(c), out[0].ptr, m, n, k, int(ta), int(tb), m * k, k * n, m * n, alpha,
                     eff_beta))


# --- the LM head's loss: a composition ------------------------------------------------------------

#: bound on the logits ([rows, vocabulary]) the LM-head loss composition holds at once (16 MiB)
LOGITS_TILE = 1 << 22


def _rows_of(a: DeviceArray, r0: int, r1: int) -> DeviceArray:
    row = math.prod(a.shape[1:]) * np.dtype(a.dtype).itemsize
    return DeviceArray(a.device, a.ptr + r0 * row, (r1 - r0, *a.shape[1:]), a.dtype)


def _head_tiles(n: int, v: int) -> list[tuple[int, int]]:
    rows = max(1, min(n, LOGITS_TILE // max(v, 1)))
    return [(r0, min(r0 + rows, n)) for r0 in range(0, n, rows)]


def _logits(x: DeviceArray, weight: DeviceArray, z: DeviceArray, softcap: float | None) -> None:
    matmul(x, weight, out=(z,), transpose="NT")
    if softcap is not None:
        z.device.launch("softcap_f32", ew_grid(z.size), (THREADS,), (z.ptr, z.size, softcap))


def fused_lm_head_loss(x: DeviceArray, weight: DeviceArray, targets: DeviceArray, *,
                       out: Sequence[DeviceArray | None], ignore_index: int, chunk_size: int = 0,
                       softcap: float | None = None) -> None:
    """Per tile of rows: logits = x w^T (matmul kernel, softcapped), then the cross-entropy kernel. The
    logits of one tile live at a time (``chunk_size``, the NumPy kernel's vocabulary chunk, is not
    needed: the cross-entropy kernel reduces whole rows)."""
    _f32(x, weight)
    n, v = x.shape[0], weight.shape[0]
    with _Scratch(x.device) as s:
        loss, lse = s.out(out[0], (n,)), s.out(out[1], (n,))
        for r0, r1 in _head_tiles(n, v):
            z = s.array((r1 - r0, v))
            _logits(_rows_of(x, r0, r1), weight, z, softcap)
            cross_entropy(z, _rows_of(targets, r0, r1), out=(_rows_of(loss, r0, r1), _rows_of(lse, r0, r1)),
                          ignore_index=ignore_index)


def fused_lm_head_loss_backward(d_loss: DeviceArray | None, x: DeviceArray, weight: DeviceArray,
                                targets: DeviceArray, lse: DeviceArray, d_lse: DeviceArray | None = None, *,
                                out: Sequence[DeviceArray | None], ignore_index: int, chunk_size: int = 0,
                                softcap: float | None = None) -> None:
    """Per tile of rows: the logits again, their gradient g (cross-entropy backward kernel, times the
    softcap's derivative), d_x = g w and d_weight += g^T x (matmul kernels; tiles in order)."""
    _f32(d_loss, x, weight, lse, d_lse)
    n, v = x.shape[0], weight.shape[0]
    d_x, d_w = out
    with _Scratch(x.device) as s:
        for i, (r0, r1) in enumerate(_head_tiles(n, v)):
            xr = _rows_of(x, r0, r1)
            z, g = s.array((r1 - r0, v)), s.array((r1 - r0, v))
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


# --- attention ------------------------------------------------------------------------------------

#: head dims a lane of the attention kernels holds (PER_LANE in attention.cu): D <= 32 * ATTN_PER_LANE
ATTN_PER_LANE = 8


def _heads(qkv: DeviceArray, hq: int, hkv: int, d: int, op: str) -> tuple[int, int]:
    b, t, f = qkv.shape
    if f != (hq + 2 * hkv) * d or hkv <= 0 or hq % hkv:
        raise KilnError(f"op {op!r} on cuda: packed qkv [{b}, {t}, {f}] does not hold Hq = {hq} and "
                        f"Hkv = {hkv} heads of D = {d} (Hq a multiple of Hkv)")
    if d > 32 * ATTN_PER_LANE:
        raise KilnError(f"op {op!r} on cuda: head dim {d} > {32 * ATTN_PER_LANE}, the SIMT kernel's limit")
    return b, t


def _window(window_size: int | None, op: str) -> int:
    if window_size is not None and window_size < 1:
        raise KilnError(f"op {op!r}: window_size must be >= 1, found {window_size}")
    return window_size or 0


def _segments(segment_ids: DeviceArray | None) -> int:
    if segment_ids is not None:
        _i32(segment_ids, "segment ids")
    return _ptr(segment_ids)


def flash_attention(qkv: DeviceArray, segment_ids: DeviceArray | None = None, *,
                    out: Sequence[DeviceArray | None], Hq: int, Hkv: int, D: int, causal: bool = True,
                    softmax_scale: float | None = None, window_size: int | None = None) -> None:
    _f32(qkv)
    b, t = _heads(qkv, Hq, Hkv, D, "flash_attention")
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    with _Scratch(qkv.device) as s:
        o, lse = s.out(out[0], (b, t, Hq * D)), s.out(out[1], (b, Hq, t))
        if b and t:
            qkv.device.launch("flash_attention_f32", (t, Hq, b), (32,),
                              (qkv.ptr, _segments(segment_ids), o.ptr, lse.ptr, t, Hq, Hkv, D, int(causal),
                               _window(window_size, "flash_attention"), scale))


def flash_attention_backward(d_out: DeviceArray | None, qkv: DeviceArray, o: DeviceArray, lse: DeviceArray,
                             d_lse: DeviceArray | None = None, segment_ids: DeviceArray | None = None, *,
                             out: Sequence[DeviceArray | None], Hq: int, Hkv: int, D: int,
                             causal: bool = True, softmax_scale: float | None = None,
                             window_size: int | None = None) -> None:
    """The query kernel (dq, and each row's shift), then the key kernel (dk, dv)."""
    _f32(d_out, qkv, o, lse, d_lse)
    op = "flash_attention_backward"
    b, t = _heads(qkv, Hq, Hkv, D, op)
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    geometry = (t, Hq, Hkv, D, int(causal), _window(window_size, op), scale)
    with _Scratch(qkv.device) as s:
        d_qkv, shift = s.out(out[0], qkv.shape), s.array((b, Hq, t))
        if b and t:
            seg = _segments(segment_ids)
            qkv.device.launch("flash_attention_backward_dq_f32", (t, Hq, b), (32,),
                              (_ptr(d_out), qkv.ptr, o.ptr, lse.ptr, _ptr(d_lse), seg, d_qkv.ptr, shift.ptr,
                               *geometry))
            qkv.device.launch("flash_attention_backward_dkv_f32", (t, Hkv, b), (32,),
                              (_ptr(d_out), qkv.ptr, lse.ptr, shift.ptr, seg, d_qkv.ptr, *geometry))


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
                     rotary_dim: int | None) -> None:
    op = "qkv_qk_norm_rope"
    _f32(qkv, q_norm_weight, k_norm_weight, freqs)
    b, t = _heads(qkv, Hq, Hkv, D, op)
    rd, batched = _rope_geometry(qkv, position_ids, D, rotary_dim, op)
    with _Scratch(qkv.device) as s:
        o, q_rstd, k_rstd = s.out(out[0], qkv.shape), s.out(out[1], (b, t, Hq)), s.out(out[2], (b, t, Hkv))
        if b and t:
            qkv.device.launch("qkv_norm_rope_f32", (Hq + 2 * Hkv, t, b), (32,),
                              (qkv.ptr, _ptr(q_norm_weight), _ptr(k_norm_weight), _ptr(freqs),
                               position_ids.ptr, o.ptr, q_rstd.ptr, k_rstd.ptr, t, Hq, Hkv, D, rd, batched,
                               eps, theta))


def qkv_qk_norm_rope_backward(d_qkv_out: DeviceArray | None, qkv: DeviceArray,
                              q_norm_weight: DeviceArray | None, k_norm_weight: DeviceArray | None,
                              freqs: DeviceArray | None,
                              position_ids: DeviceArray, q_rstd: DeviceArray, k_rstd: DeviceArray,
                              d_q_rstd: DeviceArray | None = None, d_k_rstd: DeviceArray | None = None, *,
                              out: Sequence[DeviceArray | None], Hq: int, Hkv: int, D: int, eps: float,
                              theta: float, rotary_dim: int | None) -> None:
    """The norm weights' gradients (column kernel), then d_qkv (row kernel)."""
    op = "qkv_qk_norm_rope_backward"
    _f32(d_qkv_out, qkv, q_norm_weight, k_norm_weight, freqs, q_rstd, k_rstd, d_q_rstd, d_k_rstd)
    b, t = _heads(qkv, Hq, Hkv, D, op)
    rd, batched = _rope_geometry(qkv, position_ids, D, rotary_dim, op)
    weights = (_ptr(d_qkv_out), qkv.ptr, _ptr(q_norm_weight), _ptr(k_norm_weight), _ptr(freqs),
               position_ids.ptr, q_rstd.ptr, k_rstd.ptr)
    d_qkv, d_qw, d_kw = out
    with _Scratch(qkv.device) as s:
        d_qkv = s.out(d_qkv, qkv.shape)
        if d_qw is not None or d_kw is not None:
            qkv.device.launch("qkv_norm_rope_backward_dw_f32", (cdiv(D, 32), 2), (32,),
                              (*weights, _ptr(d_qw), _ptr(d_kw), b, t, Hq, Hkv, D, rd, batched, theta))
        if b and t:
            qkv.device.launch("qkv_norm_rope_backward_dx_f32", (Hq + 2 * Hkv, t, b), (32,),
                              (*weights, _ptr(d_q_rstd), _ptr(d_k_rstd), d_qkv.ptr, t, Hq, Hkv, D, rd,
                               batched, theta))


# --- optimizer ------------------------------------------------------------------------------------


def grad_norm(*grads: DeviceArray) -> float:
    """The global L2 norm: fixed-grid partial sums per gradient, then one block sums them in order."""
    _f32(*grads)
    if not grads:
        return 0.0
    dev = grads[0].device
    with _Scratch(dev) as s:
        partial = s.array((len(grads) * NORM_BLOCKS + 1,))
        dev.memset(partial.ptr, 0, partial.nbytes)
        for i, g in enumerate(grads):
            blocks = max(1, min(NORM_BLOCKS, cdiv(g.size, THREADS)))  # the rest of its partials stay 0
            dev.launch("sumsq_partial_f32", (blocks,), (THREADS,),
                       (g.ptr, g.size, partial.ptr + 4 * i * NORM_BLOCKS))
        total = partial.ptr + 4 * len(grads) * NORM_BLOCKS
        dev.launch("sqrt_sum_f32", (1,), (THREADS,), (partial.ptr, len(grads) * NORM_BLOCKS, total))
        dev.synchronize()
        return float(dev.copy_to_host(total, 4).view(np.float32)[0])


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
    "fused_residual_rmsnorm": (fused_residual_rmsnorm, frozenset({0, 1})),
    "fused_residual_rmsnorm_backward": (fused_residual_rmsnorm_backward, frozenset()),
    "cross_entropy": (cross_entropy, frozenset()),
    "cross_entropy_backward": (cross_entropy_backward, frozenset()),
    "embedding": (embedding, frozenset()),
    "embedding_backward": (embedding_backward, frozenset()),
    "rope": (rope, frozenset()),
    "matmul": (matmul, frozenset()),
    "fused_lm_head_loss": (fused_lm_head_loss, frozenset()),
    "fused_lm_head_loss_backward": (fused_lm_head_loss_backward, frozenset()),
    "flash_attention": (flash_attention, frozenset()),
    "flash_attention_backward": (flash_attention_backward, frozenset()),
    "qkv_qk_norm_rope": (qkv_qk_norm_rope, frozenset()),
    "qkv_qk_norm_rope_backward": (qkv_qk_norm_rope_backward, frozenset()),
    "batched_matmul": (matmul, frozenset()),
    "grad_norm": (grad_norm, frozenset()),
    "adamw_update": (adamw_update, frozenset()),
    "sgd_update": (sgd_update, frozenset()),
}
