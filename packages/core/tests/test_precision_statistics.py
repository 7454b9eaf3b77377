"""Float32 statistics under the bf16 precision: never rounded, wherever their op computes.

torch keeps SDPA's log-sum-exp float32 for bf16 q, k, v (its backward reads that float32 logsumexp)
and runs ``cross_entropy`` in float32 under autocast. kiln's ops declare such tensors
(``OpDef.statistics``: attention's ``lse``, a norm's ``rstd`` and ``mean``, a loss, their cotangents),
and a step that computes in bf16 reads them as they are stored and writes them in float32; its other
float inputs (activations, which torch holds in bf16 there) are read rounded to bf16.

The model: embedding -> rmsnorm -> qkv projection -> flash attention -> output projection -> residual
add -> LM-head loss, under the ``fp32`` recipe with ``@precision(compute="bf16")`` on the attention and
on the head (torch: autocast around SDPA and around the head's linear and cross-entropy). Oracles: a
float64 NumPy attention backward written here from torch's CPU SDPA backward (the bf16 points of
``test_precision_fused.py``) with the float32 log-sum-exp; for the parity test, that model in torch.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from kiln_core_tiny import random_batch

from kiln.core import SGD, KilnError, Model, op_registry
from kiln.core.ir import Annotation, Bundle, Graph, Module, Op, ParamSpec, TensorDecl
from kiln.core.ops import OpDef
from kiln.core.plan import _precision, _program
from kiln.core.plan._precision import Override, precision_recipe, rounded_reads

ml_dtypes = pytest.importorskip("ml_dtypes", reason="the bf16 recipe needs ml_dtypes (kiln-core[bf16])")
V, C, HQ, HKV, D, EPS = 40, 16, 2, 2, 8, 1e-6
QKV = (HQ + 2 * HKV) * D
OPS = op_registry()


def r(x: np.ndarray) -> np.ndarray:
    """Round to bfloat16 (float64 values)."""
    return np.asarray(x, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def is_bf16(x: np.ndarray) -> np.ndarray:
    """Per element: whether it is a bfloat16 value."""
    return np.asarray(x, np.float64) == r(x)


def bf16_compute(*tensors: str) -> list[Annotation]:
    return [Annotation("precision", "tensor", t, {"compute": "bf16"}) for t in tensors]


def attention_lm(annotations: list[Annotation] | None = None) -> Bundle:
    """One attention layer and the LM head; ``annotations`` on the model's tensors."""
    n = ["B * T"]
    qkv = "(HQ + 2 * HKV) * D"
    shapes = {"embedding": ["V", "C"], "norm": ["C"], "wqkv": [qkv, "C"], "wo": ["C", "HQ * D"],
              "head": ["V", "C"]}
    init = {"kind": "normal", "std": 0.5}
    heads = {"Hq": "HQ", "Hkv": "HKV", "D": "D"}
    model = Module(
        "AttnLM", kind="model", config={"V": V, "C": C, "HQ": HQ, "HKV": HKV, "D": D},
        params=[ParamSpec(k, s, "fp32", init={"kind": "ones"} if k == "norm" else init)
                for k, s in shapes.items()],
        forward=Graph(
            "AttnLM",
            inputs=[TensorDecl("token_ids", ["B", "T"], "int32"), TensorDecl("targets", ["B", "T"], "int32")],
            params=[TensorDecl(k, s, "fp32") for k, s in shapes.items()],
            ops=[Op("embedding", ["token_ids", "embedding"], ["x3"]),
                 Op("view", ["x3"], ["x"], {"shape": [*n, "C"]}),
                 Op("rmsnorm", ["x", "norm"], ["h", "rstd"], {"eps": EPS}),
                 Op("matmul", ["h", "wqkv"], ["qkv_flat"], {"transpose": "NT"}),
                 Op("view", ["qkv_flat"], ["qkv"], {"shape": ["B", "T", qkv]}),
                 Op("flash_attention", ["qkv"], ["att", "lse"], {**heads, "causal": True}),
                 Op("view", ["att"], ["att_flat"], {"shape": [*n, "HQ * D"]}),
                 Op("matmul", ["att_flat", "wo"], ["o"], {"transpose": "NT"}),
                 Op("add", ["x", "o"], ["y"]),
                 Op("view", ["targets"], ["t"], {"shape": n}),
                 Op("fused_lm_head_loss", ["y", "head", "t"], ["loss", "head_lse"])],
            outputs=[TensorDecl("loss", n, "fp32")]),
        annotations=annotations or [])
    return Bundle([model], entry="AttnLM")


def old_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule before statistics were declared: a bf16 step rounds every float input and output."""
    monkeypatch.setattr(_precision, "statistic_flags", lambda opdef, n, outputs=False: (False,) * n)


# --- the rule, as the precision recipe states it ---------------------------------------------------


def test_ops_declare_their_float32_statistics_and_a_wrong_name_is_an_error() -> None:
    declared = {name: OPS.get_op(name).statistics for name in (
        "flash_attention", "flash_attention_backward", "attention_backward", "fused_lm_head_loss",
        "fused_lm_head_loss_backward", "rmsnorm_backward", "layernorm_backward", "qkv_qk_norm_rope_backward")}
    assert declared["flash_attention"] == {"lse"} and declared["flash_attention_backward"] == {"lse", "d_lse"}
    assert declared["fused_lm_head_loss"] == {"loss", "lse"}
    assert {"rstd", "d_rstd"} <= declared["rmsnorm_backward"]
    assert {"mean", "rstd"} <= declared["layernorm_backward"]
    with pytest.raises(KilnError, match=r"op 'probe': statistics names 'lse', which is not one of its"):
        OpDef("probe", ("x",), ("y",), lambda x: x, lambda ctx: [], statistics={"lse"})


def test_a_bf16_step_reads_its_statistics_as_stored_and_never_writes_them_bf16() -> None:
    bwd = OPS.get_op("flash_attention_backward")  # (d_out?, qkv, out, lse, d_lse?, segment_ids?)
    assert rounded_reads(bwd, 6, lower=True) == (True, True, True, False, False, True)
    assert rounded_reads(bwd, 6, lower=False) == (False,) * 6
    head_bwd = OPS.get_op("fused_lm_head_loss_backward")  # (d_loss?, x, weight, targets, lse, d_lse?)
    assert rounded_reads(head_bwd, 6, lower=True) == (False, True, True, True, False, False)
    norm_rope_bwd = OPS.get_op("qkv_qk_norm_rope_backward")  # ..., q_rstd, k_rstd, d_q_rstd?, d_k_rstd?
    assert rounded_reads(norm_rope_bwd, 10, lower=True) == (True,) * 6 + (False,) * 4
    bf16, fp32 = precision_recipe("bf16"), precision_recipe("fp32")
    bf16_on_fp32 = attrs.evolve(fp32, low="bfloat16")  # the fp32 recipe with a bf16 override
    attention = OPS.get_op("flash_attention")
    assert bf16.rounded_outputs(attention, [True], [True, True]) == (True, False)
    # fp32 recipe, q, k, v already bf16 (a cast): torch's SDPA gives bf16 out and float32 logsumexp
    assert bf16_on_fp32.rounded_outputs(attention, [True], [True, True]) == (True, False)
    head = OPS.get_op("fused_lm_head_loss")
    compute = Override(compute="bf16", where="loss")
    assert bf16_on_fp32.rounded_outputs(head, [False, False, None], [True, True], compute) == (False, False)
    # an explicit output type binds: @dtype("bf16") on the loss still stores it in bf16
    binding = Override(compute="bf16", output="bf16", where="loss")
    assert bf16_on_fp32.rounded_outputs(head, [False, False, None], [True, True], binding) == (True, False)


# --- the rule in a Program and on the NumPy backend ------------------------------------------------


def attention_backward_oracle(qkv: np.ndarray, o: np.ndarray, lse: np.ndarray,
                              d_out: np.ndarray) -> np.ndarray:
    """d_qkv of causal attention as torch's CPU SDPA backward computes it on bf16 q, k, v, out and d_out
    with a float32 ``lse`` (float64 arithmetic, bf16 rounding where autograd has it): P = exp(S - lse),
    d_v = bf16(bf16(P)^T dO), dS = bf16(P (dO V^T - rowsum(dO O))), d_q = bf16(dS K s), d_k = bf16(dS^T Q s).
    ``qkv`` [B, T, QKV], ``o`` and ``d_out`` [B, T, HQ * D], ``lse`` [B, HQ, T] (HQ == HKV here)."""
    b, t = qkv.shape[:2]
    qkv, o, d_out = r(qkv), r(o), r(d_out)
    q, k, v = (qkv[..., i * HQ * D:(i + 1) * HQ * D].reshape(b, t, HQ, D).transpose(0, 2, 1, 3)
               for i in range(3))
    do, oh = (a.reshape(b, t, HQ, D).transpose(0, 2, 1, 3) for a in (d_out, o))
    scale = D ** -0.5
    s = np.where(np.tril(np.ones((t, t), bool)), q @ k.transpose(0, 1, 3, 2) * scale, -np.inf)
    p = np.exp(s - np.asarray(lse, np.float64)[..., None])
    d_v = r(r(p).transpose(0, 1, 3, 2) @ do)
    ds = r(p * (do @ v.transpose(0, 1, 3, 2) - (do * oh).sum(-1, keepdims=True)))
    d_q, d_k = r(ds @ k * scale), r(ds.transpose(0, 1, 3, 2) @ q * scale)
    return np.concatenate([x.transpose(0, 2, 1, 3).reshape(b, t, -1) for x in (d_q, d_k, d_v)], -1)


def attention_run(model: Model, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The forward tensors the attention backward reads (saved: they live through the backward), the
    float32 type of ``lse``, and the gradients of one step of ``model`` on ``batch``."""
    prog = model.feed(batch)
    model.run(["forward"])
    seen = {k: model.read(k).astype(np.float64) for k in ("h", "qkv", "att", "lse", "y")}
    seen["lse_dtype"] = np.array(prog.tensors["lse"].dtype)
    seen.update(model.loss_and_grads(batch["input_ids"], batch["labels"])[1])
    return seen


def d_wqkv_oracle(seen: dict[str, np.ndarray], p: dict[str, np.ndarray], labels: np.ndarray,
                  lse: np.ndarray) -> np.ndarray:
    """The qkv projection's gradient in float64 from the forward tensors kiln saved: the fp32 head's
    gradient of the mean loss, through the fp32 output projection to ``d_out``, then
    :func:`attention_backward_oracle` with ``lse``, then ``d_qkv^T h``."""
    b, t = seen["qkv"].shape[:2]
    z = seen["y"] @ p["head"].astype(np.float64).T
    tt = labels.reshape(-1)
    keep = tt != -100
    g = np.exp(z - z.max(1, keepdims=True))
    g /= g.sum(1, keepdims=True)
    g[np.arange(len(tt)), np.where(keep, tt, 0)] -= 1
    g = np.where(keep[:, None], g, 0) / keep.sum()
    d_out = (g @ p["head"].astype(np.float64) @ p["wo"].astype(np.float64)).reshape(b, t, -1)
    d_qkv = attention_backward_oracle(seen["qkv"], seen["att"], lse, d_out)
    return d_qkv.reshape(b * t, -1).T @ seen["h"]


def test_the_bf16_attention_backward_reads_the_float32_lse(monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention in bf16 under ``fp32`` (``@precision(compute="bf16")``): its lse is stored float32 (not
    bf16 values), and its backward reads that lse: the qkv projection's gradient is the float64
    oracle's with the float32 lse, and measurably further from the oracle with a bf16-rounded one
    (rounding lse moves exp(s - lse) by up to 2^-9 relative). The old rule gives the latter."""
    batch = random_batch(V, 2, 12, seed=4)

    def run() -> tuple[float, float]:
        model = Model.from_ir(attention_lm(bf16_compute("att")), seed=2)
        seen = attention_run(model, batch)
        assert str(seen["lse_dtype"]) == "float32" and is_bf16(seen["att"]).all()
        p = model.parameters()
        want = d_wqkv_oracle(seen, p, batch["labels"], seen["lse"])
        rounded = d_wqkv_oracle(seen, p, batch["labels"], r(seen["lse"]))
        scale = np.abs(want).max()
        return (float(np.abs(seen["wqkv"] - want).max() / scale),
                float(np.abs(seen["wqkv"] - rounded).max() / scale))

    err, err_rounded = run()  # measured: 1e-7 (float32 sums) and 9e-3
    assert err < 2e-6 and err_rounded > 1e-3, (err, err_rounded)
    old_rule(monkeypatch)  # the oracle tells the rules apart: the old one rounded lse on read
    old, old_rounded = run()
    assert old > 1e-3 and old_rounded < 2e-6, (old, old_rounded)


def test_a_bf16_head_writes_a_float32_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    """``@precision(compute="bf16")`` on the LM head's loss: bf16 logits, a float32 per-token loss and
    log-sum-exp over them (autocast's ``cross_entropy``), the loss equal to a float64 oracle's to
    float32 rounding; the old rule stored the loss in bf16."""
    model = Model.from_ir(attention_lm(bf16_compute("loss")), seed=3)
    prog = model.program(2, 12)
    assert prog.computes["loss"] == "bf16" and "loss" not in prog.rounded
    assert prog.tensors["loss"].dtype == prog.tensors["head_lse"].dtype == "float32"
    batch = random_batch(V, 2, 12, seed=5)
    model.feed(batch)
    model.run(["forward"])
    y, loss = model.read("y").astype(np.float64), model.read("loss").astype(np.float64)
    z = r(r(y) @ r(model.parameter("head").astype(np.float64)).T)
    t = batch["labels"].reshape(-1)
    keep = t != -100
    lse = np.log(np.exp(z).sum(1))
    want = lse - z[np.arange(len(t)), np.where(keep, t, 0)]
    # float32 rounding of lse - z[t] (a difference of values up to max|lse|): far below one bf16 step
    np.testing.assert_allclose(loss[keep], want[keep], rtol=0, atol=4 * 2.0 ** -24 * np.abs(lse).max())
    assert not is_bf16(loss[keep]).all()
    assert np.abs(r(want[keep]) - want[keep]).max() > 100 * 4 * 2.0 ** -24 * np.abs(lse).max()

    old_rule(monkeypatch)
    old = Model.from_ir(attention_lm(bf16_compute("loss")), seed=3).program(2, 12)
    assert old.tensors["loss"].dtype == "bfloat16"


# --- a gradient's type is its tensor's: the head's d_y is float32 holding bf16 values ---------------


def untyped_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule before gradients took their tensor's type: a gradient holding bf16 values counted bf16."""
    monkeypatch.setattr(_program, "_float32_reads", lambda *args: frozenset())


def test_the_gradient_of_a_float32_tensor_is_float32_though_its_values_are_bf16(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The head computes in bf16, so its gradient of ``y`` holds bf16 values; ``y`` is float32 (the
    residual add of float32 ``x`` and ``o``), and torch's autograd casts a gradient to its tensor's dtype:
    ``d_y`` is a float32 tensor, and the output projection's ``d_wo = d_y^T att`` (float32 ``d_y``, bf16
    ``att``) a float32 product, as torch's. kiln reads a gradient typed as its tensor in a ``promote``
    step: ``d_wo`` is float32, the float64 product of the tensors kiln saved to float32 rounding. The
    rule before (``d_y`` counted bf16 as its values are) rounded ``d_wo`` to bf16."""
    batch = random_batch(V, 2, 12, seed=6)

    def run() -> tuple[Model, dict[str, np.ndarray]]:
        model = Model.from_ir(attention_lm(bf16_compute("att", "loss")), seed=2)
        return model, model.loss_and_grads(batch["input_ids"], batch["labels"])[1]

    model, grads = run()
    prog = model.program(2, 12)
    d_y = next(st.outputs[0] for st in prog.steps if st.op.type == "fused_lm_head_loss_backward")
    assert d_y in prog.rounded and "att_flat" in prog.rounded  # both hold bf16 values
    assert "d_wo" not in prog.rounded
    model.feed(batch)
    model.run(["forward", "backward"])
    want = model.read(d_y).astype(np.float64).T @ model.read("att_flat").astype(np.float64)
    assert is_bf16(model.read(d_y)).all()
    scale = np.abs(want).max()
    assert np.abs(grads["wo"] - want).max() < 4 * 2.0 ** -24 * 24 * scale  # float32 sums of 24 products
    assert not is_bf16(grads["wo"]).all()
    untyped_gradients(monkeypatch)
    old, old_grads = run()
    assert "d_wo" in old.program(2, 12).rounded and is_bf16(old_grads["wo"]).all()


# --- against torch: autocast around SDPA and around the head (``nox -s parity``) --------------------


def torch_train(params: dict[str, np.ndarray], batches: list[dict[str, np.ndarray]], lr: float
                ) -> tuple[list[float], dict[str, np.ndarray]]:
    """The model in torch with fp32 weights, SDPA and the head's linear and cross-entropy under
    ``torch.autocast("cpu", dtype=torch.bfloat16)``, trained with plain SGD: the losses and weights."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    p = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in params.items()}
    opt = torch.optim.SGD(list(p.values()), lr=lr)
    losses = []
    for batch in batches:
        ids, labels = (torch.from_numpy(batch[k]).long() for k in ("input_ids", "labels"))
        b, t = ids.shape
        x = F.embedding(ids, p["embedding"]).reshape(-1, C)
        h = p["norm"] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))
        qkv = F.linear(h, p["wqkv"]).reshape(b, t, HQ + 2 * HKV, D)
        q, k, v = (qkv[:, :, i * HQ:(i + 1) * HQ].transpose(1, 2) for i in range(3))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert att.dtype == torch.bfloat16
        y = x + F.linear(att.transpose(1, 2).reshape(b * t, HQ * D).float(), p["wo"])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(F.linear(y, p["head"]), labels.reshape(-1), ignore_index=-100)
        assert loss.dtype == torch.float32
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().numpy() for k, v in p.items()}


def kiln_train(params: dict[str, np.ndarray], batches: list[dict[str, np.ndarray]], lr: float
               ) -> tuple[list[float], dict[str, np.ndarray]]:
    model = Model.from_ir(attention_lm(bf16_compute("att", "loss")),
                          optimizer=SGD(lr=lr, max_grad_norm=None, schedule="constant"))
    model.set_parameters(params)
    losses = [float(model.train_step(b)["loss"]) for b in batches]
    return losses, model.parameters()


def gaps(a: tuple[list[float], dict[str, np.ndarray]], b: tuple[list[float], dict[str, np.ndarray]]
         ) -> tuple[float, float, float]:
    """(the first loss's relative difference, the largest relative loss difference, the largest weight
    difference relative to the weight's scale)."""
    rel = [abs(x - y) / abs(y) for x, y in zip(a[0], b[0], strict=True)]
    weights = max(float(np.abs(a[1][k] - b[1][k]).max() / np.abs(b[1][k]).max()) for k in b[1])
    return rel[0], max(rel), weights


@pytest.mark.parity
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_attention_and_head_train_as_torch_autocast(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three SGD steps of the model with attention and the head in bf16 under ``fp32``, against torch
    with autocast around SDPA and around the head: kiln reads the float32 lse in the attention
    backward and keeps the head's loss float32, as torch does.

    Measured (seeds 0-2): the three losses agree to 1.5e-7 (float32 sums) and the weights to 2.2e-7 of
    their scale (6.4e-5 for seed 1, where training moves a value across a bf16 rounding boundary). With
    gradients typed by their values (the head's ``d_y`` counted bf16, so ``d_wo = d_y^T att`` rounded to
    bf16 where torch's is a float32 product) the losses were 4.4e-4 to 7.1e-4 apart and the weights
    1.1e-3 to 4.5e-3. The old statistics rule (lse and the loss rounded to bf16) is off from the first
    loss (2.6e-5 to 5.8e-4: bf16 per-token losses) and trains further still: weights 9.7e-3 to 3.7e-2."""
    rng = np.random.default_rng(seed)
    shapes = Model.from_ir(attention_lm(), seed=0).parameters()
    params = {k: (np.ones_like(v) if k == "norm" else rng.normal(0, 0.5, v.shape)).astype(np.float32)
              for k, v in shapes.items()}
    batches = [random_batch(V, 2, 12, seed=10 * seed + i) for i in range(3)]
    lr = 0.2
    want = torch_train(params, batches, lr)
    first, losses, weights = gaps(kiln_train(params, batches, lr), want)
    assert first < 1e-6 and losses < 1e-6 and weights < 3e-4
    with monkeypatch.context() as m:
        untyped_gradients(m)
        _, untyped_losses, untyped_weights = gaps(kiln_train(params, batches, lr), want)
    assert untyped_losses > 1e-4 and untyped_weights > 3 * weights
    old_rule(monkeypatch)
    old_first, _, old_weights = gaps(kiln_train(params, batches, lr), want)
    assert old_first > max(10 * first, 1e-5) and old_weights > 3 * weights


# --- the other ops' float32 statistics: the MoE routing statistics and aux loss, Mamba's scan state ---


def test_the_moe_and_mamba_ops_declare_their_float32_statistics() -> None:
    """torch keeps them float32: transformers' load-balancing loss takes a float32 softmax and
    ``expert_mask.float()`` means, and mamba's ``selective_scan_ref`` carries its state in float32 (it
    starts as ``A.new_zeros``, A float32). A bf16 step reads them as stored and never writes them bf16."""
    router_bwd = OPS.get_op("moe_router_backward")  # (d_weights?, d_aux_loss?, x, gate, indices)
    assert rounded_reads(router_bwd, 5, lower=True) == (True, False, True, True, True)
    aux_bwd = OPS.get_op("moe_aux_loss_backward")  # (d_loss_out?, d_aux_loss?, targets, load)
    assert rounded_reads(aux_bwd, 4, lower=True) == (False, False, True, False)
    aux = OPS.get_op("moe_aux_loss")  # (loss, targets, load, mean_probs) -> (loss_out, aux_loss)
    assert rounded_reads(aux, 4, lower=True) == (False, True, False, False)
    scan_bwd = OPS.get_op("mamba_selective_scan_backward")  # d_out?, u .., ssm_state?, d_last_state?
    assert rounded_reads(scan_bwd, 11, lower=True) == (True,) * 9 + (False, False)
    assert rounded_reads(OPS.get_op("mamba_selective_scan"), 9, lower=True) == (True,) * 8 + (False,)
    bf16 = precision_recipe("bf16")
    compute = Override(compute="bf16", where="out")
    # every float input bf16 (promote would round every output): the statistics stay float32
    load_stats = OPS.get_op("moe_load_stats")
    assert bf16.rounded_outputs(load_stats, [True, None, None], [True, True]) == (False, False)
    assert bf16.rounded_outputs(aux, [True, None, True, True], [True, True], compute) == (False, False)
    assert bf16.rounded_outputs(OPS.get_op("moe_load_stats_backward"), [True, True, None], [True]) == (True,)
    assert bf16.rounded_outputs(aux_bwd, [True, True, None, True], [True]) == (False,)
    scan = OPS.get_op("mamba_selective_scan")  # every input bf16 under an fp32 recipe's bf16 override
    bf16_on_fp32 = attrs.evolve(precision_recipe("fp32"), low="bfloat16")
    assert bf16_on_fp32.rounded_outputs(scan, [True] * 9, [True, True]) == (True, False)
    assert bf16_on_fp32.rounded_outputs(scan_bwd, [True] * 11, [True] * 9) == (True,) * 8 + (False,)


def moe_aux_lm() -> Bundle:
    """Embedding -> router logits (a matmul) -> moe_softmax -> top-2 -> moe_load_stats -> the LM loss
    (cross_entropy over the router logits, as a stand-in) plus the load-balancing loss (moe_aux_loss)."""
    e = 4
    init = {"kind": "normal", "std": 0.5}
    model = Module(
        "MoeAux", kind="model", config={"V": e, "C": C, "E": e},
        params=[ParamSpec("embedding", ["V", "C"], "fp32", init=init),
                ParamSpec("gate", ["E", "C"], "fp32", init=init)],
        forward=Graph(
            "MoeAux",
            inputs=[TensorDecl("token_ids", ["B", "T"], "int32"), TensorDecl("targets", ["B", "T"], "int32")],
            params=[TensorDecl("embedding", ["V", "C"], "fp32"), TensorDecl("gate", ["E", "C"], "fp32")],
            ops=[Op("embedding", ["token_ids", "embedding"], ["x3"]),
                 Op("view", ["x3"], ["x"], {"shape": ["B * T", "C"]}),
                 Op("matmul", ["x", "gate"], ["logits"], {"transpose": "NT"}),
                 Op("moe_softmax", ["logits"], ["probs"]),
                 Op("moe_topk", ["probs"], ["weights", "indices"], {"k": 2, "normalize": True}),
                 Op("moe_load_stats", ["probs", "indices"], ["load", "mean_probs"]),
                 Op("view", ["targets"], ["t"], {"shape": ["B * T"]}),
                 Op("cross_entropy", ["logits", "t"], ["ce", "ce_lse"]),
                 Op("moe_aux_loss", ["ce", "t", "load", "mean_probs"], ["loss", "aux_loss"],
                    {"coef": 0.25, "num_layers": 1})],
            outputs=[TensorDecl("loss", ["B * T"], "fp32")]))
    return Bundle([model], entry="MoeAux")


def test_the_moe_routing_statistics_stay_float32_under_the_bf16_recipe(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``bf16`` the router's logits and probabilities are bf16 (a matmul; moe_softmax promotes),
    but the routing statistics moe_load_stats writes from them are float32 means (the old rule rounded
    them: promote, every float input bf16), and so is the load-balancing loss over them: equal to a
    float64 oracle over the bf16 probabilities to float32 rounding, not one bf16 step away."""
    batch = random_batch(4, 2, 12, seed=7)
    model = Model.from_ir(moe_aux_lm(), seed=1, precision="bf16")
    prog = model.program(2, 12)
    assert prog.tensors["probs"].dtype == "bfloat16"
    assert {prog.tensors[k].dtype for k in ("load", "mean_probs", "aux_loss", "loss")} == {"float32"}
    model.feed(batch)
    model.run(["forward"])
    probs = model.read("probs").astype(np.float64)
    mean_probs, aux = model.read("mean_probs").astype(np.float64), float(model.read("aux_loss"))
    want = probs.mean(0)
    np.testing.assert_allclose(mean_probs, want, rtol=4 * 2.0 ** -24)
    assert not is_bf16(mean_probs).all()
    load = model.read("load").astype(np.float64)
    assert abs(aux - 4 * float((load * want).sum())) <= 8 * 2.0 ** -24 * aux
    old_rule(monkeypatch)
    old = Model.from_ir(moe_aux_lm(), seed=1, precision="bf16").program(2, 12)
    assert old.tensors["load"].dtype == old.tensors["mean_probs"].dtype == "bfloat16"
