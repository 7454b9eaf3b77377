"""The auto planner against exhaustive search on small random graphs (issue 6, acceptance 5).

Each graph is a block of elementwise ops, weight matmuls, views and a dropout over tensors of random
sizes, with a random set of tensors its backward reads and random op costs. The exhaustive optimum tries
every set of kept tensors; the planner must come within 1.1x of its recomputed FLOPs at every budget,
keep within the budget, and keep less as the budget shrinks.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest
from kiln_core_tiny import tiny_qwen3_bundle

from kiln.core import Cost, KilnError, compile, hookimpl, op_registry, register_plugin, reset_plugins
from kiln.core.ir import FrozenDict, Graph, Module, Op, TensorDecl
from kiln.core.recompute import BlockContext, PlanContext, pareto, plan_context, plan_recompute

UNARY, BINARY = ("relu", "silu", "gelu"), ("add", "mul")
MATMULS = {"matmul"}


def random_block(rng: np.random.Generator, n_ops: int) -> PlanContext:
    act = ["N", "C"]
    tensors = ["x"]
    ops: list[Op] = []
    for k in range(n_ops):
        kind = rng.choice(["unary", "binary", "matmul", "view", "dropout"], p=[0.3, 0.25, 0.2, 0.15, 0.1])
        pick = lambda: str(rng.choice(tensors[-4:]))  # noqa: E731  (mostly local, chain-like graphs)
        out = f"t{k}"
        if kind == "unary":
            ops.append(Op(str(rng.choice(UNARY)), [pick()], [out]))
        elif kind == "binary":
            ops.append(Op(str(rng.choice(BINARY)), [pick(), pick()], [out]))
        elif kind == "matmul":
            ops.append(Op("matmul", [pick(), "w"], [out], {"transpose": "NT"}))
        elif kind == "view":
            ops.append(Op("view", [pick()], [out], {"shape": act}))
        else:
            ops.append(Op("dropout", [pick()], [out], {"p": 0.1, "seed": int(k)}))
        tensors.append(out)
    g = Graph("R", inputs=[TensorDecl("x", act, "fp32")], params=[TensorDecl("w", ["C", "C"], "fp32")],
              ops=ops, outputs=[TensorDecl(tensors[-1], act, "fp32")])
    sizes = {t: 64 * int(rng.integers(1, 16)) for t in tensors}
    costs = tuple(Cost(0.0, 0.0) if op.type == "view" else
                  Cost(float(rng.integers(200, 2000)) if op.type in MATMULS else float(rng.integers(1, 40)),
                       float(rng.integers(1, 10))) for op in ops)
    needed = [t for t in tensors[1:] if rng.random() < 0.5] or [tensors[-1]]
    block = Module("R", kind="block", config={"C": 4}, forward=g)
    ctx = BlockContext(block, 1, tuple(needed), FrozenDict(sizes), costs)
    return PlanContext(Module("M", kind="model"), (ctx,), registry=op_registry())


def roots(ctx: PlanContext) -> dict[str, str]:
    """tensor -> the tensor whose storage it uses (a view uses its input's)."""
    g = ctx.blocks[0].module.forward
    assert g is not None
    root = {"x": "x", "w": "w"}
    for op in g.ops:
        root[op.outputs[0]] = root[op.inputs[0]] if op.type == "view" else op.outputs[0]
    return root


def exhaustive(ctx: PlanContext) -> list[tuple[int, float, bool]]:
    """(bytes kept, FLOPs replayed, replays a matmul) of every feasible set of kept roots."""
    b = ctx.blocks[0]
    g = b.module.forward
    assert g is not None
    producer = g.producers()
    root = roots(ctx)
    candidates = sorted({r for r in root.values() if r not in ("x", "w")})
    needed = {root[t] for t in b.saves} - {"x", "w"}
    out = []
    for n in range(len(candidates) + 1):
        for kept in itertools.combinations(candidates, n):
            keep = set(kept) | {"x", "w"}
            replay: set[int] = set()
            todo = [t for t in needed if t not in keep]
            while todo:
                k = producer[todo.pop()]
                op = g.ops[k]
                if k in replay:
                    continue
                replay.add(k)
                todo += [root[i] for i in op.inputs if root[i] not in keep]
                todo += [op.inputs[0]] if op.type == "view" and op.inputs[0] not in keep else []
            flops = sum(b.costs[k].flops for k in replay)
            matmul = any(g.ops[k].type in MATMULS for k in replay)
            out.append((sum(int(b.sizes[r]) for r in kept), flops, matmul))
    return out


def optimum(solutions: list[tuple[int, float, bool]], budget: int) -> float | None:
    fits = [s for s in solutions if s[0] <= budget]
    plain = [s for s in fits if not s[2]]
    pool = plain or fits
    return min(s[1] for s in pool) if pool else None


@pytest.mark.parametrize("seed", range(40))
def test_auto_is_within_1_1x_of_the_exhaustive_optimum_and_monotone(seed: int) -> None:
    rng = np.random.default_rng(seed)
    ctx = random_block(rng, int(rng.integers(4, 10)))
    solutions = exhaustive(ctx)
    reference = max(s[0] for s in solutions if s[1] == 0)  # keep all the backward reads
    budgets = {s[0] for s in solutions if 0 < s[0] <= reference} | {reference // 2, reference // 3}
    budgets = sorted(budgets - {0}, reverse=True)
    last = math.inf
    for budget in budgets:
        best = optimum(solutions, budget)
        if best is None:
            with pytest.raises(KilnError, match="no recompute plan"):
                plan_recompute(ctx, "auto", budget=budget)
            continue
        plan = plan_recompute(ctx, "auto", budget=budget)
        assert plan.planned_bytes is not None and plan.planned_bytes <= budget
        assert plan.extra_flops <= 1.1 * best + 1e-9, (seed, budget, plan.extra_flops, best)
        assert plan.planned_bytes <= last  # a smaller budget never keeps more
        last = plan.planned_bytes
        # what the plan says it replays is what the backward needs, from what it keeps, counted here again
        block = plan.blocks[0]
        needed = set(ctx.blocks[0].saves)
        assert needed <= set(block.saved) | set(block.recomputed)
        kept = {roots(ctx)[t] for t in block.saved} - {"x", "w"}
        assert sum(int(ctx.blocks[0].sizes[r]) for r in kept) == plan.planned_bytes


def test_the_front_has_the_exhaustive_trade_offs() -> None:
    for seed in range(12):
        ctx = random_block(np.random.default_rng(100 + seed), 7)
        solutions = exhaustive(ctx)
        front = pareto(ctx, allow_matmul=True)
        for s_bytes, s_flops, _ in solutions:  # every exhaustive solution is matched or beaten by the front
            assert any(p.bytes <= s_bytes and p.flops <= s_flops for p in front), (seed, s_bytes, s_flops)
        assert [p.bytes for p in front] == sorted((p.bytes for p in front), reverse=True)
        assert [p.flops for p in front] == sorted(p.flops for p in front)


def test_matmuls_are_replayed_only_when_the_budget_forces_it() -> None:
    ctx = plan_context(tiny_qwen3_bundle(num_layers=2), bindings={"B": 2, "T": 8})
    front = pareto(ctx)
    plain = [p for p in front if not p.matmul]
    assert plain and any(p.matmul for p in front)
    floor = min(p.bytes for p in plain)
    assert all(p.bytes < floor for p in front if p.matmul)
    for p in front:
        plan = plan_recompute(ctx, "auto", budget=p.bytes)
        types = {op.op_type for b in plan.blocks for op in b.ops}
        assert bool(types & {"matmul", "flash_attention"}) == (p.bytes < floor), p
    with pytest.raises(KilnError, match="no recompute plan"):
        plan_recompute(ctx, "auto", budget=floor - 1, options={"allow_matmul": False})


def test_planned_saved_bytes_are_what_the_memory_planner_places() -> None:
    """Every point of the front, compiled through a plugin that returns it, places exactly its bytes."""
    from kiln.core.plan._recompute_auto import to_plan

    bundle = tiny_qwen3_bundle(num_layers=3)
    binds = {"B": 2, "T": 8}
    ctx = plan_context(bundle, bindings=binds)
    chosen: list[Any] = []

    class Fixed:
        @hookimpl
        def kiln_plan_recompute(self, layout: PlanContext) -> Any:
            return to_plan(layout, chosen[0])

    reset_plugins()
    register_plugin(Fixed(), "fixed-point")
    try:
        for point in pareto(ctx):
            chosen[:] = [point]
            program = compile(bundle, bindings=binds, recompute="auto")
            assert program.recompute.planner == "fixed-point"
            assert program.memory_report()["saved_activations"] == point.bytes
    finally:
        reset_plugins()
