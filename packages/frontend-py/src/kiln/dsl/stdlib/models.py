"""Causal language models: LlamaModel, Qwen3Model, Qwen3MoEModel (with HuggingFace mappings) and
HyperConnectionModel.

Numerics follow HF ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``: the model's
output ``loss`` is the per-token cross entropy [B * T] (0 where the target is -100) of already
shifted targets. ``position_ids`` and ``segment_ids`` are ``[B, T]``: a packed sequence restarts its
positions per document and numbers its documents 1, 2, ...; padding is segment 0 (HF's
``attention_mask == 0``), so real tokens never attend to it. Fused weights are HF tensors
concatenated along dim 0: ``qkv_weight = [q | k | v]``,
``mlp_up_weight = [gate | up]`` (the order kiln's ``swiglu`` reads).
"""

# Tensor[...] annotations hold dimension names, which ruff would read as forward references.
# ruff: noqa: F821

import itertools
from typing import Any, ClassVar

from kiln.core.ops import ROPE_TYPES
from kiln.dsl import (
    Activation,
    Array,
    B,
    Param,
    T,
    Tensor,
    forward,
    fuse,
    graph,
    hf_config,
    hf_mapping,
    model,
    param,
    stack_experts,
    tied_to,
)
from kiln.dsl.stdlib.blocks import (
    DenseTransformerBlock,
    GPTNeoXBlock,
    HyperConnectionBlock,
    MoETransformerBlock,
    ParallelTransformerBlock,
)

__all__ = ["GPTNeoXModel", "HyperConnectionModel", "LlamaModel", "MistralModel", "MixtralModel",
           "ParallelModel", "Qwen3MoEModel", "Qwen3Model"]

F = "fp32"
_LAYER = "model.layers.{layer}."


def _proj(*names: str, kind: str = "weight") -> Any:
    keys = [f"{_LAYER}{n}.{kind}" for n in names]
    return fuse(*keys, dim=0) if len(keys) > 1 else keys[0]


#: HF keys of the attention half of every decoder layer (dense and MoE blocks share these names)
ATTENTION_MAPPINGS = {
    "ln1_weight": _proj("input_layernorm"),
    "qkv_weight": _proj("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "qkv_bias": _proj("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", kind="bias"),
    "out_weight": _proj("self_attn.o_proj"),
    "out_bias": _proj("self_attn.o_proj", kind="bias"),
    "q_norm_weight": _proj("self_attn.q_norm"),
    "k_norm_weight": _proj("self_attn.k_norm"),
    "ln2_weight": _proj("post_attention_layernorm"),
}
#: HF keys of a dense SwiGLU MLP
MLP_MAPPINGS = {
    "mlp_up_weight": _proj("mlp.gate_proj", "mlp.up_proj"),
    "mlp_down_weight": _proj("mlp.down_proj"),
}
#: HF keys of a sparse MoE MLP (Qwen3-MoE; the shared expert as in Qwen2-MoE)
MOE_MAPPINGS = {
    "router_weight": _proj("mlp.gate"),
    "experts_gate_up": stack_experts(_LAYER + "mlp.experts.{expert}.gate_proj.weight", fuse_gate_up=True),
    "experts_down": stack_experts(_LAYER + "mlp.experts.{expert}.down_proj.weight"),
    "shared_up_weight": _proj("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
    "shared_down_weight": _proj("mlp.shared_expert.down_proj"),
    "shared_gate_weight": _proj("mlp.shared_expert_gate"),
}


#: the transformers RoPE parameters a ``rope_freqs`` op takes
_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
              "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate")
_ROPE_NEEDS = {"linear": ("factor",), "dynamic": ("factor",), "yarn": (),
               "llama3": ("factor", "low_freq_factor", "high_freq_factor")}


def scaled_rope(rope: dict[str, Any], head_size: int, max_seq: int) -> tuple[dict[str, Any] | None, bool]:
    """The ``rope_freqs`` attributes (``rope_type``, ``rotary_dim`` and the kind's parameters) of
    transformers RoPE settings, None for plain RoPE of the whole head; and whether kiln computes them.
    As transformers, ``original_max_position_embeddings`` defaults to ``max_position_embeddings`` (the
    model's ``max_seq``), which ``dynamic`` (and a yarn without ``factor``) scales against; the table
    has ``max_seq`` rows (so ``dynamic`` is plain RoPE up to ``max_seq`` positions, as in transformers)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    factor = rope.get("partial_rotary_factor", 1.0)
    rotary_dim = int(head_size * factor) if isinstance(factor, int | float) else 0
    ok = kind in ROPE_TYPES and all(rope.get(k) is not None for k in _ROPE_NEEDS.get(kind, ())) and (
        factor == 1.0 or (0 < rotary_dim <= head_size and rotary_dim % 2 == 0))
    if not ok or (kind == "default" and rotary_dim == head_size):
        return None, ok
    params = {k: rope[k] for k in _ROPE_KEYS if rope.get(k) is not None}
    if kind in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", max_seq)
    if kind == "dynamic" or (kind == "yarn" and "factor" not in params):
        params["max_position_embeddings"] = max_seq
    return {"rope_type": kind, "rotary_dim": rotary_dim, **params}, ok


class _CausalLM:
    """Embedding, a stack of blocks, final RMSNorm and the LM head with its loss (seed 003 §6.1)."""

    embedding = Param(Tensor["vocab_size", "d_model", F], hf_mapping="model.embed_tokens.weight",
                      role="embedding", init={"kind": "normal", "zero_row": "pad_token_id"})
    final_norm = Param(Tensor["d_model", F], hf_mapping="model.norm.weight", init="ones")

    @param(hf_mapping="lm_head.weight")
    @tied_to("embedding", when="tie_word_embeddings")
    def lm_head(self) -> Tensor["vocab_size", "d_model", F]:
        """LM head; shares the embedding's storage when tie_word_embeddings."""

    # IO slots
    token_ids = Activation(Tensor["B", "T"], dtype="int32", scope="global")
    position_ids = Activation(Tensor["B", "T"], dtype="int32", scope="global")
    segment_ids = Activation(Tensor["B", "T"], dtype="int32", scope="global",
                             description="document of each token (packing); 0 marks padding")
    targets = Activation(Tensor["B", "T"], dtype="int32", scope="global", aliases=["labels"])

    # Global activation slots
    x0 = Activation(Tensor["B", "T", "d_model", F], aliases=["encoded"], scope="global")
    xF = Activation(Tensor["B", "T", "d_model", F], aliases=["ln_final", "xF_flat"], scope="global")
    loss = Activation(Tensor["B * T"], dtype="fp32", scope="global")

    _constraints_ = (("rope_ok", "RoPE settings (rope_scaling / rope_parameters): rope_type must be one of "
                      f"{', '.join(ROPE_TYPES)}, with the values transformers' kind needs (linear, "
                      "dynamic: factor; llama3: factor, low_freq_factor, high_freq_factor), and "
                      "head_size * partial_rotary_factor an even number of dims"),
                     ("num_query_heads % num_kv_heads == 0", "num_query_heads must be a multiple of "
                      "num_kv_heads: each kv head serves a group of query heads"),
                     ("pad_row < vocab_size", "pad_token_id must be a row of the embedding (below "
                      "vocab_size): that row gets no gradient, as in torch.nn.Embedding(padding_idx=...)"))

    def _configure(self, args: dict[str, Any]) -> None:
        """The constructor's arguments become attributes, which the blocks' constructors read by name.

        HF defaults apply: ``num_kv_heads = num_query_heads``, ``head_size = d_model // num_query_heads``.
        ``pad_token_id`` (HF's) is the embedding row that gets no gradient.
        RoPE comes from ``rope_theta`` or, when given, ``rope_scaling`` (transformers 4) or
        ``rope_parameters`` (transformers 5): a scaled kind (``rope_type`` linear, dynamic, yarn,
        llama3) or a ``partial_rotary_factor`` makes every block compute its ``freqs`` table with
        ``rope_freqs`` (:func:`scaled_rope`). HF's ``attention_bias`` biases o_proj as well as q, k, v.
        """
        args = {k: v for k, v in args.items() if k not in ("self", "__class__")}
        rope = {**(args.pop("rope_scaling", None) or {}), **(args.pop("rope_parameters", None) or {})}
        self.__dict__.update(args)
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_query_heads
        if self.head_size is None:
            self.head_size = self.d_model // self.num_query_heads
        self.pad_row = -1 if self.pad_token_id is None else self.pad_token_id
        self.rope_theta = float(rope.get("rope_theta", self.rope_theta))
        self.scaled_rope, self.rope_ok = scaled_rope(rope, self.head_size, self.max_seq)
        self.use_out_bias = self.use_qkv_bias

    def _head(self, g: Any, xN: Any, residualN: Any, targets: Any, out_name: str = "loss") -> Any:
        """Final fused residual + RMSNorm, then the per-token loss."""
        _, xF, _ = g.fused_residual_rmsnorm(residualN, xN, "final_norm", eps=self.eps,
                                            res_out_name="residual_final", y_name="xF",
                                            rstd_name="ln_final_rstd")
        xF_flat = g.view(xF, shape=[B * T, "d_model"], out_name="xF_flat")
        return g.fused_lm_head_loss(xF_flat, "lm_head", targets, out_name=out_name)

    @forward
    def forward(
        self,
        token_ids: Tensor["B", "T", "int32"],
        position_ids: Tensor["B", "T", "int32"],
        segment_ids: Tensor["B", "T", "int32"],
        targets: Tensor["B", "T", "int32"],
    ) -> Tensor["B * T", "fp32"]:
        with graph() as g:
            x0 = g.embedding(token_ids, "embedding", padding_idx=self.pad_token_id, out_name="x0")
            residual0 = g.zeros(shape=[B, T, "d_model"], dtype=F, out_name="residual0")
            xN, residualN = g.call("StackedBlocks", x0, residual0, position_ids, segment_ids, num_outputs=2,
                                   blocks="blocks", n_layers=self.n_layers, out_names=["xN", "residualN"])
            return self._head(g, xN, residualN, targets)


_DENSE_HF = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "n_layers": "num_hidden_layers",
    "num_query_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "d_ff": "intermediate_size",
    "max_seq": "max_position_embeddings",
    "head_size": "head_dim",
    "eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "use_qkv_bias": "attention_bias",
    "pad_token_id": "pad_token_id",
}


@model
@hf_config(architecture="LlamaForCausalLM", model_type="llama", **_DENSE_HF)
class LlamaModel(_CausalLM):
    """Llama: dense pre-norm decoder, GQA attention without QK-norm, SwiGLU MLP."""

    blocks = Param(Array["n_layers", DenseTransformerBlock])
    _hf_block_mappings_: ClassVar[dict[str, Any]] = {**ATTENTION_MAPPINGS, **MLP_MAPPINGS}
    _constraints_ = (*_CausalLM._constraints_, ("not mlp_bias", "MLP biases (mlp_bias) are not supported"))

    def __init__(
        self,
        vocab_size: int = 32000,
        d_model: int = 4096,
        n_layers: int = 32,
        num_query_heads: int = 32,
        num_kv_heads: int | None = None,
        d_ff: int = 11008,
        max_seq: int = 2048,
        head_size: int | None = None,
        eps: float = 1e-6,
        rope_theta: float = 10000.0,
        use_qkv_bias: bool = False,
        tie_word_embeddings: bool = False,
        pad_token_id: int | None = None,
        mlp_bias: bool = False,
        rope_scaling: dict[str, Any] | None = None,
        rope_parameters: dict[str, Any] | None = None,
    ):
        self._configure(locals())
        self.use_qk_norm = False


@model
@hf_config(architecture="Qwen3ForCausalLM", model_type="qwen3", **_DENSE_HF)
class Qwen3Model(_CausalLM):
    """Qwen3: Llama's layout plus a per-head RMSNorm of q and k before RoPE."""

    blocks = Param(Array["n_layers", DenseTransformerBlock])
    _hf_block_mappings_: ClassVar[dict[str, Any]] = {**ATTENTION_MAPPINGS, **MLP_MAPPINGS}

    def __init__(
        self,
        vocab_size: int = 151936,
        d_model: int = 1024,
        n_layers: int = 28,
        num_query_heads: int = 16,
        num_kv_heads: int | None = 8,
        d_ff: int = 3072,
        max_seq: int = 40960,
        head_size: int | None = 128,
        eps: float = 1e-6,
        rope_theta: float = 1000000.0,
        use_qkv_bias: bool = False,
        use_qk_norm: bool = True,
        tie_word_embeddings: bool = False,
        pad_token_id: int | None = None,
        rope_scaling: dict[str, Any] | None = None,
        rope_parameters: dict[str, Any] | None = None,
    ):
        self._configure(locals())


@model
@hf_config(architecture="MistralForCausalLM", model_type="mistral", **_DENSE_HF,
           sliding_window="sliding_window")
class MistralModel(_CausalLM):
    """Mistral: Llama's layout with sliding-window attention (each query sees its ``sliding_window``
    last keys, its own included; None: all)."""

    blocks = Param(Array["n_layers", DenseTransformerBlock])
    _hf_block_mappings_: ClassVar[dict[str, Any]] = {**ATTENTION_MAPPINGS, **MLP_MAPPINGS}

    def __init__(
        self,
        vocab_size: int = 32000,
        d_model: int = 4096,
        n_layers: int = 32,
        num_query_heads: int = 32,
        num_kv_heads: int | None = 8,
        d_ff: int = 14336,
        max_seq: int = 131072,
        head_size: int | None = None,
        eps: float = 1e-6,
        rope_theta: float = 10000.0,
        use_qkv_bias: bool = False,
        sliding_window: int | None = 4096,
        tie_word_embeddings: bool = False,
        pad_token_id: int | None = None,
        rope_scaling: dict[str, Any] | None = None,
        rope_parameters: dict[str, Any] | None = None,
    ):
        self._configure(locals())
        self.use_qk_norm = False


class _MoECausalLM(_CausalLM):
    """A causal LM some of whose layers are MoETransformerBlocks (``self.sparse``: which ones), with
    transformers' load-balancing loss when ``output_router_logits``.

    The MoE blocks carry their routing statistics from layer to layer (``moe_load_stats`` summed);
    after the last layer ``moe_aux_loss`` adds ``router_aux_loss_coef`` times the loss of
    ``load_balancing_loss_func`` (all MoE layers pooled, padding left out) to every scored token's loss,
    so the mean loss is ``CE + router_aux_loss_coef * aux_loss`` as in ``MixtralForCausalLM`` and
    ``Qwen3MoeForCausalLM``. With ``output_router_logits=False`` (transformers' default) the loss is
    the cross entropy alone.
    """

    def _configure_moe(self, sparse: list[bool]) -> None:
        self.sparse = sparse
        self.moe_layers = [i for i, moe in enumerate(sparse) if moe]
        self.dense_layers = [i for i, moe in enumerate(sparse) if not moe]
        self.n_moe_layers, self.n_dense_layers = len(self.moe_layers), len(self.dense_layers)
        self.router_aux_loss_coef = float(self.router_aux_loss_coef)

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
            stats = [g.zeros(shape=["num_experts"], dtype=F, out_name=n)
                     for n in ("router_load0", "router_mean_probs0")] if self.n_moe_layers else []
            done = {True: 0, False: 0}  # layers of each kind run so far
            for moe, run in itertools.groupby(self.sparse):
                n = len(list(run))
                stack, last = ("blocks", "N") if moe else ("dense_blocks", "_dense")
                if done[moe]:
                    last = f"_{stack}_{done[moe]}"
                carried = [x, residual, *stats] if moe else [x, residual]
                names = [f"x{last}", f"residual{last}"]
                if moe:
                    names += [f"router_load{last}", f"router_mean_probs{last}"]
                outs = g.call("StackedBlocks", *carried, position_ids, segment_ids, num_outputs=len(names),
                              blocks=stack, n_layers=n, first=done[moe], out_names=names)
                x, residual = outs[:2]
                if moe:
                    stats = list(outs[2:])
                done[moe] += n
            if not (self.output_router_logits and self.n_moe_layers):
                return self._head(g, x, residual, targets)
            ce = self._head(g, x, residual, targets, out_name="ce_loss")
            return g.moe_aux_loss(ce, targets, *stats, coef=self.router_aux_loss_coef,
                                  num_layers=self.n_moe_layers, out_name="loss", aux_loss_name="aux_loss")


#: HF keys of Mixtral's sparse MLP: the router ``gate``, experts ``w1`` (gate), ``w3`` (up), ``w2`` (down)
MIXTRAL_MAPPINGS = {
    "router_weight": _proj("block_sparse_moe.gate"),
    "experts_gate_up": stack_experts(_LAYER + "block_sparse_moe.experts.{expert}.w1.weight",
                                     fuse_gate_up=True,
                                     up_pattern=_LAYER + "block_sparse_moe.experts.{expert}.w3.weight"),
    "experts_down": stack_experts(_LAYER + "block_sparse_moe.experts.{expert}.w2.weight"),
}


#: HF config keys of the load-balancing loss (MixtralConfig, Qwen3MoeConfig)
_AUX_HF = {"output_router_logits": "output_router_logits", "router_aux_loss_coef": "router_aux_loss_coef"}


@model
@hf_config(architecture="MixtralForCausalLM", model_type="mixtral",
           **{k: v for k, v in _DENSE_HF.items() if k != "d_ff"}, num_experts="num_local_experts",
           num_experts_per_tok="num_experts_per_tok", moe_d_ff="intermediate_size",
           sliding_window="sliding_window", **_AUX_HF)
class MixtralModel(_MoECausalLM):
    """Mixtral: Mistral's attention; every MLP a mixture of SwiGLU experts, the top-k router
    probabilities renormalised to sum to 1; the load-balancing loss when ``output_router_logits``."""

    blocks = Param(Array["n_layers", MoETransformerBlock])
    _hf_block_mappings_: ClassVar[dict[str, Any]] = {**ATTENTION_MAPPINGS, **MIXTRAL_MAPPINGS}

    def __init__(
        self,
        vocab_size: int = 32000,
        d_model: int = 4096,
        n_layers: int = 32,
        num_query_heads: int = 32,
        num_kv_heads: int | None = 8,
        max_seq: int = 131072,
        head_size: int | None = None,
        eps: float = 1e-5,
        rope_theta: float = 1000000.0,
        use_qkv_bias: bool = False,
        sliding_window: int | None = None,
        num_experts: int = 8,
        num_experts_per_tok: int = 2,
        moe_d_ff: int = 14336,
        tie_word_embeddings: bool = False,
        pad_token_id: int | None = None,
        rope_scaling: dict[str, Any] | None = None,
        rope_parameters: dict[str, Any] | None = None,
        output_router_logits: bool = False,
        router_aux_loss_coef: float = 0.001,
    ):
        self._configure(locals())
        self.use_qk_norm, self.norm_topk_prob = False, True
        self._configure_moe([True] * n_layers)


def sparse_layers(n_layers: int, num_experts: int, decoder_sparse_step: int,
                  mlp_only_layers: list[int]) -> list[bool]:
    """Which decoder layers have a MoE MLP, as HF ``Qwen3MoeDecoderLayer`` decides."""
    return [i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0
            for i in range(n_layers)]


@model
@hf_config(architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe", **_DENSE_HF, num_experts="num_experts",
           num_experts_per_tok="num_experts_per_tok", moe_d_ff="moe_intermediate_size",
           norm_topk_prob="norm_topk_prob", decoder_sparse_step="decoder_sparse_step",
           mlp_only_layers="mlp_only_layers", **_AUX_HF)
@hf_mapping.indexed("dense_blocks", layers="dense_layers", **ATTENTION_MAPPINGS, **MLP_MAPPINGS)
@hf_mapping.indexed("blocks", layers="moe_layers", **ATTENTION_MAPPINGS, **MOE_MAPPINGS)
class Qwen3MoEModel(_MoECausalLM):
    """Qwen3-MoE: Qwen3 attention; MoE MLPs, except in the dense layers HF's config selects; the
    load-balancing loss when ``output_router_logits``.

    A ``call`` repeats one block body, so dense and MoE layers are two stacks: ``dense_blocks``
    (DenseTransformerBlock) and ``blocks`` (MoETransformerBlock), in any order: the forward calls
    each stack for every run of consecutive layers of its kind (``first=``), and the mappings'
    ``layers`` give ``dense_blocks.{i}`` and ``blocks.{i}`` their HF layer numbers. Each block body is
    derived once, however the kinds interleave (``decoder_sparse_step``, ``mlp_only_layers``).
    """

    dense_blocks = Param(Array["n_dense_layers", DenseTransformerBlock], when="n_dense_layers > 0")
    blocks = Param(Array["n_moe_layers", MoETransformerBlock], when="n_moe_layers > 0")

    def __init__(
        self,
        vocab_size: int = 151936,
        d_model: int = 2048,
        n_layers: int = 48,
        num_query_heads: int = 32,
        num_kv_heads: int | None = 4,
        d_ff: int = 6144,
        max_seq: int = 40960,
        head_size: int | None = None,  # transformers: hidden_size // num_attention_heads when absent
        eps: float = 1e-6,
        rope_theta: float = 1000000.0,
        use_qkv_bias: bool = False,
        use_qk_norm: bool = True,
        tie_word_embeddings: bool = False,
        pad_token_id: int | None = None,
        num_experts: int = 128,
        num_experts_per_tok: int = 8,
        moe_d_ff: int = 768,
        norm_topk_prob: bool = True,
        shared_d_ff: int = 0,
        decoder_sparse_step: int = 1,
        mlp_only_layers: list[int] | None = None,
        rope_scaling: dict[str, Any] | None = None,
        rope_parameters: dict[str, Any] | None = None,
        output_router_logits: bool = False,
        router_aux_loss_coef: float = 0.001,
    ):
        self._configure(locals())
        self._configure_moe(sparse_layers(n_layers, num_experts, decoder_sparse_step,
                                          list(mlp_only_layers or ())))


_NEOX = "gpt_neox.layers.{layer}."
#: HF keys of a GPTNeoXLayer
GPTNEOX_MAPPINGS = {
    f"{ours}_{kind}": f"{_NEOX}{theirs}.{kind}"
    for ours, theirs in (("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm"),
                         ("qkv", "attention.query_key_value"), ("out", "attention.dense"),
                         ("mlp_up", "mlp.dense_h_to_4h"), ("mlp_down", "mlp.dense_4h_to_h"))
    for kind in ("weight", "bias")
}


@model
@hf_config(architecture="GPTNeoXForCausalLM", model_type="gpt_neox", vocab_size="vocab_size",
           d_model="hidden_size", n_layers="num_hidden_layers", num_query_heads="num_attention_heads",
           d_ff="intermediate_size",
           max_seq="max_position_embeddings", eps="layer_norm_eps", rope_theta="rope_theta",
           use_qkv_bias="attention_bias", use_parallel_residual="use_parallel_residual",
           pad_token_id="pad_token_id")
class GPTNeoXModel(_CausalLM):
    """GPT-NeoX (Pythia): GPTNeoXBlocks (parallel attention and GELU MLP, LayerNorms with biases, partial
    RoPE), a final LayerNorm and an untied LM head (``embed_out``). RoPE covers the whole head unless
    ``rope_parameters`` give a ``partial_rotary_factor`` (transformers' GPT-NeoX default is 0.25, which
    kiln-hf reads from the config)."""

    embedding = Param(Tensor["vocab_size", "d_model", F], hf_mapping="gpt_neox.embed_in.weight",
                      role="embedding", init={"kind": "normal", "zero_row": "pad_token_id"})
    final_norm = Param(Tensor["d_model", F], hf_mapping="gpt_neox.final_layer_norm.weight", init="ones")
    final_norm_bias = Param(Tensor["d_model", F], hf_mapping="gpt_neox.final_layer_norm.bias", init="zeros")

    @param(hf_mapping="embed_out.weight")
    @tied_to("embedding", when="tie_word_embeddings")
    def lm_head(self) -> Tensor["vocab_size", "d_model", F]:
        """LM head (``embed_out``); shares the embedding's storage when tie_word_embeddings."""

    blocks = Param(Array["n_layers", GPTNeoXBlock])
    _hf_block_mappings_: ClassVar[dict[str, Any]] = GPTNEOX_MAPPINGS

    def __init__(
        self,
        vocab_size: int = 50432,
        d_model: int = 6144,
        n_layers: int = 44,
        num_query_heads: int = 64,
        d_ff: int = 24576,
        max_seq: int = 2048,
        head_size: int | None = None,
        num_kv_heads: int | None = None,
        eps: float = 1e-5,
        rope_theta: float = 10000.0,
        use_parallel_residual: bool = True,
        use_qkv_bias: bool = True,
        tie_word_embeddings: bool = False,
        pad_token_id: int | None = None,
        rope_scaling: dict[str, Any] | None = None,
        rope_parameters: dict[str, Any] | None = None,
    ):
        self._configure(locals())

    @forward
    def forward(
        self,
        token_ids: Tensor["B", "T", "int32"],
        position_ids: Tensor["B", "T", "int32"],
        segment_ids: Tensor["B", "T", "int32"],
        targets: Tensor["B", "T", "int32"],
    ) -> Tensor["B * T", "fp32"]:
        with graph() as g:
            x0 = g.embedding(token_ids, "embedding", padding_idx=self.pad_token_id, out_name="x0")
            hN = g.call("StackedBlocks", x0, position_ids, segment_ids, num_outputs=1, blocks="blocks",
                        n_layers=self.n_layers, out_names=["xN"])
            xF, _, _ = g.layernorm(hN, "final_norm", "final_norm_bias", eps=self.eps, y_name="xF",
                                   rstd_name="ln_final_rstd")
            xF_flat = g.view(xF, shape=[B * T, "d_model"], out_name="xF_flat")
            return g.fused_lm_head_loss(xF_flat, "lm_head", targets, out_name="loss")


@model
class ParallelModel(_CausalLM):
    """A dense decoder of ParallelTransformerBlocks (GPT-NeoX / GPT-J's parallel attention and MLP; two
    norms with ``parallel_norms``, GPT-NeoX's ``use_parallel_residual``, else one); the embedding, final
    RMSNorm and LM head as in Llama. No HuggingFace architecture maps to it."""

    blocks = Param(Array["n_layers", ParallelTransformerBlock])

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
        eps: float = 1e-6,
        rope_theta: float = 10000.0,
        parallel_norms: bool = True,
        use_qkv_bias: bool = False,
        use_qk_norm: bool = False,
        tie_word_embeddings: bool = False,
        pad_token_id: int | None = None,
        rope_scaling: dict[str, Any] | None = None,
        rope_parameters: dict[str, Any] | None = None,
    ):
        self._configure(locals())


@model
class HyperConnectionModel(_CausalLM):
    """A dense decoder whose layers are HyperConnectionBlocks on ``n_streams`` residual streams (with their
    bias-dropout-add options ``bda_bias``, ``hidden_dropout``, ``dropout_seed``).

    The embedding is copied into every stream; after the last layer the streams are summed, then the
    final RMSNorm and the LM head apply as in Llama. No HuggingFace architecture maps to it.
    """

    blocks = Param(Array["n_layers", HyperConnectionBlock])

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_layers: int,
        num_query_heads: int,
        num_kv_heads: int,
        d_ff: int,
        max_seq: int,
        head_size: int | None = None,
        n_streams: int = 4,
        hc_sinkhorn_iters: int = 20,
        eps: float = 1e-6,
        rope_theta: float = 10000.0,
        use_qkv_bias: bool = False,
        use_qk_norm: bool = False,
        tie_word_embeddings: bool = False,
        pad_token_id: int | None = None,
        bda_bias: bool = False,
        hidden_dropout: float = 0.0,
        dropout_seed: int = 0,
    ):
        self._configure(locals())

    @forward
    def forward(
        self,
        token_ids: Tensor["B", "T", "int32"],
        position_ids: Tensor["B", "T", "int32"],
        segment_ids: Tensor["B", "T", "int32"],
        targets: Tensor["B", "T", "int32"],
    ) -> Tensor["B * T", "fp32"]:
        with graph() as g:
            x0 = g.embedding(token_ids, "embedding", padding_idx=self.pad_token_id, out_name="x0")
            x0_4 = g.view(x0, shape=[B, T, 1, "d_model"], out_name="x0_4")
            h0_4 = g.custom("broadcast_to", x0_4, shape=[B, T, "n_streams", "d_model"], out_name="h0_4")
            h0 = g.view(h0_4, shape=[B, T, "n_streams * d_model"], out_name="h0")
            hN = g.call("StackedBlocks", h0, position_ids, segment_ids, num_outputs=1, blocks="blocks",
                        n_layers=self.n_layers, out_names=["hN"])
            hN_4 = g.view(hN, shape=[B, T, "n_streams", "d_model"], out_name="hN_4")
            xN = g.custom("reduce_sum", hN_4, axes=[2], out_name="xN")
            xF, _ = g.rmsnorm(xN, "final_norm", eps=self.eps, y_name="xF", rstd_name="ln_final_rstd")
            xF_flat = g.view(xF, shape=[B * T, "d_model"], out_name="xF_flat")
            return g.fused_lm_head_loss(xF_flat, "lm_head", targets, out_name="loss")
