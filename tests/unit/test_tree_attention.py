"""Tree verification: every node's logits equal a plain causal forward over its root-to-node path;
committing a path and continuing equals decoding that path token by token."""

import random

import pytest
import torch

from conftest import make_policy
from specroll_mcore.config import tiny_llama, tiny_qwen2
from specroll_mcore.model import causal_mask
from specroll_mcore.rollout.base import prefill
from specroll_mcore.tree import PAD, ROOT, tree_ancestor_mask, tree_depths


def causal_logits(model, seq):
    ids = torch.tensor([seq])
    meta = model.metadata(torch.arange(len(seq))[None], causal_mask(1, len(seq), ids.device))
    return model.full_logits(model(ids, meta))[0]


def random_tree(rng, n):
    parents = [ROOT]
    for i in range(1, n):
        parents.append(rng.choice([ROOT] + list(range(i))))
    return parents


def path_to(parents, i):
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def test_tree_mask_and_depths():
    parents = torch.tensor([[ROOT, 0, 0, 1, PAD], [ROOT, ROOT, 1, 2, 3]])
    mask = tree_ancestor_mask(parents)
    assert mask[0, 3].tolist() == [True, True, False, True, False]
    assert mask[0, 4].tolist() == [False, False, False, False, True]  # padding sees itself
    assert mask[1, 4].tolist() == [False, True, True, True, True]
    assert tree_depths(parents).tolist() == [[0, 1, 1, 2, 0], [0, 0, 1, 2, 3]]


def test_tree_logits_equal_path_forward_and_commit(ctx):
    rng = random.Random(0)
    for cfg in (tiny_llama(), tiny_qwen2()):
        model = make_policy(cfg, ctx, seed=1)
        prompts = [[rng.randrange(cfg.vocab_size) for _ in range(L)] for L in (6, 2, 9)]
        sizes = [7, 3, 5]  # ragged: row 1 padded with 4 nodes
        n = max(sizes)
        parents = torch.full((3, n), PAD)
        tokens = torch.zeros(3, n, dtype=torch.long)
        trees = []
        for r, size in enumerate(sizes):
            tree = random_tree(rng, size)
            trees.append(tree)
            parents[r, :size] = torch.tensor(tree)
            tokens[r, :size] = torch.tensor([rng.randrange(cfg.vocab_size) for _ in range(size)])
        with torch.no_grad():
            cache = model.new_cache(num_slots=3, capacity=40)
            prefill(model, cache, prompts, 64)
            slots = torch.arange(3)
            positions = cache.lengths[:, None] + tree_depths(parents)
            meta = model.metadata(positions, tree_ancestor_mask(parents), cache, slots)
            logits = model.full_logits(model(tokens, meta))  # [3, n, V]
            for r in range(3):
                for i in range(sizes[r]):
                    seq = prompts[r] + [int(tokens[r, j]) for j in path_to(trees[r], i)]
                    ref = causal_logits(model, seq)[-1]
                    assert (logits[r, i] - ref).abs().max() < 1e-5

            # Commit the path to each row's last node, then decode one more token.
            accepted = [path_to(trees[r], sizes[r] - 1) for r in range(3)]
            m = max(len(a) for a in accepted)
            keep = torch.tensor([a + [0] * (m - len(a)) for a in accepted])
            cache.commit(slots, torch.tensor([len(a) for a in accepted]), keep)
            nxt = torch.tensor([[7], [8], [9]])
            meta = model.metadata(cache.lengths[:, None], torch.ones(3, 1, 1, dtype=torch.bool), cache, slots)
            out = model.full_logits(model(nxt, meta))[:, 0]
            for r in range(3):
                seq = prompts[r] + [int(tokens[r, j]) for j in accepted[r]] + [int(nxt[r, 0])]
                assert (out[r] - causal_logits(model, seq)[-1]).abs().max() < 1e-5


def test_ancestor_mask_and_depths_match_a_walk_up_the_parents():
    """Random forests with padding, against following parent pointers node by node."""
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 5, 9, 17):
        parents = torch.full((6, n), PAD)
        for r in range(6):
            size = int(torch.randint(1, n + 1, (1,), generator=g))
            for i in range(size):
                parents[r, i] = ROOT if i == 0 or torch.rand(1, generator=g) < 0.2 else \
                    int(torch.randint(0, i, (1,), generator=g))
        mask, depth = tree_ancestor_mask(parents), tree_depths(parents)
        for r in range(6):
            for i in range(n):
                chain, j = {i}, int(parents[r, i])
                while j >= 0:
                    chain.add(j)
                    j = int(parents[r, j])
                assert set(mask[r, i].nonzero().flatten().tolist()) == chain
                assert int(depth[r, i]) == (len(chain) - 1 if int(parents[r, i]) != PAD else 0)



def test_rope_equals_the_rotate_half_convention_bit_for_bit():
    """apply_rope on rope_tables' sign-folded sin gives x * cos + cat(-x2, x1) * sin (the Llama/Qwen2
    convention, with its own cos and sin) to the bit, in each dtype."""
    from specroll_mcore.model.attention import apply_rope, rope_inv_freq, rope_tables
    positions = torch.tensor([[0, 1, 5, 200], [7, 8, 9, 4095]])
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        x = torch.randn(4, 2, 3, 16, generator=torch.Generator().manual_seed(0)).to(dtype)  # [s, b, heads, d]
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).to(compute) / 16))
        freqs = positions.to(compute)[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), -1).transpose(0, 1)[:, :, None]
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        x1, x2 = x.chunk(2, -1)
        expected = x * cos + torch.cat((-x2, x1), -1) * sin
        table_cos, table_sin = rope_tables(positions, rope_inv_freq(16, 10000.0, None, compute, positions.device),
                                           dtype)
        assert torch.equal(table_cos, cos)
        assert torch.equal(apply_rope(x, table_cos, table_sin), expected)


def test_the_causal_form_equals_the_causal_mask_on_right_padded_rows(ctx):
    """The policy update's forward (``metadata(positions, None)``: SDPA's is_causal, no mask) gives
    the real tokens the logits and the weights the gradients of the explicit causal mask with
    padding (:func:`causal_mask` with lengths), bit for bit on a CPU; a padding token then reads its
    row, which no real token's result depends on."""
    for cfg in (tiny_llama(), tiny_qwen2()):
        model = make_policy(cfg, ctx, seed=2).train()
        lengths = torch.tensor([9, 5, 1])
        ids = torch.randint(0, cfg.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
        real = torch.arange(9)[None] < lengths[:, None]  # [b, L]
        positions = torch.arange(9)[None].expand(3, 9)
        results = []
        for mask in (causal_mask(3, 9, ids.device, lengths), None):
            model.zero_grad()
            logits = model.full_logits(model(ids, model.metadata(positions, mask)))
            (logits.float().log_softmax(-1).mean(-1) * real).sum().backward()
            results.append((logits.detach()[real], {n: p.grad.clone() for n, p in model.named_parameters()
                                                     if p.grad is not None}))
        (ref_logits, ref_grads), (logits, grads) = results
        assert torch.equal(logits, ref_logits)
        assert ref_grads.keys() == grads.keys() and len(grads) > 0
        assert all(torch.equal(grads[n], ref_grads[n]) for n in grads), [n for n in grads
                                                                          if not torch.equal(grads[n], ref_grads[n])]
        model.eval()


def test_a_forward_with_a_cache_needs_its_mask(ctx):
    model = make_policy(tiny_llama(), ctx)
    cache = model.new_cache(num_slots=1, capacity=8)
    with pytest.raises(ValueError, match=r"a forward with a KV cache needs its new tokens' mask \[b, s, s\]"):
        model.metadata(torch.zeros(1, 1, dtype=torch.long), None, cache, torch.arange(1))
