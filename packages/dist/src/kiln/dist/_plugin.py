"""The ``kiln`` entry point of kiln-dist: its hook implementations, found by kiln's plugin manager."""

import pluggy

hookimpl = pluggy.HookimplMarker("kiln")
