"""Symbolic dimension expressions: ``"B * T"``, ``"D // 2"``, ``"(Hq + 2 * Hkv) * D"``,
``"ceil_div(T, block)"``.

IR files come from anyone, so text is read by a small tokenizer and precedence-climbing parser,
never by ``eval``. ``simplify`` puts ``+ - *`` into a polynomial normal form and keeps ``//`` and
``%`` as opaque terms, rewriting them only where the rewrite is exact over all integers. The
functions ``min(a, b, ...)``, ``max(a, b, ...)``, ``ceil_div(a, b)`` and ``sqrt(a)`` (the integer
square root, ``floor(sqrt(a))``) are opaque terms too, folded once their arguments are constants.
"""

from __future__ import annotations

import functools
import math
import operator
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NoReturn

import attrs

from kiln.core._errors import DimError

__all__ = [
    "BinOp",
    "Call",
    "Const",
    "DimExpr",
    "DimLike",
    "Shape",
    "Sym",
    "dim_bindings",
    "dims_equal",
    "evaluate_shape",
    "parse_dim",
    "parse_shape",
    "shape_to_json",
    "simplify",
]

_MAX_DEPTH = 200  # keeps every recursive walk far below Python's recursion limit
_MAX_TERMS = 10_000  # simplify refuses larger expansions instead of hanging
_OPS: dict[str, Callable[[int, int], int]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "//": operator.floordiv,
    "%": operator.mod,
}
_PREC = {"+": 1, "-": 1, "*": 2, "//": 2, "%": 2}


def _isqrt(a: int) -> int:
    if a < 0:
        raise ValueError("sqrt of a negative number")
    return math.isqrt(a)


def _ceil_div(a: int, b: int) -> int:
    if b == 0:
        raise ValueError("division by zero")
    return -(-a // b)


#: functions of dimensions: (implementation, least and most arguments; None: any number)
_FUNCS: dict[str, tuple[Callable[..., int], int, int | None]] = {
    "min": (min, 2, None),
    "max": (max, 2, None),
    "ceil_div": (_ceil_div, 2, 2),
    "sqrt": (_isqrt, 1, 1),
}


def _arity(fn: str, n: int) -> str | None:
    """None if ``fn`` takes ``n`` arguments, else how many it takes."""
    _, least, most = _FUNCS[fn]
    if least <= n and (most is None or n <= most):
        return None
    return str(least) if least == most else f"{least} or more"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SPACE = re.compile(r"\s*")
_TOKEN = re.compile(r"(?P<int>[0-9]+)|(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<op>//|[-+*%])|(?P<paren>[(),])")
_HINT = ("a dimension is an integer, a name, or integers and names joined by + - * // % and parentheses, "
         "or min(a, b), max(a, b), ceil_div(a, b), sqrt(a) of them")


def _quote(text: str) -> str:
    return repr(text if len(text) <= 120 else text[:117] + "...")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def dim_bindings(config: Mapping[str, Any]) -> dict[str, int]:
    """The entries of a module config that bind dimension symbols: ints, not bools."""
    return {k: v for k, v in config.items() if _is_int(v)}


def _apply(op: str, a: int, b: int, expr: DimExpr) -> int:
    if op in ("//", "%") and b == 0:
        raise DimError(f"division by zero in {_quote(str(expr))}", expr=str(expr))
    return _OPS[op](a, b)


def _combine(op: str, lhs: object, rhs: object) -> DimExpr:
    if _is_int(lhs):
        lhs = Const(lhs)  # type: ignore[arg-type]
    if _is_int(rhs):
        rhs = Const(rhs)  # type: ignore[arg-type]
    if not (isinstance(lhs, DimExpr) and isinstance(rhs, DimExpr)):
        return NotImplemented  # type: ignore[no-any-return]  # lets Python raise its usual TypeError
    if isinstance(lhs, Const) and isinstance(rhs, Const):
        return Const(_apply(op, lhs.value, rhs.value, BinOp(op, lhs, rhs)))
    return BinOp(op, lhs, rhs)


@attrs.frozen
class DimExpr:
    """A symbolic dimension; build one with :func:`parse_dim` or Python arithmetic on dims."""

    def __add__(self, other: DimExpr | int) -> DimExpr:
        return _combine("+", self, other)

    def __radd__(self, other: int) -> DimExpr:
        return _combine("+", other, self)

    def __sub__(self, other: DimExpr | int) -> DimExpr:
        return _combine("-", self, other)

    def __rsub__(self, other: int) -> DimExpr:
        return _combine("-", other, self)

    def __mul__(self, other: DimExpr | int) -> DimExpr:
        return _combine("*", self, other)

    def __rmul__(self, other: int) -> DimExpr:
        return _combine("*", other, self)

    def __floordiv__(self, other: DimExpr | int) -> DimExpr:
        return _combine("//", self, other)

    def __rfloordiv__(self, other: int) -> DimExpr:
        return _combine("//", other, self)

    def __mod__(self, other: DimExpr | int) -> DimExpr:
        return _combine("%", self, other)

    def __rmod__(self, other: int) -> DimExpr:
        return _combine("%", other, self)

    def __str__(self) -> str:
        match self:
            case Const(value):
                return str(value)
            case Sym(name):
                return name
            case BinOp(op, lhs, rhs):
                left, right = str(lhs), str(rhs)
                if _prec(lhs) < _PREC[op]:
                    left = f"({left})"
                if _prec(rhs) <= _PREC[op]:  # the parser is left-associative
                    right = f"({right})"
                return f"{left} {op} {right}"
            case Call(fn, args):
                return f"{fn}({', '.join(map(str, args))})"
        raise TypeError(f"not a concrete dimension: {self!r}")

    def free_symbols(self) -> frozenset[str]:
        match self:
            case Sym(name):
                return frozenset((name,))
            case BinOp(_, lhs, rhs):
                return lhs.free_symbols() | rhs.free_symbols()
            case Call(_, args):
                return frozenset().union(*(a.free_symbols() for a in args))
        return frozenset()

    def evaluate(self, bindings: Mapping[str, int]) -> int:
        """The value under ``bindings``, with Python's floor semantics for ``//`` and ``%``."""
        text = str(self)
        unbound = sorted(self.free_symbols() - bindings.keys())
        if unbound:
            raise DimError(
                f"cannot evaluate {_quote(text)}: unbound symbol(s) {', '.join(unbound)}",
                expr=text,
                hint=f"bind {', '.join(unbound)} to an integer",
            )
        bad = sorted(n for n in self.free_symbols() if not _is_int(bindings[n]))
        if bad:
            found = ", ".join(f"{n}={bindings[n]!r}" for n in bad)
            raise DimError(f"cannot evaluate {_quote(text)}: expected int bindings, found {found}", expr=text)
        return self._eval(bindings)

    def _eval(self, bindings: Mapping[str, int]) -> int:
        match self:
            case Const(value):
                return value
            case Sym(name):
                return bindings[name]
            case BinOp(op, lhs, rhs):
                return _apply(op, lhs._eval(bindings), rhs._eval(bindings), self)
            case Call(fn, args):
                return _call(fn, [a._eval(bindings) for a in args], self)
        raise TypeError(f"not a concrete dimension: {self!r}")

    def to_json(self) -> int | str:
        return self.value if isinstance(self, Const) else str(self)

    def substitute(self, f: Callable[[str], DimExpr]) -> DimExpr:
        """This expression with every symbol ``name`` replaced by ``f(name)`` (constants folded)."""
        match self:
            case Sym(name):
                return f(name)
            case BinOp(op, lhs, rhs):
                return _combine(op, lhs.substitute(f), rhs.substitute(f))
            case Call(fn, args):
                return Call(fn, tuple(a.substitute(f) for a in args))
        return self


def _check_int(_: object, __: object, value: Any) -> None:
    if not _is_int(value):
        raise DimError(f"a constant dimension must be an int, found {value!r}", expr=repr(value))


def _check_name(_: object, __: object, value: Any) -> None:
    if not (isinstance(value, str) and _NAME.fullmatch(value)):
        raise DimError(
            f"bad dimension name {value!r}: expected letters, digits and '_', not starting with a digit",
            expr=repr(value),
        )


def _check_op(_: object, __: object, value: Any) -> None:
    if value not in _OPS:
        raise DimError(f"bad dimension operator {value!r}: expected one of + - * // %", expr=repr(value))


def _check_expr(_: object, __: object, value: Any) -> None:
    if not isinstance(value, DimExpr):
        raise DimError(f"a dimension operand must be a DimExpr, found {value!r}", expr=repr(value))


@attrs.frozen
class Const(DimExpr):
    value: int = attrs.field(validator=_check_int)


@attrs.frozen
class Sym(DimExpr):
    name: str = attrs.field(validator=_check_name)


@attrs.frozen
class BinOp(DimExpr):
    op: str = attrs.field(validator=_check_op)
    lhs: DimExpr = attrs.field(validator=_check_expr)
    rhs: DimExpr = attrs.field(validator=_check_expr)


def _exprs(items: Iterable[DimExpr]) -> tuple[DimExpr, ...]:
    return tuple(items)


def _check_call(call: Call, _: object, args: tuple[DimExpr, ...]) -> None:
    if call.fn not in _FUNCS:
        raise DimError(f"unknown dimension function {call.fn!r}: expected one of {', '.join(_FUNCS)}",
                       expr=call.fn)
    count = _arity(call.fn, len(args))
    if count is not None:
        raise DimError(f"{call.fn}() takes {count} arguments, found {len(args)}", expr=call.fn)
    for a in args:
        _check_expr(call, _, a)


@attrs.frozen
class Call(DimExpr):
    """``fn(args...)``, one of ``min``, ``max``, ``ceil_div``, ``sqrt`` (integer square root)."""

    fn: str
    args: tuple[DimExpr, ...] = attrs.field(converter=_exprs, validator=_check_call)


def _call(fn: str, values: list[int], expr: DimExpr) -> int:
    try:
        return _FUNCS[fn][0](*values)
    except ValueError as exc:
        raise DimError(f"{exc} in {_quote(str(expr))}", expr=str(expr)) from None


DimLike = str | int | DimExpr
Shape = tuple[DimExpr, ...]


def _prec(e: DimExpr) -> int:
    return _PREC[e.op] if isinstance(e, BinOp) else 3


# --- parsing -------------------------------------------------------------------------------------


class _Parser:
    token = _TOKEN  # the condition parser reads more tokens

    def __init__(self, text: str) -> None:
        self.text = text
        self.toks: list[tuple[str, str, int]] = []  # (kind, text, position)
        pos = 0
        while (pos := _SPACE.match(text, pos).end()) < len(text):  # type: ignore[union-attr]
            m = self.token.match(text, pos)
            if m is None:
                slash = text[pos] == "/"
                self.fail(
                    "'//' (integer division)" if slash else "a number, a name, an operator or a parenthesis",
                    pos,
                    repr(text[pos]),
                )
            self.toks.append((m.lastgroup or "", m.group(), pos))
            pos = m.end()
        self.toks.append(("end", "", len(text)))
        self.i = 0

    def fail(self, expected: str, pos: int | None = None, found: str | None = None) -> NoReturn:
        kind, tok, tpos = self.toks[self.i] if pos is None else ("", "", pos)
        found = found or ("end of input" if kind == "end" else repr(tok))
        raise DimError(
            f"bad dimension {_quote(self.text)}: expected {expected} at position {tpos}, found {found}",
            expr=self.text,
            hint=_HINT,
        )

    def parse(self) -> DimExpr:
        e, _ = self.binary(1, 0)
        if self.toks[self.i][0] != "end":
            self.fail("an operator or end of input")
        return e

    def binary(self, min_prec: int, nest: int) -> tuple[DimExpr, int]:
        lhs, height = self.primary(nest)
        while (tok := self.toks[self.i])[0] == "op" and _PREC[tok[1]] >= min_prec:
            self.i += 1
            rhs, rheight = self.binary(_PREC[tok[1]] + 1, nest)
            lhs, height = BinOp(tok[1], lhs, rhs), max(height, rheight) + 1
            if height > _MAX_DEPTH:
                self.fail(f"an expression at most {_MAX_DEPTH} operators deep")
        return lhs, height

    def primary(self, nest: int) -> tuple[DimExpr, int]:
        kind, tok, _ = self.toks[self.i]
        if tok == "-" and self.toks[self.i + 1][0] == "int":  # a negative literal such as -1
            self.i += 1
            return Const(-self.literal()), 0
        if kind == "int":
            return Const(self.literal()), 0
        if kind == "name":
            self.i += 1
            if self.toks[self.i][1] == "(":
                return self.call(lambda: self.binary(1, nest + 1)[0]), 0
            return Sym(tok), 0
        if tok == "(":
            if nest >= _MAX_DEPTH:
                self.fail(f"at most {_MAX_DEPTH} nested parentheses")
            self.i += 1
            e = self.binary(1, nest + 1)
            if self.toks[self.i][1] != ")":
                self.fail("an operator or ')'")
            self.i += 1
            return e
        negate = " (write 0 - x to negate x)" if tok == "-" else ""
        self.fail(f"a number, a name or '('{negate}")

    def call(self, argument: Callable[[], Any]) -> Call:
        """A function call, the parser at its ``(``; each argument is read by ``argument``."""
        _, fn, pos = self.toks[self.i - 1]
        if fn not in _FUNCS:
            self.fail(f"a function ({', '.join(_FUNCS)}) before '('", pos, repr(fn))
        self.i += 1
        args = [argument()]
        while self.toks[self.i][1] == ",":
            self.i += 1
            args.append(argument())
        if self.toks[self.i][1] != ")":
            self.fail("an operator, ',' or ')'")
        self.i += 1
        count = _arity(fn, len(args))
        if count is not None:
            self.fail(f"{fn}() with {count} argument(s)", pos, f"{len(args)} argument(s)")
        return Call(fn, tuple(args))

    def literal(self) -> int:
        try:
            value = int(self.toks[self.i][1])
        except ValueError:  # beyond sys.get_int_max_str_digits()
            self.fail("an integer literal of reasonable length")
        self.i += 1
        return value


def parse_dim(value: DimLike) -> DimExpr:
    """Read a dimension from an int, a string such as ``"(Hq + 2 * Hkv) * D"``, or a DimExpr."""
    if isinstance(value, DimExpr):
        return value
    if _is_int(value):
        return Const(value)  # type: ignore[arg-type]
    if isinstance(value, str):
        return _Parser(value).parse()
    raise DimError(
        f"expected a dimension (int, str or DimExpr), found {type(value).__name__} {value!r}",
        expr=repr(value),
        hint=_HINT,
    )


def parse_shape(seq: Sequence[DimLike]) -> Shape:
    """Read a shape: a list or tuple of dimensions, e.g. ``["B", "T", 64]``."""
    if isinstance(seq, (str, bytes, bytearray)) or not isinstance(seq, Sequence):
        found = f"{type(seq).__name__} {seq!r}"
        raise DimError(f"expected a shape (a list of dimensions), found {found}", expr=repr(seq))
    out = []
    for i, d in enumerate(seq):
        try:
            out.append(parse_dim(d))
        except DimError as err:
            raise DimError(f"shape dimension #{i}: {err.message}", expr=err.expr, hint=err.hint) from None
    return tuple(out)


def shape_to_json(shape: Shape) -> list[int | str]:
    return [d.to_json() for d in shape]


def evaluate_shape(shape: Shape, bindings: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(d.evaluate(bindings) for d in shape)


# --- simplification ------------------------------------------------------------------------------
# A polynomial maps a monomial (a sorted tuple of atoms, repeated for powers) to a nonzero integer
# coefficient. Atoms are symbols and simplified ``//`` / ``%`` terms.

_Mono = tuple[DimExpr, ...]
_Poly = dict[_Mono, int]


def _atom_key(a: DimExpr) -> tuple[int, str]:
    return (0, a.name) if isinstance(a, Sym) else (1, str(a))


def _terms(p: _Poly) -> list[tuple[_Mono, int]]:
    return sorted(p.items(), key=lambda mc: (not mc[0], [_atom_key(a) for a in mc[0]]))


def _add(p: _Poly, q: _Poly, scale: int = 1) -> _Poly:
    out = dict(p)
    for m, c in q.items():
        if v := out.get(m, 0) + scale * c:
            out[m] = v
        else:
            out.pop(m, None)
    return out


def _mul(p: _Poly, q: _Poly) -> _Poly:
    if len(p) * len(q) > _MAX_TERMS:
        raise OverflowError
    out: _Poly = {}
    for m1, c1 in p.items():
        for m2, c2 in q.items():
            m = tuple(sorted(m1 + m2, key=_atom_key))
            out[m] = out.get(m, 0) + c1 * c2
    return {m: c for m, c in out.items() if c}


def _mono_div(t: _Mono, m: _Mono) -> _Mono | None:
    rest = list(t)
    for a in m:
        if a not in rest:
            return None
        rest.remove(a)
    return tuple(rest)


def _divmod(op: str, p: _Poly, q: _Poly) -> _Poly:
    if not q:  # kept so that evaluating still fails
        return {(BinOp(op, _expr(p), Const(0)),): 1}
    # Every rewrite below is exact whenever the divisor is nonzero: p // q == (-p) // (-q),
    # p % q == -((-p) % (-q)), (q*Q + R) // q == Q + R // q, (g*r) // (g*s) == r // s.
    sign = 1 if _terms(q)[0][1] > 0 else -1
    p, q = {m: sign * c for m, c in p.items()}, {m: sign * c for m, c in q.items()}
    quot: _Poly = {}
    if len(q) == 1:
        ((mq, k),) = q.items()
        rest: _Poly = {}
        for t, c in p.items():
            if (d := _mono_div(t, mq)) is None:
                rest[t] = c
                continue
            qc, rc = divmod(c, k)
            if qc:
                quot[d] = qc
            if rc:
                rest[t] = rc
        p = rest
    elif p:
        m0 = next(iter(q))
        c, r = divmod(p.get(m0, 0), q[m0])
        if not r and p == {m: c * v for m, v in q.items()}:
            quot, p = {(): c}, {}
    rem: _Poly = {}
    g = 1
    if p:
        g = math.gcd(*p.values(), *q.values())
        p, q = {m: c // g for m, c in p.items()}, {m: c // g for m, c in q.items()}
        if set(p) == set(q) == {()}:
            rem = {(): v} if (v := _OPS[op](p[()], q[()])) else {}
        else:
            rem = {(BinOp(op, _expr(p), _expr(q)),): 1}
    if op == "//":
        return _add(quot, rem)
    return {m: sign * g * c for m, c in rem.items()}


def _poly(e: DimExpr) -> _Poly:
    match e:
        case Const(value):
            return {(): value} if value else {}
        case Sym():
            return {(e,): 1}
        case BinOp("+", lhs, rhs):
            return _add(_poly(lhs), _poly(rhs))
        case BinOp("-", lhs, rhs):
            return _add(_poly(lhs), _poly(rhs), -1)
        case BinOp("*", lhs, rhs):
            return _mul(_poly(lhs), _poly(rhs))
        case BinOp(op, lhs, rhs):
            return _divmod(op, _poly(lhs), _poly(rhs))
        case Call(fn, args):
            simple = tuple(_expr(_poly(a)) for a in args)
            if all(isinstance(a, Const) for a in simple):
                value = _call(fn, [a.value for a in simple], e)  # type: ignore[attr-defined]
                return {(): value} if value else {}
            return {(Call(fn, simple),): 1}
    raise TypeError(f"not a concrete dimension: {e!r}")


def _expr(p: _Poly) -> DimExpr:
    out: DimExpr | None = None
    for m, c in _terms(p):
        coef = c if out is None else abs(c)  # later terms carry their sign in the + or -
        factors = list(m)
        if coef != 1 or not factors:
            factors.insert(0, Const(coef))
        term = functools.reduce(lambda a, b: BinOp("*", a, b), factors)
        out = term if out is None else BinOp("+" if c > 0 else "-", out, term)
    if out is None:
        return Const(0)
    if _height(out) > _MAX_DEPTH:  # deeper trees would overflow the recursive walks
        raise OverflowError
    return out


def _height(e: DimExpr) -> int:
    best, todo = 0, [(e, 0)]
    while todo:
        e, h = todo.pop()
        best = max(best, h)
        if isinstance(e, BinOp):
            todo += [(e.lhs, h + 1), (e.rhs, h + 1)]
        elif isinstance(e, Call):
            todo += [(a, h + 1) for a in e.args]
    return best


def simplify(e: DimLike) -> DimExpr:
    """A canonical form of ``e`` with the same value wherever ``e`` evaluates without error."""
    e = parse_dim(e)
    try:
        return _expr(_poly(e))
    except OverflowError:
        raise DimError(
            f"cannot simplify {_quote(str(e))}: its normal form has more than {_MAX_TERMS} terms"
            f" or {_MAX_DEPTH} levels",
            expr=str(e),
        ) from None


def dims_equal(a: DimLike, b: DimLike) -> bool:
    """Whether ``a`` and ``b`` are provably equal (sound but incomplete across ``//`` and ``%``)."""
    return simplify(BinOp("-", parse_dim(a), parse_dim(b))) == Const(0)
