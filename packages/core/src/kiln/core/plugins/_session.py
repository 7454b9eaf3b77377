"""The plugin manager: core's own hooks, entry-point plugins and run-time plugins, one mechanism.

All plugin state lives in a :class:`PluginSession`; the functions below act on the current one.
The manager imports no layer of the core: core's own hook implementations are loaded by module
name (``CORE_PLUGINS``) and registry kinds are declared by the layers that own them
(:func:`kiln.core.plugins._registry.declare_kind`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import os
import types
import warnings
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import attrs
import pluggy

from kiln.core._errors import KilnError, KilnWarning, PluginError
from kiln.core.plugins import _hookspecs
from kiln.core.plugins._registry import CONTRIBUTOR, KINDS, NamedRegistry, PluginInfo, declare_kind

__all__ = [
    "PluginSession",
    "failed_plugins",
    "get_registry",
    "list_plugins",
    "plugin_manager",
    "plugin_session",
    "register_plugin",
    "reset_plugins",
]

AUTOLOAD_ENV = "KILN_DISABLE_PLUGIN_AUTOLOAD"

#: Modules holding kiln-core's own hook implementations, one per layer that contributes, imported by
#: name as pytest loads its builtin plugins; together they are the plugin ``core``.
CORE_PLUGINS = ("kiln.core.ops._hooks", "kiln.core.plan._hooks", "kiln.core.backends.numpy._hooks",
                "kiln.core.cli._hooks")

declare_kind("backends", "kiln_register_backends", providers={"cuda": "kiln-kernels-cuda"})
declare_kind("graph_passes", "kiln_register_graph_passes")
declare_kind("weight_formats", "kiln_register_weight_formats")
declare_kind("adapters", "kiln_register_adapters")
declare_kind("communicators", "kiln_register_communicators")
declare_kind("model_sources", "kiln_register_model_sources")


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        return None


def _core_plugin() -> types.SimpleNamespace:
    """kiln-core's hook implementations from every module of ``CORE_PLUGINS``, as one plugin."""
    impls: dict[str, Any] = {}
    for module in map(importlib.import_module, CORE_PLUGINS):
        for name, fn in vars(module).items():
            if name.startswith("kiln_") and callable(fn):
                if name in impls:
                    raise KilnError(f"kiln-core implements {name} twice: in {impls[name].__module__} "
                                    f"and {module.__name__}")
                impls[name] = fn
    return types.SimpleNamespace(__name__="kiln.core", **impls)


def _unrecorded(name: str, obj: object) -> PluginInfo:
    return PluginInfo(name, None, None, getattr(obj, "__name__", type(obj).__qualname__))


def _explain(exc: BaseException) -> str:
    text = exc.message if isinstance(exc, KilnError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())  # one line, for warnings and the `kiln plugins` table


class PluginSession:
    """Everything kiln knows about plugins: the pluggy manager, each plugin's :class:`PluginInfo`,
    the plugins that failed and the registries built so far.

    Plugins are loaded on first use: core's own (``CORE_PLUGINS``), then the entry points of the
    group ``kiln`` unless ``autoload`` is False (None: unless ``KILN_DISABLE_PLUGIN_AUTOLOAD`` is
    set). A plugin that fails is skipped with a :class:`KilnWarning` (see :meth:`failed`).
    """

    def __init__(self, *, autoload: bool | None = None) -> None:
        self.manager = pluggy.PluginManager("kiln")
        self.manager.add_hookspecs(_hookspecs)
        self._autoload = autoload
        self._loaded = False
        self._infos: dict[str, PluginInfo] = {}
        self._objects: dict[str, object] = {}
        self._failed: list[PluginInfo] = []
        self._registries: dict[str, NamedRegistry[Any]] = {}
        self._core: set[str] = set()
        self._registering: str | None = None  # the plugin inside ``manager.register`` now
        self._pending: tuple[str, Exception] | None = None  # its failure, applied once that returns
        self._answers: dict[str, tuple[object, PluginInfo]] = {}

    @property
    def hook(self) -> pluggy.HookRelay:
        """``session.hook.<name>(...)`` calls a non-historic hook (wrappers included)."""
        self._load()
        return self.manager.hook

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True  # first, so that a plugin using kiln while it is imported finds this session
        self._core.add("core")
        info = PluginInfo("core", "kiln-core", _dist_version("kiln-core"), "kiln.core")
        self._add(_core_plugin(), info, strict=True)
        autoload = not env_flag(AUTOLOAD_ENV) if self._autoload is None else self._autoload
        if autoload:
            self._load_entry_points()

    def _load_entry_points(self) -> None:
        for ep in sorted(importlib.metadata.entry_points(group="kiln"), key=lambda ep: ep.name):
            dist, version = (ep.dist.name, ep.dist.version) if ep.dist else ("<unknown distribution>", "?")
            info = PluginInfo(ep.name, dist, version, ep.value)
            try:
                obj = ep.load()
            except Exception as exc:
                self._drop(info, f"import error: {_explain(exc)}", exc)
                continue
            self._add(obj, info, strict=False)

    # --- what a session holds -------------------------------------------------------------------

    def plugins(self) -> list[PluginInfo]:
        """Every loaded plugin, in registration order (core first)."""
        self._load()
        # A plugin registered straight through ``manager.register`` has no recorded info.
        return [self._infos.get(name) or _unrecorded(name, obj)
                for name, obj in self.manager.list_name_plugin() if obj is not None]

    def failed(self) -> list[PluginInfo]:
        """Every plugin that failed and was skipped, with the reason in ``PluginInfo.error``."""
        self._load()
        return list(self._failed)

    def registry(self, kind: str) -> NamedRegistry[Any]:
        """The registry of one declared kind, built through its historic hook on first use.

        It is reachable while it is being built (a plugin's hook may ask for it again), and every
        plugin registered later is called for it too.
        """
        self._load()
        if kind in self._registries:
            return self._registries[kind]
        if kind not in KINDS:
            raise KilnError(f"unknown registry kind {kind!r}; known: {', '.join(sorted(KINDS))}")
        decl = KINDS[kind]
        hook = getattr(self.manager.hook, decl.hook, None)
        if hook is None or not hook.is_historic():
            raise KilnError(f"registry kind {kind!r} is filled through {decl.hook!r}, which is not a "
                            "historic kiln hook")
        registry = self._registries[kind] = decl.registry_cls(kind, providers=decl.providers)
        token = _ACTIVE.set(self)
        try:
            hook.call_historic(kwargs={"registry": registry})
        finally:
            _ACTIVE.reset(token)
        return registry

    def answered_by(self, hook_name: str, result: object) -> PluginInfo | None:
        """The plugin whose implementation of ``hook_name`` returned ``result`` (None when none
        did: a hook wrapper made it)."""
        answer = self._answers.get(hook_name)
        return answer[1] if answer is not None and answer[0] is result else None

    # --- registering ----------------------------------------------------------------------------

    def register(self, module_or_obj: object, name: str) -> PluginInfo:
        """Register a plugin at run time (embedding applications, tests).

        It is called for every registry already built; if that fails, or the name is taken, or a
        hook is invalid, nothing of it stays and :class:`PluginError` is raised.
        """
        self._load()
        module = getattr(module_or_obj, "__name__", None) or type(module_or_obj).__module__
        info = PluginInfo(name, None, None, module)
        self._add(module_or_obj, info, strict=True)
        return info

    def _add(self, obj: object, info: PluginInfo, *, strict: bool) -> None:
        """Register ``obj``'s hook implementations under ``info.name``, each wrapped by :meth:`_guard`.

        If the name is taken, a hook is invalid or a historic call replayed to it fails, nothing of
        it stays: with ``strict`` a :class:`PluginError` is raised, else it is dropped with a warning.
        """
        failure = self._register(obj, info)
        if failure is not None:
            if strict:
                raise self._error(info, *failure)
            self._drop(info, *failure)

    def _register(self, obj: object, info: PluginInfo) -> tuple[str, BaseException | None] | None:
        other = self._infos.get(info.name)
        if other is not None or self.manager.has_plugin(info.name):
            return f"name taken by {other.describe() if other else 'another plugin'}", None
        if any(o is obj for o in self._objects.values()):
            return "already registered under another name", None
        self._registering, self._pending = info.name, None
        try:
            self.manager.register(self._proxy(obj, info), name=info.name)
        except pluggy.PluginValidationError as exc:
            self._remove(info)  # pluggy >= 1.7 validates before registering, older ones midway
            return f"declares an invalid hook: {' '.join(str(exc).split())}", exc
        finally:
            self._registering = None
        self._infos[info.name] = info
        self._objects[info.name] = obj
        pending, self._pending = self._pending, None
        if pending is not None:  # a historic call replayed to it failed
            self._remove(info)
        return pending

    def _proxy(self, obj: object, info: PluginInfo) -> object:
        """What pluggy registers for ``obj``: its hook implementations, guarded by :meth:`_guard`.

        The implementations of hooks that are not firstresult are marked ``trylast`` so that pluggy
        calls them in registration order (it inserts each new ``trylast`` one at the front of the
        list it calls last to first): core first, and a name two plugins claim stays with the first.
        """
        proxy = _Proxy()
        for attr in dir(obj):
            opts = self.manager.parse_hookimpl_opts(obj, attr)
            if opts is None:
                continue
            fn = getattr(obj, attr)
            hook_name = opts.get("specname") or attr
            hook = getattr(self.manager.hook, hook_name, None)
            if hook is None or hook.spec is None:
                if not opts.get("optionalhook"):
                    raise pluggy.PluginValidationError(obj, f"unknown hook {hook_name!r}")
                continue
            if opts.get("wrapper") or opts.get("hookwrapper"):
                setattr(proxy, attr, fn)  # a wrapper's exceptions are its way to change the result
                continue
            guarded = self._guard(info, hook_name, fn)
            ordered = not hook.spec.opts.get("firstresult")
            guarded.kiln_impl = {**opts, "tryfirst": False, "trylast": True} if ordered else dict(opts)  # type: ignore[attr-defined]
            setattr(proxy, attr, guarded)
        return proxy

    def _guard(self, info: PluginInfo, hook_name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` run with ``info`` as the contributor of what it registers; an exception from it
        drops the plugin (core's own propagate: they are bugs in kiln)."""

        @functools.wraps(fn)
        def guarded(*args: Any) -> Any:
            registering = info.name == self._registering
            if not (info.name in self._infos or (registering and self._pending is None)):
                return None  # dropped earlier in this same hook call
            contributor, active = CONTRIBUTOR.set(info), _ACTIVE.set(self)
            try:
                result = fn(*args)
            except Exception as exc:
                if info.name in self._core:
                    raise
                failure = f"error in {hook_name}: {_explain(exc)}", exc
                if registering:
                    self._pending = failure  # dropped once manager.register returns
                else:
                    self._remove(info)
                    self._drop(info, *failure)
                return None
            finally:
                CONTRIBUTOR.reset(contributor)
                _ACTIVE.reset(active)
            if result is not None:
                self._answers[hook_name] = (result, info)
            return result

        return guarded

    # --- failures -------------------------------------------------------------------------------

    def _error(self, info: PluginInfo, reason: str, cause: BaseException | None = None) -> PluginError:
        dist = info.distribution
        hints = []
        if reason.startswith("declares"):
            hints.append("hook implementations must be named after a kiln hookspec and take only its "
                         "parameters, see docs/hookspecs.md")
        if dist is not None:
            hints.append(f"fix it or pip uninstall {dist}, or set {AUTOLOAD_ENV}=1 to load no plugins")
        error = PluginError(f"{info.describe()}: {reason}", plugin=info.name, distribution=dist,
                            hint="; ".join(hints) or None)
        error.__cause__ = cause
        return error

    def _remove(self, info: PluginInfo) -> None:
        """Unregister ``info`` and take every entry it registered out of every registry."""
        if self.manager.has_plugin(info.name):
            self.manager.unregister(name=info.name)
        self._infos.pop(info.name, None)
        self._objects.pop(info.name, None)
        for registry in self._registries.values():
            registry.remove_owner(info)

    def _drop(self, info: PluginInfo, reason: str, cause: BaseException | None = None) -> None:
        """Record a plugin that failed and was skipped, and warn about it."""
        self._failed.append(attrs.evolve(info, error=reason))
        error = self._error(info, reason, cause)
        hint = f"; {error.hint}" if error.hint else ""
        warnings.warn(f"{error.message}. kiln goes on without it{hint}", KilnWarning, stacklevel=2)

    @contextlib.contextmanager
    def activate(self) -> Iterator[PluginSession]:
        """Make this the current session inside a ``with`` block: ``get_registry``, ``compile``,
        ``Model`` and every other kiln function use it there (an embedding application or a test
        keeps its plugins apart from the process-wide session)."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def __repr__(self) -> str:
        names = ", ".join(self._infos) if self._loaded else "not loaded yet"
        return f"<PluginSession: {names}>"


class _Proxy:
    """The object pluggy sees for one plugin: its guarded hook implementations as attributes."""


_current: PluginSession | None = None
# The session whose hook is running: a hook that uses kiln's module-level functions gets it.
_ACTIVE: ContextVar[PluginSession | None] = ContextVar("kiln_plugin_session", default=None)


def plugin_session() -> PluginSession:
    """The current plugin session (the one whose hook is running, else the process-wide one)."""
    global _current
    active = _ACTIVE.get()
    if active is not None:
        return active
    if _current is None:
        _current = PluginSession()
    return _current


def plugin_manager() -> pluggy.PluginManager:
    """The pluggy manager of the current session (plugins loaded on first use)."""
    session = plugin_session()
    session._load()
    return session.manager


def list_plugins() -> list[PluginInfo]:
    """Every loaded plugin, in registration order (core first)."""
    return plugin_session().plugins()


def failed_plugins() -> list[PluginInfo]:
    """Every plugin that failed and was skipped, each with its reason in ``error``."""
    return plugin_session().failed()


def register_plugin(module_or_obj: object, name: str) -> PluginInfo:
    """Register a plugin at run time; see :meth:`PluginSession.register`."""
    return plugin_session().register(module_or_obj, name)


def get_registry(kind: str) -> NamedRegistry[Any]:
    """The registry of one contribution kind, built through its hook on first use."""
    return plugin_session().registry(kind)


def reset_plugins() -> None:
    """Forget the current session; the next use starts a fresh one (and loads plugins again)."""
    global _current
    _current = None
