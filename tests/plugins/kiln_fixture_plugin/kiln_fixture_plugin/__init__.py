"""kiln-fixture-plugin: a real third-party kiln plugin, pip-installed by kiln's tests."""

from __future__ import annotations

import argparse
import collections
from collections.abc import Callable
from typing import Any

import numpy as np
import pluggy

hookimpl = pluggy.HookimplMarker("kiln")  # the same marker as kiln.core's hookimpl


#: what the plugin ran, for the tests to read: pass and kernel calls, steps per op type on its backend
CALLS: collections.Counter[str] = collections.Counter()


def fixture_identity(bundle: Any, options: Any) -> Any:
    """An ``adapt`` graph pass that returns its input unchanged (and counts its calls)."""
    CALLS["fixture_identity"] += 1
    return bundle


@hookimpl
def kiln_register_graph_passes(registry: Any) -> None:
    from kiln.core import GraphPass

    registry.register("fixture_identity", GraphPass("fixture_identity", fixture_identity, "adapt",
                                                    doc="returns the IR unchanged"))


class CountingBackend:
    """A second backend: host memory like ``numpy``, whose kernels it runs where it has none of its own
    (``kernel_fallback``), counting every step it runs by op type in ``CALLS``."""

    name = "fixture_counting"
    device = "cpu"
    dtypes = ("float32", "float64")
    capabilities = frozenset({"fused_lm_head_loss_and_grad"})
    kernel_fallback = "numpy"
    reference = True

    def __init__(self) -> None:
        from kiln.core import NumpyBackend

        self.host = NumpyBackend()

    def allocate(self, nbytes: int) -> Any:
        return self.host.allocate(nbytes)

    def copy(self, src: Any, dst: Any, nbytes: int) -> None:
        self.host.copy(src, dst, nbytes)

    def read(self, buffer: Any, offset: int, shape: tuple[int, ...], dtype: str) -> Any:
        return self.host.read(buffer, offset, shape, dtype)

    def write(self, buffer: Any, offset: int, value: Any) -> None:
        self.host.write(buffer, offset, value)

    def compile(self, program: Any, buffer: Any, kernels: Any) -> Any:
        return _Counting(program, self.host.compile(program, buffer, kernels))


class _Counting:
    def __init__(self, program: Any, inner: Any) -> None:
        self.program, self.inner = program, inner

    def run(self, phases: Any, *, hyper: Any) -> Any:
        phases = list(phases)
        for step in self.program.steps:
            if step.phase in phases and step.how != "alias":
                CALLS[f"step:{step.op.type}"] += 1
        return self.inner.run(phases, hyper=hyper)

    def read(self, name: str) -> Any:
        return self.inner.read(name)

    def write(self, name: str, value: Any) -> None:
        self.inner.write(name, value)


@hookimpl
def kiln_register_backends(registry: Any) -> None:
    registry.register("fixture_counting", CountingBackend())


@hookimpl
def kiln_register_kernels(registry: Any) -> None:
    numpy_matmul = registry.find("matmul", "numpy", "*")  # core registered first

    def counting_matmul(*args: Any, **kwargs: Any) -> None:
        CALLS["kernel:matmul"] += 1
        numpy_matmul.fn(*args, **kwargs)

    registry.register_kernel("matmul", "fixture_counting", "*", counting_matmul, out=True,
                             inplace=numpy_matmul.inplace)


def _sign_update(p: Any, g: Any, work: Any, *, step: int, lr: float, scale: float, weight_decay: float,
                 lr_scale: float) -> None:
    """signSGD: ``p -= lr * sign(g)`` (the clipping scale does not change a sign)."""
    lr = lr * lr_scale
    if weight_decay:
        p *= 1 - lr * weight_decay
    p -= lr * np.sign(g)


def _sign_optimizer() -> Any:
    import attrs

    from kiln.core import Optimizer

    @attrs.frozen(kw_only=True)
    class SignSGD(Optimizer):
        """signSGD (Bernstein et al. 2018), from a plugin: ``p -= lr * sign(g)``."""

        name = "fixture_signsgd"
        update_op = "fixture_signsgd_update"

    return SignSGD


@hookimpl
def kiln_register_optimizers(registry: Any) -> None:
    registry.register("fixture_signsgd", _sign_optimizer())


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", default="kiln")


def _hello(args: argparse.Namespace) -> int:
    print(f"hello from kiln-fixture-plugin, {args.name}")
    return 0


@hookimpl
def kiln_cli_commands(register: Callable[..., None]) -> None:
    register(
        "fixture-hello", help="print a greeting from the fixture plugin", configure=_configure, run=_hello
    )


def _softsign(x: Any) -> Any:
    return x / (1 + abs(x))


def _softsign_backward_kernel(d: Any, x: Any) -> Any:
    return d / (1 + abs(x)) ** 2


def _softsign_rule(ctx: Any) -> list[str | None]:
    if not ctx.needs_grad(0):
        return [None]
    return [ctx.emit("fixture_softsign_backward", ctx.d_out, ctx.saved(0))]


def _samples(rng: Any) -> Any:
    from kiln.core import Sample

    yield Sample((rng.standard_normal((3, 4)),))


@hookimpl
def kiln_register_ops(registry: Any) -> None:
    from kiln.core import AttrSpec, OpDef, TensorType

    same = lambda ctx: [TensorType(ctx.shape(0), ctx.dtype(0))]  # noqa: E731
    registry.register_op(OpDef("fixture_softsign", ("x",), ("y",), _softsign, same, backward=_softsign_rule,
                               samples=_samples,
                               doc="y = x / (1 + |x|), contributed by a third-party plugin"))
    registry.register_op(OpDef("fixture_softsign_backward", ("d_y", "x"), ("d_x",),
                               _softsign_backward_kernel, same, doc="gradient of fixture_softsign"))
    registry.register_op(OpDef("fixture_signsgd_update", ("param", "grad", "work"), (), _sign_update,
                               lambda ctx: [], attrs=(AttrSpec("weight_decay", "float", 0.0),
                                                      AttrSpec("lr_scale", "float", 1.0)),
                               doc="In place: one signSGD step of param."))
