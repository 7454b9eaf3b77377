"""``kiln cuda check``: its tables and its exit status, which a broken kernel turns non-zero."""

from __future__ import annotations

import pytest

from kiln.core.cli import main
from kiln.cuda import _check, _specs
from kiln.cuda._specs import KernelSpec


def check(capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, str]:
    code = main(["cuda", "check", "--arch", "sm_90", *flags])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out


def row(out: str, first: str) -> str:
    return next(line for line in out.splitlines() if line.split()[:1] == [first])


def test_every_kernel_compiles_and_is_listed(capsys: pytest.CaptureFixture[str], cubins: dict) -> None:
    code, out = check(capsys, "--no-emulate")
    assert code == 0, out
    for name, spec in _specs.SPECS.items():
        assert spec.file in row(out, name) and "ok," in row(out, name) and "regs" in row(out, name)
    assert "emulator not run: --no-emulate" in out and "no failure" in out


def test_a_wrong_launch_layout_fails_the_check(capsys: pytest.CaptureFixture[str], cubins: dict,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(_specs.SPECS, "rope_f32", KernelSpec("rope_f32", "rope.cu", "ppppiiiiiifiii"))
    code, out = check(capsys, "--no-emulate")
    assert code == 1 and "1 failure(s)" in out, out
    assert "FAIL layout differs from the launch code's" in row(out, "rope_f32")


def test_an_emulated_error_above_tolerance_fails_the_check(capsys: pytest.CaptureFixture[str],
                                                           emulated: object,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    real = _check.run_case
    monkeypatch.setattr(_check, "run_case",
                        lambda case, device: 1.0 if case.id == "zeros" else real(case, device))
    code, out = check(capsys)
    assert code == 1 and "1 failure(s)" in out
    assert "FAIL 1.0e+00" in row(out, "zeros")
    assert "GPU only (tensor cores)" in row(out, "flash_attention_tc-causal")
    assert row(out, "flash_attention_twin-causal").split()[1] == "ok"
