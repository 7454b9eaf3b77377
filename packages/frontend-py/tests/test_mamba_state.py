"""``MambaStateBlock``: the Python Mamba block with the inference state of seed 004's §11.3 block (optional
``ssm_state`` / ``conv_state`` inputs, ``ssm_state_out`` / ``conv_state_out`` outputs).

Oracles: the text syntax's lowering of the same block (kiln-dsl-text's shipped ``MambaStateBlock``,
which is its shipped ``MambaBlock`` with §11.3's state lines) for the IR, and the block's own
full-sequence forward on NumPy (float64, ``run_graph``) for a token-by-token decode and a chunked one."""

# ruff: noqa: F821  (dimension names inside Tensor[...] annotations are not Python names)

import json
from pathlib import Path

import numpy as np
import pytest

from kiln.core.autodiff._interp import run_graph
from kiln.core.ir import dim_bindings, evaluate_shape, verify
from kiln.dsl import B, T, Tensor, build_bundle, forward, graph, module
from kiln.dsl.stdlib.mamba import MambaStateBlock

CONFIG = {"d_model": 8, "d_inner": 16, "d_state": 4, "d_conv": 3, "dt_rank": 2}


def _stateful_text(text: str) -> str:
    """The shipped text MambaBlock (the first block of ``text``) with §11.3's inference state: the
    optional state inputs, the state outputs, and the conv and scan reading and returning them."""
    pad = " " * 6
    conv = "mamba_conv1d(activation=silu)"
    scan = "mamba_selective_scan(delta_softplus=true"
    states_in = f"{pad}ssm_state: [B, DI, N]?\n{pad}conv_state: [B, DI, KC]?\n"
    states_out = f"{pad}ssm_state_out: [B, DI, N]\n{pad}conv_state_out: [B, DI, KC]\n"
    for old, new in [
        (f"{pad}residual: [B, T, C]\n", f"{pad}residual: [B, T, C]\n{states_in}"),
        (f"{pad}res: [B, T, C]\n", f"{pad}res: [B, T, C]\n{states_out}"),
        (f"(conv_in, conv1d_weight, conv1d_bias) -> {conv} -> conv_out",
         f"(conv_in, conv1d_weight, conv1d_bias, conv_state) -> {conv} -> (conv_out, conv_state_out)"),
        (f"D, z, dt_proj_bias)\n        -> {scan}) -> scan_out",
         f"D, z, dt_proj_bias, ssm_state)\n        -> {scan}, return_last_state=true)"
         " -> (scan_out, ssm_state_out)"),
    ]:
        assert old in text, old
        text = text.replace(old, new, 1)
    return text


def _ir(m) -> dict:
    """A block module's IR as JSON, without its name, op lines, descriptions and activation-slot table
    (the recompute hints of the ``dsl`` mode, which the text syntax has no form for)."""
    data = json.loads(m.to_json())
    data["name"] = data["forward"]["name"] = "<block>"
    data.pop("activations", None)
    data.get("metadata", {}).pop("doc", None)
    for op in data["forward"]["ops"]:
        op.pop("loc", None)
    for p in data["params"]:
        p.pop("description", None)
    return data


@pytest.mark.parametrize("extra", [{}, {"use_conv_bias": False}, {"use_bias": True}], ids=str)
def test_python_and_text_mamba_blocks_with_state_lower_to_one_ir(extra: dict) -> None:
    text_dsl = pytest.importorskip("kiln.dsl_text", reason="the text syntax is kiln-dsl-text")
    config = {**CONFIG, **extra}
    shipped = Path(text_dsl.model_path("mamba")).read_text()
    text = text_dsl.load_program("mamba.kiln", shipped).bundle("MambaStateBlock", config)
    text = text.module("MambaStateBlock")
    python = build_bundle(MambaStateBlock, config).module("MambaStateBlock")
    verify(build_bundle(MambaStateBlock, config))
    assert [d.name for d in python.forward.inputs] == ["x", "residual", "ssm_state", "conv_state"]
    assert [d.name for d in python.forward.outputs] == ["out", "res", "ssm_state_out", "conv_state_out"]
    assert _ir(python) == _ir(text)
    if not extra:  # the shipped MambaStateBlock is the shipped MambaBlock with §11.3's state lines
        built = text_dsl.load_program("mamba.kiln", _stateful_text(shipped)).bundle("MambaBlock", config)
        assert _ir(built.module("MambaBlock")) == _ir(text)
    # the same parameters as the stackable MambaBlock (what MambaModel trains and HF checkpoints hold)
    plain = build_bundle("MambaBlock", config).module("MambaBlock")
    assert [(p.name, p.shape) for p in python.params] == [(p.name, p.shape) for p in plain.params]


def _params(block, binds: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    values = {p.name: 0.4 * rng.standard_normal(evaluate_shape(p.shape, binds)) for p in block.params}
    values["dt_proj_bias"] = rng.uniform(-4.0, -1.0, values["dt_proj_bias"].shape)  # dt ~ 0.02 .. 0.3
    return values


@pytest.mark.parametrize("chunk", [1, 3])
def test_decoding_with_the_state_equals_the_whole_sequence(chunk: int) -> None:
    """Token by token (``chunk=1``) or in chunks, each from the states the one before returned: the
    outputs are the whole sequence's, and so are the final states; from zero states, a chunk computes
    something else (the state is used)."""
    bundle = build_bundle(MambaStateBlock, CONFIG)
    block = bundle.module("MambaStateBlock")
    bsz, t = 2, 7
    binds = {"B": bsz, **dim_bindings(block.config)}
    rng = np.random.default_rng(3)
    params = _params(block, binds, rng)
    x, residual = rng.standard_normal((2, bsz, t, CONFIG["d_model"]))
    zeros = (np.zeros((bsz, CONFIG["d_inner"], CONFIG["d_state"])),
             np.zeros((bsz, CONFIG["d_inner"], CONFIG["d_conv"])))

    def run(lo: int, hi: int, ssm: np.ndarray, conv: np.ndarray) -> dict[str, np.ndarray]:
        values = {**params, "x": x[:, lo:hi], "residual": residual[:, lo:hi], "ssm_state": ssm,
                  "conv_state": conv}
        return run_graph(block.forward, values, bindings={**binds, "T": hi - lo}, float_dtype=np.float64)

    whole = run(0, t, *zeros)
    states, pieces = zeros, []
    for lo in range(0, t, chunk):
        step = run(lo, min(lo + chunk, t), *states)
        pieces.append(step)
        states = (step["ssm_state_out"], step["conv_state_out"])
    for name in ("out", "res"):
        np.testing.assert_allclose(np.concatenate([p[name] for p in pieces], axis=1), whole[name],
                                   rtol=1e-10, atol=1e-12, err_msg=name)
    np.testing.assert_allclose(states[0], whole["ssm_state_out"], rtol=1e-10, atol=1e-12)
    # the conv's state is its last d_conv inputs, [B, d_inner, d_conv] (transformers' conv cache)
    np.testing.assert_array_equal(states[1], whole["conv_in"][..., t - CONFIG["d_conv"]:])
    cold = run(chunk, min(2 * chunk, t), *zeros)
    assert not np.allclose(cold["out"], pieces[1]["out"])


def test_the_state_is_optional_when_the_block_is_called() -> None:
    """Inlined without states, the block starts from zeros: the outputs of a call with zero states."""

    @module
    class Prefill:
        def __init__(self, d_model: int = 8):
            self.d_model = d_model
            self.mamba = MambaStateBlock(**CONFIG)

        @forward
        def forward(self, x: Tensor["B", "T", "d_model", "fp32"]) -> tuple[
                Tensor["B", "T", "d_model", "fp32"], Tensor["B", 16, 4, "fp32"], Tensor["B", 16, 3, "fp32"]]:
            with graph() as g:
                res0 = g.zeros(shape=[B, T, "d_model"], dtype="fp32", out_name="res0")
                out, _, ssm, conv = g.call(self.mamba, x, res0, num_outputs=4)
                return out, ssm, conv

    prefill = build_bundle(Prefill, {}).module("Prefill")
    assert [d.name for d in prefill.forward.inputs] == ["x"]
    block = build_bundle(MambaStateBlock, CONFIG).module("MambaStateBlock")
    binds = {"B": 2, "T": 5, **dim_bindings(block.config)}
    rng = np.random.default_rng(4)
    params = _params(block, binds, rng)
    x = rng.standard_normal((2, 5, 8))
    got = run_graph(prefill.forward, {**{f"mamba.{k}": v for k, v in params.items()}, "x": x}, bindings=binds,
                    float_dtype=np.float64)
    want = run_graph(block.forward, {**params, "x": x, "residual": np.zeros_like(x),
                                     "ssm_state": np.zeros((2, 16, 4)), "conv_state": np.zeros((2, 16, 3))},
                     bindings=binds, float_dtype=np.float64)
    outs = [d.name for d in prefill.forward.outputs]
    for got_name, want_name in zip(outs, ("out", "ssm_state_out", "conv_state_out"), strict=True):
        np.testing.assert_allclose(got[got_name], want[want_name], rtol=1e-12, atol=1e-12)


def test_the_derived_backward_reaches_the_initial_states() -> None:
    """The gradients of the initial states (what a chunked backward hands to the chunk before) and of
    x, against float64 central differences of the block."""
    from kiln.core.autodiff import DeriveBackwardOptions, derive_backward
    from kiln.core.autodiff._gradcheck import central_differences, max_rel_error

    config = {**CONFIG, "d_inner": 8}
    block = build_bundle(MambaStateBlock, config).module("MambaStateBlock")
    binds = {"B": 1, "T": 4, **dim_bindings(block.config)}
    rng = np.random.default_rng(6)
    params = _params(block, binds, rng)
    inputs = {"x": rng.standard_normal((1, 4, 8)), "residual": rng.standard_normal((1, 4, 8)),
              "ssm_state": rng.standard_normal((1, 8, 4)), "conv_state": rng.standard_normal((1, 8, 3))}
    outs = [d.name for d in block.forward.outputs]
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
