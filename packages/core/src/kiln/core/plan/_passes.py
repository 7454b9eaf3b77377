"""Graph passes: named IR-to-IR functions that ``compile`` runs in declared stages.

``compile`` lowers a model through the stages ``adapt`` (adapters such as LoRA) → ``shard``
(tensor-parallel sharding) → ``autodiff`` → ``recompute`` → ``schedule`` → ``memory``. The first two
take passes from plugins (``kiln_register_graph_passes``): a pass is asked for by name in
``compile(passes=[...])``, runs on the whole Bundle, and must return a new one (IR is immutable). The
other stages are kiln's own. Every pass run is recorded in the Program (``Program.passes``: stage,
name, seconds), which ``kiln plan`` prints.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from kiln.core._errors import KilnError
from kiln.core.ir._ir import Bundle

__all__ = ["GRAPH_STAGES", "PLUGIN_STAGES", "GraphPass", "PassRun", "ignore_index_pass", "run_passes"]

GRAPH_STAGES = ("adapt", "shard", "autodiff", "recompute", "schedule", "memory")
#: the stages whose passes come from plugins (the others are kiln's own)
PLUGIN_STAGES = ("adapt", "shard")


@attrs.frozen
class GraphPass:
    """A graph pass: ``fn(bundle, options) -> bundle`` run in ``stage`` (``adapt`` or ``shard``).

    A plain function registered in the ``graph_passes`` registry is an ``adapt`` pass.
    """

    name: str
    fn: Callable[[Bundle, Mapping[str, Any]], Bundle]
    stage: str = attrs.field(default="adapt", validator=attrs.validators.in_(PLUGIN_STAGES))
    doc: str = ""


@attrs.frozen
class PassRun:
    """One pass as a Program records it."""

    stage: str
    name: str
    seconds: float


PassSpec = str | tuple[str, Mapping[str, Any]]


def _lookup(registry: Any, spec: PassSpec) -> tuple[GraphPass, Mapping[str, Any]]:
    name, options = (spec, {}) if isinstance(spec, str) else spec
    if not isinstance(name, str) or not isinstance(options, Mapping):
        raise KilnError(f"a pass is a name or (name, options dict), found {spec!r}")
    entry = registry[name]  # an unknown name lists the registered passes
    if isinstance(entry, GraphPass):
        return entry, options
    if not callable(entry):
        raise KilnError(f"graph pass {name!r} is a {type(entry).__name__}, "
                        "neither a GraphPass nor a function")
    return GraphPass(name, entry), options


def ignore_index_pass(bundle: Bundle, options: Mapping[str, Any]) -> Bundle:
    """``("ignore_index", {"value": v})``: every op of the bundle with an ``ignore_index`` attribute
    (the losses; -100 by default, as transformers) ignores the label ``v`` instead."""
    from kiln.core.ops.library import op_registry

    value = options.get("value")
    if set(options) != {"value"} or isinstance(value, bool) or not isinstance(value, int):
        raise KilnError(f"graph pass 'ignore_index' takes {{'value': int}}, found {dict(options)!r}")
    registry = op_registry()

    def takes(op_type: str) -> bool:
        return op_type in registry and any(a.name == "ignore_index" for a in registry.get_op(op_type).attrs)

    modules = []
    for m in bundle.modules:
        if m.forward is not None and any(takes(op.type) for op in m.forward.ops):
            ops = tuple(op.evolve(attrs={**op.attrs, "ignore_index": value}) if takes(op.type) else op
                        for op in m.forward.ops)
            m = m.evolve(forward=m.forward.evolve(ops=ops))
        modules.append(m)
    return bundle.evolve(modules=tuple(modules))


def run_passes(bundle: Bundle, passes: Sequence[PassSpec], registry: Any) -> tuple[Bundle, list[PassRun]]:
    """``bundle`` after the named passes, stage by stage (in the order given within a stage)."""
    found = [_lookup(registry, spec) for spec in passes]
    runs: list[PassRun] = []
    for stage in PLUGIN_STAGES:
        for gp, options in (f for f in found if f[0].stage == stage):
            t0 = time.perf_counter()
            out = gp.fn(bundle, options)
            if not isinstance(out, Bundle):
                raise KilnError(f"graph pass {gp.name!r} returned {type(out).__name__}, not a Bundle",
                                hint="a pass takes the Bundle and its options and returns a new Bundle")
            bundle = out
            runs.append(PassRun(stage, gp.name, time.perf_counter() - t0))
    return bundle, runs
