"""Language items of seed 004 that a model author writes directly: optional tensor inputs passed as None
or left out (§3.8). Each program is compiled, its forward run against a NumPy transcription, and every
error checked for its code and the user's line (the line of this file marked ``# <marker>``)."""

# ruff: noqa: F722, F821  (dimension names inside Tensor[...] annotations are not Python names)

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.core.autodiff import verify_backward
from kiln.core.autodiff._interp import run_graph
from kiln.core.ir import verify
from kiln.dsl import DSLError, Param, Tensor, build_bundle, compile_model, forward, graph, module, save

F = "fp32"
HERE = Path(__file__).resolve()


def line_of(marker: str) -> int:
    for i, text in enumerate(HERE.read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# <{marker}>"):
            return i
    raise AssertionError(f"no line marked <{marker}>")


def expect(cls: type, code: str, marker: str, *words: str) -> DSLError:
    with pytest.raises(DSLError) as info:
        build_bundle(cls, {})
    err = info.value
    assert err.code == code, err
    path, _, line = str(err.location).rpartition(":")
    assert (Path(path).resolve(), int(line)) == (HERE, line_of(marker)), err
    for w in words:
        assert w in err.message, err
    assert err.hint
    return err


# --- §3.8 optional tensor inputs ------------------------------------------------------------------


@module
class BiasRelu:
    @forward
    def forward(self, x: Tensor[4, F], bias: Tensor[4, F] | None) -> Tensor[4, F]:
        with graph() as g:
            if bias is None:
                return g.relu(x)
            return g.relu(g.add(x, bias))


@module
class TwoWays:
    def __init__(self) -> None:
        self.inner = BiasRelu()

    @forward
    def forward(self, x: Tensor[4, F], b: Tensor[4, F]) -> Tensor[4, F]:
        with graph() as g:
            left = g.call(self.inner, x)  # left out
            right = g.call(self.inner, x, None, name="none")  # passed as None
            both = g.call(self.inner, x, b, name="with_bias")
            return g.add(g.add(left, right), both)


def test_an_optional_input_left_out_or_none_takes_the_branch_without_it() -> None:
    m = build_bundle(TwoWays, {}).module("TwoWays")
    verify(m)
    ops = [(o.type, o.inputs) for o in m.forward.ops]
    assert ops[:2] == [("relu", ("x",)), ("relu", ("x",))]  # no add: the None branch was built
    assert ("add", ("x", "b")) in ops
    x, b = np.random.default_rng(0).normal(size=(2, 4))
    env = run_graph(m.forward, {"x": x, "b": b}, float_dtype=np.float64)
    relu = lambda v: np.maximum(v, 0.0)  # noqa: E731
    np.testing.assert_allclose(env[m.forward.outputs[0].name], 2 * relu(x) + relu(x + b), rtol=1e-12)


@module
class SavesItsBias:
    @save("x", "bias")
    @forward
    def forward(self, x: Tensor[4, F], bias: Tensor[4, F] | None = None) -> Tensor[4, F]:
        with graph() as g:
            return g.relu(x if bias is None else g.add(x, bias))


@module
class LeavesBiasOut:
    def __init__(self) -> None:
        self.act = SavesItsBias()

    @forward
    def forward(self, x: Tensor[4, F]) -> Tensor[4, F]:
        with graph() as g:
            return g.call(self.act, x)


def test_a_save_list_naming_an_absent_optional_input_is_not_a_warning() -> None:
    payload = compile_model(LeavesBiasOut, {})
    assert payload["success"] and not payload["warnings"], payload["warnings"]
    m = build_bundle(LeavesBiasOut, {}).module("LeavesBiasOut")
    assert list(m.forward.save) == ["x"]


def test_a_root_module_declares_its_optional_input() -> None:
    m = build_bundle(BiasRelu, {}).module("BiasRelu")
    assert [d.name for d in m.forward.inputs] == ["x", "bias"]
    assert [o.type for o in m.forward.ops] == ["add", "relu"]


@module
class Strict:
    @forward
    def forward(self, x: Tensor[4, F], bias: Tensor[4, F]) -> Tensor[4, F]:
        with graph() as g:
            return g.add(x, bias)


@module
class NoneToStrict:
    def __init__(self) -> None:
        self.inner = Strict()

    @forward
    def forward(self, x: Tensor[4, F]) -> Tensor[4, F]:
        with graph() as g:
            return g.call(self.inner, x, None)  # <none-to-required>


@module
class StrictLeftOut:
    def __init__(self) -> None:
        self.inner = Strict()

    @forward
    def forward(self, x: Tensor[4, F]) -> Tensor[4, F]:
        with graph() as g:
            return g.call(self.inner, x)  # <required-left-out>


@module
class ReadsNone:
    @forward
    def forward(self, x: Tensor[4, F], bias: Tensor[4, F] | None) -> Tensor[4, F]:
        with graph() as g:
            return g.add(x, bias)  # <none-read>


@module
class CallsReadsNone:
    def __init__(self) -> None:
        self.inner = ReadsNone()

    @forward
    def forward(self, x: Tensor[4, F]) -> Tensor[4, F]:
        with graph() as g:
            return g.call(self.inner, x)


def test_none_for_a_required_input_is_an_error_at_the_call() -> None:
    expect(NoneToStrict, "E003", "none-to-required", "'bias'", "not optional")
    expect(StrictLeftOut, "E003", "required-left-out", "takes 2 inputs")


def test_reading_an_absent_optional_input_is_an_error_at_the_read() -> None:
    expect(CallsReadsNone, "E004", "none-read", "'add'", "input 1")


# --- broadcasting both ways -----------------------------------------------------------------------


@module
class Broadcasts:
    """Every operand broadcast somewhere: a per-row scale times a per-head table, a key bank shared by
    the batch in a batched matmul, and a bias on the left of an add."""

    def __init__(self, N: int = 2, H: int = 3, T: int = 4, D: int = 5) -> None:
        self.N, self.H, self.T, self.D = N, H, T, D

    keys = Param(Tensor["H", "D", "T", F])
    row_bias = Param(Tensor["T", 1, F])

    @forward
    def forward(self, q: Tensor["N", 1, "T", "D", F],
                s: Tensor["H", 1, 1, F]) -> Tensor["N", "H", "T", "T", F]:
        with graph() as g:
            scores = g.batched_matmul(q, "keys")  # [N, 1, T, D] @ [H, D, T] -> [N, H, T, T]
            scaled = g.div(g.mul(s, scores), g.add("row_bias", s))  # [H, 1, 1] * [N, H, T, T]
            return g.add("row_bias", scaled, out_name="loss")  # [T, 1] + [N, H, T, T]


def test_add_mul_div_and_batched_matmul_broadcast_both_ways_with_gradients() -> None:
    m = build_bundle(Broadcasts, {}).module("Broadcasts")
    verify(m)
    assert [str(d) for d in m.forward.outputs[0].shape] == ["N", "H", "T", "T"]
    rng = np.random.default_rng(0)
    q, s = rng.standard_normal((2, 1, 4, 5)), rng.uniform(0.5, 1.5, (3, 1, 1))
    keys, bias = rng.standard_normal((3, 5, 4)), rng.uniform(0.5, 1.5, (4, 1))
    feed = {"q": q, "s": s, "keys": keys, "row_bias": bias}
    got = run_graph(m.forward, feed, float_dtype=np.float64)["loss"]
    np.testing.assert_allclose(got, bias + s * np.matmul(q, keys) / (bias + s), rtol=1e-12)
    errors = verify_backward(m.forward, bindings={"N": 2, "H": 3, "T": 4, "D": 5},
                             params=["keys", "row_bias"])
    assert set(errors) >= {"keys", "row_bias"} and max(errors.values()) < 1e-6, errors


@module
class NoBroadcast:
    @forward
    def forward(self, a: Tensor["N", 3, F], b: Tensor[4, F]) -> Tensor["N", 3, F]:
        with graph() as g:
            return g.mul(a, b)  # <no-broadcast>

    def __init__(self, N: int = 2) -> None:
        self.N = N


def test_shapes_that_do_not_broadcast_are_e004_naming_both_at_the_users_line() -> None:
    expect(NoBroadcast, "E004", "no-broadcast", "[N, 3]", "[4]")


# --- variadic leading dims ------------------------------------------------------------------------


@module
class ScaledSum:
    def __init__(self, C: int = 4) -> None:
        self.C = C

    weight = Param(Tensor["C", F])

    @forward
    def forward(self, x: Tensor["*", "C", F], r: Tensor["*", "C", F]) -> Tensor["*", "C", F]:  # <star-root>
        with graph() as g:
            return g.mul(g.add(x, r), "weight")


@module
class TwoRanks:
    def __init__(self, C: int = 4, N: int = 3, H: int = 2) -> None:
        self.C, self.N, self.H = C, N, H
        self.heads = ScaledSum(C)
        self.rows = ScaledSum(C)

    @forward
    def forward(self, x: Tensor["N", "H", "C", F], y: Tensor["N", "C", F]) -> Tensor["N", "C", F]:
        with graph() as g:
            h = g.call(self.heads, x, x)  # `*` is [N, H]
            return g.add(g.reduce_sum(h, dims=1), g.call(self.rows, y, y), out_name="loss")  # `*` is [N]


def test_variadic_leading_dims_bind_per_call_to_the_callers_leading_dims() -> None:
    m = build_bundle(TwoRanks, {}).module("TwoRanks")
    verify(m)
    assert [o.type for o in m.forward.ops] == ["add", "mul", "reduce_sum", "add", "mul", "add"]
    rng = np.random.default_rng(0)
    x, y, wh, wr = (rng.standard_normal(s) for s in ((3, 2, 4), (3, 4), (4,), (4,)))
    feed = {"x": x, "y": y, "heads.weight": wh, "rows.weight": wr}
    env = run_graph(m.forward, feed, float_dtype=np.float64)
    np.testing.assert_allclose(env["loss"], (2 * x * wh).sum(axis=1) + 2 * y * wr, rtol=1e-12)
    types = {d.name: d for d in m.forward.inputs}
    assert [str(d) for d in types["x"].shape] == ["N", "H", "C"]
    assert env[m.forward.ops[1].outputs[0]].shape == (3, 2, 4)  # the first call ran on [N, H, C]
    assert env[m.forward.ops[4].outputs[0]].shape == (3, 4)  # the second on [N, C]


@module
class Mismatched:
    def __init__(self, C: int = 4, N: int = 3, H: int = 2) -> None:
        self.C, self.N, self.H = C, N, H
        self.f = ScaledSum(C)

    @forward
    def forward(self, x: Tensor["N", "H", "C", F], y: Tensor["N", "C", F]) -> Tensor["N", "C", F]:
        with graph() as g:
            return g.call(self.f, x, y)  # <star-mismatch>


@module
class StarInside:
    @forward
    def forward(self, x: Tensor[2, "*", 4, F]) -> Tensor[2, 4, F]:  # <star-inside>
        with graph() as g:
            return g.reduce_sum(x, dims=1)


def test_variadic_dims_that_cannot_match_are_errors() -> None:
    expect(Mismatched, "E004", "star-mismatch", "[N, H]", "[N]", "'r'")
    expect(StarInside, "E008", "star-inside", "after the first dim")
    err = expect(ScaledSum, "E008", "star-root", "variadic")
    assert "g.call" in err.hint


# --- indexing and slicing (§5.11.4) ---------------------------------------------------------------


@module
class Sliced:
    def __init__(self, N: int = 3, D: int = 5) -> None:
        self.N, self.D = N, D

    w = Param(Tensor["N", "D", 4, F])

    @forward
    def forward(self, x: Tensor["N", "D", F]) -> Tensor["N", 2, F]:
        with graph() as g:
            inner = g.index("w", (slice(None), slice(1, -1)))  # w[:, 1:-1]: [N, D - 2, 4]
            last = inner[..., -1]  # [N, D - 2]
            first = x[:, 0]  # [N]
            head = g.mul(last, x[:, 2:])[:, :2]  # [N, 2]
            return g.mul(head, g.view(first, shape=["N", 1]), out_name="loss")


def test_indexing_and_slicing_compute_numpys_values_and_gradients() -> None:
    m = build_bundle(Sliced, {}).module("Sliced")
    verify(m)
    inner = next(op for op in m.forward.ops if op.inputs == ("w",))
    assert inner.type == "split" and [str(d) for d in inner.attrs["sizes"]] == ["1", "D - 2", "1"]
    rng = np.random.default_rng(0)
    w, x = rng.standard_normal((3, 5, 4)), rng.standard_normal((3, 5))
    got = run_graph(m.forward, {"w": w, "x": x}, float_dtype=np.float64)["loss"]
    np.testing.assert_allclose(got, (w[:, 1:-1][..., -1] * x[:, 2:])[:, :2] * x[:, 0][:, None], rtol=1e-12)
    errors = verify_backward(m.forward, bindings={"N": 3, "D": 5}, params=["w"])
    assert set(errors) == {"w"} and errors["w"] < 1e-6, errors


def _indexing(expr: Any) -> type:
    @module
    class Indexing:
        def __init__(self, D: int = 5) -> None:
            self.D = D

        @forward
        def forward(self, x: Tensor["B", "D", F]) -> Tensor["B", F]:
            with graph() as g:
                return expr(g, x)

    return Indexing


@pytest.mark.parametrize(("expr", "code", "words"), [
    (lambda g, x: x[:, 5], "E004", ["index 5 is out of range for dim 1 of size 5"]),  # <index>
    (lambda g, x: x[:, -6], "E004", ["index -6"]),  # <index>
    (lambda g, x: x[:, 3:1], "E004", ["sliced to -2 elements"]),  # <index>
    (lambda g, x: x[:, 0, 1], "E004", ["3 indices for a tensor of rank 2"]),  # <index>
    (lambda g, x: x[:, ::2], "E003", ["x[:, ::2]"]),  # <index>
    (lambda g, x: x[:, x], "E003", ["not a compile-time int"]),  # <index>
])
def test_indexing_errors_name_the_index_and_the_users_line(expr: Any, code: str, words: list[str]) -> None:
    with pytest.raises(DSLError) as info:
        build_bundle(_indexing(expr), {})
    err = info.value
    assert err.code == code and all(w in err.message for w in words), err
    path, _, line = str(err.location).rpartition(":")
    assert Path(path).resolve() == HERE and HERE.read_text().splitlines()[int(line) - 1].endswith("# <index>")


# --- W003: a derived backward that reads what the save list leaves out ----------------------------


@module
class SavesTooLittle:
    def __init__(self, N: int = 4) -> None:
        self.N = N

    w = Param(Tensor["N", F])

    @save("x")
    @forward
    def forward(self, x: Tensor["N", F]) -> Tensor["N", F]:
        with graph() as g:
            h = g.mul(x, "w")
            return g.mul(h, h, out_name="y")  # <reads-h>


@module
class SavesEnough:
    def __init__(self, N: int = 4) -> None:
        self.N = N

    w = Param(Tensor["N", F])

    @save("x", "h")
    @forward
    def forward(self, x: Tensor["N", F]) -> Tensor["N", F]:
        with graph() as g:
            h = g.mul(x, "w")
            return g.mul(h, h, out_name="y")


def test_w003_names_the_op_whose_derived_backward_reads_an_unsaved_tensor() -> None:
    payload = compile_model(SavesTooLittle, {})
    found = [d for d in payload["warnings"] if d["code"] == "W003"]
    assert len(found) == 1 and "'h'" in found[0]["message"] and found[0]["hint"], found
    path, _, line = found[0]["location"].rpartition(":")
    assert (Path(path).resolve(), int(line)) == (HERE, line_of("reads-h"))
    assert payload["success"]
    assert not [d for d in compile_model(SavesEnough, {})["warnings"] if d["code"] == "W003"]
