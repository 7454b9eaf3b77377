"""``@precision`` / ``@dtype`` honoured on the ``cuda`` backend (over the CPU emulator; a ``gpu`` twin on the
device): a tiny model with one op's precision overridden trains as the NumPy backend's emulation of the
same override (the oracle; kiln-dsl's ``test_annotations_precision.py`` checks that one against float64),
and differently from the same model without the annotation, so the test fails if cuda ignored it.

Where the override leaves the rounding points and the sums' order as NumPy's, the loss and gradients are
the same bits; training sums fp32 values in other orders (the GEMM tiles against NumPy's BLAS), which moves
a value by 1e-6 of its scale, and such a move can flip one bf16 rounding downstream: the trained weights
and losses are compared to 1e-5 (the ``fp32`` recipe's bound in ``test_backend.py``), far below what the
annotation changes (checked in each case)."""

import numpy as np
import pytest

from kiln.core import Model, PluginSession, compile
from kiln.core.ir import Annotation, Bundle, Graph, Module, Op, ParamSpec, TensorDecl
from kiln.core.plan import _precision
from kiln.cuda import EmulatedCuda, EmulatedDevice, _device

pytest.importorskip("ml_dtypes", reason="the bf16 recipe needs ml_dtypes")
dsl = pytest.importorskip("kiln.dsl", reason="the annotated model is written in kiln-dsl")
from kiln.dsl import build_bundle, testing  # noqa: E402
from kiln.dsl.annotations import dtype, precision  # noqa: E402

V, C = testing.V, testing.C


CASES = {  # id: (recipe, annotations of h, h's compute under the override, whether h holds bf16)
    "fp32-op-under-bf16": ("bf16", (precision(policy="fp32"),), "fp32", False),
    "bf16-compute-fp32-output-under-bf16": ("bf16", (dtype("fp32"),), "bf16", False),
    "bf16-op-under-fp32": ("fp32", (precision(compute="bf16"),), "bf16", True),
    "bf16-compute-fp32-output-under-fp32": ("fp32", (precision(policy="bf16"), dtype("fp32")), "bf16", False),
}


def weights(m: Model, seed: int = 5) -> dict[str, np.ndarray]:
    """Weights large enough that bf16 rounding shows in the loss."""
    rng = np.random.default_rng(seed)
    return {k: rng.normal(0, 0.7, v.shape).astype(np.float32) for k, v in m.parameters().items()}


def batch() -> dict[str, np.ndarray]:
    ids = np.random.default_rng(1).integers(0, V, (2, 9))
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def train(m: Model, w: dict[str, np.ndarray], steps: int = 3) -> tuple[list[float], dict[str, np.ndarray]]:
    m.set_parameters(w)
    losses = [float(m.train_step(batch())["loss"]) for _ in range(steps)]
    return losses, m.parameters()


def gap(a: tuple[list[float], dict], b: tuple[list[float], dict]) -> float:
    """The largest difference of two trainings' losses and trained weights."""
    return max(max(abs(x - y) for x, y in zip(a[0], b[0], strict=True)),
               max(float(np.abs(a[1][k] - b[1][k]).max()) for k in a[1]))


#: how far cuda may train from NumPy: on the emulator, the fp32 sums' order (observed <= 5e-7); on a GPU,
#: cuBLASLt's accumulation order too, which can flip a bf16 rounding (2^-8 relative) of an activation.
#: Either way cuda must be at least 4x nearer the annotated NumPy run than the unannotated one (which
#: differs by >= 4e-3 here)
EMULATOR, GPU = 2e-6, 1e-3


def _check(case: str, backend_models, tol: float, exact: bool) -> None:
    recipe, anns, compute, h_low = CASES[case]
    # testing.lm: x + silu(h) @ w2^T, h = x @ w1^T annotated, in one layer; an LM head of its own
    annotated = build_bundle(testing.lm(f"Ann{case.replace('-', '')}", h_ann=anns, head=True), {})
    plain = build_bundle(testing.lm(f"Plain{case.replace('-', '')}", head=True), {})
    (ref, got), (ref_plain, got_plain) = backend_models(annotated, recipe), backend_models(plain, recipe)
    w = weights(ref)

    prog = got.program(2, 8)  # the cuda Program carries the override
    assert prog.computes["blocks.0.h"] == compute
    assert ("blocks.0.h" in prog.rounded) == h_low
    assert prog.tensors["blocks.0.h"].dtype == ("bfloat16" if h_low else "float32")

    for m in (got, ref):
        m.set_parameters(w)
    (loss, grads), (want_loss, want) = (m.loss_and_grads(batch()["input_ids"], batch()["labels"])
                                        for m in (got, ref))
    if exact:  # the same rounding points: the loss is NumPy's bits, and under bf16 every gradient too
        assert loss == want_loss
    assert loss == pytest.approx(want_loss, rel=tol)
    for k in want:
        scale = float(np.abs(want[k]).max())
        # each gradient a bf16 value or a sum in NumPy's order; an fp32 op's backward (``h`` kept fp32
        # under bf16) multiplies in fp32, its products summed in the GEMM's own order
        if exact and recipe == "bf16" and compute == "bf16":
            assert np.array_equal(grads[k], want[k]), k
        assert np.abs(grads[k] - want[k]).max() <= tol * scale, k

    have, expect = train(got, w), train(ref, w)
    assert gap(have, expect) <= tol, (have[0], expect[0])
    # the annotation is visible: the same model without it trains elsewhere, on both backends
    without, without_ref = train(got_plain, w), train(ref_plain, w)
    assert gap(without, without_ref) <= tol
    assert gap(have, without) > max(4 * gap(have, expect), 1e-4), (have[0], without[0], expect[0])


@pytest.fixture(scope="module")
def emulated_models(cache):
    device = EmulatedDevice(cache=cache / "emulated")
    session = PluginSession(autoload=False)
    session.register(EmulatedCuda(device), "cuda-emulated")

    def make(bundle, recipe: str) -> tuple[Model, Model]:
        return tuple(Model.from_ir(bundle, seed=0, backend=b, precision=recipe) for b in ("numpy", "cuda"))

    with session.activate():  # for the module's tests: the models run in it
        yield make


@pytest.mark.parametrize("case", list(CASES))
def test_precision_override_on_emulated_cuda_equals_numpy(case: str, emulated_models) -> None:
    """Each override trains on emulated cuda as on NumPy (the same bits where they round alike), and
    away from the unannotated model. The ``@dtype``-only case keeps bf16 compute and checks that cuda
    leaves ``h`` unrounded where the Program says so."""
    _check(case, emulated_models, EMULATOR, exact=True)


def attention_lm(annotations: list[Annotation]) -> Bundle:
    """embedding -> rmsnorm -> qkv projection -> flash attention -> output projection -> residual add ->
    LM-head loss (kiln-core's ``test_precision_statistics.py`` model), ``annotations`` on its tensors."""
    n, qkv, init = ["B * T"], "(HQ + 2 * HKV) * D", {"kind": "normal", "std": 0.5}
    shapes = {"embedding": ["V", "C"], "norm": ["C"], "wqkv": [qkv, "C"], "wo": ["C", "HQ * D"],
              "head": ["V", "C"]}
    return Bundle([Module(
        "AttnLM", kind="model", config={"V": 40, "C": 16, "HQ": 2, "HKV": 2, "D": 8},
        params=[ParamSpec(k, s, "fp32", init={"kind": "ones"} if k == "norm" else init)
                for k, s in shapes.items()],
        forward=Graph(
            "AttnLM",
            inputs=[TensorDecl("token_ids", ["B", "T"], "int32"), TensorDecl("targets", ["B", "T"], "int32")],
            params=[TensorDecl(k, s, "fp32") for k, s in shapes.items()],
            ops=[Op("embedding", ["token_ids", "embedding"], ["x3"]),
                 Op("view", ["x3"], ["x"], {"shape": [*n, "C"]}),
                 Op("rmsnorm", ["x", "norm"], ["h", "rstd"], {"eps": 1e-6}),
                 Op("matmul", ["h", "wqkv"], ["qkv_flat"], {"transpose": "NT"}),
                 Op("view", ["qkv_flat"], ["qkv"], {"shape": ["B", "T", qkv]}),
                 Op("flash_attention", ["qkv"], ["att", "lse"],
                    {"Hq": "HQ", "Hkv": "HKV", "D": "D", "causal": True}),
                 Op("view", ["att"], ["att_flat"], {"shape": [*n, "HQ * D"]}),
                 Op("matmul", ["att_flat", "wo"], ["o"], {"transpose": "NT"}),
                 Op("add", ["x", "o"], ["y"]),
                 Op("view", ["targets"], ["t"], {"shape": n}),
                 Op("fused_lm_head_loss", ["y", "head", "t"], ["loss", "head_lse"])],
            outputs=[TensorDecl("loss", n, "fp32")]),
        annotations=annotations)], entry="AttnLM")


def test_bf16_attention_and_head_under_fp32_on_emulated_cuda_equal_numpy(
        emulated_models, monkeypatch: pytest.MonkeyPatch) -> None:
    """``@precision(compute="bf16")`` on the attention and on the LM head under ``fp32``: kiln.cuda's bf16
    attention and head kernels read their float32 statistics (lse, the loss cotangent) as NumPy's
    emulation does (``OpDef.statistics``), so the loss and the head's gradient are NumPy's bits and the
    rest within fp32 summation order (measured 3e-7 of their scale); the annotations are live
    (the unannotated model's gradients are 1e-3 and more away). Rounding the statistics (the rule before
    they were declared) moves NumPy's emulation and not cuda's kernels: the backends part."""
    ann = [Annotation("precision", "tensor", t, {"compute": "bf16"}) for t in ("att", "loss")]
    rng = np.random.default_rng(4)
    ids, labels = rng.integers(0, 40, (2, 12)), rng.integers(0, 40, (2, 12))

    def runs(annotations: list[Annotation]) -> list[tuple[float, dict[str, np.ndarray]]]:
        models = emulated_models(attention_lm(annotations), "fp32")
        assert all(m.program(2, 12).computes.get("att") == ("bf16" if annotations else None) for m in models)
        return [m.loss_and_grads(ids, labels) for m in models]

    def apart(a: tuple[float, dict[str, np.ndarray]], b: tuple[float, dict[str, np.ndarray]]) -> float:
        return max(float(np.abs(a[1][k] - b[1][k]).max() / np.abs(b[1][k]).max()) for k in b[1])

    (want_loss, want), (loss, have) = runs(ann)
    assert loss == want_loss
    assert np.array_equal(have["head"], want["head"])  # the bf16 head kernel's products
    assert apart((loss, have), (want_loss, want)) <= EMULATOR
    plain = runs([])
    assert apart(plain[0], (want_loss, want)) > 1e-3 and apart(plain[1], plain[0]) <= EMULATOR
    monkeypatch.setattr(_precision, "statistic_flags", lambda opdef, n, outputs=False: (False,) * n)
    old_numpy, old_cuda = runs(ann)
    assert apart(old_cuda, old_numpy) > 100 * EMULATOR


def test_the_override_reaches_the_cuda_kernels(cache) -> None:
    """One matmul in bf16 under ``fp32``: its operands are rounded to bf16 on the device (``matmul_bf16``, or
    its variants that round float32 operands on load) while the other matmuls stay ``matmul_f32``."""
    launched: set[str] = set()

    class Launches(EmulatedDevice):
        def launch(self, name: str, *args: object) -> None:
            launched.add(name)
            super().launch(name, *args)

    def kernels(bundle) -> set[str]:
        launched.clear()
        with PluginSession(autoload=False).activate() as session:
            session.register(EmulatedCuda(Launches(cache=cache / "emulated")), "cuda-emulated")
            Model.from_ir(bundle, seed=0, backend="cuda").train_step(batch())
        return set(launched)

    bundle = build_bundle(testing.lm("Launched", h_ann=(precision(compute="bf16"),), head=True), {})
    with PluginSession(autoload=False).activate() as session:
        session.register(EmulatedCuda(), "cuda-emulated")
        assert compile(bundle, bindings={"B": 2, "T": 8}, backend="cuda").computes["blocks.0.h"] == "bf16"

    def bf16_matmuls(names: set[str]) -> set[str]:  # matmul_bf16 and its variants (operand and out types)
        return {n for n in names if n == "matmul_bf16" or n.startswith("matmul_bf16_")}

    launched_ = kernels(bundle)
    assert bf16_matmuls(launched_) and "matmul_f32" in launched_
    assert not bf16_matmuls(kernels(build_bundle(testing.lm("NotLaunched", head=True), {})))


ok, why = _device.device_status()


@pytest.mark.gpu
@pytest.mark.skipif(not ok, reason=f"needs a CUDA GPU: {why}")
@pytest.mark.parametrize("case", list(CASES))
def test_precision_override_on_the_gpu_equals_numpy(case: str) -> None:
    def make(bundle, recipe: str) -> tuple[Model, Model]:
        return tuple(Model.from_ir(bundle, seed=0, backend=b, precision=recipe) for b in ("numpy", "cuda"))

    _check(case, make, GPU, exact=False)
