"""DSL features that reach the planner and the runtime: ``@backward`` compiles to ``Module.backward``, which
kiln checks and trains with; ``@recompute`` / ``mark_recompute`` / ``@save`` steer ``recompute="dsl"``;
``recompute_attrs`` the recompute op does not take are rejected at compile time."""

# ruff: noqa: F821  (dimension names inside Tensor[...] annotations are not Python names)

from typing import Any

import numpy as np
import pytest

from kiln.core import AutodiffError, KilnError, Model, compile
from kiln.core.ir import Bundle, verify
from kiln.dsl import (
    Activation,
    Array,
    B,
    DSLError,
    Param,
    T,
    Tensor,
    backward,
    block,
    build_bundle,
    forward,
    graph,
    model,
    recompute,
    save,
)

F = "fp32"


def lm(block_name: str) -> type:
    @model
    class HostLM:
        def __init__(self, vocab_size: int = 16, d_model: int = 8, n_layers: int = 2):
            self.vocab_size, self.d_model, self.n_layers = vocab_size, d_model, n_layers

        embedding = Param(Tensor["vocab_size", "d_model", F])
        blocks = Param(Array["n_layers", block_name])

        @forward
        def forward(self, token_ids: Tensor["B", "T", "int32"], position_ids: Tensor["T", "int32"],
                    targets: Tensor["B", "T", "int32"]) -> Tensor["B * T", F]:
            with graph() as g:
                x0 = g.embedding(token_ids, "embedding")
                xN = g.call("StackedBlocks", x0, num_outputs=1, blocks="blocks", n_layers=self.n_layers)
                return g.fused_lm_head_loss(g.view(xN, shape=[B * T, "d_model"]), "embedding", targets)

    return HostLM


def silu_block(name: str, *, scale_d_w: float = 1.0, **hints: Any) -> type:
    """``y = x + silu(x @ w^T)`` with an explicit backward (its ``d_w`` scaled by ``scale_d_w``)."""

    class Silu:
        def __init__(self, d_model: int):
            self.d_model = d_model

        w = Param(Tensor["d_model", "d_model", F])

        @forward
        def forward(self, x: Tensor["B", "T", "d_model", F]) -> Tensor["B", "T", "d_model", F]:
            with graph() as g:
                x_flat = g.view(x, shape=[B * T, "d_model"])
                h = g.matmul(x_flat, "w", transpose="NT")
                a = g.silu(h)
                if hints.get("mark_recompute"):
                    g.mark_recompute(h)
                y = g.add(x, g.view(a, shape=[B, T, "d_model"]))
                return y

        @backward
        def backward(self, d_y):
            with graph() as g:
                d_a = g.view(d_y, shape=[B * T, "d_model"])
                d_h = g.custom("silu_backward", d_a, g.saved("h"))
                d_w = g.matmul(d_h, g.saved("x_flat"), transpose="TN", alpha=scale_d_w)
                d_x_flat = g.matmul(d_h, "w")
                d_x = g.add(d_y, g.view(d_x_flat, shape=[B, T, "d_model"]))  # names avoid forward ones
                return d_x, d_w

    Silu.__name__ = Silu.__qualname__ = name
    return block(Silu)


def grads(bundle: Bundle, recompute: str = "none") -> tuple[float, dict[str, Any]]:
    ids = np.random.default_rng(0).integers(0, 16, (2, 7))
    return Model.from_ir(bundle, seed=3, recompute=recompute).loss_and_grads(ids[:, :-1], ids[:, 1:])


def without_backward(bundle: Bundle) -> Bundle:
    return bundle.evolve(modules=[m.evolve(backward=None) for m in bundle.modules])


# ---------------------------------------------------------------------------------------------
# @backward


def test_backward_compiles_to_module_backward_and_the_forward_saves_what_it_reads() -> None:
    silu_block("ExplicitSiluA")
    bundle = build_bundle(lm("ExplicitSiluA"), {})
    verify(bundle)
    blk = bundle.module("ExplicitSiluA")
    bwd = blk.backward
    assert bwd is not None and bwd.name == "ExplicitSiluA_backward"
    assert [d.name for d in bwd.inputs] == ["d_y"] and [d.name for d in bwd.outputs] == ["d_x", "d_w"]
    assert [d.name for d in bwd.params] == ["w"]
    assert bwd.ops[1].inputs == ("d_a", "saved.h") and bwd.ops[2].inputs == ("d_h", "saved.x_flat")
    assert blk.forward.save == ("h", "x_flat")
    assert not {o for op in bwd.ops for o in op.outputs} & {o for op in blk.forward.ops for o in op.outputs}


def test_training_runs_the_explicit_backward_and_matches_the_derived_one() -> None:
    silu_block("ExplicitSiluB")
    bundle = build_bundle(lm("ExplicitSiluB"), {})
    blk = bundle.module("ExplicitSiluB")
    program = compile(bundle, bindings={"B": 2, "T": 6})
    layer_1 = [st.op for st in program.steps if st.phase == "backward" and st.layer == 1]
    assert layer_1 == list(blk.backward.ops)
    loss, got = grads(bundle)
    loss0, ref = grads(without_backward(bundle))
    assert np.isclose(loss, loss0) and got.keys() == ref.keys()
    for name, g in ref.items():
        np.testing.assert_allclose(got[name], g, rtol=1e-5, atol=1e-7, err_msg=name)


def test_a_wrong_explicit_backward_is_rejected_when_compiled() -> None:
    silu_block("ExplicitSiluWrong", scale_d_w=0.5)
    bundle = build_bundle(lm("ExplicitSiluWrong"), {})
    with pytest.raises(AutodiffError) as err:
        compile(bundle, bindings={"B": 2, "T": 6})
    assert err.value.tensor == "d_w" and "'ExplicitSiluWrong'" in str(err.value)


def test_explicit_backward_and_a_recompute_hint_compose_bit_for_bit() -> None:
    silu_block("ExplicitSiluHinted", mark_recompute=True)
    bundle = build_bundle(lm("ExplicitSiluHinted"), {})
    blk = bundle.module("ExplicitSiluHinted")
    assert blk.forward.recompute == ("h",) and blk.forward.save == ("x_flat",)  # h is read, but recomputed
    b = compile(bundle, bindings={"B": 2, "T": 6}, recompute="dsl").recompute.block("ExplicitSiluHinted")
    assert b is not None and b.recomputed == ("h",)
    loss0, ref = grads(bundle)
    loss, got = grads(bundle, "dsl")
    assert loss == loss0 and all(np.array_equal(got[k], ref[k]) for k in ref)


def _compile_backward(body: Any, n_args: int = 1) -> None:
    @block
    class BadBackward:
        def __init__(self, d_model: int = 4):
            self.d_model = d_model

        w = Param(Tensor["d_model", "d_model", F])

        @forward
        def forward(self, x: Tensor["B", "d_model", F]) -> Tensor["B", "d_model", F]:
            with graph() as g:
                return g.matmul(x, "w", transpose="NT", out_name="y")

        if n_args == 1:
            @backward
            def backward(self, d_y):
                with graph() as g:
                    return body(g, d_y)
        else:
            @backward
            def backward(self, d_y, d_extra):
                with graph() as g:
                    return body(g, d_y)

    build_bundle(BadBackward, {})


@pytest.mark.parametrize(("body", "n_args", "code", "text"), [
    (lambda g, d: g.matmul(d, g.saved("nope"), transpose="TN", out_name="d_w"), 1, "E006", "'nope'"),
    (lambda g, d: g.matmul(d, g.saved("x"), transpose="TN", out_name="grad_w"), 1, "E002", "'grad_w'"),
    (lambda g, d: g.matmul(d, g.saved("x"), transpose="TN", out_name="d_w"), 2, "E003", "2 gradient(s)"),
    (lambda g, d: g.matmul(d, "x", transpose="TN", out_name="d_w"), 1, "E002", "'x'"),
])
def test_backward_mistakes_are_reported_at_compile_time(body: Any, n_args: int, code: str, text: str) -> None:
    with pytest.raises(KilnError) as err:
        _compile_backward(body, n_args)
    assert err.value.code == code and text in str(err.value), err.value


# ---------------------------------------------------------------------------------------------
# @recompute, mark_recompute, @save


@block
class HintedNormMLP:
    def __init__(self, d_model: int):
        self.d_model = d_model

    w = Param(Tensor["d_model", "d_model", F])
    norm = Param(Tensor["d_model", F])

    @recompute("n", "h", "a")
    @save("n_rstd")
    @forward
    def forward(self, x: Tensor["B", "T", "d_model", F]) -> Tensor["B", "T", "d_model", F]:
        with graph() as g:
            n, _ = g.rmsnorm(x, "norm", y_name="n", rstd_name="n_rstd")
            h = g.matmul(g.view(n, shape=[B * T, "d_model"], out_name="n_flat"), "w", transpose="NT")
            a = g.silu(h)
            return g.add(x, g.view(a, shape=[B, T, "d_model"]))


def test_recompute_and_save_decorators_steer_the_dsl_plan_bit_for_bit() -> None:
    bundle = build_bundle(lm("HintedNormMLP"), {"n_layers": 3})
    fwd = bundle.module("HintedNormMLP").forward
    assert fwd.recompute == ("n", "h", "a") and fwd.save == ("n_rstd",)
    plan = compile(bundle, bindings={"B": 2, "T": 6}, recompute="dsl").recompute.block("HintedNormMLP")
    assert plan is not None
    assert plan.recomputed == ("n", "n_flat", "h")  # a: silu's backward reads h, nobody reads a
    assert [r.type for r in plan.op("n").replay] == ["rmsnorm_apply_saved", "view"]  # from the kept rstd
    assert "n_rstd" in plan.saved and not {"n", "h"} & set(plan.saved)
    loss0, ref = grads(bundle)
    loss, got = grads(bundle, "dsl")
    assert loss == loss0 and all(np.array_equal(got[k], ref[k]) for k in ref)


# ---------------------------------------------------------------------------------------------
# recompute_attrs


def test_recompute_attrs_the_op_does_not_take_are_a_compile_error() -> None:
    def slots(**attrs: Any) -> type:
        @block
        class AttrsBlock:
            def __init__(self, d_model: int = 4):
                self.d_model = d_model

            w = Param(Tensor["d_model", "d_model", F])
            y = Activation(Tensor["B", "d_model", F], recompute=True, recompute_from=["@input:x", "@param:w"],
                           recompute_op="matmul", recompute_attrs=attrs)

            @forward
            def forward(self, x: Tensor["B", "d_model", F]) -> Tensor["B", "d_model", F]:
                with graph() as g:
                    return g.matmul(x, "w", transpose="NT", out_name="y")

        return AttrsBlock

    with pytest.raises(KilnError) as err:
        build_bundle(slots(transpose="NT", attn_impl="cudnn"), {})
    assert err.value.code == "E003" and "'attn_impl'" in str(err.value) and "'matmul'" in str(err.value)
    assert "test_backward_and_hints.py" in str(err.value.location)
    y = build_bundle(slots(transpose="NT", _matmul_op="y"), {}).module("AttrsBlock").activations.get("y")
    assert dict(y.recompute_attrs) == {"transpose": "NT", "_matmul_op": "y"}


def test_param_roles_reach_the_ir_and_bad_ones_are_diagnosed() -> None:
    from kiln.dsl.stdlib.models import Qwen3Model

    bundle = build_bundle(Qwen3Model, {"vocab_size": 64, "d_model": 32, "n_layers": 1, "num_query_heads": 4,
                                       "num_kv_heads": 2, "head_size": 8, "d_ff": 64, "max_seq": 16})
    specs = {p.name: p for m in bundle.modules for p in m.params}
    assert specs["embedding"].role == "embedding"
    assert specs["ln1_weight"].role is None and specs["ln1_weight"].inferred_role() == "norm"

    @model
    class Gained:
        def __init__(self, vocab_size: int = 16, d_model: int = 8):
            self.vocab_size, self.d_model = vocab_size, d_model

        embedding = Param(Tensor["vocab_size", "d_model", F], role="gain")

        @forward
        def forward(self, token_ids: Tensor["B", "T", "int32"],
                    targets: Tensor["B", "T", "int32"]) -> Tensor["B * T", F]:
            with graph() as g:
                x = g.embedding(token_ids, "embedding")
                return g.fused_lm_head_loss(g.view(x, shape=[B * T, "d_model"]), "embedding", targets)

    with pytest.raises(DSLError, match="role 'gain' is not one of weight, bias, norm, embedding, adapter"):
        build_bundle(Gained, {})
