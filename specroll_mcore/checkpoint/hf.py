"""Hugging Face Llama / Mistral / Phi-3 / Qwen2 / Qwen3 and their mixtures of experts (Mixtral, Qwen2-MoE,
Qwen3-MoE) <-> the full Megatron form: name tables plus named fuse helpers.

HF keeps q/k/v and gate/up as separate matrices; megatron-core fuses them:
  * ``linear_qkv`` rows are grouped per KV head: for each group g, its np/ng query heads, then its
    key head, then its value head (``fuse_qkv`` / ``split_qkv``);
  * ``linear_fc1`` is [gate; up] (``fuse_gate_up`` / ``split_gate_up``), for a dense MLP and for each
    expert alike (:func:`gate_up_table`).
Phi-3 / Phi-4 checkpoints fuse them their own way (:data:`FUSED_PROJECTIONS`).
Qwen3's per-head query/key norms are megatron-core's ``q_layernorm`` / ``k_layernorm``. A mixture of
experts' router (HF ``gate``) is megatron-core's ``mlp.router``, its experts
``mlp.experts.local_experts.E``, Qwen2-MoE's shared expert and its sigmoid gate ``mlp.shared_experts``.
Both use the rotate-half RoPE convention, so no permutation of q/k rows is needed.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch

from specroll_mcore.checkpoint.shard import _LAYER, expected_full_shapes
from specroll_mcore.config import ROPE_SCALING_FIELDS, ROPE_SCALING_OPTIONAL, ModelConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM",
                           "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                "phi3": "Phi3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
FUSED_PROJECTIONS = ("Phi3ForCausalLM",)
"""Architectures whose HF checkpoints keep q/k/v in one ``qkv_proj`` ([q; k; v] rows) and gate/up in
one ``gate_up_proj`` ([gate; up] rows, megatron's ``linear_fc1`` as it is)."""

# Megatron name (layer-relative, after "decoder.layers.{i}.") -> HF name (after "model.layers.{i}.")
LAYER_TABLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
QK_NORM_TABLE = {  # with ModelConfig.qk_layernorm (Qwen3)
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
GLOBAL_TABLE = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    """HF q [np*d, ...], k/v [ng*d, ...] -> megatron linear_qkv [ng*(np/ng+2)*d, ...] (weights or biases)."""
    ng, d = model.num_query_groups, model.kv_channels
    per = model.num_attention_heads // ng
    rest = q.shape[1:]
    qg = q.reshape(ng, per * d, *rest)
    kg = k.reshape(ng, d, *rest)
    vg = v.reshape(ng, d, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(ng * (per + 2) * d, *rest)


def split_qkv(qkv: torch.Tensor, model: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`."""
    ng, d = model.num_query_groups, model.kv_channels
    per = model.num_attention_heads // ng
    rest = qkv.shape[1:]
    grouped = qkv.reshape(ng, (per + 2) * d, *rest)
    q, k, v = grouped.split([per * d, d, d], dim=1)
    return q.reshape(ng * per * d, *rest), k.reshape(ng * d, *rest), v.reshape(ng * d, *rest)


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = fc1.chunk(2, dim=0)
    return gate, up


def _moe_names(arch: str) -> tuple[str, str, str, str]:
    """(block prefix, gate, up, down) of an architecture's expert tensors in its HF checkpoints."""
    if arch == "MixtralForCausalLM":
        return "block_sparse_moe.", "w1", "w3", "w2"
    return "mlp.", "gate_proj", "up_proj", "down_proj"


def layer_table(model: ModelConfig, arch: str = "LlamaForCausalLM") -> dict[str, str]:
    """The one-to-one layer names (Megatron -> HF) of ``model`` saved as ``arch``."""
    table = dict(LAYER_TABLE)
    if model.qk_layernorm:
        table.update(QK_NORM_TABLE)
    if arch in FUSED_PROJECTIONS:
        table["mlp.linear_fc1.weight"] = "mlp.gate_up_proj.weight"
    if not model.is_moe:
        return table
    del table["mlp.linear_fc2.weight"]
    block, _, _, down = _moe_names(arch)
    table["mlp.router.weight"] = block + "gate.weight"
    for e in range(model.num_experts):
        table[f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = f"{block}experts.{e}.{down}.weight"
    if model.moe_shared_expert_ffn_hidden_size is not None:
        table["mlp.shared_experts.linear_fc2.weight"] = "mlp.shared_expert.down_proj.weight"
        if model.moe_shared_expert_gate:
            table["mlp.shared_experts.gate_weight"] = "mlp.shared_expert_gate.weight"
    return table


def gate_up_table(model: ModelConfig, arch: str = "LlamaForCausalLM") -> dict[str, tuple[str, str]]:
    """Megatron ``linear_fc1`` names (layer-relative) -> the HF gate and up matrices fused into them."""
    if arch in FUSED_PROJECTIONS:
        return {}
    if not model.is_moe:
        return {"mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}
    block, gate, up, _ = _moe_names(arch)
    table = {f"mlp.experts.local_experts.{e}.linear_fc1.weight":
             (f"{block}experts.{e}.{gate}.weight", f"{block}experts.{e}.{up}.weight")
             for e in range(model.num_experts)}
    if model.moe_shared_expert_ffn_hidden_size is not None:
        table["mlp.shared_experts.linear_fc1.weight"] = ("mlp.shared_expert.gate_proj.weight",
                                                         "mlp.shared_expert.up_proj.weight")
    return table


def hf_architecture(hf_config: Any) -> str:
    """The supported architecture a transformers config (or its dict) describes; a clear error otherwise."""
    c = hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
    archs = c.get("architectures") or []
    known = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
    arch = known[0] if known else _MODEL_TYPES.get(c.get("model_type"))
    if arch is None:
        raise ValueError(f"unsupported architecture {archs or c.get('model_type')!r}; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def model_config_from_hf(hf_config: Any, params_dtype: str = "float32") -> ModelConfig:
    """ModelConfig from a transformers Llama / Mistral / Mixtral / Phi-3 / Qwen2 / Qwen2-MoE / Qwen3 / Qwen3-MoE
    config (or its dict)."""
    c = hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
    arch = hf_architecture(c)
    # Sliding-window attention: Mistral's and Phi-3's whenever sliding_window is set, Qwen's where
    # use_sliding_window (or transformers 5's layer_types) switches it on. A window no shorter than the
    # context is full attention.
    window, context = c.get("sliding_window"), c.get("max_position_embeddings", 2048)
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
        sliding = window is not None
    else:
        sliding = bool(c.get("use_sliding_window")) or "sliding_attention" in (c.get("layer_types") or [])
    if sliding and window is not None and window < context:
        raise ValueError(f"config.json sets sliding-window attention over {window} tokens, shorter than the "
                         f"{context}-token context (max_position_embeddings): not supported, every layer here "
                         f"attends to the whole context; lower max_position_embeddings to {window} to use the model "
                         f"within its window")
    act = c.get("hidden_act", c.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):
        raise ValueError(f"config.json sets hidden_act {act!r}: not supported, the MLP here is SwiGLU (silu)")
    if c.get("mlp_bias"):
        raise ValueError("config.json sets mlp_bias: not supported, the MLP's projections here have no biases")
    if c.get("attention_bias") and arch not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
        raise ValueError(f"config.json sets attention_bias, which in {arch} also gives the output projection "
                         f"(o_proj) a bias: not supported, only the query, key and value projections take one here")
    rope = dict(c.get("rope_parameters") or {})  # transformers >= 5: theta and scaling in one dict
    scaling = dict(c.get("rope_scaling") or {}) or {k: v for k, v in rope.items() if k != "rope_theta"}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        rope_scaling = None
    elif rope_type in ROPE_SCALING_FIELDS:
        if rope_type == "yarn" and scaling.get("factor") is None and scaling.get("original_max_position_embeddings"):
            scaling["factor"] = context / scaling["original_max_position_embeddings"]  # (transformers' rule)
        # (a missing field is named by ModelConfig; optional ones left unset take transformers' defaults)
        names = (*ROPE_SCALING_FIELDS[rope_type], *ROPE_SCALING_OPTIONAL.get(rope_type, ()), "truncate")
        rope_scaling = {"rope_type": rope_type, **{k: scaling[k] for k in names if scaling.get(k) is not None}}
    else:
        raise ValueError(f"RoPE scaling {rope_type!r} is not supported; supported: plain RoPE, "
                         f"{', '.join(sorted(ROPE_SCALING_FIELDS))}")
    partial = scaling.get("partial_rotary_factor", c.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor {partial} is not supported: RoPE rotates the whole head here")
    rope_theta = c.get("rope_theta") or rope.get("rope_theta", 10000.0)
    return ModelConfig(
        num_layers=c["num_hidden_layers"],
        hidden_size=c["hidden_size"],
        ffn_hidden_size=c["intermediate_size"],
        num_attention_heads=c["num_attention_heads"],
        num_query_groups=c.get("num_key_value_heads") or c["num_attention_heads"],
        vocab_size=c["vocab_size"],
        max_position_embeddings=context,
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        norm_eps=c.get("rms_norm_eps", 1e-6),
        add_qkv_bias=bool(c.get("attention_bias", c.get("qkv_bias", arch in ("Qwen2ForCausalLM",
                                                                             "Qwen2MoeForCausalLM")))),
        qk_layernorm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        kv_channels=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        params_dtype=params_dtype,
        **_moe_config_from_hf(c, arch),
    )


def _moe_config_from_hf(c: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """The ModelConfig fields of a Mixtral / Qwen2-MoE / Qwen3-MoE config's experts (none for a dense one)."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    step, dense = c.get("decoder_sparse_step", 1), c.get("mlp_only_layers") or []
    if step != 1 or dense:
        raise ValueError(f"config.json mixes dense and mixture-of-experts layers (decoder_sparse_step {step}, "
                         f"mlp_only_layers {dense}): not supported, every layer here is a mixture of experts")
    if c.get("router_jitter_noise"):
        raise ValueError(f"config.json sets router_jitter_noise {c['router_jitter_noise']}: not supported "
                         f"(the router here is deterministic); set it to 0")
    experts = c.get("num_experts") or c.get("num_local_experts")
    if arch == "MixtralForCausalLM":
        return dict(num_experts=experts, moe_router_topk=c["num_experts_per_tok"],
                    moe_ffn_hidden_size=c["intermediate_size"], moe_norm_topk_prob=True)
    shared = c.get("shared_expert_intermediate_size") or None
    return dict(num_experts=experts, moe_router_topk=c["num_experts_per_tok"],
                moe_ffn_hidden_size=c["moe_intermediate_size"], moe_norm_topk_prob=bool(c.get("norm_topk_prob")),
                moe_shared_expert_ffn_hidden_size=shared if arch == "Qwen2MoeForCausalLM" else None,
                moe_shared_expert_gate=arch == "Qwen2MoeForCausalLM" and shared is not None)


class HFToFull(Mapping[str, torch.Tensor]):
    """The full Megatron form of a HF state dict, computed tensor by tensor on access.

    With a lazy ``hf`` mapping (:class:`HFCheckpointReader`) only the HF tensors a full tensor
    needs are read, so converting a large model never holds it whole in memory."""

    def __init__(self, hf: Mapping[str, torch.Tensor], model: ModelConfig, arch: str = "LlamaForCausalLM") -> None:
        """``arch``: the HF architecture whose tensor names ``hf`` has (:func:`hf_architecture`)."""
        self.hf, self.model, self.arch = hf, model, arch
        self.table, self.gate_up = layer_table(model, arch), gate_up_table(model, arch)
        self._names = list(expected_full_shapes(model))

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __getitem__(self, name: str) -> torch.Tensor:
        hf, model = self.hf, self.model
        if name in GLOBAL_TABLE:
            return hf[GLOBAL_TABLE[name]]
        m = _LAYER.match(name)
        if not m:
            raise KeyError(name)
        layer, rel = f"model.layers.{m.group(1)}.", m.group(2)
        if rel in self.table:
            return hf[layer + self.table[rel]]
        if rel in self.gate_up:
            gate, up = self.gate_up[rel]
            return fuse_gate_up(hf[layer + gate], hf[layer + up])
        a = layer + "self_attn."
        if rel == "self_attention.linear_qkv.weight" and self.arch in FUSED_PROJECTIONS:
            d = model.kv_channels
            q, k, v = hf[a + "qkv_proj.weight"].split(
                [model.num_attention_heads * d, model.num_query_groups * d, model.num_query_groups * d])
            return fuse_qkv(q, k, v, model)
        if rel == "self_attention.linear_qkv.weight":
            return fuse_qkv(hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], model)
        if rel == "self_attention.linear_qkv.bias":
            return fuse_qkv(hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], model)
        raise KeyError(name)


def hf_to_full(hf: Mapping[str, torch.Tensor], model: ModelConfig,
               arch: str = "LlamaForCausalLM") -> dict[str, torch.Tensor]:
    """HF state dict -> full Megatron form, materialised (``arch``: see :class:`HFToFull`)."""
    lazy = HFToFull(hf, model, arch)
    return {name: lazy[name] for name in lazy}


def full_to_hf(full: Mapping[str, torch.Tensor], model: ModelConfig,
               arch: str = "LlamaForCausalLM") -> dict[str, torch.Tensor]:
    """Full Megatron form -> HF state dict of ``arch`` (inverse of :func:`hf_to_full`)."""
    return dict(hf_tensors(full, model, arch))


def _zero_width_shared_expert(layer: str, model: ModelConfig,
                              like: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A Qwen2-MoE layer's shared expert where the model has none: transformers' Qwen2-MoE always
    builds one (``shared_expert_intermediate_size`` 0 in the exported config), so it is written with
    zero width, and its gate as zeros, for every weight to load from the checkpoint; a zero-width
    expert adds nothing to the layer's output."""
    h, m = model.hidden_size, layer + "mlp."
    yield from ((m + "shared_expert.gate_proj.weight", like.new_zeros(0, h)),
                (m + "shared_expert.up_proj.weight", like.new_zeros(0, h)),
                (m + "shared_expert.down_proj.weight", like.new_zeros(h, 0)),
                (m + "shared_expert_gate.weight", like.new_zeros(1, h)))


def hf_tensors(full: Mapping[str, torch.Tensor], model: ModelConfig,
               arch: str = "LlamaForCausalLM") -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors of ``arch`` (name, tensor) from the full Megatron form, one at a time in the
    checkpoint's order (embedding, layers, final norm, output layer): each full tensor is read when
    its HF tensors are made (a lazy ``full``, such as checkpoint/megatron.MegatronCheckpointReader,
    is read in stage order)."""
    embedding, *last = GLOBAL_TABLE  # (the final norm, the output layer: none where tied)
    yield GLOBAL_TABLE[embedding], full[embedding]
    table, gate_up = layer_table(model, arch), gate_up_table(model, arch)
    for i in range(model.num_layers):
        layer, mlayer = f"model.layers.{i}.", f"decoder.layers.{i}."
        for mname, hname in table.items():
            yield layer + hname, full[mlayer + mname]
        for mname, (gate, up) in gate_up.items():
            g, u = split_gate_up(full[mlayer + mname])
            yield layer + gate, g
            yield layer + up, u
        if arch == "Qwen2MoeForCausalLM" and model.moe_shared_expert_ffn_hidden_size is None:
            yield from _zero_width_shared_expert(layer, model, full[mlayer + "mlp.router.weight"])
        a = layer + "self_attn."
        q, k, v = split_qkv(full[mlayer + "self_attention.linear_qkv.weight"], model)
        if arch in FUSED_PROJECTIONS:
            yield a + "qkv_proj.weight", torch.cat([q, k, v])
            continue
        yield from ((a + "q_proj.weight", q), (a + "k_proj.weight", k), (a + "v_proj.weight", v))
        if model.add_qkv_bias:
            q, k, v = split_qkv(full[mlayer + "self_attention.linear_qkv.bias"], model)
            yield from ((a + "q_proj.bias", q), (a + "k_proj.bias", k), (a + "v_proj.bias", v))
    yield from ((GLOBAL_TABLE[mname], full[mname]) for mname in last if mname in full)
