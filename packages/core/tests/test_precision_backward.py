"""The backward of an op whose ``@precision`` overrides the recipe computes where its forward computes.

Autograd runs an op's backward in the precision its forward ran in: a ``Linear`` kept in fp32 under
bf16 autocast (``torch.autocast(enabled=False)``) has fp32 gradient products, and an op run in bf16 has
bf16 ones. kiln tags each backward op with the forward op it derives from (the derived backward's
``metadata["derived_from"]``), and the Program gives those steps the override's compute
(``Program.computes``).

The oracle is a float64 NumPy computation of a tiny op chain, rounded to bfloat16 with ml_dtypes where
the recipe rounds (as in ``test_precision.py``); the parity test compares with torch's CPU autocast.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest

from kiln.core import Model
from kiln.core.autodiff import derive_backward
from kiln.core.ir import Annotation, Bundle, Graph, Module, Op, ParamSpec, TensorDecl

ml_dtypes = pytest.importorskip("ml_dtypes", reason="the bf16 recipe needs ml_dtypes (kiln-core[bf16])")
V, C, M, EPS = 24, 16, 32, 1e-6


def r(x: np.ndarray) -> np.ndarray:
    """Round to bfloat16 (float64 values)."""
    return np.asarray(x, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def is_bf16(x: np.ndarray) -> np.ndarray:
    """Per element: whether it is a bfloat16 value."""
    return np.asarray(x, np.float64) == r(x)


def chain(*a_anns: Annotation) -> Bundle:
    """embedding -> rmsnorm -> ``a = h @ w1^T`` (annotated with ``a_anns``) -> silu -> matmul w2 ->
    residual add -> LM-head loss."""
    n = ["B * T"]
    shapes = {"embedding": ["V", "C"], "norm": ["C"], "w1": ["M", "C"], "w2": ["C", "M"], "head": ["V", "C"]}
    init = {"kind": "normal", "std": 0.5}
    model = Module(
        "Chain", kind="model", config={"V": V, "C": C, "M": M},
        params=[ParamSpec(k, s, "fp32", init=init if k != "norm" else {"kind": "ones"})
                for k, s in shapes.items()],
        forward=Graph(
            "Chain",
            inputs=[TensorDecl("token_ids", ["B", "T"], "int32"), TensorDecl("targets", ["B", "T"], "int32")],
            params=[TensorDecl(k, s, "fp32") for k, s in shapes.items()],
            ops=[Op("embedding", ["token_ids", "embedding"], ["x3"]),
                 Op("view", ["x3"], ["x"], {"shape": [*n, "C"]}),
                 Op("rmsnorm", ["x", "norm"], ["h", "rstd"], {"eps": EPS}),
                 Op("matmul", ["h", "w1"], ["a"], {"transpose": "NT"}),
                 Op("silu", ["a"], ["s"]),
                 Op("matmul", ["s", "w2"], ["b"], {"transpose": "NT"}),
                 Op("add", ["x", "b"], ["y"]),
                 Op("view", ["targets"], ["t"], {"shape": n}),
                 Op("fused_lm_head_loss", ["y", "head", "t"], ["loss", "lse"])],
            outputs=[TensorDecl("loss", n, "fp32")]),
        annotations=[attrs.evolve(a, target="a") for a in a_anns])
    return Bundle([model], entry="Chain")


def batch(seed: int, b: int, t: int) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(seed).integers(0, V, (b, t + 1))
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def precision(**args: Any) -> Annotation:
    return Annotation("precision", "tensor", "a", args)


def oracle(p: dict[str, np.ndarray], ids: np.ndarray, labels: np.ndarray, recipe: str,
           a_low: bool) -> dict[str, np.ndarray]:
    """The chain's loss and weight gradients in float64, rounded to bf16 where the recipe puts it, the op
    computing ``a`` (forward and backward) in bf16 when ``a_low`` and in fp32 otherwise."""
    p = {k: v.astype(np.float64) for k, v in p.items()}
    low = recipe == "bf16"
    lo = r if low else (lambda v: v)  # rounding at a point of the recipe
    x = p["embedding"][ids.reshape(-1)]
    rstd = 1 / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + EPS)
    h = x * rstd * p["norm"]
    a = r(r(h) @ r(p["w1"]).T) if a_low else h @ p["w1"].T
    sig = 1 / (1 + np.exp(-a))
    s = r(a * sig) if a_low else a * sig  # silu promotes: bf16 in, bf16 out
    b = lo(lo(s) @ lo(p["w2"]).T)
    y = x + b
    z = lo(lo(y) @ lo(p["head"]).T)
    t = labels.reshape(-1)
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    g = np.exp(z - lse[:, None])
    g[np.arange(len(t)), t] -= 1
    g = lo(g / len(t))
    d_b = lo(g @ lo(p["head"]))
    d_s = lo(d_b @ lo(p["w2"]))
    d_a = d_s * sig * (1 + a * (1 - sig))  # silu's backward promotes: fp32 here (d_s or a is fp32)
    d_w1 = r(r(d_a).T @ r(h)) if a_low else d_a.T @ h
    return {"loss": np.float64(np.mean(lse - z[np.arange(len(t)), t])), "head": lo(g.T @ lo(y)),
            "w2": lo(d_b.T @ lo(s)), "w1": d_w1}


def test_derived_backward_records_the_forward_op_of_each_rule_op() -> None:
    res = derive_backward(chain().module("Chain").forward)
    derived = dict(res.backward.metadata["derived_from"])
    by_out = {op.outputs[0]: op for op in res.backward.ops}
    assert {k for k, v in derived.items() if v == "a"} == {"d_h", "d_w1"}  # the two products of a's matmul
    assert all(by_out[k].type == "matmul" for k, v in derived.items() if v == "a")
    assert derived["d_a"] == "s" and by_out["d_a"].type == "silu_backward"
    assert set(derived) <= set(by_out) and "d_x" not in derived  # the gradients' sum derives from no op


CASES = [  # (recipe, annotation of a, where a's op computes: its forward and backward)
    ("bf16", precision(policy="fp32"), "fp32"),  # one Linear kept in fp32 under bf16 autocast
    ("bf16", precision(compute="fp32"), "fp32"),
    ("fp32", precision(compute="bf16"), "bf16"),  # one op in bf16 under fp32
    ("fp32", precision(policy="bf16"), "bf16"),
]


@pytest.mark.parametrize(("recipe", "ann", "compute"), CASES)
def test_backward_steps_of_an_overridden_op_compute_where_its_forward_does(recipe: str, ann: Annotation,
                                                                          compute: str) -> None:
    m = Model.from_ir(chain(ann), seed=1, precision=recipe)
    prog = m.program(2, 12)
    steps = {st.outputs[0]: st for st in prog.steps if st.outputs}
    assert {k: v for k, v in prog.computes.items() if steps[k].phase == "backward"} == {"d_h": compute,
                                                                                       "d_w1": compute}
    assert prog.computes["a"] == compute
    assert ("d_h" in prog.rounded) == (compute == "bf16")

    b = batch(3, 2, 12)
    want = oracle(m.parameters(), b["input_ids"], b["labels"], recipe, compute == "bf16")
    loss, grads = m.loss_and_grads(b["input_ids"], b["labels"])
    assert loss == pytest.approx(float(want["loss"]), rel=1e-5)
    low = recipe == "bf16"
    for name in ("head", "w2"):  # the recipe's products: bf16 values under bf16, fp32 under fp32
        assert is_bf16(grads[name]).all() == low
        np.testing.assert_allclose(grads[name], want[name], rtol=0, atol=1e-2 * np.abs(want[name]).max())
    w1 = grads["w1"]
    if compute == "bf16":  # the backward's products on bf16 operands, rounded: one bf16 step at most
        assert is_bf16(w1).all()
        ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(want["w1"]), 1e-30))) - 7)
        assert np.all(np.abs(w1 - want["w1"]) <= 1.0001 * ulp) and np.mean(w1 == want["w1"]) > 0.9
    else:  # fp32 products of fp32 operands: not rounded to bf16 (the recipe would round each element)
        assert is_bf16(w1).mean() < 0.1
        rel = np.abs(w1 - want["w1"]) / np.abs(want["w1"]).max()
        rounded = np.abs(r(want["w1"]) - want["w1"]) / np.abs(want["w1"]).max()
        assert np.median(rel) < np.median(rounded) / 10, (np.median(rel), np.median(rounded))


def test_an_output_dtype_alone_leaves_the_backward_to_the_recipe() -> None:
    """``@dtype`` names the type of the forward's tensor; where the op computes is the recipe's, and so
    is where its backward computes."""
    bundle = chain(Annotation("dtype", "tensor", "a", {"type": "fp32"}))
    prog = Model.from_ir(bundle, precision="bf16").program(2, 4)
    assert prog.computes == {"a": "bf16"} and "a" not in prog.rounded
    assert {"d_h", "d_w1"} <= prog.rounded  # the recipe's bf16 matmuls


@pytest.mark.parity
def test_fp32_linear_under_bf16_autocast_matches_torch() -> None:
    """The chain in torch under ``torch.autocast("cpu", dtype=torch.bfloat16)`` with the Linear of ``a``
    under ``torch.autocast("cpu", enabled=False)``: its gradient products are fp32 (``w1.grad`` holds no
    bf16 rounding), the other Linears' are bf16. kiln with ``@precision(policy="fp32")`` on ``a`` under
    ``precision="bf16"`` gives the same gradients (to float32 summation order, which moves an element
    of a bf16 product by one bf16 step at most)."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    model = Model.from_ir(chain(precision(policy="fp32")), seed=4, precision="bf16")
    b = batch(5, 3, 10)
    ids, labels = torch.from_numpy(b["input_ids"]).long(), torch.from_numpy(b["labels"]).long()
    p = {k: torch.nn.Parameter(torch.from_numpy(v)) for k, v in model.parameters().items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x = F.embedding(ids, p["embedding"]).reshape(-1, C)
        h = p["norm"] * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS))
        with torch.autocast("cpu", enabled=False):
            a = F.linear(h, p["w1"])
        y = x + F.linear(F.silu(a), p["w2"])
        loss = F.cross_entropy(F.linear(y, p["head"]), labels.reshape(-1))
    assert a.dtype == torch.float32
    loss.backward()
    kiln_loss, grads = model.loss_and_grads(b["input_ids"], b["labels"])
    assert kiln_loss == pytest.approx(loss.item(), rel=1e-5)
    want = {k: v.grad.double().numpy() for k, v in p.items()}
    assert is_bf16(want["w2"]).all() and is_bf16(want["w1"]).mean() < 0.1  # what autocast does
    assert is_bf16(grads["w2"]).all() and is_bf16(grads["w1"]).mean() < 0.1  # what kiln does
    for name in ("head", "w2", "w1", "norm", "embedding"):
        np.testing.assert_allclose(grads[name], want[name], rtol=0, atol=8e-3 * np.abs(want[name]).max(),
                                   err_msg=name)
    rel = np.abs(grads["w1"] - want["w1"]) / np.abs(want["w1"]).max()
    assert np.median(rel) < 1e-4  # fp32 products: far nearer than one bf16 step (2**-8)
