"""The functions of the dimension and constraint language: ``min``, ``max``, ``ceil_div`` and ``sqrt`` (the
integer square root), against Python's own arithmetic."""

from __future__ import annotations

import itertools
import math

import pytest

from kiln.core import DimError
from kiln.core.ir import Call, ConditionError, Const, Sym, dims_equal, parse_condition, parse_dim, simplify

VALUES = range(-7, 8)


def test_functions_evaluate_as_python() -> None:
    for a, b, c in itertools.product(VALUES, VALUES, (-2, 5)):
        env = {"a": a, "b": b, "c": c}
        assert parse_dim("min(a, b, c)").evaluate(env) == min(a, b, c)
        assert parse_dim("max(a, b) * 2").evaluate(env) == max(a, b) * 2
        if b:
            assert parse_dim("ceil_div(a, b)").evaluate(env) == math.ceil(a / b)
        if a >= 0:
            assert parse_dim("sqrt(a + 9)").evaluate(env) == math.floor(math.sqrt(a + 9))
    assert parse_dim("sqrt(T)").evaluate({"T": 10**20 + 1}) == 10**10  # exact beyond float precision


def test_parse_print_and_build() -> None:
    e = parse_dim(" ceil_div( T , 4 )*min(a,b+1) ")
    assert str(e) == "ceil_div(T, 4) * min(a, b + 1)" and parse_dim(str(e)) == e
    assert e.free_symbols() == {"T", "a", "b"}
    assert parse_dim("sqrt(D) // 2").lhs == Call("sqrt", (Sym("D"),))  # type: ignore[attr-defined]
    assert parse_dim("min") == Sym("min")  # a name, unless it is called
    assert e.substitute(lambda n: Const(3) if n == "b" else Sym(n)) == parse_dim("ceil_div(T, 4) * min(a, 4)")


@pytest.mark.parametrize(("text", "where"), [
    ("sqrt(a, b)", "sqrt() with 1 argument(s) at position 0, found 2 argument(s)"),
    ("min(a)", "min() with 2 or more argument(s) at position 0, found 1 argument(s)"),
    ("floor(a)", "a function (min, max, ceil_div, sqrt) before '(' at position 0, found 'floor'"),
    ("max(a, b", "',' or ')' at position 8"),
    ("min(, a)", "position 4"),
])
def test_bad_calls_say_what_and_where(text: str, where: str) -> None:
    with pytest.raises(DimError) as info:
        parse_dim(text)
    assert where in info.value.message, info.value.message
    with pytest.raises(DimError, match="takes 2 arguments, found 3"):
        Call("ceil_div", (Sym("a"), Sym("b"), Sym("c")))


def test_domain_errors_name_the_expression() -> None:
    with pytest.raises(DimError, match=r"division by zero in 'ceil_div\(a, b\)'"):
        parse_dim("ceil_div(a, b)").evaluate({"a": 1, "b": 0})
    with pytest.raises(DimError, match=r"negative number in 'sqrt\(a - 5\)'"):
        parse_dim("sqrt(a - 5)").evaluate({"a": 1})


def test_simplify_folds_constant_calls_and_keeps_the_others_opaque() -> None:
    assert simplify("min(4, 2 * 3) + ceil_div(7, 2) + sqrt(17)") == Const(12)
    assert simplify("max(a + a, 1) - max(2 * a, 1)") == Const(0)  # arguments are simplified
    assert dims_equal("ceil_div(T, 4) * 2 + 1", "1 + 2 * ceil_div(T, 4)")
    assert not dims_equal("min(a, b)", "a")
    for env in ({"a": 3, "b": 5}, {"a": 9, "b": -2}):
        e = parse_dim("min(a, b) * (max(a, b) + 1) - ceil_div(a * b, 2)")
        assert simplify(e).evaluate(env) == e.evaluate(env)


def test_conditions_take_the_functions() -> None:
    cond = parse_condition("ceil_div(T, block) <= max(n, 1) and sqrt(D) * sqrt(D) == D")
    assert cond.names == {"T", "block", "n", "D"}
    assert cond.evaluate({"T": 9, "block": 4, "n": 3, "D": 16})
    assert not cond.evaluate({"T": 13, "block": 4, "n": 3, "D": 16})
    assert not cond.evaluate({"T": 9, "block": 4, "n": 3, "D": 15})
    with pytest.raises(ConditionError, match="division by zero"):
        cond.evaluate({"T": 9, "block": 0, "n": 3, "D": 16})
    for text in ("min(a and b, 1) > 0", "floor(a) == 1", "sqrt() == 0"):
        with pytest.raises(ConditionError) as info:
            parse_condition(text)
        assert info.value.code == "E026"
