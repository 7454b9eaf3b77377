"""Tokenizers: load a HF ``tokenizer.json``; train and save a byte-level BPE tokenizer (GPT-2 style)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kiln.hf._errors import DataError

EOS_TOKEN = "<|endoftext|>"


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer in ``path``: a ``tokenizer.json`` file, or a folder holding one."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise DataError("no tokenizer.json here", file=file)
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust side raises a bare Exception for every parse failure
        raise DataError(f"not a valid tokenizer.json: {e}", file=file) from None


def train_bpe_tokenizer(files: Iterable[str | Path], vocab_size: int, *,
                        special_tokens: Sequence[str] = (EOS_TOKEN,), min_frequency: int = 2) -> Tokenizer:
    """A byte-level BPE tokenizer trained on ``files`` (GPT-2's scheme: every text round-trips losslessly).

    The vocabulary holds ``special_tokens`` first (ids 0, 1, ...), then the 256 byte symbols, then
    merges up to ``vocab_size``. Encoding adds no special tokens; append the EOS yourself (the data
    pipeline does).
    """
    paths = [Path(f) for f in files]
    for p in paths:
        if not p.is_file():
            raise DataError("training file does not exist", file=p)
    minimum = len(special_tokens) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < minimum:
        raise DataError(f"vocab_size {vocab_size} is below the {minimum} special and byte tokens")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(p) for p in paths], trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, directory: str | Path, *, eos_token: str | None = EOS_TOKEN,
                   model_max_length: int | None = None) -> list[Path]:
    """Write ``tokenizer.json`` and a minimal HF ``tokenizer_config.json`` into ``directory``.

    ``transformers.AutoTokenizer.from_pretrained(directory)`` then gives a ``PreTrainedTokenizerFast``
    with ``eos_token`` set (it must be in the vocabulary).
    """
    directory = Path(directory)
    if eos_token is not None and tokenizer.token_to_id(eos_token) is None:
        raise DataError(f"eos_token {eos_token!r} is not in the tokenizer's vocabulary", file=directory)
    directory.mkdir(parents=True, exist_ok=True)
    config: dict[str, object] = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token,
                                 "clean_up_tokenization_spaces": False}
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    files = [directory / "tokenizer.json", directory / "tokenizer_config.json"]
    tokenizer.save(str(files[0]))
    files[1].write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return files
