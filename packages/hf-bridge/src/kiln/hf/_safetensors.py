"""safetensors checkpoints, one file or sharded: read tensor by tensor from memory maps, written as HF does.

The format: 8 bytes of little-endian u64 ``N``, then ``N`` bytes of JSON header (an object mapping each
tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``, plus an optional
``"__metadata__"`` of strings), then the data; offsets count from the end of the header. Every header
is checked here, before any tensor is read, so a bad file fails with a :class:`CheckpointError` that
names the file and the tensor, never with a NumPy or JSON traceback, and never half loaded.
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import attrs
import ml_dtypes
import numpy as np

from kiln.hf._errors import CheckpointError

INDEX_SUFFIX = ".index.json"
DEFAULT_NAME = "model.safetensors"
_MAX_HEADER = 100_000_000  # the safetensors library's own limit; beyond it a header is an attack, not a model

# Native byte order throughout: safetensors is little-endian, and so is every host NumPy runs on in practice.
_DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(t)
    for name, t in {
        "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
        "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64,
        "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F32": np.float32, "F64": np.float64,
        "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    }.items()
}
_NAMES = {dt: name for name, dt in _DTYPES.items()}

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string such as ``"5GB"`` (10**9) or ``"500MiB"`` (2**20), as in HF."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", str(size))
        unit = m and m.group(2).upper()
        if not m or unit not in _UNITS:
            raise CheckpointError(f"max_shard_size must be an int or a size such as '5GB' or '500MiB', "
                                  f"found {size!r}")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise CheckpointError(f"max_shard_size must be positive, found {size!r}")
    return value


@attrs.frozen
class TensorInfo:
    """Where one tensor lives: its file, safetensors dtype name, shape and absolute byte range."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def _pairs_no_duplicates(path: Path) -> Any:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise CheckpointError("the header names this key twice", file=path, tensor=key)
            out[key] = value
        return out

    return hook


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The checked tensor table and ``__metadata__`` of one safetensors file; reads the header only."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            if size < 8:
                raise CheckpointError(f"file is truncated: {size} bytes, fewer than the 8-byte header length",
                                      file=path)
            n = int.from_bytes(f.read(8), "little")
            if n > size - 8:
                raise CheckpointError(f"header length {n} runs past the end of the file ({size} bytes)",
                                      file=path)
            if n > _MAX_HEADER:
                raise CheckpointError(f"header length {n} exceeds the {_MAX_HEADER}-byte limit", file=path)
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"cannot read the file: {e.strerror or e}", file=path) from None
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_pairs_no_duplicates(path))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"header is not valid UTF-8 JSON: {e}", file=path) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"header must be a JSON object, found {type(header).__name__}", file=path)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError("__metadata__ must map strings to strings", file=path, tensor="__metadata__")
    base, buffer = 8 + n, size - 8 - n
    infos = {name: _tensor_info(path, name, entry, base, buffer) for name, entry in header.items()}
    _check_no_overlap(path, infos)
    return infos, metadata


def _tensor_info(path: Path, name: str, entry: Any, base: int, buffer: int) -> TensorInfo:
    def fail(message: str) -> CheckpointError:
        return CheckpointError(message, file=path, tensor=name)

    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise fail(f"entry must be an object with dtype, shape and data_offsets, found {entry!r}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in _DTYPES:
        raise fail(f"unknown dtype {dtype!r}; kiln reads {', '.join(_DTYPES)}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise fail(f"shape must be a list of non-negative ints, found {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise fail(f"data_offsets must be [begin, end] with 0 <= begin <= end, found {offsets!r}")
    begin, end = offsets
    expected = math.prod(shape) * _DTYPES[dtype].itemsize
    if end - begin != expected:
        raise fail(f"data_offsets {offsets} hold {end - begin} bytes, but {dtype} of shape {shape} needs "
                   f"{expected}")
    if end > buffer:
        raise fail(f"data_offsets {offsets} run past the end of the data ({buffer} bytes): "
                   f"the file is truncated or the offsets are out of range")
    return TensorInfo(path, dtype, tuple(shape), base + begin, base + end)


def _check_no_overlap(path: Path, infos: dict[str, TensorInfo]) -> None:
    spans = sorted((t.start, t.end, name) for name, t in infos.items() if t.end > t.start)
    for (_, end_a, a), (start_b, _, b) in itertools.pairwise(spans):
        if start_b < end_a:
            raise CheckpointError(f"data overlaps tensor {a!r}'s bytes", file=path, tensor=b)


class Checkpoint:
    """An open safetensors checkpoint: one file, or the shards an ``*.index.json`` names.

    Every header is read and checked on opening; tensor bytes are memory-mapped and copied out one
    tensor at a time by :meth:`get`, so reading a checkpoint holds no more than the tensors the caller
    keeps. Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.metadata: dict[str, str] = {}
        self._tensors: dict[str, TensorInfo] = {}
        self._maps: dict[Path, mmap.mmap] = {}
        if self.path.is_dir():
            index = self.path / (DEFAULT_NAME + INDEX_SUFFIX)
            single = self.path / DEFAULT_NAME
            if not index.exists() and not single.exists():
                raise CheckpointError(f"no {DEFAULT_NAME} or {index.name} in this folder", file=self.path)
            self.path = index if index.exists() else single
        if self.path.name.endswith(INDEX_SUFFIX):
            self._open_index(self.path)
        else:
            self._tensors, self.metadata = read_header(self.path)

    def _open_index(self, index: Path) -> None:
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise CheckpointError(f"cannot read the index: {e}", file=index) from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError("index must hold a 'weight_map' object of tensor name -> file name",
                                  file=index, tensor="weight_map")
        headers: dict[str, tuple[dict[str, TensorInfo], dict[str, str]]] = {}
        for name, file in weight_map.items():
            shard = index.parent / file
            if file not in headers:
                if not shard.is_file():
                    raise CheckpointError(f"shard {file!r} named by {index.name} does not exist", file=shard,
                                          tensor=name)
                headers[file] = read_header(shard)
            tensors, metadata = headers[file]
            if name not in tensors:
                raise CheckpointError(f"tensor is missing: {index.name} places it in this file, whose header "
                                      f"does not list it", file=shard, tensor=name)
            self._tensors[name] = tensors[name]
            self.metadata = self.metadata or metadata

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Unmap every file. Arrays returned by :meth:`get` stay valid: they are copies."""
        for m in self._maps.values():
            m.close()
        self._maps.clear()

    def keys(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, key: object) -> bool:
        return key in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def info(self, key: str) -> TensorInfo:
        """File, dtype name, shape and byte range of ``key``."""
        try:
            return self._tensors[key]
        except KeyError:
            raise CheckpointError("no such tensor in the checkpoint", file=self.path, tensor=key) from None

    def shape(self, key: str) -> tuple[int, ...]:
        return self.info(key).shape

    def dtype(self, key: str) -> np.dtype[Any]:
        """The stored NumPy dtype (``ml_dtypes.bfloat16`` for BF16)."""
        return _DTYPES[self.info(key).dtype]

    def get(self, key: str, dtype: Any = None, *, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """A new array holding tensor ``key``, cast to ``dtype`` if given (BF16 upcasts exactly to float32).

        ``shape``, if given, is the shape the caller expects; another raises :class:`CheckpointError`.
        """
        t = self.info(key)
        if shape is not None and tuple(shape) != t.shape:
            raise CheckpointError(f"shape {list(t.shape)} differs from the expected {list(shape)}",
                                  file=t.file, tensor=key)
        stored = _DTYPES[t.dtype]
        try:
            target = stored if dtype is None else np.dtype(dtype)
        except TypeError:
            raise CheckpointError(f"cannot convert to {dtype!r}: not a NumPy dtype", file=t.file,
                                  tensor=key) from None
        count = (t.end - t.start) // stored.itemsize
        if count == 0:
            return np.zeros(t.shape, target)
        view = np.frombuffer(self._map(t.file), stored, count, t.start).reshape(t.shape)
        out = view.astype(target)  # always a copy
        del view  # the mmap must not stay exported, or close() would fail
        return out

    def read_into(self, key: str, out: np.ndarray, index: tuple[Any, ...] | None = None) -> None:
        """Copy tensor ``key`` (or its part ``index``) into the array ``out``, casting as it goes.

        The bytes go from the memory map straight into ``out`` (which may be a strided view, e.g. a
        transposed or sliced part of a larger array): no copy of the tensor is made on the way.
        """
        t = self.info(key)
        stored = _DTYPES[t.dtype]
        count = (t.end - t.start) // stored.itemsize
        view = np.frombuffer(self._map(t.file), stored, count, t.start).reshape(t.shape) if count else \
            np.zeros(t.shape, stored)
        part = view if index is None else view[index]
        try:
            if part.shape != out.shape:
                raise CheckpointError(f"shape {list(part.shape)} differs from the expected {list(out.shape)}",
                                      file=t.file, tensor=key)
            np.copyto(out, part, casting="unsafe")
        finally:
            del view, part  # the mmap must not stay exported, or close() would fail

    def _map(self, file: Path) -> mmap.mmap:
        if file not in self._maps:
            try:
                with open(file, "rb") as f:
                    self._maps[file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:
                raise CheckpointError(f"cannot map the file: {e}", file=file) from None
        return self._maps[file]


class SafetensorsFormat:
    """The ``safetensors`` weight format (registered through ``kiln_register_weight_formats``)."""

    name = "safetensors"

    def detect(self, path: str | Path) -> bool:
        p = Path(path)
        if p.is_dir():
            return (p / DEFAULT_NAME).exists() or (p / (DEFAULT_NAME + INDEX_SUFFIX)).exists()
        return p.name.endswith((".safetensors", INDEX_SUFFIX))

    def open(self, path: str | Path) -> Checkpoint:
        return Checkpoint(path)

    def save(self, folder: str | Path, tensors: Mapping[str, Any], **options: Any) -> list[Path]:
        return save_checkpoint(folder, tensors, **options)


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open a checkpoint: a ``.safetensors`` file, an ``*.index.json``, or a folder holding either."""
    return Checkpoint(path)


def _name_of(array: Any, key: str) -> tuple[str, tuple[int, ...], int]:
    dt = np.dtype(array.dtype)
    name = _NAMES.get(dt if dt.isnative else dt.newbyteorder())
    if name is None:
        raise CheckpointError(f"dtype {dt} cannot be written; safetensors holds {', '.join(_DTYPES)}",
                              tensor=key)
    shape = tuple(int(d) for d in array.shape)
    return name, shape, math.prod(shape) * dt.itemsize


def save_checkpoint(directory: str | Path, tensors: Mapping[str, Any], *, max_shard_size: int | str = "5GB",
                    metadata: Mapping[str, str] | None = None, filename: str = DEFAULT_NAME) -> list[Path]:
    """Write ``tensors`` into ``directory`` as HF does and return the files written.

    At most ``max_shard_size`` bytes of tensor data per file, filled in order (a larger tensor gets a
    file of its own at once, as huggingface_hub does):
    one ``model.safetensors``, or ``model-00001-of-0000N.safetensors`` shards plus
    ``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``). Every header carries
    ``{"format": "pt"}``. Shards of an earlier save under the same name are removed. A value needs only
    ``shape`` and ``dtype`` until its turn comes: it is turned into an array then, one at a time.
    """
    directory = Path(directory)
    limit = parse_size(max_shard_size)
    meta = {"format": "pt", **(metadata or {})}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CheckpointError("metadata must map strings to strings", file=directory, tensor="__metadata__")
    sizes = {key: _name_of(value, key) for key, value in tensors.items()}
    shards: list[list[str]] = []
    current, used = [], 0
    for key, (_, _, nbytes) in sizes.items():  # huggingface_hub's split_state_dict_into_shards_factory
        if nbytes > limit:
            shards.append([key])
            continue
        if current and used + nbytes > limit:
            shards.append(current)
            current, used = [], 0
        current.append(key)
        used += nbytes
    if current or not shards:
        shards.append(current)

    stem = filename.removesuffix(".safetensors")
    if len(shards) == 1:
        names = [filename]
    else:
        names = [f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, keys in zip(names, shards, strict=True):
        _write_file(directory / name, {k: sizes[k] for k in keys}, tensors, meta)
        written.append(directory / name)
    index = directory / (filename + INDEX_SUFFIX)
    if len(shards) > 1:
        weight_map = {key: name for name, keys in zip(names, shards, strict=True) for key in keys}
        total = sum(nbytes for _, _, nbytes in sizes.values())
        body = {"metadata": {"total_size": total}, "weight_map": weight_map}
        index.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        written.append(index)
    stale = re.compile(re.escape(stem) + r"-\d{5}-of-\d{5}\.safetensors")
    for old in directory.iterdir():
        if (stale.fullmatch(old.name) or old == index) and old not in written:
            old.unlink()
    return written


def _write_file(path: Path, table: dict[str, tuple[str, tuple[int, ...], int]], tensors: Mapping[str, Any],
                metadata: Mapping[str, str]) -> None:
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for key, (dtype, shape, nbytes) in table.items():
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # as the safetensors library does: data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for key, (dtype, shape, nbytes) in table.items():
            array = np.asarray(tensors[key])
            if array.shape != shape:
                raise CheckpointError(f"array shape {list(array.shape)} differs from its declared shape "
                                      f"{list(shape)}", file=path, tensor=key)
            if nbytes:
                f.write(np.ascontiguousarray(array.reshape(-1), dtype=_DTYPES[dtype]).view(np.uint8))
