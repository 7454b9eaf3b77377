"""Mamba (Mamba-1 selective state space) layers: ``MambaBlock``, ``MambaModel`` (HF ``MambaForCausalLM``) and
``HybridModel``, attention every ``attn_layer_period``-th layer and Mamba elsewhere.

The block follows HF ``MambaBlock`` / ``MambaMixer`` (their slow path, Mamba's ``selective_scan_ref``)::

    h = residual + x;  n = RMSNorm(h)
    xs, z = split(n @ in_proj^T)                     [B, T, d_inner] each
    u = silu(causal depthwise conv1d(xs))            mamba_conv1d, channels-first [B, d_inner, T]
    dt_low, Bs, Cs = split(u @ x_proj^T)             [dt_rank | d_state | d_state]
    y = selective_scan(u, dt_low @ dt_proj^T, -exp(A_log), Bs, Cs, D, z, dt_proj_bias, softplus)
    out = y @ out_proj^T

and, like the transformer blocks, takes and returns ``(x, residual)``: the residual sum is fused into
the block's RMSNorm, so a stack of Mamba blocks and dense transformer blocks shares one convention.
``MambaStateBlock`` is the same block with its inference state (seed 004 §11.3): the scan's and the
conv's initial states in, their final states out, for decoding a sequence chunk by chunk.
"""

# Tensor[...] annotations hold dimension names, which ruff would read as forward references.
# ruff: noqa: F821

import math
from typing import Any, ClassVar

from kiln.dsl import (
    Activation,
    Array,
    B,
    Dim,
    Param,
    T,
    Tensor,
    block,
    forward,
    graph,
    hf_config,
    model,
    param,
    tied_to,
)
from kiln.dsl.stdlib.blocks import DenseTransformerBlock, MoETransformerBlock
from kiln.dsl.stdlib.models import _CausalLM

__all__ = ["HybridModel", "MambaBlock", "MambaModel", "MambaStateBlock", "hybrid_attention_layers"]

F = "fp32"
_MATMUL = {"transpose": "NT"}
_MIXER = "backbone.layers.{layer}.mixer."


def _dt_rank(dt_rank: int | str | None, d_model: int) -> int:
    """HF ``time_step_rank``: ``"auto"`` (or None) is ``ceil(d_model / 16)``."""
    return math.ceil(d_model / 16) if dt_rank in (None, "auto") else int(dt_rank)


@block
class MambaBlock:
    """Pre-norm Mamba-1 mixer with its residual (HF ``MambaBlock``): see the module docstring."""

    def __init__(
        self,
        d_model: int,
        d_inner: int,
        d_state: int = 16,
        d_conv: int = 4,
        dt_rank: int = 1,
        eps: float = 1e-5,
        use_bias: bool = False,
        use_conv_bias: bool = True,
    ):
        self.d_model, self.d_inner, self.d_state = d_model, d_inner, d_state
        self.d_conv, self.dt_rank = d_conv, dt_rank
        self.eps, self.use_bias, self.use_conv_bias = eps, use_bias, use_conv_bias
        self.C, self.DI, self.N = Dim("d_model"), Dim("d_inner"), Dim("d_state")
        self.KC, self.R = Dim("d_conv"), Dim("dt_rank")

    _dims_: ClassVar[dict[str, str]] = {"DI2": "2 * DI", "XP": "R + 2 * N"}

    norm_weight = Param(Tensor["C", F], init="ones")
    in_proj_weight = Param(Tensor["DI2", "C", F])
    in_proj_bias = Param(Tensor["DI2", F], when="use_bias", init="zeros")
    conv1d_weight = Param(Tensor["DI", 1, "KC", F])
    conv1d_bias = Param(Tensor["DI", F], when="use_conv_bias", init="zeros")
    x_proj_weight = Param(Tensor["XP", "DI", F])
    dt_proj_weight = Param(Tensor["DI", "R", F])
    # HF draws dt in [0.001, 0.1] and stores softplus^-1(dt), about log(dt) for small dt
    dt_proj_bias = Param(Tensor["DI", F],
                         init={"kind": "uniform", "low": math.log(1e-3), "high": math.log(0.1)})
    # HF starts A_log at log(1..d_state) per channel; a uniform draw over that range
    A_log = Param(Tensor["DI", "N", F], init={"kind": "uniform", "low": 0.0, "high": 2.0})
    D = Param(Tensor["DI", F], init="ones")
    out_proj_weight = Param(Tensor["C", "DI", F])
    out_proj_bias = Param(Tensor["C", F], when="use_bias", init="zeros")

    norm_rstd = Activation(Tensor["B", "T"], dtype="fp32", save=True)
    res = Activation(
        Tensor["B", "T", "C", F],
        recompute=True,
        recompute_group="norm_fused",
        recompute_outputs=["res", "normed"],
        recompute_from=["@input:residual", "@input:x", "norm_rstd", "@param:norm_weight"],
        recompute_op="fused_residual_rmsnorm_apply_saved",
        recompute_policy="always",
        description="Residual stream: residual + x",
    )
    normed = Activation(Tensor["B", "T", "C", F], aliases=["normed_flat"], recompute=True,
                        recompute_group="norm_fused", description="RMSNorm output")
    conv_in = Activation(Tensor["B", "DI", "T", F], description="The conv's input, channels-first")
    conv_out = Activation(
        Tensor["B", "DI", "T", F],
        recompute=True,
        recompute_from=["conv_in", "@param:conv1d_weight", "?@param:conv1d_bias"],
        recompute_op="mamba_conv1d",
        recompute_policy="always",
        description="silu(causal conv1d): the scan's input u, channels-first",
    )

    def _linear(self, g: Any, x: Any, weight: str, bias: str, rows: Any, cols: Any, name: str) -> Any:
        x_flat = g.view(x, shape=[B * T, rows], out_name=f"{name}_in")
        if self.use_bias and bias:
            y = g.matmul_bias(x_flat, weight, bias, out_name=f"{name}_flat", **_MATMUL)
        else:
            y = g.matmul(x_flat, weight, out_name=f"{name}_flat", **_MATMUL)
        return g.view(y, shape=[B, T, cols], out_name=name)

    def _mixer(self, g: Any, x: Any, residual: Any, state: bool = False, ssm_state: Any = None,
               conv_state: Any = None) -> tuple[Any, ...]:
        """(out, res), and with ``state`` the final states (ssm_state_out, conv_state_out): the scan's
        ``[B, DI, N]`` and the conv's last ``d_conv`` inputs ``[B, DI, KC]``, from the initial ones
        given (None: zeros, a sequence's start)."""
        res, normed, _ = g.fused_residual_rmsnorm(residual, x, "norm_weight", eps=self.eps,
                                                  res_out_name="res", y_name="normed", rstd_name="norm_rstd")
        xz = self._linear(g, normed, "in_proj_weight", "in_proj_bias", self.C, 2 * self.DI, "xz")
        xs, z = g.split(xz, [self.DI, self.DI], dim=2, out_names=["xs", "gate"])
        conv_in = g.transpose(xs, 1, 2, out_name="conv_in")  # [B, DI, T]
        bias = "conv1d_bias" if self.use_conv_bias else None
        if state:
            if conv_state is None:
                conv_state = g.zeros(shape=[B, self.DI, self.KC], dtype=F, out_name="conv_state")
            # the op's state is the K - 1 inputs before x; transformers' cache (and the seed's) keeps K
            before = g.split(conv_state, [1, self.KC - 1], dim=2)[1]
            conv_out = g.custom("mamba_conv1d", conv_in, "conv1d_weight", bias, before, activation="silu",
                                out_name="conv_out")
            conv_state_out = g.split(g.concat(conv_state, conv_in, dim=2), [T, self.KC], dim=2,
                                     out_names=["conv_state_out_0", "conv_state_out"])[1]
        else:
            conv_out = g.custom("mamba_conv1d", conv_in, "conv1d_weight", bias, activation="silu",
                                out_name="conv_out")
        u_btd = g.transpose(conv_out, 1, 2, out_name="u_btd")
        dbc = self._linear(g, u_btd, "x_proj_weight", "", self.DI, self.R + 2 * self.N, "x_dbc")
        dt_low, b_ssm, c_ssm = g.split(dbc, [self.R, self.N, self.N], dim=2,
                                       out_names=["dt_low", "B_ssm", "C_ssm"])
        dt = self._linear(g, dt_low, "dt_proj_weight", "", self.R, self.DI, "dt")  # bias: in the scan
        A = g.scale(g.exp("A_log", out_name="A_exp"), -1.0, out_name="A")
        delta = g.transpose(dt, 1, 2, out_name="delta")
        scan_in = (conv_out, delta, A, g.transpose(b_ssm, 1, 2, out_name="B_t"),
                   g.transpose(c_ssm, 1, 2, out_name="C_t"), "D", g.transpose(z, 1, 2, out_name="z"),
                   "dt_proj_bias")
        if state:
            y, ssm_state_out = g.custom("mamba_selective_scan", *scan_in, ssm_state, delta_softplus=True,
                                        return_last_state=True, num_outputs=2,
                                        out_names=["scan_out", "ssm_state_out"])
        else:
            y = g.custom("mamba_selective_scan", *scan_in, delta_softplus=True, out_name="scan_out")
        y_btd = g.transpose(y, 1, 2, out_name="y_btd")
        out = self._linear(g, y_btd, "out_proj_weight", "out_proj_bias", self.DI, self.C, "out")
        return (out, res, ssm_state_out, conv_state_out) if state else (out, res)

    @forward
    def forward(
        self,
        x: Tensor["B", "T", "C", F],
        residual: Tensor["B", "T", "C", F],
    ) -> tuple[Tensor["B", "T", "C", F], Tensor["B", "T", "C", F]]:
        """Returns (out, res): the next layer's x and residual."""
        with graph() as g:
            return self._mixer(g, x, residual)


@block
class MambaStateBlock(MambaBlock):
    """``MambaBlock`` with its inference state, as seed 004's §11.3 block (and the text syntax) writes
    it: the optional inputs ``ssm_state`` ``[B, d_inner, d_state]`` and ``conv_state``
    ``[B, d_inner, d_conv]`` (the conv's last ``d_conv`` inputs, transformers' cache layout; None:
    zeros) and the outputs ``ssm_state_out`` and ``conv_state_out``, the states after this chunk. Run a
    sequence chunk by chunk (or token by token), each from the states the one before returned, and
    it computes what the whole sequence does. The same parameters and HF keys as ``MambaBlock``; a
    stack of layers (``MambaModel``) carries ``(x, residual)`` only, so it stacks ``MambaBlock``."""

    # the conv reads the state too: replayed from conv_in alone it would not be what the forward saw
    conv_out = Activation(Tensor["B", "DI", "T", F], description="silu(causal conv1d): the scan's input u")

    @forward
    def forward(
        self,
        x: Tensor["B", "T", "C", F],
        residual: Tensor["B", "T", "C", F],
        ssm_state: Tensor["B", "DI", "N", F] | None = None,
        conv_state: Tensor["B", "DI", "KC", F] | None = None,
    ) -> tuple[Tensor["B", "T", "C", F], Tensor["B", "T", "C", F], Tensor["B", "DI", "N", F],
               Tensor["B", "DI", "KC", F]]:
        """Returns (out, res, ssm_state_out, conv_state_out)."""
        with graph() as g:
            return self._mixer(g, x, residual, True, ssm_state, conv_state)


#: HF keys of a Mamba layer (``MambaBlock``: ``norm`` and ``mixer``)
MAMBA_MAPPINGS = {
    "norm_weight": "backbone.layers.{layer}.norm.weight",
    "in_proj_weight": _MIXER + "in_proj.weight",
    "in_proj_bias": _MIXER + "in_proj.bias",
    "conv1d_weight": _MIXER + "conv1d.weight",
    "conv1d_bias": _MIXER + "conv1d.bias",
    "x_proj_weight": _MIXER + "x_proj.weight",
    "dt_proj_weight": _MIXER + "dt_proj.weight",
    "dt_proj_bias": _MIXER + "dt_proj.bias",
    "A_log": _MIXER + "A_log",
    "D": _MIXER + "D",
    "out_proj_weight": _MIXER + "out_proj.weight",
    "out_proj_bias": _MIXER + "out_proj.bias",
}


@model
@hf_config(architecture="MambaForCausalLM", model_type="mamba", vocab_size="vocab_size",
           d_model="hidden_size", n_layers="num_hidden_layers", d_state="state_size", d_conv="conv_kernel",
           expand="expand", d_inner="intermediate_size", dt_rank="time_step_rank", eps="layer_norm_epsilon",
           use_bias="use_bias", use_conv_bias="use_conv_bias", tie_word_embeddings="tie_word_embeddings")
class MambaModel:
    """Mamba-1 language model (HF ``MambaForCausalLM``): embedding, ``n_layers`` MambaBlocks, final
    RMSNorm and the LM head (tied to the embedding by default, as in transformers). It has no
    attention, so it takes no positions and cannot mask padding; its loss is the per-token cross
    entropy ``[B * T]`` of already shifted targets."""

    embedding = Param(Tensor["vocab_size", "d_model", F], hf_mapping="backbone.embeddings.weight",
                      role="embedding")
    blocks = Param(Array["n_layers", MambaBlock])
    final_norm = Param(Tensor["d_model", F], hf_mapping="backbone.norm_f.weight", init="ones")

    @param(hf_mapping="lm_head.weight")
    @tied_to("embedding", when="tie_word_embeddings")
    def lm_head(self) -> Tensor["vocab_size", "d_model", F]:
        """LM head; shares the embedding's storage when tie_word_embeddings."""

    _hf_block_mappings_: ClassVar[dict[str, Any]] = MAMBA_MAPPINGS
    _constraints_ = (("d_inner > 0 and d_state > 0 and d_conv > 0 and dt_rank > 0",
                      "d_inner (intermediate_size), d_state, d_conv and dt_rank must be positive"),)

    token_ids = Activation(Tensor["B", "T"], dtype="int32", scope="global")
    targets = Activation(Tensor["B", "T"], dtype="int32", scope="global", aliases=["labels"])
    loss = Activation(Tensor["B * T"], dtype="fp32", scope="global")

    def __init__(
        self,
        vocab_size: int = 50280,
        d_model: int = 768,
        n_layers: int = 32,
        d_state: int = 16,
        d_conv: int = 4,
        expand: int = 2,
        d_inner: int | None = None,
        dt_rank: int | str | None = "auto",
        eps: float = 1e-5,
        use_bias: bool = False,
        use_conv_bias: bool = True,
        tie_word_embeddings: bool = True,
    ):
        self.vocab_size, self.d_model, self.n_layers = vocab_size, d_model, n_layers
        self.d_state, self.d_conv, self.expand = d_state, d_conv, expand
        self.d_inner = d_inner if d_inner is not None else expand * d_model
        self.dt_rank = _dt_rank(dt_rank, d_model)
        self.eps, self.use_bias, self.use_conv_bias = eps, use_bias, use_conv_bias
        self.tie_word_embeddings = tie_word_embeddings

    @forward
    def forward(self, token_ids: Tensor["B", "T", "int32"],
                targets: Tensor["B", "T", "int32"]) -> Tensor["B * T", "fp32"]:
        with graph() as g:
            x0 = g.embedding(token_ids, "embedding", out_name="x0")
            residual0 = g.zeros(shape=[B, T, "d_model"], dtype=F, out_name="residual0")
            xN, residualN = g.call("StackedBlocks", x0, residual0, num_outputs=2, blocks="blocks",
                                   n_layers=self.n_layers, out_names=["xN", "residualN"])
            _, xF, _ = g.fused_residual_rmsnorm(residualN, xN, "final_norm", eps=self.eps,
                                                res_out_name="residual_final", y_name="xF",
                                                rstd_name="ln_final_rstd")
            xF_flat = g.view(xF, shape=[B * T, "d_model"], out_name="xF_flat")
            return g.fused_lm_head_loss(xF_flat, "lm_head", targets, out_name="loss")


def hybrid_attention_layers(n_layers: int, attn_layer_period: int, attn_layer_offset: int) -> list[bool]:
    """Which layers of a hybrid stack are attention layers (as Jamba's ``attn_layer_period`` and
    ``attn_layer_offset`` choose them: ``i % period == offset``); the others are Mamba layers."""
    return [i % attn_layer_period == attn_layer_offset for i in range(n_layers)]


@model
class HybridModel(_CausalLM):
    """A hybrid decoder: transformer blocks (Qwen3/Llama attention + SwiGLU MLP) at the layers
    ``i % attn_layer_period == attn_layer_offset``, MambaBlocks everywhere else.

    The kinds are separate stacks, ``attn_blocks`` (DenseTransformerBlock) or, with ``num_experts > 0``,
    ``moe_blocks`` (MoETransformerBlock: the attention layers' MLPs are mixtures of experts, routed as
    Qwen3-MoE), and ``mamba_blocks`` (MambaBlock); the forward calls each for every run of consecutive
    layers of its kind (``first=``), so each block body is derived once however the kinds interleave.
    Every kind carries ``(x, residual)``; only the attention layers read positions and segments, and
    the MoE layers carry their routing statistics past the Mamba layers to the load-balancing loss
    (with ``output_router_logits``, as ``Qwen3MoEModel``). No HuggingFace architecture maps to it.
    """

    attn_blocks = Param(Array["n_dense_layers", DenseTransformerBlock], when="n_dense_layers > 0")
    moe_blocks = Param(Array["n_moe_layers", MoETransformerBlock], when="n_moe_layers > 0")
    mamba_blocks = Param(Array["n_mamba_layers", MambaBlock], when="n_mamba_layers > 0")
    _constraints_ = (*_CausalLM._constraints_,
                     ("attn_layer_period >= 1 and 0 <= attn_layer_offset < attn_layer_period",
                      "attn_layer_offset must lie in 0 .. attn_layer_period - 1"),
                     ("num_experts == 0 or 0 < num_experts_per_tok <= num_experts",
                      "num_experts_per_tok must be in 1..num_experts"))

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_layers: int,
        num_query_heads: int,
        d_ff: int,
        max_seq: int,
        num_kv_heads: int | None = None,
        head_size: int | None = None,
        attn_layer_period: int = 4,
        attn_layer_offset: int = 3,
        d_state: int = 16,
        d_conv: int = 4,
        expand: int = 2,
        dt_rank: int | str | None = "auto",
        use_conv_bias: bool = True,
        eps: float = 1e-6,
        rope_theta: float = 10000.0,
        use_qkv_bias: bool = False,
        use_qk_norm: bool = True,
        tie_word_embeddings: bool = False,
        pad_token_id: int | None = None,
        num_experts: int = 0,
        num_experts_per_tok: int = 2,
        moe_d_ff: int | None = None,
        norm_topk_prob: bool = True,
        output_router_logits: bool = False,
        router_aux_loss_coef: float = 0.001,
    ):
        self._configure(locals())
        self.d_inner, self.dt_rank, self.use_bias = expand * d_model, _dt_rank(dt_rank, d_model), False
        self.moe_d_ff = d_ff if moe_d_ff is None else moe_d_ff
        self.router_aux_loss_coef = float(router_aux_loss_coef)
        ok = attn_layer_period >= 1 and 0 <= attn_layer_offset < attn_layer_period
        self.attention = hybrid_attention_layers(n_layers, attn_layer_period, attn_layer_offset) if ok else \
            [False] * n_layers
        n_attn = sum(self.attention)
        self.n_moe_layers = n_attn if num_experts > 0 else 0
        self.n_dense_layers = n_attn - self.n_moe_layers
        self.n_mamba_layers = n_layers - n_attn

    @forward
    def forward(
        self,
        token_ids: Tensor["B", "T", "int32"],
        position_ids: Tensor["B", "T", "int32"],
        segment_ids: Tensor["B", "T", "int32"],
        targets: Tensor["B", "T", "int32"],
    ) -> Tensor["B * T", "fp32"]:
        with graph() as g:
            x = g.embedding(token_ids, "embedding", padding_idx=self.pad_token_id, out_name="x0")
            residual = g.zeros(shape=[B, T, "d_model"], dtype=F, out_name="residual0")
            moe = self.n_moe_layers > 0
            stats = [g.zeros(shape=["num_experts"], dtype=F, out_name=n)
                     for n in ("router_load0", "router_mean_probs0")] if moe else []
            done = {True: 0, False: 0}  # layers of each kind run so far
            layer = 0
            while layer < self.n_layers:
                attn = self.attention[layer]
                n = next((k for k in range(layer, self.n_layers) if self.attention[k] != attn),
                         self.n_layers) - layer
                stack = ("moe_blocks" if moe else "attn_blocks") if attn else "mamba_blocks"
                carried = [x, residual, *stats] if attn and moe else [x, residual]
                kinds = ["x", "residual", "router_load", "router_mean_probs"][:len(carried)]
                names = [f"{kind}_{stack}_{done[attn] + n}" for kind in kinds]
                extra = [position_ids, segment_ids] if attn else []
                outs = g.call("StackedBlocks", *carried, *extra, num_outputs=len(carried), blocks=stack,
                              n_layers=n, first=done[attn], out_names=names)
                x, residual = outs[:2]
                if attn and moe:
                    stats = list(outs[2:])
                done[attn] += n
                layer += n
            if not (moe and self.output_router_logits):
                return self._head(g, x, residual, targets)
            ce = self._head(g, x, residual, targets, out_name="ce_loss")
            return g.moe_aux_loss(ce, targets, *stats, coef=self.router_aux_loss_coef,
                                  num_layers=self.n_moe_layers, out_name="loss", aux_loss_name="aux_loss")
