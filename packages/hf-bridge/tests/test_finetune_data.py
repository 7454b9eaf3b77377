"""Instruction and chat data without transformers: records read and checked (JSONL and Parquet, every
format, mapped fields and roles), loss masks, packed batches equal to the same samples unpacked
(loss and gradients of a kiln model), errors naming file, line and field, ``kiln train`` and
``kiln data`` on chat data, TensorBoard files read back by TensorBoard's own reader."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tokenizers

from kiln.core import Model
from kiln.core.cli import main
from kiln.dsl import build_bundle
from kiln.hf import (
    BUILTIN_TEMPLATES,
    EOS_TOKEN,
    IGNORE_INDEX,
    ChatTemplate,
    DataError,
    RecordError,
    SampleDataset,
    TrainConfigError,
    load_train_config,
    read_records,
    train,
    train_bpe_tokenizer,
)
from kiln.hf._preview import MASK_CLOSE, MASK_OPEN, preview
from kiln.hf._samples import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT, Record, encode

SPECIALS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
CHATML = ChatTemplate(BUILTIN_TEMPLATES["chatml"], specials={"eos_token": EOS_TOKEN})


def chats(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        messages = [{"role": "user", "content": f"What is {a} plus {b}?"},
                    {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]
        if i % 3 == 0:
            messages.insert(0, {"role": "system", "content": "Answer briefly."})
        if i % 4 == 0:
            messages += [{"role": "user", "content": "And doubled?"},
                         {"role": "assistant", "content": f"Doubled, it is {2 * (a + b)}."}]
        out.append({"messages": messages})
    return out


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tokenizers.Tokenizer:
    folder = tmp_path_factory.mktemp("tok")
    text = "\n".join(CHATML.render(c["messages"])[0] for c in chats(60)) + " Below is an instruction"
    (folder / "t.txt").write_text(text, encoding="utf-8")
    return train_bpe_tokenizer([folder / "t.txt"], 320, special_tokens=SPECIALS)


def test_records_of_every_format_with_mapped_fields_and_roles(tmp_path: Path) -> None:
    completion = write_jsonl(tmp_path / "c.jsonl", [{"q": "2+2=", "a": " 4"}, {"q": "", "a": "hello"}])
    records = read_records(completion, "completion", fields={"prompt": "q", "completion": "a"})
    assert [(r.prompt, r.completion, r.line) for r in records] == [("2+2=", " 4", 1), ("", "hello", 2)]

    alpaca = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "Add.", "input": "2 and 3", "output": "5"},
                                                {"instruction": "Say hi.", "output": "Hi."}])
    first, second = read_records(alpaca, "alpaca")
    assert first.prompt == ALPACA_PROMPT.format(instruction="Add.", input="2 and 3")
    assert second.prompt == ALPACA_PROMPT_NO_INPUT.format(instruction="Say hi.")
    assert second.completion == "Hi."

    sharegpt = tmp_path / "s.jsonl"  # blank lines are skipped, line numbers stay the file's
    sharegpt.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"},
                                                      {"from": "gpt", "value": "hello", "weight": None}]})
                        + "\n\n" + json.dumps({"conversations": [{"from": "gpt", "value": "x"}]}) + "\n")
    fields = {"messages": "conversations", "role": "from", "content": "value"}
    records = read_records(sharegpt, "chat", fields=fields, roles={"human": "user", "gpt": "assistant"})
    assert records[0].messages == ({"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": "hello"})
    assert records[1].line == 3


def test_parquet_files_give_the_records_of_the_same_jsonl(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = chats(7)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet", row_group_size=3)
    from_parquet = read_records(tmp_path / "c.parquet", "chat")
    from_jsonl = read_records(write_jsonl(tmp_path / "c.jsonl", rows), "chat")
    assert [r.messages for r in from_parquet] == [r.messages for r in from_jsonl]
    assert [r.line for r in from_parquet] == list(range(1, 8))

    bad = [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": None}]
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "bad.parquet")
    with pytest.raises(RecordError, match=r"bad\.parquet: row 2: field 'completion': is missing") as info:
        read_records(tmp_path / "bad.parquet", "completion")
    assert (info.value.line, info.value.field) == (2, "completion")


@pytest.mark.parametrize(("rows", "fmt", "line", "field", "text"), [
    (['{"prompt": "a", "completion": "b"}', '{"prompt": "a", "completion": "b"'], "completion", 2, None,
     "not valid JSON"),
    (['{"prompt": "a"}'], "completion", 1, "completion", "is missing"),
    (['{"prompt": 3, "completion": "b"}'], "completion", 1, "prompt", "expected a string, found int"),
    (['{"prompt": "a", "completion": ""}'], "completion", 1, "completion", "nothing to train on"),
    (['{"instruction": "a", "input": 1, "output": "b"}'], "alpaca", 1, "input", "expected a string"),
    (['[1, 2]'], "alpaca", 1, None, "expected a JSON object, found list"),
    (['{"messages": []}'], "chat", 1, "messages", "expected a non-empty list"),
    (['{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}'], "chat", 1,
     "messages[1].role", "'bot' is not one of"),
    (['{"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]}'], "chat", 1,
     "messages[1].content", "is missing"),
    (['{"messages": [{"role": "user", "content": "a"}]}'], "chat", 1, "messages", "no assistant message"),
    (['{"messages": ["hi"]}'], "chat", 1, "messages[0]", "expected an object"),
])
def test_a_bad_record_names_its_file_line_and_field(tmp_path: Path, rows: list[str], fmt: str, line: int,
                                                     field: str | None, text: str) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    with pytest.raises(RecordError) as info:
        read_records(path, fmt)
    e = info.value
    assert (e.file, e.line, e.field) == (str(path), line, field)
    where = f"{path}: line {line}: " + (f"field {field!r}: " if field else "")
    assert str(e).startswith(where) and text in str(e), str(e)


def test_completion_ids_and_mask(tokenizer: tokenizers.Tokenizer, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "What is 2 plus 2?", "completion": " 4."}])
    record = read_records(path, "completion")[0]
    eos = tokenizer.token_to_id(EOS_TOKEN)
    ids, mask = encode(record, tokenizer, eos, None)
    prompt = tokenizer.encode("What is 2 plus 2?").ids
    completion = tokenizer.encode(" 4.", add_special_tokens=False).ids
    assert ids.tolist() == [*prompt, *completion, eos]
    assert mask.tolist() == [False] * len(prompt) + [True] * (len(completion) + 1)
    assert encode(record, tokenizer, eos, None, train_on_prompt=True)[1].all()


def test_chat_masks_cover_the_assistants_text(tokenizer: tokenizers.Tokenizer) -> None:
    messages = chats(1)[0]["messages"]  # system, user, assistant, user, assistant
    text, spans = CHATML.render(messages)
    assert [text[a:b] for a, b in spans] == [m["content"] + "<|im_end|>" for m in messages
                                            if m["role"] == "assistant"]
    record = Record(Path("x"), 1, messages=tuple(messages))
    ids, mask = encode(record, tokenizer, 0, CHATML)
    assert ids.tolist() == tokenizer.encode(text, add_special_tokens=False).ids
    trained = tokenizer.decode(ids[mask].tolist(), skip_special_tokens=False)
    assert trained == "".join(text[a:b] for a, b in spans)

    # a template without {% generation %}: what each assistant message adds after the generation prompt
    plain = ChatTemplate(BUILTIN_TEMPLATES["chatml"].replace("{% generation %}", "").replace(
        "{% endgeneration %}", ""))
    text2, spans2 = plain.trained_spans(messages)
    assert text2 == text and [text[a:b] for a, b in spans2] == [text[a:b] + "\n" for a, b in spans]
    unsplittable = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                                "{% if add_generation_prompt %}>{% endif %}")
    with pytest.raises(DataError, match="cannot be told apart"):
        unsplittable.trained_spans(messages)


def test_templates_see_what_transformers_gives_them() -> None:
    template = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('roles are user and assistant') }}{% endif %}"
        "{% set ns = namespace(n=loop.index) %}{{ ns.n }}:{{ m | tojson }}"
        "{% if loop.last %}{% break %}{% endif %}\n{% endfor %}", specials={"bos_token": "<s>"})
    messages = [{"role": "user", "content": "é<b>"}, {"role": "assistant", "content": "x"}]
    # tojson escapes no HTML nor non-ASCII; trim_blocks drops the newline after a block tag
    assert template.render(messages)[0] == ('<s>1:{"role": "user", "content": "é<b>"}'
                                            '2:{"role": "assistant", "content": "x"}')
    with pytest.raises(DataError, match="roles are user and assistant"):
        template.render([{"role": "system", "content": "s"}])
    with pytest.raises(DataError, match="not a valid jinja2 template"):
        ChatTemplate("{% for m in messages %}")
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(Exception, match=r"unsafe|not safely"):
        sandboxed.render(messages)


def test_long_samples_are_truncated_or_dropped_and_counted(tokenizer: tokenizers.Tokenizer,
                                                           tmp_path: Path) -> None:
    rows = [{"prompt": "Q: " + "word " * n, "completion": " answer"} for n in (2, 40, 3, 60)]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    lengths = [len(encode(r, tokenizer, 0, None)[0]) for r in read_records(path, "completion")]
    seq = 32
    assert lengths[0] < seq < min(lengths[1], lengths[3])
    cut = SampleDataset(path, tokenizer, format="completion", seq_len=seq, batch_size=1)
    # a long sample cut inside its prompt has nothing left to train on: dropped
    assert (cut.stats["truncated"], cut.stats["dropped_untrained"], cut.stats["samples"]) == (2, 2, 2)
    assert all(len(ids) <= seq for _, ids, _ in cut.samples)
    on_prompt = SampleDataset(path, tokenizer, format="completion", seq_len=seq, batch_size=1,
                              train_on_prompt=True)
    assert (on_prompt.stats["truncated"], on_prompt.stats["samples"]) == (2, 4)
    dropped = SampleDataset(path, tokenizer, format="completion", seq_len=seq, batch_size=1, too_long="drop")
    assert (dropped.stats["dropped_too_long"], dropped.stats["samples"]) == (2, 2)


def test_rows_hold_shifted_labels_and_restarting_positions(tokenizer: tokenizers.Tokenizer,
                                                           tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", chats(20))
    ds = SampleDataset(path, tokenizer, format="chat", template=CHATML, seq_len=96, batch_size=4,
                       shuffle=False)
    seen = 0
    for batch in ds:
        for row in range(len(batch["input_ids"])):
            ids, labels, pos = (batch[k][row] for k in ("input_ids", "labels", "position_ids"))
            starts = [*np.flatnonzero(pos == 0).tolist(), len(pos)]
            for a, b in itertools.pairwise(starts):
                matches = [s for s in ds.samples if len(s[1]) == b - a and (s[1] == ids[a:b]).all()]
                if not matches:  # the padding after the last sample
                    assert (labels[a:b] == IGNORE_INDEX).all() and b == len(pos)
                    continue
                _, sample, mask = matches[0]
                expected = np.where(mask[1:], sample[1:], IGNORE_INDEX)
                assert labels[a:b - 1].tolist() == expected.tolist() and labels[b - 1] == IGNORE_INDEX
                seen += 1
    assert seen == len(ds.samples) == 20
    assert ds.efficiency > 0.8


def test_a_packed_batch_trains_as_its_samples_unpacked(tokenizer: tokenizers.Tokenizer,
                                                       tmp_path: Path) -> None:
    """Same loss and gradients, in float64: the positions keep the samples apart and the loss is the
    mean over the same trained tokens."""
    path = write_jsonl(tmp_path / "chat.jsonl", chats(9, seed=3))
    kw = {"format": "chat", "template": CHATML, "seq_len": 128, "shuffle": False}
    unpacked = SampleDataset(path, tokenizer, packing=False, batch_size=9, **kw)
    packed = SampleDataset(path, tokenizer, batch_size=9, **kw)
    assert packed.num_sequences < unpacked.num_sequences == 9
    model = Model(build_bundle("Qwen3Model", {"vocab_size": 320, "d_model": 16, "n_layers": 2,
                                              "num_query_heads": 2, "num_kv_heads": 1, "head_size": 8,
                                              "d_ff": 24, "max_seq": 128}), seed=0, dtype="float64")
    one = next(iter(unpacked))
    many = next(iter(packed))
    assert "position_ids" not in one and len(many["input_ids"]) == packed.num_sequences
    loss_u, grads_u = model.loss_and_grads(one["input_ids"], one["labels"])
    loss_p, grads_p = model.loss_and_grads(many["input_ids"], many["labels"],
                                           position_ids=many["position_ids"])
    assert np.count_nonzero(one["labels"] != IGNORE_INDEX) == np.count_nonzero(many["labels"] != IGNORE_INDEX)
    np.testing.assert_allclose(loss_p, loss_u, rtol=1e-12)
    for name, grad in grads_u.items():
        np.testing.assert_allclose(grads_p[name], grad, rtol=1e-9, atol=1e-13, err_msg=name)
    # without the positions, the samples of a row would see each other: the loss differs
    assert abs(model.loss(many["input_ids"], many["labels"]) - loss_u) > 1e-6


def test_validation_split_and_resume(tokenizer: tokenizers.Tokenizer, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", chats(40))
    kw = {"format": "chat", "template": CHATML, "seq_len": 64, "batch_size": 3, "validation_fraction": 0.25}
    ds = SampleDataset(path, tokenizer, **kw)
    val = ds.validation()
    rows = lambda d: {i for r in d._layout[d._first:d._first + d._count] for i in r}  # noqa: E731
    assert rows(ds).isdisjoint(rows(val)) and rows(ds) | rows(val) == set(range(40))
    assert rows(val) == set(range(30, 40))
    first = [b["input_ids"] for _, b in zip(range(len(ds) + 2), _forever(ds), strict=False)]
    again = SampleDataset(path, tokenizer, **kw)
    it = _forever(again)
    for _ in range(2):
        next(it)
    resumed = SampleDataset(path, tokenizer, **kw)
    resumed.load_state(again.state())
    rest = [b["input_ids"] for _, b in zip(range(len(ds)), _forever(resumed), strict=False)]
    for a, b in zip(first[2:], rest, strict=True):
        np.testing.assert_array_equal(a, b)
    other = SampleDataset(path, tokenizer, **{**kw, "seq_len": 80})
    with pytest.raises(DataError, match="other files, tokenizer or settings"):
        other.load_state(ds.state())


def _forever(ds: SampleDataset) -> Any:
    while True:
        yield from ds


BASE = """
[model]
name = "Qwen3Model"
config = {{ n_layers = 1, d_model = 32, d_ff = 64, num_query_heads = 2, num_kv_heads = 1, head_size = 16 }}
[data]
files = ["chat.jsonl"]
format = "chat"
chat_template = "chatml"
vocab_size = 300
{data}
[train]
steps = 4
batch_size = 4
seq_len = 96
eval_every = 2
eval_batches = 2
checkpoint_every = 2
{train}
"""


def project(tmp_path: Path, data: str = "", train: str = "", rows: list[Any] | None = None) -> Path:
    """A chat run's folder: its data and its config, ``data`` and ``train`` lines replacing BASE's."""
    write_jsonl(tmp_path / "chat.jsonl", rows if rows is not None else chats(60))
    given = {line.partition("=")[0].strip() for line in (data + "\n" + train).splitlines()}
    base = "\n".join(line for line in BASE.splitlines() if line.partition("=")[0].strip() not in given)
    config = tmp_path / "run.toml"
    config.write_text(base.format(data=data, train=train), encoding="utf-8")
    return config


@pytest.mark.parametrize(("data", "key", "text"), [
    ('chat_template = "chatlm"', "data.chat_template", "did you mean 'chatml'"),
    ('separator = "\\n"', "data.separator", "applies only with data.format = 'text'"),
    ('fields = { message = "m" }', "data.fields.message", "did you mean 'messages'"),
    ('roles = { gpt = "bot" }', "data.roles.gpt", "'bot' is not one of"),
    ('too_long = "cut"', "data.too_long", "'cut' is not one of"),
])
def test_config_errors_name_the_key(tmp_path: Path, data: str, key: str, text: str) -> None:
    with pytest.raises(TrainConfigError) as info:
        load_train_config(project(tmp_path, data))
    assert info.value.key == key and text in str(info.value), str(info.value)


def test_a_chat_run_needs_a_template_and_jsonl_files(tmp_path: Path) -> None:
    config = project(tmp_path)
    config.write_text(config.read_text().replace('chat_template = "chatml"\n', ""))
    with pytest.raises(TrainConfigError, match="the tokenizer has no chat template") as info:
        load_train_config(config)
    assert info.value.key == "data.chat_template" and "chatml, zephyr" in (info.value.hint or "")
    (tmp_path / "notes.txt").write_text("x")
    config.write_text(config.read_text().replace('"chat.jsonl"', '"notes.txt"'))
    with pytest.raises(TrainConfigError, match=r"is JSONL \(\.jsonl\) or Parquet") as info:
        load_train_config(config)
    text = project(tmp_path).read_text().replace('format = "chat"\nchat_template = "chatml"\n', "")
    config.write_text(text.replace("[data]\n", '[data]\ntrain_on_prompt = true\n'))
    with pytest.raises(TrainConfigError, match=r"applies only with data\.format"):
        load_train_config(config)


def test_kiln_train_on_chat_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    summary = train(project(tmp_path), stream=open(tmp_path / "log.txt", "w"))  # noqa: SIM115
    log = (tmp_path / "log.txt").read_text()
    assert "60 chat records in 1 file(s): 60 samples" in log and "samples packed" in log
    assert summary["eval_loss_after"] < summary["eval_loss_before"]
    assert summary["data"]["records"] == summary["data"]["samples"] == 60
    config = json.loads((summary["model"] / "tokenizer_config.json").read_text())
    assert config["chat_template"] == BUILTIN_TEMPLATES["chatml"]  # apply_chat_template reads it there
    tok = tokenizers.Tokenizer.from_file(str(summary["model"] / "tokenizer.json"))
    assert all(tok.token_to_id(t) is not None for t in SPECIALS)

    resumed = train(project(tmp_path, train="steps = 6"), resume=True,
                    stream=open(tmp_path / "log2.txt", "w"))  # noqa: SIM115
    assert len(resumed["losses"]) == 6 and resumed["losses"][:4] == summary["losses"]


def test_a_bad_record_stops_kiln_train_before_any_work(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    rows: list[Any] = chats(10)
    rows[6] = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 5}]}
    config = project(tmp_path, rows=rows, data='tokenizer = "tok"')
    train_bpe_tokenizer_folder(tmp_path / "tok")
    code = main(["train", str(config)])
    err = capsys.readouterr().err
    assert code == 3, err
    where = f"{tmp_path / 'chat.jsonl'}: line 7: field 'messages[1].content'"
    assert f"{where}: expected a string, found int" in err
    assert "Traceback" not in err and not (tmp_path / "runs").exists()
    assert main(["data", str(config)]) == 3 and "line 7" in capsys.readouterr().err


def train_bpe_tokenizer_folder(folder: Path) -> None:
    from kiln.hf import save_tokenizer

    (folder.parent / "t.txt").write_text("what is one plus two " * 20)
    save_tokenizer(train_bpe_tokenizer([folder.parent / "t.txt"], 300, special_tokens=SPECIALS), folder)


def test_kiln_data_previews_counts_efficiency_and_masked_samples(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"prompt": "Question: what is " + "very " * (40 if i == 2 else 1) + f"{i}?\nAnswer:",
             "completion": f" {i}."} for i in range(12)]
    write_jsonl(tmp_path / "qa.jsonl", rows)
    config = project(tmp_path)
    config.write_text(config.read_text().replace('"chat.jsonl"', '"qa.jsonl"').replace(
        'format = "chat"\nchat_template = "chatml"', 'format = "completion"\ntrain_on_prompt = false'))
    assert main(["data", str(config), "--samples", "2"]) == 0
    out = capsys.readouterr().out
    assert "12 completion records in 1 file(s): 12 samples" in out and "tokens per sample: min" in out
    assert "efficiency:" in out and "--- qa.jsonl:1 (" in out and "--- qa.jsonl:3" not in out
    assert f"{MASK_OPEN}Question: what is very 0?\nAnswer:{MASK_CLOSE} 0.{EOS_TOKEN}" in out
    assert not (tmp_path / "runs").exists()  # nothing written
    result = preview(config, samples=3, color=True, stream=open(tmp_path / "p.txt", "w"))  # noqa: SIM115
    assert result["samples"][0] == f"\x1b[2mQuestion: what is very 0?\nAnswer:\x1b[0m 0.{EOS_TOKEN}"
    assert result["stats"]["samples"] == 12 and result["efficiency"] > 0.5


def test_kiln_data_on_text_shows_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "t.txt").write_text("\n\n".join(f"document number {i} is here" for i in range(80)))
    config = tmp_path / "run.toml"
    config.write_text('[model]\nname = "Qwen3Model"\n[data]\nfiles = ["t.txt"]\nvocab_size = 300\n'
                      'separator = "\\n\\n"\n[train]\nseq_len = 32\nbatch_size = 2\n')
    assert main(["data", str(config), "--samples", "1"]) == 0
    out = capsys.readouterr().out
    assert "in 80 documents" in out and "--- sequence 1 of the first batch" in out
    assert f"{EOS_TOKEN}{MASK_OPEN}" in out  # the first token after an end-of-text is not predicted


def test_tensorboard_files_read_back_by_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboardX")
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    summary = train(project(tmp_path, train='report_to = ["tensorboard"]'),
                    stream=open(tmp_path / "log.txt", "w"))  # noqa: SIM115
    lines = (summary["output_dir"] / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    events = accumulator.EventAccumulator(str(summary["output_dir"] / "tensorboard"))
    events.Reload()
    assert {"train/loss", "train/lr", "train/grad_norm", "eval/loss"} <= set(events.Tags()["scalars"])
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in records if "loss" in r]
    evals = [(e.step, e.value) for e in events.Scalars("eval/loss")]
    assert evals == [(r["step"], pytest.approx(r["eval_loss"], rel=1e-6))
                     for r in records if "eval_loss" in r]
    assert [e[0] for e in evals] == [0, 2, 4]

    # resumed from step 2 (as after a crash past it): the curves show each step once, as trained last
    import shutil

    shutil.rmtree(summary["output_dir"] / "checkpoints" / "step-00000004")
    resumed = train(project(tmp_path, train='steps = 6\nreport_to = ["tensorboard"]'), resume=True,
                    stream=open(tmp_path / "log2.txt", "w"))  # noqa: SIM115
    events = accumulator.EventAccumulator(str(summary["output_dir"] / "tensorboard"))
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(step, pytest.approx(value, rel=1e-6)) for step, value in enumerate(resumed["losses"], 1)]


def test_report_to_names_the_extra_when_the_library_is_missing(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.hf import _tracking

    monkeypatch.setitem(_tracking.TRACKERS, "tensorboard", "no_such_module_kiln")
    with pytest.raises(TrainConfigError, match="needs no_such_module_kiln") as info:
        load_train_config(project(tmp_path, train='report_to = ["tensorboard"]'))
    assert info.value.key == "train.report_to" and "kiln-hf[tensorboard]" in (info.value.hint or "")
    with pytest.raises(TrainConfigError, match="'wandb' is not one of 'tensorboard'"):
        load_train_config(project(tmp_path, train='report_to = ["wandb"]'))


def test_the_demo_instruction_set_is_valid_and_correct(tmp_path: Path) -> None:
    from kiln.hf._demo import instructions

    path = tmp_path / "instructions.jsonl"
    path.write_text(instructions(), encoding="utf-8")
    records = read_records(path, "chat")
    assert 250 <= len(records) <= 500
    checked = 0
    for record in records:
        for message in record.messages:
            expression, said, value = message["content"].partition(" evaluates to ")
            if message["role"] == "assistant" and said:
                assert repr(eval(expression)) + "." == value, message  # the set's own expressions
                checked += 1
    assert checked > 100


def test_greedy_stops_at_the_stop_token() -> None:
    from kiln.hf._demo import greedy

    class Counting:  # predicts the next integer, modulo 10
        def logits(self, x: np.ndarray) -> np.ndarray:
            out = np.zeros((*x.shape, 10))
            out[0, np.arange(x.shape[1]), (x[0] + 1) % 10] = 1.0
            return out

    class Tok:
        def encode(self, text: str) -> Any:
            return type("E", (), {"ids": [int(c) for c in text]})()

        def decode(self, ids: list[int]) -> str:
            return "".join(map(str, ids))

    assert greedy(Counting(), Tok(), "12", tokens=20, window=8, stop=7) == "3456"
    assert greedy(Counting(), Tok(), "12", tokens=4, window=8) == "3456"


def test_a_json_array_file_is_read_as_records(tmp_path: Path) -> None:
    """As Stanford Alpaca's alpaca_data.json: one array; its items are numbered from 1."""
    rows = [{"instruction": "Add.", "input": "2 and 3", "output": "5"}, {"instruction": "Hi.", "output": ""}]
    (tmp_path / "alpaca.json").write_text(json.dumps(rows, indent=2))
    with pytest.raises(RecordError, match=r"alpaca\.json: record 2: field 'output': is empty") as info:
        read_records(tmp_path / "alpaca.json", "alpaca")
    assert info.value.line == 2
    (tmp_path / "alpaca.json").write_text(json.dumps(rows[:1], indent=2))
    assert read_records(tmp_path / "alpaca.json", "alpaca")[0].completion == "5"
    (tmp_path / "broken.json").write_text('[\n  {"instruction": "a",\n  "output": }\n]')
    with pytest.raises(RecordError, match=r"broken\.json: line 3: not valid JSON"):
        read_records(tmp_path / "broken.json", "alpaca")


def test_a_template_error_names_the_record(tokenizer: tokenizers.Tokenizer, tmp_path: Path) -> None:
    strict = ChatTemplate("{% for m in messages %}{% if m['role'] == 'system' %}"
                          "{{ raise_exception('no system messages') }}{% endif %}"
                          "{{ m['content'] }}{% endfor %}"
                          "{% if add_generation_prompt %}>{% endif %}")
    path = write_jsonl(tmp_path / "chat.jsonl", chats(4))  # the first has a system message
    with pytest.raises(RecordError, match=r"chat\.jsonl: line 1: chat template: no system messages") as info:
        SampleDataset(path, tokenizer, format="chat", template=strict, seq_len=64, batch_size=1)
    assert info.value.line == 1
    # where the answers cannot be told apart, training on every token needs no spans
    path = write_jsonl(tmp_path / "chat.jsonl", chats(4)[1:3])
    with pytest.raises(RecordError, match=r"line 1: .*cannot be told apart"):
        SampleDataset(path, tokenizer, format="chat", template=strict, seq_len=64, batch_size=1)
    ds = SampleDataset(path, tokenizer, format="chat", template=strict, seq_len=64, batch_size=1,
                       train_on_prompt=True)
    assert ds.stats["trained_tokens"] == ds.stats["tokens"] - 2  # all but each sample's first token
