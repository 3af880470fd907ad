"""The slow path: records from verification, the drift trigger on synthetic acceptance streams, the
trigger's guards, one-head consolidation that touches nothing else, rollback, exactness with it on,
and its state in checkpoints."""

import copy
import dataclasses

import pytest
import torch

from specroll_mcore.config import ReflexConfig, SamplingConfig, SlowPathConfig, SpecConfig, tiny_llama
from specroll_mcore.heads import DraftVocab
from specroll_mcore.rollout import SpeculativeEngine, VanillaEngine
from specroll_mcore.slow_path import AcceptanceMonitor, RecordBuffer, Records, RecordStreams, SlowPath, chain_tokens

from tests.unit.test_speculative import PROMPTS, policy_with_heads


def feed(monitor, rate, windows, H=3, window=64):
    fired = []
    for _ in range(windows):
        for h in range(H):
            monitor.observe(h, [rate] * window)
        fired.append(monitor.most_degraded())
    return fired


def test_trigger_fires_on_sustained_drop_not_on_isolated_dip():
    m = AcceptanceMonitor(3, SlowPathConfig())
    assert feed(m, 0.5, 5) == [None] * 5  # reference = 0.5
    assert feed(m, 0.1, 1) == [None]  # an isolated dip
    assert feed(m, 0.5, 2) == [None, None]
    assert feed(m, 0.1, 2) == [None, None]  # two degraded windows are not yet sustained
    assert feed(m, 0.2, 1) == [0]  # the third consecutive one is
    m.consolidated(0)
    assert m.degraded() == [1, 2]  # only the consolidated head's count restarts


def test_trigger_needs_the_drop_to_exceed_the_tolerance():
    m = AcceptanceMonitor(3, SlowPathConfig(tolerance=0.2))
    feed(m, 0.5, 3)
    assert set(feed(m, 0.42, 6)) == {None}  # -16%: within tolerance
    assert feed(m, 0.38, 3)[-1] == 0  # -24%


def degrade(m, rates, windows=3):
    for _ in range(windows):
        for h, rate in enumerate(rates):
            m.observe(h, [rate] * 64)


def chain(a):  # independent of chain_tokens: the sum over depths of the chance of reaching them
    return 1 + sum(torch.tensor(a[:d + 1]).prod().item() for d in range(len(a)))


def test_the_head_worth_most_tokens_per_step_is_chosen():
    """Head 2 dropped most (-80% against -30%), but head 0's loss also costs every draft below it:
    restoring head 0 adds more tokens per step to a chain of drafts."""
    m = AcceptanceMonitor(3, SlowPathConfig())
    feed(m, 0.5, 3)
    degrade(m, [0.35, 0.5, 0.1])
    assert m.degraded() == [0, 2]
    now = chain([0.35, 0.5, 0.1])
    assert chain([0.5, 0.5, 0.1]) - now > chain([0.35, 0.5, 0.5]) - now
    assert m.most_degraded() == 0


def test_a_deep_head_is_chosen_when_the_heads_above_it_hold():
    m = AcceptanceMonitor(3, SlowPathConfig())
    feed(m, 0.5, 3)
    degrade(m, [0.44, 0.5, 0.02])  # head 0: -12% (degraded), head 2: -96%
    assert m.degraded() == [0, 2]
    now = chain([0.44, 0.5, 0.02])
    assert chain([0.44, 0.5, 0.5]) - now > chain([0.5, 0.5, 0.02]) - now
    assert m.most_degraded() == 2


def test_chain_tokens():
    assert chain_tokens([]) == 1.0
    assert chain_tokens([0.5, 0.5, 0.1]) == pytest.approx(chain([0.5, 0.5, 0.1])) == pytest.approx(1.775)


def test_monitor_state_of_an_older_checkpoint_starts_afresh():
    """A checkpoint from the monitor of tried drafts (counts of verification events) does not mix
    into windows of record scores: the monitor starts afresh, the rest of the state loads."""
    m = AcceptanceMonitor(3, SlowPathConfig())
    m.load_state_dict({"tried": [10, 0, 0], "accepted": [5, 0, 0], "rates": [[0.5] * 3] * 3,
                       "reference": [0.5] * 3, "consecutive": [3, 0, 0]})
    assert m.state_dict() == AcceptanceMonitor(3, SlowPathConfig()).state_dict()
    assert feed(m, 0.5, 3) == [None] * 3 and m.reference == [0.5] * 3


def test_records_target_the_next_tokens_and_flush_partially_at_the_end():
    H, h, K = 2, 4, 3
    st = RecordStreams(H, h, K)
    hid = torch.arange(6, dtype=torch.float32)[:, None].expand(6, h)
    ids = torch.arange(6)[:, None].expand(6, K) * 10
    probs = torch.full((6, K), 0.2)
    st.add(7, hid[:3], ids[:3], probs[:3], torch.arange(3))
    st.set_delta([7], torch.ones(H, 1, h))  # the proposal made from entry 2
    st.add(7, hid[3:], ids[3:], probs[3:], torch.arange(3, 6))
    rec = st.take()
    assert len(rec) == 4  # entries 0..3 have both targets
    assert rec.realised.tolist() == [[1, 2], [2, 3], [3, 4], [4, 5]]
    assert rec.hidden[:, 0].tolist() == [0, 1, 2, 3]
    assert rec.target_ids[:, :, 0].tolist() == [[10, 20], [20, 30], [30, 40], [40, 50]]
    assert rec.delta[2].abs().sum() > 0 and rec.delta[[0, 1, 3]].abs().sum() == 0
    st.finish(7)
    tail = st.take()
    assert tail.realised[:, 0].tolist() == [5] and tail.valid.tolist() == [[True, False]]
    st.add(7, hid[:2], ids[:2], probs[:2], torch.tensor([8, 9]))  # slot 7 reused: a fresh stream
    st.finish(7)
    again = st.take()
    assert again.realised.tolist() == [[9, 9]] and again.valid.tolist() == [[True, False]]
    assert again.delta.abs().sum() == 0


def reference_records(history, j, H):
    """The record of entry j of one response's full history [(hidden, ids, probs, token, delta)], built
    directly from the definition: targets j+1 .. j+H, missing ones repeat the last and are invalid;
    its root is token j itself."""
    tgt = history[j + 1:j + 1 + H]
    pad = tgt + [tgt[-1]] * (H - len(tgt))
    return (history[j][0], history[j][4], torch.stack([t[1] for t in pad]), torch.stack([t[2] for t in pad]),
            torch.stack([t[3] for t in pad]), torch.tensor([k < len(tgt) for k in range(H)]), history[j][3])


@pytest.mark.parametrize("long_row", [False, True])
def test_batched_records_match_their_definition(long_row):
    """add_rows over ragged rows, with Reflex deltas, then finish: every entry but each response's
    last becomes the record its definition gives; in slot order, oldest first (one step's worth per
    row), or as a whole multiset when a row brings more than H + 1 entries at once."""
    H, h, K = 3, 5, 2
    g = torch.Generator().manual_seed(0)
    steps = [[(0, 2), (4, 4), (1, 1)], [(0, 4), (4, 1)], [(1, 9 if long_row else 4), (0, 3), (4, 2)], [(1, 1)]]
    st = RecordStreams(H, h, K)
    hist = {0: [], 1: [], 4: []}
    done = {0: 0, 1: 0, 4: 0}
    got, want = [], []
    for step in steps:
        n = sum(c for _, c in step)
        hid, ids = torch.randn(n, h, generator=g), torch.randint(0, 50, (n, K), generator=g)
        probs, toks = torch.rand(n, K, generator=g), torch.randint(0, 50, (n,), generator=g)
        st.add_rows([s for s, _ in step], [c for _, c in step], hid, ids, probs, toks)
        start = 0
        for s, c in step:
            hist[s] += [[hid[i], ids[i], probs[i], toks[i], torch.zeros(H, h)] for i in range(start, start + c)]
            start += c
            want += [reference_records(hist[s], j, H) for j in range(done[s], len(hist[s]) - H)]
            done[s] = max(done[s], len(hist[s]) - H)
        delta = torch.randn(H, len(step), h, generator=g)
        st.set_delta([s for s, _ in step], delta)
        for r, (s, _) in enumerate(step):
            hist[s][-1][4] = delta[:, r]
        got.append(st.take())
    st.finish_rows([4, 0, 1])
    for s in (4, 0, 1):
        want += [reference_records(hist[s], j, H) for j in range(done[s], len(hist[s]) - 1)]
    got.append(st.take())
    rec = Records.cat([r for r in got if r is not None])
    expect = Records(*(torch.stack(col) for col in zip(*want)))
    assert len(rec) == sum(len(v) for v in hist.values()) - 3
    if long_row:
        order_got, order_want = rec.hidden[:, 0].argsort(), expect.hidden[:, 0].argsort()
        rec, expect = rec.select(order_got), expect.select(order_want)
    for f in dataclasses.fields(Records):
        assert torch.equal(getattr(rec, f.name), getattr(expect, f.name)), f.name


def test_buffer_keeps_the_most_recent_records_in_order():
    def recs(start, n):
        t = torch.arange(start, start + n, dtype=torch.float32)
        return Records(t[:, None], torch.zeros(n, 1, 1), torch.zeros(n, 1, 1, dtype=torch.long), torch.zeros(n, 1, 1),
                       torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.bool),
                       torch.zeros(n, dtype=torch.long))

    buf = RecordBuffer(5)
    for start in range(0, 12, 3):  # 12 records in 4 adds, over 2 x capacity on the way
        buf.add(recs(start, 3))
    assert len(buf) == 5
    assert buf.records.hidden[:, 0].tolist() == [7, 8, 9, 10, 11]
    assert buf.latest(2, 0).hidden[:, 0].tolist() == [10, 11]


def tiny_engine(ctx, **slow):
    model = policy_with_heads(tiny_llama(params_dtype="float64"), ctx, head_std=0.3)
    cfg = SlowPathConfig(**{**dict(window=4, min_records=8, cooldown_batches=0, time_cap=1.0, max_records=64,
                                   buffer_size=256, steps=5), **slow})
    spec = SpecConfig(c_hw=64, reflex=ReflexConfig(alpha=0.5, z_delta=0.0, min_observations=2), slow_path=cfg)
    return model, SpeculativeEngine(model, spec)


def params_of(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items() if v is not None}


def test_consolidation_changes_one_head_only(ctx):
    model, eng = tiny_engine(ctx)
    eng.generate(PROMPTS, SamplingConfig(temperature=1.0, max_new_tokens=30, num_samples=2, seed=1))
    sp = eng.slow_path
    assert len(sp.buffer) >= 8
    gpt, heads = params_of(model.gpt), params_of(model.heads)
    flags = [p.requires_grad for p in model.heads.parameters()]
    sp.expected_acceptance = lambda rec, head, dv=None: 0.0  # never worse: the update is kept
    used = sp.buffer.latest(sp.cfg.max_records, 1).root
    ev = sp.consolidate(1)
    assert ev["kept"] and ev["steps"] == 5
    assert all(torch.equal(v, params_of(model.gpt)[k]) for k, v in gpt.items())  # backbone + vocab bit for bit
    after = params_of(model.heads)
    # the event's tokens join the draft vocabulary's ranking
    assert torch.equal(after["token_counts"] - heads["token_counts"], torch.bincount(used, minlength=300))
    assert not torch.equal(after["layers.1.weight"], heads["layers.1.weight"])
    assert torch.equal(after["layers.0.weight"], heads["layers.0.weight"])
    assert torch.equal(after["layers.2.weight"], heads["layers.2.weight"])
    assert [p.requires_grad for p in model.heads.parameters()] == flags  # as the caller had them


def bfloat16_slow_path(ctx):
    """A bfloat16 policy whose slow path holds the records of one rollout (Reflex off)."""
    model = policy_with_heads(tiny_llama(params_dtype="bfloat16"), ctx, head_std=0.3)
    cfg = SlowPathConfig(window=4, min_records=8, cooldown_batches=0, time_cap=1.0, max_records=64,
                         buffer_size=256, steps=5)
    eng = SpeculativeEngine(model, SpecConfig(c_hw=64, reflex=ReflexConfig(enabled=False), slow_path=cfg))
    eng.generate(PROMPTS, SamplingConfig(temperature=1.0, max_new_tokens=30, num_samples=2, seed=1))
    return model, eng.slow_path


def test_bfloat16_heads_consolidate_on_float32_main_copies(ctx):
    """The event's Adam steps run on float32 copies of a bfloat16 head (its gradients land in a
    float32 ``main_grad``); nothing of them outlives the event, so the next one starts clean."""
    model, sp = bfloat16_slow_path(ctx)
    sp.expected_acceptance = lambda rec, head, dv=None: 0.0  # never worse: the update is kept
    before = params_of(model.heads)
    for _ in range(2):
        assert sp.consolidate(1)["kept"]
        for p in model.heads.parameters():
            assert p.dtype == torch.bfloat16 and p.grad is None and not hasattr(p, "main_grad")
            assert not p._post_accumulate_grad_hooks
    assert not torch.equal(params_of(model.heads)["layers.1.weight"], before["layers.1.weight"])


def test_consolidation_rolls_back_when_heldout_acceptance_drops(ctx):
    model, eng = tiny_engine(ctx)
    eng.generate(PROMPTS, SamplingConfig(temperature=1.0, max_new_tokens=30, num_samples=2, seed=1))
    sp = eng.slow_path
    scores = iter([0.5, 0.4])  # before, after
    sp.expected_acceptance = lambda rec, head, dv=None: next(scores)
    heads = params_of(model.heads)
    ev = sp.consolidate(0)
    assert not ev["kept"] and ev["steps"] == 5
    weights = {k: v for k, v in heads.items() if k != "token_counts"}  # (the counts grow either way)
    assert all(torch.equal(v, params_of(model.heads)[k]) for k, v in weights.items())


def test_a_consolidation_that_fails_half_way_leaves_the_heads_as_they_were(ctx):
    model, sp = bfloat16_slow_path(ctx)
    flags = [p.requires_grad for p in model.heads.parameters()]
    heads = params_of(model.heads)
    loss, calls = sp.loss, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("interrupted")
        return loss(*args)

    sp.loss = failing
    with pytest.raises(RuntimeError, match="interrupted"):
        sp.consolidate(1)
    weights = {k: v for k, v in heads.items() if k != "token_counts"}
    assert all(torch.equal(v, params_of(model.heads)[k]) for k, v in weights.items())  # two steps undone
    assert [p.requires_grad for p in model.heads.parameters()] == flags
    for p in model.heads.parameters():
        assert p.grad is None and not hasattr(p, "main_grad") and not p._post_accumulate_grad_hooks


def test_consolidation_ranks_candidates_over_the_draft_vocabulary(ctx):
    """The head's candidates in the support and the held-out test come from the ids the engine drafts
    from (after the event's tokens joined the counts), as a masked full-vocabulary top-k gives them."""
    model, _ = tiny_engine(ctx)
    model.heads.token_counts.copy_(torch.randint(0, 50, (300,), generator=torch.Generator().manual_seed(0)))
    spec = SpecConfig(c_hw=64, draft_vocab=40, slow_path=SlowPathConfig(min_records=8, max_records=64, steps=3))
    eng = SpeculativeEngine(model, spec)
    eng.generate(PROMPTS, SamplingConfig(temperature=1.0, max_new_tokens=30, num_samples=2, seed=1))
    sp = eng.slow_path
    rec = sp.buffer.latest(64, 1)
    seen = []
    score = sp.expected_acceptance
    sp.expected_acceptance = lambda rec, head, dv=None: seen.append(dv) or score(rec, head, dv)
    ev = sp.consolidate(1)
    assert ev["steps"] == 3 and len(seen) == 2
    vocab = DraftVocab.for_policy(model, 40)  # the counts now hold the event's tokens
    assert all(torch.equal(dv.ids, vocab.ids) for dv in seen)
    # reference: the head's logits over the whole vocabulary, every id outside the subset masked
    hidden, root, path = sp._inputs(rec, 1)
    logits = model.heads.forward_one(1, hidden, None, root, path) @ model.output_weight().t()
    outside = torch.ones(logits.shape[-1], dtype=torch.bool)  # (the output layer's rows: vocabulary + padding)
    outside[vocab.ids] = False
    want = logits.masked_fill(outside, float("-inf")).topk(4, dim=-1).indices
    assert torch.equal(sp.head_candidates(rec, 1, 4, vocab), want)
    assert not torch.equal(sp.head_candidates(rec, 1, 4), want)  # the whole vocabulary ranks others first


@pytest.mark.parametrize("cap", [1000, 12])
def test_monitor_scores_the_heads_on_the_batch_records(ctx, cap):
    """After a batch, each head is scored on the most recent of its new records (at most
    ``scored_per_batch``): a window's rate is the mean policy mass on the head's top-k candidates,
    here recomputed from full-vocabulary logits. Records come from every emitted token, so windows
    close whether or not the trees tried that depth."""
    model, eng = tiny_engine(ctx, scored_per_batch=cap, degraded_windows=100)
    sp = eng.slow_path
    eng.generate(PROMPTS, SamplingConfig(temperature=1.0, max_new_tokens=30, num_samples=2, seed=1))
    assert sp.unscored == 0 and sp.stats.monitor_seconds > 0 and sp.stats.slow_seconds == 0  # (apart from the cap)
    k, window = eng.spec.topk, sp.cfg.window
    for head in range(model.num_heads):
        rec = sp.buffer.latest(min(len(sp.buffer), cap), head)
        hidden, root, path = sp._inputs(rec, head)
        logits = model.heads.forward_one(head, hidden, None, root, path) @ model.output_weight().t()
        cand = logits[:, :model.config.vocab_size].topk(k, dim=-1).indices
        mass = (rec.target_probs[:, head] * (rec.target_ids[:, head, :, None] == cand[:, None]).any(-1)).sum(-1)
        n = len(rec) // window
        want = [float(mass[i * window:(i + 1) * window].mean()) for i in range(n)]
        assert n >= 2 and sp.monitor.rates[head] == pytest.approx(want, abs=1e-6)  # (float32 target probs)
        assert sp.monitor.count[head] == len(rec) - n * window  # the open window carries over
    state = copy.deepcopy(sp.monitor.state_dict())
    eng.generate(PROMPTS, SamplingConfig(temperature=1.0, max_new_tokens=1, num_samples=1, seed=2))
    assert sp.monitor.state_dict() == state  # one token per response makes no record: nothing is scored again


def test_consolidation_lowers_its_loss(ctx):
    model, eng = tiny_engine(ctx, steps=30, lr=1e-3, proximal=0.0)
    eng.generate(PROMPTS, SamplingConfig(temperature=1.0, max_new_tokens=30, num_samples=2, seed=1))
    ev = eng.slow_path.consolidate(0)
    assert ev["loss_last"] < 0.9 * ev["loss_first"]


def test_corrected_term_equals_a_forward_of_every_record_with_its_correction(ctx):
    """KL(p_S || q_corrected) is taken from another forward of the corrected records only; the
    reference runs every record through the head with its own correction (zeros where none)."""
    model, eng = tiny_engine(ctx)
    eng.generate(PROMPTS, SamplingConfig(temperature=1.0, max_new_tokens=30, num_samples=2, seed=1))
    sp, head = eng.slow_path, 1
    rec = sp.buffer.latest(64, head).detached()
    rec.delta[::2] = 0.0  # a mix of corrected and uncorrected proposals
    rec.delta[1::4, head] = torch.randn_like(rec.delta[1::4, head])
    assert 0 < int((rec.delta[:, head] != 0).any(-1).sum()) < len(rec)
    support = torch.unique(torch.cat([rec.target_ids[:, head].flatten(), rec.realised[:, head]]))
    prev = [p.detach().clone() for p in model.heads.head_parameters(head)]
    _, parts = sp.loss(sp.event_batch(rec, head, support), head, prev)
    hidden, root, path = sp._inputs(rec, head)
    with torch.no_grad():
        z = model.heads.forward_one(head, hidden, rec.delta[:, head], root, path)
        logits = z @ model.output_weight()[support].t()
    p = torch.zeros(len(rec), support.numel(), dtype=torch.float32)
    p.scatter_add_(1, torch.searchsorted(support, rec.target_ids[:, head].contiguous()), rec.target_probs[:, head])
    p = p / p.sum(-1, keepdim=True)
    want = (p * (torch.log(p.clamp(min=1e-12)) - torch.log_softmax(logits.float(), -1))).sum(-1).mean()
    assert parts["kl_corrected"] == pytest.approx(float(want), rel=1e-6)
    rec.delta.zero_()  # no correction anywhere: q_corrected is q_raw
    parts = sp.loss(sp.event_batch(rec, head, support), head, prev)[1]
    assert parts["kl_corrected"] == parts["kl_raw"] > 0


def force_trigger(sp):
    sp.monitor.consecutive = [sp.cfg.degraded_windows, 0, 0]
    sp.monitor.reference = [0.5, 0.5, 0.5]
    sp.monitor.rates = [[0.1] * 3] * 3


def test_trigger_guards_records_cooldown_and_time_cap(ctx):
    model, eng = tiny_engine(ctx, cooldown_batches=2, time_cap=0.5, degraded_windows=100)
    sp = eng.slow_path
    force_trigger(sp)
    assert sp.end_batch(1.0, eng.draft_vocab()) is None and sp.stats.skipped == {"records": 1}  # an empty buffer
    sp.monitor.consecutive = [0, 0, 0]
    eng.generate(PROMPTS, SamplingConfig(temperature=1.0, max_new_tokens=30, num_samples=2, seed=1))
    force_trigger(sp)
    sp.stats.slow_seconds = 10.0  # far over 50% of the generation time so far
    assert sp.end_batch(1.0, eng.draft_vocab()) is None, sp.stats
    assert sp.stats.skipped["time_cap"] == 1, sp.stats
    sp.stats.slow_seconds = 0.0
    assert sp.end_batch(1.0, eng.draft_vocab()) is not None  # everything allows it
    force_trigger(sp)
    assert sp.end_batch(1.0, eng.draft_vocab()) is None and sp.stats.skipped["cooldown"] == 1  # 1 batch since the event
    assert sp.end_batch(1.0, eng.draft_vocab()) is not None  # 2 batches: the cooldown is over


def test_exact_with_reflex_and_slow_path_over_several_batches(ctx):
    """Identical tokens and log-probs to vanilla while heads are being consolidated between batches."""
    model, eng = tiny_engine(ctx, tolerance=0.05, reference_windows=1, degraded_windows=1)
    vanilla = VanillaEngine(model)
    events = 0
    for step in range(4):
        sp = SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=30, num_samples=2, seed=step)
        ref = vanilla.generate(PROMPTS, sp, step=step)
        out = eng.generate(PROMPTS, sp, step=step)
        assert out.tokens == ref.tokens
        for a, b in zip(out.logprobs, ref.logprobs):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-9)
        events = out.stats["slow_path"]["events"]
    assert events >= 1  # the heads did change along the way


def test_state_dict_round_trip(ctx):
    model, eng = tiny_engine(ctx)
    eng.generate(PROMPTS, SamplingConfig(temperature=1.0, max_new_tokens=20, seed=2))
    state = copy.deepcopy(eng.slow_path.state_dict())
    other = SlowPath(model, eng.spec.slow_path, eng.spec.topk)
    other.load_state_dict(state)
    assert len(other.buffer) == len(eng.slow_path.buffer)
    assert other.monitor.state_dict() == eng.slow_path.monitor.state_dict()
    assert dataclasses.asdict(other.stats) == dataclasses.asdict(eng.slow_path.stats)


@pytest.mark.parametrize("bad, field", [(dict(max_records=4096), "max_records"), (dict(tolerance=1.5), "tolerance"),
                                        (dict(time_cap=2.0), "time_cap"), (dict(window=0), "window"),
                                        (dict(scored_per_batch=0), "scored_per_batch"),
                                        (dict(time_cap=0.0), r"time_cap must be in \(0, 1\], got 0.0 \(a cap of 0"),
                                        (dict(lr=0.0), r"lr must be > 0, got 0.0 \(a rate of 0"),
                                        (dict(lr=float("nan")), "lr must be > 0, got nan"),
                                        (dict(proximal=-1.0), "proximal must be >= 0, got -1.0")])
def test_config_errors_name_the_field(bad, field):
    with pytest.raises(ValueError, match=f"SlowPathConfig.{field}"):
        SlowPathConfig(**bad)
