"""The ``bf16`` precision recipe on the NumPy backend (ml_dtypes rounding at autocast's points).

The oracle is a float64 NumPy computation of a tiny op chain, written here from the recipe's
definition (``kiln.core.plan._precision``) and rounded to bfloat16 with ml_dtypes at those points.
It accumulates in float64, kiln in float32: the two round the same value to bfloat16 except when a
float32 sum lands within its own error of a bfloat16 rounding boundary, so nearly every element is
exactly equal and none is more than one bfloat16 step apart.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from kiln_core_tiny import random_batch, tiny_qwen3_bundle

from kiln.core import AdamW, KilnError, Model, compile
from kiln.core.cli._cli import main
from kiln.core.ir import Bundle, Graph, Module, Op, ParamSpec, TensorDecl
from kiln.core.plan.recompute import _size

try:
    import ml_dtypes
except ImportError:  # kiln-core without its bf16 extra: only the error naming the package is tested
    ml_dtypes = None
needs_ml_dtypes = pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes (kiln-core[bf16])")
V, C, M, EPS = 24, 16, 32, 1e-6


def r(x: np.ndarray) -> np.ndarray:
    """Round to bfloat16 (float64 values)."""
    return np.asarray(x, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def ulp(x: np.ndarray) -> np.ndarray:
    """One bfloat16 step at each element's magnitude (8 significant bits)."""
    return np.exp2(np.floor(np.log2(np.maximum(np.abs(x), 1e-30))) - 7)


def chain_bundle() -> Bundle:
    """embedding -> rmsnorm -> matmul -> silu -> matmul -> residual add -> LM-head loss."""
    n = ["B * T"]
    model = Module(
        "Chain", kind="model", config={"V": V, "C": C, "M": M},
        params=[ParamSpec("embedding", ["V", "C"], "fp32", init={"kind": "normal", "std": 1.0}),
                ParamSpec("norm", ["C"], "fp32", init={"kind": "uniform", "low": 0.5, "high": 1.5}),
                ParamSpec("w1", ["M", "C"], "fp32", init={"kind": "normal", "std": 0.3}),
                ParamSpec("w2", ["C", "M"], "fp32", init={"kind": "normal", "std": 0.3}),
                ParamSpec("head", ["V", "C"], "fp32", init={"kind": "normal", "std": 0.3})],
        forward=Graph(
            "Chain",
            inputs=[TensorDecl("token_ids", ["B", "T"], "int32"), TensorDecl("targets", ["B", "T"], "int32")],
            params=[TensorDecl("embedding", ["V", "C"], "fp32"), TensorDecl("norm", ["C"], "fp32"),
                    TensorDecl("w1", ["M", "C"], "fp32"), TensorDecl("w2", ["C", "M"], "fp32"),
                    TensorDecl("head", ["V", "C"], "fp32")],
            ops=[Op("embedding", ["token_ids", "embedding"], ["x3"]),
                 Op("view", ["x3"], ["x"], {"shape": [*n, "C"]}),
                 Op("rmsnorm", ["x", "norm"], ["h", "rstd"], {"eps": EPS}),
                 Op("matmul", ["h", "w1"], ["a"], {"transpose": "NT"}),
                 Op("silu", ["a"], ["s"]),
                 Op("matmul", ["s", "w2"], ["b"], {"transpose": "NT"}),
                 Op("add", ["x", "b"], ["y"]),
                 Op("view", ["targets"], ["t"], {"shape": n}),
                 Op("fused_lm_head_loss", ["y", "head", "t"], ["loss", "lse"])],
            outputs=[TensorDecl("loss", n, "fp32")]))
    return Bundle([model], entry="Chain")


def oracle(p: dict[str, np.ndarray], ids: np.ndarray, labels: np.ndarray) -> dict[str, np.ndarray]:
    """The chain in float64 with bf16 rounding where the recipe puts it: a matmul's operands and result
    (``lower``), silu and its gradient on bf16 values (``promote``), norm, add and loss in fp32; the
    LM head's logits and their gradient bf16. Returns logits, loss and the matmul weights' gradients."""
    p = {k: v.astype(np.float64) for k, v in p.items()}
    x = p["embedding"][ids.reshape(-1)]
    rstd = 1 / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + EPS)
    h = x * rstd * p["norm"]
    w1, w2, head = r(p["w1"]), r(p["w2"]), r(p["head"])
    a = r(r(h) @ w1.T)
    sig = 1 / (1 + np.exp(-a))
    s = r(a * sig)
    b = r(s @ w2.T)
    y = x + b
    z = r(r(y) @ head.T)
    t = labels.reshape(-1)
    keep = np.flatnonzero(t != -100)  # the positions the mean loss counts
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    loss = np.mean(lse[keep] - z[keep, t[keep]])
    g = np.zeros_like(z)
    g[keep] = np.exp(z[keep] - lse[keep, None])
    g[keep, t[keep]] -= 1
    g = r(g / len(keep))
    d_head = r(g.T @ r(y))
    d_b = r(g @ head)  # the gradient of y, then of b: already bf16 values
    d_w2 = r(d_b.T @ s)
    d_s = r(d_b @ w2)
    d_a = r(d_s * sig * (1 + a * (1 - sig)))
    d_w1 = r(d_a.T @ r(h))
    return {"logits": z, "loss": np.float64(loss), "head": d_head, "w2": d_w2, "w1": d_w1}


def assert_bf16_close(got: np.ndarray, want: np.ndarray, exact: float = 0.98) -> None:
    """``got`` holds bfloat16 values, each at most one bf16 step from ``want``, most of them equal."""
    got = np.asarray(got, np.float64)
    assert np.array_equal(got, r(got)), "not bfloat16 values"
    assert np.all(np.abs(got - want) <= ulp(want) * 1.0001), np.abs(got - want).max()
    assert np.mean(got == want) >= exact, np.mean(got == want)


@needs_ml_dtypes
def test_rounding_points_match_a_float64_oracle() -> None:
    model = Model.from_ir(chain_bundle(), seed=1, precision="bf16")
    b = random_batch(V, 2, 12, seed=3)
    want = oracle(model.parameters(), b["input_ids"], b["labels"])
    logits = model.logits(b["input_ids"]).reshape(-1, V)
    assert logits.dtype == np.float32
    assert_bf16_close(logits, want["logits"])
    loss, grads = model.loss_and_grads(b["input_ids"], b["labels"])
    assert loss == pytest.approx(float(want["loss"]), rel=1e-5)
    for name in ("head", "w2", "w1"):
        assert grads[name].dtype == np.float32  # fp32 gradient slots holding bf16 values
        assert_bf16_close(grads[name], want[name])

    # the oracle tells the recipes apart: fp32 logits are not bf16 values, and they are further from it
    fp32 = Model.from_ir(chain_bundle(), seed=1).logits(b["input_ids"]).reshape(-1, V).astype(np.float64)
    assert not np.array_equal(fp32, r(fp32))
    assert np.mean(r(fp32) == want["logits"]) < np.mean(logits == want["logits"])


@needs_ml_dtypes
def test_program_records_the_recipe_and_plans_bf16_at_two_bytes() -> None:
    bundle = tiny_qwen3_bundle()
    p32 = compile(bundle, bindings={"B": 2, "T": 8})
    p16 = compile(bundle, bindings={"B": 2, "T": 8}, precision="bf16")
    assert (p32.precision.name, p32.precision.low, p32.rounded) == ("fp32", None, frozenset())
    assert (p16.precision.name, p16.precision.low) == ("bf16", "bfloat16")
    t = p16.tensors
    # matmul outputs are bf16 (2 bytes an element); the residual stream, norms and loss stay fp32
    assert t["blocks.0.attn.qkv_flat"].dtype == "bfloat16" == t["blocks.0.mlp.act"].dtype
    assert t["blocks.0.attn.qkv_flat"].nbytes == 2 * np.prod(t["blocks.0.attn.qkv_flat"].shape)
    assert t["blocks.0.res1"].dtype == t["blocks.0.mlp_norm.y"].dtype == t["loss"].dtype == "float32"
    assert "blocks.0.attn.qkv_flat" in p16.rounded and "blocks.0.res1" not in p16.rounded
    # master weights, gradients and optimizer state keep fp32: the same persistent head
    assert p16.persistent_bytes == p32.persistent_bytes
    grads = {p.grad for p in p16.params if p.grad}
    assert {t[g].dtype for g in grads} == {"float32"} and grads & p16.rounded  # a matmul's dW: bf16 values
    r16, r32 = p16.memory_report(), p32.memory_report()
    assert r16["saved_activations"] < r32["saved_activations"] and r16["peak"] < r32["peak"]
    parts = ("weights", "gradients", "optimizer_state", "inputs", "outputs", "saved_activations", "transient")
    assert sum(r16[k] for k in parts) == r16["peak"] == p16.arena_bytes


@needs_ml_dtypes
def test_kiln_plan_shows_the_lower_bf16_peak(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tiny.json"
    path.write_text(tiny_qwen3_bundle().to_json())
    peaks = {}
    for recipe in ("fp32", "bf16"):
        assert main(["plan", str(path), "--recompute", "none", "--batch", "2", "--seq", "8",
                     "--precision", recipe]) == 0
        out = capsys.readouterr().out
        peaks[recipe] = next(line.split()[1:] for line in out.splitlines() if line.strip().startswith("peak"))
        assert ("precision 'bf16'" in out) == (recipe == "bf16")
    want = {r: _size(compile(tiny_qwen3_bundle(), bindings={"B": 2, "T": 8}, precision=r).arena_bytes).split()
            for r in peaks}
    assert peaks == want and peaks["bf16"] != peaks["fp32"]
    pareto = {}
    for recipe in ("fp32", "bf16"):  # the auto plans are measured under the recipe too
        assert main(["plan", str(path), "--recompute", "auto", "--batch", "2", "--seq", "8", "--pareto",
                     "--precision", recipe]) == 0
        pareto[recipe] = capsys.readouterr().out.partition("auto plans")[2]
    assert pareto["fp32"] and pareto["bf16"] and pareto["fp32"] != pareto["bf16"]


@needs_ml_dtypes
def test_bf16_training_tracks_fp32() -> None:
    opt = AdamW(lr=2e-2, warmup_steps=2)
    m32 = Model.from_ir(tiny_qwen3_bundle(), seed=0, optimizer=opt)
    m16 = Model.from_ir(tiny_qwen3_bundle(), seed=0, optimizer=opt, precision="bf16")
    assert m16.precision == "bf16" and m16.memory_report(2, 8)["peak"] == m16.program(2, 8).arena_bytes
    l32, l16 = [], []
    for step in range(20):
        b = random_batch(32, 2, 8, seed=step % 4)
        l32.append(m32.train_step(b)["loss"])
        l16.append(m16.train_step(b)["loss"])
    # bf16 has 8 significant bits: the losses differ, by far less than training moves them
    assert l16 != l32
    assert np.max(np.abs(np.subtract(l16, l32))) < 0.03 * l32[0]
    assert l16[-1] < 0.7 * l16[0] and l32[-1] < 0.7 * l32[0]
    # the master weights and the optimizer state are fp32 (not bf16 values) after bf16 training
    w = m16.parameter("blocks.0.mlp.up_weight")
    state = m16.state_dict()["optimizer"]["exp_avg"]["blocks.0.mlp.up_weight"]
    assert w.dtype == state.dtype == np.float32
    assert not np.array_equal(w, r(w).astype(np.float32)) and not np.array_equal(state, r(state))


@needs_ml_dtypes
def test_bf16_recompute_and_offload_give_the_same_gradients_bit_for_bit() -> None:
    from kiln.core.plan.recompute import MODES

    b = random_batch(32, 2, 8, seed=5)
    modes = [m for m in ("none", "block", "offload") if m in MODES]
    models = {m: Model.from_ir(tiny_qwen3_bundle(), seed=0, precision="bf16", recompute=m) for m in modes}
    grads = {m: model.loss_and_grads(b["input_ids"], b["labels"])[1] for m, model in models.items()}
    for m in modes[1:]:
        assert all(np.array_equal(grads["none"][k], grads[m][k]) for k in grads["none"]), m
    if "offload" in modes:  # an offloaded bf16 activation keeps 2 bytes an element in the host pool
        prog = models["offload"].program(2, 8)
        hosted = [t for t in prog.tensors.values() if t.pool == "host"]
        assert any(t.dtype == "bfloat16" for t in hosted)
        assert all(t.dtype == prog.tensors[t.name.removesuffix(":host")].dtype for t in hosted)


def test_bad_precision_is_a_named_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(KilnError, match="precision='fp16' is not valid; expected one of 'fp32', 'bf16'"):
        Model.from_ir(tiny_qwen3_bundle(), precision="fp16")
    with pytest.raises(KilnError, match="keeps float32 master weights; dtype='float64'"):
        compile(tiny_qwen3_bundle(), bindings={"B": 1, "T": 4}, dtype="float64", precision="bf16")

    class Fp32Only:  # a backend that declares no precisions runs fp32 alone
        name, device, dtypes = "fp32_only", "cpu", ("float32",)

    with pytest.raises(KilnError, match="backend 'fp32_only' does not run the 'bf16' precision recipe"):
        compile(tiny_qwen3_bundle(), bindings={"B": 1, "T": 4}, backend=Fp32Only(), precision="bf16")
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # as if it were not installed
    with pytest.raises(KilnError, match="needs the package 'ml_dtypes'") as err:
        Model.from_ir(tiny_qwen3_bundle(), precision="bf16")
    assert "kiln-core[bf16]" in str(err.value.hint)


# --- against torch's CPU bf16 autocast (``nox -s parity``) ------------------------------------------


@pytest.mark.parity
@needs_ml_dtypes
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_recipe_matches_torch_cpu_autocast(seed: int) -> None:
    """The chain as a small torch module with the same fp32 weights, under
    ``torch.autocast("cpu", dtype=torch.bfloat16)``: ``F.linear`` rounds its operands and result to bf16
    and accumulates in fp32, ``cross_entropy`` upcasts, silu stays bf16, the residual add promotes to
    fp32, and the RMSNorm upcasts as transformers' does. kiln rounds at the same points, so the two
    differ only by float32 summation order inside a product or a norm, which moves an element only when
    it carries it across a bf16 rounding boundary, and then by one bf16 step: the tolerance."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    model = Model.from_ir(chain_bundle(), seed=seed, precision="bf16")
    b = random_batch(V, 3, 10, seed=seed)
    ids, labels = torch.from_numpy(b["input_ids"]).long(), torch.from_numpy(b["labels"]).long()
    p = {k: torch.nn.Parameter(torch.from_numpy(a)) for k, a in model.parameters().items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x = F.embedding(ids, p["embedding"]).reshape(-1, C)
        var = x.float().pow(2).mean(-1, keepdim=True)  # transformers' RMSNorm: fp32, then the weight
        h = p["norm"] * (x.float() * torch.rsqrt(var + EPS))
        y = x + F.linear(F.silu(F.linear(h, p["w1"])), p["w2"])
        logits = F.linear(y, p["head"])
        loss = F.cross_entropy(logits, labels.reshape(-1), ignore_index=-100)
    assert logits.dtype == torch.bfloat16 and y.dtype == loss.dtype == torch.float32
    loss.backward()
    assert_bf16_close(model.logits(b["input_ids"]).reshape(-1, V), logits.detach().double().numpy())
    kiln_loss, grads = model.loss_and_grads(b["input_ids"], b["labels"])
    assert kiln_loss == pytest.approx(loss.item(), rel=1e-5)
    for name in ("head", "w2", "w1"):  # autocast's weight gradients: bf16 products, upcast into .grad
        want = p[name].grad.double().numpy()
        assert np.array_equal(want, r(want))
        assert_bf16_close(grads[name], want)
    for name in ("embedding", "norm"):  # fp32 gradients through the fp32 norm: float32 rounding apart
        want = p[name].grad.numpy()
        np.testing.assert_allclose(grads[name], want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
