"""Whole training steps with the native kernels against the NumPy kernels, and the two ways the
native kernels stay out (KILN_CPU_KERNELS=0, no compiler)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.core import Model, PluginSession, compile
from kiln.cpu import OPS, _plugin

CONFIG = {"vocab_size": 96, "d_model": 48, "n_layers": 2, "num_query_heads": 4, "num_kv_heads": 2,
          "head_size": 12, "d_ff": 80, "max_seq": 16}


def native_session() -> PluginSession:
    session = PluginSession(autoload=False)
    session.register(_plugin, "cpu")
    return session


@pytest.fixture(scope="module")
def bundle() -> Any:
    dsl = pytest.importorskip("kiln.dsl", reason="the model comes from kiln-dsl")
    from kiln.dsl.stdlib.models import Qwen3Model

    return dsl.build_bundle(Qwen3Model, CONFIG)


def batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, CONFIG["vocab_size"], (3, 13))
    labels = np.roll(ids, -1, axis=1)
    labels[0, :4] = -100
    return {"input_ids": ids, "labels": labels}


def train(session: PluginSession, bundle: Any, steps: int = 3, **kw: Any) -> tuple[list[dict[str, float]],
                                                                                   dict[str, np.ndarray]]:
    with session.activate():
        model = Model.from_ir(bundle, seed=0, **kw)
        stats = [model.train_step(batch()) for _ in range(steps)]
        return stats, model.parameters()


def test_training_with_native_kernels_equals_numpy(bundle: Any, tables: Any) -> None:
    with native_session().activate():
        program = compile(bundle, bindings={"B": 3, "T": 13})
    used = {s.op.type: s.kernel for s in program.steps if s.op.type in OPS}
    assert {"fused_residual_rmsnorm", "fused_residual_rmsnorm_backward", "swiglu", "swiglu_backward",
            "flash_attention", "flash_attention_backward", "qkv_qk_norm_rope", "qkv_qk_norm_rope_backward",
            "adamw_update"} <= set(used)
    assert all(k == f"{op}@numpy:float32" for op, k in used.items())
    assert [f.kernel for f in program.fusions] == ["fused_lm_head_loss_and_grad@numpy:float32"]
    sessions = (PluginSession(autoload=False), native_session())
    (want, want_p), (got, got_p) = (train(s, bundle) for s in sessions)
    for w, g in zip(want, got, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5)
    assert max(float(np.abs(want_p[k] - got_p[k]).max()) for k in want_p) < 1e-5


@pytest.mark.parametrize("recompute", ["auto", "block"])
def test_recompute_does_not_change_native_results(bundle: Any, tables: Any, recompute: str) -> None:
    """kiln's rule, with the native kernels too: any recompute plan gives the same bits."""
    runs = (train(native_session(), bundle, 2, recompute=r) for r in ("none", recompute))
    (want, want_p), (got, got_p) = runs
    assert [s["loss"] for s in got] == [s["loss"] for s in want]
    assert all(np.array_equal(want_p[k], got_p[k]) for k in want_p)


SCRIPT = textwrap.dedent("""
    import json, warnings
    from kiln.core import get_registry
    import kiln.cpu
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = get_registry("kernels")  # the installed plugins fill it
    print(json.dumps({"kernel": table.find("swiglu", "numpy", "float32").key,
                      "reason": kiln.cpu.unavailable_reason(),
                      "warnings": [str(w.message) for w in caught if "kiln-kernels-cpu" in str(w.message)]}))
""")


def _run(tmp_path: Path, **env: str) -> dict[str, Any]:
    import json

    drop = ("KILN_DISABLE_PLUGIN_AUTOLOAD", "KILN_CPU_KERNELS")
    clean = {k: v for k, v in os.environ.items() if k not in drop}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True,
                          text=True, timeout=300,
                          env={**clean, "KILN_CPU_CACHE": str(tmp_path / "cache"), **env})
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_installed_plugin_builds_into_its_cache_and_registers(tmp_path: Path) -> None:
    got = _run(tmp_path)
    assert got == {"kernel": "swiglu@numpy:float32", "reason": None, "warnings": []}
    assert len(list((tmp_path / "cache").glob("_kiln_cpu_*"))) == 1


def test_env_var_turns_the_native_kernels_off(tmp_path: Path) -> None:
    got = _run(tmp_path, KILN_CPU_KERNELS="0")
    assert got == {"kernel": "swiglu@numpy:*", "reason": "KILN_CPU_KERNELS=0", "warnings": []}
    assert not (tmp_path / "cache").exists()  # not even tried


def test_without_a_compiler_the_numpy_kernels_run(tmp_path: Path) -> None:
    got = _run(tmp_path, CC=str(tmp_path / "no-such-cc"))
    assert got["kernel"] == "swiglu@numpy:*"
    assert "could not compile" in got["reason"] and "no-such-cc" in got["reason"]
    assert len(got["warnings"]) == 1 and "runs its NumPy kernels instead" in got["warnings"][0]
