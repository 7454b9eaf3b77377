"""Random token streams and random mutations of valid programs give diagnostics (KilnError), never a
Python traceback: 2,000 inputs in all."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.core import KilnError
from kiln.dsl_text import load_program, model_path

VALID = model_path("qwen3").read_text()
SMALL = """model M(d: int = 8, v: int = 16, flag: bool = true):
  let:
    h = d // 2
  params:
    w: [v, d]
    b: [d] if flag
  forward:
    inputs:
      token_ids: [B, T, int32]
    outputs:
      y: [B, T, d]
    graph:
      token_ids -> embedding(w) -> e
      if flag:
        e -> silu() -> y
      else:
        e -> y
"""
#: words of the syntax, and characters that strings, docstrings and indentation are made of
WORDS = """model block module params forward graph inputs outputs let if else import from as
    : -> ( ) [ ] , = @ x × ? * // ** ... w y B T int fp32 0 1.5 1e999 99999999999999999999
    embedding StackedBlocks None true - + { } . saved in out"""
TOKENS = [*WORDS.split(), "\n", "\n  ", "\n    ", "  ", "\t", '"s"', '"""d"""', '"""', "#c", '"\\x"', "\\"]
CHARACTERS = "az09_:()[]{},.=@#\"'\\\n\t ->*/%+?×é\x00$`!<>|"
CONFIG = {
    "vocab_size": 32,
    "d_model": 8,
    "n_layers": 1,
    "num_query_heads": 2,
    "num_kv_heads": 1,
    "d_ff": 8,
    "max_seq": 8,
    "head_size": 4,
}


def _compile(text: str) -> None:
    try:
        program = load_program("fuzz.kiln", text)
        for name in program.models():
            program.bundle(name, CONFIG if "Qwen3" in name else None)
    except KilnError as exc:
        assert exc.code, exc  # a diagnostic carries its code
        # and points at the text (or at nothing, for a file-level error), never at kiln's own source
        assert exc.location is None or exc.location.startswith("fuzz.kiln:"), exc


FAST = settings(
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
    derandomize=True,
)


@FAST
@given(st.lists(st.sampled_from(TOKENS), max_size=40).map(" ".join))
def test_random_token_streams_give_diagnostics(text: str) -> None:
    _compile(text)


@FAST
@given(
    st.sampled_from([VALID, SMALL, SMALL, SMALL]),
    st.lists(st.tuples(st.floats(0, 1), st.integers(0, 4), st.sampled_from(TOKENS)), min_size=1, max_size=3),
)
def test_mutated_programs_give_diagnostics(base: str, edits: list) -> None:
    text = base
    for where, kind, token in edits:
        i = int(where * len(text))
        if kind == 0:
            text = text[:i] + text[i + 1 :]  # delete a character
        elif kind == 1:
            text = text[:i] + token + text[i:]  # insert a token
        elif kind == 2:
            j = text.find("\n", i)
            text = text[:i] + text[j if j >= 0 else len(text) :]  # cut the rest of a line
        elif kind == 3:
            text = text[:i] + " " + text[i:]  # shift an indentation
        else:
            text = text[:i] + CHARACTERS[int(where * 9973) % len(CHARACTERS)] + text[i:]  # any character
    _compile(text)
