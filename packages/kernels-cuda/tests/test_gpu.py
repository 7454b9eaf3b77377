"""On a GPU (``nox -s gpu``): every kernel against the NumPy reference on the device, and whole-model
training on ``cuda`` against ``numpy``. Skipped, with the reason, where there is no GPU."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.cuda import _device
from kiln.cuda._check import CASES, run_case

ok, why = _device.device_status()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ok, reason=f"needs a CUDA GPU: {why}")]


@pytest.fixture(scope="module")
def gpu():
    return _device.CudaDevice()


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
def test_kernel_on_device_matches_numpy_reference(gpu, case) -> None:
    assert run_case(case, gpu) <= case.atol


def test_qwen3_training_on_cuda_equals_numpy() -> None:
    from kiln.core import Model

    build_bundle = pytest.importorskip("kiln.dsl").build_bundle
    from kiln.dsl.stdlib.models import Qwen3Model

    bundle = build_bundle(Qwen3Model, {"vocab_size": 128, "d_model": 64, "n_layers": 2, "num_query_heads": 4,
                                       "num_kv_heads": 2, "head_size": 16, "d_ff": 128, "max_seq": 32})
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 128, (4, 17))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    models = [Model.from_ir(bundle, seed=0, backend=b) for b in ("numpy", "cuda")]
    for _ in range(20):
        ref, got = (m.train_step(batch) for m in models)
        assert got["loss"] == pytest.approx(ref["loss"], abs=1e-4)
    want, have = models[0].parameters(), models[1].parameters()
    assert max(float(np.abs(want[k] - have[k]).max()) for k in want) < 1e-4
