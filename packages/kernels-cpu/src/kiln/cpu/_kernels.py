"""The kernels as the kernel table calls them: NumPy arrays in, the C functions of ``kernels.c`` on
their memory. Each has its NumPy reference kernel's signature and runs it instead for what the C
code does not take: anything but float32, arrays that are not C-contiguous, empty arrays."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

# kiln's thread policy (KILN_NUM_THREADS, else the cores); the reference's own cos/sin tables and its
# checks of rotary_dim and of position ids against freqs
from kiln.core.backends.numpy import chunks, matmul_into, parallel, threads
from kiln.core.backends.numpy import scratch as kiln_scratch
from kiln.core.ops import FUSED_LOGITS_TILE, check_rotary_dim, loss_targets, rope_tables

if TYPE_CHECKING:
    from _cffi_backend import FFI

Arrays = Sequence[np.ndarray | None]
F32 = np.dtype(np.float32)
#: bound on the logits ([rows, vocabulary chunk]) of one tile of the LM head's separate forward and
#: backward (kiln-core's own bound for them)
LOGITS_TILE = 1 << 21


def _fits(*arrays: np.ndarray | None) -> bool:
    return all(a is None or (a.dtype == F32 and a.flags.c_contiguous and a.size > 0) for a in arrays)


def kernels(lib: Any, ffi: FFI, ref: Mapping[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """The native kernel of each op, by op name; ``ref[op]`` is the kernel it falls back to. ``lib`` is
    the compiled module's ``lib``: its functions (``CDEF``) exist only once cffi has built it."""
    null = ffi.NULL

    def p(a: np.ndarray | None) -> FFI.CData:
        return null if a is None else ffi.cast("float *", a.ctypes.data)

    def scratch(o: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
        return np.empty(shape, F32) if o is None else o

    def rmsnorm(x: np.ndarray, weight: np.ndarray, *, out: Arrays, eps: float) -> None:
        if not _fits(x, weight, *out):
            ref["rmsnorm"](x, weight, out=out, eps=eps)
            return
        y, rstd = scratch(out[0], x.shape), scratch(out[1], x.shape[:-1])
        c = x.shape[-1]
        lib.kiln_rmsnorm_fwd(null, p(x), p(weight), null, null, p(y), p(rstd), x.size // c, c, eps, threads())

    def fused(residual: np.ndarray, x: np.ndarray, weight: np.ndarray, *, out: Arrays, eps: float) -> None:
        if not _fits(residual, x, weight, *out):
            ref["fused_residual_rmsnorm"](residual, x, weight, out=out, eps=eps)
            return
        res, y, rstd = scratch(out[0], x.shape), scratch(out[1], x.shape), scratch(out[2], x.shape[:-1])
        c = x.shape[-1]
        lib.kiln_rmsnorm_fwd(p(residual), p(x), p(weight), null, p(res), p(y), p(rstd), x.size // c, c, eps,
                             threads())

    def apply_saved(x: np.ndarray, rstd: np.ndarray, weight: np.ndarray, *, out: Arrays) -> None:
        if not _fits(x, rstd, weight, *out):
            ref["rmsnorm_apply_saved"](x, rstd, weight, out=out)
            return
        c = x.shape[-1]
        lib.kiln_rmsnorm_fwd(null, p(x), p(weight), p(rstd), null, p(out[0]), null, x.size // c, c, 0.0,
                             threads())

    def fused_apply_saved(residual: np.ndarray, x: np.ndarray, rstd: np.ndarray, weight: np.ndarray, *,
                          out: Arrays) -> None:
        if not _fits(residual, x, rstd, weight, *out):
            ref["fused_residual_rmsnorm_apply_saved"](residual, x, rstd, weight, out=out)
            return
        res, y = scratch(out[0], x.shape), scratch(out[1], x.shape)
        c = x.shape[-1]
        lib.kiln_rmsnorm_fwd(p(residual), p(x), p(weight), p(rstd), p(res), p(y), null, x.size // c, c, 0.0,
                             threads())

    def rmsnorm_bwd(d_y: np.ndarray | None, x: np.ndarray, rstd: np.ndarray, weight: np.ndarray,
                    d_rstd: np.ndarray | None = None, *, out: Arrays) -> None:
        if not _fits(d_y, x, rstd, weight, d_rstd, *out):
            ref["rmsnorm_backward"](d_y, x, rstd, weight, d_rstd, out=out)
            return
        d_x = scratch(out[0], x.shape)
        c = x.shape[-1]
        lib.kiln_rmsnorm_bwd(p(d_y), p(x), p(rstd), p(weight), p(d_rstd), null, p(d_x), null, p(out[1]),
                             x.size // c, c, threads())

    def fused_bwd(d_y: np.ndarray | None, d_residual_out: np.ndarray | None, residual_out: np.ndarray,
                  rstd: np.ndarray, weight: np.ndarray, d_rstd: np.ndarray | None = None, *,
                  out: Arrays) -> None:
        x = residual_out
        if not _fits(d_y, d_residual_out, x, rstd, weight, d_rstd, *out):
            ref["fused_residual_rmsnorm_backward"](d_y, d_residual_out, x, rstd, weight, d_rstd, out=out)
            return
        d_res, d_x, d_w = out
        first = d_res if d_res is not None else scratch(d_x, x.shape)
        second = d_x if d_res is not None else None
        c = x.shape[-1]
        lib.kiln_rmsnorm_bwd(p(d_y), p(x), p(rstd), p(weight), p(d_rstd), p(d_residual_out), p(first),
                             p(second), p(d_w), x.size // c, c, threads())

    def swiglu(x: np.ndarray, *, out: Arrays) -> None:
        if not _fits(x, *out):
            ref["swiglu"](x, out=out)
            return
        m = x.shape[-1] // 2
        lib.kiln_swiglu_fwd(p(x), p(out[0]), x.size // (2 * m), m, threads())

    def swiglu_bwd(d: np.ndarray, x: np.ndarray, *, out: Arrays) -> None:
        if not _fits(d, x, *out):
            ref["swiglu_backward"](d, x, out=out)
            return
        m = x.shape[-1] // 2
        lib.kiln_swiglu_bwd(p(d), p(x), p(out[0]), x.size // (2 * m), m, threads())

    def silu(x: np.ndarray, *, out: Arrays) -> None:
        if not (_fits(x, *out) and out[0] is not None and out[0].size == x.size):
            ref["silu"](x, out=out)
            return
        lib.kiln_silu_fwd(p(x), p(out[0]), x.size, threads())

    def silu_bwd(d: np.ndarray, x: np.ndarray, *, out: Arrays) -> None:
        if not (_fits(d, x, *out) and out[0] is not None and d.size == x.size == out[0].size):
            ref["silu_backward"](d, x, out=out)
            return
        lib.kiln_silu_bwd(p(d), p(x), p(out[0]), x.size, threads())

    def silu_mul(gate: np.ndarray, up: np.ndarray, *, out: Arrays) -> None:
        if not _fits(gate, up, *out):
            ref["silu_mul"](gate, up, out=out)
            return
        lib.kiln_silu_mul_fwd(p(gate), p(up), p(out[0]), gate.size, threads())

    def silu_mul_bwd(d: np.ndarray, gate: np.ndarray, up: np.ndarray, *, out: Arrays) -> None:
        if not _fits(d, gate, up, *out):
            ref["silu_mul_backward"](d, gate, up, out=out)
            return
        d_gate, d_up = scratch(out[0], gate.shape), scratch(out[1], gate.shape)
        lib.kiln_silu_mul_bwd(p(d), p(gate), p(up), p(d_gate), p(d_up), gate.size, threads())

    def adamw(param: np.ndarray, grad: np.ndarray, m: np.ndarray, v: np.ndarray, work: np.ndarray, *,
              step: int, lr: float, scale: float, beta1: float, beta2: float, eps: float, weight_decay: float,
              lr_scale: float) -> None:
        if not _fits(param, grad, m, v):
            ref["adamw_update"](param, grad, m, v, work, step=step, lr=lr, scale=scale, beta1=beta1,
                                beta2=beta2, eps=eps, weight_decay=weight_decay, lr_scale=lr_scale)
            return
        lr = lr * lr_scale  # the reference's constants, each rounded to float32 where it meets an array
        bc1, bc2 = 1 - beta1**step, 1 - beta2**step
        lib.kiln_adamw(p(param), p(grad), p(m), p(v), param.size, scale * (1 - beta1), beta1,
                       (1 - beta2) * scale * scale, beta2, 1 / math.sqrt(bc2), eps, lr / bc1,
                       1 - lr * weight_decay, 1 if weight_decay else 0, threads())

    def rope(qkv: np.ndarray, freqs: np.ndarray | None, position_ids: np.ndarray, hq: int, hkv: int, d: int,
             theta: float, rotary_dim: int | None, op: str) -> tuple[np.ndarray, np.ndarray, int] | None:
        """The cos and sin tables as the C code takes them (``[T, h]`` or ``[B, T, h]``, float32,
        contiguous) and whether they are per sequence; None where the C code does not apply."""
        if not (qkv.ndim == 3 and hkv > 0 and hq % hkv == 0 and qkv.shape[2] == (hq + 2 * hkv) * d):
            return None
        cos, sin = rope_tables(freqs, position_ids, check_rotary_dim(rotary_dim, d, op), theta, qkv.dtype, op)
        per_batch = np.ndim(position_ids) != 1
        if cos.shape[:-1] != (qkv.shape[:2] if per_batch else qkv.shape[1:2]):
            return None
        return np.ascontiguousarray(cos, F32), np.ascontiguousarray(sin, F32), int(per_batch)

    def qkv_rope(qkv: np.ndarray, q_norm_weight: np.ndarray | None, k_norm_weight: np.ndarray | None,
                 freqs: np.ndarray | None, position_ids: np.ndarray, *, out: Arrays, Hq: int, Hkv: int,
                 D: int, eps: float, theta: float, rotary_dim: int | None, interleaved: bool = False) -> None:
        tables = rope(qkv, freqs, position_ids, Hq, Hkv, D, theta, rotary_dim, "qkv_qk_norm_rope") \
            if _fits(qkv, q_norm_weight, k_norm_weight, *out) else None
        if tables is None:
            ref["qkv_qk_norm_rope"](qkv, q_norm_weight, k_norm_weight, freqs, position_ids, out=out,
                                    Hq=Hq, Hkv=Hkv, D=D, eps=eps, theta=theta, rotary_dim=rotary_dim,
                                    interleaved=interleaved)
            return
        cos, sin, per_batch = tables
        b, t = qkv.shape[:2]
        o = scratch(out[0], qkv.shape)
        q_rstd, k_rstd = scratch(out[1], (b, t, Hq)), scratch(out[2], (b, t, Hkv))
        lib.kiln_qkv_norm_rope_fwd(p(qkv), p(q_norm_weight), p(k_norm_weight), p(cos), p(sin), per_batch,
                                   p(o), p(q_rstd), p(k_rstd), b, t, Hq, Hkv, D, cos.shape[-1],
                                   bool(interleaved), eps, threads())

    def qkv_rope_bwd(d_qkv_out: np.ndarray | None, qkv: np.ndarray, q_norm_weight: np.ndarray | None,
                     k_norm_weight: np.ndarray | None, freqs: np.ndarray | None, position_ids: np.ndarray,
                     q_rstd: np.ndarray, k_rstd: np.ndarray, d_q_rstd: np.ndarray | None = None,
                     d_k_rstd: np.ndarray | None = None, *, out: Arrays, Hq: int, Hkv: int, D: int,
                     eps: float, theta: float, rotary_dim: int | None, interleaved: bool = False) -> None:
        arrays = (d_qkv_out, qkv, q_norm_weight, k_norm_weight, q_rstd, k_rstd, d_q_rstd, d_k_rstd, *out)
        tables = rope(qkv, freqs, position_ids, Hq, Hkv, D, theta, rotary_dim, "qkv_qk_norm_rope_backward") \
            if _fits(*arrays) else None
        if tables is None:
            ref["qkv_qk_norm_rope_backward"](d_qkv_out, qkv, q_norm_weight, k_norm_weight, freqs,
                                             position_ids, q_rstd, k_rstd, d_q_rstd, d_k_rstd, out=out,
                                             Hq=Hq, Hkv=Hkv, D=D, eps=eps, theta=theta,
                                             rotary_dim=rotary_dim, interleaved=interleaved)
            return
        cos, sin, per_batch = tables
        b, t = qkv.shape[:2]
        d_qkv, d_qw, d_kw = scratch(out[0], qkv.shape), scratch(out[1], (D,)), scratch(out[2], (D,))
        lib.kiln_qkv_norm_rope_bwd(p(d_qkv_out), p(qkv), p(q_norm_weight), p(k_norm_weight), p(cos),
                                   p(sin), per_batch, p(q_rstd), p(k_rstd), p(d_q_rstd), p(d_k_rstd),
                                   p(d_qkv), p(d_qw), p(d_kw), b, t, Hq, Hkv, D, cos.shape[-1],
                                   bool(interleaved), threads())

    def lm_head(d_loss: np.ndarray, x: np.ndarray, weight: np.ndarray, targets: np.ndarray, *,
                loss: np.ndarray, lse: np.ndarray, d_x: np.ndarray | None, d_weight: np.ndarray | None,
                ignore_index: int) -> None:
        """The reference's tiles and products, with each tile's softmax, loss and gradient scale in C."""
        if not (_fits(d_loss, x, weight, loss, lse, d_x, d_weight) and x.ndim == 2 and weight.ndim == 2):
            ref["fused_lm_head_loss_and_grad"](d_loss, x, weight, targets, loss=loss, lse=lse, d_x=d_x,
                                               d_weight=d_weight, ignore_index=ignore_index)
            return
        n, v = x.shape[0], weight.shape[0]
        t = np.ascontiguousarray(loss_targets(targets, v, ignore_index, "fused_lm_head_loss"), np.int64)
        dl = np.where(t >= 0, d_loss, 0).astype(F32)
        rows = max(1, min(n, FUSED_LOGITS_TILE // max(v, 1)))
        buf = kiln_scratch("lm_head_tile", min(n, rows) * v, F32)
        scale = np.empty(n, F32)
        vocab_pieces = [slice(lo, hi) for lo, hi in chunks(v, max(256, v // 16))]
        for i, r0 in enumerate(range(0, n, rows)):
            r = slice(r0, min(r0 + rows, n))
            xr = x[r]
            z = matmul_into(xr, weight.T, buf[: xr.shape[0] * v].reshape(xr.shape[0], v))
            lib.kiln_lm_head_softmax(p(z), ffi.cast("int64_t *", t[r].ctypes.data), p(dl[r]), p(lse[r]),
                                     p(loss[r]), p(scale[r]), xr.shape[0], v, threads())
            a = scale[r, None]
            if d_x is not None:
                matmul_into(z, weight, d_x[r])
                d_x[r] *= a
            if d_weight is not None:
                xs = np.multiply(xr, a, out=kiln_scratch("lm_head_xs", xr.size, F32).reshape(xr.shape))
                if i == 0:
                    matmul_into(z.T, xs, d_weight)
                else:
                    def add_rows(q: slice, z: np.ndarray = z, xs: np.ndarray = xs) -> None:
                        part = kiln_scratch("lm_head_dw", (q.stop - q.start) * x.shape[1], F32)
                        part = part.reshape(q.stop - q.start, x.shape[1])
                        d_weight[q] += np.matmul(z[:, q].T, xs, out=part)

                    parallel(add_rows, vocab_pieces)

    def lm_head_tiles(n: int, chunk: int) -> list[slice]:
        """Tiles of rows for the forward: about 4 (so that the cores find work in an evaluation's few
        rows), a multiple of 64 rows, at most LOGITS_TILE logits; a cut of the shape only."""
        rows = max(64, -(-n // 4 // 64) * 64)
        rows = max(1, min(n, rows, LOGITS_TILE // max(chunk, 1)))
        return [slice(r0, min(r0 + rows, n)) for r0 in range(0, n, rows)]

    def i64(a: np.ndarray) -> FFI.CData:
        return ffi.cast("int64_t *", a.ctypes.data)

    def lm_head_loss(x: np.ndarray, weight: np.ndarray, targets: np.ndarray, *, out: Arrays,
                     ignore_index: int, chunk_size: int, softcap: float | None) -> None:
        """Tiles of rows on kiln's threads, each over the vocabulary chunk by chunk: BLAS's product of the
        chunk's logits, then one C pass over them (an online log-sum-exp and the target's logit)."""
        if not (softcap is None and _fits(x, weight, *out) and x.ndim == 2 and weight.ndim == 2
                and x.shape[1] == weight.shape[1] and chunk_size >= 1 and np.shape(targets) == x.shape[:1]
                and all(o is None or o.shape == x.shape[:1] for o in out)):
            ref["fused_lm_head_loss"](x, weight, targets, out=out, ignore_index=ignore_index,
                                      chunk_size=chunk_size, softcap=softcap)
            return
        n, v = x.shape[0], weight.shape[0]
        loss, lse = scratch(out[0], (n,)), scratch(out[1], (n,))
        t = np.ascontiguousarray(loss_targets(targets, v, ignore_index, "fused_lm_head_loss"), np.int64)
        chunk = min(chunk_size, v)
        m, s, picked = np.full(n, -np.inf, F32), np.zeros(n), np.zeros(n, F32)

        def tile(r: slice) -> None:
            xr = x[r]
            rows = xr.shape[0]
            buf = kiln_scratch("lm_head_logits", rows * chunk, F32)
            for v0 in range(0, v, chunk):
                w = weight[v0:v0 + chunk]
                z = np.matmul(xr, w.T, out=buf[: rows * w.shape[0]].reshape(rows, w.shape[0]))
                lib.kiln_lse_chunk(p(z), rows, w.shape[0], v0, i64(t[r]), p(m[r]),
                                   ffi.cast("double *", s[r].ctypes.data), p(picked[r]), 1)

        parallel(tile, lm_head_tiles(n, chunk))
        lse[...] = m + np.log(s)
        np.subtract(lse, picked, out=loss)
        loss[t < 0] = 0

    def lm_head_loss_bwd(d_loss: np.ndarray | None, x: np.ndarray, weight: np.ndarray, targets: np.ndarray,
                         lse: np.ndarray, d_lse: np.ndarray | None, *, out: Arrays, ignore_index: int,
                         chunk_size: int, softcap: float | None) -> None:
        """The reference's tiles, vocabulary chunks on kiln's threads and products (BLAS's); each chunk's
        logits turned into their gradient in place by one C pass."""
        d_x, d_w = out
        if not (softcap is None and _fits(d_loss, x, weight, lse, d_lse, d_x, d_w) and x.ndim == 2
                and weight.ndim == 2 and x.shape[1] == weight.shape[1] and chunk_size >= 1
                and all(a is None or a.shape == x.shape[:1] for a in (d_loss, targets, lse, d_lse))
                and (d_x is None or d_x.shape == x.shape) and (d_w is None or d_w.shape == weight.shape)):
            ref["fused_lm_head_loss_backward"](d_loss, x, weight, targets, lse, d_lse, out=out,
                                               ignore_index=ignore_index, chunk_size=chunk_size,
                                               softcap=softcap)
            return
        n, (v, c) = x.shape[0], weight.shape
        t = loss_targets(targets, v, ignore_index, "fused_lm_head_loss_backward").astype(np.int64)
        dl = np.zeros(n, F32) if d_loss is None else np.where(t >= 0, d_loss, 0).astype(F32)
        chunk = min(chunk_size, v)
        starts = list(range(0, v, chunk))
        height = max(1, min(n, LOGITS_TILE // chunk))
        tiles = [slice(r0, min(r0 + height, n)) for r0 in range(0, n, height)]
        parts = kiln_scratch("lm_head_dx", len(starts) * height * c, F32) if d_x is not None else None
        for i, r in enumerate(tiles):
            xr = x[r]
            rows = xr.shape[0]

            def vocab_chunk(j: int, r: slice = r, xr: np.ndarray = xr, rows: int = rows, first: bool = i == 0
                            ) -> None:
                v0 = starts[j]
                w = weight[v0:v0 + chunk]
                buf = kiln_scratch("lm_head_logits", rows * chunk, F32)
                g = np.matmul(xr, w.T, out=buf[: rows * w.shape[0]].reshape(rows, w.shape[0]))
                lib.kiln_logits_grad(p(g), rows, w.shape[0], v0, i64(t[r]), p(lse[r]), p(dl[r]),
                                     p(None if d_lse is None else d_lse[r]), 1)
                if parts is not None:
                    np.matmul(g, w, out=parts[j * rows * c:(j + 1) * rows * c].reshape(rows, c))
                if d_w is not None:
                    if first:
                        np.matmul(g.T, xr, out=d_w[v0:v0 + chunk])
                    else:
                        part = kiln_scratch("lm_head_dw", w.shape[0] * c, F32).reshape(w.shape[0], c)
                        d_w[v0:v0 + chunk] += np.matmul(g.T, xr, out=part)

            parallel(vocab_chunk, range(len(starts)))
            if d_x is not None and parts is not None:
                np.copyto(d_x[r], parts[: rows * c].reshape(rows, c))
                for j in range(1, len(starts)):
                    d_x[r] += parts[j * rows * c:(j + 1) * rows * c].reshape(rows, c)

    def rope_op(x: np.ndarray, freqs: np.ndarray | None, position_ids: np.ndarray, *, out: Arrays,
                head_dim: int, rotary_dim: int | None, theta: float, inverse: bool = False,
                interleaved: bool = False) -> None:
        """RoPE of every head of ``x [B, T, H * head_dim]`` (``inverse``: rope's backward); ``out`` may
        be ``x``."""
        y = out[0]
        if not (_fits(x, y) and x.ndim == 3 and head_dim > 0 and x.shape[2] % head_dim == 0
                and (y is None or y.shape == x.shape)):
            ref["rope"](x, freqs, position_ids, out=out, head_dim=head_dim, rotary_dim=rotary_dim,
                        theta=theta, inverse=inverse, interleaved=interleaved)
            return
        rd = check_rotary_dim(rotary_dim, head_dim, "rope")
        cos, sin = rope_tables(freqs, position_ids, rd, theta, x.dtype, "rope")
        per_batch = np.ndim(position_ids) != 1
        if cos.shape[:-1] != (x.shape[:2] if per_batch else x.shape[1:2]):  # the reference's error
            ref["rope"](x, freqs, position_ids, out=out, head_dim=head_dim, rotary_dim=rotary_dim,
                        theta=theta, inverse=inverse, interleaved=interleaved)
            return
        cos, sin = np.ascontiguousarray(cos, F32), np.ascontiguousarray(sin, F32)
        y = scratch(y, x.shape)
        b, t, f = x.shape
        lib.kiln_rope(p(x), p(cos), p(sin), int(per_batch), p(y), b, t, f // head_dim, head_dim,
                      cos.shape[-1], bool(interleaved), -1.0 if inverse else 1.0, threads())

    def qk_norm(q: np.ndarray, k: np.ndarray, q_weight: np.ndarray, k_weight: np.ndarray, *, eps: float
                ) -> tuple[np.ndarray, ...]:
        """The rmsnorm of q and of k over the head dim (the rmsnorm kernel twice)."""
        if not (_fits(q, k, q_weight, k_weight) and q.ndim == k.ndim >= 1 and q_weight.shape == q.shape[-1:]
                and k_weight.shape == k.shape[-1:]):
            found: tuple[np.ndarray, ...] = ref["qk_norm"](q, k, q_weight, k_weight, eps=eps)
            return found
        normed = []
        for x, w in ((q, q_weight), (k, k_weight)):
            c = x.shape[-1]
            y, rstd = np.empty(x.shape, F32), np.empty(x.shape[:-1], F32)
            lib.kiln_rmsnorm_fwd(null, p(x), p(w), null, null, p(y), p(rstd), x.size // c, c, eps, threads())
            normed.append((y, rstd))
        (q_norm, q_rstd), (k_norm, k_rstd) = normed
        return q_norm, k_norm, q_rstd, k_rstd

    def layernorm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None, *, eps: float
                  ) -> tuple[np.ndarray, ...]:
        if not (_fits(x, weight, bias) and x.ndim >= 1 and weight.shape == x.shape[-1:]
                and (bias is None or bias.shape == weight.shape)):
            found: tuple[np.ndarray, ...] = ref["layernorm"](x, weight, bias, eps=eps)
            return found
        c = x.shape[-1]
        y, mean, rstd = np.empty(x.shape, F32), np.empty(x.shape[:-1], F32), np.empty(x.shape[:-1], F32)
        lib.kiln_layernorm_fwd(p(x), p(weight), p(bias), p(y), p(mean), p(rstd), x.size // c, c, eps,
                               threads())
        return y, mean, rstd

    def layernorm_bwd(d_y: np.ndarray | None, x: np.ndarray, mean: np.ndarray, rstd: np.ndarray,
                      weight: np.ndarray, d_mean: np.ndarray | None = None, d_rstd: np.ndarray | None = None
                      ) -> tuple[np.ndarray, ...]:
        stat = x.shape[:-1]
        if not (_fits(d_y, x, mean, rstd, weight, d_mean, d_rstd) and x.ndim >= 1
                and weight.shape == x.shape[-1:] and (d_y is None or d_y.shape == x.shape)
                and all(a is None or a.shape == stat for a in (mean, rstd, d_mean, d_rstd))):
            found: tuple[np.ndarray, ...] = ref["layernorm_backward"](d_y, x, mean, rstd, weight, d_mean,
                                                                      d_rstd)
            return found
        c = x.shape[-1]
        d_x, d_w, d_b = np.empty(x.shape, F32), np.empty(c, F32), np.empty(c, F32)
        lib.kiln_layernorm_bwd(p(d_y), p(x), p(mean), p(rstd), p(weight), p(d_mean), p(d_rstd), p(d_x),
                               p(d_w), p(d_b), x.size // c, c, threads())
        return d_x, d_w, d_b

    def gelu(x: np.ndarray, *, approximate: str) -> np.ndarray:
        if not _fits(x):
            found: np.ndarray = ref["gelu"](x, approximate=approximate)
            return found
        out = np.empty(x.shape, F32)
        lib.kiln_gelu_fwd(p(x), null, p(out), x.size, approximate == "tanh", threads())
        return out

    def gelu_bwd(d: np.ndarray, x: np.ndarray, *, approximate: str) -> np.ndarray:
        if not (_fits(d, x) and d.shape == x.shape):
            found: np.ndarray = ref["gelu_backward"](d, x, approximate=approximate)
            return found
        out = np.empty(x.shape, F32)
        lib.kiln_gelu_bwd(p(d), p(x), p(out), x.size, approximate == "tanh", threads())
        return out

    def geglu(gate: np.ndarray, up: np.ndarray, *, approximate: str) -> np.ndarray:
        if not (_fits(gate, up) and gate.shape == up.shape):
            found: np.ndarray = ref["geglu"](gate, up, approximate=approximate)
            return found
        out = np.empty(gate.shape, F32)
        lib.kiln_gelu_fwd(p(gate), p(up), p(out), gate.size, approximate == "tanh", threads())
        return out

    def embedding_bwd(d_out: np.ndarray, ids: np.ndarray, *, out: Arrays, num_embeddings: int,
                      padding_idx: int | None = None) -> None:
        dw = out[0]
        c = d_out.shape[-1] if d_out.ndim else 0
        if not (_fits(d_out, dw) and ids.size and np.issubdtype(ids.dtype, np.integer)
                and dw is not None and dw.shape == (num_embeddings, c) and ids.size * c == d_out.size
                and int(ids.min()) >= 0 and int(ids.max()) < num_embeddings):  # else the reference's error
            ref["embedding_backward"](d_out, ids, out=out, num_embeddings=num_embeddings,
                                      padding_idx=padding_idx)
            return
        flat = np.ascontiguousarray(ids.reshape(-1), np.int64)
        lib.kiln_embedding_bwd(p(d_out), ffi.cast("int64_t *", flat.ctypes.data), p(dw), flat.size,
                               num_embeddings, c, threads())
        if padding_idx is not None:  # as the reference (torch.nn.Embedding): that row gets no gradient
            dw[padding_idx] = 0

    def cross_entropy(logits: np.ndarray, targets: np.ndarray, *, ignore_index: int
                      ) -> tuple[np.ndarray, ...]:
        if not (_fits(logits) and logits.ndim == 2 and np.shape(targets) == logits.shape[:1]):
            out: tuple[np.ndarray, ...] = ref["cross_entropy"](logits, targets, ignore_index=ignore_index)
            return out
        n, v = logits.shape
        t = np.ascontiguousarray(loss_targets(targets, v, ignore_index, "cross_entropy"), np.int64)
        loss, lse = np.empty(n, F32), np.empty(n, F32)
        lib.kiln_cross_entropy_fwd(p(logits), ffi.cast("int64_t *", t.ctypes.data), p(loss), p(lse), n, v,
                                   threads())
        return loss, lse

    def cross_entropy_bwd(d_loss: np.ndarray | None, logits: np.ndarray, targets: np.ndarray, lse: np.ndarray,
                          d_lse: np.ndarray | None, *, ignore_index: int) -> np.ndarray:
        if not (_fits(d_loss, logits, lse, d_lse) and logits.ndim == 2
                and all(a is None or a.shape == logits.shape[:1] for a in (d_loss, targets, lse, d_lse))):
            out: np.ndarray = ref["cross_entropy_backward"](d_loss, logits, targets, lse, d_lse,
                                                            ignore_index=ignore_index)
            return out
        n, v = logits.shape
        t = np.ascontiguousarray(loss_targets(targets, v, ignore_index, "cross_entropy_backward"), np.int64)
        dl = np.zeros(n, F32) if d_loss is None else np.where(t >= 0, d_loss, 0).astype(F32)
        d_logits = np.empty((n, v), F32)
        lib.kiln_cross_entropy_bwd(p(logits), ffi.cast("int64_t *", t.ctypes.data), p(lse), p(dl), p(d_lse),
                                   p(d_logits), n, v, threads())
        return d_logits

    def segments(seg: np.ndarray | None) -> tuple[FFI.CData, np.ndarray | None]:
        """The C side's int32 segment ids, or NULL when every sequence is one segment (as the reference
        drops the mask then)."""
        if seg is None or not seg.size or bool((seg == seg[:, :1]).all()):
            return null, None
        seg32 = np.ascontiguousarray(seg, np.int32)
        return ffi.cast("int32_t *", seg32.ctypes.data), seg32

    def native_attention(qkv: np.ndarray, seg: np.ndarray | None, hq: int, hkv: int, d: int,
                         window: int | None, softcap: float | None, alibi: bool) -> bool:
        b, t = qkv.shape[:2]
        return (softcap is None and not alibi and hkv > 0 and hq % hkv == 0 and qkv.ndim == 3
                and qkv.shape[2] == (hq + 2 * hkv) * d and (window is None or window >= 1)
                and (seg is None or seg.shape == (b, t)))

    def flash(qkv: np.ndarray, segment_ids: np.ndarray | None = None, *, out: Arrays, Hq: int, Hkv: int,
              D: int, causal: bool, softmax_scale: float | None, window_size: int | None,
              softcap: float | None = None, alibi: bool = False) -> None:
        if not (_fits(qkv, *out) and native_attention(qkv, segment_ids, Hq, Hkv, D, window_size, softcap,
                                                      alibi)):
            ref["flash_attention"](qkv, segment_ids, out=out, Hq=Hq, Hkv=Hkv, D=D, causal=causal,
                                   softmax_scale=softmax_scale, window_size=window_size,
                                   softcap=softcap, alibi=alibi)
            return
        b, t = qkv.shape[:2]
        o, lse = scratch(out[0], (b, t, Hq * D)), scratch(out[1], (b, Hq, t))
        seg, keep_alive = segments(segment_ids)
        scale = D**-0.5 if softmax_scale is None else softmax_scale
        lib.kiln_flash_fwd(p(qkv), p(o), p(lse), b, t, Hq, Hkv, D, bool(causal), window_size or 0, seg, scale,
                           threads())
        del keep_alive

    def flash_bwd(d_out: np.ndarray | None, qkv: np.ndarray, o: np.ndarray, lse: np.ndarray,
                  d_lse: np.ndarray | None = None, segment_ids: np.ndarray | None = None, *, out: Arrays,
                  Hq: int, Hkv: int, D: int, causal: bool, softmax_scale: float | None,
                  window_size: int | None, softcap: float | None = None, alibi: bool = False) -> None:
        if not (_fits(d_out, qkv, o, lse, d_lse, *out)
                and native_attention(qkv, segment_ids, Hq, Hkv, D, window_size, softcap, alibi)):
            ref["flash_attention_backward"](d_out, qkv, o, lse, d_lse, segment_ids, out=out, Hq=Hq,
                                            Hkv=Hkv, D=D, causal=causal, softmax_scale=softmax_scale,
                                            window_size=window_size, softcap=softcap, alibi=alibi)
            return
        b, t = qkv.shape[:2]
        d_qkv = scratch(out[0], qkv.shape)
        seg, keep_alive = segments(segment_ids)
        scale = D**-0.5 if softmax_scale is None else softmax_scale
        lib.kiln_flash_bwd(p(d_out), p(qkv), p(o), p(lse), p(d_lse), p(d_qkv), b, t, Hq, Hkv, D, bool(causal),
                           window_size or 0, seg, scale, threads())
        del keep_alive

    def head_rows(a: np.ndarray | None, shape: tuple[int, ...]) -> tuple[int, int] | None:
        """(floats between sequences, floats between positions) of a float32 ``[B, T, H, D]`` array of
        ``shape`` whose heads and dims lie contiguous within a position (C-contiguous, or q, k or v
        sliced from packed rows), else None; ``(0, 0)`` for an absent one."""
        if a is None:
            return 0, 0
        if a.dtype != F32 or a.shape != shape or not a.size or any(x < 0 or x % 4 for x in a.strides):
            return None
        b, t, h, d = a.shape
        if (d > 1 and a.strides[3] != 4) or (h > 1 and a.strides[2] != 4 * d):
            return None
        return (a.strides[0] // 4 if b > 1 else 0), (a.strides[1] // 4 if t > 1 else 0)

    def attention_layout(q: np.ndarray, k: np.ndarray, v: np.ndarray, seg: np.ndarray | None,
                         window: int | None, softcap: float | None, alibi: bool,
                         others: Sequence[tuple[np.ndarray | None, tuple[int, ...]]] = ()
                         ) -> list[int] | None:
        """The strides the C code takes (q, k, v, then ``others``), or None where it does not apply
        (the NumPy kernel then runs, and raises what it raises for bad input)."""
        if q.ndim != 4 or k.ndim != 4 or softcap is not None or alibi or (window is not None and window < 1):
            return None
        b, tq, hq, d = q.shape
        hkv = k.shape[2]
        if k.shape[::3] != (b, d) or v.shape != k.shape or hkv <= 0 or hq % hkv:
            return None
        if seg is not None and (seg.shape != (b, k.shape[1]) or tq > k.shape[1]):
            return None
        rows = [head_rows(a, shape) for a, shape in ((q, q.shape), (k, k.shape), (v, k.shape), *others)]
        if any(r is None for r in rows):
            return None
        return [x for r in rows if r is not None for x in r]

    def strides(st: list[int]) -> FFI.CData:
        return ffi.new("int64_t[]", st)

    def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, segment_ids: np.ndarray | None = None, *,
                  out: Arrays, causal: bool, softmax_scale: float | None, window_size: int | None,
                  softcap: float | None = None, alibi: bool = False) -> None:
        st = attention_layout(q, k, v, segment_ids, window_size, softcap, alibi, [(out[0], q.shape)])
        lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if q.ndim == 4 else ()
        if st is None or not _fits(out[1]) or (out[1] is not None and out[1].shape != lse_shape):
            ref["attention"](q, k, v, segment_ids, out=out, causal=causal, softmax_scale=softmax_scale,
                             window_size=window_size, softcap=softcap, alibi=alibi)
            return
        b, tq, hq, d = q.shape
        o, lse = out[0], scratch(out[1], lse_shape)
        if o is None:
            o = np.empty(q.shape, F32)
            st[6:8] = [tq * hq * d, hq * d]
        seg, keep_alive = segments(segment_ids)
        scale = d**-0.5 if softmax_scale is None else softmax_scale
        lib.kiln_attention_fwd(p(q), p(k), p(v), p(o), p(lse), strides(st), b, tq, k.shape[1], hq,
                               k.shape[2], d, bool(causal), window_size or 0, seg, scale, threads())
        del keep_alive

    def attention_bwd(d_out: np.ndarray | None, q: np.ndarray, k: np.ndarray, v: np.ndarray, o: np.ndarray,
                      lse: np.ndarray, d_lse: np.ndarray | None = None,
                      segment_ids: np.ndarray | None = None, *, out: Arrays, causal: bool,
                      softmax_scale: float | None, window_size: int | None, softcap: float | None = None,
                      alibi: bool = False) -> None:
        lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if q.ndim == 4 else ()
        outs = [scratch(o_, a.shape) if a.ndim == 4 else o_ for o_, a in zip(out, (q, k, v), strict=True)]
        st = attention_layout(q, k, v, segment_ids, window_size, softcap, alibi,
                              [(o, q.shape), (d_out, q.shape), (outs[0], q.shape), (outs[1], k.shape),
                               (outs[2], k.shape)])
        if (st is None or not _fits(lse, d_lse) or lse.shape != lse_shape
                or (d_lse is not None and d_lse.shape != lse_shape)):
            ref["attention_backward"](d_out, q, k, v, o, lse, d_lse, segment_ids, out=out,
                                      causal=causal, softmax_scale=softmax_scale,
                                      window_size=window_size, softcap=softcap, alibi=alibi)
            return
        b, tq, hq, d = q.shape
        seg, keep_alive = segments(segment_ids)
        scale = d**-0.5 if softmax_scale is None else softmax_scale
        lib.kiln_attention_bwd(p(d_out), p(q), p(k), p(v), p(o), p(lse), p(d_lse), p(outs[0]), p(outs[1]),
                               p(outs[2]), strides(st), b, tq, k.shape[1], hq, k.shape[2], d, bool(causal),
                               window_size or 0, seg, scale, threads())
        del keep_alive

    return {"rmsnorm": rmsnorm, "fused_residual_rmsnorm": fused, "rmsnorm_apply_saved": apply_saved,
            "fused_residual_rmsnorm_apply_saved": fused_apply_saved, "rmsnorm_backward": rmsnorm_bwd,
            "fused_residual_rmsnorm_backward": fused_bwd, "swiglu": swiglu, "swiglu_backward": swiglu_bwd,
            "silu_mul": silu_mul, "silu_mul_backward": silu_mul_bwd, "adamw_update": adamw,
            "flash_attention": flash, "flash_attention_backward": flash_bwd, "qkv_qk_norm_rope": qkv_rope,
            "qkv_qk_norm_rope_backward": qkv_rope_bwd, "fused_lm_head_loss_and_grad": lm_head,
            "embedding_backward": embedding_bwd, "cross_entropy": cross_entropy,
            "cross_entropy_backward": cross_entropy_bwd, "silu": silu, "silu_backward": silu_bwd,
            "attention": attention, "attention_backward": attention_bwd, "fused_lm_head_loss": lm_head_loss,
            "fused_lm_head_loss_backward": lm_head_loss_bwd, "rope": rope_op, "qk_norm": qk_norm,
            "layernorm": layernorm, "layernorm_backward": layernorm_bwd, "gelu": gelu,
            "gelu_backward": gelu_bwd, "geglu": geglu}


#: the ops with a native kernel: the norms and their backward and recompute variants (a fused norm's
#: recompute must round as its forward did), the gated activations, attention on packed qkv (causal or
#: not, GQA, sliding window, segment ids; softcap and ALiBi run the NumPy kernel) and on separate q, k,
#: v (the same, and cross attention: Tq != Tk), the per-head q/k norm with RoPE on packed qkv, the
#: softmax of the LM head's fused loss and gradient (its products stay BLAS's), the LM head's
#: forward-only loss and its separate backward (evaluation, and training steps that do not fuse the
#: gradient: each chunk's log-sum-exp, or its logits' gradient, in C), AdamW, the embedding's
#: backward, cross-entropy on logits and its backward, silu, standalone rope (its backward is rope with
#: inverse=True), qk_norm (its backward is rmsnorm_backward), layernorm and its backward, gelu (exact
#: or tanh) and its backward, geglu (its backward is gelu_backward and products)
OPS = ("rmsnorm", "fused_residual_rmsnorm", "rmsnorm_apply_saved", "fused_residual_rmsnorm_apply_saved",
       "rmsnorm_backward", "fused_residual_rmsnorm_backward", "swiglu", "swiglu_backward", "silu_mul",
       "silu_mul_backward", "flash_attention", "flash_attention_backward", "qkv_qk_norm_rope",
       "qkv_qk_norm_rope_backward", "fused_lm_head_loss_and_grad", "adamw_update", "embedding_backward",
       "cross_entropy", "cross_entropy_backward", "silu", "silu_backward", "attention", "attention_backward",
       "fused_lm_head_loss", "fused_lm_head_loss_backward", "rope", "qk_norm", "layernorm",
       "layernorm_backward", "gelu", "gelu_backward", "geglu")
