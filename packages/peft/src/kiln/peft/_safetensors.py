"""The subset of safetensors an adapter file needs: one file of float tensors, read and written whole.

kiln-peft depends on kiln-core only, so it does not borrow kiln-hf's reader (which brings kiln-dsl,
tokenizers and ml-dtypes): an adapter is a few small float matrices. Layout: 8 bytes of
little-endian u64 ``N``, ``N`` bytes of JSON header (name -> ``{"dtype", "shape", "data_offsets"}``,
plus ``"__metadata__"``), then the data. BF16 is widened to float32 bit-exactly without ml-dtypes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kiln.peft._errors import AdapterError

_WRITE = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64", np.dtype(np.float16): "F16"}
_READ: dict[str, np.dtype[Any]] = {name: np.dtype(code) for name, code in
                                   (("F32", "<f4"), ("F64", "<f8"), ("F16", "<f2"), ("BF16", "<u2"))}


def write(path: Path, tensors: Mapping[str, np.ndarray]) -> None:
    """Write ``tensors`` (float32, float64 or float16) with PEFT's ``{"format": "pt"}`` metadata."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, array in tensors.items():
        a = np.ascontiguousarray(array)
        if a.dtype not in _WRITE:
            raise AdapterError(f"cannot store dtype {a.dtype}", file=path, key=name)
        data = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": _WRITE[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the safetensors library writes it
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for data in blobs:
            f.write(data)


def read(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of the file as float32 (float64 stays float64); a malformed file raises an
    :class:`AdapterError` naming it and, where one is at fault, the tensor."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise AdapterError(f"cannot read the adapter weights: {exc.strerror or exc}", file=path) from None
    n = int.from_bytes(raw[:8], "little") if len(raw) >= 8 else -1
    if n < 0 or 8 + n > len(raw):
        raise AdapterError("is not a safetensors file (its header length runs past the end)", file=path)
    try:
        header = json.loads(raw[8:8 + n])
    except ValueError:
        raise AdapterError("is not a safetensors file (its header is not JSON)", file=path) from None
    if not isinstance(header, dict):
        raise AdapterError("is not a safetensors file (its header is not a JSON object)", file=path)
    data = memoryview(raw)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = _READ[info["dtype"]], tuple(info["shape"]), info["data_offsets"]
            ok = all(isinstance(d, int) and d >= 0 for d in (*shape, begin, end))
        except (KeyError, TypeError, ValueError):
            raise AdapterError("has a malformed header entry; expected dtype F32, F16, BF16 or F64, a shape "
                               "and data_offsets", file=path, key=name) from None
        if not ok or not begin <= end <= len(data) or end - begin != math.prod(shape) * dtype.itemsize:
            raise AdapterError(f"data_offsets {[begin, end]} do not hold a {info['dtype']} tensor of shape "
                               f"{list(shape)} within the file", file=path, key=name)
        a = np.frombuffer(data[begin:end], dtype).reshape(shape)
        if info["dtype"] == "BF16":  # bfloat16 is the top half of a float32
            a = (a.astype(np.uint32) << 16).view(np.float32)
        out[name] = a.astype(np.float64 if a.dtype == np.float64 else np.float32)
    return out
