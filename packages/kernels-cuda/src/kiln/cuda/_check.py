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
    """One kernel run: ``build`` makes the inputs and attributes. By default the op's kernel in ``KERNELS``
    runs against the op's NumPy kernel; ``launch`` and ``reference`` replace them (for kernels outside the
    kernel table), ``bf16`` marks float inputs rounded to bfloat16 on the device (the reference computes on
    the rounded values), and ``gpu_only`` a case of tensor-core kernels the emulator cannot run. In a bf16
    case, ``fp32_inputs`` stay float32 (the reference sees them as they are) and ``rounded_on_load`` reach
    the kernel as float32 that it rounds to bf16 as it loads them (the reference sees them rounded)."""

    id: str
    op: str
    build: Build
    atol: float = 1e-5
    launch: Callable[..., Any] | None = None
    reference: Callable[..., Any] | None = None
    bf16: bool = False
    gpu_only: bool = False
    fp32_inputs: frozenset[int] = frozenset()
    #: a bf16 case whose first output is float32 (a bf16-input matmul), not bf16
    fp32_out: bool = False
    rounded_on_load: frozenset[int] = frozenset()


def _n(rng: np.random.Generator, *shape: int, s: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * s).astype(np.float32)


def _ln_bwd(r: np.random.Generator, shape: tuple[int, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """layernorm_backward's inputs: the saved mean and rstd of a random x, d_y, d_mean, d_rstd."""
    x = _n(r, *shape, s=2) + 0.5
    mean = x.astype(np.float64).mean(-1)
    rstd = 1 / np.sqrt(((x - mean[..., None]) ** 2).mean(-1) + 1e-5)
    return (_n(r, *shape), x, mean.astype(np.float32), rstd.astype(np.float32), _n(r, shape[-1]),
            _n(r, *shape[:-1]), _n(r, *shape[:-1], s=0.1)), {}


def _mean_backward_f32(d: np.ndarray, **attrs: Any) -> list[np.ndarray]:
    """``reduce_mean_backward``'s NumPy kernel on the float32 values (given as float64): its bits."""
    return [op_registry().get_op("reduce_mean_backward").kernel(d.astype(np.float32), **attrs)]


def _cases() -> Iterator[Case]:
    def c(id: str, op: str, build: Build, atol: float = 1e-5) -> Case:
        return Case(id, op, build, atol)

    yield c("copy", "copy", lambda r: ((_n(r, 3, 37),), {}))
    # the same mask (one element off would be an error of |x| / (1 - p)); the kept values differ from the
    # float64 reference by the float32 scale's rounding (a counter offset past 2^44: a later layer and step)
    for p_, off in ((0.3, 5), (0.5, (3 << 44) + (1 << 32) + 7), (0.0, 0)):
        yield c(f"dropout-{p_}", "dropout",
                lambda r, p_=p_, off=off: ((_n(r, 5, 203),), {"p": p_, "seed": 1234, "offset": off}), 1e-6)
    # rounded to nearest even on the device, in float64 through ml_dtypes by the reference: no error
    yield c("cast-bf16", "cast", lambda r: ((_n(r, 5, 67, s=100),), {"dtype": "bf16"}), 0.0)
    yield c("cast-fp32", "cast", lambda r: ((_n(r, 5, 67),), {"dtype": "fp32"}), 0.0)
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
    yield c("rope-interleaved-partial", "rope",
            lambda r: ((_n(r, 2, 5, 36), None, r.integers(0, 9, (2, 5)).astype(np.int32)),
                       {"head_dim": 12, "rotary_dim": 8, "theta": 10.0, "interleaved": True}))
    yield c("rope-interleaved-inverse-freqs", "rope",
            lambda r: ((_n(r, 2, 3, 12), _n(r, 6, 3, 2), r.integers(0, 6, (2, 3)).astype(np.int32)),
                       {"head_dim": 6, "interleaved": True, "inverse": True}))
    for name, c_ in (("", 37), ("-wide", 300)):  # ragged rows; 300 columns: 8 warps
        yield c(f"layernorm{name}", "layernorm",
                lambda r, c_=c_: ((_n(r, 3, 5, c_, s=2) + 1.5, _n(r, c_), _n(r, c_)), {"eps": 1e-5}))
        yield c(f"layernorm_backward{name}", "layernorm_backward",
                lambda r, c_=c_: _ln_bwd(r, (3, 5, c_)), 1e-4)
    yield c("layernorm-nobias", "layernorm", lambda r: ((_n(r, 7, 33), _n(r, 33), None), {"eps": 0.2}))
    yield c("layernorm_backward-dy-only", "layernorm_backward",
            lambda r: ((*_ln_bwd(r, (7, 33))[0][:5], None, None), {}), 1e-4)
    for kind, extra in (("default", {}), ("llama3", {"factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 16}),
                        ("yarn", {"factor": 4.0, "original_max_position_embeddings": 32})):
        # angles up to ~100 rad: float32 cos/sin of the same float32 angle, within an ulp or two
        yield c(f"rope_freqs-{kind}", "rope_freqs",
                lambda r, kind=kind, extra=extra: ((), {"rows": 101, "rotary_dim": 14, "theta": 500.0,
                                                        "rope_type": kind, **extra}), 3e-7)
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
    qkv = lambda r, t=7, a=heads: _n(r, 2, t, (a["Hq"] + 2 * a["Hkv"]) * a["D"])  # noqa: E731
    seg = np.array([[1, 1, 1, 2, 2, 2, 2], [0, 0, 1, 1, 1, 1, 1]], np.int32)  # packed documents, padding
    attention = {"causal": dict(heads), "full-scaled": {**heads, "causal": False, "softmax_scale": 0.3},
                 "window": {**heads, "window_size": 3},
                 "window-full": {**heads, "causal": False, "window_size": 2},
                 "softcap-alibi": {"Hq": 6, "Hkv": 2, "D": 24, "softcap": 1.5, "alibi": True},  # 6 heads: the
                 "full-alibi": {"Hq": 3, "Hkv": 1, "D": 40, "causal": False, "alibi": True}}   # extra slopes
    for name, a in attention.items():
        yield c(f"flash_attention-{name}", "flash_attention", lambda r, a=a: ((qkv(r, a=a),), a), 2e-5)
    yield c("flash_attention-segments", "flash_attention", lambda r: ((qkv(r), seg), heads), 2e-5)

    def attn_bwd(r: np.random.Generator, a: dict[str, Any], segments: bool = False, d_out: bool = True,
                 d_lse: bool = False) -> tuple[tuple[Any, ...], dict[str, Any]]:
        x = qkv(r, a=a)
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

    def sep(r: np.random.Generator, a: dict[str, Any], tk: int = 7) -> tuple[np.ndarray, ...]:
        return (_n(r, 2, 7, a["Hq"], a["D"]), _n(r, 2, tk, a["Hkv"], a["D"]), _n(r, 2, tk, a["Hkv"], a["D"]))

    def no_heads(a: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in a.items() if k not in ("Hq", "Hkv", "D")}

    separate = {"causal": (heads, False, 7), "segments": (heads, True, 7),
                "softcap-alibi": (attention["softcap-alibi"], False, 7),
                "cross": ({**heads, "causal": False}, False, 5),  # Tq != Tk: cross attention
                "cross-causal": ({**heads, "window_size": 6}, False, 11)}  # queries at the last 7 keys
    for name, (a, segments, tk) in separate.items():
        yield c(f"attention-{name}", "attention",
                lambda r, a=a, g=segments, tk=tk: ((*sep(r, a, tk), seg if g else None), no_heads(a)), 2e-5)

        def sep_bwd(r: np.random.Generator, a: dict[str, Any] = a, g: bool = segments,
                    tk: int = tk) -> tuple[tuple[Any, ...], dict[str, Any]]:
            q, k, v = sep(r, a, tk)
            opdef = op_registry().get_op("attention")
            full = {s.name: no_heads(a).get(s.name, None if s.required else s.default) for s in opdef.attrs}
            o, lse = opdef.kernel(*(x.astype(np.float64) for x in (q, k, v)), seg if g else None, **full)
            return ((_n(r, *o.shape), q, k, v, o.astype(np.float32), lse.astype(np.float32),
                     _n(r, *lse.shape) if g else None, seg if g else None), no_heads(a))

        yield c(f"attention_backward-{name}", "attention_backward", sep_bwd, 5e-5)
    # Mamba's conv: ragged B x D x T past a block, K > T (the padding reaches past x), with and without bias
    # with a conv_state (the chunk before) and the final state (the next chunk's), T < K - 1 among them
    for name, (shape, k_, bias_, act, state) in {"silu": ((2, 37, 9), 4, True, "silu", False),
                                                "none-nobias": ((1, 5, 2), 4, False, "none", False),
                                                "wide": ((3, 70, 33), 3, True, "silu", False),
                                                "states": ((2, 37, 9), 4, True, "silu", True),
                                                "states-short": ((1, 6, 2), 5, False, "none", True)}.items():
        def conv(r: np.random.Generator, shape: tuple[int, ...] = shape, k_: int = k_, bias_: bool = bias_,
                 act: str = act, state: bool = state) -> tuple[tuple[Any, ...], dict[str, Any]]:
            ins = (_n(r, *shape), _n(r, shape[1], 1, k_), _n(r, shape[1]) if bias_ else None,
                   _n(r, shape[0], shape[1], k_ - 1) if state else None)
            return ins, {"activation": act, **({"return_final_states": True} if state else {})}

        def conv_bwd(r: np.random.Generator, conv: Build = conv,
                     state: bool = state) -> tuple[tuple[Any, ...], dict[str, Any]]:
            ins, a = conv(r)
            a = {"activation": a["activation"]}
            return (_n(r, *ins[0].shape), *ins, _n(r, *ins[3].shape) if state else None), a

        yield c(f"mamba_conv1d-{name}", "mamba_conv1d", conv, 1e-5)
        yield c(f"mamba_conv1d_backward-{name}", "mamba_conv1d_backward", conv_bwd, 1e-4)
    # the selective scan: N = 16 (lanes past N idle), D ragged past a block of 4 warps, groups of B and C,
    # softplus, a state in and out; A negative as Mamba's -exp(A_log). Short T runs the sequential kernels;
    # T = 1100 the chunked ones (two chunks of 1024 steps, the second ragged), as does N = 40 (past a warp)
    scans = {"plain": (2, 9, 11, 16, 0, False, False), "full": (2, 10, 7, 5, 2, True, True),
             "states": (1, 6, 13, 8, 3, True, True), "chunked": (1, 2, 1100, 16, 0, True, True),
             "chunked-wide-state": (2, 3, 9, 40, 3, True, True)}
    for name, (b_, d_, t_, n_, g_, full_, state_) in scans.items():
        def scan(r: np.random.Generator, b_: int = b_, d_: int = d_, t_: int = t_, n_: int = n_, g_: int = g_,
                 full_: bool = full_, state_: bool = state_) -> tuple[tuple[Any, ...], dict[str, Any]]:
            bc = (b_, g_, n_, t_) if g_ else (b_, n_, t_)
            delta = _n(r, b_, d_, t_, s=0.5)  # without softplus a step is positive, as Mamba's dt
            ins = (_n(r, b_, d_, t_), delta if full_ else np.abs(delta), -np.exp(_n(r, d_, n_, s=0.5)),
                   _n(r, *bc), _n(r, *bc), _n(r, d_) if full_ else None, _n(r, b_, d_, t_) if full_ else None,
                   _n(r, d_, s=0.3) if full_ else None, _n(r, b_, d_, n_) if state_ else None)
            return ins, {"delta_softplus": full_, **({"return_last_state": True} if state_ else {})}

        def scan_bwd(r: np.random.Generator, scan: Build = scan,
                     state_: bool = state_) -> tuple[tuple[Any, ...], dict[str, Any]]:
            ins, a = scan(r)
            d_last = _n(r, *ins[8].shape) if state_ else None
            return (_n(r, *ins[0].shape), *ins, d_last), {"delta_softplus": a["delta_softplus"]}

        yield c(f"mamba_selective_scan-{name}", "mamba_selective_scan", scan, 1e-4)
        yield c(f"mamba_selective_scan_backward-{name}", "mamba_selective_scan_backward", scan_bwd, 2e-4)
    rope_heads = {"Hq": 4, "Hkv": 2, "D": 40, "theta": 50.0}
    yield c("qkv_qk_norm_rope", "qkv_qk_norm_rope",
            lambda r: ((qkv(r), _n(r, 40), _n(r, 40), None, np.arange(3, 10, dtype=np.int32)), rope_heads),
            2e-5)
    yield c("qkv_qk_norm_rope-no-q-norm-partial", "qkv_qk_norm_rope",
            lambda r: ((qkv(r), None, _n(r, 40), None, r.integers(0, 9, (2, 7)).astype(np.int32)),
                       {**rope_heads, "rotary_dim": 16, "eps": 0.1}), 2e-5)
    yield c("qkv_qk_norm_rope-interleaved-partial", "qkv_qk_norm_rope",
            lambda r: ((qkv(r), _n(r, 40), _n(r, 40), None, r.integers(0, 9, (2, 7)).astype(np.int32)),
                       {**rope_heads, "rotary_dim": 16, "interleaved": True}), 2e-5)
    yield c("qkv_qk_norm_rope-freqs", "qkv_qk_norm_rope",
            lambda r: ((qkv(r), _n(r, 40), None, _n(r, 9, 20, 2), r.integers(0, 9, (2, 7)).astype(np.int32)),
                       {"Hq": 4, "Hkv": 2, "D": 40}), 2e-5)

    def qkv_bwd(r: np.random.Generator, q_w: bool, d_out: bool, d_rstd: bool, rotary: int | None = None,
                interleaved: bool = False) -> tuple[tuple[Any, ...], dict[str, Any]]:
        x, p = qkv(r), r.integers(0, 9, (2, 7)).astype(np.int32)
        w = (_n(r, 40) if q_w else None, _n(r, 40))
        a = {**rope_heads, "rotary_dim": rotary, "eps": 1e-6}
        if interleaved:
            a["interleaved"] = True
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
    yield c("qkv_qk_norm_rope_backward-interleaved-partial", "qkv_qk_norm_rope_backward",
            lambda r: qkv_bwd(r, True, True, True, rotary=16, interleaved=True), 5e-5)
    yield from _moe_cases()
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


def _moe_cases() -> Iterator[Case]:
    n, k, e, c = 6, 2, 5, 37  # expert 4 is never chosen (empty); rows not a multiple of a warp

    def routing(r: np.random.Generator) -> np.ndarray:
        return np.stack([r.choice(e - 1, k, replace=False) for _ in range(n)]).astype(np.int32)

    def scatter(r: np.random.Generator) -> np.ndarray:
        return r.permutation(n * k).astype(np.int32)

    def tied(r: np.random.Generator) -> np.ndarray:  # probabilities with exact ties, some at the cut
        p = np.round(r.random((9, 7)) * 4) / 8
        p[0] = [0.5, 0.25, 0.5, 0.125, 0.25, 0.5, 0.0]
        return p.astype(np.float32)

    def router_inputs(r: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """x [300, 19] (past a block) and gate [7, 19]: experts 2 and 5 copy expert 0's row (exact ties of
        the scores, float32 and float64 alike), expert 6 is never chosen (ragged counts, one empty)."""
        x, gate = _n(r, 300, 19), _n(r, 7, 19)
        x[:, -1], gate[:, -1], gate[6, -1] = 4.0, 0.0, -6.0
        gate[[2, 5]] = gate[0]
        return x, gate

    def router_bwd(r: np.random.Generator, a: dict[str, Any], d_w: bool, d_aux: bool) -> tuple[Any, ...]:
        x, gate = router_inputs(r)
        _, idx, _ = op_registry().get_op("moe_router").kernel(*(v.astype(np.float64) for v in (x, gate)), **a)
        attrs = {k: a[k] for k in ("normalize", "use_sigmoid", "aux_loss_coef")}
        return ((_n(r, 300, a["top_k"]) if d_w else None, _n(r) if d_aux else None, x, gate, idx), attrs)

    yield Case("moe_softmax", "moe_softmax", lambda r: ((_n(r, 5, 7, s=3),), {}))
    yield Case("moe_softmax_backward", "moe_softmax_backward",
               lambda r: ((_n(r, 5, 7), np.exp(_n(r, 5, 7)) / 7), {}))
    yield Case("moe_sigmoid", "moe_sigmoid", lambda r: ((_n(r, 5, 7, s=4),), {}))
    yield Case("moe_sigmoid_backward", "moe_sigmoid_backward",
               lambda r: ((_n(r, 5, 7), 1 / (1 + np.exp(_n(r, 5, 7)))), {}))
    for top, normalize in ((3, False), (2, True)):
        yield Case(f"moe_topk-{top}{normalize:d}", "moe_topk",
                   lambda r, t=top, z=normalize: ((tied(r),), {"k": t, "normalize": z}))

        def topk_bwd(r: np.random.Generator, t: int = top, z: bool = normalize) -> tuple[Any, ...]:
            p = np.exp(_n(r, 9, 7)) / 7
            _, idx = op_registry().get_op("moe_topk").kernel(p, k=t, normalize=z)
            return (_n(r, 9, t), p, idx), {"normalize": z}

        yield Case(f"moe_topk_backward-{top}{normalize:d}", "moe_topk_backward", topk_bwd)
    def stats(r: np.random.Generator, segments: bool) -> tuple[Any, ...]:  # 300 rows: past one block
        p = np.exp(_n(r, 300, 7)) / 7
        idx = np.stack([r.choice(6, 2, replace=False) for _ in range(300)]).astype(np.int32)
        return (p, idx, r.integers(0, 3, 300).astype(np.int32) if segments else None)

    for segments in (False, True):
        name = "-segments" if segments else ""
        yield Case(f"moe_load_stats{name}", "moe_load_stats", lambda r, g=segments: (stats(r, g), {}), 1e-6)
        yield Case(f"moe_load_stats_backward{name}", "moe_load_stats_backward",
                   lambda r, g=segments: ((_n(r, 7), *stats(r, g)[::2]), {}), 1e-6)
    aux = {"coef": 0.3, "num_layers": 3, "ignore_index": -100}

    def targets_of(r: np.random.Generator) -> np.ndarray:
        return np.where(r.random(300) < 0.3, -100, r.integers(0, 50, 300)).astype(np.int32)

    yield Case("moe_aux_loss", "moe_aux_loss", lambda r: ((_n(r, 300), targets_of(r), r.random(7).astype(
        np.float32), r.random(7).astype(np.float32)), aux), 1e-5)
    for name, d_loss, d_aux in (("", True, True), ("-dloss", True, False), ("-daux", False, True)):
        yield Case(f"moe_aux_loss_backward{name}", "moe_aux_loss_backward",
                   lambda r, a=d_loss, b=d_aux: ((_n(r, 300) if a else None, _n(r) if b else None,
                                                  targets_of(r), r.random(7).astype(np.float32)), aux), 1e-5)
    for top, normalize, sigmoid in ((2, True, False), (3, False, True)):
        flags = {"top_k": top, "normalize": normalize, "use_sigmoid": sigmoid, "aux_loss_coef": 0.3}
        name = f"{top}{normalize:d}{sigmoid:d}"
        yield Case(f"moe_router-{name}", "moe_router", lambda r, a=flags: (router_inputs(r), a), 1e-5)
        for d_w, d_aux in ((True, True), (False, True), (True, False)):
            yield Case(f"moe_router_backward-{name}-{d_w:d}{d_aux:d}", "moe_router_backward",
                       lambda r, a=flags, w=d_w, g=d_aux: router_bwd(r, a, w, g), 1e-5)
    yield Case("moe_permute", "moe_permute", lambda r: ((_n(r, n, c), routing(r)), {"num_experts": e}))
    yield Case("moe_permute_backward", "moe_permute_backward",
               lambda r: ((_n(r, n * k, c), scatter(r)), {"num_tokens": n}))
    yield Case("moe_unpermute", "moe_unpermute",
               lambda r: ((_n(r, n * k, c), _n(r, n, k), scatter(r)), {"top_k": k}))
    yield Case("moe_unpermute_dy", "moe_unpermute_dy", lambda r: ((_n(r, n, c), _n(r, n, k), scatter(r)), {}))
    yield Case("moe_unpermute_dw", "moe_unpermute_dw",
               lambda r: ((_n(r, n, c), _n(r, n * k, c), scatter(r)), {"top_k": k}), 1e-4)
    offsets = np.array([0, 3, 3, 10, 13], np.int32)  # four experts, the second empty
    x, o = lambda r: _n(r, 13, 19), 17
    yield Case("grouped_gemm-NT", "grouped_gemm", lambda r: ((x(r), _n(r, 4, o, 19), offsets), {}), 1e-4)
    yield Case("grouped_gemm-NN", "grouped_gemm",
               lambda r: ((x(r), _n(r, 4, 19, o), offsets), {"transpose": "NN"}), 1e-4)
    yield Case("moe_grouped_gemm_gate_up", "moe_grouped_gemm_gate_up",
               lambda r: ((x(r), _n(r, 4, 2 * o, 19), offsets), {}), 1e-4)
    yield Case("moe_grouped_gemm_down", "moe_grouped_gemm_down",
               lambda r: ((x(r), _n(r, 4, o, 19), offsets), {}), 1e-4)
    yield Case("moe_grouped_gemm_dx", "moe_grouped_gemm_dx",
               lambda r: ((_n(r, 13, o), _n(r, 4, o, 19), offsets), {}), 1e-4)
    yield Case("moe_grouped_gemm_dw", "moe_grouped_gemm_dw",
               lambda r: ((_n(r, 13, o), x(r), offsets), {}), 1e-4)


def _split(qkv: np.ndarray, Hq: int, Hkv: int, D: int) -> tuple[np.ndarray, ...]:
    b, t, _ = qkv.shape
    return (qkv[..., :Hq * D].reshape(b, t, Hq, D), qkv[..., Hq * D:(Hq + Hkv) * D].reshape(b, t, Hkv, D),
            qkv[..., (Hq + Hkv) * D:].reshape(b, t, Hkv, D))


def _score_attrs(a: dict[str, Any]) -> dict[str, Any]:
    return {k: a.get(k, d) for k, d in (("causal", True), ("softmax_scale", None), ("window_size", None),
                                         ("softcap", None), ("alibi", False))}


def _packed_attention(qkv: np.ndarray, segment_ids: np.ndarray | None = None, *, Hq: int, Hkv: int, D: int,
                      **a: Any) -> tuple[np.ndarray, np.ndarray]:
    """flash_attention with attention's softcap and ALiBi: kiln-core's ``attention`` on the split heads."""
    q, k, v = _split(qkv, Hq, Hkv, D)
    o, lse = op_registry().get_op("attention").kernel(q, k, v, segment_ids, **_score_attrs(a))
    return o.reshape(*qkv.shape[:2], Hq * D), lse


def _packed_attention_backward(d_out: np.ndarray | None, qkv: np.ndarray, o: np.ndarray, lse: np.ndarray,
                               d_lse: np.ndarray | None = None, segment_ids: np.ndarray | None = None, *,
                               Hq: int, Hkv: int, D: int, **a: Any) -> np.ndarray:
    q, k, v = _split(qkv, Hq, Hkv, D)
    b, t, _ = qkv.shape
    heads = (b, t, Hq, D)
    dq, dk, dv = op_registry().get_op("attention_backward").kernel(
        None if d_out is None else d_out.reshape(heads), q, k, v, o.reshape(heads), lse, d_lse, segment_ids,
        **_score_attrs(a))
    return np.concatenate([x.reshape(b, t, -1) for x in (dq, dk, dv)], axis=-1)


def _bf16(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (to nearest even) and back."""
    import ml_dtypes

    return a.astype(ml_dtypes.bfloat16).astype(np.float32)


def _mma_cases() -> Iterator[Case]:
    """The tiled bf16 attention: its SIMT twin on the emulator, the tensor-core kernels on a GPU, against
    kiln-core's attention in float64 on the bf16 inputs (tolerances: bf16 probabilities and outputs)."""
    from kiln.cuda._ops import flash_attention_mma, flash_attention_mma_backward

    def qkv(r: np.random.Generator, b: int, t: int, a: dict[str, Any]) -> np.ndarray:
        return _n(r, b, t, (a["Hq"] + 2 * a["Hkv"]) * a["D"])

    def seg(t: int) -> np.ndarray:
        return np.array([[1] * (t // 3) + [2] * (t - t // 3), [0] * 5 + [1] * (t - 5)], np.int32)

    gqa = {"Hq": 4, "Hkv": 2, "D": 40}  # D padded to 64; 70 rows: a ragged second block of 64
    forward = {
        "causal": (1, 70, gqa, False),
        "segments-window": (2, 37, {**gqa, "window_size": 9}, True),
        "full-softcap-alibi": (1, 37, {"Hq": 3, "Hkv": 1, "D": 24, "causal": False, "softcap": 2.0,
                                       "alibi": True, "softmax_scale": 0.4}, False),
        "d72": (1, 21, {"Hq": 2, "Hkv": 2, "D": 72}, False),  # the 128-wide kernel
    }
    backward = {
        "causal": (1, 37, gqa, False, True),
        "segments-window-dlse": (2, 21, {**gqa, "window_size": 7}, True, True),
        "full-softcap-alibi": (1, 21, {"Hq": 3, "Hkv": 1, "D": 24, "causal": False, "softcap": 2.0,
                                       "alibi": True}, False, False),
    }
    for tc in (False, True):
        variant = "tc" if tc else "twin"
        for name, (b, t, a, segments) in forward.items():
            def build(r: np.random.Generator, b: int = b, t: int = t, a: dict[str, Any] = a,
                      segments: bool = segments, tc: bool = tc) -> tuple[tuple[Any, ...], dict[str, Any]]:
                return (qkv(r, b, t, a), seg(t)[:b] if segments else None), {**a, "tensor_cores": tc}

            yield Case(f"flash_attention_{variant}-{name}", "flash_attention", build, 1.5e-2,
                       flash_attention_mma, _packed_attention, True, tc)
        for name, (b, t, a, segments, d_lse) in backward.items():
            def build_bwd(r: np.random.Generator, b: int = b, t: int = t, a: dict[str, Any] = a,
                          segments: bool = segments, d_lse: bool = d_lse,
                          tc: bool = tc) -> tuple[tuple[Any, ...], dict[str, Any]]:
                x, s = _bf16(qkv(r, b, t, a)), seg(t)[:b] if segments else None
                o, lse = _packed_attention(x.astype(np.float64), s, **a)
                return ((_n(r, *o.shape), x, _bf16(o.astype(np.float32)), lse.astype(np.float32),
                         _n(r, *lse.shape) if d_lse else None, s), {**a, "tensor_cores": tc})

            yield Case(f"flash_attention_backward_{variant}-{name}", "flash_attention_backward", build_bwd,
                       3e-2, flash_attention_mma_backward, _packed_attention_backward, True, tc,
                       frozenset({3, 4}))


def _bf16_matmul_cases() -> Iterator[Case]:
    """``matmul_bf16`` (the bf16 recipe's matmul on CUDA cores): bf16 a and b, fp32 accumulate and out,
    against kiln-core's matmul in float64 on the same bf16 values, every transpose, ragged shapes."""
    from kiln.cuda._ops import matmul

    opdef = op_registry().get_op("matmul")

    def reference(*inputs: Any, **given: Any) -> Any:
        defaults = {a.name: a.default for a in opdef.attrs if not a.required}
        return opdef.kernel(*inputs, **{**defaults, **given})

    for t in ("NN", "NT", "TN", "TT"):
        def mm(r: np.random.Generator, t: str = t) -> tuple[tuple[Any, ...], dict[str, Any]]:
            a = _n(r, 37, 50) if t[0] == "N" else _n(r, 50, 37)
            b = _n(r, 50, 45) if t[1] == "N" else _n(r, 45, 50)
            return (a, b), {"transpose": t, "alpha": 0.5}

        yield Case(f"matmul_bf16-{t}", "matmul", mm, 1e-4, matmul, reference, True, fp32_out=True)
    yield Case("matmul_bf16-accumulate", "matmul",
               lambda r: ((_n(r, 19, 33), _n(r, 33, 17), _n(r, 19, 17)), {"accumulate": True}), 1e-4,
               matmul, reference, True, fp32_inputs=frozenset({2}), fp32_out=True)
    yield Case("matmul_bf16-batched", "batched_matmul",
               lambda r: ((_n(r, 3, 20, 18), _n(r, 3, 21, 18)), {"transpose": "NT"}), 1e-4, matmul,
               reference, True, fp32_out=True)


def _rounding_cases() -> Iterator[Case]:
    """The bf16 recipe's kernels with rounding points inside the op, against NumPy's ``op@numpy:bfloat16``
    kernels on the same float32 values (bf16 inputs). Sigmoid is ``(1 + tanh(g / 2)) / 2`` on both, but
    NumPy's float32 ``tanh`` is its own SIMD code, a last bit away from libm's ``tanhf`` (and the GPU's)
    on about a third of the inputs; where ``1 + tanh`` cancels (``g`` below about -4) that bit can move
    silu's tiny value across a bf16 rounding boundary: differences of 1e-6 at most, found there only.
    ``qkv_qk_norm_rope``'s rstd sums over a warp, NumPy's pairwise, and its rope angles are ``cosf``/``sinf``
    of fp32 angles against NumPy's tables: fp32 differences (a few 1e-6 on the norm weights' sums)."""
    from types import SimpleNamespace

    from kiln.core.plugins import get_registry
    from kiln.cuda import _ops

    table = get_registry("kernels")  # NumPy's bf16 kernels, as the kernel table gives them to the recipe
    np_bf16 = SimpleNamespace(**{f"{op}_bf16": table.find(op, "numpy", "bfloat16").fn for op in (
        "swiglu", "swiglu_backward", "qkv_qk_norm_rope", "qkv_qk_norm_rope_backward", "fused_lm_head_loss",
        "fused_lm_head_loss_backward")})

    def f32(kernel: Callable[..., Any]) -> Callable[..., Any]:
        def wide(x: Any) -> Any:
            return x.astype(np.float32) if isinstance(x, np.ndarray) and x.dtype == np.float64 else x

        return lambda *a, **k: kernel(*[wide(x) for x in a], **k)

    yield Case("swiglu-bf16", "swiglu", lambda r: ((_n(r, 3, 5, 94, s=3),), {}), 1e-5, _ops.swiglu_bf16,
               f32(np_bf16.swiglu_bf16), True)
    yield Case("swiglu_backward-bf16", "swiglu_backward",
               lambda r: ((_n(r, 3, 5, 47), _n(r, 3, 5, 94, s=3)), {}), 1e-5, _ops.swiglu_backward_bf16,
               f32(np_bf16.swiglu_backward_bf16), True)

    heads = {"Hq": 4, "Hkv": 2, "D": 40, "theta": 50.0, "eps": 1e-6, "rotary_dim": None, "interleaved": False}

    def qkv(r: np.random.Generator) -> np.ndarray:
        return _n(r, 2, 7, 320, s=2)

    def _pos(r: np.random.Generator) -> np.ndarray:
        return r.integers(0, 9, (2, 7)).astype(np.int32)

    for name, a in (("", heads), ("-interleaved-partial", {**heads, "rotary_dim": 16, "interleaved": True})):
        yield Case(f"qkv_qk_norm_rope-bf16{name}", "qkv_qk_norm_rope",
                   lambda r, a=a: ((qkv(r), _n(r, 40), _n(r, 40), None, _pos(r)), a), 2e-5,
                   _ops.qkv_qk_norm_rope_bf16, f32(np_bf16.qkv_qk_norm_rope_bf16), True,
                   fp32_inputs=frozenset({1, 2}), fp32_out=True)

    def qkv_bwd(r: np.random.Generator, q_w: bool, d_rstd: bool,
                a: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        x, p = _bf16(qkv(r)), _pos(r)
        w = (_n(r, 40) if q_w else None, _n(r, 40))
        _, q_rstd, k_rstd = np_bf16.qkv_qk_norm_rope_bf16(x, *w, None, p, **a)
        extra = (_n(r, 2, 7, 4), _n(r, 2, 7, 2)) if d_rstd else (None, None)
        return (_n(r, *x.shape), x, *w, None, p, q_rstd, k_rstd, *extra), a

    partial = {**heads, "rotary_dim": 16, "interleaved": True}
    for q_w, d_rstd, a in ((1, 0, heads), (0, 1, heads), (1, 1, partial)):
        yield Case(f"qkv_qk_norm_rope_backward-bf16-{q_w:d}{d_rstd:d}{'-partial' if a['rotary_dim'] else ''}",
                   "qkv_qk_norm_rope_backward", lambda r, q=q_w, d=d_rstd, a=a: qkv_bwd(r, q, d, a), 2e-5,
                   _ops.qkv_qk_norm_rope_backward_bf16, f32(np_bf16.qkv_qk_norm_rope_backward_bf16), True,
                   fp32_inputs=frozenset({2, 3, 6, 7, 8, 9}))

    def head(r: np.random.Generator, n: int = 37, v: int = 53) -> tuple[np.ndarray, ...]:
        t = r.integers(0, v, n).astype(np.int32)
        t[::5] = -100
        return _n(r, n, 24), _n(r, v, 24, s=0.5), t

    for cap in (None, 3.0):
        yield Case(f"fused_lm_head_loss-bf16-{cap}", "fused_lm_head_loss",
                   lambda r, cap=cap: (head(r), {"ignore_index": -100, "chunk_size": 16, "softcap": cap}),
                   2e-6,
                   _ops.fused_lm_head_loss_bf16, f32(np_bf16.fused_lm_head_loss_bf16), True, fp32_out=True)

        def head_bwd(r: np.random.Generator,
                     cap: float | None = cap) -> tuple[tuple[Any, ...], dict[str, Any]]:
            x, w, t = head(r)
            a = {"ignore_index": -100, "chunk_size": 16, "softcap": cap}
            lse = np_bf16.fused_lm_head_loss_bf16(_bf16(x), _bf16(w), t, **a)[1]
            return (_n(r, 37), x, w, t, lse, _n(r, 37, s=0.1)), a

        # the emulator gives NumPy's bits (tests/test_emulated.py); a GPU's cuBLASLt sums the products in
        # another order, which can move a bf16 gradient by one step of its scale (about 0.05 here)
        yield Case(f"fused_lm_head_loss_backward-bf16-{cap}", "fused_lm_head_loss_backward", head_bwd, 2.5e-4,
                   _ops.fused_lm_head_loss_backward_bf16, f32(np_bf16.fused_lm_head_loss_backward_bf16), True,
                   fp32_inputs=frozenset({0, 4, 5}))


CASES: dict[str, Case] = {case.id: case for case in (*_cases(), *_bf16_matmul_cases(), *_mma_cases(),
                                                   *_rounding_cases())}


def _coverage_cases() -> Iterator[Case]:
    """The kernels of the ops that ran on the host before issue 17: the norms' recompute variants, pointwise
    ops, q/k norm, reductions (adjacent and scattered axes, wide rows and long columns) and layout copies
    (float32 and int32), on ragged shapes."""

    def c(id: str, op: str, build: Build, atol: float = 1e-5) -> Case:
        return Case(id, op, build, atol)

    def away(r: np.random.Generator, *shape: int) -> np.ndarray:  # |b| in [0.5, 2]: a smooth divisor
        return (r.uniform(0.5, 2.0, shape) * np.where(r.random(shape) < 0.5, -1, 1)).astype(np.float32)

    def saved(r: np.random.Generator, shape: tuple[int, ...], fused: bool) -> tuple[Any, ...]:
        x, w = _n(r, *shape), _n(r, shape[-1])
        res = _n(r, *shape) if fused else None
        s = x.astype(np.float64) + (0 if res is None else res)
        rstd = (1 / np.sqrt((s ** 2).mean(-1) + 1e-6)).astype(np.float32)
        return (res, x, rstd, w) if fused else (x, rstd, w)

    for name, shape in (("", (2, 3, 77)), ("-wide", (4, 300))):
        yield c(f"rmsnorm_apply_saved{name}", "rmsnorm_apply_saved",
                lambda r, s=shape: (saved(r, s, False), {}))
        yield c(f"fused_residual_rmsnorm_apply_saved{name}", "fused_residual_rmsnorm_apply_saved",
                lambda r, s=shape: (saved(r, s, True), {}))
    yield c("div-same", "div", lambda r: ((_n(r, 5, 37), away(r, 5, 37)), {}))
    yield c("div-trailing", "div", lambda r: ((_n(r, 3, 4, 37), away(r, 37)), {}))
    yield c("div-middle", "div", lambda r: ((_n(r, 2, 4, 37), away(r, 4, 1)), {}))
    yield c("div-both-ways", "div", lambda r: ((_n(r, 4, 1), away(r, 2, 4, 37)), {}))
    yield c("exp", "exp", lambda r: ((_n(r, 5, 61, s=1.5),), {}), 1e-5)  # up to e^5: float32 steps of 1e-5
    yield c("reciprocal", "reciprocal", lambda r: ((away(r, 5, 61),), {}))
    yield c("sigmoid", "sigmoid", lambda r: ((_n(r, 5, 61, s=8),), {}))
    yield c("sigmoid_backward", "sigmoid_backward",
            lambda r: ((_n(r, 5, 61), r.random((5, 61)).astype(np.float32)), {}))
    yield c("relu2", "relu2", lambda r: ((_n(r, 5, 61, s=2),), {}))
    yield c("relu2_backward", "relu2_backward", lambda r: ((_n(r, 5, 61), _n(r, 5, 61, s=2)), {}))
    for approx in ("none", "tanh"):
        yield c(f"geglu-{approx}", "geglu",
                lambda r, a=approx: ((_n(r, 4, 45, s=2), _n(r, 4, 45)), {"approximate": a}))
    yield c("add3", "add3", lambda r: ((_n(r, 3, 67), _n(r, 3, 67), _n(r, 3, 67)), {}))
    yield c("matmul_bias-NT", "matmul_bias", lambda r: ((_n(r, 37, 50), _n(r, 45, 50), _n(r, 45)), {}), 1e-4)
    yield c("matmul_bias-NN", "matmul_bias",
            lambda r: ((_n(r, 19, 33), _n(r, 33, 17), _n(r, 17)), {"transpose": "NN"}), 1e-4)
    from kiln.cuda._ops import matmul_bias

    opdef = op_registry().get_op("matmul_bias")
    # under the bf16 recipe x and w reach the kernel as bf16 (BF16_OPERANDS), the bias as float32
    yield Case("matmul_bias_bf16-NT", "matmul_bias", lambda r: ((_n(r, 37, 50), _n(r, 45, 50), _n(r, 45)),
                                                               {"transpose": "NT"}),
               1e-4, matmul_bias, opdef.kernel, True, fp32_inputs=frozenset({2}), fp32_out=True)
    yield c("qk_norm", "qk_norm",
            lambda r: ((_n(r, 2, 5, 4, 40), _n(r, 2, 5, 2, 40), _n(r, 40), _n(r, 40)), {"eps": 1e-6}))
    yield c("qk_norm-wide", "qk_norm",
            lambda r: ((_n(r, 3, 300), _n(r, 2, 300), _n(r, 300), _n(r, 300)), {"eps": 0.3}))
    shapes = {"last": ((5, 300), (-1,), False), "first-long": ((700, 3), (0,), False),
              "middle-keep": ((3, 37, 5), (1,), True), "scattered": ((4, 3, 37), (0, 2), False),
              "scattered-keep": ((2, 3, 4, 5), (-1, 1), True), "all": ((3, 7, 11), (0, 1, 2), False)}
    for op in ("reduce_sum", "reduce_mean", "reduce_max"):
        for name, (shape, axes, keep) in shapes.items():
            yield c(f"{op}-{name}", op,
                    lambda r, s=shape, a=axes, k=keep: ((_n(r, *s),), {"axes": a, "keepdims": k}), 1e-4)
    for name, (shape, axes, keep) in shapes.items():
        def mean_bwd(r: np.random.Generator, s: tuple[int, ...] = shape, a: tuple[int, ...] = axes,
                     k: bool = keep) -> tuple[tuple[Any, ...], dict[str, Any]]:
            red = {i % len(s) for i in a}
            d = tuple(1 if i in red else n for i, n in enumerate(s)) if k else \
                tuple(n for i, n in enumerate(s) if i not in red)
            return (_n(r, *d),), {"shape": s, "axes": a, "keepdims": k}

        # against the NumPy kernel in float32 (d / count, one rounding): the same bits
        yield Case(f"reduce_mean_backward-{name}", "reduce_mean_backward", mean_bwd, 0.0,
                   launch=KERNELS["reduce_mean_backward"][0], reference=_mean_backward_f32)

        def max_bwd(r: np.random.Generator, s: tuple[int, ...] = shape, a: tuple[int, ...] = axes,
                    k: bool = keep) -> tuple[tuple[Any, ...], dict[str, Any]]:
            x = np.round(_n(r, *s) * 2) / 2  # few values: ties share the gradient
            y = np.max(x, axis=a, keepdims=k)
            return (_n(r, *y.shape), x, y), {"axes": a, "keepdims": k}

        yield c(f"reduce_max_backward-{name}", "reduce_max_backward", max_bwd, 1e-6)
    yield c("transpose", "transpose", lambda r: ((_n(r, 3, 37, 5),), {"dim0": 0, "dim1": -1}), 0.0)
    yield c("transpose-inner", "transpose", lambda r: ((_n(r, 2, 3, 37, 5),), {"dim0": 2, "dim1": 3}), 0.0)
    yield c("permute", "permute", lambda r: ((_n(r, 2, 3, 1, 37),), {"dims": (0, -2, 3, 1)}), 0.0)
    yield c("permute-int32", "permute",
            lambda r: ((r.integers(-9, 9, (4, 5, 6)).astype(np.int32),), {"dims": (2, 0, 1)}), 0.0)
    yield c("concat", "concat", lambda r: ((_n(r, 3, 2), _n(r, 3, 37), _n(r, 3, 1)), {}), 0.0)
    yield c("concat-first", "concat", lambda r: ((_n(r, 2, 2, 33), _n(r, 1, 2, 33)), {"dim": 0}), 0.0)
    yield c("concat-middle-int32", "concat",
            lambda r: ((r.integers(0, 50, (2, 3, 5)).astype(np.int32),
                        r.integers(0, 50, (2, 1, 5)).astype(np.int32)), {"dim": 1}), 0.0)
    yield c("split", "split", lambda r: ((_n(r, 3, 37),), {"sizes": (2, 34, 1)}), 0.0)
    yield c("split-first", "split", lambda r: ((_n(r, 5, 2, 33),), {"sizes": (3, 2), "dim": 0}), 0.0)
    yield c("split-middle", "split", lambda r: ((_n(r, 2, 7, 9),), {"sizes": (4, 0, 3), "dim": 1}), 0.0)
    yield c("broadcast_to-leading", "broadcast_to", lambda r: ((_n(r, 37),), {"shape": (2, 3, 37)}), 0.0)
    yield c("broadcast_to-ones", "broadcast_to", lambda r: ((_n(r, 3, 1),), {"shape": (2, 3, 37)}), 0.0)
    yield c("broadcast_to-axes", "broadcast_to",
            lambda r: ((_n(r, 2, 37),), {"shape": (2, 3, 37), "axes": (1,)}), 0.0)
    # the last two axes swapped: the tiled transpose (32 x 32 tiles), ragged edges, a batch of tiles
    yield c("transpose-last-two", "transpose", lambda r: ((_n(r, 3, 70, 45),), {"dim0": -1, "dim1": -2}), 0.0)
    yield c("permute-to-channels-last", "permute",
            lambda r: ((_n(r, 2, 5, 7, 11),), {"dims": (0, 2, 3, 1)}), 0.0)
    yield c("transpose-last-two-int32", "transpose",
            lambda r: ((r.integers(-9, 9, (33, 65)).astype(np.int32),), {"dim0": 0, "dim1": 1}), 0.0)
    # bf16 tensors under the bf16 recipe: 16-bit copies, the same bits (split's later parts are float32 here:
    # the bf16 part widened exactly)
    for id_, op, build in (
            ("transpose-bf16", "transpose", lambda r: ((_n(r, 3, 37, 5),), {"dim0": 0, "dim1": -1})),
            ("transpose-last-two-bf16", "transpose", lambda r: ((_n(r, 2, 33, 70),), {"dim0": 1, "dim1": 2})),
            ("permute-bf16", "permute", lambda r: ((_n(r, 2, 3, 1, 37),), {"dims": (0, -2, 3, 1)})),
            ("concat-bf16", "concat", lambda r: ((_n(r, 3, 2), _n(r, 3, 37), _n(r, 3, 1)), {"dim": -1})),
            ("split-bf16", "split", lambda r: ((_n(r, 5, 2, 33),), {"sizes": (3, 2), "dim": 0})),
            ("broadcast_to-bf16", "broadcast_to",
             lambda r: ((_n(r, 2, 37),), {"shape": (2, 3, 37), "axes": (1,)}))):
        opdef = op_registry().get_op(op)

        def reference(*a: Any, opdef: Any = opdef, **k: Any) -> Any:
            return opdef.kernel(*a, **{x.name: k.get(x.name, None if x.required else x.default)
                                       for x in opdef.attrs})

        yield Case(id_, op, build, 0.0, KERNELS[op][0], reference, True)


CASES |= {case.id: case for case in _coverage_cases()}


def _fused_head_cases() -> Iterator[Case]:
    """The LM head's fused training pass (``kiln.cuda._ops.FUSIONS``, outside the kernel table) against the
    NumPy backend's fused pass in float64, and under the bf16 recipe against NumPy's bf16 kernels of the two
    steps it replaces; 37 rows, a vocabulary of 301, ignored rows; and tiled over the vocabulary, the plan
    forced (ragged row blocks and chunks, targets on the chunks' edges)."""
    from kiln.core.plugins import get_registry
    from kiln.cuda import _ops

    table = get_registry("kernels")  # NumPy's kernels as the kernel table gives them: float64, and bf16's
    numpy_fused = table.find("fused_lm_head_loss_and_grad", "numpy", "float64").fn
    head_bf16 = table.find("fused_lm_head_loss", "numpy", "bfloat16").fn
    head_backward_bf16 = table.find("fused_lm_head_loss_backward", "numpy", "bfloat16").fn

    def launch(fn: Callable[..., None], plan: tuple[int, int] | None = None) -> Callable[..., None]:
        """``fn`` on the case's outputs; with ``plan``, in blocks of ``plan[0]`` rows and vocabulary chunks
        of ``plan[1]`` words, whatever the roofline would pick."""
        def run(d_loss: Any, x: Any, w: Any, t: Any, *, out: Any, **a: Any) -> None:
            fn(d_loss, x, w, t, loss=out[0], lse=out[1], d_x=out[2], d_weight=out[3], plan=plan, **a)

        return run

    def reference(d_loss: Any, x: Any, w: Any, t: Any, *, ignore_index: int) -> list[np.ndarray]:
        outs = [np.empty(x.shape[0]), np.empty(x.shape[0]), np.empty(x.shape), np.empty(w.shape)]
        numpy_fused(d_loss, x, w, t, loss=outs[0], lse=outs[1], d_x=outs[2], d_weight=outs[3],
                    ignore_index=ignore_index)
        return outs

    def two_steps_bf16(d_loss: Any, x: Any, w: Any, t: Any, *, ignore_index: int) -> list[np.ndarray]:
        a = {"ignore_index": ignore_index, "chunk_size": 64, "softcap": None}
        x, w = x.astype(np.float32), w.astype(np.float32)
        loss, lse = head_bf16(x, w, t, **a)
        return [loss, lse, *head_backward_bf16(d_loss.astype(np.float32), x, w, t, lse, None, **a)]

    def build(r: np.random.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
        t = r.integers(0, 301, 37).astype(np.int32)
        t[::5] = -100
        return (_n(r, 37, s=0.1), _n(r, 37, 24), _n(r, 301, 24, s=0.5), t), {"ignore_index": -100}

    name = "fused_lm_head_loss_and_grad"
    yield Case(name, name, build, 2e-5, launch(_ops.fused_lm_head_loss_and_grad), reference)
    # a GPU's cuBLASLt sums in another order: a bf16 gradient may move by one step of its scale
    yield Case(f"{name}-bf16", name, build, 2.5e-4, launch(_ops.fused_lm_head_loss_and_grad_bf16),
               two_steps_bf16, True, fp32_inputs=frozenset({0}), fp32_out=True)

    def head(n: int, v: int, chunk: int, ignore: int, s: float = 1.0) -> Build:
        def build(r: np.random.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
            t = r.integers(0, v, n).astype(np.int32)
            t[::4] = ignore  # ignored rows: no loss, no gradient
            t[1], t[2], t[3] = chunk - 1, chunk, v - 1  # on the chunks' edges, and in the ragged last chunk
            return (_n(r, n, s=s), _n(r, n, 24), _n(r, v, 24, s=0.5), t), {"ignore_index": ignore}

        return build

    # tiled over the vocabulary too (two passes): 13 rows in blocks of 5 (the last of 3), 150 words in
    # chunks of 64 (the last of 22); one block of 13 rows, chunks of 40 (the last of 30)
    tiled = f"{name}-vocab-tiled"
    yield Case(tiled, name, head(13, 150, 64, -100), 2e-5, launch(_ops.fused_lm_head_loss_and_grad, (5, 64)),
               reference)
    yield Case(f"{tiled}-ignore7", name, head(13, 150, 40, 7), 2e-5,
               launch(_ops.fused_lm_head_loss_and_grad, (13, 40)), reference)
    # under the bf16 recipe: 21 rows in blocks of 8, 53 words in chunks of 16. The log-sum-exp sums in
    # another order than NumPy's (and a GPU's GEMMs too), which can move a bf16 gradient by one step: d_loss
    # of 0.005 keeps them below 0.125 (0.04 typical), where a step is at most 2^-11
    yield Case(f"{tiled}-bf16", name, head(21, 53, 16, -100, 0.005), 2 ** -11,
               launch(_ops.fused_lm_head_loss_and_grad_bf16, (8, 16)), two_steps_bf16, True,
               fp32_inputs=frozenset({0}), fp32_out=True)


CASES |= {case.id: case for case in _fused_head_cases()}


def _direct_cases() -> Iterator[Case]:
    """The bf16 recipe's kernel variants that read their slots as they lie: the SIMT matmuls reading
    float32 operands rounded on load and writing bf16 (``matmul_bf16_<a><b><out>``, every transpose; on a
    GPU the same cases run cuBLASLt's bf16 GEMM, a bf16 output as its D type); the tiled bf16 attention
    reading a float32 ``qkv`` rounded on load and writing a float32 ``d_qkv`` (causal, GQA, a ragged
    block of rows)."""
    from kiln.cuda import _ops

    opdef = op_registry().get_op("matmul")

    def matmul_reference(*inputs: Any, **given: Any) -> Any:
        defaults = {a.name: a.default for a in opdef.attrs if not a.required}
        return opdef.kernel(*inputs, **{**defaults, **given})

    for types in ("hhh", "hff", "hfh", "fhf", "fhh", "fff", "ffh"):
        for t in ("NN", "NT", "TN", "TT"):
            def mm(r: np.random.Generator, t: str = t) -> tuple[tuple[Any, ...], dict[str, Any]]:
                a = _n(r, 37, 50, s=0.1) if t[0] == "N" else _n(r, 50, 37, s=0.1)
                b = _n(r, 50, 45, s=0.1) if t[1] == "N" else _n(r, 45, 50, s=0.1)
                return (a, b), {"transpose": t, "alpha": 0.5}

            # outputs of 0.035 typical, below 0.5 (14 of those): a bf16 one within half a step of 2^-9 (1e-3);
            # a float32 one within float32 summation order of the float64 product of the rounded operands
            # (a float32 operand read unrounded is off by about 3e-4)
            yield Case(f"matmul_bf16_{types}-{t}", "matmul", mm, 1e-3 if types[2] == "h" else 1e-6,
                       _ops.matmul_lowp, matmul_reference, True, fp32_out=types[2] == "f",
                       rounded_on_load=frozenset(i for i in (0, 1) if types[i] == "f"))

    def qkv(r: np.random.Generator, b: int, t: int, a: dict[str, Any]) -> np.ndarray:
        return _n(r, b, t, (a["Hq"] + 2 * a["Hkv"]) * a["D"])

    gqa = {"Hq": 2, "Hkv": 1, "D": 24}  # two query heads per KV head; 21 rows: one ragged block of 64
    for tc in (False, True):
        variant = "tc" if tc else "twin"

        def build(r: np.random.Generator, tc: bool = tc) -> tuple[tuple[Any, ...], dict[str, Any]]:
            return (qkv(r, 1, 21, gqa), None), {**gqa, "tensor_cores": tc}

        # flash_attention_<variant>64_bf16_f: the kernel reads the float32 qkv and rounds it
        yield Case(f"flash_attention_{variant}-f32-qkv-causal-gqa", "flash_attention", build, 1.5e-2,
                   _ops._flash_mma, _packed_attention, True, tc, rounded_on_load=frozenset({0}))
        for qkv_type in ("f32", "bf16"):
            def build_bwd(r: np.random.Generator, tc: bool = tc) -> tuple[tuple[Any, ...], dict[str, Any]]:
                x = qkv(r, 1, 21, gqa)
                o, lse = _packed_attention(_bf16(x).astype(np.float64), None, **gqa)
                return ((_n(r, *o.shape), x, _bf16(o.astype(np.float32)), lse.astype(np.float32),
                         _n(r, *lse.shape), None), {**gqa, "tensor_cores": tc})

            # ..._bf16_ff (a float32 qkv rounded on load) and _bf16_hf (a bf16 one): d_qkv float32
            yield Case(f"flash_attention_backward_{variant}-{qkv_type}-qkv-f32-grad-causal-gqa",
                       "flash_attention_backward", build_bwd, 3e-2, _ops._flash_mma_backward,
                       _packed_attention_backward, True, tc, frozenset({3, 4}), fp32_out=True,
                       rounded_on_load=frozenset({1}) if qkv_type == "f32" else frozenset())


CASES |= {case.id: case for case in _direct_cases()}

_UPDATES = ("adamw_update", "sgd_update")


def _to_device(device: Any, a: np.ndarray | None) -> DeviceArray | None:
    return None if a is None else DeviceArray.upload(device, a)


def _to_host(a: DeviceArray) -> np.ndarray:
    a.device.synchronize()
    if a.dtype == "bfloat16":  # widen the 16 bits to float32 exactly
        bits = a.device.copy_to_host(a.ptr, a.nbytes).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(a.shape)
    return a.download()


def _run_bf16(case: Case, device: Any, inputs: tuple[Any, ...], given: dict[str, Any]) -> float:
    """A case of kernels outside the kernel table on bf16 tensors: float inputs rounded to bf16 (those in
    ``case.fp32_inputs`` stay float32; those in ``case.rounded_on_load`` go to the device as float32, and to
    the reference rounded), the first output bf16 and the others float32."""
    import ml_dtypes

    assert case.launch is not None and case.reference is not None
    bf16 = [_is_float(a) and i not in case.fp32_inputs for i, a in enumerate(inputs)]
    rounded = [_bf16(a) if low else a for a, low in zip(inputs, bf16, strict=True)]
    dev_in = [_to_device(device, a if i in case.rounded_on_load else
                         r.astype(ml_dtypes.bfloat16) if low else r)
              for i, (a, r, low) in enumerate(zip(inputs, rounded, bf16, strict=True))]
    try:
        ref = case.reference(*[_f64(a) for a in rounded],
                             **{k: v for k, v in given.items() if k != "tensor_cores"})
        refs = list(ref) if isinstance(ref, (tuple, list)) else [ref]
        low_out = not case.fp32_out
        outs = [_to_device(device, np.full(np.shape(r), np.nan,
                                           ml_dtypes.bfloat16 if i == 0 and low_out else np.float32))
                for i, r in enumerate(refs)]
        case.launch(*dev_in, out=outs, **given)
        return max(float(np.abs(_to_host(o) - np.asarray(r)).max(initial=0.0))  # type: ignore[arg-type]
                   for o, r in zip(outs, refs, strict=True))
    finally:
        for d in [*dev_in]:
            if d is not None:
                device.free(d.ptr)


def _run_launch(case: Case, device: Any, inputs: tuple[Any, ...], given: dict[str, Any]) -> float:
    """A float32 case of a kernel outside the kernel table: ``case.launch`` against ``case.reference``
    (in float64), every output float32."""
    assert case.launch is not None and case.reference is not None
    dev_in = [_to_device(device, a) for a in inputs]
    try:
        refs = list(case.reference(*[_f64(a) for a in inputs], **given))
        outs = [_to_device(device, np.full(np.shape(r), np.nan, np.float32)) for r in refs]
        case.launch(*dev_in, out=outs, **given)
        return max(float(np.abs(_to_host(o) - np.asarray(r)).max(initial=0.0))  # type: ignore[arg-type]
                   for o, r in zip(outs, refs, strict=True))
    finally:
        for d in dev_in:
            if d is not None:
                device.free(d.ptr)


def _is_float(a: Any) -> bool:
    return isinstance(a, np.ndarray) and a.dtype == np.float32


def _f64(a: Any) -> Any:
    return a.astype(np.float64) if isinstance(a, np.ndarray) and a.dtype == np.float32 else a


def run_case(case: Case, device: Any, seed: int = 0) -> float:
    """The largest absolute difference between the kernel's outputs on ``device`` and the op's NumPy
    reference (in float64) for one case; raises if an output has the wrong shape."""
    inputs, given = case.build(np.random.default_rng(seed))
    if case.bf16:
        return _run_bf16(case, device, inputs, given)
    if case.launch is not None:
        return _run_launch(case, device, inputs, given)
    opdef = op_registry().get_op(case.op)
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
        outs = [_to_device(device, np.full(np.shape(r), -1, np.int32) if np.asarray(r).dtype.kind in "iu"
                           else np.full(np.shape(r), np.nan, np.float32)) for r in refs]
        fn(*dev_in, out=outs, **attrs_)
        return max(float(np.abs(_to_host(o) - np.asarray(r)).max(initial=0.0))  # type: ignore[arg-type]
                   for o, r in zip(outs, refs, strict=True))
    finally:
        for d in dev_in:
            if d is not None:
                device.free(d.ptr)
