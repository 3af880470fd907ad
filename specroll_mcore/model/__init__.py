"""The policy model (megatron-core GPTModel) with KV-cache and tree attention."""

from specroll_mcore.model.attention import AttentionMetadata, causal_mask
from specroll_mcore.model.gpt import PolicyModel, layer_spec, transformer_config
from specroll_mcore.model.kv_cache import KVCache

__all__ = ["AttentionMetadata", "KVCache", "PolicyModel", "causal_mask", "layer_spec", "transformer_config"]
