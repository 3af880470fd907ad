"""Rollout engines: vanilla (reference and baseline) and SpecRoll (speculative, same tokens)."""

from typing import Any

from specroll_mcore.rollout.base import RolloutOutput
from specroll_mcore.rollout.speculative import SpeculativeEngine
from specroll_mcore.rollout.vanilla import VanillaEngine

ENGINES = ("vanilla", "specroll")


def make_engine(name: str, model: Any, spec: Any = None, latency: Any = None, **kwargs: Any):
    """The engine named by a config flag: ``vanilla`` or ``specroll`` (``spec``: its SpecConfig;
    ``latency``: the profiled step latency it sizes trees with, see rollout/profile.speculative_setup)."""
    if name == "vanilla":
        return VanillaEngine(model, **kwargs)
    if name == "specroll":
        if spec is None:
            raise ValueError("the specroll engine needs a SpecConfig")
        return SpeculativeEngine(model, spec, latency=latency, **kwargs)
    raise ValueError(f"unknown engine {name!r}; choose one of {ENGINES}")


def engine_for(name: str, policy: Any, spec: Any, **kwargs: Any):
    """:func:`make_engine` for ``policy``, as the commands and the trainer build it: a speculative
    engine gets ``spec`` with its head count and C_hw filled in and the profiled step latency
    (rollout/profile.speculative_setup; collective, it may measure them)."""
    latency = None
    if name == "specroll":
        from specroll_mcore.rollout.profile import speculative_setup

        spec, latency = speculative_setup(policy, spec)
    return make_engine(name, policy, spec, latency, **kwargs)


__all__ = ["ENGINES", "RolloutOutput", "SpeculativeEngine", "VanillaEngine", "engine_for", "make_engine"]
