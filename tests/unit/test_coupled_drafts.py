"""Coupled drafting: heads rank ids by the sampler's own scores (filtered logits / T + the Gumbel
noise of the drafted position), so a draft that equals the policy is always accepted."""

import pytest
import torch

from specroll_mcore.checkpoint import random_full_state_dict
from specroll_mcore.config import ReflexConfig, SamplingConfig, SlowPathConfig, SpecConfig, tiny_llama
from specroll_mcore.heads import coupled_scores, vocab_parallel_filter
from specroll_mcore.model import PolicyModel
from specroll_mcore.rollout import SpeculativeEngine, VanillaEngine
from specroll_mcore.sampling import SampleKeys, filter_logits, sample

FILTERS = [(1.0, 1.0, 0, 0.0), (0.7, 0.9, 0, 0.0), (1.3, 1.0, 12, 0.0), (1.0, 0.8, 40, 0.0), (1.0, 1.0, 0, 0.05),
           (0.7, 0.9, 30, 0.1)]  # (T, top_p, top_k, min_p)


def keys(n, seed=4):
    return SampleKeys(seed, 3, torch.arange(n) % 5, torch.arange(n) % 2, torch.arange(n) + 10)


@pytest.mark.parametrize("temperature, top_p, top_k, min_p", FILTERS)
def test_filter_equals_the_samplers_when_the_cut_is_inside_the_window(ctx, temperature, top_p, top_k, min_p):
    g = torch.Generator().manual_seed(1)
    logits = 3.0 * torch.randn(32, 500, generator=g, dtype=torch.float64)  # peaked: top-p keeps a few ids
    x = logits / temperature
    ours = vocab_parallel_filter(x, top_p, top_k, 0, 500, ctx, min_p=min_p)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(filter_logits(logits, temperature, top_p, top_k, min_p)))


def test_filter_keeps_everything_when_the_cut_lies_beyond_the_window(ctx):
    logits = -1e-3 * torch.arange(400, dtype=torch.float64).expand(3, -1)  # nearly flat
    ours = vocab_parallel_filter(logits, 0.9, 0, 0, 400, ctx, window=64)
    assert torch.isfinite(ours).all()
    kept = torch.isfinite(filter_logits(logits, 1.0, 0.9, 0)).sum(-1)
    assert (kept > 64).all() and (kept < 400).all()  # the sampler's cut: past the window, short of all


@pytest.mark.parametrize("temperature, top_p, top_k, min_p", FILTERS)
def test_a_draft_equal_to_the_policy_is_its_sample(ctx, temperature, top_p, top_k, min_p):
    g = torch.Generator().manual_seed(2)
    logits = 2.0 * torch.randn(64, 300, generator=g, dtype=torch.float64)
    k = keys(64)
    tokens, _ = sample(logits, k, temperature, top_p, top_k, min_p)
    scores = coupled_scores(logits / temperature, k, top_p, top_k, 0, 300, ctx, min_p=min_p)
    assert torch.equal(scores.argmax(-1), tokens)
    # another position's noise gives other tokens: the scores read the drafted position's noise
    other = SampleKeys(k.seed, k.step, k.prompt, k.sample, k.position + 1)
    elsewhere = coupled_scores(logits / temperature, other, top_p, top_k, 0, 300, ctx, min_p=min_p)
    assert not torch.equal(elsewhere.argmax(-1), tokens)


def test_drafts_under_several_paths_share_their_positions_noise(ctx):
    logits = torch.randn(12, 300, generator=torch.Generator().manual_seed(4))
    k = keys(4)  # 3 drafts (paths) per key
    repeated = SampleKeys(k.seed, k.step, *(t.repeat_interleave(3) for t in (k.prompt, k.sample, k.position)))
    assert torch.equal(coupled_scores(logits, k, 0.9, 0, 0, 300, ctx),
                       coupled_scores(logits, repeated, 0.9, 0, 0, 300, ctx))


def constant_policy(ctx):
    """Every token has the same embedding, so the policy's next-token distribution is the same at
    every position, and zero-initialised heads (z = h) draft exactly that distribution."""
    cfg = tiny_llama(params_dtype="float64")
    model = PolicyModel(cfg, ctx, num_heads=3).eval()
    full = random_full_state_dict(cfg, seed=3, std=0.08)
    emb = full["embedding.word_embeddings.weight"]
    full["embedding.word_embeddings.weight"] = emb[:1].expand_as(emb).clone()
    model.load_full_state_dict(full)
    return model


def test_coupled_heads_that_equal_the_policy_are_always_accepted(ctx):
    model = constant_policy(ctx)
    prompts = [[5, 6, 7], [8], [9, 10]]
    sp = SamplingConfig(temperature=1.0, max_new_tokens=24, num_samples=2, seed=3)
    ref = VanillaEngine(model).generate(prompts, sp)
    taus = {}
    for coupled in (True, False):
        spec = SpecConfig(c_hw=64, coupled=coupled, reflex=ReflexConfig(enabled=False),  # the heads as they are
                          slow_path=SlowPathConfig(enabled=False))
        out = SpeculativeEngine(model, spec).generate(prompts, sp)
        assert out.tokens == ref.tokens
        taus[coupled] = out.stats["tau"]
    assert taus[True] == 4.0  # every draft of all three heads matches the sample
    assert taus[False] < 2.0  # ranking by probability alone: the flat distribution's top-4 rarely hold it
