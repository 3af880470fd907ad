"""Rollout engines: vanilla (reference and baseline); speculative engines share its interface."""

from specroll_mcore.rollout.base import RolloutOutput
from specroll_mcore.rollout.vanilla import VanillaEngine

__all__ = ["RolloutOutput", "VanillaEngine"]
