"""kiln-badhook-plugin: declares a misspelled hook, to test that kiln rejects it by distribution."""

import pluggy

hookimpl = pluggy.HookimplMarker("kiln")


@hookimpl
def kiln_register_opz(registry):  # misspelled on purpose: no hookspec has this name
    pass
