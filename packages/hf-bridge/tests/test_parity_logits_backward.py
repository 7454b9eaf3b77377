"""``Model.backward_from_logits`` against torch autograd: kiln's model as the first part of a torch graph.

transformers computes logits, a loss of torch's own is taken over them, and autograd differentiates
the whole: the gradient the loss gives the logits, handed to kiln, must give kiln's parameters the
gradients autograd gives transformers' (compared under the checkpoint's names, within 1e-4 of each
tensor's largest magnitude).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from kiln.hf import from_pretrained

sys.path.insert(0, str(Path(__file__).parent))
from test_parity_pretrained import VOCAB, assert_close, make_checkpoint, torch_grads_by_checkpoint_name

pytestmark = pytest.mark.parity
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("case", ["qwen3-tied", "qwen3-untied"])
def test_the_gradient_of_an_outer_loss_flows_back_through_kilns_model(case: str, tmp_path: Path) -> None:
    hf = make_checkpoint(case, tmp_path / "hf")
    model = from_pretrained(tmp_path / "hf", optimizer=None)
    ids = np.random.default_rng(3).integers(0, VOCAB, (2, 12))
    target = torch.randn(2, 12, VOCAB, generator=torch.Generator().manual_seed(5))

    logits = hf(torch.tensor(ids)).logits
    logits.retain_grad()
    outer = (torch.tanh(logits / 4) * target).pow(2).mean()  # any loss of torch's over the logits
    outer.backward()
    assert logits.grad is not None
    model.backward_from_logits(ids, logits.grad.numpy())

    expected = torch_grads_by_checkpoint_name(hf, tmp_path / "grads")
    grads = model.weights.export(model.gradients(), np.dtype(np.float32))  # by the checkpoint's names
    assert set(grads) == set(expected)
    for name, g in expected.items():
        assert_close(np.asarray(grads[name]), g, name)
