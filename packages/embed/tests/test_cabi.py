"""libkiln as a C host meets it: built once per test session with `kiln embed build`, driven by the C
programs in tests/c compiled with gcc against kiln.h, in an environment without any Python variables
that would point it at kiln."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kiln.embed
from kiln.core import PluginSession
from kiln.core.cli import main

C = Path(__file__).parent / "c"
# isolated: libkiln's interpreter must ignore these and run in the environment that built it
HOST_ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHOME": "/nowhere",
            "PYTHONPATH": "/nowhere", **{k: v for k, v in os.environ.items() if k == "KILN_NUM_THREADS"}}


def _cc() -> str:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler (gcc or cc) on PATH")
    return cc


def _host(libdir: Path, name: str) -> Path:
    """tests/c/<name>.c compiled against libdir's kiln.h and libkiln, as docs/embedding.md says."""
    exe = libdir / name
    if not exe.exists():
        subprocess.run([_cc(), "-std=c11", "-Wall", "-Wextra", "-Werror", "-o", str(exe),
                        str(C / f"{name}.c"), f"-I{libdir}", f"-L{libdir}", "-lkiln", f"-Wl,-rpath,{libdir}"],
                       check=True)
    return exe


@pytest.fixture(scope="session")
def libkiln(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _cc()
    out = tmp_path_factory.mktemp("libkiln")
    with PluginSession(autoload=True).activate() as session:  # `kiln embed` comes from the entry point
        assert "kiln-embed" in {p.distribution for p in session.plugins()}
        assert main(["embed", "build", "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} >= {"libkiln.so", "kiln.h"}
    return out


def _run(exe: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(exe), *args], env=HOST_ENV, capture_output=True, text=True, timeout=120)


def test_a_c_host_trains_as_the_python_api_does(
        libkiln: Path, spec: dict[str, Any], oracle: Callable[..., Any], batches: Callable[..., Any]) -> None:
    steps, tensor = 4, "blocks.1.qkv_weight"
    out = libkiln / "qkv.bin"
    done = _run(_host(libkiln, "train"), json.dumps(spec), str(steps), tensor, str(out))
    assert done.returncode == 0, done.stderr
    version, *lines = done.stdout.splitlines()
    info = json.loads(version)
    assert info["abi"] == 1 and info["kiln-embed"] == kiln.embed.__version__
    assert info["prefix"] == sys.prefix  # the building environment's interpreter, not the base one
    losses = [float.fromhex(line.split()[0]) for line in lines]
    assert [int(line.split()[1]) for line in lines] == list(range(1, steps + 1))

    model = oracle()
    expected = [model.train_step(dict(zip(("input_ids", "labels"), batches(s), strict=True)))["loss"]
                for s in range(steps)]
    assert losses == expected  # bit for bit
    assert losses[-1] < losses[0]
    assert out.read_bytes() == model.parameter(tensor).tobytes()


EXPECTED = {  # case of tests/c/garbage.c: (status, culprit)
    "json": ("json", "spec"), "spec_null": ("argument", "spec_json"), "out_null": ("argument", "out"),
    "not_object": ("argument", "spec"), "unknown_model": ("model", "model 'NoSuchModel'"),
    "bad_batch": ("argument", "batch"), "unknown_key": ("argument", "lr"), "bad_ir": ("model", "ir"),
    "not_utf8": ("argument", "spec_json"), "compile": ("ok", ""), "plan_small": ("size", "cap"),
    "arena_null": ("argument", "out"), "unknown_handle": ("handle", "program 12345"), "arena": ("ok", ""),
    "bind_small": ("size", "buffer"), "bind_unaligned": ("argument", "buffer"),
    "bind_null": ("argument", "buffer"), "step_count": ("size", "count"),
    "step_token": ("argument", "input_ids"), "step_label": ("argument", "labels"),
    "step_null": ("argument", "input_ids"), "tensor_unknown": ("tensor", "embeding"),
    "tensor_size": ("size", "embedding"), "tensor_src_null": ("argument", "src"),
    "tensor_name_null": ("argument", "name"), "bind": ("ok", ""), "step": ("ok", ""), "free": ("ok", ""),
    "free_again": ("handle", "program 1"), "step_freed": ("handle", "program 1"),
}


def test_garbage_input_gets_a_status_and_a_message_naming_the_culprit(
        libkiln: Path, spec: dict[str, Any], oracle: Callable[..., Any]) -> None:
    done = _run(_host(libkiln, "garbage"), json.dumps(spec))
    assert done.returncode == 0, done.stderr
    rows = dict(line.split("|", 1) for line in done.stdout.splitlines())
    for case, (code, culprit) in EXPECTED.items():
        status, error = rows[case].split("|", 1)
        assert int(status) == kiln.embed.CODES.index(code), (case, rows[case])
        if code != "ok":
            err = json.loads(error)
            assert (err["code"], err["culprit"]) == (code, culprit), case
            assert err["message"]
    assert "did you mean 'embedding'" in rows["tensor_unknown"]
    assert "2 x 8 = 16 tokens" in rows["step_count"] and "100000" in rows["step_token"]
    assert int(rows["plan_needed"]) == len(json.dumps(kiln.embed.compile(spec).plan()).encode()) + 1
    # the last error was read into a buffer too small for it: a status, and the size it needs
    assert rows["last_error_small"].split("|")[0] == str(kiln.embed.CODES.index("size"))
    assert int(rows["error_needed"]) == len(rows["last_error_small"].split("|", 1)[1].encode()) + 1
    # after every error, the program still trains as the Python API does
    ids, labels = np.zeros((2, 8), np.int32), np.zeros((2, 8), np.int32)
    labels[0, 2] = -100
    expected = oracle().train_step({"input_ids": ids, "labels": labels})["loss"]
    assert float.fromhex(rows["loss"]) == expected


def test_an_environment_without_kiln_is_an_init_status(tmp_path: Path) -> None:
    _cc()
    env = tmp_path / "empty-env"  # a venv with nothing installed: neither cffi nor kiln
    (env / "bin").mkdir(parents=True)
    (env / "pyvenv.cfg").write_text(f"home = {Path(sys.base_prefix) / 'bin'}\n"
                                    "include-system-site-packages = false\n")
    kiln.embed.build_library(tmp_path, python=str(env / "bin" / "python"))
    done = _run(_host(tmp_path, "train"), "{}", "1", "x", str(tmp_path / "x"))
    assert done.returncode == 1
    assert "kiln_version: status 1: " in done.stderr
    err = json.loads(done.stderr.split("status 1: ", 1)[1])
    assert err["code"] == "init" and err["culprit"] == "libkiln"
    assert "cannot import" in err["message"] and str(env) in err["message"]


def test_the_docs_c_host_builds_and_trains(libkiln: Path, oracle: Callable[..., Any]) -> None:
    docs = (Path(__file__).parents[3] / "docs" / "embedding.md").read_text(encoding="utf-8")
    (libkiln / "docs_host.c").write_text(docs.split("```c\n", 1)[1].split("```", 1)[0])
    exe = libkiln / "docs_host"
    subprocess.run([_cc(), "-std=c11", "-Wall", "-Werror", str(libkiln / "docs_host.c"), f"-I{libkiln}",
                    f"-L{libkiln}", "-lkiln", f"-Wl,-rpath,{libkiln}", "-o", str(exe)], check=True)
    done = _run(exe)
    assert done.returncode == 0, done.stderr
    ids = np.arange(16).reshape(2, 8) % 64
    model = oracle()
    expected = [model.train_step({"input_ids": ids, "labels": (ids + 1) % 64})["loss"] for _ in range(3)]
    lines = [line.split() for line in done.stdout.splitlines()]
    assert [(step, float(loss)) for _, step, _, loss in lines] == \
        [(f"{i + 1}:", x) for i, x in enumerate(expected)]


def test_threads_take_turns_and_keep_their_own_last_error(
        libkiln: Path, spec: dict[str, Any], oracle: Callable[..., Any]) -> None:
    exe = libkiln / "threads"
    subprocess.run([_cc(), "-std=c11", "-Wall", "-Werror", "-pthread", str(C / "threads.c"), f"-I{libkiln}",
                    f"-L{libkiln}", "-lkiln", f"-Wl,-rpath,{libkiln}", "-o", str(exe)], check=True)
    done = _run(exe, json.dumps(spec))
    assert done.returncode == 0, done.stderr
    ids = np.arange(16).reshape(2, 8) % 64
    model = oracle()
    expected = [model.train_step({"input_ids": ids, "labels": (ids + 1) % 64})["loss"] for _ in range(3)]
    rows = [line.split("|", 1) for line in done.stdout.splitlines()]
    for i, (numbers, error) in enumerate(rows):
        thread, status, *losses = numbers.split()
        assert (int(thread), int(status), [float.fromhex(x) for x in losses]) == (i, 0, expected)
        assert (json.loads(error)["code"] if error else None) == ("handle" if i == 0 else None)


def test_the_header_statuses_are_the_error_codes() -> None:
    header = (Path(kiln.embed.__file__).parent / "kiln.h").read_text()
    statuses = dict(re.findall(r"KILN_(?:ERR_)?(\w+) = (\d+)", header))
    assert {name.lower(): int(n) for name, n in statuses.items()} == \
        {code: i for i, code in enumerate(kiln.embed.CODES)}
