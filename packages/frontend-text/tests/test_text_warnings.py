"""kiln-dsl's warnings reach a text file's user at the line and column of the flow (W005: an implicit
dtype narrowing; W003: a save list the derived backward outgrows), in Program.warnings and on
`kiln compile`'s stderr. They used to be dropped."""

from pathlib import Path

import pytest

from kiln.core.cli import main
from kiln.dsl_text import load_program

TEXT = """block M(d: int = 8):
  params:
    w: [d]
  forward:
    inputs:
      x: [B, T, d, {x}]
    outputs:
      y: [B, T, d, {x}]
    graph:
      x -> silu() -> h
      (h, w) -> add() -> y
"""


def test_an_implicit_narrowing_is_w005_at_the_flow() -> None:
    program = load_program("m.kiln", TEXT.format(x="bf16"))
    assert program.warnings == []
    program.bundle("M")
    program.bundle("M")  # a second compile adds nothing new
    assert [w.code for w in program.warnings] == ["W005"]
    w = program.warnings[0]
    assert (w.path, w.line, w.column) == ("m.kiln", 11, 7)
    assert "'w'" in w.message and "bf16" in w.message and "(h, w) -> add() -> y" in str(w)


def test_a_widening_add_is_no_warning() -> None:
    program = load_program("m.kiln", TEXT.format(x="fp32"))
    program.bundle("M")
    assert program.warnings == []


def test_kiln_compile_prints_the_warning_with_its_place(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "m.kiln"
    src.write_text(TEXT.format(x="bf16"))
    assert main(["compile", str(src), "--model", "M", "-o", str(tmp_path / "m.json")]) == 0
    err = capsys.readouterr().err
    assert "warning: [W005]" in err and f"{src}:11:7" in err


def test_a_save_list_the_derived_backward_outgrows_is_w003_at_the_op_that_reads_it() -> None:
    text = """module M(n: int = 4):
  params:
    w: [n]
  forward:
    inputs:
      x: [n]
    outputs:
      y: [n]
    graph:
      (x, w) -> mul() -> h
      (h, h) -> mul() -> y
    save: {save}
"""
    program = load_program("m.kiln", text.format(save="[x]"))
    program.bundle("M")
    (w,) = program.warnings
    assert w.code == "W003" and "'h'" in w.message and (w.line, w.column) == (11, 7)
    enough = load_program("m.kiln", text.format(save="[x, h]"))
    enough.bundle("M")
    assert enough.warnings == []


def test_kiln_compile_of_a_python_module_prints_its_warnings(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "narrow.py"
    src.write_text('''from kiln.dsl import Param, Tensor, forward, graph, module


@module
class Narrow:
    b = Param(Tensor[3, "fp32"])

    @forward
    def forward(self, x: Tensor[3, "bf16"]) -> Tensor[3, "bf16"]:
        with graph() as g:
            return g.add(x, "b")
''')
    assert main(["compile", str(src), "--model", "Narrow", "-o", str(tmp_path / "n.json")]) == 0
    err = capsys.readouterr().err
    assert "warning: [W005]" in err and f"{src}:11" in err
