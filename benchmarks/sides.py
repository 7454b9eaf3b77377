"""One side of the benchmark in its own process: kiln's NumPy backend or HF transformers.

``python benchmarks/sides.py SIDE CONFIG`` builds that side's model and batch, then answers one
JSON line per command read from stdin. Sides: ``kiln`` (the NumPy backend with kiln-kernels-cpu's
native kernels where installed), ``kiln-ref`` (the NumPy backend's NumPy kernels only:
``KILN_CPU_KERNELS=0``), ``hf`` (transformers eager) and ``compile`` (the same model through
``torch.compile``, inductor on the CPU); ``kiln:block``, ``kiln:auto`` and ``kiln:dsl`` build kiln's
model with that recompute mode, ``auto`` at its default budget (half the saved activations):

* ``step``: one full training step (forward, backward, AdamW), ``{"seconds": ...}``;
* ``memory``: ``{"peak_rss": ..., "import_rss": ...}`` in bytes (the process's high-water mark, and
  its resident size after the imports, before the model was built); a kiln side adds its planned
  ``memory_report()`` under ``planned``;
* ``info``: library versions and the BLAS each library runs (threadpoolctl, torch's build config);
* ``quit``.

The driver (``run.py``) keeps one process per side alive and sends ``step`` to each in turn, so the
two sides run interleaved on the same machine, and each one's peak memory is its own.

``python benchmarks/sides.py matmul numpy|torch`` prints the float32 rate of a large matmul (GFLOP/s,
best of a few) in a process of its own.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

CONFIGS: dict[str, dict[str, int]] = {
    "tiny": {"hidden": 256, "layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 64, "intermediate": 768,
             "vocab": 8192, "batch": 8, "seq": 256},
    "small": {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 4, "head_dim": 64, "intermediate": 1536,
              "vocab": 16384, "batch": 4, "seq": 512},
}
ROPE_THETA = 10000.0  # transformers' Qwen3Config default
LR = 1e-3
MAX_GRAD_NORM = 1.0  # both sides clip by global norm, as kiln's AdamW does by default
MATMUL_N = 2048
IMPORTS = {"kiln": ("numpy", "kiln.core", "kiln.dsl"),
           "hf": ("numpy", "torch", "transformers", "transformers.models.qwen3.modeling_qwen3")}
IMPORTS["kiln-ref"], IMPORTS["compile"] = IMPORTS["kiln"], IMPORTS["hf"]


def training_flops(c: dict[str, int]) -> float:
    """Model FLOPs of one training step (3x the forward: the backward costs two forwards).

    Counts every matmul of the model once and the causal half of the attention score and value
    products; recomputation (kiln's LM-head backward recomputes the logits) is not counted, so both
    sides are credited with the same work.
    """
    tokens = c["batch"] * c["seq"]
    q, kv, d = c["heads"], c["kv_heads"], c["head_dim"]
    per_layer = c["hidden"] * ((q + 2 * kv) * d + q * d + 3 * c["intermediate"])
    dense = 2.0 * tokens * (c["layers"] * per_layer + c["hidden"] * c["vocab"])
    attention = 2.0 * 2.0 * c["batch"] * c["seq"] ** 2 * q * d * c["layers"] * 0.5
    return 3.0 * (dense + attention)


def _batch(c: dict[str, int]) -> Any:
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.integers(0, c["vocab"], (c["batch"], c["seq"] + 1)).astype(np.int32)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _best_rate(run: Callable[[], object], flops: float, repeats: int = 5) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return flops / best / 1e9


def _blas() -> list[dict[str, Any]]:
    from threadpoolctl import threadpool_info

    keys = ("user_api", "internal_api", "prefix", "version", "architecture", "threading_layer",
            "num_threads")
    return [{k: lib.get(k) for k in keys} for lib in threadpool_info()]


# --- kiln ------------------------------------------------------------------------------------------


def kiln_bundle(c: dict[str, int]) -> Any:
    """The config's model as kiln-dsl's Qwen3Model, untied."""
    import kiln.dsl

    if "Qwen3Model" not in kiln.dsl.list_registered_models():
        raise SystemExit("kiln-dsl has no Qwen3Model: install the kiln packages (nox -s bench does)")
    return kiln.dsl.build_bundle("Qwen3Model", {
        "vocab_size": c["vocab"], "d_model": c["hidden"], "n_layers": c["layers"],
        "num_query_heads": c["heads"], "num_kv_heads": c["kv_heads"], "d_ff": c["intermediate"],
        "max_seq": c["seq"], "head_size": c["head_dim"], "rope_theta": ROPE_THETA,
        "tie_word_embeddings": False,
    })


def kiln_side(c: dict[str, int], recompute: str = "none") -> tuple[Callable[[], None], dict[str, Any],
                                                                   Callable[[], dict[str, int]]]:
    import numpy as np

    import kiln.core
    from kiln.core import AdamW, Model

    model = Model.from_ir(kiln_bundle(c), seed=0, optimizer=AdamW(lr=LR, max_grad_norm=MAX_GRAD_NORM),
                          recompute=recompute)
    ids = _batch(c)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}

    try:
        import kiln.cpu

        native = kiln.cpu.unavailable_reason() or f"on (kiln-kernels-cpu {kiln.cpu.__version__})"
    except ImportError:
        native = "off (kiln-kernels-cpu is not installed)"
    info = {"numpy": np.__version__, "kiln-core": kiln.core.__version__, "native kernels": native,
            "blas": _blas()}

    def step() -> None:
        model.train_step(batch)

    def planned() -> dict[str, int]:
        return {k: v for k, v in model.memory_report().items() if isinstance(v, int)}

    return step, info, planned


# --- transformers ----------------------------------------------------------------------------------


def hf_side(c: dict[str, int], compiled: bool = False) -> tuple[Callable[[], None], dict[str, Any], None]:
    import torch
    import transformers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["intermediate"],
        num_hidden_layers=c["layers"], num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
        head_dim=c["head_dim"], max_position_embeddings=c["seq"], tie_word_embeddings=False,
        attn_implementation="sdpa", use_cache=False,
    )
    model = Qwen3ForCausalLM(config).float().train()
    assert model.config._attn_implementation == "sdpa"
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    ids = torch.from_numpy(_batch(c)[:, :-1].astype("int64"))
    forward = torch.compile(model) if compiled else model  # inductor; compiles in the first (warm-up) step

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = forward(input_ids=ids, labels=ids).loss  # transformers shifts the labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        opt.step()

    build = torch.__config__.show()
    wanted = re.findall(r"BLAS_INFO=\w+|Math Kernel Library Version [\w.]+|CPU capability usage: \w+", build)
    info = {"torch": torch.__version__, "transformers": transformers.__version__,
            "threads": torch.get_num_threads(), "blas": _blas(), "torch_blas": wanted,
            "mode": "torch.compile (inductor)" if compiled else "eager"}
    return step, info, None


def matmul_rate(library: str) -> float:
    """GFLOP/s of a float32 [N, N] @ [N, N] in ``library`` (numpy or torch, all cores), best of 5."""
    if library == "torch":
        import torch

        torch.set_num_threads(os.cpu_count() or 1)
        a = torch.ones(MATMUL_N, MATMUL_N)
        out = torch.empty_like(a)
        return _best_rate(lambda: torch.matmul(a, a, out=out), 2.0 * MATMUL_N**3)
    import numpy as np

    b = np.ones((MATMUL_N, MATMUL_N), np.float32)
    res = np.empty_like(b)
    return _best_rate(lambda: np.matmul(b, b, out=res), 2.0 * MATMUL_N**3)


def main(side: str, config: str) -> None:
    # answers go to the original stdout; anything a library prints goes to stderr
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    library, _, recompute = side.partition(":")
    if library == "kiln-ref":  # before kiln loads its plugins
        os.environ["KILN_CPU_KERNELS"] = "0"
    for name in IMPORTS[library]:  # imported first, so that import_rss is the libraries' own footprint
        importlib.import_module(name)
    import_rss = _rss()
    if library in ("kiln", "kiln-ref"):
        step, info, planned = kiln_side(CONFIGS[config], recompute or "none")
    else:
        step, info, planned = hf_side(CONFIGS[config], compiled=library == "compile")

    def reply(value: dict[str, Any]) -> None:
        answers.write(json.dumps(value) + "\n")
        answers.flush()

    reply({"ready": True})
    for line in sys.stdin:
        command = line.strip()
        if command == "step":
            t = time.perf_counter()
            step()
            reply({"seconds": time.perf_counter() - t})
        elif command == "memory":
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
            reply({"peak_rss": peak, "import_rss": import_rss, **({"planned": planned()} if planned else {})})
        elif command == "info":
            reply(info)
        elif command == "quit":
            return
        else:
            reply({"error": f"unknown command {command!r}"})


if __name__ == "__main__":
    if sys.argv[1] == "matmul":
        print(matmul_rate(sys.argv[2]))
    else:
        main(*sys.argv[1:3])
