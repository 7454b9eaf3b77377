"""Vocabulary parallelism (Megatron-LM's): rank ``r`` of ``n`` holds rows ``[r V/n, (r+1) V/n)`` of
the embedding and of the LM head.

- ``vocab_parallel_embedding`` looks up the token ids that fall in the rank's rows and gives zeros
  for the others; the ``tp_all_reduce`` after it sums the ranks' parts into the whole embedding.
- ``vocab_parallel_lm_head_loss`` is ``fused_lm_head_loss`` on the rank's logits ``x @ w_r^T``: the
  row maxima are all-gathered (the global maximum), then the sums of ``exp(z - max)`` and each row's
  target logit (from the rank whose rows hold the target, 0 on the others) are summed over the
  ranks in one all-reduce. Every rank ends with the whole loss and log-sum-exp. Its backward needs
  no collective: each rank's logits' gradient gives its rows of ``d_weight`` and its part of
  ``d_x``, which the ``tp_copy`` before the op sums over the ranks.

The rank's rows start at ``rank * rows``, ``rank`` being the communicator's (read when the kernel
runs), so a rank's IR is every rank's. A vocabulary ``V`` the ranks cannot share is padded (as
Megatron-LM pads it): ``rows = ceil(V / n)``, and the ops' ``vocab_size`` attribute (``V``) makes the
padding rows' logits ``-inf`` (no probability, no gradient). ``vocab_parallel_logits`` all-gathers
the rank's logits into the whole vocabulary's (``Model.logits``).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from kiln.core import (
    AttrSpec,
    BackwardContext,
    InferContext,
    KilnError,
    OpDef,
    OpError,
    Sample,
    TensorType,
    get_registry,
)
from kiln.core.ir import is_float
from kiln.core.runtime import Communicator

__all__ = ["VOCAB_OPS"]


def _comm(name: str) -> Communicator:
    comm: Communicator = get_registry("communicators")[name]
    return comm


def _local(ids: np.ndarray, rows: int, communicator: str, op: str,
           ignore: int | None = None, vocab: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The ids relative to this rank's first row, and where they fall in its rows; an id outside the
    whole vocabulary (``vocab``, else every rank's rows) is an error naming the op."""
    comm = _comm(communicator)
    size = rows * comm.world_size if vocab is None else vocab
    live = ids if ignore is None else ids[ids != ignore]
    bad = live[(live < 0) | (live >= size)]
    if bad.size:
        raise OpError(f"op {op!r}: index {bad[0]} is outside [0, {size})", op=op)
    rel = ids - comm.rank * rows
    mine = (rel >= 0) & (rel < rows)
    if ignore is not None:
        mine &= ids != ignore
    return rel, mine


# --- embedding -----------------------------------------------------------------------------------


def _embedding(ids: np.ndarray, weight: np.ndarray, *, communicator: str,
               padding_idx: int | None = None, vocab_size: int | None = None) -> np.ndarray:
    rel, mine = _local(ids, weight.shape[0], communicator, "vocab_parallel_embedding", vocab=vocab_size)
    out: np.ndarray = np.zeros((*ids.shape, weight.shape[1]), weight.dtype)
    out[mine] = weight[rel[mine]]
    return out


def _embedding_infer(ctx: InferContext) -> list[TensorType]:
    w = ctx.shape(1)
    if len(w) != 2:
        raise ctx.fail(f"weight must be [rows, C], found rank {len(w)}")
    return [TensorType((*ctx.shape(0), w[1]), ctx.dtype(1))]


def _embedding_backward(d_out: np.ndarray, ids: np.ndarray, *, communicator: str, num_embeddings: int,
                        padding_idx: int | None = None, vocab_size: int | None = None) -> np.ndarray:
    rel, mine = _local(ids, num_embeddings, communicator, "vocab_parallel_embedding_backward",
                       vocab=vocab_size)
    if padding_idx is not None:  # that row gets no gradient, on the rank that holds it
        mine &= ids != padding_idx
    dw = np.zeros((num_embeddings, d_out.shape[-1]), d_out.dtype)
    np.add.at(dw, rel[mine], d_out[mine])
    return dw


def _embedding_rule(ctx: BackwardContext) -> list[str | None]:
    if not ctx.needs_grad(1) or ctx.d_out is None:
        return [None, None]
    return [None, ctx.emit("vocab_parallel_embedding_backward", ctx.d_out, ctx.saved(0),
                           communicator=ctx.attrs["communicator"], num_embeddings=ctx.shape_of(1)[0],
                           padding_idx=ctx.attrs.get("padding_idx"), vocab_size=ctx.attrs.get("vocab_size"))]


def _embedding_samples(rng: np.random.Generator) -> Iterator[Sample]:
    """On one rank (``local``), the plain embedding."""
    yield Sample((np.array([[1, 4, 1, 0, 6], [4, 4, 2, 1, 3]]), rng.standard_normal((7, 4))),
                 {"communicator": "local"})
    yield Sample((rng.integers(0, 5, (2, 2, 3)), rng.standard_normal((5, 3))), {"communicator": "local"})


# --- LM head and cross-entropy -------------------------------------------------------------------


def _logits(x: np.ndarray, w: np.ndarray, softcap: float | None, communicator: str,
            vocab: int | None) -> tuple[np.ndarray, np.ndarray | None]:
    """The rank's logits, and (soft-capped) ``tanh(raw / softcap)`` for the backward; the padding rows
    past ``vocab`` (when the ranks' rows hold more) give ``-inf``: no probability, no gradient."""
    z = x @ w.T
    th = None
    if softcap is not None:
        th = np.tanh(z / softcap)
        z = th * softcap
    if vocab is not None:
        real = vocab - _comm(communicator).rank * w.shape[0]
        z[:, max(real, 0):] = -np.inf
    return z, th


def _loss(x: np.ndarray, weight: np.ndarray, targets: np.ndarray, *, communicator: str, ignore_index: int,
          softcap: float | None, vocab_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    comm = _comm(communicator)
    dtype = np.result_type(x, weight)
    rows = weight.shape[0]
    rel, mine = _local(targets, rows, communicator, "vocab_parallel_lm_head_loss", ignore_index, vocab_size)
    z, _ = _logits(x.astype(dtype, copy=False), weight.astype(dtype, copy=False), softcap, communicator,
                   vocab_size)
    n = z.shape[0]
    maxima = np.empty(comm.world_size * n, dtype)
    comm.all_gather(np.ascontiguousarray(z.max(axis=1)), maxima)
    m = maxima.reshape(comm.world_size, n).max(axis=0)
    sums = np.zeros(2 * n, dtype)  # sum of exp(z - m) | the target's logit
    sums[:n] = np.exp(z - m[:, None]).sum(axis=1)
    picked = np.flatnonzero(mine)
    sums[n + picked] = z[picked, rel[picked]]
    comm.all_reduce(sums)
    lse = m + np.log(sums[:n])
    return np.where(targets != ignore_index, lse - sums[n:], 0).astype(dtype), lse.astype(dtype)


def _loss_infer(ctx: InferContext) -> list[TensorType]:
    x, w = ctx.shape(0), ctx.shape(1)
    if len(x) != 2 or len(w) != 2:
        raise ctx.fail(f"x must be [N, C] and weight [rows, C], found ranks {len(x)} and {len(w)}")
    if is_float(ctx.dtype(2)):
        raise ctx.fail(f"targets must be an integer tensor, found {ctx.dtype(2)}")
    return [TensorType(x[:1], "fp32")] * 2


def _loss_backward(d_loss: np.ndarray | None, x: np.ndarray, weight: np.ndarray, targets: np.ndarray,
                   lse: np.ndarray, d_lse: np.ndarray | None, *, communicator: str, ignore_index: int,
                   softcap: float | None, vocab_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """This rank's part of ``d_x`` and its rows of ``d_weight``:
    ``d z = softmax(z) (d_loss + d_lse) - onehot(target) d_loss`` on its columns."""
    dtype = np.result_type(x, weight)
    x, weight = x.astype(dtype, copy=False), weight.astype(dtype, copy=False)
    rel, mine = _local(targets, weight.shape[0], communicator, "vocab_parallel_lm_head_loss_backward",
                       ignore_index, vocab_size)
    live = targets != ignore_index
    dl = np.where(live, 0 if d_loss is None else d_loss, 0).astype(dtype)
    dlse = np.zeros_like(dl) if d_lse is None else d_lse.astype(dtype)
    z, th = _logits(x, weight, softcap, communicator, vocab_size)
    g = np.exp(z - lse[:, None]) * (dl + dlse)[:, None]
    picked = np.flatnonzero(mine)
    g[picked, rel[picked]] -= dl[picked]
    if th is not None:
        g *= 1 - th * th
    return g @ weight, g.T @ x


def _loss_backward_infer(ctx: InferContext) -> list[TensorType]:
    return [TensorType(ctx.shape(1), ctx.dtype(1)), TensorType(ctx.shape(2), ctx.dtype(2))]


_HEAD_KEYS = ("communicator", "ignore_index", "softcap", "vocab_size")


def _loss_rule(ctx: BackwardContext) -> list[str | None]:
    d_loss, d_lse = ctx.d_outputs
    if not (ctx.needs_grad(0) or ctx.needs_grad(1)) or d_loss is d_lse is None:
        return [None, None, None]
    dx, dw = ctx.emit("vocab_parallel_lm_head_loss_backward", d_loss, ctx.saved(0), ctx.saved(1),
                      ctx.saved(2), ctx.saved_output(1), d_lse, **{k: ctx.attrs[k] for k in _HEAD_KEYS})
    return [dx if ctx.needs_grad(0) else None, dw if ctx.needs_grad(1) else None, None]


def _loss_samples(rng: np.random.Generator) -> Iterator[Sample]:
    """On one rank (``local``), ``fused_lm_head_loss``."""
    targets = np.array([3, -100, 10, 0, 7, -100])
    yield Sample((rng.standard_normal((6, 4)), rng.standard_normal((11, 4)), targets),
                 {"communicator": "local"})
    yield Sample((rng.standard_normal((6, 4)), rng.standard_normal((11, 4)), targets),
                 {"communicator": "local", "softcap": 2.0})
    # rows 9 and 10 pad a vocabulary of 9 (as the last rank's rows may)
    below = np.array([3, -100, 8, 0, 7, -100])
    yield Sample((rng.standard_normal((6, 4)), rng.standard_normal((11, 4)), below),
                 {"communicator": "local", "vocab_size": 9})


def _loss_backward_samples(rng: np.random.Generator) -> Iterator[Sample]:
    for s in _loss_samples(rng):
        x, w, targets = s.inputs
        assert x is not None and w is not None and targets is not None
        attrs = {"ignore_index": -100, "softcap": None, "vocab_size": None, **s.attrs}
        _, lse = _loss(x, w, targets, **attrs)
        for d_loss, d_lse in ((rng.standard_normal(6), None), (None, rng.standard_normal(6)),
                              (rng.standard_normal(6), rng.standard_normal(6))):
            yield Sample((d_loss, x, w, targets, lse, d_lse), s.attrs)


def _gathered_logits(x: np.ndarray, weight: np.ndarray, *, communicator: str, softcap: float | None = None,
                     vocab_size: int | None = None) -> np.ndarray:
    """The whole vocabulary's logits on every rank: each rank's ``x @ w_r^T`` all-gathered, in rank
    order, less the padding rows."""
    comm = _comm(communicator)
    z, _ = _logits(x, weight, softcap, communicator, None)
    n, rows = z.shape
    parts = np.empty(comm.world_size * n * rows, z.dtype)
    comm.all_gather(np.ascontiguousarray(z).reshape(-1), parts)
    out: np.ndarray = parts.reshape(comm.world_size, n, rows).transpose(1, 0, 2).reshape(n, -1)
    return out if vocab_size is None else out[:, :vocab_size]


def _gathered_infer(ctx: InferContext) -> list[TensorType]:
    x, w = ctx.shape(0), ctx.shape(1)
    if len(x) != 2 or len(w) != 2:
        raise ctx.fail(f"x must be [N, C] and weight [rows, C], found ranks {len(x)} and {len(w)}")
    vocab = ctx.attrs.get("vocab_size")
    whole = w[0] * _comm(ctx.attrs["communicator"]).world_size if vocab is None else vocab
    return [TensorType((x[0], whole), ctx.dtype(1))]


def _gathered_samples(rng: np.random.Generator) -> Iterator[Sample]:
    """On one rank (``local``), ``x @ weight^T`` (less the padding rows past ``vocab_size``)."""
    yield Sample((rng.standard_normal((5, 4)), rng.standard_normal((7, 4))), {"communicator": "local"})
    yield Sample((rng.standard_normal((5, 4)), rng.standard_normal((7, 4))),
                 {"communicator": "local", "vocab_size": 6})


_COMM = AttrSpec("communicator", "str")
_PADDING = AttrSpec("padding_idx", "int", None)
#: the whole vocabulary, when the ranks' rows hold padding rows past it (None: they hold it exactly)
_VOCAB = AttrSpec("vocab_size", "int", None)
_HEAD_ATTRS = (_COMM, AttrSpec("ignore_index", "int", -100), AttrSpec("softcap", "float", None), _VOCAB)

VOCAB_OPS = [
    OpDef("vocab_parallel_logits", ("x", "weight"), ("logits",), _gathered_logits, _gathered_infer,
          attrs=(_COMM, AttrSpec("softcap", "float", None), _VOCAB), samples=_gathered_samples,
          collective=True,
          doc="The logits of the whole vocabulary on every rank (Model.logits of a vocabulary-parallel "
              "model): each rank's x @ weight^T all-gathered, the padding rows past vocab_size dropped."),
    OpDef("vocab_parallel_embedding", ("token_ids", "weight"), ("out",), _embedding, _embedding_infer,
          backward=_embedding_rule, attrs=(_COMM, _PADDING, _VOCAB), samples=_embedding_samples,
          nondiff_inputs={0},
          doc="This rank's part of embedding(token_ids, whole weight): the rows of ids in its share of the "
              "vocabulary (rank * rows onwards), zeros for the others."),
    OpDef("vocab_parallel_embedding_backward", ("d_out", "token_ids"), ("d_weight",), _embedding_backward,
          lambda ctx: [TensorType((ctx.attrs["num_embeddings"], ctx.shape(0)[-1]), ctx.dtype(0))],
          attrs=(_COMM, AttrSpec("num_embeddings", "dim"), _PADDING, _VOCAB), nondiff_inputs={1},
          doc="d_weight of vocab_parallel_embedding: this rank's rows of the scatter-add."),
    OpDef("vocab_parallel_lm_head_loss", ("x", "weight", "targets"), ("loss", "lse"), _loss, _loss_infer,
          backward=_loss_rule, attrs=_HEAD_ATTRS, samples=_loss_samples, nondiff_inputs={2}, collective=True,
          logits="vocab_parallel_logits", statistics={"loss", "lse"},
          doc="fused_lm_head_loss with the LM head's rows split over the ranks: the row maxima all-gathered, "
              "the sums of exp and the target logits all-reduced; every rank gets the whole loss and lse."),
    OpDef("vocab_parallel_lm_head_loss_backward", ("d_loss?", "x", "weight", "targets", "lse", "d_lse?"),
          ("d_x", "d_weight"), _loss_backward, _loss_backward_infer, attrs=_HEAD_ATTRS, nondiff_inputs={3},
          samples=_loss_backward_samples, statistics={"d_loss", "lse", "d_lse"},
          doc="This rank's part of d_x (summed over the ranks by tp_copy) and its rows of d_weight."),
]


def check_vocab(rows: int, world: int, model: str) -> int:
    """The rows of the vocabulary one of ``world`` ranks holds: ``ceil(rows / world)``, the last
    ranks' past ``rows`` being padding rows (as Megatron-LM pads the vocabulary); a vocabulary smaller
    than the ranks is an error naming the model."""
    if rows < world:
        raise KilnError(f"model {model!r}: vocab_size = {rows} is smaller than the {world} tensor-parallel "
                        "ranks (the embedding and the LM head are split by rows)")
    return -(-rows // world)
