"""derive_backward on whole graphs, its options, and the explicit-backward diagnostics."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.core import KilnError, op_registry
from kiln.core.autodiff import DeriveBackwardOptions, check_backward, derive_backward, verify_backward
from kiln.core.autodiff._interp import run_graph
from kiln.core.ir import Graph, Op, TensorDecl

REG = op_registry()
DIMS = {"B": 2, "T": 3, "C": 8, "Hq": 2, "Hkv": 1, "D": 4, "M": 6, "V": 11}


def decoder(n_layers: int = 2) -> Graph:
    """A small Qwen3-style decoder written directly in IR: GQA attention with qk-norm, SwiGLU MLP."""
    qkv_dim, attn = "(Hq + 2 * Hkv) * D", "Hq * D"
    params = [TensorDecl("embed", ["V", "C"], "fp32"), TensorDecl("final_norm", ["C"], "fp32"),
              TensorDecl("lm_head", ["V", "C"], "fp32")]
    heads = {"Hq": "Hq", "Hkv": "Hkv", "D": "D"}
    ops = [Op("embedding", ["token_ids", "embed"], ["x0"])]
    x = "x0"
    for i in range(n_layers):
        params += [TensorDecl(f"ln1_{i}", ["C"], "fp32"), TensorDecl(f"qkv_w_{i}", [qkv_dim, "C"], "fp32"),
                   TensorDecl(f"qn_{i}", ["D"], "fp32"), TensorDecl(f"kn_{i}", ["D"], "fp32"),
                   TensorDecl(f"o_w_{i}", ["C", attn], "fp32"), TensorDecl(f"ln2_{i}", ["C"], "fp32"),
                   TensorDecl(f"up_w_{i}", ["2 * M", "C"], "fp32"),
                   TensorDecl(f"down_w_{i}", ["C", "M"], "fp32")]
        ops += [
            Op("rmsnorm", [x, f"ln1_{i}"], [f"h{i}", f"rstd1_{i}"]),
            Op("view", [f"h{i}"], [f"hf{i}"], {"shape": ["B * T", "C"]}),
            Op("matmul", [f"hf{i}", f"qkv_w_{i}"], [f"qkvf{i}"], {"transpose": "NT"}),
            Op("view", [f"qkvf{i}"], [f"qkv{i}"], {"shape": ["B", "T", qkv_dim]}),
            Op("qkv_qk_norm_rope", [f"qkv{i}", f"qn_{i}", f"kn_{i}", "", "position_ids"],
               [f"qkvr{i}", f"qr{i}", f"kr{i}"], heads),
            Op("flash_attention", [f"qkvr{i}"], [f"att{i}", f"lse{i}"], {**heads, "causal": True}),
            Op("view", [f"att{i}"], [f"attf{i}"], {"shape": ["B * T", attn]}),
            Op("matmul", [f"attf{i}", f"o_w_{i}"], [f"of{i}"], {"transpose": "NT"}),
            Op("view", [f"of{i}"], [f"o{i}"], {"shape": ["B", "T", "C"]}),
            Op("add", [x, f"o{i}"], [f"r{i}"]),
            Op("rmsnorm", [f"r{i}", f"ln2_{i}"], [f"g{i}", f"rstd2_{i}"]),
            Op("view", [f"g{i}"], [f"gf{i}"], {"shape": ["B * T", "C"]}),
            Op("matmul", [f"gf{i}", f"up_w_{i}"], [f"up{i}"], {"transpose": "NT"}),
            Op("swiglu", [f"up{i}"], [f"act{i}"]),
            Op("matmul", [f"act{i}", f"down_w_{i}"], [f"dn{i}"], {"transpose": "NT"}),
            Op("view", [f"dn{i}"], [f"mlp{i}"], {"shape": ["B", "T", "C"]}),
            Op("add", [f"r{i}", f"mlp{i}"], [f"x{i + 1}"]),
        ]
        x = f"x{i + 1}"
    ops += [
        Op("rmsnorm", [x, "final_norm"], ["xf", "rstdf"]),
        Op("view", ["xf"], ["xff"], {"shape": ["B * T", "C"]}),
        Op("fused_lm_head_loss", ["xff", "lm_head", "targets"], ["loss", "lse_f"], {"chunk_size": 4}),
    ]
    return Graph("decoder", inputs=[TensorDecl("token_ids", ["B", "T"], "int32"),
                                    TensorDecl("position_ids", ["T"], "int32"),
                                    TensorDecl("targets", ["B * T"], "int32")],
                 params=params, ops=ops, outputs=[TensorDecl("loss", ["B * T"], "fp32")])


def test_two_layer_decoder_gradients_equal_finite_differences() -> None:
    g = decoder()
    g.verify(registry=REG)
    report = verify_backward(g, bindings=DIMS, registry=REG, seed=3)
    assert set(report) == {d.name for d in g.params}
    worst = max(report.items(), key=lambda kv: kv[1])
    assert worst[1] <= 1e-6, worst


def test_repeated_structure_backward_is_well_formed_and_saves_match_references() -> None:
    res = derive_backward(decoder(), registry=REG)
    res.backward.verify(registry=REG)
    refs = {i.removeprefix("saved.") for op in res.backward.ops for i in op.inputs if i.startswith("saved.")}
    assert set(res.saves) == refs and len(res.saves) == len(refs)
    assert res.forward.save == res.saves
    assert {d.name for d in res.backward.outputs} == {"d_" + d.name for d in decoder().params}


def _values(g: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for d in (*g.inputs, *g.params):
        shape = tuple(s.evaluate(DIMS) for s in d.shape)
        out[d.name] = (rng.standard_normal(shape) if d.dtype == "fp32"
                       else rng.integers(0, DIMS["V"], size=shape).astype(np.int32))
    out["position_ids"] = np.arange(DIMS["T"], dtype=np.int32)
    return out


def test_stop_gradients_remove_the_gradient_and_the_ops_that_only_fed_it() -> None:
    g = decoder(1)
    full = derive_backward(g, registry=REG)
    frozen = derive_backward(g, DeriveBackwardOptions(stop_gradients=("embed", "qkv_w_0")), registry=REG)
    outs = {d.name for d in frozen.backward.outputs}
    assert "d_embed" not in outs and "d_qkv_w_0" not in outs and "d_o_w_0" in outs
    assert not any(op.type == "embedding_backward" for op in frozen.backward.ops)
    assert any(op.type == "embedding_backward" for op in full.backward.ops)
    assert len(frozen.backward.ops) < len(full.backward.ops)
    # what remains computes the same numbers as in the full backward
    vals = _values(g)
    fwd = run_graph(g, vals, registry=REG, bindings=DIMS, float_dtype=np.float64)
    seed = {"d_loss": np.ones(DIMS["B"] * DIMS["T"]), **{f"saved.{k}": v for k, v in fwd.items()}, **fwd}
    a = run_graph(full.backward, seed, registry=REG, bindings=DIMS, float_dtype=np.float64)
    b = run_graph(frozen.backward, seed, registry=REG, bindings=DIMS, float_dtype=np.float64)
    np.testing.assert_array_equal(a["d_o_w_0"], b["d_o_w_0"])


def test_integer_tensors_never_receive_gradients() -> None:
    res = derive_backward(decoder(1), registry=REG)
    names = {o for op in res.backward.ops for o in op.outputs} | {d.name for d in res.backward.outputs}
    for t in ("token_ids", "position_ids", "targets"):
        assert "d_" + t not in names
        assert t not in res.grads


def test_a_tensor_used_three_times_gets_the_sum_of_three_contributions() -> None:
    g = Graph("fan", inputs=[TensorDecl("x", ["N", "C"], "fp32")],
              params=[TensorDecl("w", ["C", "C"], "fp32")],
              ops=[Op("matmul", ["x", "w"], ["a"]), Op("matmul", ["x", "w"], ["b"], {"transpose": "NT"}),
                   Op("matmul", ["x", "w"], ["c"], {"alpha": 2.0}), Op("add", ["a", "b"], ["ab"]),
                   Op("add", ["ab", "c"], ["s"]), Op("reduce_sum", ["s"], ["loss"], {"axes": [1]})],
              outputs=[TensorDecl("loss", ["N"], "fp32")])
    res = derive_backward(g, registry=REG)
    acc = [op for op in res.backward.ops if op.type == "add" and op.outputs[0].startswith("d_w")]
    assert len(acc) == 2  # three contributions need two additions
    report = verify_backward(g, bindings={"N": 3, "C": 4}, registry=REG)
    assert report["w"] <= 1e-6
    with pytest.raises(KilnError, match="is used by 2 ops"):
        derive_backward(g, DeriveBackwardOptions(accumulate_grads=False), registry=REG)


def test_extra_saves_auto_save_and_grad_prefix() -> None:
    g = decoder(1)
    extra = derive_backward(g, DeriveBackwardOptions(extra_saves=("h0",)), registry=REG)
    assert "h0" in extra.saves
    plain = derive_backward(g, registry=REG)
    assert set(extra.saves) == set(plain.saves) | {"h0"}
    with pytest.raises(KilnError) as err:
        derive_backward(g, DeriveBackwardOptions(auto_save=False), registry=REG)
    assert err.value.code == "E006"
    assert "saved." in str(err.value)
    only = derive_backward(g, DeriveBackwardOptions(auto_save=False, extra_saves=plain.saves), registry=REG)
    assert only.saves == plain.saves
    pref = derive_backward(g, DeriveBackwardOptions(grad_prefix="grad_"), registry=REG)
    assert {d.name for d in pref.backward.outputs} == {"grad_" + d.name for d in g.params}
    assert not any(o.startswith("d_") for op in pref.backward.ops for o in op.outputs)
    with pytest.raises(KilnError, match="nope"):
        derive_backward(g, DeriveBackwardOptions(extra_saves=("nope",)), registry=REG)


def test_missing_rule_names_the_op_and_how_to_register_one() -> None:
    from kiln.core import OpDef, OpRegistry, TensorType

    reg = OpRegistry()
    for _name, opdef in REG.items():
        reg.register_op(opdef)
    reg.register_op(OpDef("norule", ("x",), ("y",), lambda x: x,
                          lambda c: [TensorType(c.shape(0), c.dtype(0))]))
    g = Graph("g", inputs=[TensorDecl("x", ["N"], "fp32")], ops=[Op("norule", ["x"], ["loss"])],
              outputs=[TensorDecl("loss", ["N"], "fp32")])
    with pytest.raises(KilnError, match="'norule' has no backward rule") as err:
        derive_backward(g, registry=reg)
    assert "register_backward_rule" in (err.value.hint or "")


def test_unknown_op_is_E014() -> None:
    g = Graph("g", inputs=[TensorDecl("x", ["N"], "fp32")], ops=[Op("mystery", ["x"], ["loss"])],
              outputs=[TensorDecl("loss", ["N"], "fp32")])
    with pytest.raises(KilnError) as err:
        derive_backward(g, registry=REG)
    assert err.value.code == "E014" and "mystery" in str(err.value)


# Explicit backward graphs ---------------------------------------------------------------------

FWD = Graph("lin", inputs=[TensorDecl("x", ["N", "C"], "fp32")], params=[TensorDecl("w", ["O", "C"], "fp32")],
            ops=[Op("matmul", ["x", "w"], ["loss"], {"transpose": "NT"})],
            outputs=[TensorDecl("loss", ["N", "O"], "fp32")])


def _bwd(*ops: Op) -> Graph:
    return Graph("lin_backward", inputs=[TensorDecl("d_loss", ["N", "O"], "fp32")], params=FWD.params,
                 ops=ops)


def test_correct_explicit_backward_passes_and_matches_finite_differences() -> None:
    bwd = _bwd(Op("matmul", ["d_loss", "saved.x"], ["d_w"], {"transpose": "TN"}))
    assert check_backward(FWD, bwd, ["x"], registry=REG) == []
    assert verify_backward(FWD, bwd, bindings={"N": 3, "C": 4, "O": 2}, registry=REG)["w"] <= 1e-6


@pytest.mark.parametrize(("code", "bwd", "saves", "culprit"), [
    ("E005", _bwd(Op("matmul", ["d_loss", "saved.x"], ["d_other"], {"transpose": "TN"})), ["x"], "'w'"),
    ("E006", _bwd(Op("matmul", ["d_loss", "saved.x"], ["d_w"], {"transpose": "TN"})), [], "saved.x"),
    ("E018", _bwd(Op("matmul", ["saved.x", "d_loss"], ["d_w"], {"transpose": "TN"})), ["x"], "'d_w'"),
    ("E019", _bwd(Op("add", ["d_loss", "b"], ["a"]), Op("add", ["a", "d_loss"], ["b"]),
                  Op("matmul", ["b", "saved.x"], ["d_w"], {"transpose": "TN"})), ["x"], "add"),
    ("E020", _bwd(Op("zeros", [], ["d_w"], {"shape": ["O", "C"], "dtype": "int32"})), [], "'d_w'"),
])
def test_explicit_backward_diagnostics(code: str, bwd: Graph, saves: list[str], culprit: str) -> None:
    diags = check_backward(FWD, bwd, saves, registry=REG)
    assert [d.code for d in diags] == [code], diags
    assert culprit in diags[0].message


def _stacked(n_layers: int) -> tuple[Graph, dict[str, object]]:
    from kiln.core.ir import Module, ParamSpec

    block = Graph("block", inputs=[TensorDecl("x", ["N", "C"], "fp32")],
                  params=[TensorDecl("w", ["C", "C"], "fp32"), TensorDecl("ln", ["C"], "fp32")],
                  ops=[Op("rmsnorm", ["x", "ln"], ["h", "rstd"]),
                       Op("matmul", ["h", "w"], ["m"], {"transpose": "NT"}), Op("add", ["x", "m"], ["y"])],
                  outputs=[TensorDecl("y", ["N", "C"], "fp32")])
    blk = Module("Block", kind="block",
                 params=[ParamSpec("w", ["C", "C"], "fp32"), ParamSpec("ln", ["C"], "fp32")], forward=block)
    model = Graph("model", inputs=[TensorDecl("ids", ["N"], "int32"), TensorDecl("targets", ["N"], "int32")],
                  params=[TensorDecl("embed", ["V", "C"], "fp32"), TensorDecl("blocks", [], "fp32")],
                  ops=[Op("embedding", ["ids", "embed"], ["x0"]),
                       Op("call", ["x0"], ["xn"],
                          {"module": "Block", "n_layers": n_layers, "params": "blocks"}),
                       Op("fused_lm_head_loss", ["xn", "embed", "targets"], ["loss", "lse"])],
                  outputs=[TensorDecl("loss", ["N"], "fp32")])
    return model, {"Block": blk}


def test_repeated_layers_are_differentiated_once_not_per_layer() -> None:
    two, modules = _stacked(2)
    many, _ = _stacked(64)
    b2 = derive_backward(two, registry=REG, modules=modules).backward  # type: ignore[arg-type]
    b64 = derive_backward(many, registry=REG, modules=modules).backward  # type: ignore[arg-type]
    calls = [op for op in b64.ops if op.type == "call_backward"]
    assert len(calls) == 1 and calls[0].attrs["n_layers"] == 64
    assert len(b2.ops) == len(b64.ops)  # the layer count is an attribute, not unrolled ops
    assert {d.name for d in b64.outputs} == {"d_embed", "d_blocks"}
    # the gradient flows through the stack into the (tied) embedding: two contributions, summed
    emb = next(op for op in b64.ops if op.type == "embedding_backward")
    assert emb.inputs[0] == calls[0].outputs[0]
    assert any(op.type == "add" and op.outputs[0] == "d_embed" for op in b64.ops)


def test_a_module_with_an_explicit_backward_is_validated_by_verify() -> None:
    from kiln.core import IRError
    from kiln.core.ir import Module, ParamSpec

    bwd = _bwd(Op("matmul", ["d_loss", "saved.x"], ["d_w"], {"transpose": "TN"}))
    good = Module("lin", params=[ParamSpec("w", ["O", "C"], "fp32")], forward=FWD.evolve(save=("x",)),
                  backward=bwd)
    good.verify(registry=REG)
    with pytest.raises(IRError) as err:
        good.evolve(forward=FWD).verify(registry=REG)  # x is no longer saved
    assert err.value.code == "E006" and "saved.x" in str(err.value)


def test_rule_registry_api() -> None:
    from kiln.core import OpDef, OpError, TensorType, register_op, reset_plugins
    from kiln.core.autodiff import has_rule, register_rule, registered_ops

    assert has_rule("matmul") and "matmul" in registered_ops() and "rmsnorm_backward" not in registered_ops()
    try:
        same = lambda c: [TensorType(c.shape(0), c.dtype(0))]  # noqa: E731
        register_op(OpDef("api_probe", ("x",), ("y",), lambda x: 2 * x, same))
        assert not has_rule("api_probe")
        register_rule("api_probe", lambda ctx: [ctx.emit("scale", ctx.d_out, factor=2.0)])
        assert has_rule("api_probe") and "api_probe" in registered_ops()
        with pytest.raises(OpError, match="already has a backward rule"):
            register_rule("api_probe", lambda ctx: [None])
        g = Graph("g", inputs=[TensorDecl("x", ["N"], "fp32")], ops=[Op("api_probe", ["x"], ["loss"])],
                  outputs=[TensorDecl("loss", ["N"], "fp32")])
        assert [op.type for op in derive_backward(g).backward.ops] == ["scale"]
    finally:
        reset_plugins()  # drop the run-time op from the process-wide registry
