"""A roofline prediction of a training Program's step time on a GPU, from kiln's own op costs.

Each step of the Program takes ``max(flops / peak, bytes / bandwidth)`` plus a kernel launch, where
``flops`` and ``bytes`` are its op's cost (``OpDef.cost``: float32 bytes) and ``peak`` is the
device's float32 rate on CUDA cores, or, for the matmul-like ops with ``matmul="tf32"`` or ``"bf16"``,
its dense tensor-core rate. Matmul-like: the ops with the ``flop_heavy`` trait (matmuls, attention),
their backward ops, and any op doing at least :data:`MATMUL_INTENSITY` FLOPs per byte (the LM head
fused with its loss). A view costs nothing. The Program's fusions run as one step each: the LM head's
loss and gradient in one pass (``fused_lm_head_loss_and_grad``) cost its forward and backward steps
less the backward's recompute of the logits (one product and one read of x and the weight fewer). MFU
is the FLOPs of the matmul-like steps (the model's own work, recomputation included) over the predicted
time at the device's dense bf16 tensor-core peak, the usual yardstick.
"""

from __future__ import annotations

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
#: FLOPs per byte above which an op is a matmul in disguise (elementwise ops do a few)
MATMUL_INTENSITY = 64.0


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

    @property
    def mfu(self) -> float:
        return self.model_flops / self.seconds / self.device.tensor["bf16"]

    def table(self, top: int = 12) -> str:
        rows = sorted(self.by_op.items(), key=lambda kv: -kv[1][0])[:top]
        lines = [f"{'op':<34} {'steps':>6} {'GFLOP':>10} {'GB':>8} {'ms':>9}  bound by"]
        for op, (secs, n, flops, nbytes, compute) in rows:
            lines.append(f"{op:<34} {n:>6} {flops / 1e9:>10.1f} {nbytes / 1e9:>8.2f} {secs * 1e3:>9.2f}  "
                         f"{'compute' if compute else 'memory'}")
        lines.append(f"predicted step on {self.device.name} (matmuls in {self.matmul}): "
                     f"{self.seconds * 1e3:.4g} ms, {self.tokens / self.seconds:,.0f} tokens/s, "
                     f"MFU {self.mfu:.1%} of the bf16 peak")
        return "\n".join(lines)


def roofline(program: Any, device: str = "h100", matmul: str = "fp32") -> Roofline:
    """The roofline of ``program`` (a compiled training Program) on ``device`` (a key of
    :data:`DEVICES`), its FLOP-heavy ops on CUDA cores (``fp32``) or tensor cores (``tf32``, ``bf16``)."""
    if device not in DEVICES:
        raise KilnError(f"unknown device {device!r}; kiln knows {', '.join(sorted(DEVICES))}")
    if matmul not in MATMUL:
        raise KilnError(f"matmul={matmul!r} is not one of {', '.join(MATMUL)}")
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

    fused = {i: f for f in getattr(program, "fusions", ()) for i in f.steps}
    by_op: dict[str, list[Any]] = defaultdict(lambda: [0.0, 0, 0.0, 0.0, 0.0])
    total = model_flops = 0.0
    for st in program.steps:
        if st.how == "alias":
            continue
        fusion = fused.get(st.index) if fused else None
        if fusion is None:
            op_type, (flops, nbytes) = st.op.type, cost_of(st)
            heavy = matmul_like(op_type, flops, nbytes)
        elif st.index != fusion.steps[0]:
            continue
        else:  # the fused steps' costs, less the logits product and the reads of x and w they repeat
            costs = [cost_of(program.steps[i]) for i in fusion.steps]
            (n, c), v = program.tensors[fusion.inputs[1]].shape, program.tensors[fusion.inputs[2]].shape[0]
            op_type, heavy = fusion.kind, True
            flops = sum(f for f, _ in costs) - 2.0 * n * v * c
            nbytes = sum(b for _, b in costs) - 4.0 * (n * c + v * c)
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
    b, t = (int(program.bindings[k]) for k in ("B", "T"))
    return Roofline(dev, matmul, total, model_flops, b * t,
                    {op: (r[0], r[1], r[2], r[3], r[4] > 0) for op, r in by_op.items()})
