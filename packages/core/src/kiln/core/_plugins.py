"""The plugin manager: core's own hooks, entry-point plugins and run-time plugins, one mechanism."""

from __future__ import annotations

import importlib.metadata
import os
from typing import Any, TypeVar

import pluggy

from kiln.core import _hookspecs
from kiln.core._errors import KilnError, PluginError
from kiln.core._ops import OpRegistry
from kiln.core._registry import CONTRIBUTOR, NamedRegistry, PluginInfo

__all__ = [
    "contribute",
    "get_registry",
    "list_plugins",
    "plugin_manager",
    "register_plugin",
    "reset_plugins",
]

R = TypeVar("R", bound=NamedRegistry[Any])

AUTOLOAD_ENV = "KILN_DISABLE_PLUGIN_AUTOLOAD"

# kind -> (contribution hook, registry class). One line per kind.
REGISTRY_KINDS: dict[str, tuple[str, type[NamedRegistry[Any]]]] = {
    "ops": ("kiln_register_ops", OpRegistry),
    "backends": ("kiln_register_backends", NamedRegistry),
    "graph_passes": ("kiln_register_graph_passes", NamedRegistry),
    "weight_formats": ("kiln_register_weight_formats", NamedRegistry),
    "adapters": ("kiln_register_adapters", NamedRegistry),
    "communicators": ("kiln_register_communicators", NamedRegistry),
}
# Names a kind is known to get from an optional distribution, for "pip install ..." hints.
PROVIDERS: dict[str, dict[str, str]] = {
    "backends": {"cuda": "kiln-kernels-cuda"},
}

_pm: pluggy.PluginManager | None = None
_infos: dict[str, PluginInfo] = {}
_registries: dict[str, NamedRegistry[Any]] = {}


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        return None


def _add(pm: pluggy.PluginManager, obj: object, info: PluginInfo) -> None:
    """Register and validate one plugin; on failure leave the manager as it was."""
    try:
        pm.register(obj, name=info.name)
        pm.check_pending()
    except ValueError as exc:  # the name or the object is already registered
        other = _infos.get(info.name)
        taken = f"the name is taken by {other.describe()}" if other else "it is already registered"
        raise PluginError(
            f"cannot register {info.describe()}: {taken}", plugin=info.name, distribution=info.distribution
        ) from exc
    except pluggy.PluginValidationError as exc:
        if pm.is_registered(obj):  # pluggy >= 1.7 validates before registering, older after
            pm.unregister(obj)
        raise PluginError(
            f"{info.describe()} declares an invalid hook: {exc}",
            plugin=info.name,
            distribution=info.distribution,
            hint="hook implementations must be named after a kiln hookspec and take only its "
            "parameters; see docs/hookspecs.md",
        ) from exc
    _infos[info.name] = info


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    for ep in sorted(importlib.metadata.entry_points(group="kiln"), key=lambda ep: ep.name):
        dist = ep.dist.name if ep.dist else "<unknown distribution>"
        version = ep.dist.version if ep.dist else "?"
        try:
            obj = ep.load()
        except Exception as exc:
            raise PluginError(
                f"plugin {ep.name!r} ({ep.value}) from {dist} {version} failed to import: "
                f"{type(exc).__name__}: {exc}",
                plugin=ep.name,
                distribution=dist,
                hint=f"fix or uninstall {dist} (pip uninstall {dist}), "
                f"or set {AUTOLOAD_ENV}=1 to skip plugin loading",
            ) from exc
        _add(pm, obj, PluginInfo(ep.name, dist, version, ep.value))


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, created (and plugins loaded) on first use."""
    global _pm
    if _pm is None:
        from kiln.core import _builtin

        pm = pluggy.PluginManager("kiln")
        pm.add_hookspecs(_hookspecs)
        _infos.clear()
        _add(pm, _builtin, PluginInfo("core", "kiln-core", _dist_version("kiln-core"), _builtin.__name__))
        if not env_flag(AUTOLOAD_ENV):
            _load_entry_points(pm)
        _pm = pm
    return _pm


def list_plugins() -> list[PluginInfo]:
    """Every registered plugin, in registration order (core first)."""
    pm = plugin_manager()
    return [_info(name, obj) for name, obj in pm.list_name_plugin()]


def _info(name: str, obj: object) -> PluginInfo:
    # A plugin registered straight through ``plugin_manager().register`` has no recorded info.
    return _infos.get(name) or PluginInfo(name, None, None, getattr(obj, "__name__", type(obj).__qualname__))


def register_plugin(module_or_obj: object, name: str) -> PluginInfo:
    """Register a plugin at run time (for embedding applications and tests).

    Registries that were already built receive the new plugin's contributions right away.
    """
    pm = plugin_manager()
    module = getattr(module_or_obj, "__name__", None) or type(module_or_obj).__module__
    info = PluginInfo(name, None, None, module)
    _add(pm, module_or_obj, info)
    for kind, registry in _registries.items():
        _contribute(REGISTRY_KINDS[kind][0], registry, None, only=name)
    return info


def reset_plugins() -> None:
    """Forget the plugin manager and every cached registry; the next use reloads plugins."""
    global _pm
    _pm = None
    _infos.clear()
    _registries.clear()


def contribute(hook_name: str, registry: R, *, arg: object = None) -> R:
    """Call each implementation of a contribution hook in turn and return ``registry``.

    The hook's one parameter receives ``arg`` if given, else ``registry``. Entries registered
    while a plugin's implementation runs are attributed to that plugin. An exception from inside
    a plugin becomes a :class:`PluginError` naming its distribution; a ``KilnError`` (such as a
    duplicate name) passes through unchanged.
    """
    return _contribute(hook_name, registry, arg)


def _contribute(hook_name: str, registry: R, arg: object, *, only: str | None = None) -> R:
    hook = getattr(plugin_manager().hook, hook_name, None)
    if hook is None or hook.spec is None or len(hook.spec.argnames) != 1:
        raise KilnError(f"{hook_name!r} is not a kiln contribution hook")
    kwargs = {hook.spec.argnames[0]: registry if arg is None else arg}
    for impl in hook.get_hookimpls():
        if impl.hookwrapper or impl.wrapper or (only is not None and impl.plugin_name != only):
            continue
        info = _info(impl.plugin_name, impl.plugin)
        token = CONTRIBUTOR.set(info)
        try:
            impl.function(*[kwargs[a] for a in impl.argnames])
        except KilnError:
            raise
        except Exception as exc:
            dist = info.distribution
            raise PluginError(
                f"{info.describe()} failed in {hook_name}: {type(exc).__name__}: {exc}",
                plugin=info.name,
                distribution=dist,
                hint=f"report this to the authors of {dist}, uninstall it, or set {AUTOLOAD_ENV}=1"
                if dist
                else None,
            ) from exc
        finally:
            CONTRIBUTOR.reset(token)
    return registry


def get_registry(kind: str) -> NamedRegistry[Any]:
    """The registry of one contribution kind, built through its hook on first use."""
    if kind not in _registries:
        if kind not in REGISTRY_KINDS:
            raise KilnError(f"unknown registry kind {kind!r}; known: {', '.join(sorted(REGISTRY_KINDS))}")
        hook_name, cls = REGISTRY_KINDS[kind]
        _registries[kind] = contribute(hook_name, cls(kind, providers=PROVIDERS.get(kind)))
    return _registries[kind]
