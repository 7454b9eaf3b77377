"""Makes the annotation tests' shared model in ``_annotated.py`` importable as ``kiln_dsl_annotated``
(tests run with importlib mode)."""

import importlib.util
import sys
from pathlib import Path

if "kiln_dsl_annotated" not in sys.modules:
    _path = Path(__file__).with_name("_annotated.py")
    _spec = importlib.util.spec_from_file_location("kiln_dsl_annotated", _path)
    assert _spec is not None and _spec.loader is not None
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kiln_dsl_annotated"] = _module
    _spec.loader.exec_module(_module)
