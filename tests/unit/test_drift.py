"""The drift the adaptation benchmarks move the policy with: real optimizer steps on the backbone
only, in the requested style, and clear errors for what cannot run."""

import pytest
import torch
import transformers

from grpo_fixtures import tiny_policy_checkpoint
from specroll_mcore.checkpoint.megatron import load_policy
from specroll_mcore.rl.drift import STYLES, SFTDrift, nll, sft_batches
from specroll_mcore.rl.schedule import forward_logprobs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    ckpt = tiny_policy_checkpoint(tmp_path_factory.mktemp("drift"))
    return ckpt, transformers.AutoTokenizer.from_pretrained(ckpt)


def test_styles_rewrite_the_solution_tokens_only(tiny):
    _, tok = tiny
    assert STYLES["reversed"]("ab cd\nef") == "ba dc\nfe"
    plain, rev = (sft_batches(tok, 2, 7, 2, torch.device("cpu"), s)[0] for s in ("solutions", "reversed"))
    first = plain.loss_mask[0].nonzero()[0, 0]
    assert torch.equal(plain.input_ids[0, :first], rev.input_ids[0, :first])  # the same chat prompt
    assert not torch.equal(plain.labels[0][plain.loss_mask[0] > 0][:5], rev.labels[0][rev.loss_mask[0] > 0][:5])
    assert int(rev.labels[0][rev.loss_mask[0] > 0][-1]) == tok.eos_token_id
    with pytest.raises(ValueError, match="unknown drift style 'shouting'"):
        sft_batches(tok, 2, 7, 2, torch.device("cpu"), "shouting")


def test_drift_moves_the_backbone_not_the_heads(tiny, ctx):
    ckpt, tok = tiny
    policy = load_policy(ckpt, ctx, with_heads=True)
    heads = {k: v.clone() for k, v in policy.heads.state_dict().items() if torch.is_tensor(v)}
    gpt = {k: v.clone() for k, v in policy.gpt.state_dict().items() if torch.is_tensor(v)}
    drift = SFTDrift(policy, tok, "reversed", lr=1e-3, batch=2, steps=1)
    with torch.no_grad():
        before = float(nll(drift.train[0], forward_logprobs(policy, drift.train, 1.0)[0])[0])
    for _ in range(4):
        drift.step()
    with torch.no_grad():
        after = float(nll(drift.train[0], forward_logprobs(policy, drift.train, 1.0)[0])[0])
    assert after < before
    assert all(torch.equal(v, heads[k]) for k, v in policy.heads.state_dict().items() if k in heads)
    assert any(not torch.equal(v, gpt[k]) for k, v in policy.gpt.state_dict().items() if k in gpt)
    assert torch.isfinite(torch.tensor(drift.held_nll()))


def test_drift_bad_settings(tiny, ctx):
    ckpt, tok = tiny
    policy = load_policy(ckpt, ctx)
    for steps, batch, lr in ((-1, 2, 1e-4), (1, 0, 1e-4), (1, 2, 0.0)):
        with pytest.raises(ValueError, match="drift needs steps >= 0, batch >= 1 and lr > 0"):
            SFTDrift(policy, tok, "upper", lr, batch, steps)
    with pytest.raises(RuntimeError, match="built for 0 steps"):
        SFTDrift(policy, tok, "upper", 1e-4, 2, 0).step()
