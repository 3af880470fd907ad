"""Rollout engines: vanilla (reference and baseline) and SpecRoll (speculative, same tokens)."""

from typing import Any

from specroll_mcore.rollout.base import RolloutOutput
from specroll_mcore.rollout.speculative import SpeculativeEngine
from specroll_mcore.rollout.vanilla import VanillaEngine

ENGINES = ("vanilla", "specroll")


def make_engine(name: str, model: Any, spec: Any = None, latency: Any = None, **kwargs: Any):
    """The engine named by a config flag: ``vanilla`` or ``specroll`` (``spec``: its SpecConfig;
    ``latency``: the profiled LatencyCurve it sizes trees with, see rollout/profile.ensure_capacity)."""
    if name == "vanilla":
        return VanillaEngine(model, **kwargs)
    if name == "specroll":
        if spec is None:
            raise ValueError("the specroll engine needs a SpecConfig")
        return SpeculativeEngine(model, spec, latency=latency, **kwargs)
    raise ValueError(f"unknown engine {name!r}; choose one of {ENGINES}")


__all__ = ["ENGINES", "RolloutOutput", "SpeculativeEngine", "VanillaEngine", "make_engine"]
