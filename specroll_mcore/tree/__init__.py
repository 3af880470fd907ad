"""Draft trees: budget (C_hw, N_t), builder, and buffers (masks, depths) from parent pointers."""

from specroll_mcore.tree.budget import (DepthCalibration, LatencyCurve, LatencySurface, StepCost, StepOverhead,
                                        capacity_from_latency, node_budget, row_chunks, tree_size)
from specroll_mcore.tree.buffers import PAD, ROOT, tree_ancestor_mask, tree_depths
from specroll_mcore.tree.builder import DraftLevel, TreeBatch, expansion, expected_tokens, node_beliefs, select_tree

__all__ = ["PAD", "ROOT", "DepthCalibration", "DraftLevel", "LatencyCurve", "LatencySurface", "StepCost",
           "StepOverhead", "TreeBatch", "capacity_from_latency", "expansion", "expected_tokens", "node_beliefs",
           "node_budget", "row_chunks", "select_tree", "tree_ancestor_mask", "tree_depths", "tree_size"]
