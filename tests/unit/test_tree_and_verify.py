"""Tree builder, node budget and the acceptance walk, as pure functions."""

import random

import torch

from specroll_mcore.tree import PAD, ROOT, build_trees, capacity_from_latency, node_budget, row_chunks
from specroll_mcore.tree.builder import TreeBatch
from specroll_mcore.verify import accept


def random_candidates(rng, b, H, k, vocab=50):
    toks = torch.stack([torch.stack([torch.tensor(rng.sample(range(vocab), k)) for _ in range(H)]) for _ in range(b)])
    logq = torch.log_softmax(torch.randn(b, H, k, generator=torch.Generator().manual_seed(rng.randrange(999))), -1)
    logq, order = logq.sort(-1, descending=True)
    return toks, logq


def test_trees_are_prefix_closed_within_budget_with_distinct_siblings():
    rng = random.Random(0)
    for budget in (1, 2, 3, 5, 8, 13, 40):
        toks, logq = random_candidates(rng, 6, 3, 4)
        tree = build_trees(torch.arange(6), toks, logq, budget)
        assert tree.shape[1] == min(budget, 1 + 4 + 16 + 64)
        for r in range(6):
            n = int(tree.num_nodes[r])
            parents = tree.parents[r, :n].tolist()
            assert parents[0] == ROOT and all(0 <= p < i for i, p in enumerate(parents) if i > 0)
            for i in range(1, n):
                d = int(tree.depth[r, i])
                assert d == int(tree.depth[r, parents[i]]) + 1 and 1 <= d <= 3
                assert int(tree.tokens[r, i]) in toks[r, d - 1].tolist()  # a head-d candidate
            sibling_tokens = {}
            for i in range(1, n):
                key = parents[i]
                assert int(tree.tokens[r, i]) not in sibling_tokens.setdefault(key, set())
                sibling_tokens[key].add(int(tree.tokens[r, i]))


def test_trunk_first_then_greedy_by_cumulative_probability():
    toks = torch.tensor([[[10, 11, 12], [20, 21, 22], [30, 31, 32]]])
    logq = torch.log(torch.tensor([[[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.9, 0.05, 0.05]]]))
    tree = build_trees(torch.tensor([5]), toks, logq, 8)
    assert tree.tokens[0].tolist() == [5, 10, 20, 30, 11, 21, 30, 20]
    assert tree.parents[0].tolist() == [ROOT, 0, 1, 2, 0, 1, 5, 4]


def greedy_reference(root, toks, logq, budget):
    """One row grown node by node from the definition: the trunk of top-1s, then repeatedly the free
    slot (the next unused candidate under a node above depth H) with the best cumulative log q."""
    H, k = len(toks), len(toks[0])
    tokens, parents, depths, cum, used = [root], [ROOT], [0], [0.0], [0]

    def add(u, rank):
        d = depths[u]
        tokens.append(toks[d][rank])
        parents.append(u)
        depths.append(d + 1)
        cum.append(cum[u] + logq[d][rank])
        used[u] += 1
        used.append(0)
        return len(tokens) - 1

    u = 0
    while len(tokens) < budget and depths[u] < H:
        u = add(u, 0)
    while len(tokens) < budget:
        slots = [(cum[u] + logq[depths[u]][used[u]], u) for u in range(len(tokens)) if depths[u] < H and used[u] < k]
        if not slots:
            break
        _, u = max(slots)
        add(u, used[u])
    return tokens, parents, depths


def test_batched_trees_equal_node_by_node_greedy_growth():
    rng = random.Random(1)
    for b, H, k in ((5, 3, 4), (3, 2, 6), (4, 4, 3), (2, 1, 5)):
        for budget in (1, 2, 4, 7, 16, 33):
            toks, logq = random_candidates(rng, b, H, k, vocab=99)
            tree = build_trees(torch.arange(b), toks, logq, budget)
            for r in range(b):
                want = greedy_reference(r, toks[r].tolist(), logq[r].tolist(), budget)
                n = int(tree.num_nodes[r])
                assert n == len(want[0])
                assert tree.tokens[r, :n].tolist() == want[0]
                assert tree.parents[r, :n].tolist() == want[1]
                assert tree.depth[r, :n].tolist() == want[2]


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
