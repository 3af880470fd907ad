"""The policy: a megatron-core ``GPTModel`` built from our layer spec, plus stage-to-stage glue.

Parameter names, shapes and TP layout are megatron-core's (``embedding.word_embeddings.weight``,
``decoder.layers.N.self_attention.linear_qkv.weight``, ... ``output_layer.weight``), so Megatron
checkpoints and tools apply. The swaps in the local layer spec are the self-attention class (KV
cache and tree masks), its core attention (torch SDPA, runs on CPU and GPU), linears with packed CPU
inference products and, in a mixture of experts (megatron-core's MoELayer, ``moe_fields``), experts
that skip the empty ones in inference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable, Iterator, Mapping, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                           gather_from_sequence_parallel_region)
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from specroll_mcore import cpu_gemm
from specroll_mcore.checkpoint.shard import (check_full_state_dict, expert_shard, expert_unshard, local_state_dict,
                                             routed_expert, shard_tensor)
from specroll_mcore.config import ModelConfig, check_tensor_parallel
from specroll_mcore.cpu_gemm import PackedColumnParallelLinear, PackedRowParallelLinear
from specroll_mcore.heads import TOKEN_COUNTS, HorizonHeads, horizon_heads_spec, vocab_rows
from specroll_mcore.model.attention import (KEY_BLOCK, STEP_ATTENTION_DTYPES, STEP_ATTENTION_HEAD_DIMS,
                                            AttentionMetadata, SDPACoreAttention,
                                            SpecRollSelfAttention, rope_attention_factor, rope_inv_freq,
                                            step_attention_kernels)
from specroll_mcore.model.kv_cache import KVCache
from specroll_mcore.model.routing import recorded_routing, routers
from specroll_mcore.parallel import ParallelContext, cpu_model_construction


def transformer_config(model: ModelConfig, ctx: ParallelContext) -> TransformerConfig:
    """megatron-core TransformerConfig for a Llama/Qwen2/Qwen3 architecture (dense or mixture of
    experts) under this layout."""
    check_tensor_parallel(model, ctx.tp_size)  # (a checkpoint loaded into a layout it does not fit)
    ctx.stage_layers(model.num_layers)  # a split that does not add up fails here, naming the fields
    dtype = model.torch_dtype
    return TransformerConfig(**moe_fields(model, ctx),
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.add_qkv_bias,
        qk_layernorm=model.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_method_std,
        tensor_model_parallel_size=ctx.tp_size,
        pipeline_model_parallel_size=ctx.pp_size,
        num_layers_in_first_pipeline_stage=ctx.first_stage_layers,
        num_layers_in_last_pipeline_stage=ctx.last_stage_layers,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=ctx.device.type == "cpu",
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )


def batch_invariant(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a policy of ``dtype`` on ``device`` computes a step's tokens as one-token forwards would,
    bit for bit (ordered attention, model/attention.py; row-invariant products, cpu_gemm.py; routers
    in float64, :func:`moe_fields`): half precision on CPU, where rounding would otherwise flip
    samples. On GPU the products are cuBLAS's, whose results depend on the row count; SDPA there."""
    return dtype in (torch.bfloat16, torch.float16) and device.type == "cpu"


def moe_fields(model: ModelConfig, ctx: ParallelContext) -> dict:
    """The TransformerConfig fields of ``model``'s mixture of experts (none for a dense model).

    Routing as Hugging Face's Mixtral / Qwen-MoE: a softmax over the router's logits, the top k
    experts, weighed by their probabilities renormalised over the k (megatron-core's top-k then
    softmax) or not (its pre-softmax routing). Dropless (no expert capacity); megatron-core's
    Switch load-balancing loss on each router in training where ``moe_aux_loss_coeff`` > 0 (see
    rl/schedule.py for its scale and padding), else none; megatron-core's all-gather token dispatcher
    without expert parallelism (every rank holds every expert, nothing travels), its all-to-all one
    with it (``ParallelConfig.expert_model_parallel_size``: each token goes to the ranks of its
    experts and back; on CPU through the shim in parallel.py). A batch-invariant policy (half
    precision on CPU) routes in float64, where a router product depends on the rows in the call by
    far less (measured on Qwen3-30B-A3B's 128 x 2048 router: in bfloat16, 1 of 64 rows differs from
    its one-row product in calls of 64 rows or more; in float32, nearly every row; in float64 none on
    one CPU, and on a 2-core Xeon with AMX every row, by at most 3e-11 relative), so that an expert
    choice flips only at a near-tie of that size: a flipped choice would change a token's hidden state
    far more than a rounding. Every router carries
    megatron-core's routing-replay hook (idle unless :mod:`specroll_mcore.model.routing` sets it): what
    rollouts record and the policy update replays (``TrainConfig.routing_replay``)."""
    if not model.is_moe:
        return {}
    return dict(num_moe_experts=model.num_experts, moe_router_topk=model.moe_router_topk,
                moe_ffn_hidden_size=model.moe_ffn_hidden_size, moe_router_pre_softmax=not model.moe_norm_topk_prob,
                moe_shared_expert_intermediate_size=model.moe_shared_expert_ffn_hidden_size,
                moe_shared_expert_gate=model.moe_shared_expert_gate,
                moe_router_load_balancing_type="aux_loss" if model.moe_aux_loss_coeff > 0 else "none",
                moe_aux_loss_coeff=model.moe_aux_loss_coeff,
                expert_model_parallel_size=ctx.ep_size,
                moe_token_dispatcher_type="alltoall" if ctx.ep_size > 1 else "allgather",
                moe_grouped_gemm=False, moe_enable_routing_replay=True,
                moe_router_dtype="fp64" if batch_invariant(model.torch_dtype, ctx.device) else None)


class SpecRollSequentialMLP(SequentialMLP):
    """megatron-core's ``SequentialMLP`` (each expert an MLP, run one after another on the tokens routed
    to it); in inference only the experts that received tokens run. Its forward calls every expert,
    empty ones included: at a decoding step of a 128-expert layer that routes 8 a token, 120 calls
    compute nothing but cost their launch. Training keeps megatron's forward, so every expert takes a
    gradient (zero where it got no token) and the data-parallel reductions see the same tensors on
    every replica. The experts that run are the same calls on the same rows: outputs are identical."""

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        if (torch.is_grad_enabled() or self.num_local_experts == 1 or self.config.moe_apply_probs_on_input
                or self.config.fp8 or self.config.fp4):
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        outputs, start = [], 0
        for expert, n in zip(self.local_experts, tokens_per_expert.tolist()):
            if n:
                outputs.append(expert(permuted_local_hidden_states[start:start + n],
                                      permuted_probs[start:start + n])[0])
                start += n
        return (torch.cat(outputs) if outputs else permuted_local_hidden_states[:0]), None


def _submodules(spec: ModuleSpec | functools.partial) -> object:
    """The submodules of a megatron-core module spec. megatron-core 0.16 gives an MLP, a mixture of
    experts and its experts as a ``ModuleSpec``; 0.17 and later as a ``functools.partial`` of their
    builder with ``submodules=`` bound."""
    return spec.keywords["submodules"] if isinstance(spec, functools.partial) else spec.submodules


def _with_submodules(spec: ModuleSpec | functools.partial, **changes: object) -> ModuleSpec | functools.partial:
    """``spec`` (either form, :func:`_submodules`) with some of its submodules replaced."""
    submodules = dataclasses.replace(_submodules(spec), **changes)
    if isinstance(spec, functools.partial):
        return functools.partial(spec.func, *spec.args, **{**spec.keywords, "submodules": submodules})
    return dataclasses.replace(spec, submodules=submodules)


def _with_module(spec: ModuleSpec | functools.partial, module: type) -> ModuleSpec | functools.partial:
    """``spec`` building ``module`` (a subclass of the one it built) with the same arguments."""
    if isinstance(spec, functools.partial):
        return functools.partial(module, *spec.args, **spec.keywords)
    return dataclasses.replace(spec, module=module)


def _packed_mlp(mlp: ModuleSpec | functools.partial) -> ModuleSpec | functools.partial:
    return _with_submodules(mlp, linear_fc1=PackedColumnParallelLinear, linear_fc2=PackedRowParallelLinear)


def layer_spec(qk_layernorm: bool = False, num_experts: Optional[int] = None) -> ModuleSpec:
    """megatron-core's local GPT layer spec with our self-attention and core attention, and linears
    whose CPU inference products run on packed weights (cpu_gemm.py); ``qk_layernorm``: its per-head
    query and key RMSNorms (Qwen3), applied by megatron's ``get_query_key_value_tensors``;
    ``num_experts``: its mixture-of-experts MLP (router, ``SequentialMLP`` experts that skip the empty
    ones in inference, shared expert), the experts' linears packed alike."""
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm, num_experts=num_experts,
                                    moe_grouped_gemm=False)
    attn = spec.submodules.self_attention
    attn_sub = dataclasses.replace(attn.submodules, core_attention=SDPACoreAttention,
                                   linear_qkv=PackedColumnParallelLinear, linear_proj=PackedRowParallelLinear)
    new_attn = dataclasses.replace(attn, module=SpecRollSelfAttention, submodules=attn_sub)
    mlp = spec.submodules.mlp
    if num_experts is None:
        new_mlp = _packed_mlp(mlp)
    else:
        moe = _submodules(mlp)
        new_mlp = _with_submodules(mlp, experts=_with_module(_packed_mlp(moe.experts), SpecRollSequentialMLP),
                                   shared_experts=_packed_mlp(moe.shared_experts))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=new_attn,
                                                                   mlp=new_mlp))


LAYER_FEATURES = ("recompute_input_layernorm", "recompute_pre_mlp_layernorm", "recompute_mlp", "offload_attn_norm",
                  "offload_mlp_norm")
"""TransformerLayer features whose forward the lean inference chain (:func:`_chained_layer`) leaves out."""


def lean_layer(layer: torch.nn.Module) -> bool:
    """Whether a megatron-core TransformerLayer computes, in inference, norm -> self-attention -> residual
    add -> norm -> MLP -> residual add and nothing else (none of :data:`LAYER_FEATURES`, no
    cross-attention, no fused TP inference kernel, no chunked MLP in prefill)."""
    config = layer.config
    return (not any(getattr(layer, name, False) for name in LAYER_FEATURES)
            and isinstance(layer.cross_attention, IdentityOp)
            and not getattr(config, "inference_fuse_tp_communication", False)
            and getattr(config, "mlp_chunks_for_prefill", 1) <= 1 and layer.hidden_dropout == 0.0)


def _layer_output(layer: torch.nn.Module, hidden: torch.Tensor, meta: AttentionMetadata,
                  padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    # a TransformerLayer returns (output, context)
    return layer(hidden_states=hidden, attention_mask=meta, padding_mask=padding_mask)[0]


def _recomputed_layer(layer: torch.nn.Module, hidden: torch.Tensor, meta: AttentionMetadata,
                      padding_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """A layer whose backward reruns its forward, keeping only its input: ``torch.utils.checkpoint``
    (non-reentrant, so the attention metadata passes as it is; megatron's own recompute saves its
    arguments with ``save_for_backward``, which takes tensors only)."""
    return checkpoint(_layer_output, layer, hidden, meta, padding_mask, use_reentrant=False)


def _chained_layer(layer: torch.nn.Module, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """A layer in inference as its submodules chain: norm, self-attention, residual add, norm, MLP,
    residual add; the operations of megatron's ``TransformerLayer.forward`` in the same order, without
    the Python around them (offloading and recompute contexts, NVTX ranges, bias-dropout-add
    factories, the cross-attention identities). On a GPU, where a small model's forward waits on the
    host, that Python is a sixth of a SmolLM2-shaped forward (docs/results/README.md); only layers
    that use none of those features take it (:func:`lean_layer`)."""
    out, bias = layer.self_attention(layer.input_layernorm(hidden), attention_mask=meta)
    hidden = hidden + (out if bias is None else out + bias)
    out, bias = layer.mlp(layer.pre_mlp_layernorm(hidden))
    return hidden + (out if bias is None else out + bias)


class PolicyModel(torch.nn.Module):
    """One pipeline stage of the policy, with the point-to-point glue for inference.

    ``forward`` runs this stage: the first stage embeds ``input_ids``, the others receive hidden
    states from the previous stage; the last stage returns vocab-parallel logits [b, s, V/tp]
    (and, if asked, the final hidden states [s, b, h] that heads read), the others send their
    output on and return None.
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext, num_heads: int = 0) -> None:
        super().__init__()
        self.config = config
        self.ctx = ctx
        self.padded_vocab_size = config.padded_vocab_size(ctx.tp_size)
        with cpu_model_construction():
            self.gpt = GPTModel(
                config=transformer_config(config, ctx),
                transformer_layer_spec=layer_spec(config.qk_layernorm, config.num_experts),
                vocab_size=self.padded_vocab_size,
                max_sequence_length=config.max_position_embeddings,
                pre_process=ctx.is_first_stage,
                post_process=ctx.is_last_stage,
                parallel_output=True,
                share_embeddings_and_output_weights=config.tie_word_embeddings,
                position_embedding_type="none",
            ).to(device=ctx.device, dtype=config.torch_dtype)  # torch norms are built in the default dtype
        # Horizon heads live beside the output layer they share: on the last pipeline stage.
        self.heads: Optional[HorizonHeads] = None
        if num_heads > 0 and ctx.is_last_stage:
            with cpu_model_construction():
                self.heads = build_module(horizon_heads_spec(num_heads, config.vocab_size), config=self.gpt.config,
                                          tp_group=ctx.tp_group)
            self.heads.to(device=ctx.device, dtype=config.torch_dtype)
        self.num_heads = num_heads
        self._packed_vocab = cpu_gemm.PackedWeight()  # (CPU inference, see vocab_projection)
        self._inv_freq: dict[str, torch.Tensor] = {}  # device -> RoPE's frequencies (see rope_inv_freq)
        self._lean_layers = all(lean_layer(layer) for layer in self.gpt.decoder.layers)
        """Whether inference runs the layers without megatron's per-layer Python (:func:`_chained_layer`)."""
        self.routers = routers(self.gpt)
        """This stage's expert routers, in layer order (none for a dense model)."""
        self.record_routing = False
        """Whether rollouts keep each token's experts in their KV caches (:meth:`new_cache`) for the
        policy update to replay (``TrainConfig.routing_replay``; model/routing.py)."""
        self._rope_scale = rope_attention_factor(config.rope_scaling)  # (YaRN's factor on cos and sin; else 1)
        self._lockstep = False  # inside expert_lockstep: every forward of this stage joins the EP group's count
        self._sequence_parallel = False  # inside sequence_parallel(): activations split along the sequence
        if ctx.ep_size > 1:  # megatron-core's mark of a parameter split over expert-parallel ranks, as its
            for name, p in self.gpt.named_parameters():  # Transformer Engine layers set it (local ones do not)
                if routed_expert(name):
                    p.allreduce = False

    @property
    def dtype(self) -> torch.dtype:
        return self.config.torch_dtype

    def new_cache(self, num_slots: int, capacity: int, num_rows: Optional[int] = None) -> KVCache:
        """A KV cache for this stage's layers, all in one buffer of keys and one of values, for
        ``num_slots`` responses of which ``num_rows`` (None: all) are held at once (KVCache.admit). A
        batch-invariant policy's steps read whole key blocks (model/attention.py); where the
        step-attention kernel runs them (its dtypes and head dimensions), keys are stored position-major
        for it."""
        kernel = (self.batch_invariant and self.dtype in STEP_ATTENTION_DTYPES
                  and self.config.kv_channels in STEP_ATTENTION_HEAD_DIMS and step_attention_kernels() is not None)
        layers = [layer.self_attention.layer_number for layer in self.gpt.decoder.layers]
        return KVCache(num_slots, self._cache_capacity(capacity), self.ctx.device, self.dtype, layers,
                       position_major_keys=kernel, routing_topk=self._routing_topk(), num_rows=num_rows)

    def kv_cache_bytes(self, num_slots: int, capacity: int) -> int:
        """The memory :meth:`new_cache` ``(num_slots, capacity)`` (or with ``num_rows=num_slots``) takes on
        this rank once written: the keys
        and values of this stage's layers for this TP rank's query groups (and the experts each token was
        routed to, where routing is recorded)."""
        attention = self.gpt.decoder.layers[0].self_attention
        per_position = (2 * attention.num_query_groups_per_partition * attention.hidden_size_per_attention_head
                        * self.dtype.itemsize + 2 * self._routing_topk())  # (routing: int16)
        return len(self.gpt.decoder.layers) * num_slots * self._cache_capacity(capacity) * per_position

    def _cache_capacity(self, capacity: int) -> int:
        """A cache's positions per slot: a batch-invariant policy's steps read whole key blocks."""
        return -(-capacity // KEY_BLOCK) * KEY_BLOCK if self.batch_invariant else capacity

    def _routing_topk(self) -> int:
        return self.config.moe_router_topk if self.record_routing and self.routers else 0

    @property
    def batch_invariant(self) -> bool:
        """Whether a step's forward computes each token as a one-token forward would, bit for bit
        (:func:`batch_invariant`)."""
        return batch_invariant(self.dtype, self.ctx.device)

    def rope_inv_freq(self, device: torch.device) -> torch.Tensor:
        """RoPE's frequencies (model/attention.rope_inv_freq), made once per device: float64 for a
        float64 policy, float32 otherwise (as Hugging Face computes them)."""
        key = str(device)
        if key not in self._inv_freq:
            c = self.config
            compute = torch.float64 if self.dtype == torch.float64 else torch.float32
            self._inv_freq[key] = rope_inv_freq(c.kv_channels, c.rope_theta, c.rope_scaling, compute, device)
        return self._inv_freq[key]

    def metadata(self, positions: torch.Tensor, new_token_mask: Optional[torch.Tensor],
                 cache: Optional[KVCache] = None, slots: Optional[torch.Tensor] = None) -> AttentionMetadata:
        """See :meth:`AttentionMetadata.build` (``new_token_mask`` None: causal, without a cache). A
        batch-invariant policy computes every token of a forward with a cache as a one-token forward
        would (ordered attention): a decoding or verification step's tokens whatever the tree and the
        rows beside them, and a prompt's in prefill whatever the prompts it shares the forward with
        (their padding) and the pieces it is cut into."""
        return AttentionMetadata.build(positions, new_token_mask, self.rope_inv_freq(positions.device), self.dtype,
                                       cache, slots, rope_scale=self._rope_scale,
                                       ordered=cache is not None and self.batch_invariant)

    def stage_forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                      hidden_in: Optional[torch.Tensor] = None, logits_index: Optional[torch.Tensor] = None,
                      recompute: bool = False, padding_mask: Optional[torch.Tensor] = None,
                      logits_span: Optional[slice] = None, project: bool = True):
        """This stage's computation, no communication: embedding (first stage) or ``hidden_in``
        [s, b, h] (other stages) -> decoder (final norm included) -> output layer (last stage).

        The same submodules ``GPTModel.forward`` chains, but the vocab projection is applied only
        where logits are wanted: ``logits_index`` [b] picks one position per row (the last prompt
        token in prefill), ``logits_span`` a range of positions of every row (the policy update's
        response tokens: no vocab product, softmax or gradient for the prompts), else all positions.
        Returns (vocab-parallel logits [b, s', V/tp], final hidden states at those positions
        [s', b, h]) on the last stage, the output hidden states [s, b, h] elsewhere. Differentiable
        (the training schedule uses it); with ``recompute`` and gradients enabled, each layer keeps
        only its input and reruns its forward in the backward.
        ``padding_mask`` [b, s] (True: padding, megatron-core's convention): a mixture of experts'
        load-balancing loss leaves it out. ``project`` False: the last stage returns (None, the final
        hidden states at those positions), for a caller that projects them in pieces."""
        b, s = input_ids.shape
        gpt = self.gpt
        sp = self._sequence_parallel
        if sp and s % self.ctx.tp_size:
            raise ValueError(f"sequence parallelism splits the sequence over the {self.ctx.tp_size} tensor-parallel "
                             f"ranks, but this forward has {s} positions; pad the micro-batch to a multiple "
                             f"(pack_micro_batch's multiple=)")
        if self._lockstep:
            self._lockstep_count(forward=True)
        if self.ctx.is_first_stage:
            hidden = gpt.embedding(input_ids=input_ids, position_ids=meta.positions)  # [s, b, h] ([s/tp, b, h])
        else:
            gpt.decoder.set_input_tensor(hidden_in)
            hidden = None
        if recompute and torch.is_grad_enabled():
            hidden = self._layer_by_layer(hidden, lambda layer, x: _recomputed_layer(layer, x, meta, padding_mask))
        elif not torch.is_grad_enabled() and self._lean_layers:
            hidden = self._layer_by_layer(hidden, lambda layer, x: _chained_layer(layer, x, meta))
        else:
            hidden = gpt.decoder(hidden_states=hidden, attention_mask=meta, padding_mask=padding_mask)
        if not self.ctx.is_last_stage:
            return hidden
        if sp:  # the whole sequence again; the output layer's input gradient is all-reduced, the
            # gather's backward keeps this rank's part of it
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                          group=self.ctx.tp_group)
        if logits_index is not None:
            selected = hidden[logits_index, torch.arange(b, device=hidden.device)][None]  # [1, b, h]
        else:
            selected = hidden if logits_span is None else hidden[logits_span]
        if not project:
            return None, selected
        return self.vocab_projection(selected).transpose(0, 1), selected  # [b, s, V/tp], [s, b, h]

    @contextlib.contextmanager
    def sequence_parallel(self) -> Iterator[None]:
        """Megatron's sequence parallelism (ParallelConfig.sequence_parallel) for the forwards and
        backwards inside, the policy update's; nothing where the layout does not ask for it.

        Between the tensor-parallel products each rank holds its TP-th of the sequence: the first stage
        reduce-scatters the embeddings, every column-parallel linear all-gathers its input (and
        reduce-scatters its input's gradient), every row-parallel linear reduce-scatters its output,
        and the last stage gathers the final hidden states before the vocabulary
        (:meth:`stage_forward`). The embedding and the linears are megatron's, switched for the
        duration to what megatron builds for sequence parallelism (there it is a construction
        argument, and rollouts would then have to split one-token steps too), so the backward, and
        recomputation within it, must run inside too. The norms then see a part of the sequence each:
        their gradients are summed over the TP ranks (rl/schedule.finalize_grads)."""
        if not self.ctx.sequence_parallel or self._sequence_parallel:
            yield
            return
        switched: list[tuple[torch.nn.Module, str, bool]] = []  # (module, attribute, value inside)
        for m in self.gpt.decoder.modules():
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                switched.append((m, "sequence_parallel", True))
            if isinstance(m, ColumnParallelLinear):
                switched.append((m, "allreduce_dgrad", False))  # (its input's gradient is reduce-scattered)
        if self.ctx.is_first_stage:  # the embedding's partial sums reduce-scattered, not all-reduced and split
            embedding = self.gpt.embedding
            switched += [(embedding, "reduce_scatter_embeddings", True),
                         (embedding.word_embeddings, "reduce_scatter_embeddings", True)]
        saved = [(m, name, getattr(m, name)) for m, name, _ in switched]
        for m, name, value in switched:
            setattr(m, name, value)
        self._sequence_parallel = True
        try:
            yield
        finally:
            self._sequence_parallel = False
            for m, name, value in saved:
                setattr(m, name, value)

    def _layer_by_layer(self, hidden: Optional[torch.Tensor],
                        run: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """What megatron's ``TransformerBlock.forward`` computes (layers, then the final norm on the
        last stage), each layer through ``run(layer, hidden)``: with activation recomputation
        (:func:`_recomputed_layer`) or chained lean in inference (:func:`_chained_layer`)."""
        decoder = self.gpt.decoder
        if hidden is None:
            hidden = decoder.input_tensor  # set_input_tensor: the previous stage's output
        for layer in decoder.layers:
            hidden = run(layer, hidden)
        if decoder.final_layernorm is not None:
            hidden = decoder.final_layernorm(hidden)
        return hidden

    def output_weight(self) -> torch.Tensor:
        """This rank's rows of the vocab projection, [V/tp, h] (the tied embedding when shared)."""
        gpt = self.gpt
        if gpt.share_embeddings_and_output_weights:
            return gpt.shared_embedding_or_output_weight()
        return gpt.output_layer.weight

    def vocab_projection(self, x: torch.Tensor) -> torch.Tensor:
        """The policy's output layer (vocab-parallel): [..., h] -> [..., V/tp].

        With gradients this is megatron's ``output_layer(x, weight=shared)``. In inference it is this
        rank's product alone (the layer's forward, without its autograd functions): on GPU
        ``F.linear``, on CPU :func:`specroll_mcore.cpu_gemm.vocab_product`: on packed weights where
        they apply, else as ``W @ x^T``."""
        gpt = self.gpt
        if torch.is_grad_enabled():
            weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
            logits, _ = gpt.output_layer(x, weight=weight)
            return logits
        if x.device.type != "cpu":
            return F.linear(x, self.output_weight())
        return cpu_gemm.vocab_product(x, self.output_weight(), self._packed_vocab)  # weight [V/tp, h]

    def pack_for_inference(self) -> None:
        """Lay out this stage's weights (layers, heads, vocab projection) for CPU inference products
        now (cpu_gemm.py), rather than in the first forward after a weight update. Nothing to do on
        GPU or outside float32."""
        cpu_gemm.pack_layers(self)
        if self.ctx.is_last_stage:
            self._packed_vocab.prepare(self.output_weight())

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                logits_index: Optional[torch.Tensor] = None, return_hidden: bool = False):
        """Inference across pipeline stages: receive the previous stage's hidden states, run this
        stage, send to the next. Returns vocab-parallel logits [b, s|1, V/tp] on the last stage (and
        the final hidden states at the same positions if ``return_hidden``), None elsewhere."""
        b, s = input_ids.shape
        hidden_in = None
        if not self.ctx.is_first_stage:
            hidden_in = self.ctx.recv_forward((s, b, self.config.hidden_size), self.dtype)
        if meta.cache is not None and meta.cache.routing_topk:  # each token's experts, kept with its keys
            with recorded_routing(self.routers) as recorded:
                out = self.stage_forward(input_ids, meta, hidden_in, logits_index)
            meta.cache.write_routing(meta.rows, meta.row_index, meta.write_index, recorded)
        else:
            out = self.stage_forward(input_ids, meta, hidden_in, logits_index)
        if not self.ctx.is_last_stage:
            self.ctx.post_forward(out)
            return None
        logits, hidden = out
        return (logits, hidden) if return_hidden else logits

    @contextlib.contextmanager
    def expert_lockstep(self) -> Iterator[None]:
        """Inference forwards of this stage that the ranks of its expert-parallel group make together.

        Under expert parallelism every MoE layer's forward is a collective of the EP group (its
        tokens go to the ranks of their experts by all-to-all), so its ranks must run the same number
        of forwards, while each samples its own prompts: one finishes its responses, or takes fewer
        speculative steps, before another. In the block, each forward of this stage first joins a
        count over the EP group; a rank with no forward of its own to run joins the others' with a
        dummy token (:meth:`_idle_forward`): at :meth:`lockstep_barrier`, until every rank has
        reached it, and on leaving the block, until every rank has left it. Tokens do not depend on
        it. Without expert parallelism (or nested) the block is a no-op. A rank that raises in the
        block does not join the others' forwards."""
        if self.ctx.ep_size == 1 or self._lockstep:
            yield
            return
        self._lockstep = True
        try:
            yield
        finally:
            self._lockstep = False
        while True:
            forwards, inside = self._lockstep_count(forward=False, inside=False)
            if forwards:
                self._idle_forward()
            elif not inside:
                return

    def lockstep_barrier(self) -> None:
        """In :meth:`expert_lockstep` with pipeline stages: this stage's forwards so far are matched on
        every rank of its EP group before any rank runs another (joining the others' forwards until
        all are here). Each stage's EP group otherwise pairs its ranks' n-th forwards, whichever
        they are; the replicas' stages also meet in their own pipeline's broadcasts, and where two
        replicas' stages run different numbers of forwards between those (prompts prefilled in pieces
        on one alone), the pairings and the broadcasts can wait on each other in a cycle: replica A's
        first stage in a broadcast for its last stage, which waits for B's last stage to pair a
        forward, B's last stage in a broadcast for B's first stage, which waits for A's first stage.
        Rollouts call it where every replica's stages are at the same point of the same sequence
        (after each group-step's forwards, rollout/base.run_groups; after the first prefill), so that
        the replicas pair forward steps as one pipeline's stages run them. A no-op outside the
        block, without expert parallelism, or with one stage (no broadcast to wait on)."""
        if not self._lockstep or self.ctx.pp_size == 1:
            return
        while self._lockstep_count(forward=False)[0]:
            self._idle_forward()

    def _lockstep_count(self, forward: bool, inside: bool = True) -> tuple[int, int]:
        """This stage's EP group agrees on one forward: how many of its ranks run it with tokens, and how
        many are still in the block (``inside``: a rank running a forward or at a barrier)."""
        flags = torch.tensor([int(forward), int(inside)], dtype=torch.int32, device=self.ctx.device)
        forwards, inside = self.ctx.all_reduce_ep(flags).tolist()
        return forwards, inside

    @torch.no_grad()
    def _idle_forward(self) -> None:
        """This stage's MoE layers on one zero token, whose output is dropped: the all-to-alls of another
        EP rank's forward (megatron-core's router does not take an empty input). A router that replays
        or records routing is left as it was."""
        hooks = [r.router_replay for r in self.routers]
        actions = [h.router_replay_action for h in hooks]
        for h in hooks:
            h.router_replay_action = None
        try:
            token = torch.zeros(1, 1, self.config.hidden_size, dtype=self.dtype, device=self.ctx.device)
            for layer in self.gpt.decoder.layers:
                layer.mlp(token)
        finally:
            for h, action in zip(hooks, actions):
                h.router_replay_action = action

    def expert_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's weights (megatron names, local layer numbers), every routed expert included:
        under expert parallelism each rank holds ``num_experts / EP`` of them, gathered here over the
        EP group (a collective: every rank of the group calls it); checkpoints hold the full set, as
        without EP, so any EP size loads them (:meth:`load_local_state_dict` keeps its own)."""
        own = {k: v.detach() for k, v in self.gpt.state_dict().items() if not k.endswith("_extra_state")}
        if self.ctx.ep_size == 1:
            return own
        local = {k: v for k, v in own.items() if routed_expert(k)}
        parts = [{} for _ in range(self.ctx.ep_size)]
        for name in sorted(local):  # the same order on every rank
            for rank, t in enumerate(self.ctx.all_gather_ep(local[name])):
                parts[rank][name] = t
        rest = {k: v for k, v in own.items() if k not in local}
        return {**rest, **expert_unshard(parts, self.config.num_experts)}

    def load_full_state_dict(self, full: Mapping[str, torch.Tensor]) -> None:
        """Load weights given in the full form (see checkpoint/shard.py), sharding for this rank."""
        check_full_state_dict(full, self.config)
        self.load_local_state_dict(local_state_dict(full, self.config, self.ctx.tp_size, self.ctx.tp_rank,
                                                    self.ctx.pp_size, self.ctx.pp_rank,
                                                    self.ctx.stage_layers(self.config.num_layers)))

    def load_local_state_dict(self, local: Mapping[str, torch.Tensor]) -> None:
        """Load this rank's shard (megatron names, local layer numbers); every parameter must be given.
        Under expert parallelism the shard holds every routed expert (as checkpoints do) and this rank
        keeps its own."""
        if self.ctx.ep_size > 1:
            local = expert_shard(local, self.config.num_experts, self.ctx.ep_size, self.ctx.ep_rank)
        own = self.gpt.state_dict()
        missing = sorted(k for k in own if k not in local and not k.endswith("_extra_state"))
        unexpected = sorted(k for k in local if k not in own)
        if missing or unexpected:
            raise ValueError(f"the shard does not fit this stage of the model: missing {missing[:5]}, unexpected "
                             f"{unexpected[:5]}; was the checkpoint written for this model config?")
        with torch.no_grad():
            for name, tensor in local.items():
                if own[name].shape != tensor.shape:
                    raise ValueError(f"{name}: shard shape {tuple(tensor.shape)} != parameter shape "
                                     f"{tuple(own[name].shape)}; was the checkpoint written for this model config?")
                own[name].copy_(tensor)

    def load_full_heads(self, full: Mapping[str, torch.Tensor]) -> None:
        """Load head weights given unsharded (``heads.layers.{i}.weight``, ``heads.root_layers.{i}.weight``,
        ``heads.path_layers.{i}.{j}.weight``, [h, h] each, cast to the heads' dtype; missing root and
        path layers are zero: heads saved before them) and ``heads.token_counts`` [V] (replicated;
        missing: zero, no draft vocabulary); no-op off the last stage."""
        if self.heads is None:
            return
        own = {k: v for k, v in self.heads.state_dict().items() if not k.endswith("_extra_state")}
        expected = {f"heads.{k}" for k in own}
        optional = {f"heads.{k}" for k in own if k.startswith(("root_layers.", "path_layers.", TOKEN_COUNTS))}
        if not (expected - optional) <= set(full) <= expected:
            raise ValueError(f"head weights {sorted(full)} do not match this policy's heads {sorted(expected)}")
        with torch.no_grad():
            for name in optional - set(full):
                own[name[len("heads."):]].zero_()
            for name, tensor in full.items():
                shard = shard_tensor(name, tensor, self.config, self.ctx.tp_size, self.ctx.tp_rank)
                target = own[name[len("heads."):]]
                if shard.shape != target.shape:
                    raise ValueError(f"{name} has shape {tuple(shard.shape)} on this rank, this policy's heads need "
                                     f"{tuple(target.shape)}")
                target.copy_(shard)

    @property
    def vocab_start(self) -> int:
        """First vocabulary id of this rank's vocab-parallel logits."""
        return self.ctx.tp_rank * (self.padded_vocab_size // self.ctx.tp_size)

    @torch.no_grad()
    def root_features(self, ids: torch.Tensor) -> torch.Tensor:
        """e(x) for the heads (the root and the drafted path tokens): the rows of the vocab projection
        for token ids [...] -> [..., h] (each TP rank reads the rows it owns; one all-reduce; the
        matrix is never gathered)."""
        rows = vocab_rows(self.output_weight(), ids, self.vocab_start, whole=self.ctx.tp_size == 1)
        return self.ctx.all_reduce_tp(rows.contiguous(), "sum") if self.ctx.tp_size > 1 else rows

    def head_logits(self, hidden: torch.Tensor, root_ids: torch.Tensor, delta: Optional[torch.Tensor] = None,
                    path_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Vocab-parallel logits of every head: hidden [n, h], the roots sampled from it [n] and the
        path tokens [n, >= H-1] (head i reads the first i: in training, the realised continuation)
        -> [H, n, V/tp], through the policy's own output layer in one call (its weight is read once
        for all heads)."""
        assert self.heads is not None, "this policy was built without heads (num_heads=0) or is not the last stage"
        path = None
        if path_ids is not None and path_ids.shape[-1] > 0:
            path = self.root_features(path_ids).to(hidden.dtype)
        z = self.heads(hidden, delta, self.root_features(root_ids).to(hidden.dtype), path)
        return self.vocab_projection(z)  # [H, n, h] -> [H, n, V/tp]

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel logits [..., V/tp] -> the true vocabulary [..., vocab_size]."""
        return self.ctx.gather_vocab(logits)[..., : self.config.vocab_size]
