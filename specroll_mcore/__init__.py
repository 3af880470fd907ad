"""specroll_mcore: lossless speculative GRPO rollouts on megatron-core."""

__version__ = "0.1.0"
