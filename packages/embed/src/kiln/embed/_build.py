"""Building libkiln: cffi's embedding mode compiles kiln.h's functions and an init code that attaches
their Python side into a shared library that starts its own interpreter."""

from __future__ import annotations

import json
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
#: the types and the C helper that _cabi.py uses, as cffi parses them (kiln.h has the same types)
CDEF = """
typedef uint64_t kiln_program;
typedef struct { double loss; double grad_norm; double lr; int64_t step; int64_t tokens; } kiln_step_stats;
void kiln_store_error(const char *json);
"""
#: the Python functions behind kiln.h (kiln/embed/_cabi.py)
API = """
int kiln_py_version(char *buf, size_t cap, size_t *needed);
int kiln_py_compile(const char *spec_json, kiln_program *out);
int kiln_py_plan(kiln_program program, char *buf, size_t cap, size_t *needed);
int kiln_py_arena_bytes(kiln_program program, size_t *out);
int kiln_py_bind(kiln_program program, void *buffer, size_t nbytes);
int kiln_py_train_step(kiln_program program, const int32_t *input_ids, const int32_t *labels, size_t count,
                       kiln_step_stats *stats);
int kiln_py_get_tensor(kiln_program program, const char *name, void *dst, size_t nbytes);
int kiln_py_set_tensor(kiln_program program, const char *name, const void *src, size_t nbytes);
int kiln_py_free(kiln_program program);
"""
INIT = """
from _libkiln import ffi, lib
from kiln.embed._cabi import attach
attach(ffi, lib)
"""


def build_library(out_dir: str | Path, *, python: str | None = None, verbose: bool = False) -> Path:
    """Build ``libkiln`` (``libkiln.so``; ``.dylib``, ``.dll`` elsewhere) and copy ``kiln.h`` into
    ``out_dir``; returns the library's path. The library's interpreter runs in the environment of
    ``python`` (default: this interpreter, so the one kiln is installed in), whatever the host's
    environment variables say."""
    import cffi

    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(HERE / "kiln.h", out / "kiln.h")
    libdir = sysconfig.get_config_var("LIBDIR")
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.embedding_api(API)
    define = f"#define KILN_PYTHON {json.dumps(python or sys.executable)}\n"
    source = define + (HERE / "_libkiln.c").read_text()
    ffi.set_source("_libkiln", source, include_dirs=[str(out)], extra_compile_args=["-std=c11", "-O1"],
                   extra_link_args=[f"-Wl,-rpath,{libdir}"] if libdir else [])
    ffi.embedding_init_code(INIT)
    with tempfile.TemporaryDirectory() as tmp:
        return Path(ffi.compile(tmpdir=tmp, target=str(out / "libkiln.*"), verbose=verbose))
