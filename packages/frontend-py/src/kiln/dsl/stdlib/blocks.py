"""Transformer blocks: dense (Llama, Qwen3), mixture-of-experts (Qwen3-MoE) and Hyper-Connection (mHC).

Dense and MoE blocks follow seed 003 §6.1: the block takes ``(x, residual, position_ids, segment_ids)``
(positions and segments ``[B, T]``: packed documents restart their positions and attend within their own
segment; padding is segment 0) and returns
``(mlp_down, res_att)``; each block starts with ``res_ffn = residual + x`` fused into its first RMSNorm,
so the model passes ``residual0 = 0`` to the first layer and adds the last block's pair once more in its
final fused norm. RoPE is HF's ``rotate_half`` computed from ``rope_theta`` (no table parameter), or with
``scaled_rope`` (the attributes of a ``rope_freqs`` op: a scaled kind or a partial rotary dim) from a
``freqs`` table the block computes; ``rope_interleaved`` takes GPT-J's pairs ``(2i, 2i + 1)``.
"""

# Tensor[...] annotations hold dimension names, which ruff would read as forward references.
# ruff: noqa: F821

from typing import Any, ClassVar

from kiln.dsl import Activation, B, Dim, Gradient, Param, T, Tensor, block, forward, graph

__all__ = ["DenseTransformerBlock", "GPTNeoXBlock", "HyperConnectionBlock", "MoETransformerBlock",
           "ParallelTransformerBlock"]

F = "fp32"
_MATMUL = {"transpose": "NT"}
#: LoRA targets of the fused weights, in the order of their HF sources (q_proj, k_proj, v_proj and
#: gate_proj, up_proj); ``out_weight`` is ``o`` (o_proj) and ``mlp_down_weight`` is ``down`` (down_proj)
QKV_LORA = [("q", 0, "Hq * D"), ("k", "Hq * D", "Hkv * D"), ("v", "(Hq + Hkv) * D", "Hkv * D")]
MLP_UP_LORA = [("gate", 0, "M"), ("up", "M", "M")]


def _init_attention(blk: Any, d_model: int, num_query_heads: int, num_kv_heads: int, head_size: int | None,
                    max_seq: int, eps: float, rope_theta: float, use_qkv_bias: bool, use_qk_norm: bool,
                    use_out_bias: bool, sliding_window: int | None = None,
                    scaled_rope: dict[str, Any] | None = None, rope_interleaved: bool = False) -> None:
    blk.d_model, blk.num_query_heads, blk.num_kv_heads = d_model, num_query_heads, num_kv_heads
    blk.head_size = head_size if head_size is not None else d_model // num_query_heads
    blk.max_seq, blk.eps, blk.rope_theta = max_seq, eps, float(rope_theta)
    blk.use_qkv_bias, blk.use_qk_norm, blk.use_out_bias = use_qkv_bias, use_qk_norm, use_out_bias
    blk.sliding_window = sliding_window  # keys a query sees, its own included (HF's sliding_window)
    blk.scaled_rope, blk.rope_interleaved = scaled_rope, rope_interleaved
    blk.C, blk.Hq, blk.Hkv = Dim("d_model"), Dim("num_query_heads"), Dim("num_kv_heads")
    blk.D = Dim("head_size")
    blk.QKV = (blk.Hq + 2 * blk.Hkv) * blk.D
    blk.AttnDim = blk.Hq * blk.D


def _attention(g: Any, blk: Any, ln1: Any, position_ids: Any, segment_ids: Any,
               per_head_qkv: bool = False) -> Any:
    """Causal GQA self-attention of the normed input ``ln1`` [B, T, C]: returns ``att_out`` [B, T, C].
    ``per_head_qkv``: the projection's rows are GPT-NeoX's ``[q_h | k_h | v_h]`` per head (Hq = Hkv),
    regrouped into kiln's ``[q | k | v]``."""
    ln1_flat = g.view(ln1, shape=[B * T, blk.C], out_name="ln1_flat")
    if blk.use_qkv_bias:
        qkv_flat = g.matmul_bias(ln1_flat, "qkv_weight", "qkv_bias", out_name="qkv_flat", **_MATMUL)
    else:
        qkv_flat = g.matmul(ln1_flat, "qkv_weight", out_name="qkv_flat", **_MATMUL)
    if per_head_qkv:
        heads = g.view(qkv_flat, shape=[B, T, blk.Hq, 3, blk.D], out_name="qkv_heads")
        qkv_flat = g.permute(heads, [0, 1, 3, 2, 4], out_name="qkv_grouped")
    qkv = g.view(qkv_flat, shape=[B, T, blk.QKV], out_name="qkv")
    qk_norm = blk.use_qk_norm
    freqs, rope = None, {}
    if blk.scaled_rope:  # a scaled kind or a partial rotary dim: the block computes its table
        rope = {"rotary_dim": blk.scaled_rope["rotary_dim"]}
        freqs = g.rope_freqs(blk.max_seq, theta=blk.rope_theta, out_name="rope_table", **blk.scaled_rope)
    qkv_rope, _, _ = g.qkv_qk_norm_rope(
        qkv, "q_norm_weight" if qk_norm else None, "k_norm_weight" if qk_norm else None, freqs, position_ids,
        eps=blk.eps, theta=blk.rope_theta, interleaved=blk.rope_interleaved, qkv_out_name="qkv_rope",
        q_rstd_name="q_rstd", k_rstd_name="k_rstd", **rope,
    )
    att, _ = g.flash_attention(qkv_rope, segment_ids, causal=True, window_size=blk.sliding_window,
                               out_name="att", lse_name="lse")
    att_flat = g.view(att, shape=[B * T, blk.AttnDim], out_name="att_flat")
    if blk.use_out_bias:
        att_out_flat = g.matmul_bias(att_flat, "out_weight", "out_bias", out_name="att_out_flat", **_MATMUL)
    else:
        att_out_flat = g.matmul(att_flat, "out_weight", out_name="att_out_flat", **_MATMUL)
    return g.view(att_out_flat, shape=[B, T, blk.C], out_name="att_out")


class _PreNormAttention:
    """Parameters and activation slots (seed 000 §2) shared by the dense and the MoE block: the fused
    residual + LN1, attention, and the fused residual + LN2 that feeds the block's MLP."""

    ln1_weight = Param(Tensor["C", F], init="ones")
    ln2_weight = Param(Tensor["C", F], init="ones")
    qkv_weight = Param(Tensor["QKV", "C", F], lora_targets=QKV_LORA)
    qkv_bias = Param(Tensor["QKV", F], when="use_qkv_bias", init="zeros")
    out_weight = Param(Tensor["C", "AttnDim", F], lora_targets=["o"])
    out_bias = Param(Tensor["C", F], when="use_out_bias", init="zeros")
    q_norm_weight = Param(Tensor["D", F], when="use_qk_norm", init="ones")
    k_norm_weight = Param(Tensor["D", F], when="use_qk_norm", init="ones")

    # === Checkpoints (always saved, small footprint) ===
    ln1_rstd = Activation(Tensor["B", "T"], dtype="fp32", save=True)
    ln2_rstd = Activation(Tensor["B", "T"], dtype="fp32", save=True)
    lse = Activation(
        Tensor["B", "Hq", "T"],
        dtype="fp32",
        save=True,
        recompute=True,
        recompute_policy="lora_only",
        recompute_group="attn_fwd",
        description="Attention log-sum-exp (overwritten in LoRA recompute)",
    )
    q_rstd = Activation(
        Tensor["B", "T", "Hq"],
        dtype="fp32",
        save=True,
        recompute=True,
        recompute_policy="lora_only",
        recompute_group="qk_norm_rope",
        when="use_qk_norm",
    )
    k_rstd = Activation(
        Tensor["B", "T", "Hkv"],
        dtype="fp32",
        save=True,
        recompute=True,
        recompute_policy="lora_only",
        recompute_group="qk_norm_rope",
        when="use_qk_norm",
    )

    # === Recomputable activations ===
    res_ffn = Activation(
        Tensor["B", "T", "C", F],
        aliases=["residual_ffn"],
        recompute=True,
        recompute_group="ln1_fused",
        recompute_outputs=["res_ffn", "ln1"],
        recompute_from=["@input:residual", "@input:x", "ln1_rstd", "@param:ln1_weight"],
        recompute_op="fused_residual_rmsnorm_apply_saved",
        recompute_policy="always",
        description="Residual stream after LN1 fused residual",
    )
    ln1 = Activation(
        Tensor["B", "T", "C", F],
        aliases=["ln1_flat"],
        recompute=True,
        recompute_group="ln1_fused",
        description="LN1 output",
    )
    qkv = Activation(
        Tensor["B", "T", "QKV", F],
        aliases=["qkv_flat", "qkv_biased"],
        recompute=True,
        recompute_from=["ln1", "@param:qkv_weight", "?@param:qkv_bias"],
        recompute_op="matmul",
        recompute_attrs={"_matmul_op": "qkv", "transpose": "NT"},
        recompute_policy="lora_only",
        lora_targets=["q", "k", "v"],
        description="QKV projection output",
    )
    qkv_rope = Activation(
        Tensor["B", "T", "QKV", F],
        recompute=True,
        recompute_group="qk_norm_rope",
        recompute_outputs=["qkv_rope", "q_rstd", "k_rstd"],
        recompute_from=[
            "qkv",
            "?@global:freq_cis",  # optional: kiln computes the angles from rope_theta
            "@input:position_ids",
            "?@param:q_norm_weight",
            "?@param:k_norm_weight",
        ],
        recompute_op="qkv_qk_norm_rope",
        recompute_attrs={"_use_qk_norm": "use_qk_norm", "_rope_fused": "auto", "rotary_dim": "D"},
        recompute_policy="lora_only",
        description="QKV after RoPE (and optional QK-norm)",
    )
    att = Activation(
        Tensor["B", "T", "AttnDim", F],
        aliases=["att_flat", "attn"],
        recompute=True,
        recompute_group="attn_fwd",
        recompute_outputs=["att", "lse"],
        recompute_from=["qkv_rope", "?@input:segment_ids"],
        recompute_op="flash_attention",
        recompute_policy="lora_only",  # cuDNN is not bit-exact in full finetune
        description="Attention output (softmax @ V)",
    )
    att_out = Activation(
        Tensor["B", "T", "C", F],
        aliases=["att_out_flat"],
        recompute=True,
        recompute_from=["att", "@param:out_weight", "?@param:out_bias"],  # HF attention_bias: o_proj too
        recompute_op="matmul",
        recompute_attrs={"_matmul_op": "attn_out", "transpose": "NT"},
        recompute_policy="lora_only",
        lora_targets=["o"],
        description="Output projection",
    )
    # Fused residual + LN2 (multi-output op)
    res_att = Activation(
        Tensor["B", "T", "C", F],
        aliases=["residual_att"],
        recompute=True,
        recompute_group="ln2_fused",
        recompute_outputs=["res_att", "ln2"],
        recompute_from=["res_ffn", "att_out", "ln2_rstd", "@param:ln2_weight"],
        recompute_op="fused_residual_rmsnorm_apply_saved",
        recompute_policy="always",
        description="Residual + attention output",
    )
    ln2 = Activation(
        Tensor["B", "T", "C", F],
        aliases=["ln2_flat"],
        recompute=True,
        recompute_group="ln2_fused",
        description="LN2 output",
    )

    # === Gradient slots ===
    d_ln1 = Gradient(Tensor["B", "T", "C", F], gradient_of="ln1")
    d_qkv = Gradient(Tensor["B", "T", "QKV", F], gradient_of="qkv")
    d_att = Gradient(Tensor["B", "T", "AttnDim", F], gradient_of="att")
    d_ln2 = Gradient(Tensor["B", "T", "C", F], gradient_of="ln2")
    d_res_att = Gradient(Tensor["B", "T", "C", F], gradient_of="res_att")
    d_res_ffn = Gradient(Tensor["B", "T", "C", F], gradient_of="res_ffn")

    def _attention_half(self, g: Any, x: Any, residual: Any, position_ids: Any,
                        segment_ids: Any) -> tuple[Any, Any]:
        """LN1 (fused with ``residual + x``), attention, LN2 (fused with the attention residual):
        returns ``(res_att, ln2)``."""
        res_ffn, ln1, _ = g.fused_residual_rmsnorm(residual, x, "ln1_weight", eps=self.eps,
                                                   res_out_name="res_ffn", y_name="ln1", rstd_name="ln1_rstd")
        att_out = _attention(g, self, ln1, position_ids, segment_ids)
        res_att, ln2, _ = g.fused_residual_rmsnorm(res_ffn, att_out, "ln2_weight", eps=self.eps,
                                                   res_out_name="res_att", y_name="ln2", rstd_name="ln2_rstd")
        return res_att, ln2


@block
class DenseTransformerBlock(_PreNormAttention):
    """Pre-norm dense transformer block: attention + SwiGLU MLP (Llama, Qwen3)."""

    def __init__(
        self,
        d_model: int,
        num_query_heads: int,
        num_kv_heads: int,
        head_size: int | None,
        d_ff: int,
        max_seq: int,
        eps: float = 1e-6,
        rope_theta: float = 10000.0,
        use_qkv_bias: bool = False,
        use_qk_norm: bool = False,
        use_out_bias: bool = False,
        sliding_window: int | None = None,
        scaled_rope: dict[str, Any] | None = None,
        rope_interleaved: bool = False,
    ):
        _init_attention(self, d_model, num_query_heads, num_kv_heads, head_size, max_seq, eps, rope_theta,
                        use_qkv_bias, use_qk_norm, use_out_bias, sliding_window, scaled_rope,
                        rope_interleaved)
        self.d_ff = d_ff
        self.M = Dim("d_ff")
        self.MUp = 2 * self.M

    # MLP weights: mlp_up_weight rows are [gate | up], as swiglu reads them
    mlp_up_weight = Param(Tensor["MUp", "C", F], lora_targets=MLP_UP_LORA)
    mlp_down_weight = Param(Tensor["C", "M", F], lora_targets=["down"])

    mlp_up = Activation(
        Tensor["B", "T", "MUp", F],
        aliases=["mlp_up_flat"],
        recompute=True,
        recompute_from=["ln2", "@param:mlp_up_weight"],
        recompute_op="matmul",
        recompute_attrs={"_matmul_op": "mlp_up", "transpose": "NT"},
        recompute_policy="lora_only",
        lora_targets=["up", "gate"],
        description="MLP up projection (gate + up)",
    )
    swiglu = Activation(
        Tensor["B", "T", "M", F],
        aliases=["swiglu_flat"],
        recompute=True,
        recompute_from=["mlp_up"],
        recompute_op="swiglu",
        recompute_attrs={"_activation": "swiglu"},
        recompute_policy="lora_only",
        description="SwiGLU activation",
    )
    mlp_down = Activation(
        Tensor["B", "T", "C", F],
        aliases=["mlp_down_flat"],
        lora_targets=["down"],
        description="MLP down projection: the block's first output (the next layer's x)",
    )
    d_mlp_up = Gradient(Tensor["B", "T", "MUp", F], gradient_of="mlp_up")
    d_swiglu = Gradient(Tensor["B", "T", "M", F], gradient_of="swiglu")

    @forward
    def forward(
        self,
        x: Tensor["B", "T", "C", F],
        residual: Tensor["B", "T", "C", F],
        position_ids: Tensor["B", "T", "int32"],
        segment_ids: Tensor["B", "T", "int32"],
    ) -> tuple[Tensor["B", "T", "C", F], Tensor["B", "T", "C", F]]:
        """Returns (mlp_down, res_att): the next layer's x and residual."""
        with graph() as g:
            res_att, ln2 = self._attention_half(g, x, residual, position_ids, segment_ids)
            ln2_flat = g.view(ln2, shape=[B * T, self.C], out_name="ln2_flat")
            mlp_up_flat = g.matmul(ln2_flat, "mlp_up_weight", out_name="mlp_up_flat", **_MATMUL)
            mlp_up = g.view(mlp_up_flat, shape=[B, T, self.MUp], out_name="mlp_up")
            swiglu = g.swiglu(mlp_up, out_name="swiglu")
            swiglu_flat = g.view(swiglu, shape=[B * T, self.M], out_name="swiglu_flat")
            mlp_down_flat = g.matmul(swiglu_flat, "mlp_down_weight", out_name="mlp_down_flat", **_MATMUL)
            mlp_down = g.view(mlp_down_flat, shape=[B, T, self.C], out_name="mlp_down")
            return mlp_down, res_att


@block
class MoETransformerBlock(_PreNormAttention):
    """Pre-norm transformer block whose MLP is a mixture of experts (Qwen3-MoE routing).

    ``router_probs = softmax(ln2 @ router_weight^T)``; each token goes to its ``num_experts_per_tok``
    most probable experts, weighted by their probabilities (renormalised to sum to 1 when
    ``norm_topk_prob``); an expert is a SwiGLU MLP. With ``shared_d_ff > 0`` every token also goes
    through a shared SwiGLU expert scaled by ``sigmoid(ln2 @ shared_gate_weight^T)`` (Qwen2-MoE).
    """

    def __init__(
        self,
        d_model: int,
        num_query_heads: int,
        num_kv_heads: int,
        head_size: int | None,
        num_experts: int,
        num_experts_per_tok: int,
        moe_d_ff: int,
        max_seq: int,
        eps: float = 1e-6,
        rope_theta: float = 10000.0,
        norm_topk_prob: bool = True,
        shared_d_ff: int = 0,
        use_qkv_bias: bool = False,
        use_qk_norm: bool = True,
        use_out_bias: bool = False,
        sliding_window: int | None = None,
        scaled_rope: dict[str, Any] | None = None,
        rope_interleaved: bool = False,
    ):
        _init_attention(self, d_model, num_query_heads, num_kv_heads, head_size, max_seq, eps, rope_theta,
                        use_qkv_bias, use_qk_norm, use_out_bias, sliding_window, scaled_rope,
                        rope_interleaved)
        self.num_experts, self.num_experts_per_tok, self.moe_d_ff = num_experts, num_experts_per_tok, moe_d_ff
        self.norm_topk_prob, self.shared_d_ff = norm_topk_prob, shared_d_ff
        self.use_shared_expert = shared_d_ff > 0
        self.E, self.MoeM = Dim("num_experts"), Dim("moe_d_ff")

    _constraints_ = (("0 < num_experts_per_tok and num_experts_per_tok <= num_experts",
                      "num_experts_per_tok must be in 1..num_experts"),)

    router_weight = Param(Tensor["E", "C", F])
    experts_gate_up = Param(Tensor["E", "2 * MoeM", "C", F])  # per expert [gate | up]
    experts_down = Param(Tensor["E", "C", "MoeM", F])
    shared_up_weight = Param(Tensor["2 * SharedM", "C", F], when="use_shared_expert")
    shared_down_weight = Param(Tensor["C", "SharedM", F], when="use_shared_expert")
    shared_gate_weight = Param(Tensor[1, "C", F], when="use_shared_expert")

    # Routing: the expert choice is kept (small, and top-k is not differentiable in its indices)
    router_logits = Activation(
        Tensor["B * T", "E", F],
        recompute=True,
        recompute_from=["ln2", "@param:router_weight"],
        recompute_op="matmul",
        recompute_attrs={"_matmul_op": "router", "transpose": "NT"},
        recompute_policy="lora_only",
        description="Router logits",
    )
    router_probs = Activation(
        Tensor["B * T", "E"],
        dtype="fp32",
        recompute=True,
        recompute_from=["router_logits"],
        recompute_op="moe_softmax",
        description="Router probabilities (fp32)",
    )
    routing_weights = Activation(Tensor["B * T", "K"], dtype="fp32", save=True,
                                 description="Top-k routing weights (renormalised when norm_topk_prob)")
    routing_indices = Activation(Tensor["B * T", "K"], dtype="int32", save=True, description="Top-k experts")
    scatter_idx = Activation(Tensor["B * T * K"], dtype="int32", save=True,
                             description="Source (token, slot) of each expert-grouped row")
    expert_offsets = Activation(Tensor["E + 1"], dtype="int32", save=True,
                                description="First row of each expert in the grouped rows")
    moe_permuted = Activation(
        Tensor["B * T * K", "C", F],
        recompute=True,
        recompute_group="moe_permute",
        recompute_outputs=["moe_permuted", "scatter_idx", "expert_offsets"],
        recompute_from=["ln2", "routing_indices"],
        recompute_op="moe_permute",
        recompute_attrs={"num_experts": "E"},
        description="Token rows grouped by expert",
    )
    expert_gate_up = Activation(
        Tensor["B * T * K", "2 * MoeM", F],
        recompute=True,
        recompute_from=["moe_permuted", "@param:experts_gate_up", "expert_offsets"],
        recompute_op="moe_grouped_gemm_gate_up",
        recompute_policy="lora_only",
        description="Grouped expert up projections (gate + up)",
    )
    expert_act = Activation(
        Tensor["B * T * K", "MoeM", F],
        recompute=True,
        recompute_from=["expert_gate_up"],
        recompute_op="swiglu",
        recompute_attrs={"_activation": "swiglu"},
        recompute_policy="lora_only",
        description="Expert SwiGLU activations",
    )
    expert_down = Activation(
        Tensor["B * T * K", "C", F],
        recompute=True,
        recompute_from=["expert_act", "@param:experts_down", "expert_offsets"],
        recompute_op="moe_grouped_gemm_down",
        recompute_policy="lora_only",
        description="Grouped expert down projections",
    )
    shared_up = Activation(
        Tensor["B * T", "2 * SharedM", F],
        recompute=True,
        recompute_from=["ln2", "@param:shared_up_weight"],
        recompute_op="matmul",
        recompute_attrs={"_matmul_op": "shared_up", "transpose": "NT"},
        recompute_policy="lora_only",
        when="use_shared_expert",
        description="Shared expert up projection (gate + up)",
    )
    shared_act = Activation(
        Tensor["B * T", "SharedM", F],
        recompute=True,
        recompute_from=["shared_up"],
        recompute_op="swiglu",
        recompute_policy="lora_only",
        when="use_shared_expert",
        description="Shared expert SwiGLU activation",
    )
    shared_gate = Activation(Tensor["B * T", 1], dtype="fp32", save=True, when="use_shared_expert",
                             description="sigmoid gate of the shared expert")
    mlp_down = Activation(
        Tensor["B", "T", "C", F],
        aliases=["moe_out", "mlp_down_flat"],
        description="MoE output: the block's first output (the next layer's x)",
    )

    @forward
    def forward(
        self,
        x: Tensor["B", "T", "C", F],
        residual: Tensor["B", "T", "C", F],
        router_load: Tensor["E", F],
        router_mean_probs: Tensor["E", F],
        position_ids: Tensor["B", "T", "int32"],
        segment_ids: Tensor["B", "T", "int32"],
    ) -> tuple[Tensor["B", "T", "C", F], Tensor["B", "T", "C", F], Tensor["E", F], Tensor["E", F]]:
        """Returns (mlp_down, res_att, router_load, router_mean_probs): the next layer's x and residual,
        and the routing statistics of the layers so far (this layer's ``moe_load_stats`` added), from
        which the model computes the load-balancing loss."""
        with graph() as g:
            res_att, ln2 = self._attention_half(g, x, residual, position_ids, segment_ids)
            ln2_flat = g.view(ln2, shape=[B * T, self.C], out_name="ln2_flat")
            router_logits = g.matmul(ln2_flat, "router_weight", out_name="router_logits", **_MATMUL)
            router_probs = g.moe_softmax(router_logits, out_name="router_probs")
            weights, indices = g.moe_topk(router_probs, top_k=self.num_experts_per_tok,
                                          normalize=self.norm_topk_prob, weights_name="routing_weights",
                                          indices_name="routing_indices")
            rows = g.view(segment_ids, shape=[B * T], out_name="segment_rows")
            load, mean_probs = g.moe_load_stats(router_probs, indices, rows, load_name="layer_load",
                                                mean_probs_name="layer_mean_probs")
            load_out = g.add(router_load, load, out_name="router_load_out")
            mean_probs_out = g.add(router_mean_probs, mean_probs, out_name="router_mean_probs_out")
            permuted, scatter = g.moe_permute(ln2_flat, indices, out_name="moe_permuted",
                                              scatter_name="scatter_idx", offsets_name="expert_offsets")
            gate_up = g.moe_grouped_gemm_gate_up(permuted, "experts_gate_up", scatter,
                                                 out_name="expert_gate_up")
            act = g.swiglu(gate_up, out_name="expert_act")
            down = g.moe_grouped_gemm_down(act, "experts_down", scatter, out_name="expert_down")
            moe_name = "routed_out" if self.use_shared_expert else "moe_out"
            out = g.moe_unpermute(down, weights, scatter, top_k=self.num_experts_per_tok, out_name=moe_name)
            if self.use_shared_expert:
                shared_up = g.matmul(ln2_flat, "shared_up_weight", out_name="shared_up", **_MATMUL)
                shared_act = g.swiglu(shared_up, out_name="shared_act")
                shared = g.matmul(shared_act, "shared_down_weight", out_name="shared_down", **_MATMUL)
                gate_logit = g.matmul(ln2_flat, "shared_gate_weight", out_name="shared_gate_logit", **_MATMUL)
                gate = g.moe_sigmoid(gate_logit, out_name="shared_gate")
                out = g.add(out, g.mul(shared, gate, out_name="shared_out"), out_name="moe_out")
            mlp_down = g.view(out, shape=[B, T, self.C], out_name="mlp_down")
            return mlp_down, res_att, load_out, mean_probs_out


@block
class ParallelTransformerBlock:
    """GPT-NeoX / GPT-J parallel layer: attention and MLP read the same input and both add to the residual,
    ``h_out = h + attention(ln1(h)) + mlp(ln2(h))`` with ``h = residual + x``.

    ``parallel_norms=True`` (GPT-NeoX's ``use_parallel_residual``) normalises ``h`` twice, with
    ``ln1_weight`` for the attention and ``ln2_weight`` for the MLP; ``False`` (GPT-J) feeds ``ln1(h)`` to
    both. As the library's other blocks: RMSNorm, SwiGLU MLP, the attention options of
    DenseTransformerBlock, and ``(x, residual)`` in and out (``x`` the two branches' sum, added to the
    residual by the next block's fused norm).
    """

    def __init__(
        self,
        d_model: int,
        num_query_heads: int,
        num_kv_heads: int,
        head_size: int | None,
        d_ff: int,
        max_seq: int,
        eps: float = 1e-6,
        rope_theta: float = 10000.0,
        parallel_norms: bool = True,
        use_qkv_bias: bool = False,
        use_qk_norm: bool = False,
        use_out_bias: bool = False,
        sliding_window: int | None = None,
        scaled_rope: dict[str, Any] | None = None,
        rope_interleaved: bool = False,
    ):
        _init_attention(self, d_model, num_query_heads, num_kv_heads, head_size, max_seq, eps, rope_theta,
                        use_qkv_bias, use_qk_norm, use_out_bias, sliding_window, scaled_rope,
                        rope_interleaved)
        self.parallel_norms, self.d_ff = parallel_norms, d_ff
        self.M = Dim("d_ff")
        self.MUp = 2 * self.M

    ln1_weight = Param(Tensor["C", F], init="ones")
    ln2_weight = Param(Tensor["C", F], init="ones", when="parallel_norms")
    qkv_weight = Param(Tensor["QKV", "C", F], lora_targets=QKV_LORA)
    qkv_bias = Param(Tensor["QKV", F], when="use_qkv_bias", init="zeros")
    out_weight = Param(Tensor["C", "AttnDim", F], lora_targets=["o"])
    out_bias = Param(Tensor["C", F], when="use_out_bias", init="zeros")
    q_norm_weight = Param(Tensor["D", F], when="use_qk_norm", init="ones")
    k_norm_weight = Param(Tensor["D", F], when="use_qk_norm", init="ones")
    mlp_up_weight = Param(Tensor["MUp", "C", F], lora_targets=MLP_UP_LORA)
    mlp_down_weight = Param(Tensor["C", "M", F], lora_targets=["down"])

    ln1_rstd = Activation(Tensor["B", "T"], dtype="fp32", save=True)
    ln2_rstd = Activation(Tensor["B", "T"], dtype="fp32", save=True, when="parallel_norms")
    res_ffn = Activation(
        Tensor["B", "T", "C", F],
        recompute=True,
        recompute_group="ln1_fused",
        recompute_outputs=["res_ffn", "ln1"],
        recompute_from=["@input:residual", "@input:x", "ln1_rstd", "@param:ln1_weight"],
        recompute_op="fused_residual_rmsnorm_apply_saved",
        recompute_policy="always",
        description="The layer's input h = residual + x: the next layer's residual",
    )
    ln1 = Activation(Tensor["B", "T", "C", F], aliases=["ln1_flat"], recompute=True,
                     recompute_group="ln1_fused", description="LN1 output: the attention's input")
    ln2 = Activation(Tensor["B", "T", "C", F], recompute=True, recompute_from=["res_ffn", "ln2_rstd",
                                                                               "@param:ln2_weight"],
                     recompute_op="rmsnorm_apply_saved", recompute_policy="always", when="parallel_norms",
                     description="LN2 output: the MLP's input")
    parallel_out = Activation(Tensor["B", "T", "C", F], description="attention + MLP: the next layer's x")

    @forward
    def forward(
        self,
        x: Tensor["B", "T", "C", F],
        residual: Tensor["B", "T", "C", F],
        position_ids: Tensor["B", "T", "int32"],
        segment_ids: Tensor["B", "T", "int32"],
    ) -> tuple[Tensor["B", "T", "C", F], Tensor["B", "T", "C", F]]:
        """Returns (attention + MLP, residual + x): the next layer's x and residual."""
        with graph() as g:
            res, ln1, _ = g.fused_residual_rmsnorm(residual, x, "ln1_weight", eps=self.eps,
                                                   res_out_name="res_ffn", y_name="ln1", rstd_name="ln1_rstd")
            att_out = _attention(g, self, ln1, position_ids, segment_ids)
            mlp_in = ln1
            if self.parallel_norms:
                mlp_in, _ = g.rmsnorm(res, "ln2_weight", eps=self.eps, y_name="ln2", rstd_name="ln2_rstd")
            mlp_in_flat = g.view(mlp_in, shape=[B * T, self.C], out_name="mlp_in_flat")
            mlp_up = g.matmul(mlp_in_flat, "mlp_up_weight", out_name="mlp_up", **_MATMUL)
            swiglu = g.swiglu(mlp_up, out_name="swiglu")
            mlp_down_flat = g.matmul(swiglu, "mlp_down_weight", out_name="mlp_down_flat", **_MATMUL)
            mlp_down = g.view(mlp_down_flat, shape=[B, T, self.C], out_name="mlp_down")
            return g.add(att_out, mlp_down, out_name="parallel_out"), res


@block
class GPTNeoXBlock:
    """HF ``GPTNeoXLayer``: LayerNorms with biases, fused ``query_key_value`` in GPT-NeoX's per-head layout
    (each head's q, k, v rows together), partial rotate_half RoPE, GELU MLP with biases. With
    ``use_parallel_residual`` (GPT-NeoX's default) ``h + attention(ln1(h)) + mlp(ln2(h))``, else the
    sequential ``a = h + attention(ln1(h))``, ``a + mlp(ln2(a))``. Carries the one stream ``h``.
    """

    def __init__(
        self,
        d_model: int,
        num_query_heads: int,
        head_size: int | None,
        d_ff: int,
        max_seq: int,
        eps: float = 1e-5,
        rope_theta: float = 10000.0,
        use_parallel_residual: bool = True,
        use_qkv_bias: bool = True,
        scaled_rope: dict[str, Any] | None = None,
    ):
        _init_attention(self, d_model, num_query_heads, num_query_heads, head_size, max_seq, eps, rope_theta,
                        use_qkv_bias, False, use_qkv_bias, scaled_rope=scaled_rope)
        self.use_parallel_residual, self.d_ff = use_parallel_residual, d_ff
        self.M = Dim("d_ff")

    ln1_weight = Param(Tensor["C", F], init="ones")
    ln1_bias = Param(Tensor["C", F], init="zeros")
    ln2_weight = Param(Tensor["C", F], init="ones")
    ln2_bias = Param(Tensor["C", F], init="zeros")
    qkv_weight = Param(Tensor["QKV", "C", F])  # rows per head: [q_h | k_h | v_h], h = 0, 1, ...
    qkv_bias = Param(Tensor["QKV", F], when="use_qkv_bias", init="zeros")
    out_weight = Param(Tensor["C", "AttnDim", F], lora_targets=["o"])
    out_bias = Param(Tensor["C", F], when="use_qkv_bias", init="zeros")
    mlp_up_weight = Param(Tensor["M", "C", F], lora_targets=["up"])
    mlp_up_bias = Param(Tensor["M", F], init="zeros")
    mlp_down_weight = Param(Tensor["C", "M", F], lora_targets=["down"])
    mlp_down_bias = Param(Tensor["C", F], init="zeros")

    h = Activation(Tensor["B", "T", "C", F], save=True, description="Block input: the residual stream")

    def _mlp(self, g: Any, x: Any) -> Any:
        ln2, _, _ = g.layernorm(x, "ln2_weight", "ln2_bias", eps=self.eps, y_name="ln2", rstd_name="ln2_rstd")
        ln2_flat = g.view(ln2, shape=[B * T, self.C], out_name="ln2_flat")
        up = g.matmul_bias(ln2_flat, "mlp_up_weight", "mlp_up_bias", out_name="mlp_up")
        act = g.gelu(up, approximate="none", out_name="mlp_act")
        down = g.matmul_bias(act, "mlp_down_weight", "mlp_down_bias", out_name="mlp_down_flat")
        return g.view(down, shape=[B, T, self.C], out_name="mlp_down")

    @forward
    def forward(self, h: Tensor["B", "T", "C", F], position_ids: Tensor["B", "T", "int32"],
                segment_ids: Tensor["B", "T", "int32"]) -> Tensor["B", "T", "C", F]:
        with graph() as g:
            ln1, _, _ = g.layernorm(h, "ln1_weight", "ln1_bias", eps=self.eps, y_name="ln1",
                                    rstd_name="ln1_rstd")
            att_out = _attention(g, self, ln1, position_ids, segment_ids, per_head_qkv=True)
            if self.use_parallel_residual:
                return g.add3(h, att_out, self._mlp(g, h), out_name="h_out")
            mid = g.add(h, att_out, out_name="h_mid")
            return g.add(mid, self._mlp(g, mid), out_name="h_out")


@block
class HyperConnectionBlock:
    """A transformer layer on ``n_streams`` residual streams with manifold-constrained Hyper-Connections.

    The residual is ``n_streams`` copies of width C, carried as ``h: [B, T, n_streams * C]``. Each of the
    two sublayers f (attention, then the SwiGLU MLP, each with its pre-RMSNorm) is wrapped as (mHC)::

        h_pre, h_post, h_res = mappings(h)          per token, from RMSNorm(h) through one projection
        h <- h_res @ h + h_post^T f(h_pre @ h)       streams mixed by h_res, f's output spread by h_post

    with ``h_pre = sigmoid(.)`` [n], ``h_post = 2 * sigmoid(.)`` [n] and ``h_res`` [n, n] made doubly
    stochastic by ``hc_sinkhorn_iters`` Sinkhorn-Knopp steps on ``exp(.)``. Only the block input is
    saved: every other slot is recomputed from it when the block's output gradient arrives (seed 001).

    Bias-dropout-add (Megatron's): with ``bda_bias`` each sublayer's output gets a bias
    (``attn_bda_bias``, ``mlp_bda_bias``, [C], zeros at init) and with ``hidden_dropout = p > 0`` a
    dropout before it is spread over the streams, ``f <- dropout(f + bias, p)``; the two dropouts draw
    independent counter-based masks (``dropout_seed``, offsets 0 and 2**31 in each layer), which a
    recompute replays bit for bit. Inference (eval) runs without them.
    """

    def __init__(
        self,
        d_model: int,
        num_query_heads: int,
        num_kv_heads: int,
        head_size: int | None,
        d_ff: int,
        max_seq: int,
        n_streams: int = 4,
        hc_sinkhorn_iters: int = 20,
        eps: float = 1e-6,
        rope_theta: float = 10000.0,
        use_qkv_bias: bool = False,
        use_qk_norm: bool = False,
        use_out_bias: bool = False,
        scaled_rope: dict[str, Any] | None = None,
        rope_interleaved: bool = False,
        bda_bias: bool = False,
        hidden_dropout: float = 0.0,
        dropout_seed: int = 0,
    ):
        _init_attention(self, d_model, num_query_heads, num_kv_heads, head_size, max_seq, eps, rope_theta,
                        use_qkv_bias, use_qk_norm, use_out_bias, scaled_rope=scaled_rope,
                        rope_interleaved=rope_interleaved)
        self.bda_bias, self.hidden_dropout, self.dropout_seed = bda_bias, float(hidden_dropout), dropout_seed
        self.dropout_ok = 0.0 <= self.hidden_dropout < 1.0
        self.d_ff, self.n_streams, self.hc_sinkhorn_iters = d_ff, n_streams, hc_sinkhorn_iters
        self.M, self.S = Dim("d_ff"), Dim("n_streams")
        self.MUp = 2 * self.M

    # streams of width C; the mapping logits of a token: h_pre, h_post, h_res
    _dims_: ClassVar[dict[str, str]] = {"SC": "S * C", "HC": "2 * S + S * S"}
    _constraints_ = (("n_streams >= 1", "n_streams must be positive"),
                     ("dropout_ok", "hidden_dropout must be a probability in [0, 1)"))

    ln1_weight = Param(Tensor["C", F], init="ones")
    qkv_weight = Param(Tensor["QKV", "C", F], lora_targets=QKV_LORA)
    qkv_bias = Param(Tensor["QKV", F], when="use_qkv_bias", init="zeros")
    out_weight = Param(Tensor["C", "AttnDim", F], lora_targets=["o"])
    out_bias = Param(Tensor["C", F], when="use_out_bias", init="zeros")
    q_norm_weight = Param(Tensor["D", F], when="use_qk_norm", init="ones")
    k_norm_weight = Param(Tensor["D", F], when="use_qk_norm", init="ones")
    ln2_weight = Param(Tensor["C", F], init="ones")
    mlp_up_weight = Param(Tensor["MUp", "C", F], lora_targets=MLP_UP_LORA)
    mlp_down_weight = Param(Tensor["C", "M", F], lora_targets=["down"])
    attn_hc_norm_weight = Param(Tensor["SC", F], init="ones")
    attn_hc_proj = Param(Tensor["HC", "SC", F])
    attn_hc_bias = Param(Tensor["HC", F], init="zeros")
    mlp_hc_norm_weight = Param(Tensor["SC", F], init="ones")
    mlp_hc_proj = Param(Tensor["HC", "SC", F])
    mlp_hc_bias = Param(Tensor["HC", F], init="zeros")
    attn_bda_bias = Param(Tensor["C", F], when="bda_bias", init="zeros")
    mlp_bda_bias = Param(Tensor["C", F], when="bda_bias", init="zeros")

    # The block input is the only checkpoint (seed 001's persistent input). Every other slot is
    # refilled by re-running its forward ops in forward order; recompute_from names what each reads.
    h = Activation(Tensor["B", "T", "SC", F], save=True, description="Block input: the residual streams")
    attn_h_pre = Activation(
        Tensor["B * T", "S"],
        dtype="fp32",
        recompute=True,
        recompute_group="attn_hc_compute",
        recompute_outputs=["attn_h_pre", "attn_h_post", "attn_h_res"],
        recompute_from=["@input:h", "@param:attn_hc_norm_weight", "@param:attn_hc_proj",
                        "@param:attn_hc_bias"],
        description="Attention sublayer: how much of each stream its input takes",
    )
    attn_h_post = Activation(Tensor["B * T", "S"], dtype="fp32", recompute=True,
                             recompute_group="attn_hc_compute",
                             description="Attention sublayer: how much of its output each stream gets")
    attn_h_res = Activation(Tensor["B * T", "S", "S"], dtype="fp32", recompute=True,
                            recompute_group="attn_hc_compute", description="Attention sublayer: stream mix")
    attn_in = Activation(Tensor["B", "T", "C", F], recompute=True, recompute_from=["@input:h", "attn_h_pre"],
                         description="Attention sublayer input: the streams aggregated by attn_h_pre")
    attn_mixed = Activation(Tensor["B * T", "S", "C", F], recompute=True,
                            recompute_from=["attn_h_res", "@input:h"],
                            description="Streams mixed by attn_h_res")
    ln1 = Activation(Tensor["B", "T", "C", F], aliases=["ln1_flat"], recompute=True,
                     recompute_from=["attn_in", "@param:ln1_weight"], description="LN1 output")
    att_out = Activation(Tensor["B", "T", "C", F], aliases=["att_out_flat"], recompute=True,
                         recompute_from=["ln1"], lora_targets=["q", "k", "v", "o"],
                         description="Attention output")
    attn_biased = Activation(Tensor["B", "T", "C", F], recompute=True,
                             recompute_from=["att_out", "@param:attn_bda_bias"], when="bda_bias",
                             description="Attention output plus its bias-dropout-add bias")
    h_mid = Activation(Tensor["B", "T", "SC", F], recompute=True,
                       recompute_from=["attn_mixed", "att_out", "?attn_biased", "attn_h_post"],
                       description="Streams after the attention sublayer")
    mlp_h_pre = Activation(
        Tensor["B * T", "S"],
        dtype="fp32",
        recompute=True,
        recompute_group="mlp_hc_compute",
        recompute_outputs=["mlp_h_pre", "mlp_h_post", "mlp_h_res"],
        recompute_from=["h_mid", "@param:mlp_hc_norm_weight", "@param:mlp_hc_proj", "@param:mlp_hc_bias"],
        description="MLP sublayer: how much of each stream its input takes",
    )
    mlp_h_post = Activation(Tensor["B * T", "S"], dtype="fp32", recompute=True,
                            recompute_group="mlp_hc_compute",
                            description="MLP sublayer: how much of its output each stream gets")
    mlp_h_res = Activation(Tensor["B * T", "S", "S"], dtype="fp32", recompute=True,
                           recompute_group="mlp_hc_compute", description="MLP sublayer: stream mixing")
    mlp_in = Activation(Tensor["B", "T", "C", F], recompute=True, recompute_from=["h_mid", "mlp_h_pre"],
                        description="MLP sublayer input: the streams aggregated by mlp_h_pre")
    mlp_mixed = Activation(Tensor["B * T", "S", "C", F], recompute=True,
                           recompute_from=["mlp_h_res", "h_mid"], description="Streams mixed by mlp_h_res")
    ln2 = Activation(Tensor["B", "T", "C", F], aliases=["ln2_flat"], recompute=True,
                     recompute_from=["mlp_in", "@param:ln2_weight"], description="LN2 output")
    mlp_down = Activation(Tensor["B", "T", "C", F], aliases=["mlp_down_flat"], recompute=True,
                          recompute_from=["ln2"], lora_targets=["gate", "up", "down"],
                          description="MLP output")
    mlp_biased = Activation(Tensor["B", "T", "C", F], recompute=True,
                            recompute_from=["mlp_down", "@param:mlp_bda_bias"], when="bda_bias",
                            description="MLP output plus its bias-dropout-add bias")
    h_out = Activation(Tensor["B", "T", "SC", F], description="Block output: the next layer's streams")

    def _mappings(self, g: Any, s: str, h: Any) -> tuple[Any, Any, Any]:
        """``(h_pre [N, n], h_post [N, n], h_res [N, n, n])`` of sublayer ``s`` from the streams ``h``."""
        n = self.S
        h_flat = g.view(h, shape=[B * T, n * self.C], out_name=f"{s}_hc_in")
        normed, _ = g.rmsnorm(h_flat, f"{s}_hc_norm_weight", eps=self.eps, y_name=f"{s}_hc_normed",
                              rstd_name=f"{s}_hc_rstd")
        logits = g.matmul_bias(normed, f"{s}_hc_proj", f"{s}_hc_bias", out_name=f"{s}_hc_logits", **_MATMUL)
        pre, post, res = g.split(logits, [n, n, n * n], dim=1,
                                 out_names=[f"{s}_pre_logits", f"{s}_post_logits", f"{s}_res_logits"])
        h_pre = g.sigmoid(pre, out_name=f"{s}_h_pre")
        h_post = g.scale(g.sigmoid(post, out_name=f"{s}_post_sigmoid"), 2.0, out_name=f"{s}_h_post")
        iters = self.hc_sinkhorn_iters
        m = g.softmax(g.view(res, shape=[B * T, n, n], out_name=f"{s}_res_logits3"), dim=-1,
                      out_name=f"{s}_sinkhorn_0" if iters else f"{s}_h_res")  # exp with rows normalised
        for i in range(1, iters + 1):
            m = self._normalise(g, m, 1, f"{s}_sinkhorn_{i}_cols")
            m = self._normalise(g, m, 2, f"{s}_sinkhorn_{i}" if i < iters else f"{s}_h_res")
        return h_pre, h_post, m

    def _normalise(self, g: Any, m: Any, axis: int, name: str) -> Any:
        """``m`` [N, n, n] divided by its sums along ``axis`` (1: columns, 2: rows)."""
        sums = g.custom("reduce_sum", m, axes=[axis], keepdims=True, out_name=f"{name}_sums")
        return g.div(m, sums, out_name=name)

    def _sublayer(self, g: Any, s: str, h: Any, f: Any) -> Any:
        """``h_res @ h + h_post^T f(h_pre @ h)`` on the streams ``h: [B, T, n * C]``."""
        n, c = self.S, self.C
        h_pre, h_post, h_res = self._mappings(g, s, h)
        streams = g.view(h, shape=[B * T, n, c], out_name=f"{s}_streams")
        pre3 = g.view(h_pre, shape=[B * T, 1, n], out_name=f"{s}_h_pre3")
        agg = g.batched_matmul(pre3, streams, out_name=f"{s}_in_rows")  # [N, 1, C]
        f_out = f(g.view(agg, shape=[B, T, c], out_name=f"{s}_in"))
        if self.bda_bias:
            f_out = g.bias_add(f_out, f"{s}_bda_bias", out_name=f"{s}_biased")
        if self.hidden_dropout > 0:
            f_out = g.custom("dropout", f_out, p=self.hidden_dropout, seed=self.dropout_seed,
                             offset=0 if s == "attn" else 1 << 31, out_name=f"{s}_dropped")
        mixed = g.batched_matmul(h_res, streams, out_name=f"{s}_mixed")  # [N, n, C]
        spread = g.batched_matmul(g.view(h_post, shape=[B * T, n, 1], out_name=f"{s}_h_post3"),
                                  g.view(f_out, shape=[B * T, 1, c], out_name=f"{s}_out_rows"),
                                  out_name=f"{s}_spread")  # [N, n, C]
        return g.view(g.add(mixed, spread, out_name=f"{s}_sum"), shape=[B, T, n * c],
                      out_name="h_mid" if s == "attn" else "h_out")

    def _attention(self, g: Any, x: Any, position_ids: Any, segment_ids: Any) -> Any:
        ln1, _ = g.rmsnorm(x, "ln1_weight", eps=self.eps, y_name="ln1", rstd_name="ln1_rstd")
        return _attention(g, self, ln1, position_ids, segment_ids)

    def _mlp(self, g: Any, x: Any) -> Any:
        ln2, _ = g.rmsnorm(x, "ln2_weight", eps=self.eps, y_name="ln2", rstd_name="ln2_rstd")
        ln2_flat = g.view(ln2, shape=[B * T, self.C], out_name="ln2_flat")
        mlp_up = g.matmul(ln2_flat, "mlp_up_weight", out_name="mlp_up", **_MATMUL)
        swiglu = g.swiglu(mlp_up, out_name="swiglu")
        mlp_down_flat = g.matmul(swiglu, "mlp_down_weight", out_name="mlp_down_flat", **_MATMUL)
        return g.view(mlp_down_flat, shape=[B, T, self.C], out_name="mlp_down")

    @forward
    def forward(self, h: Tensor["B", "T", "SC", F], position_ids: Tensor["B", "T", "int32"],
                segment_ids: Tensor["B", "T", "int32"]) -> Tensor["B", "T", "SC", F]:
        with graph() as g:
            h_mid = self._sublayer(g, "attn", h, lambda x: self._attention(g, x, position_ids, segment_ids))
            return self._sublayer(g, "mlp", h_mid, lambda x: self._mlp(g, x))
