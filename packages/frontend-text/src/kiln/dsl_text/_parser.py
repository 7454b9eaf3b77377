"""Text to syntax tree: the Lark grammar (``grammar.lark``), the indentation post-lexer, and E001
diagnostics with the file, line, column and a caret under the offending character."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from importlib import resources

from lark import Lark, Token, Tree
from lark.exceptions import LarkError, UnexpectedCharacters, UnexpectedEOF, UnexpectedInput
from lark.indenter import DedentError, Indenter

from kiln.dsl_text._errors import TextError

__all__ = ["parse"]

#: what an expected terminal looks like in a message
_SHOWN = {
    "_NL": "a line break",
    "_INDENT": "an indented block",
    "_DEDENT": "the end of a block",
    "NAME": "a name",
    "INT": "an integer",
    "FLOAT": "a number",
    "STRING": "a string",
    "ARROW": "'->'",
    "AT": "'@'",
    "COLON": "':'",
    "LPAR": "'('",
    "RPAR": "')'",
    "LSQB": "'['",
    "RSQB": "']'",
    "COMMA": "','",
    "DOCSTRING": "a docstring",
    "KIND": "module, block or model",
}


class _Lines(Indenter):
    """Python-style INDENT/DEDENT (the grammar's ``_NL`` already skips continuation lines)."""

    NL_type = "_NL"
    OPEN_PAREN_types = ("LPAR", "LSQB", "LBRACE")  # type: ignore[assignment]
    CLOSE_PAREN_types = ("RPAR", "RSQB", "RBRACE")  # type: ignore[assignment]
    INDENT_type = "_INDENT"
    DEDENT_type = "_DEDENT"
    tab_len = 8
    last_nl: Token | None = None  # the line break before a bad dedent says where it is

    def handle_NL(self, token: Token) -> Iterator[Token]:
        self.last_nl = token
        yield from super().handle_NL(token)


@functools.cache
def _parser() -> Lark:
    grammar = resources.files("kiln.dsl_text").joinpath("grammar.lark").read_text(encoding="utf-8")
    return Lark(grammar, parser="lalr", postlex=_Lines(), propagate_positions=True, maybe_placeholders=False)


def parse(text: str, path: str = "<text>") -> Tree[Token]:
    """The syntax tree of ``text``; a :class:`TextError` E001 where it does not follow the grammar."""
    if not text.endswith("\n"):
        text += "\n"
    parser = _parser()
    try:
        return parser.parse(text)
    except UnexpectedInput as exc:
        line, column = _position(exc, text)
        raise TextError("E001", _message(exc), path, text, line, column, _hint(exc)) from None
    except DedentError:  # a line indented less than its block but more than the enclosing one
        nl = parser.options.postlex.last_nl  # type: ignore[union-attr]
        line = nl.end_line if nl is not None and nl.end_line is not None else 1
        column = len(str(nl).rsplit("\n", 1)[-1].expandtabs(8)) + 1 if nl is not None else 1
        raise TextError(
            "E001",
            "the indentation of this line matches no enclosing block",
            path,
            text,
            line,
            column,
            "indent it like the lines of the block it belongs to",
        ) from None
    except LarkError as exc:  # anything else the parser rejects is still a syntax error
        raise TextError("E001", f"syntax error: {exc}", path, text, 1, 1) from None


def _position(exc: UnexpectedInput, text: str) -> tuple[int, int]:
    line, column = getattr(exc, "line", -1), getattr(exc, "column", -1)
    token = getattr(exc, "token", None)
    if (isinstance(token, Token) and token.type in ("_DEDENT", "_INDENT", "$END")) or line in (None, -1):
        lines = text.splitlines()
        if isinstance(exc, UnexpectedEOF) or not isinstance(token, Token) or token.line is None:
            line = max(1, len(lines))
            return line, len(lines[line - 1]) + 1 if lines else 1
        line, column = token.line, token.column
    return max(1, int(line)), max(1, int(column))


def _message(exc: UnexpectedInput) -> str:
    if isinstance(exc, UnexpectedCharacters):
        return f"unexpected character {exc.char!r}"
    if isinstance(exc, UnexpectedEOF):
        return "the file ends in the middle of a declaration"
    token = getattr(exc, "token", None)
    if isinstance(token, Token):
        if token.type == "_NL":
            found = "the end of the line"
        elif token.type == "_INDENT":
            found = "an indented line"
        elif token.type == "_DEDENT":
            found = "the end of the block"
        elif token.type == "$END":
            found = "the end of the file"
        else:
            found = repr(str(token))
        return f"unexpected {found}"
    return "syntax error"


def _hint(exc: UnexpectedInput) -> str | None:
    expected = sorted(getattr(exc, "expected", None) or getattr(exc, "allowed", None) or ())
    if not expected:
        return None
    shown = sorted(
        {
            _SHOWN.get(t, repr(t.strip('"').lower()) if t.isupper() else repr(t))
            for t in expected
            if not t.startswith("__")
        }
    )
    if len(shown) > 8:
        shown = [*shown[:8], "..."]
    return "expected " + ", ".join(shown)
