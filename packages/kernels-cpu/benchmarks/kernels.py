"""Each native kernel against the NumPy kernel it replaces, on the benchmark's tiny config (B 8, T 256,
4 query heads and 2 kv heads of 64, C 256, vocabulary 8192, MLP 768): the best of ``--repeat`` samples (each a
loop of calls that takes ~20 ms, per call), in CPU time (``time.process_time``: every thread of the
process; on a shared machine the figure to read) and wall time, on one thread and on two
(``KILN_NUM_THREADS``; BLAS held to one thread, as a Program run holds it), each thread count in a
process of its own.

    python packages/kernels-cpu/benchmarks/kernels.py [--ops attention,rope] [--repeat 7] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

B, T, HQ, HKV, D, C, V, FF = 8, 256, 4, 2, 64, 256, 8192, 768


def rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def cases() -> dict[str, Callable[[np.random.Generator], tuple[list[Any], dict[str, Any]]]]:
    """op -> a function that makes its arguments (positional, keywords: outputs preallocated)."""
    attn = {"causal": True, "softmax_scale": None, "window_size": None}

    def attention(rng: np.random.Generator) -> tuple[list[Any], dict[str, Any]]:
        q, k, v = rand(rng, B, T, HQ, D), rand(rng, B, T, HKV, D), rand(rng, B, T, HKV, D)
        return [q, k, v, None], {"out": [np.empty_like(q), np.empty((B, HQ, T), np.float32)], **attn}

    def attention_backward(rng: np.random.Generator) -> tuple[list[Any], dict[str, Any]]:
        from kiln.core import op_registry

        q, k, v = rand(rng, B, T, HQ, D), rand(rng, B, T, HKV, D), rand(rng, B, T, HKV, D)
        o, lse = op_registry().get_op("attention").kernel(q, k, v, None, **attn)
        outs = [np.empty_like(q), np.empty_like(k), np.empty_like(v)]
        return [rand(rng, B, T, HQ, D), q, k, v, o, lse, None, None], {"out": outs, **attn}

    head = {"ignore_index": -100, "chunk_size": 4096, "softcap": None}
    n = B * T

    def lm_head(rng: np.random.Generator) -> tuple[list[Any], dict[str, Any]]:
        x, w, t = rand(rng, n, C), rand(rng, V, C) * 0.05, rng.integers(0, V, n)
        return [x, w, t], {"out": [np.empty(n, np.float32), np.empty(n, np.float32)], **head}

    def lm_head_backward(rng: np.random.Generator) -> tuple[list[Any], dict[str, Any]]:
        from kiln.core import op_registry

        x, w, t = rand(rng, n, C), rand(rng, V, C) * 0.05, rng.integers(0, V, n)
        _, lse = op_registry().get_op("fused_lm_head_loss").kernel(x, w, t, **head)
        d_loss = np.full(n, 1 / n, np.float32)
        return [d_loss, x, w, t, lse, None], {"out": [np.empty_like(x), np.empty_like(w)], **head}

    def cross_entropy(rng: np.random.Generator) -> tuple[list[Any], dict[str, Any]]:
        return [rand(rng, n, V) * 4, rng.integers(0, V, n)], {"ignore_index": -100}

    def rope(rng: np.random.Generator) -> tuple[list[Any], dict[str, Any]]:
        x = rand(rng, B, T, HQ * D)
        return [x, None, np.arange(T)], {"out": [np.empty_like(x)], "head_dim": D, "rotary_dim": None,
                                         "theta": 10000.0, "inverse": False}

    def qk_norm(rng: np.random.Generator) -> tuple[list[Any], dict[str, Any]]:
        return [rand(rng, B, T, HQ, D), rand(rng, B, T, HKV, D), rand(rng, D), rand(rng, D)], {"eps": 1e-6}

    def layernorm(rng: np.random.Generator) -> tuple[list[Any], dict[str, Any]]:
        return [rand(rng, B, T, C), rand(rng, C), rand(rng, C)], {"eps": 1e-5}

    def layernorm_backward(rng: np.random.Generator) -> tuple[list[Any], dict[str, Any]]:
        from kiln.core import op_registry

        x, w = rand(rng, B, T, C), rand(rng, C)
        _, mean, rstd = op_registry().get_op("layernorm").kernel(x, w, None, eps=1e-5)
        return [rand(rng, B, T, C), x, mean, rstd, w, None, None], {}

    def gelu(rng: np.random.Generator) -> tuple[list[Any], dict[str, Any]]:
        return [rand(rng, B * T, FF)], {"approximate": "none"}

    def gelu_backward(rng: np.random.Generator) -> tuple[list[Any], dict[str, Any]]:
        return [rand(rng, B * T, FF), rand(rng, B * T, FF)], {"approximate": "none"}

    def gelu_tanh(rng: np.random.Generator) -> tuple[list[Any], dict[str, Any]]:
        return [rand(rng, B * T, FF)], {"approximate": "tanh"}

    return {"gelu": gelu, "gelu_backward": gelu_backward, "gelu (tanh)": gelu_tanh,
            "attention": attention, "attention_backward": attention_backward, "fused_lm_head_loss": lm_head,
            "fused_lm_head_loss_backward": lm_head_backward, "cross_entropy": cross_entropy, "rope": rope,
            "qk_norm": qk_norm, "layernorm": layernorm, "layernorm_backward": layernorm_backward}


def measure(ops: list[str], repeat: int) -> dict[str, dict[str, float]]:
    from kiln.core import PluginSession, get_registry
    from kiln.core._threads import blas_held_to_one_thread
    from kiln.cpu import _plugin

    native_session = PluginSession(autoload=False)
    native_session.register(_plugin, "cpu")
    with native_session.activate():
        native = get_registry("kernels")
    with PluginSession(autoload=False).activate():
        numpy = get_registry("kernels")
    found: dict[str, dict[str, float]] = {}
    make = cases()
    with blas_held_to_one_thread():
        for op in ops:
            args, kw = make[op](np.random.default_rng(0))
            name = op.split()[0]  # "gelu (tanh)": op gelu
            for side, table in (("native", native), ("numpy", numpy)):
                fn = table.find(name, "numpy", "float32" if side == "native" else "*").fn
                w = time.perf_counter()
                fn(*args, **kw)  # warm-up; then each sample times enough calls to take ~20 ms
                calls = max(1, min(100, int(0.02 / max(time.perf_counter() - w, 1e-6))))
                cpu, wall = [], []
                for _ in range(repeat):
                    c, w = time.process_time(), time.perf_counter()
                    for _ in range(calls):
                        fn(*args, **kw)
                    cpu.append((time.process_time() - c) / calls)
                    wall.append((time.perf_counter() - w) / calls)
                found.setdefault(op, {})[f"{side}_cpu"] = min(cpu)
                found[op][f"{side}_wall"] = min(wall)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default=",".join(cases()))
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = parser.parse_args()
    ops = a.ops.split(",")
    if a.child:
        print(json.dumps(measure(ops, a.repeat)))
        return
    results = {}
    for n in a.threads.split(","):
        command = [sys.executable, __file__, "--child", "--ops", a.ops, "--repeat", str(a.repeat)]
        done = subprocess.run(command,
                              env={**os.environ, "KILN_NUM_THREADS": n}, capture_output=True, text=True)
        if done.returncode:
            sys.exit(done.stderr)
        results[n] = json.loads(done.stdout.strip().splitlines()[-1])
    if a.markdown:
        heads = " | ".join(f"NumPy / C, {n} thread{'s' if n != '1' else ''}" for n in results)
        print(f"| op | {heads} |\n| --- |" + " --- |" * len(results))
    for op in ops:
        cells = []
        for r in results.values():
            x = r[op]
            cells.append(f"{x['numpy_cpu'] * 1e3:.2f} / {x['native_cpu'] * 1e3:.2f} ms CPU "
                         f"({x['numpy_cpu'] / x['native_cpu']:.1f}x; wall {x['numpy_wall'] * 1e3:.2f} / "
                         f"{x['native_wall'] * 1e3:.2f})")
        print(f"| `{op}` | " + " | ".join(cells) + " |" if a.markdown else f"{op}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
