"""One side of ``bench_gpu.py`` in a process of its own: build, warm up, time, measure memory, answer.

``python gpu_sides.py SIDE SPEC_JSON`` builds SIDE's model for the shape in SPEC_JSON, runs
``warmup`` training steps (forward, backward, global-norm clipping, AdamW), then ``steps`` timed ones,
and prints one JSON line: the seconds of each timed step, the peak device memory of the timed steps and
of everything before them, the driver's view of used memory and the library versions. Sides:

* ``kiln-fp32``, ``kiln-bf16``: kiln-dsl's ``Qwen3Model`` on kiln's ``cuda`` backend under the ``fp32``
  or ``bf16`` precision recipe. This process never imports torch. Peak memory is the high-water mark of
  the device allocations the backend makes (the arena, whose head holds weights, gradients and optimizer
  state, plus the Executable's small tables), counted by wrapping the device's ``alloc`` and ``free``;
  the driver's used memory (``cuMemGetInfo``) before the model and after the timed steps is the
  cross-check (it also sees cuBLASLt's workspace and the loaded kernels' code).
* ``eager-fp32``, ``eager-bf16``, ``compile-fp32``, ``compile-bf16``: transformers' ``Qwen3ForCausalLM``
  (``attn_implementation="sdpa"``), eager or through ``torch.compile``; fp32 is plain float32 (torch's
  default: no TF32 matmuls), bf16 is ``torch.autocast(dtype=torch.bfloat16)`` over float32 weights,
  gradients and AdamW state, the recipe kiln's ``bf16`` follows. Peak memory is
  ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.

With ``"dry_run": true`` the kiln sides run on kiln.cuda's ``EmulatedCuda`` (the kernels on the CPU) and
the torch sides on the CPU, where peak memory is the process's peak RSS above its size after the
imports: every code path runs, the figures mean nothing.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

LR = 1e-3
MAX_GRAD_NORM = 1.0  # every side clips by global norm, as kiln's AdamW does by default
ROPE_THETA = 1e6  # Qwen3-0.6B's
SIDES = ("kiln-bf16", "eager-bf16", "kiln-fp32", "eager-fp32", "compile-bf16", "compile-fp32")


def batch_ids(shape: dict[str, int]) -> Any:
    """The same random token ids on every side: ``[batch, seq + 1]`` int32, seeded."""
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.integers(0, shape["vocab"], (shape["batch"], shape["seq"] + 1)).astype(np.int32)


def _rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Allocations:
    """Live bytes of a kiln device's allocations and their high-water mark, by wrapping its ``alloc`` and
    ``free`` (instance attributes, so the finalizers the backend registers call the wrappers)."""

    def __init__(self, dev: Any) -> None:
        self.live = self.high = 0
        self.sizes: dict[int, int] = {}
        alloc, free = dev.alloc, dev.free

        def counted_alloc(nbytes: int) -> int:
            ptr = int(alloc(nbytes))
            self.sizes[ptr] = max(int(nbytes), 1)
            self.live += self.sizes[ptr]
            self.high = max(self.high, self.live)
            return ptr

        def counted_free(ptr: int) -> None:
            free(ptr)
            self.live -= self.sizes.pop(int(ptr), 0)

        dev.alloc, dev.free = counted_alloc, counted_free

    def reset(self) -> int:
        """Starts a new high-water mark from the live bytes; returns the old mark."""
        old, self.high = self.high, self.live
        return old


def _driver_used(dev: Any) -> int | None:
    """The device's used memory by the driver's count (``total - free``); None on the emulator."""
    driver = getattr(dev, "driver", None)
    if driver is None:
        return None
    err, free, total = driver.cuMemGetInfo()
    return None if int(err) else int(total) - int(free)


def kiln_side(side: str, spec: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    import kiln.core
    import kiln.cuda
    from kiln.core import AdamW, Model, PluginSession, get_registry
    from kiln.dsl import build_bundle
    from kiln.dsl.stdlib.models import Qwen3Model

    shape, recipe = spec["shape"], side.split("-")[1]
    bundle = build_bundle(Qwen3Model, {
        "vocab_size": shape["vocab"], "d_model": shape["hidden"], "n_layers": shape["layers"],
        "num_query_heads": shape["heads"], "num_kv_heads": shape["kv_heads"], "head_size": shape["head_dim"],
        "d_ff": shape["intermediate"], "max_seq": shape["seq"], "rope_theta": ROPE_THETA,
        "tie_word_embeddings": bool(shape["tied"]),
    })
    if spec["dry_run"]:  # kiln's kernels and `cuda` over the CPU emulator, the installed plugin not loaded
        session = PluginSession(autoload=False)
        session.register(kiln.cuda.EmulatedCuda(), "cuda-emulated")
        active = session.activate()  # held until the process ends
        active.__enter__()
    dev = get_registry("backends")["cuda"].gpu
    counted = Allocations(dev)
    used_before = _driver_used(dev)
    model = Model.from_ir(bundle, seed=0, backend="cuda", precision=recipe,
                          optimizer=AdamW(lr=LR, max_grad_norm=MAX_GRAD_NORM))
    ids = batch_ids(shape)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}

    def step() -> float:
        loss = model.train_step(batch)["loss"]
        dev.synchronize()
        return float(loss)

    losses, seconds, setup = _run(step, spec, counted.reset)
    planned = {k: v for k, v in model.memory_report().items() if isinstance(v, int)}
    used_after = _driver_used(dev)
    blas = getattr(dev, "blas", None)
    return {
        "seconds": seconds, "losses": losses, "peak_bytes": counted.high, "setup_peak_bytes": setup,
        "peak_source": "kiln device allocations (arena + tables), high-water mark",
        "arena_bytes": model.arena_bytes, "planned": planned,
        "driver_used_bytes": None if used_before is None or used_after is None else used_after - used_before,
        "torch_imported": "torch" in sys.modules,
        "info": {"kiln-core": kiln.core.__version__, "kiln-kernels-cuda": kiln.cuda.__version__,
                 "numpy": np.__version__, "device": _kiln_device_name(dev), "arch": dev.arch,
                 "matmuls": "cuBLASLt" if blas is not None else
                 getattr(dev, "blas_error", "SIMT kernels (the emulator)")},
    }


def _kiln_device_name(dev: Any) -> str:
    driver = getattr(dev, "driver", None)
    if driver is None:
        return str(dev.name)
    err, name = driver.cuDeviceGetName(256, dev.handle)
    return name.split(b"\0", 1)[0].decode() if not int(err) else "unknown GPU"


def torch_side(side: str, spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape, (mode, recipe) = spec["shape"], side.split("-")
    gpu = not spec["dry_run"]
    device = torch.device("cuda" if gpu else "cpu")
    import_rss = _rss()
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
        max_position_embeddings=shape["seq"],
        tie_word_embeddings=bool(shape["tied"]), rope_theta=ROPE_THETA, attn_implementation="sdpa",
        use_cache=False,
    )
    model = Qwen3ForCausalLM(config).to(device).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    ids = torch.from_numpy(batch_ids(shape)[:, :-1].astype("int64")).to(device)
    forward = torch.compile(model) if mode == "compile" else model  # compiles in the first warm-up step

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=recipe == "bf16"):
            loss = forward(input_ids=ids, labels=ids).loss  # transformers shifts the labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        opt.step()
        if gpu:
            torch.cuda.synchronize()
        return float(loss.detach())

    def reset() -> int:
        if not gpu:
            return _rss_peak() - import_rss
        setup = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return int(setup)

    used_before = None
    if gpu:
        free, total = torch.cuda.mem_get_info()
        used_before = total - free
    losses, seconds, setup = _run(step, spec, reset)
    result: dict[str, Any] = {"seconds": seconds, "losses": losses}
    if gpu:
        free, total = torch.cuda.mem_get_info()
        result.update(peak_bytes=int(torch.cuda.max_memory_allocated()), setup_peak_bytes=setup,
                      peak_source="torch.cuda.max_memory_allocated after reset_peak_memory_stats",
                      reserved_bytes=int(torch.cuda.max_memory_reserved()),
                      driver_used_bytes=int(total - free) - used_before)
    else:
        result.update(peak_bytes=_rss_peak() - import_rss, setup_peak_bytes=setup,
                      peak_source="peak RSS above the imports (CPU dry run)", driver_used_bytes=None)
    result["info"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                      "device": torch.cuda.get_device_name() if gpu else "cpu",
                      "cuda": torch.version.cuda, "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
                      "attention": model.config._attn_implementation}
    return result


def _run(step: Callable[[], float], spec: dict[str, Any],
         reset: Callable[[], int]) -> tuple[list[float], list[float], int]:
    """``warmup`` steps, the peak-memory reset, then ``steps`` timed steps: the losses of all steps, the
    timed steps' seconds, and the peak ``reset`` returned (that of the build and the warm-up)."""
    losses = [step() for _ in range(spec["warmup"])]
    setup = reset()
    seconds = []
    for _ in range(spec["steps"]):
        t = time.perf_counter()
        losses.append(step())
        seconds.append(time.perf_counter() - t)
    return losses, seconds, setup


def main(side: str, spec_json: str) -> None:
    # the answer goes to the original stdout; anything a library prints goes to stderr
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if side not in SIDES:
        raise SystemExit(f"unknown side {side!r}; the sides are {', '.join(SIDES)}")
    spec = json.loads(spec_json)
    result = kiln_side(side, spec) if side.startswith("kiln") else torch_side(side, spec)
    result["median_seconds"] = statistics.median(result["seconds"])
    answer.write(json.dumps(result) + "\n")
    answer.flush()


if __name__ == "__main__":
    main(*sys.argv[1:3])
