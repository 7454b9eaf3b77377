"""``@kernel`` and ``@nofuse`` (seed 004 §7.5): the kernel each annotated tensor's op runs.

:func:`~kiln.core.plan.compile` applies them to the Program it returns, after the memory plan (an
``out`` kernel must not write over an input the plan shares its memory with), so every entry point
(``compile``, a ``Model``'s Programs, ``kiln plan``) runs and shows one choice.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from kiln.core._errors import KilnError
from kiln.core.ir._ir import Annotation, Module

if TYPE_CHECKING:
    from kiln.core.plan._program import Program, Step


def annotated_kernels(program: Program, model: Module, modules: Mapping[str, Module], kernels: Any,
                      backend: Any) -> Program:
    """The Program with the kernel choices of ``@kernel`` and ``@nofuse`` applied to the steps computing
    the annotated tensors (forward steps and their backward replays alike, so a recompute gives the same
    bits): ``@kernel("reference")`` runs the op's reference kernel, ``@kernel(key)`` the kernel-table
    kernel ``key`` (``op@backend:dtype``) of that op; a kernel that cannot run the step keeps the
    table's choice, or with ``fallback=False`` is a KilnError. ``@nofuse`` drops the fusions
    (``Program.fusions``) that would run the step inside a fused kernel."""
    mods = {model.name: model, **modules}
    wanted: dict[tuple[str, str], list[Annotation]] = {}
    for m in mods.values():
        for a in m.annotations:
            if a.on == "tensor" and a.kind in ("kernel", "nofuse"):  # both may annotate one tensor
                wanted.setdefault((m.name, a.target), []).append(a)
    if not wanted:
        return program
    stacks = {f"{p.name}.": p.array_of for p in model.params if p.array_of}
    steps, unfused = list(program.steps), set()
    names = {backend.name, getattr(backend, "kernel_fallback", None)}
    for i, step in enumerate(steps):
        if step.phase not in ("forward", "backward") or step.how in ("alias", "copy", "optimizer"):
            continue
        first = next((k for k in step.outputs if k), "")
        module = (model.name if step.layer is None
                  else next((m for prefix, m in stacks.items() if first.startswith(prefix)), model.name))
        for ir_name, a in ((n, a) for n in step.op.outputs for a in wanted.get((module, n), ())):
            if a.kind == "nofuse":
                unfused.add(step.index)
                continue
            name = str(a.args["name"])
            kernel = kernels[name] if name != "reference" and name in kernels else None  # a registry: no .get
            why = ""
            if name != "reference" and kernel is None:
                why = "it is not in the kernel table"
            elif kernel is not None and kernel.op != step.op.type:
                why = f"it is a kernel of {kernel.op!r}"
            elif kernel is not None and kernel.backend not in names:
                why = f"it runs on backend {kernel.backend!r}"
            elif kernel is not None and kernel.out and _overlap(program, step):
                why = "it writes its outputs while the plan reuses an input's memory for them"
            if why:
                if a.args.get("fallback", True) is False:
                    where = f" (annotated at {a.loc})" if a.loc else ""
                    raise KilnError(f"@kernel({name!r}) on tensor {ir_name!r} of {module!r}: {why}",
                                    hint="kernels of the op: "
                                    + ", ".join(k for k, v in kernels.items() if v.op == step.op.type)
                                    + f"; or 'reference'{where}")
                continue
            steps[i] = attrs.evolve(step, kernel="" if kernel is None else name,
                                    how="out" if kernel is not None and kernel.out else "kernel")
    fusions = tuple(f for f in program.fusions if not unfused & set(f.steps))
    return attrs.evolve(program, steps=tuple(steps), fusions=fusions)


def _overlap(program: Program, step: Step) -> bool:
    def ranges(keys: Iterable[str]) -> list[tuple[int, int]]:
        ts = [program.tensors[k] for k in keys if k]
        return [(t.offset, t.offset + t.nbytes) for t in ts]

    return any(a < d and c < b for a, b in ranges(step.outputs) for c, d in ranges(step.inputs))
