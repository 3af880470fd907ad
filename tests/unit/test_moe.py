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


def switch_loss(inputs, weight, topk, coeff):
    """The Switch load-balancing loss computed here from a router's inputs [T, h] (real tokens only):
    coeff * E * sum_e f_e P_e, f_e the share of the k x T routed slots expert e takes, P_e its mean
    softmax probability."""
    probs = torch.softmax(inputs.double() @ weight.T, dim=-1)
    chosen = torch.zeros_like(probs).scatter(1, probs.topk(topk, dim=-1).indices, 1.0)
    f = chosen.sum(0) / (topk * inputs.shape[0])
    return coeff * weight.shape[0] * (f * probs.mean(0)).sum()


def test_load_balancing_loss_and_its_gradient_leave_the_padding_out(ctx):
    """ModelConfig.moe_aux_loss_coeff: megatron-core's routers add the Switch loss of each micro-batch
    (weighed by 1 / micro-batches); its value and its gradient on the last router equal the loss
    computed here on the real tokens alone (with the padding counted, they differ), and recomputed
    activations give the same gradients and logged value."""
    from specroll_mcore.rl.schedule import (forward_backward, moe_aux_loss, pack_micro_batch, routers_training,
                                            set_moe_aux_loss_scale)

    coeff = 0.5
    policy = make_policy(tiny_qwen3_moe(num_experts=8, num_layers=2, params_dtype="float64",
                                        moe_aux_loss_coeff=coeff), ctx)
    g = torch.Generator().manual_seed(0)
    seqs = [([1, 2, 3], torch.randint(5, 300, (n,), generator=g).tolist(), None, 1.0) for n in (9, 4, 6)]
    mbs = [pack_micro_batch(seqs[:2], ctx.device), pack_micro_batch(seqs[2:], ctx.device)]  # padded rows
    routers = [layer.mlp.router for layer in policy.gpt.decoder.layers]
    inputs = {id(r): [] for r in routers}
    for r in routers:
        r.register_forward_pre_hook(lambda mod, args: inputs[id(mod)].append(args[0].detach()))

    def run(recompute):
        for r in routers:
            inputs[id(r)].clear()
        policy.zero_grad(set_to_none=True)
        set_moe_aux_loss_scale(len(mbs))
        with routers_training(policy):
            # the policy loss times 0: only the load-balancing loss moves the routers
            forward_backward(policy, mbs, lambda mb, lp: (0 * lp.masked_fill(mb.loss_mask == 0, 0).sum(), {}), 1.0,
                             recompute)
        return [r.weight.grad.clone() for r in routers], moe_aux_loss(policy, len(mbs), recompute)

    grads, logged = run(False)
    assert not any(r.training for r in routers)  # back in evaluation mode
    expected, total = [], 0.0
    for r in routers:
        w = r.weight.detach().clone().requires_grad_()
        loss = 0.0
        for mb, x in zip(mbs, inputs[id(r)][:len(mbs)]):  # [L, b, h] -> the real tokens' rows
            real = torch.arange(x.shape[0])[:, None] < mb.lengths[None, :]
            loss = loss + switch_loss(x[real], w, 2, coeff) / len(mbs)
        expected.append(torch.autograd.grad(loss, w)[0])
        total += float(loss.detach()) / coeff
    # the last router's gradient (the first one's also takes the second's loss through the hidden
    # states); megatron-core computes the loss's probabilities in float32
    torch.testing.assert_close(grads[-1], expected[-1], rtol=1e-5, atol=1e-7)
    assert (grads[-1] - expected[-1]).abs().max() < 1e-4 * expected[-1].abs().max()
    assert logged == pytest.approx(total / len(routers), rel=1e-6)
    assert 1.0 < logged < 8.0  # 1: perfectly balanced; at most E
    grads_r, logged_r = run(True)
    assert logged_r == pytest.approx(logged, rel=1e-12)
    for a, b in zip(grads, grads_r):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("engine", ["vanilla", "specroll"])
def test_rollouts_keep_each_tokens_experts(ctx, engine):
    """A policy that records routing keeps, per response, the experts every token it took in was routed
    to (prompt and response, through prefill, the shared prompt cache, decoding or tree verification
    and its commits, and rows finishing early): those a whole-sequence forward routes it to."""
    from test_speculative import policy_with_heads
    from specroll_mcore.config import SamplingConfig, SpecConfig
    from specroll_mcore.model.routing import recorded_routing
    from specroll_mcore.rollout import SpeculativeEngine, VanillaEngine

    policy = policy_with_heads(tiny_qwen3_moe(num_experts=8, num_layers=2, params_dtype="float64"), ctx)
    policy.record_routing = True
    prompts = [[5, 9, 13, 2, 77], [40, 8]]
    sp = SamplingConfig(temperature=1.0, max_new_tokens=14, num_samples=3, seed=3)
    eos = VanillaEngine(policy).generate(prompts, sp).tokens[1][6]  # a token some response emits: ragged ends
    make = (lambda: VanillaEngine(policy, eos_token_ids=[eos])) if engine == "vanilla" else \
        (lambda: SpeculativeEngine(policy, SpecConfig(c_hw=32, n_max=8), eos_token_ids=[eos]))
    out = make().generate(prompts, sp)
    assert len({len(t) for t in out.tokens}) > 1
    assert engine == "vanilla" or out.stats["tau"] > 1.2  # accepted drafts: commits compacted tree nodes
    for k, (toks, routed) in enumerate(zip(out.tokens, out.routing)):
        seq = prompts[k // 3] + toks
        assert routed.dtype == torch.int16 and routed.shape == (len(seq) - 1, 2, 2)
        with torch.no_grad(), recorded_routing(policy.routers) as recorded:
            logits(policy, torch.tensor([seq[:-1]]))
        want = torch.stack(recorded, dim=1)  # [tokens, layers, k]
        assert torch.equal(routed.long().sort(-1).values, want.sort(-1).values), k
    policy.record_routing = False
    assert make().generate(prompts, sp).routing is None


def test_update_routes_each_token_to_its_rollout_experts(ctx):
    """A micro-batch's routing reaches the router rows of its tokens (megatron's [s, b] order), in the
    forward and in the backward's recomputation; tokens past it (the last, padding) take experts
    0 .. k - 1. Replaying the experts the update would pick anyway changes nothing, bit for bit;
    replaying others changes the log-probs, and recomputed activations give the same gradients."""
    from specroll_mcore.model.routing import recorded_routing
    from specroll_mcore.rl.schedule import forward_backward, forward_logprobs, pack_micro_batch

    policy = make_policy(tiny_qwen3_moe(num_experts=8, num_layers=2, params_dtype="float64"), ctx)
    g = torch.Generator().manual_seed(0)
    seqs = [([1, 2, 3], torch.randint(5, 300, (n,), generator=g).tolist(), None, 1.0, True) for n in (9, 4, 6)]
    maps = []
    for r in policy.routers:
        r.register_forward_hook(lambda mod, args, out: maps.append(out[1].detach().clone()))

    def own(seq):  # the experts a whole-sequence forward picks for the tokens a rollout took in
        with torch.no_grad(), recorded_routing(policy.routers) as recorded:
            logits(policy, torch.tensor([seq[0] + seq[1][:-1]]))
        return torch.stack(recorded, dim=1).to(torch.int16)

    plain = pack_micro_batch(seqs, ctx.device)
    same = pack_micro_batch([(*s, own(s)) for s in seqs], ctx.device)
    with pytest.raises(ValueError, match="every sequence of a micro-batch carries its rollout's routing or none"):
        pack_micro_batch([seqs[0], (*seqs[1], own(seqs[1]))], ctx.device)
    other = [(*s, torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(2 * (len(s[0]) + len(s[1]) - 1))])
              .view(-1, 2, 2).to(torch.int16)) for s in seqs]
    forced = pack_micro_batch(other, ctx.device)
    assert forced.routing.shape == (3, 12, 2, 2)
    maps.clear()
    lp_plain, lp_same, lp_forced = (forward_logprobs(policy, [mb], 1.0)[0] for mb in (plain, same, forced))
    taken_in = torch.arange(12)[None] < plain.lengths[:, None] - 1  # (the last token and padding: filler experts)
    assert torch.equal(lp_plain[taken_in], lp_same[taken_in]) and not torch.equal(lp_plain, lp_forced)
    for layer in range(2):
        routed = maps[4 + layer].view(12, 3, 8).transpose(0, 1)  # [b, s, E] of the forced forward
        for b, (p, t, *_, r) in enumerate(other):
            n = len(p) + len(t) - 1
            want = torch.zeros(12, 8, dtype=torch.bool)
            want[torch.arange(12)[:, None], torch.cat([r[:, layer].long(), torch.arange(2).expand(12 - n, 2)])] = True
            assert torch.equal(routed[b], want), (b, layer)
    assert all(r.router_replay.router_replay_action is None for r in policy.routers)  # idle afterwards

    def grads(recompute):
        policy.zero_grad(set_to_none=True)
        maps.clear()
        forward_backward(policy, [forced, same], lambda mb, lp: (lp.masked_fill(mb.loss_mask == 0, 0).sum(), {}), 1.0,
                         recompute)
        return [p.grad.clone() for p in policy.gpt.parameters() if p.grad is not None], len(maps)

    (kept, n_kept), (again, n_again) = grads(False), grads(True)
    assert (n_kept, n_again) == (2 * 2, 2 * 2 * 2)  # the recomputation ran the routers again
    for a, b in zip(kept, again):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_expert_shards_split_and_join_the_experts():
    """Expert parallelism's load-time split (each EP rank keeps its consecutive experts, numbered from
    0) and the save-time join give back the full set; other tensors pass through."""
    from specroll_mcore.checkpoint.shard import expert_shard, expert_unshard

    full = {f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc{j}.weight": torch.full((2,), 10. * i + e)
            for i in range(2) for e in range(4) for j in (1, 2)}
    full["decoder.layers.0.mlp.router.weight"] = torch.zeros(4, 2)
    parts = [expert_shard(full, 4, 2, rank) for rank in range(2)]
    assert parts[1]["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"][0] == 12.0
    assert all("decoder.layers.0.mlp.router.weight" in p for p in parts)
    for p in parts:  # 2 layers x 2 local experts (numbered 0, 1) x 2 linears
        assert sorted({int(k.split(".")[6]) for k in p if ".experts." in k}) == [0, 1]
        assert sum(".experts." in k for k in p) == 8
    joined = expert_unshard([{k: v for k, v in p.items() if ".experts." in k} for p in parts], 4)
    assert set(joined) == {k for k in full if ".experts." in k}
    assert all(torch.equal(joined[k], full[k]) for k in joined)
    with pytest.raises(KeyError, match="expert 4 of a model with 4 experts"):
        expert_shard({"decoder.layers.0.mlp.experts.local_experts.4.linear_fc1.weight": torch.zeros(1)}, 4, 2, 0)


@pytest.mark.parametrize("form", ["ModuleSpec", "partial"])
def test_layer_spec_swaps_reach_both_forms_of_megatron_specs(form):
    """megatron-core 0.16 gives MLP, mixture-of-experts and experts specs as ModuleSpecs, 0.17 and later
    as functools.partial of their builders with submodules= bound. The layer spec's swaps (packed
    linears, experts that skip the empty ones) reach both, keeping every other argument; the form
    the installed megatron-core gives is built whole in the tests above."""
    import functools

    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    from specroll_mcore.cpu_gemm import PackedColumnParallelLinear, PackedRowParallelLinear
    from specroll_mcore.model import gpt

    mlp = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    spec = (ModuleSpec(module=SequentialMLP, submodules=mlp, params={"gate": True}) if form == "ModuleSpec"
            else functools.partial(SequentialMLP, submodules=mlp, gate=True))
    swapped = gpt._with_module(gpt._packed_mlp(spec), SpecRollSequentialMLP)
    assert type(swapped) is type(spec)
    built, params = ((swapped.module, swapped.params) if form == "ModuleSpec"
                     else (swapped.func, {k: v for k, v in swapped.keywords.items() if k != "submodules"}))
    assert built is SpecRollSequentialMLP and params == {"gate": True}
    assert gpt._submodules(swapped) == MLPSubmodules(linear_fc1=PackedColumnParallelLinear,
                                                     linear_fc2=PackedRowParallelLinear)
    assert gpt._submodules(spec) is mlp  # the spec given is left as it was
