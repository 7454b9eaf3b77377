"""Diagnostics of the text syntax: a ``KilnError`` with the seed's code, ``file:line:column`` and the
source line with a caret under the culprit."""

from __future__ import annotations

from kiln.core import Diagnostic
from kiln.dsl import DSLError

__all__ = ["TextError", "excerpt"]


def excerpt(text: str, line: int, column: int) -> str:
    """The source line ``line`` (1-based) and a caret under ``column`` (1-based)."""
    lines = text.splitlines()
    if not 1 <= line <= len(lines):
        return ""
    src = lines[line - 1].expandtabs(8)
    column = max(1, min(column, len(src) + 1))
    return f"    {src}\n    {' ' * (column - 1)}^"


class TextError(DSLError):
    """A text-DSL file that cannot be compiled: ``path``, ``line`` and ``column`` say where."""

    def __init__(
        self, code: str, message: str, path: str, text: str, line: int, column: int, hint: str | None = None
    ) -> None:
        self.path, self.line, self.column = path, line, column
        self.excerpt = excerpt(text, line, column)
        location = f"{path}:{line}:{column}"
        super().__init__(
            message,
            code=code,
            hint=hint,
            location=location,
            diagnostics=[Diagnostic(code, message, hint, location)],
        )

    def _render(self) -> str:
        text = f"[{self.code}] {self.message}\n  at: {self.location}"
        if self.excerpt:
            text += "\n" + self.excerpt
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text
