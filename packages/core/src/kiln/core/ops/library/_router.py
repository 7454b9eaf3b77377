"""``moe_router``: routing in one op (seed 004 §6.9.1), with transformers' load-balancing loss; and the
same loss over a whole model's MoE layers (``moe_load_stats`` per layer, ``moe_aux_loss`` once).

``probs = softmax(x @ gate^T)`` (or ``sigmoid`` with ``use_sigmoid``), then the ``moe_topk`` of
:mod:`._moe`, then ``aux_loss = aux_loss_coef * E * sum_e (assignments to e / N) * mean_n probs[n, e]``:
transformers' ``load_balancing_loss_func`` (Mixtral, Qwen3-MoE) scaled by its coefficient. The
assignment counts are piecewise constant, so the loss's gradient flows through ``mean_n probs``.

Over L layers transformers pools the layers' rows before the product: ``aux = E * sum_e load_e *
prob_e`` with ``load_e`` the mean over layers of each layer's ``assignments to e / N`` and ``prob_e`` the
mean over layers of ``mean_n probs[n, e]`` (rows of padding, ``segment_ids == 0``, left out, as its
``attention_mask`` does). ``moe_load_stats`` gives one layer's two vectors; a model sums them over its
layers and ``moe_aux_loss`` adds ``coef * aux`` to the mean loss.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from kiln.core._errors import OpError
from kiln.core.ir._ir import TensorType
from kiln.core.ops._ops import AttrSpec, BackwardContext, Cost, InferContext, Sample
from kiln.core.ops.library._common import check_same, core_op, randn
from kiln.core.ops.library._moe import (
    _ROUTER_ATTRS,
    _check_int,
    _check_rank,
    _nbytes,
    _sigmoid,
    _sigmoid_backward,
    _softmax,
    _softmax_backward,
    _topk,
    _topk_backward_kernel,
    _topk_infer,
)


def _router_probs(x: np.ndarray, gate: np.ndarray, use_sigmoid: bool) -> np.ndarray:
    logits = x @ gate.T
    return _sigmoid(logits) if use_sigmoid else _softmax(logits)


def _router(x: np.ndarray, gate: np.ndarray, *, top_k: int, normalize: bool, aux_loss_coef: float,
            use_sigmoid: bool) -> tuple[np.ndarray, ...]:
    probs = _router_probs(x, gate, use_sigmoid)
    weights, indices = _topk(probs, k=top_k, normalize=normalize)
    n, e = probs.shape
    # transformers' load_balancing_loss_func: E * sum_e (assignments to e / N) * mean_n probs[n, e]
    count = np.bincount(indices.ravel(), minlength=e)
    aux = aux_loss_coef * e * np.sum(count / n * probs.mean(axis=0))
    return weights, indices, np.asarray(aux, dtype=probs.dtype)


def _router_infer(ctx: InferContext) -> list[TensorType]:
    _check_rank(ctx, 0, 2, "x")
    _check_rank(ctx, 1, 2, "gate")
    (n, c), (e, cg) = ctx.shape(0), ctx.shape(1)
    check_same(ctx, (c,), (cg,), "x's last dim and gate's input dim differ")
    probs = TensorType((n, e), "fp32")
    weights, indices = _topk_infer(InferContext(ctx.op, (probs,), {"k": ctx.attrs["top_k"]}))
    return [weights, indices, TensorType((), "fp32")]


_ROUTING = ("normalize", "aux_loss_coef", "use_sigmoid")


def _router_backward(ctx: BackwardContext) -> list[str | None]:
    d_weights, _, d_aux = ctx.d_outputs
    if (d_weights is None and d_aux is None) or not (ctx.needs_grad(0) or ctx.needs_grad(1)):
        return [None, None]
    routing = {k: ctx.attrs[k] for k in _ROUTING}
    d_logits = ctx.emit("moe_router_backward", d_weights, d_aux, ctx.saved(0), ctx.saved(1),
                        ctx.saved_output(1), dtype=ctx.type_of(0).dtype, **routing)
    dx = ctx.emit("matmul", d_logits, ctx.saved(1)) if ctx.needs_grad(0) else None  # [N, E] @ [E, C]
    d_gate = ctx.emit("matmul", d_logits, ctx.saved(0), transpose="TN") if ctx.needs_grad(1) else None
    return [dx, d_gate]


def _router_backward_kernel(d_weights: np.ndarray | None, d_aux: np.ndarray | None, x: np.ndarray,
                            gate: np.ndarray, indices: np.ndarray, *, normalize: bool, aux_loss_coef: float,
                            use_sigmoid: bool, dtype: object) -> np.ndarray:
    probs = _router_probs(x, gate, use_sigmoid)
    n, e = probs.shape
    d_probs = np.zeros_like(probs) if d_weights is None else \
        _topk_backward_kernel(d_weights, probs, indices, normalize=normalize)
    if d_aux is not None:  # d aux / d probs[n, e] = coef * E * count_e / N^2
        d_probs = d_probs + d_aux * aux_loss_coef * e * np.bincount(indices.ravel(), minlength=e) / n**2
    grad = _sigmoid_backward if use_sigmoid else _softmax_backward
    return grad(d_probs, probs, dtype=dtype)


def _router_samples(rng: np.random.Generator) -> Iterator[Sample]:
    # Logits whose top experts are well separated, so finite differences never change the selection.
    for k, normalize, use_sigmoid in ((2, True, False), (1, False, False), (2, False, True)):
        x = randn(rng, 5, 3)
        ranks = np.stack([rng.permutation(6) for _ in range(5)]) * 0.8
        gate = np.linalg.lstsq(x, ranks, rcond=None)[0].T + 0.01 * randn(rng, 6, 3)
        yield Sample((x, gate), {"top_k": k, "normalize": normalize, "use_sigmoid": use_sigmoid,
                                 "aux_loss_coef": 0.1})


# --- the load-balancing loss over a model's layers -------------------------------------------------


def _row_mask(segment_ids: np.ndarray | None, n: int) -> tuple[np.ndarray, float]:
    """The rows that count (not padding) as floats, and how many there are."""
    m = np.ones(n) if segment_ids is None else (np.asarray(segment_ids).reshape(-1) != 0).astype(np.float64)
    return m, float(m.sum())


def _load_stats(probs: np.ndarray, indices: np.ndarray,
                segment_ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    n, e = probs.shape
    m, rows = _row_mask(segment_ids, n)
    if segment_ids is not None and np.size(segment_ids) != n:
        raise OpError(f"op 'moe_load_stats': segment_ids has {np.size(segment_ids)} entries for {n} rows",
                      op="moe_load_stats")
    flat = indices.astype(np.intp)
    if flat.size and (flat.min() < 0 or flat.max() >= e):
        raise OpError(f"op 'moe_load_stats': expert indices must lie in 0..{e - 1}, found "
                      f"{flat.min()}..{flat.max()}", op="moe_load_stats", code="E004")
    dt = probs.dtype
    counts = np.zeros(e)
    np.add.at(counts, flat, np.broadcast_to(m[:, None], flat.shape))
    denom = max(rows, 1.0)
    return (counts / denom).astype(dt), ((m @ probs) / denom).astype(dt)


def _load_stats_infer(ctx: InferContext) -> list[TensorType]:
    _check_rank(ctx, 0, 2, "probs")
    _check_rank(ctx, 1, 2, "indices")
    _check_int(ctx, 1, "indices")
    n, e = ctx.shape(0)
    check_same(ctx, (n,), ctx.shape(1)[:1], "probs and indices have different row counts")
    if len(ctx.inputs) > 2 and ctx.inputs[2] is not None:
        _check_rank(ctx, 2, 1, "segment_ids")
        _check_int(ctx, 2, "segment_ids")
        check_same(ctx, ctx.shape(2), (n,), "segment_ids must have one entry per row of probs")
    return [TensorType((e,), "fp32")] * 2


def _load_stats_backward(ctx: BackwardContext) -> list[str | None]:
    none: list[str | None] = [None] * (len(ctx.inputs) - 1)
    if not ctx.needs_grad(0) or ctx.d_outputs[1] is None:  # the load is piecewise constant
        return [None, *none]
    seg = ctx.saved(2) if len(ctx.inputs) > 2 and ctx.inputs[2] else None
    return [ctx.emit("moe_load_stats_backward", ctx.d_outputs[1], ctx.saved(0), seg), *none]


def _load_stats_bwd(d_mean: np.ndarray, probs: np.ndarray,
                    segment_ids: np.ndarray | None = None) -> np.ndarray:
    m, rows = _row_mask(segment_ids, probs.shape[0])
    out: np.ndarray = (m[:, None] / max(rows, 1.0) * d_mean[None, :]).astype(probs.dtype)
    return out


def _load_stats_samples(rng: np.random.Generator) -> Iterator[Sample]:
    probs = _softmax(randn(rng, 6, 4))
    idx = _topk(probs, k=2, normalize=False)[1]
    yield Sample((probs, idx))
    yield Sample((probs, idx, np.array([1, 1, 0, 2, 2, 0])))


def _aux(load: np.ndarray, mean_probs: np.ndarray, num_layers: int) -> np.ndarray:
    if num_layers < 1:
        raise OpError(f"op 'moe_aux_loss': num_layers must be >= 1, found {num_layers}", op="moe_aux_loss")
    e = load.shape[0]
    out: np.ndarray = e * np.sum(load * mean_probs) / num_layers**2
    return out


def _aux_loss(loss: np.ndarray, targets: np.ndarray, load: np.ndarray, mean_probs: np.ndarray, *,
              coef: float, num_layers: int, ignore_index: int) -> tuple[np.ndarray, np.ndarray]:
    aux = _aux(load, mean_probs, num_layers)
    valid = (np.asarray(targets).reshape(-1) != ignore_index).astype(loss.dtype)
    return loss + loss.dtype.type(coef * aux) * valid, np.asarray(aux, dtype=loss.dtype)


def _aux_loss_infer(ctx: InferContext) -> list[TensorType]:
    _check_rank(ctx, 0, 1, "loss")
    _check_int(ctx, 1, "targets")
    check_same(ctx, ctx.shape(1), ctx.shape(0), "targets must have one entry per entry of the loss")
    for i, what in ((2, "load"), (3, "mean_probs")):
        _check_rank(ctx, i, 1, what)
    check_same(ctx, ctx.shape(3), ctx.shape(2), "load and mean_probs differ (one entry per expert each)")
    if ctx.attrs["num_layers"] < 1:
        raise ctx.fail(f"num_layers must be >= 1, found {ctx.attrs['num_layers']}")
    return [TensorType(ctx.shape(0), ctx.dtype(0)), TensorType((), "fp32")]


def _aux_loss_backward(ctx: BackwardContext) -> list[str | None]:
    d_loss, d_aux = ctx.d_outputs
    d_probs = None
    if ctx.needs_grad(3) and (d_loss is not None or d_aux is not None):
        d_probs = ctx.emit("moe_aux_loss_backward", d_loss, d_aux, ctx.saved(1), ctx.saved(2),
                           **{k: ctx.attrs[k] for k in ("coef", "num_layers", "ignore_index")})
    return [d_loss if ctx.needs_grad(0) else None, None, None, d_probs]


def _aux_loss_bwd(d_loss: np.ndarray | None, d_aux: np.ndarray | None, targets: np.ndarray,
                  load: np.ndarray, *, coef: float, num_layers: int, ignore_index: int) -> np.ndarray:
    """d mean_probs = (coef * sum_i d_loss_i * valid_i + d_aux) * E * load / L^2."""
    total = 0.0 if d_aux is None else float(d_aux)
    if d_loss is not None:
        total += coef * float(np.sum(d_loss * (np.asarray(targets).reshape(-1) != ignore_index)))
    out: np.ndarray = (total * load.shape[0] / num_layers**2 * load).astype(load.dtype)
    return out


def _aux_loss_samples(rng: np.random.Generator) -> Iterator[Sample]:
    targets = np.array([3, -100, 0, 7, -100])
    for coef, layers in ((0.01, 1), (0.5, 3)):
        load, probs = rng.random(4), rng.random(4)
        yield Sample((randn(rng, 5), targets, load, probs), {"coef": coef, "num_layers": layers})


_AUX_ATTRS = (AttrSpec("coef", "float", 0.001), AttrSpec("num_layers", "int", 1),
              AttrSpec("ignore_index", "int", -100))


_ROUTING_ATTRS = (AttrSpec("normalize", "bool", True), AttrSpec("aux_loss_coef", "float", 0.01),
                  AttrSpec("use_sigmoid", "bool", False))

CORE_OPS = [
    core_op(
        "moe_router", ("x", "gate"), ("weights", "indices", "aux_loss"), _router, _router_infer,
        backward=_router_backward, attrs=(AttrSpec("top_k", "int"), *_ROUTING_ATTRS), samples=_router_samples,
        cost=lambda s, a: Cost(flops=2.0 * s[0][0] * s[0][1] * s[1][0], bytes=_nbytes(s[0], s[1])),
        flop_heavy=True,
        statistics={"aux_loss"},
        doc="Routing in one op: probs = softmax (or sigmoid) of x @ gate^T [N, E]; (weights, indices) = "
            "moe_topk(probs, top_k, normalize); aux_loss = aux_loss_coef * E * sum_e (assignments to e / N) "
            "* mean_n probs[n, e], transformers' load-balancing loss (fp32 scalar).",
    ),
    core_op(
        "moe_router_backward", ("d_weights?", "d_aux_loss?", "x", "gate", "indices"), ("d_logits",),
        _router_backward_kernel,
        lambda ctx: [TensorType((ctx.shape(2)[0], ctx.shape(3)[0]), ctx.attrs["dtype"])],
        attrs=(*_ROUTING_ATTRS, *_ROUTER_ATTRS),
        cost=lambda s, a: Cost(flops=2.0 * s[2][0] * s[2][1] * s[3][0], bytes=_nbytes(s[2], s[3])),
        statistics={"d_aux_loss"},
        doc="d_logits [N, E] of moe_router from d_weights and d_aux_loss (either may be absent).",
    ),
    core_op(
        "moe_load_stats", ("probs", "indices", "segment_ids?"), ("load", "mean_probs"), _load_stats,
        _load_stats_infer, backward=_load_stats_backward, samples=_load_stats_samples, nondiff_inputs={1, 2},
        cost=lambda s, a: Cost(flops=2.0 * float(np.prod(s[0])), bytes=_nbytes(*s)),
        statistics={"load", "mean_probs"},
        doc="One MoE layer's routing statistics [E] (fp32) over the rows that are not padding (segment_ids "
            "!= 0, when given): load = assignments to e / rows (top-k indices [N, K]), mean_probs = mean of "
            "probs[:, e]. The load is piecewise constant (no gradient).",
    ),
    core_op(
        "moe_load_stats_backward", ("d_mean_probs", "probs", "segment_ids?"), ("d_probs",), _load_stats_bwd,
        lambda ctx: [TensorType(ctx.shape(1), ctx.dtype(1))],
        cost=lambda s, a: Cost(flops=float(np.prod(s[1])), bytes=_nbytes(*s)),
        statistics={"d_mean_probs"},
        doc="d_probs [N, E] of moe_load_stats: d_mean_probs[e] / rows on every row that counts.",
    ),
    core_op(
        "moe_aux_loss", ("loss", "targets", "load", "mean_probs"), ("loss_out", "aux_loss"), _aux_loss,
        _aux_loss_infer, backward=_aux_loss_backward, samples=_aux_loss_samples, attrs=_AUX_ATTRS,
        nondiff_inputs={1, 2}, cost=lambda s, a: Cost(flops=2.0 * float(np.prod(s[0])), bytes=_nbytes(*s)),
        statistics={"loss", "load", "mean_probs", "loss_out", "aux_loss"},
        doc="transformers' load-balancing loss of L MoE layers added to a per-token loss [N]: aux_loss = E * "
            "sum_e (load_e / L) * (mean_probs_e / L) (load and mean_probs summed over the layers' "
            "moe_load_stats); loss_out = loss + coef * aux_loss on every token whose target is not "
            "ignore_index, so the mean loss over those tokens grows by coef * aux_loss.",
    ),
    core_op(
        "moe_aux_loss_backward", ("d_loss_out?", "d_aux_loss?", "targets", "load"), ("d_mean_probs",),
        _aux_loss_bwd, lambda ctx: [TensorType(ctx.shape(3), ctx.dtype(3))], attrs=_AUX_ATTRS,
        cost=lambda s, a: Cost(flops=2.0 * float(np.prod(s[2])), bytes=_nbytes(*s)),
        statistics={"d_loss_out", "d_aux_loss", "load", "d_mean_probs"},
        doc="d_mean_probs [E] of moe_aux_loss: (coef * sum of d_loss_out over counted tokens + d_aux_loss) "
            "* E * load / L^2.",
    ),
]

OPS = [c.opdef for c in CORE_OPS]
