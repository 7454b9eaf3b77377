"""Every diagnostic the compiler emits, each triggered by a faulty model: code, hint, and a location that
is the user's line (the line of this file marked ``# <marker>``)."""

# ruff: noqa: E741, F821  (dimension names inside Tensor[...] annotations are not Python names)

from pathlib import Path
from typing import Any

import pytest

from kiln.dsl import (
    Activation,
    Array,
    B,
    Dim,
    DSLError,
    Param,
    T,
    Tensor,
    block,
    build_bundle,
    compile_model,
    compile_model_for_hf,
    extends,
    forward,
    fuse,
    graph,
    hf_mapping,
    model,
    module,
    save,
    split,
    stack_experts,
)

HERE = Path(__file__).resolve()
F = "fp32"


def line_of(marker: str) -> int:
    for i, text in enumerate(HERE.read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# <{marker}>"):
            return i
    raise AssertionError(f"no line marked <{marker}>")


def check(payload: dict[str, Any], code: str, marker: str) -> dict[str, Any]:
    """The diagnostic ``code`` of a compile payload, after checking its hint and its location."""
    diags = payload["errors"] + payload["warnings"]
    found = [d for d in diags if d["code"] == code]
    assert found, f"no {code} in {diags}"
    d = found[0]
    assert d["message"] and d.get("hint"), d
    path, _, line = d["location"].rpartition(":")
    assert (Path(path).resolve(), int(line)) == (HERE, line_of(marker)), d
    assert payload["success"] == (not code.startswith("E"))
    return d


# --- small well-formed pieces ---------------------------------------------------------------------


@block
class TinyBlock:
    def __init__(self, C: int = 4):
        self.C = C

    w = Param(Tensor["C", "C", F])

    @forward
    def forward(self, x: Tensor["B", "T", "C", F]) -> Tensor["B", "T", "C", F]:
        with graph() as g:
            h = g.matmul(g.view(x, shape=[B * T, "C"]), "w")
            return g.view(h, shape=[B, T, "C"])


class _Base:
    def __init__(self, C: int = 4, n_layers: int = 2):
        self.C, self.n_layers = C, n_layers

    emb = Param(Tensor["C", "C", F])
    blocks = Param(Array["n_layers", "TinyBlock"])


# --- errors --------------------------------------------------------------------------------------


def test_e001_forward_that_fails_while_capturing() -> None:
    @module
    class Broken:
        @forward
        def forward(self, x: Tensor[3, F]) -> Tensor[3, F]:
            with graph() as g:
                y = g.relu(x)
                return y.no_such_method()  # <E001>

    d = check(compile_model(Broken, {}), "E001", "E001")
    assert "AttributeError" in d["message"]


def test_e016_a_tensor_as_a_python_condition() -> None:
    @module
    class Branchy:
        @forward
        def forward(self, x: Tensor[3, F]) -> Tensor[3, F]:
            with graph() as g:
                y = g.relu(x)
                if y:  # <E016>
                    return g.relu(y)
                return y

    d = check(compile_model(Branchy, {}), "E016", "E016")
    assert "used as a Python condition" in d["message"] and "one branch" in d["message"]


def test_e002_unknown_tensor_and_unknown_model() -> None:
    @module
    class Unknown:
        @forward
        def forward(self, x: Tensor[3, 3, F]) -> Tensor[3, 3, F]:
            with graph() as g:
                return g.matmul(x, "no_such_weight")  # <E002>

    d = check(compile_model(Unknown, {}), "E002", "E002")
    assert "'no_such_weight'" in d["message"]
    d = check(compile_model("NoSuchModel", {}), "E002", "E002-name")  # <E002-name>
    assert "NoSuchModel" in d["message"]
    d = check(compile_model_for_hf("NoSuchForCausalLM", {}), "E002", "E002-hf")  # <E002-hf>


def test_e003_stacked_blocks_type_and_arity() -> None:
    @model
    class WrongStack(_Base):
        @forward
        def forward(self, x: Tensor["B", "T", "C", F]) -> Tensor["B", "T", "C", F]:
            with graph() as g:
                return g.call("StackedBlocks", x, blocks="emb", n_layers=2)  # <E003-type>

    d = check(compile_model(WrongStack, {}), "E003", "E003-type")
    assert "'emb' is not an Array" in d["message"]

    @model
    class WrongArity(_Base):
        @forward
        def forward(self, x: Tensor["B", "T", "C", F]) -> Tensor["B", "T", "C", F]:
            with graph() as g:
                return g.call("StackedBlocks", x, x, blocks="blocks", n_layers=2)  # <E003-arity>

    d = check(compile_model(WrongArity, {}), "E003", "E003-arity")
    assert "takes 1 inputs" in d["message"]


def test_e004_shape_mismatch_at_the_builder_call() -> None:
    @module
    class BadShapes:
        def __init__(self, N: int = 2, C: int = 4, O: int = 3):
            self.N, self.C, self.O = N, C, O

        w = Param(Tensor["O", "C", F])

        @forward
        def forward(self, x: Tensor["N", "C", F]) -> Tensor["N", "O", F]:
            with graph() as g:
                return g.matmul(x, "w")  # <E004>

    d = check(compile_model(BadShapes, {}), "E004", "E004")
    assert "matmul" in d["message"]


def test_e008_not_a_dsl_model_and_missing_annotation() -> None:
    class Plain:  # <E008-class>
        pass

    check(compile_model(Plain, {}), "E008", "E008-class")

    @module
    class NoAnnotation:
        @forward
        def forward(self, x):  # <E008-ann>
            with graph() as g:
                return g.relu(x)

    d = check(compile_model(NoAnnotation, {}), "E008", "E008-ann")
    assert "'x'" in d["message"]


def test_e010_invalid_weight_mappings() -> None:
    @model
    @hf_mapping(emb="model.embed_tokens.weight", ghost="model.ghost.weight")  # <E010-param>
    class BadMapping(_Base):
        _hf_block_mappings_ = {  # noqa: RUF012
            "w": stack_experts("model.layers.{layer}.mlp.experts.{expertt}.w"),  # <E010-stack>
        }

        @forward
        def forward(self, x: Tensor["B", "T", "C", F]) -> Tensor["B", "T", "C", F]:
            with graph() as g:
                y, _ = g.call("StackedBlocks", x, blocks="blocks", n_layers=2), None
                return y

    payload = compile_model(BadMapping, {})
    check(payload, "E010", "E010-param")
    stack = [d for d in payload["errors"] if "expertt" in d["message"]]
    assert stack and stack[0]["location"].endswith(f":{line_of('E010-stack')}")


def test_e012_missing_forward_and_missing_n_layers() -> None:
    @model
    class NoForward(_Base):  # <E012-forward>
        pass

    check(compile_model(NoForward, {}), "E012", "E012-forward")

    @model
    class NoLayers(_Base):
        @forward
        def forward(self, x: Tensor["B", "T", "C", F]) -> Tensor["B", "T", "C", F]:
            with graph() as g:
                return g.call("StackedBlocks", x, blocks="blocks")  # <E012-layers>

    check(compile_model(NoLayers, {}), "E012", "E012-layers")

    @module
    class NeedsConfig:  # <E012-config>
        def __init__(self, C: int):
            self.C = C

        @forward
        def forward(self, x: Tensor["C", F]) -> Tensor["C", F]:
            with graph() as g:
                return g.relu(x)

    check(compile_model(NeedsConfig, {}), "E012", "E012-config")


def test_e013_invalid_fuse_and_split() -> None:
    @model
    class BadFusion(_Base):
        _hf_block_mappings_ = {  # noqa: RUF012
            "w": fuse("model.layers.{layer}.q_proj.weight", dim=0),  # <E013-fuse>
        }

        @forward
        def forward(self, x: Tensor["B", "T", "C", F]) -> Tensor["B", "T", "C", F]:
            with graph() as g:
                return g.call("StackedBlocks", x, blocks="blocks", n_layers=2)

    d = check(compile_model(BadFusion, {}), "E013", "E013-fuse")
    assert "at least two" in d["message"]

    @model
    @hf_mapping(emb=split("model.embed.weight", ranges=[(8, 4)]))  # <E013-split>
    class BadSplit(BadFusion):
        _hf_block_mappings_ = {"w": "model.layers.{layer}.w"}  # noqa: RUF012

    check(compile_model(BadSplit, {}), "E013", "E013-split")


def test_e014_custom_op_must_be_registered() -> None:
    @module
    class Custom:
        @forward
        def forward(self, x: Tensor[3, F]) -> Tensor[3, F]:
            with graph() as g:
                return g.custom("my_kernel", x, num_outputs=1, alpha=2)  # <E014>

    d = check(compile_model(Custom, {}), "E014", "E014")
    assert "'my_kernel'" in d["message"]


def test_e017_out_name_reused() -> None:
    @module
    class Redefined:
        @forward
        def forward(self, x: Tensor[3, F]) -> Tensor[3, F]:
            with graph() as g:
                h = g.relu(x, out_name="h")
                h2 = g.silu(h, out_name="h")  # <E017>
                return h2

    d = check(compile_model(Redefined, {}), "E017", "E017")
    assert "'h'" in d["message"]

    @module
    class ShadowsInput:
        @forward
        def forward(self, x: Tensor[3, F]) -> Tensor[3, F]:
            with graph() as g:
                return g.relu(x, out_name="x")  # <E017-input>

    check(compile_model(ShadowsInput, {}), "E017", "E017-input")


def test_e026_e027_constraints() -> None:
    @module
    class Heads:
        _constraints_ = (
            ("d_model % num_heads == 0", "d_model must be divisible by num_heads"),  # <E027>
            ("d_model // num_heads <= 128 and num_heads > 0", "head dimension exceeds limit"),  # <E027b>
        )

        def __init__(self, d_model: int = 64, num_heads: int = 4):
            self.d_model, self.num_heads = d_model, num_heads

        @forward
        def forward(self, x: Tensor["d_model", F]) -> Tensor["d_model", F]:
            with graph() as g:
                return g.relu(x)

    assert compile_model(Heads, {})["success"]
    d = check(compile_model(Heads, {"d_model": 10, "num_heads": 3}), "E027", "E027")
    assert "d_model must be divisible by num_heads" in d["message"]
    assert "d_model = 10" in d["hint"] and "num_heads = 3" in d["hint"]
    check(compile_model(Heads, {"d_model": 4096, "num_heads": 4}), "E027", "E027b")

    @module
    class BadConstraint(Heads):
        _constraints_ = (("d_model %% 2 == 0", "even"),)  # <E026>

    check(compile_model(BadConstraint, {}), "E026", "E026")

    @module
    class UnknownName(Heads):
        _constraints_ = (("d_modle > 0", "typo"),)  # <E026-name>

    d = check(compile_model(UnknownName, {}), "E026", "E026-name")
    assert "'d_modle'" in d["message"]


def test_constraints_are_not_evaluated_as_python() -> None:
    @module
    class Hostile:
        _constraints_ = (("__import__('os').getcwd() == 0", "never"),)

        @forward
        def forward(self, x: Tensor[3, F]) -> Tensor[3, F]:
            with graph() as g:
                return g.relu(x)

    assert compile_model(Hostile, {})["errors"][0]["code"] == "E026"


def test_e015_integer_tensor_where_an_op_computes_in_floats() -> None:
    @module
    class IntActivation:
        @forward
        def forward(self, ids: Tensor[3, "int32"]) -> Tensor[3, F]:
            with graph() as g:
                return g.silu(ids)  # <E015>

    d = check(compile_model(IntActivation, {}), "E015", "E015")
    assert "'silu'" in d["message"] and "'x' is int32" in d["message"]

    @module
    class MixedAdd:
        @forward
        def forward(self, ids: Tensor[3, "int32"], x: Tensor[3, F]) -> Tensor[3, F]:
            with graph() as g:
                return g.add(x, ids)  # <E015-mixed>

    d = check(compile_model(MixedAdd, {}), "E015", "E015-mixed")
    assert "'b' is int32" in d["message"] and "'a' (fp32)" in d["message"]

    @module
    class IntMovesAndSums:  # integer data movement and arithmetic stay legal, as does a float op on ids
        def __init__(self, V: int = 5, C: int = 4):
            self.V, self.C = V, C

        emb = Param(Tensor["V", "C", F])

        @forward
        def forward(self, ids: Tensor[2, 3, "int32"]) -> Tensor[6, "C", F]:
            with graph() as g:
                flat = g.view(g.transpose(ids, 0, 1), shape=[6])
                shifted = g.add(flat, g.view(flat, shape=[6]))
                return g.embedding(shifted, "emb")

    payload = compile_model(IntMovesAndSums, {})
    assert payload["success"] and not payload["warnings"], payload


def test_e011_redefined_parameter_with_another_shape() -> None:
    @module
    class Projection:
        def __init__(self, C: int = 4, O: int = 3):
            self.C, self.O = C, O

        w = Param(Tensor["O", "C", F])

        @forward
        def forward(self, x: Tensor["B", "C", F]) -> Tensor["B", "O", F]:
            with graph() as g:
                return g.matmul(x, "w", transpose="NT")

    @module
    @extends(Projection)
    class SameShape:
        w = Param(Tensor["O", "C", F], frozen=True)  # compatible: only its options change

    assert compile_model(SameShape, {})["success"]

    @module
    @extends(Projection)
    class Square:
        w = Param(Tensor["C", "C", F])  # <E011>

    d = check(compile_model(Square, {}), "E011", "E011")
    assert "Square.w" in d["message"] and "Projection" in d["message"] and "'O'" in d["message"]

    @module
    @extends(Projection)
    class Narrower:
        w = Param(Tensor["O", "C", "bf16"])  # <E011-dtype>

    check(compile_model(Narrower, {}), "E011", "E011-dtype")


def test_e021_e014_recompute_op_checked_against_the_op_it_replays() -> None:
    def mlp(op: str | None) -> type:
        @block
        class Mlp:
            def __init__(self, C: int = 4, M: int = 3):
                self.C, self.M, self.MUp = C, M, 2 * Dim("M")

            up_weight = Param(Tensor["MUp", "C", F])
            act = Activation(Tensor["B", "T", "M", F], recompute=True, recompute_op=op)  # <E021-op>
            up = Activation(Tensor["B", "T", "MUp", F], save=True)

            @forward
            def forward(self, x: Tensor["B", "T", "C", F]) -> Tensor["B", "T", "M", F]:
                with graph() as g:
                    flat = g.matmul(g.view(x, shape=[B * T, "C"]), "up_weight", transpose="NT")
                    up = g.view(flat, shape=[B, T, "MUp"], out_name="up")
                    return g.swiglu(up, out_name="act")

        return Mlp

    assert compile_model(mlp("swiglu"), {})["success"]
    d = check(compile_model(mlp("gelu"), {}), "E021", "E021-op")
    assert "'gelu'" in d["message"] and "swiglu" in d["message"] and "'swiglu'" in d["hint"]
    d = check(compile_model(mlp("no_such_op"), {}), "E014", "E021-op")
    assert "'no_such_op'" in d["message"]


# --- warnings ------------------------------------------------------------------------------------


def test_w001_definition_shadows_a_primitive() -> None:
    @module
    class swiglu:  # <W001>
        def __init__(self, N: int = 4):
            self.N = N

        @forward
        def forward(self, x: Tensor["N", F]) -> Tensor["N", F]:
            with graph() as g:
                return g.relu(x)

    d = check(compile_model(swiglu, {}), "W001", "W001")
    assert "'swiglu'" in d["message"]


def test_w005_implicit_dtype_narrowing() -> None:
    @module
    class Narrowing:
        b = Param(Tensor[3, F])

        @forward
        def forward(self, x: Tensor[3, "bf16"]) -> Tensor[3, "bf16"]:
            with graph() as g:
                return g.add(x, "b")  # <W005>

    d = check(compile_model(Narrowing, {}), "W005", "W005")
    assert "'add'" in d["message"] and "'b'" in d["message"] and "fp32" in d["message"]
    assert "bf16" in d["message"]

    @module
    class Widening:
        b = Param(Tensor[3, "bf16"])

        @forward
        def forward(self, x: Tensor[3, F]) -> Tensor[3, F]:
            with graph() as g:
                return g.add(x, "b")

    assert not compile_model(Widening, {})["warnings"]


def test_w004_unused_saved_tensor() -> None:
    @module
    class SavesGhost:
        @save("x", "ghost")  # <W004>
        @forward
        def forward(self, x: Tensor[3, F]) -> Tensor[3, F]:
            with graph() as g:
                return g.relu(x)

    payload = compile_model(SavesGhost, {})
    d = check(payload, "W004", "W004")
    assert "'ghost'" in d["message"]
    saved = next(m for m in payload["modules"] if m["name"] == "SavesGhost")["forward"]["save"]
    assert saved == ["x"]


# --- raising ----------------------------------------------------------------------------------------


def test_raise_on_error_raises_dsl_error_with_every_diagnostic() -> None:
    @module
    class Redefined2:
        @forward
        def forward(self, x: Tensor[3, F]) -> Tensor[3, F]:
            with graph() as g:
                g.relu(x, out_name="h")
                return g.silu(x, out_name="h")

    with pytest.raises(DSLError) as err:
        compile_model(Redefined2, {}, raise_on_error=True)
    assert err.value.code == "E017" and err.value.location and err.value.hint
    with pytest.raises(DSLError):
        build_bundle(Redefined2, {})
