"""Test-wide settings: the auto recompute planner prices by FLOPs in tests, so the plans they check do
not depend on this machine's kernel timings (tests of the measured cost model ask for it by the option
``cost="measured"`` or a Calibration), and kernel calibrations are cached in a temporary folder, not in
the user's ``~/.cache``."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("KILN_RECOMPUTE_COST", "flops")
if "KILN_CALIBRATION_CACHE" not in os.environ:
    os.environ["KILN_CALIBRATION_CACHE"] = _cache = tempfile.mkdtemp(prefix="kiln-calibration-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
