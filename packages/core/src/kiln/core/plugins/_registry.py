"""Registries of named contributions that remember which plugin supplied each entry."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import Any, Generic, TypeVar

import attrs

from kiln.core._errors import KilnError, PluginError

__all__ = ["KINDS", "NamedRegistry", "PluginInfo", "RegistryKind", "declare_kind"]

T = TypeVar("T")


@attrs.frozen
class PluginInfo:
    """A plugin. ``distribution`` and ``version`` are None for one registered at run time;
    ``error`` says why a plugin that failed was skipped (None for a loaded one)."""

    name: str
    distribution: str | None
    version: str | None
    module: str
    error: str | None = None

    @property
    def status(self) -> str:
        """``"ok"``, or ``"failed: <why>"`` for a plugin that was skipped."""
        return "ok" if self.error is None else f"failed: {self.error}"

    def describe(self) -> str:
        where = f"{self.distribution} {self.version}" if self.distribution else "registered at run time"
        return f"plugin {self.name!r} ({where})"


# Set by the plugin session while one plugin's hook runs, so that entries it registers are
# attributed to it without the plugin having to say who it is.
CONTRIBUTOR: ContextVar[PluginInfo | None] = ContextVar("kiln_contributor", default=None)

RUNTIME = "<runtime>"


def _describe(owner: PluginInfo | str) -> str:
    return owner.describe() if isinstance(owner, PluginInfo) else f"plugin {owner!r} (registered at run time)"


class NamedRegistry(Generic[T]):
    """Named entries of one kind (``"backends"``, ``"graph_passes"``, ...) with their owners.

    ``providers`` maps names that are known to come from an optional distribution to that
    distribution, so that asking for a missing one says what to install. Subclasses keep this
    constructor signature (``get_registry`` builds every registry as ``cls(kind, providers=...)``).
    """

    def __init__(self, kind: str, *, providers: Mapping[str, str] | None = None) -> None:
        self.kind = kind
        self.providers = dict(providers or {})
        self._entries: dict[str, tuple[T, PluginInfo | str]] = {}

    def register(self, name: str, obj: T, *, plugin: str | None = None) -> None:
        """Add ``obj`` under ``name``; the owner is ``plugin``, else the contributing plugin."""
        if not isinstance(name, str) or not name:
            raise KilnError(f"{self.kind} names must be non-empty strings, got {name!r}")
        owner: PluginInfo | str = plugin or CONTRIBUTOR.get() or RUNTIME
        if name in self._entries:
            first = self._entries[name][1]
            raise PluginError(
                f"{name!r} is registered twice in the {self.kind} registry: "
                f"by {_describe(first)} and by {_describe(owner)}",
                plugin=owner.name if isinstance(owner, PluginInfo) else owner,
                distribution=owner.distribution if isinstance(owner, PluginInfo) else None,
                hint="uninstall one of the two distributions, or rename the entry in one of them",
            )
        self._entries[name] = (obj, owner)

    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name][0]
        except KeyError:
            pass
        known = ", ".join(sorted(self._entries)) or "none"
        dist = self.providers.get(name)
        raise KilnError(
            f"unknown name {name!r} in the {self.kind} registry; registered: {known}",
            hint=f"{name!r} is provided by {dist}: pip install {dist}" if dist else None,
        )

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> list[str]:
        """Registered names, in registration order."""
        return list(self._entries)

    def owner(self, name: str) -> PluginInfo | str:
        """The plugin that registered ``name`` (a plain name for run-time registrations)."""
        self[name]  # raises the helpful error for unknown names
        return self._entries[name][1]

    def items(self) -> list[tuple[str, T]]:
        return [(name, obj) for name, (obj, _) in self._entries.items()]

    def remove_owner(self, owner: PluginInfo | str) -> list[str]:
        """Remove every entry ``owner`` registered (a plugin that failed); returns their names."""
        gone = [name for name, (_, who) in self._entries.items() if who == owner]
        for name in gone:
            del self._entries[name]
        return gone

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.kind}: {', '.join(self._entries) or 'empty'}>"


@attrs.frozen
class RegistryKind:
    """A kind of registry: its contribution hook and the registry class the hook fills."""

    kind: str
    hook: str
    registry_cls: type[NamedRegistry[Any]]
    providers: Mapping[str, str] = attrs.field(factory=dict)


#: Every declared kind. The layer that owns a registry class declares its kind, so the plugin
#: manager builds registries without importing any layer.
KINDS: dict[str, RegistryKind] = {}


def declare_kind(kind: str, hook_name: str, registry_cls: type[NamedRegistry[Any]] = NamedRegistry,
                 providers: Mapping[str, str] | None = None) -> None:
    """Declare that registries of ``kind`` are ``registry_cls(kind, providers=...)`` objects filled
    through the historic hook ``hook_name``; ``providers`` maps names known to come from an optional
    distribution to it. Declaring a kind again (a module reload) replaces it, with the same hook."""
    known = KINDS.get(kind)
    if known is not None and known.hook != hook_name:
        raise KilnError(f"registry kind {kind!r} is already declared with hook {known.hook!r}, "
                        f"not {hook_name!r}")
    KINDS[kind] = RegistryKind(kind, hook_name, registry_cls, dict(providers or {}))
