"""The roofline prediction: a large matmul is bound by the device's compute peak, an elementwise op by
its bandwidth, tensor cores apply to matmuls only when asked; ``kiln cuda roofline`` prints it."""

from __future__ import annotations

from types import SimpleNamespace

import attrs
import pytest

from kiln.core import KilnError, compile
from kiln.core.cli import main
from kiln.cuda._roofline import DEVICES, roofline


def program(op: str, inputs: dict[str, tuple[int, ...]], attrs: dict[str, object]) -> SimpleNamespace:
    """A Program of one step (what roofline reads of one)."""
    tensors = {k: SimpleNamespace(shape=s, nbytes=4 * int.__mul__(*s[:2])) for k, s in inputs.items()}
    step = SimpleNamespace(how="out", op=SimpleNamespace(type=op), inputs=tuple(inputs), outputs=("y",),
                           attrs=attrs)
    return SimpleNamespace(steps=(step,), tensors=tensors, bindings={"B": 1, "T": 4096})


def test_a_large_matmul_is_compute_bound_on_cuda_cores_or_tensor_cores() -> None:
    n = 4096
    prog = program("matmul", {"a": (n, n), "b": (n, n)}, {"transpose": "NT"})
    h100 = DEVICES["h100"]
    flops = 2.0 * n**3  # the definition of a matmul, not kiln's cost table
    fp32, bf16 = roofline(prog, "h100", "fp32"), roofline(prog, "h100", "bf16")
    assert fp32.seconds == pytest.approx(flops / h100.fp32 + h100.launch, rel=1e-9)
    assert bf16.seconds == pytest.approx(flops / h100.tensor["bf16"] + h100.launch, rel=1e-9)
    assert fp32.by_op["matmul"][4] and bf16.mfu == pytest.approx(flops / bf16.seconds / h100.tensor["bf16"])


def test_an_elementwise_op_is_bandwidth_bound_and_gets_no_tensor_cores() -> None:
    prog = program("silu", {"x": (4096, 4096)}, {})
    a100 = DEVICES["a100"]
    fp32, bf16 = roofline(prog, "a100", "fp32"), roofline(prog, "a100", "bf16")
    assert fp32.seconds == bf16.seconds  # tensor cores do not run it
    assert fp32.seconds >= 2 * 4 * 4096**2 / a100.bandwidth  # at least a float32 read and write
    assert not fp32.by_op["silu"][4] and fp32.model_flops == 0.0


def test_unknown_devices_and_precisions_are_named() -> None:
    prog = program("silu", {"x": (8, 8)}, {})
    with pytest.raises(KilnError, match="unknown device 'v100'; kiln knows a100, h100, h200"):
        roofline(prog, "v100")
    with pytest.raises(KilnError, match="matmul='fp8' is not one of fp32, tf32, bf16"):
        roofline(prog, "h100", "fp8")


def test_kiln_cuda_roofline_prints_the_prediction(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("kiln.dsl", reason="the model is a kiln-dsl one")
    config = ('{"vocab_size": 512, "d_model": 64, "n_layers": 2, "num_query_heads": 4, "num_kv_heads": 2, '
              '"head_size": 16, "d_ff": 128, "max_seq": 256}')
    times = {}
    for matmul in ("fp32", "bf16"):
        code = main(["cuda", "roofline", "Qwen3Model", "--config", config, "--batch", "2", "--seq", "128",
                     "--matmul", matmul])
        out = capsys.readouterr().out
        assert code == 0 and "flash_attention_backward" in out, out
        last = out.strip().splitlines()[-1]
        assert last.startswith(f"predicted step on H100 SXM (matmuls in {matmul}): ") and "MFU" in last
        times[matmul] = float(last.split(": ")[1].split(" ms")[0])
    assert times["bf16"] < times["fp32"]


def test_bad_roofline_input_is_named_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("kiln.dsl", reason="the model is a kiln-dsl one")
    assert main(["cuda", "roofline", "Qwen3Model", "--config", "{not json"]) == 2
    err = capsys.readouterr().err
    assert "--config is neither a JSON object nor a JSON file" in err and "Traceback" not in err


def test_kiln_plan_device_prints_the_roofline(capsys: pytest.CaptureFixture[str]) -> None:
    """`kiln plan --device` asks the plugins (the kiln_step_time hook): kiln-kernels-cuda's roofline, in
    bf16 under the bf16 recipe; the H200's bandwidth makes the memory-bound steps faster than the H100's."""
    pytest.importorskip("kiln.dsl", reason="the model is a kiln-dsl one")
    from kiln.core import compile
    from kiln.core.cli import load_model

    config = ('{"vocab_size": 512, "d_model": 64, "n_layers": 2, "num_query_heads": 4, "num_kv_heads": 2, '
              '"head_size": 16, "d_ff": 128, "max_seq": 256}')
    seen = {}
    for device, precision in (("h100", "fp32"), ("H200", "fp32"), ("h100", "bf16")):
        code = main(["plan", "Qwen3Model", "--config", config, "--batch", "2", "--seq", "128", "--device",
                     device, "--precision", precision])
        out = capsys.readouterr().out
        assert code == 0 and f"predicted step time on {device}:" in out, out
        matmul = "bf16" if precision == "bf16" else "fp32"
        last = out.strip().splitlines()[-1].strip()
        assert last.startswith(f"predicted step on {device.upper()} SXM (matmuls in {matmul}): ")
        seen[device, precision] = float(last.split(": ")[1].split(" ms")[0])
    bundle, _ = load_model("Qwen3Model", config)
    program = compile(bundle, bindings={"B": 2, "T": 128}, recompute="dsl")  # kiln plan's default
    assert seen["h100", "fp32"] == pytest.approx(roofline(program, "h100", "fp32").seconds * 1e3, rel=1e-3)
    assert seen["H200", "fp32"] < seen["h100", "fp32"]
    # the bf16 Program's matmuls on tensor cores (its plan may fuse other steps than the fp32 one's)
    low = compile(bundle, bindings={"B": 2, "T": 128}, recompute="dsl", precision="bf16")
    assert seen["h100", "bf16"] == pytest.approx(roofline(low, "h100", "bf16").seconds * 1e3, rel=1e-3)
    assert seen["h100", "bf16"] < roofline(low, "h100", "fp32").seconds * 1e3


def test_kiln_plan_names_a_device_no_plugin_knows(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("kiln.dsl", reason="the model is a kiln-dsl one")
    assert main(["plan", "Qwen3Model", "--config", '{"n_layers": 1, "vocab_size": 64, "d_model": 32, '
                 '"num_query_heads": 2, "num_kv_heads": 1, "head_size": 16, "d_ff": 64}', "--batch", "1",
                 "--seq", "8", "--device", "tpu-v5"]) == 2
    err = capsys.readouterr().err
    assert "--device 'tpu-v5': no installed plugin predicts step times on it" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_program_compiled_for_numpy_is_priced_as_cuda_plans_it(precision: str) -> None:
    """``kiln plan --device`` compiles for ``numpy``, which plans no fused LM-head pass under bf16 (it has
    no bf16 pass); the roofline prices the head as the ``cuda`` backend runs it, one fused pass, in both
    recipes: the same price as a Program whose plan holds the fusion."""
    pytest.importorskip("ml_dtypes", reason="the bf16 recipe needs ml_dtypes")
    from kiln.dsl import build_bundle
    from kiln.dsl.stdlib.models import Qwen3Model

    bundle = build_bundle(Qwen3Model, {"vocab_size": 4096, "d_model": 64, "n_layers": 1, "num_query_heads": 4,
                                       "num_kv_heads": 2, "head_size": 16, "d_ff": 128, "max_seq": 64})
    prog = compile(bundle, bindings={"B": 2, "T": 64}, precision=precision)
    assert (prog.fusions == ()) == (precision == "bf16")  # numpy fuses the float32 head only
    matmul = "bf16" if precision == "bf16" else "fp32"
    costs = roofline(prog, "h100", matmul).by_op
    assert "fused_lm_head_loss_and_grad" in costs
    assert "fused_lm_head_loss" not in costs and "fused_lm_head_loss_backward" not in costs
    if precision == "fp32":  # the plan's own fusion and the one the roofline infers cost the same
        inferred = roofline(attrs.evolve(prog, fusions=()), "h100", matmul)
        assert inferred.seconds == pytest.approx(roofline(prog, "h100", matmul).seconds)


def test_kiln_plan_with_a_device_does_not_time_the_host_step(capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``--device`` and a plan that replays steps, ``kiln plan`` prints the device's prediction (the
    replays priced there) and does not calibrate this host's kernels over a whole step (minutes for a
    large model); without ``--device`` it does."""
    pytest.importorskip("kiln.dsl", reason="the model is a kiln-dsl one")
    from kiln.core.plan import _calibrate

    calls = []
    real = _calibrate.predict
    monkeypatch.setattr(_calibrate, "predict", lambda *a, **k: calls.append(1) or real(*a, **k))
    config = ('{"vocab_size": 512, "d_model": 64, "n_layers": 2, "num_query_heads": 4, "num_kv_heads": 2, '
              '"head_size": 16, "d_ff": 128, "max_seq": 256}')
    args = ["plan", "Qwen3Model", "--config", config, "--batch", "2", "--seq", "64", "--recompute", "block"]
    assert main([*args, "--device", "h100"]) == 0
    out = capsys.readouterr().out
    assert "predicted step time on h100:" in out and "recompute overhead" not in out and not calls
    assert main(args) == 0
    assert "recompute overhead: predicted" in capsys.readouterr().out and calls
