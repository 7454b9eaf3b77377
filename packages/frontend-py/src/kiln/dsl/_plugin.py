"""The ``kiln`` entry point of kiln-dsl: its hook implementations, found by kiln's plugin manager."""

import pluggy

hookimpl = pluggy.HookimplMarker("kiln")
