"""Instruction and chat data: JSONL or Parquet records, checked one by one, tokenized into samples
(token ids and a loss mask each) and packed into rows whose positions restart with every sample.

Formats (the field names are the defaults; ``fields`` maps them to a file's own):

- ``completion``: ``prompt`` and ``completion`` strings. The sample is ``tokenizer(prompt)`` followed
  by ``tokenizer(completion)`` (no special tokens added) and the EOS token, so that the prompt's ids
  are those a model sees at inference; the completion and the EOS are trained.
- ``alpaca``: ``instruction``, optional ``input``, ``output``: a completion whose prompt is the Alpaca
  prompt (:data:`ALPACA_PROMPT`).
- ``chat``: ``messages``, a list of ``{"role", "content"}`` (roles ``system``, ``user``,
  ``assistant``, ``tool``; ``roles`` maps a file's own names, as ShareGPT's ``human`` and ``gpt``).
  The chat is rendered with a :class:`~kiln.hf.ChatTemplate` and tokenized whole, as transformers'
  ``apply_chat_template`` does; the trained tokens are those overlapping the assistant's text (what
  ``return_assistant_tokens_mask`` marks).

With ``train_on_prompt`` every token is trained. Labels are shifted for kiln: ``labels[t]`` is the
target of position ``t``, ``ignore_index`` where the next token is not trained and at each sample's
last token. Packed rows hold whole samples (best fit, longest first); their ``position_ids``
restart with each sample, so a sample attends only to itself, and the loss of a packed batch is the
loss of its samples one per row.
"""

from __future__ import annotations

import bisect
import copy
import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import numpy as np
from tokenizers import Tokenizer

from kiln.hf._chat import ChatTemplate
from kiln.hf._data import IGNORE_INDEX, Batches
from kiln.hf._errors import DataError
from kiln.hf._tokenizer import EOS_TOKEN, load_tokenizer

#: each format's fields, the names a config's ``fields`` table maps
FIELDS: dict[str, tuple[str, ...]] = {"completion": ("prompt", "completion"),
                                      "alpaca": ("instruction", "input", "output"),
                                      "chat": ("messages", "role", "content")}
ROLES = ("system", "user", "assistant", "tool")
#: the prompts of Stanford Alpaca, with and without an input
ALPACA_PROMPT = ("Below is an instruction that describes a task, paired with an input that provides further "
                 "context. Write a response that appropriately completes the request.\n\n"
                 "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_PROMPT_NO_INPUT = ("Below is an instruction that describes a task. Write a response that "
                          "appropriately completes the request.\n\n"
                          "### Instruction:\n{instruction}\n\n### Response:\n")


class RecordError(DataError):
    """A record of a data file that is not as its format expects: ``file``, ``line`` (the line of a
    JSONL file, the row of a Parquet file, the item of a JSON array, from 1; ``unit`` says which) and
    ``field`` (``None``: the whole record)."""

    def __init__(self, message: str, *, file: str | Path, line: int, field: str | None = None,
                 unit: str = "line", **kw: Any) -> None:
        self.line, self.field = line, field
        where = f"{unit} {line}" + (f": field {field!r}" if field is not None else "")
        super().__init__(f"{where}: {message}", file=file, **kw)


@attrs.frozen
class Record:
    """One checked record: a prompt and a completion, or a chat's messages (roles mapped)."""

    file: Path
    line: int
    prompt: str = ""
    completion: str = ""
    messages: tuple[Mapping[str, Any], ...] = ()


def _jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield n, json.loads(line)
                    except ValueError as e:
                        raise RecordError(f"not valid JSON: {e}", file=path, line=n) from None
    except UnicodeDecodeError as e:
        raise DataError(f"not UTF-8 text: {e.reason}", file=path) from None
    except OSError as e:
        raise DataError(f"cannot read the file: {e.strerror or e}", file=path) from None


def _json_array(path: Path) -> Iterator[tuple[int, Any]]:
    """The items of a ``.json`` file holding one array (as Stanford Alpaca's ``alpaca_data.json``)."""
    try:
        items = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(f"not UTF-8 text: {e.reason}", file=path) from None
    except json.JSONDecodeError as e:
        raise RecordError(f"not valid JSON: {e.msg}", file=path, line=e.lineno) from None
    yield from enumerate(items, 1)


def _starts_an_array(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(1 << 12).lstrip().startswith(b"[")
    except OSError as e:
        raise DataError(f"cannot read the file: {e.strerror or e}", file=path) from None


def _parquet(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("reading Parquet files needs pyarrow, which is not installed", file=path,
                        hint="pip install 'kiln-hf[parquet]'") from None
    try:
        table = pq.ParquetFile(path)
        n = 0
        for batch in table.iter_batches():
            for row in batch.to_pylist():
                n += 1
                yield n, row
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"not a readable Parquet file: {e}", file=path) from None


def read_records(files: str | Path | Iterable[str | Path], format: str, *,
                 fields: Mapping[str, str] | None = None,
                 roles: Mapping[str, str] | None = None) -> list[Record]:
    """The records of JSONL (``.jsonl``, ``.json``: one JSON object a line), JSON (``.json``: one array
    of objects) and Parquet (``.parquet``) files, each checked against ``format``; the first bad one
    raises :class:`RecordError` naming its file, line and field. ``fields`` maps the format's field
    names to the files' own, ``roles`` the files' role names to ``system``, ``user``, ``assistant``
    and ``tool``."""
    if format not in FIELDS:
        raise DataError(f"unknown format {format!r}; the formats are {', '.join(FIELDS)}")
    paths = [Path(files)] if isinstance(files, str | Path) else [Path(f) for f in files]
    names = {f: (fields or {}).get(f, f) for f in FIELDS[format]}
    unknown = set(fields or {}) - set(names)
    if unknown:
        raise DataError(f"fields {sorted(unknown)} are not fields of the {format!r} format "
                        f"({', '.join(FIELDS[format])})")
    records = []
    for path in paths:
        if not path.is_file():
            raise DataError("data file does not exist", file=path)
        suffix = path.suffix.lower()
        if suffix not in (".jsonl", ".json", ".parquet"):
            raise DataError(f"a {format!r} data file is JSONL (.jsonl) or Parquet (.parquet), not {suffix!r}",
                            file=path)
        if suffix == ".parquet":
            rows, unit = _parquet(path), "row"
        elif suffix == ".json" and _starts_an_array(path):
            rows, unit = _json_array(path), "record"
        else:
            rows, unit = _jsonl(path), "line"
        for line, row in rows:
            records.append(_record(row, format, names, roles or {}, path, line, unit))
    if not records:
        raise DataError("the data files hold no records", file=paths[0] if len(paths) == 1 else None)
    return records


def _record(row: Any, format: str, names: Mapping[str, str], roles: Mapping[str, str], file: Path, line: int,
            unit: str) -> Record:
    def bad(message: str, field: str | None = None) -> RecordError:
        return RecordError(message, file=file, line=line, field=field, unit=unit)

    def text(obj: Mapping[str, Any], field: str, *, where: str = "", optional: bool = False) -> str:
        value = obj.get(names.get(field, field))
        if value is None and optional:
            return ""
        if value is None:
            raise bad("is missing", where + names.get(field, field))
        if not isinstance(value, str):
            raise bad(f"expected a string, found {type(value).__name__}", where + names.get(field, field))
        return value

    if not isinstance(row, dict):
        raise bad(f"expected a JSON object, found {type(row).__name__}")
    if format == "completion":
        completion = text(row, "completion")
        if not completion:
            raise bad("is empty: there is nothing to train on", names["completion"])
        return Record(file, line, text(row, "prompt"), completion)
    if format == "alpaca":
        instruction, extra = text(row, "instruction"), text(row, "input", optional=True)
        output = text(row, "output")
        if not output:
            raise bad("is empty: there is nothing to train on", names["output"])
        template = ALPACA_PROMPT if extra else ALPACA_PROMPT_NO_INPUT
        prompt = template.format(instruction=instruction, input=extra)
        return Record(file, line, prompt, output)
    messages = row.get(names["messages"])
    if not isinstance(messages, list) or not messages:
        found = "it is missing" if messages is None else f"found {type(messages).__name__} {messages!r}"[:80]
        raise bad(f"expected a non-empty list of messages, {found}", names["messages"])
    out = []
    for i, message in enumerate(messages):
        where = f"{names['messages']}[{i}]."
        if not isinstance(message, dict):
            raise bad(f"expected an object with a role and a content, found {type(message).__name__}",
                      where[:-1])
        role = text(message, "role", where=where)
        role = roles.get(role, role)
        if role not in ROLES:
            raise bad(f"{role!r} is not one of {', '.join(map(repr, ROLES))}"
                      + (" (map it with data.roles)" if not roles else ""), where + names["role"])
        content = text(message, "content", where=where)
        rest = {k: v for k, v in message.items()
                if v is not None and k not in (names["role"], names["content"])}
        out.append({"role": role, "content": content, **rest})
    if not any(m["role"] == "assistant" for m in out):
        raise bad("has no assistant message: there is nothing to train on", names["messages"])
    return Record(file, line, messages=tuple(out))


def record_text(record: Record, template: ChatTemplate | None) -> str:
    """The text of a record as a model reads it (a chat rendered with ``template``)."""
    if not record.messages:
        return record.prompt + record.completion
    return _chat(record, template, spans=False)[0]


def _chat(record: Record, template: ChatTemplate | None, *, spans: bool) -> tuple[str, list[tuple[int, int]]]:
    """A chat record rendered, with the spans of the assistant's text if asked; a template's error
    names the record."""
    if template is None:
        raise DataError("chat records need a chat template")
    try:
        return template.trained_spans(record.messages) if spans else template.render(record.messages)
    except DataError as e:
        raise RecordError(e.message, file=record.file, line=record.line, hint=e.hint) from None


def encode(record: Record, tokenizer: Tokenizer, eos_id: int, template: ChatTemplate | None, *,
           train_on_prompt: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """A record's token ids (int32) and which of them are trained (bool), before any truncation."""
    if not record.messages:
        prompt = tokenizer.encode(record.prompt).ids  # with the tokenizer's special tokens (a BOS)
        completion = [*tokenizer.encode(record.completion, add_special_tokens=False).ids, eos_id]
        ids = np.asarray([*prompt, *completion], np.int32)
        mask = np.arange(len(ids)) >= (0 if train_on_prompt else len(prompt))
        return ids, mask
    text, spans = _chat(record, template, spans=not train_on_prompt)
    encoding = tokenizer.encode(text, add_special_tokens=False)
    ids = np.asarray(encoding.ids, np.int32)
    if train_on_prompt:
        return ids, np.ones(len(ids), bool)
    mask = np.zeros(len(ids), bool)  # a token overlapping a span is trained (transformers' rule)
    offsets = np.asarray(encoding.offsets, np.int64).reshape(-1, 2)
    for start, end in spans:
        mask |= (offsets[:, 1] > start) & (offsets[:, 0] < end)
    return ids, mask


def _pack(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Rows of sample indices: best fit, longest first (each into the fullest row it fits)."""
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free positions, row), sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        at = bisect.bisect_left(room, (lengths[i], -1))
        if at == len(room):
            rows.append([i])
            left, row = capacity - lengths[i], len(rows) - 1
        else:
            left, row = room.pop(at)
            rows[row].append(i)
            left -= lengths[i]
        if left:
            bisect.insort(room, (left, row))
    return rows


class SampleDataset(Batches):
    """Batches ``{"input_ids", "labels"}`` (int64 ``[batch_size, seq_len]``, plus ``position_ids`` when
    packed) from instruction or chat records (see the module's docstring for the formats).

    A sample longer than ``seq_len`` is cut to its first ``seq_len`` tokens (``too_long="truncate"``)
    or left out (``"drop"``); one left with no trained token is left out; :attr:`stats` counts them.
    The last ``validation_fraction`` of the samples is held out (:meth:`validation`); the rest is
    shuffled per epoch by ``seed`` as :class:`PackedDataset` does, and resumes the same way.
    """

    def __init__(self, files: str | Path | Iterable[str | Path], tokenizer: Tokenizer | str | Path, *,
                 format: str, seq_len: int, batch_size: int, template: ChatTemplate | None = None,
                 fields: Mapping[str, str] | None = None, roles: Mapping[str, str] | None = None,
                 eos_token: str = EOS_TOKEN, train_on_prompt: bool = False,
                 too_long: Literal["truncate", "drop"] = "truncate", packing: bool = True, seed: int = 0,
                 shuffle: bool = True, validation_fraction: float = 0.0, drop_last: bool = False,
                 ignore_index: int = IGNORE_INDEX) -> None:
        if not isinstance(tokenizer, Tokenizer):
            tokenizer = load_tokenizer(tokenizer)
        eos = tokenizer.token_to_id(eos_token)
        if eos is None:
            raise DataError(f"eos_token {eos_token!r} is not in the tokenizer's vocabulary")
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise DataError(f"{name} must be a positive int, found {value!r}")
        if too_long not in ("truncate", "drop"):
            raise DataError(f"too_long must be 'truncate' or 'drop', found {too_long!r}")
        if not 0.0 <= validation_fraction < 1.0:
            raise DataError(f"validation_fraction must be in [0, 1), found {validation_fraction!r}")
        if format == "chat" and template is None:
            raise DataError("the chat format needs a chat template (kiln.hf.ChatTemplate)")
        self.seq_len, self.batch_size, self.eos_id, self.packing = seq_len, batch_size, eos, packing
        self.seed, self.shuffle, self.drop_last, self.ignore_index = seed, shuffle, drop_last, ignore_index
        self.validation_fraction, self.template, self.tokenizer = validation_fraction, template, tokenizer
        self.split: Literal["train", "validation"] = "train"

        self.records = read_records(files, format, fields=fields, roles=roles)
        kept: list[tuple[Record, np.ndarray, np.ndarray]] = []
        truncated = too_long_dropped = untrained = 0
        for record in self.records:
            ids, mask = encode(record, tokenizer, eos, template, train_on_prompt=train_on_prompt)
            if len(ids) > seq_len:
                if too_long == "drop":
                    too_long_dropped += 1
                    continue
                ids, mask = ids[:seq_len], mask[:seq_len]
                truncated += 1
            if not mask[1:].any():  # nothing is predicted in this sample
                untrained += 1
                continue
            kept.append((record, ids, mask))
        if len(kept) < 1 + bool(validation_fraction):
            raise DataError(f"{len(kept)} of the {len(self.records)} records are left to train on "
                            f"({too_long_dropped} longer than seq_len {seq_len} dropped, {untrained} with no "
                            "trained token)" + (", too few to hold some out for validation" if kept else ""))
        self.samples = kept
        lengths = [len(ids) for _, ids, _ in kept]
        self.stats = {"records": len(self.records), "samples": len(kept), "truncated": truncated,
                      "dropped_too_long": too_long_dropped, "dropped_untrained": untrained,
                      "tokens": sum(lengths), "trained_tokens": int(sum(m[1:].sum() for _, _, m in kept)),
                      "min_tokens": min(lengths), "mean_tokens": sum(lengths) / len(lengths),
                      "max_tokens": max(lengths)}

        held = max(1, round(len(kept) * validation_fraction)) if validation_fraction else 0
        splits = (range(len(kept) - held), range(len(kept) - held, len(kept)))
        self._layout: list[list[int]] = []
        self._splits: list[tuple[int, int]] = []
        for split in splits:
            sizes = [lengths[i] for i in split]
            rows = _pack(sizes, seq_len) if packing else [[k] for k in range(len(sizes))]
            self._splits.append((len(self._layout), len(rows)))
            self._layout += [[split[k] for k in sorted(row)] for row in rows]
        digest = hashlib.sha256()
        for _, ids, mask in kept:
            digest.update(ids.tobytes() + np.packbits(mask).tobytes() + b"|")
        self._key = digest.hexdigest()[:32]
        self._first, self._count = self._splits[0]
        self._rewind()

    def validation(self) -> SampleDataset:
        """This dataset over its held-out samples (same settings and seed), at epoch 0."""
        if not self.validation_fraction:
            raise DataError("validation_fraction is 0: nothing is held out")
        other = copy.copy(self)
        other.split = "validation"
        other._first, other._count = self._splits[1]
        other._rewind()
        return other

    @property
    def efficiency(self) -> float:
        """The share of this split's row positions that hold a token rather than padding."""
        rows = self._layout[self._first:self._first + self._count]
        used = sum(len(self.samples[i][1]) for row in rows for i in row)
        return used / max(1, self._count * self.seq_len)

    def _fingerprint(self) -> str:
        settings = [self._key, self.seq_len, self.batch_size, self.seed, self.shuffle, self.drop_last,
                    self.validation_fraction, self.split, self.packing, self.ignore_index]
        return hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:16]

    def _rows(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        t = self.seq_len
        input_ids = np.full((len(rows), t), self.eos_id, np.int64)
        labels = np.full((len(rows), t), self.ignore_index, np.int64)
        positions = np.zeros((len(rows), t), np.int64)
        for r, row in enumerate(rows):
            at = 0
            for i in self._layout[row]:
                _, ids, mask = self.samples[i]
                n = len(ids)
                input_ids[r, at:at + n] = ids
                labels[r, at:at + n - 1] = np.where(mask[1:], ids[1:], self.ignore_index)
                positions[r, at:at + n] = np.arange(n)
                at += n
            positions[r, at:] = np.arange(t - at)  # the padding: a segment of its own
        batch = {"input_ids": input_ids, "labels": labels}
        if self.packing:
            batch["position_ids"] = positions
        return batch
