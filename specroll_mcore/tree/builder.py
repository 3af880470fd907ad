"""Sparse, prefix-closed draft trees under a per-row node budget (pure, no torch.distributed).

Row r's tree hangs from its root: the token the policy itself sampled last (certain, depth 0).
A node at depth d >= 1 carries one of head d's candidates. Growth order:
  1. the trunk: head 1's top-1 under the root, head 2's top-1 under that, ... (the single most
     likely continuation, depth H);
  2. then, greedily, the free slot (a node u at depth d < H, head d+1's next-ranked candidate under
     u) with the highest cumulative draft log-probability  sum of log q along the path,
until the row's budget of nodes (root included) is spent. All rows are built at once with tensor
operations (no per-row loop: on a GPU the step's host work is what speculation must beat). Every
node's parent is in the tree (prefix-closed) and siblings carry distinct tokens (distinct candidates of one head), so at most
one child can match the policy's sample.
"""

from __future__ import annotations

import functools
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


@functools.lru_cache(maxsize=64)
def _rank_tuples(H: int, k: int, budget: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Every node a tree of ``budget`` nodes can hold, as rank tuples (r_1 .. r_d): node (.., r) is
    added only after (.., r - 1) and its parent, so its tree holds >= sum(r) + d + 1 nodes. Returns
    (ranks [T, H] padded with 0, depth [T], parent [T] (T = the root), trunk [T] bool), parents
    before children."""
    tuples, index = [], {(): None}
    frontier = [()]
    for d in range(1, H + 1):
        nxt = []
        for t in frontier:
            for r in range(k):
                u = t + (r,)
                if sum(u) + d + 1 > budget:
                    break
                index[u] = len(tuples)
                tuples.append(u)
                nxt.append(u)
        frontier = nxt
    T = len(tuples)
    ranks = torch.tensor([list(u) + [0] * (H - len(u)) for u in tuples], dtype=torch.long).reshape(T, H)
    depth = torch.tensor([len(u) for u in tuples], dtype=torch.long)
    parent = torch.tensor([T if len(u) == 1 else index[u[:-1]] for u in tuples], dtype=torch.long)
    trunk = torch.tensor([not any(u) for u in tuples], dtype=torch.bool)
    return tuple(t.to(device) for t in (ranks, depth, parent, trunk))


def build_trees(root_tokens: torch.Tensor, cand_tokens: torch.Tensor, cand_logq: torch.Tensor,
                budget: int) -> TreeBatch:
    """root_tokens [b]; cand_tokens, cand_logq [b, H, k] (each head's top-k, best first);
    budget: nodes per row, root included (>= 1); fewer only if the candidates run out.

    Batched: the greedy growth from the trunk picks free slots in non-increasing cumulative log q
    (a child never scores above its parent, nor a candidate above a better-ranked sibling), so a
    row's tree is its trunk plus its best-scoring other nodes, in that order; ties go to the
    shallower node, then to the better ranks."""
    b, H, k = cand_tokens.shape
    dev = cand_tokens.device
    ranks, depth, parent, trunk = _rank_tuples(H, k, budget, dev)
    T = depth.shape[0]
    m = min(budget - 1, T)
    level = torch.arange(H, device=dev)
    on_path = level[None, :] < depth[:, None]  # [T, H]
    lq = cand_logq.float()[:, level[None, :], ranks]  # [b, T, H]: log q of each level's candidate
    score = torch.where(on_path, lq, torch.zeros((), device=dev)).sum(-1)
    key = torch.where(trunk, torch.full_like(score, float("-inf")), -score)  # trunk first
    order = depth.argsort(stable=True).expand(b, T)  # shallower first among equal keys
    order = order.gather(1, key.gather(1, order).argsort(dim=1, stable=True))[:, :m]  # [b, m]
    # tree positions: root 0, the chosen nodes 1..m in order
    pos = torch.zeros(b, T + 1, dtype=torch.long, device=dev)
    pos.scatter_(1, order, torch.arange(1, m + 1, device=dev).expand(b, m))
    node_depth = depth[order]
    last_rank = ranks.gather(1, (depth - 1).clamp(min=0)[:, None])[:, 0][order]  # [b, m]
    tokens = cand_tokens[torch.arange(b, device=dev)[:, None], (node_depth - 1).clamp(min=0), last_rank]
    root = root_tokens.to(dev)[:, None]
    return TreeBatch(torch.cat([root, tokens], 1),
                     torch.cat([torch.full((b, 1), ROOT, dtype=torch.long, device=dev), pos.gather(1, parent[order])], 1),
                     torch.cat([torch.zeros(b, 1, dtype=torch.long, device=dev), node_depth], 1),
                     torch.full((b,), m + 1, dtype=torch.long, device=dev))
