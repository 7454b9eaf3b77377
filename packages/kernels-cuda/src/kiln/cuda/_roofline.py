"""A roofline prediction of a training Program's step time on a GPU, from kiln's own op costs.

Each step of the Program takes ``max(flops / peak, bytes / bandwidth)`` plus a kernel launch, where
``flops`` and ``bytes`` are its op's cost (``OpDef.cost``: float32 bytes) and ``peak`` is the
device's float32 rate on CUDA cores, or, for the matmul-like ops with ``matmul="tf32"`` or ``"bf16"``,
its dense tensor-core rate. Matmul-like: the ops with the ``flop_heavy`` trait (matmuls, attention),
their backward ops, and any op doing at least :data:`MATMUL_INTENSITY` FLOPs per byte (the LM head
fused with its loss). A view costs nothing. The Program's fusions run as one step each: the LM head's
loss and gradient (``fused_lm_head_loss_and_grad``) is priced kernel by kernel in the tiling the CUDA
pass picks (:func:`lm_head_plan`, :func:`lm_head_cost`: one pass over row tiles of the whole
vocabulary, or two passes over row blocks and vocabulary chunks, whichever is predicted faster). MFU
is the FLOPs of the matmul-like steps (the model's own work, replayed activations included; the LM
head's fused pass counts its three products, not the logits its second pass computes again) over the predicted
time at the device's dense bf16 tensor-core peak, the usual yardstick.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import attrs

from kiln.core import KilnError, op_registry


@attrs.frozen
class Device:
    """A GPU's published peaks: FLOP/s on CUDA cores (float32) and tensor cores (dense, by input type),
    memory bandwidth in bytes/s, and the cost of one kernel launch in seconds."""

    name: str
    fp32: float
    tensor: Mapping[str, float]
    bandwidth: float
    launch: float = 4e-6


#: NVIDIA's data-sheet figures (SXM parts, dense tensor-core rates)
DEVICES = {
    "h100": Device("H100 SXM", 67e12, {"tf32": 494.7e12, "bf16": 989.4e12}, 3.35e12),
    "a100": Device("A100 SXM", 19.5e12, {"tf32": 156e12, "bf16": 312e12}, 2.039e12),
    "h200": Device("H200 SXM", 67e12, {"tf32": 494.7e12, "bf16": 989.4e12}, 4.8e12),
}
MATMUL = ("fp32", "tf32", "bf16")
#: the LM head's steps the roofline prices by their CUDA tiles: op -> the indices of x and the weight
LM_HEAD_STEPS = {"fused_lm_head_loss": (0, 1), "fused_lm_head_loss_backward": (1, 2)}
#: FLOPs per byte above which an op is a matmul in disguise (elementwise ops do a few)
MATMUL_INTENSITY = 64.0


def _gemm(dev: Device, peak: float, m: int, n: int, k: int, accumulate: bool) -> tuple[float, float, float]:
    """One ``[m, k] x [k, n]`` product (float32 bytes; reading ``out`` too when it accumulates): its
    seconds (roofline plus a launch), FLOPs and bytes."""
    flops, nbytes = 2.0 * m * n * k, 4.0 * (m * k + k * n + m * n * (2 if accumulate else 1))
    return max(flops / peak, nbytes / dev.bandwidth) + dev.launch, flops, nbytes


def _sweep(dev: Device, nbytes: float) -> tuple[float, float, float]:
    """One memory-bound kernel moving ``nbytes``."""
    return nbytes / dev.bandwidth + dev.launch, 0.0, nbytes


def lm_head_cost(n: int, v: int, c: int, rows: int, chunk: int, device: str = "h100",
                 matmul: str = "fp32", phase: str = "both",
                 softcap: bool = False) -> tuple[float, float, float]:
    """The predicted seconds, FLOPs and (float32) bytes of the LM head's fused loss-and-gradient pass over
    ``n`` rows of ``c`` features and a vocabulary of ``v``, in row blocks of ``rows`` and vocabulary chunks
    of ``chunk``, kernel by kernel (each ``max(flops / peak, bytes / bandwidth)`` plus a launch).

    ``chunk >= v``, one pass per row block: the logits ``z = x w^T``, the loss-and-gradient kernel (reads and
    writes ``z``), ``d_x = g w`` and ``d_w += g^T x``: three products, but the last two, like the first,
    sweep all of ``w`` (or ``d_w``, read and written) once per row block. ``chunk < v``, two passes per row
    block: pass 1 computes each chunk's logits and folds them into an online log-sum-exp; pass 2 computes
    them again, turns them into their gradient and adds ``g w_chunk`` to ``d_x`` and ``g^T x`` to
    ``d_w_chunk``: one product over the logits more, but ``w`` and ``d_w`` are swept once per (large) row
    block, and ``d_x`` once per chunk.

    ``phase`` ``"forward"`` or ``"backward"``: one of the two unfused steps instead (``chunk`` is then
    ``v``), as the CUDA composition runs them: the forward's logits (softcapped) and cross-entropy kernel;
    the backward's logits again, the cross-entropy backward kernel (the softcap's backward beside it),
    ``d_x`` and ``d_w``."""
    dev = DEVICES[device]
    peak = dev.tensor[matmul] if matmul != "fp32" else dev.fp32
    total = [0.0, 0.0, 0.0]

    def add(cost: tuple[float, float, float], times: int = 1) -> None:
        for i in range(3):
            total[i] += cost[i] * times

    chunk = min(chunk, v)
    for r0 in range(0, n, rows):
        r = min(rows, n - r0)
        first = r0 == 0
        if phase != "both":
            add(_gemm(dev, peak, r, v, c, False))
            if softcap:
                add(_sweep(dev, 8.0 * r * v))
            if phase == "forward":
                add(_sweep(dev, 4.0 * r * v + 16.0 * r))
                continue
            add(_sweep(dev, 8.0 * r * v))
            if softcap:
                add(_sweep(dev, 12.0 * r * v))
            add(_gemm(dev, peak, r, c, v, False))
            add(_gemm(dev, peak, v, c, r, not first))
            continue
        if chunk >= v:
            add(_gemm(dev, peak, r, v, c, False))
            add(_sweep(dev, 8.0 * r * v))
            add(_gemm(dev, peak, r, c, v, False))
            add(_gemm(dev, peak, v, c, r, not first))
            continue
        full, last = divmod(v, chunk)
        for vc, times in ((chunk, full), (last, 1 if last else 0)):
            add(_gemm(dev, peak, r, vc, c, False), 2 * times)  # the logits, in each pass
            add(_sweep(dev, 4.0 * r * vc), times)  # pass 1's online log-sum-exp
            add(_sweep(dev, 8.0 * r * vc), times)  # pass 2's gradient, in place
            add(_gemm(dev, peak, r, c, vc, True), times - (vc == chunk))  # d_x += g w_chunk
            add(_gemm(dev, peak, vc, c, r, not first), times)
        add(_gemm(dev, peak, r, c, chunk, False))  # the first chunk's d_x = g w_chunk, nothing to read
        add(_sweep(dev, 16.0 * r))  # lse and loss from the running sums
    return total[0], total[1], total[2]


@functools.lru_cache(maxsize=256)  # the CUDA pass asks on every run
def lm_head_plan(n: int, v: int, c: int, tile: int, device: str = "h100",
                 matmul: str = "fp32") -> tuple[int, int]:
    """The row block and vocabulary chunk of the LM head's fused pass predicted fastest by
    :func:`lm_head_cost`, holding at most ``tile`` logits at once: the one-pass tiling (rows over the
    whole vocabulary, ``tile // v`` of them) against two-pass tilings of ``rows`` in powers of two from 64
    with ``chunk = tile // rows`` (at least 256 words, fewer than ``v``). The trade: a long vocabulary
    leaves the one-pass tile few rows, so its ``d_w += g^T x`` reads and writes all of ``d_w`` (and its
    other two products read all of ``w``) once per handful of rows; the two-pass tiling recomputes the
    logits once (one ``2 n v c`` product more) but sweeps ``w`` and ``d_w`` once per block of
    ``rows`` rows, and ``d_x`` once per chunk, so it wins where the sweeps outweigh the product (a long
    vocabulary and many rows: Qwen3-0.6B's head at 8192 rows, on tensor cores and on CUDA cores alike);
    a small vocabulary or few rows keep the one pass. Ties go to the one pass."""
    one = (max(1, min(n, tile // max(v, 1))), v)
    best, best_s = one, lm_head_cost(n, v, c, *one, device, matmul)[0]
    rows = 64
    while rows < 2 * n and tile // rows >= 256:
        r, chunk = min(rows, n), tile // rows
        if chunk < v:
            secs = lm_head_cost(n, v, c, r, chunk, device, matmul)[0]
            if secs < best_s:
                best, best_s = (r, chunk), secs
        rows *= 2
    return best


@attrs.frozen
class Roofline:
    """The prediction: ``seconds`` per step, the FLOP-heavy FLOPs, MFU, and by op type (seconds,
    steps, FLOPs, bytes, whether bound by compute)."""

    device: Device
    matmul: str
    seconds: float
    model_flops: float
    tokens: int
    by_op: Mapping[str, tuple[float, int, float, float, bool]]
    #: the bf16 copies of float32 weights the bf16 matmuls read on cuBLASLt (``kiln.cuda._backend.
    #: weight_copies``): how many, and their bytes in the ``cuda`` backend's arena (memory kind ``held``);
    #: their casts, like the matmuls' bf16 reads, are not priced apart (op costs count float32 bytes)
    copies: int = 0
    copy_bytes: int = 0

    @property
    def mfu(self) -> float:
        return self.model_flops / self.seconds / self.device.tensor["bf16"]

    def table(self, top: int = 12) -> str:
        rows = sorted(self.by_op.items(), key=lambda kv: -kv[1][0])[:top]
        lines = [f"{'op':<34} {'steps':>6} {'GFLOP':>10} {'GB':>8} {'ms':>9}  bound by"]
        for op, (secs, n, flops, nbytes, compute) in rows:
            lines.append(f"{op:<34} {n:>6} {flops / 1e9:>10.1f} {nbytes / 1e9:>8.2f} {secs * 1e3:>9.2f}  "
                         f"{'compute' if compute else 'memory'}")
        if self.copies:
            lines.append(f"bf16 weight copies for cuBLASLt: {self.copies} weights, "
                         f"{self.copy_bytes / 1e6:.2f} MB in the cuda arena (memory kind 'held'), "
                         "cast once per step")
        lines.append(f"predicted step on {self.device.name} (matmuls in {self.matmul}): "
                     f"{self.seconds * 1e3:.4g} ms, {self.tokens / self.seconds:,.0f} tokens/s, "
                     f"MFU {self.mfu:.1%} of the bf16 peak")
        return "\n".join(lines)


def _as_cuda_fuses(program: Any) -> tuple[Any, ...]:
    """The LM head's fused pass the ``cuda`` backend would plan for a Program compiled for another backend
    (``kiln plan`` and ``kiln cuda roofline`` compile for ``numpy``, which has no bf16 pass and so fuses
    nothing under the bf16 recipe): kiln-core's pairing of the head's two steps (``head_pair``). A Program
    compiled for ``cuda`` keeps its own choice."""
    from kiln.core.plan import Fusion, head_pair

    if getattr(program, "backend", "cuda") == "cuda" or getattr(program, "task", "train") != "train":
        return ()
    pair = head_pair(program.steps, getattr(program, "computes", {}))
    if pair is None:
        return ()
    fwd, bwd = pair
    return (Fusion("fused_lm_head_loss_and_grad", (fwd.index, bwd.index), (bwd.inputs[0], *fwd.inputs),
                   (*fwd.outputs, *bwd.outputs[:2])),)


def roofline(program: Any, device: str = "h100", matmul: str = "fp32") -> Roofline:
    """The roofline of ``program`` (a compiled training Program) on ``device`` (a key of
    :data:`DEVICES`), its FLOP-heavy ops on CUDA cores (``fp32``) or tensor cores (``tf32``, ``bf16``)."""
    if device not in DEVICES:
        raise KilnError(f"unknown device {device!r}; kiln knows {', '.join(sorted(DEVICES))}")
    if matmul not in MATMUL:
        raise KilnError(f"matmul={matmul!r} is not one of {', '.join(MATMUL)}")
    from kiln.cuda import _ops

    dev, registry = DEVICES[device], op_registry()

    def matmul_like(op_type: str, flops: float, nbytes: float) -> bool:
        forward = op_type.removesuffix("_backward")
        heavy_forward = forward in registry and registry.get_op(forward).flop_heavy
        return (registry.get_op(op_type).flop_heavy or heavy_forward
                or flops >= MATMUL_INTENSITY * max(nbytes, 1.0))

    def cost_of(st: Any) -> tuple[float, float]:
        opdef = registry.get_op(st.op.type)
        shapes = [tuple(program.tensors[k].shape) if k else () for k in st.inputs]
        cost = opdef.cost(shapes, st.attrs) if opdef.cost is not None else None
        if cost is not None:
            return cost.flops, cost.bytes
        return 0.0, float(sum(program.tensors[k].nbytes for k in st.outputs if k))

    fused = {i: f for f in (getattr(program, "fusions", ()) or _as_cuda_fuses(program)) for i in f.steps}
    by_op: dict[str, list[Any]] = defaultdict(lambda: [0.0, 0, 0.0, 0.0, 0.0])
    total = model_flops = 0.0
    for st in program.steps:
        if st.how == "alias":
            continue
        fusion = fused.get(st.index) if fused else None
        if fusion is None and st.op.type in LM_HEAD_STEPS:  # the CUDA composition's tiles, kernel by kernel
            x_shape, w_shape = (program.tensors[st.inputs[i]].shape for i in LM_HEAD_STEPS[st.op.type])
            n, c, v = math.prod(x_shape[:-1]), x_shape[-1], w_shape[0]
            op_type, heavy = st.op.type, True
            phase = "forward" if op_type == "fused_lm_head_loss" else "backward"
            rows = max(1, min(n, _ops.LOGITS_TILE // max(v, 1)))
            secs, flops, nbytes = lm_head_cost(n, v, c, rows, v, device, matmul, phase,
                                               st.attrs.get("softcap") is not None)
            peak = dev.tensor[matmul] if matmul != "fp32" else dev.fp32
            compute, memory = flops / peak, nbytes / dev.bandwidth
        elif fusion is None:
            op_type, (flops, nbytes) = st.op.type, cost_of(st)
            heavy = matmul_like(op_type, flops, nbytes)
        elif st.index != fusion.steps[0]:
            continue
        else:  # the fused pass, kernel by kernel, in the tiling it would run (lm_head_plan)
            (n, c), v = program.tensors[fusion.inputs[1]].shape, program.tensors[fusion.inputs[2]].shape[0]
            op_type, heavy = fusion.kind, True
            plan = lm_head_plan(n, v, c, _ops.LOGITS_TILE, device, matmul)
            secs, flops, nbytes = lm_head_cost(n, v, c, *plan, device, matmul)
            peak = dev.tensor[matmul] if matmul != "fp32" else dev.fp32
            compute, memory = flops / peak, nbytes / dev.bandwidth
            # MFU counts the head's three products (the logits, d_x, d_W), not the second pass's logits:
            # 6 n v c in all, the ``flops`` added below replaced
            model_flops += 6.0 * n * v * c - flops
        if fusion is None and st.op.type not in LM_HEAD_STEPS:
            peak = dev.tensor[matmul] if heavy and matmul != "fp32" else dev.fp32
            compute, memory = flops / peak, nbytes / dev.bandwidth
            secs = max(compute, memory) + dev.launch
        total += secs
        if heavy:
            model_flops += flops
        row = by_op[op_type]
        row[0] += secs
        row[1] += 1
        row[2] += flops
        row[3] += nbytes
        row[4] += compute - memory  # which bound dominates over this op's steps
    copies: tuple[Any, ...] = ()
    if matmul == "bf16" and getattr(getattr(program, "precision", None), "lowers", False):
        from kiln.cuda._backend import weight_copies

        copies = weight_copies(program, None)
    b, t = (int(program.bindings[k]) for k in ("B", "T"))
    return Roofline(dev, matmul, total, model_flops, b * t,
                    {op: (r[0], r[1], r[2], r[3], r[4] > 0) for op, r in by_op.items()},
                    len(copies), sum(c.nbytes for c in copies))
