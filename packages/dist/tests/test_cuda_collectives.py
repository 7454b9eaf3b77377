"""The collective ops' kernels on the ``cuda`` backend, on kiln-kernels-cuda's emulated device (its
memory is host memory whose addresses stand for device pointers): a communicator that takes device
buffers (as ``nccl`` does) gets one flat device buffer per bucket, never a host array, and the
gradients and parameters end as the NumPy reference leaves them; any other communicator runs the
reference on host copies. A stand-in communicator plays this rank and another rank whose buffers
are derived from this rank's, so the sums are known without a second process.

The overlapped ops (``*_start``/``*_wait``) run on a stand-in device with a communication stream
whose collectives wait in a queue until the compute stream waits on an event recorded after them
(as on a GPU, where NCCL runs them asynchronously): a wait that did not make the compute stream wait
would unpack a bucket not yet summed. It counts the bytes copied to and from the host (none: whether
a gradient changed since the start is the host's to know) and the device allocations (none during a
training step: the buckets live in planned arena memory)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.core import KilnError, PluginSession, get_registry
from kiln.dist import launcher
from kiln.dist._cuda import (
    IN_FLIGHT,
    CudaBuffer,
    cuda_bucket_all_gather,
    cuda_bucket_all_reduce,
    cuda_bucket_all_reduce_start,
    cuda_bucket_all_reduce_wait,
    cuda_bucket_reduce_scatter,
    cuda_bucket_reduce_scatter_start,
    cuda_bucket_reduce_scatter_wait,
    cuda_sharded_grad_norm,
)
from kiln.dist._ops import (
    PENDING,
    bucket_all_gather,
    bucket_all_reduce,
    bucket_all_reduce_start,
    bucket_all_reduce_wait,
    bucket_reduce_scatter,
    bucket_reduce_scatter_start,
    bucket_reduce_scatter_wait,
    sharded_grad_norm,
)

pytest.importorskip("kiln.cuda", reason="the cuda backend is kiln-kernels-cuda's")
from kiln.cuda import EmulatedDevice
from kiln.cuda._ops import DeviceArray


def _view(buf: Any) -> np.ndarray:
    """A NumPy view of a host array or of an emulated device buffer (its address is host memory)."""
    if isinstance(buf, np.ndarray):
        return buf
    assert isinstance(buf, CudaBuffer) and buf.__cuda_array_interface__["data"][0] == buf.ptr
    raw = (ctypes.c_char * buf.nbytes).from_address(buf.ptr)
    return np.frombuffer(raw, buf.dtype)


class Streams(EmulatedDevice):
    """The emulator with a communication stream: a collective enqueued there (``stream=COMM``) waits in
    ``queue`` until the compute stream waits on an event recorded after it, or a synchronisation;
    ``to_host``/``to_device`` count the bytes copied between host and device."""

    COMPUTE, COMM = 101, 202

    def __init__(self, cache: Path) -> None:
        super().__init__(cache=cache)
        self.queue: list[Any] = []
        self.ran, self.to_host, self.to_device = 0, 0, 0
        self.marks: dict[int, int] = {}  # event -> the collectives queued before it was recorded on comm
        self.log: list[tuple[Any, ...]] = []  # device copies (dst, src) and the compute stream's waits

    def stream_handle(self, name: str = "compute") -> int:
        return {"compute": self.COMPUTE, "comm": self.COMM}[name]

    def record(self, event: int, stream: str) -> None:
        if stream == "comm":
            self.marks[event] = len(self.queue)
        else:
            super().record(event, stream)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self.log.append(("copy", dst, src))
        super().copy(dst, src, nbytes)

    def waited_before_unpacking(self, arrays: list[DeviceArray]) -> bool:
        """Whether the compute stream waited on a communication-stream event before the first copy
        into one of ``arrays`` (the unpacking)."""
        ptrs = {a.ptr for a in arrays}
        first = next(i for i, e in enumerate(self.log) if e[0] == "copy" and e[1] in ptrs)
        return ("wait", "compute", "comm") in self.log[:first]

    def wait(self, stream: str, event: int) -> None:
        self.log.append(("wait", stream, "comm" if event in self.marks else "compute"))
        if stream == "compute" and event in self.marks:
            self._run(self.marks[event])
        else:  # the communication stream waits for compute work: done already (it runs at once)
            super().wait(stream, event)

    def _run(self, upto: int) -> None:
        while self.ran < upto:
            self.queue[self.ran]()
            self.ran += 1

    def synchronize(self) -> None:
        super().synchronize()
        self._run(len(self.queue))

    def copy_to_host(self, ptr: int, nbytes: int) -> np.ndarray:
        self.to_host += nbytes
        return super().copy_to_host(ptr, nbytes)

    def copy_to_device(self, ptr: int, value: np.ndarray) -> None:
        self.to_device += value.nbytes
        super().copy_to_device(ptr, value)


class Pair:
    """Rank ``rank`` of two; the other rank's buffers are this rank's times 3 (sums) or plus 100
    (gathers). ``got`` records the type of every buffer handed to a collective."""

    name, world_size = "pair", 2
    COMM = Streams.COMM

    def __init__(self, rank: int, device_buffers: bool, device: Any = None) -> None:
        self.rank, self.device_buffers, self.got, self.device = rank, device_buffers, [], device
        self.streams: list[Any] = []  # the stream each device collective was handed

    def _run(self, work: Any, stream: Any) -> None:
        """On the stand-in device's communication stream: queued; else now."""
        self.streams.append(stream)
        if self.device is not None and stream == self.COMM:
            self.device.queue.append(work)
        else:
            work()

    def all_reduce(self, buf: Any, *, stream: Any = None) -> None:
        self.got.append(type(buf))

        def work() -> None:
            v = _view(buf)
            v += 3 * v

        if isinstance(buf, np.ndarray):
            work()
        else:
            self._run(work, stream)

    def reduce_scatter(self, send: Any, recv: Any, *, stream: Any = None) -> None:
        self.got += [type(send), type(recv)]

        def work() -> None:
            s, r = _view(send), _view(recv)
            chunk = r.size
            r[...] = 4 * s[self.rank * chunk:(self.rank + 1) * chunk]

        if isinstance(send, np.ndarray):
            work()
        else:
            self._run(work, stream)

    def all_gather(self, send: Any, recv: Any, *, stream: Any = None) -> None:
        self.got += [type(send), type(recv)]
        s, r = _view(send), _view(recv)
        chunk = s.size
        for q in range(2):
            r[q * chunk:(q + 1) * chunk] = s if q == self.rank else s + 100

    def broadcast(self, buf: Any, root: int = 0) -> None: ...
    def barrier(self) -> None: ...


SHAPES = [(3, 4), (5,), (2, 2, 2)]
OWNERS = (1, 0, 1)


def _tensors(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def _on_device(dev: EmulatedDevice, arrays: list[np.ndarray]) -> list[DeviceArray]:
    return [DeviceArray.upload(dev, a) for a in arrays]


def _read(dev: EmulatedDevice, arrays: list[DeviceArray]) -> list[np.ndarray]:
    return [a.download() for a in arrays]


CASES = [(cuda_bucket_all_reduce, bucket_all_reduce, {}),
         (cuda_bucket_reduce_scatter, bucket_reduce_scatter, {"owners": OWNERS}),
         (cuda_bucket_all_gather, bucket_all_gather, {"owners": OWNERS})]


@pytest.mark.parametrize("device_buffers", [True, False], ids=["device-buffers", "host-copies"])
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize(("kernel", "reference", "attrs"), CASES,
                         ids=["all_reduce", "reduce_scatter", "all_gather"])
def test_bucket_collectives_on_the_cuda_backend_leave_what_the_reference_leaves(
        kernel: Any, reference: Any, attrs: dict[str, Any], rank: int, device_buffers: bool) -> None:
    with PluginSession().activate():
        comm = Pair(rank, device_buffers)
        get_registry("communicators").register("pair", comm)
        host = _tensors(rank)
        expected = [a.copy() for a in host]
        reference(*expected, communicator="pair", **attrs)  # the NumPy reference, on host arrays
        dev = EmulatedDevice()
        arrays = _on_device(dev, host)
        comm.got.clear()
        kernel(*arrays, communicator="pair", step=1, lr=0.0, scale=1.0, **attrs)  # as a Program calls it
        for got, want in zip(_read(dev, arrays), expected, strict=True):
            np.testing.assert_array_equal(got, want)
        assert any(not np.array_equal(g, h) for g, h in zip(expected, host, strict=True))  # it did something
        # one collective per bucket, on device buffers only where the communicator takes them
        assert comm.got and set(comm.got) == ({CudaBuffer} if device_buffers else {np.ndarray})


def test_a_bucket_of_bf16_gradients_goes_through_host_copies() -> None:
    """A dtype a device collective does not take as it is (bfloat16) runs the reference on host
    copies, even where the communicator takes device buffers."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    with PluginSession().activate():
        comm = Pair(0, device_buffers=True)
        get_registry("communicators").register("pair", comm)
        host = [a.astype(ml_dtypes.bfloat16) for a in _tensors(0)]
        arrays = _on_device(EmulatedDevice(), host)
        cuda_bucket_all_reduce(*arrays, communicator="pair")
        got = [a.download() for a in arrays]
        for g, h in zip(got, host, strict=True):
            np.testing.assert_array_equal(g.astype(np.float32), 4 * h.astype(np.float32))
        assert set(comm.got) == {np.ndarray}


def test_the_cuda_backend_runs_these_kernels_for_the_bucket_ops() -> None:
    with PluginSession().activate():
        kernels = get_registry("kernels")
        for op, fn in (("bucket_all_reduce", cuda_bucket_all_reduce),
                       ("bucket_reduce_scatter", cuda_bucket_reduce_scatter),
                       ("bucket_all_gather", cuda_bucket_all_gather)):
            for dtype in ("float32", "bfloat16"):
                found = kernels.find(op, "cuda", dtype)
                assert found is not None and found.fn is fn, (op, dtype)
        for op, fn in (("bucket_all_reduce_start", cuda_bucket_all_reduce_start),
                       ("bucket_all_reduce_wait", cuda_bucket_all_reduce_wait),
                       ("bucket_reduce_scatter_start", cuda_bucket_reduce_scatter_start),
                       ("bucket_reduce_scatter_wait", cuda_bucket_reduce_scatter_wait),
                       ("sharded_grad_norm", cuda_sharded_grad_norm)):
            found = kernels.find(op, "cuda", "float32")
            assert found is not None and found.fn is fn, op


OVERLAPPED = [(cuda_bucket_all_reduce_start, cuda_bucket_all_reduce_wait, bucket_all_reduce_start,
               bucket_all_reduce_wait, {"bucket": 3}),
              (cuda_bucket_reduce_scatter_start, cuda_bucket_reduce_scatter_wait, bucket_reduce_scatter_start,
               bucket_reduce_scatter_wait, {"bucket": 3, "owners": OWNERS})]


@pytest.fixture
def streams(tmp_path_factory: pytest.TempPathFactory) -> Streams:
    return Streams(tmp_path_factory.getbasetemp() / "emulated")


def _buffer_for(start: Any, dev: EmulatedDevice, world: int = 2) -> DeviceArray:
    """The bucket's flat buffer as a Program plans it (``SyncPlan.buffers``): the sizes of SHAPES for an
    all-reduce; every rank's chunk and this rank's receive chunk for a reduce-scatter."""
    sizes = [int(np.prod(s)) for s in SHAPES]
    chunk = max(sum(n for n, o in zip(sizes, OWNERS, strict=True) if o == r) for r in range(world))
    n = sum(sizes) if start is cuda_bucket_all_reduce_start else (world + 1) * chunk
    return _on_device(dev, [np.full(n, np.nan, np.float32)])[0]  # whatever the arena held before


@pytest.mark.parametrize("changed", [False, True], ids=["as-sent", "written-after-the-start"])
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize(("start", "wait", "ref_start", "ref_wait", "attrs"), OVERLAPPED,
                         ids=["all_reduce", "reduce_scatter"])
def test_overlapped_collectives_run_on_the_communication_stream_without_host_copies(
        streams: Streams, start: Any, wait: Any, ref_start: Any, ref_wait: Any, attrs: dict[str, Any],
        rank: int, changed: bool) -> None:
    """The start packs into the bucket's planned buffer on the device and enqueues the collective on
    the communication stream (nothing summed yet, nothing copied to or from the host, nothing
    allocated); the wait makes the compute stream wait, then unpacks: the reference's results. A
    gradient the host wrote between them (an Executable's ``write``: micro-batches' sums) is summed
    again as it is then; whether it was is known on the host: nothing is read back."""
    from kiln.cuda._backend import note_host_write

    with PluginSession().activate():
        comm = Pair(rank, device_buffers=True, device=streams)
        get_registry("communicators").register("pair", comm)
        host = _tensors(rank)
        expected = [a.copy() for a in host]
        ref_start(*expected, communicator="pair", **attrs)
        if changed:
            expected[1] += 1
        ref_wait(*expected, communicator="pair", **attrs)
        arrays = _on_device(streams, host)
        buffer = _buffer_for(start, streams)
        streams.to_host = streams.to_device = streams.allocs = 0
        comm.got.clear()
        start(*arrays, buffer, communicator="pair", step=1, lr=0.0, scale=1.0, buffer=1, **attrs)
        assert (streams.to_host, streams.to_device, streams.allocs) == (0, 0, 0)
        assert comm.streams == [Streams.COMM] and len(streams.queue) == 1 and streams.ran == 0  # in flight
        for got, sent in zip(_read(streams, arrays), host, strict=True):
            np.testing.assert_array_equal(got, sent)  # the gradients untouched while it runs
        if changed:  # as CudaExecutable.write does it
            streams.copy_to_device(arrays[1].ptr, host[1] + 1)
            note_host_write(streams)
        streams.to_host = streams.to_device = 0
        wait(*arrays, buffer, communicator="pair", step=1, lr=0.0, scale=1.0, buffer=1, **attrs)
        assert (streams.to_host, streams.to_device, streams.allocs) == (0, 0, 0)  # nothing read back
        assert streams.ran == len(streams.queue) == 1  # the started collective has run
        assert comm.streams == [Streams.COMM] + [Streams.COMPUTE] * changed  # again, on the compute stream
        assert set(comm.got) == {CudaBuffer}  # the bucket on the device; no flag through the host
        assert streams.waited_before_unpacking(arrays)
        for got, want in zip(_read(streams, arrays), expected, strict=True):
            np.testing.assert_array_equal(got, want)
        assert not IN_FLIGHT and not PENDING


@pytest.mark.parametrize(("start", "wait", "ref_start", "ref_wait", "attrs"), OVERLAPPED,
                         ids=["all_reduce", "reduce_scatter"])
def test_a_wait_that_does_not_make_the_compute_stream_wait_is_caught(
        streams: Streams, monkeypatch: pytest.MonkeyPatch, start: Any, wait: Any, ref_start: Any,
        ref_wait: Any, attrs: dict[str, Any]) -> None:
    """Without the wait's event the compute stream would unpack before the sum is known to have landed
    (here the device synchronisation of the change test still lets it land: the order is what shows)."""
    from kiln.dist import _cuda

    monkeypatch.setattr(_cuda._InFlight, "wait", lambda self: None)
    with PluginSession().activate():
        comm = Pair(0, device_buffers=True, device=streams)
        get_registry("communicators").register("pair", comm)
        host = _tensors(0)
        expected = [a.copy() for a in host]
        ref_start(*expected, communicator="pair", **attrs)
        ref_wait(*expected, communicator="pair", **attrs)
        arrays = _on_device(streams, host)
        streams.log.clear()
        start(*arrays, communicator="pair", **attrs)
        wait(*arrays, communicator="pair", **attrs)
        assert not streams.waited_before_unpacking(arrays)


def test_micro_batches_wait_for_the_bucket_in_flight_before_starting_it_again(streams: Streams) -> None:
    with PluginSession().activate():
        comm = Pair(0, device_buffers=True, device=streams)
        get_registry("communicators").register("pair", comm)
        host = _tensors(0)
        expected = [a.copy() for a in host]
        for _ in range(2):
            bucket_all_reduce_start(*expected, communicator="pair", bucket=0)
        bucket_all_reduce_wait(*expected, communicator="pair", bucket=0)
        arrays = _on_device(streams, host)
        for _ in range(2):  # the second backward's start: the first's sum waited for and let go
            cuda_bucket_all_reduce_start(*arrays, communicator="pair", bucket=0)
        assert streams.ran == 1 and len(streams.queue) == 2 and len(IN_FLIGHT) == 1
        cuda_bucket_all_reduce_wait(*arrays, communicator="pair", bucket=0)
        for got, want in zip(_read(streams, arrays), expected, strict=True):
            np.testing.assert_array_equal(got, want)
        with pytest.raises(KilnError, match="bucket_all_reduce_wait of bucket 0 over 'pair': no "
                                            "bucket_all_reduce_start of that bucket is in flight"):
            cuda_bucket_all_reduce_wait(*arrays, communicator="pair", bucket=0)


@pytest.mark.parametrize("over", [None, "pair"], ids=["one-axis", "grid"])
def test_sharded_grad_norm_sums_the_squares_on_the_device(streams: Streams, over: str | None) -> None:
    """One scalar collective on the compute stream, the norm written on the device, nothing read back;
    the reference's norm (float32 sums in another order)."""
    with PluginSession().activate():
        comm = Pair(0, device_buffers=True, device=streams)
        get_registry("communicators").register("pair", comm)
        host = _tensors(0)
        want = np.zeros((), np.float32)
        sharded_grad_norm(want, *host, communicator="pair", over=over)
        norm = _on_device(streams, [np.zeros((), np.float32)])[0]
        arrays = _on_device(streams, host)
        streams.to_host = streams.to_device = 0
        comm.got.clear()
        cuda_sharded_grad_norm(norm, *arrays, communicator="pair", over=over, step=1, lr=0.0, scale=1.0)
        assert (streams.to_host, streams.to_device) == (0, 0)
        assert comm.got == [CudaBuffer] * (1 + (over is not None)) and set(comm.streams) == {Streams.COMPUTE}
        got = _read(streams, [norm])[0]
        np.testing.assert_allclose(got, want, rtol=1e-6)
        assert want > 0


def test_the_dry_run_that_sizes_temporaries_runs_no_collective(streams: Streams) -> None:
    """The backend's dry run (a device named ``sizing``) sees the flat buffers a plain bucket op packs
    into (its step's workspace is sized by them), and no collective runs."""
    from kiln.cuda._backend import _SizingDevice

    n = sum(int(np.prod(s)) for s in SHAPES)
    chunk = 12 + 8  # rank 1's part (OWNERS), the larger: every rank's is padded to it
    with PluginSession().activate():
        comm = Pair(0, device_buffers=True, device=streams)
        get_registry("communicators").register("pair", comm)
        sizing = _SizingDevice(streams)
        arrays = [DeviceArray(sizing, 0, s, "float32") for s in SHAPES]
        for fn, attrs, least in ((cuda_bucket_all_reduce, {}, 4 * n),
                                 (cuda_bucket_reduce_scatter, {"owners": OWNERS}, 4 * 3 * chunk),
                                 (cuda_bucket_all_gather, {"owners": OWNERS}, 4 * 3 * chunk),
                                 (cuda_bucket_all_reduce_start, {"bucket": 0}, 0),
                                 (cuda_bucket_reduce_scatter_wait, {"bucket": 0, "owners": OWNERS}, 0)):
            sizing.high = sizing.live = 0
            fn(*arrays, communicator="pair", **attrs)
            assert sizing.high >= least and sizing.live == 0, fn.__name__  # given back at the end
        cuda_sharded_grad_norm(*arrays, communicator="pair")
        assert comm.got == [] and not IN_FLIGHT


class Mirror(Pair):
    """:class:`Pair` whose other rank's gathered part is this rank's part as it is (values of the
    parameters' scale, where Pair's ``+ 100`` would make a training step ill-conditioned)."""

    def all_gather(self, send: Any, recv: Any, *, stream: Any = None) -> None:
        self.got += [type(send), type(recv)]
        s, r = _view(send), _view(recv)
        r[...] = np.tile(s, 2)


@pytest.mark.parametrize(("zero", "overlap", "micro"),
                         [(0, True, 1), (1, True, 2)], ids=["overlap", "zero1-overlap-micro-batches"])
def test_data_parallel_on_emulated_cuda_over_a_device_communicator_equals_numpy(zero: int, overlap: bool,
                                                                                micro: int) -> None:
    """The collectives as a Program runs them on the ``cuda`` backend (the starts in the backward, the
    waits and the norm in grad_sync, the all-gathers after the update, the backend's dry run first):
    a tiny Qwen3 as rank 0 of the stand-in pair trains as on the NumPy backend over the same pair
    (float32 kernels of the CUDA backend: to 1e-5)."""
    dsl = pytest.importorskip("kiln.dsl", reason="the Qwen3 model comes from kiln-dsl")
    from kiln.core import Model
    from kiln.cuda import EmulatedCuda
    from kiln.dist import DataParallel, _plugin
    from kiln.dsl.stdlib.models import Qwen3Model

    bundle = dsl.build_bundle(Qwen3Model, {"vocab_size": 64, "d_model": 32, "n_layers": 1,
                                           "num_query_heads": 4, "num_kv_heads": 2, "head_size": 8,
                                           "d_ff": 64, "max_seq": 16})
    ids = np.random.default_rng(0).integers(0, 64, (4, 9))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    runs = []
    for backend, device_buffers in (("numpy", False), ("cuda", True)):
        session = PluginSession(autoload=False)
        session.register(_plugin, "kiln-dist")
        session.register(EmulatedCuda(), "cuda-emulated")
        with session.activate():
            comm = Mirror(0, device_buffers)
            get_registry("communicators").register("pair", comm)
            dp = DataParallel("pair", zero=zero, overlap=overlap, bucket_bytes=16 * 1024)
            model = Model.from_ir(bundle, seed=0, backend=backend, data_parallel=dp,
                                  optimizer={"name": "adamw", "lr": 1e-3, "max_grad_norm": 0.5})
            stats = [model.train_step(batch, micro_batches=micro) for _ in range(2)]
            runs.append((stats, model.parameters(), set(comm.got)))
            assert not IN_FLIGHT and not PENDING
    (want, ref, _), (got, params, buffers) = runs
    assert buffers == {CudaBuffer, np.ndarray}  # buckets on the device; the step's loss on the host
    for a, b in zip(got, want, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    for k, v in ref.items():
        assert np.linalg.norm(params[k] - v) <= 1e-5 * np.linalg.norm(v), k


BIND = """
import os, sys
from kiln.dist import bind_gpu
from mpi4py import MPI
chosen = bind_gpu()
with open(os.path.join(sys.argv[1], f"rank{MPI.COMM_WORLD.Get_rank()}"), "w") as f:
    f.write(chosen + " " + os.environ["CUDA_VISIBLE_DEVICES"])
"""


@pytest.mark.parametrize(("visible", "expected"),
                         [(None, ["0", "1"]), ("5,7", ["5", "7"]), ("3", ["3", "3"])])
def test_bind_gpu_gives_each_rank_of_a_node_its_own_gpu(tmp_path: Path, visible: str | None,
                                                        expected: list[str]) -> None:
    """Two ranks on this node: each sees one GPU, the one of its node-local rank (of the list Slurm
    gives, where it gives one); no GPU is needed to check it."""
    script = tmp_path / "bind.py"
    script.write_text(BIND)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    done = subprocess.run([launcher(), "-n", "2", sys.executable, str(script), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == [f"{e} {e}" for e in expected]


def _flat_bytes(program: Any, step: Any, world: int = 2) -> int:
    """The bytes a bucket op packs its tensors into: the tensors' for an all-reduce; every rank's chunk
    (each rank's part padded to the largest) and one chunk more (to receive, or to send) otherwise."""
    keys = step.inputs[:-1] if step.attrs.get("buffer") else step.inputs
    sizes = [int(np.prod(program.tensors[k].shape)) for k in keys]
    if "owners" not in step.attrs:
        return 4 * sum(sizes)
    part = [0] * world
    for n, r in zip(sizes, step.attrs["owners"], strict=True):
        part[r] += n
    return 4 * (world + 1) * max(part)


OVERLAPPED_ZERO1 = {"bucket_reduce_scatter_start", "bucket_reduce_scatter_wait", "bucket_all_gather"}


@pytest.mark.parametrize(("zero", "overlap", "ops"),
                         [(0, False, {"bucket_all_reduce"}), (1, True, OVERLAPPED_ZERO1)],
                         ids=["plain", "zero1-overlap"])
def test_the_arena_plans_the_buckets_and_a_training_step_allocates_nothing(zero: int, overlap: bool,
                                                                           ops: set[str]) -> None:
    """On the ``cuda`` backend over a communicator of device buffers: each plain bucket collective's
    flat buffers lie in its step's planned workspace, each overlapped bucket in a ``buffer`` slot of the
    arena live through the Program (a collective in flight outlives its step), both within the planned
    peak; a training step then allocates no device memory."""
    dsl = pytest.importorskip("kiln.dsl", reason="the Qwen3 model comes from kiln-dsl")
    from kiln.core import Model
    from kiln.cuda import EmulatedCuda
    from kiln.dist import DataParallel, _plugin
    from kiln.dsl.stdlib.models import Qwen3Model

    bundle = dsl.build_bundle(Qwen3Model, {"vocab_size": 64, "d_model": 32, "n_layers": 1,
                                           "num_query_heads": 4, "num_kv_heads": 2, "head_size": 8,
                                           "d_ff": 64, "max_seq": 16})
    ids = np.random.default_rng(0).integers(0, 64, (4, 9))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    session = PluginSession(autoload=False)
    session.register(_plugin, "kiln-dist")
    device = EmulatedDevice()  # counts its allocations
    session.register(EmulatedCuda(device), "cuda-emulated")
    with session.activate():
        get_registry("communicators").register("pair", Mirror(0, device_buffers=True))
        dp = DataParallel("pair", zero=zero, overlap=overlap, bucket_bytes=16 * 1024)
        model = Model.from_ir(bundle, seed=0, backend="cuda", data_parallel=dp,
                              optimizer={"name": "adamw", "lr": 1e-3, "max_grad_norm": 0.5})
        model.train_step(batch)  # compiles the Program and allocates its arena
        program = model.program(2, 8)  # this rank's half of the batch
        slots = {sl.name: sl for sl in program.slots}
        buckets = [st for st in program.steps if st.op.type.startswith("bucket_")]
        assert {st.op.type for st in buckets} == ops
        for st in buckets:
            if st.attrs.get("buffer"):  # overlapped: the bucket's buffer, the op's last input
                buffer = slots[st.inputs[-1]]
                assert buffer.kind == "buffer" and (buffer.first, buffer.last) == (0, len(program.steps) - 1)
                assert buffer.nbytes >= _flat_bytes(program, st), st.op.type
            else:
                assert slots[f"workspace.{st.index}"].nbytes >= _flat_bytes(program, st), st.op.type
        assert overlap == any(sl.kind == "buffer" for sl in program.slots)
        for st in buckets:  # no step between a start and its wait writes the bucket's gradients: only
            if st.op.type.endswith("_start"):  # the host can (the wait's reason to sum again)
                wait = next(w for w in buckets if w.op.type.endswith("_wait")
                            and w.attrs["bucket"] == st.attrs["bucket"])
                grads = set(st.inputs[:-1])
                for between in program.steps[st.index + 1:wait.index]:
                    written = between.inputs if between.how == "optimizer" else between.outputs  # in place
                    assert not grads & set(written), (st.attrs["bucket"], between.op.type)
        assert max(sl.offset + sl.nbytes for sl in program.slots) <= program.arena_bytes <= model.arena_bytes
        device.allocs = 0
        model.train_step(batch)
        assert device.allocs == 0
