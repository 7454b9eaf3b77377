"""``kiln cuda check``: every kernel compiled per architecture, its resources and argument layout, and
every kernel case run on the CPU emulator (and on the GPU when there is one) against the NumPy
reference; a non-zero exit on any failure."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kiln.core import KilnError

DEFAULT_ARCHS = ("sm_80", "sm_90")


def configure(p: argparse.ArgumentParser) -> None:
    from kiln.cuda._roofline import DEVICES, MATMUL

    p.add_argument("model", nargs="?",
                   help="roofline: the model, as kiln plan takes it (a kiln-dsl model name, an IR .json "
                        "file, a HF checkpoint folder or a kiln train config)")
    p.add_argument("--arch", default=",".join(DEFAULT_ARCHS),
                   help="check: comma-separated architectures to compile for (default %(default)s)")
    p.add_argument("--no-emulate", action="store_true",
                   help="check: skip running the kernels on the CPU emulator (compile and layout checks)")
    p.add_argument("--config", default=None, help="roofline: the model's config as a JSON object")
    p.add_argument("--device", default="h100", choices=sorted(DEVICES),
                   help="roofline: the GPU (default h100)")
    p.add_argument("--matmul", default="fp32", choices=MATMUL,
                   help="roofline: matmuls and attention on CUDA cores (fp32, as kiln's kernels run "
                        "today) or on tensor cores (tf32, bf16)")
    p.add_argument("--batch", type=int, default=None, help="roofline: batch size (default 8)")
    p.add_argument("--seq", type=int, default=None, help="roofline: sequence length (default 2048)")


def _archs(text: str) -> list[str]:
    archs = [a.strip() for a in text.split(",") if a.strip()]
    bad = [a for a in archs if not (a.startswith("sm_") and a[3:].isdigit())]
    if not archs or bad:
        raise KilnError(f"--arch {text!r}: expected architectures such as sm_80,sm_90")
    return archs


def compile_rows(archs: list[str]) -> tuple[list[list[str]], int]:
    """One row per kernel: per architecture its registers (or the failure), layout and spill checks;
    and the number of failures."""
    from kiln.cuda import _cubin, _nvrtc, _specs

    if _cubin.cuobjdump() is None:
        raise KilnError("cuobjdump is not installed, so CUBIN layouts cannot be read",
                        hint="pip install nvidia-cuda-cuobjdump")
    found: dict[tuple[str, str], str] = {}  # (kernel, arch) -> cell
    failures = 0
    for source in _specs.sources():
        kernels = [name for name, s in _specs.SPECS.items() if s.file == source.name]
        for arch in archs:
            try:
                cubin = _nvrtc.compile_cubin(source.name, arch).cubin
            except KilnError as e:
                failures += len(kernels)
                found.update({(k, arch): f"FAIL compile: {e.message.splitlines()[0]}" for k in kernels})
                continue
            layouts, res = _cubin.param_layouts(cubin), _cubin.resources(cubin)
            for k in kernels:
                problems = []
                if layouts.get(k) != _specs.SPECS[k].layout():
                    problems.append("layout differs from the launch code's")
                if k in res and res[k].local:
                    problems.append(f"spills {res[k].local} bytes")
                failures += bool(problems)
                regs = f"{res[k].registers} regs" if k in res else "?"
                found[k, arch] = f"FAIL {'; '.join(problems)}" if problems else f"ok, {regs}"
    rows = [[k, _specs.SPECS[k].file, *(found[k, a] for a in archs)] for k in sorted(_specs.SPECS)]
    return rows, failures


def case_rows(emulate: bool) -> tuple[list[list[str]], int, list[str]]:
    """One row per kernel case: its error on the emulator and on the GPU against the NumPy reference;
    the number of failures; why a device did not run (one line each)."""
    from kiln.cuda._check import CASES, run_case
    from kiln.cuda._plugin import unavailable_reason

    emulated = gpu = None
    why_no_emulator = why_no_gpu = None
    if emulate:
        from kiln.cuda._emulate import EmulatedDevice, compiler

        emulated = EmulatedDevice() if compiler() else None
        why_no_emulator = None if emulated else "no C++ compiler (g++)"
    else:
        why_no_emulator = "--no-emulate"
    why_no_gpu = unavailable_reason()
    if why_no_gpu is None:
        from kiln.cuda._device import CudaDevice

        gpu = CudaDevice()
    rows, failures = [], 0
    for case in CASES.values():
        cells = []
        for device in (emulated, gpu):
            if device is None:
                cells.append("not run")
                continue
            if case.gpu_only and device is emulated:
                cells.append("GPU only (tensor cores)")
                continue
            try:
                err = run_case(case, device)
            except Exception as e:  # a kernel that fails to run is a failure of this case, not of the tool
                failures += 1
                cells.append(f"FAIL {type(e).__name__}: {e}")
                continue
            ok = err <= case.atol
            failures += not ok
            cells.append(f"{'ok' if ok else 'FAIL'} {err:.1e} (<= {case.atol:.0e})")
        rows.append([case.id, *cells])
    notes = [f"{what} not run: {why}" for what, why in (("emulator", why_no_emulator), ("GPU", why_no_gpu))
             if why is not None]
    return rows, failures, notes


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in [header, ["-" * w for w in widths], *rows])


def run(args: Any) -> int:
    archs = _archs(args.arch)
    compiled, compile_failures = compile_rows(archs)
    print(_table(["kernel", "source", *archs], compiled))
    cases, case_failures, notes = case_rows(not args.no_emulate)
    print()
    print(_table(["case", "emulator (CPU)", "GPU"], cases))
    for note in notes:
        print(note)
    failures = compile_failures + case_failures
    runs = sum(cell not in ("not run", "GPU only (tensor cores)") for row in cases for cell in row[1:])
    print(f"\n{len(compiled)} kernels compiled for {', '.join(archs)}; {runs} runs of {len(cases)} cases: "
          + (f"{failures} failure(s)" if failures else "no failure"))
    sys.stdout.flush()
    return 1 if failures else 0


def run_roofline(args: Any) -> int:
    from kiln.core import compile
    from kiln.core.cli import load_model
    from kiln.cuda._roofline import roofline

    if not args.model:
        raise KilnError("kiln cuda roofline needs a model (e.g. Qwen3Model --config '{...}')")
    bundle, settings = load_model(args.model, args.config)
    batch, seq = args.batch or settings.get("batch", 8), args.seq or settings.get("seq", 2048)
    for flag, value in (("--batch", batch), ("--seq", seq)):
        if value < 1:
            raise KilnError(f"{flag} must be >= 1, found {value}")
    program = compile(bundle, bindings={"B": batch, "T": seq}, backend="numpy",
                      mode=settings.get("mode", "full"), recompute=settings.get("recompute", "none"))
    print(f"{args.model}, batch {batch} x {seq} tokens, one training step:")
    print(roofline(program, args.device, args.matmul).table())
    return 0
