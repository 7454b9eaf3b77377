"""``@fuse`` (seed 004 §7.5.1): the ops computing the annotated tensor become one fused op."""

# ruff: noqa: F821  (dimension names inside Tensor[...] annotations are not Python names)

import numpy as np
import pytest

from kiln.core import Model, compile
from kiln.core.ir import from_json
from kiln.dsl import B, DSLError, Param, T, Tensor, block, build_bundle, forward, graph
from kiln.dsl.annotations import fuse, hook, nofuse
from kiln.dsl.testing import V, stack_lm


def lm(name: str, y_ann: tuple = (), m_ann: tuple = (), *, broadcast: bool = False,
       gate_twice: bool = False, cls_ann: tuple = ()) -> type:
    """A pre-norm block: ``s = x + x w^T``, ``y = rmsnorm(s)`` (``y_ann``), then a gated MLP
    ``m = silu(y g^T) * (y u^T)`` (``m_ann``) and ``s + m d^T``."""

    class Layer:
        def __init__(self, d_model: int):
            self.d_model = d_model

        w = Param(Tensor["d_model", "d_model", "fp32"])
        norm = Param(Tensor["d_model", "fp32"], init="ones")
        wg = Param(Tensor["d_model", "d_model", "fp32"])
        wu = Param(Tensor["d_model", "d_model", "fp32"])
        wd = Param(Tensor["d_model", "d_model", "fp32"])
        bias = Param(Tensor["d_model", "fp32"])

        @forward
        def forward(self, x: Tensor["B", "T", "d_model", "fp32"]) -> Tensor["B", "T", "d_model", "fp32"]:
            with graph() as g:
                xf = g.view(x, shape=[B * T, "d_model"])
                h = g.matmul(xf, "w", transpose="NT")
                s = g.add(xf, "bias" if broadcast else h, out_name="s")
                y, _ = g.rmsnorm(s, "norm", eps=1e-5, y_name="y")
                y = g.annotate(y, *y_ann)
                act = g.silu(g.matmul(y, "wg", transpose="NT"), out_name="act")
                m = g.annotate(g.mul(act, g.matmul(y, "wu", transpose="NT"), out_name="m"), *m_ann)
                if gate_twice:
                    m = g.add(m, act)
                out = g.add(s, g.matmul(m, "wd", transpose="NT"))
                return g.view(out, shape=[B, T, "d_model"])

    Layer.__name__ = Layer.__qualname__ = f"{name}Layer"
    cls = block(Layer)
    for ann in reversed(cls_ann):
        cls = ann(cls)
    return stack_lm(name, f"{name}Layer", n_layers=2)


def types(bundle, block_name: str) -> list[str]:
    return [op.type for op in bundle.module(block_name).forward.ops]


@pytest.mark.parametrize(
    ("ann", "where", "fused", "replaced"),
    [
        (fuse("residual_norm"), "y", "fused_residual_rmsnorm", ("add", "rmsnorm")),
        (fuse(ops=["add", "rmsnorm"]), "y", "fused_residual_rmsnorm", ("add", "rmsnorm")),
        (fuse("gated_mlp"), "m", "silu_mul", ("silu", "mul")),
        (fuse(ops=["silu", "mul"]), "m", "silu_mul", ("silu", "mul")),
    ],
)
def test_fuse_rewrites_the_ops_into_the_fused_op_with_the_same_numbers(ann, where, fused, replaced) -> None:
    """The oracle is the unannotated model: its separate ops run their own reference kernels."""
    tag = f"{fused.title().replace('_', '')}{len(ann.args.get('ops', ()))}"
    plain_b = build_bundle(lm(f"Plain{tag}"), {})
    fused_b = build_bundle(lm(f"Fused{tag}", **{f"{where}_ann": (ann,)}), {})
    before, after = types(plain_b, f"Plain{tag}Layer"), types(fused_b, f"Fused{tag}Layer")
    assert fused not in before and after.count(fused) == 1
    for op in replaced:
        assert after.count(op) == before.count(op) - 1
    # the annotation is carried, and the IR round-trips
    (carried,) = fused_b.module(f"Fused{tag}Layer").annotated("fuse")
    assert (carried.on, carried.target) == ("tensor", where)
    assert from_json(fused_b.to_json()) == fused_b
    binds = {"B": 2, "T": 5}
    assert len(compile(fused_b, bindings=binds).steps) < len(compile(plain_b, bindings=binds).steps)
    a = Model(plain_b, seed=2)
    b = Model(fused_b, weights=a.parameters())
    ids = np.random.default_rng(1).integers(0, V, (2, 6))
    la, ga = a.loss_and_grads(ids[:, :-1], ids[:, 1:])
    lb, gb = b.loss_and_grads(ids[:, :-1], ids[:, 1:])
    assert abs(la - lb) < 1e-6
    for k in ga:
        np.testing.assert_allclose(gb[k], ga[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_fuse_on_a_module_fuses_every_place_it_can() -> None:
    plain = types(build_bundle(lm("ModPlain"), {}), "ModPlainLayer")
    bundle = build_bundle(lm("ModFused", cls_ann=(fuse("residual_norm"), fuse(ops=["silu", "mul"]))), {})
    fused = types(bundle, "ModFusedLayer")
    assert fused.count("fused_residual_rmsnorm") == 1 and fused.count("silu_mul") == 1
    assert len(fused) == len(plain) - 2
    assert [a.on for a in bundle.module("ModFusedLayer").annotated("fuse")] == ["module", "module"]
    with pytest.raises(DSLError) as info:  # silu's output is read twice: nothing to fuse
        build_bundle(lm("ModNothing", cls_ann=(fuse("gated_mlp"),), gate_twice=True), {})
    assert info.value.code == "E013" and "no silu then mul in its graph can be fused" in str(info.value)


def test_advisory_patterns_kiln_lacks_are_carried_unchanged() -> None:
    plain = build_bundle(lm("NoBiasAct"), {})
    carried = build_bundle(lm("BiasAct", m_ann=(fuse("bias_activation"),)), {})
    assert types(carried, "BiasActLayer") == types(plain, "NoBiasActLayer")
    assert [a.target for a in carried.module("BiasActLayer").annotated("fuse")] == ["m"]


@pytest.mark.parametrize(
    ("kw", "code", "words"),
    [
        ({"m_ann": (fuse("residual_norm"),)}, "E013", "computed by mul of silu, not rmsnorm of add"),
        ({"y_ann": (fuse("gated_mlp"),)}, "E013", "computed by rmsnorm"),
        ({"y_ann": (fuse("residual_norm"),), "broadcast": True}, "E013", "the add broadcasts"),
        ({"m_ann": (fuse("gated_mlp"),), "gate_twice": True}, "E013", "'act' is read elsewhere"),
        ({"y_ann": (fuse("residual_norm"), nofuse)}, "E008", "both @fuse('residual_norm') and @nofuse"),
        ({"y_ann": (fuse("residual_norm"),), "m_ann": (hook("AfterMLPActivation"),)}, "", ""),
    ],
)
def test_a_fusion_that_cannot_be_done_is_a_compile_error(kw: dict, code: str, words: str) -> None:
    name = f"Bad{len(words)}{'B' if kw.get('broadcast') else ''}{'G' if kw.get('gate_twice') else ''}"
    if not code:  # an annotation on a tensor the fused op still writes is fine
        build_bundle(lm(name, **kw), {})
        return
    with pytest.raises(DSLError) as info:
        build_bundle(lm(name, **kw), {})
    assert info.value.code == code and words in str(info.value), str(info.value)


def test_fuse_refuses_to_drop_an_annotated_tensor() -> None:
    """``gated_mlp`` removes ``silu``'s output: a hook on it could never run, so the fusion is refused."""

    @block
    class HookedAct:
        def __init__(self, d_model: int):
            self.d_model = d_model

        wg = Param(Tensor["d_model", "d_model", "fp32"])

        @forward
        def forward(self, x: Tensor["B", "d_model", "fp32"]) -> Tensor["B", "d_model", "fp32"]:
            with graph() as g:
                act = g.silu(g.matmul(x, "wg", transpose="NT")) @ hook("AfterMLPActivation")
                return g.mul(act, x) @ fuse("gated_mlp")

    with pytest.raises(DSLError) as info:
        build_bundle(HookedAct, {"d_model": 4})
    assert info.value.code == "E013" and "is annotated @hook" in str(info.value)
