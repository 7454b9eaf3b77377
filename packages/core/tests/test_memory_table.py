"""``Program.memory_table()``: one row per kind of the memory report, the host pool's row only where the
plan offloads activations to it (the oracle: the report's own bytes and the host slots)."""

from __future__ import annotations

from pathlib import Path

import pytest
from kiln_core_tiny import tiny_qwen3_bundle

from kiln.core import compile
from kiln.core.cli._cli import main

BINDS = {"B": 2, "T": 8}


def rows(table: str) -> dict[str, str]:
    return {line.split()[0]: line for line in table.splitlines() if line.split()}


@pytest.mark.parametrize("recompute", ["none", "block", "auto"])
def test_a_plan_that_offloads_nothing_has_no_host_row(recompute: str) -> None:
    prog = compile(tiny_qwen3_bundle(), bindings=BINDS, recompute=recompute)
    assert prog.host_bytes == 0 and not any(sl.kind == "host" for sl in prog.slots)
    table = rows(prog.memory_table())
    assert "host" not in table
    report = prog.memory_report()
    for kind in ("weights", "gradients", "optimizer_state", "inputs", "outputs", "saved_activations",
                 "transient", "peak"):
        assert kind in table and report[kind] >= 0


def test_an_offloading_plan_shows_its_host_pool() -> None:
    prog = compile(tiny_qwen3_bundle(), bindings=BINDS, recompute="offload")
    n = sum(1 for sl in prog.slots if sl.kind == "host")
    assert prog.host_bytes > 0 and n > 0
    host = rows(prog.memory_table())["host"]
    assert f"{prog.host_bytes / 1024:.2f} KiB" in host and f"(pool of {n} offloaded tensors" in host


def test_kiln_plan_prints_the_host_row_only_when_it_offloads(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tiny.json"
    path.write_text(tiny_qwen3_bundle().to_json())
    assert main(["plan", str(path), "--batch", "2", "--seq", "8"]) == 0
    out = capsys.readouterr().out
    assert "peak" in rows(out) and "host" not in rows(out)
    assert main(["plan", str(path), "--recompute", "offload", "--batch", "2", "--seq", "8"]) == 0
    assert "host" in rows(capsys.readouterr().out)
