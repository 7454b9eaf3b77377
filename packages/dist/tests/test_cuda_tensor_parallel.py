"""Tensor parallelism's ops on the ``cuda`` backend, on kiln-kernels-cuda's emulated device (its memory is
host memory whose addresses stand for device pointers). Two ranks run as two threads of this process,
each with its own emulated device, over a communicator that takes device buffers (as ``nccl`` does):
every kernel leaves what the op's NumPy reference leaves when the same two ranks run it on host arrays,
its collectives get device buffers only, and nothing is copied to or from the host: not even the token
ids and targets, which kiln.cuda's ``vocab_local_ids`` maps into the rank's rows on the device (an id
outside the vocabulary raised after the next synchronisation). A communicator of host arrays
(``mpi``) keeps the host path. Under 2 MPI ranks with the stand-in nccl (``standin/``), a tiny Qwen3
trains tensor parallel on emulated cuda as one process does (``test_nccl_grid.py``)."""

from __future__ import annotations

import contextvars
import ctypes
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kiln.core import OpError, PluginSession, get_registry
from kiln.dist import _cuda
from kiln.dist._cuda import (
    CUDA_TP_KERNELS,
    CudaBuffer,
    cuda_tp_all_reduce,
    cuda_tp_copy,
    cuda_vocab_parallel_embedding,
    cuda_vocab_parallel_embedding_backward,
    cuda_vocab_parallel_lm_head_loss,
    cuda_vocab_parallel_lm_head_loss_backward,
    cuda_vocab_parallel_logits,
)
from kiln.dist._tensor import _tp_all_reduce
from kiln.dist._vocab import _embedding, _embedding_backward, _gathered_logits, _local, _loss, _loss_backward

pytest.importorskip("kiln.cuda", reason="the cuda backend is kiln-kernels-cuda's")
from kiln.cuda import DeviceArray, EmulatedDevice, check_id_errors


def _view(buf: Any) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1)
    assert isinstance(buf, CudaBuffer)
    return np.frombuffer((ctypes.c_char * buf.nbytes).from_address(buf.ptr), buf.dtype)


class Group:
    """What the ranks of one group share: their buffers at each collective, met at a barrier."""

    def __init__(self, world: int) -> None:
        self.world, self.slots = world, [np.empty(0)] * world
        self.barrier = threading.Barrier(world, timeout=60)


class ThreadRank:
    """Rank ``rank`` of ``group``, each rank a thread; ``got``: the type of every buffer it was handed."""

    def __init__(self, group: Group, rank: int, device_buffers: bool = True) -> None:
        self.group, self.rank, self.world_size = group, rank, group.world
        self.device_buffers, self.got = device_buffers, []
        self.name = f"tp{rank}"

    def _exchange(self, buf: Any) -> list[np.ndarray]:
        self.got.append(type(buf))
        self.group.slots[self.rank] = _view(buf).copy()
        self.group.barrier.wait()
        parts = list(self.group.slots)
        self.group.barrier.wait()
        return parts

    def all_reduce(self, buf: Any, *, stream: Any = None) -> None:
        parts = self._exchange(buf)
        _view(buf)[...] = sum(parts[1:], parts[0])

    def all_gather(self, send: Any, recv: Any, *, stream: Any = None) -> None:
        self.got.append(type(recv))
        _view(recv)[...] = np.concatenate(self._exchange(send))

    def broadcast(self, buf: Any, root: int = 0) -> None: ...
    def barrier(self) -> None: ...


#: the emulator runs a launch's blocks with process-wide state: one launch at a time, of either rank
LAUNCH = threading.Lock()


class Counting(EmulatedDevice):
    """The emulator counting the bytes copied between host and device, by the device address read; its
    launches one at a time (the ranks are threads)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[int, int]] = []
        self.written = self.syncs = 0

    def synchronize(self) -> None:
        self.syncs += 1
        super().synchronize()

    def copy_to_host(self, ptr: int, nbytes: int) -> np.ndarray:
        self.reads.append((ptr, nbytes))
        return super().copy_to_host(ptr, nbytes)

    def copy_to_device(self, ptr: int, value: np.ndarray) -> None:
        self.written += value.nbytes
        super().copy_to_device(ptr, value)

    def launch(self, *args: Any) -> None:
        with LAUNCH:
            super().launch(*args)


def _put(dev: EmulatedDevice, a: np.ndarray) -> DeviceArray:
    return DeviceArray.upload(dev, a)


def _get(a: DeviceArray) -> np.ndarray:
    return a.download().copy()


def _ranks(world: int, fn: Callable[[int], Any]) -> list[Any]:
    """``fn(rank)`` for every rank, each in a thread of its own (in this context: the plugin session)."""
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(r: int, ctx: contextvars.Context) -> None:
        try:
            results[r] = ctx.run(fn, r)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r, contextvars.copy_context())) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


WORLD = 2
V, ROWS, C, N = 7, 4, 5, 6  # a vocabulary of 7 over 2 ranks: 4 rows each, rank 1's last one padding


def _case(op: str, rank: int, rng: np.random.Generator) -> tuple[list[Any], dict[str, Any]]:
    """The inputs (the same on both ranks where the op takes whole tensors) and attributes of ``op``."""
    common = np.random.default_rng(7)
    x = common.standard_normal((N, C)).astype(np.float32)
    targets = np.array([0, 6, -100, 3, 4, 2], np.int32)  # targets on both ranks, one ignored
    d_loss, d_lse = common.standard_normal(N).astype(np.float32), common.standard_normal(N).astype(np.float32)
    w = rng.standard_normal((ROWS, C)).astype(np.float32)  # this rank's rows
    head = {"ignore_index": -100, "softcap": None, "vocab_size": V}
    if op == "tp_all_reduce":
        return [rng.standard_normal((3, C)).astype(np.float32)], {}
    if op == "vocab_parallel_embedding":
        return [np.array([[0, 6, 3], [4, 1, 5]], np.int32), w], {"vocab_size": V}
    if op == "vocab_parallel_embedding_backward":
        d_out = common.standard_normal((2, 3, C)).astype(np.float32)
        return ([d_out, np.array([[0, 6, 3], [4, 6, 5]], np.int32)],
                {"num_embeddings": ROWS, "vocab_size": V, "padding_idx": 5})
    if op == "vocab_parallel_logits":
        return [x, w], {"vocab_size": V, "softcap": 2.0}
    if op == "vocab_parallel_lm_head_loss":
        return [x, w, targets], head
    if op == "softcapped_loss":
        return [x, w, targets], {**head, "softcap": 1.5}
    assert op == "vocab_parallel_lm_head_loss_backward"
    return [d_loss, x, w, targets, None, d_lse], head


#: op -> (its NumPy reference, its cuda kernel, how many outputs)
REFERENCES = {
    "tp_all_reduce": (_tp_all_reduce, cuda_tp_all_reduce, 1),
    "vocab_parallel_embedding": (_embedding, cuda_vocab_parallel_embedding, 1),
    "vocab_parallel_embedding_backward": (_embedding_backward, cuda_vocab_parallel_embedding_backward, 1),
    "vocab_parallel_logits": (_gathered_logits, cuda_vocab_parallel_logits, 1),
    "vocab_parallel_lm_head_loss": (_loss, cuda_vocab_parallel_lm_head_loss, 2),
    "softcapped_loss": (_loss, cuda_vocab_parallel_lm_head_loss, 2),
    "vocab_parallel_lm_head_loss_backward": (_loss_backward, cuda_vocab_parallel_lm_head_loss_backward, 2),
}


def _run(op: str, device_buffers: bool) -> tuple[list[Any], list[Any], list[ThreadRank]]:
    """Both ranks' results of ``op``'s NumPy reference on host arrays and of its cuda kernel, the
    kernel's communicators and devices."""
    reference, kernel, outs = REFERENCES[op]
    host_group, dev_group = Group(WORLD), Group(WORLD)
    host_ranks = [ThreadRank(host_group, r, False) for r in range(WORLD)]
    dev_ranks = [ThreadRank(dev_group, r, device_buffers) for r in range(WORLD)]
    for c in host_ranks:
        get_registry("communicators").register(f"host{c.rank}", c)
    for c in dev_ranks:
        get_registry("communicators").register(f"dev{c.rank}", c)
    devices = [Counting() for _ in range(WORLD)]

    def inputs(r: int) -> tuple[list[Any], dict[str, Any]]:
        return _case(op, r, np.random.default_rng(100 + r))

    def on_host(r: int) -> Any:
        ins, attrs = inputs(r)
        if op == "vocab_parallel_lm_head_loss_backward":
            ins[4] = _loss(*ins[1:4], communicator=f"host{r}", **attrs)[1]
        got = reference(*ins, communicator=f"host{r}", **attrs)
        return list(got) if outs == 2 else [got]

    def on_device(r: int) -> Any:
        ins, attrs = inputs(r)
        dev = devices[r]
        if op == "vocab_parallel_lm_head_loss_backward":
            ins[4] = _loss(*ins[1:4], communicator=f"host{r}", **attrs)[1]  # the whole lse, as the forward's
        arrays = [None if a is None else _put(dev, a) for a in ins]
        want = on_host_results[r]
        out = [_put(dev, np.full(w.shape, np.nan, np.float32)) for w in want]
        dev.reads.clear()
        dev.written = dev.syncs = 0
        kernel(*arrays, out=out, communicator=f"dev{r}", **attrs)
        moved = (list(dev.reads), dev.written, dev.syncs)
        dev.synchronize()
        check_id_errors(dev)  # every id in the vocabulary
        return [_get(o) for o in out], moved

    on_host_results = _ranks(WORLD, on_host)
    got = _ranks(WORLD, on_device)
    return on_host_results, got, dev_ranks


@pytest.mark.parametrize("op", list(REFERENCES))
def test_tensor_parallel_kernels_on_device_buffers_leave_what_the_reference_leaves(op: str) -> None:
    with PluginSession().activate():
        want, got, comms = _run(op, device_buffers=True)
    for r in range(WORLD):
        outs, (reads, written, syncs) = got[r]
        for g, w in zip(outs, want[r], strict=True):
            np.testing.assert_allclose(g, np.asarray(w, np.float32), rtol=2e-5, atol=2e-6,
                                       err_msg=f"rank {r}")
        # the collectives on device buffers only; nothing copied to or from the host (not the ids either),
        # no synchronisation
        assert set(comms[r].got) <= {CudaBuffer}
        assert (reads, written, syncs) == ([], 0, 0), op
    if op == "tp_all_reduce":
        assert comms[0].got == [CudaBuffer]  # one all-reduce, of the output in place


def test_tp_copy_is_a_device_copy() -> None:
    dev = Counting()
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    a, out = _put(dev, x), _put(dev, np.zeros_like(x))
    dev.reads.clear()
    cuda_tp_copy(a, out=[out], communicator="nccl")
    np.testing.assert_array_equal(_get(out), x)
    assert len(dev.reads) == 1  # the read above alone


def test_a_communicator_of_host_arrays_keeps_the_host_path() -> None:
    with PluginSession().activate():
        want, got, comms = _run("vocab_parallel_lm_head_loss", device_buffers=False)
    for r in range(WORLD):
        for g, w in zip(got[r][0], want[r], strict=True):
            np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)
        assert comms[r].got and set(comms[r].got) == {np.ndarray}


@pytest.mark.parametrize("op", ["vocab_parallel_embedding", "vocab_parallel_lm_head_loss"])
def test_a_token_id_outside_the_vocabulary_names_the_op_at_the_next_synchronisation(op: str) -> None:
    """The op reads nothing back; the reference's error, naming the op, comes where the device is next
    synchronised (the backend checks when it reads a tensor back: the loss, at the latest)."""
    with PluginSession().activate():
        comm = ThreadRank(Group(1), 0)
        get_registry("communicators").register("one", comm)
        dev = Counting()
        ids, w = _put(dev, np.array([1, 9], np.int32)), _put(dev, np.ones((4, 3), np.float32))
        out = _put(dev, np.zeros((2, 3), np.float32))
        dev.reads.clear()
        if op == "vocab_parallel_embedding":
            cuda_vocab_parallel_embedding(ids, w, out=[out], communicator="one")
        else:
            x = _put(dev, np.ones((2, 3), np.float32))
            loss = [_put(dev, np.zeros(2, np.float32)) for _ in "ab"]
            cuda_vocab_parallel_lm_head_loss(x, w, ids, out=loss, communicator="one", ignore_index=-100,
                                             softcap=None)
        assert dev.reads == []
        dev.synchronize()
        with pytest.raises(OpError, match=f"'{op}': index 9 is outside \\[0, 4\\)"):
            check_id_errors(dev)


@pytest.mark.parametrize("vocab", [None, 13])
def test_the_device_mapping_of_every_rank_equals_the_references(vocab: int | None) -> None:
    """kiln.cuda's ``vocab_local_ids`` against kiln-dist's ``_local`` for each of 3 ranks of 5 rows (13:
    the last rank's last two rows padding), ignored targets among the ids: what the ops take from it."""
    world, rows, ignore = 3, 5, -100
    ids = np.random.default_rng(0).integers(0, vocab or world * rows, 600).astype(np.int32)
    ids[::7] = ignore
    with PluginSession().activate():
        group = Group(1)
        dev = Counting()
        d_ids = _put(dev, ids)
        for r in range(world):
            comm = ThreadRank(group, 0)
            comm.rank, comm.world_size = r, world
            get_registry("communicators").register(f"rank{r}", comm)
            rel, mine = _local(ids, rows, f"rank{r}", "op", ignore, vocab)
            outs = [_put(dev, np.zeros(ids.shape, np.int32)) for _ in range(3)]
            _cuda._local_ids(d_ids, outs, comm, rows, "op", fill=7, ignore=ignore, vocab=vocab)
            got_rel, got_mine, got_owner = (_get(o) for o in outs)
            np.testing.assert_array_equal(got_mine, mine.astype(np.int32), err_msg=f"rank {r}")
            np.testing.assert_array_equal(got_rel, np.where(mine, rel, np.where(ids != ignore, 7, -1)))
            np.testing.assert_array_equal(got_owner, np.where(ids != ignore, ids // rows, -1))
        dev.synchronize()
        check_id_errors(dev)


def test_the_cuda_backend_runs_these_kernels_for_tensor_parallelism() -> None:
    with PluginSession().activate():
        kernels = get_registry("kernels")
        for op, fn in CUDA_TP_KERNELS:
            found = kernels.find(op, "cuda", "float32")
            assert found is not None and found.fn is fn and found.out, op


def test_tensor_parallel_on_the_nccl_grid_on_emulated_cuda_equals_one_process(tmp_path: Any) -> None:
    """2 MPI ranks, the stand-in nccl: a tiny Qwen3 whose blocks and vocabulary are split over
    ``nccl-tp`` trains on the emulated ``cuda`` backend as one process does (losses and clipped-by norms
    to 1e-5, weights to 1e-4: float32 sums in another order); every tensor-parallel op ran its cuda kernel,
    whose collectives got device buffers only, and none copied anything to the host (token ids and
    targets included) or synchronised the device."""
    import importlib.util
    from pathlib import Path

    from kiln.cuda import EmulatedCuda
    from kiln.dist import _plugin, launch

    here = Path(__file__).parent
    path = (str(here / "standin"), os.environ.get("PYTHONPATH"))
    env = {"PYTHONPATH": os.pathsep.join(p for p in path if p), "KILN_NUM_THREADS": "1"}
    assert launch(2, [str(here / "_nccl_grid.py"), str(tmp_path), "2", "tp"], env=env) == 0
    spec = importlib.util.spec_from_file_location("kiln_dist_tp_worker_cuda_tp", here / "_tp_worker.py")
    assert spec is not None and spec.loader is not None
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    session = PluginSession(autoload=False)
    session.register(_plugin, "kiln-dist")
    session.register(EmulatedCuda(), "cuda-emulated")
    with session.activate():
        full, stats = worker.train(None, "Qwen3Model", backend="cuda")
    for r in range(2):
        rank = np.load(tmp_path / f"rank{r}.npz")
        np.testing.assert_allclose(rank["stats"], stats, rtol=1e-5)
        for k, v in full.parameters().items():
            assert np.linalg.norm(rank[f"param:{k}"] - v) <= 1e-4 * np.linalg.norm(v), k
        assert (int(rank["activations"]), int(rank["syncs"])) == (0, 0)  # not even an id read back
        assert set(rank["ops"]) == {"tp_copy", "tp_all_reduce", "vocab_parallel_embedding",
                                    "vocab_parallel_embedding_backward", "vocab_parallel_lm_head_loss",
                                    "vocab_parallel_lm_head_loss_backward"}, rank["ops"]
        assert list(rank["handed"]) == ["CudaBuffer"]
