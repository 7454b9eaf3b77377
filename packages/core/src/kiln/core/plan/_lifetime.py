"""``@lifetime`` (seed 004 §7.2.3): how long the memory planner keeps a forward tensor's buffer.

By default a buffer lives from the step that writes it to its last reader, which is as tight as any
scope (``operation``, and ``sublayer``: kiln has no finer boundary). The annotation can only keep a
buffer longer, never free it earlier than a reader needs it:

- ``end=X``: until the step computing tensor ``X`` of the same graph (and layer);
- ``start=X``: from the step computing ``X``, which must not come after the tensor's own;
- ``scope="block"`` / ``"layer"``: until the last forward step of its layer (the model's forward for
  a tensor of the model's graph);
- ``scope="global"``: through the whole Program, so no other tensor reuses its memory.

Precedence (seed 004 §7.2.0): the recompute plan outranks it. A tensor the backward replays
(``@memory("recompute")``, ``@checkpoint``, an automatic plan) keeps its forward buffer to the end of
the forward at most, and a saved tensor already lives into the backward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kiln.core._errors import KilnError


def lifetime_spans(steps: Sequence[Any], model: Any, modules: Mapping[str, Any],
                   stacks: Mapping[str, str], replayed: Any) -> dict[str, tuple[int | None, int]]:
    """``key -> (first step or None, last step)`` for the forward tensors whose ``@lifetime`` keeps
    them longer than their readers; ``stacks`` maps a stack's key prefix to its block module and
    ``replayed`` holds the keys of the tensors the backward recomputes or fetches."""
    mods = {model.name: model, **modules}
    wanted = {(m.name, a.target): a for m in mods.values() for a in getattr(m, "annotations", ())
              if a.kind == "lifetime" and a.on == "tensor"}
    if not wanted:
        return {}
    fwd = [st for st in steps if st.phase == "forward" and not st.recompute and st.how != "optimizer"]
    fwd_end = max((st.index for st in fwd), default=-1)
    n = len(steps)
    where: dict[tuple[str, int | None, str], tuple[int, str]] = {}  # (module, layer, IR name) -> (step, key)
    layer_end: dict[tuple[str, int | None], int] = {}
    for st in fwd:
        head = next((k for k in st.outputs if k), "")
        module = model.name if st.layer is None else next(
            (m for pre, m in stacks.items() if head.startswith(pre)), model.name)
        layer_end[(module, st.layer)] = st.index
        for name, key in zip(st.op.outputs, st.outputs, strict=False):
            if name and key:
                where.setdefault((module, st.layer, name), (st.index, key))
    out: dict[str, tuple[int | None, int]] = {}
    for (module, layer, name), (index, key) in where.items():
        a = wanted.get((module, name))
        if a is None:
            continue
        args = dict(a.args)
        at = f" (annotated at {a.loc})" if a.loc else ""
        start: int | None = None
        last = index
        for arg in ("start", "end"):
            if arg in args:
                other = where.get((module, layer, str(args[arg])))
                if other is None:
                    raise KilnError(f"@lifetime({arg}={args[arg]!r}) on tensor {name!r} of {module!r}: "
                                    f"no forward step of that graph computes {args[arg]!r}{at}",
                                    hint="name a tensor the same graph computes", code="E002")
                if (arg == "start") != (other[0] <= index):
                    raise KilnError(f"@lifetime({arg}={args[arg]!r}) on tensor {name!r} of {module!r}: "
                                    f"{args[arg]!r} is computed {'after' if arg == 'start' else 'before'} "
                                    f"{name!r}{at}", hint="start= names an earlier tensor, end= a later one",
                                    code="E008")
                if arg == "start":
                    start = other[0]
                else:
                    last = max(last, other[0])
        scope = args.get("scope", "operation")
        if scope in ("block", "layer"):
            last = max(last, layer_end[(module, layer)])
        elif scope == "global":
            last = n - 1
        if key in replayed:  # the recompute plan frees it after the forward: that outranks a lifetime
            last = min(last, fwd_end)
        out[key] = (start, last)
    return out
