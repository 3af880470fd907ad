"""Random-initialised tiny Hugging Face models saved to disk: converter fixtures."""

from pathlib import Path

import torch
import transformers


def tiny_hf_config(arch: str, tied: bool) -> transformers.PretrainedConfig:
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tied, rms_norm_eps=1e-6)
    if arch == "llama":
        return transformers.LlamaConfig(**common, rope_theta=10000.0)
    return transformers.Qwen2Config(**common, rope_theta=1e6)


def save_tiny_hf(path: Path, arch: str, tied: bool, seed: int = 0, safe: bool = True) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    cfg = tiny_hf_config(arch, tied)
    model = (transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen2ForCausalLM)(cfg).eval()
    with torch.no_grad():  # HF initialises biases and norms to constants: make every tensor informative
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=safe)
    return model
