"""Matmuls through cuBLASLt: the plan (how kiln's row-major matmul maps onto cuBLASLt's column-major GEMM)
checked here by running it with cuBLASLt's documented semantics in NumPy, on the emulator's memory, as the
backend's matmul path; the real library runs in test_gpu.py."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest

from kiln.core import KilnError
from kiln.cuda import _blas
from kiln.cuda._blas import CUDA_TYPES, GemmPlan, gemm_plan
from kiln.cuda._check import CASES, run_case
from kiln.cuda._emulate import EmulatedDevice

_NP: dict[int, Any] = {CUDA_TYPES["float32"]: np.float32}
try:  # bf16 operands (the bf16 recipe's matmuls)
    import ml_dtypes

    _NP[CUDA_TYPES["bfloat16"]] = ml_dtypes.bfloat16
except ImportError:  # pragma: no cover - ml_dtypes comes with kiln-core[bf16]
    pass


def _colmajor(ptr: int, dtype: Any, rows: int, cols: int, ld: int, batch: int, stride: int) -> np.ndarray:
    """The column-major [batch, rows, cols] matrices at ``ptr`` (leading dimension ld, batch stride)."""
    item = np.dtype(dtype).itemsize
    size = (batch - 1) * stride + (cols - 1) * ld + rows if rows and cols else 0
    flat = np.ctypeslib.as_array((ctypes.c_char * max(size * item, 1)).from_address(ptr)).view(dtype)
    return np.lib.stride_tricks.as_strided(flat, (batch, rows, cols), (stride * item, item, ld * item))


class NumpyBlas:
    """cuBLASLt's GEMM as its documentation states it, D = alpha opA(A) opB(B) + beta C in column-major
    order, on host pointers (the emulator's memory): an oracle independent of :func:`gemm_plan`."""

    def __init__(self) -> None:
        self.calls: list[GemmPlan] = []

    def gemm(self, p: GemmPlan, a: int, b: int, c: int, d: int) -> None:
        self.calls.append(p)
        dt, operands = _NP[p.types[2]], _NP[p.types[0]]  # a and b share one type (gemm_plan checks)
        opa = _colmajor(a, operands, *((p.k, p.m) if p.trans_a else (p.m, p.k)), p.lda, p.batch, p.stride_a)
        opb = _colmajor(b, operands, *((p.n, p.k) if p.trans_b else (p.k, p.n)), p.ldb, p.batch, p.stride_b)
        opa, opb = (x.swapaxes(1, 2) if t else x for x, t in ((opa, p.trans_a), (opb, p.trans_b)))
        out = p.alpha * np.matmul(opa.astype(np.float64), opb.astype(np.float64))
        if p.beta:
            out += p.beta * _colmajor(c or d, dt, p.m, p.n, p.ldc, p.batch, p.stride_c)
        _colmajor(d, dt, p.m, p.n, p.ldc, p.batch, p.stride_c)[...] = out


@pytest.fixture
def blas_device(emulated: EmulatedDevice) -> Any:
    device = EmulatedDevice(kernel_dir=emulated.kernel_dir, cache=emulated.cache)
    device.blas = NumpyBlas()  # type: ignore[attr-defined]
    return device


MATMULS = [name for name, case in CASES.items()
           if case.op in ("matmul", "batched_matmul", "fused_lm_head_loss", "fused_lm_head_loss_backward",
                          "fused_lm_head_loss_and_grad")]


@pytest.mark.parametrize("name", MATMULS)
def test_matmul_cases_through_the_cublaslt_path(blas_device: Any, name: str) -> None:
    """Every transpose, alpha, beta, accumulate, a batch, and the LM head's tiles (its fused pass tiled over
    the vocabulary too): the plans cuBLASLt would get give the NumPy reference's results, and the SIMT
    kernel is not used. cuBLASLt cannot round on load: a float32 operand of the bf16 recipe's matmul takes
    a bf16 copy (one cast kernel), and a bf16 output is the GEMM's D type."""
    case = CASES[name]
    assert run_case(case, blas_device) <= case.atol
    assert blas_device.blas.calls
    if "matmul" in case.op:
        assert blas_device.launches == len(case.rounded_on_load)
        if case.bf16 and not case.fp32_out:
            assert {p.types[2] for p in blas_device.blas.calls} == {CUDA_TYPES["bfloat16"]}


@pytest.mark.parametrize("name", ["grouped_gemm-NT", "grouped_gemm-NN", "moe_grouped_gemm_dx",
                                  "moe_grouped_gemm_dw"])
def test_grouped_gemms_one_cublaslt_gemm_per_expert(blas_device: Any, name: str) -> None:
    case = CASES[name]
    assert run_case(case, blas_device) <= case.atol
    assert len(blas_device.blas.calls) == 3  # four experts, one of them empty: no GEMM (dw: zeros)
    assert blas_device.launches == 0


def test_bf16_in_fp32_accumulate() -> None:
    plan = gemm_plan((4, 8), (8, 6), (4, 6), ("bfloat16", "bfloat16", "float32"))
    assert plan.types == (14, 14, 0) and plan.compute == _blas.COMPUTE_32F
    tf32 = gemm_plan((4, 8), (8, 6), (4, 6), ("float32",) * 3, tf32=True)
    assert tf32.compute == _blas.COMPUTE_32F_FAST_TF32
    assert gemm_plan((4, 8), (8, 6), (4, 6), ("bfloat16",) * 3, tf32=True).compute == _blas.COMPUTE_32F


@pytest.mark.parametrize(("args", "message"), [
    (((4, 8), (8, 6), (4, 6), ("bfloat16", "float32", "float32")), "must both be bfloat16 or both float32"),
    (((4, 8), (8, 6), (4, 6), ("float16",) * 3), "must both be bfloat16 or both float32"),
    (((4, 8), (7, 6), (4, 6), ("float32",) * 3), r"op\(a\) of \(4, 8\) \(NN\) times op\(b\) of \(7, 6\)"),
    (((2, 4, 8), (3, 8, 6), (2, 4, 6), ("float32",) * 3), "does not make out"),
    (((8,), (8, 6), (6,), ("float32",) * 3), "same rank"),
])
def test_bad_matmuls_are_named(args: tuple, message: str) -> None:
    with pytest.raises(KilnError, match=message):
        gemm_plan(*args)
    with pytest.raises(KilnError, match="transpose must be"):
        gemm_plan((4, 8), (8, 6), (4, 6), ("float32",) * 3, transpose="NX")


def test_without_nvmath_a_gpu_device_keeps_the_simt_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_blas.importlib.util, "find_spec", lambda name: None)
    assert not _blas.nvmath_installed()


def test_the_bf16_recipe_gives_cublaslt_bf16_operands(emulated: EmulatedDevice) -> None:
    """Under the bf16 recipe the backend hands cuBLASLt bf16 a and b (fp32 out): a tiny Qwen3 trains two
    steps through that path, every GEMM of its matmuls with bf16 operands, within 1e-3 of the NumPy
    backend's emulation (the oracle GEMM sums in float64, NumPy in float32: a bf16 rounding of a matmul
    output flips now and then)."""
    pytest.importorskip("ml_dtypes")
    dsl = pytest.importorskip("kiln.dsl", reason="the Qwen3 model comes from kiln-dsl")
    from kiln.core import Model, PluginSession
    from kiln.cuda import EmulatedCuda
    from kiln.dsl.stdlib.models import Qwen3Model

    config = {"vocab_size": 64, "d_model": 32, "n_layers": 1, "num_query_heads": 4, "num_kv_heads": 2,
              "head_size": 8, "d_ff": 64, "max_seq": 16}
    bundle = dsl.build_bundle(Qwen3Model, config)
    device = EmulatedDevice(kernel_dir=emulated.kernel_dir, cache=emulated.cache)
    device.blas = NumpyBlas()  # type: ignore[attr-defined]
    rng = np.random.default_rng(0)
    batch = {"input_ids": rng.integers(0, 64, (2, 8)), "labels": rng.integers(0, 64, (2, 8))}
    session = PluginSession(autoload=False)
    session.register(EmulatedCuda(device), "cuda-emulated")
    with session.activate():
        ref, got = (Model.from_ir(bundle, seed=0, backend=b, precision="bf16") for b in ("numpy", "cuda"))
        for _ in range(2):
            assert got.train_step(batch)["loss"] == pytest.approx(ref.train_step(batch)["loss"], abs=1e-3)
    bf16 = CUDA_TYPES["bfloat16"]
    assert device.blas.calls and all(p.types[:2] == (bf16, bf16) for p in device.blas.calls)


# --- the bf16 recipe on cuBLASLt: one bf16 copy of each weight per training step, planned in the arena ---

QWEN3 = {"vocab_size": 64, "d_model": 32, "n_layers": 1, "num_query_heads": 4, "num_kv_heads": 2,
         "head_size": 8, "d_ff": 64, "max_seq": 16}
#: the float32 weights a Qwen3 layer's bf16 matmuls read (the LM head's and the embedding's are not matmuls)
LAYER_MATMUL_WEIGHTS = ("blocks.0.qkv_weight", "blocks.0.out_weight", "blocks.0.mlp_up_weight",
                        "blocks.0.mlp_down_weight")
LORA = {"passes": [("lora", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                             "init_lora_weights": False})], "mode": "lora"}


class CastCounting(EmulatedDevice):
    """The emulator with cuBLASLt's documented GEMM, recording the source of every float32 -> bf16 cast."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.blas = NumpyBlas()
        self.cast_from: list[int] = []

    def launch(self, name: str, grid: Any, block: Any, args: Any) -> None:
        if name == "cast_f32_bf16":
            self.cast_from.append(int(args[0]))
        super().launch(name, grid, block, args)


def _train(emulated: EmulatedDevice, *, copies: bool = True, blas: bool = True, steps: int = 2,
           recompute: str = "block", **options: Any) -> tuple[Any, CastCounting, list[dict[str, float]]]:
    """A tiny Qwen3 trained ``steps`` AdamW steps (recompute ``block``: each weight read by its forward
    product, the replay and ``d_x``) under the bf16 recipe on the emulator, with cuBLASLt's GEMM when
    ``blas``; ``copies=False``: the backend plans no weight copies (a copy per product, as before them).
    Returns the model, its device and the steps' results, each with the device's allocations after it."""
    pytest.importorskip("ml_dtypes")
    dsl = pytest.importorskip("kiln.dsl", reason="the Qwen3 model comes from kiln-dsl")
    from kiln.core import Model, PluginSession
    from kiln.cuda import EmulatedCuda, _backend
    from kiln.dsl.stdlib.models import Qwen3Model

    device = CastCounting(kernel_dir=emulated.kernel_dir, cache=emulated.cache)
    if not blas:
        device.blas = None  # type: ignore[assignment]
    rng = np.random.default_rng(0)
    batch = {"input_ids": rng.integers(0, 64, (2, 8)), "labels": rng.integers(0, 64, (2, 8))}
    session = PluginSession(autoload=False)
    session.register(EmulatedCuda(device), "cuda-emulated")
    if "passes" in options:
        session.register(pytest.importorskip("kiln.peft._plugin", reason="LoRA comes from kiln-peft"), "peft")
    with pytest.MonkeyPatch.context() as mp, session.activate():
        if not copies:
            mp.setattr(_backend.CudaBackend, "held_bytes", lambda self, program, kernels: {})
        model = Model.from_ir(dsl.build_bundle(Qwen3Model, QWEN3), seed=0, backend="cuda", precision="bf16",
                              recompute=recompute, **options)
        results = [{**model.train_step(batch), "allocs": device.allocs} for _ in range(steps)]
    return model, device, results


@pytest.fixture(scope="module")
def with_copies(emulated: EmulatedDevice) -> tuple[Any, CastCounting, list[dict[str, float]]]:
    return _train(emulated)


@pytest.fixture(scope="module")
def per_product(emulated: EmulatedDevice) -> tuple[Any, CastCounting, list[dict[str, float]]]:
    return _train(emulated, copies=False)


def _weight_casts(model: Any, device: CastCounting) -> dict[str, int]:
    """How many times each weight was cast to bf16 (casts whose source is the weight's arena address)."""
    program = model.program(2, 8)
    weights = {sl.name for sl in program.slots if sl.kind == "weight"}
    at = {model._arena.ptr + t.offset: k for k, t in program.tensors.items() if t.slot in weights}
    counts: dict[str, int] = {}
    for ptr in device.cast_from:
        if ptr in at:
            counts[at[ptr]] = counts.get(at[ptr], 0) + 1
    return counts


def _matmul_reads(program: Any, weights: Any) -> dict[str, int]:
    """The products reading each weight: its forward, a recompute replay, d_x (d_W reads activations)."""
    return {w: sum(st.op.type == "matmul" and w in st.inputs for st in program.steps) for w in weights}


def test_each_weight_takes_one_bf16_copy_per_step_with_the_same_bits(with_copies: Any,
                                                                     per_product: Any) -> None:
    """On cuBLASLt the bf16 recipe casts each float32 weight its matmuls read once per training step (the
    forward product, a recompute replay and ``d_x`` read that copy), not once per product; and the losses
    of two AdamW steps (the second reads the updated weights: a stale copy would change it) and every
    weight after them are bit for bit those of a copy per product."""
    (model, device, results), (base, base_device, base_results) = with_copies, per_product
    reads = _matmul_reads(model.program(2, 8), LAYER_MATMUL_WEIGHTS)
    assert min(reads.values()) >= 2 and max(reads.values()) == 3
    # two steps; the LM head's pass casts its weight once per step of its own (one copy for all its tiles)
    assert _weight_casts(base, base_device) == {**{w: 2 * n for w, n in reads.items()}, "lm_head": 2}
    assert _weight_casts(model, device) == {w: 2 for w in (*LAYER_MATMUL_WEIGHTS, "lm_head")}  # 1 a step
    assert [r["loss"] for r in results] == [r["loss"] for r in base_results]
    assert results[1]["loss"] != results[0]["loss"]  # the second step ran on updated weights
    for k in (*LAYER_MATMUL_WEIGHTS, "lm_head", "embedding"):
        np.testing.assert_array_equal(model.read(k), base.read(k))


def test_the_weight_copies_are_planned_in_the_arena(with_copies: Any) -> None:
    """The copies are slots of the Program's arena (kind ``held``), one per weight, live from its first
    reader to its last, 2 bytes an element: the memory report counts them (its kinds still add up to the
    peak), the memory table shows them, and a training step allocates nothing beside the arena."""
    model, _, results = with_copies
    program = model.program(2, 8)
    held = {sl.name: sl for sl in program.slots if sl.kind == "held"}
    assert set(held) == {f"bf16.{w}" for w in LAYER_MATMUL_WEIGHTS}
    for w in LAYER_MATMUL_WEIGHTS:
        elements = int(np.prod(program.tensors[w].shape))
        assert held[f"bf16.{w}"].nbytes == -(-2 * elements // 64) * 64
        readers = [st.index for st in program.steps if st.op.type == "matmul" and w in st.inputs]
        assert (held[f"bf16.{w}"].first, held[f"bf16.{w}"].last) == (min(readers), max(readers))
    report = program.memory_report()
    assert report["held"] == sum(sl.nbytes for sl in held.values()) > 0
    assert sum(report[k] for k in ("weights", "gradients", "optimizer_state", "inputs", "outputs",
                                   "saved_activations", "held", "transient")) == report["peak"]
    assert "held" in program.memory_table() and "bf16.blocks.0.qkv_weight" in program.memory_table()
    assert results[1]["allocs"] == results[0]["allocs"]  # the second step allocated nothing


def test_the_simt_kernels_plan_no_weight_copies(emulated: EmulatedDevice) -> None:
    """Without cuBLASLt the SIMT matmul rounds a float32 weight on its load: no copy is planned or made (the
    LM head's pass keeps its own)."""
    model, device, _ = _train(emulated, blas=False, steps=1)
    program = model.program(2, 8)
    assert not [sl for sl in program.slots if sl.kind == "held"] and program.memory_report()["held"] == 0
    assert set(_weight_casts(model, device)) <= {"lm_head"}


def test_lora_copies_its_frozen_base_weights_once_per_step(emulated: EmulatedDevice) -> None:
    """LoRA on q_proj and v_proj: the frozen base weights (no gradient of their own) and the adapters'
    weights are each cast once per step, with the bits of a copy per product (the adapters train)."""
    model, device, results = _train(emulated, **LORA)
    base, base_device, base_results = _train(emulated, copies=False, **LORA)
    program = model.program(2, 8)
    trained = {p.name for p in program.params if p.trainable}
    assert trained and all("lora" in k for k in trained)
    weights = {sl.name for sl in program.slots if sl.kind == "weight"}
    read = {k for st in program.steps if st.op.type == "matmul" for k in st.inputs if k in weights}
    assert read & trained and read - trained  # adapters and frozen base weights, both read by matmuls
    reads = _matmul_reads(program, read)
    assert max(reads.values()) > 1
    assert _weight_casts(base, base_device) == {**{w: 2 * n for w, n in reads.items()}, "lm_head": 2}
    assert _weight_casts(model, device) == {w: 2 for w in read | {"lm_head"}}
    assert [r["loss"] for r in results] == [r["loss"] for r in base_results]
    assert results[1]["loss"] != results[0]["loss"]
    for k in trained:
        np.testing.assert_array_equal(model.read(k), base.read(k))


def test_kiln_plan_device_shows_the_weight_copies(capsys: pytest.CaptureFixture[str]) -> None:
    """``kiln plan --precision bf16 --device h100`` plans for ``numpy`` (no copies in its memory table) and
    prints, under the roofline, the bf16 copies the ``cuda`` backend plans on cuBLASLt: the layer
    weights, 2 bytes an element; the fp32 plan prints none."""
    pytest.importorskip("ml_dtypes")
    pytest.importorskip("kiln.dsl", reason="the model is a kiln-dsl one")
    from kiln.core import compile
    from kiln.core.cli import load_model, main

    config = ('{"vocab_size": 512, "d_model": 64, "n_layers": 2, "num_query_heads": 4, "num_kv_heads": 2, '
              '"head_size": 16, "d_ff": 128, "max_seq": 256}')
    args = ["plan", "Qwen3Model", "--config", config, "--batch", "2", "--seq", "128", "--device", "h100"]
    assert main([*args, "--precision", "bf16"]) == 0
    out = capsys.readouterr().out
    program = compile(load_model("Qwen3Model", config)[0], bindings={"B": 2, "T": 128}, precision="bf16")
    weights = [w.replace("blocks.0", f"blocks.{i}") for i in range(2) for w in LAYER_MATMUL_WEIGHTS]
    nbytes = sum(2 * int(np.prod(program.tensors[w].shape)) for w in weights)
    line = f"bf16 weight copies for cuBLASLt: {len(weights)} weights, {nbytes / 1e6:.2f} MB in the cuda arena"
    assert line in out, out
    assert main([*args, "--precision", "fp32"]) == 0
    assert "bf16 weight copies" not in capsys.readouterr().out


@pytest.mark.gpu
def test_weight_copies_on_a_gpu_give_the_bits_of_a_copy_per_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU with cuBLASLt: the planned copies (``held`` slots) and the same losses, bit for bit, over
    three AdamW steps as a copy per product (the same GEMM plans on the same bf16 values)."""
    from kiln.cuda import _backend, _device

    ok, why = _device.device_status()
    if not ok:
        pytest.skip(f"needs a CUDA GPU: {why}")
    pytest.importorskip("ml_dtypes")
    dsl = pytest.importorskip("kiln.dsl", reason="the Qwen3 model comes from kiln-dsl")
    from kiln.core import Model
    from kiln.dsl.stdlib.models import Qwen3Model

    bundle = dsl.build_bundle(Qwen3Model, {**QWEN3, "n_layers": 2, "d_model": 64, "head_size": 16})
    rng = np.random.default_rng(0)
    batch = {"input_ids": rng.integers(0, 64, (2, 8)), "labels": rng.integers(0, 64, (2, 8))}
    losses = []
    for copies in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            if not copies:
                mp.setattr(_backend.CudaBackend, "held_bytes", lambda self, program, kernels: {})
            model = Model.from_ir(bundle, seed=0, backend="cuda", precision="bf16", recompute="block")
            losses.append([model.train_step(batch)["loss"] for _ in range(3)])
            if copies and getattr(model.backend.gpu, "blas", None) is None:
                pytest.skip("nvmath-python (cuBLASLt) is not installed: the SIMT kernels plan no copies")
            held = [sl for sl in model.program(2, 8).slots if sl.kind == "held"]
            assert bool(held) == copies
    assert losses[0] == losses[1]


def test_cublaslt_is_told_each_operands_alignment() -> None:
    """cuBLASLt's heuristic assumes 256-byte aligned operands unless told less, and an algorithm chosen so
    may not run on kiln's 64-byte aligned arena slots: ``Blas`` sets A's, B's, C's and D's alignment
    (``MIN_ALIGNMENT_*_BYTES``) from the pointers, one heuristic per plan and alignments (cuBLASLt's
    calls recorded by a stand-in for nvmath's bindings; the real ones need a GPU)."""
    import ctypes
    import enum
    import types

    from kiln.cuda._blas import Blas, alignment, gemm_plan

    class Pref(enum.IntEnum):
        MAX_WORKSPACE_BYTES, MIN_ALIGNMENT_A_BYTES, MIN_ALIGNMENT_B_BYTES = 0, 1, 2
        MIN_ALIGNMENT_C_BYTES, MIN_ALIGNMENT_D_BYTES = 3, 4

    prefs: list[dict[str, int]] = []

    def set_pref(pref: int, attr: int, address: int, size: int) -> None:
        prefs[pref - 1][Pref(attr).name] = (ctypes.c_uint32 if size == 4 else ctypes.c_uint64).from_address(
            address).value

    def create_pref() -> int:
        prefs.append({})
        return len(prefs)

    def heuristic(*args: Any) -> None:
        ctypes.c_int32.from_address(args[-1]).value = 1  # one algorithm found

    runs: list[tuple[Any, ...]] = []
    lt = types.SimpleNamespace(
        MatmulPreferenceAttribute=Pref, MatmulDescAttribute=types.SimpleNamespace(TRANSA=0, TRANSB=1),
        MatrixLayoutAttribute=types.SimpleNamespace(BATCH_COUNT=0, STRIDED_BATCH_OFFSET=1),
        matmul_desc_create=lambda *a: 1, matmul_desc_set_attribute=lambda *a: None,
        matrix_layout_create=lambda *a: 1, matrix_layout_set_attribute=lambda *a: None,
        matmul_preference_create=create_pref, matmul_preference_set_attribute=set_pref,
        MatmulHeuristicResult=lambda n: types.SimpleNamespace(ptr=1), matmul_algo_get_heuristic=heuristic,
        matmul=lambda *a: runs.append(a))
    blas = object.__new__(Blas)  # without nvmath's handle and workspace
    blas.lt, blas.device, blas.handle, blas.workspace, blas._plans = lt, types.SimpleNamespace(), 1, 0, {}
    plan = gemm_plan((4, 8), (8, 6), (4, 6), ("bfloat16", "bfloat16", "float32"))
    base = 1 << 30
    blas.gemm(plan, base + 64, base + 512, 0, base + 96)  # no C: D's alignment stands for it
    assert prefs == [{"MAX_WORKSPACE_BYTES": _blas.WORKSPACE_BYTES, "MIN_ALIGNMENT_A_BYTES": 64,
                      "MIN_ALIGNMENT_B_BYTES": 256, "MIN_ALIGNMENT_C_BYTES": 32, "MIN_ALIGNMENT_D_BYTES": 32}]
    blas.gemm(plan, base + 192, base + 768, 0, base + 224)  # the same alignments: the same algorithm
    blas.gemm(plan, base, base, 0, base)
    assert len(prefs) == 2 and prefs[1]["MIN_ALIGNMENT_A_BYTES"] == 256 and len(runs) == 3
    assert [alignment(p) for p in (0, 2, 48, 4096)] == [256, 2, 16, 256]
