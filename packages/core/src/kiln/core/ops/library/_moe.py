"""Mixture-of-experts primitives: router probabilities, top-k, permutation, grouped GEMMs, combine.

A layer (HF ``Qwen3MoeSparseMoeBlock``) composes as::

    probs = moe_softmax(x @ gate^T)                       [N, E], fp32
    weights, indices = moe_topk(probs, k, normalize)      [N, k]
    x_perm, scatter_idx, offsets = moe_permute(x, indices, num_experts=E)
    h = swiglu(moe_grouped_gemm_gate_up(x_perm, gate_up_weight, offsets))
    out = moe_unpermute(moe_grouped_gemm_down(h, down_weight, offsets), weights, scatter_idx)

Rows of ``x_perm`` are the N*k (token, slot) pairs grouped by expert; ``scatter_idx[r]`` is the flat
``token * k + slot`` position of row ``r`` and ``expert_offsets[e]:expert_offsets[e + 1]`` its
expert's rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from kiln.core._errors import OpError
from kiln.core.ir._dims import parse_dim, simplify
from kiln.core.ir._ir import TensorType
from kiln.core.ops._ops import AttrSpec, BackwardContext, Cost, InferContext, Sample
from kiln.core.ops.library._common import check_same, core_op, randn


def _check_int(ctx: InferContext, i: int, what: str) -> None:
    if ctx.dtype(i) not in ("int32", "int8"):
        raise ctx.fail(f"{what} must be an integer tensor, found {ctx.dtype(i)}")


def _check_rank(ctx: InferContext, i: int, rank: int, what: str) -> None:
    if len(ctx.shape(i)) != rank:
        raise ctx.fail(f"{what} must have rank {rank}, found shape [{', '.join(map(str, ctx.shape(i)))}]")


def _nbytes(*shapes: tuple[int, ...]) -> float:
    return 4.0 * sum(float(np.prod(s)) for s in shapes)


# --- router probabilities ------------------------------------------------------------------------


def _softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    out: np.ndarray = e / e.sum(axis=-1, keepdims=True)
    return out


def _sigmoid(logits: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * logits))  # overflow-free form of 1 / (1 + exp(-x))


def _probs_infer(ctx: InferContext) -> list[TensorType]:
    _check_rank(ctx, 0, 2, "logits")
    return [TensorType(ctx.shape(0), "fp32")]  # routing runs in fp32 whatever the logits' dtype


def _probs_backward(name: str) -> Callable[[BackwardContext], list[str | None]]:
    def rule(ctx: BackwardContext) -> list[str | None]:
        if not ctx.needs_grad(0):
            return [None]
        return [ctx.emit(name, ctx.d_out, ctx.saved_output(0), dtype=ctx.type_of(0).dtype)]
    return rule


def _softmax_backward(d: np.ndarray, p: np.ndarray, *, dtype: object) -> np.ndarray:
    out: np.ndarray = p * (d - np.sum(d * p, axis=-1, keepdims=True))
    return out


def _sigmoid_backward(d: np.ndarray, p: np.ndarray, *, dtype: object) -> np.ndarray:
    out: np.ndarray = d * p * (1.0 - p)
    return out


def _probs_grad_infer(ctx: InferContext) -> list[TensorType]:
    check_same(ctx, ctx.shape(0), ctx.shape(1), "d_probs and probs differ")
    return [TensorType(ctx.shape(1), ctx.attrs["dtype"])]


def _logits_samples(rng: np.random.Generator) -> Iterator[Sample]:
    yield Sample((randn(rng, 4, 5),))
    yield Sample((3.0 * randn(rng, 3, 8),))


# --- top-k ---------------------------------------------------------------------------------------


def _topk_indices(probs: np.ndarray, k: int) -> np.ndarray:
    # A stable sort of -probs puts equal values in index order: ties go to the lower expert index.
    return np.argsort(-probs, axis=-1, kind="stable")[:, :k].astype(np.int32)


def _topk(probs: np.ndarray, *, k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    if not 1 <= k <= probs.shape[-1]:
        raise OpError(f"op 'moe_topk': k = {k} is not in 1..{probs.shape[-1]} (the number of experts)",
                      op="moe_topk", code="E004")
    idx = _topk_indices(probs, k)
    w = np.take_along_axis(probs, idx, axis=-1)
    if normalize:
        w = w / w.sum(axis=-1, keepdims=True)
    return w, idx


def _topk_infer(ctx: InferContext) -> list[TensorType]:
    _check_rank(ctx, 0, 2, "probs")
    n, e = ctx.shape(0)
    k = ctx.attrs["k"]
    if k < 1 or (e.free_symbols() == frozenset() and k > e.evaluate({})):
        raise ctx.fail(f"k = {k} is not in 1..{e} (the number of experts)")
    return [TensorType((n, parse_dim(k)), ctx.dtype(0)), TensorType((n, parse_dim(k)), "int32")]


def _topk_backward_kernel(d: np.ndarray, probs: np.ndarray, idx: np.ndarray, *,
                          normalize: bool) -> np.ndarray:
    if normalize:  # w = s / sum(s)  =>  ds_j = (dw_j - <dw, w>) / sum(s)
        s = np.take_along_axis(probs, idx, axis=-1)
        total = s.sum(axis=-1, keepdims=True)
        d = (d - np.sum(d * s, axis=-1, keepdims=True) / total) / total
    out = np.zeros_like(probs, dtype=d.dtype)
    np.put_along_axis(out, idx.astype(np.intp), d, axis=-1)
    return out


def _topk_backward(ctx: BackwardContext) -> list[str | None]:
    if not ctx.needs_grad(0) or ctx.d_outputs[0] is None:
        return [None]
    return [ctx.emit("moe_topk_backward", ctx.d_out, ctx.saved(0), ctx.saved_output(1),
                     normalize=ctx.attrs["normalize"])]


def _topk_samples(rng: np.random.Generator) -> Iterator[Sample]:
    # Distinct, well separated values per row so finite differences never change the selection.
    def probs(n: int, e: int) -> np.ndarray:
        ranks = np.stack([rng.permutation(e) for _ in range(n)]) + 1.0
        return _softmax(0.7 * ranks + 0.05 * rng.random((n, e)))

    for k, normalize in ((1, False), (2, False), (2, True), (3, True), (1, True)):
        yield Sample((probs(4, 6),), {"k": k, "normalize": normalize})


# --- permute / unpermute -------------------------------------------------------------------------


def _permute(x: np.ndarray, indices: np.ndarray, *, num_experts: int) -> tuple[np.ndarray, ...]:
    flat = indices.reshape(-1).astype(np.intp)
    if flat.size and (flat.min() < 0 or flat.max() >= num_experts):
        raise OpError(f"op 'moe_permute': expert indices must lie in 0..{num_experts - 1}, found "
                      f"{flat.min()}..{flat.max()}", op="moe_permute", code="E004")
    order = np.argsort(flat, kind="stable")  # by expert, then by (token, slot)
    k = indices.shape[1]
    counts = np.bincount(flat, minlength=num_experts)
    offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int32)
    return x[order // k], order.astype(np.int32), offsets


def _permute_infer(ctx: InferContext) -> list[TensorType]:
    _check_rank(ctx, 0, 2, "x")
    _check_rank(ctx, 1, 2, "indices")
    _check_int(ctx, 1, "indices")
    (n, c), (ni, k) = ctx.shape(0), ctx.shape(1)
    check_same(ctx, (n,), (ni,), "x and indices have different token counts")
    r = n * k
    e = parse_dim(ctx.attrs["num_experts"])
    return [TensorType((r, c), ctx.dtype(0)), TensorType((r,), "int32"), TensorType((e + 1,), "int32")]


def _permute_backward(ctx: BackwardContext) -> list[str | None]:
    dx = None
    if ctx.needs_grad(0) and ctx.d_outputs[0] is not None:
        dx = ctx.emit("moe_permute_backward", ctx.d_out, ctx.saved_output(1), num_tokens=ctx.shape_of(0)[0])
    return [dx, None]


def _permute_backward_kernel(d: np.ndarray, scatter_idx: np.ndarray, *, num_tokens: int) -> np.ndarray:
    k = d.shape[0] // num_tokens if num_tokens else 1
    out = np.zeros((num_tokens, d.shape[1]), dtype=d.dtype)
    np.add.at(out, scatter_idx.astype(np.intp) // k, d)
    return out


def _permute_backward_infer(ctx: InferContext) -> list[TensorType]:
    return [TensorType((parse_dim(ctx.attrs["num_tokens"]), ctx.shape(0)[1]), ctx.dtype(0))]


def _routing(rng: np.random.Generator, n: int, e: int, k: int) -> np.ndarray:
    """Expert indices [n, k]: k distinct experts per token, expert e - 1 never chosen."""
    return np.stack([rng.choice(e - 1, k, replace=False) for _ in range(n)]).astype(np.int32)


def _permute_samples(rng: np.random.Generator) -> Iterator[Sample]:
    yield Sample((randn(rng, 5, 3), _routing(rng, 5, 4, 2)), {"num_experts": 4})
    yield Sample((randn(rng, 4, 2), _routing(rng, 4, 6, 3)), {"num_experts": 6})


def _unpermute(y: np.ndarray, weights: np.ndarray, scatter_idx: np.ndarray, *,
               top_k: int | None) -> np.ndarray:
    n, k = weights.shape
    s = scatter_idx.astype(np.intp)
    out = np.zeros((n, y.shape[1]), dtype=np.result_type(y, weights))
    np.add.at(out, s // k, weights.reshape(-1)[s, None] * y)
    return out


def _unpermute_infer(ctx: InferContext) -> list[TensorType]:
    for i, what in ((0, "y_perm"), (1, "weights")):
        _check_rank(ctx, i, 2, what)
    _check_rank(ctx, 2, 1, "scatter_idx")
    _check_int(ctx, 2, "scatter_idx")
    (r, c), (n, k) = ctx.shape(0), ctx.shape(1)
    check_same(ctx, (r,), ctx.shape(2), "y_perm rows and scatter_idx differ")
    check_same(ctx, (r,), (n * k,), "y_perm must have one row per (token, slot)")
    if ctx.attrs["top_k"] is not None:
        check_same(ctx, (k,), (parse_dim(ctx.attrs["top_k"]),), "weights' last dim is not top_k")
    return [TensorType((n, c), ctx.dtype(0))]


def _unpermute_backward(ctx: BackwardContext) -> list[str | None]:
    d = ctx.d_outputs[0]
    dy = dw = None
    if d is not None and ctx.needs_grad(0):
        dy = ctx.emit("moe_unpermute_dy", d, ctx.saved(1), ctx.saved(2))
    if d is not None and ctx.needs_grad(1):
        dw = ctx.emit("moe_unpermute_dw", d, ctx.saved(0), ctx.saved(2), top_k=ctx.shape_of(1)[1])
    return [dy, dw, None]


def _unpermute_dy(d: np.ndarray, weights: np.ndarray, scatter_idx: np.ndarray) -> np.ndarray:
    s = scatter_idx.astype(np.intp)
    out: np.ndarray = weights.reshape(-1)[s, None] * d[s // weights.shape[1]]
    return out


def _unpermute_dw(d: np.ndarray, y: np.ndarray, scatter_idx: np.ndarray, *, top_k: int) -> np.ndarray:
    s = scatter_idx.astype(np.intp)
    out = np.zeros(d.shape[0] * top_k, dtype=np.result_type(d, y))
    out[s] = np.sum(d[s // top_k] * y, axis=-1)
    return out.reshape(d.shape[0], top_k)


def _unpermute_samples(rng: np.random.Generator) -> Iterator[Sample]:
    for n, k, c in ((4, 2, 3), (3, 3, 2)):
        yield Sample((randn(rng, n * k, c), randn(rng, n, k), rng.permutation(n * k).astype(np.int32)),
                     {"top_k": k})
    yield Sample((randn(rng, 5, 2), randn(rng, 5, 1), rng.permutation(5).astype(np.int32)))


# --- grouped GEMMs -------------------------------------------------------------------------------


def _groups(offsets: np.ndarray, rows: int, op: str) -> list[slice]:
    o = offsets.astype(np.intp)
    if o[0] != 0 or o[-1] != rows or np.any(np.diff(o) < 0):
        raise OpError(f"op {op!r}: expert_offsets must rise from 0 to {rows} (the row count), found "
                      f"{offsets.tolist()}", op=op, code="E004")
    return [slice(a, b) for a, b in itertools.pairwise(o)]


def _grouped_gemm(op: str) -> Callable[..., np.ndarray]:
    def kernel(x: np.ndarray, w: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        out = np.zeros((x.shape[0], w.shape[1]), dtype=np.result_type(x, w))
        for e, rows in enumerate(_groups(offsets, x.shape[0], op)):
            out[rows] = x[rows] @ w[e].T
        return out
    return kernel


def _grouped_gemm_infer(ctx: InferContext, what: str) -> list[TensorType]:
    _check_rank(ctx, 0, 2, what)
    _check_rank(ctx, 1, 3, "weight")
    _check_rank(ctx, 2, 1, "expert_offsets")
    _check_int(ctx, 2, "expert_offsets")
    (r, i), (e, o, iw) = ctx.shape(0), ctx.shape(1)
    check_same(ctx, (i,), (iw,), f"{what}'s last dim and the weight's input dim differ")
    check_same(ctx, ctx.shape(2), (e + 1,), "expert_offsets must have num_experts + 1 entries")
    return [TensorType((r, o), ctx.dtype(0))]


def _gate_up_infer(ctx: InferContext) -> list[TensorType]:
    out = _grouped_gemm_infer(ctx, "x_perm")
    two_m = ctx.shape(1)[1]
    if not two_m.free_symbols() and two_m.evaluate({}) % 2:
        raise ctx.fail(f"gate_up_weight's dim 1 must be 2 * M ([gate | up] rows), found {two_m}")
    return out


def _grouped_gemm_backward(ctx: BackwardContext) -> list[str | None]:
    dx = dw = None
    if ctx.needs_grad(0):  # dx_e = dh_e @ W_e
        dx = ctx.emit("moe_grouped_gemm_dx", ctx.d_out, ctx.saved(1), ctx.saved(2))
    if ctx.needs_grad(1):  # dW_e = dh_e^T @ x_e
        dw = ctx.emit("moe_grouped_gemm_dw", ctx.d_out, ctx.saved(0), ctx.saved(2))
    return [dx, dw, None]


def _grouped_gemm_dx(d: np.ndarray, w: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    out = np.zeros((d.shape[0], w.shape[2]), dtype=np.result_type(d, w))
    for e, rows in enumerate(_groups(offsets, d.shape[0], "moe_grouped_gemm_dx")):
        out[rows] = d[rows] @ w[e]
    return out


def _grouped_gemm_dw(d: np.ndarray, x: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    groups = _groups(offsets, d.shape[0], "moe_grouped_gemm_dw")
    out = np.zeros((len(groups), d.shape[1], x.shape[1]), dtype=np.result_type(d, x))
    for e, rows in enumerate(groups):
        out[e] = d[rows].T @ x[rows]
    return out


def _grouped_gemm_dx_infer(ctx: InferContext) -> list[TensorType]:
    (r, o), (_, ow, i) = ctx.shape(0), ctx.shape(1)
    check_same(ctx, (o,), (ow,), "d_out's last dim and the weight's output dim differ")
    return [TensorType((r, i), ctx.dtype(0))]


def _grouped_gemm_dw_infer(ctx: InferContext) -> list[TensorType]:
    (_, o), (_, i), (e1,) = ctx.shape(0), ctx.shape(1), ctx.shape(2)
    return [TensorType((simplify(e1 - 1), o, i), ctx.dtype(0))]


def _grouped_gemm_samples(out_mult: int) -> Callable[[np.random.Generator], Iterator[Sample]]:
    def samples(rng: np.random.Generator) -> Iterator[Sample]:
        for offsets, i, o in (([0, 2, 2, 6], 3, 2), ([0, 1, 4, 5, 7], 2, 3)):
            e = len(offsets) - 1
            yield Sample((randn(rng, offsets[-1], i), randn(rng, e, out_mult * o, i),
                          np.array(offsets, dtype=np.int32)))
    return samples


def _grouped_gemm_cost(shapes: Sequence[tuple[int, ...]], attrs: Mapping[str, Any]) -> Cost:
    (r, i), (e, o, _) = shapes[0], shapes[1]
    return Cost(flops=2.0 * r * i * o, bytes=_nbytes((r, i), (e, o, i), (r, o)))


def _generic_gemm(x: np.ndarray, w: np.ndarray, offsets: np.ndarray, *, transpose: str) -> np.ndarray:
    wt = w if transpose == "NT" else np.swapaxes(w, 1, 2)  # NN weights are [E, I, O]
    return _grouped_gemm("grouped_gemm")(x, wt, offsets)


def _generic_gemm_infer(ctx: InferContext) -> list[TensorType]:
    _check_rank(ctx, 1, 3, "weight")
    if ctx.attrs["transpose"] == "NN":  # weight [G, I, O]: checked as the NT layout [G, O, I]
        g, i, o = ctx.shape(1)
        ctx = InferContext(ctx.op, (ctx.inputs[0], TensorType((g, o, i), ctx.dtype(1)), *ctx.inputs[2:]),
                           ctx.attrs)
    return _grouped_gemm_infer(ctx, "x")


def _generic_gemm_backward(ctx: BackwardContext) -> list[str | None]:
    nt = ctx.attrs["transpose"] == "NT"
    dx = dw = None
    if ctx.needs_grad(0):  # NT: dx_e = d_e @ W_e;  NN: dx_e = d_e @ W_e^T
        dx = ctx.emit("moe_grouped_gemm_dx" if nt else "grouped_gemm", ctx.d_out, ctx.saved(1), ctx.saved(2),
                      transpose=None if nt else "NT")
    if ctx.needs_grad(1):  # NT: dW_e = d_e^T @ x_e;  NN: dW_e = x_e^T @ d_e
        a, b = (ctx.d_out, ctx.saved(0)) if nt else (ctx.saved(0), ctx.d_out)
        dw = ctx.emit("moe_grouped_gemm_dw", a, b, ctx.saved(2))
    return [dx, dw, None]


def _generic_gemm_samples(rng: np.random.Generator) -> Iterator[Sample]:
    for transpose in ("NT", "NN"):
        for sample in _grouped_gemm_samples(1)(rng):
            x, w, offsets = sample.inputs
            assert w is not None
            yield Sample((x, w if transpose == "NT" else np.swapaxes(w, 1, 2).copy(), offsets),
                         {"transpose": transpose})


_ROUTER_ATTRS = (AttrSpec("dtype", "dtype", "fp32"),)


CORE_OPS = [
    core_op(
        "moe_softmax", ("logits",), ("probs",), _softmax, _probs_infer,
        backward=_probs_backward("moe_softmax_backward"), samples=_logits_samples,
        cost=lambda s, a: Cost(flops=5.0 * np.prod(s[0]), bytes=_nbytes(s[0], s[0])),
        doc="Router probabilities [N, E] = softmax(logits) over experts, in fp32.",
    ),
    core_op(
        "moe_softmax_backward", ("d_probs", "probs"), ("d_logits",), _softmax_backward, _probs_grad_infer,
        attrs=_ROUTER_ATTRS, cost=lambda s, a: Cost(flops=4.0 * np.prod(s[0]), bytes=_nbytes(*s, s[0])),
        doc="d_logits = probs * (d_probs - sum(d_probs * probs)); dtype is the logits' dtype.",
    ),
    core_op(
        "moe_sigmoid", ("logits",), ("probs",), _sigmoid, _probs_infer,
        backward=_probs_backward("moe_sigmoid_backward"), samples=_logits_samples,
        cost=lambda s, a: Cost(flops=4.0 * np.prod(s[0]), bytes=_nbytes(s[0], s[0])),
        doc="Router scores [N, E] = sigmoid(logits) per expert (DeepSeek-style routing), in fp32.",
    ),
    core_op(
        "moe_sigmoid_backward", ("d_probs", "probs"), ("d_logits",), _sigmoid_backward, _probs_grad_infer,
        attrs=_ROUTER_ATTRS, cost=lambda s, a: Cost(flops=3.0 * np.prod(s[0]), bytes=_nbytes(*s, s[0])),
        doc="d_logits = d_probs * probs * (1 - probs); dtype is the logits' dtype.",
    ),
    core_op(
        "moe_topk", ("probs",), ("weights", "indices"), _topk, _topk_infer, backward=_topk_backward,
        attrs=(AttrSpec("k", "int"), AttrSpec("normalize", "bool", False)), samples=_topk_samples,
        cost=lambda s, a: Cost(flops=float(np.prod(s[0])) * max(1.0, np.log2(s[0][-1])),
                               bytes=_nbytes(s[0], (s[0][0], 2 * a["k"]))),
        doc="The k largest probs per row, largest first (weights [N, k], expert indices [N, k] int32); "
            "ties go to the lower expert index; normalize rescales each row's weights to sum to 1.",
    ),
    core_op(
        "moe_topk_backward", ("d_weights", "probs", "indices"), ("d_probs",), _topk_backward_kernel,
        lambda ctx: [TensorType(ctx.shape(1), ctx.dtype(0))],
        attrs=(AttrSpec("normalize", "bool", False),),
        cost=lambda s, a: Cost(flops=4.0 * np.prod(s[0]), bytes=_nbytes(s[0], s[0], s[1])),
        doc="Scatters d_weights (through the renormalisation if normalize) into a zero [N, E] d_probs.",
    ),
    core_op(
        "grouped_gemm", ("x", "weight", "offsets"), ("out",), _generic_gemm, _generic_gemm_infer,
        backward=_generic_gemm_backward, attrs=(AttrSpec("transpose", "str", "NT", ("NT", "NN")),),
        samples=_generic_gemm_samples, nondiff_inputs={2}, flop_heavy=True,
        cost=lambda s, a: _grouped_gemm_cost(s if a["transpose"] == "NT" else
                                             [s[0], (s[1][0], s[1][2], s[1][1])], a),
        doc="out [R, O] = rows offsets[g]:offsets[g + 1] of x [R, I] times weight[g]: its transpose for NT "
            "(weight [G, O, I], the seed's layout) or itself for NN (weight [G, I, O]); offsets [G + 1] int.",
    ),
    core_op(
        "moe_permute", ("x", "indices"), ("x_perm", "scatter_idx", "expert_offsets"), _permute,
        _permute_infer, backward=_permute_backward, attrs=(AttrSpec("num_experts", "dim"),),
        samples=_permute_samples, nondiff_inputs={1},
        cost=lambda s, a: Cost(bytes=2 * _nbytes((s[1][0] * s[1][1], s[0][1]))),
        doc="Copies token rows to the N*k (token, slot) rows grouped by expert (ascending, stable in "
            "token*k + slot order); scatter_idx[r] = token*k + slot of row r, expert_offsets [E+1] bound "
            "each expert's rows.",
    ),
    core_op(
        "moe_permute_backward", ("d_x_perm", "scatter_idx"), ("d_x",), _permute_backward_kernel,
        _permute_backward_infer, attrs=(AttrSpec("num_tokens", "dim"),),
        cost=lambda s, a: Cost(flops=float(np.prod(s[0])), bytes=_nbytes(s[0], s[0])),
        doc="d_x[t] = sum of the d_x_perm rows that came from token t.",
    ),
    core_op(
        "moe_grouped_gemm_gate_up", ("x_perm", "gate_up_weight", "expert_offsets"), ("h",),
        _grouped_gemm("moe_grouped_gemm_gate_up"), _gate_up_infer, backward=_grouped_gemm_backward,
        samples=_grouped_gemm_samples(2), nondiff_inputs={2}, cost=_grouped_gemm_cost,
        flop_heavy=True,
        doc="h [R, 2M] = x_perm rows of expert e @ gate_up_weight[e]^T, weight [E, 2M, C] rows [gate | up].",
    ),
    core_op(
        "moe_grouped_gemm_down", ("act", "down_weight", "expert_offsets"), ("y",),
        _grouped_gemm("moe_grouped_gemm_down"),
        lambda ctx: _grouped_gemm_infer(ctx, "act"), backward=_grouped_gemm_backward,
        samples=_grouped_gemm_samples(1), nondiff_inputs={2}, cost=_grouped_gemm_cost,
        flop_heavy=True,
        doc="y [R, C] = act rows of expert e @ down_weight[e]^T, weight [E, C, M].",
    ),
    core_op(
        "moe_grouped_gemm_dx", ("d_out", "weight", "expert_offsets"), ("d_x",), _grouped_gemm_dx,
        _grouped_gemm_dx_infer,
        cost=lambda s, a: _grouped_gemm_cost([(s[0][0], s[1][2]), s[1]], a),
        doc="d_x [R, I] = d_out rows of expert e @ weight[e] (weight [E, O, I]).",
    ),
    core_op(
        "moe_grouped_gemm_dw", ("d_out", "x", "expert_offsets"), ("d_weight",), _grouped_gemm_dw,
        _grouped_gemm_dw_infer,
        cost=lambda s, a: _grouped_gemm_cost([s[1], (s[2][0] - 1, s[0][1], s[1][1])], a),
        doc="d_weight [E, O, I], d_weight[e] = (d_out rows of e)^T @ (x rows of e); zero for empty experts.",
    ),
    core_op(
        "moe_unpermute", ("y_perm", "weights", "scatter_idx"), ("out",), _unpermute, _unpermute_infer,
        backward=_unpermute_backward, attrs=(AttrSpec("top_k", "int", None),), samples=_unpermute_samples,
        nondiff_inputs={2},
        cost=lambda s, a: Cost(flops=2.0 * np.prod(s[0]), bytes=_nbytes(s[0], s[1], (s[1][0], s[0][1]))),
        doc="out[t] = sum over slots j of weights[t, j] * y_perm[row of (t, j)] (top_k, if given, must "
            "equal weights' last dim).",
    ),
    core_op(
        "moe_unpermute_dy", ("d_out", "weights", "scatter_idx"), ("d_y_perm",), _unpermute_dy,
        lambda ctx: [TensorType((ctx.shape(2)[0], ctx.shape(0)[1]), ctx.dtype(0))],
        cost=lambda s, a: Cost(flops=float(s[2][0] * s[0][1]), bytes=_nbytes((s[2][0], s[0][1]), s[0])),
        doc="d_y_perm[r] = weights of (t, j) * d_out[t] for the (token, slot) pair (t, j) of row r.",
    ),
    core_op(
        "moe_unpermute_dw", ("d_out", "y_perm", "scatter_idx"), ("d_weights",), _unpermute_dw,
        lambda ctx: [TensorType((ctx.shape(0)[0], parse_dim(ctx.attrs["top_k"])), ctx.dtype(0))],
        attrs=(AttrSpec("top_k", "dim"),),
        cost=lambda s, a: Cost(flops=2.0 * np.prod(s[1]), bytes=_nbytes(s[0], s[1])),
        doc="d_weights[t, j] = <d_out[t], y_perm[row of (t, j)]>.",
    ),
]

OPS = [c.opdef for c in CORE_OPS]
