"""``@lifetime`` (seed 004 §7.2.3): honoured by the memory planner."""

# ruff: noqa: F821  (dimension names inside Tensor[...] annotations are not Python names)

import numpy as np
import pytest

from kiln.core import KilnError, Model, compile
from kiln.core.ir import from_json
from kiln.dsl import B, DSLError, Param, T, Tensor, block, build_bundle, forward, graph
from kiln.dsl.annotations import lifetime, memory
from kiln.dsl.testing import V, stack_lm

BINDS = {"B": 2, "T": 5}


def lm(name: str, *b_ann: object, a_ann: tuple = ()) -> type:
    """``x + (2 silu(x @ w1^T)) @ w2^T`` in a two-layer stack; ``b_ann`` annotate ``b = silu(a)``, which
    the backward does not read (``c = b + b`` needs no input for its gradient): its last reader is the
    add; ``a_ann`` annotate ``a = x @ w1^T``, which the backward of ``silu`` reads."""

    class Mlp:
        def __init__(self, d_model: int):
            self.d_model = d_model

        w1 = Param(Tensor["d_model", "d_model", "fp32"])
        w2 = Param(Tensor["d_model", "d_model", "fp32"])

        @forward
        def forward(self, x: Tensor["B", "T", "d_model", "fp32"]) -> Tensor["B", "T", "d_model", "fp32"]:
            with graph() as g:
                xf = g.view(x, shape=[B * T, "d_model"], out_name="xf")
                a = g.annotate(g.matmul(xf, "w1", transpose="NT", out_name="a"), *a_ann)
                b = g.annotate(g.silu(a, out_name="b"), *b_ann)
                c = g.add(b, b, out_name="c")
                out = g.matmul(c, "w2", transpose="NT", out_name="d")
                return g.add(x, g.view(out, shape=[B, T, "d_model"]))

    Mlp.__name__ = Mlp.__qualname__ = f"{name}Block"
    block(Mlp)
    return stack_lm(name, f"{name}Block", n_layers=2)


def slot_of(prog, key: str):
    (slot,) = [s for s in prog.slots if key in s.tensors]
    return slot


def step_of(prog, key: str) -> int:
    return next(st.index for st in prog.steps if key in st.outputs and not st.recompute)


def readers(prog, key: str) -> list[int]:
    return [st.index for st in prog.steps if key in st.inputs]


def overlapping(prog, slot) -> list[str]:
    """Slots of the packed region that share bytes with ``slot`` while it is alive."""
    return [s.name for s in prog.slots if s is not slot and s.kind in ("saved", "transient")
            and s.offset < slot.offset + slot.nbytes and slot.offset < s.offset + s.nbytes
            and s.first <= slot.last and slot.first <= s.last]


def test_lifetime_is_carried_in_the_ir() -> None:
    bundle = build_bundle(lm("Carried", lifetime(end="d")), {})
    (ann,) = [a for a in bundle.module("CarriedBlock").annotations if a.kind == "lifetime"]
    assert (ann.on, ann.target, dict(ann.args)) == ("tensor", "b", {"end": "d"})
    again = from_json(bundle.to_json())
    assert [a for a in again.module("CarriedBlock").annotations if a.kind == "lifetime"] == [ann]


def test_lifetime_end_keeps_the_buffer_until_that_step() -> None:
    """Without the annotation ``b`` dies at its last reader (the add); ``end="d"`` keeps it until the
    step that computes ``d``, in every layer, and nothing else may use its bytes meanwhile."""
    plain = compile(build_bundle(lm("Short"), {}), bindings=BINDS)
    kept = compile(build_bundle(lm("Long", lifetime(end="d")), {}), bindings=BINDS)
    for layer in (0, 1):
        key = f"blocks.{layer}.b"
        # unannotated, the add writes ``c`` over ``b`` (its last reader): one buffer for both
        assert f"blocks.{layer}.c" in slot_of(plain, key).tensors
        assert max(readers(kept, key)) < step_of(kept, f"blocks.{layer}.d")
        slot = slot_of(kept, key)
        assert slot.tensors == (key,) and slot.last == step_of(kept, f"blocks.{layer}.d")
        assert overlapping(kept, slot) == [], overlapping(kept, slot)
    # the planned bytes only grow, and the numbers do not change
    assert kept.arena_bytes >= plain.arena_bytes
    a = Model(build_bundle(lm("ShortRun"), {}), seed=1)
    b = Model(build_bundle(lm("LongRun", lifetime(end="d")), {}), weights=a.parameters())
    ids = np.random.default_rng(0).integers(0, V, (2, 6))
    la, ga = a.loss_and_grads(ids[:, :-1], ids[:, 1:])
    lb, gb = b.loss_and_grads(ids[:, :-1], ids[:, 1:])
    assert la == lb and all(np.array_equal(ga[k], gb[k]) for k in ga)


def test_lifetime_scopes_layer_and_global() -> None:
    layer = compile(build_bundle(lm("LayerScope", lifetime("layer")), {}), bindings=BINDS)
    glob = compile(build_bundle(lm("GlobalScope", lifetime(scope="global")), {}), bindings=BINDS)
    for prog in (layer, glob):
        assert slot_of(prog, "blocks.0.b").last > max(readers(prog, "blocks.0.b"))
    # layer: until the last forward step of its layer (the residual add), not beyond
    fwd0 = [st.index for st in layer.steps if st.phase == "forward" and st.layer == 0]
    assert slot_of(layer, "blocks.0.b").last == max(fwd0) < min(
        st.index for st in layer.steps if st.layer == 1)
    # global: through the whole Program, its bytes used by nothing else
    slot = slot_of(glob, "blocks.1.b")
    assert slot.last == len(glob.steps) - 1 and overlapping(glob, slot) == []


def test_lifetime_start_reserves_the_buffer_from_an_earlier_step() -> None:
    """``start=`` names the tensor whose step opens the lifetime: the block's view ``xf`` of its input."""
    prog = compile(build_bundle(lm("Early", lifetime(start="xf")), {}), bindings=BINDS)
    plain = compile(build_bundle(lm("Late"), {}), bindings=BINDS)
    view = next(st for st in prog.steps if st.layer == 0 and st.op.type == "view" and st.phase == "forward")
    assert slot_of(prog, "blocks.0.b").first == view.index < step_of(prog, "blocks.0.b")
    assert slot_of(plain, "blocks.0.b").first == step_of(plain, "blocks.0.b")


def test_recompute_outranks_lifetime() -> None:
    """§7.2.0: ``@memory("recompute")`` frees the forward copy after the forward, whatever the lifetime
    says; under ``recompute="none"`` the global lifetime holds."""
    bundle = build_bundle(lm("Replayed", a_ann=(lifetime(scope="global"), memory("recompute"))), {})
    replayed = compile(bundle, bindings=BINDS, recompute="dsl")
    assert any(st.recompute and "blocks.0.a:recompute" in st.outputs for st in replayed.steps)
    fwd_end = max(st.index for st in replayed.steps if st.phase == "forward")
    assert slot_of(replayed, "blocks.0.a").last <= fwd_end
    kept = compile(bundle, bindings=BINDS, recompute="none")
    assert slot_of(kept, "blocks.0.a").last == len(kept.steps) - 1


@pytest.mark.parametrize(
    ("ann", "code", "words"),
    [
        (lambda: lifetime(end="nowhere"), "E002", "'nowhere'"),
        (lambda: lifetime(start="d"), "E008", "computed after"),
        (lambda: lifetime(end="xf"), "E008", "computed before"),
        (lambda: lifetime(scope="forever"), "E008", "scope="),
    ],
)
def test_bad_lifetimes_are_compile_errors(ann, code: str, words: str) -> None:
    with pytest.raises(DSLError) as info:
        build_bundle(lm(f"Bad{code}{len(words)}", ann()), {})
    assert info.value.code == code and words in str(info.value)


def test_core_checks_a_lifetime_written_in_the_ir() -> None:
    """IR from another frontend: the planner names the tensor and the annotation it cannot honour."""
    bundle = build_bundle(lm("Raw", lifetime(end="d")), {})
    blk = bundle.module("RawBlock")
    anns = [a.evolve(args={"end": "xf"}) if a.kind == "lifetime" else a for a in blk.annotations]
    bad = bundle.evolve(modules=[blk.evolve(annotations=anns) if m.name == "RawBlock" else m
                                 for m in bundle.modules])
    with pytest.raises(KilnError, match="'xf' is computed before 'b'"):
        compile(bad, bindings=BINDS)
