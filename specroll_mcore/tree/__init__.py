"""Draft trees: budget (C_hw, N_t), builder, and buffers (masks, depths) from parent pointers."""

from specroll_mcore.tree.budget import capacity_from_latency, node_budget, row_chunks
from specroll_mcore.tree.buffers import PAD, ROOT, tree_ancestor_mask, tree_depths
from specroll_mcore.tree.builder import DraftLevel, TreeBatch, expansion, select_tree

__all__ = ["PAD", "ROOT", "DraftLevel", "TreeBatch", "capacity_from_latency", "expansion", "node_budget",
           "row_chunks", "select_tree", "tree_ancestor_mask", "tree_depths"]
