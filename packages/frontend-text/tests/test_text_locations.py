"""Diagnostics that kiln-dsl raises while compiling a text file point at the text (file:line:column
and a caret), not at the line of kiln's lowerer that made the kiln-dsl class: constraints (E026,
E027), hf_mapping entries (E010), parameter types (E002), a tie's condition."""

import pytest

from kiln.core import KilnError
from kiln.dsl_text import TextError, load_program, model_path

QWEN3 = model_path("qwen3").read_text()
CONFIG = {"vocab_size": 32, "d_model": 8, "n_layers": 1, "num_query_heads": 2, "num_kv_heads": 1, "d_ff": 8,
          "max_seq": 8, "head_size": 4}


def _error(text: str, config: dict = CONFIG) -> TextError:
    with pytest.raises(KilnError) as info:
        load_program("q.kiln", text).bundle(None, config)
    assert isinstance(info.value, TextError), info.value
    return info.value


def _place(text: str, needle: str) -> tuple[int, int]:
    """(line, column) of the first character of ``needle`` in ``text``, 1-based."""
    before = text[: text.index(needle)]
    return before.count("\n") + 1, len(before) - before.rfind("\n")


def test_a_constraint_naming_an_unknown_value_is_e026_at_the_constraint() -> None:
    text = QWEN3.replace("num_query_heads % num_kv_heads == 0", "num_query_heads % num_kv_hads == 0", 1)
    err = _error(text)
    assert err.code == "E026" and "num_kv_hads" in err.message
    assert (err.path, err.line, err.column) == ("q.kiln", *_place(text, "num_query_heads % num_kv_hads"))


def test_a_failed_constraint_is_e027_at_the_constraint() -> None:
    err = _error(QWEN3, {**CONFIG, "num_kv_heads": 3})
    assert err.code == "E027" and "multiple of num_kv_heads" in err.message
    assert (err.line, err.column) == _place(QWEN3, "num_query_heads % num_kv_heads == 0")


@pytest.mark.parametrize(("old", "new", "at"), [
    ('    final_norm: "model.norm.weight"', '    final_nrm: "model.norm.weight"', "final_nrm:"),
    ("    blocks[{layer}].out_weight:", "    blocks[{layer}].out_weigt:", "blocks[{layer}].out_weigt"),
])
def test_a_mapping_of_no_parameter_is_e010_at_its_entry(old: str, new: str, at: str) -> None:
    text = QWEN3.replace(old, new, 1)
    assert text != QWEN3
    err = _error(text)
    assert err.code == "E010"
    assert (err.line, err.column) == _place(text, at)


def test_a_tie_condition_naming_nothing_is_e002_at_the_condition() -> None:
    text = QWEN3.replace("  tie_word_embeddings: bool", "  tie_embeddings: bool", 1)
    err = _error(text)
    assert err.code == "E002" and "tie_word_embeddings" in err.message
    assert (err.line, err.column) == _place(text, "tie_word_embeddings)")


def test_a_parameter_dimension_kiln_dsl_rejects_is_at_the_parameter() -> None:
    """kiln-dsl's own check of a parameter's type: an int parameter whose default is a float is no
    dimension."""
    text = """model M(d: int = 8, v: int = 1.5):
  params:
    w: [v, d]
  forward:
    inputs:
      token_ids: [B, T]
    outputs:
      y: [B, T, d]
    graph:
      token_ids -> embedding(w) -> y
"""
    with pytest.raises(TextError) as info:
        load_program("m.kiln", text).bundle("M")
    assert info.value.code == "E002" and "'v'" in info.value.message
    assert (info.value.line, info.value.column) == _place(text, "w: [v, d]")


def test_an_output_whose_shape_differs_from_its_declaration_is_e004_at_the_forward_section() -> None:
    """kiln-dsl checks a forward's outputs against their declared types in the method the lowerer
    generates; the error points at the model's forward section (it pointed at kiln's lowerer)."""
    text = """model M(d: int = 8, v: int = 16):
  params:
    w: [v, d]
  forward:
    inputs:
      token_ids: [T, int32]
    outputs:
      y: [B, T, d]
    graph:
      token_ids -> embedding(w) -> e
      e -> silu() -> y
"""
    with pytest.raises(KilnError) as info:
        load_program("m.kiln", text).bundle("M", None)
    err = info.value
    assert err.code == "E004" and "annotated [B, T, d]" in err.message, err
    assert err.location is not None and err.location.startswith(f"m.kiln:{_place(text, 'forward:')[0]}"), err
