"""Mamba's selective scan on cuda: the chunked (parallel) kernels for long sequences and the sequential kernel
for short ones, through the CPU emulator against kiln-core's NumPy reference (float64) and float64 finite
differences of it.

The chunked kernels run a block per channel, its threads along time (SCAN_ITEMS steps each), the state carried
from chunk to chunk. Here the blocks are made small (SCAN_CHUNK_THREADS = 64: two warps, chunks of 512
steps) so that ragged sequences span several chunks, the last one partial, at shapes the emulator runs in
seconds; one test runs the full-size geometry (four warps, chunks of 1024 steps).

Tolerance: the chunked scan reassociates the recurrence. The state before each thread's steps is a product
of up to a chunk's decays composed in a tree (the block scan) instead of left to right, so it differs from the
sequential float32 scan by a few ulps per factor: about (steps per thread + log2(threads)) * 2^-24 relative,
10^-6 of the outputs' scale here. Both float32 scans are compared to the float64 reference within ``RTOL`` of
the largest reference value of each output (the float32 rounding of a few thousand steps, of the order of
10^-6, and the reassociation, far below 2 * 10^-5).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.core import KilnError, op_registry
from kiln.cuda import _cubin, _device, _nvrtc, _ops
from kiln.cuda._emulate import EmulatedDevice
from kiln.cuda._ops import DeviceArray
from kiln.cuda._specs import SPECS

RTOL = 2e-5

#: (batch, channels D, T, state N, groups G (0: B and C of [B, N, T]), softplus/D/z/delta_bias, ssm_state in)
SHAPES = {
    "ragged-3-chunks": (2, 1, 1100, 16, 0, True, True),  # 512 + 512 + 76 steps
    "one-past-a-chunk": (1, 4, 513, 5, 2, False, False),  # a second chunk of a single step
    "groups-n1": (2, 6, 300, 1, 3, True, False),  # one chunk, the second warp's last threads idle
    "wide-state": (2, 3, 77, 40, 3, True, True),  # N > 32: chunked whatever T
    "tiny": (1, 2, 5, 3, 0, True, True),  # fewer steps than one thread holds
}


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_ops, "SCAN_CHUNK_THREADS", 64)
    monkeypatch.setattr(_ops, "SCAN_CHUNKED_MIN_T", 0)  # every scan chunked


def _n(rng: np.random.Generator, *shape: int, s: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * s).astype(np.float32)


def _inputs(shape: tuple[Any, ...], seed: int = 0) -> tuple[tuple[np.ndarray | None, ...], bool]:
    b, d, t, n, g, full, state = shape
    r = np.random.default_rng(seed)
    bc = (b, g, n, t) if g else (b, n, t)
    delta = _n(r, b, d, t, s=0.5)  # without softplus a step is positive, as Mamba's dt
    return ((_n(r, b, d, t), delta if full else np.abs(delta), -np.exp(_n(r, d, n, s=0.5)), _n(r, *bc),
             _n(r, *bc), _n(r, d) if full else None, _n(r, b, d, t) if full else None,
             _n(r, d, s=0.3) if full else None, _n(r, b, d, n) if state else None), full)


def _dev(device: Any, a: np.ndarray | None) -> DeviceArray | None:
    return None if a is None else DeviceArray.upload(device, np.asarray(a, np.float32))


def _host(a: DeviceArray) -> np.ndarray:
    return a.download()


def _empty(device: Any, shape: tuple[int, ...]) -> DeviceArray:
    return _dev(device, np.full(shape, np.nan, np.float32))


def _forward(device: Any, ins: tuple[np.ndarray | None, ...], full: bool) -> list[np.ndarray]:
    b, d, _ = ins[0].shape
    outs = [_empty(device, ins[0].shape), _empty(device, (b, d, ins[2].shape[1]))]
    _ops.mamba_selective_scan(*[_dev(device, a) for a in ins], out=outs, delta_softplus=full,
                              return_last_state=True)
    return [_host(o) for o in outs]


def _backward(device: Any, d_out: np.ndarray | None, ins: tuple[np.ndarray | None, ...],
              d_last: np.ndarray | None, full: bool) -> list[np.ndarray]:
    ref = op_registry().get_op("mamba_selective_scan_backward").kernel(
        d_out, *ins, d_last, delta_softplus=full)  # only for the outputs' shapes
    outs = [_empty(device, np.shape(r)) for r in ref]
    _ops.mamba_selective_scan_backward(_dev(device, d_out), *[_dev(device, a) for a in ins],
                                       _dev(device, d_last), out=outs, delta_softplus=full)
    return [_host(o) for o in outs]


def _f64(ins: tuple[np.ndarray | None, ...]) -> list[np.ndarray | None]:
    return [None if a is None else a.astype(np.float64) for a in ins]


def _close(got: list[np.ndarray], want: Any, rtol: float = RTOL) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == np.shape(w), i
        scale = max(1.0, float(np.abs(w).max(initial=0.0)))
        assert float(np.abs(g - w).max(initial=0.0)) <= rtol * scale, (i, float(np.abs(g - w).max()), scale)


def _launches(device: EmulatedDevice, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    names: list[str] = []
    launch = device.launch

    def record(name: str, *args: Any) -> None:
        names.append(name)
        launch(name, *args)

    monkeypatch.setattr(device, "launch", record)
    return names


@pytest.mark.parametrize("name", SHAPES)
def test_chunked_forward_matches_the_reference(emulated: EmulatedDevice, small_chunks: None,
                                               name: str) -> None:
    ins, full = _inputs(SHAPES[name])
    want = op_registry().get_op("mamba_selective_scan").kernel(*_f64(ins), delta_softplus=full,
                                                               return_last_state=True)
    _close(_forward(emulated, ins, full), want)


@pytest.mark.parametrize("name", SHAPES)
def test_chunked_backward_matches_the_reference(emulated: EmulatedDevice, small_chunks: None,
                                                name: str) -> None:
    ins, full = _inputs(SHAPES[name])
    r = np.random.default_rng(1)
    d_out = _n(r, *ins[0].shape)
    d_last = _n(r, *ins[0].shape[:2], ins[2].shape[1])
    want = op_registry().get_op("mamba_selective_scan_backward").kernel(
        d_out.astype(np.float64), *_f64(ins), d_last.astype(np.float64), delta_softplus=full)
    _close(_backward(emulated, d_out, ins, d_last, full), want)


def test_chunked_backward_without_output_or_state_gradients(emulated: EmulatedDevice,
                                                            small_chunks: None) -> None:
    """d_out None (only the last state's gradient flows) and, separately, no d_last_state."""
    ins, full = _inputs(SHAPES["ragged-3-chunks"])
    d_last = _n(np.random.default_rng(2), *ins[8].shape)
    bwd = op_registry().get_op("mamba_selective_scan_backward").kernel
    for d_out, last in ((None, d_last), (_n(np.random.default_rng(3), *ins[0].shape), None)):
        want = bwd(None if d_out is None else d_out.astype(np.float64), *_f64(ins),
                   None if last is None else last.astype(np.float64), delta_softplus=full)
        _close(_backward(emulated, d_out, ins, last, full), want)


def test_chunked_and_sequential_kernels_agree(emulated: EmulatedDevice,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The same scan (three chunks) through both kernels, forward and backward, within the tolerance."""
    monkeypatch.setattr(_ops, "SCAN_CHUNK_THREADS", 64)
    ins, full = _inputs(SHAPES["ragged-3-chunks"], seed=4)
    r = np.random.default_rng(5)
    d_out, d_last = _n(r, *ins[0].shape), _n(r, *ins[8].shape)
    runs = []
    names = _launches(emulated, monkeypatch)
    for min_t in (0, 10**9):
        monkeypatch.setattr(_ops, "SCAN_CHUNKED_MIN_T", min_t)
        runs.append(_forward(emulated, ins, full) + _backward(emulated, d_out, ins, d_last, full))
    assert "mamba_scan_chunked_backward_f32" in names and "mamba_scan_backward_f32" in names
    _close(runs[0], runs[1])


def test_chunked_backward_is_deterministic(emulated: EmulatedDevice, small_chunks: None) -> None:
    """The same bits twice (d_A's, d_B's and d_C's sums run in a fixed order), on fresh buffers each time."""
    ins, full = _inputs(SHAPES["ragged-3-chunks"], seed=6)
    r = np.random.default_rng(7)
    d_out, d_last = _n(r, *ins[0].shape), _n(r, *ins[8].shape)
    first, again = (_backward(emulated, d_out, ins, d_last, full) for _ in range(2))
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))


def test_chunked_gradients_match_finite_differences(emulated: EmulatedDevice, small_chunks: None) -> None:
    """The kernel's gradients of L = <out, W> + <last_state, V> against central differences of the float64
    reference along a random direction of each input (two chunks: 512 + 88 steps, groups, every option)."""
    shape = (1, 2, 600, 3, 2, True, True)
    ins, full = _inputs(shape, seed=8)
    r = np.random.default_rng(9)
    W, V = r.standard_normal(ins[0].shape), r.standard_normal(ins[8].shape)
    fwd = op_registry().get_op("mamba_selective_scan").kernel

    def loss(x: list[np.ndarray | None]) -> float:
        out, last = fwd(*x, delta_softplus=full, return_last_state=True)
        return float((out * W).sum() + (last * V).sum())

    grads = _backward(emulated, W.astype(np.float32), ins, V.astype(np.float32), full)
    # gradient of each input: d_u, d_delta, d_A, d_B, d_C, d_D, d_z, d_delta_bias, d_ssm_state
    base, eps = _f64(ins), 1e-6
    for i, g in enumerate(grads):
        direction = r.standard_normal(g.shape)
        plus = [a if j != i else a + eps * direction for j, a in enumerate(base)]
        minus = [a if j != i else a - eps * direction for j, a in enumerate(base)]
        numeric = (loss(plus) - loss(minus)) / (2 * eps)
        analytic = float((g.astype(np.float64) * direction).sum())
        assert abs(analytic - numeric) <= 1e-4 * max(1.0, abs(numeric)), (i, analytic, numeric)


@pytest.mark.parametrize(("min_blocks", "per_block"), [(16, 1), (8, 2), (1, 4)])
def test_blocks_of_several_channels_sum_d_B_and_d_C_in_order(emulated: EmulatedDevice, small_chunks: None,
                                                            monkeypatch: pytest.MonkeyPatch, min_blocks: int,
                                                            per_block: int) -> None:
    """A chunked backward's block runs 1, 2 or all 4 channels of a group (two groups, two chunks), summing
    their parts of d_B and d_C in its slice: every gradient as the float64 reference, the same bits on a
    second run; with a block per group its slices are d_B and d_C (no group sum runs)."""
    monkeypatch.setattr(_ops, "SCAN_MIN_BLOCKS", min_blocks)
    shape = (2, 8, 600, 3, 2, True, True)
    assert _ops.scan_channels_per_block(2, 8, 2) == per_block
    ins, full = _inputs(shape, seed=13)
    r = np.random.default_rng(14)
    d_out, d_last = _n(r, *ins[0].shape), _n(r, *ins[8].shape)
    names = _launches(emulated, monkeypatch)
    got = _backward(emulated, d_out, ins, d_last, full)
    want = op_registry().get_op("mamba_selective_scan_backward").kernel(
        d_out.astype(np.float64), *_f64(ins), d_last.astype(np.float64), delta_softplus=full)
    _close(got, want)
    assert names.count("mamba_sum_group_f32") == (0 if per_block == 4 else 2)
    again = _backward(emulated, d_out, ins, d_last, full)
    assert all(np.array_equal(a, b) for a, b in zip(got, again, strict=True))


@pytest.mark.parametrize(("b", "d", "g", "per_block"), [(4, 1536, 0, 12), (4, 1536, 8, 12), (8, 512, 64, 8),
                                                        (1, 64, 4, 1)])
def test_the_chunked_backward_workspace_holds_d_B_and_d_C_parts_per_block(b: int, d: int, g: int,
                                                                           per_block: int) -> None:
    """The backward's scratch, by the dry run that sizes a Program's workspace, at T = 2048, N = 16: the
    parts of d_B and d_C per block of ``per_block`` channels ([B, D / per_block, N, T] each; none when a block
    runs a whole group: it sums into d_B and d_C), d_A's [B, D, N], d_D's and d_delta_bias's [B, D] and the
    chunks' first states [B, D, 2, N]. Before, the parts were per channel: 2 * B * D * N * T floats (0.8 GB
    each at B = 4, D = 1536)."""
    from kiln.cuda._backend import _SizingDevice

    t, n = 2048, 16
    assert _ops.scan_channels_per_block(b, d, g) == per_block
    sizing = _SizingDevice(None)
    bc = (b, g, n, t) if g else (b, n, t)
    shapes = {"u": (b, d, t), "A": (d, n), "B": bc, "D": (d,), "bias": (d,), "state": (b, d, n)}
    a = {k: DeviceArray(sizing, 0, v, "float32") for k, v in shapes.items()}
    outs = [a["u"], a["u"], a["A"], a["B"], a["B"], a["D"], a["u"], a["bias"], a["state"]]
    _ops.mamba_selective_scan_backward(a["u"], a["u"], a["u"], a["A"], a["B"], a["B"], a["D"], a["u"],
                                       a["bias"], a["state"], a["state"], out=outs, delta_softplus=True)
    parts = 0 if per_block == d // (g or 1) else 2 * b * (d // per_block) * n * t
    assert sizing.high == 4 * (parts + b * d * n + 2 * b * d + b * d * 2 * n)
    if (b, d) == (4, 1536):
        assert sizing.high < 2 * b * d * n * t * 4 / 10


def test_the_backward_cost_counts_the_parts_of_d_B_and_d_C() -> None:
    """kiln-core's cost of the scan backward (the roofline's bytes) at B = 4, D = 1536, T = 2048, N = 16:
    every input read and every gradient written, float32, plus the per-channel parts of d_B and d_C (4
    bytes per (b, d, n, t) each) written and read back once: they outweigh the rest (B and C serve every
    channel of their group)."""
    b, d, t, n = 4, 1536, 2048, 16
    bdt, dn, bnt, bdn = (b, d, t), (d, n), (b, n, t), (b, d, n)
    # d_out, u, delta, A, B, C, D, z, delta_bias, ssm_state, d_last_state
    ins = [bdt, bdt, bdt, dn, bnt, bnt, (d,), bdt, (d,), bdn, bdn]
    grads = ins[1:]
    tensors = 4 * sum(np.prod(s) for s in ins + grads)
    parts = 2 * 2 * 4 * b * d * n * t
    cost = op_registry().get_op("mamba_selective_scan_backward").cost(ins, {"delta_softplus": True})
    assert cost.bytes == pytest.approx(tensors + parts)
    assert parts > 5 * tensors


def test_the_kernel_is_chosen_by_sequence_length(emulated: EmulatedDevice,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Short T with N <= 32: the sequential kernel; T >= SCAN_CHUNKED_MIN_T or N > 32: the chunked one."""
    names = _launches(emulated, monkeypatch)
    for shape, kernel in (((1, 2, _ops.SCAN_CHUNKED_MIN_T - 1, 16, 0, False, False), "mamba_scan_f32"),
                          ((1, 2, _ops.SCAN_CHUNKED_MIN_T, 16, 0, False, False), "mamba_scan_chunked_f32"),
                          ((1, 2, 3, 33, 0, False, False), "mamba_scan_chunked_f32")):
        names.clear()
        ins, full = _inputs(shape)
        _forward(emulated, ins, full)
        assert names == [kernel]
    assert [_ops.scan_threads(t) for t in (1, 256, 257, 1024, 5000)] == [32, 32, 64, 128, 128]


def test_long_sequence_in_full_size_chunks(emulated: EmulatedDevice) -> None:
    """The launch geometry a GPU gets: 128 threads (four warps), chunks of 1024 steps; T = 2100 is three
    chunks. Forward and backward against the reference."""
    shape = (1, 2, 2100, 4, 0, True, True)
    assert _ops.scan_chunked(2100, 4) and _ops.scan_threads(2100) * _ops.SCAN_ITEMS == 1024
    ins, full = _inputs(shape, seed=10)
    f64 = _f64(ins)
    fwd = op_registry().get_op("mamba_selective_scan").kernel
    want = fwd(*f64, delta_softplus=full, return_last_state=True)
    _close(_forward(emulated, ins, full), want)
    r = np.random.default_rng(11)
    d_out, d_last = _n(r, *ins[0].shape), _n(r, *ins[8].shape)
    want = op_registry().get_op("mamba_selective_scan_backward").kernel(
        d_out.astype(np.float64), *f64, d_last.astype(np.float64), delta_softplus=full)
    _close(_backward(emulated, d_out, ins, d_last, full), want)


def test_a_state_past_the_kernels_is_an_error(emulated: EmulatedDevice) -> None:
    ins, full = _inputs((1, 2, 4, _ops.SCAN_MAX_N + 1, 0, False, False))
    with pytest.raises(KilnError, match=r"N <= 256 per channel.*found N = 257"):
        _forward(emulated, ins, full)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_100"])
def test_scan_kernels_compile_with_the_launch_layout_and_no_spills(cubins: dict, tmp_path: Path,
                                                                  arch: str) -> None:
    """mamba.cu's CUBIN (cuobjdump): every scan kernel with the launch code's parameter layout and no local
    memory (no register spills in the chunked kernels' per-thread arrays); sm_100 where NVRTC has it."""
    if arch == "sm_100":
        nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
        err, archs = nvrtc.nvrtcGetSupportedArchs()
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS or 100 not in archs:
            pytest.skip(f"this NVRTC does not compile for sm_100 ({archs})")
        cubin = _nvrtc.compile_cubin("mamba.cu", arch, cache=tmp_path).cubin
    else:
        cubin = cubins["mamba.cu", arch]
    layouts, resources = _cubin.param_layouts(cubin), _cubin.resources(cubin)
    scan = [name for name in SPECS if name.startswith(("mamba_scan", "mamba_sum"))]
    assert {"mamba_scan_chunked_f32", "mamba_scan_chunked_backward_f32"} <= set(scan)
    for name in scan:
        assert layouts[name] == SPECS[name].layout(), name
        assert resources[name].local == 0, name


def test_a_mamba_model_trains_on_the_chunked_scan_as_on_numpy(emulated: EmulatedDevice,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny MambaModel on ``cuda`` over the emulator, its scans (forward, and the backward's replay) on the
    chunked kernels in two chunks (T = 300, chunks of 256 steps): the loss and every gradient of the NumPy
    backend, through the backend's planning of the kernels' workspace."""
    from kiln.core import Model, PluginSession
    from kiln.cuda import EmulatedCuda
    from kiln.dsl import build_bundle

    monkeypatch.setattr(_ops, "SCAN_CHUNKED_MIN_T", 0)
    monkeypatch.setattr(_ops, "SCAN_CHUNK_THREADS", 32)
    names = _launches(emulated, monkeypatch)
    config = {"vocab_size": 29, "d_model": 8, "n_layers": 1, "d_state": 3, "d_conv": 3, "expand": 2,
              "dt_rank": 2}
    rng = np.random.default_rng(12)
    ids = rng.integers(0, 29, (2, 300))
    batch = {"input_ids": ids, "labels": np.roll(ids, -1, axis=1)}
    bundle = build_bundle("MambaModel", config)
    with PluginSession(autoload=False).activate() as session:
        session.register(EmulatedCuda(emulated), "cuda-emulated")
        reference, device = (Model.from_ir(bundle, seed=0, backend=b) for b in ("numpy", "cuda"))
        losses = [m.forward_backward(batch)["loss"] for m in (reference, device)]
        want, got = reference.gradients(), device.gradients()
    assert "mamba_scan_chunked_backward_f32" in names and "mamba_scan_backward_f32" not in names
    assert losses[1] == pytest.approx(losses[0], abs=1e-5)
    assert set(got) == set(want)
    for name in want:
        scale = max(1.0, float(np.abs(want[name]).max()))
        assert float(np.abs(got[name] - want[name]).max()) <= 1e-5 * scale, name


def _timed(device: Any, run: Any, repeat: int = 5) -> float:
    run()  # compiles and warms up
    device.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        run()
    device.synchronize()
    return (time.perf_counter() - start) / repeat


def _both_kernels_timed(gpu: Any, t: int, monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    """Seconds of a forward plus backward (B = 2, D = 1024, N = 16) on each kernel."""
    ins, full = _inputs((2, 1024, t, 16, 0, True, True))
    dev_in = [_dev(gpu, a) for a in ins]
    r = np.random.default_rng(13)
    d_out, d_last = _dev(gpu, _n(r, *ins[0].shape)), _dev(gpu, _n(r, *ins[8].shape))
    outs = [_empty(gpu, ins[0].shape), _empty(gpu, ins[8].shape)]
    grads = [_empty(gpu, a.shape) for a in (*ins[:6], ins[0], ins[7], ins[8])]

    def step() -> None:
        _ops.mamba_selective_scan(*dev_in, out=outs, delta_softplus=full, return_last_state=True)
        _ops.mamba_selective_scan_backward(d_out, *dev_in, d_last, out=grads, delta_softplus=full)

    times = {}
    for kind, min_t in (("sequential", 10**9), ("chunked", 0)):
        monkeypatch.setattr(_ops, "SCAN_CHUNKED_MIN_T", min_t)
        times[kind] = _timed(gpu, step)
    monkeypatch.undo()
    for a in (*dev_in, d_out, d_last, *outs, *grads):
        if a is not None:
            gpu.free(a.ptr)
    return times


@pytest.mark.gpu
@pytest.mark.skipif(not _device.device_status()[0], reason=f"needs a CUDA GPU: {_device.device_status()[1]}")
def test_the_length_threshold_picks_the_faster_kernel_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the device, forward plus backward of both kernels over T: the kernel SCAN_CHUNKED_MIN_T picks takes
    at most 1.25x the faster one's time at every T, and the chunked one wins at T = 2048. A failure means the
    threshold (an estimate until a GPU measured it) needs moving; the times are printed."""
    gpu = _device.CudaDevice()
    times = {t: _both_kernels_timed(gpu, t, monkeypatch) for t in (16, 64, 128, 512, 2048)}
    print("\n".join(f"T={t}: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in ts.items())
                    for t, ts in times.items()))
    for t, ts in times.items():
        picked = ts["chunked" if _ops.scan_chunked(t, 16) else "sequential"]
        assert picked <= 1.25 * min(ts.values()), times
    assert times[2048]["chunked"] < times[2048]["sequential"], times
