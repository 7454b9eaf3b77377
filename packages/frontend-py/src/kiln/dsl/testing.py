"""Tiny models for tests, kiln's own and a plugin's (a backend's kernels against the NumPy backend, say):
:func:`lm`, ``x + silu(x @ w1^T) @ w2^T`` in a stack of blocks, then the LM head's loss, with
annotations where a test puts them; :func:`stack_lm`, the same model around a block of the test's own;
:func:`head_lm`, one product and the LM head's loss, annotations on the loss. Vocabulary ``V`` and width
``C`` by default."""

# ruff: noqa: F821  (dimension names inside Tensor[...] annotations are not Python names)

from kiln.dsl import Array, B, Param, T, Tensor, block, forward, graph, model

V, C = 16, 8


def lm(name: str, *, h_ann: tuple = (), a_ann: tuple = (), w_ann: tuple = (), cls_ann: tuple = (),
       embedding_ann: tuple = (), n_layers: int = 1, head: bool = False) -> type:
    """The model ``name`` with block ``{name}Block``, ``x + a @ w2^T`` of ``a = silu(h)``,
    ``h = x_flat @ w1^T``; ``h_ann`` annotate ``h``, ``a_ann`` ``a``, ``w_ann`` the weight ``w1``,
    ``cls_ann`` the block (outermost first); the rest as :func:`stack_lm`."""

    class Mlp:
        def __init__(self, d_model: int):
            self.d_model = d_model

        w1 = Param(Tensor["d_model", "d_model", "fp32"])
        w2 = Param(Tensor["d_model", "d_model", "fp32"])
        for ann in w_ann:
            w1 = w1 @ ann

        @forward
        def forward(self, x: Tensor["B", "T", "d_model", "fp32"]) -> Tensor["B", "T", "d_model", "fp32"]:
            with graph() as g:
                x_flat = g.view(x, shape=[B * T, "d_model"], out_name="x_flat")
                h = g.annotate(g.matmul(x_flat, "w1", transpose="NT", out_name="h"), *h_ann)
                a = g.annotate(g.silu(h, out_name="a"), *a_ann)
                out = g.matmul(a, "w2", transpose="NT")
                return g.add(x, g.view(out, shape=[B, T, "d_model"]))

    Mlp.__name__ = Mlp.__qualname__ = f"{name}Block"
    cls = block(Mlp)
    for ann in reversed(cls_ann):
        cls = ann(cls)
    return stack_lm(name, f"{name}Block", n_layers=n_layers, head=head, embedding_ann=embedding_ann)


def stack_lm(name: str, block_name: str, *, n_layers: int = 1, head: bool = False,
             embedding_ann: tuple = ()) -> type:
    """The model ``name``: the token embeddings, a stack of ``n_layers`` blocks ``block_name`` (a block
    the test has registered), then the LM head's loss; ``head``: an LM head of its own (``head``)
    instead of the tied ``embedding``; ``embedding_ann`` annotate the weight ``embedding``."""
    layers, untied, head_name = n_layers, head, "head" if head else "embedding"

    class Lm:
        def __init__(self, vocab_size: int = V, d_model: int = C, n_layers: int = layers):
            self.vocab_size, self.d_model, self.n_layers = vocab_size, d_model, n_layers

        embedding = Param(Tensor["vocab_size", "d_model", "fp32"])
        for ann in embedding_ann:
            embedding = embedding @ ann
        if untied:
            head = Param(Tensor["vocab_size", "d_model", "fp32"])
        blocks = Param(Array["n_layers", block_name])

        @forward
        def forward(
            self,
            token_ids: Tensor["B", "T", "int32"],
            position_ids: Tensor["T", "int32"],
            targets: Tensor["B", "T", "int32"],
        ) -> Tensor["B * T", "fp32"]:
            with graph() as g:
                x0 = g.embedding(token_ids, "embedding")
                xN = g.call("StackedBlocks", x0, num_outputs=1, blocks="blocks", n_layers=self.n_layers)
                return g.fused_lm_head_loss(g.view(xN, shape=[B * T, "d_model"]), head_name, targets)

    Lm.__name__ = Lm.__qualname__ = name
    return model(Lm)


def head_lm(name: str, *anns: object) -> type:
    """The model ``name``: ``loss = lm_head_loss(x @ w^T, head)`` of the token embeddings ``x``, ``anns``
    on the loss."""

    class Lm:
        def __init__(self, vocab_size: int = V, d_model: int = C):
            self.vocab_size, self.d_model = vocab_size, d_model

        embedding = Param(Tensor["vocab_size", "d_model", "fp32"])
        w = Param(Tensor["d_model", "d_model", "fp32"])
        head = Param(Tensor["vocab_size", "d_model", "fp32"])

        @forward
        def forward(
            self,
            token_ids: Tensor["B", "T", "int32"],
            position_ids: Tensor["T", "int32"],
            targets: Tensor["B", "T", "int32"],
        ) -> Tensor["B * T", "fp32"]:
            with graph() as g:
                x = g.view(g.embedding(token_ids, "embedding"), shape=[B * T, "d_model"])
                y = g.matmul(x, "w", transpose="NT", out_name="y")
                return g.annotate(g.fused_lm_head_loss(y, "head", targets, out_name="loss"), *anns)

    Lm.__name__ = Lm.__qualname__ = name
    return model(Lm)
