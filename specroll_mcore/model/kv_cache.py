"""Preallocated key/value cache of a pipeline stage's layers with per-slot committed lengths.

A *slot* is one response being generated. Row ``b`` of a forward uses slot ``slots[b]``; finished
responses simply stop appearing in ``slots`` (they leave the compute). Every forward writes the
keys/values of its new tokens just past each slot's committed length (a scratch area); ``commit``
then keeps a chosen subset of them (all of them for prefill and decode, the accepted path for tree
verification), compacted to contiguous positions, and advances the committed length. What is not
committed is overwritten by the next forward.

A slot's keys and values live in one row of the buffers, not necessarily its own. A forward's slots
occupy a contiguous range of rows in its order, so attention reads the cache as a view; otherwise,
once some responses have finished, every layer of every forward would gather the unfinished rows'
whole context into a copy (a pipeline stage's response groups, interleaved by slot, from the first
step). When a group of responses changes, the engine asks :meth:`KVCache.pack` for the order to run
it in: only the rows that must move do (unfinished responses beyond the range swap with finished ones
inside it), and the forward takes the rows in the order they lie. :meth:`KVCache.rows` arranges any
other request (in its own order) before the forward reads it.

Made with ``num_rows``, a cache starts with every row free: a slot holds none until :meth:`admit`
gives it one, and gives it back with :meth:`release` when its response finishes (its experts, where
routing is recorded, stay readable through :meth:`routing`). With fewer rows than slots, that is
continuous batching: a waiting response takes over the row of a finished one.

With ``routing_topk`` the cache also keeps, per layer, the experts each token's forward routed it to
(``[layers, slots, capacity, topk]``, int16), written beside its keys and moved with them by every
commit, pack and copy: a response's routing for the policy update to replay (model/routing.py).

With ``position_major_keys`` the keys are stored ``[slots, groups, head_dim, capacity]``: one row's
keys of one group hold each head dimension's values over consecutive positions, the layout the CPU
step-attention kernel reads 16 keys at a time from (model/attention.py; vLLM's CPU key cache is
position-blocked likewise). Every method, and the views :meth:`write_and_read` returns, stay in the
logical ``[slots, capacity, groups, head_dim]`` order; only the strides differ.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


class KVCache:
    """Keys/values for the layers of one pipeline stage, for ``num_slots`` responses."""

    def __init__(self, num_slots: int, capacity: int, device: torch.device, dtype: torch.dtype,
                 layers: Sequence[int], position_major_keys: bool = False, routing_topk: int = 0,
                 num_rows: Optional[int] = None) -> None:
        """``layers``: the layer numbers that use the cache (this pipeline stage's). All their keys live
        in one tensor and all their values in another, so that moving positions or rows (commit, pack,
        copy_slots) is one indexing operation for every layer. ``routing_topk`` > 0: also keep each
        token's experts at every layer (:meth:`write_routing`). ``num_rows``: the responses it holds at
        once, each slot taking a row by :meth:`admit` (None: one row per slot, slot s in row s from the
        start)."""
        if not layers:
            raise ValueError("a KV cache needs the layer numbers that use it (layers)")
        admitting, num_rows = num_rows is not None, num_slots if num_rows is None else num_rows
        if not 0 < num_rows <= num_slots:
            raise ValueError(f"a KV cache of {num_slots} slots needs 1 to {num_slots} rows, got num_rows={num_rows}")
        self.num_slots = num_slots
        self.num_rows = num_rows
        self.position_major_keys = position_major_keys
        self.capacity = capacity
        self.device = device
        self.dtype = dtype
        self.lengths = torch.zeros(num_slots, dtype=torch.long, device=device)
        """Committed tokens per slot."""
        self.row_of = (torch.full((num_slots,), -1, dtype=torch.long, device=device) if admitting
                       else torch.arange(num_slots, device=device))
        """The buffers' row holding each slot (-1: none)."""
        self._free = list(range(num_rows - 1, -1, -1)) if admitting else []  # rows no slot holds, lowest last
        self._released: dict[int, torch.Tensor] = {}  # slot -> its experts, kept when it gave its row back
        self._extent = 0  # positions any forward has written: what a moved row carries
        self._index = {number: i for i, number in enumerate(layers)}  # layer number -> its index in the buffers
        # keys, values [layers, slots, capacity, groups, head_dim] (logical order), made at the first write
        self._k: Optional[torch.Tensor] = None
        self._v: Optional[torch.Tensor] = None
        self.routing_topk = routing_topk
        self._r: Optional[torch.Tensor] = None  # experts [layers, slots, capacity, topk], made at the first write

    def _buffers(self, layer: int, groups: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s keys and values [slots, capacity, groups, head_dim] (views)."""
        if self._k is None:
            shape = (len(self._index), self.num_rows, self.capacity, groups, head_dim)
            self._v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if self.position_major_keys:  # stored [layers, slots, groups, head_dim, capacity], viewed in order
                self._k = torch.zeros(*shape[:2], groups, head_dim, self.capacity, dtype=self.dtype,
                                      device=self.device).permute(0, 1, 4, 2, 3)
            else:
                self._k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        i = self._index[layer]
        return self._k[i], self._v[i]

    def _all_buffers(self) -> tuple[torch.Tensor, ...]:
        """The key, value (and expert) buffers, [layers, slots, ...] each (none before the first write)."""
        kv = () if self._k is None else (self._k, self._v)
        return kv if self._r is None else (*kv, self._r)

    def write_routing(self, rows: tuple[int, int], row_index: torch.Tensor, write_index: torch.Tensor,
                      experts: Sequence[torch.Tensor]) -> None:
        """Keep the experts a forward routed its new tokens to, where their keys went: ``experts`` per
        layer [s * b, topk] (megatron's token order), rows / row_index / write_index as for
        :meth:`write_and_read`."""
        if self._r is None:
            self._r = torch.zeros(len(self._index), self.num_rows, self.capacity, self.routing_topk,
                                  dtype=torch.int16, device=self.device)
        b, s = write_index.shape
        routed = torch.stack(list(experts)).view(len(experts), s, b, self.routing_topk).transpose(1, 2)
        first, end = rows
        self._r[:, first:end][:, row_index, write_index] = routed.to(torch.int16)  # (write_and_read kept the extent)

    def routing(self, slots: torch.Tensor) -> list[torch.Tensor]:
        """Each slot's kept experts over its committed tokens, [length, layers, topk] int16 on the CPU
        (one transfer for the slots holding rows); empty where none were written."""
        out = [self._released.get(s) for s in slots.tolist()]
        held_slots = slots[torch.tensor([o is None for o in out], dtype=torch.bool)]
        if self._r is None:
            return [torch.zeros(0, len(self._index), self.routing_topk, dtype=torch.int16) if o is None else o
                    for o in out]
        lengths = self.lengths[held_slots].tolist()
        held = iter(self._r[:, self.row_of[held_slots], :max(lengths, default=0)].permute(1, 2, 0, 3).cpu())
        fresh = iter(lengths)
        return [next(held)[:next(fresh)] if o is None else o for o in out]

    def admit(self, slots: Sequence[int]) -> None:
        """Give each of ``slots`` (holding no row) a free row, its committed length 0: a waiting response
        enters the cache (:meth:`release` frees rows)."""
        if len(slots) > len(self._free):
            raise RuntimeError(f"KV cache: {len(slots)} slots to admit, {len(self._free)} of {self.num_rows} rows free")
        index = torch.tensor(list(slots), dtype=torch.long, device=self.device)
        if bool((self.row_of[index] >= 0).any()):
            raise RuntimeError("KV cache: a slot admitted twice")
        rows = [self._free.pop() for _ in slots]
        self.row_of[index] = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.lengths[index] = 0

    def release(self, slots: Sequence[int]) -> None:
        """Free the rows of ``slots`` (finished responses) for :meth:`admit`; their experts (where routing
        is recorded) stay readable through :meth:`routing`, their keys and values do not."""
        if not slots:
            return
        index = torch.tensor(list(slots), dtype=torch.long, device=self.device)
        if self.routing_topk:
            self._released.update(zip(slots, self.routing(index)))
        self._free.extend(self.row_of[index].tolist())
        self._free.sort(reverse=True)  # (the lowest rows first: a forward's rows stay near the start)
        self.row_of[index] = -1

    def pack(self, slots: torch.Tensor) -> torch.Tensor:
        """Make the rows holding ``slots`` [b] a contiguous range with as few moves as possible: the
        slots beyond it swap rows with whatever holds its gaps (finished responses). Returns the
        order ``perm`` they lie in (``slots[perm]`` in rows first, first + 1, ...): a forward of
        ``slots[perm]`` reads the cache as it is. Engines call this when a group's responses change."""
        if len(slots) == 0:
            return torch.zeros(0, dtype=torch.long, device=slots.device)
        rows = self.row_of[slots]
        first = int(rows.min())
        if first < 0:
            raise RuntimeError("KV cache: a slot without a row (admit it first)")
        beyond = rows >= first + len(slots)
        if bool(beyond.any()):
            held = torch.zeros(len(slots), dtype=torch.bool, device=rows.device)
            held[rows[~beyond] - first] = True
            self._place(slots[beyond], first + (~held).nonzero().squeeze(1))
            rows = self.row_of[slots]
        return torch.argsort(rows)

    def rows(self, slots: torch.Tensor) -> tuple[int, int]:
        """The rows (first, end) holding ``slots`` [b], row ``first + i`` holding ``slots[i]``: as they
        are after :meth:`pack` (nothing moves), else made so, from the lowest of their rows on."""
        if len(slots) == 0:
            return 0, 0
        rows = self.row_of[slots]
        first = int(rows.min())
        if first < 0:
            raise RuntimeError("KV cache: a slot without a row (admit it first)")
        target = torch.arange(first, first + len(slots), device=rows.device)
        if not torch.equal(rows, target):
            self._place(slots, target)
        return first, first + len(slots)

    def _place(self, slots: torch.Tensor, target: torch.Tensor) -> None:
        """Move ``slots`` to rows ``target``; the other slots found there take the rows they leave."""
        rows = self.row_of[slots]
        asked = torch.zeros(self.num_slots, dtype=torch.bool, device=rows.device)
        asked[slots] = True
        taken = torch.zeros(self.num_rows, dtype=torch.bool, device=rows.device)
        taken[target] = True
        slot_at = torch.full((self.num_rows,), -1, dtype=torch.long, device=rows.device)  # each row's slot (-1: free)
        holding = (self.row_of >= 0).nonzero().squeeze(1)
        slot_at[self.row_of[holding]] = holding
        occupants = slot_at[target]
        occupants = occupants[occupants >= 0]
        displaced = occupants[~asked[occupants]]
        freed = rows[~taken[rows]]  # as many as the displaced slots and the free rows in target together
        src = torch.cat([rows, self.row_of[displaced]])
        dst = torch.cat([target, freed[:len(displaced)]])
        n = self._extent
        for buf in self._all_buffers():  # gathered first, then written: overlapping moves are safe
            buf[:, dst, :n] = buf[:, src, :n]
        self.row_of[slots] = target
        self.row_of[displaced] = freed[:len(displaced)]
        if self._free:  # free rows in target are taken now, the rows left beyond the displaced are free
            now_free = set(self._free) - set(target.tolist()) | set(freed[len(displaced):].tolist())
            self._free = sorted(now_free, reverse=True)

    def write_and_read(self, layer: int, rows: tuple[int, int], row_index: torch.Tensor, write_index: torch.Tensor,
                       kv_len: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' key/value and return each row's cache prefix, new tokens included.

        rows: (first, end) from :meth:`rows`; key, value: [s, b, g, d] (megatron layout);
        row_index, write_index: [b, s] each new token's row (0 .. b - 1, from ``first``) and cache
        position (built once per forward, see AttentionMetadata). Returns keys, values:
        [kv_len, b, g, d], views of the cache.
        """
        k_buf, v_buf = self._buffers(layer, key.shape[2], key.shape[3])
        first, end = rows
        k_rows, v_rows = k_buf[first:end], v_buf[first:end]
        k_rows[row_index, write_index] = key.transpose(0, 1).to(self.dtype)
        v_rows[row_index, write_index] = value.transpose(0, 1).to(self.dtype)
        self._extent = max(self._extent, kv_len)
        return k_rows[:, :kv_len].transpose(0, 1), v_rows[:, :kv_len].transpose(0, 1)

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
            rows = self.row_of[slots][:, None].expand_as(src)
            for buf in self._all_buffers():  # gather first, then scatter: safe when ranges overlap
                buf[:, rows, dst] = buf[:, rows, src]
        self.lengths[slots] += num_new.to(self.lengths.device)
        if int(self.lengths.max()) > self.capacity:
            raise RuntimeError(f"KV cache overflow: a slot holds {int(self.lengths.max())} tokens, "
                               f"capacity is {self.capacity}")

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor, length: Optional[torch.Tensor] = None) -> None:
        """Duplicate whole slots (shared prompt prefill: one prompt, G samples); ``dst`` hold rows. With
        ``length`` [n], only the first ``length`` committed positions of each (a prompt's prefix)."""
        n = self.capacity if length is None else int(length.max())
        for buf in self._all_buffers():
            buf[:, self.row_of[dst], :n] = buf[:, self.row_of[src], :n]
        self.lengths[dst] = self.lengths[src] if length is None else length.to(self.lengths.device)

    def reset(self) -> None:
        self.lengths.zero_()
        self._released.clear()
