"""Declarations: Tensor/Array/Dim, Param styles, Activation and Gradient fields, @abstract/@extends,
@primitive, @save/@recompute order, and the registries."""

# ruff: noqa: E741, F821  (dimension names inside Tensor[...] annotations are not Python names)

from typing import Any

import pytest

import kiln.dsl as dsl
from kiln.core import KilnError
from kiln.core.ir import BinOp, Const, Sym, thaw
from kiln.dsl import (
    Activation,
    Array,
    B,
    Dim,
    DSLError,
    Gradient,
    Param,
    T,
    Tensor,
    abstract,
    block,
    build_bundle,
    extends,
    forward,
    graph,
    module,
    param,
    primitive,
    recompute,
    registry,
    save,
    tied_to,
)


def test_public_api_is_explicit() -> None:
    seed_names = [
        "module",
        "block",
        "model",
        "primitive",
        "forward",
        "backward",
        "save",
        "recompute",
        "param",
        "tied_to",
        "abstract",
        "extends",
        "hf_config",
        "hf_mapping",
        "hf_export",
        "Param",
        "Activation",
        "Gradient",
        "Tensor",
        "Array",
        "Dim",
        "DimExpr",
        "B",
        "T",
        "graph",
        "fuse",
        "split",
        "transform",
        "hf_tied_to",
        "stack_experts",
        "compile_model",
        "compile_model_for_hf",
        "get_model_spec",
        "get_block_spec",
        "get_module_spec",
        "list_registered_models",
        "list_registered_blocks",
        "list_registered_modules",
        "registry",
        "DSLError",
        "build_bundle",
    ]
    assert set(seed_names) <= set(dsl.__all__)
    assert all(hasattr(dsl, n) for n in dsl.__all__)
    assert issubclass(DSLError, KilnError)


def test_tensor_annotations() -> None:
    t = Tensor["B", "T", "C"]
    assert (t.dims, t.dtype, t.optional) == (("B", "T", "C"), "bf16", False)  # seed default dtype
    assert Tensor["B", "T", 4096, "fp32"].dims == ("B", "T", 4096)
    assert Tensor["B", "T", "fp8_e4m3"].dtype == "fp8_e4m3"
    assert (Tensor["C", "D"] | None).optional
    assert Tensor["MaxSeq", "D // 2", 2, "fp32"].dims == ("MaxSeq", "D // 2", 2)
    assert Tensor[B, T, Dim("C")].dims == (Sym("B"), Sym("T"), Sym("C"))
    with pytest.raises(TypeError):
        Tensor["B", 1.5]


def test_array_and_dims() -> None:
    arr = Array["n_layers", "DenseTransformerBlock"]
    assert (arr.count, arr.element_name) == ("n_layers", "DenseTransformerBlock")
    assert Array[8, "ExpertMLP"].count == 8
    C, H = Dim("d_model"), Dim("num_heads")
    D = C // H
    assert BinOp("//", Sym("d_model"), Sym("num_heads")) == D and str(D) == "d_model // num_heads"
    assert str(B * T) == "B * T" and (2 * Dim("M")).lhs == Const(2)
    assert isinstance(D, dsl.DimExpr)


def test_param_options_and_method_style() -> None:
    @module
    class Styles:
        def __init__(self, O: int = 4, C: int = 3, use_bias: bool = True, MaxSeq: int = 8, D: int = 4):
            self.O, self.C, self.use_bias, self.MaxSeq, self.D = O, C, use_bias, MaxSeq, D

        weight = Param(Tensor["O", "C", "fp32"], hf_mapping="proj.weight", description="the weight")
        bias = Param(Tensor["O", "fp32"], when="use_bias")
        rope_freqs = Param(Tensor["MaxSeq", "D // 2", 2, "fp32"], frozen=True, init="zeros")
        extra: Tensor["O", "fp32"] | None

        @param
        def scale(self) -> Tensor["O", "fp32"]:
            """Per-output scale."""

        @param(condition=lambda self: not self.use_bias)
        def offset(self) -> Tensor["O", "fp32"]: ...

        @param(frozen=True)
        def table(self) -> Tensor["MaxSeq", "D // 2", 2, "fp32"]: ...

        @forward
        def forward(self, x: Tensor["B", "C", "fp32"]) -> Tensor["B", "O", "fp32"]:
            with graph() as g:
                return g.matmul_bias(x, "weight", "bias", transpose="NT")

    m = build_bundle(Styles, {}).module("Styles")
    params = {p.name: p for p in m.params}
    assert list(params) == ["weight", "bias", "rope_freqs", "scale", "table", "extra"]
    assert params["weight"].hf_mapping == "proj.weight" and params["weight"].description == "the weight"
    assert params["bias"].optional and params["bias"].condition == "use_bias"
    assert params["rope_freqs"].frozen and params["rope_freqs"].init == {"kind": "zeros"}
    assert params["scale"].description == "Per-output scale."
    assert params["table"].frozen and params["extra"].optional
    assert "offset" not in params  # its callable condition is false
    assert m.hf_mappings == {"weight": "proj.weight"}


def test_tied_param_either_order() -> None:
    @module
    class Tied:
        def __init__(self, V: int = 10, C: int = 4):
            self.V, self.C = V, C

        embedding = Param(Tensor["V", "C", "fp32"])

        @tied_to("embedding")
        @param
        def head(self) -> Tensor["V", "C", "fp32"]: ...

        @param
        @tied_to("embedding")
        def head2(self) -> Tensor["V", "C", "fp32"]: ...

        @forward
        def forward(self, x: Tensor["B", "C", "fp32"]) -> Tensor["B", "V", "fp32"]:
            with graph() as g:
                return g.matmul(x, "head", transpose="NT")

    m = build_bundle(Tied, {}).module("Tied")
    assert [(p.name, p.tied_to) for p in m.params] == [
        ("embedding", None),
        ("head", "embedding"),
        ("head2", "embedding"),
    ]
    assert [d.name for d in m.forward.params] == ["embedding"]  # tied params have no storage
    assert m.forward.ops[0].inputs == ("x", "embedding")


def test_activation_and_gradient_carry_every_field() -> None:
    @block
    class Slots:
        def __init__(self, C: int = 4, use_qk_norm: bool = False):
            self.C, self.use_qk_norm = C, use_qk_norm

        w = Param(Tensor["C", "C", "fp32"])

        h = Activation(
            Tensor["B", "T", "C"],
            dtype="fp32",
            aliases=["h_flat"],
            save=True,
            recompute=True,
            recompute_from=["@input:x", "@param:w", "?@param:bias", "@global:freq_cis", "h_flat"],
            recompute_op="matmul",
            recompute_attrs={"transpose": "NT", "_rotary_dim": Dim("C")},
            recompute_policy="fft_only",
            recompute_group="proj",
            recompute_outputs=["h", "gone"],
            lora_targets=["q", "k"],
            shares_with="y",
            share_policy="when_recomputed",
            scope="block",
            description="projection",
        )
        y = Activation(Tensor["B", "T", "C"], recompute=True, recompute_policy="lora_only")
        gone = Activation(Tensor["B", "T"], dtype="fp32", save=True, when="use_qk_norm")
        cond = Activation(Tensor["B", "T"], when=lambda self: self.C == 4)
        d_h = Gradient(
            Tensor["B", "T", "C"],
            gradient_of="h",
            dtype="fp32",
            shares_with="d_y",
            when="C",
            description="grad",
        )
        d_y = Gradient(Tensor["B", "T", "C"], gradient_of="y", alias_of="d_h", scope="global_gradient")

        @forward
        def forward(self, x: Tensor["B", "T", "C", "fp32"]) -> Tensor["B", "T", "C", "fp32"]:
            with graph() as g:
                flat = g.view(x, shape=[B * T, "C"])
                h = g.matmul(flat, "w", transpose="NT")
                return g.view(h, shape=[B, T, "C"])

    layout = build_bundle(Slots, {}).module("Slots").activations
    h = layout.get("h_flat")
    assert h.name == "h" and h.dtype == "fp32" and h.aliases == ("h_flat",)
    assert (h.save, h.recompute, h.memory_hint) == (True, True, "shared")
    assert h.recompute_from == ("@input:x", "@param:w", "?@param:bias", "@global:freq_cis", "h_flat")
    assert (h.recompute_op, thaw(h.recompute_attrs)) == ("matmul", {"transpose": "NT", "_rotary_dim": "C"})
    assert (h.recompute_policy, h.recompute_group) == ("fft_only", "proj")
    assert h.recompute_outputs == ("h",)  # "gone" is left out by its condition, so is its output entry
    assert h.lora_targets == ("q", "k") and (h.shares_with, h.share_policy) == ("y", "when_recomputed")
    assert h.description == "projection"
    assert layout.get("y").memory_hint == "recompute" and layout.get("y").dtype == "bf16"
    assert layout.get("gone") is None and layout.get("cond").condition is None
    d_h, d_y = layout.get("d_h"), layout.get("d_y")
    assert (d_h.scope, d_h.gradient_of, d_h.dtype, d_h.condition, d_h.memory_hint) == (
        "gradient",
        "h",
        "fp32",
        "C",
        "shared",
    )
    assert (d_y.scope, d_y.alias_of) == ("global_gradient", "d_h")
    assert layout.alias_map()["h_flat"] == "h"


def test_save_and_recompute_in_either_order() -> None:
    @module
    class Orders:
        def __init__(self, C: int = 4):
            self.C = C

        w = Param(Tensor["C", "C", "fp32"])

        @recompute("h")
        @forward
        @save("x")
        def forward(self, x: Tensor["B", "C", "fp32"]) -> Tensor["B", "C", "fp32"]:
            with graph() as g:
                h = g.matmul(x, "w")
                g.save(h)
                g.mark_recompute("y")
                y = g.relu(h)
                return y

    fwd = build_bundle(Orders, {}).module("Orders").forward
    assert fwd.save == ("h", "x") and fwd.recompute == ("y", "h")


def test_abstract_and_extends() -> None:
    @abstract
    @module
    class Base:
        def __init__(self, C: int):
            self.C = C

        w = Param(Tensor["C", "C", "fp32"])

    @module
    @extends(Base)
    class Child:
        def __init__(self, C: int, scale: float = 2.0):
            super().__init__(C)
            self.scale = scale

        @forward
        def forward(self, x: Tensor["B", "C", "fp32"]) -> Tensor["B", "C", "fp32"]:
            with graph() as g:
                return g.scale(g.matmul(x, "w"), factor=self.scale)

    assert issubclass(Child, Base) and registry.get_module("Child").extends == "Base"
    assert registry.get_module("Base").abstract and not registry.get_module("Child").abstract
    m = build_bundle(Child, {"C": 3}).module("Child")
    assert [p.name for p in m.params] == ["w"] and m.config["C"] == 3 and m.metadata["extends"] == "Base"
    with pytest.raises(DSLError) as err:
        build_bundle(Base, {"C": 3})
    assert err.value.code == "E012"
    with pytest.raises(DSLError) as err:
        extends("NoSuchBase")(type("X", (), {}))
    assert err.value.code == "E002"


def test_primitive_records_signatures_and_emits_its_op() -> None:
    @primitive(impl="kernels.silu_mul")
    def silu_mul(gate: Tensor["N", "M"], up: Tensor["N", "M"]) -> Tensor["N", "M"]:
        """silu(gate) * up."""

    @silu_mul.backward
    @save("gate", "up")
    def silu_mul_backward(d_out: Tensor["N", "M"], gate: Tensor["N", "M"], up: Tensor["N", "M"]) -> Any: ...

    spec = registry.get_primitive("silu_mul")
    assert (spec.impl, list(spec.inputs), spec.doc) == (
        "kernels.silu_mul",
        ["gate", "up"],
        "silu(gate) * up.",
    )
    assert spec.backward_fn is silu_mul_backward and spec.backward_save == ("gate", "up")

    @primitive
    def scale(x: Tensor["N"], *, factor: float = 1.0) -> Tensor["N"]: ...

    assert registry.get_primitive("scale").attrs == {"factor": 1.0}

    @module
    class UsesPrimitive:
        def __init__(self, N: int = 3):
            self.N = N

        @forward
        def forward(self, a: Tensor["N", "fp32"], b: Tensor["N", "fp32"]) -> Tensor["N", "fp32"]:
            with graph():
                return silu_mul(a, b)

    assert build_bundle(UsesPrimitive, {}).module("UsesPrimitive").forward.ops[0].type == "silu_mul"


def test_registries() -> None:
    @block
    class RegisteredBlock:
        @forward
        def forward(self, x: Tensor["B", "fp32"]) -> Tensor["B", "fp32"]:
            with graph() as g:
                return g.relu(x)

    assert "RegisteredBlock" in dsl.list_registered_blocks()
    spec = dsl.get_block_spec("RegisteredBlock")
    assert spec.kind == "block" and spec.cls is RegisteredBlock
    assert registry.get_block("RegisteredBlock") == spec == registry.get_any("RegisteredBlock")
    assert "RegisteredBlock" not in dsl.list_registered_modules()
    for getter in (dsl.get_model_spec, dsl.get_module_spec, registry.get_any):
        with pytest.raises(DSLError) as err:
            getter("Nope")
        assert err.value.code == "E002"


def test_dsl_instances_record_their_config() -> None:
    @module
    class Recorded:
        def __init__(self, a: int, b: int = 2, **extra: Any):
            self.a = a

    obj = Recorded(1, c=3)
    assert obj.__kiln_args__ == {"a": 1, "b": 2, "c": 3}
