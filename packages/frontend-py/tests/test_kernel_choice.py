"""``@kernel`` and ``@nofuse`` are applied by ``kiln.core.compile``, so every entry point agrees: a Program
compiled directly, a ``Model``'s Programs and ``kiln plan`` run (and show) the annotated kernel.

The oracle for what a step runs is the kernel table itself: without the annotation the same step runs
the table's choice (``matmul@numpy:*``), with it the named kernel or the reference (``""``)."""

# ruff: noqa: F821  (dimension names inside Tensor[...] annotations are not Python names)

import numpy as np
import pytest

from kiln.core import KilnError, Model, compile
from kiln.core.cli import main
from kiln.dsl import B, Param, T, Tensor, build_bundle, forward, graph, model
from kiln.dsl.annotations import kernel, nofuse
from kiln.dsl.testing import V
from kiln.dsl.testing import lm as annotated_lm

BINDS = {"B": 2, "T": 4}


def runs(program, key: str) -> set[tuple[str, str]]:
    """(kernel, how) of every step computing ``key``: the forward step and its replays."""
    return {(st.kernel, st.how) for st in computing(program, key)}


def computing(program, key: str) -> list:
    """The steps computing ``key``: the forward step and its replays (``<key>:recompute``)."""
    return [st for st in program.steps if st.outputs and st.outputs[0].split(":")[0] == key]


@pytest.mark.parametrize("recompute", ["none", "block"])
def test_compile_runs_the_annotated_kernel(recompute: str) -> None:
    plain = compile(build_bundle(annotated_lm("KernelTable"), {}), bindings=BINDS, recompute=recompute)
    chosen = compile(build_bundle(annotated_lm("KernelRef", h_ann=(kernel("reference"),)), {}),
                     bindings=BINDS, recompute=recompute)
    assert runs(plain, "blocks.0.h") == {("matmul@numpy:*", "out")}  # the table's choice
    assert runs(chosen, "blocks.0.h") == {("", "kernel")}  # the reference kernel, replays too
    if recompute == "block":
        assert [st.recompute for st in computing(chosen, "blocks.0.h")] == [False, True]


def test_model_and_compile_give_one_program() -> None:
    bundle = build_bundle(annotated_lm("KernelBoth", h_ann=(kernel("reference"),)), {})
    direct = compile(bundle, bindings=BINDS)
    via_model = Model(bundle).program(2, 4)
    assert [(st.kernel, st.how) for st in via_model.steps] == [(st.kernel, st.how) for st in direct.steps]
    assert via_model.fusions == direct.fusions


def test_compile_refuses_a_kernel_that_cannot_run_without_fallback() -> None:
    bundle = build_bundle(annotated_lm("KernelMissing", h_ann=(kernel("cublas_gemm", fallback=False),)), {})
    with pytest.raises(KilnError, match=r"@kernel\('cublas_gemm'\) on tensor 'h'.*not in the kernel table"):
        compile(bundle, bindings=BINDS)
    silu = kernel("silu@numpy:float32", fallback=False)
    other = build_bundle(annotated_lm("KernelOther", h_ann=(silu,)), {})
    with pytest.raises(KilnError, match=r"it is a kernel of 'silu'"):
        compile(other, bindings=BINDS)
    kept = build_bundle(annotated_lm("KernelKept", h_ann=(kernel("cublas_gemm"),)), {})
    assert runs(compile(kept, bindings=BINDS), "blocks.0.h") == {("matmul@numpy:*", "out")}  # falls back


@model
class UnfusedHead:
    def __init__(self, vocab_size: int = V, d_model: int = 8):
        self.vocab_size, self.d_model = vocab_size, d_model

    embedding = Param(Tensor["vocab_size", "d_model", "fp32"])

    @forward
    def forward(self, token_ids: Tensor["B", "T", "int32"], position_ids: Tensor["T", "int32"],
                targets: Tensor["B", "T", "int32"]) -> Tensor["B * T", "fp32"]:
        with graph() as g:
            x = g.view(g.embedding(token_ids, "embedding"), shape=[B * T, "d_model"])
            return g.fused_lm_head_loss(x, "embedding", targets) @ nofuse(reason="profile the head")


def test_compile_drops_the_fusions_of_a_nofuse_tensor() -> None:
    bundle = build_bundle(UnfusedHead, {})
    plain = bundle.evolve(modules=[m.evolve(annotations=()) for m in bundle.modules])
    assert compile(plain, bindings=BINDS).fusions != ()
    assert compile(bundle, bindings=BINDS).fusions == () == Model(bundle).program(2, 4).fusions


def test_kiln_plan_shows_what_compile_chose(tmp_path, capsys) -> None:
    bundle = build_bundle(annotated_lm("KernelPlan", h_ann=(kernel("reference"),)), {})
    path = tmp_path / "kernel.json"
    path.write_text(bundle.to_json())
    assert main(["plan", str(path), "--batch", "2", "--seq", "4"]) == 0
    out = capsys.readouterr().out
    assert "tensor 'h' of KernelPlanBlock (1 step(s)): runs reference (asked 'reference')" in out
    head = tmp_path / "head.json"
    head.write_text(build_bundle(UnfusedHead, {}).to_json())
    assert main(["plan", str(head), "--batch", "2", "--seq", "4"]) == 0
    assert "tensor 'loss' of UnfusedHead (1 step(s)): not fused: profile the head" in capsys.readouterr().out


def test_the_chosen_kernel_computes_the_same_values() -> None:
    plain = Model(build_bundle(annotated_lm("KernelValuesPlain"), {}), seed=0)
    chosen = Model(build_bundle(annotated_lm("KernelValues", h_ann=(kernel("reference"),)), {}),
                   weights=plain.parameters())
    ids = np.random.default_rng(0).integers(0, V, (2, 5))
    (a, ga), (b, gb) = (m.loss_and_grads(ids[:, :-1], ids[:, 1:]) for m in (plain, chosen))
    assert b == pytest.approx(a, rel=1e-6) and all(np.allclose(ga[k], gb[k], atol=1e-6) for k in ga)
