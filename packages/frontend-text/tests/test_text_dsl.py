"""kiln-dsl-text: the seed's examples parse, the text Qwen3 is the Python Qwen3, diagnostics point at
the text, `kiln compile` writes the IR, and no input makes the parser raise anything but KilnError."""

import json
from pathlib import Path

import numpy as np
import pytest

from kiln.core import KilnError, Model
from kiln.core.cli import main
from kiln.dsl import build_bundle
from kiln.dsl_text import TextError, compile_file, load_program, model_path, parse

TINY = {
    "vocab_size": 64,
    "d_model": 16,
    "n_layers": 2,
    "num_query_heads": 2,
    "num_kv_heads": 1,
    "d_ff": 24,
    "max_seq": 32,
    "head_size": 8,
}
SEEDS = Path(__file__).parent / "seed_examples"


def _canonical(bundle):
    """The IR as JSON without what only names or places differ: the model's name, op source lines,
    descriptions and the model's own activation-slot table (a Python-only annotation)."""
    data = json.loads(bundle.to_json())
    entry = data.pop("entry")
    for m in data["modules"]:
        if m["name"] == entry:
            m["name"] = m["forward"]["name"] = "<model>"
            m.pop("activations", None)
            m.pop("metadata", None)
            # the Python model also takes HF's rope_scaling / rope_parameters dicts (None here)
            m["config"] = {
                k: v for k, v in m["config"].items() if k not in ("rope_scaling", "rope_parameters")
            }
        for op in m["forward"]["ops"]:
            op.pop("loc", None)
        for p in m["params"]:
            p.pop("description", None)
    return data


def test_text_qwen3_compiles_to_the_python_qwen3_ir() -> None:
    text = compile_file(model_path("qwen3"), config=TINY)
    python = build_bundle("Qwen3Model", TINY)
    assert _canonical(text) == _canonical(python)
    # and the ops point at the text file
    assert text.module(text.entry).forward.ops[0].loc == "qwen3.kiln:45"


def test_text_qwen3_trains_to_the_python_qwen3_losses_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    models = [
        Model.from_ir(b, seed=0)
        for b in (compile_file(model_path("qwen3"), config=TINY), build_bundle("Qwen3Model", TINY))
    ]
    for _ in range(3):
        ids = rng.integers(0, 64, size=(2, 6))
        batch = {"input_ids": ids, "labels": np.roll(ids, -1, axis=1)}
        text_loss, python_loss = (m.train_step(batch)["loss"] for m in models)
        assert text_loss == python_loss
    a, b = (m.parameters() for m in models)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", ["llama2", "moe", "mamba"])
def test_the_seed_examples_parse(name: str) -> None:
    tree = parse((SEEDS / f"{name}.kiln").read_text(), name)
    assert [c.data for c in tree.children if hasattr(c, "data")][-1] == "decl"


SEED_CONFIG = {
    "vocab_size": 64,
    "d_model": 16,
    "n_layers": 2,
    "num_heads": 2,
    "num_kv_heads": 1,
    "d_ff": 8,
    "max_seq": 32,
    "num_experts": 4,
    "top_k": 2,
}


def test_the_seed_llama2_compiles_with_the_text_standard_library() -> None:
    from kiln.core.ir import verify

    program = load_program(SEEDS / "llama2.kiln")
    assert [w.code for w in program.warnings] == ["W003"]  # its explicit backward: kiln derives it
    bundle = program.bundle(None, SEED_CONFIG)
    verify(bundle)
    model, block = bundle.module("Llama2"), bundle.module("DenseTransformerBlock")
    assert [p.name for p in block.params] == [
        "ln1.weight",
        "ln2.weight",
        "attention.qkv_weight",
        "attention.out_weight",
        "mlp.up_weight",
        "mlp.down_weight",
    ]
    assert [op.type for op in model.forward.ops] == [
        "embedding",
        "zeros",
        "call",
        "fused_residual_rmsnorm",
        "view",
        "matmul",
        "view",
    ]
    assert model.forward.ops[5].inputs[1] == "embedding"  # lm_head: tied_to(embedding)
    assert "flash_attention" in [op.type for op in block.forward.ops]
    mapping = model.hf_mappings["blocks"]["mappings"]
    assert mapping["attention.qkv_weight"]["sources"][0] == "model.layers.{i}.self_attn.q_proj.weight"


def test_the_seed_moe_block_compiles() -> None:
    from kiln.core.ir import verify

    bundle = load_program(SEEDS / "moe.kiln").bundle("MoETransformerBlock", SEED_CONFIG)
    verify(bundle)
    block = bundle.module("MoETransformerBlock")
    ops = [op.type for op in block.forward.ops]
    assert ops[-7:] == [
        "moe_router",
        "moe_permute",
        "moe_grouped_gemm_gate_up",
        "swiglu",
        "moe_grouped_gemm_down",
        "moe_unpermute",
        "view",
    ]
    assert [str(d) for d in block.param("experts.gate_up").shape] == ["E", "2 * M", "C"]
    router = block.forward.ops[-7]
    assert router.attrs["top_k"] == 2
    (hook,) = [a for a in block.annotations if a.target == "weights"]  # @hook(...) after the flow
    assert (hook.kind, dict(hook.args), hook.loc) == (
        "hook",
        {"point": "AfterRouterProjection"},
        "moe.kiln:39",
    )


def _error(text: str, path: str = "m.kiln") -> TextError:
    with pytest.raises(TextError) as info:
        load_program(path, text).bundle()
    return info.value


HEADER = """model M(d: int = 8, v: int = 16):
  params:
    w: [v, d]
  forward:
    inputs:
      token_ids: [B, T, int32]
    outputs:
      y: [B, T, d]
    graph:
"""


def test_a_syntax_error_is_e001_with_line_column_and_caret() -> None:
    err = _error(HEADER + "      token_ids -> embedding(w) -> -> y\n")
    assert (err.code, err.line, err.column) == ("E001", 10, 36)
    assert err.location == "m.kiln:10:36"
    assert str(err).splitlines()[2:4] == ["          token_ids -> embedding(w) -> -> y", " " * (4 + 35) + "^"]


def test_an_undefined_tensor_is_e002_at_its_name() -> None:
    err = _error(HEADER + "      tokens -> embedding(w) -> y\n")
    assert (err.code, err.line, err.column) == ("E002", 10, 7) and "tokens" in err.message


def test_an_unknown_op_is_e014() -> None:
    err = _error(HEADER + "      token_ids -> embedd(w) -> y\n")
    assert (err.code, err.line, err.column) == ("E014", 10, 20)


def test_a_tensor_defined_twice_is_e017() -> None:
    err = _error(HEADER + "      token_ids -> embedding(w) -> y\n      y -> silu() -> y\n")
    assert (err.code, err.line) == ("E017", 11)


def test_a_tensor_guard_is_e016_and_a_failed_constraint_e027() -> None:
    err = _error(HEADER + "      if w:\n        token_ids -> embedding(w) -> y\n")
    assert (err.code, err.line) == ("E016", 10)
    text = HEADER.replace(
        "  params:", '  let:\n    constraint:\n      d % 3 == 0, "d must divide by 3"\n  params:'
    )
    with pytest.raises(KilnError) as info:
        load_program("m.kiln", text + "      token_ids -> embedding(w) -> y\n").bundle()
    assert info.value.code == "E027" and "d must divide by 3" in str(info.value)


def test_an_unknown_or_malformed_annotation_is_e008() -> None:
    err = _error(HEADER + "      token_ids -> embedding(w) -> y @hookk(AfterEmbedding)\n")
    assert (err.code, err.line, err.column) == ("E008", 10, 39)
    err = _error(HEADER + "      token_ids -> embedding(w) -> y @hook(AfterEmbedding, when=1)\n")
    assert (err.code, err.line) == ("E008", 10) and "when" in err.message


def test_a_parameter_without_default_after_defaults_is_e012() -> None:
    err = _error("model M(a: int = 1, b: int):\n  params:\n    w: [a, b]\n")
    assert (err.code, err.line, err.column) == ("E012", 1, 21)


def test_a_shape_error_in_an_op_is_reported_at_the_text_line() -> None:
    err = _error(
        HEADER + "      token_ids -> embedding(w) -> e\n      (e, e) -> matmul(transpose=NT) -> z\n"
        "      z -> view(shape=[B, T, d]) -> y\n"
    )
    assert err.code == "E004" and err.line == 11 and "matmul" in err.message


def test_kiln_compile_writes_the_ir_of_a_text_file_and_of_a_python_module(tmp_path: Path, capsys) -> None:
    src = tmp_path / "qwen.kiln"
    src.write_text(model_path("qwen3").read_text())
    cfg = json.dumps(TINY)
    assert main(["compile", str(src), "--config", cfg]) == 0
    out = capsys.readouterr().out
    assert "model Qwen3:" in out and "block DenseTransformerBlock:" in out
    written = json.loads((tmp_path / "qwen.json").read_text())
    assert written["entry"] == "Qwen3"
    py = tmp_path / "mine.py"
    py.write_text("from kiln.dsl.stdlib.models import Qwen3Model\n\nclass Unused: pass\n")
    assert (
        main(["compile", str(py), "--model", "Qwen3Model", "--config", cfg, "-o", str(tmp_path / "p.json")])
        == 0
    )
    assert json.loads((tmp_path / "p.json").read_text())["entry"] == "Qwen3Model"
    bad = tmp_path / "bad.kiln"
    bad.write_text("model M(:\n")
    assert main(["compile", str(bad)]) == 2
    assert "E001" in capsys.readouterr().err


def test_kiln_plan_reads_a_text_file(tmp_path: Path, capsys) -> None:
    assert (
        main(
            [
                "plan",
                f"{model_path('qwen3')}:Qwen3",
                "--config",
                json.dumps(TINY),
                "--batch",
                "1",
                "--seq",
                "8",
            ]
        )
        == 0
    )
    assert "DenseTransformerBlock" in capsys.readouterr().out


MLP = """module MyMLP(d: int, f: int):
  params:
    up: [2 * f, d]
    down: [d, f]
  forward:
    in: [B, T, d]
    out: [B, T, d]
    graph:
      in -> view(shape=[B * T, d]) -> x
      (x, up) -> matmul(transpose=NT) -> h
      h -> swiglu() -> a
      (a, down) -> matmul(transpose=NT) -> y
      y -> view(shape=[B, T, d]) -> out
"""


def test_a_file_imports_another_file_beside_it(tmp_path: Path) -> None:
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "mlp.kiln").write_text(MLP)
    (tmp_path / "m.kiln").write_text("""from parts.mlp import MyMLP as FFN

module Net(d: int = 8, f: int = 12):
  params:
    ffn: FFN(d, f)
  forward:
    in: [B, T, d]
    out: [B, T, d]
    graph:
      in -> ffn -> out
""")
    net = load_program(tmp_path / "m.kiln").bundle("Net").module("Net")
    assert [p.name for p in net.params] == ["ffn.up", "ffn.down"]
    assert [str(d) for d in net.param("ffn.up").shape] == ["2 * f", "d"]
    assert net.forward.ops[2].type == "swiglu" and net.forward.ops[2].loc == "m.kiln:10"


def test_import_conflicts_are_e023_and_e024(tmp_path: Path) -> None:
    (tmp_path / "a.kiln").write_text(MLP)
    (tmp_path / "b.kiln").write_text(MLP)
    err = _error("import a.MyMLP\nimport b.MyMLP\n", str(tmp_path / "m.kiln"))
    assert (err.code, err.line, err.column) == ("E023", 2, 10)
    err = _error("import a.MyMLP\n" + MLP, str(tmp_path / "m.kiln"))
    assert (err.code, err.line) == ("E024", 1)
    err = _error("import nowhere.Thing\n", str(tmp_path / "m.kiln"))
    assert (err.code, err.line, err.column) == ("E002", 1, 8)


def test_a_python_dsl_class_is_imported_by_its_module_path() -> None:
    from kiln.dsl.stdlib.blocks import DenseTransformerBlock

    program = load_program(model_path("qwen3"))
    assert program.classes["Qwen3"].blocks.type.element is DenseTransformerBlock


def test_the_guide_lists_every_code_the_frontend_reports() -> None:
    import re

    import kiln.dsl_text

    guide = (Path(__file__).parents[3] / "docs" / "dsl-text.md").read_text()
    source = "".join(p.read_text() for p in Path(kiln.dsl_text.__file__).parent.glob("_*.py"))
    codes = sorted(set(re.findall(r'"([EW]0\d\d)"', source)))
    assert len(codes) >= 15
    assert [c for c in codes if f"| {c} |" not in guide] == []


def test_annotations_reach_the_ir_on_their_parameter_and_tensor() -> None:
    text = """module M(d: int = 4):
  params:
    w: [d, d] @frozen
    v: [d, d] @shard(column)
  forward:
    in: [B, T, d]
    out: [B, T, d]
    graph:
      in -> view(shape=[B * T, d]) -> x
      (x, w) -> matmul(transpose=NT) -> y
        @memory(recompute)
      (y, v) -> matmul(transpose=NT) -> z
      z -> view(shape=[B, T, d]) -> out
"""
    m = load_program("m.kiln", text).bundle().module("M")
    assert [(p.name, p.frozen) for p in m.params] == [("w", True), ("v", False)]
    got = {(a.kind, a.on, a.target, tuple(a.args.items()), a.loc) for a in m.annotations}
    assert got == {
        ("frozen", "param", "w", (), "m.kiln:3"),
        ("shard", "param", "v", (("strategy", "column"),), "m.kiln:4"),
        ("memory", "tensor", "y", (("mode", "recompute"),), "m.kiln:11"),
    }


SEED_LM = """
model SeedLM(vocab_size: int = 64, d_model: int = 16, n_layers: int = 2, num_heads: int = 2,
             num_kv_heads: int = 1, d_ff: int = 24, max_seq: int = 32, eps: float = 1e-5):
  params:
    embedding: [vocab_size, d_model]
    blocks: [n_layers] x DenseTransformerBlock(d_model, num_heads, num_kv_heads, d_ff, max_seq, eps)
    final_norm: [d_model] @init(ones)
  forward:
    inputs:
      token_ids: [B, T]
      targets: [B, T]
    out: [B * T]
    graph:
      token_ids -> embedding(embedding) -> x0
      zeros([B, T, d_model]) -> residual0
      (x0, residual0) -> StackedBlocks(blocks, n_layers) -> (xN, residualN)
      (residualN, xN) -> fused_residual_rmsnorm(final_norm, eps) -> (_, xF)
      xF -> view(shape=[B * T, d_model]) -> xF_flat
      (xF_flat, embedding, targets) -> fused_lm_head_loss() -> out
"""


def test_a_model_of_the_text_standard_library_trains_the_same_with_every_recompute_mode() -> None:
    import numpy as np

    bundle = load_program("lm.kiln", SEED_LM).bundle()
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 64, size=(2, 8))
    batches = [{"input_ids": ids, "labels": np.roll(ids, -1, axis=1)}] * 4  # one batch, learnt
    losses = {}
    for mode in ("none", "dsl", "block", "auto"):
        model = Model.from_ir(bundle, seed=0, recompute=mode)
        losses[mode] = [model.train_step(b)["loss"] for b in batches]
    assert losses["none"][-1] < losses["none"][0]  # it trains
    assert all(losses[m] == losses["none"] for m in losses), losses  # bit for bit


def test_a_bad_dedent_and_a_bad_string_are_e001_at_their_place() -> None:
    err = _error("model M(d: int = 4):\n  params:\n      w: [d]\n    v: [d]\n")
    assert (err.code, err.line, err.column) == ("E001", 4, 5)
    err = _error('model M(a: string = "\\x"):\n  params:\n    w: [1]\n')
    assert (err.code, err.line, err.column) == ("E001", 1, 21) and "string" in err.message


def test_array_syntax_and_runs_of_a_stack() -> None:
    text = """block Blk(d: int = 4):
  params:
    w: [d] @init(ones)
  forward:
    inputs:
      x: [B, T, d]
      r: [B, T, d]
    outputs:
      y: [B, T, d]
      r2: [B, T, d]
    graph:
      (r, x) -> fused_residual_rmsnorm(w) -> (r2, y)

model M(n: int = 2, d: int = 4, v: int = 8):
  params:
    e: [v, d]
    blocks: Array<n, Blk(d)>
  forward:
    inputs:
      token_ids: [B, T]
      targets: [B, T]
    out: [B * T]
    graph:
      token_ids -> embedding(e) -> x
      zeros([B, T, d]) -> r
      (x, r) -> StackedBlocks(blocks, 1) -> (x1, r1)
      (x1, r1) -> StackedBlocks(blocks, 1, first=1) -> (x2, r2)
      x2 -> view(shape=[B * T, d]) -> f
      (f, e, targets) -> fused_lm_head_loss() -> out
"""
    model = load_program("a.kiln", text).bundle().module("M")
    calls = [op for op in model.forward.ops if op.type == "call"]
    assert [(c.attrs["n_layers"], c.attrs.get("first", 0)) for c in calls] == [(1, 0), (1, 1)]
    assert str(model.param("blocks").count) == "2" and model.param("blocks").array_of == "Blk"


def test_block_arguments_reach_the_blocks_by_position_and_must_agree_with_the_model() -> None:
    text = SEED_LM.replace("num_heads: int = 2", "heads: int = 2").replace(
        "DenseTransformerBlock(d_model, num_heads,", "DenseTransformerBlock(d_model, heads,"
    )
    block = load_program("lm.kiln", text).bundle().module("DenseTransformerBlock")
    assert block.config["num_heads"] == 2  # the model's `heads`, passed in the block's num_heads slot
    clash = SEED_LM.replace("DenseTransformerBlock(d_model, num_heads,", "DenseTransformerBlock(d_model, 4,")
    with pytest.raises(TextError) as info:
        load_program("lm.kiln", clash).bundle()
    assert info.value.code == "E003" and "num_heads" in info.value.message and info.value.line == 6


HYBRID = """block Norm(d: int = 4):
  params:
    w: [d] @init(ones)
  forward:
    inputs:
      x: [B, T, d]
      r: [B, T, d]
    outputs:
      y: [B, T, d]
      r2: [B, T, d]
    graph:
      (r, x) -> fused_residual_rmsnorm(w) -> (r2, y)

block Mix(d: int = 4):
  params:
    w: [d] @init(ones)
    m: [d, d]
  forward:
    inputs:
      x: [B, T, d]
      r: [B, T, d]
    outputs:
      y: [B, T, d]
      r2: [B, T, d]
    graph:
      (r, x) -> fused_residual_rmsnorm(w) -> (r2, h)
      h -> Linear(m) -> h2
      h2 -> silu() -> y

model M(d: int = 4, v: int = 8, interleave: bool = true):
  params:
    e: [v, d]
    norms: [2] x Norm(d)
    mixes: [1] x Mix(d)
  forward:
    inputs:
      token_ids: [B, T]
      targets: [B, T]
    out: [B * T]
    graph:
      token_ids -> embedding(e) -> x
      zeros([B, T, d]) -> r
      if interleave:
        (x, r) -> StackedBlocks(norms, 1) -> (x1, r1)
        (x1, r1) -> StackedBlocks(mixes, 1) -> (x2, r2)
        (x2, r2) -> StackedBlocks(norms, 1, first=1) -> (x3, r3)
      else:
        (x, r) -> StackedBlocks(norms, 2) -> (x2, r2)
        (x2, r2) -> StackedBlocks(mixes, 1) -> (x3, r3)
      x3 -> view(shape=[B * T, d]) -> f
      (f, e, targets) -> fused_lm_head_loss() -> out
"""


@pytest.mark.parametrize(
    ("interleave", "runs"),
    [
        (True, [("Norm", "norms", 1, 0), ("Mix", "mixes", 1, 0), ("Norm", "norms", 1, 1)]),
        (False, [("Norm", "norms", 2, 0), ("Mix", "mixes", 1, 0)]),
    ],
)
def test_layers_of_two_kinds_run_in_the_layout_the_text_fixes(interleave: bool, runs: list) -> None:
    """No loop in the seed's grammar: a hybrid layout is runs of stacks, an `if` picks one; both train
    bit for bit with and without recompute."""
    bundle = load_program("h.kiln", HYBRID).bundle("M", {"interleave": interleave})
    calls = [op for op in bundle.module("M").forward.ops if op.type == "call"]
    got = [(c.attrs["module"], c.attrs["params"], c.attrs["n_layers"], c.attrs.get("first", 0))
           for c in calls]
    assert got == runs
    ids = np.random.default_rng(0).integers(0, 8, size=(2, 4)).astype(np.int32)
    batch = {"input_ids": ids, "labels": np.roll(ids, -1, axis=1)}
    losses = {}
    for mode in ("none", "dsl", "block"):
        model = Model.from_ir(bundle, seed=0, recompute=mode)
        losses[mode] = [model.train_step(batch)["loss"] for _ in range(3)]
    assert losses["none"][-1] < losses["none"][0]
    assert all(losses[m] == losses["none"] for m in losses), losses
