"""Self-attention for training, prefill, decode and tree verification through one code path.

A forward appends ``s`` new tokens to each of ``b`` rows. What a new token may attend to is
  * the committed context of its row (held in a :class:`KVCache`, if any), and
  * the new tokens of its row allowed by ``new_token_mask`` [b, s, s]:
    causal for training / prefill / decode, ancestor-or-self for a tree of drafted tokens,
    block-diagonal causal for packed training sequences; padding tokens see only themselves.
Positions are per token ([b, s]: committed length + depth for a tree node), so RoPE is applied
here, from positions, rather than by GPTModel over a contiguous range.

A decoding or verification step of a half-precision policy on CPU (``PolicyModel.batch_invariant``)
computes each token's attention in *one-token order* (:func:`one_token_key_order`,
:func:`ordered_attention`): its softmax over its committed context, then its tree ancestors, then
itself, at positions 0, 1, ... as a one-token forward of that token holds them, padded with masked
keys to a multiple of :data:`KEY_BLOCK`; its values summed in blocks of :data:`KEY_BLOCK` such
positions, added in order. Every reduction then runs over the same keys in the same order whether
the token is decoded alone or verified as a tree node, so a tree forward gives it the same bfloat16
logits (torch's SDPA sums a node's keys at its scratch positions, with its non-ancestors masked in
between: another order, and bfloat16 rounding of the difference flips sampled tokens). Float32 and
float64 keep SDPA, whose differences are ~1e-6 (rare near-ties, measured by the benchmarks).

On AVX-512 CPUs a bfloat16 step runs that computation in one kernel instead
(:func:`step_attention_kernels`, ``specroll_mcore/csrc/step_attention.cpp``): each token's scores
are fused multiply-add chains over the head dimension, its softmax and value sums float32 chains
over its keys in one-token order, so a token gets the same result in any call, with no padding, key
gathering or per-block products. It reads each row's keys and values once per key group for all of
its heads and new tokens, from a cache whose keys are stored position-major
(``KVCache.position_major_keys``, made so by ``PolicyModel.new_cache``). Measured on a 2-core Xeon
(SmolLM2's 9 heads in 3 groups, 320-token contexts, ms per layer): 16 rows x 1 / 3 tokens 0.31 / 0.60
against ordered attention's 1.14 / 2.04 and SDPA's (not batch-invariant) 0.29 / 0.73; one row x 16
tokens 0.16 against 0.65. ``SPECROLL_STEP_ATTENTION=0`` switches the kernel off.

The per-forward description travels as GPTModel's ``attention_mask`` argument, which megatron-core
passes unchanged to every layer's self-attention: an :class:`AttentionMetadata` built once per
forward (masks and RoPE tables are shared by all layers).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.module import MegatronModule

from specroll_mcore.model.kv_cache import KVCache

STEP_ATTENTION_SOURCE = Path(__file__).parent.parent / "csrc" / "step_attention.cpp"
STEP_ATTENTION_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-fopenmp")
STEP_ATTENTION_DTYPES = (torch.float32, torch.bfloat16)
STEP_ATTENTION_HEAD_DIMS = (16, 32, 48, 64)
"""Head dimensions the kernel takes (AVX-512 lanes of 16 floats, up to 4 per head); other heads
(Qwen2.5-7B's and Llama's 128) take ordered attention."""


def step_attention_kernels() -> Optional[Any]:
    """The compiled step-attention kernel (``step_attention``); None with ``SPECROLL_STEP_ATTENTION=0``,
    where torch does not dispatch to AVX-512 on this CPU, or where it could not be built (a warning
    says why: cpu_gemm.build_extension)."""
    if os.environ.get("SPECROLL_STEP_ATTENTION", "1") == "0":
        return None
    return _build_step_attention()


@functools.lru_cache(maxsize=1)
def _build_step_attention() -> Optional[Any]:
    from specroll_mcore.cpu_gemm import build_extension

    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return None
    return build_extension(STEP_ATTENTION_SOURCE, STEP_ATTENTION_FLAGS, "half-precision steps take ordered attention "
                           "(slower, the same tokens)", "SPECROLL_STEP_ATTENTION")


# ------------------------------------------------------------------------------------------------
# RoPE (rotate-half convention, as Megatron's default and Hugging Face Llama/Qwen2/Qwen3)
# ------------------------------------------------------------------------------------------------
def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[Mapping[str, Any]], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """RoPE's angular frequency of each pair of dimensions [head_dim / 2], in ``dtype`` (float32, or
    float64 for a float64 policy). ``scaling`` (ModelConfig.rope_scaling): ``linear`` divides every
    frequency by ``factor``; ``llama3`` (Llama 3.1's long-context rule) divides those whose wavelength
    exceeds ``original_max_position_embeddings / low_freq_factor`` by ``factor``, keeps those shorter
    than ``original_max_position_embeddings / high_freq_factor``, and blends the two in between,
    linearly in ``original_max_position_embeddings / wavelength``; ``yarn`` (YaRN's "NTK-by-parts")
    keeps the pairs that turn more than ``beta_fast`` (32) times over the original context, divides
    by ``factor`` those that turn less than ``beta_slow`` (1) times, and blends linearly in the pair's
    index between the two (the bounds rounded outwards unless ``truncate`` is false)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(dtype) / head_dim))
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    if scaling["rope_type"] == "yarn":
        context = scaling["original_max_position_embeddings"]

        def pair_turning(turns: float) -> float:  # the pair index whose wavelength fits `turns` times in context
            return head_dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(theta))

        low, high = pair_turning(scaling.get("beta_fast") or 32), pair_turning(scaling.get("beta_slow") or 1)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        high = high + 0.001 if low == high else high
        pair = torch.arange(head_dim // 2, dtype=dtype, device=device)
        scaled = ((pair - low) / (high - low)).clamp(0.0, 1.0)  # 0: kept, 1: divided by factor
        return inv_freq / factor * scaled + inv_freq * (1 - scaled)
    # llama3
    context, low, high = (scaling["original_max_position_embeddings"], scaling["low_freq_factor"],
                          scaling["high_freq_factor"])
    wavelength = 2 * math.pi / inv_freq
    blend = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: long wavelengths, 1: short
    return (1 - blend) * inv_freq / factor + blend * inv_freq


def rope_attention_factor(scaling: Optional[Mapping[str, Any]]) -> float:
    """What YaRN multiplies cos and sin by (so queries and keys: attention logits by its square):
    ``attention_factor``, else ``m(factor, mscale) / m(factor, mscale_all_dim)`` where both are given,
    else ``m(factor)``, with m(s, k) = 0.1 k ln(s) + 1 (1 for s <= 1). 1 for every other RoPE."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor"):
        return float(scaling["attention_factor"])

    def m(s: float, k: float = 1.0) -> float:
        return 1.0 if s <= 1 else 0.1 * k * math.log(s) + 1.0

    factor = scaling["factor"]
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return m(factor, scaling["mscale"]) / m(factor, scaling["mscale_all_dim"])
    return m(factor)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and the sign-folded sin for ``positions`` [b, s] -> each [s, b, 1, head_dim]: sin's first
    half negated, so that :func:`apply_rope` rotates without negating half of its input.
    ``inv_freq``: :func:`rope_inv_freq`, whose dtype the angles are computed in; ``scale``:
    :func:`rope_attention_factor`, applied to both tables."""
    freqs = positions.to(inv_freq.dtype)[..., None] * inv_freq  # [b, s, d/2]
    emb = torch.cat((freqs, freqs), dim=-1).transpose(0, 1)[:, :, None, :]  # [s, b, 1, d]
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    half = inv_freq.shape[0]
    return cos.to(dtype), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [s, b, heads, d]; ``sin`` sign-folded (:func:`rope_tables`). The rotate-half convention,
    ``x * cos + cat(-x2, x1) * sin``, as ``x * cos + cat(x2, x1) * sin'`` with sin' = cat(-sin1, sin2):
    the same products to the bit (negation is exact), one operation fewer."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


KEY_BLOCK = 64
"""Ordered attention pads each token's keys (and a step's cache read) to a multiple of this many: the
kernels then see whole blocks of keys (masked ones at the end), whatever the longest token of the
forward; unpadded, a token's bfloat16 results change with the forward's key count (measured)."""
SCORE_DEPTH = 32
"""Ordered attention's score product pads the head dimension with zeros to a multiple of this many (a
bfloat16 AMX tile's depth): over 24 dimensions (a test model's heads) oneDNN's batched bfloat16
product gave a row another result in a call of 32 rows or more than in one of fewer (measured on a
2-core Xeon with AMX); over 32, 48 and 64 never. Head dimensions of real models (64, 96, 128) need
no padding."""


def one_token_key_order(mask: torch.Tensor) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """mask [b, s, kv] (True = may attend) -> (order [b, s, K], valid [b, s, K]): each token's
    visible key positions in increasing order (committed context, ancestors, itself: the order a
    one-token forward holds them in), padded with position 0 (not valid) to K, the largest count
    rounded up to :data:`KEY_BLOCK`. One token per row (a decoding step) already has its keys in that
    order: order is None (the cache read, ``kv``, is then padded alike: see AttentionMetadata.build)."""
    b, s, kv = mask.shape
    count = mask.sum(-1)  # [b, s]
    k = -(-int(count.max()) // KEY_BLOCK) * KEY_BLOCK
    valid = torch.arange(k, device=mask.device) < count[..., None]
    if s == 1:
        return None, valid
    cols = torch.arange(kv, device=mask.device)
    order = torch.where(mask, cols, cols + kv).argsort(dim=-1, stable=True)[..., :k]  # visible first, in order
    if k > kv:
        order = torch.cat([order, order.new_zeros(b, s, k - kv)], dim=-1)
    return torch.where(valid, order, 0), valid


def ordered_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, order: Optional[torch.Tensor],
                      valid: torch.Tensor, shared: int = 0, scale: Optional[float] = None) -> torch.Tensor:
    """Attention over each token's own keys in one-token order (see :func:`one_token_key_order`).

    query [sq, b, np, d], key/value [sk, b, ng, d] (GQA: head h reads group h // (np / ng)),
    order/valid [b, sq, K] (order None: the first K keys as they are, sq = 1); ``shared``: how many
    leading blocks of :data:`KEY_BLOCK` keys every token has from its row's committed context.
    Scores: one product of a row's tokens with its keys as they lie, gathered to one-token order;
    softmax in float32. Values: a product per block of keys at one-token positions, rounded to the
    input dtype, the blocks added in order in float32; the shared blocks are one product for all of
    a row's tokens, the others gathered per token. Returns [sq, b, np * d]."""
    sq, b, heads, d = query.shape
    sk, groups, k_len = key.shape[0], key.shape[2], valid.shape[-1]
    per_group, blocks = heads // groups, k_len // KEY_BLOCK
    q = query.permute(1, 2, 0, 3).reshape(b, groups, per_group * sq, d)
    keys = key.permute(1, 2, 3, 0)  # [b, ng, d, sk]
    if d % SCORE_DEPTH:  # zeros to a multiple of SCORE_DEPTH: the products are the same, and row-invariant
        q, keys = F.pad(q, (0, -d % SCORE_DEPTH)), F.pad(keys, (0, 0, 0, -d % SCORE_DEPTH))
    scores = torch.matmul(q, keys).view(b, groups, per_group, sq, sk)
    if order is None:
        scores, shared = scores[..., :k_len], blocks
    else:
        scores = scores.gather(-1, order[:, None, None].expand(b, groups, per_group, sq, k_len))
    scores = scores.float() * (scale if scale is not None else d ** -0.5)
    scores.masked_fill_(~valid[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(query.dtype).view(b, groups, per_group, sq, blocks, KEY_BLOCK)
    values = value.permute(1, 2, 0, 3)  # [b, ng, sk, d]
    parts = []  # [b, ng, blocks of each, np / ng * sq, d]
    if shared:
        v = values[:, :, :shared * KEY_BLOCK].reshape(b, groups, shared, KEY_BLOCK, d)
        p = probs[:, :, :, :, :shared].permute(0, 1, 4, 2, 3, 5).reshape(b, groups, shared, per_group * sq, KEY_BLOCK)
        parts.append(torch.matmul(p, v))
    if shared < blocks:
        tail = order[..., shared * KEY_BLOCK:]  # [b, sq, T]
        rows = values.contiguous().view(-1, d)
        base = (torch.arange(b, device=tail.device)[:, None] * groups
                + torch.arange(groups, device=tail.device)[None, :]) * sk  # [b, ng]
        index = (base[:, :, None, None] + tail[:, None]).reshape(-1)  # [b, ng, sq, T]
        v = rows.index_select(0, index).view(b, groups, sq, blocks - shared, KEY_BLOCK, d)
        p = probs[:, :, :, :, shared:].permute(0, 1, 3, 4, 2, 5)  # [b, ng, sq, blocks, np / ng, KEY_BLOCK]
        out = torch.matmul(p, v).permute(0, 1, 3, 4, 2, 5)  # [b, ng, blocks, np / ng, sq, d]
        parts.append(out.reshape(b, groups, blocks - shared, per_group * sq, d))
    partial = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
    total = partial[:, :, 0].float()
    for t in range(1, blocks):  # in order, whatever the block count: added zeros change nothing
        total += partial[:, :, t]
    return total.to(query.dtype).view(b, groups, per_group, sq, d).permute(3, 0, 1, 2, 4).reshape(sq, b, heads * d)


# ------------------------------------------------------------------------------------------------
# Per-forward metadata
# ------------------------------------------------------------------------------------------------
def causal_mask(batch: int, seq: int, device: torch.device,
                lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[b, s, s] causal mask; with ``lengths`` [b], tokens past a row's length see only themselves."""
    idx = torch.arange(seq, device=device)
    mask = (idx[None, :] <= idx[:, None]).expand(batch, seq, seq).clone()
    if lengths is not None:
        pad = idx[None, :] >= lengths[:, None]  # [b, s]
        mask &= ~pad[:, None, :]
        mask |= torch.eye(seq, dtype=torch.bool, device=device)[None] & pad[:, :, None]
    return mask


@dataclass
class AttentionMetadata:
    """Everything a layer needs to know about one forward, shared by all layers."""

    cos: torch.Tensor
    """RoPE cos, [s, b, 1, head_dim]."""
    sin: torch.Tensor
    """RoPE sin with its first half negated (see rope_tables), [s, b, 1, head_dim]."""
    mask: Optional[torch.Tensor]
    """Boolean, True = may attend: [b, 1, s, kv_len] (kv_len = s without a cache); None: causal over
    each row (a forward without a cache, see :meth:`build`)."""
    cache: Optional[KVCache] = None
    slots: Optional[torch.Tensor] = None
    """[b] cache slot of each row."""
    write_index: Optional[torch.Tensor] = None
    """[b, s] cache position each new token's key/value is written to."""
    row_index: Optional[torch.Tensor] = None
    """[b, s] the cache row (0 .. b - 1 from ``rows[0]``) each new token's key/value is written to."""
    kv_len: int = 0
    positions: Optional[torch.Tensor] = None
    """[b, s] RoPE positions."""
    rows: Optional[tuple[int, int]] = None
    """(first, end): the cache rows holding ``slots``, in order (KVCache.rows; read as a view)."""
    key_order: Optional[tuple[Optional[torch.Tensor], torch.Tensor, int]] = None
    """Ordered attention's (order, valid) [b, s, K] (:func:`one_token_key_order`) and the key blocks
    all of the forward's tokens have from committed context; None: SDPA (or the step kernel)."""
    step_kernel: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    """The step-attention kernel's committed lengths [b] and new-token mask [b, s, s]
    (:func:`step_attention_kernels`): an ordered forward over a cache with position-major keys."""

    @classmethod
    def build(cls, positions: torch.Tensor, new_token_mask: Optional[torch.Tensor], inv_freq: torch.Tensor,
              dtype: torch.dtype, cache: Optional[KVCache] = None,
              slots: Optional[torch.Tensor] = None, ordered: bool = False,
              rope_scale: float = 1.0) -> "AttentionMetadata":
        """positions [b, s]; new_token_mask [b, s, s] (True = query i may see new token j);
        ``inv_freq``: RoPE's frequencies (:func:`rope_inv_freq`) and ``rope_scale`` its tables' factor
        (:func:`rope_attention_factor`); ``ordered``: attend over each token's keys in one-token order
        (a forward with a cache).

        ``new_token_mask`` None, without a cache: each token sees its row's earlier tokens and itself,
        as SDPA's ``is_causal`` computes it, without a [b, s, s] mask (on a GPU, FlashAttention's
        kernel; on a CPU, the same values as :func:`causal_mask`'s, in less time). For right-padded
        rows (the policy update's): a padding token then sees the row before it, which changes only
        what the padding computes, and no real token reads that."""
        b, s = positions.shape
        cos, sin = rope_tables(positions, inv_freq, dtype, rope_scale)
        if cache is None:
            return cls(cos=cos, sin=sin, mask=None if new_token_mask is None else new_token_mask[:, None],
                       positions=positions)
        if new_token_mask is None:
            raise ValueError("a forward with a KV cache needs its new tokens' mask [b, s, s] (the causal form "
                             "without one attends over the forward's own tokens only)")
        assert slots is not None and slots.shape == (b,)
        committed = cache.lengths[slots]  # [b]
        kv_len = int(committed.max()) + s
        if ordered:
            kv_len = -(-kv_len // KEY_BLOCK) * KEY_BLOCK  # whole key blocks (see KEY_BLOCK)
        if kv_len > cache.capacity:
            raise RuntimeError(f"forward needs {kv_len} cache positions, KV cache capacity is {cache.capacity}")
        write_index = committed[:, None] + torch.arange(s, device=positions.device)[None, :]  # [b, s]
        cols = torch.arange(kv_len, device=positions.device)
        mask = (cols[None, :] < committed[:, None])[:, None, :].expand(b, s, kv_len).clone()
        mask.scatter_(2, write_index[:, None, :].expand(b, s, s), new_token_mask)
        row_index = torch.arange(b, device=positions.device)[:, None].expand(b, s)
        kernel = ordered and cache.position_major_keys and dtype in STEP_ATTENTION_DTYPES
        return cls(cos=cos, sin=sin, mask=mask[:, None], cache=cache, slots=slots, write_index=write_index,
                   row_index=row_index, kv_len=kv_len, positions=positions, rows=cache.rows(slots),
                   key_order=(*one_token_key_order(mask), int(committed.min()) // KEY_BLOCK)
                   if ordered and not kernel else None,
                   step_kernel=(committed, new_token_mask.contiguous()) if kernel else None)


# ------------------------------------------------------------------------------------------------
# Modules (placed by the layer spec in model/gpt.py)
# ------------------------------------------------------------------------------------------------
class SDPACoreAttention(MegatronModule):
    """Core attention with an explicit boolean mask, on torch's scaled_dot_product_attention.

    query [sq, b, np, d], key/value [sk, b, ng, d] (GQA: ng divides np), mask [b, 1, sq, sk]
    with True = may attend, or None: causal (sq = sk). Returns [sq, b, np * d]. Runs on CPU and GPU,
    any float dtype.
    """

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any = None,
                 attention_type: Any = None, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, **unused: Any) -> None:
        super().__init__(config=config)
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], **unused: Any) -> torch.Tensor:
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, d]
        k = key.permute(1, 2, 0, 3)  # [b, ng, sk, d]
        v = value.permute(1, 2, 0, 3)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=attention_mask is None, scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1])
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)  # [sq, b, np * d]


class SpecRollSelfAttention(SelfAttention):
    """megatron-core ``SelfAttention`` (same parameters: linear_qkv, linear_proj, optional q/k norm,
    same GQA-grouped QKV layout and TP split) whose forward takes an :class:`AttentionMetadata`
    in place of the attention mask and keeps its keys/values in the metadata's KV cache."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: AttentionMetadata,
                *args: Any, **unused: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        meta = attention_mask
        if not isinstance(meta, AttentionMetadata):
            raise TypeError("SpecRollSelfAttention expects an AttentionMetadata as attention_mask; "
                            "build one with AttentionMetadata.build (see PolicyModel.forward)")
        qkv = self.get_query_key_value_tensors(hidden_states)
        query, key, value = qkv[0], qkv[1], qkv[2]  # [s, b, np|ng, d]
        # queries and keys rotated together: one pass of the rotation's operations instead of two
        heads = query.shape[2]
        rotated = apply_rope(torch.cat((query, key), dim=2), meta.cos, meta.sin)
        query, key = rotated[:, :, :heads], rotated[:, :, heads:]
        if meta.cache is not None:
            key, value = meta.cache.write_and_read(self.layer_number, meta.rows, meta.row_index, meta.write_index,
                                                   meta.kv_len, key, value)
        if meta.step_kernel is not None:
            scale = self.core_attention.softmax_scale
            scale = query.shape[-1] ** -0.5 if scale is None else scale
            context = step_attention_kernels().step_attention(query.contiguous(), key, value, *meta.step_kernel, scale)
        elif meta.key_order is not None:
            context = ordered_attention(query, key, value, *meta.key_order, scale=self.core_attention.softmax_scale)
        else:
            context = self.core_attention(query, key, value, meta.mask)
        return self.linear_proj(context)
