"""Checkpoint formats: the full Megatron form, TP/PP shards, and Hugging Face conversion."""

from specroll_mcore.checkpoint.shard import (check_full_state_dict, local_state_dict,
                                             random_full_heads, random_full_state_dict, unshard_tensor)

__all__ = ["check_full_state_dict", "local_state_dict", "random_full_heads", "random_full_state_dict",
           "unshard_tensor"]
