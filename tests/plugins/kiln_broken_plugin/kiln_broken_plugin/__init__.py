"""kiln-broken-plugin: fails on import, to test that kiln names the distribution at fault."""

raise ImportError("kiln_broken_plugin is broken on purpose")
