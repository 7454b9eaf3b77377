"""The ``kiln`` entry point of kiln-hf: its hook implementations, found by kiln's plugin manager."""

import pluggy

hookimpl = pluggy.HookimplMarker("kiln")
