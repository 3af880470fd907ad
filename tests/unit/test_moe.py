"""Mixtures of experts: inference runs only the experts that received tokens, with megatron-core's
outputs; training keeps megatron's forward, which gives every expert a gradient."""

import pytest
import torch
from megatron.core.transformer.moe.experts import SequentialMLP

from conftest import make_policy
from specroll_mcore.config import tiny_qwen3_moe
from specroll_mcore.model import causal_mask
from specroll_mcore.model.gpt import SpecRollSequentialMLP


def logits(policy, ids):
    b, s = ids.shape
    meta = policy.metadata(torch.arange(s)[None].expand(b, s), causal_mask(b, s, ids.device))
    return policy.full_logits(policy(ids, meta))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_inference_runs_only_routed_experts_and_equals_megatrons_forward(ctx, dtype, monkeypatch):
    policy = make_policy(tiny_qwen3_moe(num_experts=16, num_layers=2, params_dtype=dtype), ctx)
    experts = [layer.mlp.experts for layer in policy.gpt.decoder.layers]
    assert all(type(e) is SpecRollSequentialMLP for e in experts)
    calls = []
    for e in experts:
        for expert in e.local_experts:
            expert.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[0]))
    for ids in (torch.tensor([[7]]), torch.randint(0, 300, (3, 9), generator=torch.Generator().manual_seed(0))):
        calls.clear()
        with torch.no_grad():
            ours = logits(policy, ids)
        ran = list(calls)
        calls.clear()
        monkeypatch.setattr(SpecRollSequentialMLP, "forward", SequentialMLP.forward)  # megatron's: every expert
        with torch.no_grad():
            ref = logits(policy, ids)
        monkeypatch.undo()
        assert torch.equal(ours, ref)
        assert len(calls) == 2 * 16 and all(n > 0 for n in ran) and sum(ran) == sum(calls) == 2 * 2 * ids.numel()
        if ids.numel() == 1:
            assert len(ran) == 2 * 2  # one token, 2 experts a layer


def test_training_gives_every_expert_a_gradient(ctx):
    """One token routes to 2 of 16 experts; the other 14 still take a (zero) gradient, so every
    data-parallel replica reduces the same tensors."""
    policy = make_policy(tiny_qwen3_moe(num_experts=16, num_layers=1), ctx)
    policy.zero_grad(set_to_none=True)
    logits(policy, torch.tensor([[7]])).sum().backward()
    grads = {n: p.grad for n, p in policy.gpt.named_parameters() if ".mlp.experts." in n}
    assert len(grads) == 16 * 2 and all(g is not None for g in grads.values())
    assert sum(bool(g.any()) for g in grads.values()) == 2 * 2  # the routed experts' fc1 and fc2
