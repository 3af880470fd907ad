"""Continuous batching (``max_num_seqs``): the same responses as one batch with at most that many in
flight, waiting prompts taking the rows of finished responses, and a KV cache larger than the memory
free refused before it is allocated."""

import dataclasses

import pytest
import torch

from conftest import make_policy
from test_speculative import policy_with_heads
from specroll_mcore.config import GenerateConfig, SamplingConfig, SpecConfig, TrainConfig, tiny_llama, tiny_qwen3_moe
from specroll_mcore.rollout import SpeculativeEngine, VanillaEngine, base

PROMPTS = [[11, 12, 13, 14], [21], [31, 32, 33, 34, 35, 36, 37], [41, 42], [51, 52, 53]]
SAMPLING = SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=30, num_samples=2, seed=5)


def caches_made(model, monkeypatch):
    """The KV caches ``model`` makes from now on, recorded, each with its admissions: per admission the
    slots admitted and the responses then in flight (holding rows before it)."""
    made, new_cache = [], model.new_cache

    def spy(num_slots, capacity, num_rows=None):
        cache = new_cache(num_slots, capacity, num_rows)
        cache.requested, cache.admissions = (num_rows or num_slots, capacity), []
        admit = cache.admit

        def spy_admit(slots):
            cache.admissions.append((list(slots), int((cache.row_of >= 0).sum())))
            admit(slots)

        cache.admit = spy_admit
        made.append(cache)
        return cache

    monkeypatch.setattr(model, "new_cache", spy)
    return made


def prefills_made(monkeypatch):
    """The prompts (indices into PROMPTS) of each prefill forward from now on."""
    prefills, prefill = [], base.prefill

    def spy(model, cache, prompts, *args, **kwargs):
        prefills.append([PROMPTS.index(list(p)) for p in prompts])
        return prefill(model, cache, prompts, *args, **kwargs)

    monkeypatch.setattr(base, "prefill", spy)
    return prefills


def make_engine(engine_name, model, eos, max_num_seqs=None, groups=None):
    if engine_name == "vanilla":
        return VanillaEngine(model, eos_token_ids=[eos], max_num_seqs=max_num_seqs, pipeline_groups=groups)
    return SpeculativeEngine(model, SpecConfig(c_hw=16), eos_token_ids=[eos], max_num_seqs=max_num_seqs,
                             pipeline_groups=groups)


def same_rollout(a, b):
    assert a.prompt_index == b.prompt_index and a.sample_index == b.sample_index
    assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
    assert all(torch.equal(x, y) for x, y in zip(a.logprobs, b.logprobs))


@pytest.mark.parametrize("engine_name", ["vanilla", "specroll"])
def test_continuous_batching_gives_the_rollout_of_one_batch(ctx, monkeypatch, engine_name):
    model = policy_with_heads(tiny_llama(params_dtype="float64"), ctx)
    ids = [7, 3, 9, 0, 4]
    eos = VanillaEngine(model).generate(PROMPTS, SAMPLING, step=3, prompt_ids=ids).tokens[0][9]  # (response 0's 10th)
    whole = make_engine(engine_name, model, eos).generate(PROMPTS, SAMPLING, step=3, prompt_ids=ids)
    assert "eos" in whole.finish_reason and len({len(t) for t in whole.tokens}) > 1  # ragged, early EOS
    made = caches_made(model, monkeypatch)
    prefills = prefills_made(monkeypatch)
    # 5 rows, one prompt's, 3 with two groups of responses, all
    for max_num_seqs, groups in ((5, None), (2, None), (3, 2), (10, None)):
        made.clear()
        prefills.clear()
        out = make_engine(engine_name, model, eos, max_num_seqs, groups).generate(PROMPTS, SAMPLING, step=3,
                                                                                  prompt_ids=ids)
        same_rollout(out, whole)
        (cache,) = made
        assert cache.num_rows == out.stats["kv_cache_rows"] == max_num_seqs and cache.num_slots == 10
        admitted = [s for slots, _ in cache.admissions for s in sorted(slots)]
        assert admitted == list(range(10))  # every response once, in order
        assert all(held + len(slots) <= max_num_seqs for slots, held in cache.admissions)  # never over the rows
        if groups is None:  # every row busy while responses wait (with more groups, one may wait for another's prefill)
            assert all(held + len(slots) == max_num_seqs or 9 in slots for slots, held in cache.admissions)
        if 2 < max_num_seqs < 10:  # responses joined others still in flight (not one batch after another)
            assert len(cache.admissions) > 1 and any(held > 0 for _, held in cache.admissions[1:])
            assert any(len(slots) % 2 for slots, _ in cache.admissions)  # a prompt's samples in two admissions
        assert sorted(p for ps in prefills for p in ps) == list(range(5))  # each prompt once
        assert out.stats["tokens"] == out.num_tokens
        assert out.stats["forwards"] == len(prefills) + len(out.stats["per_step"])  # prefills and steps
        if engine_name == "specroll":  # tau and acceptance over every step
            steps = out.stats["per_step"]
            assert out.stats["tau"] == pytest.approx(sum(p["emitted"] for p in steps) / sum(p["active"] for p in steps))
            assert len(out.stats["tau_per_row"]) == len(PROMPTS) * 2
            assert sum(out.stats["tried_per_depth"]) > 0


@pytest.mark.parametrize("engine_name", ["vanilla", "specroll"])
def test_a_prompt_none_of_whose_responses_holds_a_row_is_prefilled_again(ctx, monkeypatch, engine_name):
    """3 rows, 2 samples a prompt: prompt 1's first response takes the last row and finishes at its first
    token (its EOS) while its second waits; no row holds prompt 1's keys any more, so the second gets
    them from a new prefill."""
    model = policy_with_heads(tiny_llama(params_dtype="float64"), ctx)
    eos = VanillaEngine(model).generate(PROMPTS, SAMPLING).tokens[2][0]  # response 2 = prompt 1, sample 0
    whole = make_engine(engine_name, model, eos).generate(PROMPTS, SAMPLING)
    assert whole.tokens[2] == [eos] and whole.finish_reason[2] == "eos"
    prefills = prefills_made(monkeypatch)
    same_rollout(make_engine(engine_name, model, eos, 3).generate(PROMPTS, SAMPLING), whole)
    assert prefills[:2] == [[0, 1], [1]]  # (the second prefill: right after the first tokens)


@pytest.mark.parametrize("engine_name", ["vanilla", "specroll"])
def test_fewer_rows_than_a_prompts_samples_give_the_rollout_of_one_batch(ctx, monkeypatch, engine_name):
    """max_num_seqs below sampling.num_samples (3): a prompt's samples are never all in flight. In one
    row each response prefills its prompt (no other holds its keys); in two, a later sample copies
    them from one still in flight where it can."""
    model = policy_with_heads(tiny_llama(params_dtype="float64"), ctx)
    sampling = dataclasses.replace(SAMPLING, num_samples=3)
    eos = VanillaEngine(model).generate(PROMPTS, sampling).tokens[0][9]  # (response 0's 10th)
    whole = make_engine(engine_name, model, eos).generate(PROMPTS, sampling)
    assert "eos" in whole.finish_reason and len({len(t) for t in whole.tokens}) > 1  # ragged, early EOS
    made, prefills = caches_made(model, monkeypatch), prefills_made(monkeypatch)
    for max_num_seqs, groups in ((1, None), (2, None), (1, 2)):
        made.clear()
        prefills.clear()
        same_rollout(make_engine(engine_name, model, eos, max_num_seqs, groups).generate(PROMPTS, sampling), whole)
        assert [c.num_rows for c in made] == [max_num_seqs]
        admitted = [s for slots, _ in made[0].admissions for s in sorted(slots)]
        assert admitted == list(range(15)) and all(held + len(s) <= max_num_seqs for s, held in made[0].admissions)
        if max_num_seqs == 1:
            assert prefills == [[p] for p in range(5) for _ in range(3)]
        else:
            assert sorted({p for ps in prefills for p in ps}) == list(range(5)) and len(prefills) < 15


@pytest.mark.parametrize("engine_name", ["vanilla", "specroll"])
def test_prompts_longer_than_a_prefill_forward_are_prefilled_in_pieces(ctx, monkeypatch, engine_name):
    """max_prefill_tokens 3: the prompts of 4 to 7 tokens are prefilled alone in pieces of at most 3
    tokens, each attending to the cache of the pieces before it; all at once and continuously batched,
    the rollout is that of whole prompts (float64: the same tokens, log-probs to rounding)."""
    model = policy_with_heads(tiny_llama(params_dtype="float64"), ctx)
    eos = VanillaEngine(model).generate(PROMPTS, SAMPLING).tokens[0][9]
    whole = make_engine(engine_name, model, eos).generate(PROMPTS, SAMPLING)
    forwards, prefill_forward = [], base._prefill_forward

    def spy(model, cache, pieces, offset, slots):
        forwards.append(([len(p) for p in pieces], offset))
        return prefill_forward(model, cache, pieces, offset, slots)

    monkeypatch.setattr(base, "_prefill_forward", spy)
    for max_num_seqs in (None, 3):
        forwards.clear()
        engine = make_engine(engine_name, model, eos, max_num_seqs)
        engine.max_prefill_tokens = 3
        out = engine.generate(PROMPTS, SAMPLING)
        assert out.tokens == whole.tokens and out.finish_reason == whole.finish_reason
        assert max(float((a - b).abs().max()) for a, b in zip(out.logprobs, whole.logprobs)) < 1e-12
        assert all(len(rows) * max(rows) <= 3 for rows, _ in forwards)
        if max_num_seqs is None:  # prompts 0 (4 tokens), 1 (1), 2 (7), 3 (2), 4 (3), each prompt once
            assert forwards == [([3], 0), ([1], 3), ([1], 0), ([3], 0), ([3], 3), ([1], 6), ([2], 0), ([3], 0)]


def test_continuous_batching_keeps_features_and_expert_routing(ctx):
    """What the policy update and head distillation read from a rollout survives rows that change
    hands (the experts of a finished response are kept when it gives its row back)."""
    model = make_policy(tiny_qwen3_moe(params_dtype="float64"), ctx, seed=2)
    model.record_routing = True
    try:
        whole = VanillaEngine(model).generate(PROMPTS, SAMPLING, features_topk=4)
        out = VanillaEngine(model, max_num_seqs=3).generate(PROMPTS, SAMPLING, features_topk=4)
    finally:
        model.record_routing = False
    same_rollout(out, whole)
    assert out.stats["kv_cache_rows"] == 3
    for a, b in zip(out.routing, whole.routing):
        assert torch.equal(a, b) and a.shape[0] > 0
    for a, b in zip(out.features, whole.features):  # (float64: rows of other batches agree to rounding)
        assert torch.equal(a.top_ids, b.top_ids) and a.hidden.shape[0] == len(a.top_ids) > 0
        assert torch.allclose(a.hidden, b.hidden, atol=1e-12) and torch.allclose(a.top_probs, b.top_probs, atol=1e-12)


def test_kv_cache_bytes_is_what_the_cache_holds(ctx, monkeypatch):
    # (bfloat16: on CPUs where it is batch-invariant, the cache holds whole key blocks of positions)
    models = [make_policy(tiny_llama(), ctx), make_policy(tiny_qwen3_moe(), ctx),
              make_policy(tiny_llama(params_dtype="bfloat16"), ctx)]
    for model in models:
        model.record_routing = True
        made = caches_made(model, monkeypatch)
        try:
            VanillaEngine(model).generate(PROMPTS, SAMPLING)
            cache = made[0]
            held = sum(b.nbytes for b in cache._all_buffers())
            assert held == model.kv_cache_bytes(*cache.requested) > 0 and cache.requested[0] == 10
            assert len(cache._all_buffers()) == (3 if model.config.num_experts else 2)  # keys, values (experts)
        finally:
            model.record_routing = False


def test_a_kv_cache_larger_than_free_memory_is_refused_with_what_fits(ctx, monkeypatch):
    model = make_policy(tiny_llama(), ctx)
    capacity = max(len(p) for p in PROMPTS) + SAMPLING.max_new_tokens
    per_response = model.kv_cache_bytes(1, capacity)
    step = base.step_memory(model, 1)  # a plain step's logits and sampling, per response

    def refusal(rows, kv_gib, step_gib):
        return (rf"the KV cache of {rows} responses of up to 37 positions \({kv_gib} GiB\) and a step's logits and "
                rf"sampling over the vocabulary \({step_gib} GiB for {rows} tokens\) need .* GiB on this rank, which "
                rf"has .* GiB free; ")

    monkeypatch.setattr(base, "available_memory", lambda device: 5 * (per_response + step) + 1)
    made = caches_made(model, monkeypatch)
    with pytest.raises(ValueError, match=refusal(10, r"0\.00", r"0\.00")
                       + r"set max_num_seqs to at most 5 \(the responses decoded at once\)"):
        VanillaEngine(model).generate(PROMPTS, SAMPLING)
    assert not made  # refused before anything was allocated
    out = VanillaEngine(model, max_num_seqs=5).generate(PROMPTS, SAMPLING)  # what the error advised
    assert out.stats["kv_cache_rows"] == 5 and [c.num_rows for c in made] == [5]
    # the KV cache alone would fit: the step's logits and sampling do not
    monkeypatch.setattr(base, "available_memory", lambda device: 5 * per_response + 4 * step)
    with pytest.raises(ValueError, match=refusal(5, r"0\.00", r"0\.00") + "set max_num_seqs to at most 4"):
        VanillaEngine(model, max_num_seqs=5).generate(PROMPTS, SAMPLING)
    monkeypatch.setattr(base, "available_memory", lambda device: per_response + step)
    out = VanillaEngine(model, max_num_seqs=1).generate(PROMPTS, SAMPLING)  # (below a prompt's 2 samples)
    assert out.stats["kv_cache_rows"] == 1
    monkeypatch.setattr(base, "available_memory", lambda device: per_response + step - 1)
    with pytest.raises(ValueError, match="not even one response fits: lower sampling.max_new_tokens"):
        VanillaEngine(model, max_num_seqs=1).generate(PROMPTS, SAMPLING)
    # a speculative step verifies trees: one response's step holds min(n_max, C_hw) tokens
    spec_model = policy_with_heads(tiny_llama(), ctx)
    engine = SpeculativeEngine(spec_model, SpecConfig(c_hw=8))
    per_spec = spec_model.kv_cache_bytes(1, len(PROMPTS[0]) + SAMPLING.max_new_tokens + engine.spec.n_max)
    monkeypatch.setattr(base, "available_memory", lambda device: per_spec + 8 * step)
    assert engine.generate(PROMPTS[:1], dataclasses.replace(SAMPLING, num_samples=1)).stats["kv_cache_rows"] == 1
    monkeypatch.setattr(base, "available_memory", lambda device: per_spec + 8 * step - 1)
    with pytest.raises(ValueError, match="for 8 tokens.* not even one response fits"):
        engine.generate(PROMPTS[:1], dataclasses.replace(SAMPLING, num_samples=1))
    monkeypatch.setattr(base, "available_memory", lambda device: None)  # unknown: not checked
    VanillaEngine(model).generate(PROMPTS[:1], SAMPLING)


def test_the_step_tokens_of_a_speculative_rollout_bound_its_trees(ctx):
    """SpeculativeEngine.step_tokens: every row's node budget (n_min .. n_max, C_hw over the rows) at
    any count of unfinished responses, per pipeline group."""
    model = policy_with_heads(tiny_llama(), ctx)
    engine = SpeculativeEngine(model, SpecConfig(c_hw=64, n_min=2, n_max=16))
    assert [engine.step_tokens(r) for r in (0, 1, 4, 8, 32, 100)] == [0, 16, 64, 64, 64, 200]
    from specroll_mcore.tree import node_budget

    for rows in range(1, 80):
        assert engine.step_tokens(rows) >= max(a * node_budget(a, 64, 2, 16) for a in range(1, rows + 1))
    engine.groups = 2  # (two pipeline stages: each group of rows under its own budget)
    assert [engine.step_tokens(r) for r in (1, 3, 8, 200)] == [16, 32 + 16, 64 + 64, 200 + 200]


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_steps_memory_beyond_the_kv_cache_is_within_its_bound(ctx, monkeypatch, top_p):
    """What whole rollouts allocate beyond their KV cache, measured by torch's profiler on a model with
    32768 ids (where the vocabulary's tensors dominate), on the path a GPU runs: the noise in one pass
    over the rows and top-p over whole rows (and, in the speculative engine, every tree node sampled
    at once), is within base.step_memory of the most tokens a step samples, and not far below it."""
    from torch.profiler import ProfilerActivity, profile

    from specroll_mcore import sampling

    monkeypatch.setattr(sampling, "CPU_CHUNK", 1 << 62)
    monkeypatch.setattr(sampling, "NUCLEUS_WINDOW", 1 << 30)
    monkeypatch.setenv("SPECROLL_NOISE_KERNEL", "0")
    monkeypatch.setenv("SPECROLL_PACKED_GEMM", "0")
    monkeypatch.setenv("SPECROLL_ACCEPT_AT_ONCE", "1")
    model = policy_with_heads(tiny_llama(vocab_size=32768, num_layers=2), ctx)
    caches = []
    new_cache = model.new_cache

    def recorded(num_slots, capacity, num_rows=None):
        caches.append(model.kv_cache_bytes(num_rows or num_slots, capacity))
        return new_cache(num_slots, capacity, num_rows)

    monkeypatch.setattr(model, "new_cache", recorded)

    def peak_beyond_kv(engine, prompts, sp):
        engine.generate(prompts, sp)  # (first-use allocations apart)
        caches.clear()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            engine.generate(prompts, sp)
        held = peak = 0
        for e in sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start):
            held += e.self_cpu_memory_usage
            peak = max(peak, held)
        return peak - sum(caches)

    for P, G in ((1, 1), (4, 4)):
        prompts = [[(7 * i + j) % 32768 for j in range(5 + i)] for i in range(P)]
        sp = SamplingConfig(temperature=1.0, top_p=top_p, max_new_tokens=8, num_samples=G, seed=3)
        for engine, tokens in ((VanillaEngine(model), P * G),
                               (SpeculativeEngine(model, SpecConfig(c_hw=64)), min(P * G * 16, 64))):
            bound = base.step_memory(model, tokens)
            assert 0.4 * bound < peak_beyond_kv(engine, prompts, sp) <= bound, (type(engine).__name__, P * G)


def test_a_rank_that_cannot_tell_its_free_memory_follows_the_one_that_is_short(ctx, monkeypatch):
    """The verdict of another rank of the model-parallel group (a tensor-parallel peer with room for 2
    responses, here the all-reduce's result) refuses the rollout on this one too."""
    model = make_policy(tiny_llama(), ctx)
    monkeypatch.setattr(base, "available_memory", lambda device: None)

    def peer_is_short(tensor, op="sum"):
        tensor[0], tensor[1] = 1.0, max(float(tensor[1]), -2.0)
        return tensor

    monkeypatch.setattr(ctx, "all_reduce_tp", peer_is_short)
    with pytest.raises(ValueError, match="need more memory than another rank of its model-parallel group has free; "
                                         "set max_num_seqs to at most 2"):
        VanillaEngine(model).generate(PROMPTS, SAMPLING)


def test_available_memory_on_this_cpu():
    free = base.available_memory(torch.device("cpu"))
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    assert 0 < free <= total


def test_max_num_seqs_and_max_prefill_tokens_errors(ctx):
    model = make_policy(tiny_llama(), ctx)
    with pytest.raises(ValueError, match="max_prefill_tokens must be a positive number of tokens a prefill forward "
                                         "takes, got 0"):
        VanillaEngine(model, max_prefill_tokens=0)
    with pytest.raises(ValueError, match="max_prefill_tokens must be a positive number of tokens"):
        SpeculativeEngine(policy_with_heads(tiny_llama(), ctx), SpecConfig(c_hw=16), max_prefill_tokens=-3)
    for bad in (0, -2, 1.5, True, "8"):
        with pytest.raises(ValueError, match="max_num_seqs must be a positive number of responses"):
            VanillaEngine(model, max_num_seqs=bad)
    with pytest.raises(ValueError, match="GenerateConfig.max_num_seqs must be a positive number"):
        GenerateConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="TrainConfig.max_num_seqs must be a positive number"):
        TrainConfig(max_num_seqs=-1)
    assert TrainConfig(max_num_seqs=2).max_num_seqs == 2  # (below GRPO's default groups of 4)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="GenerateConfig.max_prefill_tokens must be a positive number of tokens"):
            GenerateConfig(max_prefill_tokens=bad)
    with pytest.raises(ValueError, match="TrainConfig.max_prefill_tokens must be a positive number of tokens"):
        TrainConfig(max_prefill_tokens=-1)
