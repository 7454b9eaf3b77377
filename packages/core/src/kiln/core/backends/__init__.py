"""Backends that ship with kiln-core: ``numpy``, the embedded reference. Others live in their own
distributions (``kiln-kernels-cuda``) and register through ``kiln_register_backends``."""
