"""GPU checks: the same contracts as the CPU suite, on nccl/CUDA (`python -m pytest tests/gpu` on a GPU
machine; tools/gpu_checks.sh runs them first). Without CUDA they run on the CPU, so that the CPU suite
keeps them in step with the code they call."""

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def gpu_ctx():
    from specroll_mcore import parallel
    from specroll_mcore.config import ParallelConfig

    return parallel.initialize(ParallelConfig())


def _policy(ctx, dtype="float32", make=None, **overrides):
    from specroll_mcore.checkpoint import random_full_state_dict
    from specroll_mcore.config import tiny_qwen2
    from specroll_mcore.model import PolicyModel

    cfg = (make or tiny_qwen2)(params_dtype=dtype, **overrides)
    model = PolicyModel(cfg, ctx, num_heads=3).eval()
    model.load_full_state_dict({k: v.to(DEVICE) for k, v in random_full_state_dict(cfg, 0, std=0.08).items()})
    return model


def _check_cache_against_recompute(model, new_tokens):
    """Greedy decoding with the KV cache picks what one full forward over the result picks."""
    from specroll_mcore.config import SamplingConfig
    from specroll_mcore.model import causal_mask
    from specroll_mcore.rollout import VanillaEngine

    out = VanillaEngine(model).generate([[3, 4, 5, 6]], SamplingConfig(temperature=0, max_new_tokens=new_tokens))
    seq = [3, 4, 5, 6] + out.tokens[0]
    ids = torch.tensor([seq], device=DEVICE)
    with torch.no_grad():
        logits = model.full_logits(model(ids, model.metadata(torch.arange(len(seq), device=DEVICE)[None],
                                                              causal_mask(1, len(seq), ids.device))))[0]
    assert logits[3:-1].argmax(-1).tolist() == out.tokens[0]


def test_kv_cache_matches_recompute_on_gpu(gpu_ctx):
    _check_cache_against_recompute(_policy(gpu_ctx), 16)


def test_speculative_equals_vanilla_on_gpu(gpu_ctx):
    from specroll_mcore.config import SamplingConfig, SpecConfig
    from specroll_mcore.rollout import SpeculativeEngine, VanillaEngine

    model = _policy(gpu_ctx, "float64")
    sp = SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=32, num_samples=4, seed=3)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    a = VanillaEngine(model).generate(prompts, sp)
    b = SpeculativeEngine(model, SpecConfig(c_hw=64)).generate(prompts, sp)
    assert a.tokens == b.tokens
    synced = SpeculativeEngine(model, SpecConfig(c_hw=64), sync_timers=True).generate(prompts, sp)
    assert synced.tokens == a.tokens and synced.stats["time_split_s"]["verify"] > 0


def test_reflex_and_slow_path_on_gpu(gpu_ctx):
    """Both adaptation paths on CUDA: tokens equal vanilla, and a consolidation runs and changes one head."""
    from specroll_mcore.config import ReflexConfig, SamplingConfig, SlowPathConfig, SpecConfig
    from specroll_mcore.rollout import SpeculativeEngine, VanillaEngine

    model = _policy(gpu_ctx, "float64")
    with torch.no_grad():
        for layer in model.heads.layers:
            layer.weight.normal_(0, 0.3)
    spec = SpecConfig(c_hw=64, reflex=ReflexConfig(alpha=0.5, z_delta=0.0, min_observations=2),
                      slow_path=SlowPathConfig(window=4, min_records=8, cooldown_batches=0, time_cap=1.0,
                                               reference_windows=1, degraded_windows=1, tolerance=0.05))
    engine = SpeculativeEngine(model, spec)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    for step in range(3):
        sp = SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=32, num_samples=2, seed=step)
        assert VanillaEngine(model).generate(prompts, sp, step=step).tokens == \
            engine.generate(prompts, sp, step=step).tokens
    before = model.heads.layers[2].weight.detach().clone()
    engine.slow_path.expected_acceptance = lambda rec, head, dv=None: 0.0
    event = engine.slow_path.consolidate(2)
    assert event["kept"] and not torch.equal(before, model.heads.layers[2].weight)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


@pytest.mark.parametrize("arch", ["qwen3", "llama3", "qwen2_yarn", "qwen3_moe"])
def test_architectures_on_gpu(gpu_ctx, arch):
    """Qwen3's query/key norms, Llama 3.1's and YaRN's RoPE, and a Qwen3-MoE's experts (megatron-core's
    MoELayer, without Transformer Engine) on the device: cached decoding equals a full recompute, and
    the speculative engine emits the vanilla engine's tokens."""
    from specroll_mcore.config import SamplingConfig, SpecConfig, tiny_llama, tiny_qwen2, tiny_qwen3, tiny_qwen3_moe
    from specroll_mcore.rollout import SpeculativeEngine, VanillaEngine

    make, overrides = {"qwen3": (tiny_qwen3, {}), "llama3": (tiny_llama, {"rope_scaling": LLAMA3}),
                       "qwen2_yarn": (tiny_qwen2, {"rope_scaling": YARN}), "qwen3_moe": (tiny_qwen3_moe, {})}[arch]
    model = _policy(gpu_ctx, "float64", make, **overrides)
    _check_cache_against_recompute(model, 24)
    sp = SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=24, num_samples=3, seed=5)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    assert SpeculativeEngine(model, SpecConfig(c_hw=64)).generate(prompts, sp).tokens == \
        VanillaEngine(model).generate(prompts, sp).tokens


def test_routing_replay_on_gpu(gpu_ctx):
    """A Qwen3-MoE's rollout keeps each token's experts on the device (tree commits included), and the
    update's forward replays them: kept as the rollout routed them, its log-probs equal the forward
    that routes by itself on every token a rollout took in."""
    from specroll_mcore.config import SamplingConfig, SpecConfig, tiny_qwen3_moe
    from specroll_mcore.model import causal_mask
    from specroll_mcore.model.routing import recorded_routing
    from specroll_mcore.rl.schedule import forward_logprobs, pack_micro_batch
    from specroll_mcore.rollout import SpeculativeEngine

    model = _policy(gpu_ctx, "float64", tiny_qwen3_moe)
    model.record_routing = True
    prompts = [[1, 2, 3], [4, 5]]
    out = SpeculativeEngine(model, SpecConfig(c_hw=64)).generate(
        prompts, SamplingConfig(temperature=1.0, max_new_tokens=16, num_samples=2, seed=5))
    model.record_routing = False
    seqs = [(prompts[k // 2], toks, None, 1.0, True, routed) for k, (toks, routed) in
            enumerate(zip(out.tokens, out.routing))]
    for p, toks, *_, routed in seqs:
        seq = torch.tensor([p + toks[:-1]], device=DEVICE)
        with torch.no_grad(), recorded_routing(model.routers) as recorded:
            model(seq, model.metadata(torch.arange(seq.shape[1], device=DEVICE)[None],
                                      causal_mask(1, seq.shape[1], DEVICE)))
        assert torch.equal(routed.long().sort(-1).values, torch.stack(recorded, 1).cpu().sort(-1).values)
    replayed = forward_logprobs(model, [pack_micro_batch(seqs, DEVICE)], 1.0)[0]
    routed_by_itself = forward_logprobs(model, [pack_micro_batch([s[:5] for s in seqs], DEVICE)], 1.0)[0]
    mb = pack_micro_batch(seqs, DEVICE)
    taken_in = torch.arange(mb.input_ids.shape[1], device=DEVICE)[None] < mb.lengths[:, None] - 1
    assert torch.equal(replayed[taken_in], routed_by_itself[taken_in])


@pytest.mark.parametrize("bonus", [False, True])
def test_update_attention_and_log_probs_in_pieces_on_gpu(gpu_ctx, bonus):
    """The policy update's forward-backward on ragged, right-padded sequences, as the trainer runs it
    (causal attention without a mask: on CUDA in bfloat16, FlashAttention's kernel) and with log-probs
    in pieces of 5 positions, against an explicit causal mask over the whole span: the same loss and
    gradients (to bfloat16's rounding on the device; float32 elsewhere). ``bonus``: with an entropy
    bonus in the loss (its gradient through the vocabulary-parallel entropy, rebuilt with each piece)."""
    from specroll_mcore.model import causal_mask
    from specroll_mcore.rl.schedule import forward_backward, pack_micro_batch

    dtype = "bfloat16" if DEVICE.type == "cuda" else "float32"
    model = _policy(gpu_ctx, dtype)
    g = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(0, 300, (p,), generator=g).tolist(), torch.randint(0, 300, (r,), generator=g).tolist(),
             None, 1.0) for p, r in ((5, 17), (3, 6), (9, 11))]
    mbs = [pack_micro_batch(seqs, DEVICE)]
    causal = model.metadata

    def explicit_mask(positions, new_token_mask, *rest, **kw):
        return causal(positions, causal_mask(*positions.shape, positions.device, mbs[0].lengths.to(positions.device))
                      if new_token_mask is None else new_token_mask, *rest, **kw)

    def update(metadata, chunk):
        model.zero_grad()
        model.metadata = metadata
        try:
            parts = forward_backward(model, mbs, lambda mb, lp, *entropy: (
                (out := (lp * mb.loss_mask).sum() + sum(0.5 * (e * mb.loss_mask).sum() for e in entropy)),
                {"loss": float(out.detach())}), 1.0, logprob_chunk=chunk, entropy_grad=bonus)
        finally:
            model.metadata = causal
        return parts[0]["loss"], [p.grad.float().clone() for p in model.parameters() if p.grad is not None]

    (ref_loss, ref), (loss, grads) = update(explicit_mask, 0), update(causal, 5)
    tol = 2e-2 if dtype == "bfloat16" else 1e-5
    assert loss == pytest.approx(ref_loss, rel=tol) and len(grads) == len(ref) > 0
    for a, b in zip(ref, grads):
        assert (a - b).norm() <= tol * a.norm() + 1e-6, (a - b).norm() / a.norm()


def test_continuous_batching_and_the_kv_cache_memory_check_on_gpu(gpu_ctx):
    """The memory a KV cache may take on this device (a GPU: the driver's free memory and torch's cached
    blocks), what a cache takes, and a rollout continuously batched in 3 rows equal to one batch."""
    from specroll_mcore.config import SamplingConfig
    from specroll_mcore.rollout import VanillaEngine
    from specroll_mcore.rollout.base import available_memory

    model = _policy(gpu_ctx)
    free = available_memory(DEVICE)
    if DEVICE.type == "cuda":
        assert 0 < free <= torch.cuda.mem_get_info(DEVICE)[1]
        block = torch.empty(64 << 20, dtype=torch.uint8, device=DEVICE)
        del block  # (back in torch's cache, not the driver's: still available to a cache)
        assert available_memory(DEVICE) >= free - (1 << 20)
    made = []
    new_cache = model.new_cache
    model.new_cache = lambda num_slots, capacity, num_rows=None: made.append(
        (num_rows or num_slots, capacity)) or new_cache(num_slots, capacity, num_rows)
    prompts = [[3, 4, 5], [6], [7, 8, 9, 10]]
    sp = SamplingConfig(temperature=1.0, max_new_tokens=12, num_samples=2, seed=1)
    whole = VanillaEngine(model).generate(prompts, sp)
    before = torch.cuda.memory_allocated(DEVICE) if DEVICE.type == "cuda" else None
    out = VanillaEngine(model, max_num_seqs=3).generate(prompts, sp)
    del model.new_cache
    assert out.tokens == whole.tokens and out.stats["kv_cache_rows"] == 3 and [n for n, _ in made] == [6, 3]
    assert model.kv_cache_bytes(*made[0]) == 2 * model.kv_cache_bytes(*made[1]) > 0
    if DEVICE.type == "cuda":  # the rollout's cache is freed when it ends
        assert torch.cuda.memory_allocated(DEVICE) - before < model.kv_cache_bytes(*made[1])


def test_the_optimizer_state_waits_in_host_memory_between_steps(gpu_ctx):
    """TrainConfig.offload_optimizer: between steps a bfloat16 policy's float32 main copies and AdamW's
    moments (float32 and bfloat16 parameters alike) are in pinned host memory and the device has their
    bytes back; each step brings them back first, and the weights equal those of an optimizer that
    never moved, bit for bit. (On a CPU nothing moves: the same steps.)"""
    from specroll_mcore.optimizer import MainParamAdamW

    g = torch.Generator().manual_seed(0)
    init = [torch.randn(64, 32, generator=g).bfloat16(), torch.randn(32, generator=g)]
    grads = [[torch.randn(t.shape, generator=g) for t in init] for _ in range(3)]
    runs = {}
    for offload in (False, True):
        params = [torch.nn.Parameter(t.clone().to(DEVICE)) for t in init]
        opt = MainParamAdamW(params, lr=1e-2, weight_decay=0.1)
        for step in grads:
            for p, grad in zip(params, step):
                if p.dtype == torch.bfloat16:
                    p.main_grad = grad.to(DEVICE)
                else:
                    p.grad = grad.to(DEVICE)
            opt.step()
            opt.zero_grad()
            if offload:
                on_device = torch.cuda.memory_allocated(DEVICE) if DEVICE.type == "cuda" else 0
                opt.offload()
                state = [opt.main[0]] + [v for s in opt.optimizer.state.values() for k, v in s.items() if k != "step"]
                assert len(state) == 5  # the main copy, two moments a parameter
                if DEVICE.type == "cuda":
                    assert all(t.device.type == "cpu" and t.is_pinned() for t in state)
                    freed = on_device - torch.cuda.memory_allocated(DEVICE)
                    assert freed >= sum(t.numel() * t.element_size() for t in state), freed
                    assert all(p.device == DEVICE for p in params)
        runs[offload] = [p.detach().cpu() for p in params]
        if offload:
            opt.reload()
            assert all(v.device == DEVICE for s in opt.optimizer.state.values() for k, v in s.items() if k != "step")
    assert all(torch.equal(a, b) for a, b in zip(runs[False], runs[True]))


def test_the_kl_reference_waits_in_host_memory(gpu_ctx):
    """TrainConfig.offload_reference: the KL reference's weights are pinned host copies of the policy's,
    taking no device memory; with them swapped in, a forward gives the logits of the policy they were
    copied from, though the policy has moved since, and afterwards the policy has its own weights back
    and the device's copies are freed. (On a CPU: plain copies, the same values checked.)"""
    from specroll_mcore.model import causal_mask
    from specroll_mcore.rl.trainer import reference_weights, swapped_weights

    model = _policy(gpu_ctx, "bfloat16")
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    meta = model.metadata(torch.arange(12, device=DEVICE)[None].expand(2, 12), causal_mask(2, 12, ids.device))

    def logits():
        with torch.no_grad():
            return model.full_logits(model(ids, meta)).float()

    initial = logits()
    on_device = torch.cuda.memory_allocated(DEVICE) if DEVICE.type == "cuda" else 0
    ref = reference_weights(model, offload=True)
    if DEVICE.type == "cuda":
        assert all(t.device.type == "cpu" and t.is_pinned() for t in ref.values())
        assert torch.cuda.memory_allocated(DEVICE) == on_device
    with torch.no_grad():
        for p in model.gpt.parameters():
            p.add_(0.05 * torch.randn_like(p))
    moved = {k: p.detach().clone() for k, p in model.gpt.named_parameters()}
    after = logits()
    assert (after - initial).abs().max() > 1e-2
    held = torch.cuda.memory_allocated(DEVICE) if DEVICE.type == "cuda" else 0
    with swapped_weights(model, ref):
        torch.testing.assert_close(logits(), initial, rtol=0, atol=0)
    if DEVICE.type == "cuda":  # the reference's device copies are gone
        assert torch.cuda.memory_allocated(DEVICE) == held
    assert all(torch.equal(p, moved[k]) for k, p in model.gpt.named_parameters())
    torch.testing.assert_close(logits(), after, rtol=0, atol=0)
