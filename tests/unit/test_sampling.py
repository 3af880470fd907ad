"""Counter-based sampling: distribution (chi-square), filters, greedy, key independence."""

import torch
from scipy import stats

from specroll_mcore.sampling import SampleKeys, filter_logits, gumbel_noise, gumbel_noise_at, sample, uniform_noise


def keys_for(n, seed=0, step=0, prompt=0, sample_idx=0):
    return SampleKeys(seed, step, torch.full((n,), prompt), torch.full((n,), sample_idx), torch.arange(n))


def chi_square_p(tokens, probs):
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() / probs.double().sum() * tokens.numel()
    keep = expected > 0
    return stats.chisquare(counts[keep].numpy(), expected[keep].numpy()).pvalue


def test_t1_frequencies_match_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.2])
    n = 40000
    tokens, logp = sample(logits.expand(n, -1), keys_for(n), temperature=1.0)
    assert chi_square_p(tokens, torch.softmax(logits, -1)) > 1e-3
    assert torch.allclose(logp, torch.log_softmax(logits, -1)[tokens])


def test_temperature_top_k_top_p_distribution():
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0])
    n = 40000
    # top-k 3 at T=0.7: only the three best, renormalised.
    tokens, _ = sample(logits.expand(n, -1), keys_for(n, seed=1), 0.7, top_k=3)
    target = torch.softmax(filter_logits(logits[None], 0.7, 1.0, 3)[0], -1)
    assert set(tokens.unique().tolist()) <= {0, 1, 2}
    assert chi_square_p(tokens, target) > 1e-3
    # top-p 0.8 at T=1: the smallest prefix reaching 0.8.
    p = torch.softmax(logits, -1)
    kept = int((torch.cumsum(p, 0) - p < 0.8).sum())
    tokens, logp = sample(logits.expand(n, -1), keys_for(n, seed=2), 1.0, top_p=0.8)
    assert tokens.max() < kept
    target = torch.softmax(filter_logits(logits[None], 1.0, 0.8, 0)[0], -1)
    assert chi_square_p(tokens, target) > 1e-3
    assert torch.allclose(logp, torch.log(target[tokens]))


def test_greedy():
    logits = torch.randn(5, 50)
    tokens, logp = sample(logits, keys_for(5), temperature=0.0)
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.allclose(logp, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0])


def test_noise_is_a_pure_function_of_the_key():
    a = keys_for(6, seed=3, step=2, prompt=5, sample_idx=1)
    g1 = gumbel_noise(a, 100)
    # Same keys in another batch order and alongside other rows give the same noise.
    perm = torch.tensor([4, 0, 5, 2, 1, 3])
    b = SampleKeys(3, 2, torch.cat([a.prompt[perm], torch.tensor([9])]),
                   torch.cat([a.sample[perm], torch.tensor([0])]), torch.cat([a.position[perm], torch.tensor([0])]))
    assert torch.equal(gumbel_noise(b, 100)[:6], g1[perm])
    # Every key field matters.
    for other in (keys_for(6, seed=4, step=2, prompt=5, sample_idx=1), keys_for(6, seed=3, step=3, prompt=5, sample_idx=1),
                  keys_for(6, seed=3, step=2, prompt=6, sample_idx=1), keys_for(6, seed=3, step=2, prompt=5, sample_idx=2)):
        assert not torch.equal(gumbel_noise(other, 100), g1)
    u = uniform_noise(keys_for(200), 1000)
    assert 0 < u.min() and u.max() < 1
    assert stats.kstest(u.flatten().numpy(), "uniform").pvalue > 1e-3


def test_noise_of_a_vocabulary_slice_is_that_slice_of_the_noise():
    keys = keys_for(4, seed=8, step=1)
    assert torch.equal(gumbel_noise(keys, 70, start=30), gumbel_noise(keys, 100)[:, 30:])


def test_noise_at_some_ids_is_those_entries_of_the_noise():
    keys = keys_for(4, seed=8, step=1)
    ids = torch.tensor([[0, 99, 5], [7, 7, 1], [50, 2, 3], [98, 97, 96]])
    assert torch.equal(gumbel_noise_at(keys, ids), gumbel_noise(keys, 100, torch.float32).gather(1, ids))


def test_noise_in_row_chunks_equals_one_pass(monkeypatch):
    """On CPU the noise is computed a few rows at a time (cache-sized passes); the values are those
    of one pass over all rows, for chunks that do and do not divide the rows."""
    import specroll_mcore.sampling as sampling

    keys = SampleKeys(5, 3, torch.arange(11) // 4, torch.arange(11) % 4, torch.arange(11) + 17)
    ids = torch.randint(0, 1000, (11, 30))
    monkeypatch.setattr(sampling, "CPU_CHUNK", 10**9)
    whole = [gumbel_noise(keys, 1000), uniform_noise(keys, 1000, torch.float32, start=40), gumbel_noise_at(keys, ids)]
    for chunk in (1000, 3000, 4000, 1):
        monkeypatch.setattr(sampling, "CPU_CHUNK", chunk)
        got = [gumbel_noise(keys, 1000), uniform_noise(keys, 1000, torch.float32, start=40), gumbel_noise_at(keys, ids)]
        assert all(torch.equal(a, b) for a, b in zip(got, whole)), chunk
