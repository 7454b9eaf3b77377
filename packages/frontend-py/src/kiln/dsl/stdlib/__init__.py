"""kiln's standard library, written in the DSL: importing it registers every module, block and model.

Modules: Linear, RMSNorm, SwiGLUMLP, Embedding, LMHead. Blocks: DenseTransformerBlock,
MoETransformerBlock, ParallelTransformerBlock, HyperConnectionBlock. Models: LlamaModel, Qwen3Model,
MistralModel, MixtralModel, Qwen3MoEModel, ParallelModel, HyperConnectionModel.
Mamba (module ``mamba``): MambaBlock, MambaStateBlock (with its inference state), MambaModel, HybridModel.
"""

from kiln.dsl.stdlib import blocks, mamba, models, modules

__all__ = ["blocks", "mamba", "models", "modules"]
