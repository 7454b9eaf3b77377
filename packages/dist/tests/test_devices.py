"""Each rank's GPU: a parallel Model on the ``cuda`` backend (named without an index) runs on the GPU of
its node-local rank, counted among the GPUs the process sees (one left visible by ``bind_gpu`` is every
rank's GPU 0); an explicit ``cuda:N`` wins; a backend with one device is never asked. Without a GPU the
driver's device count is monkeypatched and the device is the CPU emulator, noting its ordinal; with two
GPUs (``nox -s gpu``) two ranks train data parallel on their own GPU without ``bind_gpu``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.core import Model, PluginSession, get_registry
from kiln.core.plugins import hookimpl
from kiln.dist import (
    DataParallel,
    NcclCommunicator,
    PlanRank,
    TensorParallel,
    _communicators,
    _plugin,
    launch,
)

cuda = pytest.importorskip("kiln.cuda", reason="the cuda backend is kiln-kernels-cuda's")
from kiln.cuda import CudaBackend, EmulatedDevice, _device  # noqa: E402

CONFIG = {"vocab_size": 64, "d_model": 32, "n_layers": 1, "num_query_heads": 4, "num_kv_heads": 2,
          "head_size": 8, "d_ff": 64, "max_seq": 16}


@pytest.fixture(scope="module")
def bundle() -> Any:
    dsl = pytest.importorskip("kiln.dsl", reason="the Qwen3 model comes from kiln-dsl")
    from kiln.dsl.stdlib.models import Qwen3Model

    return dsl.build_bundle(Qwen3Model, CONFIG)


class Rank(PlanRank):
    """Rank ``rank`` of 2, the ``local``-th on its node; counts the times its node-local rank is asked."""

    def __init__(self, rank: int, local: int) -> None:
        super().__init__("ranks", rank, 2)
        object.__setattr__(self, "asked", [])
        object.__setattr__(self, "local", local)

    @property
    def local_rank(self) -> int:
        self.asked.append(1)
        return int(self.local)


class Gpus:
    """``cuda`` as registered on a machine with GPUs (its device opened on first use)."""

    @hookimpl
    def kiln_register_backends(self, registry: Any) -> None:
        registry.register("cuda", CudaBackend())


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """``gpus(n)``: a driver that sees ``n`` GPUs, each device opened being the emulator; returns the
    ordinals opened."""
    opened: list[int] = []

    class StandIn(EmulatedDevice):
        def __init__(self, ordinal: int = 0) -> None:
            super().__init__(cache=tmp_path)
            self.ordinal = ordinal
            opened.append(ordinal)

    monkeypatch.setattr(_device, "CudaDevice", StandIn)

    def see(n: int) -> list[int]:
        monkeypatch.setattr(_device, "device_count", lambda: n)
        return opened

    return see


def _session() -> PluginSession:
    session = PluginSession(autoload=False)
    session.register(_plugin, "kiln-dist")
    session.register(Gpus(), "gpus")
    return session


@pytest.mark.parametrize(("local", "count", "expected"), [(1, 2, 1), (0, 2, 0), (3, 2, 1), (1, 1, 0)],
                         ids=["rank1-2gpus", "rank0-2gpus", "rank3-2gpus", "one-visible-gpu"])
@pytest.mark.parametrize("parallel", ["data", "tensor"])
def test_a_parallel_model_on_cuda_takes_its_node_local_gpu(bundle: Any, gpus: Any, parallel: str, local: int,
                                                           count: int, expected: int) -> None:
    opened = gpus(count)
    comm = Rank(local % 2, local)
    with _session().activate():
        get_registry("communicators").register("ranks", comm)
        how = DataParallel("ranks") if parallel == "data" else TensorParallel("ranks")
        model = Model.from_ir(bundle, init=None, backend="cuda", parallel=how)
        assert model.backend.ordinal == expected and comm.asked
        model.parameters()  # the device opens on first use
        assert opened == [expected]


def test_an_explicit_index_or_a_backend_without_devices_is_left_as_it_is(bundle: Any, gpus: Any) -> None:
    opened = gpus(2)
    comm = Rank(1, 1)
    with _session().activate():
        get_registry("communicators").register("ranks", comm)
        assert Model.from_ir(bundle, init=None, backend="cuda:0",
                             parallel=DataParallel("ranks")).backend.ordinal == 0
        assert Model.from_ir(bundle, init=None, parallel=DataParallel("ranks")).backend.name == "numpy"
        assert comm.asked == [] and opened == [0]
        # a planning stand-in has no node: the backend's default device
        get_registry("communicators").register("plan", PlanRank("plan", 1, 2))
        assert Model.from_ir(bundle, init=None, backend="cuda",
                             parallel=DataParallel("plan")).backend.ordinal == 0


def test_the_node_local_rank_is_the_launchers(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        monkeypatch.delenv("MPI_LOCALRANKID", raising=False)
        monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_RANK", raising=False)
        monkeypatch.setenv(name, "3")
        _communicators.node_rank.cache_clear()
        try:
            assert _communicators.node_rank() == 3
        finally:
            _communicators.node_rank.cache_clear()


def test_nccl_runs_on_the_gpu_a_parallel_model_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    from cuda.bindings import driver

    monkeypatch.setattr(driver, "cuInit", lambda flags: 0)
    monkeypatch.setattr(driver, "cuDeviceGetCount", lambda: (0, 2))
    mpi = _communicators.MpiCommunicator()
    monkeypatch.setattr(type(mpi), "local_rank", property(lambda self: 3))
    comm = NcclCommunicator(mpi)
    assert comm.local_rank == 3 and comm.device == 1  # the 4th rank of a node with 2 GPUs: GPU 1
    backend = CudaBackend()
    monkeypatch.setattr(_device, "device_count", lambda: 2)
    assert _communicators.rank_device(comm, backend) == comm.device  # the Model's GPU, the same


BIND = """
import os, sys
import numpy as np
from mpi4py import MPI
from kiln.core import Model
from kiln.dist import DataParallel
from kiln.dsl import build_bundle
from kiln.dsl.stdlib.models import Qwen3Model
cfg = {"vocab_size": 64, "d_model": 32, "n_layers": 1, "num_query_heads": 4, "num_kv_heads": 2,
       "head_size": 8, "d_ff": 64, "max_seq": 16}
model = Model.from_ir(build_bundle(Qwen3Model, cfg), seed=0, backend="cuda",
                      parallel=DataParallel(sys.argv[2]))
ids = np.random.default_rng(0).integers(0, 64, (4, 9))
loss = model.train_step({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})["loss"]
gpu = model.backend.gpu
d = gpu.driver
attr = d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
where = d.cuPointerGetAttribute(attr, model._arena.ptr)[1]
rank = MPI.COMM_WORLD.Get_rank()
np.savez(os.path.join(sys.argv[1], f"rank{rank}.npz"), ordinal=gpu.ordinal, arena=int(where), loss=loss)
"""


@pytest.mark.gpu
@pytest.mark.parametrize("comm", ["mpi", "nccl"])
def test_two_ranks_train_on_their_own_gpus_without_bind_gpu(tmp_path: Path, comm: str) -> None:
    if cuda.unavailable_reason() is not None or _device.device_count() < 2:
        pytest.skip(f"needs two CUDA GPUs: {cuda.unavailable_reason() or f'found {_device.device_count()}'}")
    if comm == "nccl" and not _communicators.nccl_available():
        pytest.skip("nccl4py is not installed (pip install 'kiln-dist[nccl]')")
    script = tmp_path / "rank.py"
    script.write_text(BIND)
    assert launch(2, [str(script), str(tmp_path), comm], env={"KILN_NUM_THREADS": "1"}) == 0
    got = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    assert [int(g["ordinal"]) for g in got] == [0, 1] and [int(g["arena"]) for g in got] == [0, 1]
    assert float(got[0]["loss"]) == float(got[1]["loss"])  # the global batch's loss, on every rank
