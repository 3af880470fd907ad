"""Preallocated per-layer key/value cache with per-slot committed lengths.

A *slot* is one response being generated. Row ``b`` of a forward uses slot ``slots[b]``; finished
responses simply stop appearing in ``slots`` (they leave the compute). Every forward writes the
keys/values of its new tokens just past each slot's committed length (a scratch area); ``commit``
then keeps a chosen subset of them (all of them for prefill and decode, the accepted path for tree
verification), compacted to contiguous positions, and advances the committed length. What is not
committed is overwritten by the next forward.
"""

from __future__ import annotations

from typing import Optional

import torch


class KVCache:
    """Keys/values for the layers of one pipeline stage, for ``num_slots`` responses."""

    def __init__(self, num_slots: int, capacity: int, device: torch.device, dtype: torch.dtype) -> None:
        self.num_slots = num_slots
        self.capacity = capacity
        self.device = device
        self.dtype = dtype
        self.lengths = torch.zeros(num_slots, dtype=torch.long, device=device)
        """Committed tokens per slot."""
        self._k: dict[int, torch.Tensor] = {}  # layer_number -> [slots, capacity, groups, head_dim]
        self._v: dict[int, torch.Tensor] = {}

    def _buffers(self, layer: int, groups: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in self._k:
            shape = (self.num_slots, self.capacity, groups, head_dim)
            self._k[layer] = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self._v[layer] = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return self._k[layer], self._v[layer]

    def write_and_read(self, layer: int, slots: torch.Tensor, write_index: torch.Tensor, kv_len: int,
                       key: torch.Tensor, value: torch.Tensor,
                       slot_range: Optional[tuple[int, int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' key/value and return each row's cache prefix, new tokens included.

        key, value: [s, b, g, d] (megatron layout); write_index: [b, s] cache positions;
        slot_range: (first, end) when ``slots`` is that contiguous range, read as a view (no copy).
        Returns keys, values: [kv_len, b, g, d].
        """
        k_buf, v_buf = self._buffers(layer, key.shape[2], key.shape[3])
        rows = slots[:, None].expand_as(write_index)
        k_buf[rows, write_index] = key.transpose(0, 1).to(self.dtype)
        v_buf[rows, write_index] = value.transpose(0, 1).to(self.dtype)
        if slot_range is not None:
            first, end = slot_range
            return k_buf[first:end, :kv_len].transpose(0, 1), v_buf[first:end, :kv_len].transpose(0, 1)
        return k_buf[slots, :kv_len].transpose(0, 1), v_buf[slots, :kv_len].transpose(0, 1)

    def commit(self, slots: torch.Tensor, num_new: torch.Tensor,
               keep_index: Optional[torch.Tensor] = None) -> None:
        """Make ``num_new[b]`` of the last forward's tokens of ``slots[b]`` part of its context.

        keep_index: [b, m] indices (into that forward's new tokens) of the tokens to keep, in order;
        None keeps the first ``num_new[b]`` in place (prefill, decode). Entries past ``num_new[b]``
        are ignored. Kept tokens are moved to contiguous positions after the committed prefix.
        """
        if keep_index is not None and keep_index.numel() > 0:
            base = self.lengths[slots][:, None]
            src = base + keep_index
            dst = base + torch.arange(keep_index.shape[1], device=self.device)[None, :]
            rows = slots[:, None].expand_as(src)
            for buf in (*self._k.values(), *self._v.values()):
                buf[rows, dst] = buf[rows, src]  # gather first, then scatter: safe when ranges overlap
        self.lengths[slots] += num_new.to(self.lengths.device)
        if int(self.lengths.max()) > self.capacity:
            raise RuntimeError(f"KV cache overflow: a slot holds {int(self.lengths.max())} tokens, "
                               f"capacity is {self.capacity}")

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Duplicate whole slots (shared prompt prefill: one prompt, G samples)."""
        for buf in (*self._k.values(), *self._v.values()):
            buf[dst] = buf[src]
        self.lengths[dst] = self.lengths[src]

    def reset(self) -> None:
        self.lengths.zero_()
