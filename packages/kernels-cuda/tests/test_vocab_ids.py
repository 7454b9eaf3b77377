"""``vocab_local_ids``: token ids (or targets) mapped into one rank's rows of a vocabulary split over
ranks, on the emulated device against a NumPy mapping written here (kiln-dist's ``_local``: rank ``r``
of rows ``[r * rows, (r + 1) * rows)``); an id outside the vocabulary is raised by ``check_id_errors``
after the launch, which reads nothing back itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.core import KilnError, OpError
from kiln.cuda import DeviceArray, _device, check_id_errors, vocab_local_ids
from kiln.cuda._emulate import EmulatedDevice

WORLD, ROWS, VOCAB, IGNORE = 3, 5, 13, -100  # rank 2 holds rows 10..14: 13 and 14 are padding


class Reads(EmulatedDevice):
    """The emulator counting copies to the host."""

    def __init__(self, cache: Path) -> None:
        super().__init__(cache=cache)
        self.reads = 0

    def copy_to_host(self, ptr: int, nbytes: int) -> np.ndarray:
        self.reads += 1
        return super().copy_to_host(ptr, nbytes)


@pytest.fixture
def device(emulated: EmulatedDevice) -> Reads:
    """A fresh emulated device (its own error slots), the session's emulator build."""
    assert emulated.cache is not None
    return Reads(emulated.cache)


def _mapping(ids: np.ndarray, rank: int, fill: int, ignore: int | None) -> tuple[np.ndarray, ...]:
    """The NumPy oracle: (rel, mine, owner) of rank ``rank``."""
    live = np.ones(ids.shape, bool) if ignore is None else ids != ignore
    owner = np.where(live, ids // ROWS, -1)
    mine = owner == rank
    rel = np.where(mine, ids - rank * ROWS, np.where(live, fill, -1))
    return rel, mine.astype(np.int32), owner


def _run(dev: Any, ids: np.ndarray, rank: int, **kw: Any) -> list[np.ndarray]:
    a = DeviceArray.upload(dev, ids.astype(np.int32))
    outs = [DeviceArray.upload(dev, np.full(ids.shape, 77, np.int32)) for _ in range(3)]
    vocab_local_ids(a, out=outs, rank=rank, rows=ROWS, size=VOCAB, **kw)
    dev.synchronize()
    return [o.download().reshape(ids.shape) for o in outs]


@pytest.mark.parametrize("ignore", [IGNORE, None])
@pytest.mark.parametrize("fill", [0, -1, 4])
def test_every_ranks_mapping_equals_numpys(device: Reads, fill: int, ignore: int | None) -> None:
    rng = np.random.default_rng(3)
    ids = rng.integers(0, VOCAB, (3, 1100))  # past one block of 256 threads, over several blocks
    if ignore is not None:
        ids[rng.random(ids.shape) < 0.2] = ignore
    for rank in range(WORLD):
        got = _run(device, ids, rank, fill=fill, ignore_index=ignore, op="lookup")
        want = _mapping(ids, rank, fill, ignore)
        for g, w, name in zip(got, want, ("rel", "mine", "owner"), strict=True):
            np.testing.assert_array_equal(g, w, err_msg=f"{name} of rank {rank}")
    check_id_errors(device)  # every id in the vocabulary: no error


def test_outputs_may_be_left_out(device: Reads) -> None:
    ids = np.array([0, 12, 7, IGNORE, 5], np.int32)
    a = DeviceArray.upload(device, ids)
    owner = DeviceArray.upload(device, np.zeros(5, np.int32))
    vocab_local_ids(a, out=(None, None, owner), rank=1, rows=ROWS, size=VOCAB, fill=0, ignore_index=IGNORE)
    got = owner.download().ravel()
    np.testing.assert_array_equal(got, [0, 2, 1, -1, 1])


@pytest.mark.parametrize(("ids", "ignore", "bad"), [
    ([3, 13, 4], IGNORE, 13),  # a padding row of the last rank: past the vocabulary
    ([IGNORE, -1, 2], IGNORE, -1),  # negative, not the ignored one
    ([IGNORE, 2], None, IGNORE),  # without an ignore_index, -100 is an id like any other
])
def test_an_id_outside_the_vocabulary_is_raised_after_the_launch(device: Reads, ids: list[int],
                                                                 ignore: int | None, bad: int) -> None:
    a = DeviceArray.upload(device, np.array(ids, np.int32))
    rel = DeviceArray.upload(device, np.zeros(len(ids), np.int32))
    device.reads = 0
    vocab_local_ids(a, out=(rel,), rank=2, rows=ROWS, size=VOCAB, fill=0, ignore_index=ignore,
                    op="vocab_parallel_embedding")
    assert device.reads == 0  # the launch reads nothing back: no synchronisation per op
    device.synchronize()
    message = f"op 'vocab_parallel_embedding': index {bad} is outside \\[0, 13\\)"
    with pytest.raises(OpError, match=message) as e:
        check_id_errors(device)
    assert e.value.op == "vocab_parallel_embedding"
    check_id_errors(device)  # reported once: the slot is reset
    # the bad id matches no row: never an index past the rows
    assert (rel.download() < ROWS).all()


def test_the_error_names_the_op_that_found_it(device: Reads) -> None:
    good, bad = (DeviceArray.upload(device, np.array(v, np.int32)) for v in ([1, 2], [1, 99]))
    out = DeviceArray.upload(device, np.zeros(2, np.int32))
    vocab_local_ids(good, out=(out,), rank=0, rows=ROWS, size=VOCAB, fill=0, op="embedding_op")
    vocab_local_ids(bad, out=(out,), rank=0, rows=ROWS, size=VOCAB, fill=-1, ignore_index=IGNORE,
                    op="loss_op")
    with pytest.raises(OpError, match="op 'loss_op': index 99 is outside"):
        check_id_errors(device)


def test_ids_other_than_int32_are_refused(device: Reads) -> None:
    ids = DeviceArray.upload(device, np.array([1, 2], np.int64))
    out = DeviceArray.upload(device, np.zeros(2, np.int32))
    with pytest.raises(KilnError, match="token ids as int32; found int64"):
        vocab_local_ids(ids, out=(out,), rank=0, rows=ROWS, size=VOCAB, fill=0)
    ids32 = DeviceArray.upload(device, np.array([1, 2], np.int32))
    with pytest.raises(KilnError, match="writes int32 of the ids' 2 elements; found float32"):
        vocab_local_ids(ids32, out=(DeviceArray.upload(device, np.zeros(2, np.float32)),), rank=0, rows=ROWS,
                        size=VOCAB, fill=0)


def test_a_device_that_mapped_no_ids_reads_nothing(device: Reads) -> None:
    check_id_errors(device)
    assert device.reads == 0


def test_the_backend_raises_it_where_it_reads_a_tensor_back(device: Reads) -> None:
    """A tiny Qwen3 on the emulated ``cuda`` backend: a bad id mapped on its device before the step is
    raised when the step's loss is read back, and the model runs on after it."""
    dsl = pytest.importorskip("kiln.dsl", reason="the Qwen3 model comes from kiln-dsl")
    from kiln.core import Model, PluginSession
    from kiln.cuda import EmulatedCuda
    from kiln.dsl.stdlib.models import Qwen3Model

    config = {"vocab_size": 64, "d_model": 16, "n_layers": 1, "num_query_heads": 2, "num_kv_heads": 1,
              "head_size": 8, "d_ff": 32, "max_seq": 8}
    bundle = dsl.build_bundle(Qwen3Model, config)
    ids = np.arange(8).reshape(1, 8)
    with PluginSession(autoload=False).activate() as session:
        session.register(EmulatedCuda(device), "cuda-emulated")
        model = Model.from_ir(bundle, seed=0, backend="cuda")
        bad = DeviceArray.upload(device, np.array([64], np.int32))
        vocab_local_ids(bad, out=(None,), rank=0, rows=64, size=64, fill=0, op="vocab_parallel_embedding")
        with pytest.raises(OpError, match="op 'vocab_parallel_embedding': index 64 is outside \\[0, 64\\)"):
            model.loss(ids, ids)
        assert np.isfinite(model.loss(ids, ids))


@pytest.mark.gpu
@pytest.mark.skipif(not _device.device_status()[0], reason=f"needs a CUDA GPU: {_device.device_status()[1]}")
def test_on_a_gpu_every_ranks_mapping_and_the_error() -> None:
    gpu = _device.CudaDevice()
    ids = np.random.default_rng(5).integers(0, VOCAB, 5000)
    ids[::3] = IGNORE
    for rank in range(WORLD):
        got = _run(gpu, ids, rank, fill=-1, ignore_index=IGNORE, op="lookup")
        for g, w in zip(got, _mapping(ids, rank, -1, IGNORE), strict=True):
            np.testing.assert_array_equal(g, w)
    check_id_errors(gpu)
    _run(gpu, np.array([2, 14]), 0, fill=0, op="lookup")
    with pytest.raises(OpError, match="op 'lookup': index 14 is outside \\[0, 13\\)"):
        check_id_errors(gpu)
