"""KilnModule in a torch training loop, against the same model written in torch: loss, logits and
gradients within 1e-5, and parameters and gradients shared with kiln's arena (equal data pointers)."""

from __future__ import annotations

import builtins
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.core.ir import Bundle, Graph, Module, Op, ParamSpec, TensorDecl
from kiln.embed import EmbedError, compile

torch = pytest.importorskip("torch", reason="KilnModule needs torch (kiln-embed[torch]; nox -s parity)")
pytestmark = pytest.mark.parity

V, C, L, EPS = 16, 8, 2, 1e-6


def tiny_lm() -> Bundle:
    """docs/runtime.md's model: an embedding, L residual blocks (rmsnorm, a matmul), a tied LM head."""
    config, act = {"V": V, "C": C, "L": L}, ["B", "T", "C"]
    weights = [TensorDecl("norm.weight", ["C"], "fp32"), TensorDecl("proj.weight", ["C", "C"], "fp32")]
    block = Module(
        "Block", kind="block", config=config,
        params=[ParamSpec("norm.weight", ["C"], "fp32", init={"kind": "normal", "std": 1.0}),
                ParamSpec("proj.weight", ["C", "C"], "fp32", init={"kind": "normal", "std": 0.2})],
        forward=Graph("Block", inputs=[TensorDecl("x", act, "fp32")], params=weights,
                      ops=[Op("rmsnorm", ["x", "norm.weight"], ["h", "rstd"]),
                           Op("view", ["h"], ["h_flat"], {"shape": ["B * T", "C"]}),
                           Op("matmul", ["h_flat", "proj.weight"], ["p_flat"], {"transpose": "NT"}),
                           Op("view", ["p_flat"], ["p"], {"shape": act}),
                           Op("add", ["x", "p"], ["y"])],
                      outputs=[TensorDecl("y", act, "fp32")]))
    model = Module(
        "TinyLM", kind="model", config=config,
        params=[ParamSpec("embedding", ["V", "C"], "fp32", init={"kind": "normal", "std": 0.5}),
                ParamSpec("blocks", [], "fp32", array_of="Block", count="L")],
        forward=Graph(
            "TinyLM",
            inputs=[TensorDecl("token_ids", ["B", "T"], "int32"), TensorDecl("targets", ["B", "T"], "int32")],
            params=[TensorDecl("embedding", ["V", "C"], "fp32"), TensorDecl("blocks", [], "fp32")],
            ops=[Op("embedding", ["token_ids", "embedding"], ["x0"]),
                 Op("call", ["x0"], ["xN"], {"module": "Block", "n_layers": "L", "params": "blocks"}),
                 Op("view", ["xN"], ["x_flat"], {"shape": ["B * T", "C"]}),
                 Op("view", ["targets"], ["t_flat"], {"shape": ["B * T"]}),
                 Op("fused_lm_head_loss", ["x_flat", "embedding", "t_flat"], ["loss", "lse"])],
            outputs=[TensorDecl("loss", ["B * T"], "fp32")]))
    return Bundle([model, block], entry="TinyLM")


def reference(p: dict[str, Any], ids: Any, labels: Any) -> tuple[Any, Any]:
    """The same model in torch: (mean loss over labels not -100, logits)."""
    x = p["embedding"][ids]
    for i in range(L):
        h = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + EPS) * p[f"blocks.{i}.norm.weight"]
        x = x + h @ p[f"blocks.{i}.proj.weight"].T
    logits = x @ p["embedding"].T
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100)
    return loss, logits


@pytest.fixture
def module() -> Any:
    from kiln.embed import KilnModule

    return KilnModule(compile({"ir": tiny_lm().to_dict(), "batch": 2, "seq": 6, "recompute": "block"}))


def _batch(seed: int) -> tuple[Any, Any]:
    ids = torch.from_numpy(np.random.default_rng(seed).integers(0, V, (2, 7)))
    labels = ids[:, 1:].clone()
    labels[0, 0] = -100
    return ids[:, :-1], labels


def test_gradients_match_torch_autograd_and_share_kiln_memory(module: Any) -> None:
    mine = {n: p.detach().clone().requires_grad_() for n, p in module.kiln_parameters.items()}
    ids, labels = _batch(0)
    loss, (ref_loss, ref_logits) = module(ids, labels), reference(mine, ids, labels)
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-5)
    (3 * loss).backward()
    (3 * ref_loss).backward()
    torch.testing.assert_close(module.logits(ids), ref_logits.detach(), atol=1e-5, rtol=0)
    for name, p in module.kiln_parameters.items():
        torch.testing.assert_close(p.grad, mine[name].grad, atol=1e-5, rtol=0, msg=name)
        # zero copy: torch's parameter and gradient are kiln's arena
        assert p.data_ptr() == module.handle.view(name).ctypes.data
        assert p.grad.data_ptr() == module.gradient(name).data_ptr()
    # accumulating a second backward into .grad adds, as autograd does
    first = {n: p.grad.clone() for n, p in module.kiln_parameters.items()}
    module(ids, labels).backward()
    for name, p in module.kiln_parameters.items():
        torch.testing.assert_close(p.grad, first[name] * 4 / 3, atol=1e-5, rtol=1e-5, msg=name)
    loss = module(ids, labels)
    module.logits(ids)  # overwrites the activations that loss's backward needs
    with pytest.raises(EmbedError, match="the arena holds the activations of the last run only"):
        loss.backward()
    report = module.memory_report()
    assert report == module.handle.plan()["memory"] | {"slots": report["slots"]}
    assert 0 < report["saved_activations"] < report["peak"]


def test_a_torch_optimizer_trains_kiln_parameters_in_place(module: Any) -> None:
    mine = {n: p.detach().clone().requires_grad_() for n, p in module.kiln_parameters.items()}
    ours, theirs = (torch.optim.AdamW(list(ps), lr=2e-2) for ps in (module.parameters(), mine.values()))
    losses = []
    for step in range(8):
        ids, labels = _batch(step % 2)
        for opt, run in ((ours, module), (theirs, lambda i, t: reference(mine, i, t)[0])):
            opt.zero_grad()
            loss = run(ids, labels)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    np.testing.assert_allclose(losses[0::2], losses[1::2], atol=1e-5)
    assert losses[-2] < losses[0]
    for name, p in module.kiln_parameters.items():
        assert np.array_equal(module.handle.get(name), p.detach().numpy())  # the update landed in kiln
        torch.testing.assert_close(p.detach(), mine[name].detach(), atol=1e-5, rtol=1e-5, msg=name)


def test_the_docs_torch_example_runs() -> None:
    docs = (Path(__file__).parents[3] / "docs" / "embedding.md").read_text(encoding="utf-8")
    blocks = [b.split("```", 1)[0] for b in docs.split("```python\n")[1:]]
    block = next(b for b in blocks if "needs torch" in b.split("\n")[0])
    exec(builtins.compile(block, "docs/embedding.md", "exec"), {"__name__": "docs.embed"})


def test_a_torch_loss_over_kilns_logits_backpropagates_into_kiln(module: Any) -> None:
    """kiln's model as the first part of a torch graph: a loss of torch's over module.logits gives the
    parameters the gradients autograd gives the torch model; the gradients accumulate as usual."""
    mine = {n: p.detach().clone().requires_grad_() for n, p in module.kiln_parameters.items()}
    ids, _ = _batch(3)
    target = torch.randn(2, 6, V, generator=torch.Generator().manual_seed(0))

    def outer(logits: Any) -> Any:
        return (torch.tanh(logits) * target).pow(2).sum()

    logits = module.logits(ids)
    assert logits.requires_grad
    ref_logits = reference(mine, ids, ids)[1]
    torch.testing.assert_close(logits.detach(), ref_logits.detach(), atol=1e-5, rtol=0)
    outer(logits).backward()
    outer(ref_logits).backward()
    for name, p in module.kiln_parameters.items():
        torch.testing.assert_close(p.grad, mine[name].grad, atol=1e-4, rtol=1e-5, msg=name)
        assert p.grad.data_ptr() == module.gradient(name).data_ptr()  # kiln's arena, no copy
    first = {n: p.grad.clone() for n, p in module.kiln_parameters.items()}
    outer(module.logits(ids)).backward()
    for name, p in module.kiln_parameters.items():
        torch.testing.assert_close(p.grad, 2 * first[name], atol=1e-4, rtol=1e-5, msg=name)
    with torch.no_grad():
        assert not module.logits(ids).requires_grad
