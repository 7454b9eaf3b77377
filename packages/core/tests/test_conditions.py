"""Conditions on parameters and activation slots (``kiln.core.ir.parse_condition``): the one reader
the recompute planner and kiln-dsl share."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.core import KilnError, init_value
from kiln.core.ir import Condition, ConditionError, parse_condition
from kiln.core.plan._recompute import condition_holds

CONFIG = {"use_bias": True, "use_qk_norm": False, "d_model": 10, "num_heads": 3, "n": 2, "zero": 0,
          "theta": 1e4, "name": "llama"}


@pytest.mark.parametrize(("text", "expected"), [
    ("use_bias", True),
    ("use_qk_norm", False),
    ("name", True),  # a name alone: its truth, whatever its type
    ("zero", False),
    ("not use_qk_norm", True),
    ("d_model + n * 2 == 14", True),  # * before +
    ("(d_model + n) * 2 == 24", True),
    ("d_model - n - 1 == 7", True),  # left to right
    ("d_model // num_heads == 3 and d_model % num_heads == 1", True),
    ("-7 // 2 == -4 and -7 % 2 == 1", True),  # floor division, as in Python
    ("d_model != 10 or n <= 2", True),
    ("0 < n < num_heads <= 3", True),  # chained comparisons
    ("0 < n > num_heads", False),
    ("not use_bias or n >= 2 and zero", False),  # not, then and, then or
    ("(not use_bias or n >= 2) and zero", False),
    ("not (use_bias and use_qk_norm)", True),
    ("use_bias + use_bias == 2", True),  # bools count as 0 and 1
    ("True and not False", True),
    ("n * 0", False),  # an integer's truth
    ("use_qk_norm and missing", False),  # and/or stop at the operand that decides
    ("use_bias or missing > 0", True),
])
def test_operators_and_precedence(text: str, expected: bool) -> None:
    assert parse_condition(text).evaluate(CONFIG) is expected


def test_a_condition_knows_its_names_and_takes_a_lookup_function() -> None:
    cond = parse_condition(" use_a and (n + 1) % K == 0 or not True ")
    assert isinstance(cond, Condition) and cond.names == {"use_a", "n", "K"}
    assert cond == parse_condition(" use_a and (n + 1) % K == 0 or not True ")
    asked: list[str] = []

    def lookup(name: str) -> Any:
        asked.append(name)
        return {"use_a": 1, "n": 5, "K": 3}[name]

    assert cond.evaluate(lookup) and asked == ["use_a", "K", "n"]
    assert not cond.evaluate({"use_a": 1, "n": 5, "K": 4})


def test_an_unknown_name_is_named() -> None:
    with pytest.raises(ConditionError) as err:
        parse_condition("use_bias and d_modle > 0").evaluate(CONFIG)
    assert (err.value.code, err.value.name) == ("E026", "d_modle")
    assert err.value.condition == "use_bias and d_modle > 0"
    assert "names 'd_modle', which is not in the config" in err.value.message
    assert "d_model" in (err.value.hint or "")  # a mapping lists what it holds
    with pytest.raises(ConditionError, match="names 'x'") as err:
        parse_condition("x").evaluate(lambda name: {}[name])
    assert err.value.name == "x"


@pytest.mark.parametrize(("text", "reason"), [
    ("theta > 1", "theta = 10000.0 is not an integer"),
    ("name == 1", "name = 'llama' is not an integer"),
    ("d_model // zero > 0", "division by zero in 'd_model // zero'"),
    ("n % zero", "division by zero"),
])
def test_arithmetic_takes_integers(text: str, reason: str) -> None:
    with pytest.raises(ConditionError) as err:
        parse_condition(text).evaluate(CONFIG)
    assert err.value.name is None and reason in err.value.reason
    assert err.value.message.startswith(f"condition {text!r} cannot be evaluated: ")


@pytest.mark.parametrize(("text", "where"), [
    ("", "position 0, found end of input"),
    ("   ", "position 3, found end of input"),
    ("d_model %% 2 == 0", "position 9, found '%'"),
    ("__import__('os').getcwd() == 0", "position 11, found \"'\""),  # never Python
    ("n / 2", "position 2, found '/'"),
    ("n ** 2", "position 3, found '*'"),
    ("n = 2", "position 2, found '='"),
    ("use_bias && n", "position 9, found '&'"),
    ("(use_bias", "')' at position 9, found end of input"),
    ("use_bias)", "end of input at position 8, found ')'"),
    ("use_bias n", "position 9, found 'n'"),
    ("and n", "position 0, found 'and'"),
    ("n <", "position 3, found end of input"),
    ("not", "position 3, found end of input"),
    ("(use_bias or n) + 1", "an integer expression"),
    ("1 == (n < 2)", "an integer expression"),
    ("1.5 > n", "position 1, found '.'"),
    ("'llama' == name", "position 0, found \"'\""),
])
def test_malformed_text_is_e026_with_its_position(text: str, where: str) -> None:
    with pytest.raises(ConditionError) as err:
        parse_condition(text)
    assert err.value.code == "E026" and where in err.value.reason, err.value.reason
    assert err.value.message == f"invalid condition {text!r}: {err.value.reason}"


def test_deep_text_is_refused_not_a_recursion_error() -> None:
    for text in ("(" * 1000 + "n" + ")" * 1000, "not " * 1000 + "n", "n" + " + n" * 1000):
        with pytest.raises(ConditionError, match="at most"):
            parse_condition(text)
    assert parse_condition("(" * 30 + " + ".join(["n"] * 150) + ")" * 30 + " == 300").evaluate(CONFIG)


def test_the_recompute_planner_names_the_slot() -> None:
    assert condition_holds("not use_qk_norm", CONFIG, "block 'B', slot 's'")
    with pytest.raises(KilnError, match=r"\[E026\] block 'B', slot 's': condition 'nope' names 'nope'"):
        condition_holds("nope", CONFIG, "block 'B', slot 's'")


# --- the Python subset means what it means in Python ---------------------------------------------

NAMES = ("a", "b", "c")
atoms = st.sampled_from(NAMES) | st.integers(-5, 9).map(str)


def _arith(kids: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    ops = st.sampled_from(["+", "-", "*", "//", "%"])
    return st.tuples(kids, ops, kids).map(lambda t: f"({t[0]} {t[1]} {t[2]})")


arith = st.recursive(atoms, _arith, max_leaves=6)
comparisons = st.lists(st.tuples(st.sampled_from(["==", "!=", "<", "<=", ">", ">="]), arith), min_size=1,
                       max_size=3).flatmap(lambda rest: arith.map(lambda first: first + "".join(
                           f" {op} {e}" for op, e in rest)))


def _logic(kids: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return (kids.map(lambda k: f"not {k}")
            | st.tuples(kids, st.sampled_from(["and", "or"]), kids).map(lambda t: f"{t[0]} {t[1]} {t[2]}")
            | kids.map(lambda k: f"({k})"))


conditions = st.recursive(comparisons | arith | st.sampled_from(NAMES), _logic, max_leaves=6)


@settings(max_examples=300, deadline=None)
@given(conditions, st.fixed_dictionaries({n: st.integers(-4, 4) for n in NAMES}))
def test_agrees_with_python_on_integers(text: str, env: dict[str, int]) -> None:
    try:
        expected: bool | None = bool(eval(text, {"__builtins__": {}}, dict(env)))
    except ZeroDivisionError:
        expected = None
    try:
        found: bool | None = parse_condition(text).evaluate(env)
    except ConditionError as err:
        assert "division by zero" in err.reason, err.reason
        found = None
    assert found == expected, text


# --- initial values ------------------------------------------------------------------------------


def test_init_value_by_kind() -> None:
    rng = np.random.default_rng(0)
    assert (init_value({"kind": "ones"}, (2, 3), rng, 0.02, "w") == 1).all()
    assert not init_value({"kind": "zeros"}, (2,), rng, 0.02, "w").any()
    assert 0.5 < init_value({}, (4000,), rng, 1.0, "w").std() < 1.5  # normal with the default std
    drawn = init_value({"kind": "uniform", "low": -1, "high": 1}, (1000,), rng, 0.02, "w")
    assert drawn.min() >= -1 and drawn.max() <= 1
    with pytest.raises(KilnError, match=r"parameter 'blocks.0.w': unknown init kind 'xavier'"):
        init_value({"kind": "xavier"}, (2,), rng, 0.02, "blocks.0.w")
    with pytest.raises(KilnError, match=r"parameter 'b': init .* is not valid \(KeyError: 'low'\)"):
        init_value({"kind": "uniform", "high": 1}, (2,), rng, 0.02, "b")
