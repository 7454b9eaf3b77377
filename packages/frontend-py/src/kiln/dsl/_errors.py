"""DSL diagnostics: :class:`DSLError` and the helpers that point a message at the user's source line."""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import weakref
from collections.abc import Callable
from typing import Any

from kiln.core import Diagnostic, KilnError

__all__ = ["DSLError", "Diagnostic", "class_location", "function_location", "user_location"]

_HERE = os.path.dirname(os.path.abspath(__file__))


class DSLError(KilnError):
    """A model definition that cannot be compiled; ``diagnostics`` lists every error found."""


def _internal(filename: str) -> bool:
    """Frames of the DSL implementation itself (``kiln/dsl/_*.py``), never of the standard library."""
    path = os.path.abspath(filename)
    return os.path.dirname(path) == _HERE and os.path.basename(path).startswith("_")


def user_frame() -> Any:
    """The innermost frame outside the DSL implementation (the user's call), or None."""
    frame = sys._getframe(1)
    while frame is not None and _internal(frame.f_code.co_filename):
        frame = frame.f_back  # type: ignore[assignment]
    return frame


def user_location() -> str | None:
    """``file:line`` of the user's call."""
    frame = user_frame()
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else None


def traceback_location(exc: BaseException) -> str | None:
    """``file:line`` of the innermost user frame of a traceback."""
    tb, best = exc.__traceback__, None
    while tb is not None:
        if (
            not _internal(tb.tb_frame.f_code.co_filename)
            and "kiln/core" not in tb.tb_frame.f_code.co_filename
        ):
            best = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return best


_SOURCES: weakref.WeakKeyDictionary[Any, tuple[str, list[str], int] | None] = weakref.WeakKeyDictionary()


def _source(obj: Any) -> tuple[str, list[str], int] | None:
    try:  # finding a class's source parses its whole module: once per class, not once per compile
        return _SOURCES[obj]
    except (KeyError, TypeError):
        pass
    try:
        lines, start = inspect.getsourcelines(obj)
        found: tuple[str, list[str], int] | None = (inspect.getsourcefile(obj) or "?", lines, start)
    except (OSError, TypeError):
        found = None
    with contextlib.suppress(TypeError):  # not weakly referenceable: not cached
        _SOURCES[obj] = found
    return found


def class_location(cls: type, needle: str | None = None) -> str | None:
    """``file:line`` of a class statement (or of the first line of its body containing ``needle``)."""
    src = _source(cls)
    if src is None:
        return None
    path, lines, start = src
    line = start
    for i, text in enumerate(lines):
        if text.lstrip().startswith("class "):
            line = start + i
            break
    if needle is not None:
        for i, text in enumerate(lines):
            if needle in text:
                return f"{path}:{start + i}"
    return f"{path}:{line}"


def function_location(fn: Callable[..., Any]) -> str | None:
    """``file:line`` of a function's ``def`` line (after its decorators), or the location another
    frontend gave the function it generated (``forward(fn, location=...)``)."""
    fn = inspect.unwrap(fn)
    given = getattr(fn, "__kiln_location__", None)
    if isinstance(given, str):
        return given
    src = _source(fn)
    if src is None:
        return None
    path, lines, start = src
    for i, text in enumerate(lines):
        if text.lstrip().startswith(("def ", "async def ")):
            return f"{path}:{start + i}"
    return f"{path}:{start}"


def error(code: str, message: str, hint: str | None = None, location: str | None = None) -> DSLError:
    return DSLError(message, code=code, hint=hint, location=location)


def diag(code: str, message: str, hint: str | None = None, location: str | None = None) -> Diagnostic:
    return Diagnostic(code, message, hint, location)
