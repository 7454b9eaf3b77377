"""Chat and completion samples against transformers: on a tiny tokenizer made here, the text, token ids
and loss masks kiln makes equal those of transformers' tokenizer and ``apply_chat_template`` (its
``assistant_masks`` where the template marks ``{% generation %}``), for kiln's built-in templates
and for templates in the styles of published checkpoints (special-token variables, ``tojson``,
``namespace``, ``raise_exception``, whitespace control); a template read from a folder transformers
saved renders the same; and the tokenizer folder ``kiln train`` writes gives transformers the same
samples."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.parity
transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

from tokenizers import processors  # noqa: E402

from kiln.hf import (  # noqa: E402
    BUILTIN_TEMPLATES,
    EOS_TOKEN,
    ChatTemplate,
    SampleDataset,
    load_tokenizer,
    train,
    train_bpe_tokenizer,
)
from kiln.hf._chat import checkpoint_template, special_tokens, tokenizer_config  # noqa: E402
from kiln.hf._samples import Record, encode  # noqa: E402

SPECIALS = [EOS_TOKEN, "<s>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>"]

#: in the style of Llama 3's template, with the generation block TRL's training templates add
LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = "You are a helpful assistant." %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system + '<|eot_id|>' }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {%- if message['role'] == 'assistant' %}
        {%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}
    {%- else %}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

#: Zephyr's published template (one tag a line: trim_blocks matters), with a generation block
ZEPHYR_HUB = """{% for message in messages %}
{% if message['role'] == 'user' %}
{{ '<|user|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'system' %}
{{ '<|system|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\n' }}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}

{% endif %}
{% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}
{% endfor %}"""

#: answers glued to the text around them, so that tokens straddle the span boundaries
GLUED = ("{% for m in messages %}{% if m['role'] == 'assistant' %}ans{% generation %}{{ m['content'] }}"
         "{% endgeneration %}ed{% else %}{{ m['content'] }}{% endif %}{% endfor %}")

#: Qwen-style, with a namespace, tojson of extra fields, and loop controls; no generation block
QWEN = """{%- set ns = namespace(last_user=0) %}
{%- for message in messages %}
{%- if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}
{%- endfor %}
{{- '' if ns.last_user >= 0 else raise_exception('unreachable') }}
{%- for message in messages %}
{%- if message.role == 'tool' %}{% continue %}{% endif %}
{{- '<|im_start|>' + message.role + '\\n' + message.content }}
{%- if message.meta is defined %}{{ ' ' + message.meta | tojson }}{% endif %}
{{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"""


def conversations(n: int) -> list[list[dict[str, Any]]]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        chat = [{"role": "user", "content": f" What is {a} + {b}? "},
                {"role": "assistant", "content": f"wer: {a} + {b} = {a + b}, answ"}]
        if i % 2:
            chat.insert(0, {"role": "system", "content": "Be brief; use digits."})
        if i % 3 == 0:
            chat += [{"role": "user", "content": "Ünïcode? 日本"},
                     {"role": "assistant", "content": "Yes: 日本."}]
        out.append(chat)
    return out


@pytest.fixture(scope="module")
def tokenizers_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """A byte-level BPE tokenizer that adds a BOS (as Llama's), and transformers' view of it."""
    folder = tmp_path_factory.mktemp("tok")
    text = "\n".join(m["content"] for chat in conversations(40) for m in chat)
    (folder / "t.txt").write_text(text * 3 + " answered answer" * 50, encoding="utf-8")
    tok = train_bpe_tokenizer([folder / "t.txt"], 400, special_tokens=SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token=EOS_TOKEN)
    return tok, hf


@pytest.mark.parametrize("name", ["chatml", "zephyr", "llama3", "zephyr-hub", "glued"])
def test_ids_and_assistant_masks_equal_apply_chat_template(tokenizers_pair: tuple[Any, Any],
                                                           name: str) -> None:
    tok, hf = tokenizers_pair
    source = {"llama3": LLAMA3, "zephyr-hub": ZEPHYR_HUB, "glued": GLUED}.get(name) or BUILTIN_TEMPLATES[name]
    template = ChatTemplate(source, specials=hf.special_tokens_map)
    straddling = 0
    for chat in conversations(6):
        out = hf.apply_chat_template(chat, chat_template=source, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        ids, mask = encode(Record(Path("x"), 1, messages=tuple(chat)), tok, 0, template)
        assert ids.tolist() == list(out["input_ids"])
        assert mask.astype(int).tolist() == list(out["assistant_masks"])
        assert sum(out["assistant_masks"]) > 0
        text, spans = template.render(chat)
        offsets = tok.encode(text, add_special_tokens=False).offsets
        straddling += sum(a < edge < b for a, b in offsets for span in spans for edge in span)
        assert template.render(chat, add_generation_prompt=True)[0] == hf.apply_chat_template(
            chat, chat_template=source, tokenize=False, add_generation_prompt=True)
    assert straddling or name != "glued"  # the overlap rule is exercised


def test_a_template_without_generation_masks_what_each_answer_adds(tokenizers_pair: tuple[Any, Any]) -> None:
    """The ids are apply_chat_template's; the mask is transformers' for the same template with a
    generation block around each answer and its end of turn."""
    tok, hf = tokenizers_pair
    meta = "{%- if message.meta is defined %}{{ ' ' + message.meta | tojson }}{% endif %}\n"
    marked = QWEN.replace(meta, "", 1).replace(
        "{{- '<|im_start|>' + message.role + '\\n' + message.content }}",
        "{{- '<|im_start|>' + message.role + '\\n' }}{% if message.role == 'assistant' %}"
        "{% generation %}{{ message.content }}" + meta.strip() + "{{ '<|im_end|>\\n' }}{% endgeneration %}"
        "{% else %}{{ message.content }}")
    marked = marked.replace("{{- '<|im_end|>\\n' }}", "{{- '<|im_end|>\\n' }}{% endif %}")
    template = ChatTemplate(QWEN, specials=hf.special_tokens_map)
    assert not template.marks_generation
    for chat in conversations(6):
        chat = [*chat, {"role": "tool", "content": "ignored"}]
        chat[-2] = {**chat[-2], "meta": {"ok": True, "note": "ü<"}}
        out = hf.apply_chat_template(chat, chat_template=QWEN, tokenize=True, return_dict=True)
        ids, mask = encode(Record(Path("x"), 1, messages=tuple(chat)), tok, 0, template)
        assert ids.tolist() == list(out["input_ids"])
        reference = hf.apply_chat_template(chat, chat_template=marked, tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)
        assert list(reference["input_ids"]) == ids.tolist()
        assert mask.astype(int).tolist() == list(reference["assistant_masks"])


def test_completion_ids_equal_the_tokenizers(tokenizers_pair: tuple[Any, Any]) -> None:
    tok, hf = tokenizers_pair
    record = Record(Path("x"), 1, prompt="What is 12 + 30?", completion=" 42.")
    ids, mask = encode(record, tok, hf.eos_token_id, None)
    prompt = hf(record.prompt)["input_ids"]
    assert prompt[0] == hf.bos_token_id
    expected = prompt + hf(record.completion, add_special_tokens=False)["input_ids"] + [hf.eos_token_id]
    assert ids.tolist() == expected and mask.tolist() == [i >= len(prompt) for i in range(len(expected))]


def test_a_template_transformers_saved_renders_the_same(tokenizers_pair: tuple[Any, Any],
                                                        tmp_path: Path) -> None:
    _, hf = tokenizers_pair
    hf.chat_template = LLAMA3
    hf.save_pretrained(tmp_path)
    source = checkpoint_template(tmp_path)
    assert source is not None
    template = ChatTemplate(source, specials=special_tokens(tokenizer_config(tmp_path)))
    again = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for chat in conversations(3):
        assert template.render(chat)[0] == again.apply_chat_template(chat, tokenize=False)


def test_the_tokenizer_kiln_train_saves_gives_transformers_the_same_samples(tmp_path: Path) -> None:
    rows = [{"messages": chat} for chat in conversations(40)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (tmp_path / "run.toml").write_text(
        '[model]\nname = "Qwen3Model"\nconfig = { n_layers = 1, d_model = 32, d_ff = 64, '
        'num_query_heads = 2, num_kv_heads = 1, head_size = 16 }\n[data]\nfiles = ["chat.jsonl"]\n'
        'format = "chat"\nchat_template = "chatml"\nvocab_size = 320\n[train]\nsteps = 1\nbatch_size = 2\n'
        'seq_len = 128\neval_every = 0\neval_batches = 1\n', encoding="utf-8")
    summary = train(tmp_path / "run.toml", stream=open(tmp_path / "log.txt", "w"))  # noqa: SIM115
    hf = transformers.AutoTokenizer.from_pretrained(summary["model"])
    ds = SampleDataset(tmp_path / "chat.jsonl", load_tokenizer(summary["model"]), format="chat", seq_len=128,
                       batch_size=1, template=ChatTemplate(BUILTIN_TEMPLATES["chatml"],
                                                           specials={"eos_token": EOS_TOKEN}))
    for (record, ids, mask), row in zip(ds.samples, rows, strict=True):
        out = hf.apply_chat_template(row["messages"], tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        assert ids.tolist() == list(out["input_ids"]), record.line
        assert np.asarray(mask, int).tolist() == list(out["assistant_masks"]), record.line
