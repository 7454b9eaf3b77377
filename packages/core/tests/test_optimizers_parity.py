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
