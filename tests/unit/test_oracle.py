"""The rank oracle (tree/oracle.py): replay by hand, the chosen tree's shape, and the ceiling it gives."""

import random

import pytest

from specroll_mcore.tree.oracle import accepted_drafts, best_rank_tree, oracle_tau, rank_prefixes, replay

RANKS = [9, 0, 0, 1, 0]  # token 0 comes from the prefill; its rank plays no part


def test_replay_by_hand():
    assert replay(RANKS, frozenset({(0,), (0, 0), (0, 0, 1)}), depth=3) == (4, 1)  # one step takes all four
    # (0,) only: step 1 accepts token 1 and samples token 2; step 2 rejects at token 3 (rank 1);
    # step 3 accepts token 4 -> 3 steps for 4 tokens.
    assert replay(RANKS, frozenset({(0,)}), depth=3) == (4, 3)
    assert replay(RANKS, frozenset(), depth=3) == (4, 4)  # no drafts: one token per step
    assert oracle_tau([RANKS, RANKS], frozenset({(0,)}), depth=3) == pytest.approx(8 / 6)


def test_depth_limits_the_walk():
    assert replay([0, 0, 0, 0, 0], frozenset({(0,), (0, 0), (0, 0, 0)}), depth=2) == (4, 2)


def test_prefixes_stop_at_rare_ranks():
    assert list(rank_prefixes([3, 0, 40, 0], depth=3, max_rank=32)) == [(0,), (0,)]


def test_best_tree_by_hand():
    # prefixes: (0) x3, (1) x1, and six prefixes of depth 2-3 once each -> (0) then (1) (shorter first on ties)
    assert best_rank_tree([RANKS], nodes=3, depth=3) == frozenset({(0,), (1,)})
    assert best_rank_tree([RANKS], nodes=1, depth=3) == frozenset()


def random_tree(rng, nodes, depth):
    """A random prefix-closed rank tree of ``nodes`` nodes (root included)."""
    tree = set()
    while len(tree) < nodes - 1:
        parent = rng.choice([()] + [p for p in tree if len(p) < depth])
        tree.add(parent + (rng.randrange(4),))
    return frozenset(tree)


def test_best_tree_is_prefix_closed_and_beats_every_other_tree():
    rng = random.Random(0)
    responses = [[min(int(rng.expovariate(1.0)), 40) for _ in range(60)] for _ in range(20)]
    for nodes in (2, 4, 8, 16):
        tree = best_rank_tree(responses, nodes, depth=3)
        assert len(tree) == nodes - 1
        assert all(len(p) == 1 or p[:-1] in tree for p in tree)
        best = accepted_drafts(responses, tree, 3)
        for _ in range(50):
            assert best >= accepted_drafts(responses, random_tree(rng, nodes, 3), 3)


def test_bad_arguments():
    with pytest.raises(ValueError, match="nodes >= 1"):
        best_rank_tree([RANKS], nodes=0, depth=3)
