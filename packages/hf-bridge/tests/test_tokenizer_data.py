"""Tokenizer training and loading (checked through the ``tokenizers`` package itself) and the packed
dataset: every token exactly once per epoch, shifted labels, seeded shuffles, held-out split,
resumable position, and streaming a file with bounded memory."""

import itertools
import json
import random
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from kiln.core import KilnError
from kiln.hf import (
    EOS_TOKEN,
    IGNORE_INDEX,
    DataError,
    PackedDataset,
    load_tokenizer,
    save_tokenizer,
    train_bpe_tokenizer,
)

WORDS = ["the", "cat", "sat", "on", "a", "mat", "über", "naïve", "日本語", "🙂", "dog's", "ran", "1234", "--",
         "\t", "fast", "slow"]
SAMPLE = "The naïve cat's 🙂 sat  on\tthe mat, 日本語 1234!\n\n  über-fast\r\n"


def corpus(rng: random.Random, documents: int, separator: str = "\n\n") -> str:
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30))) for _ in range(documents)]
    return separator.join(docs)


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    folder = tmp_path_factory.mktemp("texts")
    rng = random.Random(0)
    paths = []
    for i in range(3):
        path = folder / f"part{i}.txt"
        path.write_text(corpus(rng, 40 + 10 * i) + "\n\n" * i, encoding="utf-8")
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def tokenizer(texts: list[Path]) -> tokenizers.Tokenizer:
    return train_bpe_tokenizer(texts, 300, special_tokens=[EOS_TOKEN, "<|pad|>"])


def test_trained_tokenizer_round_trips(tmp_path: Path, tokenizer: tokenizers.Tokenizer) -> None:
    files = save_tokenizer(tokenizer, tmp_path, model_max_length=128)
    assert [f.name for f in files] == ["tokenizer.json", "tokenizer_config.json"]
    reloaded = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert reloaded.get_vocab() == tokenizer.get_vocab()
    assert 256 < reloaded.get_vocab_size() <= 300
    assert (reloaded.token_to_id(EOS_TOKEN), reloaded.token_to_id("<|pad|>")) == (0, 1)
    encoded = reloaded.encode(SAMPLE)
    assert encoded.ids == tokenizer.encode(SAMPLE).ids
    assert reloaded.decode(encoded.ids) == SAMPLE  # byte-level: lossless on any text
    assert len(encoded.ids) < len(SAMPLE.encode())  # merges were learned
    assert reloaded.encode(f"a{EOS_TOKEN}b").ids[1] == 0  # special tokens stay whole
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config == {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN,
                      "clean_up_tokenization_spaces": False, "model_max_length": 128}
    assert load_tokenizer(tmp_path).get_vocab() == tokenizer.get_vocab()


def test_tokenizer_errors_name_the_file(tmp_path: Path, tokenizer: tokenizers.Tokenizer) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(DataError) as info:
        load_tokenizer(tmp_path)
    assert isinstance(info.value, KilnError) and info.value.file == str(bad) and str(bad) in str(info.value)
    with pytest.raises(DataError, match=r"no tokenizer\.json"):
        load_tokenizer(tmp_path / "nowhere")
    with pytest.raises(DataError, match="'<eos>' is not in the tokenizer's vocabulary"):
        save_tokenizer(tokenizer, tmp_path / "out", eos_token="<eos>")
    with pytest.raises(DataError, match="does not exist"):
        train_bpe_tokenizer([tmp_path / "missing.txt"], 300)


def expected_stream(paths: list[Path], tokenizer: tokenizers.Tokenizer, separator: str | None) -> list[int]:
    """The oracle: each whole document through ``tokenizers`` directly, then the EOS."""
    eos = tokenizer.token_to_id(EOS_TOKEN)
    out: list[int] = []
    for path in paths:
        text = path.read_text(encoding="utf-8")
        for doc in (text.split(separator) if separator else [text]):
            if doc:
                out += [*tokenizer.encode(doc, add_special_tokens=False).ids, eos]
    return out


def all_batches(ds: PackedDataset) -> tuple[np.ndarray, np.ndarray]:
    batches = list(ds)
    return (np.concatenate([b["input_ids"] for b in batches]), np.concatenate([b["labels"] for b in batches]))


@pytest.mark.parametrize("separator", [None, "\n\n", " the "])
def test_every_token_exactly_once_per_epoch(texts: list[Path], tokenizer: tokenizers.Tokenizer,
                                            separator: str | None) -> None:
    stream = expected_stream(texts, tokenizer, separator)
    eos = tokenizer.token_to_id(EOS_TOKEN)
    # tiny chunks: documents are cut many times while streaming, and the ids must not change
    ds = PackedDataset(texts, tokenizer, seq_len=16, batch_size=5, separator=separator, shuffle=False,
                       chunk_chars=37)
    assert ds.tokens.tolist() == stream
    batches = list(ds)
    inputs, labels, positions = (np.concatenate([b[k] for b in batches])
                                 for k in ("input_ids", "labels", "position_ids"))
    assert inputs.shape[1] == 16 and inputs.dtype == labels.dtype == np.int64
    n = len(stream) - 1  # rows cut the stream: each token an input once (but the final EOS)
    assert inputs.reshape(-1)[:n].tolist() == stream[:-1] and (inputs.reshape(-1)[n:] == eos).all()
    # each token a label once (but the first), except where an EOS would predict the next document
    want = [IGNORE_INDEX if x == eos else y for x, y in itertools.pairwise(stream)]
    assert labels.reshape(-1)[:n].tolist() == want and (labels.reshape(-1)[n:] == IGNORE_INDEX).all()
    # positions count from each row's start and from every document's start (after an EOS)
    for row_in, row_pos in zip(inputs, positions, strict=True):
        count = 0
        for t, (x, p) in enumerate(zip(row_in, row_pos, strict=True)):
            assert p == count, (t, p, count)
            count = 0 if x == eos else count + 1
    assert ds.efficiency == pytest.approx(n / inputs.size)

    shuffled = PackedDataset(texts, tokenizer, seq_len=16, batch_size=5, separator=separator, seed=3,
                             chunk_chars=37)
    s_inputs, s_labels = all_batches(shuffled)
    assert s_inputs.tolist() != inputs.tolist()
    rows = sorted(zip(map(tuple, inputs), map(tuple, labels), strict=True))
    assert sorted(zip(map(tuple, s_inputs), map(tuple, s_labels), strict=True)) == rows


def test_without_packing_each_row_holds_one_document(texts: list[Path],
                                                     tokenizer: tokenizers.Tokenizer) -> None:
    stream = expected_stream(texts, tokenizer, "\n\n")
    eos = tokenizer.token_to_id(EOS_TOKEN)
    docs, doc = [], []  # the oracle: documents (with their EOS), each cut into pieces of 8 pairs
    for x in stream:
        doc.append(x)
        if x == eos:
            docs.append(doc)
            doc = []
    pieces = [d[k:k + 9] for d in docs for k in range(0, len(d) - 1, 8)]
    ds = PackedDataset(texts, tokenizer, seq_len=8, batch_size=4, separator="\n\n", shuffle=False,
                       packing=False)
    inputs, labels = all_batches(ds)
    assert ds.num_sequences == len(pieces) == len(inputs)
    for row_in, row_lab, piece in zip(inputs, labels, pieces, strict=True):
        k = len(piece) - 1
        assert row_in[:k].tolist() == piece[:-1] and row_lab[:k].tolist() == piece[1:]
        assert (row_in[k:] == eos).all() and (row_lab[k:] == IGNORE_INDEX).all()
    assert "position_ids" not in next(iter(ds))
    packed = PackedDataset(texts, tokenizer, seq_len=8, batch_size=4, separator="\n\n")
    assert ds.efficiency == pytest.approx(sum(len(p) - 1 for p in pieces) / (8 * len(pieces)))
    assert ds.efficiency < packed.efficiency


def test_shuffle_is_seeded_per_epoch(texts: list[Path], tokenizer: tokenizers.Tokenizer) -> None:
    def epochs(seed: int) -> list[list[int]]:
        ds = PackedDataset(texts, tokenizer, seq_len=8, batch_size=4, seed=seed)
        return [all_batches(ds)[0][:, 0].tolist() for _ in range(2)]

    first, second = epochs(7)
    assert epochs(7) == [first, second] and first != second and epochs(8)[0] != first
    assert sorted(first) == sorted(second)


def test_state_resumes_exactly(texts: list[Path], tokenizer: tokenizers.Tokenizer, tmp_path: Path) -> None:
    def make() -> PackedDataset:
        return PackedDataset(texts, tokenizer, seq_len=8, batch_size=4, seed=1, cache_dir=tmp_path)

    straight = make()
    run = [b["input_ids"] for _ in range(2) for b in straight]
    ds = make()
    taken = []
    for i, batch in enumerate(ds):
        taken.append(batch["input_ids"])
        if i == 4:
            break
    state = json.loads(json.dumps(ds.state()))  # JSON-serialisable
    assert (state["epoch"], state["batch"]) == (0, 5)
    resumed = make()  # a new process: the token cache in cache_dir is reused
    assert len(list(tmp_path.glob("tokens-*"))) == 1
    resumed.load_state(state)
    taken += [b["input_ids"] for b in resumed]
    assert resumed.state()["epoch"] == resumed.epoch == 1
    taken += [b["input_ids"] for b in resumed]
    assert len(taken) == len(run) and all((a == b).all() for a, b in zip(taken, run, strict=True))

    other = PackedDataset(texts, tokenizer, seq_len=8, batch_size=2, seed=1, cache_dir=tmp_path)
    with pytest.raises(DataError, match="other files, tokenizer or settings"):
        other.load_state(state)


def test_held_out_split(texts: list[Path], tokenizer: tokenizers.Tokenizer) -> None:
    full = PackedDataset(texts, tokenizer, seq_len=8, batch_size=4, shuffle=False)
    train = PackedDataset(texts, tokenizer, seq_len=8, batch_size=4, validation_fraction=0.2, shuffle=False)
    held = train.validation()
    assert held.split == "validation" and held.tokens is train.tokens
    assert held.num_sequences == round(0.2 * full.num_sequences)
    assert train.num_sequences + held.num_sequences == full.num_sequences
    joined = np.concatenate([all_batches(train)[0], all_batches(held)[0]])
    np.testing.assert_array_equal(joined, all_batches(full)[0])
    with pytest.raises(DataError, match="nothing is held out"):
        full.validation()


def test_drop_last_and_lengths(texts: list[Path], tokenizer: tokenizers.Tokenizer) -> None:
    ds = PackedDataset(texts, tokenizer, seq_len=8, batch_size=7, drop_last=True)
    batches = list(ds)
    assert len(batches) == len(ds) == ds.num_sequences // 7
    assert all(b["input_ids"].shape == (7, 8) for b in batches)


def test_bad_inputs(tmp_path: Path, tokenizer: tokenizers.Tokenizer) -> None:
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8") as info:
        PackedDataset(bad, tokenizer, seq_len=4, batch_size=2)
    assert info.value.file == str(bad)
    with pytest.raises(DataError, match="does not exist"):
        PackedDataset(tmp_path / "nope.txt", tokenizer, seq_len=4, batch_size=2)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="0 token"):
        PackedDataset(tmp_path / "empty.txt", tokenizer, seq_len=4, batch_size=2)
    with pytest.raises(DataError, match="eos_token"):
        PackedDataset(bad, tokenizer, seq_len=4, batch_size=2, eos_token="</s>")
    with pytest.raises(DataError, match="seq_len"):
        PackedDataset(bad, tokenizer, seq_len=0, batch_size=2)


def test_streams_a_file_with_bounded_memory(tmp_path: Path, tokenizer: tokenizers.Tokenizer) -> None:
    rng = random.Random(1)
    big = tmp_path / "big.txt"
    with open(big, "w", encoding="utf-8") as f:
        for _ in range(60):
            f.write(corpus(rng, 400) + "\n\n")
    size = big.stat().st_size
    assert size > 1_600_000
    small = tmp_path / "small.txt"
    small.write_text(corpus(rng, 10))
    next(iter(PackedDataset(small, tokenizer, seq_len=4, batch_size=2)))  # first-use imports, not counted
    tracemalloc.start()
    try:
        ds = PackedDataset(big, tokenizer, seq_len=64, batch_size=8, separator="\n\n", chunk_chars=2048)
        first = next(iter(ds))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < size // 8, (peak, size)  # bounded by the chunk, not the file
    assert first["input_ids"].shape == (8, 64)
    assert len(ds.tokens) == len(expected_stream([big], tokenizer, "\n\n"))
