"""kiln's standard library, written in the DSL: importing it registers every module, block and model.

Modules: Linear, RMSNorm, SwiGLUMLP, Embedding, LMHead. Blocks: DenseTransformerBlock,
MoETransformerBlock, HyperConnectionBlock. Models: LlamaModel, Qwen3Model, Qwen3MoEModel,
HyperConnectionModel.
"""

from kiln.dsl.stdlib import blocks, models, modules

__all__ = ["blocks", "models", "modules"]
