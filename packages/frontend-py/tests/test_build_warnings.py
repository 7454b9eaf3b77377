"""build_bundle hands its warnings to a caller that asks (it raises errors and used to drop warnings),
and g.locate moves a warning with the ops it re-points: a frontend that lowers another syntax through
the builder shows W005 at its user's line, not at its own."""

from pathlib import Path

from kiln.dsl import Param, Tensor, build_bundle, forward, graph, module

HERE = Path(__file__).resolve()
F, BF = "fp32", "bf16"


def _line(marker: str) -> int:
    return next(i for i, text in enumerate(HERE.read_text().splitlines(), 1) if text.endswith(marker))


@module
class Narrowing:
    b = Param(Tensor[3, F])

    @forward
    def forward(self, x: Tensor[3, BF]) -> Tensor[3, BF]:
        with graph() as g:
            return g.add(x, "b")  # <narrows>


@module
class Relocated:
    b = Param(Tensor[3, F])

    @forward
    def forward(self, x: Tensor[3, BF]) -> Tensor[3, BF]:
        with graph() as g:
            start = g.op_count
            y = g.add(x, "b")
            g.locate(start, "model.txt:7:3")
            return y


@module
class Widening:
    b = Param(Tensor[3, BF])

    @forward
    def forward(self, x: Tensor[3, F]) -> Tensor[3, F]:
        with graph() as g:
            return g.add(x, "b")


def test_build_bundle_gives_its_warnings_to_a_list() -> None:
    warnings: list = []
    bundle = build_bundle(Narrowing, {}, warnings=warnings)
    assert bundle.module("Narrowing").forward is not None
    assert [w.code for w in warnings] == ["W005"]
    path, _, line = warnings[0].location.rpartition(":")
    assert (Path(path).resolve(), int(line)) == (HERE, _line("# <narrows>"))
    quiet: list = []
    build_bundle(Widening, {}, warnings=quiet)
    assert quiet == []
    build_bundle(Narrowing, {})  # without the list: as before


def test_locate_moves_the_warnings_of_the_ops_it_re_points() -> None:
    warnings: list = []
    bundle = build_bundle(Relocated, {}, warnings=warnings)
    (op,) = bundle.module("Relocated").forward.ops
    assert op.loc == "model.txt:7:3"
    assert [(w.code, w.location) for w in warnings] == [("W005", "model.txt:7:3")]
