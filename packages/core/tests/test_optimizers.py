"""Optimizers in the Program's optimizer phase: AdamW and SGD with parameter groups, against float64
NumPy oracles written from torch's update rules (and torch itself, in ``nox -s parity``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from kiln_core_tiny import random_batch, tiny_qwen3_bundle

from kiln.core import (
    HF_TRAINER_GROUPS,
    SGD,
    AdamW,
    KilnError,
    Model,
    Optimizer,
    ParamGroup,
    compile,
    get_registry,
)

STEPS = 3


def _roles(model: Model) -> dict[str, str]:
    return {k: spec.inferred_role() for k, (spec, _) in model.parameter_specs().items()}


def _adamw_oracle(opt: AdamW) -> Callable[..., None]:
    def update(p: np.ndarray, g: np.ndarray, state: dict[str, np.ndarray], step: int, lr: float,
               wd: float) -> None:
        m = state.setdefault("m", np.zeros_like(p))
        v = state.setdefault("v", np.zeros_like(p))
        p *= 1 - lr * wd
        m[...] = opt.beta1 * m + (1 - opt.beta1) * g
        v[...] = opt.beta2 * v + (1 - opt.beta2) * g * g
        denom = np.sqrt(v / (1 - opt.beta2**step)) + opt.eps
        p -= lr / (1 - opt.beta1**step) * m / denom

    return update


def _sgd_oracle(opt: SGD) -> Callable[..., None]:
    def update(p: np.ndarray, g: np.ndarray, state: dict[str, np.ndarray], step: int, lr: float,
               wd: float) -> None:
        d = g
        if opt.momentum:
            if "buf" not in state:
                state["buf"] = g.copy()
            else:
                state["buf"] = opt.momentum * state["buf"] + (1 - opt.dampening) * g
            d = g + opt.momentum * state["buf"] if opt.nesterov else state["buf"]
        p *= 1 - lr * wd
        p -= lr * d

    return update


def _oracle_run(opt: Optimizer, update: Callable[..., None],
                groups: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """Train a float64 twin step by step: kiln's gradients, the oracle's update, clipping by hand."""
    model = Model.from_ir(tiny_qwen3_bundle(), seed=0, dtype="float64", optimizer=opt)
    params, state = model.parameters(), {k: {} for k in model.parameters()}
    for step in range(1, STEPS + 1):
        model.set_parameters(params)
        _, grads = model.loss_and_grads(**_batch(step))
        norm = np.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
        scale = opt.clip_scale(norm)
        for k, g in grads.items():
            wd, lr_scale = groups[k]
            update(params[k], scale * g, state[k], step, opt.lr_at(step) * lr_scale, wd)
    return params


def _kiln_run(opt: Optimizer) -> dict[str, Any]:
    model = Model.from_ir(tiny_qwen3_bundle(), seed=0, dtype="float64", optimizer=opt)
    for step in range(1, STEPS + 1):
        model.train_step(_batch(step))
    return model.parameters()


def _batch(step: int) -> dict[str, Any]:
    b = random_batch(32, 2, 5, seed=step)
    return {"input_ids": b["input_ids"], "labels": b["labels"]}


OPTIMIZERS = {
    "adamw-torch-default": AdamW(lr=0.05, weight_decay=0.1, max_grad_norm=0.5, warmup_steps=2),
    "adamw-hf-trainer": AdamW(lr=0.05, weight_decay=0.1, max_grad_norm=None, groups=HF_TRAINER_GROUPS),
    "adamw-lr-scale": AdamW(lr=0.05, weight_decay=0.1,
                            groups=[{"params": "blocks.*.attn.*", "lr_scale": 0.25}, {"roles": "norm",
                                                                                       "weight_decay": 0.0}]),
    "sgd-momentum": SGD(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "sgd-nesterov": SGD(lr=0.1, momentum=0.8, nesterov=True, groups=HF_TRAINER_GROUPS, weight_decay=0.2),
    "sgd-plain": SGD(lr=0.1),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_updates_match_the_float64_oracle(name: str) -> None:
    opt = OPTIMIZERS[name]
    model = Model.from_ir(tiny_qwen3_bundle(), seed=0, dtype="float64", optimizer=opt)
    groups = {k: opt.group(k, role) for k, role in _roles(model).items()}
    update = _adamw_oracle(opt) if isinstance(opt, AdamW) else _sgd_oracle(opt)  # type: ignore[arg-type]
    want, got = _oracle_run(opt, update, groups), _kiln_run(opt)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-10, atol=1e-12, err_msg=k)
    assert any(not np.allclose(got[k], model.parameters()[k]) for k in got)  # it trained


def test_groups_resolve_by_role_then_name_first_match_wins() -> None:
    model = Model.from_ir(tiny_qwen3_bundle(), seed=0)
    roles = _roles(model)
    assert roles["blocks.0.attn_norm.weight"] == "norm" and roles["blocks.0.mlp.up_weight"] == "weight"
    opt = AdamW(weight_decay=0.1, groups=[ParamGroup(params="blocks.1.*", lr_scale=0.0), *HF_TRAINER_GROUPS])
    assert opt.group("blocks.1.attn_norm.weight", "norm") == (0.1, 0.0)
    assert opt.group("blocks.0.attn_norm.weight", "norm") == (0.0, 1.0)
    assert opt.group("blocks.0.mlp.up_weight", "weight") == (0.1, 1.0)
    program = compile(tiny_qwen3_bundle(), bindings={"B": 2, "T": 5}, optimizer=opt)
    attrs = {s.inputs[0]: dict(s.attrs) for s in program.phase("optimizer") if s.op.type == "adamw_update"}
    assert attrs["blocks.1.mlp.up_weight"]["lr_scale"] == 0.0 and attrs["embedding"]["weight_decay"] == 0.1
    assert attrs["final_norm.weight"]["weight_decay"] == 0.0


def test_optimizers_come_from_the_registry_and_bad_settings_name_the_culprit() -> None:
    assert {"adamw", "sgd"} <= set(get_registry("optimizers").names())
    program = compile(tiny_qwen3_bundle(), bindings={"B": 2, "T": 5},
                      optimizer={"name": "sgd", "momentum": 0.9})
    updates = [s for s in program.phase("optimizer") if s.op.type != "grad_norm"]
    assert {s.op.type for s in updates} == {"sgd_update"} and len(updates) == len(program.params)
    state = {sl.name.split(".")[1] for sl in program.slots if sl.kind == "optimizer_state"}
    assert state == {"momentum_buffer"}
    with pytest.raises(KilnError, match=r"unknown name 'lion' in the optimizers registry; registered: "):
        compile(tiny_qwen3_bundle(), bindings={"B": 2, "T": 5}, optimizer="lion")
    with pytest.raises(KilnError, match=r"optimizer 'sgd': .*'betas'.* it takes"):
        compile(tiny_qwen3_bundle(), bindings={"B": 2, "T": 5}, optimizer={"name": "sgd", "betas": 0.9})
    with pytest.raises(KilnError, match=r"parameter group key\(s\) decay unknown"):
        AdamW(groups=[{"decay": 0.0}])
    with pytest.raises(KilnError, match="parameter role 'norms' is not one of"):
        ParamGroup(roles="norms")
    with pytest.raises(KilnError, match="Nesterov momentum needs momentum > 0"):
        SGD(nesterov=True)


def test_grad_sync_runs_between_backward_and_optimizer_and_is_empty_on_one_process() -> None:
    program = compile(tiny_qwen3_bundle(), bindings={"B": 2, "T": 5})
    phases = [s.phase for s in program.steps]
    assert phases.index("optimizer") > max(i for i, p in enumerate(phases) if p == "backward")
    assert program.phase("grad_sync") == ()


def test_state_dict_carries_the_optimizers_own_state() -> None:
    a = Model.from_ir(tiny_qwen3_bundle(), seed=0, optimizer=SGD(lr=0.1, momentum=0.9))
    a.train_step(_batch(1))
    state = a.state_dict()
    assert state["optimizer"]["name"] == "sgd"
    assert set(state["optimizer"]) == {"name", "step", "momentum_buffer"}
    b = Model.from_ir(tiny_qwen3_bundle(), seed=1, optimizer=SGD(lr=0.1, momentum=0.9))
    b.load_state_dict(state)
    assert a.train_step(_batch(2)) == b.train_step(_batch(2))
    with pytest.raises(KilnError, match="the state is of optimizer 'sgd'; this model trains with 'adamw'"):
        Model.from_ir(tiny_qwen3_bundle(), seed=0).load_state_dict(state)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_schedules_follow_the_hf_trainer_step_convention(schedule: str) -> None:
    """Update t takes the factor of scheduler step t - 1 (transformers' get_scheduler curves)."""
    import math

    total, warmup = 20, 5

    def factor(s: int) -> float:  # transformers' lr_lambda, written out
        if s < warmup:
            return s / warmup
        progress = (s - warmup) / (total - warmup)
        return {"cosine": 0.5 * (1 + math.cos(math.pi * progress)), "linear": 1 - progress,
                "constant": 1.0}[schedule]

    opt = SGD(lr=0.1, warmup_steps=warmup, total_steps=total, schedule=schedule)
    assert [opt.lr_at(t) for t in range(1, total + 1)] == pytest.approx([0.1 * factor(t - 1)
                                                                         for t in range(1, total + 1)])
    with pytest.raises(KilnError, match="schedule"):
        SGD(schedule="exponential")


def test_gradient_accumulation_equals_the_full_batch() -> None:
    opt = AdamW(lr=0.05, weight_decay=0.1, max_grad_norm=0.5)
    full, accumulated = (Model.from_ir(tiny_qwen3_bundle(), seed=0, dtype="float64", optimizer=opt)
                         for _ in range(2))
    for step in range(1, 4):
        batch = random_batch(32, 4, 5, seed=step)
        batch["labels"][1, :3] = -100  # the micro-batches hold different numbers of scored tokens
        a = full.train_step(batch)
        b = accumulated.train_step(batch, micro_batches=2)
        assert b["tokens"] == a["tokens"] and b["loss"] == pytest.approx(a["loss"], rel=1e-12)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-12)
    assert accumulated.memory_report()["peak"] < full.memory_report()["peak"]  # a micro-batch's Program
    want, got = full.parameters(), accumulated.parameters()
    assert all(np.allclose(got[k], want[k], rtol=1e-10, atol=1e-13) for k in want)
    with pytest.raises(KilnError, match="micro_batches=3 must be a positive int dividing the batch of 4"):
        accumulated.train_step(random_batch(32, 4, 5), micro_batches=3)
