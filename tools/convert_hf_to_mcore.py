#!/usr/bin/env python
"""Convert a Hugging Face checkpoint (directory or .gguf) into a Megatron checkpoint: Llama, Mistral, Phi-3,
Qwen2, Qwen3 and the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE (checkpoint/hf.py).

    python tools/convert_hf_to_mcore.py HF_DIR_OR_GGUF OUT_DIR --tp 2 --pp 1 [--dtype bfloat16]

Same as `specroll convert hf-to-mcore`.
"""

import sys

from specroll_mcore.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "hf-to-mcore", *sys.argv[1:]]))
