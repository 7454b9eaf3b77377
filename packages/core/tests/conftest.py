"""Makes the test helpers in ``_tiny.py`` importable as ``kiln_core_tiny`` (tests run with importlib mode);
``fresh_plugins`` gives a test its own plugin session."""

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.core import PluginSession, plugin_session, reset_plugins

if "kiln_core_tiny" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("kiln_core_tiny", Path(__file__).with_name("_tiny.py"))
    assert _spec is not None and _spec.loader is not None
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kiln_core_tiny"] = _module
    _spec.loader.exec_module(_module)


@pytest.fixture
def fresh_plugins() -> Iterator[PluginSession]:
    """A fresh current plugin session for the test, and another one after it."""
    reset_plugins()
    yield plugin_session()
    reset_plugins()
