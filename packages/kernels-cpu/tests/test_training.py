"""Whole training steps with the native kernels against the NumPy kernels, and the two ways the
native kernels stay out (KILN_CPU_KERNELS=0, no compiler)."""

# ruff: noqa: F821, UP037  (dimension names inside Tensor[...] annotations are not Python names)

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


LLAMA = {"vocab_size": 96, "d_model": 48, "n_layers": 2, "num_query_heads": 4, "num_kv_heads": 2,
         "head_size": 12, "d_ff": 80}


try:  # the model comes from kiln-dsl
    from kiln.dsl import Array, B, Param, T, Tensor, block, forward, graph, model
except ImportError:  # pragma: no cover - kiln-dsl not installed
    model = None
else:
    F = "fp32"

    @block
    class SeparateQkvBlock:
        """A Llama block written with separate q, k and v projections (as a model that does not pack qkv
        is): RMSNorm, standalone RoPE on q and k, GQA ``attention`` on [B, T, H, D] views, SwiGLU."""

        def __init__(self, d_model: int, num_query_heads: int, num_kv_heads: int, head_size: int, d_ff: int):
            self.d_model, self.hq, self.hkv, self.d, self.d_ff = (d_model, num_query_heads, num_kv_heads,
                                                                  head_size, d_ff)
            self.q_dim, self.kv_dim = num_query_heads * head_size, num_kv_heads * head_size

        ln1 = Param(Tensor["d_model", F], init="ones")
        ln2 = Param(Tensor["d_model", F], init="ones")
        wq = Param(Tensor["q_dim", "d_model", F])
        wk = Param(Tensor["kv_dim", "d_model", F])
        wv = Param(Tensor["kv_dim", "d_model", F])
        wo = Param(Tensor["d_model", "q_dim", F])
        w_gate_up = Param(Tensor["2 * d_ff", "d_model", F])
        w_down = Param(Tensor["d_model", "d_ff", F])

        @forward
        def forward(self, x: Tensor["B", "T", "d_model", F], position_ids: Tensor["T", "int32"]
                    ) -> Tensor["B", "T", "d_model", F]:
            with graph() as g:
                h, _ = g.rmsnorm(x, "ln1")
                flat = g.view(h, shape=[B * T, "d_model"])

                def proj(w: str, width: str, heads: str, rope: bool) -> Any:
                    y = g.view(g.matmul(flat, w, transpose="NT"), shape=[B, T, width])
                    if rope:
                        y = g.rope(y, None, position_ids, head_dim=self.d, theta=10000.0)
                    return g.view(y, shape=[B, T, heads, self.d])

                q, k = proj("wq", "q_dim", "hq", True), proj("wk", "kv_dim", "hkv", True)
                att, _ = g.flash_attention_qkv(q, k, proj("wv", "kv_dim", "hkv", False), causal=True)
                o = g.matmul(g.view(att, shape=[B * T, "q_dim"]), "wo", transpose="NT")
                x1 = g.add(x, g.view(o, shape=[B, T, "d_model"]))
                h2, _ = g.rmsnorm(x1, "ln2")
                act = g.swiglu(g.matmul(g.view(h2, shape=[B * T, "d_model"]), "w_gate_up", transpose="NT"))
                down = g.matmul(act, "w_down", transpose="NT")
                return g.add(x1, g.view(down, shape=[B, T, "d_model"]))

    @model
    class SeparateQkvLlama:
        def __init__(self, vocab_size: int, d_model: int, n_layers: int, num_query_heads: int,
                     num_kv_heads: int, head_size: int, d_ff: int):
            self.vocab_size, self.d_model, self.n_layers = vocab_size, d_model, n_layers
            self.num_query_heads, self.num_kv_heads = num_query_heads, num_kv_heads
            self.head_size, self.d_ff = head_size, d_ff

        embedding = Param(Tensor["vocab_size", "d_model", F])
        final_norm = Param(Tensor["d_model", F], init="ones")
        lm_head = Param(Tensor["vocab_size", "d_model", F])
        blocks = Param(Array["n_layers", "SeparateQkvBlock"])

        @forward
        def forward(self, token_ids: Tensor["B", "T", "int32"], position_ids: Tensor["T", "int32"],
                    targets: Tensor["B", "T", "int32"]) -> Tensor["B * T", F]:
            with graph() as g:
                x0 = g.embedding(token_ids, "embedding")
                xN = g.call("StackedBlocks", x0, position_ids, num_outputs=1, blocks="blocks",
                            n_layers=self.n_layers)
                xF, _ = g.rmsnorm(xN, "final_norm")
                return g.fused_lm_head_loss(g.view(xF, shape=[B * T, "d_model"]), "lm_head", targets)


def test_separate_qkv_llama_training_with_native_kernels_equals_numpy(tables: Any) -> None:
    """A model with separate q, k, v (attention, standalone rope) trains three steps with the native
    kernels to the NumPy kernels' losses, gradient norms and parameters within 1e-5; its eval loss
    (the forward-only LM-head loss) too."""
    if model is None:
        pytest.skip("the model comes from kiln-dsl")
    from kiln.dsl import build_bundle

    bundle = build_bundle(SeparateQkvLlama, LLAMA)
    with native_session().activate():
        program = compile(bundle, bindings={"B": 3, "T": 13})
    used = {s.op.type: s.kernel for s in program.steps}
    assert used["attention"] == "attention@numpy:float32"
    assert used["attention_backward"] == "attention_backward@numpy:float32"
    assert all(k == f"{op}@numpy:float32" for op, k in used.items() if op in OPS)
    sessions = (PluginSession(autoload=False), native_session())
    (want, want_p), (got, got_p) = (train(s, bundle) for s in sessions)
    for w, g in zip(want, got, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5)
    assert max(float(np.abs(want_p[k] - got_p[k]).max()) for k in want_p) < 1e-5
    # evaluation: the forward-only LM-head loss runs natively
    with native_session().activate():
        eval_program = Model.from_ir(bundle, seed=0).program(3, 13, task="eval")
    assert "fused_lm_head_loss@numpy:float32" in {s.kernel for s in eval_program.steps}
    (want_loss, _), (got_loss, _) = (evaluate(s, bundle) for s in sessions)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)


def evaluate(session: PluginSession, bundle: Any) -> tuple[float, dict[str, np.ndarray]]:
    """The eval loss (forward only: the LM head's fused_lm_head_loss) and one batch's gradients."""
    with session.activate():
        model = Model.from_ir(bundle, seed=0)
        b = batch()
        loss = model.loss(b["input_ids"], b["labels"])
        return loss, model.loss_and_grads(b["input_ids"], b["labels"])[1]


def test_gpt_neox_training_with_native_kernels_equals_numpy(tables: Any) -> None:
    """GPT-NeoX (LayerNorms with biases, partial RoPE, GELU): layernorm and its backward run natively;
    the eval loss, every gradient and three training steps' losses and gradient norms equal the NumPy
    kernels' within 1e-5. (Its parameters after three AdamW steps differ by a few 1e-5, 3e-5 already
    with the native kernels this package had before layernorm: AdamW's update of an element whose
    gradient is near 0 is ~lr whatever that gradient's last bits.)"""
    dsl = pytest.importorskip("kiln.dsl", reason="the model comes from kiln-dsl")
    from kiln.dsl.stdlib.models import GPTNeoXModel

    config = {"vocab_size": 96, "d_model": 48, "n_layers": 2, "num_query_heads": 4, "d_ff": 80, "max_seq": 16,
              "rope_parameters": {"partial_rotary_factor": 0.5}}
    bundle = dsl.build_bundle(GPTNeoXModel, config)
    with native_session().activate():
        program = compile(bundle, bindings={"B": 3, "T": 13})
    used = {s.op.type: s.kernel for s in program.steps}
    assert used["layernorm"] == "layernorm@numpy:float32"
    assert used["layernorm_backward"] == "layernorm_backward@numpy:float32"
    sessions = (PluginSession(autoload=False), native_session())
    (want_loss, want_g), (got_loss, got_g) = (evaluate(s, bundle) for s in sessions)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    for name, w in want_g.items():
        scale = float(np.abs(w).max())
        np.testing.assert_allclose(got_g[name], w, rtol=1e-5, atol=1e-5 * scale, err_msg=name)
    (want, _), (got, _) = (train(s, bundle) for s in sessions)
    for w, g in zip(want, got, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5)


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
