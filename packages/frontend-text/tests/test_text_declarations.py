"""What the guide (docs/dsl-text.md) says of declarations holds, at the user's line and column: the
headers the text syntax parses but does not lower (`extends`, `backward:`), and the seed's §11.4
constraint example."""

import pytest

from kiln.core import KilnError
from kiln.dsl_text import load_program

TEXT = '''model M(d: int = 8, v: int = 16){extends}:
  params:
    w: [v, d]
  forward:
    inputs:
      token_ids: [B, T]
    outputs:
      y: [B, T, d]
    graph:
      token_ids -> embedding(w) -> y
{backward}'''
BACKWARD = """  backward:
    graph:
      y -> silu() -> z
"""


def test_extends_is_e011_at_the_base_name() -> None:
    text = TEXT.format(extends=" extends Base", backward="")
    with pytest.raises(KilnError) as info:
        load_program("m.kiln", text).bundle("M")
    assert info.value.code == "E011"
    column = text.splitlines()[0].index("Base") + 1
    assert f"m.kiln:1:{column}" in str(info.value) and "Base" in str(info.value)


def test_an_explicit_backward_section_is_w003_and_the_model_compiles_without_it() -> None:
    plain = load_program("m.kiln", TEXT.format(extends="", backward=""))
    with_backward = load_program("m.kiln", TEXT.format(extends="", backward=BACKWARD))
    assert not plain.warnings
    assert [w.code for w in with_backward.warnings] == ["W003"]
    assert "m.kiln:11:3" in str(with_backward.warnings[0])
    assert with_backward.bundle("M").to_json() == plain.bundle("M").to_json()


#: seed 004 §11.4, as written
SAFE_LINEAR = """import std.primitives.matmul.v1

module SafeLinear(in_dim: int, out_dim: int):
  let:
    constraint:
      in_dim > 0, "Input dimension must be positive"
      out_dim % 8 == 0, "FP8 requires output dim multiple of 8"

  params:
    weight: [out_dim, in_dim] @dtype(fp8_e4m3)

  forward:
    in: [B, in_dim]
    out: [B, out_dim]
    graph:
      (in, weight) -> matmul() -> out @precision(accumulate=fp32)
"""


def test_the_seed_constraint_example_is_e004_as_written_at_its_matmul() -> None:
    """§11.4 multiplies [B, in_dim] by a [out_dim, in_dim] weight with the seed's own default transpose
    (NN, §6.1.1): the contraction dims differ, which the shape rule reports at the flow."""
    with pytest.raises(KilnError) as info:
        load_program("safe.kiln", SAFE_LINEAR).bundle("SafeLinear", {"in_dim": 4, "out_dim": 16})
    err = info.value
    assert err.code == "E004" and "contraction" in err.message
    assert (err.line, err.column) == (16, 23)


def test_the_seed_constraint_example_with_nt_checks_its_constraints_at_their_lines() -> None:
    program = load_program("safe.kiln", SAFE_LINEAR.replace("matmul()", "matmul(transpose=NT)"))
    module = program.bundle("SafeLinear", {"in_dim": 4, "out_dim": 16}).module("SafeLinear")
    assert [(op.type, op.inputs, op.attrs["transpose"]) for op in module.forward.ops] == [
        ("matmul", ("in_", "weight"), "NT")]
    assert {(a.kind, a.target) for a in module.annotations} == {("dtype", "weight"), ("precision", "out")}
    for config, line, words in [({"in_dim": 0, "out_dim": 16}, 6, "Input dimension must be positive"),
                                ({"in_dim": 4, "out_dim": 12}, 7, "multiple of 8")]:
        with pytest.raises(KilnError) as info:
            program.bundle("SafeLinear", config)
        assert info.value.code == "E027" and words in info.value.message
        assert (info.value.line, info.value.column) == (line, 7)
