"""The vocabulary-parallel LM head's float32 statistics under a bf16 override: its per-token loss and
log-sum-exp are float32 (as torch autocast's ``cross_entropy``, and as ``fused_lm_head_loss``), and its
backward reads them, and the loss cotangent, as they are stored. One rank (``communicator="local"``)."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.core import Model, op_registry
from kiln.core.ir import Annotation, Bundle, Graph, Module, Op, ParamSpec, TensorDecl
from kiln.core.plan import _precision, rounded_reads

ml_dtypes = pytest.importorskip("ml_dtypes", reason="the bf16 recipe needs ml_dtypes (kiln-core[bf16])")
V, C, B, T = 24, 16, 2, 6


def r(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def vocab_head_lm() -> Bundle:
    """Embedding -> the vocabulary-parallel head's loss, annotated ``@precision(compute="bf16")`` under
    the ``fp32`` recipe."""
    shapes = {"embedding": ["V", "C"], "head": ["V", "C"]}
    model = Module(
        "VocabHead", kind="model", config={"V": V, "C": C},
        params=[ParamSpec(k, s, "fp32", init={"kind": "normal", "std": 0.7}) for k, s in shapes.items()],
        forward=Graph(
            "VocabHead",
            inputs=[TensorDecl("token_ids", ["B", "T"], "int32"), TensorDecl("targets", ["B", "T"], "int32")],
            params=[TensorDecl(k, s, "fp32") for k, s in shapes.items()],
            ops=[Op("embedding", ["token_ids", "embedding"], ["x3"]),
                 Op("view", ["x3"], ["x"], {"shape": ["B * T", "C"]}),
                 Op("view", ["targets"], ["t"], {"shape": ["B * T"]}),
                 Op("vocab_parallel_lm_head_loss", ["x", "head", "t"], ["loss", "lse"],
                    {"communicator": "local"})],
            outputs=[TensorDecl("loss", ["B * T"], "fp32")]),
        annotations=[Annotation("precision", "tensor", "loss", {"compute": "bf16"})])
    return Bundle([model], entry="VocabHead")


def batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    ids = rng.integers(0, V, (B, T)).astype(np.int32)
    labels = rng.integers(0, V, (B, T)).astype(np.int32)
    labels[0, 0] = -100
    return {"input_ids": ids, "labels": labels}


def run() -> tuple[Model, dict[str, np.ndarray], dict[str, np.ndarray]]:
    model = Model.from_ir(vocab_head_lm(), seed=2)
    b = batch()
    model.feed(b)
    model.run(["forward"])
    seen = {k: model.read(k).astype(np.float64) for k in ("x", "loss", "lse")}
    seen.update(model.loss_and_grads(b["input_ids"], b["labels"])[1])
    return model, b, seen


def test_the_vocab_parallel_head_declares_its_float32_statistics() -> None:
    ops = op_registry()
    assert ops.get_op("vocab_parallel_lm_head_loss").statistics == {"loss", "lse"}
    bwd = ops.get_op("vocab_parallel_lm_head_loss_backward")  # (d_loss?, x, weight, targets, lse, d_lse?)
    assert rounded_reads(bwd, 6, lower=True) == (False, True, True, True, False, False)


def test_a_bf16_vocab_parallel_head_keeps_its_loss_and_lse_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    """``compute="bf16"`` on the head: x and the weight are read as bf16, the per-token loss and lse are
    float32 (a float64 oracle over the bf16 operands, to float32 rounding), and the weight's gradient
    is the oracle's from that float32 lse and the mean loss's cotangent 1/n (not bf16 values). The rule
    before the declaration stored the loss as bf16 and rounded lse and the cotangent on read."""
    model, b, seen = run()
    prog = model.program(B, T)
    assert prog.computes["loss"] == "bf16"
    assert prog.tensors["loss"].dtype == prog.tensors["lse"].dtype == "float32"
    xr, wr = r(seen["x"]), r(model.parameter("head"))
    z = xr @ wr.T
    lse = np.log(np.exp(z).sum(1))
    t = b["labels"].reshape(-1)
    keep = t != -100
    want = np.where(keep, lse - z[np.arange(len(t)), np.where(keep, t, 0)], 0)
    tol = 4 * 2.0 ** -24 * np.abs(lse).max()
    np.testing.assert_allclose(seen["loss"], want, rtol=0, atol=tol)
    np.testing.assert_allclose(seen["lse"], lse, rtol=0, atol=tol)
    assert np.abs(r(want[keep]) - want[keep]).max() > 100 * tol  # bf16 losses would be told apart
    # d_weight = g^T x (bf16 x), g = softmax(z) d_loss - onehot d_loss, d_loss = 1/n on kept rows
    g = np.exp(z - seen["lse"][:, None]) * np.where(keep, 1 / keep.sum(), 0)[:, None]
    g[np.flatnonzero(keep), t[keep]] -= 1 / keep.sum()
    d_w = g.T @ xr
    scale = np.abs(d_w).max()
    assert np.abs(seen["head"] - d_w).max() < 2e-6 * scale  # measured 1e-7: float32 sums

    monkeypatch.setattr(_precision, "statistic_flags", lambda opdef, n, outputs=False: (False,) * n)
    old, _, old_seen = run()
    assert old.program(B, T).tensors["loss"].dtype == "bfloat16"
    assert np.abs(old_seen["head"] - d_w).max() > 1e-3 * scale  # measured 6e-3
