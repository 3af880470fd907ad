"""Draft trees: buffers (masks, depths) from parent pointers."""

from specroll_mcore.tree.buffers import PAD, ROOT, tree_ancestor_mask, tree_depths

__all__ = ["PAD", "ROOT", "tree_ancestor_mask", "tree_depths"]
