"""``@precision`` / ``@dtype`` / ``@scaling`` honoured by the precision recipe on the NumPy backend.

The oracle is a float64 NumPy computation of the tiny model below, written here from the recipe's
definition (seed 004 §7.4: an annotated op computes and writes in the dtypes its annotation names,
every other op as the recipe says) and rounded to bfloat16 with ml_dtypes at those points.
"""

# ruff: noqa: F821  (dimension names inside Tensor[...] annotations are not Python names)

import numpy as np
import pytest

from kiln.core import KilnError, Model
from kiln.dsl import B, Param, T, Tensor, build_bundle, forward, graph, model
from kiln.dsl.annotations import dtype, precision, scaling
from kiln.dsl.testing import C, V
from kiln.dsl.testing import lm as annotated_lm

ml_dtypes = pytest.importorskip("ml_dtypes", reason="the bf16 recipe needs ml_dtypes (kiln-core[bf16])")


def r(x: np.ndarray) -> np.ndarray:
    """Round to bfloat16 (float64 values)."""
    return np.asarray(x, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def lm(name: str, *h_ann: object, cls_ann: tuple = ()) -> type:
    """``x + silu(x @ w1^T) @ w2^T`` in a one-layer stack, then the LM head's loss with its own ``head``;
    ``h_ann`` annotate ``h = x @ w1^T``, ``cls_ann`` the block."""
    return annotated_lm(name, h_ann=h_ann, cls_ann=cls_ann, head=True)


def oracle(p: dict[str, np.ndarray], ids: np.ndarray, labels: np.ndarray, recipe: str,
           compute: str | None, output: str | None) -> float:
    """The mean loss in float64 with the recipe's rounding points, ``h``'s op computing in ``compute``
    and writing ``output`` (None: as the recipe says)."""
    p = {k: v.astype(np.float64) for k, v in p.items()}
    low = recipe == "bf16"
    x = p["embedding"][ids.reshape(-1)]
    compute = compute or ("bf16" if low else "fp32")
    h = r(x) @ r(p["blocks.0.w1"]).T if compute == "bf16" else x @ p["blocks.0.w1"].T
    h_low = output == "bf16" if output is not None else compute == "bf16"
    h = r(h) if h_low else h
    a = h / (1 + np.exp(-h))
    a = r(a) if h_low else a  # silu promotes: bf16 in, bf16 out
    out = r(r(a) @ r(p["blocks.0.w2"]).T) if low else a @ p["blocks.0.w2"].T
    y = x + out
    z = r(r(y) @ r(p["head"]).T) if low else y @ p["head"].T
    t = labels.reshape(-1)
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    return float(np.mean(lse - z[np.arange(len(t)), t]))


def big_weights(m: Model, seed: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    weights = {k: rng.normal(0, 0.7, v.shape).astype(np.float32) for k, v in m.parameters().items()}
    m.set_parameters(weights)
    return weights


CASES = [  # (recipe, annotations of h, the compute and output dtypes h's op gets)
    ("bf16", (precision(policy="fp32"),), "fp32", "fp32"),  # keep one matmul fp32 under bf16
    ("bf16", (precision(compute="fp32"),), "fp32", None),
    ("bf16", (dtype("fp32"),), None, "fp32"),  # bf16 compute, fp32 output
    ("bf16", (precision(policy="fp32"), dtype("bf16")), "fp32", "bf16"),  # @dtype binds the output
    ("fp32", (precision(compute="bf16"),), "bf16", None),  # one op in bf16 under fp32
    ("fp32", (precision(policy="bf16"), dtype("fp32")), "bf16", "fp32"),
]


@pytest.mark.parametrize(("recipe", "anns", "compute", "output"), CASES)
def test_precision_and_dtype_override_the_recipe_for_one_op(recipe, anns, compute, output) -> None:
    name = f"Override{CASES.index((recipe, anns, compute, output))}"
    m = Model(build_bundle(lm(name, *anns), {}), precision=recipe)
    weights = big_weights(m)
    ids = np.random.default_rng(1).integers(0, V, (2, 7))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    want = oracle(weights, inputs, labels, recipe, compute, output)
    ignored = oracle(weights, inputs, labels, recipe, None, None)  # the recipe alone
    assert abs(want - ignored) > 20 * 1e-6 * abs(want)  # the override is visible in the loss
    assert m.loss(inputs, labels) == pytest.approx(want, rel=1e-6)
    prog = m.program(*inputs.shape)
    h_low = output == "bf16" if output is not None else (compute or recipe) == "bf16"
    assert ("blocks.0.h" in prog.rounded) == h_low
    assert prog.tensors["blocks.0.h"].dtype == ("bfloat16" if h_low else "float32")
    if compute is not None:
        assert prog.computes["blocks.0.h"] == compute
    # the model still trains: gradients are finite and the loss goes down
    before = m.loss(inputs, labels)
    for _ in range(3):
        m.train_step({"input_ids": inputs, "labels": labels})
    assert m.loss(inputs, labels) < before


def test_unsupported_precision_is_a_clear_error() -> None:
    bundle = build_bundle(lm("Fp8Op", precision(compute="fp8_e4m3", output="bf16")), {})
    with pytest.raises(KilnError, match=r"tensor 'h' of Fp8OpBlock asks for compute 'fp8_e4m3'"):
        Model(bundle).program(2, 4)
    bundle = build_bundle(lm("Acc16", precision(accumulate="bf16")), {})
    with pytest.raises(KilnError, match=r"accumulate='bf16'\) on tensor 'h' of Acc16Block"):
        Model(bundle).program(2, 4)


def test_scaling_is_an_identity_under_bf16() -> None:
    """bf16 keeps fp32's exponent range, and a power-of-two scale commutes with rounding to it: a
    ``@scaling`` strategy changes no bit of a bf16 Program (it is for fp8/fp4, not implemented)."""
    plain = Model(build_bundle(lm("Unscaled"), {}), precision="bf16")
    scaled = Model(build_bundle(lm("Scaled", scaling("delayed", history_len=4)), {}), precision="bf16")
    weights = big_weights(plain)
    scaled.set_parameters(weights)
    ids = np.random.default_rng(2).integers(0, V, (2, 5))
    a, ga = plain.loss_and_grads(ids[:, :-1], ids[:, 1:])
    b, gb = scaled.loss_and_grads(ids[:, :-1], ids[:, 1:])
    assert a == b and all(np.array_equal(ga[k], gb[k]) for k in ga)


def test_graph_builder_cast_rounds_and_bf16_flows_until_an_fp32_operand() -> None:
    class CastLM:
        def __init__(self, vocab_size: int = V, d_model: int = C):
            self.vocab_size, self.d_model = vocab_size, d_model

        embedding = Param(Tensor["vocab_size", "d_model", "fp32"])
        w = Param(Tensor["d_model", "d_model", "fp32"])

        @forward
        def forward(
            self,
            token_ids: Tensor["B", "T", "int32"],
            position_ids: Tensor["T", "int32"],
            targets: Tensor["B", "T", "int32"],
        ) -> Tensor["B * T", "fp32"]:
            with graph() as g:
                x = g.view(g.embedding(token_ids, "embedding"), shape=[B * T, "d_model"])
                a = g.silu(g.cast(g.matmul(x, "w", transpose="NT"), "bf16", out_name="hb"), out_name="a")
                return g.fused_lm_head_loss(g.add(x, a, out_name="y"), "embedding", targets)

    m = Model(build_bundle(model(CastLM), {}))  # the fp32 recipe
    weights = big_weights(m)
    ids = np.random.default_rng(3).integers(0, V, (2, 6))
    prog = m.program(2, 5)
    assert {"hb", "a"} <= prog.rounded and "y" not in prog.rounded  # silu of bf16 is bf16; x + a is fp32
    p = {k: v.astype(np.float64) for k, v in weights.items()}
    x = p["embedding"][ids[:, :-1].reshape(-1)]
    hb = r(x @ p["w"].T)
    y = x + r(hb / (1 + np.exp(-hb)))
    z, t = y @ p["embedding"].T, ids[:, 1:].reshape(-1)
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    want = float(np.mean(lse - z[np.arange(len(t)), t]))
    assert m.loss(ids[:, :-1], ids[:, 1:]) == pytest.approx(want, rel=1e-6)


def test_kiln_plan_shows_kernel_nofuse_and_precision_choices(tmp_path, capsys) -> None:
    from kiln.core.cli import main
    from kiln.dsl.annotations import kernel, nofuse

    anns = (kernel("reference"), nofuse(reason="debug"), precision(policy="fp32"))
    bundle = build_bundle(lm("Shown", *anns), {})
    path = tmp_path / "shown.json"
    path.write_text(bundle.to_json())
    assert main(["plan", str(path), "--batch", "2", "--seq", "4", "--precision", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "annotated kernels and precision (@kernel, @nofuse, @precision, @dtype):" in out
    assert "tensor 'h' of ShownBlock (1 step(s)): runs reference (asked 'reference')" in out
    assert "tensor 'h' of ShownBlock (1 step(s)): not fused" in out and ": debug" in out
    assert "computes in fp32, 0/1 bf16 output(s)" in out


@pytest.mark.parametrize(("recipe", "region"), [("fp32", "bf16"), ("bf16", "fp32")])
def test_precision_on_a_block_runs_it_as_that_recipe(recipe: str, region: str) -> None:
    """``@precision(policy=...)`` on a block: its ops compute as that recipe would (bf16: autocast's
    classes; fp32: all fp32), the model around it as its own recipe; a tensor's own annotation wins."""
    policy = precision(policy=region)
    m = Model(build_bundle(lm(f"Region{region}", cls_ann=(policy,)), {}), precision=recipe)
    inner = Model(build_bundle(lm(f"RegionInner{region}", precision(compute=recipe), cls_ann=(policy,)), {}),
                  precision=recipe)
    weights = big_weights(m)
    inner.set_parameters(weights)
    ids = np.random.default_rng(4).integers(0, V, (2, 7))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    p = {k: v.astype(np.float64) for k, v in weights.items()}
    t = labels.reshape(-1)

    def loss(h_low: bool) -> float:
        low = region == "bf16"
        x = p["embedding"][inputs.reshape(-1)]
        h = r(r(x) @ r(p["blocks.0.w1"]).T) if h_low else x @ p["blocks.0.w1"].T
        a = h / (1 + np.exp(-h))
        a = r(a) if h_low and low else a  # silu promotes in a bf16 region; computes fp32 in an fp32 one
        out = r(r(a) @ r(p["blocks.0.w2"]).T) if low else a @ p["blocks.0.w2"].T
        y = x + out
        z = r(r(y) @ r(p["head"]).T) if recipe == "bf16" else y @ p["head"].T
        lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
        return float(np.mean(lse - z[np.arange(len(t)), t]))

    region_low = region == "bf16"
    assert m.loss(inputs, labels) == pytest.approx(loss(region_low), rel=1e-6)
    assert inner.loss(inputs, labels) == pytest.approx(loss(not region_low), rel=1e-6)
    assert abs(loss(True) - loss(False)) > 2e-5 * abs(loss(True))
    assert ("blocks.0.h" in m.program(2, 6).rounded) == region_low
