"""Counter-based sampling: distribution (chi-square), filters, greedy, key independence, the CPU noise kernel."""

import pytest
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


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 0), (1.3, 40)])
def test_min_p_equals_transformers_warpers(temperature, top_k):
    """Min-p after temperature and top-k against transformers' logits warpers in generate's order."""
    from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper

    logits = 2.5 * torch.randn(64, 300, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    for min_p in (0.02, 0.1, 0.5, 1.0):
        ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            ref = TopKLogitsWarper(top_k)(None, ref)
        ref = MinPLogitsWarper(min_p)(None, ref)
        ours = filter_logits(logits, temperature, 1.0, top_k, min_p)
        assert torch.equal(torch.isfinite(ours), torch.isfinite(ref)), min_p
        assert torch.equal(ours[torch.isfinite(ours)], ref[torch.isfinite(ref)])
        kept = torch.isfinite(ours).sum(-1)
        assert (kept >= 1).all() and (min_p == 1.0 or (kept > 1).any()) and (kept < (top_k or 300)).any()


@pytest.mark.parametrize("window", [16, 10_000])  # the cut looked for among 16 ids first; the whole row sorted
def test_top_p_equals_transformers_warper_and_each_row_alone(monkeypatch, window):
    """Top-p against transformers' TopPLogitsWarper, on rows from peaked (a few ids kept: the cut
    inside the window) to flat (hundreds kept: past it, the row sorted whole), mixed in one call; and
    each row filtered alone as in the batch (which way a row goes is its own)."""
    from transformers.generation.logits_process import TopPLogitsWarper

    from specroll_mcore import sampling

    monkeypatch.setattr(sampling, "NUCLEUS_WINDOW", window)
    scale = torch.linspace(0.05, 6.0, 24, dtype=torch.float64)[:, None]
    logits = scale * torch.randn(24, 500, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    for top_p in (0.5, 0.9, 0.95):
        ours = filter_logits(logits, 1.0, top_p, 0)
        kept = torch.isfinite(ours).sum(-1)
        assert (kept <= 16).any() and (kept > 16).any(), kept  # both ways in one call
        assert torch.equal(torch.isfinite(ours), torch.isfinite(TopPLogitsWarper(top_p)(None, logits.clone())))
        alone = torch.cat([filter_logits(logits[i:i + 1], 1.0, top_p, 0) for i in range(24)])
        assert torch.equal(alone, ours)
    # with top-k first: ids past the k-th are out before the nucleus is taken
    both = filter_logits(logits, 1.0, 0.95, 10)
    ref = TopPLogitsWarper(0.95)(None, filter_logits(logits, 1.0, 1.0, 10))
    assert torch.equal(torch.isfinite(both), torch.isfinite(ref)) and (torch.isfinite(both).sum(-1) <= 10).all()


def test_min_p_after_top_p_keeps_the_ids_both_keep():
    """The best id survives top-p, so min-p's threshold is the same before or after it: the kept set
    is the intersection of the two filters' kept sets."""
    logits = 2.0 * torch.randn(32, 200, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    both = torch.isfinite(filter_logits(logits, 0.8, 0.9, 0, 0.05))
    top_p = torch.isfinite(filter_logits(logits, 0.8, 0.9, 0))
    assert torch.equal(both, top_p & torch.isfinite(filter_logits(logits, 0.8, 1.0, 0, 0.05)))
    assert not torch.equal(both, top_p)  # min-p cuts more


def test_min_p_distribution():
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0])
    n = 40000
    # min-p 0.2 at T=1: ids with p >= 0.2 p_max, i.e. logit >= 3 + log(0.2) = 1.39: the first three
    tokens, logp = sample(logits.expand(n, -1), keys_for(n, seed=3), 1.0, min_p=0.2)
    assert set(tokens.unique().tolist()) == {0, 1, 2}
    target = torch.softmax(filter_logits(logits[None], 1.0, 1.0, 0, 0.2)[0], -1)
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
    for other in (keys_for(6, seed=4, step=2, prompt=5, sample_idx=1),
                  keys_for(6, seed=3, step=3, prompt=5, sample_idx=1),
                  keys_for(6, seed=3, step=2, prompt=6, sample_idx=1),
                  keys_for(6, seed=3, step=2, prompt=5, sample_idx=2)):
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


def reference_uniform(row_hash: int, token: int) -> float:
    """The noise's uniform for one (row hash, token id), in Python integers: MurmurHash3's fmix32 of the
    row hash xor the id's golden-ratio multiple, centred in its 2^-32 bucket."""
    h = row_hash ^ ((token * 0x9E3779B1) & 0xFFFFFFFF)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return (h + 0.5) / 2**32


def noise_values(keys, ids):
    return [gumbel_noise(keys, 49152), uniform_noise(keys, 1000, torch.float32, start=40),
            gumbel_noise_at(keys, ids), gumbel_noise(keys, 3000, torch.bfloat16)]


def test_noise_kernel_gives_torchs_values_bit_for_bit(monkeypatch):
    """The compiled uniforms (csrc/counter_noise.cpp) against torch's int64 ops and against the hash
    in Python integers: every key field's full range, ids shared by all rows and per row, rows that
    span several parallel tasks and chunks."""
    import specroll_mcore.sampling as sampling

    kernel = sampling.noise_kernel()
    if kernel is None:
        pytest.skip("the noise kernel could not be built here")
    g = torch.Generator().manual_seed(0)
    n = 37
    keys = SampleKeys(2**31 + 5, 2**20, torch.randint(0, 2**40, (n,), generator=g),
                      torch.randint(0, 2**16, (n,), generator=g), torch.randint(0, 2**17, (n,), generator=g))
    ids = torch.randint(0, 49152, (n, 33), generator=g)
    on = noise_values(keys, ids)
    monkeypatch.setenv("SPECROLL_NOISE_KERNEL", "0")
    assert sampling.noise_kernel() is None
    off = noise_values(keys, ids)
    assert all(torch.equal(a, b) for a, b in zip(on, off))
    h = keys.row_hash()
    shared = kernel.counter_uniform(h, torch.tensor([[0, 1, 49151, 2**31 - 1, 2**40 + 7]]))
    per_row = kernel.counter_uniform(h, ids)
    for r in (0, 17, n - 1):
        assert shared[r].tolist() == [reference_uniform(int(h[r]), t) for t in (0, 1, 49151, 2**31 - 1, 2**40 + 7)]
        assert per_row[r].tolist() == [reference_uniform(int(h[r]), int(t)) for t in ids[r]]


def test_the_noise_in_one_pass_equals_the_noise_in_chunks(monkeypatch):
    """torch's path in one pass over the rows (a GPU's: the hash mixed in place, no buffer of its own)
    against the CPU's row chunks and against the hash in Python integers, bit for bit."""
    import specroll_mcore.sampling as sampling

    monkeypatch.setenv("SPECROLL_NOISE_KERNEL", "0")
    g = torch.Generator().manual_seed(1)
    n = 9
    keys = SampleKeys(7, 3, torch.randint(0, 2**40, (n,), generator=g), torch.randint(0, 2**16, (n,), generator=g),
                      torch.randint(0, 2**17, (n,), generator=g))
    ids = torch.randint(0, 49152, (n, 5), generator=g)
    chunked = noise_values(keys, ids)
    monkeypatch.setattr(sampling, "CPU_CHUNK", 1 << 62)
    assert all(torch.equal(a, b) for a, b in zip(noise_values(keys, ids), chunked))
    h = keys.row_hash()
    uniforms = sampling._torch_uniform(h, ids)
    for r in (0, n - 1):
        assert uniforms[r].tolist() == [reference_uniform(int(h[r]), int(t)) for t in ids[r]]


def reference_row_hash(seed: int, step: int, prompt: int, sample: int, position: int) -> int:
    """A key's row hash in Python integers: fmix32 of the seed, then each field combined in turn."""
    def fmix(h: int) -> int:
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)

    h = fmix((seed ^ 0x5BD1E995) & 0xFFFFFFFF)
    for x in (step, prompt, sample, position):
        h = fmix((h * 0x9E3779B1 + (x & 0xFFFFFFFF) + 0x7F4A7C15) & 0xFFFFFFFF)
    return h


def test_row_hashes_are_python_integers_hashes():
    """torch's row hashes (the GPU path; the seed and step mixed in Python's integers) and, where it is
    built, the kernel's (one call for all keys) against Python integers, over the fields' full int64
    range, negative values and seeds past 32 bits included."""
    import specroll_mcore.sampling as sampling

    g = torch.Generator().manual_seed(3)
    for seed, step in ((0, 0), (2**40 + 3, 2**33 + 1), (-7, -3), (123456789, 2**62), (-2**63, 2**63 - 1)):
        fields = [torch.randint(-2**62, 2**62, (50,), generator=g) for _ in range(3)]
        keys = SampleKeys(seed, step, *fields)
        h = keys._torch_row_hash()
        assert h.dtype == torch.long and bool(((h >= 0) & (h < 2**32)).all())
        assert [int(x) for x in h] == [reference_row_hash(seed, step, *(int(f[r]) for f in fields)) for r in range(50)]
        if sampling.noise_kernel() is not None:
            assert torch.equal(keys.row_hash(), h)
    empty = SampleKeys(1, 2, *[torch.zeros(0, dtype=torch.long)] * 3)
    assert empty.row_hash().shape == empty._torch_row_hash().shape == (0,)


def test_keys_with_hashes_computed_once_give_the_same_noise():
    """Keys whose row hashes were computed once (with_hashes), and their subsets by rows and select,
    give the noise of keys hashed at each use."""
    g = torch.Generator().manual_seed(5)
    keys = SampleKeys(11, 3, torch.randint(0, 9, (12,), generator=g), torch.randint(0, 4, (12,), generator=g),
                      torch.randint(0, 300, (12,), generator=g))
    hashed = keys.with_hashes()
    assert keys.hashes is None and torch.equal(hashed.hashes, keys.row_hash()) and hashed.with_hashes() is hashed
    index = torch.tensor([7, 0, 7, 3])
    for a, b in ((hashed, keys), (hashed.rows(2, 9), keys.rows(2, 9)), (hashed.select(index), keys.select(index))):
        assert a.hashes is not None and b.hashes is None
        assert torch.equal(gumbel_noise(a, 50), gumbel_noise(b, 50))
    picked = keys.select(index)
    assert torch.equal(picked.position, keys.position[index]) and torch.equal(picked.prompt, keys.prompt[index])
    assert torch.equal(gumbel_noise(picked, 50), gumbel_noise(keys, 50)[index])


def test_first_argmax_is_torchs_first_maximal_index():
    """The kernel's argmax (vector lanes, then the rest of the row) against torch's max(dim).indices:
    ties (the first index wins), NaN (the first NaN wins), rows of -inf, +inf, rows shorter than a
    vector block and with a partial last block, vocabulary-wide rows, a non-contiguous view; other
    dtypes take torch's path."""
    import specroll_mcore.sampling as sampling

    if sampling.noise_kernel() is None:
        pytest.skip("the noise kernel could not be built here")
    g = torch.Generator().manual_seed(0)
    for width in (1, 7, 16, 17, 31, 32, 33, 100, 49152):
        x = torch.randint(-3, 3, (12, width), generator=g).float()  # many ties
        x[1] = float("-inf")
        x[2, -1] = float("inf")
        x[3, width // 2] = x[3, -1] = float("nan")
        x[4, 0] = float("nan")
        x[5, width // 3:] = float("inf")
        assert torch.equal(sampling.first_argmax(x), x.max(dim=-1).indices), width
    wide = torch.randn(40, 1000, generator=g).round(decimals=1)
    assert torch.equal(sampling.first_argmax(wide[:, ::2]), wide[:, ::2].max(dim=-1).indices)
    rows = wide.view(10, 4, 1000)[:, 1]  # rows read in place: a view with a row stride of 4000
    assert torch.equal(sampling.first_argmax(rows), rows.max(dim=-1).indices)
    half = wide.bfloat16()
    assert torch.equal(sampling.first_argmax(half), half.max(dim=-1).indices)
    assert sampling.first_argmax(torch.zeros(0, 5)).shape == (0,)


def test_noise_kernel_checks_its_inputs():
    import specroll_mcore.sampling as sampling

    kernel = sampling.noise_kernel()
    if kernel is None:
        pytest.skip("the noise kernel could not be built here")
    with pytest.raises(RuntimeError, match="must be CPU int64 tensors"):
        kernel.counter_row_hash(1, 2, torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.long),
                                torch.zeros(2, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"first_argmax: a CPU float32 tensor \[n, V\]"):
        kernel.first_argmax(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"first_argmax: a CPU float32 tensor \[n, V\]"):
        kernel.first_argmax(torch.zeros(3))
    with pytest.raises(RuntimeError, match="must have equal length"):
        kernel.counter_row_hash(1, 2, torch.zeros(2, dtype=torch.long), torch.zeros(3, dtype=torch.long),
                                torch.zeros(2, dtype=torch.long))
    with pytest.raises(RuntimeError, match="ids must have 1 or n = 2 rows, got 3"):
        kernel.counter_uniform(torch.zeros(2, dtype=torch.long), torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(RuntimeError, match="int64 row hashes and ids"):
        kernel.counter_uniform(torch.zeros(2, dtype=torch.int32), torch.zeros(1, 4, dtype=torch.long))


def test_without_a_compiler_the_noise_is_torchs(monkeypatch):
    """A failed build of the noise kernel warns once, naming the cause and the switch, and the noise
    keeps its values (torch's ops compute it)."""
    import warnings

    import torch.utils.cpp_extension as cpp_extension

    import specroll_mcore.sampling as sampling

    keys = keys_for(5, seed=4, step=9)
    ids = torch.randint(0, 49152, (5, 7), generator=torch.Generator().manual_seed(1))
    expected = noise_values(keys, ids)

    def no_compiler(*args, **kwargs):
        raise RuntimeError("error: command 'c++' failed: No such file or directory")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    sampling._build_noise_kernel.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match=r"counter_noise.cpp could not be built \(RuntimeError: .*c\+\+.*"
                                                 r"SPECROLL_NOISE_KERNEL=0"):
            assert sampling.noise_kernel() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = noise_values(keys, ids)  # no second warning
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    finally:
        sampling._build_noise_kernel.cache_clear()


def test_sample_draws_the_first_maximal_score():
    """sample() draws argmax(filtered logits / T + g), the first index among equal scores: bfloat16
    logits and noise tie often."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(64, 4096, generator=g) * 2).to(torch.bfloat16)
    keys = keys_for(64, seed=2)
    for T, top_p in ((1.0, 1.0), (0.7, 1.0), (1.0, 0.9)):
        x = filter_logits(logits, T, top_p, 0)
        scores = x + gumbel_noise(keys, 4096, x.dtype)
        ties = (scores == scores.max(-1, keepdim=True).values).sum(-1)
        tokens, _ = sample(logits, keys, T, top_p)
        assert torch.equal(tokens, scores.argmax(-1))
        if T == 1.0 and top_p == 1.0:
            assert (ties > 1).any()  # the case this checks
