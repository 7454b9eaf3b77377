"""The graph builder: every method of seed 003 §8 emits a registered op with kiln's attribute names;
naming; memory directives; submodule inlining; MoE plumbing."""

# ruff: noqa: F821  (dimension names inside Tensor[...] annotations are not Python names)

from typing import Any

import pytest

from kiln.core import op_registry
from kiln.core.autodiff import DeriveBackwardOptions, derive_backward
from kiln.core.ir import Graph, thaw, verify
from kiln.dsl import (
    B,
    Dim,
    DSLError,
    GraphBuilder,
    Param,
    T,
    Tensor,
    build_bundle,
    forward,
    graph,
    module,
    save,
)

F = "fp32"


def _graph(cls: type, config: dict[str, Any] | None = None) -> Graph:
    m = build_bundle(cls, config or {}).module(cls.__name__)
    verify(m)
    return m.forward


def _ops(g: Graph) -> list[tuple[str, dict[str, Any]]]:
    return [(op.type, thaw(op.attrs)) for op in g.ops]


@module
class Everything:
    """Uses every builder method once."""

    def __init__(
        self,
        d_model: int = 16,
        num_query_heads: int = 2,
        num_kv_heads: int = 1,
        head_size: int = 8,
        num_experts: int = 4,
        max_seq: int = 32,
        rope_theta: float = 500.0,
    ):
        self.d_model, self.num_query_heads, self.num_kv_heads = d_model, num_query_heads, num_kv_heads
        self.head_size, self.num_experts, self.max_seq, self.rope_theta = (
            head_size,
            num_experts,
            max_seq,
            rope_theta,
        )
        self.C, self.D = Dim("C"), Dim("D")
        self.QKV = (Dim("Hq") + 2 * Dim("Hkv")) * self.D

    w = Param(Tensor["C", "C", F])
    w_qkv = Param(Tensor["QKV", "C", F])
    bias = Param(Tensor["C", F])
    norm = Param(Tensor["C", F])
    qn = Param(Tensor["D", F])
    freqs = Param(Tensor["MaxSeq", "D // 2", 2, F], frozen=True)
    emb = Param(Tensor[64, "C", F])
    router = Param(Tensor["E", "C", F])
    gate_up = Param(Tensor["E", "2 * C", "C", F])
    down = Param(Tensor["E", "C", "C", F])

    @forward
    def forward(
        self,
        x: Tensor["B", "T", "C", F],
        ids: Tensor["B", "T", "int32"],
        position_ids: Tensor["T", "int32"],
        targets: Tensor["B", "T", "int32"],
    ) -> Tensor["B * T", F]:
        with graph() as g:
            flat = g.view(x, shape=[B * T, self.C])
            a = g.matmul(flat, "w", transpose="NT", alpha=0.5)
            acc = g.matmul(flat, "w", a, accumulate=True)
            b = g.matmul_bias(acc, "w", "bias")
            b3 = g.reshape(b, shape=[B, T, "C"])
            bm = g.batched_matmul(b3, g.transpose(b3, dim0=1, dim1=2))
            y, rstd = g.rmsnorm(x, "norm", eps=1e-5)
            res, y2, rstd2 = g.fused_residual_rmsnorm(x, y, "norm")
            ln, mean, lrstd = g.layernorm(y2, "norm", "bias")
            acts = [
                g.silu(ln),
                g.relu(ln),
                g.relu2(ln),
                g.gelu(ln),
                g.softmax(ln, dim=-1),
                g.silu_mul(ln, ln),
                g.swiglu(g.concat(ln, ln, dim=-1)),
            ]
            qkv = g.view(g.matmul(flat, "w_qkv", transpose="NT"), shape=[B, T, self.QKV])
            roped = g.rope(qkv, "freqs", position_ids)
            qkv2, q_rstd, k_rstd = g.qkv_qk_norm_rope(roped, "qn", "qn", None, position_ids, eps=1e-5)
            att, lse = g.flash_attention(qkv2, causal=True, window_size=4)
            q4 = g.view(qkv, shape=[B, T, "Hq + 2 * Hkv", "D"])
            q, k, v = g.split(q4, split_size=[2, 1, 1], dim=2)
            att2, lse2 = g.flash_attention_qkv(q, g.copy(k), g.contiguous(v))
            perm = g.permute(att2, dims=[0, 2, 1, 3])
            z = g.add(g.mul(res, ln), g.scale(ln, factor=0.5))
            z = g.bias_add(z, "bias")
            e = g.embedding(ids, "emb")
            zeros, ones = g.zeros(shape=[B, T, "C"], dtype=F), g.ones(shape=[B, T, "C"], dtype=F)
            filled = g.fill(shape=[B, T, "C"], value=0.5, dtype=F)
            probs = g.moe_softmax(g.matmul(flat, "router", transpose="NT"))
            probs2 = g.moe_sigmoid(g.matmul(flat, "router", transpose="NT"))
            weights, indices = g.moe_topk(probs, top_k=2, normalize=True)
            permuted, scatter = g.moe_permute(flat, indices, top_k=2)
            h = g.moe_grouped_gemm_gate_up(permuted, "gate_up", scatter)
            d = g.moe_grouped_gemm_down(g.swiglu(h), "down", scatter)
            moe = g.moe_unpermute(d, weights, indices, top_k=2)
            total = g.custom("add", g.view(moe, shape=[B, T, "C"]), z)
            for t in (
                *acts,
                att,
                lse,
                att2,
                lse2,
                bm,
                perm,
                e,
                zeros,
                ones,
                filled,
                probs2,
                rstd,
                rstd2,
                mean,
                lrstd,
                q_rstd,
                k_rstd,
            ):
                g.save(t)
            return g.fused_lm_head_loss(g.view(total, shape=[B * T, "C"]), "w", targets, softcap=30.0)


def test_every_builder_method_maps_onto_a_registered_op() -> None:
    fwd = _graph(Everything)
    registry = op_registry()
    assert all(op.type in registry for op in fwd.ops)
    types = {op.type for op in fwd.ops}
    seed_methods = [
        "matmul",
        "matmul_bias",
        "batched_matmul",
        "rmsnorm",
        "fused_residual_rmsnorm",
        "layernorm",
        "swiglu",
        "silu",
        "relu",
        "relu2",
        "gelu",
        "softmax",
        "silu_mul",
        "flash_attention",
        "rope",
        "qkv_qk_norm_rope",
        "view",
        "transpose",
        "permute",
        "split",
        "concat",
        "copy",
        "contiguous",
        "add",
        "mul",
        "scale",
        "bias_add",
        "embedding",
        "fused_lm_head_loss",
        "zeros",
        "ones",
        "fill",
        "moe_softmax",
        "moe_sigmoid",
        "moe_topk",
        "moe_permute",
        "moe_grouped_gemm_gate_up",
        "moe_grouped_gemm_down",
        "moe_unpermute",
    ]
    assert set(seed_methods) <= types
    assert "attention" in types  # flash_attention_qkv
    assert all(
        callable(getattr(GraphBuilder, m))
        for m in [
            *seed_methods,
            "flash_attention_qkv",
            "custom",
            "call",
            "input",
            "output",
            "save",
            "mark_recompute",
            "saved",
        ]
    )
    derive_backward(fwd, DeriveBackwardOptions(loss_name=fwd.outputs[0].name))


def test_seed_argument_names_are_translated() -> None:
    ops = _ops(_graph(Everything))
    by = {}
    for t, a in ops:
        by.setdefault(t, a)
    assert by["softmax"] == {"axis": -1}
    assert by["moe_topk"] == {"k": 2, "normalize": True}
    assert by["moe_permute"] == {"num_experts": "E"}
    assert by["moe_unpermute"] == {"top_k": 2}
    assert by["split"] == {"sizes": [2, 1, 1], "dim": 2}
    assert by["flash_attention"] == {"Hq": "Hq", "Hkv": "Hkv", "D": "D", "causal": True, "window_size": 4}
    assert by["rope"] == {"head_dim": "D", "theta": 500.0}  # rope_theta from the config
    assert by["qkv_qk_norm_rope"]["theta"] == 500.0
    assert [a for t, a in ops if t == "matmul"][:2] == [
        {"transpose": "NT", "alpha": 0.5},
        {"transpose": "NN", "accumulate": True, "beta": 1.0},
    ]
    assert by["fused_lm_head_loss"] == {"softcap": 30.0}


def test_moe_plumbing_passes_offsets_and_scatter_indices() -> None:
    fwd = _graph(Everything)
    (permute,) = [op for op in fwd.ops if op.type == "moe_permute"]
    offsets, scatter = permute.outputs[2], permute.outputs[1]
    gemms = [op for op in fwd.ops if op.type.startswith("moe_grouped_gemm")]
    assert [op.inputs[2] for op in gemms] == [offsets, offsets]
    (unpermute,) = [op for op in fwd.ops if op.type == "moe_unpermute"]
    assert unpermute.inputs[2] == scatter


@module
class Naming:
    def __init__(self, N: int = 3, C: int = 4):
        self.N, self.C = N, C

    w = Param(Tensor["C", "C", F])
    norm = Param(Tensor["C", F])

    @forward
    def forward(self, x: Tensor["N", "C", F]) -> Tensor["N", "C", F]:
        with graph() as g:
            h = g.matmul(x, "w", out_name="proj")  # an explicit name wins over the variable's
            hidden = g.relu(h)
            x = g.silu(hidden)  # "x" is taken by the input: a generated name
            y, rstd = g.rmsnorm(x, "norm", y_name="normed")  # noqa: RUF059 (rstd is named after its variable)
            n, _ = g.rmsnorm(y, "norm")  # the unnamed sibling is named after the named one
            return g.add(n, g.scale(g.silu(hidden), factor=2.0))


def test_output_names() -> None:
    fwd = _graph(Naming)
    assert [op.outputs for op in fwd.ops] == [
        ("proj",),
        ("hidden",),
        ("silu_1",),
        ("normed", "rstd"),
        ("n", "n_rstd"),
        ("silu_2",),
        ("scale_1",),
        ("add_1",),
    ]


def test_saved_refs_and_input_lookup() -> None:
    @module
    class Saved:
        def __init__(self, N: int = 3):
            self.N = N

        @forward
        def forward(self, x: Tensor["N", F]) -> Tensor["N", F]:
            with graph() as g:
                assert g.input("x") is x
                h = g.relu(x)
                s = g.saved("h")  # a tensor may be named by its variable
                assert s.shape == h.shape and s.name.startswith("saved.")
                g.save("h")
                return h

    fwd = _graph(Saved)
    assert fwd.outputs[0].name == "h" and fwd.save == ("h",)


def test_graph_input_and_output_declared_in_the_body() -> None:
    @module
    class Explicit:
        _dims_ = {"N": 5}  # noqa: RUF012

        @forward
        def forward(self) -> Tensor["N", F]:
            with graph() as g:
                a = g.input("a", shape=["N"], dtype=F)
                b = g.relu(a)
                g.output(b)

    m = build_bundle(Explicit, {}).module("Explicit")
    assert [d.name for d in m.forward.inputs] == ["a"] and [d.name for d in m.forward.outputs] == ["b"]
    assert m.config == {"N": 5}


@module
class Mlp:
    def __init__(self, d_model: int, d_ff: int):
        self.d_model, self.d_ff = d_model, d_ff
        self.C, self.M = Dim("d_model"), Dim("d_ff")

    up = Param(Tensor["2 * M", "C", F])
    down = Param(Tensor["C", "M", F])

    @save("x", "gate_up")
    @forward
    def forward(self, x: Tensor["B", "T", "C", F]) -> Tensor["B", "T", "C", F]:
        with graph() as g:
            x_flat = g.view(x, shape=[B * T, self.C])
            gate_up = g.matmul(x_flat, "up", transpose="NT")
            act = g.swiglu(gate_up)
            return g.view(g.matmul(act, "down", transpose="NT"), shape=[B, T, self.C])


@module
class Norm:
    def __init__(self, d_model: int, eps: float = 1e-6):
        self.d_model, self.eps = d_model, eps

    weight = Param(Tensor["d_model", F])

    @forward
    def forward(self, x: Tensor["B", "T", "d_model", F]) -> Tensor["B", "T", "d_model", F]:
        with graph() as g:
            y, _ = g.rmsnorm(x, "weight", eps=self.eps)
            return y


@module
class Layer:
    def __init__(self, d_model: int = 8, d_ff: int = 12):
        self.d_model, self.d_ff = d_model, d_ff
        self.norm = Norm(d_model)
        self.mlp = Mlp(Dim("C"), Dim("M"))  # dims tie the submodule's shapes to this module's symbols

    @forward
    def forward(self, x: Tensor["B", "T", "C", F]) -> Tensor["B", "T", "C", F]:
        with graph() as g:
            h = g.call(self.norm, x)
            y = g.call("mlp", h)
            z = g.call(Mlp, y, name="mlp2", d_model=self.d_model, d_ff=self.d_ff)
            return g.add(x, z)


def test_submodules_are_inlined_under_their_prefix() -> None:
    m = build_bundle(Layer, {}).module("Layer")
    verify(m)
    assert [p.name for p in m.params] == ["norm.weight", "mlp.up", "mlp.down", "mlp2.up", "mlp2.down"]
    assert [[str(d) for d in p.shape] for p in m.params][1:3] == [["2 * M", "C"], ["C", "M"]]
    assert m.param("norm.weight").init == {"kind": "ones"}
    outs = [o for op in m.forward.ops for o in op.outputs]
    assert outs[:5] == ["norm.y", "norm.y_rstd", "mlp.x_flat", "mlp.gate_up", "mlp.act"]
    assert m.forward.save == (
        "norm.y",
        "mlp.gate_up",
        "mlp.view_1",
        "mlp2.gate_up",
    )  # @save("x") -> the input
    assert {k: m.config[k] for k in ("C", "M")} == {"C": 8, "M": 12}
    assert len(m.forward.ops) == 1 + 5 + 5 + 1
    derive_backward(m.forward, DeriveBackwardOptions(loss_name=None))


def test_builder_outside_a_compile_is_an_error() -> None:
    with pytest.raises(DSLError) as err:
        graph()
    assert err.value.code == "E001"
