"""Self-attention for training, prefill, decode and tree verification through one code path.

A forward appends ``s`` new tokens to each of ``b`` rows. What a new token may attend to is
  * the committed context of its row (held in a :class:`KVCache`, if any), and
  * the new tokens of its row allowed by ``new_token_mask`` [b, s, s]:
    causal for training / prefill / decode, ancestor-or-self for a tree of drafted tokens,
    block-diagonal causal for packed training sequences; padding tokens see only themselves.
Positions are per token ([b, s]: committed length + depth for a tree node), so RoPE is applied
here, from positions, rather than by GPTModel over a contiguous range.

A decoding or verification step of a half-precision policy on CPU (``PolicyModel.batch_invariant``)
takes each token's keys in *one-token order* (:func:`one_token_key_order`, :func:`ordered_attention`):
its committed context, then its tree ancestors, then itself, gathered to positions 0, 1, ... as a
one-token forward of that token holds them, and padded with masked keys to a multiple of
:data:`KEY_BLOCK`. Its score and softmax reductions then run over the same keys in the same order
whether the token is decoded alone or verified as a tree node, so a tree forward gives it the same
bfloat16 logits (torch's SDPA sums a node's keys at its scratch positions, with its non-ancestors
masked in between: another order, and bfloat16 rounding of the difference flips sampled tokens).
Float32 and float64 keep SDPA, whose differences are ~1e-6 (rare near-ties, measured by the
benchmarks).

The per-forward description travels as GPTModel's ``attention_mask`` argument, which megatron-core
passes unchanged to every layer's self-attention: an :class:`AttentionMetadata` built once per
forward (masks and RoPE tables are shared by all layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.module import MegatronModule

from specroll_mcore.model.kv_cache import KVCache


# ------------------------------------------------------------------------------------------------
# RoPE (rotate-half convention, as Megatron's default and Hugging Face Llama/Qwen2)
# ------------------------------------------------------------------------------------------------
def rope_tables(positions: torch.Tensor, head_dim: int, theta: float,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin for ``positions`` [b, s] -> each [s, b, 1, head_dim]."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                             device=positions.device).to(compute) / head_dim))
    freqs = positions.to(compute)[..., None] * inv_freq  # [b, s, d/2]
    emb = torch.cat((freqs, freqs), dim=-1).transpose(0, 1)[:, :, None, :]  # [s, b, 1, d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [s, b, heads, d]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


KEY_BLOCK = 64
"""Ordered attention pads each token's keys (and a step's cache read) to a multiple of this many: the
kernels then see whole blocks of keys (masked ones at the end), whatever the longest token of the
forward; unpadded, a token's bfloat16 results change with the forward's key count (measured)."""


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
                      valid: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
    """Attention over each token's own keys in one-token order (see :func:`one_token_key_order`).

    query [sq, b, np, d], key/value [sk, b, ng, d] (GQA: head h reads group h // (np / ng)),
    order/valid [b, sq, K] (order None: the first K keys as they are, sq = 1). Keys and values are
    laid out once per call as rows of d per (row, group), and a tree's tokens take theirs from there
    with one ``index_select`` each, straight into the layout the products read. Scores and softmax
    in float32, products in the input dtype. Returns [sq, b, np * d]."""
    sq, b, heads, d = query.shape
    sk, groups, k_len = key.shape[0], key.shape[2], valid.shape[-1]
    k_rows = key.permute(1, 2, 0, 3).contiguous()  # [b, ng, sk, d]
    v_rows = value.permute(1, 2, 0, 3).contiguous()
    if order is None:
        k, v = k_rows[:, None, :, :k_len], v_rows[:, None, :, :k_len]  # [b, 1, ng, K, d]
    else:
        base = (torch.arange(b, device=order.device)[:, None, None] * groups
                + torch.arange(groups, device=order.device)[None, None, :]) * sk  # [b, 1, ng]
        index = (base[..., None] + order[:, :, None, :]).reshape(-1)  # [b, sq, ng, K]
        k = k_rows.view(-1, d).index_select(0, index).view(b, sq, groups, k_len, d)
        v = v_rows.view(-1, d).index_select(0, index).view(b, sq, groups, k_len, d)
    q = query.transpose(0, 1).reshape(b, sq, groups, heads // groups, d)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * (scale if scale is not None else d ** -0.5)
    scores.masked_fill_(~valid[:, :, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    return torch.matmul(probs, v).reshape(b, sq, heads * d).transpose(0, 1).contiguous()


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
    """RoPE sin, [s, b, 1, head_dim]."""
    mask: torch.Tensor
    """Boolean, True = may attend: [b, 1, s, kv_len] (kv_len = s without a cache)."""
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
    key_order: Optional[tuple[Optional[torch.Tensor], torch.Tensor]] = None
    """Ordered attention's (order, valid) [b, s, K] (:func:`one_token_key_order`); None: SDPA."""

    @classmethod
    def build(cls, positions: torch.Tensor, new_token_mask: torch.Tensor, head_dim: int, theta: float,
              dtype: torch.dtype, cache: Optional[KVCache] = None,
              slots: Optional[torch.Tensor] = None, ordered: bool = False) -> "AttentionMetadata":
        """positions [b, s]; new_token_mask [b, s, s] (True = query i may see new token j);
        ``ordered``: attend over each token's keys in one-token order (a forward with a cache)."""
        b, s = positions.shape
        cos, sin = rope_tables(positions, head_dim, theta, dtype)
        if cache is None:
            return cls(cos=cos, sin=sin, mask=new_token_mask[:, None], positions=positions)
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
        return cls(cos=cos, sin=sin, mask=mask[:, None], cache=cache, slots=slots, write_index=write_index,
                   row_index=row_index, kv_len=kv_len, positions=positions, rows=cache.rows(slots),
                   key_order=one_token_key_order(mask) if ordered else None)


# ------------------------------------------------------------------------------------------------
# Modules (placed by the layer spec in model/gpt.py)
# ------------------------------------------------------------------------------------------------
class SDPACoreAttention(MegatronModule):
    """Core attention with an explicit boolean mask, on torch's scaled_dot_product_attention.

    query [sq, b, np, d], key/value [sk, b, ng, d] (GQA: ng divides np), mask [b, 1, sq, sk]
    with True = may attend. Returns [sq, b, np * d]. Runs on CPU and GPU, any float dtype.
    """

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any = None,
                 attention_type: Any = None, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, **unused: Any) -> None:
        super().__init__(config=config)
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor, **unused: Any) -> torch.Tensor:
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, d]
        k = key.permute(1, 2, 0, 3)  # [b, ng, sk, d]
        v = value.permute(1, 2, 0, 3)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, dropout_p=self.dropout_p if self.training else 0.0,
            scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1])
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
        query = apply_rope(query, meta.cos, meta.sin)
        key = apply_rope(key, meta.cos, meta.sin)
        if meta.cache is not None:
            key, value = meta.cache.write_and_read(self.layer_number, meta.rows, meta.row_index, meta.write_index,
                                                   meta.kv_len, key, value)
        if meta.key_order is not None:
            context = ordered_attention(query, key, value, *meta.key_order, self.core_attention.softmax_scale)
        else:
            context = self.core_attention(query, key, value, meta.mask)
        return self.linear_proj(context)
