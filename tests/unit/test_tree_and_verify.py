"""Tree builder, node budget and the acceptance walk, as pure functions."""

import json
import math
import random

import pytest
import torch

from specroll_mcore.tree import (PAD, ROOT, DraftLevel, LatencyCurve, LatencySurface, TreeBatch,
                                 capacity_from_latency, expansion, expected_tokens, node_beliefs, node_budget,
                                 row_chunks, select_tree, tree_size)
from specroll_mcore.tree.budget import DepthCalibration, StepCost, StepOverhead, tree_row_seconds
from specroll_mcore.verify import accept, node_rows


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
    assert capacity_from_latency([1, 2, 4, 8, 16, 32], [1.0, 1.0, 1.1, 1.3, 1.6, 2.5], tolerance=1.5) == 8
    assert capacity_from_latency([1, 2, 4, 8, 16, 32], [1.0, 1.0, 1.1, 1.3, 1.6, 2.5]) == 16  # within 2x


def test_latency_curve_interpolates_and_checks_its_points():
    curve = LatencyCurve((1, 4, 8), (1.0, 1.6, 2.0))
    assert curve(1) == 1.0 and curve(8) == 2.0
    assert curve(2) == pytest.approx(1.2) and curve(6) == pytest.approx(1.8)
    assert curve(16) == pytest.approx(2.8)  # past the last point: the last segment's slope (0.1 per token)
    with pytest.raises(ValueError, match="at least two"):
        LatencyCurve((1,), (1.0,))
    with pytest.raises(ValueError, match="increasing"):
        LatencyCurve((1, 8, 4), (1.0, 2.0, 3.0))
    with pytest.raises(ValueError, match="seconds must be > 0"):
        LatencyCurve((1, 2), (1.0, 0.0))
    with pytest.raises(ValueError, match="measured 1 token count.*rerun tools/profile_capacity.py with at least two"):
        LatencyCurve.from_profile({"curve": {"tokens": [1], "tree_row_s": [0.01]}})
    # the one-token forward is timed in both shapes (the same forward): the smaller timing counts, so
    # that one slow timing of it does not double C_hw
    profile = {"tokens": [1, 2, 4, 8, 16, 32], "tree_row_s": [27.0, 23.0, 25.0, 28.0, 34.0, 48.0],
               "decode_rows_s": [23.0, 24.0, 27.0, 29.0, 48.0, 60.0]}
    assert LatencyCurve.from_profile({"curve": profile}).seconds == (23.0, 23.0, 25.0, 28.0, 34.0, 48.0)
    assert capacity_from_latency(profile["tokens"], profile["tree_row_s"]) == 32
    assert capacity_from_latency(profile["tokens"], tree_row_seconds(profile)) == 16
    assert tree_row_seconds({"tokens": [2, 4], "tree_row_s": [3.0, 4.0], "decode_rows_s": [1.0, 2.0]}) == [3.0, 4.0]


def test_tree_size_keeps_the_nodes_that_pay_for_their_latency():
    expected = [2.0, 2.9, 3.3, 3.5]  # two rows: tokens expected with 1..4 nodes per row
    flat = LatencyCurve((1, 64), (1.0, 1.0))
    steep = LatencyCurve((1, 2, 64), (1.0, 2.0, 64.0))  # every extra token costs a whole forward
    assert tree_size(expected, 2, flat) == 4  # free nodes: the whole budget
    assert tree_size(expected, 2, steep) == 1  # (2.9 tokens in 4 s < 2 tokens in 2 s)
    mid = LatencyCurve((1, 2, 4, 8), (1.0, 1.0, 1.2, 2.0))  # rows * N tokens: 2, 4, 6, 8
    # rates: 2.0 / 1.0, 2.9 / 1.2, 3.3 / 1.6, 3.5 / 2.0 -> two nodes per row
    assert tree_size(expected, 2, mid) == 2
    assert tree_size([2.0, 2.0, 2.0], 2, flat) == 1  # nothing to gain: the smallest


def linear_surface(rows=(1, 2, 4, 8), nodes=(1, 2, 4, 8), contexts=(100, 300), budget=8):
    """A grid of seconds = 1 + 0.1 * rows + 0.05 * rows * nodes * (1 + context / 100), measured where
    rows * nodes <= budget or nodes <= 2 (as profile.forward_grid)."""
    def f(r, n, c):
        return 1 + 0.1 * r + 0.05 * r * n * (1 + c / 100)
    return LatencySurface(rows, nodes, contexts, tuple(tuple(tuple(f(r, n, c) if n <= 2 or r * n <= budget else None
                                                                   for n in nodes) for r in rows) for c in contexts)), f


def test_latency_surface_interpolates_over_rows_nodes_and_context():
    surface, f = linear_surface()
    assert surface.step(4, 2, 300) == pytest.approx(f(4, 2, 300))  # a measured point
    assert surface.step(3, 2, 200) == pytest.approx(f(3, 2, 200))  # between points (f is linear in each)
    assert surface.step(2, 3, 100) == pytest.approx(f(2, 3, 100))
    assert surface.step(8, 4, 300) == pytest.approx(f(8, 4, 300))  # an unmeasured shape: along its row's slope
    assert surface.step(16, 2, 500) == pytest.approx(f(16, 2, 500))  # past the grid: along the last segments
    assert surface.step(2, 2) == surface.step(2, 2, 100)  # no context: the grid's first
    assert surface.step(1, 1, 0) == surface.fastest == f(1, 1, 100)  # never below the fastest measured forward
    flat = LatencySurface((1, 2), (1, 2), (8,), (((1.0, 1.0), (1.0, 1.0)),))
    assert flat.step(64, 64, 4096) == 1.0
    assert LatencyCurve((1, 4, 8), (1.0, 1.6, 2.0)).step(2, 3, 4096) == pytest.approx(1.8)  # (rows x nodes tokens)
    assert LatencySurface.from_profile({"curve": {"tokens": [1, 2], "tree_row_s": [1.0, 2.0]}}) is None
    record = {"curve": {"grid": {"rows": [1, 2], "nodes": [1, 2], "contexts": [8],
                                 "seconds": [[[1.0, 1.5], [1.2, 2.0]]]}}}
    assert LatencySurface.from_profile(record).step(2, 2, 8) == 2.0
    with pytest.raises(ValueError, match="rows must be >= 1 and increasing"):
        LatencySurface((2, 1), (1, 2), (8,), (((1.0, 1.0), (1.0, 1.0)),))
    with pytest.raises(ValueError, match=r"seconds must be \[contexts\]\[rows\]\[nodes\] = \[1, 2, 2\]"):
        LatencySurface((1, 2), (1, 2), (8,), (((1.0, 1.0),),))
    with pytest.raises(ValueError, match="at least two measured node counts.*2 rows has"):
        LatencySurface((1, 2), (1, 2), (8,), (((1.0, 1.0), (1.0, None)),))
    with pytest.raises(ValueError, match="seconds > 0"):
        LatencySurface((1, 2), (1, 2), (8,), (((1.0, 0.0), (1.0, 1.0)),))


def test_tree_size_weighs_the_forwards_rows_and_context():
    """Trees of one row may pay where the same tokens spread over many rows on long contexts do not:
    the surface prices the shape, a one-row curve only the token count."""
    surface = LatencySurface((1, 16), (1, 2), (300,), (((1.0, 1.01), (2.0, 2.8)),))  # 16 rows x 2 nodes: 1.4x
    curve = LatencyCurve((1, 32), (1.0, 1.31))  # one row's tree of 16 x 2 tokens: 1.31 / 1.15 = 1.14x 16 tokens
    expected = [16.0, 16 * 1.3]  # 16 rows: 0.3 more tokens a row with 2 nodes
    assert tree_size(expected, 16, surface, 300) == 1  # 1.3x the tokens for 1.4x the time
    assert tree_size(expected, 16, curve, 300) == 2  # what the token count alone says
    assert tree_size([1.0, 1.3], 1, surface, 300) == 2  # one row: they pay


def test_depth_calibration_follows_the_observed_ratio():
    cal = DepthCalibration(2, decay=0.9, prior=4.0)
    assert cal.factors() == [1.0, 1.0]
    for _ in range(200):  # depth 1: half of what the drafts believe is accepted; depth 2: all of it
        cal.update([2.0, 1.0], [1.0, 1.0])
    assert cal.factors() == pytest.approx([0.5, 1.0], abs=1e-6)
    assert DepthCalibration(1, prior=0.0).factors() == [1.0]  # nothing seen: trust the drafts


def test_tree_prefixes_are_trees_and_expected_tokens_sum_path_beliefs():
    b, k = 3, 3
    g = torch.Generator().manual_seed(0)
    lq = torch.log_softmax(torch.randn(b, 1, k, generator=g), -1).sort(-1, descending=True).values
    lv1 = DraftLevel(torch.full((b, 1), ROOT), torch.randint(5, 50, (b, 1, k), generator=g), lq)
    sel = expansion(lv1, 2)
    lq2 = torch.log_softmax(torch.randn(b, 2, k, generator=g), -1).sort(-1, descending=True).values
    lv2 = DraftLevel(sel, torch.randint(5, 50, (b, 2, k), generator=g),
                     lv1.score.reshape(b, -1).gather(1, sel)[..., None] + lq2)
    tree, pool = select_tree(torch.tensor([1, 2, 3]), [lv1, lv2], 7)
    flat = torch.cat([lv1.score.reshape(b, -1), lv2.score.reshape(b, -1)], 1)
    want = [b + sum(float(flat[r, pool[r, j]].exp()) for r in range(b) for j in range(1, n)) for n in range(1, 8)]
    assert expected_tokens(node_beliefs([lv1, lv2], pool)).tolist() == pytest.approx(want)
    for n in range(1, 8):
        part = tree.prefix(n)
        assert part.shape == (b, n) and part.num_nodes.tolist() == [n] * b
        parents = part.parents[:, 1:]
        assert bool(((parents >= 0) & (parents < torch.arange(1, n))).all())  # every parent is kept, and first


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


def test_accepting_every_node_at_once_equals_the_walk_depth_by_depth():
    """verify.accept's two forms on random trees (select_tree's, with padding) and a sampler whose
    noise is keyed by (row, position), the policy's logits leaning towards some drafted child: the
    same tokens, log-probs, paths, counts, last nodes and counts per depth, for logits laid out
    [b, n, V] or as a forward's [n, b, V] viewed as [b, n, V]."""
    vocab = 50

    def sample_fn(lg, rows, pos):
        noise = torch.stack([torch.rand(vocab, generator=torch.Generator().manual_seed(int(r) * 997 + int(p)))
                             for r, p in zip(rows, pos)]) if len(rows) else torch.zeros(0, vocab)
        x = lg - torch.log(-torch.log(noise.clamp(min=1e-9)))
        tok = x.argmax(-1)
        return tok, torch.log_softmax(lg, -1).gather(-1, tok[:, None])[:, 0]

    rng = random.Random(3)
    seen_depth = 0
    for trial in range(40):
        b, H, k, budget = rng.choice((1, 2, 5)), rng.choice((1, 2, 3)), rng.choice((2, 3)), rng.choice((1, 2, 4, 9))
        roots = [rng.randrange(1000) for _ in range(b)]
        tree, _ = select_tree(torch.tensor(roots), draft(roots, H, k, budget), budget)
        n = tree.shape[1]
        logits = torch.randn(n, b, vocab, generator=torch.Generator().manual_seed(trial)).transpose(0, 1)
        for r in range(b):
            for i in range(1, int(tree.num_nodes[r])):
                if rng.random() < 0.7:  # the policy at the parent leans towards this child
                    logits[r, int(tree.parents[r, i]), int(tree.tokens[r, i])] += 6.0
        position = torch.tensor([rng.randrange(40) for _ in range(b)])
        for layout in (logits, logits.contiguous()):
            walked, at_once = (accept(tree, layout, sample_fn, position, H, at_once=a) for a in (False, True))
            for field in ("tokens", "logprobs", "path", "counts", "last_node", "tried", "accepted"):
                assert torch.equal(getattr(walked, field), getattr(at_once, field)), (trial, field)
        seen_depth = max(seen_depth, int(walked.counts.max()))
    assert seen_depth == 4  # some rows accepted a whole 3-deep path


def test_node_rows_equal_advanced_indexing():
    """Logits at tree nodes, read by index_select over merged (row, node) dimensions where they merge
    (a view of the vocabulary slice of padded logits included), else by advanced indexing."""
    g = torch.Generator().manual_seed(0)
    padded = torch.randn(3, 4, 10, generator=g)
    rows, nodes = torch.tensor([2, 0, 2, 1]), torch.tensor([3, 0, 1, 3])
    for x in (padded, padded[..., :7], padded.transpose(0, 1), padded[:1], padded[:, :1]):
        r, n = rows.clamp(max=x.shape[0] - 1), nodes.clamp(max=x.shape[1] - 1)
        assert torch.equal(node_rows(x, r, n), x[r, n])
    assert node_rows(padded, rows[:0], nodes[:0]).shape == (0, 10)


def test_latency_surface_reads_every_shape_as_its_whole_grid_does():
    """step() reads only the two points of each segment it interpolates; the value is that of
    interpolating over every measured point (bit for bit), on random grids with unmeasured shapes."""
    from specroll_mcore.tree.budget import _along

    def over_all_points(s, rows, nodes, context):
        per_context = [_along(s.rows, [_along(xs, ys, nodes) for xs, ys in c], rows) for c in s._measured]
        return max(per_context[0] if context is None else _along(s.contexts, per_context, context), s.fastest)

    rng = random.Random(0)
    for _ in range(50):
        rows, nodes = (1, 2, 4, 8, 16)[:rng.randint(1, 5)], (1, 2, 4, 8)[:rng.randint(2, 4)]
        contexts = (128, 512, 1024)[:rng.randint(1, 3)]
        seconds = tuple(tuple(tuple(rng.uniform(0.01, 0.2) if n < 2 or rng.random() < 0.7 else None
                                    for n in range(len(nodes))) for _ in rows) for _ in contexts)
        s = LatencySurface(rows, nodes, contexts, seconds)
        for r in (1, 3, 16, 40):
            for n in (1, 3, 20):
                for c in (None, 50, 300, 2000):
                    assert s.step(r, n, c) == over_all_points(s, r, n, c)


def test_step_cost_prices_the_work_around_a_drafted_steps_forward():
    """A step's cost is its forward's plus its work around it, which a drafted step pays in full: at
    16 rows, drafts worth 0.4 tokens a row pay for their forward but not for the drafting around it
    (plain decoding); at one row, a fixed cost per drafted step makes deeper trees pay. Once the
    drafts are proposed, proposing them is no longer part of the cost."""
    from specroll_mcore.tree import tree_size

    overhead = StepOverhead((1, 16), plain=(0.001, 0.005), drafted=(0.010, 0.018), drafting=(0.006, 0.004))
    assert overhead(1, False) == 0.001 and overhead(16, True) == 0.018
    assert overhead(8, True) == pytest.approx(0.010 + 0.008 * 7 / 15)  # linear in rows between the counts
    assert overhead(32, False) == pytest.approx(0.005 + 0.004 * 16 / 15)  # past them along the last segment
    assert StepOverhead((4,), (0.002,), (0.006,), (0.003,))(64, True) == 0.006  # one row count: constant
    assert StepOverhead((1, 2), (0.004, 0.001), (0.01, 0.01), (0.0, 0.0))(9, False) == 0.0  # never below 0
    proposed = overhead.proposed()
    assert proposed.drafted == pytest.approx((0.004, 0.014)) and proposed.drafting == (0.0, 0.0)
    assert proposed.plain == overhead.plain
    forward = LatencyCurve((1, 16, 32, 64), (0.040, 0.046, 0.058, 0.1))
    cost = StepCost(forward, overhead)
    assert cost.step(16, 1) == forward.step(16, 1) + 0.005 and cost.step(16, 2) == forward.step(16, 2) + 0.018
    assert tree_size([16, 16 * 1.4], 16, forward) == 2 and tree_size([16, 16 * 1.4], 16, cost) == 1
    assert cost.proposed().step(16, 2) == pytest.approx(forward.step(16, 2) + 0.014)
    one_row = LatencyCurve((1, 2, 3, 4), (0.030, 0.034, 0.038, 0.042))
    expected = [1.0, 1.6, 1.75, 1.95]
    assert tree_size(expected, 1, one_row) == 2 and tree_size(expected, 1, StepCost(one_row, overhead)) == 4


@pytest.mark.parametrize("rows, plain, drafted, message", [
    ((), (), (), "a plain, a drafted and a drafting time per row count, for at least one row count"),
    ((1, 2), (0.1,), (0.1, 0.2), "a plain, a drafted and a drafting time per row count"),
    ((2, 1), (0.1, 0.1), (0.1, 0.2), r"rows must be >= 1 and increasing, got \[2, 1\]"),
    ((0, 1), (0.1, 0.1), (0.1, 0.2), "rows must be >= 1"),
    ((1, 2), (0.1, -0.1), (0.1, 0.2), "seconds must be >= 0"),
    ((1, 2), (0.1, 0.1), (0.1, float("nan")), "seconds must be >= 0")])
def test_a_malformed_step_overhead_is_named(rows, plain, drafted, message):
    from specroll_mcore.tree import StepOverhead

    with pytest.raises(ValueError, match=message):
        StepOverhead(rows, plain, drafted, tuple(d / 2 for d in drafted))


def test_step_overhead_is_measured_once_per_engine_settings_and_cached(ctx, tmp_path, monkeypatch):
    """The engine's work around a step's forward, measured on engines of its own at 1, 2 .. C_hw // 2
    rows (plain steps: trees of one node; drafted: the whole budget), cached beside the capacity
    profile under the engine settings it depends on; the policy's own engines are not touched."""
    import dataclasses

    from test_speculative import policy_with_heads

    from specroll_mcore.config import SpecConfig, tiny_llama
    from specroll_mcore.rollout import profile
    from specroll_mcore.tree import StepCost

    monkeypatch.setenv("SPECROLL_CACHE", str(tmp_path))
    model = policy_with_heads(tiny_llama(), ctx)
    spec = SpecConfig(c_hw=8)
    forward = LatencyCurve((1, 8), (0.01, 0.02))
    measured = []
    real = profile.measure_step_overhead
    monkeypatch.setattr(profile, "measure_step_overhead",
                        lambda policy, spec: measured.append(spec) or real(policy, spec))
    cost = profile.with_step_overhead(model, spec, forward)
    assert isinstance(cost, StepCost) and cost.forward == forward and len(measured) == 1
    assert cost.overhead.rows == (1, 2, 4) == tuple(profile.overhead_rows(8))
    assert all(d > p > 0 and d > a > 0 for d, p, a in zip(cost.overhead.drafted, cost.overhead.plain,
                                                          cost.overhead.drafting))
    (record,) = json.loads((tmp_path / "capacity_profiles.json").read_text()).values()
    assert record["kind"] == "step_overhead" and record["rows"] == [1, 2, 4] and record["c_hw"] == 8
    assert profile.with_step_overhead(model, spec, forward) == cost and len(measured) == 1  # cached
    for other in (dataclasses.replace(spec, topk=2), dataclasses.replace(spec, c_hw=16),
                  dataclasses.replace(spec, reflex=dataclasses.replace(spec.reflex, enabled=False))):
        assert profile.overhead_key(model, other) != profile.overhead_key(model, spec)
    assert profile.overhead_key(model, dataclasses.replace(spec, probe_every=2)) == profile.overhead_key(
        model, spec)  # (speed-only settings that leave a step's work alone share it)
    # nothing to price: no latency profile, nothing weighed, or switched off
    for s, latency in ((spec, None), (dataclasses.replace(spec, adaptive_nodes=False), forward),
                       (dataclasses.replace(spec, step_overhead=False), forward)):
        assert profile.with_step_overhead(model, s, latency) is latency
    assert len(measured) == 1
    assert profile.overhead_rows(1) == [1, 2] and profile.overhead_rows(32) == [1, 2, 4, 8, 16]
    assert profile.overhead_rows(4096) == [1, 2, 4, 8, 16, 32, 64]  # (at most 64 rows)


def test_capacity_is_profiled_once_and_cached(ctx, tmp_path, monkeypatch):
    from conftest import make_policy
    from specroll_mcore.config import tiny_llama
    from specroll_mcore.rollout import profile

    monkeypatch.setenv("SPECROLL_CACHE", str(tmp_path))
    # a tiny model's curve may stay flat past 128 tokens: the profile then goes on one size at a time, and its
    # grid covers shapes up to the C_hw found. One more size at most here, which keeps this test's time
    # bounded whatever the machine's timings (going on to 2048: test_quick_profile_goes_on_while_the_curve_is_flat)
    monkeypatch.setattr(profile, "QUICK_MORE_SIZES", profile.QUICK_MORE_SIZES[:1])
    model = make_policy(tiny_llama(), ctx)
    assert profile.ensure_capacity(model, 24) == (24, None)  # configured wins, nothing measured
    assert not (tmp_path / "capacity_profiles.json").exists()
    cap = profile.ensure_capacity(model, None)
    assert (tmp_path / "capacity_profiles.json").is_file()
    record = json.loads((tmp_path / "capacity_profiles.json").read_text())
    (record,) = record.values()
    tokens = record["curve"]["tokens"]
    assert tokens[:8] == list(profile.QUICK_SIZES) and len(record["curve"]["tree_row_s"]) == len(tokens)
    assert cap.c_hw in tokens and set(tokens[8:]) <= set(profile.QUICK_MORE_SIZES)
    rows, nodes = profile.grid_axes(cap.c_hw)
    assert isinstance(cap.latency, LatencySurface)  # the engine sizes trees against the grid
    assert (cap.latency.rows, cap.latency.nodes, cap.latency.contexts) == (tuple(rows), tuple(nodes),
                                                                          profile.GRID_CONTEXTS)
    for c in record["curve"]["grid"]["seconds"]:  # shapes of up to C_hw tokens, and 1 and 2 nodes for every row
        assert [[s is not None for s in row] for row in c] == [[n <= 2 or r * n <= cap.c_hw for n in nodes]
                                                               for r in rows]
    monkeypatch.setattr(profile, "forward_latency",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("re-measured")))
    assert profile.ensure_capacity(model, None) == cap  # cached
    assert profile.ensure_capacity(model, 24) == (24, cap.latency)  # configured C_hw, the cached curve
    # C_hw comes from the cached curve by the rule in force (by the measured seconds at 0.5x; at 0x no
    # size is within it, whatever the timings: the least)
    seconds = tree_row_seconds(record["curve"])
    assert profile.ensure_capacity(model, None, tolerance=0.5).c_hw == capacity_from_latency(tokens, seconds,
                                                                                                   0.5)
    assert profile.ensure_capacity(model, None, tolerance=0.0).c_hw == 1


@pytest.mark.parametrize("knee, c_hw, measured", [(None, 2048, 12), (700, 512, 11), (100, 64, 8)])
def test_quick_profile_goes_on_while_the_curve_is_flat(ctx, tmp_path, monkeypatch, knee, c_hw, measured):
    """A GPU's forward costs the same up to ~1024 tokens: the quick profile measures 256 .. 2048 one at
    a time while C_hw is still its largest size, and stops at the first size past the rule (a C_hw of
    128 would leave a step of 128+ rows no node to draft with)."""
    from conftest import make_policy
    from specroll_mcore.config import tiny_llama
    from specroll_mcore.rollout import profile

    monkeypatch.setenv("SPECROLL_CACHE", str(tmp_path))
    calls = []

    def flat_until_knee(policy, sizes, reps, **kw):  # 10 ms, 25 ms from `knee` tokens on
        calls.append(list(sizes))
        times = [0.025 if knee is not None and n >= knee else 0.010 for n in sizes]
        return {"tokens": list(sizes), "context": 128, "tree_row_s": times, "decode_rows_s": list(times)}

    monkeypatch.setattr(profile, "forward_latency", flat_until_knee)
    monkeypatch.setattr(profile, "forward_grid", lambda policy, c_hw, reps, **kw: {
        "rows": [1], "nodes": [1, 2], "contexts": [128], "seconds": [[[0.01, 0.01]]]})
    cap = profile.ensure_capacity(make_policy(tiny_llama(), ctx), None)
    assert cap.c_hw == c_hw
    assert calls[0] == list(profile.QUICK_SIZES) and all(len(c) == 1 for c in calls[1:])
    (record,) = json.loads((tmp_path / "capacity_profiles.json").read_text()).values()
    assert record["c_hw"] == c_hw and len(record["curve"]["tokens"]) == len(record["curve"]["tree_row_s"]) == measured
    assert record["curve"]["tokens"] == sorted(record["curve"]["tokens"])


def test_latency_profile_leaves_out_each_shapes_first_forward(monkeypatch):
    """A shape's first forward in a process is slower (allocations, kernel setup); timed, it would
    inflate the one-token latency that C_hw is measured against (a 2x C_hw on a 2-core machine)."""
    import contextlib
    import time
    from types import SimpleNamespace

    from specroll_mcore.rollout import profile

    def fake(policy, n, context):
        calls = []

        def run():
            calls.append(n)
            time.sleep(0.05 if len(calls) == 1 else 0.001)
        return run

    monkeypatch.setattr(profile, "tree_forward", fake)
    monkeypatch.setattr(profile, "decode_forward", fake)
    cpu_policy = SimpleNamespace(ctx=SimpleNamespace(device=torch.device("cpu")),
                                 expert_lockstep=contextlib.nullcontext)
    res = profile.forward_latency(cpu_policy, [1, 4], reps=1)
    assert max(res["tree_row_s"] + res["decode_rows_s"]) < 0.04, res


def test_latency_grid_times_every_shape_after_an_untimed_first_forward(monkeypatch):
    """The grid runs each shape once untimed (as the one-row curve) and measures what the engine
    weighs: rows x nodes up to C_hw tokens, and one and two nodes for every row count."""
    import contextlib
    import time
    from types import SimpleNamespace

    from specroll_mcore.rollout import profile

    shapes = []

    def fake_step(policy, cache, rows, n):
        calls = []

        def run():
            calls.append(1)
            shapes.append((cache, rows, n))
            time.sleep(0.05 if len(calls) == 1 else 0.001 * n)
        return run

    monkeypatch.setattr(profile, "_committed_cache", lambda policy, rows, context, capacity: (rows, context, capacity))
    monkeypatch.setattr(profile, "_step", fake_step)
    cpu_policy = SimpleNamespace(ctx=SimpleNamespace(device=torch.device("cpu")),
                                 expert_lockstep=contextlib.nullcontext)
    grid = profile.forward_grid(cpu_policy, 4, reps=2, contexts=(8, 32))
    assert (grid["rows"], grid["nodes"], grid["contexts"]) == ([1, 2, 4], [1, 2, 4], [8, 32])
    for c in grid["seconds"]:
        assert [[s is not None for s in row] for row in c] == [[True] * 3, [True, True, False], [True, True, False]]
        assert max(s for row in c for s in row if s is not None) < 0.04  # the first forwards left out
        assert c[0][2] > c[0][0]  # (the fake's 1 ms per node)
    assert {(cache, r, n) for cache, r, n in shapes} == {((r, c, c + (4 if r == 1 else 2)), r, n)
                                                         for c in (8, 32) for r, n in
                                                         [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1), (4, 2)]}
    assert len(shapes) == 2 * 7 * 3  # each shape: one untimed forward and the reps
    assert profile.grid_axes(1) == ([1], [1, 2]) and profile.grid_axes(24) == ([1, 2, 4, 8, 16], [1, 2, 4, 8, 16])


def test_a_profile_from_before_grids_sizes_trees_by_its_one_row_curve(ctx, tmp_path, monkeypatch):
    from conftest import make_policy
    from specroll_mcore.config import tiny_llama
    from specroll_mcore.rollout import profile
    from specroll_mcore.tree import budget

    monkeypatch.setenv("SPECROLL_CACHE", str(tmp_path))
    model = make_policy(tiny_llama(), ctx)
    budget.save_capacity(profile.capacity_key(model),
                         {"c_hw": 4, "curve": {"tokens": [1, 4, 8], "tree_row_s": [1.0, 1.5, 3.0]}})
    monkeypatch.setattr(profile, "forward_grid", lambda *a, **k: (_ for _ in ()).throw(AssertionError("re-measured")))
    cap = profile.ensure_capacity(model, None)
    assert cap == (4, LatencyCurve((1, 4, 8), (1.0, 1.5, 3.0)))  # (tools/profile_capacity.py measures a grid)


@pytest.mark.parametrize("text", ['{"key": {"c_hw": 4', '["a list"]'])
def test_a_capacity_profile_cache_that_is_not_a_json_object_is_named(tmp_path, text):
    from specroll_mcore.tree import budget

    budget.profile_path(tmp_path).write_text(text)  # (edited by hand, say)
    for call in (lambda: budget.load_profile("key", tmp_path), lambda: budget.save_capacity("key", {}, tmp_path)):
        with pytest.raises(ValueError, match=r"capacity profile cache .*capacity_profiles.json is not a JSON object "
                                             r".*: delete it, and the profiles are measured again"):
            call()
    assert budget.profile_path(tmp_path).read_text() == text  # not overwritten


@pytest.mark.parametrize("fault", ["not_a_directory", "disk_full"])
def test_a_profile_that_cannot_be_cached_is_used_and_named(ctx, tmp_path, monkeypatch, fault):
    """A read-only or full cache: a warning that names the path and SPECROLL_CACHE, and the run goes
    on with the profile it measured (measured again next time), not a crash after the measurement."""
    from conftest import make_policy
    from specroll_mcore.checkpoint import megatron
    from specroll_mcore.config import SpecConfig, tiny_llama
    from specroll_mcore.rollout import profile
    from specroll_mcore.tree import budget

    if fault == "not_a_directory":
        (tmp_path / "file").write_text("")
        cache = tmp_path / "file" / "cache"  # (its parent is a file: the directory cannot be made)
    else:
        cache = tmp_path / "cache"
        monkeypatch.setattr(megatron.os, "replace", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")))
    monkeypatch.setenv("SPECROLL_CACHE", str(cache))
    warned = r"could not cache a profile in .*capacity_profiles.json .*: this run uses it as measured.* set " \
             r"SPECROLL_CACHE to a writable directory"
    with pytest.warns(UserWarning, match=warned):
        assert budget.save_capacity("key", {"c_hw": 4}) is None
    # (the step overhead, measured on first use and cached: the run goes on with it)
    model = make_policy(tiny_llama(), ctx)
    record = {"rows": [1, 2], "plain_s": [0.001] * 2, "drafted_s": [0.004] * 2, "drafting_s": [0.002] * 2}
    monkeypatch.setattr(profile, "measure_step_overhead", lambda *a, **k: record)
    curve = LatencyCurve((1, 4, 8), (1.0, 1.5, 3.0))
    with pytest.warns(UserWarning, match=warned):
        latency = profile.with_step_overhead(model, SpecConfig(num_heads=2, c_hw=8), curve)
    assert latency == StepCost(curve, StepOverhead.from_record(record))
    assert budget.load_profile("key") is None
    assert not (cache.is_dir() and any(cache.iterdir()))  # (no temporary file left behind)


def profiled(monkeypatch, noted) -> list:
    """Capacity profiles measured by a fake of the forward's timing (a 1 s forward growing by 1/16 s a
    token, one grid point): returns the list that ``noted(policy)`` of each policy profiled goes to."""
    from specroll_mcore.rollout import profile

    measured = []

    def fake_latency(policy, sizes, reps, **kw):
        measured.append(noted(policy))
        return {"tokens": list(sizes), "context": 8, "tree_row_s": [1.0 + n / 16 for n in sizes],
                "decode_rows_s": [1.0 + n / 16 for n in sizes]}

    monkeypatch.setattr(profile, "forward_latency", fake_latency)
    monkeypatch.setattr(profile, "forward_grid", lambda policy, c_hw, reps, **kw: {
        "rows": [1], "nodes": [1, 2], "contexts": [8], "seconds": [[[1.0, 1.1]]]})
    return measured


def test_capacity_profile_is_keyed_by_dtype(ctx, tmp_path, monkeypatch):
    """The same weights loaded in another dtype (TrainConfig / `specroll generate` params_dtype) have
    another latency curve: a float32 profile is not taken for a bfloat16 policy."""
    from conftest import make_policy
    from specroll_mcore.config import tiny_llama
    from specroll_mcore.rollout import profile

    monkeypatch.setenv("SPECROLL_CACHE", str(tmp_path))
    measured = profiled(monkeypatch, lambda policy: policy.dtype)
    fp32 = profile.ensure_capacity(make_policy(tiny_llama(), ctx), None)
    bf16 = profile.ensure_capacity(make_policy(tiny_llama(params_dtype="bfloat16"), ctx), None)
    assert measured == [torch.float32, torch.bfloat16]  # the bfloat16 policy was profiled, not given float32's
    assert profile.ensure_capacity(make_policy(tiny_llama(params_dtype="bfloat16"), ctx), None) == bf16
    assert len(measured) == 2 and fp32.c_hw == bf16.c_hw
    records = json.loads((tmp_path / "capacity_profiles.json").read_text()).values()
    assert sorted(r["dtype"] for r in records) == ["bfloat16", "float32"]


def test_capacity_profile_is_keyed_by_architecture_not_weights(ctx, tmp_path, monkeypatch):
    """A policy trained from another (other weights, the same shapes) finds the profile measured for
    it, as does one differing only in values its kernels compute with (RoPE base, norm epsilon);
    another shape is profiled anew, and so is another pipeline split of the same layers."""
    from conftest import make_policy
    from specroll_mcore.config import tiny_llama
    from specroll_mcore.rollout import profile
    from specroll_mcore.tree import budget

    monkeypatch.setenv("SPECROLL_CACHE", str(tmp_path))
    measured = profiled(monkeypatch, lambda policy: policy.config)
    base = profile.ensure_capacity(make_policy(tiny_llama(), ctx, seed=0), None)
    for same_shapes in (make_policy(tiny_llama(), ctx, seed=1),
                        make_policy(tiny_llama(rope_theta=5e5, norm_eps=1e-6, max_position_embeddings=512,
                                               rope_scaling={"rope_type": "linear", "factor": 2.0}), ctx)):
        assert profile.ensure_capacity(same_shapes, None) == base
    assert len(measured) == 1
    (record,) = json.loads((tmp_path / "capacity_profiles.json").read_text()).values()
    assert record["architecture"] == profile.architecture(same_shapes) and record["stage_layers"] == [4]
    for other in (tiny_llama(hidden_size=128), tiny_llama(num_layers=2), tiny_llama(vocab_size=600),
                  tiny_llama(num_query_groups=4), tiny_llama(num_experts=4)):
        profile.ensure_capacity(make_policy(other, ctx), None)
        assert measured[-1] == other
    assert len(measured) == 6
    key = budget.profile_key("arch", "float32", "cpu", 1, 2, 1, [2, 2])
    assert key != budget.profile_key("arch", "float32", "cpu", 1, 2, 1, [1, 3])  # the slowest stage differs
    assert key != budget.profile_key("arch", "float32", "cpu", 1, 2, 2, [2, 2])


def test_cpu_hardware_name_tells_cpu_generations_apart():
    """Capacity profiles of a CPU with AMX (flat bfloat16 latency) and one without, or of AVX2 and
    AVX-512 machines, get different keys."""
    from specroll_mcore.tree import budget

    info = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: fpu avx512f amx_bf16 amx_tile\n" \
           "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: fpu avx512f amx_bf16 amx_tile\n"
    assert budget.parse_cpuinfo(info) == ("Intel(R) Xeon(R) Platinum 8480+", {"fpu", "avx512f", "amx_bf16", "amx_tile"})
    assert budget.parse_cpuinfo("model name : X\n") == ("X", set())
    if not torch.cuda.is_available():
        name = budget.hardware_name()
        assert name.startswith("cpu:" + budget.cpu_model()) and torch.backends.cpu.get_cpu_capability() in name


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU products")
def test_cpu_hardware_name_tells_product_kernels_apart(monkeypatch):
    """Panels, oneDNN's layout, BLAS and the step-attention kernel give different latency curves: their
    profiles get different keys."""
    from specroll_mcore import cpu_gemm
    from specroll_mcore.model import attention
    from specroll_mcore.tree import budget

    names = {budget.hardware_name()}
    monkeypatch.setenv("SPECROLL_PANEL_GEMM", "0")
    names.add(budget.hardware_name())
    assert ":panels" not in budget.hardware_name()
    monkeypatch.setenv("SPECROLL_PACKED_GEMM", "0")
    names.add(budget.hardware_name())
    monkeypatch.setenv("SPECROLL_STEP_ATTENTION", "0")  # half-precision steps on ordered attention
    assert not budget.hardware_name().endswith(":step-attention")
    names.add(budget.hardware_name())
    built = (cpu_gemm._build_panel_kernels() is not None) + (attention._build_step_attention() is not None)
    assert len(names) == 2 + built
