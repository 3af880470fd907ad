"""Exact acceptance: a drafted child is accepted iff it equals the token the policy samples at its
parent (with the counter-based noise of that position), so speculation only decides how many
positions one forward confirms, never which tokens are emitted.

For deterministic top-k children this is the lossless tree rule; with counter-based sampling it
gives more: the emitted tokens are exactly those the vanilla engine would sample with the same seed.
Every walk emits at least one token (the policy's own sample at the root). At T -> 0 the sample is
the argmax and the rule becomes greedy verification. Pure tensor code; no torch.distributed.

The walk samples depth by depth, at the nodes still reached (on a CPU, where sampling costs its
vocabulary-wide work per node), or samples every node at once and walks without reading anything
back (on a GPU, where each operation is a launch and each data-dependent shape a wait for the
device; ``SPECROLL_ACCEPT_AT_ONCE=1`` / ``0`` chooses either anywhere). A node's sample depends on its
logits and its position alone, so both give the same result.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from specroll_mcore.tree.buffers import ROOT
from specroll_mcore.tree.builder import TreeBatch

# (logits [m, V], row indices [m], response positions [m]) -> (tokens [m], log-probs [m])
Sampler = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Acceptance:
    """Fixed-shape results (they travel between pipeline stages as they are)."""

    tokens: torch.Tensor
    """[b, D+1] emitted tokens: accepted drafts, then the policy's sample at the last accepted node."""
    logprobs: torch.Tensor
    """[b, D+1] float32 log-probs of the emitted tokens."""
    path: torch.Tensor
    """[b, D+1] tree nodes whose keys/values to keep (the root, then accepted drafts); -1 pads."""
    counts: torch.Tensor
    """[b] tokens emitted per row (>= 1); the path holds ``counts`` nodes."""
    last_node: torch.Tensor
    """[b] the node the final token was sampled at (its hidden state seeds the next proposal)."""
    tried: torch.Tensor
    """[D] rows that reached depth d with a drafted child to check."""
    accepted: torch.Tensor
    """[D] of those, rows whose sample matched a child."""


def node_rows(x: torch.Tensor, rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    """``x[rows, nodes]`` for x [b, n, ...] (logits at tree nodes): one row copy per entry through
    index_select where the first two dimensions merge into one, in either order (a forward's logits
    are [n, b, ...] viewed as [b, n, ...]); on CPU, advanced indexing of vocabulary-wide rows took
    2.5-4x as long."""
    b, n = x.shape[:2]
    if b == 1 or x.stride(0) == n * x.stride(1):
        return x.flatten(0, 1).index_select(0, rows * n + nodes)
    if n == 1 or x.stride(1) == b * x.stride(0):
        return x.transpose(0, 1).flatten(0, 1).index_select(0, nodes * b + rows)
    return x[rows, nodes]


def accept_at_once(device: torch.device) -> bool:
    """Whether :func:`accept` samples every node at once on ``device`` (module docstring)."""
    choice = os.environ.get("SPECROLL_ACCEPT_AT_ONCE")
    return device.type != "cpu" if choice is None else choice != "0"


def accept(tree: TreeBatch, logits: torch.Tensor, sample_fn: Sampler, position: torch.Tensor,
           max_depth: int, at_once: Optional[bool] = None) -> Acceptance:
    """Walk each row's tree from the root, sampling one token per depth.

    tree: [b, n]; logits: [b, n, V] (the policy at every node); position [b]: response index of
    the token sampled at the root (the root itself is the previous one). ``at_once``: sample every
    node first, then walk without a host sync (None: :func:`accept_at_once` of the logits' device).
    """
    if at_once is None:
        at_once = accept_at_once(logits.device)
    if at_once:
        return _accept_at_once(tree, logits, sample_fn, position, max_depth)
    b, n = tree.shape
    device = logits.device
    D = max(max_depth, 1)
    tokens = torch.full((b, D + 1), -1, dtype=torch.long, device=device)
    logprobs = torch.zeros(b, D + 1, dtype=torch.float32, device=device)
    path = torch.full((b, D + 1), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    counts = torch.zeros(b, dtype=torch.long, device=device)
    cur = torch.zeros(b, dtype=torch.long, device=device)
    alive = torch.arange(b, device=device)
    tried = torch.zeros(D, dtype=torch.long, device=device)  # (on the device: counted without a host sync)
    accepted = torch.zeros(D, dtype=torch.long, device=device)
    for d in range(max_depth + 1):
        node = cur[alive]
        # every row starts at its root: a view of the root logits, not a gathered copy of them
        at_node = logits[:, 0] if d == 0 else node_rows(logits, alive, node)
        tok, lp = sample_fn(at_node, alive, position[alive] + d)
        tokens[alive, d] = tok
        logprobs[alive, d] = lp.float()
        counts[alive] += 1
        if d == max_depth or n == 1:
            break
        # The child of `node` whose token equals the sample (siblings are distinct: at most one).
        is_child = tree.parents[alive] == node[:, None]  # [m, n]
        match = is_child & (tree.tokens[alive] == tok[:, None])
        has_match = match.any(-1)
        tried[d] += is_child.any(-1).sum()
        accepted[d] += has_match.sum()
        nxt = match.to(torch.int8).argmax(-1)
        alive, nxt = alive[has_match], nxt[has_match]
        if alive.numel() == 0:
            break
        cur[alive] = nxt
        path[alive, d + 1] = nxt
    return Acceptance(tokens, logprobs, path, counts, cur, tried, accepted)


def _accept_at_once(tree: TreeBatch, logits: torch.Tensor, sample_fn: Sampler, position: torch.Tensor,
                    max_depth: int) -> Acceptance:
    """:func:`accept` with the policy's sample at every node drawn in one call (a padding node at its
    row's root position: drawn, never read; the memory of a plain step of as many rows), then the
    walk in closed form: a drafted node is accepted iff its token is its parent's sample and its
    parent is accepted (the root always is); siblings are distinct, so at most one node a depth is.
    Fixed-shape tensor operations over every row: nothing is read back to the host."""
    b, n = tree.shape
    device = logits.device
    D, levels = max(max_depth, 1), max_depth + 1
    rows = torch.arange(b, device=device).repeat_interleave(n)
    sampled, lp = sample_fn(logits.reshape(b * n, -1), rows, position[rows] + tree.depth.flatten())
    sampled, lp = sampled.view(b, n), lp.float().view(b, n)
    parent = tree.parents.clamp(min=0)
    root = tree.parents == ROOT
    hit = (tree.parents >= 0) & (tree.tokens == sampled.gather(1, parent))  # drafted, and its parent's sample
    accepted_node = root
    for _ in range(min(max_depth, n - 1)):  # one more depth of accepted ancestors each pass
        accepted_node = root | (hit & accepted_node.gather(1, parent))
    at_depth = accepted_node[:, None] & (tree.depth[:, None] == torch.arange(levels, device=device)[:, None])
    reached = at_depth.any(-1)  # [b, levels]: the walk reached depth d
    node = at_depth.to(torch.int8).argmax(-1)  # the node it reached there (0 where it did not)
    counts = reached.sum(-1)
    tokens = torch.full((b, D + 1), -1, dtype=torch.long, device=device)
    logprobs = torch.zeros(b, D + 1, dtype=torch.float32, device=device)
    path = torch.full((b, D + 1), -1, dtype=torch.long, device=device)
    tokens[:, :levels] = torch.where(reached, sampled.gather(1, node), -1)
    logprobs[:, :levels] = torch.where(reached, lp.gather(1, node), 0.0)
    path[:, :levels] = torch.where(reached, node, -1)
    tried = torch.zeros(D, dtype=torch.long, device=device)
    accepted = torch.zeros(D, dtype=torch.long, device=device)
    if max_depth > 0 and n > 1:
        has_child = (tree.parents[:, None] == torch.arange(n, device=device)[:, None]).any(-1)  # [b, n]
        tried[:max_depth] = (reached[:, :-1] & has_child.gather(1, node[:, :-1])).sum(0)
        accepted[:max_depth] = reached[:, 1:].sum(0)
    last_node = node.gather(1, (counts - 1)[:, None])[:, 0]
    return Acceptance(tokens, logprobs, path, counts, last_node, tried, accepted)
