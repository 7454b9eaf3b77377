"""The ``bf16`` precision recipe on the ``cuda`` backend over the CPU emulator, against the NumPy backend's
emulation of the same recipe (ml_dtypes rounding at autocast's points): the independent oracle.

Where both backends round at the same points and sum in the same order, the results are the same bits:
the loss, and every gradient that is a bf16 value (a matmul's output, rounded before it lands in its fp32
slot). Gradients summed in fp32 (the norms' weights, the embedding's rows) differ by the order of their
fp32 sums only (``matmul``'s tiles against NumPy's BLAS): 1e-6 of their scale. The attention on the
emulator is the tensor-core kernel's SIMT twin (FlashAttention-2's tiling); its backward sums a GQA
group's ``d_k``/``d_v`` in fp32 and rounds once, where the emulation (torch's SDPA with ``repeat_kv``)
rounds each query head's and then the sum: those gradients differ by up to two bf16 steps (2^-7 of
their scale) and the loss after a few steps by 1e-4."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.core import KilnError, Model, PluginSession, compile, get_registry
from kiln.cuda import EmulatedCuda, EmulatedDevice

pytest.importorskip("ml_dtypes", reason="the bf16 recipe needs ml_dtypes")

CONFIG = {"vocab_size": 64, "d_model": 32, "n_layers": 1, "num_query_heads": 4, "num_kv_heads": 2,
          "head_size": 8, "d_ff": 64, "max_seq": 16}
#: the gradients of weights used by a matmul: bf16 values in fp32 slots
MATMUL_GRADS = ("lm_head", "blocks.0.out_weight", "blocks.0.mlp_up_weight", "blocks.0.mlp_down_weight")
ATTENTION = ("flash_attention", "flash_attention_backward")
#: the kernels of the ops whose bf16 rounding points lie inside them (those of swiglu and the q/k norm
#: reading their bf16 slots directly, tests/test_bf16_direct.py)
ROUNDING_KERNELS = {"swiglu_rp_bf16io", "swiglu_backward_rp_bf16io", "qkv_norm_rope_rp_bf16in",
                    "qkv_norm_rope_backward_rp_bf16in", "qkv_norm_rope_backward_dw_rp_bf16in", "matmul_bf16",
                    "lm_head_loss_grad_bf16"}  # the LM head's fused training pass


@pytest.fixture(scope="module")
def bundle():
    dsl = pytest.importorskip("kiln.dsl", reason="the Qwen3 model comes from kiln-dsl")
    from kiln.dsl.stdlib.models import Qwen3Model

    return dsl.build_bundle(Qwen3Model, CONFIG)


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    return rng.integers(0, 64, (2, 8)), rng.integers(0, 64, (2, 8))


class Launches(EmulatedDevice):
    """The emulator, recording the name of every kernel it launches."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def launch(self, name: str, *args: object) -> None:
        self.names.add(name)
        super().launch(name, *args)


def _models(bundle, device, without=()):
    session = PluginSession(autoload=False)
    session.register(EmulatedCuda(device, without=without), "cuda-emulated")
    with session.activate():
        ref, got = (Model.from_ir(bundle, seed=0, backend=b, precision="bf16") for b in ("numpy", "cuda"))
    return session, ref, got


def test_same_rounding_points_give_the_same_bits(bundle, batch) -> None:
    """Attention withdrawn to the host (its NumPy bf16 kernel): the loss and every matmul gradient are
    the NumPy emulation's bits, the rest within fp32 summation order; matmuls ran on ``matmul_bf16``."""
    device = Launches()
    session, ref, got = _models(bundle, device, without=ATTENTION)
    with session.activate():
        (want_loss, want), (loss, have) = (m.loss_and_grads(*batch) for m in (ref, got))
        fp32 = Model.from_ir(bundle, seed=0, backend="numpy").loss_and_grads(*batch)[1]
    assert loss == want_loss
    for name in want:
        scale = float(np.abs(want[name]).max())
        if name in MATMUL_GRADS or name == "blocks.0.qkv_weight":
            assert np.array_equal(have[name], want[name]), name
        else:
            assert np.abs(have[name] - want[name]).max() <= 1e-6 * scale, name
        assert not np.array_equal(fp32[name], want[name]), name  # the recipe is live, not fp32
    assert "matmul_bf16" in device.names and "matmul_f32" not in device.names
    assert "cast_f32_bf16" in device.names  # a matmul's float32 output into its bf16 slot
    assert "cast_bf16_f32" not in device.names  # no widened copies: kernels read bf16 where it lies
    assert device.names >= ROUNDING_KERNELS  # swiglu, the q/k norms and the LM head on the device


def test_the_bf16_step_has_no_host_steps(bundle) -> None:
    """Every op of the bf16 training step runs a CUDA kernel (the ops with rounding points inside them
    included), so forward and backward capture as one graph."""
    session = PluginSession(autoload=False)
    session.register(EmulatedCuda(), "cuda-emulated")
    with session.activate():
        program = compile(bundle, bindings={"B": 2, "T": 8}, backend="cuda", precision="bf16")
        backend = get_registry("backends")["cuda"]
        exe = backend.compile(program, backend.allocate(program.arena_bytes), None)
    assert {s.op.type for s in program.steps} >= {"swiglu", "qkv_qk_norm_rope", "fused_lm_head_loss"}
    assert exe.host_steps == {}
    exe.capture(("forward", "backward"))


def test_attention_runs_the_tensor_core_kernels_twin(bundle, batch) -> None:
    """Attention on the tiled bf16 kernels' SIMT twin: the forward (one tile of keys here) gives the NumPy
    emulation's loss; gradients within two bf16 steps; three AdamW steps' losses within 1e-4."""
    device = Launches()
    session, ref, got = _models(bundle, device)
    with session.activate():
        (want_loss, want), (loss, have) = (m.loss_and_grads(*batch) for m in (ref, got))
        assert loss == pytest.approx(want_loss, abs=1e-6)
        for name in want:
            assert np.abs(have[name] - want[name]).max() <= 2 ** -6 * float(np.abs(want[name]).max()), name
        for name in MATMUL_GRADS:  # above the attention's backward: the same bits
            assert np.array_equal(have[name], want[name]), name
        batch_ = {"input_ids": batch[0], "labels": batch[1]}
        for _ in range(3):
            assert got.train_step(batch_)["loss"] == pytest.approx(ref.train_step(batch_)["loss"], abs=1e-4)
    for kernel in ("flash_attention_twin64_bf16", "flash_attention_backward_dq_twin64_bf16",
                   "flash_attention_backward_dkv_twin64_bf16"):  # or its variant on float32 qkv / d_qkv
        assert any(n == kernel or n.startswith(kernel + "_") for n in device.names), kernel
    assert not any(n.startswith("flash_attention_f32") for n in device.names)


def test_bf16_tensors_are_two_byte_device_buffers(bundle) -> None:
    """The plan's bf16 tensors (``Tensor.dtype == "bfloat16"``) are 2-byte buffers in the device arena:
    the tensors' bytes drop, and the executable reads them back as bf16 values."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    session = PluginSession(autoload=False)
    session.register(EmulatedCuda(), "cuda-emulated")
    with session.activate():
        low, full = (compile(bundle, bindings={"B": 2, "T": 8}, backend="cuda", precision=p)
                     for p in ("bf16", "fp32"))
        backend = get_registry("backends")["cuda"]
        exe = backend.compile(low, backend.allocate(low.arena_bytes), None)
    stored = [k for k, t in low.tensors.items() if t.dtype == "bfloat16"]
    assert stored and set(stored) <= set(low.rounded)
    def tensor_bytes(program) -> int:  # the arena less the kernels' planned temporaries (the casts' widened
        return sum(sl.nbytes for sl in program.slots if sl.kind not in ("workspace", "host"))  # copies)

    assert tensor_bytes(low) < tensor_bytes(full)
    value = np.linspace(-3, 3, int(np.prod(low.tensors[stored[0]].shape)), dtype=np.float32)
    exe.write(stored[0], value.reshape(low.tensors[stored[0]].shape))
    back = exe.read(stored[0])
    assert back.dtype == ml_dtypes.bfloat16
    assert np.array_equal(back.astype(np.float32).ravel(),
                          value.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_the_fp32_only_kernels_refuse_bf16_tensors() -> None:
    from kiln.cuda._ops import DeviceArray, rmsnorm

    dev = EmulatedDevice()
    x = DeviceArray(dev, 0, (2, 4), "bfloat16")
    with pytest.raises(KilnError, match="compute in float32; found a bfloat16 tensor"):
        rmsnorm(x, x, out=(x, None), eps=1e-6)
