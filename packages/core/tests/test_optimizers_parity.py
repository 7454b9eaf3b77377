"""AdamW and its parameter groups against ``torch.optim.AdamW`` (``nox -s parity``): torch's default
(every parameter given is decayed) and the HF Trainer's (no decay for biases and norm weights)."""

from __future__ import annotations

import numpy as np
import pytest
from kiln_core_tiny import random_batch, tiny_qwen3_bundle

from kiln.core import HF_TRAINER_GROUPS, AdamW, Model

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.parity

STEPS = 4


def _batch(step: int) -> dict[str, np.ndarray]:
    b = random_batch(32, 2, 5, seed=step)
    return {"input_ids": b["input_ids"], "labels": b["labels"]}


@pytest.mark.parametrize("hf_groups", [False, True], ids=["torch-default", "hf-trainer"])
def test_adamw_groups_reproduce_torch(hf_groups: bool) -> None:
    opt = AdamW(lr=0.03, weight_decay=0.1, max_grad_norm=0.5, groups=HF_TRAINER_GROUPS if hf_groups else ())
    kiln = Model.from_ir(tiny_qwen3_bundle(), seed=0, dtype="float64", optimizer=opt)
    twin = Model.from_ir(tiny_qwen3_bundle(), seed=0, dtype="float64", optimizer=opt)  # gradients for torch
    params = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in kiln.parameters().items()}
    if hf_groups:  # what transformers' Trainer builds: no decay for norm modules' weights and biases
        no_decay = {k for k in params if "norm" in k.rsplit(".", 1)[-1] or k.endswith("norm.weight")
                    or k.endswith("bias")}
        assert no_decay and no_decay == {k for k, (s, _) in kiln.parameter_specs().items()
                                         if s.inferred_role() in ("bias", "norm")}
        groups = [{"params": [p for k, p in params.items() if k not in no_decay], "weight_decay": 0.1},
                  {"params": [p for k, p in params.items() if k in no_decay], "weight_decay": 0.0}]
    else:
        groups = [{"params": list(params.values()), "weight_decay": 0.1}]
    reference = torch.optim.AdamW(groups, lr=0.03, betas=(0.9, 0.999), eps=1e-8)
    for step in range(1, STEPS + 1):
        twin.set_parameters({k: p.detach().numpy() for k, p in params.items()})
        _, grads = twin.loss_and_grads(**_batch(step))
        for k, p in params.items():
            p.grad = torch.from_numpy(grads[k])
        torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm=0.5)
        reference.step()
        kiln.train_step(_batch(step))
    got = kiln.parameters()
    for k, p in params.items():
        np.testing.assert_allclose(got[k], p.detach().numpy(), rtol=1e-9, atol=1e-12, err_msg=k)


@pytest.mark.parametrize(("schedule", "hf_name", "min_lr_ratio"), [
    ("cosine", "cosine", 0.0), ("linear", "linear", 0.0), ("constant", "constant_with_warmup", 0.0),
    ("cosine", "cosine_with_min_lr", 0.1)])
def test_schedules_are_transformers_curves_point_by_point(schedule: str, hf_name: str,
                                                          min_lr_ratio: float) -> None:
    transformers = pytest.importorskip("transformers")
    total, warmup, lr = 40, 7, 3e-3
    param = torch.nn.Parameter(torch.zeros(1))
    reference = torch.optim.SGD([param], lr=lr)
    kwargs = {"scheduler_specific_kwargs": {"min_lr_rate": min_lr_ratio}} if min_lr_ratio else {}
    scheduler = transformers.get_scheduler(hf_name, reference, num_warmup_steps=warmup,
                                           num_training_steps=total, **kwargs)
    opt = AdamW(lr=lr, warmup_steps=warmup, total_steps=total, schedule=schedule, min_lr_ratio=min_lr_ratio)
    for step in range(1, total + 1):  # the HF Trainer: optimizer.step() with the current lr, then scheduler
        assert opt.lr_at(step) == pytest.approx(reference.param_groups[0]["lr"], rel=1e-12, abs=1e-15), step
        reference.step()
        scheduler.step()
