"""Packed causal-LM batches from text files: tokenize once (streaming), pack, shuffle, split, batch, resume.

Label alignment. kiln's loss reads ``labels[t]`` as the target of position ``t``, so the labels come
already shifted: ``labels[t] = input_ids[t + 1]`` inside a sequence, the last label being the token
after the sequence. (HF causal-LM models shift inside the model: give one of them ``input_ids`` as
its labels, not these.) Padding only ever ends the last sequence of the corpus: ``input_ids`` pads
with the EOS id, ``labels`` with ``-100``, the ``ignore_index`` of kiln's losses.

Packing. The files, in the order given, are one token stream: each document's tokens, then the EOS.
With ``packing`` (the default), sequence ``i`` covers stream positions ``[i*T, i*T + T]`` (inputs the
first ``T``, labels the last ``T``), so in one epoch every stream token is an input exactly once (but
the final EOS) and a label exactly once (but the first token and each document's first token). A
row holds several documents, kept apart as transformers' flash-attention-2 packing does: its
``position_ids`` restart after every EOS, so each token attends only to its own document, and an
EOS is not trained to predict the next document's first token (label -100). A document longer than
the rest of a row continues in the next. Without ``packing`` each row holds one document (or a
``T``-token piece of a longer one), right-padded; :attr:`PackedDataset.efficiency` says how much of
the rows is padding.

Streaming. Text is read ``chunk_chars`` characters at a time and the token ids go to a file on disk
(memory-mapped afterwards), so files larger than memory work and are tokenized once. Inside a
document, text is cut only where a non-space character meets whitespace: no pre-token of GPT-2-style
byte-level tokenizers spans such a point, so the ids equal those of the whole document.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
from tokenizers import Tokenizer

from kiln.core.runtime import IGNORE_INDEX
from kiln.hf._errors import DataError
from kiln.hf._tokenizer import EOS_TOKEN, load_tokenizer


def _pieces(path: Path, separator: str | None, chunk_chars: int) -> Iterator[tuple[str, bool]]:
    """``(text, ends_document)`` pieces of ``path``, each at most about ``2 * chunk_chars`` characters."""
    with open(path, encoding="utf-8", newline="") as f:
        buf = ""
        while True:
            chunk = f.read(chunk_chars)
            buf += chunk
            if separator:
                *docs, buf = buf.split(separator)
                for doc in docs:
                    yield doc, True
            if not chunk:
                yield buf, True
                return
            if len(buf) > chunk_chars:
                # cut at the last point where non-space meets whitespace; a separator still to complete
                # starts in the last len(separator) - 1 characters, so the cut stays before them
                cut = len(buf) - max(1, len(separator or "") - 1)
                while cut > 0 and not (buf[cut].isspace() and not buf[cut - 1].isspace()):
                    cut -= 1
                if cut > 0:
                    yield buf[:cut], False
                    buf = buf[cut:]


def _tokenize(files: list[Path], tokenizer: Tokenizer, eos: int, separator: str | None, chunk_chars: int,
              dtype: np.dtype[Any], out: Path) -> None:
    with open(out, "wb") as sink:
        pending: list[str | None] = []  # texts, and None where a document ends
        size = 0

        def flush() -> None:
            texts = [t for t in pending if t is not None]
            encoded = iter(tokenizer.encode_batch(texts, add_special_tokens=False))
            for item in pending:
                ids = [eos] if item is None else next(encoded).ids
                sink.write(np.asarray(ids, dtype).tobytes())
            pending.clear()

        for file in files:
            open_doc = False
            try:
                for text, ends in _pieces(file, separator, chunk_chars):
                    if text:
                        pending.append(text)
                        size += len(text)
                        open_doc = True
                    if ends and open_doc:
                        pending.append(None)
                        open_doc = False
                    if size >= chunk_chars:
                        flush()
                        size = 0
            except UnicodeDecodeError as e:
                raise DataError(f"not UTF-8 text: {e.reason}", file=file) from None
            except OSError as e:
                raise DataError(f"cannot read the file: {e.strerror or e}", file=file) from None
        flush()


class Batches:
    """What the datasets share: the rows ``_first .. _first + _count`` of a split, shuffled each epoch
    by ``(seed, epoch)``, in batches of ``batch_size`` rows; :meth:`state` / :meth:`load_state` resume.

    A subclass sets ``batch_size``, ``seed``, ``shuffle``, ``drop_last``, ``_first`` and ``_count``,
    calls :meth:`_rewind`, and gives ``_rows`` (the batch of some row indices) and ``_fingerprint``.
    """

    batch_size: int
    seed: int
    shuffle: bool
    drop_last: bool
    _first: int
    _count: int

    def _rewind(self) -> None:
        self._epoch, self._batch = 0, 0
        self._order: tuple[int, np.ndarray] | None = None

    def _rows(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def _fingerprint(self) -> str:
        raise NotImplementedError

    @property
    def num_sequences(self) -> int:
        return self._count

    @property
    def epoch(self) -> int:
        return self._epoch + (self._batch >= len(self))

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self._count, self.batch_size)
        return full + (bool(rest) and not self.drop_last)

    def state(self) -> dict[str, Any]:
        """Where iteration resumes: the epoch and the batch within it (JSON-serialisable)."""
        epoch, batch = (self._epoch + 1, 0) if self._batch >= len(self) else (self._epoch, self._batch)
        return {"epoch": epoch, "batch": batch, "fingerprint": self._fingerprint()}

    def load_state(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state` of a dataset over the same files and settings."""
        if not isinstance(state, dict) or state.get("fingerprint") != self._fingerprint():
            raise DataError("this state comes from a dataset over other files, tokenizer or settings")
        epoch, batch = state["epoch"], state["batch"]
        if not (isinstance(epoch, int) and isinstance(batch, int) and epoch >= 0 and 0 <= batch <= len(self)):
            raise DataError(f"state position epoch={epoch!r}, batch={batch!r} is out of range")
        self._epoch, self._batch = epoch, batch

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        if self._batch >= len(self):
            self._epoch, self._batch = self._epoch + 1, 0
        epoch = self._epoch
        if self._order is None or self._order[0] != epoch:
            order = np.arange(self._first, self._first + self._count)
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(order)
            self._order = (epoch, order)
        order = self._order[1]
        while self._epoch == epoch and self._batch < len(self):
            rows = order[self._batch * self.batch_size:(self._batch + 1) * self.batch_size]
            self._batch += 1
            yield self._rows(rows)


class PackedDataset(Batches):
    """Batches ``{"input_ids", "labels"}`` (int64 ``[batch_size, seq_len]``) from text files, packed
    (then with ``position_ids`` that restart per document) or one document per row.

    ``tokenizer`` is a ``tokenizers.Tokenizer`` or a path for :func:`load_tokenizer`; ``eos_token``
    ends every document. A document is a whole file, or with ``separator`` (e.g. ``"\\n"``,
    ``"\\n\\n"``) each piece of a file between separators; empty documents are skipped.

    Iterating yields the rest of the current epoch; each epoch is shuffled by ``seed`` and its number.
    The last ``validation_fraction`` of the sequences is held out: :meth:`validation` gives the same
    dataset over them. Labels of positions nothing is predicted at are ``ignore_index``. :meth:`state`
    and :meth:`load_state` save and restore the position. Token ids
    are cached in ``cache_dir`` (keyed by the files, their sizes and times, and the tokenizer), or in a
    temporary folder removed with the dataset. Tokenizing holds a few ``chunk_chars`` of text and its
    ids in memory at a time, whatever the size of the files.
    """

    def __init__(self, files: str | Path | Iterable[str | Path], tokenizer: Tokenizer | str | Path, *,
                 seq_len: int, batch_size: int, eos_token: str = EOS_TOKEN, separator: str | None = None,
                 seed: int = 0, shuffle: bool = True, validation_fraction: float = 0.0,
                 drop_last: bool = False, cache_dir: str | Path | None = None,
                 chunk_chars: int = 1 << 18, packing: bool = True, ignore_index: int = IGNORE_INDEX) -> None:
        paths = [Path(files)] if isinstance(files, str | Path) else [Path(f) for f in files]
        for p in paths:
            if not p.is_file():
                raise DataError("text file does not exist", file=p)
        if not isinstance(tokenizer, Tokenizer):
            tokenizer = load_tokenizer(tokenizer)
        eos = tokenizer.token_to_id(eos_token)
        if eos is None:
            raise DataError(f"eos_token {eos_token!r} is not in the tokenizer's vocabulary")
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("chunk_chars", chunk_chars)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise DataError(f"{name} must be a positive int, found {value!r}")
        if not 0.0 <= validation_fraction < 1.0:
            raise DataError(f"validation_fraction must be in [0, 1), found {validation_fraction!r}")
        self.files, self.seq_len, self.batch_size, self.eos_id = paths, seq_len, batch_size, eos
        self.seed, self.shuffle, self.drop_last, self.packing = seed, shuffle, drop_last, packing
        self.ignore_index = ignore_index
        self.validation_fraction = validation_fraction
        self.split: Literal["train", "validation"] = "train"

        vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)
        key = hashlib.sha256(json.dumps([
            tokenizer.to_str(), eos, separator, chunk_chars, dtype.str,
            [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in paths],
        ]).encode()).hexdigest()[:32]
        temporary = cache_dir is None
        if temporary:
            cache = Path(tempfile.mkdtemp(prefix="kiln-tokens-"))
        else:
            cache = Path(cache_dir)
            cache.mkdir(parents=True, exist_ok=True)
        self.cache_file = cache / f"tokens-{key}.{dtype.name}"
        if not self.cache_file.exists():
            partial = self.cache_file.with_name(self.cache_file.name + f".{os.getpid()}.partial")
            try:
                _tokenize(paths, tokenizer, eos, separator, chunk_chars, dtype, partial)
                os.replace(partial, self.cache_file)  # only a complete cache ever has the final name
            finally:
                partial.unlink(missing_ok=True)
        n = self.cache_file.stat().st_size // dtype.itemsize
        if n < 2:
            raise DataError(f"the text files hold {n} token(s); a training pair needs 2",
                            file=paths[0] if len(paths) == 1 else None)
        self.tokens: np.ndarray = np.memmap(self.cache_file, dtype, "r", shape=(n,))
        if temporary:  # gone with the last dataset sharing these tokens (see validation())
            weakref.finalize(self.tokens, shutil.rmtree, cache, ignore_errors=True)
        self._key = key
        self._table = self._pieces()
        self._setup()

    def _pieces(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Without packing: where each row starts in the stream and how many (input, label) pairs it
        holds (each document, its tokens and EOS, cut into pieces of seq_len pairs). None when packed:
        row ``i`` starts at ``i * seq_len``."""
        if self.packing:
            return None
        t, n, step = self.seq_len, len(self.tokens), 1 << 20
        ends = np.concatenate([[-1], *(np.flatnonzero(self.tokens[i:i + step] == self.eos_id) + i
                                       for i in range(0, n, step))])  # scanned a part at a time
        if ends[-1] != n - 1:
            ends = np.append(ends, n - 1)
        firsts, ends = ends[:-1] + 1, ends[1:]
        keep = ends > firsts  # a document of one token has no pair
        firsts, ends = firsts[keep], ends[keep]
        counts = -(-(ends - firsts) // t)  # pieces per document
        piece = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        starts = np.repeat(firsts, counts) + t * piece
        return starts, np.minimum(t, np.repeat(ends, counts) - starts)

    def _piece(self, i: int) -> tuple[int, int]:
        if self._table is None:
            start = i * self.seq_len
            return start, min(self.seq_len, len(self.tokens) - 1 - start)
        return int(self._table[0][i]), int(self._table[1][i])

    def _setup(self) -> None:
        windows = -(-(len(self.tokens) - 1) // self.seq_len) if self._table is None else len(self._table[0])
        held = round(windows * self.validation_fraction)
        if self.validation_fraction and (held == 0 or held == windows):
            held = 1
            if windows < 2:
                raise DataError(f"{windows} sequence(s) of {self.seq_len} tokens cannot be split for "
                                "validation")
        self._first, self._count = (0, windows - held) if self.split == "train" else (windows - held, held)
        self._rewind()

    def validation(self) -> PackedDataset:
        """This dataset over its held-out sequences (same tokens, settings and seed), at epoch 0.

        The held-out sequences are the last of the stream; the first token they predict from is also
        the last label of the training sequence before them.
        """
        if not self.validation_fraction:
            raise DataError("validation_fraction is 0: nothing is held out")
        other = copy.copy(self)
        other.split = "validation"
        other._setup()
        return other

    @property
    def efficiency(self) -> float:
        """The share of this split's row positions that hold a token rather than padding."""
        first, end = self._first, self._first + self._count
        if self._table is None:
            pairs = min(end * self.seq_len, len(self.tokens) - 1) - first * self.seq_len
        else:
            pairs = int(self._table[1][first:end].sum())
        return pairs / max(1, self._count * self.seq_len)

    def _fingerprint(self) -> str:
        settings = [self._key, self.seq_len, self.batch_size, self.seed, self.shuffle, self.drop_last,
                    self.validation_fraction, self.split, *([] if self.packing else ["unpacked"]),
                    *([] if self.ignore_index == IGNORE_INDEX else [self.ignore_index])]
        return hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:16]

    def _rows(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        t = self.seq_len
        input_ids = np.full((len(rows), t), self.eos_id, np.int64)
        labels = np.full((len(rows), t), self.ignore_index, np.int64)
        for row, i in enumerate(rows):
            start, pairs = self._piece(i)
            seg = self.tokens[start: start + pairs + 1]
            input_ids[row, :pairs] = seg[:-1]
            labels[row, :pairs] = seg[1:]
        if not self.packing:
            return {"input_ids": input_ids, "labels": labels}
        # a document starts after each EOS: its positions restart, and the EOS predicts nothing
        ends = input_ids == self.eos_id
        labels[ends] = self.ignore_index
        index = np.arange(t)
        starts = np.zeros_like(ends)
        starts[:, 1:] = ends[:, :-1]
        first = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
        return {"input_ids": input_ids, "labels": labels, "position_ids": index - first}
