"""The plugin layer: hookspecs, registries of named contributions and the plugin session.

It sits under every other layer and imports none of them: layers declare their registry kinds
(:func:`declare_kind`) and core's own hook implementations are loaded by module name.
"""

from kiln.core.plugins._hookspecs import hookimpl, hookspec
from kiln.core.plugins._registry import NamedRegistry, PluginInfo, declare_kind
from kiln.core.plugins._session import (
    AUTOLOAD_ENV,
    PluginSession,
    failed_plugins,
    get_registry,
    list_plugins,
    plugin_manager,
    plugin_session,
    register_plugin,
    reset_plugins,
)

__all__ = [
    "AUTOLOAD_ENV",
    "NamedRegistry",
    "PluginInfo",
    "PluginSession",
    "declare_kind",
    "failed_plugins",
    "get_registry",
    "hookimpl",
    "hookspec",
    "list_plugins",
    "plugin_manager",
    "plugin_session",
    "register_plugin",
    "reset_plugins",
]
