"""The public API kiln-dsl offers other frontends (docs/dsl.md, "API for other frontends"): registry
lookups by name, classes defined without replacing registered ones, and the builder methods a lowering
needs (op count and source locations, naming results, resolving names, MoE scatter indices)."""

# ruff: noqa: F821  (dimension names inside Tensor[...] annotations are not Python names)

from typing import Any

import pytest

from kiln.core import KilnError
from kiln.core.ir import Graph, thaw, verify
from kiln.dsl import (
    B,
    GraphRef,
    Param,
    T,
    Tensor,
    block,
    build_bundle,
    forward,
    graph,
    is_component,
    kind_of,
    list_registered_modules,
    local_definitions,
    lookup_component,
    model,
    module,
)

F = "fp32"


def _forward(cls: type, config: dict[str, Any] | None = None) -> Graph:
    m = build_bundle(cls, config or {}).module(cls.__name__)
    verify(m)
    return m.forward


def test_lookup_component_returns_the_registered_class_or_none() -> None:
    from kiln.dsl.stdlib.modules import RMSNorm

    assert lookup_component("RMSNorm") is RMSNorm
    assert lookup_component("RMSNorm", "module") is RMSNorm
    assert lookup_component("RMSNorm", "block") is None  # a module, not a block
    assert lookup_component("NoSuchThing_frontend_api") is None
    with pytest.raises(KilnError, match="kind must be one of"):
        lookup_component("RMSNorm", "primitive")


def test_kind_of_and_is_component() -> None:
    @block
    class FrontendApiBlock:
        pass

    class Sub(FrontendApiBlock):
        pass

    assert kind_of(FrontendApiBlock) == "block" and is_component(FrontendApiBlock)
    assert kind_of(Sub) == "block" and not is_component(Sub)  # inherits the kind, not decorated itself
    assert kind_of(int) is None and not is_component(int) and not is_component("RMSNorm")


def test_local_definitions_keep_the_registry_as_it_was() -> None:
    from kiln.dsl.stdlib.modules import RMSNorm

    with local_definitions("RMSNorm", "FrontendApiFresh"):
        mine = module(type("RMSNorm", (), {"__module__": "user_frontend"}))
        fresh = model(type("FrontendApiFresh", (), {"__module__": "user_frontend"}))
        assert lookup_component("RMSNorm") is mine  # inside the block the definitions are visible
    assert kind_of(mine) == "module" and kind_of(fresh) == "model"  # still decorated classes
    assert lookup_component("RMSNorm") is RMSNorm
    assert lookup_component("FrontendApiFresh") is None
    assert "FrontendApiFresh" not in list_registered_modules()


def test_local_definitions_restore_even_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError), local_definitions("FrontendApiBroken"):
        block(type("FrontendApiBroken", (), {}))
        raise RuntimeError("boom")
    assert lookup_component("FrontendApiBroken") is None


@module
class Located:
    def __init__(self, d: int = 4) -> None:
        self.d = d

    w = Param(Tensor["d", "d"])

    @forward
    def forward(self, x: Tensor[B, T, "d"]) -> Tensor[B, T, "d"]:
        with graph() as g:
            start = g.op_count
            assert start == 0
            h = g.silu(x)
            y = g.mul(h, x)
            assert g.op_count == 2
            g.locate(start, "model.kiln:7:3", _note=1)
            assert g.resolve(y) is y and g.resolve("w").name == "w"
            named = g.name_tensor("gated", y, "model.kiln:7:3")
            assert isinstance(named, GraphRef) and named.name == "gated"
            flat = g.matmul(g.view(named, shape=["B * T", "d"]), "w", transpose="NT")
            return g.view(flat, shape=[B, T, "d"])


def test_op_count_locate_name_tensor_and_resolve() -> None:
    fwd = _forward(Located, {"d": 4})
    silu, mul, *rest = fwd.ops
    assert (silu.type, mul.type) == ("silu", "mul")
    assert silu.loc == mul.loc == "model.kiln:7:3"
    assert "_note" not in thaw(silu.attrs) and thaw(mul.attrs)["_note"] == 1  # the last op of the statement
    assert all(op.loc != "model.kiln:7:3" for op in rest)  # later ops keep their own location
    assert mul.outputs == ("gated",)


@module
class Misused:
    def __init__(self, what: str = "") -> None:
        self.what = what

    @forward
    def forward(self, x: Tensor[B, T, 4]) -> Tensor[B, T, 4]:
        with graph() as g:
            y = g.silu(x, out_name="taken")
            if self.what == "locate":
                g.locate(5, None)
            elif self.what == "twice":
                g.name_tensor("taken", g.mul(y, x), "model.kiln:9:1")
            elif self.what == "unknown":
                g.resolve("nope")
            return y


@pytest.mark.parametrize(
    ("what", "code", "text"),
    [
        ("locate", "E003", "since must be an op count"),
        ("twice", "E017", "defined twice"),
        ("unknown", "E002", "'nope' is not a parameter"),
    ],
)
def test_misuse_of_the_frontend_builder_methods_is_a_clear_error(what: str, code: str, text: str) -> None:
    with pytest.raises(KilnError, match=text) as info:
        _forward(Misused, {"what": what})
    assert info.value.code == code


@module
class Routed:
    def __init__(self, d: int = 4, num_experts: int = 2) -> None:
        self.d, self.num_experts = d, num_experts

    router = Param(Tensor["num_experts", "d"])

    @forward
    def forward(self, x3: Tensor[B, T, "d"]) -> Tensor[B, T, "d"]:
        with graph() as g:
            x = g.view(x3, shape=["B * T", "d"])
            probs = g.moe_softmax(g.matmul(x, "router", transpose="NT"))
            weights, indices = g.moe_topk(probs, top_k=1, normalize=True)
            assert g.scatter_indices(indices) is None  # not permuted yet
            permuted, scatter = g.moe_permute(x, indices, top_k=1)
            assert g.scatter_indices(indices) is scatter
            assert g.scatter_indices(weights) is None
            y = g.moe_unpermute(permuted, weights, indices, top_k=1)
            return g.view(y, shape=[B, T, "d"])


def test_scatter_indices_finds_what_moe_permute_made() -> None:
    fwd = _forward(Routed, {"d": 4, "num_experts": 2})
    (permute,) = [op for op in fwd.ops if op.type == "moe_permute"]
    (unpermute,) = [op for op in fwd.ops if op.type == "moe_unpermute"]
    assert unpermute.inputs[2] == permute.outputs[1]
