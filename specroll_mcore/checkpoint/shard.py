"""Full (unsharded) Megatron state dicts <-> the shard one rank holds.

The *full* form is what a TP=1, PP=1 ``GPTModel`` would hold, except that the vocabulary rows are
not padded (``vocab_size`` rows): padding depends on the TP size, so it is added when sharding and
removed when gathering. Converters (HF <-> Megatron) speak the full form; resharding (a TP=1
checkpoint loaded at TP=2) is full -> shard with the new layout.

How each parameter is split over TP follows megatron-core's layers:
  * ColumnParallelLinear / VocabParallelEmbedding: dim 0 (QKV rows are grouped per KV head, so
    contiguous chunks give each rank whole groups; the SwiGLU fc1 is [gate; up], chunked separately);
  * RowParallelLinear: dim 1;
  * a mixture of experts' MLPs (each expert's, the shared expert's) as the dense MLP;
  * norms, the router, the shared expert's gate and the heads' token counts: replicated.
Layer numbers are global in the full form and local to the stage in the shard. Expert parallelism
splits a shard's routed experts further, at load time (:func:`expert_shard`): files hold every expert.
"""

from __future__ import annotations

import re
from typing import Mapping, Optional, Sequence

import torch

from specroll_mcore.config import ModelConfig, pipeline_split

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_ROW_PARALLEL = ("self_attention.linear_proj.weight", "linear_fc2.weight")  # (fc2: dense, expert, shared)
_COLUMN_PARALLEL = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
_HEADS = re.compile(r"^heads\..*\.weight$")  # horizon heads' ColumnParallelLinears, rows split over TP
# (their token_counts buffer is replicated)


def _pad_vocab(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def shard_tensor(name: str, full: torch.Tensor, model: ModelConfig, tp_size: int, tp_rank: int) -> torch.Tensor:
    """The TP shard of one full-form tensor (``name`` without the layer prefix for layers)."""
    if name in _VOCAB:
        if full.shape[0] != model.vocab_size:
            raise ValueError(f"{name} has {full.shape[0]} rows, ModelConfig.vocab_size is {model.vocab_size}")
        return _pad_vocab(full, model.padded_vocab_size(tp_size)).chunk(tp_size, 0)[tp_rank]
    if name.endswith(_COLUMN_PARALLEL) or _HEADS.match(name):
        return full.chunk(tp_size, 0)[tp_rank]
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2, 0)
        return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]])
    if name.endswith(_ROW_PARALLEL):
        return full.chunk(tp_size, 1)[tp_rank]
    return full


def unshard_tensor(name: str, shards: list[torch.Tensor], model: ModelConfig) -> torch.Tensor:
    """Inverse of :func:`shard_tensor`: the TP shards of one tensor, rank order -> full form."""
    if name in _VOCAB:
        return torch.cat(shards)[: model.vocab_size]
    if name.endswith(_COLUMN_PARALLEL) or _HEADS.match(name):
        return torch.cat(shards)
    if name.endswith("linear_fc1.weight"):
        gates, ups = zip(*(s.chunk(2, 0) for s in shards))
        return torch.cat([*gates, *ups])
    if name.endswith(_ROW_PARALLEL):
        return torch.cat(shards, 1)
    return shards[0]


_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")


def routed_expert(name: str) -> bool:
    """Whether ``name`` is a routed expert's tensor (what expert parallelism splits; not a shared expert's)."""
    return _EXPERT.match(name) is not None


def expert_shard(local: Mapping[str, torch.Tensor], num_experts: int, ep_size: int, ep_rank: int
                 ) -> dict[str, torch.Tensor]:
    """Expert parallelism: a stage's state dict holding every routed expert -> the one EP rank
    ``ep_rank`` holds: its ``num_experts / ep_size`` consecutive experts (megatron-core's
    ``local_expert_indices``), numbered from 0; every other tensor as it is."""
    per_rank = num_experts // ep_size
    out: dict[str, torch.Tensor] = {}
    for name, t in local.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = t
            continue
        e = int(m.group(2))
        if e >= num_experts:
            raise KeyError(f"{name}: expert {e} of a model with {num_experts} experts")
        if e // per_rank == ep_rank:
            out[f"{m.group(1)}{e - ep_rank * per_rank}{m.group(3)}"] = t
    return out


def expert_global_name(name: str, num_experts: int, ep_size: int, ep_rank: int) -> str:
    """The name a tensor of EP rank ``ep_rank`` has where every expert is held (its routed experts
    numbered globally, as in checkpoints; any other name as it is)."""
    m = _EXPERT.match(name)
    if m is None or ep_size == 1:
        return name
    return f"{m.group(1)}{int(m.group(2)) + ep_rank * (num_experts // ep_size)}{m.group(3)}"


def expert_unshard(parts: Sequence[Mapping[str, torch.Tensor]], num_experts: int) -> dict[str, torch.Tensor]:
    """Inverse of :func:`expert_shard`: each EP rank's experts (local numbers), rank order -> every
    expert under its global number."""
    per_rank = num_experts // len(parts)
    out: dict[str, torch.Tensor] = {}
    for rank, part in enumerate(parts):
        for name, t in part.items():
            m = _EXPERT.match(name)
            if m is None:
                raise KeyError(f"{name} is not a routed expert's tensor")
            out[f"{m.group(1)}{int(m.group(2)) + rank * per_rank}{m.group(3)}"] = t
    return out


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """A shard that is a view into a full tensor would keep (and torch.save would write) the whole
    full tensor: copy it out so the full tensor can be freed."""
    if t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone()


def stage_split(model: ModelConfig, pp_size: int, stage_layers: Optional[Sequence[int]] = None) -> list[int]:
    """Layers per pipeline stage: ``stage_layers`` (ParallelConfig.stage_layers) or, when None, an
    even split."""
    return list(stage_layers) if stage_layers is not None else pipeline_split(model.num_layers, pp_size)


def local_state_dict(full: Mapping[str, torch.Tensor], model: ModelConfig, tp_size: int, tp_rank: int,
                     pp_size: int, pp_rank: int, stage_layers: Optional[Sequence[int]] = None
                     ) -> dict[str, torch.Tensor]:
    """The state dict one (tp_rank, pp_rank) GPTModel holds, from the full form.

    ``stage_layers``: layers per pipeline stage (ParallelConfig.stage_layers; None: an even split).
    ``full`` may compute its tensors lazily (see checkpoint/hf.py): only the tensors this stage
    needs are read, one at a time."""
    split = stage_split(model, pp_size, stage_layers)
    lo = sum(split[:pp_rank])
    hi = lo + split[pp_rank]
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    out: dict[str, torch.Tensor] = {}
    for name in full.keys():
        m = _LAYER.match(name)
        if m:
            layer = int(m.group(1))
            if lo <= layer < hi:
                local = f"decoder.layers.{layer - lo}.{m.group(2)}"
                out[local] = _own_storage(shard_tensor(m.group(2), full[name], model, tp_size, tp_rank))
        elif name == "embedding.word_embeddings.weight":
            if first or (model.tie_word_embeddings and last):
                shard = _own_storage(shard_tensor(name, full[name], model, tp_size, tp_rank))
                if first:
                    out[name] = shard
                if model.tie_word_embeddings and last and not first:
                    out["output_layer.weight"] = shard  # the last stage's copy of the tied weight
        elif name == "output_layer.weight":
            if last and not model.tie_word_embeddings:
                out[name] = _own_storage(shard_tensor(name, full[name], model, tp_size, tp_rank))
        elif name == "decoder.final_layernorm.weight":
            if last:
                out[name] = full[name]
        else:
            raise KeyError(f"unexpected parameter {name!r} in a full Megatron state dict")
    return out


def full_name(local: str, stage_start: int, model: ModelConfig) -> str:
    """Inverse of :func:`local_state_dict`'s naming: a stage's tensor name (local layer numbers; the stage's
    first layer is ``stage_start``) -> its full-form name (the last stage's copy of a tied embedding is
    the embedding)."""
    m = _LAYER.match(local)
    if m:
        return f"decoder.layers.{int(m.group(1)) + stage_start}.{m.group(2)}"
    return "embedding.word_embeddings.weight" if local == "output_layer.weight" and model.tie_word_embeddings else local


def expected_full_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the full form (for validation and random init)."""
    h, d, f = model.hidden_size, model.kv_channels, model.ffn_hidden_size
    qkv = (model.num_attention_heads + 2 * model.num_query_groups) * d
    moe = _moe_shapes(model) if model.is_moe else {}
    shapes: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (model.vocab_size, h)}
    for i in range(model.num_layers):
        p = f"decoder.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attention.linear_qkv.weight"] = (qkv, h)
        if model.add_qkv_bias:
            shapes[p + "self_attention.linear_qkv.bias"] = (qkv,)
        shapes[p + "self_attention.linear_proj.weight"] = (h, model.num_attention_heads * d)
        if model.qk_layernorm:
            shapes[p + "self_attention.q_layernorm.weight"] = (d,)
            shapes[p + "self_attention.k_layernorm.weight"] = (d,)
        shapes[p + "pre_mlp_layernorm.weight"] = (h,)
        if model.is_moe:
            shapes.update({p + k: v for k, v in moe.items()})
        else:
            shapes[p + "mlp.linear_fc1.weight"] = (2 * f, h)
            shapes[p + "mlp.linear_fc2.weight"] = (h, f)
    shapes["decoder.final_layernorm.weight"] = (h,)
    if not model.tie_word_embeddings:
        shapes["output_layer.weight"] = (model.vocab_size, h)
    return shapes


def _moe_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Layer-relative name -> shape of a mixture-of-experts MLP (megatron-core's MoELayer)."""
    h, f = model.hidden_size, model.moe_ffn_hidden_size
    shapes: dict[str, tuple[int, ...]] = {"mlp.router.weight": (model.num_experts, h)}
    for e in range(model.num_experts):
        shapes[f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = (2 * f, h)
        shapes[f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = (h, f)
    s = model.moe_shared_expert_ffn_hidden_size
    if s is not None:
        shapes["mlp.shared_experts.linear_fc1.weight"] = (2 * s, h)
        shapes["mlp.shared_experts.linear_fc2.weight"] = (h, s)
        if model.moe_shared_expert_gate:
            shapes["mlp.shared_experts.gate_weight"] = (1, h)
    return shapes


def check_full_state_dict(full: Mapping[str, torch.Tensor], model: ModelConfig) -> None:
    """Every expected tensor present with the shape the config implies; nothing unexpected."""
    expected = expected_full_shapes(model)
    missing = sorted(set(expected) - set(full))
    extra = sorted(set(full) - set(expected))
    if missing or extra:
        raise ValueError(f"state dict does not match the model config: missing {missing[:5]}"
                         f"{'...' if len(missing) > 5 else ''}, unexpected {extra[:5]}"
                         f"{'...' if len(extra) > 5 else ''}")
    for name, shape in expected.items():
        if tuple(full[name].shape) != shape:
            raise ValueError(f"{name} has shape {tuple(full[name].shape)} but the model config implies "
                             f"{shape}; does config.json belong to these weights?")


def random_full_state_dict(model: ModelConfig, seed: int, std: float = 0.02) -> dict[str, torch.Tensor]:
    """A seeded random model in the full form (independent of the parallel layout)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_full_shapes(model).items():
        if name.endswith("layernorm.weight"):
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith(".bias"):
            out[name] = 0.1 * torch.randn(shape, generator=g)
        else:
            out[name] = std * torch.randn(shape, generator=g)
    return {k: v.to(model.torch_dtype) for k, v in out.items()}


def random_full_heads(model: ModelConfig, num_heads: int, generator: torch.Generator,
                      std: float = 0.05) -> dict[str, torch.Tensor]:
    """Random horizon heads in the full form (PolicyModel.load_full_heads): each head's ``layers``,
    then ``root_layers``, then ``path_layers.{i}.{j}`` (j < i), [h, h] each, drawn from ``generator``
    in that order (independent of the parallel layout)."""
    h = model.hidden_size
    names = [f"heads.{kind}.{i}.weight" for kind in ("layers", "root_layers") for i in range(num_heads)]
    names += [f"heads.path_layers.{i}.{j}.weight" for i in range(num_heads) for j in range(i)]
    return {name: (std * torch.randn(h, h, generator=generator)).to(model.torch_dtype) for name in names}
