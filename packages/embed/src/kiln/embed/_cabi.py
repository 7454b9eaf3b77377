"""The Python side of libkiln: the functions behind kiln.h, which libkiln's init code attaches to its
``extern "Python"`` declarations. Each returns a status and, on an error, stores the structured error
as the calling thread's last error."""

from __future__ import annotations

import itertools
import json
import sys
import threading
from collections.abc import Callable
from importlib.metadata import version as dist_version
from typing import Any

import numpy as np

import kiln.core
from kiln.embed._handle import CODES, EmbedError, ProgramHandle, compile, error_dict

ABI_VERSION = 1  # KILN_ABI_VERSION in kiln.h
STATUS = {code: i for i, code in enumerate(CODES)}
_programs: dict[int, ProgramHandle] = {}
_ids = itertools.count(1)
_lock = threading.Lock()  # one call at a time (kiln.h's thread-safety rule)


def attach(ffi: Any, lib: Any) -> None:
    """Define libkiln's ``kiln_py_*`` functions on its cffi ``ffi`` (called once, by its init code)."""

    def extern(fn: Callable[..., None]) -> None:
        def call(*args: Any) -> int:
            try:
                with _lock:
                    fn(*args)
                return STATUS["ok"]
            except Exception as exc:  # every error reaches the host as a status, never as a crash
                err = error_dict(exc)
                lib.kiln_store_error(json.dumps(err).encode())
                return STATUS[err["code"]]

        # compile_ is kiln_py_compile: its trailing _ keeps kiln.embed.compile in reach
        ffi.def_extern(name=f"kiln_py_{fn.__name__.rstrip('_')}", error=STATUS["internal"])(call)

    def need(ptr: Any, what: str) -> None:
        if ptr == ffi.NULL:
            raise EmbedError("argument", f"{what} is NULL", what)

    def string(ptr: Any, what: str) -> str:
        need(ptr, what)
        raw = ffi.string(ptr)
        try:
            return str(raw.decode())
        except UnicodeDecodeError as exc:
            raise EmbedError("argument", f"{what} is not UTF-8 text: {exc}", what) from None

    def handle(program: int) -> ProgramHandle:
        found = _programs.get(int(program))
        if found is None:
            raise EmbedError("handle", f"there is no program {program}: it was never compiled, or freed",
                             f"program {program}")
        return found

    def text_out(text: str, buf: Any, cap: int, needed: Any) -> None:
        data = text.encode() + b"\0"
        if needed != ffi.NULL:
            needed[0] = len(data)
        if buf == ffi.NULL:
            return
        if cap < len(data):
            raise EmbedError("size", f"the text needs {len(data)} bytes; the buffer has {cap}", "cap")
        ffi.memmove(buf, data, len(data))

    def tensor(program: int, name: Any, nbytes: int) -> np.ndarray:
        key = string(name, "name")
        view = handle(program).view(key)
        if nbytes != view.nbytes:
            raise EmbedError("size", f"tensor {key!r} ({view.dtype} {list(view.shape)}) has {view.nbytes} "
                             f"bytes; nbytes is {nbytes}", key)
        return view

    @extern
    def version(buf: Any, cap: int, needed: Any) -> None:
        info = {"abi": ABI_VERSION, "kiln-embed": dist_version("kiln-embed"),
                "kiln-core": kiln.core.__version__, "python": sys.version.split()[0], "prefix": sys.prefix}
        text_out(json.dumps(info), buf, cap, needed)

    @extern
    def compile_(spec: Any, out: Any) -> None:
        need(out, "out")
        program = compile(string(spec, "spec_json"))
        key = next(_ids)
        _programs[key] = program
        out[0] = key

    @extern
    def plan(program: int, buf: Any, cap: int, needed: Any) -> None:
        text_out(json.dumps(handle(program).plan()), buf, cap, needed)

    @extern
    def arena_bytes(program: int, out: Any) -> None:
        need(out, "out")
        out[0] = handle(program).arena_bytes

    @extern
    def bind(program: int, buffer: Any, nbytes: int) -> None:
        need(buffer, "buffer")
        handle(program).bind(ffi.buffer(buffer, nbytes))

    @extern
    def train_step(program: int, input_ids: Any, labels: Any, count: int, stats: Any) -> None:
        need(input_ids, "input_ids")
        need(labels, "labels")
        h = handle(program)
        shape = (h.batch, h.seq)
        if count != h.batch * h.seq:
            raise EmbedError("size", f"count is {count}; the program trains on batch x seq = "
                             f"{shape[0]} x {shape[1]} = {h.batch * h.seq} tokens", "count")
        ids, labs = (np.frombuffer(ffi.buffer(p, 4 * count), np.int32).reshape(shape)
                     for p in (input_ids, labels))
        result = h.train_step(ids, labs)
        if stats != ffi.NULL:
            for key in ("loss", "grad_norm", "lr"):
                setattr(stats, key, result[key])
            stats.step, stats.tokens = int(result["step"]), int(result["tokens"])

    @extern
    def get_tensor(program: int, name: Any, dst: Any, nbytes: int) -> None:
        need(dst, "dst")
        ffi.memmove(dst, tensor(program, name, nbytes), nbytes)

    @extern
    def set_tensor(program: int, name: Any, src: Any, nbytes: int) -> None:
        need(src, "src")
        ffi.memmove(tensor(program, name, nbytes), src, nbytes)

    @extern
    def free(program: int) -> None:
        handle(program)
        del _programs[int(program)]
