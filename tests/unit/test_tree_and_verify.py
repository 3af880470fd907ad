"""Tree builder, node budget and the acceptance walk, as pure functions."""

import math
import random

import torch

from specroll_mcore.tree import (PAD, ROOT, DraftLevel, TreeBatch, capacity_from_latency, expansion, node_budget,
                                 row_chunks, select_tree)
from specroll_mcore.verify import accept


def drafter(root, path, k, vocab=50):
    """A deterministic conditional draft: k distinct tokens under (root, path), log-probs sorted."""
    rng = random.Random(hash((root,) + tuple(path)))
    logq = sorted((rng.gauss(0, 1) for _ in range(k)), reverse=True)
    z = math.log(sum(math.exp(x) for x in logq) + rng.random())
    return rng.sample(range(vocab), k), [x - z for x in logq]


def draft(roots, H, k, budget):
    """Levels drafted as the engine does: head d+1 under the nodes :func:`expansion` picks, each
    conditioned on its own path. Returns the levels and every candidate's path, per row."""
    b, D = len(roots), min(H, budget - 1)
    levels, cand_paths, offset = [], [[()] for _ in roots], 0
    for d in range(D):
        if d == 0:
            parent = torch.full((b, 1), ROOT)
            expanded, base = [[()] for _ in roots], torch.zeros(b, 1)
        else:
            above = levels[-1]
            sel = expansion(above, min(k, above.width, (budget - d) // 2))
            parent = offset + sel
            offset += above.width
            expanded = [[cand_paths[r][j] for j in sel[r].tolist()] for r in range(b)]
            base = above.score.reshape(b, -1).gather(1, sel)
        drafts = [[drafter(roots[r], p, k) for p in expanded[r]] for r in range(b)]
        tokens = torch.tensor([[t for t, _ in row] for row in drafts])
        score = base[..., None] + torch.tensor([[q for _, q in row] for row in drafts])
        levels.append(DraftLevel(parent, tokens, score))
        cand_paths = [[p + (t,) for p, (toks, _) in zip(expanded[r], drafts[r]) for t in toks] for r in range(b)]
    return levels


def node_path(tree, r, i):
    path = []
    while i > 0:
        path.append(int(tree.tokens[r, i]))
        i = int(tree.parents[r, i])
    return tuple(reversed(path))


def test_trees_are_prefix_closed_within_budget_and_drafted_under_their_own_path():
    for b, H, k in ((6, 3, 4), (3, 2, 6), (4, 4, 3), (2, 1, 5)):
        for budget in (1, 2, 3, 5, 8, 13, 40):
            roots = list(range(100, 100 + b))
            levels = draft(roots, H, k, budget)
            tree, pool = select_tree(torch.tensor(roots), levels, budget)
            assert tree.shape[1] == min(budget, 1 + sum(lv.width for lv in levels))
            assert pool[:, 0].eq(ROOT).all()
            for r in range(b):
                n = int(tree.num_nodes[r])
                parents = tree.parents[r, :n].tolist()
                assert parents[0] == ROOT and all(0 <= p < i for i, p in enumerate(parents) if i > 0)
                children = {}
                for i in range(1, n):
                    d = int(tree.depth[r, i])
                    assert d == int(tree.depth[r, parents[i]]) + 1 and 1 <= d <= H
                    above = node_path(tree, r, parents[i])
                    assert int(tree.tokens[r, i]) in drafter(roots[r], above, k)[0]  # drafted under its own path
                    children.setdefault(parents[i], []).append(int(tree.tokens[r, i]))
                assert all(len(set(c)) == len(c) for c in children.values())  # distinct siblings
                trunk = []
                for _ in range(min(H, budget - 1)):
                    trunk.append(drafter(roots[r], tuple(trunk), k)[0][0])
                assert tree.tokens[r, 1:1 + len(trunk)].tolist() == trunk  # the trunk first


def test_selection_is_trunk_then_best_cumulative_scores():
    rng = random.Random(1)
    for _ in range(20):
        b, H, k, budget = 3, rng.choice((2, 3, 4)), rng.choice((2, 3, 4)), rng.choice((3, 5, 8, 16))
        roots = [rng.randrange(1000) for _ in range(b)]
        levels = draft(roots, H, k, budget)
        tree, pool = select_tree(torch.tensor(roots), levels, budget)
        score = torch.cat([lv.score.reshape(b, -1) for lv in levels], 1)
        for r in range(b):
            n = int(tree.num_nodes[r])
            chosen = pool[r, 1:n].tolist()
            depth = len(levels)
            rest = chosen[depth:]
            assert all(score[r, u] >= score[r, v] for u, v in zip(rest, rest[1:]))  # best first
            others = set(range(score.shape[1])) - set(chosen)
            if rest and others:
                assert score[r, rest[-1]] >= max(score[r, v] for v in others)  # no better node left out


def test_trunk_first_then_by_cumulative_probability():
    level1 = DraftLevel(torch.tensor([[ROOT]]), torch.tensor([[[10, 11, 12]]]),
                        torch.log(torch.tensor([[[0.6, 0.3, 0.1]]])))
    # head 2 under nodes 10 and 11 (pool indices 0 and 1): different candidates under each
    level2 = DraftLevel(torch.tensor([[0, 1]]), torch.tensor([[[20, 21], [22, 23]]]),
                        torch.log(torch.tensor([[[0.6 * 0.5, 0.6 * 0.4], [0.3 * 0.9, 0.3 * 0.1]]])))
    tree, pool = select_tree(torch.tensor([5]), [level1, level2], 6)
    assert tree.tokens[0].tolist() == [5, 10, 20, 11, 22, 21]
    assert tree.parents[0].tolist() == [ROOT, 0, 1, 0, 3, 1]
    assert tree.depth[0].tolist() == [0, 1, 2, 1, 2, 2]
    assert pool[0].tolist() == [ROOT, 0, 3, 1, 5, 4]


def test_candidates_the_sampler_removed_are_left_out():
    inf = float("inf")
    level1 = DraftLevel(torch.tensor([[ROOT], [ROOT]]), torch.tensor([[[10, 11, 12]], [[13, 14, 15]]]),
                        torch.tensor([[[-0.1, -inf, -inf]], [[-0.1, -1.0, -2.0]]]))
    level2 = DraftLevel(torch.tensor([[0], [0]]), torch.tensor([[[20, 21, 22]], [[23, 24, 25]]]),
                        torch.tensor([[[-0.5, -inf, -inf]], [[-0.5, -0.6, -inf]]]))
    tree, pool = select_tree(torch.tensor([5, 6]), [level1, level2], 6)
    assert tree.num_nodes.tolist() == [3, 6]
    assert tree.tokens.tolist() == [[5, 10, 20, 5, 5, 5], [6, 13, 23, 24, 14, 15]]
    assert tree.parents.tolist() == [[ROOT, 0, 1, PAD, PAD, PAD], [ROOT, 0, 1, 1, 0, 0]]
    assert tree.depth.tolist() == [[0, 1, 2, 0, 0, 0], [0, 1, 2, 2, 1, 1]]
    assert pool.tolist() == [[ROOT, 0, 3, ROOT, ROOT, ROOT], [ROOT, 0, 3, 4, 1, 2]]


def test_budget_and_chunks():
    assert node_budget(256, 64, 1, 16) == 1
    assert node_budget(8, 64, 1, 16) == 8
    assert node_budget(1, 64, 1, 16) == 16
    assert node_budget(100, 64, 2, 16) == 2
    assert row_chunks(100, 2, 64) == [(0, 32), (32, 64), (64, 96), (96, 100)]
    assert capacity_from_latency([1, 2, 4, 8, 16, 32], [1.0, 1.0, 1.1, 1.3, 1.6, 2.5]) == 8


def test_accept_walk_matches_children_and_always_emits():
    # Row 0: root -> 1 (tok 7) -> 2 (tok 8); root -> 3 (tok 9). Row 1: root only.
    tree = TreeBatch(tokens=torch.tensor([[0, 7, 8, 9], [0, 0, 0, 0]]),
                     parents=torch.tensor([[ROOT, 0, 1, 0], [ROOT, PAD, PAD, PAD]]),
                     depth=torch.tensor([[0, 1, 2, 1], [0, 0, 0, 0]]), num_nodes=torch.tensor([4, 1]))
    logits = torch.zeros(2, 4, 12)
    # The "policy" samples the argmax of its logits at each node.
    logits[0, 0, 7] = logits[0, 1, 8] = logits[0, 2, 3] = 5.0
    logits[1, 0, 4] = 5.0

    def sample_fn(lg, rows, pos):
        return lg.argmax(-1), torch.zeros(len(rows))

    acc = accept(tree, logits, sample_fn, torch.tensor([5, 9]), max_depth=2)
    assert acc.tokens.tolist() == [[7, 8, 3], [4, -1, -1]]
    assert acc.counts.tolist() == [3, 1]
    assert acc.path.tolist() == [[0, 1, 2], [0, -1, -1]]
    assert acc.last_node.tolist() == [2, 0]
    assert acc.tried.tolist() == [1, 1] and acc.accepted.tolist() == [1, 1]


def test_capacity_is_profiled_once_and_cached(ctx, tmp_path, monkeypatch):
    from conftest import make_policy
    from specroll_mcore.config import tiny_llama
    from specroll_mcore.rollout import profile

    monkeypatch.setenv("SPECROLL_CACHE", str(tmp_path))
    model = make_policy(tiny_llama(), ctx)
    assert profile.ensure_capacity(model, 24, "fp") == 24  # configured wins, nothing measured
    assert not (tmp_path / "capacity_profiles.json").exists()
    c_hw = profile.ensure_capacity(model, None, "fp")
    assert c_hw in profile.QUICK_SIZES and (tmp_path / "capacity_profiles.json").is_file()
    monkeypatch.setattr(profile, "forward_latency", lambda *a, **k: (_ for _ in ()).throw(AssertionError("re-measured")))
    assert profile.ensure_capacity(model, None, "fp") == c_hw  # cached
