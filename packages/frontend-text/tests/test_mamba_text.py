"""Mamba in the text syntax: the seed's §6.10 primitives lowered to kiln's ops (its §11.3 block), and
the shipped MambaBlock / MambaModel / Hybrid equal to kiln-dsl's (kiln.dsl.stdlib.mamba) in IR and in
training, bit for bit, with every recompute mode."""

import json
from pathlib import Path

import numpy as np
import pytest

from kiln.core import KilnError, Model
from kiln.core.ir import verify
from kiln.dsl import build_bundle
from kiln.dsl_text import compile_file, load_program, model_path

SEED = (Path(__file__).parent / "seed_examples" / "mamba.kiln").read_text()
MAMBA = {"vocab_size": 64, "d_model": 16, "n_layers": 2, "d_state": 4, "d_conv": 3, "d_inner": 32,
         "dt_rank": 1}
HYBRID = {"vocab_size": 64, "d_model": 16, "n_layers": 4, "num_query_heads": 2, "num_kv_heads": 1, "d_ff": 24,
          "max_seq": 32, "head_size": 8, "d_state": 4, "d_conv": 3, "dt_rank": 1, "moe_d_ff": 24}
LAYOUT = {"attn_layer_period": 2, "attn_layer_offset": 1}  # attention at layers 1 and 3 of 4


def _ir(bundle):
    """The IR as JSON without what only names or places differ (as test_text_dsl's Qwen3 comparison:
    the model's name, op lines, descriptions and the model's activation-slot table), and without the
    Python MambaBlock's activation-slot table: recompute hints for the ``dsl`` mode, which the text
    syntax has no form for."""
    data = json.loads(bundle.to_json())
    entry = data.pop("entry")
    for m in data["modules"]:
        if m["name"] in (entry, "MambaBlock"):
            m.pop("activations", None)
        if m["name"] == entry:
            m["name"] = m["forward"]["name"] = "<model>"
            m.pop("metadata", None)
        for op in m["forward"]["ops"]:
            op.pop("loc", None)
        for p in m["params"]:
            p.pop("description", None)
    return data


def _train(bundle, recompute: str = "none", steps: int = 3) -> tuple[list[float], dict]:
    model = Model.from_ir(bundle, seed=0, recompute=recompute)
    ids = np.random.default_rng(0).integers(0, 64, size=(2, 6))
    batch = {"input_ids": ids, "labels": np.roll(ids, -1, axis=1)}  # one batch, learnt: the loss falls
    losses = [model.train_step(batch)["loss"] for _ in range(steps)]
    return losses, model.parameters()


def _training_form(text: str) -> str:
    """The seed's §11.3 block without its token-by-token inference state (inputs ssm_state and
    conv_state, outputs ssm_state_out and conv_state_out)."""
    for old, new in [
        ("      ssm_state: [B, d_inner, d_state]?   # Recurrent state\n", ""),
        ("      conv_state: [B, d_conv_dim, d_conv]? # Conv state\n", ""),
        ("      ssm_state_out: [B, d_inner, d_state]\n", ""),
        ("      conv_state_out: [B, d_conv_dim, d_conv]\n", ""),
        ("(conv_in, conv1d_weight, conv1d_bias, conv_state)", "(conv_in, conv1d_weight, conv1d_bias)"),
        ("(conv_out, conv_state_out)", "(conv_out, _)"),
        ("dt_bias, ssm_state)\n", "dt_bias)\n"),
        ("(scan_out, ssm_state_out)", "(scan_out, _)"),
    ]:
        assert old in text
        text = text.replace(old, new)
    return text


SEED_CONFIG = {"d_model": 8, "d_state": 4, "d_conv": 3}


def test_the_seed_mamba_block_compiles_to_kilns_mamba_ops() -> None:
    bundle = load_program("mamba.kiln", _training_form(SEED)).bundle("MambaBlock", SEED_CONFIG)
    verify(bundle)
    block = bundle.module("MambaBlock")
    ops = {op.type: op for op in block.forward.ops}
    assert ops["mamba_conv1d"].attrs["activation"] == "silu"  # silu=true
    scan = ops["mamba_selective_scan"]
    # the seed's (u, delta, A, B, C, D, dt_bias): no gate z (its silu_mul gates after), dt_bias as
    # kiln's delta_bias under softplus; A is -exp(A_log) (exp_neg)
    assert scan.inputs[5:] == ("D", "", "dt_bias") and scan.attrs["delta_softplus"] is True
    assert [op.type for op in block.forward.ops if op.type in ("exp", "scale", "rmsnorm", "silu_mul")] == [
        "exp", "scale", "silu_mul", "rmsnorm"]
    # §11.3 is channels-last: the conv and the scan are wrapped in transposes to kiln's [B, D, T]
    conv_in = next(op for op in block.forward.ops if op.outputs[0] == ops["mamba_conv1d"].inputs[0])
    assert conv_in.type == "transpose"
    # B and C: [B, G, N, T] groups; delta: one step size per group, spread to the group's channels
    by_out = {o: op for op in block.forward.ops for o in op.outputs}
    b_ssm = by_out[scan.inputs[3]]
    assert (b_ssm.type, list(b_ssm.attrs["dims"])) == ("permute", [0, 2, 3, 1])
    assert [str(d) for d in by_out[b_ssm.inputs[0]].attrs["shape"]] == ["B", "T", "n_groups", "d_state"]
    assert "broadcast_to" in [op.type for op in block.forward.ops]


def _block_params(module, bindings: dict, rng: np.random.Generator) -> dict:
    from kiln.core.ir._dims import evaluate_shape

    return {p.name: 0.5 * rng.standard_normal(evaluate_shape(p.shape, bindings)) for p in module.params}


@pytest.mark.parametrize(("n_groups", "cut"), [(1, 2), (2, 5), (1, 1)])
def test_the_seed_block_as_written_carries_its_state_across_chunks(n_groups: int, cut: int) -> None:
    """§11.3 with its inference state compiles; a sequence run in two chunks, the second from the
    first's ssm_state_out and conv_state_out, gives the whole sequence's outputs and final states."""
    from kiln.core.autodiff._interp import run_graph

    config = {**SEED_CONFIG, "n_groups": n_groups}
    bundle = load_program("mamba.kiln", SEED).bundle("MambaBlock", config)
    verify(bundle)
    block = bundle.module("MambaBlock")
    types = {op.type for op in block.forward.ops}
    assert {"mamba_conv1d", "mamba_selective_scan"} <= types
    scan = next(op for op in block.forward.ops if op.type == "mamba_selective_scan")
    assert scan.inputs[8] == "ssm_state" and scan.outputs[1] == "ssm_state_out"

    bsz, t, d_model, d_state, k = 2, 6, 8, 4, 3
    d_inner = 2 * d_model
    d_conv_dim = d_inner + 2 * n_groups * d_state
    binds = {"B": bsz, "C": d_model, **{n: v for n, v in block.config.items() if isinstance(v, int)}}
    rng = np.random.default_rng(5)
    params = _block_params(block, binds, rng)
    params["A_log"] = 0.5 * rng.standard_normal((d_inner, d_state))
    x, residual = rng.standard_normal((bsz, t, d_model)), rng.standard_normal((bsz, t, d_model))

    def step(lo: int, hi: int, ssm: np.ndarray, conv: np.ndarray) -> dict:
        values = {**params, "x": x[:, lo:hi], "residual": residual[:, lo:hi], "ssm_state": ssm,
                  "conv_state": conv}
        return run_graph(block.forward, values, bindings={**binds, "T": hi - lo}, float_dtype=np.float64)

    zeros = (np.zeros((bsz, d_inner, d_state)), np.zeros((bsz, d_conv_dim, k)))
    whole = step(0, t, *zeros)
    first = step(0, cut, *zeros)
    second = step(cut, t, first["ssm_state_out"], first["conv_state_out"])
    for name in ("out", "residual_out"):
        np.testing.assert_allclose(np.concatenate([first[name], second[name]], axis=1), whole[name],
                                   rtol=1e-9, atol=1e-11, err_msg=name)
    for name in ("ssm_state_out", "conv_state_out"):
        np.testing.assert_allclose(second[name], whole[name], rtol=1e-9, atol=1e-11, err_msg=name)
    # conv_state_out is the last d_conv inputs of the conv (transformers' cache layout), [B, D, K]
    conv_in = np.swapaxes(whole["conv_in"], 1, 2)
    np.testing.assert_array_equal(whole["conv_state_out"], conv_in[..., t - k:])
    # the state matters: the second chunk from zero states differs
    fresh = step(cut, t, *zeros)
    assert not np.allclose(fresh["out"], second["out"])


def test_the_seed_blocks_derived_backward_reaches_its_states() -> None:
    """kiln's backward of §11.3 with its state, against float64 finite differences of the block: the
    gradients of the initial states (what a chunked backward passes to the chunk before) and of x."""
    from kiln.core.autodiff import DeriveBackwardOptions, derive_backward
    from kiln.core.autodiff._gradcheck import central_differences, max_rel_error
    from kiln.core.autodiff._interp import run_graph

    config = {"d_model": 4, "d_state": 2, "d_conv": 3, "n_groups": 2}
    block = load_program("mamba.kiln", SEED).bundle("MambaBlock", config).module("MambaBlock")
    binds = {"B": 1, "T": 4, "C": 4, **{n: v for n, v in block.config.items() if isinstance(v, int)}}
    rng = np.random.default_rng(8)
    params = _block_params(block, binds, rng)
    inputs = {"x": rng.standard_normal((1, 4, 4)), "residual": rng.standard_normal((1, 4, 4)),
              "ssm_state": rng.standard_normal((1, 8, 2)), "conv_state": rng.standard_normal((1, 16, 3))}
    outs = [d.name for d in block.forward.outputs]
    assert outs == ["out", "residual_out", "ssm_state_out", "conv_state_out"]
    first = run_graph(block.forward, {**params, **inputs}, bindings=binds, float_dtype=np.float64)
    cots = {f"d_{n}": rng.standard_normal(first[n].shape) for n in outs}

    def loss(name: str, value: np.ndarray) -> float:
        env = run_graph(block.forward, {**params, **inputs, name: value}, bindings=binds,
                        float_dtype=np.float64)
        return float(sum(np.sum(cots[f"d_{n}"] * env[n]) for n in outs))

    result = derive_backward(block.forward, DeriveBackwardOptions(loss_name=None))
    env = run_graph(result.backward, {**first, **cots}, bindings=binds, float_dtype=np.float64)
    for name in ("ssm_state", "conv_state", "x"):
        fd = central_differences(lambda v, name=name: loss(name, v), inputs[name])
        assert max_rel_error(env[result.grads[name]], fd) <= 1e-6, name


def test_the_seed_conv_state_of_its_primitive_is_the_inputs_before_x() -> None:
    """§6.10's own form: channels-first, conv_state [B, D, K-1]; against a naive loop."""
    from kiln.core.autodiff._interp import run_graph

    text = """module Conv(d: int = 3, k: int = 4):
  params:
    weight: [d, 1, k]
    bias: [d]
  forward:
    inputs:
      x: [B, d, T]
      conv_state: [B, d, k - 1]
    outputs:
      y: [B, d, T]
      conv_state_out: [B, d, k - 1]
    graph:
      (x, weight, bias, conv_state) -> mamba_conv1d(kernel_size=k, activation=silu) -> (y, conv_state_out)
"""
    graph = load_program("c.kiln", text).bundle("Conv", {}).module("Conv").forward
    rng = np.random.default_rng(6)
    x, w, b, state = (rng.standard_normal(s) for s in ((2, 3, 5), (3, 1, 4), (3,), (2, 3, 3)))
    got = run_graph(graph, {"x": x, "weight": w, "bias": b, "conv_state": state}, float_dtype=np.float64)
    full = np.concatenate([state, x], axis=-1)
    pre = np.stack([sum(w[:, 0, j] * full[..., s + j] for j in range(4)) + b for s in range(5)], axis=-1)
    np.testing.assert_allclose(got["y"], pre / (1 + np.exp(-pre)), rtol=1e-12)
    np.testing.assert_array_equal(got["conv_state_out"], x[..., 2:])


@pytest.mark.parametrize(("old", "new", "culprit"), [
    ("conv_state: [B, d_conv_dim, d_conv]?", "conv_state: [B, d_conv_dim, d_conv + 1]?", "conv_state"),
    ("ssm_state: [B, d_inner, d_state]?", "ssm_state: [B, d_state, d_inner]?", "ssm_state"),
])
def test_a_state_of_the_wrong_shape_names_it(old: str, new: str, culprit: str) -> None:
    assert old in SEED
    with pytest.raises(KilnError) as info:
        load_program("mamba.kiln", SEED.replace(old, new)).bundle("MambaBlock", SEED_CONFIG)
    assert info.value.code == "E004" and f"{culprit} must be" in info.value.message


MODEL = """
model M(vocab_size: int = 64, d_model: int = 8, n_layers: int = 2, n_groups: int = 1):
  params:
    embedding: [vocab_size, d_model]
    blocks: [n_layers] x MambaBlock(d_model)
    final_norm: [d_model] @init(ones)
  forward:
    inputs:
      token_ids: [B, T]
      targets: [B, T]
    out: [B * T]
    graph:
      token_ids -> embedding(embedding) -> x0
      zeros([B, T, d_model]) -> r0
      (x0, r0) -> StackedBlocks(blocks, n_layers) -> (xN, rN)
      (rN, xN) -> fused_residual_rmsnorm(final_norm) -> (_, xF)
      xF -> view(shape=[B * T, d_model]) -> f
      (f, embedding, targets) -> fused_lm_head_loss() -> out
"""


def _trainable(text: str) -> str:
    return text.replace("conv1d_bias: [d_conv_dim]?", "conv1d_bias: [d_conv_dim]") + MODEL


@pytest.mark.parametrize("n_groups", [1, 2])
def test_a_model_of_the_seed_block_trains(n_groups: int) -> None:
    text = _trainable(_training_form(SEED))
    bundle = load_program("m.kiln", text).bundle("M", {"d_state": 4, "d_conv": 3, "n_groups": n_groups})
    block = bundle.module("MambaBlock")
    assert block.config["n_groups"] == n_groups
    norms = [op.type for op in block.forward.ops if op.type in ("rmsnorm", "mul")]
    assert norms == (["rmsnorm"] if n_groups == 1 else ["rmsnorm", "mul"])  # group_rmsnorm
    losses = [_train(bundle, mode, steps=4)[0] for mode in ("none", "block")]
    assert losses[0][-1] < losses[0][0] and losses[0] == losses[1]


def test_naming_the_state_results_changes_no_training_step() -> None:
    """The ops' state outputs, named but unused, in a real training Program: the losses are those of
    the block without them, in every recompute mode."""
    plain = _training_form(SEED)
    named = plain.replace("(scan_out, _)", "(scan_out, h_last)")
    named = named.replace("(conv_out, _)", "(conv_out, c_last)")
    bundles = [load_program("m.kiln", _trainable(t)).bundle("M", {"d_state": 4, "d_conv": 3})
               for t in (plain, named)]
    scan = next(op for op in bundles[1].module("MambaBlock").forward.ops if op.type == "mamba_selective_scan")
    assert scan.attrs["return_last_state"] is True and len(scan.outputs) == 2
    reference = _train(bundles[0])[0]
    for mode in ("none", "block", "auto", "dsl"):
        assert _train(bundles[1], mode)[0] == reference, mode


def test_text_mamba_block_and_model_are_the_python_ones() -> None:
    block = {k: MAMBA[k] for k in ("d_model", "d_inner", "d_state", "d_conv", "dt_rank")}
    text = load_program(model_path("mamba")).bundle("MambaBlock", block)
    assert _ir(text) == _ir(build_bundle("MambaBlock", block))
    for config in (MAMBA, {**MAMBA, "use_conv_bias": False, "use_bias": True, "tie_word_embeddings": False}):
        text = compile_file(model_path("mamba"), model="MambaModel", config=config)
        assert _ir(text) == _ir(build_bundle("MambaModel", config))


def test_text_mamba_model_trains_to_the_python_losses_bit_for_bit() -> None:
    text = _train(compile_file(model_path("mamba"), model="MambaModel", config=MAMBA))
    python = _train(build_bundle("MambaModel", MAMBA))
    assert text[0] == python[0] and text[0][-1] < text[0][0]
    assert text[1].keys() == python[1].keys()
    assert all(np.array_equal(text[1][k], python[1][k]) for k in text[1])


@pytest.mark.parametrize("moe", [{}, {"num_experts": 4}, {"num_experts": 4, "output_router_logits": True}])
def test_text_hybrid_is_the_python_hybrid_model_with_its_layout(moe: dict) -> None:
    text = compile_file(model_path("hybrid"), config={**HYBRID, **moe})
    python = build_bundle("HybridModel", {**HYBRID, **LAYOUT, **moe})
    assert _ir(text) == _ir(python)
    calls = [op for op in text.module(text.entry).forward.ops if op.type == "call"]
    attn = "MoETransformerBlock" if moe else "DenseTransformerBlock"
    assert [(c.attrs["module"], c.attrs.get("first", 0)) for c in calls] == [
        ("MambaBlock", 0), (attn, 0), ("MambaBlock", 1), (attn, 1)]


@pytest.mark.parametrize("moe", [{}, {"num_experts": 4, "output_router_logits": True}])
def test_text_hybrid_trains_like_the_python_one_bit_for_bit_in_every_recompute_mode(moe: dict) -> None:
    text = compile_file(model_path("hybrid"), config={**HYBRID, **moe})
    python = build_bundle("HybridModel", {**HYBRID, **LAYOUT, **moe})
    reference = _train(python)[0]
    assert reference[-1] < reference[0]
    for mode in ("none", "dsl", "block", "auto"):
        assert _train(text, mode)[0] == reference, mode


def test_the_hybrid_file_fixes_its_layout() -> None:
    with pytest.raises(KilnError) as info:
        compile_file(model_path("hybrid"), config={**HYBRID, "n_layers": 6})
    assert info.value.code == "E027" and "attention at layers 1 and 3" in info.value.message


SCAN = """module Scan(d: int = 4, g: int = 2, n: int = 3):
  params:
    A: [d, n]
    D: [d]
    dt_bias: [d]
  forward:
    inputs:
      u: [B, T, d]
      delta: [B, T, g]
      Bm: [B, g, n, T]
      Cm: [B, g, n, T]
    outputs:
      y: [B, T, d]
    graph:
      (u, delta, A, Bm, Cm, D, dt_bias) -> mamba_selective_scan() -> (y, _)
"""


def _selective_scan_ref(u, delta, A, Bm, Cm, D, dt_bias):
    """Mamba's selective_scan_ref in float64 loops, channels-last u [B, T, d], one delta per group."""
    b, t, d = u.shape
    g = delta.shape[2]
    y = np.zeros((b, t, d))
    for i in range(b):
        for c in range(d):
            grp = c // (d // g)
            h = np.zeros(A.shape[1])
            for s in range(t):
                dt = np.log1p(np.exp(delta[i, s, grp] + dt_bias[c]))  # softplus
                h = np.exp(dt * A[c]) * h + dt * Bm[i, grp, :, s] * u[i, s, c]
                y[i, s, c] = h @ Cm[i, grp, :, s] + D[c] * u[i, s, c]
    return y


def test_the_seed_scan_in_channels_last_with_one_step_size_per_group_is_mambas_scan() -> None:
    from kiln.core.autodiff._interp import run_graph

    graph = load_program("scan.kiln", SCAN).bundle("Scan", {}).module("Scan").forward
    rng = np.random.default_rng(3)
    values = {"u": rng.standard_normal((2, 5, 4)), "delta": 0.5 * rng.standard_normal((2, 5, 2)),
              "A": -np.exp(0.5 * rng.standard_normal((4, 3))), "Bm": rng.standard_normal((2, 2, 3, 5)),
              "Cm": rng.standard_normal((2, 2, 3, 5)), "D": rng.standard_normal(4),
              "dt_bias": rng.standard_normal(4)}
    got = run_graph(graph, values, float_dtype=np.float64)["y"]
    np.testing.assert_allclose(got, _selective_scan_ref(**values), rtol=1e-10, atol=1e-12)


def test_the_seed_blocks_group_rmsnorm_and_exp_neg_are_their_math() -> None:
    from kiln.core.autodiff._interp import run_graph

    text = """module Norm(d: int = 6, g: int = 2):
  params:
    w: [d]
    a: [d, 3]
  forward:
    inputs:
      x: [B, T, d]
    outputs:
      y: [B, T, d]
      na: [d, 3]
    graph:
      x -> group_rmsnorm(w, g, 1e-6) -> y
      a -> exp_neg() -> na
"""
    graph = load_program("n.kiln", text).bundle("Norm", {}).module("Norm").forward
    rng = np.random.default_rng(4)
    x, w, a = rng.standard_normal((2, 3, 6)), rng.standard_normal(6), rng.standard_normal((6, 3))
    out = run_graph(graph, {"x": x, "w": w, "a": a}, float_dtype=np.float64)
    parts = x.reshape(2, 3, 2, 3)
    want = (parts / np.sqrt(np.mean(parts**2, axis=-1, keepdims=True) + 1e-6)).reshape(2, 3, 6) * w
    np.testing.assert_allclose(out["y"], want, rtol=1e-10)
    np.testing.assert_allclose(out["na"], -np.exp(a), rtol=1e-12)
