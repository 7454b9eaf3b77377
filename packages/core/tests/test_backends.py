"""The Backend protocol and the kernel table: compile plans for the backend it is given."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from kiln_core_tiny import random_batch, tiny_qwen3_bundle

from kiln.core import (
    Backend,
    Executable,
    KernelTable,
    KilnError,
    Model,
    NumpyBackend,
    PluginError,
    compile,
    get_registry,
)

BINDS = {"B": 2, "T": 5}


class HostBackend:
    """A backend written to the protocol alone: host buffers, no kernels of its own, no fusions."""

    device = "cpu"
    dtypes = ("float32", "float64")
    capabilities: frozenset[str] = frozenset()

    def __init__(self, name: str, kernel_fallback: str | None, reference: bool) -> None:
        self.name, self.kernel_fallback, self.reference = name, kernel_fallback, reference
        self.host = NumpyBackend()

    def allocate(self, nbytes: int) -> Any:
        return self.host.allocate(nbytes)

    def copy(self, src: Any, dst: Any, nbytes: int) -> None:
        self.host.copy(src, dst, nbytes)

    def read(self, buffer: Any, offset: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return self.host.read(buffer, offset, shape, dtype)

    def write(self, buffer: Any, offset: int, value: np.ndarray) -> None:
        self.host.write(buffer, offset, value)

    def compile(self, program: Any, buffer: Any, kernels: Any) -> Executable:
        return self.host.compile(program, buffer, kernels)


def test_the_numpy_backend_implements_the_protocols() -> None:
    backend = get_registry("backends")["numpy"]
    assert isinstance(backend, Backend) and backend.device == "cpu"
    program = compile(tiny_qwen3_bundle(), bindings=BINDS)
    ex = backend.compile(program, backend.allocate(program.arena_bytes), get_registry("kernels"))
    assert isinstance(ex, Executable)


def test_a_backend_without_a_kernel_fails_at_compile_time_naming_both() -> None:
    bare = HostBackend("bare", kernel_fallback=None, reference=False)
    with pytest.raises(KilnError, match=r"backend 'bare' has no kernel for op 'embedding' \(float32\)"):
        compile(tiny_qwen3_bundle(), bindings=BINDS, backend=bare)
    with pytest.raises(KilnError, match=r"dtype='float16' is not valid"):
        compile(tiny_qwen3_bundle(), bindings=BINDS, backend=bare, dtype="float16")


def test_steps_run_the_kernel_the_table_has_for_the_backend() -> None:
    numpy_program = compile(tiny_qwen3_bundle(), bindings=BINDS)
    kernels = {s.op.type: s.kernel for s in numpy_program.steps if s.how not in ("alias", "copy")}
    assert kernels["matmul"] == "matmul@numpy:*"
    # (kiln-kernels-cpu, when installed, registers a native float32 kernel for it)
    assert kernels["fused_lm_head_loss"] in ("fused_lm_head_loss@numpy:*", "fused_lm_head_loss@numpy:float32")
    assert kernels["grad_norm"] == "grad_norm@numpy:*"  # a NumPy kernel for every core op
    # a backend that runs references only: every step takes the op's reference kernel, returning arrays
    ref = compile(tiny_qwen3_bundle(), bindings=BINDS, backend=HostBackend("ref", None, reference=True))
    assert {s.kernel for s in ref.steps} == {""} and {s.how for s in ref.steps} <= {"kernel", "alias", "copy",
                                                                                    "optimizer"}
    assert numpy_program.fusions and not ref.fusions  # no capability, no fused LM head


def test_training_through_the_protocol_on_another_backend_matches_numpy() -> None:
    backends = {"numpy": "numpy", "same kernels": HostBackend("host", "numpy", reference=True),
                "references": HostBackend("ref", None, reference=True)}
    models = {k: Model.from_ir(tiny_qwen3_bundle(), seed=0, dtype="float64", backend=b)
              for k, b in backends.items()}
    for step in range(3):
        batch = random_batch(32, 2, 5, seed=step)
        losses = {k: m.train_step(batch)["loss"] for k, m in models.items()}
        assert losses["same kernels"] == pytest.approx(losses["numpy"], rel=1e-12)
        assert losses["references"] == pytest.approx(losses["numpy"], rel=1e-10)
    ref = models["numpy"].parameters()
    for k in ("same kernels", "references"):
        got = models[k].parameters()
        assert all(np.allclose(got[n], ref[n], rtol=1e-9, atol=1e-12) for n in ref), k


def test_a_kernel_registered_twice_names_both_owners() -> None:
    table = KernelTable()
    table.register_kernel("matmul", "cuda", "float16", lambda *a: None, plugin="first")
    with pytest.raises(PluginError, match="registered twice in the kernels registry: by plugin 'first'"):
        table.register_kernel("matmul", "cuda", "float16", lambda *a: None, plugin="second")
    assert table.find("matmul", "cuda", "float16") is not None
    assert table.find("matmul", "cuda", "bf16") is None


def test_a_backend_declares_the_float_types_it_computes_in() -> None:
    half = HostBackend("half", None, reference=True)
    half.dtypes = ("bfloat16",)
    program = compile(tiny_qwen3_bundle(), bindings=BINDS, backend=half, dtype="bfloat16")
    f32 = compile(tiny_qwen3_bundle(), bindings=BINDS, backend=half.__class__("f", None, True))
    assert program.tensors["embedding"].dtype == "bfloat16" and program.tensors["token_ids"].dtype == "int32"
    assert program.tensors["embedding"].nbytes * 2 == f32.tensors["embedding"].nbytes
    assert program.persistent_bytes < f32.persistent_bytes
    with pytest.raises(KilnError, match=r"dtype='float32' is not valid for backend 'half'; expected one of "
                                        r"'bfloat16'"):
        compile(tiny_qwen3_bundle(), bindings=BINDS, backend=half)


def test_a_model_is_built_from_ir_with_an_init_policy_or_weights() -> None:
    drawn = Model.from_ir(tiny_qwen3_bundle(), seed=3)
    zeros = Model.from_ir(tiny_qwen3_bundle(), init=None)
    assert all(not v.any() for v in zeros.parameters().values())
    given = Model.from_ir(tiny_qwen3_bundle(), init=None, weights=drawn.parameters())
    assert all(np.array_equal(given.parameter(k), v) for k, v in drawn.parameters().items())
    assert given.trainable == {k: True for k in drawn.parameters()}
    with pytest.raises(KilnError, match="init='xavier' is not valid"):
        Model.from_ir(tiny_qwen3_bundle(), init="xavier")


def test_an_init_spec_can_start_a_row_at_zero() -> None:
    from kiln.core import init_value

    rng = np.random.default_rng(0)
    assert not init_value({"zero_row": 2}, (4, 3), rng, 0.02, "w")[2].any()
    named = init_value({"kind": "uniform", "low": 1, "high": 2, "zero_row": "pad"}, (4, 3), rng, 0.02, "w",
                       {"pad": 1})
    assert not named[1].any() and named[[0, 2, 3]].all()
    assert init_value({"zero_row": "pad"}, (4, 3), rng, 0.02, "w", {"pad": None}).all()  # no padding row
