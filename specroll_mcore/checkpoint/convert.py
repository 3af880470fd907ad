"""Hugging Face <-> Megatron checkpoint conversion (the architectures of checkpoint/hf.py; safetensors, .bin
or GGUF).

HF -> Megatron streams: tensors are read lazily from safetensors (or memory-mapped .bin) and each
TP/PP shard is built and written on its own. GGUF files are dequantized through ``transformers``
into a plain ``LlamaForCausalLM``/``Qwen2ForCausalLM`` first (a GGUF-loaded model carries a
quantization flag that trainers refuse; the plain form trains).
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import torch

from specroll_mcore.checkpoint.hf import (FUSED_PROJECTIONS, HFToFull, gate_up_table, hf_architecture, hf_tensors,
                                         layer_table, model_config_from_hf)
from specroll_mcore.checkpoint.megatron import (MegatronCheckpointReader, atomic_directory, saved_iteration,
                                                write_checkpoint_files)
from specroll_mcore.config import ModelConfig, ParallelConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json",
                   "added_tokens.json")


class HFCheckpointReader(Mapping[str, torch.Tensor]):
    """Lazy name -> tensor view of a HF checkpoint directory (safetensors or .bin, sharded or not)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise FileNotFoundError(f"{self.path} has no config.json: not a Hugging Face model directory")
        self._where: dict[str, Path] = {}
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index = self.path / index_name
            if index.is_file():
                weight_map = json.loads(index.read_text())["weight_map"]
                self._where = {k: self.path / v for k, v in weight_map.items()}
                break
        else:
            for single in ("model.safetensors", "pytorch_model.bin"):
                if (self.path / single).is_file():
                    self._where = {k: self.path / single for k in self._keys_of(self.path / single)}
                    break
        if not self._where:
            raise FileNotFoundError(f"{self.path} has no weights (model.safetensors, pytorch_model.bin or an "
                                    f"index of shards)")
        missing = sorted({str(p) for p in self._where.values() if not p.is_file()})
        if missing:
            raise FileNotFoundError(f"weight shards listed in the index are missing: {missing[:3]}")
        self._bin_cache: dict[Path, dict[str, torch.Tensor]] = {}

    @staticmethod
    def _keys_of(file: Path) -> list[str]:
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                return list(f.keys())
        return list(torch.load(file, map_location="cpu", mmap=True, weights_only=True).keys())

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"{name} not found in the checkpoint at {self.path}")
        file = self._where[name]
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                return f.get_tensor(name)
        if file not in self._bin_cache:  # memory-mapped: pages are read on access
            self._bin_cache = {file: torch.load(file, map_location="cpu", mmap=True, weights_only=True)}
        return self._bin_cache[file][name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def config(self) -> dict[str, Any]:
        return json.loads((self.path / "config.json").read_text())


HUB_MODEL_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""``organisation/name``: a Hugging Face Hub model id."""


def hf_source(src: Any) -> Path:
    """A local HF model directory as it is; a Hub model id (``Qwen/Qwen2.5-7B-Instruct``) that names no
    local path, downloaded into the Hugging Face cache (``HF_HOME``; what is cached already is not fetched
    again): its config, tokenizer files and weights, the safetensors where the repository has them, else
    its .bin files (not both, nor the other formats some repositories add: ``original/``, GGUF, ONNX).
    Offline, a model in the cache is used as it is."""
    path = Path(src)
    if path.exists() or not HUB_MODEL_ID.match(str(src)):
        return path
    from huggingface_hub import list_repo_files, snapshot_download

    common = ["config.json", *TOKENIZER_FILES]
    safetensors = ["model*.safetensors", "model.safetensors.index.json"]
    bins = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]
    try:
        files = list_repo_files(str(src))
    except Exception as online:  # (offline, unknown, gated: the cache may still hold it)
        try:
            return Path(snapshot_download(str(src), allow_patterns=common + safetensors + bins, local_files_only=True))
        except Exception:
            raise FileNotFoundError(f"{src} is not a local directory, and the Hugging Face Hub did not give it "
                                    f"({type(online).__name__}: {online}); download it (`hf download {src} "
                                    f"--local-dir DIR`) and convert DIR") from online
    weights = safetensors if any(f.startswith("model") and f.endswith(".safetensors") for f in files) else bins
    return Path(snapshot_download(str(src), allow_patterns=common + weights))


def gguf_to_hf(gguf_file: Path, out_dir: Path, overwrite: bool = False) -> Path:
    """Dequantize a GGUF file (an architecture ``transformers`` reads from GGUF and we convert) into a
    plain HF directory (safetensors + tokenizer)."""
    import transformers

    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_file} does not exist")

    def write(tmp: Path) -> None:
        kw = dict(gguf_file=gguf_file.name)
        config = transformers.AutoConfig.from_pretrained(gguf_file.parent, **kw)
        model_config_from_hf(config)  # fail early on an unsupported architecture
        loaded = transformers.AutoModelForCausalLM.from_pretrained(gguf_file.parent, **kw)
        plain = transformers.AutoModelForCausalLM.from_config(config)
        plain.load_state_dict(loaded.state_dict())
        plain.save_pretrained(tmp)
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, **kw)
        set_gguf_padding(tokenizer, gguf_file)
        tokenizer.save_pretrained(tmp)

    return atomic_directory(Path(out_dir), write, overwrite)


def set_gguf_padding(tokenizer, gguf_file: Path) -> None:
    """Give a tokenizer read from GGUF the pad token the file names (``tokenizer.ggml.padding_token_id``)
    where ``transformers`` left it unset: 5.25 reads it, 5.17 does not, and batched ``generate`` needs it."""
    if tokenizer.pad_token_id is not None:
        return
    from gguf import GGUFReader

    field = GGUFReader(gguf_file).fields.get("tokenizer.ggml.padding_token_id")
    if field is not None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(int(field.contents()))


def convert_hf_to_mcore(src: Path, out_dir: Path, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                        params_dtype: Optional[str] = None, overwrite: bool = False,
                        first_stage_layers: Optional[int] = None, last_stage_layers: Optional[int] = None) -> Path:
    """Convert a HF directory (or a Hub model id: :func:`hf_source`) into a Megatron checkpoint sharded for
    TP x PP (see checkpoint/megatron.py);
    ``first_stage_layers`` / ``last_stage_layers``: an uneven pipeline split
    (ParallelConfig.num_layers_in_first/last_pipeline_stage)."""
    local = hf_source(src)  # (a Hub model id: its download)
    reader = HFCheckpointReader(local)
    hf_config = reader.config()
    first = reader[next(iter(reader))]
    dtype = params_dtype or {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                             torch.float64: "float64"}[first.dtype]
    model = model_config_from_hf(hf_config, dtype)
    layout = ParallelConfig(tensor_model_parallel_size=tensor_parallel_size,
                            pipeline_model_parallel_size=pipeline_parallel_size,
                            num_layers_in_first_pipeline_stage=first_stage_layers,
                            num_layers_in_last_pipeline_stage=last_stage_layers)
    layout.validate(model, tensor_parallel_size * pipeline_parallel_size)
    arch = hf_architecture(hf_config)
    _check_hf_shapes(reader, model, arch)
    read = _Recording(reader)
    full = _CastMapping(HFToFull(read, model, arch), model.torch_dtype)

    def write(tmp: Path) -> None:
        write_checkpoint_files(tmp, full, model, tensor_parallel_size, pipeline_parallel_size,
                               extra_config={"hf_config": hf_config,
                                             "source": str(src) if local != Path(src) else str(local.resolve())},
                               stage_layers=layout.stage_layers(model.num_layers))
        unused = sorted(name for name in reader if name not in read.names and not _derived(name, model))
        if unused:  # (raised before the output is moved into place: nothing is written)
            raise ValueError(f"{reader.path} holds {len(unused)} tensors this conversion would drop, such as "
                             f"{unused[:4]}: a variant of {arch} that is not supported here")
        for name in TOKENIZER_FILES:
            if (local / name).is_file():
                shutil.copy2(local / name, tmp / name)

    return atomic_directory(Path(out_dir), write, overwrite)


DEFAULT_MAX_SHARD_BYTES = 5 * 10 ** 9
"""HF checkpoints' usual shard size (``save_pretrained``'s "5GB")."""


def convert_mcore_to_hf(ckpt_dir: Path, out_dir: Path, overwrite: bool = False,
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, iteration: Optional[int] = None) -> Path:
    """Convert a Megatron checkpoint (any TP/PP) back into a HF directory ``transformers`` loads: the
    iteration its tracker names, or a training run's iteration ``iteration``.

    Streaming: the checkpoint is read tensor by tensor in stage order (MegatronCheckpointReader,
    memory-mapped) and written in safetensors shards of at most ``max_shard_bytes`` (a tensor larger
    than that gets a shard of its own): ``model.safetensors`` when one shard holds it all, else
    ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``, as ``save_pretrained``
    writes them. Peak memory stays near one shard, not the model."""
    from safetensors.torch import save_file

    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    full = MegatronCheckpointReader(Path(ckpt_dir), iteration=saved_iteration(Path(ckpt_dir), iteration)
                                    if iteration is not None else None)
    model = full.model
    hf_config = dict(full.meta.get("hf_config") or _hf_config_from_model(model))
    arch = hf_architecture(hf_config)
    # the weights' dtype under both names: transformers >= 4.56 (and vLLM through it) reads `dtype`, which
    # the source config may hold with its own dtype, and older readers `torch_dtype`
    hf_config["dtype"] = hf_config["torch_dtype"] = model.params_dtype

    def write(tmp: Path) -> None:
        files: list[list[str]] = []  # the tensor names of each shard written
        shard: dict[str, torch.Tensor] = {}
        size = total = 0

        def flush() -> None:
            save_file(shard, str(tmp / f"part-{len(files)}.safetensors"), metadata={"format": "pt"})
            files.append(list(shard))
            shard.clear()

        for name, tensor in hf_tensors(full, model, arch):
            nbytes = tensor.numel() * tensor.element_size()
            if shard and size + nbytes > max_shard_bytes:
                flush()
                size = 0
            shard[name] = tensor.contiguous()
            size, total = size + nbytes, total + nbytes
        flush()
        if len(files) == 1:
            (tmp / "part-0.safetensors").rename(tmp / "model.safetensors")
        else:
            weight_map = {}
            for i, names in enumerate(files):
                final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                (tmp / f"part-{i}.safetensors").rename(tmp / final)
                weight_map.update(dict.fromkeys(names, final))
            (tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        for name in TOKENIZER_FILES:
            if (Path(ckpt_dir) / name).is_file():
                shutil.copy2(Path(ckpt_dir) / name, tmp / name)

    return atomic_directory(Path(out_dir), write, overwrite)


def _hf_config_from_model(model: ModelConfig) -> dict[str, Any]:
    """A transformers config.json for a checkpoint without its source config: the architecture that
    describes ``model`` (dense: Qwen3 with q/k norms, Qwen2 with a QKV bias, else Llama; a mixture of
    experts: Qwen3-MoE with q/k norms, Mixtral without a bias or shared expert that renormalises the
    top k, else Qwen2-MoE)."""
    if model.qk_layernorm:
        arch, model_type = "Qwen3ForCausalLM", "qwen3"
    elif model.add_qkv_bias:
        arch, model_type = "Qwen2ForCausalLM", "qwen2"
    else:
        arch, model_type = "LlamaForCausalLM", "llama"
    intermediate, moe = model.ffn_hidden_size, {}
    if model.is_moe and not model.qk_layernorm and not model.add_qkv_bias and model.moe_norm_topk_prob \
            and model.moe_shared_expert_ffn_hidden_size is None:
        arch, model_type, intermediate = "MixtralForCausalLM", "mixtral", model.moe_ffn_hidden_size
        moe = {"num_local_experts": model.num_experts, "num_experts_per_tok": model.moe_router_topk,
               "sliding_window": None}
    elif model.is_moe:
        arch, model_type = ("Qwen3MoeForCausalLM", "qwen3_moe") if model.qk_layernorm else \
            ("Qwen2MoeForCausalLM", "qwen2_moe")
        moe = {"num_experts": model.num_experts, "num_experts_per_tok": model.moe_router_topk,
               "moe_intermediate_size": model.moe_ffn_hidden_size, "norm_topk_prob": model.moe_norm_topk_prob,
               "decoder_sparse_step": 1, "mlp_only_layers": [], "qkv_bias": model.add_qkv_bias,
               "shared_expert_intermediate_size": model.moe_shared_expert_ffn_hidden_size or 0}
    return {"architectures": [arch], "model_type": model_type, **moe,
            "hidden_size": model.hidden_size, "intermediate_size": intermediate,
            "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_attention_heads,
            "num_key_value_heads": model.num_query_groups, "head_dim": model.kv_channels,
            "vocab_size": model.vocab_size, "max_position_embeddings": model.max_position_embeddings,
            "rope_theta": model.rope_theta, "rope_scaling": copy.deepcopy(model.rope_scaling),
            "rms_norm_eps": model.norm_eps,
            "tie_word_embeddings": model.tie_word_embeddings, "attention_bias": model.add_qkv_bias,
            "hidden_act": "silu"}


def _check_hf_shapes(reader: HFCheckpointReader, model: ModelConfig, arch: str = "LlamaForCausalLM") -> None:
    """Shapes of the HF tensors that determine the fused ones, checked against config.json."""
    h, d = model.hidden_size, model.kv_channels
    expect = {"model.embed_tokens.weight": (model.vocab_size, h)}
    first, last = "model.layers.0.", f"model.layers.{model.num_layers - 1}."
    if arch in FUSED_PROJECTIONS:
        expect[first + "self_attn.qkv_proj.weight"] = ((model.num_attention_heads + 2 * model.num_query_groups) * d, h)
        expect[first + "mlp.gate_up_proj.weight"] = (2 * model.ffn_hidden_size, h)
    else:
        expect[first + "self_attn.q_proj.weight"] = (model.num_attention_heads * d, h)
        expect[first + "self_attn.k_proj.weight"] = (model.num_query_groups * d, h)
    if model.is_moe:  # the router of the first layer, the first and last experts' matrices
        table, gate_up = layer_table(model, arch), gate_up_table(model, arch)
        f = model.moe_ffn_hidden_size
        expect[first + table["mlp.router.weight"]] = (model.num_experts, h)
        for e in (0, model.num_experts - 1):
            expect[first + gate_up[f"mlp.experts.local_experts.{e}.linear_fc1.weight"][0]] = (f, h)
            expect[last + table[f"mlp.experts.local_experts.{e}.linear_fc2.weight"]] = (h, f)
        if model.moe_shared_expert_ffn_hidden_size is not None:
            shared_gate = gate_up["mlp.shared_experts.linear_fc1.weight"][0]
            expect[first + shared_gate] = (model.moe_shared_expert_ffn_hidden_size, h)
    else:
        if arch not in FUSED_PROJECTIONS:
            expect[first + "mlp.gate_proj.weight"] = (model.ffn_hidden_size, h)
        expect[last + "mlp.down_proj.weight"] = (h, model.ffn_hidden_size)
    if model.qk_layernorm:
        expect["model.layers.0.self_attn.q_norm.weight"] = (d,)
    for name, shape in expect.items():
        if name not in reader:
            raise ValueError(f"{name} is missing from {reader.path}; does config.json belong to these weights?")
        got = tuple(reader[name].shape)
        if got != shape:
            raise ValueError(f"{name} has shape {got} but config.json implies {shape}; "
                             f"does config.json belong to these weights?")


class _Recording(Mapping[str, torch.Tensor]):
    """A mapping that remembers the names read from it."""

    def __init__(self, inner: Mapping[str, torch.Tensor]) -> None:
        self.inner, self.names = inner, set()

    def __getitem__(self, k: str) -> torch.Tensor:
        self.names.add(k)
        return self.inner[k]

    def __iter__(self) -> Iterator[str]:
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)


def _derived(name: str, model: ModelConfig) -> bool:
    """HF tensors that hold nothing of their own: RoPE's inverse frequencies (recomputed from the config),
    with tied embeddings a saved copy of the embedding as the output layer, and a Qwen2-MoE's shared
    expert of zero width (transformers always builds one; ``shared_expert_intermediate_size`` 0)."""
    return (name.endswith("rotary_emb.inv_freq") or (model.tie_word_embeddings and name == "lm_head.weight")
            or (model.is_moe and model.moe_shared_expert_ffn_hidden_size is None and ".mlp.shared_expert" in name))


class _CastMapping(Mapping[str, torch.Tensor]):
    def __init__(self, inner: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.inner, self.dtype = inner, dtype

    def __getitem__(self, k: str) -> torch.Tensor:
        return self.inner[k].to(self.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)
