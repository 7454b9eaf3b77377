"""kiln-fixture-plugin: a real third-party kiln plugin, pip-installed by kiln's tests."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import pluggy

hookimpl = pluggy.HookimplMarker("kiln")  # the same marker as kiln.core's hookimpl


def fixture_identity(graph: Any) -> Any:
    """A graph pass that returns its input unchanged."""
    return graph


@hookimpl
def kiln_register_graph_passes(registry: Any) -> None:
    registry.register("fixture_identity", fixture_identity)


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
    from kiln.core import OpDef, TensorType

    same = lambda ctx: [TensorType(ctx.shape(0), ctx.dtype(0))]  # noqa: E731
    registry.register_op(OpDef("fixture_softsign", ("x",), ("y",), _softsign, same, backward=_softsign_rule,
                               samples=_samples,
                               doc="y = x / (1 + |x|), contributed by a third-party plugin"))
    registry.register_op(OpDef("fixture_softsign_backward", ("d_y", "x"), ("d_x",),
                               _softsign_backward_kernel, same, doc="gradient of fixture_softsign"))
