"""Routing replay for mixtures of experts: the policy update routes each token to the experts the
rollout routed it to (R3, "rollout routing replay", as verl's ``enable_rollout_routing_replay``).

A rollout and the update compute a token's router logits in different forwards (a decoding step or
a tree against a whole sequence; other kernels, other row counts). Where two experts nearly tie,
the two forwards can pick different ones, and the token's log-prob under the update is then that
of another network: the importance ratio and the clipping see a change the weights did not make.
Replaying the rollout's choices keeps the update on the network that sampled; the router's weights
still learn, through the probabilities it gives the replayed experts.

This uses megatron-core's own hook (``moe_enable_routing_replay``: a ``RouterReplay`` on every
router, which records or replays the top-k indices; the same methods in 0.16.1 and 0.19.2) per
policy, not through its process-wide registry of hooks, which would mix the layers of every model a
process builds (a reference model, tests): :func:`routers` takes a policy's hooks out of it.

Indices follow megatron-core's token order: a forward of ``[s, b]`` tokens routes them as
``s * b`` rows, row ``i * b + j`` for token ``i`` of sequence ``j``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction


def routers(module: torch.nn.Module) -> list[TopKRouter]:
    """The expert routers in ``module`` (a pipeline stage's model), in layer order, their replay hooks
    taken out of megatron-core's process-wide registry (see the module docstring)."""
    found = [m for m in module.modules() if isinstance(m, TopKRouter)]
    mine = {id(r.router_replay) for r in found if r.router_replay is not None}
    registry = RouterReplay.global_router_replay_instances
    registry[:] = [hook for hook in registry if id(hook) not in mine]
    return [r for r in found if r.router_replay is not None]


@contextlib.contextmanager
def recorded_routing(layers: list[TopKRouter]) -> Iterator[list[torch.Tensor]]:
    """Record the experts every router picks in the block: the list yielded holds, after it, each
    router's top-k indices ``[s * b, k]`` of the last forward (megatron's token order)."""
    out: list[torch.Tensor] = []
    for r in layers:
        r.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield out
        out.extend(r.router_replay.get_recorded_indices() for r in layers)
    finally:
        for r in layers:
            r.router_replay.clear_indices()
            r.router_replay.clear_router_replay_action()


def replay_routing(layers: list[TopKRouter], routing: Optional[torch.Tensor]) -> None:
    """Make the next forwards route a ``[s, b]`` batch of tokens by ``routing`` [b, s, layers, k] (the
    experts of every token at each of these routers, in layer order; no routers: nothing to do); None:
    route as trained. The indices stay set until the next call, so that a backward's recomputation of
    a layer routes as its forward did (set the same micro-batch's again before that backward)."""
    for i, r in enumerate(layers):
        hook = r.router_replay
        hook.clear_indices()
        if routing is None:
            hook.clear_router_replay_action()
            continue
        b, s, _, k = routing.shape
        hook.set_target_indices(routing[:, :, i].transpose(0, 1).reshape(s * b, k))
        hook.replay_backward_list.clear()  # (megatron's queue for its own recompute; unused here)
        hook.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def fill_routing(recorded: Optional[torch.Tensor], length: int, layers: int, topk: int) -> torch.Tensor:
    """A sequence's routing for ``length`` tokens [length, layers, topk] (int64): the ``recorded``
    [n, layers, topk] for its first n tokens, experts 0 .. topk - 1 past them (tokens whose routing
    no loss reads: the last token, which no rollout forward took as input, and padding)."""
    out = torch.arange(topk, dtype=torch.long).expand(length, layers, topk).clone()
    if recorded is not None:
        n = min(length, recorded.shape[0])
        out[:n] = recorded[:n].long()
    return out
