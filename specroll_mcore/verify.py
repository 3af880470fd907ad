"""Exact acceptance: a drafted child is accepted iff it equals the token the policy samples at its
parent (with the counter-based noise of that position), so speculation only decides how many
positions one forward confirms, never which tokens are emitted.

For deterministic top-k children this is the lossless tree rule; with counter-based sampling it
gives more: the emitted tokens are exactly those the vanilla engine would sample with the same seed.
Every walk emits at least one token (the policy's own sample at the root). At T -> 0 the sample is
the argmax and the rule becomes greedy verification. Pure tensor code; no torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specroll_mcore.tree.builder import TreeBatch

# (logits [m, V], row indices [m], response positions [m]) -> (tokens [m], log-probs [m])
Sampler = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Acceptance:
    tokens: list[list[int]]
    """Per row: the emitted tokens, accepted drafts then the policy's sample at the last accepted node."""
    logprobs: list[list[torch.Tensor]]
    path: list[list[int]]
    """Per row: tree nodes whose keys/values to keep: the root and the accepted drafts, in order."""
    last_node: torch.Tensor
    """[b] the node the final token was sampled at (its hidden state feeds the next proposal)."""
    tried: torch.Tensor
    """[H] rows that reached depth d with a drafted child to check."""
    accepted: torch.Tensor
    """[H] of those, rows whose sample matched a child."""


def accept(tree: TreeBatch, logits: torch.Tensor, sample_fn: Sampler, position: torch.Tensor,
           max_depth: int) -> Acceptance:
    """Walk each row's tree from the root, sampling one token per depth.

    tree: [b, n]; logits: [b, n, V] (the policy at every node); position [b]: response index of
    the token sampled at the root (the root itself is the previous one).
    """
    b, n = tree.shape
    device = logits.device
    cur = torch.zeros(b, dtype=torch.long, device=device)
    alive = torch.arange(b, device=device)
    out_tokens: list[list[int]] = [[] for _ in range(b)]
    out_logp: list[list[torch.Tensor]] = [[] for _ in range(b)]
    path: list[list[int]] = [[0] for _ in range(b)]
    tried = torch.zeros(max(max_depth, 1), dtype=torch.long)
    accepted = torch.zeros_like(tried)
    for d in range(max_depth + 1):
        node = cur[alive]
        tok, lp = sample_fn(logits[alive, node], alive, position[alive] + d)
        for i, r in enumerate(alive.tolist()):
            out_tokens[r].append(int(tok[i]))
            out_logp[r].append(lp[i])
        # The child of `node` whose token equals the sample (siblings are distinct: at most one).
        is_child = tree.parents[alive] == node[:, None]  # [m, n]
        match = is_child & (tree.tokens[alive] == tok[:, None])
        has_child, has_match = is_child.any(-1), match.any(-1)
        if d < max_depth:
            tried[d] += int(has_child.sum())
            accepted[d] += int(has_match.sum())
        nxt = match.float().argmax(-1)
        for i in torch.nonzero(has_match).flatten().tolist():
            path[int(alive[i])].append(int(nxt[i]))
        cur[alive[has_match]] = nxt[has_match]
        alive = alive[has_match]
        if alive.numel() == 0:
            break
    return Acceptance(out_tokens, out_logp, path, cur, tried, accepted)
