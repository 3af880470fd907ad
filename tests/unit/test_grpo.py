"""GRPO advantages and loss against hand-computed values; DAPO's dynamic sampling choice and soft
overlong punishment."""

import math

import pytest
import torch

from specroll_mcore.rl.grpo import group_advantages, k3_kl, learning_rate, policy_loss, varied_groups
from specroll_mcore.rl.rewards import overlong_penalty
from specroll_mcore.rl.schedule import balanced_assignment, micro_batch_split
from specroll_mcore.rl.trainer import chosen_groups


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])  # 2 prompts x 4 samples
    adv = group_advantages(r, 4, eps=0.0)
    std = math.sqrt(((0.5 ** 2) * 4) / 3)  # unbiased std of [1, 0, 0, 1]
    assert torch.allclose(adv[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / std)
    assert torch.equal(adv[4:], torch.zeros(4))  # all equal: no signal
    assert torch.allclose(group_advantages(r, 4, mean_only=True)[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        group_advantages(r, 3)


def test_policy_loss_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.75, 0.5, 0.25], [0.75, 0.5, 0.5]]))  # ratios 1.5, 1, 0.5 / 1.5, 1, 1
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.2, normalization="token")
    # row 0 (A=+1): min(1.5, 1.2)=1.2, 1, min(0.5, 0.8)=0.5 -> -(1.2+1+0.5); row 1 (A=-1): min(-1.5,-1.2)=-1.5, -1
    expected = (-(1.2 + 1.0 + 0.5) + (1.5 + 1.0)) / 5
    assert out.loss.item() == pytest.approx(expected)
    seq = policy_loss(new, old, adv, mask, normalization="sequence")
    assert seq.loss.item() == pytest.approx((-(2.7) / 3 + 2.5 / 2) / 2)
    # Dr. GRPO: each response's token sum over the length limit (4), averaged over the responses
    const = policy_loss(new, old, adv, mask, normalization="constant", max_tokens=4)
    assert const.loss.item() == pytest.approx((-(2.7) / 4 + 2.5 / 4) / 2)
    assert out.clip_fraction == pytest.approx(1 / 5)  # only ratio 1.5 with A > 0 hits the clip
    # asymmetric clipping (DAPO clip-higher): 1.5 with A>0 is now inside [0.8, 1.6]
    hi = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.6)
    assert hi.loss.item() == pytest.approx((-(1.5 + 1.0 + 0.5) + (1.5 + 1.0)) / 5)


def test_sequence_level_ratio_by_hand():
    """GSPO: a response's tokens all take the geometric mean of their ratios, clipped as one, and its
    gradient spreads evenly over them."""
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.75, 0.5, 0.25], [0.75, 0.5, 0.5]])).requires_grad_()
    adv, mask = torch.tensor([1.0, -1.0]), torch.tensor([[1, 1, 1], [1, 1, 0]])
    s0, s1 = (1.5 * 1.0 * 0.5) ** (1 / 3), (1.5 * 1.0) ** (1 / 2)  # 0.909 (inside [0.8, 1.2]), 1.225
    out = policy_loss(new, old, adv, mask, normalization="sequence", ratio_level="sequence")
    assert out.loss.item() == pytest.approx((-s0 + s1) / 2)  # row 1 (A < 0): min(-1.225, -1.2) = -1.225
    assert out.ratio_mean == pytest.approx((3 * s0 + 2 * s1) / 5) and out.clip_fraction == 0.0
    out.loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[-s0 / 6] * 3, [s1 / 4, s1 / 4, 0.0]]))
    # GSPO's clip range, the advantages' signs swapped so that it binds on both rows (token-normalised)
    tight = policy_loss(new, old, -adv, mask, clip_low=3e-4, clip_high=4e-4, ratio_level="sequence")
    assert tight.loss.item() == pytest.approx((3 * (1 - 3e-4) - 2 * (1 + 4e-4)) / 5)
    assert tight.clip_fraction == 1.0
    with pytest.raises(ValueError, match="ratio_level must be 'token' or 'sequence', got 'group'"):
        policy_loss(new, old, adv, mask, ratio_level="group")


def test_dual_clip_by_hand():
    """A token of negative advantage whose ratio grew past clip_ratio_c loses c * |A|, with no gradient;
    positive advantages and smaller ratios are as without it."""
    old = torch.log(torch.full((2, 2), 0.1))
    new = torch.log(torch.tensor([[0.5, 0.2], [0.5, 0.2]])).requires_grad_()  # ratios 5, 2 on both rows
    adv, mask = torch.tensor([-1.0, 1.0]), torch.ones(2, 2)
    plain = policy_loss(new, old, adv, mask)
    assert plain.loss.item() == pytest.approx((5 + 2 - 1.2 - 1.2) / 4)
    dual = policy_loss(new, old, adv, mask, clip_ratio_c=3.0)
    assert dual.loss.item() == pytest.approx((3 + 2 - 1.2 - 1.2) / 4)
    assert dual.clip_fraction == pytest.approx(3 / 4)  # the dual clip on (0, 0); the upper clip on row 1
    dual.loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, 2 / 4], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="clip_ratio_c \\(dual clip\\) must be > 1, got 1.0"):
        policy_loss(new, old, adv, mask, clip_ratio_c=1.0)


@pytest.mark.parametrize("normalization", ["token", "sequence", "constant"])
def test_pg_loss_is_the_clipped_ratio_term_alone(normalization):
    """LossOutput.pg_loss: the loss without its KL penalty and entropy bonus (verl's pg_loss)."""
    g = torch.Generator().manual_seed(3)
    logp, old, ref = (-torch.rand(3, 5, generator=g) * 3 for _ in range(3))
    adv, mask = torch.tensor([1.0, -0.5, 2.0]), (torch.rand(3, 5, generator=g) > 0.3).float()
    entropy = torch.rand(3, 5, generator=g)
    plain = policy_loss(logp, old, adv, mask, normalization=normalization, max_tokens=5)
    assert plain.pg_loss == plain.loss.item()
    full = policy_loss(logp, old, adv, mask, normalization=normalization, max_tokens=5, ref_logp=ref, kl_beta=0.3,
                       entropy=entropy, entropy_coeff=0.1)
    assert full.pg_loss == pytest.approx(plain.loss.item(), rel=1e-6)
    assert full.loss.item() != pytest.approx(full.pg_loss)


def test_entropy_bonus_by_hand():
    """entropy_coeff: - c x entropy per token, masked and normalised as the policy loss (token and
    sequence level), with gradient -c / n to each counted entropy; refused without the entropy."""
    logp = torch.zeros(2, 3)
    entropy = torch.tensor([[1.0, 2.0, 9.0], [3.0, 0.5, 0.5]]).requires_grad_()
    adv, mask = torch.zeros(2), torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    out = policy_loss(logp, logp, adv, mask, entropy=entropy, entropy_coeff=0.1)
    assert out.loss.item() == pytest.approx(-0.1 * (1 + 2 + 3 + 0.5 + 0.5) / 5)
    out.loss.backward()
    torch.testing.assert_close(entropy.grad, -0.1 * mask / 5)
    seq = policy_loss(logp, logp, adv, mask, normalization="sequence", entropy=entropy, entropy_coeff=0.1)
    assert seq.loss.item() == pytest.approx(-0.1 * ((1 + 2) / 2 + (3 + 0.5 + 0.5) / 3) / 2)
    assert policy_loss(logp, logp, adv, mask, entropy=entropy).loss.item() == 0.0  # coefficient 0: off
    with pytest.raises(ValueError, match="an entropy bonus \\(entropy_coeff 0.1\\) needs the entropy at every "
                                         "position, shaped as logp \\(2, 3\\); got None"):
        policy_loss(logp, logp, adv, mask, entropy_coeff=0.1)
    with pytest.raises(ValueError, match="entropy_coeff must be a finite number >= 0, got -0.1"):
        policy_loss(logp, logp, adv, mask, entropy=entropy, entropy_coeff=-0.1)


def test_k3_and_kl_penalty():
    logp = torch.log(torch.tensor([[0.5, 0.25]]))
    ref = torch.log(torch.tensor([[0.25, 0.25]]))
    d = ref - logp
    assert torch.allclose(k3_kl(logp, ref), torch.exp(d) - d - 1)
    assert (k3_kl(logp, ref) >= 0).all()
    base = policy_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 2))
    pen = policy_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 2), ref_logp=ref, kl_beta=0.1)
    assert pen.loss.item() == pytest.approx(0.1 * k3_kl(logp, ref).mean().item())
    assert base.loss.item() == 0.0


def test_k2_penalty_by_hand():
    """kl_estimator k2: 0.1 x (logp - ref)^2 / 2 per token, gradient 0.1 x (logp - ref) / n; the kl
    reported stays k3's; an unknown estimator is refused."""
    logp = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_()
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    d = (logp - ref).detach()
    out = policy_loss(logp, logp.detach(), torch.tensor([0.0]), torch.ones(1, 2), ref_logp=ref, kl_beta=0.1,
                      kl_estimator="k2")
    assert out.loss.item() == pytest.approx(0.1 * (0.5 * d ** 2).mean().item())
    assert out.kl == pytest.approx(k3_kl(logp, ref).mean().item())
    out.loss.backward()
    torch.testing.assert_close(logp.grad, 0.1 * d / 2)
    with pytest.raises(ValueError, match="kl_estimator must be one of \\['k2', 'k3'\\], got 'k1'"):
        policy_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 2), ref_logp=ref, kl_beta=0.1, kl_estimator="k1")


def test_micro_batches_add_up():
    g = torch.Generator().manual_seed(0)
    logp, old = torch.randn(4, 6, generator=g) - 2, torch.randn(4, 6, generator=g) - 2
    adv, mask = torch.randn(4, generator=g), (torch.rand(4, 6, generator=g) > 0.3).float()
    whole = policy_loss(logp, old, adv, mask).loss
    parts = sum(policy_loss(logp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], total_tokens=mask.sum()).loss
                for i in (0, 2))
    assert torch.allclose(whole, parts)
    for norm, level in [("sequence", "token"), ("constant", "token"), ("token", "sequence"), ("sequence", "sequence")]:
        whole = policy_loss(logp, old, adv, mask, normalization=norm, max_tokens=6, ratio_level=level).loss
        parts = sum(policy_loss(logp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], normalization=norm,
                                total_tokens=mask.sum(), total_sequences=4, max_tokens=6, ratio_level=level).loss
                    for i in (0, 2))  # (the sequences with loss tokens: all four here)
        assert torch.allclose(whole, parts), (norm, level)
    with pytest.raises(ValueError, match="normalization must be 'token', 'sequence' or 'constant', got 'batch'"):
        policy_loss(logp, old, adv, mask, normalization="batch")
    with pytest.raises(ValueError, match="normalization 'constant' divides by max_tokens, .* got None"):
        policy_loss(logp, old, adv, mask, normalization="constant")


def test_learning_rate_schedule_by_hand():
    assert [learning_rate(k, 1.0, 6, 2) for k in range(1, 7)] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    cosine = [learning_rate(k, 1.0, 6, 2, "cosine", 0.1) for k in range(1, 7)]
    assert cosine[:2] == [0.5, 1.0] and cosine[-1] == pytest.approx(0.1)
    assert cosine[2] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))  # a quarter of the way
    assert cosine[3] == pytest.approx(0.55)  # half way: the mean of lr and min_lr
    assert learning_rate(3, 2.0, 3, 0, "cosine") == pytest.approx(0.0)  # no warm-up: lr at 1, min_lr at the end
    with pytest.raises(ValueError, match="learning-rate decay must be 'constant' or 'cosine', got 'linear'"):
        learning_rate(1, 1.0, 6, 0, "linear")


def test_micro_batch_split_by_hand():
    lengths = [30, 10, 50, 10, 40, 20]
    assert micro_batch_split(lengths, 4) == [[0, 1, 2, 3], [4, 5]]  # no budget: the given order
    # a budget of 100 padded tokens: longest first, ties in the given order, rows x longest <= 100
    assert micro_batch_split(lengths, 4, 100) == [[2, 4], [0, 5, 1], [3]]
    assert micro_batch_split(lengths, 2, 100) == [[2, 4], [0, 5], [1, 3]]  # at most 2 rows
    assert micro_batch_split(lengths, 8, 50) == [[2], [4], [0], [5, 1], [3]]
    # lengths padded to multiples of 16 (sequence parallelism's padding) count as 32, 16, 64, 16, 48, 32
    assert micro_batch_split(lengths, 4, 100, multiple=16) == [[2], [4, 0], [5, 1, 3]]
    assert micro_batch_split([], 4, 100) == []
    with pytest.raises(ValueError, match="a 50-token sequence does not fit a micro-batch of 40 tokens: raise "
                                         "TrainConfig.micro_batch_tokens"):
        micro_batch_split(lengths, 4, 40)
    with pytest.raises(ValueError, match="micro-batches need max_rows >= 1 and max_tokens >= 0, got 0, 100"):
        micro_batch_split(lengths, 0, 100)


def test_balanced_assignment_by_hand():
    # replica 0: a long group (212 tokens each) and a short one (52); replica 1: two short groups.
    # Mean 552: replica 0 keeps 212, 212, 52, 52 (528) and passes on 212 (to replica 1, then the
    # lighter) and 52 (to replica 1, still the lighter: 524 < 528).
    costs = [[212, 212, 212, 52, 52, 52], [52, 52, 52, 52, 52, 52]]
    plan = balanced_assignment(costs)
    assert plan == [[(0, 0), (0, 1), (0, 3), (0, 4)], [(1, i) for i in range(6)] + [(0, 2), (0, 5)]]
    loads = [sum(costs[r][i] for r, i in part) for part in plan]
    assert loads == [528, 576] and max(loads) < max(map(sum, costs)) == 792
    assert sorted(x for part in plan for x in part) == [(r, i) for r in range(2) for i in range(6)]  # each once


def test_balanced_assignment_moves_nothing_that_does_not_help():
    assert balanced_assignment([[62, 62, 62], [52, 52, 52]]) == [[(0, 0), (0, 1), (0, 2)], [(1, 0), (1, 1), (1, 2)]]
    assert balanced_assignment([[10, 10], [10, 10]]) == [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]  # balanced already
    assert balanced_assignment([[300], [], [5]]) == [[(0, 0)], [], [(2, 0)]]  # one sequence: no better split
    assert balanced_assignment([[], []]) == [[], []]
    # a replica with nothing to train (its responses all overlong-filtered) takes some
    assert balanced_assignment([[40, 30, 20, 10], []]) == [[(0, 0), (0, 3)], [(0, 1), (0, 2)]]
    assert balanced_assignment([[7]]) == [[(0, 0)]]


def test_varied_groups_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 2.0, 0.5, 0.5, 0.25])  # 3 prompts x 3 samples
    assert varied_groups(r, 3).tolist() == [True, False, True]
    assert varied_groups(torch.tensor([1.0, 1.0]), 1).tolist() == [True, True]  # G = 1: nothing to compare
    with pytest.raises(ValueError, match="do not split into groups of 2"):
        varied_groups(r, 2)


def test_chosen_groups_take_the_first_varied_in_round_order_and_split_over_replicas():
    rounds = [torch.tensor([True, False, False, True]), torch.tensor([True, True, True, False])]
    # one replica: round 0's prompts 0 and 3, then round 1's prompts 0 and 1; prompt 2 of round 1 is surplus
    assert chosen_groups(rounds, 4, 1, 0) == [(0, 0, 0), (1, 0, 3), (2, 1, 0), (3, 1, 1)]
    # two replicas: prompt i is replica i % 2's local group i // 2; together they hold the same four
    r0, r1 = chosen_groups(rounds, 4, 2, 0), chosen_groups(rounds, 4, 2, 1)
    assert r0 == [(0, 0, 0), (2, 1, 0)] and r1 == [(1, 0, 1), (3, 1, 0)]
    assert chosen_groups(rounds, 1, 2, 1) == [] and chosen_groups([torch.zeros(4, dtype=torch.bool)], 2, 1, 0) == []


def test_overlong_penalty_by_hand():
    # limit 100, buffer 20: nothing up to 80 tokens, then linear to -factor at 100
    assert [overlong_penalty(n, 100, 20) for n in (10, 80, 81, 90, 100)] == [0.0, 0.0, -0.05, -0.5, -1.0]
    assert overlong_penalty(90, 100, 20, factor=0.5) == -0.25
    assert overlong_penalty(100, 100, 0) == 0.0  # buffer 0: off


def test_rounds_statistics_combine_over_their_steps():
    from specroll_mcore.rollout.base import combined_stats

    a = {"tau": 2.0, "per_step": [{"emitted": 4, "active": 2, "nodes_per_row": 4}], "tried_per_depth": [2, 1],
         "accepted_per_depth": [1, 1],
         "acceptance_per_depth": [0.5, 1.0], "reflex_gate_open": 0.0, "slow_path": {"events": 1, "event": {"head": 0}}}
    b = {"tau": 1.0, "per_step": [{"emitted": 2, "active": 2, "nodes_per_row": 1}, {"emitted": 1, "active": 1,
                                                                                    "nodes_per_row": 2}],
         "tried_per_depth": [2, 0],
         "accepted_per_depth": [0, 0], "acceptance_per_depth": [0.0, 0.0], "reflex_gate_open": 0.5,
         "slow_path": {"events": 1, "event": None}}
    c = combined_stats([a, b])
    assert c["tau"] == 7 / 5 and c["tried_per_depth"] == [4, 1] and c["accepted_per_depth"] == [1, 1]
    assert c["nodes_per_row"] == (4 * 2 + 1 * 2 + 2 * 1) / 5  # per row and step
    assert c["acceptance_per_depth"] == [0.25, 1.0]
    assert c["reflex_gate_open"] == 0.25 and c["slow_path"] == {"events": 1, "event": {"head": 0}}
    assert combined_stats([a]) is a
