"""Every CUDA kernel run against its op's NumPy reference on one device (a GPU, or the CPU emulator).

Each case is an op of kiln-core's library with random inputs, ragged shapes among them (not multiples
of a warp, a block or a tile): the reference is the op's own ``OpDef.kernel``, computed in float64 from
the same float32 inputs; the kernel runs on device copies. The tests run every case through the
emulator here and on the GPU under ``nox -s gpu``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import attrs
import numpy as np

from kiln.core import op_registry
from kiln.cuda._ops import KERNELS, DeviceArray

Build = Callable[[np.random.Generator], tuple[tuple[Any, ...], dict[str, Any]]]


@attrs.frozen
class Case:
    id: str
    op: str
    build: Build
    atol: float = 1e-5


def _n(rng: np.random.Generator, *shape: int, s: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * s).astype(np.float32)


def _cases() -> Iterator[Case]:
    def c(id: str, op: str, build: Build, atol: float = 1e-5) -> Case:
        return Case(id, op, build, atol)

    yield c("scale", "scale", lambda r: ((_n(r, 3, 37),), {"factor": -0.7}))
    yield c("add-same", "add", lambda r: ((_n(r, 4, 33), _n(r, 4, 33)), {}))
    yield c("add-trailing", "add", lambda r: ((_n(r, 2, 5, 33), _n(r, 1, 5, 33)), {}))
    yield c("mul-trailing", "mul", lambda r: ((_n(r, 3, 7, 9), _n(r, 9)), {}))
    yield c("bias_add", "bias_add", lambda r: ((_n(r, 2, 3, 37), _n(r, 37)), {}))
    for op in ("silu", "relu"):
        yield c(op, op, lambda r: ((_n(r, 5, 61, s=2),), {}))
        yield c(f"{op}_backward", f"{op}_backward", lambda r: ((_n(r, 5, 61), _n(r, 5, 61, s=2)), {}))
    for approx in ("tanh", "none"):
        yield c(f"gelu-{approx}", "gelu", lambda r, a=approx: ((_n(r, 4, 45, s=2),), {"approximate": a}))
        yield c(f"gelu_backward-{approx}", "gelu_backward",
                lambda r, a=approx: ((_n(r, 4, 45), _n(r, 4, 45, s=2)), {"approximate": a}))
    yield c("swiglu", "swiglu", lambda r: ((_n(r, 2, 3, 90, s=2),), {}))
    yield c("swiglu_backward", "swiglu_backward", lambda r: ((_n(r, 2, 3, 45), _n(r, 2, 3, 90, s=2)), {}))
    yield c("silu_mul", "silu_mul", lambda r: ((_n(r, 7, 33, s=2), _n(r, 7, 33)), {}))
    yield c("silu_mul_backward", "silu_mul_backward",
            lambda r: ((_n(r, 7, 33), _n(r, 7, 33, s=2), _n(r, 7, 33)), {}))
    yield c("softmax-last", "softmax", lambda r: ((_n(r, 5, 300, s=3),), {"axis": -1}))
    yield c("softmax-middle", "softmax", lambda r: ((_n(r, 3, 7, 5),), {"axis": 1}))
    yield c("softmax_backward", "softmax_backward",
            lambda r: ((_n(r, 4, 70), np.exp(_n(r, 4, 70)) / 70), {"axis": -1}))

    def rms(r: np.random.Generator, c: int = 77, eps: float = 1e-6) -> tuple[Any, ...]:
        x, w = _n(r, 2, 3, c), _n(r, c)
        rstd = (1 / np.sqrt((x.astype(np.float64) ** 2).mean(-1) + eps)).astype(np.float32)
        return x, w, rstd

    yield c("rmsnorm", "rmsnorm", lambda r: ((_n(r, 2, 3, 77), _n(r, 77)), {"eps": 1e-6}))
    yield c("rmsnorm-wide", "rmsnorm", lambda r: ((_n(r, 4, 300), _n(r, 300)), {"eps": 0.3}))

    def rms_bwd(r: np.random.Generator, d_y: bool, d_rstd: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
        x, w, rstd = rms(r)
        return ((_n(r, *x.shape) if d_y else None, x, rstd, w, _n(r, 2, 3) if d_rstd else None), {})

    for d_y, d_rstd in ((True, False), (True, True), (False, True)):
        yield c(f"rmsnorm_backward-{d_y:d}{d_rstd:d}", "rmsnorm_backward",
                lambda r, a=d_y, b=d_rstd: rms_bwd(r, a, b), 1e-4)
    yield c("fused_residual_rmsnorm", "fused_residual_rmsnorm",
            lambda r: ((_n(r, 2, 3, 77), _n(r, 2, 3, 77), _n(r, 77)), {"eps": 1e-6}))

    def fused_bwd(r: np.random.Generator, d_res: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
        x, w, rstd = rms(r)
        return ((_n(r, *x.shape), _n(r, *x.shape) if d_res else None, x, rstd, w, _n(r, 2, 3)), {})

    for d_res in (True, False):
        yield c(f"fused_residual_rmsnorm_backward-{d_res:d}", "fused_residual_rmsnorm_backward",
                lambda r, a=d_res: fused_bwd(r, a), 1e-4)

    def targets(r: np.random.Generator, n: int, v: int, ignore: int) -> np.ndarray:
        t = r.integers(0, v, n).astype(np.int32)
        t[::3] = ignore
        return t

    yield c("cross_entropy", "cross_entropy",
            lambda r: ((_n(r, 7, 301, s=3), targets(r, 7, 301, -100)), {"ignore_index": -100}))
    yield c("cross_entropy-ignore2", "cross_entropy",
            lambda r: ((_n(r, 4, 6), np.array([2, 5, 2, 1], np.int32)), {"ignore_index": 2}))

    def ce_bwd(r: np.random.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
        z = _n(r, 7, 301, s=3)
        lse = np.log(np.exp(z.astype(np.float64)).sum(1)).astype(np.float32)
        return (_n(r, 7), z, targets(r, 7, 301, -100), lse, _n(r, 7)), {"ignore_index": -100}

    yield c("cross_entropy_backward", "cross_entropy_backward", ce_bwd)
    ids = lambda r: r.integers(0, 23, (2, 9)).astype(np.int32)  # noqa: E731 - repeats on purpose
    yield c("embedding", "embedding", lambda r: ((ids(r), _n(r, 23, 37)), {}))
    yield c("embedding_backward", "embedding_backward",
            lambda r: ((_n(r, 2, 9, 37), ids(r)), {"num_embeddings": 23}))
    yield c("embedding_backward-padding", "embedding_backward",
            lambda r: ((_n(r, 2, 9, 37), ids(r)), {"num_embeddings": 23, "padding_idx": 3}))
    pos = lambda r: r.integers(0, 40, 5).astype(np.int32)  # noqa: E731
    yield c("rope", "rope", lambda r: ((_n(r, 2, 5, 24), None, pos(r)), {"head_dim": 8, "theta": 100.0}))
    yield c("rope-inverse-partial", "rope",
            lambda r: ((_n(r, 2, 5, 36), None, r.integers(0, 9, (2, 5)).astype(np.int32)),
                       {"head_dim": 12, "rotary_dim": 6, "theta": 10.0, "inverse": True}))
    yield c("rope-freqs", "rope",
            lambda r: ((_n(r, 2, 3, 12), _n(r, 6, 2, 2), r.integers(0, 6, (2, 3)).astype(np.int32)),
                       {"head_dim": 6, "rotary_dim": 4}))
    for t in ("NN", "NT", "TN", "TT"):
        def mm(r: np.random.Generator, t: str = t) -> tuple[tuple[Any, ...], dict[str, Any]]:
            a = _n(r, 37, 50) if t[0] == "N" else _n(r, 50, 37)
            b = _n(r, 50, 45) if t[1] == "N" else _n(r, 45, 50)
            return (a, b), {"transpose": t, "alpha": 0.5}

        yield c(f"matmul-{t}", "matmul", mm, 1e-4)
    yield c("matmul-accumulate", "matmul",
            lambda r: ((_n(r, 19, 33), _n(r, 33, 17), _n(r, 19, 17)), {"accumulate": True}), 1e-4)
    yield c("matmul-beta", "matmul",
            lambda r: ((_n(r, 19, 33), _n(r, 33, 17), _n(r, 19, 17)), {"beta": -2.0}), 1e-4)
    yield c("batched_matmul", "batched_matmul", lambda r: ((_n(r, 3, 20, 18), _n(r, 3, 21, 18)),
                                                           {"transpose": "NT"}), 1e-4)
    head = lambda r: (_n(r, 13, 24), _n(r, 301, 24, s=0.5), targets(r, 13, 301, -100))  # noqa: E731
    for cap in (None, 5.0):
        yield c(f"fused_lm_head_loss-cap{cap}", "fused_lm_head_loss",
                lambda r, cap=cap: (head(r), {"ignore_index": -100, "softcap": cap}), 2e-5)

        def head_bwd(r: np.random.Generator, cap: float | None = cap) -> tuple[tuple[Any, ...], Any]:
            x, w, t = head(r)
            a = {"ignore_index": -100, "softcap": cap, "chunk_size": 64}
            forward = op_registry().get_op("fused_lm_head_loss").kernel
            _, lse = forward(x.astype(np.float64), w.astype(np.float64), t, **a)
            return (_n(r, 13), x, w, t, lse.astype(np.float32), _n(r, 13)), a

        yield c(f"fused_lm_head_loss_backward-cap{cap}", "fused_lm_head_loss_backward", head_bwd, 5e-5)
    heads = {"Hq": 4, "Hkv": 2, "D": 40}  # GQA; D not a multiple of 32
    qkv = lambda r, t=7: _n(r, 2, t, 8 * 40)  # noqa: E731
    seg = np.array([[1, 1, 1, 2, 2, 2, 2], [0, 0, 1, 1, 1, 1, 1]], np.int32)  # packed documents, padding
    attention = {"causal": dict(heads), "full-scaled": {**heads, "causal": False, "softmax_scale": 0.3},
                 "window": {**heads, "window_size": 3},
                 "window-full": {**heads, "causal": False, "window_size": 2}}
    for name, a in attention.items():
        yield c(f"flash_attention-{name}", "flash_attention", lambda r, a=a: ((qkv(r),), a), 2e-5)
    yield c("flash_attention-segments", "flash_attention", lambda r: ((qkv(r), seg), heads), 2e-5)

    def attn_bwd(r: np.random.Generator, a: dict[str, Any], segments: bool = False, d_out: bool = True,
                 d_lse: bool = False) -> tuple[tuple[Any, ...], dict[str, Any]]:
        x = qkv(r)
        ops = op_registry()
        spec = ops.get_op("flash_attention").attrs
        full = {s.name: a.get(s.name, None if s.required else s.default) for s in spec}
        o, lse = ops.get_op("flash_attention").kernel(x.astype(np.float64), seg if segments else None, **full)
        return ((_n(r, *o.shape) if d_out else None, x, o.astype(np.float32), lse.astype(np.float32),
                 _n(r, *lse.shape) if d_lse else None, seg if segments else None), a)

    for name, a in attention.items():
        yield c(f"flash_attention_backward-{name}", "flash_attention_backward",
                lambda r, a=a: attn_bwd(r, a), 5e-5)
    yield c("flash_attention_backward-segments-dlse", "flash_attention_backward",
            lambda r: attn_bwd(r, heads, segments=True, d_lse=True), 5e-5)
    yield c("flash_attention_backward-dlse-only", "flash_attention_backward",
            lambda r: attn_bwd(r, heads, d_out=False, d_lse=True), 5e-5)
    rope_heads = {"Hq": 4, "Hkv": 2, "D": 40, "theta": 50.0}
    yield c("qkv_qk_norm_rope", "qkv_qk_norm_rope",
            lambda r: ((qkv(r), _n(r, 40), _n(r, 40), None, np.arange(3, 10, dtype=np.int32)), rope_heads),
            2e-5)
    yield c("qkv_qk_norm_rope-no-q-norm-partial", "qkv_qk_norm_rope",
            lambda r: ((qkv(r), None, _n(r, 40), None, r.integers(0, 9, (2, 7)).astype(np.int32)),
                       {**rope_heads, "rotary_dim": 16, "eps": 0.1}), 2e-5)
    yield c("qkv_qk_norm_rope-freqs", "qkv_qk_norm_rope",
            lambda r: ((qkv(r), _n(r, 40), None, _n(r, 9, 20, 2), r.integers(0, 9, (2, 7)).astype(np.int32)),
                       {"Hq": 4, "Hkv": 2, "D": 40}), 2e-5)

    def qkv_bwd(r: np.random.Generator, q_w: bool, d_out: bool, d_rstd: bool,
                rotary: int | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
        x, p = qkv(r), r.integers(0, 9, (2, 7)).astype(np.int32)
        w = (_n(r, 40) if q_w else None, _n(r, 40))
        a = {**rope_heads, "rotary_dim": rotary, "eps": 1e-6}
        _, q_rstd, k_rstd = op_registry().get_op("qkv_qk_norm_rope").kernel(
            x.astype(np.float64), *[None if v is None else v.astype(np.float64) for v in w], None, p, **a)
        extra = (_n(r, 2, 7, 4), _n(r, 2, 7, 2)) if d_rstd else (None, None)
        return ((_n(r, *x.shape) if d_out else None, x, *w, None, p, q_rstd.astype(np.float32),
                 k_rstd.astype(np.float32), *extra), a)

    for q_w, d_out, d_rstd in ((1, 1, 0), (1, 1, 1), (1, 0, 1), (0, 1, 1)):
        yield c(f"qkv_qk_norm_rope_backward-{q_w:d}{d_out:d}{d_rstd:d}", "qkv_qk_norm_rope_backward",
                lambda r, a=q_w, b=d_out, d=d_rstd: qkv_bwd(r, a, b, d), 5e-5)
    yield c("qkv_qk_norm_rope_backward-partial", "qkv_qk_norm_rope_backward",
            lambda r: qkv_bwd(r, True, True, True, rotary=16), 5e-5)
    yield c("zeros", "zeros", lambda r: ((), {"shape": (3, 5), "dtype": np.dtype(np.float32)}))
    yield c("fill", "fill", lambda r: ((), {"shape": (3, 5), "value": 2.5, "dtype": np.dtype(np.float32)}))
    yield c("grad_norm", "grad_norm", lambda r: ((_n(r, 300), _n(r, 7, 9), _n(r, 5000)), {}), 1e-4)
    yield c("adamw_update", "adamw_update",
            lambda r: ((_n(r, 301), _n(r, 301), _n(r, 301, s=0.1), np.abs(_n(r, 301, s=0.1)), _n(r, 301)),
                       {"step": 3, "lr": 1e-2, "scale": 0.7, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
                        "weight_decay": 0.1, "lr_scale": 0.5}))
    for nesterov in (False, True):
        yield c(f"sgd_update-{nesterov:d}", "sgd_update",
                lambda r, n=nesterov: ((_n(r, 301), _n(r, 301), _n(r, 301), _n(r, 301)),
                                       {"step": 2, "lr": 1e-2, "scale": 0.7, "momentum": 0.9,
                                        "dampening": 0.1, "nesterov": n, "weight_decay": 0.1,
                                        "lr_scale": 1.0}))


CASES: dict[str, Case] = {case.id: case for case in _cases()}

_UPDATES = ("adamw_update", "sgd_update")


def _to_device(device: Any, a: np.ndarray | None) -> DeviceArray | None:
    if a is None:
        return None
    a = np.ascontiguousarray(a)
    ptr = device.alloc(a.nbytes)
    device.copy_to_device(ptr, a)
    return DeviceArray(device, ptr, a.shape, str(a.dtype))


def _to_host(a: DeviceArray) -> np.ndarray:
    a.device.synchronize()
    return a.device.copy_to_host(a.ptr, a.nbytes).view(a.dtype).reshape(a.shape)


def _f64(a: Any) -> Any:
    return a.astype(np.float64) if isinstance(a, np.ndarray) and a.dtype == np.float32 else a


def run_case(case: Case, device: Any, seed: int = 0) -> float:
    """The largest absolute difference between the kernel's outputs on ``device`` and the op's NumPy
    reference (in float64) for one case; raises if an output has the wrong shape."""
    opdef = op_registry().get_op(case.op)
    inputs, given = case.build(np.random.default_rng(seed))
    attrs_ = {a.name: given.get(a.name, None if a.required else a.default) for a in opdef.attrs}
    fn = KERNELS[case.op][0]
    dev_in = [_to_device(device, a) for a in inputs]
    try:
        if case.op in _UPDATES:  # in place: compare the parameter and its state (the last input is scratch)
            run = {k: given[k] for k in ("step", "lr", "scale")}
            ref = [_f64(a).copy() for a in inputs]
            opdef.kernel(*ref, **run, **attrs_)
            fn(*dev_in, **run, **attrs_)
            pairs = zip(dev_in[:-1], ref[:-1], strict=True)
            return max(float(np.abs(_to_host(d) - r).max()) for d, r in pairs if d is not None)
        if case.op == "grad_norm":
            return abs(fn(*dev_in) - opdef.kernel(*[_f64(a) for a in inputs]))
        ref = opdef.kernel(*[_f64(a) for a in inputs], **attrs_)
        refs = list(ref) if isinstance(ref, (tuple, list)) else [ref]
        outs = [_to_device(device, np.full(np.shape(r), np.nan, np.float32)) for r in refs]
        fn(*dev_in, out=outs, **attrs_)
        return max(float(np.abs(_to_host(o) - np.asarray(r)).max(initial=0.0))  # type: ignore[arg-type]
                   for o, r in zip(outs, refs, strict=True))
    finally:
        for d in dev_in:
            if d is not None:
                device.free(d.ptr)
