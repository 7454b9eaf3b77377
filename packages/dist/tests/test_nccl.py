"""The ``nccl`` communicator on GPUs (``nox -s gpu`` runs these; they skip, saying why, elsewhere):
an all-reduce of device buffers on one GPU and across every GPU of the machine (a rank per GPU), and
data parallelism over ``nccl`` on the ``cuda`` backend (plain, overlapped, ZeRO-1 and both) equal to
one process on one and on two GPUs; data x tensor parallelism on the ``nccl`` grid equal to one
process."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.dist import launch, nccl_available

pytestmark = pytest.mark.gpu
HERE = Path(__file__).parent
ENV = {"KILN_NUM_THREADS": "1"}


def gpus() -> int:
    """The GPUs nvidia-smi lists (0 without it)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    done = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60, check=False)
    return sum(line.startswith("GPU ") for line in done.stdout.splitlines()) if done.returncode == 0 else 0


def need(ranks: int) -> None:
    """Skip, saying why, unless nccl4py, CuPy (the tests' device buffers) and ``ranks`` GPUs are here."""
    if not nccl_available():
        pytest.skip("nccl4py is not installed (pip install 'kiln-dist[nccl]' on a machine with GPUs)")
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("CuPy is not installed: the tests make their device buffers with it")
    found = gpus()
    if found < ranks:
        pytest.skip(f"needs {ranks} CUDA GPU(s), found {found}")


@pytest.mark.parametrize("ranks", ["one", "all"], ids=["1-gpu", "every-gpu"])
def test_nccl_all_reduce_of_device_buffers(tmp_path: Path, ranks: str) -> None:
    need(1 if ranks == "one" else 2)
    n = 1 if ranks == "one" else gpus()
    assert launch(n, [str(HERE / "_nccl.py"), str(tmp_path)], env=ENV) == 0
    for r in range(n):
        got = np.load(tmp_path / f"rank{r}.npz")
        assert got["world"] == n and got["device"] == r  # one GPU per rank, the rank's own
        np.testing.assert_array_equal(got["summed"], np.arange(8) * sum(range(1, n + 1)))


def _worker() -> Any:
    spec = importlib.util.spec_from_file_location("kiln_dist_worker_gpu", HERE / "_worker.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("zero", ["0", "overlap", "1", "overlap1"],
                         ids=["plain", "overlap", "zero1", "zero1-overlap"])
@pytest.mark.parametrize("ranks", [1, 2], ids=["1-gpu", "2-gpus"])
def test_data_parallel_over_nccl_on_the_cuda_backend_equals_one_process(tmp_path: Path, ranks: int,
                                                                         zero: str) -> None:
    """Every bucket collective on device buffers (the overlapped ones on the communication stream,
    ZeRO-1's norm a device scalar), the result one process's."""
    need(ranks)
    cuda = pytest.importorskip("kiln.cuda", reason="the cuda backend is kiln-kernels-cuda's")
    if cuda.unavailable_reason() is not None:
        pytest.skip(f"the cuda backend cannot run here: {cuda.unavailable_reason()}")
    worker = _worker()
    n = ranks  # the global batch of 8 shared by the ranks, one GPU each
    model, stats = worker.train(None, backend="cuda")
    assert launch(n, [str(HERE / "_worker.py"), str(tmp_path), "nccl", zero, "1", "cuda"], env=ENV) == 0
    for r in range(n):
        rank = np.load(tmp_path / f"rank{r}.npz")
        np.testing.assert_allclose(rank["stats"], stats, rtol=1e-5)  # float32 sums in another order
        for k, v in model.parameters().items():
            assert np.linalg.norm(rank[f"param:{k}"] - v) <= 1e-4 * np.linalg.norm(v), k


def test_data_by_tensor_parallel_over_the_nccl_grid_equals_one_process(tmp_path: Path) -> None:
    """``grid(2, communicator="nccl")`` on the ``cuda`` backend, a GPU per rank: 2 x 2 on four GPUs, 1 x 2
    on two (two ranks of one NCCL communicator may not share a GPU); a tiny Qwen3-MoE trains as one
    process on the whole batch (float32 sums in another order: losses to 1e-4)."""
    need(2)
    cuda = pytest.importorskip("kiln.cuda", reason="the cuda backend is kiln-kernels-cuda's")
    if cuda.unavailable_reason() is not None:
        pytest.skip(f"the cuda backend cannot run here: {cuda.unavailable_reason()}")
    spec = importlib.util.spec_from_file_location("kiln_dist_tp_worker_gpu", HERE / "_tp_worker.py")
    assert spec is not None and spec.loader is not None
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    n = 4 if gpus() >= 4 else 2
    full, stats = worker.train(None, "Qwen3MoEModel", backend="cuda")
    assert launch(n, [str(HERE / "_tp_worker.py"), str(tmp_path), "Qwen3MoEModel", "grid", "2", "cuda"],
                  env=ENV) == 0
    for r in range(n):
        rank = np.load(tmp_path / f"rank{r}.npz")
        np.testing.assert_allclose(rank["stats"], stats, rtol=1e-4)
        for k, v in full.parameters().items():  # gathered from the slices: the whole model's
            got = rank[f"whole:param:{k}"]
            assert np.linalg.norm(got - v) <= 1e-3 * np.linalg.norm(v), k


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-rs"]))
