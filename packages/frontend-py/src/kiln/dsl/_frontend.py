"""What another frontend (the text syntax, a converter from another format) needs from kiln-dsl to
build its declarations as kiln-dsl classes: find registered classes by name, and define classes whose
names are already registered without replacing them (docs/dsl.md, "API for other frontends")."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kiln.dsl._decorators import _DEFINED, _REGISTRY, _ensure_stdlib

__all__ = ["local_definitions", "lookup_component"]

_COMPONENT_KINDS = ("model", "block", "module")


def lookup_component(name: str, kind: str | None = None) -> type | None:
    """The class registered as ``name`` (a ``"model"``, ``"block"`` or ``"module"``; with ``kind=None``
    models first, then blocks, then modules), or None when no such class is registered.

    Unlike ``registry.get_block`` it returns the decorated class itself (what ``g.call`` and
    ``Array[n, Block]`` take), not its spec, and it does not raise: the frontend reports the unknown
    name in its own terms. The standard library is loaded first.
    """
    if kind is not None and kind not in _COMPONENT_KINDS:
        from kiln.dsl._errors import error

        raise error("E003", f"lookup_component: kind must be one of {_COMPONENT_KINDS}, found {kind!r}")
    _ensure_stdlib()
    for k in (kind,) if kind is not None else _COMPONENT_KINDS:
        found = _REGISTRY[k].get(name)
        if found is not None:
            return found  # type: ignore[no-any-return]
    return None


@contextmanager
def local_definitions(*names: str) -> Iterator[None]:
    """Classes decorated with ``@module``/``@block``/``@model`` inside the ``with`` block under one of
    ``names`` stay out of the global registry: on exit every name resolves to what it resolved to
    before (or to nothing), and lookups by name do not find the new classes. The classes themselves
    are fully decorated and compile as usual.

    A frontend uses it so that a file defining its own ``RMSNorm`` does not replace the standard
    library's for everyone else::

        with local_definitions("RMSNorm"):
            MyRMSNorm = module(type("RMSNorm", (), namespace))
    """
    _ensure_stdlib()  # a lazy stdlib import inside the block would otherwise be undone on exit
    before = {n: {k: _REGISTRY[k].get(n) for k in _REGISTRY} for n in names}
    defined = {n: list(_DEFINED.get(n, ())) for n in names}
    try:
        yield
    finally:
        for n, olds in before.items():
            for k, old in olds.items():
                if old is None:
                    _REGISTRY[k].pop(n, None)
                else:
                    _REGISTRY[k][n] = old
            if defined[n]:
                _DEFINED[n] = defined[n]
            else:
                _DEFINED.pop(n, None)
