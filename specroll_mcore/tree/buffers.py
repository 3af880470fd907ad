"""Tree buffers from parent pointers: pure tensor functions, computed once per verification step.

A row's tree is given by ``parents`` [b, n]: node i's parent index (< i), -1 for a child of the
committed context (a root), and -2 for padding (rows with fewer nodes). Nodes are in topological
order (parents first).
"""

from __future__ import annotations

import torch

ROOT, PAD = -1, -2


def tree_ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[b, n, n] bool: node i may attend to node j iff j is i or an ancestor of i.
    Padding nodes see only themselves.

    Batched, with no host round trips: start from "self or parent" and square the relation
    ceil(log2(n)) times (each squaring doubles the path length it covers)."""
    b, n = parents.shape
    idx = torch.arange(n, device=parents.device)
    step = (idx[:, None] == idx[None, :])[None] | (parents[:, :, None] == idx[None, None, :])  # [b, n, n]
    m = step.float()
    for _ in range((n - 1).bit_length()):
        m = (torch.bmm(m, m) > 0).float()
    return m.bool()


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """[b, n] long: 0 for roots (and padding), parent depth + 1 otherwise (ancestors counted)."""
    return tree_ancestor_mask(parents).sum(-1) - 1
