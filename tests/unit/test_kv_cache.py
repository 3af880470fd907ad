"""Decode with the KV cache equals full recompute (mode a: no cache, causal over the whole text)."""

import torch

from conftest import make_policy
from specroll_mcore.config import tiny_llama, tiny_qwen2
from specroll_mcore.model import causal_mask


def full_recompute_logits(model, seq: list[int]) -> torch.Tensor:
    ids = torch.tensor([seq])
    meta = model.metadata(torch.arange(len(seq))[None], causal_mask(1, len(seq), ids.device))
    return model.full_logits(model(ids, meta))[0]  # [s, V]


def test_cached_decode_matches_full_recompute(ctx):
    torch.manual_seed(0)
    for cfg in (tiny_llama(), tiny_qwen2()):
        model = make_policy(cfg, ctx)
        prompts = [[3, 14, 15, 92, 65], [35], [89, 79, 32, 38, 46, 26, 43]]  # ragged
        steps = 12
        cache = model.new_cache(num_slots=3, capacity=32)
        from specroll_mcore.rollout.base import prefill

        with torch.no_grad():
            last = prefill(model, cache, prompts, max_tokens_per_forward=64)
            seqs = [list(p) for p in prompts]
            active = torch.arange(3)
            logits_cached = [[] for _ in prompts]
            for r in range(3):
                logits_cached[r].append(last[r])
            for _ in range(steps):
                nxt = torch.stack([logits_cached[r][-1].argmax() for r in range(3)])
                for r in range(3):
                    seqs[r].append(int(nxt[r]))
                meta = model.metadata(cache.lengths[active][:, None], torch.ones(3, 1, 1, dtype=torch.bool),
                                      cache, active)
                out = model.full_logits(model(nxt[:, None], meta))[:, 0]
                cache.commit(active, torch.ones(3, dtype=torch.long))
                for r in range(3):
                    logits_cached[r].append(out[r])
            for r in range(3):
                ref = full_recompute_logits(model, seqs[r])[len(prompts[r]) - 1:]
                got = torch.stack(logits_cached[r])
                assert (ref - got).abs().max() < 1e-5, (ref - got).abs().max()
                assert torch.equal(ref.argmax(-1), got.argmax(-1))
        assert cache.lengths.tolist() == [len(p) + steps for p in prompts]


def test_shared_prefix_copy(ctx):
    """copy_slots duplicates a prompt's cache for its G samples."""
    model = make_policy(tiny_llama(), ctx)
    from specroll_mcore.rollout.base import prefill

    cache = model.new_cache(num_slots=4, capacity=16)
    with torch.no_grad():
        prefill(model, cache, [[5, 6, 7]], 64)
        cache.copy_slots(torch.tensor([0, 0, 0]), torch.tensor([1, 2, 3]))
        slots = torch.arange(4)
        meta = model.metadata(cache.lengths[:, None], torch.ones(4, 1, 1, dtype=torch.bool), cache, slots)
        out = model.full_logits(model(torch.full((4, 1), 9), meta))[:, 0]
    assert cache.lengths.tolist() == [3, 3, 3, 3]  # the decoded token is not committed
    ref = full_recompute_logits(model, [5, 6, 7, 9])[-1]
    assert (out - ref).abs().max() < 1e-5
