"""``mamba_conv1d`` with a state and no bias in the text syntax: ``(x, weight, conv_state)`` (a third input
of rank 3) passes the state, not a bias, so the shipped ``MambaStateBlock`` without a conv bias reads its
state (its IR against kiln-dsl's ``MambaStateBlock``: kiln-dsl's ``tests/test_mamba_state.py``). The oracle
for the values: the conv of the state's last ``K - 1`` columns followed by ``x``, written in NumPy here."""

import numpy as np
import pytest

from kiln.core import KilnError
from kiln.core.autodiff._interp import run_graph
from kiln.dsl_text import load_program

TEXT = '''block Conv(d: int = 3, k: int = 4):
  params:
    w: [d, 1, k]
  forward:
    inputs:
      x: [B, d, T]
      state: [B, d, k]
    outputs:
      y: [B, d, T]
      state_out: [B, d, k]
    graph:
      (x, w, state) -> mamba_conv1d(activation=silu) -> (y, state_out)
'''


def test_a_rank_3_third_input_is_the_conv_state() -> None:
    block = load_program("conv.kiln", TEXT).bundle("Conv", {}).module("Conv")
    (conv,) = [op for op in block.forward.ops if op.type == "mamba_conv1d"]
    assert conv.inputs[2] == ""  # no bias
    rng = np.random.default_rng(0)
    b, d, k, t = 2, 3, 4, 5
    x, w = rng.standard_normal((b, d, t)), rng.standard_normal((d, 1, k))
    state = rng.standard_normal((b, d, k))
    out = run_graph(block.forward, {"x": x, "w": w, "state": state}, bindings={"B": b, "T": t},
                    float_dtype=np.float64)
    seq = np.concatenate([state[..., 1:], x], axis=2)  # the K - 1 inputs before x, then x
    pre = np.stack([np.einsum("bdk,dk->bd", seq[..., i:i + k], w[:, 0]) for i in range(t)], axis=2)
    np.testing.assert_allclose(out["y"], pre / (1 + np.exp(-pre)), rtol=1e-12)
    np.testing.assert_array_equal(out["state_out"], seq[..., -k:])  # the last K inputs


def test_a_rank_1_third_input_is_still_the_bias() -> None:
    text = TEXT.replace("state: [B, d, k]\n    outputs", "bias: [d]\n    outputs")
    text = text.replace("(x, w, state)", "(x, w, bias)").replace("(y, state_out)", "y")
    text = text.replace("      state_out: [B, d, k]\n", "")
    block = load_program("conv.kiln", text).bundle("Conv", {}).module("Conv")
    (conv,) = [op for op in block.forward.ops if op.type == "mamba_conv1d"]
    assert conv.inputs[2] == "bias" and (len(conv.inputs) < 4 or not conv.inputs[3])
    with pytest.raises(KilnError, match="mamba_conv1d takes"):
        load_program("conv.kiln", text.replace("(x, w, bias)", "(x, w, bias, bias, bias)")).bundle("Conv", {})
