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
    Padding nodes see only themselves."""
    b, n = parents.shape
    eye = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n).clone()
    mask = eye.clone()
    for i in range(n):  # topological order: a parent's row is complete before its children's
        p = parents[:, i]
        has_parent = p >= 0
        if has_parent.any():
            rows = torch.nonzero(has_parent, as_tuple=True)[0]
            mask[rows, i] |= mask[rows, p[rows]]
    return mask


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """[b, n] long: 0 for roots (and padding), parent depth + 1 otherwise."""
    b, n = parents.shape
    depth = torch.zeros(b, n, dtype=torch.long, device=parents.device)
    for i in range(n):
        p = parents[:, i]
        has_parent = p >= 0
        depth[has_parent, i] = depth[has_parent, p[has_parent]] + 1
    return depth
