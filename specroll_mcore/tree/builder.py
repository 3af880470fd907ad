"""Sparse, prefix-closed draft trees under a per-row node budget (pure, no torch.distributed).

Row r's tree hangs from its root: the token the policy itself sampled last (certain, depth 0).
Heads draft level by level (rollout/speculative.py): head 1 drafts k candidates under the root;
head d+1 drafts k candidates under each of a few depth-d nodes (the *expanded* ones), conditioned on
the tokens of that node's path. Every candidate carries its cumulative draft log-probability
(the sum of log q along its path). This module picks

  * which nodes of a level to expand (:func:`expansion`): the trunk (the top-1 under the trunk
    node above) first, then the best cumulative scores, and
  * the tree (:func:`select_tree`): the trunk (each head's top-1 under the previous trunk node: the
    single most likely continuation), then the other candidates by cumulative score, until the
    row's budget of nodes (root included) is spent. Candidates scored -inf (removed by the
    sampler's top-k / top-p: the policy cannot sample them) are left out; a row then holds fewer
    nodes, padded.

All rows are handled at once with tensor operations (no per-row loop: on a GPU the step's host
work is what speculation must beat). A child never scores above its parent (log q <= 0) and ties
go to the shallower node, so every chosen node's parent is chosen first (prefix-closed); siblings
are distinct candidates of one distribution, so at most one child can match the policy's sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

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

    def prefix(self, n: int) -> "TreeBatch":
        """The first ``n`` nodes of every row: a tree again for trees from :func:`select_tree` (each
        node's parent comes before it)."""
        return TreeBatch(self.tokens[:, :n], self.parents[:, :n], self.depth[:, :n], self.num_nodes.clamp(max=n))


@dataclass
class DraftLevel:
    """What one head drafted: k candidates under each of P expanded nodes of the level above."""

    parent: torch.Tensor  # [b, P] pool index of each expanded node (ROOT for the root)
    tokens: torch.Tensor  # [b, P, k] candidates, best first
    score: torch.Tensor  # [b, P, k] cumulative draft log-prob of the path ending in each candidate

    @property
    def width(self) -> int:
        return self.tokens.shape[1] * self.tokens.shape[2]


def expansion(level: DraftLevel, count: int) -> torch.Tensor:
    """[b, count] indices (into the level's flattened P * k candidates) of the nodes the next head
    extends: the trunk (expanded node 0's top-1) first, then by cumulative score (ties to the
    lower index)."""
    b = level.tokens.shape[0]
    key = -level.score.reshape(b, -1).float()
    key[:, 0] = float("-inf")
    return key.argsort(dim=1, stable=True)[:, :count]


def select_tree(root_tokens: torch.Tensor, levels: Sequence[DraftLevel],
                budget: int) -> tuple[TreeBatch, torch.Tensor]:
    """The tree of each row: root_tokens [b] and the drafted levels (level d holds depth d + 1;
    pool indices number the levels' flattened candidates one after another) -> the trees and, per
    tree node, its pool index [b, n] (ROOT for the root). ``budget``: nodes per row, root included
    (>= 1); fewer only if the live candidates run out (padding nodes: PAD parent, depth 0, the
    root's token, pool index ROOT)."""
    b = root_tokens.shape[0]
    dev = root_tokens.device
    if not levels or budget <= 1:
        return (TreeBatch(root_tokens[:, None], torch.full((b, 1), ROOT, dtype=torch.long, device=dev),
                          torch.zeros(b, 1, dtype=torch.long, device=dev), torch.ones(b, dtype=torch.long, device=dev)),
                torch.full((b, 1), ROOT, dtype=torch.long, device=dev))
    tokens = torch.cat([lv.tokens.reshape(b, -1) for lv in levels], 1)  # [b, M]
    score = torch.cat([lv.score.reshape(b, -1).float() for lv in levels], 1)
    parent = torch.cat([lv.parent[:, :, None].expand(lv.tokens.shape).reshape(b, -1) for lv in levels], 1)
    depth = torch.cat([torch.full((lv.width,), d + 1, dtype=torch.long, device=dev) for d, lv in enumerate(levels)])
    offsets = torch.tensor([0] + [lv.width for lv in levels], device=dev).cumsum(0)[:-1]
    M = tokens.shape[1]
    m = min(budget - 1, M)
    trunk = torch.zeros(M, dtype=torch.bool, device=dev)
    trunk[offsets] = True  # each level's first candidate under its first expanded node
    key = torch.where(trunk[None], torch.full_like(score, float("-inf")), -score)
    order = depth.argsort(stable=True).expand(b, M)  # shallower first among equal keys
    order = order.gather(1, key.gather(1, order).argsort(dim=1, stable=True))[:, :m]  # [b, m]
    # tree positions: root 0, the chosen nodes 1..m in order; pool index M stands for the root
    pos = torch.zeros(b, M + 1, dtype=torch.long, device=dev)
    pos.scatter_(1, order, torch.arange(1, m + 1, device=dev).expand(b, m))
    par = parent.gather(1, order)
    par_pos = pos.gather(1, torch.where(par == ROOT, torch.full_like(par, M), par))
    live = score.gather(1, order) > float("-inf")  # a dead node's children are dead too: they sort after it
    root_tok = root_tokens.to(dev)[:, None]
    root = torch.full((b, 1), ROOT, dtype=torch.long, device=dev)
    tree = TreeBatch(torch.cat([root_tok, torch.where(live, tokens.gather(1, order), root_tok)], 1),
                     torch.cat([root, torch.where(live, par_pos, PAD)], 1),
                     torch.cat([torch.zeros(b, 1, dtype=torch.long, device=dev),
                                torch.where(live, depth[order], 0)], 1),
                     1 + live.sum(1))
    return tree, torch.cat([root, torch.where(live, order, ROOT)], 1)


def node_beliefs(levels: Sequence[DraftLevel], pool_index: torch.Tensor) -> torch.Tensor:
    """[b, n - 1]: for the non-root nodes of trees from :func:`select_tree` (``pool_index`` [b, n]),
    the drafts' belief that the node is accepted: a node is accepted iff its whole path is, which the
    drafts believe with the path's cumulative probability; padding 0."""
    b = pool_index.shape[0]
    nodes = pool_index[:, 1:]
    if not levels or nodes.shape[1] == 0:
        return torch.zeros(b, nodes.shape[1], device=pool_index.device)
    score = torch.cat([lv.score.reshape(b, -1).float() for lv in levels], 1)
    return torch.where(nodes >= 0, score.gather(1, nodes.clamp(min=0)).exp(), 0.0)


def expected_tokens(beliefs: torch.Tensor) -> torch.Tensor:
    """Node beliefs [b, n - 1] (:func:`node_beliefs`) -> [n]: the tokens a step is expected to emit
    over all rows with the trees cut to their first N = 1 .. n nodes (a row emits one token plus one
    per accepted node)."""
    b = beliefs.shape[0]
    return torch.cat([beliefs.new_zeros(1), beliefs.sum(0).cumsum(0)]) + b
