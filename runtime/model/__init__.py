"""The decoder-only MoE transformer: configs, layers and the model that runs one forward batch.

ModelConfig          frozen, parsed once from a HF config.json, a GGUF header or a named config
named_config(name)   seed-700b, mixtral-8x7b, qwen3-30b-a3b, deepseek-v3-nomla, tiny-*
Transformer          embeddings, decoder layers (attention + MoE/dense FFN), final norm, LM head
"""

from zerodram.runtime.model.config import ModelConfig, RopeScaling
from zerodram.runtime.model.named import NAMED_CONFIGS, named_config

__all__ = ["NAMED_CONFIGS", "ModelConfig", "RopeScaling", "named_config"]
