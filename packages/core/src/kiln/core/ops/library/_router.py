"""``moe_router``: routing in one op (seed 004 §6.9.1), with transformers' load-balancing loss.

``probs = softmax(x @ gate^T)`` (or ``sigmoid`` with ``use_sigmoid``), then the ``moe_topk`` of
:mod:`._moe`, then ``aux_loss = aux_loss_coef * E * sum_e (assignments to e / N) * mean_n probs[n, e]``:
transformers' ``load_balancing_loss_func`` (Mixtral, Qwen3-MoE) scaled by its coefficient. The
assignment counts are piecewise constant, so the loss's gradient flows through ``mean_n probs``.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from kiln.core.ir._ir import TensorType
from kiln.core.ops._ops import AttrSpec, BackwardContext, Cost, InferContext, Sample
from kiln.core.ops.library._common import check_same, core_op, randn
from kiln.core.ops.library._moe import (
    _ROUTER_ATTRS,
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


_ROUTING_ATTRS = (AttrSpec("normalize", "bool", True), AttrSpec("aux_loss_coef", "float", 0.01),
                  AttrSpec("use_sigmoid", "bool", False))

CORE_OPS = [
    core_op(
        "moe_router", ("x", "gate"), ("weights", "indices", "aux_loss"), _router, _router_infer,
        backward=_router_backward, attrs=(AttrSpec("top_k", "int"), *_ROUTING_ATTRS), samples=_router_samples,
        cost=lambda s, a: Cost(flops=2.0 * s[0][0] * s[0][1] * s[1][0], bytes=_nbytes(s[0], s[1])),
        flop_heavy=True,
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
        doc="d_logits [N, E] of moe_router from d_weights and d_aux_loss (either may be absent).",
    ),
]

OPS = [c.opdef for c in CORE_OPS]
