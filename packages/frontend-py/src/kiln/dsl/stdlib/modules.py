"""Reusable modules: Linear, RMSNorm, SwiGLUMLP, Embedding, LMHead (seed 003 §13).

They compute in fp32 (the NumPy backend's dtype). A caller that uses one gets its ops inlined
under the caller's name for it (``mlp.up_weight``, ...).
"""

# Tensor[...] annotations hold dimension names, which ruff would read as forward references.
# ruff: noqa: F821

from kiln.dsl import B, Dim, Param, T, Tensor, forward, graph, module, save

__all__ = ["Embedding", "LMHead", "Linear", "RMSNorm", "SwiGLUMLP"]

F = "fp32"


@module
class Linear:
    """Linear projection: y = x @ W^T (+ bias)."""

    def __init__(self, in_dim: int, out_dim: int, use_bias: bool = False):
        self.in_dim, self.out_dim, self.use_bias = in_dim, out_dim, use_bias
        self.C = Dim("in_dim")
        self.O = Dim("out_dim")

    weight = Param(Tensor["O", "C", F])
    bias = Param(Tensor["O", F], when="use_bias", init="zeros")

    @save("x")
    @forward
    def forward(self, x: Tensor["B", "T", "C", F]) -> Tensor["B", "T", "O", F]:
        with graph() as g:
            x_flat = g.view(x, shape=[B * T, self.C])
            if self.use_bias:
                y_flat = g.matmul_bias(x_flat, "weight", "bias", transpose="NT")
            else:
                y_flat = g.matmul(x_flat, "weight", transpose="NT")
            return g.view(y_flat, shape=[B, T, self.O])


@module
class RMSNorm:
    """Root mean square layer normalization (HF ``LlamaRMSNorm``)."""

    def __init__(self, d_model: int, eps: float = 1e-6):
        self.d_model, self.eps = d_model, eps

    weight = Param(Tensor["d_model", F], init="ones")

    @forward
    def forward(self, x: Tensor["B", "T", "d_model", F]) -> Tensor["B", "T", "d_model", F]:
        with graph() as g:
            y, _ = g.rmsnorm(x, "weight", eps=self.eps)
            return y


@module
class SwiGLUMLP:
    """SwiGLU MLP: down(silu(gate) * up), with gate and up fused as up_weight = [gate | up]."""

    def __init__(self, d_model: int, d_ff: int):
        self.d_model, self.d_ff = d_model, d_ff
        self.C = Dim("d_model")
        self.M = Dim("d_ff")

    up_weight = Param(Tensor["2 * M", "C", F])
    down_weight = Param(Tensor["C", "M", F])

    @save("x", "up")
    @forward
    def forward(self, x: Tensor["B", "T", "C", F]) -> Tensor["B", "T", "C", F]:
        with graph() as g:
            x_flat = g.view(x, shape=[B * T, self.C])
            up = g.matmul(x_flat, "up_weight", transpose="NT", out_name="up")
            act = g.swiglu(up)
            out_flat = g.matmul(act, "down_weight", transpose="NT")
            return g.view(out_flat, shape=[B, T, self.C])


@module
class Embedding:
    """Token embedding lookup."""

    def __init__(self, vocab_size: int, d_model: int):
        self.vocab_size, self.d_model = vocab_size, d_model

    weight = Param(Tensor["vocab_size", "d_model", F])

    @forward
    def forward(self, token_ids: Tensor["B", "T", "int32"]) -> Tensor["B", "T", "d_model", F]:
        with graph() as g:
            return g.embedding(token_ids, "weight")


@module
class LMHead:
    """LM head and cross entropy in one op: per-token loss [B * T] (0 where the target is -100)."""

    def __init__(self, vocab_size: int, d_model: int):
        self.vocab_size, self.d_model = vocab_size, d_model

    weight = Param(Tensor["vocab_size", "d_model", F])

    @forward
    def forward(self, x: Tensor["B", "T", "d_model", F], targets: Tensor["B", "T", "int32"]
                ) -> Tensor["B * T", "fp32"]:
        with graph() as g:
            x_flat = g.view(x, shape=["B * T", "d_model"])
            return g.fused_lm_head_loss(x_flat, "weight", targets)
