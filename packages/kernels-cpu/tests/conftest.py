"""Kernel tables with and without kiln-kernels-cpu, each from a plugin session of its own."""

from __future__ import annotations

from typing import Any

import pytest

from kiln.core import PluginSession, get_registry
from kiln.cpu import _plugin, available, unavailable_reason


def native_session() -> PluginSession:
    session = PluginSession(autoload=False)
    session.register(_plugin, "cpu")
    return session


@pytest.fixture(scope="session")
def tables() -> dict[str, Any]:
    """``{"native": ..., "numpy": ...}``: the kernel table with this package's kernels, and core's alone."""
    if not available():
        pytest.fail(f"the native kernels did not build here: {unavailable_reason()}")
    out = {}
    for name, session in (("native", native_session()), ("numpy", PluginSession(autoload=False))):
        with session.activate():
            out[name] = get_registry("kernels")
    return out
