"""Random-initialised tiny Hugging Face models saved to disk: converter fixtures.

Architectures: ``llama``, ``mistral`` (head_dim apart, as Mistral NeMo), ``phi3`` (fused q/k/v and gate/up
projections, as Phi-4), ``qwen2``, ``qwen3`` (per-head q/k norms, head_dim apart from hidden / heads)
``llama3`` (Llama with Llama 3.1's RoPE scaling, its original context short enough that the
tiny head_dim has frequencies in each of the rule's three bands), ``qwen2_yarn`` (Qwen2 with YaRN
over a 32-token original context) and the mixtures of experts ``qwen3_moe`` (4 experts, 2 a token,
renormalised), ``qwen2_moe`` (QKV bias, a gated shared expert, probabilities not renormalised) and
``mixtral``."""

from pathlib import Path

import torch
import transformers

YARN_SCALING = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}
CLASSES = {"llama": transformers.LlamaForCausalLM, "llama3": transformers.LlamaForCausalLM,
           "mistral": transformers.MistralForCausalLM, "phi3": transformers.Phi3ForCausalLM,
           "qwen2": transformers.Qwen2ForCausalLM, "qwen2_yarn": transformers.Qwen2ForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM,
           "qwen2_moe": transformers.Qwen2MoeForCausalLM, "mixtral": transformers.MixtralForCausalLM}
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)


def tiny_hf_config(arch: str, tied: bool) -> transformers.PretrainedConfig:
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tied, rms_norm_eps=1e-6)
    if arch == "llama":
        return transformers.LlamaConfig(**common, rope_theta=10000.0)
    if arch == "llama3":
        return transformers.LlamaConfig(**common, rope_theta=10000.0, rope_scaling=dict(LLAMA3_SCALING))
    if arch == "mistral":  # a window longer than the context: full attention
        return transformers.MistralConfig(**common, rope_theta=1e6, head_dim=24, sliding_window=4096)
    if arch == "phi3":  # Phi-3 / Phi-4: fused qkv_proj and gate_up_proj
        return transformers.Phi3Config(**common, rope_theta=10000.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "qwen2_yarn":  # YaRN over a 32-token original context, 4x
        return transformers.Qwen2Config(**common, rope_theta=1e6, rope_scaling=dict(YARN_SCALING))
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, rope_theta=1e6, head_dim=24)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, **MOE, rope_theta=1e6, head_dim=24, norm_topk_prob=True)
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**common, **MOE, rope_theta=1e6, shared_expert_intermediate_size=80,
                                           norm_topk_prob=False)
    if arch == "mixtral":
        return transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6)
    return transformers.Qwen2Config(**common, rope_theta=1e6)


def save_tiny_hf(path: Path, arch: str, tied: bool, seed: int = 0, safe: bool = True) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    cfg = tiny_hf_config(arch, tied)
    model = CLASSES[arch](cfg).eval()
    with torch.no_grad():  # HF initialises biases and norms to constants: make every tensor informative
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("gate.weight"):  # routers (and Qwen2-MoE's shared-expert gate): decided choices
                p.normal_(0, 0.3)
    model.save_pretrained(path, safe_serialization=safe)
    return model
