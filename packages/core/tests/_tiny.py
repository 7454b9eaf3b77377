"""A tiny Qwen3-style model written directly in IR, as kiln-dsl compiles one (see the model contract).

The Bundle holds the model Module (kind "model") and the block it repeats (kind "block"): the model
embeds the tokens, runs the stack through one ``call`` op, applies the final norm and the fused LM-head
loss. ``tiny_qwen3_bundle`` stands in for the DSL's ``Qwen3Model`` until that exists.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kiln.core.ir import Bundle, Graph, Module, Op, ParamSpec, TensorDecl

QKV = "(Hq + 2 * Hkv) * D"


def _normal(config: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "normal", "std": config["initializer_range"]}


def _block(config: dict[str, Any]) -> Module:
    eps, theta = config["rms_norm_eps"], config["rope_theta"]
    heads = {"Hq": "Hq", "Hkv": "Hkv", "D": "D"}
    shapes = {
        "attn_norm.weight": ["C"], "attn.qkv_weight": [QKV, "C"], "attn.q_norm_weight": ["D"],
        "attn.k_norm_weight": ["D"], "attn.out_weight": ["C", "Hq * D"], "mlp_norm.weight": ["C"],
        "mlp.up_weight": ["2 * M", "C"], "mlp.down_weight": ["C", "M"],
    }
    ops = [
        Op("fused_residual_rmsnorm", ["residual", "x", "attn_norm.weight"],
           ["res1", "attn_norm.y", "attn_norm.rstd"], {"eps": eps}),
        Op("view", ["attn_norm.y"], ["attn.x_flat"], {"shape": ["B * T", "C"]}),
        Op("matmul", ["attn.x_flat", "attn.qkv_weight"], ["attn.qkv_flat"], {"transpose": "NT"}),
        Op("view", ["attn.qkv_flat"], ["attn.qkv"], {"shape": ["B", "T", QKV]}),
        Op("qkv_qk_norm_rope", ["attn.qkv", "attn.q_norm_weight", "attn.k_norm_weight", "", "position_ids"],
           ["attn.qkv_rope", "attn.q_rstd", "attn.k_rstd"], {**heads, "eps": eps, "theta": theta}),
        Op("flash_attention", ["attn.qkv_rope"], ["attn.out", "attn.lse"], {**heads, "causal": True}),
        Op("view", ["attn.out"], ["attn.out_flat"], {"shape": ["B * T", "Hq * D"]}),
        Op("matmul", ["attn.out_flat", "attn.out_weight"], ["attn.proj_flat"], {"transpose": "NT"}),
        Op("view", ["attn.proj_flat"], ["attn.proj"], {"shape": ["B", "T", "C"]}),
        Op("fused_residual_rmsnorm", ["res1", "attn.proj", "mlp_norm.weight"],
           ["res2", "mlp_norm.y", "mlp_norm.rstd"], {"eps": eps}),
        Op("view", ["mlp_norm.y"], ["mlp.x_flat"], {"shape": ["B * T", "C"]}),
        Op("matmul", ["mlp.x_flat", "mlp.up_weight"], ["mlp.gate_up"], {"transpose": "NT"}),
        Op("swiglu", ["mlp.gate_up"], ["mlp.act"]),
        Op("matmul", ["mlp.act", "mlp.down_weight"], ["mlp.out_flat"], {"transpose": "NT"}),
        Op("view", ["mlp.out_flat"], ["mlp.out"], {"shape": ["B", "T", "C"]}),
    ]
    act = ["B", "T", "C"]
    forward = Graph(
        "Qwen3Block",
        inputs=[TensorDecl("x", act, "fp32"), TensorDecl("residual", act, "fp32"),
                TensorDecl("position_ids", ["T"], "int32")],
        params=[TensorDecl(n, s, "fp32") for n, s in shapes.items()],
        ops=ops,
        outputs=[TensorDecl("mlp.out", act, "fp32"), TensorDecl("res2", act, "fp32")],
    )
    params = [ParamSpec(n, s, "fp32", init={"kind": "ones"} if n.endswith(("norm.weight", "norm_weight"))
                        else _normal(config)) for n, s in shapes.items()]
    return Module("Qwen3Block", kind="block", config=config, params=params, forward=forward)


def tiny_qwen3_bundle(*, vocab_size: int = 32, hidden_size: int = 16, num_layers: int = 2, num_heads: int = 2,
                      num_kv_heads: int = 1, head_dim: int = 8, intermediate_size: int = 32,
                      tie_word_embeddings: bool = False, rope_theta: float = 10000.0,
                      rms_norm_eps: float = 1e-6, initializer_range: float = 0.02) -> Bundle:
    """A Qwen3-style decoder (GQA attention with QK-norm and RoPE, SwiGLU MLP) as a kiln IR Bundle."""
    config: dict[str, Any] = {
        "V": vocab_size, "C": hidden_size, "L": num_layers, "Hq": num_heads, "Hkv": num_kv_heads,
        "D": head_dim, "M": intermediate_size, "rope_theta": rope_theta, "rms_norm_eps": rms_norm_eps,
        "initializer_range": initializer_range, "tie_word_embeddings": tie_word_embeddings,
    }
    block = _block(config)
    head = "embedding" if tie_word_embeddings else "lm_head"
    graph_params = [TensorDecl("embedding", ["V", "C"], "fp32"),
                    TensorDecl("final_norm.weight", ["C"], "fp32"), TensorDecl("blocks", [], "fp32")]
    if not tie_word_embeddings:
        graph_params.append(TensorDecl("lm_head", ["V", "C"], "fp32"))
    forward = Graph(
        "Qwen3Model",
        inputs=[TensorDecl("token_ids", ["B", "T"], "int32"), TensorDecl("position_ids", ["T"], "int32"),
                TensorDecl("targets", ["B", "T"], "int32")],
        params=graph_params,
        ops=[
            Op("embedding", ["token_ids", "embedding"], ["x0"]),
            Op("zeros", [], ["residual0"], {"shape": ["B", "T", "C"], "dtype": "fp32"}),
            Op("call", ["x0", "residual0", "position_ids"], ["xN", "residualN"],
               {"module": "Qwen3Block", "n_layers": num_layers, "params": "blocks"}),
            Op("fused_residual_rmsnorm", ["residualN", "xN", "final_norm.weight"],
               ["final_residual", "final_norm.y", "final_norm.rstd"], {"eps": rms_norm_eps}),
            Op("view", ["final_norm.y"], ["final_norm.y_flat"], {"shape": ["B * T", "C"]}),
            Op("view", ["targets"], ["targets_flat"], {"shape": ["B * T"]}),
            Op("fused_lm_head_loss", ["final_norm.y_flat", head, "targets_flat"], ["loss", "lse"]),
        ],
        outputs=[TensorDecl("loss", ["B * T"], "fp32")],
    )
    params = [
        ParamSpec("embedding", ["V", "C"], "fp32", init=_normal(config)),
        ParamSpec("final_norm.weight", ["C"], "fp32", init={"kind": "ones"}),
        ParamSpec("lm_head", ["V", "C"], "fp32", init=_normal(config),
                  tied_to="embedding" if tie_word_embeddings else None),
        ParamSpec("blocks", [], "fp32", array_of="Qwen3Block", count="L"),
    ]
    model = Module("Qwen3Model", kind="model", config=config, params=params, forward=forward)
    return Bundle([model, block], entry="Qwen3Model")


def random_batch(vocab_size: int, batch: int, seq: int, *, seed: int = 0,
                 ignore_last: bool = True) -> dict[str, np.ndarray]:
    """Random tokens and their next-token labels (the last position of each row ignored, -100)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab_size, (batch, seq + 1)).astype(np.int32)
    labels = ids[:, 1:].copy()
    if ignore_last:
        labels[:, -1] = -100
    return {"input_ids": ids[:, :-1].copy(), "labels": labels}


def with_dropout(bundle: Bundle, p: float = 0.25) -> Bundle:
    """Dropout on the attention output, before the residual add (counter-based: seed and offset attrs)."""
    block = bundle.module("Qwen3Block")
    assert block.forward is not None
    ops = []
    for op in block.forward.ops:
        if op.type == "fused_residual_rmsnorm" and op.inputs[1] == "attn.proj":
            ops.append(Op("dropout", ["attn.proj"], ["attn.proj_drop"], {"p": p, "seed": 1234, "offset": 7}))
            op = op.evolve(inputs=(op.inputs[0], "attn.proj_drop", op.inputs[2]))
        ops.append(op)
    block = block.evolve(forward=block.forward.evolve(ops=ops))
    return bundle.evolve(modules=[block if m.name == block.name else m for m in bundle.modules])
