"""kiln inside a torch training loop: a program handle as a ``torch.nn.Module``.

The module's arena is a torch tensor, bound into kiln through DLPack; its parameters and the
gradients its backward hands to autograd are views of that tensor, so kiln's forward and backward
run on the very memory torch's optimizer updates, and nothing is copied between the two.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kiln.embed._handle import EmbedError, ProgramHandle


def _host(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise EmbedError("argument", "KilnModule runs on the CPU (kiln's numpy backend); the batch "
                             f"is on {value.device}", "input_ids")
        return value.detach().numpy()
    return np.asarray(value)


class _KilnLoss(torch.autograd.Function):
    """The mean loss of kiln's forward; its backward is kiln's planned backward (recompute included)."""

    @staticmethod
    def forward(ctx: Any, module: KilnModule, input_ids: Any, labels: Any,
                *params: torch.Tensor) -> torch.Tensor:
        loss, ctx.forward_id = module.handle.loss(_host(input_ids), _host(labels))
        ctx.module = module
        return params[0].new_tensor(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        module: KilnModule = ctx.module
        grads = module._writable_gradients()
        module.handle.backward(ctx.forward_id, float(grad))
        return (None, None, None, *grads)


class _KilnLogits(torch.autograd.Function):
    """kiln's logits; their backward is kiln's backward seeded with the logits' gradient."""

    @staticmethod
    def forward(ctx: Any, module: KilnModule, input_ids: Any, *params: torch.Tensor) -> torch.Tensor:
        ctx.module, ctx.ids = module, np.array(_host(input_ids))
        return torch.from_numpy(module.handle.logits(ctx.ids))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        module: KilnModule = ctx.module
        grads = module._writable_gradients()
        module.handle.logits_backward(ctx.ids, grad.detach().numpy())
        return (None, None, *grads)


class KilnModule(torch.nn.Module):
    """A compiled kiln program (a :class:`ProgramHandle`) as a torch module on the CPU.

    ``module(input_ids, labels)`` is the mean loss of kiln's forward (dropout on); ``backward()`` on it
    runs kiln's planned backward and gives every trained parameter its gradient. The parameters
    (``kiln_parameters``: kiln's names to ``torch.nn.Parameter``; registered with ``.`` as ``_``) and
    their gradients live in ``arena``, the torch tensor kiln runs in: a torch optimizer updates kiln's
    weights in place. Keep the module on the CPU; moving it would copy the parameters out of the
    arena. One forward's activations are kept at a time: backward the last loss computed.
    """

    def __init__(self, handle: ProgramHandle) -> None:
        super().__init__()
        self.handle = handle
        self.arena = torch.empty(handle.arena_bytes, dtype=torch.uint8)
        handle.bind(self.arena)
        params = handle.plan()["parameters"]
        self._grads = {p["name"]: p["grad"] for p in params if p["trainable"] and p["grad"]}
        self.kiln_parameters = {name: torch.nn.Parameter(self.tensor(name)) for name in self._grads}
        for name, param in self.kiln_parameters.items():
            self.register_parameter(name.replace(".", "_"), param)

    def tensor(self, name: str) -> torch.Tensor:
        """The Program tensor ``name`` as a torch view of the arena."""
        t = self.handle.tensor(name)
        return self.arena[t.offset:t.offset + t.nbytes].view(getattr(torch, t.dtype)).view(t.shape)

    def gradient(self, name: str) -> torch.Tensor:
        """Parameter ``name``'s gradient slot in the arena (what the last backward wrote)."""
        return self.tensor(self._grads[name])

    def _writable_gradients(self) -> list[torch.Tensor]:
        """The gradient slots a backward is about to write, a ``.grad`` that is one of them copied out
        first (autograd accumulates into it)."""
        grads = [self.gradient(name) for name in self.kiln_parameters]
        for p, g in zip(self.kiln_parameters.values(), grads, strict=True):
            if p.grad is not None and p.grad.data_ptr() == g.data_ptr():
                p.grad = p.grad.clone()
        return grads

    def forward(self, input_ids: Any, labels: Any) -> torch.Tensor:
        out: torch.Tensor = _KilnLoss.apply(self, input_ids, labels, *self.kiln_parameters.values())
        return out

    def logits(self, input_ids: Any) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]`` in eval mode. Differentiable: a torch loss over them
        backpropagates into the parameters through kiln's backward seeded with their gradient
        (:meth:`kiln.core.Model.backward_from_logits`, whose forward runs again in training mode: the
        same logits where the model has no dropout)."""
        out: torch.Tensor = _KilnLogits.apply(self, input_ids, *self.kiln_parameters.values())
        return out

    def memory_report(self) -> dict[str, Any]:
        """The planned bytes of the training Program by kind: ``saved_activations`` is what the backward
        keeps, as the recompute plan of the spec decided (see docs/runtime.md)."""
        return self.handle.program.memory_report()
