"""test_threads.py passes in any order, after other tests have run in the same interpreter (issue 24:
the BLAS test passed alone and failed after the frontend tests).

A fresh pytest runs test_threads.py in reverse order and in a shuffled order, behind a plugin that
first does in that interpreter what earlier tests do to the process: a training step (kiln's first
hold of BLAS and its scan of the loaded libraries), an import that loads a BLAS of its own (scipy),
and holds of BLAS from two threads that close out of order. Proportionate to the one
order-dependent test file the audit found; a random-order plugin over the whole suite would add a
dependency and check nothing a default run sees."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
THREADS = Path(__file__).with_name("test_threads.py")

PLUGIN = textwrap.dedent('''
    """Earlier tests' state, then the collected tests in the order KILN_TEST_ORDER names."""
    import os
    import random
    import threading


    def pytest_configure(config):
        import kiln_core_tiny  # made importable by packages/core/tests/conftest.py
        from kiln.core import Model, _threads

        model = Model.from_ir(kiln_core_tiny.tiny_qwen3_bundle(), seed=0)
        model.train_step(kiln_core_tiny.random_batch(32, 2, 8))
        try:
            import scipy.linalg  # noqa: F401  (a second BLAS, loaded after the first hold)
        except ImportError:
            pass
        entered, leave = threading.Event(), threading.Event()

        def other():
            with _threads.blas_held_to_one_thread():
                entered.set()
                leave.wait(20)

        thread = threading.Thread(target=other)
        with _threads.blas_held_to_one_thread():
            thread.start()
            entered.wait(20)
        leave.set()  # the first holder left before the second
        thread.join(20)


    def pytest_collection_modifyitems(session, config, items):
        order = os.environ["KILN_TEST_ORDER"]
        if order == "reverse":
            items.reverse()
        else:
            random.Random(int(order)).shuffle(items)
''')


@pytest.mark.slow  # two fresh interpreters, about 5 s each
@pytest.mark.parametrize("order", ["reverse", "24"])
def test_the_thread_tests_pass_in_any_order_after_other_tests(tmp_path: Path, order: str) -> None:
    (tmp_path / "kiln_threads_order.py").write_text(PLUGIN)
    env = {
        **os.environ,
        "KILN_TEST_ORDER": order,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
        "OPENBLAS_NUM_THREADS": "2",  # BLAS starts on more than one thread, so a missed hold shows
    }
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "kiln_threads_order",
         "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT),
         str(THREADS)],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout, run.stdout[-2000:]
