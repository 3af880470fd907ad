"""Reflex: feedback vectors against autograd, the vocab-parallel decomposition, the gate on synthetic
streams, the bounded correction, per-trajectory state, and exactness of the engine with it on."""

import math

import pytest
import torch

from conftest import import_tool
from specroll_mcore import reflex
from specroll_mcore.config import ReflexConfig, SamplingConfig, SlowPathConfig, SpecConfig, tiny_llama
from specroll_mcore.heads import vocab_rows
from specroll_mcore.rollout import SpeculativeEngine, VanillaEngine

from tests.unit.test_speculative import PROMPTS, policy_with_heads


class NoTP:
    tp_size = 1

    @staticmethod
    def all_reduce_tp(t, op="sum"):
        return t


def _problem(seed=0, m=5, V=40, h=12, k=3):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(V, h, generator=g, dtype=torch.float64)
    z = torch.randn(m, h, generator=g, dtype=torch.float64)
    p_logits = 2 * torch.randn(m, V, generator=g, dtype=torch.float64)
    q_full = z @ W.t()
    cand = q_full.topk(k, -1).indices
    q_top = q_full.topk(5, -1).indices
    p_top = p_logits.topk(5, -1).indices
    sampled = torch.multinomial(torch.softmax(p_logits, -1), 1, generator=g)[:, 0]
    ids, valid = reflex.support(cand, q_top, p_top, sampled)
    return W, z, p_logits, cand, p_top[:, :k], ids, valid


def test_support_masks_duplicates():
    ids, valid = reflex.support(torch.tensor([[1, 2]]), torch.tensor([[2, 3]]), torch.tensor([[3, 1]]),
                                torch.tensor([4]))
    assert ids.tolist() == [[1, 2, 2, 3, 3, 1, 4]]
    assert valid.tolist() == [[True, True, False, True, False, False, True]]


def test_distribution_feedback_is_minus_the_gradient_of_support_cross_entropy():
    W, z, p_logits, cand, p_star, ids, valid = _problem()
    q_logits = torch.einsum("msh,mh->ms", W[ids], z)
    coef = reflex.feedback_coefficients(p_logits.gather(1, ids), q_logits, ids, valid, cand, p_star, 0.0)
    e = reflex.feedback_vectors(vocab_rows(W, ids, 0), coef, NoTP())
    # independent reference: autograd through the restricted softmax on S
    zz = z.clone().requires_grad_()
    ql = torch.einsum("msh,mh->ms", W[ids], zz).masked_fill(~valid, -math.inf)
    p_s = torch.softmax(p_logits.gather(1, ids).masked_fill(~valid, -math.inf), -1)
    ce = -(p_s * torch.log_softmax(ql, -1).masked_fill(~valid, 0)).sum()
    ce.backward()
    torch.testing.assert_close(e, -zz.grad.float(), rtol=1e-5, atol=1e-6)


def test_coverage_feedback_raises_missing_policy_tokens_over_the_weakest_candidate():
    W, z, p_logits, cand, p_star, ids, valid = _problem(seed=3)
    q_logits = torch.einsum("msh,mh->ms", W[ids], z)
    dist = reflex.feedback_coefficients(p_logits.gather(1, ids), q_logits, ids, valid, cand, p_star, 0.0)
    both = reflex.feedback_coefficients(p_logits.gather(1, ids), q_logits, ids, valid, cand, p_star, 1.0)
    r_cov = reflex.feedback_vectors(vocab_rows(W, ids, 0), both - dist, NoTP()).double()
    p_s = torch.softmax(p_logits.gather(1, ids).masked_fill(~valid, -math.inf), -1)
    for r in range(z.shape[0]):
        missing = [y for y in p_star[r].tolist() if y not in cand[r].tolist()]
        # reference: the formula written out, sum_{y in C* \ C} p_S(y) (W_y - W_b*)
        expect = torch.zeros(W.shape[1], dtype=torch.float64)
        for y in missing:
            pos = ((ids[r] == y) & valid[r]).nonzero()[0, 0]
            expect += p_s[r, pos] * (W[y] - W[cand[r, -1]])
        torch.testing.assert_close(r_cov[r], expect, rtol=1e-5, atol=1e-6)


def test_vocab_parallel_partial_sums_equal_the_full_product():
    W, z, p_logits, cand, p_star, ids, valid = _problem(seed=5)
    coef = torch.randn(ids.shape, dtype=torch.float32)
    full = reflex.feedback_vectors(vocab_rows(W, ids, 0), coef, NoTP())
    half = W.shape[0] // 2
    shards = reflex.feedback_vectors(vocab_rows(W[:half], ids, 0), coef, NoTP()) + \
        reflex.feedback_vectors(vocab_rows(W[half:], ids, half), coef, NoTP())
    torch.testing.assert_close(shards, full)


def _stream(consistent: bool, steps=200, S=32, H=3, h=256, seed=0):
    cfg = ReflexConfig()
    g = torch.Generator().manual_seed(seed)
    st = reflex.ReflexState.new(S, H, h, torch.device("cpu"))
    slots, hz = torch.arange(S).repeat_interleave(H), torch.arange(H).repeat(S)
    direction = torch.randn(S * H, h, generator=g)
    opened = []
    for _ in range(steps):
        e = torch.randn(S * H, h, generator=g) + (direction if consistent else 0)
        reflex.update(st, slots, hz, e, cfg.decay_for(H))
        opened.append(st.gate(torch.arange(S), cfg.z_delta, cfg.min_observations).float().mean().item())
    return opened


def test_gate_stays_closed_on_random_feedback_and_opens_on_consistent_feedback():
    random_open = _stream(consistent=False)
    consistent_open = _stream(consistent=True)
    assert sum(random_open) / len(random_open) < 0.05  # a 2-sigma lower bound: rare false openings
    assert min(consistent_open[10:]) == 1.0
    assert max(consistent_open[:3]) == 0.0  # never before min_observations alignments


def test_correction_is_bounded_and_gated():
    S, H, h = 4, 3, 16
    st = reflex.ReflexState.new(S, H, h, torch.device("cpu"))
    st.memory[:] = torch.randn(S, H, h)
    st.count[:2] = 10
    st.mean[:2] = 0.5
    x = 3 * torch.randn(S, h)
    delta, open_ = reflex.correction(st, torch.arange(S), x, alpha=0.2, z_delta=2.0, min_observations=4)
    assert open_[:2].all() and not open_[2:].any()
    rms = delta.pow(2).mean(-1).sqrt()  # [H, S]
    torch.testing.assert_close(rms[:, :2], (0.2 * x[:2].pow(2).mean(-1).sqrt()).expand(H, 2))
    assert delta[:, 2:].abs().max() == 0


def test_ungated_correction_ignores_the_alignments():
    S, H, h = 3, 2, 8
    st = reflex.ReflexState.new(S, H, h, torch.device("cpu"))
    st.memory[:] = torch.randn(S, H, h)
    st.count[:2] = 10
    st.mean[:2] = -0.5  # memory that pointed the wrong way
    x = torch.randn(S, h)
    _, gated = reflex.correction(st, torch.arange(S), x, 0.1, 2.0, 4)
    delta, ungated = reflex.correction(st, torch.arange(S), x, 0.1, 2.0, 4, gated=False)
    assert not gated.any()
    assert ungated[:2].all() and not ungated[2].any()  # still needs min_observations
    assert delta[:, :2].abs().min() > 0


def test_release_forgets_one_trajectory_only():
    st = reflex.ReflexState.new(3, 2, 8, torch.device("cpu"))
    slots, hz = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 0, 1])
    for _ in range(3):
        reflex.update(st, slots, hz, torch.randn(4, 8), [0.5, 0.5])
    kept = [t[1].clone() for t in (st.memory, st.count, st.mean, st.m2)]
    st.release(torch.tensor([0]))
    assert all(t[0].abs().sum() == 0 for t in (st.memory, st.count, st.mean, st.m2))
    assert all(torch.equal(t[1], k) for t, k in zip((st.memory, st.count, st.mean, st.m2), kept))


def _reference_update(st, slots, horizons, e, decay):
    """Welford's update and the EMA, one (slot, horizon) pair at a time."""
    for s, h, v in zip(slots.tolist(), horizons.tolist(), e):
        m = st.memory[s, h].clone()
        if m.norm() > 0:
            a = torch.nn.functional.cosine_similarity(m, v, dim=0, eps=1e-12)
            n = st.count[s, h] + 1
            d = a - st.mean[s, h]
            mean = st.mean[s, h] + d / n
            st.m2[s, h] += d * (a - mean)
            st.mean[s, h], st.count[s, h] = mean, n
            st.totals[:, h] += torch.stack([a, torch.ones(())]).double()
        st.memory[s, h] = decay[h] * m + (1 - decay[h]) * v


def test_update_observes_only_the_marked_pairs():
    """``observed`` leaves the other pairs as they were (bit for bit) and updates the marked ones as a
    pair-at-a-time Welford update would; their alignments come back, NaN elsewhere."""
    g = torch.Generator().manual_seed(0)
    st = reflex.ReflexState.new(4, 3, 16, torch.device("cpu"))
    ref = reflex.ReflexState.new(4, 3, 16, torch.device("cpu"))
    slots, hz, decay = torch.arange(4).repeat_interleave(3), torch.arange(3).repeat(4), [0.5, 0.7, 0.9]
    for step in range(6):
        e = torch.randn(12, 16, generator=g)
        observed = torch.rand(12, generator=g) < 0.6
        before = [t.clone() for t in (st.memory, st.count, st.mean, st.m2)]
        a = reflex.update(st, slots, hz, e, decay, observed=observed)
        _reference_update(ref, slots[observed], hz[observed], e[observed], decay)
        for t, r, old in zip((st.memory, st.count, st.mean, st.m2), (ref.memory, ref.count, ref.mean, ref.m2), before):
            assert torch.allclose(t, r, rtol=1e-5, atol=1e-6)
            assert torch.equal(t[slots[~observed], hz[~observed]], old[slots[~observed], hz[~observed]])
        assert torch.allclose(st.totals, ref.totals)
        assert a[~observed].isnan().all() and (step == 0 or not a[observed & (before[1][slots, hz] > 0)].isnan().any())
    assert st.count.sum() > 0


def test_feedback_reads_no_host_value_but_the_paths_length(ctx):
    """The engine's feedback (Reflex and slow-path records) makes one host sync a step, for the
    positions the accepted paths reached: the levels' observations, the support and the memory's
    update are masked, not selected (on a GPU, each selection waits for the device)."""
    OpCounter = import_tool("bench_step_phases").OpCounter
    model = policy_with_heads(tiny_llama(params_dtype="float64"), ctx, head_std=0.3)
    eng = SpeculativeEngine(model, SpecConfig(c_hw=64, n_max=8, reflex=AGGRESSIVE_REFLEX))
    counters, feedback = [], eng.feedback

    def counted(*args, **kwargs):
        counters.append(OpCounter())
        with counters[-1]:
            return feedback(*args, **kwargs)

    eng.feedback = counted
    out = eng.generate(PROMPTS[:2], SamplingConfig(temperature=1.0, max_new_tokens=20, seed=3), prompt_ids=[0, 1])
    assert out.stats["reflex_alignment_per_depth"][0] is not None and len(counters) == out.stats["steps"]
    for c in counters:
        assert c.ops["nonzero"] + c.ops["nonzero_numpy"] == 1
        assert c.masks == c.tolist == c.ops["item"] == c.ops["_local_scalar_dense"] == 0


AGGRESSIVE_REFLEX = ReflexConfig(alpha=0.5, z_delta=0.0, min_observations=2)


def test_no_state_leaks_between_trajectories(ctx):
    """A response's speculation (its per-row tau) is the same alone and next to another response."""
    model = policy_with_heads(tiny_llama(params_dtype="float64"), ctx, head_std=0.3)
    spec = SpecConfig(c_hw=64, n_max=8, reflex=AGGRESSIVE_REFLEX, slow_path=SlowPathConfig(enabled=False))
    sp = SamplingConfig(temperature=1.0, max_new_tokens=30, seed=3)
    eng = SpeculativeEngine(model, spec)
    pair = eng.generate(PROMPTS[:2], sp, prompt_ids=[0, 1])
    alone = eng.generate(PROMPTS[1:2], sp, prompt_ids=[1])
    assert pair.stats["reflex_gate_open"] > 0  # the memory was in use
    assert pair.tokens[1] == alone.tokens[0]
    assert pair.stats["tau_per_row"][1] == alone.stats["tau_per_row"][0]


def test_reflex_changes_proposals_not_tokens(ctx):
    model = policy_with_heads(tiny_llama(params_dtype="float64"), ctx, head_std=0.3)
    sp = SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=40, num_samples=2, seed=11)
    ref = VanillaEngine(model).generate(PROMPTS, sp, step=1)
    off = SpeculativeEngine(model, SpecConfig(c_hw=64, reflex=ReflexConfig(enabled=False),
                                              slow_path=SlowPathConfig(enabled=False))).generate(PROMPTS, sp, step=1)
    on = SpeculativeEngine(model, SpecConfig(c_hw=64, reflex=AGGRESSIVE_REFLEX,
                                             slow_path=SlowPathConfig(enabled=False))).generate(PROMPTS, sp, step=1)
    assert on.tokens == ref.tokens == off.tokens
    for a, b in zip(on.logprobs, ref.logprobs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)
    assert on.stats["reflex_gate_open"] > 0 and off.stats["reflex_gate_open"] == 0


def test_alignment_statistic_is_the_mean_of_the_delayed_alignments(ctx, monkeypatch):
    """The engine reports, per horizon, the mean alignment the gate judges (None where none was seen)."""
    model = policy_with_heads(tiny_llama(params_dtype="float64"), ctx, head_std=0.3)
    seen = []

    def update(*args, **kwargs):
        a = real_update(*args, **kwargs)
        seen.append((args[2].clone(), a.clone()))
        return a

    real_update = reflex.update
    monkeypatch.setattr(reflex, "update", update)
    spec = SpecConfig(c_hw=64, reflex=AGGRESSIVE_REFLEX, slow_path=SlowPathConfig(enabled=False))
    out = SpeculativeEngine(model, spec).generate(PROMPTS, SamplingConfig(temperature=1.0, max_new_tokens=30, seed=4))
    depth, a = torch.cat([d for d, _ in seen]), torch.cat([x for _, x in seen])
    for h, got in enumerate(out.stats["reflex_alignment_per_depth"]):
        mine = a[(depth == h) & ~a.isnan()]
        assert (got is None) if mine.numel() == 0 else got == pytest.approx(float(mine.double().mean()), abs=1e-12)
    assert out.stats["reflex_alignment_per_depth"][0] is not None
    off = SpeculativeEngine(model, SpecConfig(c_hw=64, reflex=ReflexConfig(enabled=False),
                                              slow_path=SlowPathConfig(enabled=False)))
    assert off.generate(PROMPTS, SamplingConfig(max_new_tokens=5)).stats["reflex_alignment_per_depth"] == [None] * 3


@pytest.mark.parametrize("bad, field", [(dict(decay=(0.5, 1.0)), "decay"), (dict(alpha=-1), "alpha"),
                                        (dict(min_observations=1), "min_observations")])
def test_config_errors_name_the_field(bad, field):
    with pytest.raises(ValueError, match=f"ReflexConfig.{field}"):
        ReflexConfig(**bad)
