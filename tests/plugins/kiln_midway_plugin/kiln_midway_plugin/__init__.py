"""kiln-midway-plugin: its hook registers one graph pass and then raises, to test that kiln removes
what the plugin had registered and goes on without it."""

import pluggy

hookimpl = pluggy.HookimplMarker("kiln")


def midway_identity(graph):
    return graph


@hookimpl
def kiln_register_graph_passes(registry):
    registry.register("midway_identity", midway_identity)
    raise RuntimeError("kiln_midway_plugin fails midway on purpose")
