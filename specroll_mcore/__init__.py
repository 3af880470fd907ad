"""specroll_mcore: lossless speculative GRPO rollouts on megatron-core."""

__version__ = "0.1.0"

from specroll_mcore.parallel import defer_megatron_compiles as _defer_megatron_compiles

_defer_megatron_compiles()  # (before anything imports megatron-core: parallel.py lists what this changes)
