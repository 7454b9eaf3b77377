"""The kiln error hierarchy.

Every error a user can cause is a :class:`KilnError`. An error names the thing at fault (file,
tensor, op, plugin) as an attribute and in its message, and says what was expected.
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = [
    "AutodiffError",
    "Diagnostic",
    "DimError",
    "IRError",
    "KilnError",
    "KilnWarning",
    "OpError",
    "PluginError",
]


@attrs.frozen
class Diagnostic:
    """One compiler message: a code from the catalogue (E001-E027, W001-W005), text and place.

    ``location`` is free text such as ``"model.py:42"`` or ``"graph 'block', op #3 (matmul)"``.
    """

    code: str
    message: str
    hint: str | None = None
    location: str | None = None

    @property
    def is_error(self) -> bool:
        return self.code.startswith("E")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.hint:
            out["hint"] = self.hint
        if self.location:
            out["location"] = self.location
        return out

    def __str__(self) -> str:
        text = f"[{self.code}] {self.message}"
        if self.location:
            text += f"\n  at: {self.location}"
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


class KilnError(Exception):
    """Root of every error kiln raises on bad input.

    ``diagnostics`` holds the structured messages; the first one gives ``code``, ``hint`` and
    ``location``. Subclasses keep the culprit (op, tensor, plugin, file) as attributes.
    """

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        hint: str | None = None,
        location: str | None = None,
        diagnostics: tuple[Diagnostic, ...] | list[Diagnostic] = (),
    ) -> None:
        diags = tuple(diagnostics)
        if not diags and code is not None:
            diags = (Diagnostic(code, message, hint, location),)
        self.message = message
        self.diagnostics: tuple[Diagnostic, ...] = diags
        self.code = code if code is not None else (diags[0].code if diags else None)
        self.hint = hint if hint is not None else (diags[0].hint if diags else None)
        self.location = location if location is not None else (diags[0].location if diags else None)
        super().__init__(self._render())

    def _render(self) -> str:
        if len(self.diagnostics) > 1 or (self.diagnostics and self.diagnostics[0].message != self.message):
            return self.message + "\n" + "\n".join(str(d) for d in self.diagnostics)
        text = f"[{self.code}] {self.message}" if self.code else self.message
        if self.location:
            text += f"\n  at: {self.location}"
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


class IRError(KilnError):
    """Malformed IR: bad JSON, a failed ``verify()``, an unknown IR version."""


class DimError(KilnError):
    """A symbolic dimension that cannot be parsed or evaluated (names the expression)."""

    def __init__(self, message: str, *, expr: str | None = None, **kw: Any) -> None:
        self.expr = expr
        super().__init__(message, **kw)


class OpError(KilnError):
    """An op that is unknown, registered twice, or called with bad inputs or attributes."""

    def __init__(self, message: str, *, op: str | None = None, **kw: Any) -> None:
        self.op = op
        super().__init__(message, **kw)


class AutodiffError(KilnError):
    """Backward derivation or an explicit backward graph failed (E005, E006, E018-E020)."""

    def __init__(self, message: str, *, tensor: str | None = None, op: str | None = None, **kw: Any) -> None:
        self.tensor = tensor
        self.op = op
        super().__init__(message, **kw)


class PluginError(KilnError):
    """A plugin failed to load, declared a bad hook, or contributed a name another plugin owns."""

    def __init__(self, message: str, *, plugin: str | None = None, distribution: str | None = None,
                 **kw: Any) -> None:
        self.plugin = plugin
        self.distribution = distribution
        super().__init__(message, **kw)


class KilnWarning(UserWarning):
    """Something kiln went on without, such as a plugin that failed and was skipped."""
