"""The NumPy backend's threads: the pool, the cuts, results independent of the thread count, BLAS
held to one thread while a Program runs, and the fused LM-head pass against the two plain steps."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from kiln_core_tiny import random_batch, tiny_qwen3_bundle, with_dropout
from threadpoolctl import threadpool_info

from kiln.core import KilnError, Model, _threads
from kiln.core.autodiff._gradcheck import max_rel_error


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test gets its own pool (the module's one is made on first use)."""
    monkeypatch.setattr(_threads, "_pool", None)
    yield


def test_parallel_runs_every_item_once_on_several_threads(pool: None,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_NUM_THREADS", "3")
    seen: list[int] = []
    names: set[str] = set()
    lock = threading.Lock()
    barrier = threading.Barrier(3, timeout=10)

    def work(i: int) -> None:
        if i < 3:
            barrier.wait()  # the first three items can only pass together: three threads ran them
        with lock:
            seen.append(i)
            names.add(threading.current_thread().name)

    _threads.parallel(work, list(range(50)))
    assert sorted(seen) == list(range(50))
    assert len(names) == 3 and _threads.threads() == 3


def test_parallel_raises_a_piece_error_and_nested_calls_run_inline(pool: None,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_NUM_THREADS", "2")

    def fail(i: int) -> None:
        if i == 7:
            raise ValueError("piece 7")

    with pytest.raises(ValueError, match="piece 7"):
        _threads.parallel(fail, list(range(20)))
    inner: list[int] = []
    _threads.parallel(lambda i: _threads.parallel(inner.append, [i * 10, i * 10 + 1]), list(range(4)))
    assert sorted(inner) == [0, 1, 10, 11, 20, 21, 30, 31]


@pytest.mark.parametrize("raw", ["0", "-2", "two"])
def test_bad_thread_count_is_named(pool: None, monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("KILN_NUM_THREADS", raw)
    with pytest.raises(KilnError, match="KILN_NUM_THREADS"):
        _threads.threads()


@pytest.mark.parametrize(("n", "grain"), [(0, 4), (1, 4), (10, 4), (10, 3), (1000, 64), (5, 100)])
def test_chunks_cover_the_range_in_order(n: int, grain: int) -> None:
    cuts = _threads.chunks(n, grain)
    assert [i for a, b in cuts for i in range(a, b)] == list(range(n))
    assert all(b - a >= min(n, grain) // 2 for a, b in cuts)


@pytest.mark.parametrize("transpose", ["NN", "NT", "TN", "TT"])
@pytest.mark.parametrize("shape", [(300, 70, 200), (130, 50, 700), (64, 33, 129)])
def test_matmul_into_cuts_give_the_product(pool: None, monkeypatch: pytest.MonkeyPatch, transpose: str,
                                           shape: tuple[int, int, int]) -> None:
    monkeypatch.setenv("KILN_NUM_THREADS", "3")
    monkeypatch.setattr(_threads, "PARALLEL_MACS", 1)  # cut even these small products
    m, k, n = shape
    rng = np.random.default_rng(0)
    a = rng.standard_normal((k, m) if transpose[0] == "T" else (m, k))
    b = rng.standard_normal((n, k) if transpose[1] == "T" else (k, n))
    a_op, b_op = (a.T if transpose[0] == "T" else a), (b.T if transpose[1] == "T" else b)
    out = np.full((m, n), np.nan)
    _threads.matmul_into(a_op, b_op, out)
    expected = np.einsum("ik,kj->ij", a_op, b_op)  # not BLAS: an independent oracle
    assert max_rel_error(out, expected) < 1e-12


def _run(bundle: object, batch: dict[str, np.ndarray],
         steps: int = 2) -> tuple[list[float], dict[str, np.ndarray]]:
    model = Model.from_ir(bundle, seed=0, dtype="float64")  # type: ignore[arg-type]
    losses = [model.train_step(batch)["loss"] for _ in range(steps)]
    _, grads = model.loss_and_grads(batch["input_ids"], batch["labels"])
    return losses, grads


@pytest.mark.parametrize("dropout", [False, True])
def test_results_do_not_depend_on_the_thread_count(pool: None, monkeypatch: pytest.MonkeyPatch,
                                                   dropout: bool) -> None:
    """One thread against three, with pieces small enough that every kernel is cut many ways (the
    products stay below the size that is cut per thread): bit for bit the same."""
    bundle = tiny_qwen3_bundle(vocab_size=64, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                               intermediate_size=64)
    if dropout:
        bundle = with_dropout(bundle)
    batch = random_batch(64, 4, 16, seed=3)
    monkeypatch.setattr(_threads, "GRAIN", 64)
    runs = []
    for n in ("1", "3"):
        monkeypatch.setenv("KILN_NUM_THREADS", n)
        monkeypatch.setattr(_threads, "_pool", None)
        runs.append(_run(bundle, batch))
    (losses_1, grads_1), (losses_3, grads_3) = runs
    assert losses_1 == losses_3
    assert grads_1.keys() == grads_3.keys()
    for name in grads_1:
        assert np.array_equal(grads_1[name], grads_3[name]), name


def _blas_threads() -> list[int]:
    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]


def test_blas_is_held_to_one_thread_during_a_run_and_restored() -> None:
    bundle = tiny_qwen3_bundle()
    model = Model.from_ir(bundle, seed=0)
    before = _blas_threads()
    seen: list[list[int]] = []
    _, ex = model._bind("train", 2, 8)
    ex.runs["forward"].insert(0, lambda: seen.append(_blas_threads()))
    ex.train_runs = None  # the plain steps, which the spy joined
    model.train_step(random_batch(32, 2, 8))
    assert seen and all(n == 1 for n in seen[0])
    assert _blas_threads() == before


@pytest.mark.parametrize("tie", [False, True])
def test_fused_lm_head_pass_matches_the_two_steps(tie: bool) -> None:
    """The training step's one-pass LM head against the plain forward op and its backward op."""
    bundle = tiny_qwen3_bundle(vocab_size=96, tie_word_embeddings=tie)
    batch = random_batch(96, 3, 10, seed=5)
    results = []
    for fused in (True, False):
        model = Model.from_ir(bundle, seed=0, dtype="float64")
        _, ex = model._bind("train", 3, 10)
        assert ex.train_runs is not None  # the pair was found
        if not fused:
            ex.train_runs = None
        results.append(model.loss_and_grads(batch["input_ids"], batch["labels"]))
    (loss_f, grads_f), (loss_p, grads_p) = results
    assert abs(loss_f - loss_p) <= 1e-12 * abs(loss_p)
    for name in grads_p:
        assert max_rel_error(grads_f[name], grads_p[name]) < 1e-10, name


def test_blas_holds_stay_balanced_when_threads_interleave() -> None:
    """The main thread holds BLAS, a second thread holds it too, the main thread leaves first: BLAS
    stays held until the second leaves, and the next hold holds it again (the count of open holds
    never goes wrong). The checks read BLAS from the main thread: OpenBLAS may ignore a thread count
    set from another thread."""
    from threadpoolctl import ThreadpoolController

    before = _blas_threads()
    b_in, a_out, b_out = threading.Event(), threading.Event(), threading.Event()

    def b() -> None:
        with _threads.blas_held_to_one_thread():
            b_in.set()
            a_out.wait(20)
        b_out.set()

    other = threading.Thread(target=b)
    try:
        with _threads.blas_held_to_one_thread():
            other.start()
            assert b_in.wait(20)
        a_out.set()
        assert all(n == 1 for n in _blas_threads())  # the second thread still holds it
        assert b_out.wait(20)
        other.join(20)
        assert _threads._held == 0
        with _threads.blas_held_to_one_thread():
            assert all(n == 1 for n in _blas_threads())
    finally:
        a_out.set()
        other.join(20)
        if len(set(before)) == 1:  # as it was, set from this thread
            ThreadpoolController().limit(limits=before[0], user_api="blas")
    assert _blas_threads() == before


def test_a_blas_loaded_after_the_first_run_is_held_too(tmp_path: Path) -> None:
    """A library imported after kiln first held BLAS (scipy brings an OpenBLAS of its own) is held
    as well. In a fresh interpreter, so that the import really comes after the first run."""
    pytest.importorskip("scipy.linalg")
    script = tmp_path / "late_blas.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        from threadpoolctl import threadpool_info
        from kiln.core import _threads

        def blas():
            return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]

        with _threads.blas_held_to_one_thread():
            np.ones((4, 4)) @ np.ones((4, 4))
        import scipy.linalg  # noqa: F401  (a second BLAS)
        assert len(blas()) >= 2, blas()
        before = blas()
        with _threads.blas_held_to_one_thread():
            assert all(n == 1 for n in blas()), blas()
        assert blas() == before, (blas(), before)
        print("ok")
    """))
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "2"}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr
