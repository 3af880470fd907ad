"""The vanilla engine: exactness-contract invariances, finish rules, log-probs."""

import torch

from conftest import make_policy
from specroll_mcore.config import SamplingConfig, tiny_llama, tiny_qwen2
from specroll_mcore.model import causal_mask
from specroll_mcore.rollout import VanillaEngine

PROMPTS = [[11, 12, 13, 14], [21], [31, 32, 33, 34, 35, 36, 37], [41, 42]]


def by_key(out):
    return {(p, s): (t, lp) for p, s, t, lp in zip(out.prompt_index, out.sample_index, out.tokens, out.logprobs)}


def test_same_seed_same_tokens_any_batch_and_order(ctx):
    """float64: no near-ties, so the tokens must be identical whatever the batch composition."""
    model = make_policy(tiny_qwen2(params_dtype="float64"), ctx, seed=3)
    engine = VanillaEngine(model, eos_token_ids=[7])
    sp = SamplingConfig(temperature=1.0, top_p=0.95, max_new_tokens=24, num_samples=3, seed=11)
    full = by_key(engine.generate(PROMPTS, sp, step=4))
    for subset in ([2, 0], [3], [1, 3, 0, 2]):
        part = by_key(engine.generate([PROMPTS[i] for i in subset], sp, step=4, prompt_ids=subset))
        for k, (toks, lp) in part.items():
            assert toks == full[k][0]
            assert torch.allclose(lp, full[k][1], atol=1e-6)
    # The step and seed are part of the key.
    other = by_key(engine.generate(PROMPTS, sp, step=5))
    assert any(other[k][0] != full[k][0] for k in full)


def test_greedy_matches_full_recompute_argmax_and_logprobs(ctx):
    model = make_policy(tiny_llama(), ctx, seed=4)
    engine = VanillaEngine(model)
    out = engine.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=10))
    for p, toks, lp in zip(PROMPTS, out.tokens, out.logprobs):
        seq = p + toks
        with torch.no_grad():
            ids = torch.tensor([seq])
            logits = model.full_logits(model(ids, model.metadata(torch.arange(len(seq))[None],
                                                                  causal_mask(1, len(seq), ids.device))))[0]
        ref = logits[len(p) - 1: -1]
        assert ref.argmax(-1).tolist() == toks
        assert torch.allclose(torch.log_softmax(ref, -1).gather(-1, torch.tensor(toks)[:, None])[:, 0], lp, atol=1e-5)


def test_finish_reasons_eos_length_and_context(ctx):
    model = make_policy(tiny_llama(max_position_embeddings=20), ctx, seed=5)
    greedy = VanillaEngine(model).generate([[3, 4, 5]], SamplingConfig(temperature=0, max_new_tokens=8))
    eos = greedy.tokens[0][2]
    out = VanillaEngine(model, eos_token_ids=[eos]).generate([[3, 4, 5]],
                                                            SamplingConfig(temperature=0, max_new_tokens=8))
    assert out.finish_reason == ["eos"] and out.tokens[0][-1] == eos
    assert len(out.tokens[0]) == greedy.tokens[0].index(eos) + 1
    ignore = VanillaEngine(model, eos_token_ids=[eos]).generate(
        [[3, 4, 5]], SamplingConfig(temperature=0, max_new_tokens=8, ignore_eos=True))
    assert ignore.finish_reason == ["length"] and len(ignore.tokens[0]) == 8
    # The context (20) ends a 15-token prompt's response after 5 tokens.
    ctx_out = VanillaEngine(model).generate([list(range(2, 17))], SamplingConfig(max_new_tokens=50))
    assert ctx_out.finish_reason == ["length"] and len(ctx_out.tokens[0]) == 5


def test_stop_strings(ctx):
    class CharTok:
        """Token id -> one character."""

        def __len__(self):
            return 300

        def decode(self, ids):
            return "".join(chr(ord("a") + i % 26) for i in ids)

    model = make_policy(tiny_llama(), ctx, seed=6)
    base = VanillaEngine(model, tokenizer=CharTok()).generate([[1, 2]],
                                                             SamplingConfig(temperature=0, max_new_tokens=12))
    text = CharTok().decode(base.tokens[0])
    stop = text[4:6]
    out = VanillaEngine(model, tokenizer=CharTok()).generate(
        [[1, 2]], SamplingConfig(temperature=0, max_new_tokens=12, stop=[stop]))
    assert out.finish_reason == ["stop"]
    assert CharTok().decode(out.tokens[0]) == text[: text.index(stop) + len(stop)]


def test_keep_rows_selects_aligned_rows_and_passes_all_kept_through():
    from specroll_mcore.rollout.base import keep_rows
    slots, hidden = torch.tensor([4, 7, 9]), torch.arange(6.0).view(3, 2)
    assert all(a is b for a, b in zip(keep_rows([True] * 3, slots, hidden, None), (slots, hidden, None)))
    kept_slots, kept_hidden, none = keep_rows([True, False, True], slots, hidden, None)
    assert kept_slots.tolist() == [4, 9] and kept_hidden.tolist() == [[0.0, 1.0], [4.0, 5.0]] and none is None
    assert [t.numel() for t in keep_rows([False] * 3, slots, hidden)] == [0, 0]


def test_run_order_is_the_cache_layout_once_packed(ctx):
    """A group's rows in the order the KV cache lays them out once packed (one stage here; across
    stages the last one's order, broadcast: tests/dist/test_fuzz_layouts.py replays a case whose
    stages parted when each read its own)."""
    from specroll_mcore.model.kv_cache import KVCache
    from specroll_mcore.rollout.base import run_order

    cache = KVCache(6, 8, torch.device("cpu"), torch.float32, [1], num_rows=6)
    cache.admit([3, 1, 4, 0])  # rows 0, 1, 2, 3
    slots, tags = torch.tensor([0, 1, 3, 4]), torch.tensor([10, 11, 13, 14])
    ordered, ordered_tags = run_order(cache, ctx, slots, tags)
    assert ordered.tolist() == [3, 1, 4, 0] and ordered_tags.tolist() == [13, 11, 14, 10]
