"""The rank oracle: how many tokens per step a drafter that ranks exactly like the policy would get.

A verification step with root y_t accepts the drafts along the sampled path, so a tree whose nodes
are identified by the policy's own ranks — node (r_1, ..., r_d) holds the policy's r_d-th most likely
token at depth d under the accepted prefix — accepts L drafts where L is the longest prefix of the
realised rank tuple (rank(y_{t+1}), ..., rank(y_{t+H})) that is a node. Given the ranks of every
sampled token (one teacher-forced forward over finished responses), this module

  * picks the best fixed tree of N nodes for those statistics: the N - 1 most frequent rank
    prefixes (a prefix is at least as frequent as any of its extensions, so the set is
    prefix-closed), which maximises the drafts accepted summed over every root position, and
  * replays responses step by step with a tree, as the engine would, giving tokens per step (tau).

A drafter whose candidates at every depth were the policy's own top tokens under the true prefix,
ranked by probability, is exactly this oracle; it bounds drafts ranked by probability (up to the
choice of one fixed shape). Coupled drafts (SpecConfig.coupled) rank by the sampler's own noise
instead and can exceed it. Pure Python on lists of ints; no torch.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

RankTree = frozenset  # of tuples of ranks; the root () is implicit


def rank_prefixes(ranks: Sequence[int], depth: int, max_rank: int) -> Iterable[tuple[int, ...]]:
    """Every rank prefix a step could accept, for each root position of one response.

    ``ranks[j]`` is the policy's rank of response token j under its own prefix (0 = most likely).
    The step rooted at token t drafts tokens t+1 ... t+depth; prefixes stop at the first rank
    >= ``max_rank`` (no tree holds such a node)."""
    for t in range(len(ranks) - 1):
        prefix: tuple[int, ...] = ()
        for j in range(t + 1, min(len(ranks), t + 1 + depth)):
            if ranks[j] >= max_rank:
                break
            prefix += (ranks[j],)
            yield prefix


def best_rank_tree(responses: Iterable[Sequence[int]], nodes: int, depth: int, max_rank: int = 32) -> RankTree:
    """The fixed tree of ``nodes`` nodes (root included; fewer if the responses hold fewer distinct
    rank prefixes) that accepts the most drafts on ``responses`` (each a list of per-token ranks),
    summed over all root positions."""
    if nodes < 1 or depth < 1:
        raise ValueError(f"need nodes >= 1 and depth >= 1, got nodes={nodes}, depth={depth}")
    counts: Counter = Counter()
    for ranks in responses:
        counts.update(rank_prefixes(ranks, depth, max_rank))
    # Most frequent first; on ties the shorter prefix first, so a prefix always precedes its extensions.
    order = sorted(counts, key=lambda p: (-counts[p], len(p), p))
    return frozenset(order[: nodes - 1])


def accepted_drafts(responses: Iterable[Sequence[int]], tree: RankTree, depth: int, max_rank: int = 32) -> int:
    """Drafts ``tree`` accepts summed over every root position of ``responses`` (what
    :func:`best_rank_tree` maximises)."""
    return sum(p in tree for ranks in responses for p in rank_prefixes(ranks, depth, max_rank))


def replay(ranks: Sequence[int], tree: RankTree, depth: int) -> tuple[int, int]:
    """Decode one response again with ``tree``: (tokens emitted after the first, verification steps).

    The first token comes from the prefill; every step emits its accepted drafts plus the policy's
    own sample (at least one token)."""
    t, steps = 0, 0
    while t < len(ranks) - 1:
        prefix: tuple[int, ...] = ()
        accepted = 0
        for j in range(t + 1, min(len(ranks) - 1, t + depth) + 1):
            if prefix + (ranks[j],) not in tree:
                break
            prefix += (ranks[j],)
            accepted += 1
        t = min(len(ranks) - 1, t + accepted + 1)
        steps += 1
    return len(ranks) - 1, steps


def oracle_tau(responses: Sequence[Sequence[int]], tree: RankTree, depth: int) -> float:
    """Tokens per verification step over ``responses`` replayed with ``tree``."""
    emitted = steps = 0
    for ranks in responses:
        e, s = replay(ranks, tree, depth)
        emitted, steps = emitted + e, steps + s
    return emitted / steps if steps else 1.0
