"""The graph IR: exact JSON round trips, robustness against hostile JSON, and ``verify`` codes."""

from __future__ import annotations

import contextlib
import copy
import json
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.core import AttrSpec, Diagnostic, IRError, KilnError, OpDef, OpRegistry, TensorType
from kiln.core.ir import (
    DTYPES,
    IR_VERSION,
    ActivationLayout,
    ActivationSlot,
    Annotation,
    BinOp,
    Bundle,
    Const,
    Graph,
    LoraTarget,
    Module,
    Op,
    ParamSpec,
    Sym,
    TensorDecl,
    diagnostics,
    from_json,
    parse_dim,
    verify,
)
from kiln.core.ir._ir import MEMORY_HINTS, MODULE_KINDS, RECOMPUTE_POLICIES, SCOPES, SHARE_POLICIES, is_float
from kiln.core.ops.library._linalg import OPS as LINALG_OPS

# --- a deterministic op registry ------------------------------------------------------------------


def _same(ctx: Any) -> list[TensorType]:
    return [TensorType(ctx.shape(0), ctx.dtype(0))]


PAYLOAD = (AttrSpec("payload", "any", None),)
LOCAL_OPS = [
    OpDef("ident", ("x",), ("out",), lambda x, payload: x, _same, attrs=PAYLOAD),
    OpDef("join", ("a", "*rest"), ("out",), lambda a, *rest, payload: a, _same, attrs=PAYLOAD),
    OpDef("split2", ("x",), ("lo", "hi"), lambda x, payload: (x, x), lambda c: _same(c) * 2, attrs=PAYLOAD),
]


def make_registry() -> OpRegistry:
    reg = OpRegistry()
    for opdef in [*(o for o in LINALG_OPS if o.name in ("matmul", "matmul_bias")), *LOCAL_OPS]:
        reg.register_op(opdef)
    return reg


REG = make_registry()

# --- strategies -------------------------------------------------------------------------------------

json_leaf = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)  # includes ±inf
    | st.text(max_size=8)
)
json_data = st.recursive(
    json_leaf,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=10,
)
json_dicts = st.dictionaries(st.text(max_size=6), json_data, max_size=4)
texts = st.text(max_size=10)
SEED_DIMS = ["B", "T", "C", "D // 2", "(Hq + 2 * Hkv) * D", "B * T", "D % 4", "Hq - 1", 1, 64, -1]
dim_leaves = st.builds(Const, st.integers(-9, 99)) | st.builds(Sym, st.sampled_from(["B", "T", "D", "n_1"]))
dim_trees = st.recursive(
    dim_leaves,
    lambda kids: st.builds(BinOp, st.sampled_from(["+", "-", "*", "//", "%"]), kids, kids),
    max_leaves=5,
)
dims = st.sampled_from(SEED_DIMS).map(parse_dim) | dim_trees
shapes = st.lists(dims, max_size=4).map(tuple)
dtypes = st.sampled_from(sorted(DTYPES))


def non_default(values: tuple[str, ...], default: str) -> st.SearchStrategy[str]:
    return st.sampled_from([v for v in values if v != default])


@st.composite
def graphs(draw: st.DrawFn, name: str | None = None) -> Graph:
    """A random SSA chain over the ops of REG (plus ``call``) whose declarations agree with the
    shape rules, so that it also verifies cleanly."""
    types: dict[str, tuple[tuple[Any, ...], str]] = {}
    inputs, params, ops = [], [], []
    for i in range(draw(st.integers(1, 3))):
        inputs.append(TensorDecl(f"x{i}", draw(shapes), draw(dtypes)))
        types[inputs[-1].name] = (inputs[-1].shape, inputs[-1].dtype)
    produced: list[str] = []
    for k in range(draw(st.integers(0, 6))):
        out = f"h{k}" + draw(st.sampled_from(["", ".0", "_ü", ":call", "/τ"]))
        src = draw(st.sampled_from(sorted(types)))
        op_attrs: dict[str, Any] = {}
        if draw(st.booleans()):
            op_attrs["_note"] = draw(json_data)  # "_" attrs are annotations every op accepts
        kind = draw(st.sampled_from(["ident", "join", "split2", "matmul", "call"]))
        two_d = sorted(n for n, (s, dt) in types.items() if len(s) == 2 and is_float(dt))  # matmul: floats
        if kind == "matmul" and two_d:
            src = draw(st.sampled_from(two_d))
            (m, kdim), dtype = types[src]
            n = draw(dims)
            w = f"w{k}"
            params.append(TensorDecl(w, (kdim, n), dtype))
            types[w] = ((kdim, n), dtype)
            op_attrs.update(transpose="NN", alpha=draw(st.floats(allow_nan=False)))
            ops.append(Op("matmul", (src, w), (out,), op_attrs, loc=draw(st.none() | texts)))
            types[out] = ((m, n), dtype)
        elif kind == "call":
            op_attrs.update(module=draw(texts), n_layers=draw(st.sampled_from(["L", 3])), params=draw(texts))
            ops.append(Op("call", (src,), (out,), op_attrs))
            types[out] = types[src]
        elif kind == "split2":
            op_attrs["payload"] = draw(json_data)
            ops.append(Op("split2", (src,), (out, out + "~hi"), op_attrs))
            types[out] = types[out + "~hi"] = types[src]
            produced.append(out + "~hi")
        else:
            others = st.lists(st.sampled_from(sorted(types)), min_size=1, max_size=2)
            rest = draw(others) if kind == "join" else []
            if kind == "ident" or rest:
                op_attrs["payload"] = draw(json_data)
            ops.append(Op("join" if rest else "ident", (src, *rest), (out,), op_attrs))
            types[out] = types[src]
        produced.append(out)
    names = draw(st.permutations(produced or [inputs[0].name]))
    n_out = draw(st.integers(1, len(names)))
    outputs = [TensorDecl(n, *types[n]) for n in names[:n_out]]
    inter = [TensorDecl(n, *types[n]) for n in names[n_out:] if draw(st.booleans())]
    return Graph(
        name if name is not None else draw(texts),
        inputs=inputs,
        outputs=outputs,
        params=params,
        intermediates=inter,
        ops=ops,
        save=draw(st.lists(st.sampled_from(produced), unique=True)) if produced else (),
        recompute=draw(st.lists(st.sampled_from(produced), unique=True)) if produced else (),
        metadata=draw(json_dicts),
    )


lora_targets = st.builds(
    LoraTarget, name=texts, start=dims, size=st.none() | dims, dim=st.integers(-2, 3)
)
param_specs = st.builds(
    ParamSpec,
    name=texts,
    shape=shapes,
    dtype=dtypes,
    frozen=st.booleans(),
    optional=st.booleans(),
    condition=st.none() | texts,
    tied_to=st.none() | texts,
    lora_targets=st.lists(lora_targets, max_size=3),
    array_of=st.none() | texts,
    count=st.none() | dims,
    hf_mapping=json_data,
    init=json_dicts,
    description=texts,
)
nonempty = st.text(min_size=1, max_size=8)
# Every field away from its default, so that every field takes part in the round trip.
full_slots = st.builds(
    ActivationSlot,
    name=nonempty,
    shape=st.lists(dims, min_size=1, max_size=3),
    dtype=non_default(tuple(DTYPES), "bf16"),
    scope=non_default(SCOPES, "block"),
    aliases=st.lists(nonempty, min_size=1, max_size=3),
    memory_hint=non_default(MEMORY_HINTS, "persistent"),
    save=st.just(True),
    recompute=st.just(True),
    shares_with=nonempty,
    share_policy=non_default(SHARE_POLICIES, "per_layer"),
    gradient_of=nonempty,
    alias_of=nonempty,
    condition=nonempty,
    recompute_from=st.lists(nonempty, min_size=1, max_size=3),
    recompute_op=nonempty,
    recompute_attrs=st.dictionaries(st.text(max_size=6), json_data, min_size=1, max_size=3),
    recompute_policy=non_default(RECOMPUTE_POLICIES, "always"),
    recompute_group=nonempty,
    recompute_outputs=st.lists(nonempty, min_size=1, max_size=3),
    lora_targets=st.lists(nonempty, min_size=1, max_size=3),
    description=nonempty,
)


@st.composite
def modules(draw: st.DrawFn, name: str | None = None) -> Module:
    return Module(
        name if name is not None else draw(texts),
        kind=draw(st.sampled_from(MODULE_KINDS)),
        config=draw(json_dicts),
        params=draw(st.lists(param_specs, max_size=3)),
        forward=draw(st.none() | graphs()),
        backward=draw(st.none() | graphs()),
        activations=ActivationLayout(draw(st.lists(full_slots, max_size=3))),
        hf_config=draw(json_dicts),
        hf_mappings=draw(st.dictionaries(texts, json_data, max_size=3)),
        hf_export=draw(json_dicts),
        metadata=draw(json_dicts),
    )


@st.composite
def bundles(draw: st.DrawFn) -> Bundle:
    names = draw(st.lists(texts, min_size=1, max_size=3, unique=True))
    mods = [draw(modules(name=n)) for n in names]
    return Bundle(mods, entry=draw(st.none() | st.sampled_from(names)))


ir_objects = (
    graphs()
    | modules()
    | bundles()
    | full_slots
    | param_specs
    | lora_targets
    | st.builds(TensorType, shapes, dtypes)
    | st.builds(TensorDecl, texts, shapes, dtypes)
)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- round trips ------------------------------------------------------------------------------------


@FAST
@given(ir_objects)
def test_json_round_trip_is_exact(obj: Any) -> None:
    text = obj.to_json()
    assert text == obj.to_json()  # stable
    back = from_json(text)
    assert type(back) is type(obj)
    assert back == obj
    assert back.to_json() == text  # also catches True -> 1 or 1.0 -> 1, which == would hide
    assert from_json(json.loads(text)) == obj
    assert from_json(obj.to_dict()) == obj
    assert from_json(text.encode()) == obj
    assert hash(back) == hash(obj)


@FAST
@given(graphs())
def test_random_graphs_verify_cleanly(graph: Graph) -> None:
    assert diagnostics(graph, registry=REG) == []
    verify(graph, registry=REG)


@settings(max_examples=20, deadline=None)
@given(full_slots)
def test_every_activation_slot_field_is_serialised(slot: ActivationSlot) -> None:
    assert set(slot.to_dict()) == {"kiln_ir", "ir"} | {f.name for f in attrs.fields(ActivationSlot)}


# --- robustness -------------------------------------------------------------------------------------


def _accepts_or_kiln_error(data: Any) -> None:
    """``from_json`` then ``verify`` either succeed or raise a KilnError; a loaded object round-trips."""
    try:
        obj = from_json(data)
    except KilnError:
        return
    assert from_json(obj.to_json()) == obj
    with contextlib.suppress(KilnError):
        verify(obj, registry=REG)


TAGS = ["tensortype", "tensordecl", "op", "graph", "paramspec", "loratarget", "activationslot",
        "activationlayout", "annotation", "module", "bundle"]


@settings(max_examples=150, deadline=None)
@given(json_data, st.sampled_from([None, *TAGS]))
def test_arbitrary_json_raises_only_kiln_errors(value: Any, tag: str | None) -> None:
    _accepts_or_kiln_error(value)
    _accepts_or_kiln_error(json.dumps(value))
    if tag is not None and isinstance(value, dict):  # get past the header into the decoder
        _accepts_or_kiln_error({**value, "kiln_ir": 1, "ir": tag})


def _paths(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*path, i))
    return out


def _at(node: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        node = node[k]
    return node


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs() | modules() | bundles(), st.data())
def test_mutated_ir_raises_only_kiln_errors(obj: Any, data: st.DataObject) -> None:
    doc = copy.deepcopy(obj.to_dict())
    paths = _paths(doc)
    how = data.draw(st.sampled_from(["replace", "delete", "add", "version"]))
    if how == "version":
        doc["kiln_ir"] = data.draw(json_data.filter(lambda v: not (type(v) is int and v == IR_VERSION)))
        with pytest.raises(IRError, match="version"):
            from_json(doc)
        return
    if how == "replace":
        path = data.draw(st.sampled_from(paths[1:]))
        _at(doc, path[:-1])[path[-1]] = data.draw(json_data)
    elif how == "delete":
        path = data.draw(st.sampled_from([p for p in paths if p and isinstance(_at(doc, p[:-1]), dict)]))
        del _at(doc, path[:-1])[path[-1]]
    else:
        path = data.draw(st.sampled_from([p for p in paths if isinstance(_at(doc, p), dict)]))
        _at(doc, path)["unknown_" + data.draw(texts)] = data.draw(json_data)
    _accepts_or_kiln_error(doc)
    _accepts_or_kiln_error(json.dumps(doc))


@settings(max_examples=150, deadline=None)
@given(st.text() | st.binary())
def test_arbitrary_text_and_bytes_raise_only_kiln_errors(data: str | bytes) -> None:
    _accepts_or_kiln_error(data)


@pytest.mark.parametrize(
    "data",
    [
        "[" * 100_000,
        '{"kiln_ir": 1, "ir": "op", "type": "ident", "inputs": [], "outputs": ["y"], "attrs": {"a": '
        + "[" * 900 + "]" * 900 + "}}",
        '{"kiln_ir": 1, "ir": ["graph"], "name": "g"}',
        '{"kiln_ir": 1, "ir": {"graph": 1}}',
        '{"kiln_ir": 1, "ir": "op", "type": "ident", "inputs": ["x"], "outputs": ["y"], "attrs": {"a": NaN}}',
        '{"kiln_ir": 1, "ir": "tensortype", "shape": ["B", "1" ], "dtype": "fp64"}',
        '{"kiln_ir": 1, "ir": "tensortype", "shape": ["((((B"], "dtype": "fp32"}',
        '{"kiln_ir": 1, "ir": "tensortype", "shape": [' + "9" * 5000 + '], "dtype": "fp32"}',
        '{"kiln_ir": 1, "ir": "graph"}',
        b"\xff\xfe\x00garbage",
        "",
        "null",
    ],
)
def test_hostile_documents_raise_ir_errors(data: str | bytes) -> None:
    with pytest.raises(IRError):
        verify(from_json(data), registry=REG)


def test_verify_rejects_objects_it_cannot_check() -> None:
    with pytest.raises(IRError, match="TensorType"):
        verify(TensorType(("B",), "fp32"), registry=REG)


# --- verify -----------------------------------------------------------------------------------------

X = TensorDecl("x", ("B", "D"), "bf16")
PARAMS = (
    TensorDecl("w1", ("D", "F"), "bf16"),
    TensorDecl("w2", ("F", "D"), "bf16"),
    TensorDecl("w3", ("D", "D"), "bf16"),
    TensorDecl("b", ("D",), "bf16"),
)
GOOD_OPS = (
    Op("matmul", ("x", "w1"), ("h",)),
    Op("ident", ("h",), ("a",)),
    Op("matmul", ("a", "w2"), ("y",)),
    Op("matmul_bias", ("y", "w3", "b"), ("z",)),  # index 3: where the faults go
    Op("ident", ("z",), ("u",)),
    Op("ident", ("u",), ("v",)),
    Op("ident", ("v",), ("out",), {"payload": {"why": ["kept", 1, None]}}),
)
GOOD = Graph("block", inputs=(X,), params=PARAMS, ops=GOOD_OPS, save=("h", "z"),
             outputs=(TensorDecl("out", ("B", "D"), "bf16"),),
             intermediates=(TensorDecl("z", ("B", "D"), "bf16"),))


def with_op(i: int, op: Op, *, insert: bool = False, **changes: Any) -> Graph:
    ops = list(GOOD_OPS)
    ops[i:i if insert else i + 1] = [op]
    return GOOD.evolve(ops=tuple(ops), **changes)


def only(graph: Graph | Module | Bundle, code: str) -> Diagnostic:
    diags = diagnostics(graph, registry=REG)
    assert [d.code for d in diags] == [code], "\n".join(map(str, diags))
    with pytest.raises(IRError) as info:
        verify(graph, registry=REG)
    assert info.value.diagnostics == tuple(diags)
    assert code in str(info.value)
    return diags[0]


def assert_window(d: Diagnostic, graph: Graph, i: int) -> None:
    """The location names the graph and op, marks op ``i`` with ``>>`` among its neighbours."""
    assert d.location is not None
    head, *lines = d.location.splitlines()
    assert repr(graph.name) in head and f"%{i} ({graph.ops[i].type})" in head
    marked = [ln for ln in lines if ">>" in ln]
    assert marked == [f"%{i:<3}>> {graph.ops[i]}"]
    shown = [int(ln[1:4]) for ln in lines]
    assert shown == list(range(max(0, i - 2), min(len(graph.ops), i + 3)))
    assert len(shown) > 1


def test_good_graph_verifies_cleanly() -> None:
    assert diagnostics(GOOD, registry=REG) == []
    GOOD.verify(registry=REG)
    assert from_json(GOOD.to_json()) == GOOD


def test_e002_undefined_tensor() -> None:
    g = with_op(3, Op("matmul_bias", ("y", "w3", "ghost"), ("z",)))
    d = only(g, "E002")
    assert "'ghost'" in d.message and "never defined" in d.message
    assert_window(d, g, 3)


def test_e002_use_before_def() -> None:
    g = GOOD.evolve(ops=(*GOOD_OPS[:3], GOOD_OPS[4], GOOD_OPS[3], *GOOD_OPS[5:]))
    d = only(g, "E002")
    assert "'z'" in d.message and "before op %4" in d.message
    assert_window(d, g, 3)


def test_e002_unproduced_output_and_save() -> None:
    g = GOOD.evolve(outputs=(*GOOD.outputs, TensorDecl("nowhere", ("B",), "fp32")), save=("h", "gone"))
    codes = {d.code for d in diagnostics(g, registry=REG)}
    messages = " ".join(d.message for d in diagnostics(g, registry=REG))
    assert codes == {"E002"} and "'nowhere'" in messages and "'gone'" in messages


def test_e003_arity() -> None:
    g = with_op(3, Op("matmul_bias", ("y", "w3"), ("z",)))
    d = only(g, "E003")
    assert "'matmul_bias'" in d.message and "3 inputs" in d.message and "found 2 inputs" in d.message
    assert d.hint is not None and "x, w, bias" in d.hint
    assert_window(d, g, 3)


@pytest.mark.parametrize(("attrs", "culprit"), [({"transpose": "XY"}, "'XY'"), ({"bogus": 1}, "bogus")])
def test_e003_bad_attribute(attrs: dict[str, Any], culprit: str) -> None:
    g = with_op(3, Op("matmul_bias", ("y", "w3", "b"), ("z",), attrs))
    d = only(g, "E003")
    assert "'matmul_bias'" in d.message and culprit in d.message
    assert_window(d, g, 3)


def test_e003_dtype_differs_from_declaration() -> None:
    fp32 = TensorDecl("z", ("B", "D"), "fp32")
    g = GOOD.evolve(intermediates=(fp32,), outputs=(GOOD.outputs[0].evolve(dtype="fp32"),))
    d = only(g, "E003")
    assert "'z'" in d.message and "fp32" in d.message and "bf16" in d.message and "'matmul_bias'" in d.message
    assert_window(d, g, 3)


def test_e004_shape_rule_rejects_inputs() -> None:
    g = with_op(3, Op("matmul_bias", ("y", "w1", "b"), ("z",)))
    d = only(g, "E004")
    assert "'matmul_bias'" in d.message and "[D] vs [F]" in d.message
    assert_window(d, g, 3)


def test_e004_shape_differs_from_declaration() -> None:
    g = GOOD.evolve(intermediates=(TensorDecl("z", ("B", "F"), "bf16"),),
                    outputs=(TensorDecl("out", ("B", "F"), "bf16"),))
    d = only(g, "E004")
    assert "'z'" in d.message and "[B, F]" in d.message and "[B, D]" in d.message
    assert_window(d, g, 3)


def test_dims_are_compared_symbolically() -> None:
    g = GOOD.evolve(intermediates=(TensorDecl("z", ("B", "D + F - F"), "bf16"),))
    assert diagnostics(g, registry=REG) == []


def test_dims_too_large_to_compare_are_reported_not_raised() -> None:
    huge = " * ".join(["(a + b + c + d + e + f + g + h + i + j)"] * 5)
    g = GOOD.evolve(intermediates=(TensorDecl("z", ("B", huge), "bf16"),), outputs=(GOOD.outputs[0],))
    assert "E004" in [d.code for d in diagnostics(g, registry=REG)]


def test_e007_cycle() -> None:
    g = with_op(3, Op("matmul_bias", ("v", "w3", "b"), ("z",)))
    d = only(g, "E007")
    assert "circular" in d.message
    for i in (3, 4, 5):
        assert f"%{i} ({g.ops[i].type})" in d.message
    marked = int(d.location.split("op %")[1].split(" ")[0])  # type: ignore[union-attr]
    assert marked in (3, 4, 5)
    assert_window(d, g, marked)


def test_e007_self_loop() -> None:
    g = with_op(3, Op("ident", ("z",), ("z",)), insert=True)
    codes = [d.code for d in diagnostics(g, registry=REG)]
    assert "E007" in codes


@pytest.mark.parametrize("dup", ["x", "w2"])
def test_e009_duplicate_input_or_param(dup: str) -> None:
    first = next(d for d in (X, *PARAMS) if d.name == dup)
    g = GOOD.evolve(params=(*PARAMS, first))
    d = only(g, "E009")
    assert f"'{dup}'" in d.message and "twice" in d.message
    assert d.location == "graph 'block'"


def test_e009_duplicate_module_param() -> None:
    m = Module("mlp", params=(ParamSpec("w", ("D", "D")), ParamSpec("b", ("D",)), ParamSpec("w", ("D",))),
               forward=GOOD)
    d = only(m, "E009")
    assert "'w'" in d.message and d.location == "module 'mlp'"


def test_e014_unknown_op() -> None:
    g = with_op(3, Op("mystery_op", ("y", "w3", "b"), ("z",)))
    d = only(g, "E014")
    assert "'mystery_op'" in d.message and d.hint is not None and "plugin" in d.hint
    assert_window(d, g, 3)


def test_e017_ssa_redefinition() -> None:
    g = with_op(3, Op("ident", ("y",), ("h",)), insert=True)
    d = only(g, "E017")
    assert "'h'" in d.message and "op %0" in d.message
    assert_window(d, g, 3)
    g = with_op(3, Op("ident", ("y",), ("x",)), insert=True)
    assert "input or parameter" in only(g, "E017").message


def test_diagnostics_collect_every_error() -> None:
    g = GOOD.evolve(ops=(Op("mystery_op", ("x",), ("q",)), *GOOD_OPS[:3], Op("ident", ("ghost",), ("z",)),
                         *GOOD_OPS[4:]))
    assert [d.code for d in diagnostics(g, registry=REG)] == ["E002", "E014"]


# --- bundles and the call op ------------------------------------------------------------------------

BLOCK = Module("blk", kind="block", params=(ParamSpec("w", ("D", "D")),), forward=Graph(
    "blk", inputs=(X, TensorDecl("scale", (), "fp32")), params=(TensorDecl("w", ("D", "D"), "bf16"),),
    ops=(Op("matmul", ("x", "w"), ("h",)), Op("ident", ("h",), ("y",))),
    outputs=(TensorDecl("y", ("B", "D"), "bf16"),)))


def model(target: str, n_in: int = 2) -> Module:
    ops = (
        Op("ident", ("x",), ("x0",)),
        Op("ident", ("s",), ("s0",)),
        Op("call", ("x0", "s0")[:n_in], ("hs",), {"module": target, "n_layers": "L", "params": "blocks"}),
        Op("ident", ("hs",), ("out",)),
    )
    graph = Graph("model", inputs=(X, TensorDecl("s", (), "fp32")), ops=ops,
                  params=(TensorDecl("blocks", ("L", "D", "D"), "bf16"),),
                  outputs=(TensorDecl("out", ("B", "D"), "bf16"),))
    return Module("model", kind="model", forward=graph,
                  params=(ParamSpec("blocks", ("L", "D", "D"), array_of="blk", count="L"),))


def test_good_bundle_verifies_cleanly() -> None:
    bundle = Bundle((model("blk"), BLOCK), entry="model")
    assert diagnostics(bundle, registry=REG) == []
    bundle.verify(registry=REG)
    assert from_json(bundle.to_json()) == bundle
    assert bundle.module("blk") is BLOCK


def test_call_of_missing_module_is_e002() -> None:
    bundle = Bundle((model("no_such_block"), BLOCK), entry="model")
    d = only(bundle, "E002")
    assert "'no_such_block'" in d.message
    assert_window(d, bundle.modules[0].forward, 2)  # type: ignore[arg-type]
    with pytest.raises(IRError, match="no_such_block"):
        bundle.module("no_such_block")


def test_call_arity_and_module_attr() -> None:
    d = only(Bundle((model("blk", n_in=1), BLOCK)), "E003")
    assert "'blk'" in d.message and "2 inputs" in d.message
    bad = Graph("g", inputs=(X,), ops=(Op("call", ("x",), ("y",), {"module": 3}),))
    assert "'module'" in only(bad, "E003").message


def test_call_backward_layout() -> None:
    """``call_backward``: (d_outputs..., saved inputs...) -> (d_inputs... with "" for none, d_params)."""
    bwd = Graph("model_backward", inputs=(TensorDecl("d_hs", ("B", "D"), "bf16"),), ops=(
        Op("call_backward", ("d_hs", "saved.x0", "saved.s0"), ("d_x0", "", "d_blocks"), {"module": "blk"}),))
    base = model("blk")
    assert base.forward is not None
    good = base.evolve(forward=base.forward.evolve(save=("x0", "s0")), backward=bwd)
    assert diagnostics(Bundle((good, BLOCK)), registry=REG) == []
    short = bwd.evolve(ops=(bwd.ops[0].evolve(outputs=("d_x0", "d_blocks")),))
    d = only(Bundle((good.evolve(backward=short), BLOCK)), "E003")
    assert "call_backward of module 'blk' takes 3 inputs and returns 3 outputs" in d.message


def test_bundle_level_errors() -> None:
    diags = diagnostics(Bundle((BLOCK, BLOCK), entry="missing"), registry=REG)
    assert sorted(d.code for d in diags) == ["E002", "E009"]
    assert all("'blk'" in d.message or "'missing'" in d.message for d in diags)


# --- activation layouts and the version -------------------------------------------------------------


def test_activation_layout_resolves_aliases() -> None:
    ln1 = ActivationSlot("ln1", ("B", "T", "C"), aliases=("ln1_flat", "norm1"))
    d_ln1 = ActivationSlot("d_ln1", ("B", "T", "C"), scope="gradient", gradient_of="ln1")
    layout = ActivationLayout((ln1, d_ln1))
    assert layout.alias_map() == {"ln1": "ln1", "ln1_flat": "ln1", "norm1": "ln1", "d_ln1": "d_ln1"}
    assert layout.get("norm1") is ln1
    assert layout.get("ln1") is ln1
    assert layout.get("d_ln1") is d_ln1
    assert layout.get("nope") is None


EXAMPLES = [
    TensorType(("B",), "fp32"),
    X,
    GOOD_OPS[0],
    GOOD,
    LoraTarget("q", 0, "Hq * D"),
    ParamSpec("w"),
    ActivationSlot("a"),
    ActivationLayout(),
    Annotation("hook", "tensor", "h", {"point": "AfterAttention"}),
    BLOCK,
    Bundle((BLOCK,)),
]


@pytest.mark.parametrize("obj", EXAMPLES, ids=lambda o: type(o).__name__)
def test_every_object_carries_the_ir_version(obj: Any) -> None:
    d = obj.to_dict()
    assert IR_VERSION == 2
    assert d["kiln_ir"] == 2 and type(d["kiln_ir"]) is int
    assert d["ir"] == type(obj).__name__.lower()
    assert from_json(d) == obj


@pytest.mark.parametrize("version", [3, 0, -1, "1", 1.0, True, None, [1]])
def test_unknown_version_is_rejected(version: Any) -> None:
    d = GOOD.to_dict()
    d["kiln_ir"] = version
    with pytest.raises(IRError, match="version") as info:
        from_json(d)
    assert repr(version) in info.value.message
    del d["kiln_ir"]
    with pytest.raises(IRError, match="version"):
        from_json(d)


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        (("ops", 1, "inputs"), "h", "Graph.ops: item 1: Op.inputs: expected a list of strings, found 'h'"),
        (("inputs", 0, "shape"), ["B", 1.5], "Graph.inputs: item 0: TensorDecl.shape: shape dimension #1"),
        (("intermediates", 0, "dtype"), "fp64", "TensorDecl.dtype: unknown dtype 'fp64'"),
        (("ops", 6, "attrs"), {"x": float("nan")}, "Op.attrs: value.x: NaN is not allowed"),
        (("ops", 2, "type"), None, "Graph.ops: item 2: Op: missing required field(s) 'type'"),
        (("surprise",), 1, "Graph: unknown field(s) 'surprise'"),
    ],
)
def test_field_errors_name_the_path_to_the_culprit(path: tuple[Any, ...], value: Any, expected: str) -> None:
    d = GOOD.to_dict()
    if value is None:
        del _at(d, path[:-1])[path[-1]]
    else:
        _at(d, path[:-1])[path[-1]] = value
    with pytest.raises(IRError) as info:
        from_json(d)
    assert expected in info.value.message
    assert info.value.code == "E003"


def test_version_1_objects_migrate_to_the_current_version() -> None:
    block = BLOCK.evolve(annotations=[Annotation("frozen", "param", "w"), Annotation("checkpoint", "module")])
    d = BLOCK.to_dict()
    d["kiln_ir"] = 1
    assert from_json(d) == BLOCK  # a version 1 object has no annotations
    assert from_json(json.dumps(d)).to_dict()["kiln_ir"] == IR_VERSION
    assert from_json(block.to_json()) == block != BLOCK
    with pytest.raises(IRError, match=r"Annotation\.on"):
        from_json({**block.to_dict(), "annotations": [{"kind": "frozen", "on": "layer"}]})
