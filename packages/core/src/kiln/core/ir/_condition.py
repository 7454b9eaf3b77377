"""Conditions on parameters and activation slots: ``"use_bias"``, ``"not use_qk_norm"``,
``"use_a and d_model % num_heads == 0"``, ``"ceil_div(T, block) <= max(n_blocks, 1)"``.

A condition reads names (a module's config entries, or whatever the caller's lookup knows). A name
on its own is true when its value is (a flag, a nonzero count). Arithmetic (integers, names, ``+ -
* // %``, parentheses and ``min``, ``max``, ``ceil_div``, ``sqrt``, as in dimensions) and comparisons
(``== != < <= > >=``, chained as in Python) take integers, a bool counting as 0 or 1. ``not``,
``and`` and ``or`` combine them with Python's precedence; ``and`` and ``or`` stop at the first
operand that decides. ``True`` and ``False`` are literals. IR files come from anyone, so the text is
read by a small parser, never by ``eval``.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import attrs

from kiln.core._errors import DimError, KilnError
from kiln.core.ir import _dims
from kiln.core.ir._dims import _MAX_DEPTH, _PREC, BinOp, Const, DimExpr, Sym, _height, _quote

__all__ = ["Condition", "ConditionError", "parse_condition"]

_TOKEN = re.compile(r"(?P<int>[0-9]+)|(?P<keyword>(?:and|or|not|True|False)\b)"
                    r"|(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<op>//|==|!=|<=|>=|[-+*%<>(),])")
_CMP: dict[str, Callable[[int, int], bool]] = {"==": operator.eq, "!=": operator.ne, "<": operator.lt,
                                               "<=": operator.le, ">": operator.gt, ">=": operator.ge}
_MAX_NEST = 40  # parentheses and nots; each level takes ~9 Python frames of the parser
_HINT = ("a condition is a name, or integers and names joined by + - * // % (and min, max, ceil_div, sqrt of "
         "them) and compared by == != < <= > >=, combined with not, and, or and parentheses")


class ConditionError(KilnError):
    """A condition that cannot be read or evaluated (E026). ``condition`` is its text, ``reason`` what
    is wrong, ``name`` the name it reads that the lookup does not know (when that is what is wrong)."""

    def __init__(self, message: str, *, condition: str, reason: str, name: str | None = None,
                 **kw: Any) -> None:
        self.condition, self.reason, self.name = condition, reason, name
        kw.setdefault("hint", _HINT)
        super().__init__(message, code="E026", **kw)


@attrs.frozen
class _Not:
    operand: Any


@attrs.frozen
class _Logic:
    op: str  # "and" | "or"
    operands: tuple[Any, ...]


@attrs.frozen
class _Compare:
    first: DimExpr
    rest: tuple[tuple[str, DimExpr], ...]


Node = DimExpr | _Not | _Logic | _Compare


@attrs.frozen
class Condition:
    """A parsed condition (:func:`parse_condition` makes one); ``names`` are the names it reads."""

    text: str
    names: frozenset[str]
    _tree: Node = attrs.field(repr=False, eq=False)

    def evaluate(self, lookup: Mapping[str, Any] | Callable[[str], Any]) -> bool:
        """Whether the condition holds, ``lookup`` giving each name's value (a mapping, or a function
        that raises KeyError for a name it does not know). Raises :class:`ConditionError` naming the
        unknown name, a value that is not an integer where arithmetic needs one, or a division by zero."""
        get = lookup.__getitem__ if isinstance(lookup, Mapping) else lookup

        def value(name: str) -> Any:
            try:
                return get(name)
            except KeyError:
                reason = f"names {name!r}, which is not in the config"
                hint = None
                if isinstance(lookup, Mapping):
                    hint = f"the config holds {', '.join(sorted(lookup))}"
                raise ConditionError(f"condition {self.text!r} {reason}", condition=self.text, reason=reason,
                                     name=name, hint=hint) from None

        def fail(reason: str) -> NoReturn:
            raise ConditionError(f"condition {self.text!r} cannot be evaluated: {reason}",
                                 condition=self.text, reason=reason,
                                 hint="arithmetic and comparisons take integer values")

        def num(e: DimExpr) -> int:
            binds = {}
            for s in sorted(e.free_symbols()):
                v = value(s)
                if not isinstance(v, int):  # bools are ints
                    fail(f"{s} = {v!r} is not an integer")
                binds[s] = int(v)
            try:
                return e.evaluate(binds)
            except DimError as exc:  # division by zero
                fail(exc.message)

        def holds(node: Node) -> bool:
            match node:
                case Sym(name):
                    return bool(value(name))
                case DimExpr():
                    return bool(num(node))
                case _Not(operand):
                    return not holds(operand)
                case _Logic("and", operands):
                    return all(holds(n) for n in operands)
                case _Logic(_, operands):
                    return any(holds(n) for n in operands)
                case _Compare(first, rest):
                    left = num(first)
                    for op, e in rest:
                        right = num(e)
                        if not _CMP[op](left, right):
                            return False
                        left = right
                    return True
            raise TypeError(f"not a condition node: {node!r}")

        return holds(self._tree)

    def __str__(self) -> str:
        return self.text


def parse_condition(text: str) -> Condition:
    """Read a condition such as ``"use_bias and d_model % num_heads == 0"``; raises
    :class:`ConditionError` (E026) naming the position of what it cannot read."""
    tree = _Parser(text).condition()
    return Condition(text, frozenset(_names(tree)), tree)


def _names(node: Node) -> set[str]:
    match node:
        case DimExpr():
            return set(node.free_symbols())
        case _Not(operand):
            return _names(operand)
        case _Logic(_, operands):
            return set().union(*(_names(n) for n in operands))
        case _Compare(first, rest):
            return set().union(first.free_symbols(), *(e.free_symbols() for _, e in rest))
    raise TypeError(f"not a condition node: {node!r}")


class _Parser(_dims._Parser):
    """The dimension parser's tokens and literals, with conditions above its arithmetic."""

    token = _TOKEN
    nest = 0

    def fail(self, expected: str, pos: int | None = None, found: str | None = None) -> NoReturn:
        kind, tok, tpos = self.toks[self.i] if pos is None else ("", "", pos)
        found = found or ("end of input" if kind == "end" else repr(tok))
        reason = f"expected {expected} at position {tpos}, found {found}"
        raise ConditionError(f"invalid condition {_quote(self.text)}: {reason}", condition=self.text,
                             reason=reason)

    def peek(self) -> str:
        return self.toks[self.i][1]

    def condition(self) -> Node:
        node = self.disjunction()
        if self.toks[self.i][0] != "end":
            self.fail("an operator, 'and', 'or' or end of input")
        return node

    def disjunction(self) -> Node:
        return self.logic("or", self.conjunction)

    def conjunction(self) -> Node:
        return self.logic("and", self.negation)

    def logic(self, op: str, operand: Callable[[], Node]) -> Node:
        nodes = [operand()]
        while self.peek() == op:  # keywords are never names
            self.i += 1
            nodes.append(operand())
        return nodes[0] if len(nodes) == 1 else _Logic(op, tuple(nodes))

    def negation(self) -> Node:
        if self.peek() == "not":
            self.i += 1
            return _Not(self.nested(self.negation))
        return self.comparison()

    def nested(self, parse: Callable[[], Node]) -> Node:
        if self.nest >= _MAX_NEST:
            self.fail(f"at most {_MAX_NEST} nested parentheses and 'not's")
        self.nest += 1
        node = parse()
        self.nest -= 1
        return node

    def comparison(self) -> Node:
        first = self.arith(1)[0]
        rest = []
        while self.peek() in _CMP:
            op = self.peek()
            self.i += 1
            rest.append((op, self.integer(self.arith(1)[0])))
        if not rest:
            return first
        return _Compare(self.integer(first), tuple(rest))

    def integer(self, node: Node) -> DimExpr:
        """``node`` where an integer is needed: a condition there (``(a and b) + 1``) is an error."""
        if not isinstance(node, DimExpr):
            self.fail("an integer expression, not a condition in parentheses, before or after an operator")
        return node

    def arith(self, min_prec: int) -> tuple[Node, int]:
        """An operand and its height, operators binding at least as tightly as ``min_prec``."""
        lhs = self.atom()
        height = _height(lhs) if isinstance(lhs, BinOp) else 0
        while (tok := self.toks[self.i])[0] == "op" and _PREC.get(tok[1], 0) >= min_prec:
            self.i += 1
            rhs, rheight = self.arith(_PREC[tok[1]] + 1)
            lhs, height = BinOp(tok[1], self.integer(lhs), self.integer(rhs)), max(height, rheight) + 1
            if height > _MAX_DEPTH:
                self.fail(f"an expression at most {_MAX_DEPTH} operators deep")
        return lhs, height

    def atom(self) -> Node:
        kind, tok, _ = self.toks[self.i]
        if tok == "-" and self.toks[self.i + 1][0] == "int":  # a negative literal such as -1
            self.i += 1
            return Const(-self.literal())
        if kind == "int":
            return Const(self.literal())
        if kind == "name":
            self.i += 1
            if self.peek() == "(":
                return self.nested(lambda: self.call(lambda: self.integer(self.arith(1)[0])))
            return Sym(tok)
        if tok in ("True", "False"):
            self.i += 1
            return Const(int(tok == "True"))
        if tok == "(":
            self.i += 1
            node = self.nested(self.disjunction)
            if self.peek() != ")":
                self.fail("an operator or ')'")
            self.i += 1
            return node
        self.fail("a number, a name, 'not' or '('")
