"""Sparse, prefix-closed draft trees under a per-row node budget (pure, no torch.distributed).

Row r's tree hangs from its root: the token the policy itself sampled last (certain, depth 0).
A node at depth d >= 1 carries one of head d's candidates. Growth order:
  1. the trunk: head 1's top-1 under the root, head 2's top-1 under that, ... (the single most
     likely continuation, depth H);
  2. then, greedily, the free slot (a node u at depth d < H, head d+1's next-ranked candidate under
     u) with the highest cumulative draft log-probability  sum of log q along the path,
until the row's budget of nodes (root included) is spent. Every node's parent is in the tree
(prefix-closed) and siblings carry distinct tokens (distinct candidates of one head), so at most
one child can match the policy's sample.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from specroll_mcore.tree.buffers import PAD, ROOT


@dataclass
class TreeBatch:
    """Trees of b rows, padded to n nodes. Node 0 of every row is its root."""

    tokens: torch.Tensor  # [b, n] long
    parents: torch.Tensor  # [b, n] long: ROOT for node 0, PAD for padding
    depth: torch.Tensor  # [b, n] long
    num_nodes: torch.Tensor  # [b] long

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)  # type: ignore[return-value]


def build_trees(root_tokens: torch.Tensor, cand_tokens: torch.Tensor, cand_logq: torch.Tensor,
                budget: int) -> TreeBatch:
    """root_tokens [b]; cand_tokens, cand_logq [b, H, k] (each head's top-k, best first);
    budget: nodes per row, root included (>= 1); a row gets fewer only if its candidates run out."""
    b, H, k = cand_tokens.shape
    cand_tokens_l, cand_logq_l = cand_tokens.tolist(), cand_logq.float().tolist()
    roots = root_tokens.tolist()
    rows = []
    for r in range(b):
        toks, logq = cand_tokens_l[r], cand_logq_l[r]
        tokens, parents, depths, cum = [roots[r]], [ROOT], [0], [0.0]
        heap: list[tuple[float, int, int, int]] = []  # (-cumulative log q, tie-break, parent, rank)

        def add(u: int, rank: int) -> int:
            d = depths[u]
            tokens.append(toks[d][rank])
            parents.append(u)
            depths.append(d + 1)
            cum.append(cum[u] + logq[d][rank])
            if rank + 1 < k:  # the parent's next-ranked candidate becomes a free slot
                heapq.heappush(heap, (-(cum[u] + logq[d][rank + 1]), len(tokens), u, rank + 1))
            return len(tokens) - 1

        u = 0  # 1. trunk: each head's top-1 under the previous one
        while len(tokens) < budget and depths[u] < H:
            u = add(u, 0)
        while len(tokens) < budget and heap:  # 2. greedy growth
            _, _, parent, rank = heapq.heappop(heap)
            v = add(parent, rank)
            if depths[v] < H:
                heapq.heappush(heap, (-(cum[v] + logq[depths[v]][0]), len(tokens) + b * k, v, 0))
        rows.append((tokens, parents, depths))
    n = max(len(t) for t, _, _ in rows)
    tokens_t = torch.zeros(b, n, dtype=torch.long)
    parents_t = torch.full((b, n), PAD, dtype=torch.long)
    depth_t = torch.zeros(b, n, dtype=torch.long)
    for r, (t, p, d) in enumerate(rows):
        tokens_t[r, : len(t)] = torch.tensor(t)
        parents_t[r, : len(p)] = torch.tensor(p)
        depth_t[r, : len(d)] = torch.tensor(d)
    dev = root_tokens.device
    return TreeBatch(tokens_t.to(dev), parents_t.to(dev), depth_t.to(dev),
                     torch.tensor([len(t) for t, _, _ in rows], device=dev))
