"""Explicit backward graphs (``Module.backward``): ``compile`` validates one (seed 004 §5.12.5), checks it
against the derived backward on random float64 inputs (§9.8.1) and then runs it in place of the derived
one; a wrong one is rejected naming the module and the gradient."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kiln.core import AutodiffError, Model, compile
from kiln.core.autodiff import explicit_backward, verify_backward
from kiln.core.ir import Bundle, Graph, Module, Op, ParamSpec, TensorDecl

ACT = ["B", "T", "C"]
FLAT = ["B * T", "C"]
BINDS = {"B": 2, "T": 5}

# y = x + silu(x @ up^T) @ down^T, with up [M, C] and down [C, M]
FORWARD = Graph(
    "Lin", inputs=[TensorDecl("x", ACT, "fp32")],
    params=[TensorDecl("up", ["M", "C"], "fp32"), TensorDecl("down", ["C", "M"], "fp32")],
    ops=[Op("view", ["x"], ["x_flat"], {"shape": FLAT}),
         Op("matmul", ["x_flat", "up"], ["u"], {"transpose": "NT"}), Op("silu", ["u"], ["a"]),
         Op("matmul", ["a", "down"], ["d"], {"transpose": "NT"}), Op("view", ["d"], ["d3"], {"shape": ACT}),
         Op("add", ["x", "d3"], ["y"])],
    outputs=[TensorDecl("y", ACT, "fp32")], save=("x_flat", "u", "a"))

# its backward, by hand
CORRECT = (
    Op("view", ["d_y"], ["g_d"], {"shape": FLAT}),
    Op("matmul", ["g_d", "saved.a"], ["d_down"], {"transpose": "TN"}),
    Op("matmul", ["g_d", "down"], ["g_a"], {"transpose": "NN"}),
    Op("silu_backward", ["g_a", "saved.u"], ["g_u"]),
    Op("matmul", ["g_u", "saved.x_flat"], ["d_up"], {"transpose": "TN"}),
    Op("matmul", ["g_u", "up"], ["g_x"], {"transpose": "NN"}),
    Op("view", ["g_x"], ["g_x3"], {"shape": ACT}),
    Op("add", ["d_y", "g_x3"], ["d_x"]),
)


def block(ops: tuple[Op, ...] = CORRECT, forward: Graph = FORWARD) -> Module:
    backward = Graph("Lin_backward", inputs=[TensorDecl("d_y", ACT, "fp32")], params=forward.params, ops=ops)
    return Module("Lin", kind="block", config={"C": 4, "M": 6}, forward=forward, backward=backward,
                  params=[ParamSpec(d.name, d.shape, "fp32", init={"kind": "normal", "std": 0.5})
                          for d in forward.params])


def replace(op_out: str, new: Op) -> tuple[Op, ...]:
    return tuple(new if op.outputs == (op_out,) else op for op in CORRECT)


def lm(blk: Module | None) -> Bundle:
    """Embedding, two layers of the block (``None``: without its explicit backward), tied LM-head loss."""
    blk = blk if blk is not None else block().evolve(backward=None)
    model = Module(
        "LM", kind="model", config={"V": 11, "C": 4, "L": 2},
        params=[ParamSpec("embedding", ["V", "C"], "fp32", init={"kind": "normal", "std": 0.5}),
                ParamSpec("blocks", [], "fp32", array_of="Lin", count="L")],
        forward=Graph(
            "LM", inputs=[TensorDecl("token_ids", ["B", "T"], "int32"),
                          TensorDecl("targets", ["B", "T"], "int32")],
            params=[TensorDecl("embedding", ["V", "C"], "fp32"), TensorDecl("blocks", [], "fp32")],
            ops=[Op("embedding", ["token_ids", "embedding"], ["x0"]),
                 Op("call", ["x0"], ["xN"], {"module": "Lin", "n_layers": "L", "params": "blocks"}),
                 Op("view", ["xN"], ["x_flat"], {"shape": FLAT}),
                 Op("view", ["targets"], ["t_flat"], {"shape": ["B * T"]}),
                 Op("fused_lm_head_loss", ["x_flat", "embedding", "t_flat"], ["loss", "lse"])],
            outputs=[TensorDecl("loss", ["B * T"], "fp32")]))
    return Bundle([model, blk], entry="LM")


def grads(bundle: Bundle, recompute: str = "none") -> tuple[float, dict[str, Any]]:
    ids = np.random.default_rng(4).integers(0, 11, (2, 6))
    return Model.from_ir(bundle, seed=1, recompute=recompute).loss_and_grads(ids[:, :-1], ids[:, 1:])


def test_the_hand_written_backward_agrees_with_finite_differences() -> None:
    """The test's own oracle, independent of kiln's derived backward."""
    binds = {"B": 2, "T": 3, "C": 4, "M": 6}
    report = verify_backward(FORWARD, block().backward, bindings=binds, loss_name="y")
    assert report.keys() == {"up", "down"} and max(report.values()) < 1e-6


def test_a_correct_explicit_backward_is_checked_then_used_for_training() -> None:
    res = explicit_backward(block())
    assert dict(res.grads) == {"x": "d_x", "up": "d_up", "down": "d_down"}
    assert res.saves == ("a", "u", "x_flat") and res.backward == block().backward
    bundle = lm(block())
    program = compile(bundle, bindings=BINDS)
    for layer in (0, 1):  # the backward of each layer is the explicit graph's ops, in order
        steps = [st.op for st in program.steps if st.phase == "backward" and st.layer == layer]
        assert steps == list(CORRECT)
    loss, got = grads(bundle)
    loss0, ref = grads(lm(None))  # the derived backward's gradients
    assert np.isclose(loss, loss0, rtol=1e-6)
    weights = {f"blocks.{i}.{w}" for i in (0, 1) for w in ("up", "down")}
    assert got.keys() == ref.keys() == {"embedding", *weights}
    for name, g in ref.items():
        np.testing.assert_allclose(got[name], g, rtol=1e-5, atol=1e-7, err_msg=name)


def test_an_explicit_backward_reads_recomputed_tensors_like_a_derived_one() -> None:
    hinted = FORWARD.evolve(save=("x_flat", "a"), recompute=("u",))
    bundle = lm(block(forward=hinted))
    b = compile(bundle, bindings=BINDS, recompute="dsl").recompute.block("Lin")
    assert b is not None and b.recomputed == ("u",) and "u" not in b.saved
    loss0, ref = grads(bundle)
    loss, got = grads(bundle, "dsl")
    assert loss == loss0 and all(np.array_equal(got[k], ref[k]) for k in ref)


def test_a_wrong_explicit_backward_is_rejected_naming_the_module_and_the_gradient() -> None:
    doubled = (*CORRECT[:1], Op("matmul", ["g_d", "saved.a"], ["d_down:raw"], {"transpose": "TN"}),
               Op("scale", ["d_down:raw"], ["d_down"], {"factor": 2.0}), *CORRECT[2:])
    with pytest.raises(AutodiffError) as err:
        explicit_backward(block(doubled))
    assert err.value.tensor == "d_down" and "'Lin'" in str(err.value) and "'d_down'" in str(err.value)
    with pytest.raises(AutodiffError, match=r"module 'Lin': explicit gradient 'd_down' differs"):
        compile(lm(block(doubled)), bindings=BINDS)
    swapped = replace("g_u", Op("silu_backward", ["g_a", "saved.a"], ["g_u"]))  # silu'(a), not silu'(u)
    with pytest.raises(AutodiffError) as err:
        grads(lm(block(swapped)))
    assert err.value.tensor in ("d_up", "d_x") and "'Lin'" in str(err.value)


def test_a_frozen_parameter_needs_no_explicit_gradient() -> None:
    def frozen_down(ops: tuple[Op, ...]) -> Module:
        blk = block(ops)
        return blk.evolve(params=[p.evolve(frozen=p.name == "down") for p in blk.params])

    without = tuple(op for op in CORRECT if op.outputs != ("d_down",))
    assert dict(explicit_backward(frozen_down(without)).grads) == {"x": "d_x", "up": "d_up"}
    twice = {"transpose": "TN", "alpha": 2.0}
    doubled = replace("d_down", Op("matmul", ["g_d", "saved.a"], ["d_down"], twice))
    explicit_backward(frozen_down(doubled))  # kiln never uses it, so it is not compared
    _, got = grads(lm(frozen_down(without)))
    assert set(got) == {"embedding", "blocks.0.up", "blocks.1.up"}


@pytest.mark.parametrize(("ops", "forward", "code", "culprit"), [
    (CORRECT[:-1], FORWARD, "E005", "input 'x'"),
    (replace("g_u", Op("silu_backward", ["g_a", "saved.zzz"], ["g_u"])), FORWARD, "E006", "'zzz'"),
    (CORRECT, FORWARD.evolve(save=("x_flat", "a")), "E006", "'u' is not in the forward save list"),
    (replace("g_u", Op("silu_backward", ["g_a", "u"], ["g_u"])), FORWARD, "E002", "'u'"),
    (replace("d_up", Op("matmul", ["saved.x_flat", "g_u"], ["d_up"], {"transpose": "TN"})), FORWARD, "E018",
     "'d_up'"),
    (replace("d_down", Op("zeros", [], ["d_down"], {"shape": ["C", "M"], "dtype": "int32"})), FORWARD, "E020",
     "'d_down'"),
    (replace("g_a", Op("matmul", ["g_d", "down"], ["a"], {"transpose": "NN"})), FORWARD, "E017", "'a'"),
])
def test_an_invalid_explicit_backward_is_rejected_with_its_diagnostic(
        ops: tuple[Op, ...], forward: Graph, code: str, culprit: str) -> None:
    with pytest.raises(AutodiffError) as err:
        explicit_backward(block(ops, forward))
    assert code in [d.code for d in err.value.diagnostics], err.value
    assert culprit in str(err.value) and "'Lin'" in str(err.value)
    with pytest.raises(AutodiffError):
        compile(lm(block(ops, forward)), bindings=BINDS)
