"""safetensors I/O: bit-exact round trips, interop with the safetensors package both ways, HF sharding,
precise errors on bad files, and reading tensor by tensor within one tensor of extra memory."""

import json
import struct
import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy

from kiln.core import KilnError
from kiln.hf import CheckpointError, open_checkpoint, parse_size, save_checkpoint

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.float64, np.int64, np.int32, np.int8, np.uint8,
          np.bool_]


def random_tensor(rng: np.random.Generator, shape: tuple[int, ...], dtype) -> np.ndarray:
    """Arbitrary bit patterns (NaN payloads, infinities, subnormals included) of ``dtype``."""
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    raw = rng.integers(0, 256, (*shape, dt.itemsize), dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.fixture
def tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {f"t.{np.dtype(dt).name}": random_tensor(rng, (3, 5), dt) for dt in DTYPES}
    out["scalar"] = np.array(2.5, np.float32)
    out["empty"] = np.zeros((0, 4), ml_dtypes.bfloat16)
    return out


def test_round_trip_is_bit_exact(tmp_path: Path, tensors: dict[str, np.ndarray]) -> None:
    [file] = save_checkpoint(tmp_path, tensors)
    assert file == tmp_path / "model.safetensors"
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.keys() == list(tensors)
        assert ckpt.metadata == {"format": "pt"}
        for key, value in tensors.items():
            assert ckpt.shape(key) == value.shape and ckpt.dtype(key) == value.dtype
            assert same_bits(ckpt.get(key), value), key


def test_bf16_upcasts_exactly(tmp_path: Path) -> None:
    values = np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32)
    bf16 = values.astype(ml_dtypes.bfloat16)
    save_checkpoint(tmp_path, {"w": bf16})
    with open_checkpoint(tmp_path / "model.safetensors") as ckpt:
        up = ckpt.get("w", np.float32)
    # bf16 is the top half of a float32: upcasting appends 16 zero bits
    expected = (bf16.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    assert up.dtype == np.float32 and same_bits(up, expected)


def test_kiln_files_load_in_safetensors(tmp_path: Path, tensors: dict[str, np.ndarray]) -> None:
    save_checkpoint(tmp_path, tensors)
    loaded = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    assert loaded.keys() == tensors.keys()
    for key, value in tensors.items():
        assert same_bits(loaded[key], value), key
    with safetensors.safe_open(tmp_path / "model.safetensors", framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}


def test_safetensors_files_load_in_kiln(tmp_path: Path, tensors: dict[str, np.ndarray]) -> None:
    safetensors.numpy.save_file(tensors, tmp_path / "theirs.safetensors", metadata={"format": "np"})
    with open_checkpoint(tmp_path / "theirs.safetensors") as ckpt:
        assert ckpt.metadata == {"format": "np"}
        assert sorted(ckpt.keys()) == sorted(tensors)
        for key, value in tensors.items():
            assert same_bits(ckpt.get(key), value), key


def test_sharding_follows_hf(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    sizes = {"a": 40, "b": 40, "c": 32, "big": 200, "d": 12}  # bytes, of float32 tensors
    tensors = {k: random_tensor(rng, (n // 4,), np.float32) for k, n in sizes.items()}
    files = save_checkpoint(tmp_path, tensors, max_shard_size=100)
    # huggingface_hub's rule: fill in order (c would tip a+b past 100); a tensor above the limit gets a
    # shard of its own at once while the open shard goes on (c, d)
    names = [f"model-0000{i}-of-00003.safetensors" for i in range(1, 4)]
    assert [f.name for f in files] == [*names, "model.safetensors.index.json"]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard_of = {"a": 0, "b": 0, "big": 1, "c": 2, "d": 2}
    assert index == {"metadata": {"total_size": sum(sizes.values())},
                     "weight_map": {key: names[i] for key, i in shard_of.items()}}
    for name in names:  # every shard is a complete safetensors file in its own right
        shard = safetensors.numpy.load_file(tmp_path / name)
        assert all(same_bits(v, tensors[k]) for k, v in shard.items())
    with open_checkpoint(tmp_path) as ckpt:
        assert sorted(ckpt.keys()) == sorted(tensors)
        assert all(same_bits(ckpt.get(k), v) for k, v in tensors.items())
    # saving again unsharded removes the old shards and the index
    assert save_checkpoint(tmp_path, tensors, max_shard_size="1MB") == [tmp_path / "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_parse_size() -> None:
    assert parse_size(123) == 123
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("2KiB") == 2048
    assert parse_size("1.5 gib") == 3 * 2**29
    for bad in ("5 parsecs", "GB", "-1", 0, "", True):
        with pytest.raises(CheckpointError):
            parse_size(bad)


def test_loading_tensor_by_tensor_holds_at_most_one_extra_tensor(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    data = {f"layer{i}": rng.standard_normal((128, 256 * i + 256)).astype(ml_dtypes.bfloat16)
            for i in range(6)}
    save_checkpoint(tmp_path, data, max_shard_size=300_000)
    del data
    with open_checkpoint(tmp_path) as ckpt:
        kept = {}
        tracemalloc.start()
        try:
            for key in ckpt:
                kept[key] = ckpt.get(key, np.float32)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    kept_bytes = sum(a.nbytes for a in kept.values())
    largest = max(a.nbytes for a in kept.values())
    assert kept_bytes <= peak <= kept_bytes + largest, (peak, kept_bytes, largest)


def raw_bytes(path: Path, raw: bytes, data: bytes = b"", header_len: int | None = None) -> Path:
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)
    return path


def raw_file(path: Path, header: object, data: bytes = b"", header_len: int | None = None) -> Path:
    return raw_bytes(path, json.dumps(header).encode(), data, header_len)


def f32(offsets: list[int], shape: list[int] | None = None, dtype: str = "F32") -> dict:
    return {"dtype": dtype, "shape": shape or [(offsets[1] - offsets[0]) // 4], "data_offsets": offsets}


def truncated(p: Path) -> Path:
    save_checkpoint(p.parent / "ok", {"a": np.ones(4, np.float32), "b": np.ones(8, np.float32)})
    p.write_bytes((p.parent / "ok" / "model.safetensors").read_bytes()[:-5])
    return p


DUPLICATE = (b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},'
             b' "w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}')
BAD_FILES = {
    "truncated": (truncated, "b", "truncated"),
    "header length past the end": (lambda p: raw_file(p, {}, header_len=1 << 20), None, "past the end"),
    "overlapping offsets": (lambda p: raw_file(p, {"a": f32([0, 16]), "b": f32([8, 24])}, bytes(24)), "b",
                            "overlaps tensor 'a'"),
    "offsets out of range": (lambda p: raw_file(p, {"a": f32([0, 16]), "b": f32([16, 32])}, bytes(20)), "b",
                             "out of range"),
    "unknown dtype": (lambda p: raw_file(p, {"w": f32([0, 8], [2], "F12")}, bytes(8)), "w", "unknown dtype"),
    "shape and size disagree": (lambda p: raw_file(p, {"w": f32([0, 8], [3])}, bytes(8)), "w", "needs 12"),
    "bad shape": (lambda p: raw_file(p, {"w": f32([0, 8], [-2])}, bytes(8)), "w", "non-negative"),
    "reversed offsets": (lambda p: raw_file(p, {"w": f32([8, 0], [0])}, bytes(8)), "w", "begin <= end"),
    "header not json": (lambda p: raw_bytes(p, b"{x]"), None, "JSON"),
    "header not an object": (lambda p: raw_file(p, [1, 2]), None, "JSON object"),
    "duplicate tensor": (lambda p: raw_bytes(p, DUPLICATE, bytes(8)), "w", "twice"),
    "too short for a header": (lambda p: p.write_bytes(b"\x01\x00") and p, None, "truncated"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_bad_file_names_file_and_tensor(tmp_path: Path, case: str) -> None:
    make, tensor, words = BAD_FILES[case]
    path = make(tmp_path / "bad.safetensors")
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(path)
    err = info.value
    assert isinstance(err, KilnError)
    assert err.file == str(path) and str(path) in str(err)
    assert err.tensor == tensor and (tensor is None or repr(tensor) in str(err))
    assert words in str(err)


def write_index(tmp_path: Path, weight_map: dict[str, str]) -> Path:
    path = tmp_path / "model.safetensors.index.json"
    path.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return path


def test_index_naming_a_missing_tensor(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, {"a": np.ones(2, np.float32)}, filename="part.safetensors")
    write_index(tmp_path, {"a": "part.safetensors", "lm_head.weight": "part.safetensors"})
    with pytest.raises(CheckpointError, match="missing") as info:
        open_checkpoint(tmp_path)
    assert (info.value.file, info.value.tensor) == (str(tmp_path / "part.safetensors"), "lm_head.weight")


def test_index_naming_a_missing_shard(tmp_path: Path) -> None:
    write_index(tmp_path, {"a": "model-00001-of-00002.safetensors"})
    with pytest.raises(CheckpointError, match="does not exist") as info:
        open_checkpoint(tmp_path / "model.safetensors.index.json")
    assert info.value.tensor == "a" and "model-00001-of-00002.safetensors" in str(info.value)


def test_bad_index_and_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no model\.safetensors or"):
        open_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": [1]}')
    with pytest.raises(CheckpointError, match="weight_map"):
        open_checkpoint(tmp_path)


def test_wrong_shape_and_unknown_key(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, {"w": np.ones((2, 3), np.float32)})
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.get("w", shape=(2, 3)).shape == (2, 3)
        with pytest.raises(CheckpointError, match=r"\[2, 3\] differs from the expected \[3, 2\]") as info:
            ckpt.get("w", shape=(3, 2))
        assert (info.value.file, info.value.tensor) == (str(tmp_path / "model.safetensors"), "w")
        with pytest.raises(CheckpointError, match="no such tensor"):
            ckpt.get("v")
        with pytest.raises(CheckpointError, match="not a NumPy dtype"):
            ckpt.get("w", "float-ish")


def test_unwritable_dtype_names_the_tensor(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="complex64") as info:
        save_checkpoint(tmp_path, {"z": np.zeros(2, np.complex64)})
    assert info.value.tensor == "z"
