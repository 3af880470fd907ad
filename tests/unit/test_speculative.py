"""The speculative engine emits exactly the vanilla engine's tokens and log-probs (same seed), on
random tiny models, at T=0 and at T=1 with top-p, on ragged batches with early EOS; the near-tie
divergence rate in float32 is measured and reported."""

import copy
import dataclasses

import pytest
import torch

from specroll_mcore.checkpoint import random_full_state_dict
from specroll_mcore.config import SamplingConfig, SpecConfig, tiny_llama, tiny_qwen2, tiny_qwen3, tiny_qwen3_moe
from specroll_mcore.model import PolicyModel
from specroll_mcore.rollout import SpeculativeEngine, VanillaEngine, make_engine
from specroll_mcore.sampling import SampleKeys
from specroll_mcore.tree import DepthCalibration, LatencyCurve, LatencySurface, StepCost, StepOverhead

PROMPTS = [[11, 12, 13, 14], [21], [31, 32, 33, 34, 35, 36, 37], [41, 42]]
SAMPLINGS = {"greedy": SamplingConfig(temperature=0.0, max_new_tokens=40, num_samples=2),
             "t1_top_p": SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=40, num_samples=3, seed=7)}


def policy_with_heads(cfg, ctx, head_std=0.05, seed=0):
    model = PolicyModel(cfg, ctx, num_heads=3).eval()
    model.load_full_state_dict(random_full_state_dict(cfg, seed, std=0.08))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        paths = (v for vs in model.heads.path_layers for v in vs)
        for layer in [*model.heads.layers, *model.heads.root_layers, *paths]:
            layer.weight.copy_(head_std * torch.randn(layer.weight.shape, generator=g))
    return model


def compare(a, b):
    same = [x == y for x, y in zip(a.tokens, b.tokens)]
    lp = max((x - y).abs().max().item() for x, y, s in zip(a.logprobs, b.logprobs, same) if s and len(x))
    return same, lp


@pytest.mark.parametrize("make_cfg", [tiny_llama, tiny_qwen2, tiny_qwen3, tiny_qwen3_moe])
@pytest.mark.parametrize("mode", list(SAMPLINGS))
def test_identical_to_vanilla_float64(ctx, make_cfg, mode):
    model = policy_with_heads(make_cfg(params_dtype="float64"), ctx)
    sp = SAMPLINGS[mode]
    eos = VanillaEngine(model).generate(PROMPTS, sp, step=2).tokens[0][12]  # a token some response emits
    ref = VanillaEngine(model, eos_token_ids=[eos]).generate(PROMPTS, sp, step=2)
    # full batch (plain decoding), small trees, large trees; drafts coupled to the noise or not
    for c_hw, coupled in ((3, True), (16, True), (64, True), (16, False)):
        out = SpeculativeEngine(model, SpecConfig(c_hw=c_hw, coupled=coupled), eos_token_ids=[eos]).generate(
            PROMPTS, sp, step=2)
        same, lp = compare(ref, out)
        assert all(same), f"c_hw={c_hw}, coupled={coupled}: near-ties are impossible in float64"
        assert out.finish_reason == ref.finish_reason
        assert lp < 1e-9
    assert "eos" in ref.finish_reason and len({len(t) for t in ref.tokens}) > 1  # ragged, early EOS


@pytest.mark.parametrize("mode", list(SAMPLINGS))
def test_acceptance_sampling_every_node_at_once_gives_the_same_rollout(ctx, monkeypatch, mode):
    """The GPU's acceptance (every tree node sampled in one call, the walk without host syncs),
    forced on a CPU: the vanilla engine's tokens, and the same acceptance counts as the walk depth
    by depth."""
    model = policy_with_heads(tiny_llama(params_dtype="float64"), ctx)
    sp = SAMPLINGS[mode]
    ref = VanillaEngine(model).generate(PROMPTS, sp, step=2)
    outs = {}
    for choice in ("0", "1"):
        monkeypatch.setenv("SPECROLL_ACCEPT_AT_ONCE", choice)
        outs[choice] = SpeculativeEngine(model, SpecConfig(c_hw=64)).generate(PROMPTS, sp, step=2)
        same, lp = compare(ref, outs[choice])
        assert all(same) and lp < 1e-9, choice
    assert outs["1"].stats["tau"] > 1.0
    for key in ("tried_per_depth", "accepted_per_depth", "tau_per_row"):
        assert outs["1"].stats[key] == outs["0"].stats[key], key


def test_min_p_and_top_k_identical_to_vanilla_float64(ctx):
    """vLLM's min-p, with top-k and top-p, in the sampler and the coupled drafts alike."""
    model = policy_with_heads(tiny_llama(params_dtype="float64"), ctx, seed=4)
    sp = SamplingConfig(temperature=0.8, top_p=0.95, top_k=40, min_p=0.3, max_new_tokens=40, num_samples=3, seed=9)
    ref = VanillaEngine(model).generate(PROMPTS, sp, step=1)
    unfiltered = VanillaEngine(model).generate(PROMPTS, dataclasses.replace(sp, min_p=0.0), step=1)
    assert ref.tokens != unfiltered.tokens  # min-p removes ids some response would have sampled
    for c_hw, coupled in ((64, True), (64, False)):
        out = SpeculativeEngine(model, SpecConfig(c_hw=c_hw, coupled=coupled)).generate(PROMPTS, sp, step=1)
        same, lp = compare(ref, out)
        assert all(same) and lp < 1e-9, (c_hw, coupled)
        assert out.stats["tau"] > 1.0  # trees of several nodes a row, some drafts accepted


def test_float32_near_tie_rate(ctx):
    """float32: a packed tree forward and a one-token forward may differ by an ulp; a sequence can
    diverge only at a near-tie of the sampled argmax. Contract: at most 0.1% of sequences."""
    model = policy_with_heads(tiny_qwen2(), ctx, seed=1)
    prompts = [[i + 3, i + 4, (7 * i) % 300] for i in range(16)]
    diverged = total = 0
    for mode, sp in SAMPLINGS.items():
        ref = VanillaEngine(model, eos_token_ids=[9]).generate(prompts, sp)
        out = SpeculativeEngine(model, SpecConfig(c_hw=32), eos_token_ids=[9]).generate(prompts, sp)
        same, lp = compare(ref, out)
        diverged += same.count(False)
        total += len(same)
        assert lp < 1e-4
    print(f"float32 near-tie divergences: {diverged}/{total} sequences")
    assert diverged / total <= 0.001


def test_random_heads_same_tokens_only_slower(ctx):
    model = policy_with_heads(tiny_llama(params_dtype="float64"), ctx, head_std=3.0, seed=2)
    sp = SAMPLINGS["t1_top_p"]
    ref = VanillaEngine(model).generate(PROMPTS, sp)
    out = SpeculativeEngine(model, SpecConfig(c_hw=64)).generate(PROMPTS, sp)
    assert out.tokens == ref.tokens
    assert out.stats["tau"] >= 1.0  # every step still emits the policy's own token


@pytest.mark.parametrize("shortlist", [4, 10_000])  # as narrow as top-k; wider than the vocabulary
def test_any_shortlist_gives_the_same_tokens(ctx, shortlist):
    model = policy_with_heads(tiny_llama(params_dtype="float64"), ctx, seed=3)
    for sp in SAMPLINGS.values():
        ref = VanillaEngine(model).generate(PROMPTS, sp)
        out = SpeculativeEngine(model, SpecConfig(c_hw=64, shortlist=shortlist)).generate(PROMPTS, sp)
        assert out.tokens == ref.tokens


def test_deeper_heads_shortlists_ignore_the_sampling_filters(ctx):
    """A shortlist is ranked by the path-free logits and noise before any filter: top-k, top-p and
    min-p cut relative to one distribution, and the path moves it. With as many candidates as
    shortlisted ids, each depth-2 node drafts exactly its row's shortlist, so the drafted sets must
    not change with the filters; only the path-conditioned filter then leaves fewer finite scores."""
    model = policy_with_heads(tiny_llama(params_dtype="float64"), ctx, seed=3)
    S, b = 8, 3
    engine = SpeculativeEngine(model, SpecConfig(c_hw=64, topk=S, shortlist=S, draft_vocab=0))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(b, model.config.hidden_size, generator=g, dtype=torch.float64)
    roots = torch.randint(0, model.config.vocab_size, (b,), generator=g)
    H = model.num_heads
    keys = SampleKeys(5, 0, torch.arange(b).repeat(H), torch.zeros(H * b, dtype=torch.long),
                      torch.arange(1, H + 1).repeat_interleave(b))

    def depth2(**filters):
        level = engine.propose(hidden, roots, SamplingConfig(**filters), 16, keys).levels[1]
        return [[set(node.tolist()) for node in row] for row in level.tokens], level.score

    for T in [1.0, 0.7]:
        plain, plain_score = depth2(temperature=T)
        assert all(len(row[0]) == S and all(node == row[0] for node in row) for row in plain)
        assert torch.isfinite(plain_score).all()
        for filters in [dict(top_k=1), dict(min_p=0.5), dict(top_p=0.1), dict(top_k=2, top_p=0.5, min_p=0.2)]:
            drafted, score = depth2(temperature=T, **filters)
            assert [row[0] for row in drafted] == [row[0] for row in plain], (T, filters)
            kept = torch.isfinite(score[:, 0]).sum(-1)  # under each row's best depth-1 node
            assert (kept >= 1).all() and (kept < S).any(), (T, filters)  # the path's own filter still applies


def test_draft_vocab_gives_the_same_tokens_and_drafts_only_its_ids(ctx, monkeypatch):
    model = policy_with_heads(tiny_llama(params_dtype="float64"), ctx, seed=3)
    spec = SpecConfig(c_hw=64, shortlist=100, draft_vocab=60)  # (a shortlist wider than the draft vocabulary)
    assert SpeculativeEngine(model, spec).draft_vocab() is None  # heads without counts: the whole vocabulary
    ref = {name: VanillaEngine(model).generate(PROMPTS, sp) for name, sp in SAMPLINGS.items()}
    counts = torch.zeros(300, dtype=torch.long)
    for r in ref.values():  # the tokens these responses use, as tools/train_heads.py counts them
        counts += torch.bincount(torch.tensor([t for toks in r.tokens for t in toks]), minlength=300)
    model.heads.token_counts.copy_(counts)
    engine = SpeculativeEngine(model, spec)
    ids = set(engine.draft_vocab().ids.tolist())
    drafted = set()
    propose = engine.propose

    def spy(*args, **kwargs):
        p = propose(*args, **kwargs)
        drafted.update(t for level in p.levels for t in level.tokens.flatten().tolist())
        return p

    monkeypatch.setattr(engine, "propose", spy)
    for name, sp in SAMPLINGS.items():
        out = engine.generate(PROMPTS, sp)
        assert out.tokens == ref[name].tokens, name
        assert out.stats["tau"] > 1.0
    assert drafted and drafted <= ids  # only ids of the draft vocabulary are ever drafted
    dv = engine.draft_vocab()
    assert engine.draft_vocab() is dv  # kept across rollouts while nothing it is made of changes
    model.heads.token_counts[sorted(set(range(300)) - ids)[:5]] += 10 ** 6  # the slow path adds counts in place
    grown = engine.draft_vocab()
    assert grown is not dv and set(grown.ids.tolist()) != ids
    with torch.no_grad():
        model.output_weight().mul_(1.01)  # an optimizer step
    assert engine.draft_vocab() is not grown
    torch.testing.assert_close(engine.draft_vocab().rows, model.output_weight()[engine.draft_vocab().ids])
    with pytest.raises(ValueError, match=r"SpecConfig.draft_vocab \(6\) must be 0 \(the whole vocabulary\) or at "
                                         r"least the candidates a head proposes, max\(SpecConfig.topk, "
                                         r"reflex.support_topk\) = 8"):
        SpecConfig(draft_vocab=6)


def test_tree_forwards_never_exceed_c_hw(ctx, monkeypatch):
    """A forward holding trees (more than one node per row) holds at most C_hw tokens; when more
    responses are unfinished than C_hw, each gets one node and the step is one plain decode forward."""
    model = policy_with_heads(tiny_llama(), ctx)
    sizes = []
    real = PolicyModel.forward

    def counting(self, input_ids, meta, **kw):
        if kw.get("logits_index") is None:  # every forward but prefill is a verification forward
            sizes.append(tuple(input_ids.shape))
        return real(self, input_ids, meta, **kw)

    monkeypatch.setattr(PolicyModel, "forward", counting)
    for c_hw in (5, 12, 40):
        sizes.clear()
        SpeculativeEngine(model, SpecConfig(c_hw=c_hw, n_max=8, n_min=2)).generate(PROMPTS, SAMPLINGS["t1_top_p"])
        trees = [b * n for b, n in sizes if n > 1]
        assert trees and max(trees) <= c_hw, (c_hw, sizes)
    sizes.clear()
    SpeculativeEngine(model, SpecConfig(c_hw=3)).generate(PROMPTS, SAMPLINGS["t1_top_p"])  # 12 rows > C_hw
    assert sizes[0] == (12, 1)  # all unfinished rows in one plain decode forward


def test_adaptive_nodes_follow_the_latency_curve_and_keep_the_tokens(ctx, monkeypatch):
    """Each step keeps the nodes that pay for their latency: the whole budget when extra tokens are
    free (without weighing them: no host round trip), one node (plain decoding) when each costs a
    whole forward; the tokens are vanilla's always."""
    import specroll_mcore.rollout.speculative as engine_module

    model = policy_with_heads(tiny_llama(params_dtype="float64"), ctx)
    sp = SAMPLINGS["t1_top_p"]
    ref = VanillaEngine(model).generate(PROMPTS, sp)
    curves = {"flat": LatencyCurve((1, 64), (1.0, 1.0)), "steep": LatencyCurve((1, 2, 64), (1.0, 2.0, 64.0)),
              "mid": LatencyCurve((1, 8, 16, 64), (1.0, 1.1, 2.0, 8.0)), "none": None}
    nodes = {}
    weighed = []
    real_tree_size = engine_module.tree_size
    monkeypatch.setattr(engine_module, "tree_size", lambda *a: weighed.append(a) or real_tree_size(*a))
    for name, curve in curves.items():
        weighed.clear()
        engine = SpeculativeEngine(model, SpecConfig(c_hw=64), latency=curve)
        engine.calibration = DepthCalibration(3, decay=1.0, prior=0.0)  # plain sums
        out = engine.generate(PROMPTS, sp)
        assert out.tokens == ref.tokens, name
        if curve is not None:  # the calibration counts every accepted draft, per depth
            accepted = [round(a * t) for a, t in zip(out.stats["acceptance_per_depth"], out.stats["tried_per_depth"])]
            assert engine.calibration.accepted == accepted == out.stats["accepted_per_depth"]
        nodes[name] = [p["nodes_per_row"] for p in out.stats["per_step"]]
        if name == "steep":  # plain decoding, but for the trunk (root + 3 heads) on every 8th step
            assert nodes[name] == [4 if i % 8 == 7 else 1 for i in range(len(nodes[name]))]
        assert bool(weighed) == (name in ("steep", "mid")), name
    assert nodes["flat"] == nodes["none"]  # nothing trimmed where nodes cost nothing
    assert sum(nodes["mid"]) < sum(nodes["flat"])
    out = SpeculativeEngine(model, SpecConfig(c_hw=64, probe_every=0), latency=curves["steep"]).generate(PROMPTS, sp)
    assert {p["nodes_per_row"] for p in out.stats["per_step"]} == {1} and out.stats["tau"] == 1.0
    assert out.tokens == ref.tokens
    engine = SpeculativeEngine(model, SpecConfig(c_hw=64, adaptive_nodes=False), latency=curves["steep"])
    assert engine.latency is None  # switched off: every step uses its whole budget


def test_trees_are_sized_by_the_latency_of_the_forwards_shape_and_context(ctx, monkeypatch):
    """With a latency surface, a step prices its forward by its rows, nodes and the longest committed
    context among them: on short contexts, where extra nodes are free, trees take the whole budget;
    on long ones, where each node costs a forward, steps decode plainly but for the probes' trunks.
    The tokens are vanilla's throughout."""
    import specroll_mcore.rollout.speculative as engine_module

    model = policy_with_heads(tiny_llama(params_dtype="float64"), ctx)
    sp = SAMPLINGS["t1_top_p"]
    ref = VanillaEngine(model).generate(PROMPTS, sp)
    free, steep = (1.0, 1.0, 1.0), (1.0, 2.0, 4.0)
    surface = LatencySurface((1, 16), (1, 2, 4), (8, 24), ((free, free), (steep, steep)))
    contexts = []
    real_tree_size = engine_module.tree_size
    monkeypatch.setattr(engine_module, "tree_size", lambda *a: contexts.append(a[3]) or real_tree_size(*a))
    out = SpeculativeEngine(model, SpecConfig(c_hw=64), latency=surface).generate(PROMPTS, sp)
    assert out.tokens == ref.tokens
    steps = out.stats["per_step"]
    budget = 64 // len(ref.tokens)
    assert steps[0]["nodes_per_row"] == budget  # contexts of at most the longest prompt (7): nodes are free
    assert contexts and min(contexts) > 8 and contexts == sorted(contexts)  # weighed once contexts grew
    long = [p["nodes_per_row"] for p in steps[-8:]]  # past 24 committed tokens in the longest row
    assert set(long) <= {1, 4} and long.count(4) <= 1, long
    flat = SpeculativeEngine(model, SpecConfig(c_hw=64),
                             latency=LatencySurface((1, 16), (1, 2, 4), (8,), ((free, free),)))
    assert flat.generate(PROMPTS, sp).tokens == ref.tokens


def test_the_work_around_a_drafted_steps_forward_is_priced(ctx):
    """With a flat forward, every step drafts its whole budget; priced with a drafted step's work
    around the forward at more than the drafts can win, steps decode plainly but for the probes'
    trunks, and where that work costs nothing the trees are the forward's alone. Where the work is
    all in proposing the drafts, steps do not propose them, but a probe that has keeps every node:
    proposing is spent by then. The tokens are vanilla's throughout; every step's forward and its
    preparation are timed apart from the rest of it."""
    model = policy_with_heads(tiny_llama(params_dtype="float64"), ctx)
    sp = SAMPLINGS["t1_top_p"]
    ref = VanillaEngine(model).generate(PROMPTS, sp)
    flat = LatencyCurve((1, 64), (1.0, 1.0))
    nodes = {}
    for name, drafted, drafting in (("forward", None, None), ("free", 0.0, 0.0), ("costly", 5.0, 0.0),
                                    ("proposing", 5.0, 5.0)):
        latency = flat if drafted is None else StepCost(flat, StepOverhead((1, 16), (0.0, 0.0), (drafted, drafted),
                                                                           (drafting, drafting)))
        engine = SpeculativeEngine(model, SpecConfig(c_hw=64), latency=latency)
        engine.calibration = DepthCalibration(3, prior=1e9)  # (factors 1 throughout: at most a token per depth)
        out = engine.generate(PROMPTS, sp)
        assert out.tokens == ref.tokens, name
        nodes[name] = [p["nodes_per_row"] for p in out.stats["per_step"]]
        assert all(0 < p["prepare_s"] + p["forward_s"] < p["seconds"] for p in out.stats["per_step"])
    assert nodes["free"] == nodes["forward"] and min(nodes["forward"]) > 1
    assert nodes["costly"] == [4 if i % 8 == 7 else 1 for i in range(len(nodes["costly"]))]
    probes = nodes["proposing"][7::8]
    assert min(probes) > 4 and nodes["proposing"] == [probes[i // 8] if i % 8 == 7 else 1
                                                      for i in range(len(nodes["proposing"]))]


def test_no_drafting_where_no_tree_could_pay(ctx, monkeypatch):
    """Where even trunks believed certain would not pay for their latency at the current calibration,
    steps do not draft at all (plain decoding without the heads' cost), except the probe steps; the
    slow path still gets a record for every token, as when every step drafts. Where drafts could
    pay, every step drafts."""
    model = policy_with_heads(tiny_llama(params_dtype="float64"), ctx)
    sp = SAMPLINGS["t1_top_p"]
    ref = VanillaEngine(model).generate(PROMPTS, sp)
    steep = LatencyCurve((1, 2, 64), (1.0, 2.0, 64.0))  # a token costs a forward: no draft pays
    records = {}
    for probe_every, curve in ((8, steep), (1, steep), (8, LatencyCurve((1, 64), (1.0, 1.1)))):
        engine = SpeculativeEngine(model, SpecConfig(c_hw=64, probe_every=probe_every), latency=curve)
        proposed = []
        real = engine.propose
        monkeypatch.setattr(engine, "propose", lambda *a, **k: proposed.append(1) or real(*a, **k))
        assert engine.drafts_can_pay(12, 5) is (curve is not steep)  # factors 1: a certain trunk
        out = engine.generate(PROMPTS, sp)
        assert out.tokens == ref.tokens
        steps = len(out.stats["per_step"])
        if curve is steep:
            assert len(proposed) == (sum(i % 8 == 7 for i in range(steps)) if probe_every == 8 else steps)
            records[probe_every] = len(engine.slow_path.buffer)
        else:
            assert len(proposed) == steps
    # (drafting every step also records the few drafts accepted past a response's length limit)
    assert records[1] - 12 * 3 <= records[8] <= records[1]


def test_probes_keep_measuring_the_drafts_where_trimming_stopped_trying_them(ctx):
    """A calibration that believes the drafts worthless trims every tree to its root; without probes
    nothing is tried again, so it never learns otherwise (an absorbing state). Probe steps try the
    trunk, the calibration sees the accepted drafts and its factors move back up."""
    model = policy_with_heads(tiny_llama(params_dtype="float64"), ctx)
    sp = SAMPLINGS["greedy"]
    ref = VanillaEngine(model).generate(PROMPTS, sp)
    curve = LatencyCurve((1, 2, 64), (1.0, 1.5, 40.0))
    factors = {}
    for probe_every in (0, 4):
        engine = SpeculativeEngine(model, SpecConfig(c_hw=64, probe_every=probe_every), latency=curve)
        engine.calibration = DepthCalibration(3, decay=1.0, prior=0.0)
        engine.calibration.update([1000.0] * 3, [1e-3] * 3)  # "the drafts are never accepted"
        out = engine.generate(PROMPTS, sp)
        assert out.tokens == ref.tokens
        factors[probe_every] = engine.calibration.factors()
        if probe_every == 0:
            assert out.stats["tried_per_depth"] == [0, 0, 0]
        else:
            assert out.stats["tried_per_depth"][0] > 0 and sum(out.stats["acceptance_per_depth"]) > 0
    assert factors[0] == [1e-6] * 3
    assert factors[4][0] > factors[0][0]


def test_engine_state_round_trip(ctx):
    """What a resumed run restores: the tree-size calibration and the slow path's state; a checkpoint
    from before the calibration holds the slow path's state alone."""
    model = policy_with_heads(tiny_llama(params_dtype="float64"), ctx)
    flat = LatencyCurve((1, 64), (1.0, 1.0))
    engine = SpeculativeEngine(model, SpecConfig(c_hw=64), latency=flat)
    engine.generate(PROMPTS, SAMPLINGS["t1_top_p"])
    state = copy.deepcopy(engine.state_dict())
    assert state["calibration"]["accepted"] != [4.0, 4.0, 4.0]  # it has seen steps
    other = SpeculativeEngine(model, SpecConfig(c_hw=64), latency=flat)
    other.load_state_dict(state)
    assert other.calibration.state_dict() == engine.calibration.state_dict()
    assert len(other.slow_path.buffer) == len(engine.slow_path.buffer) > 0
    old = SpeculativeEngine(model, SpecConfig(c_hw=64), latency=flat)
    old.load_state_dict(copy.deepcopy(engine.slow_path.state_dict()))
    assert len(old.slow_path.buffer) == len(engine.slow_path.buffer) and old.calibration.factors() == [1.0] * 3
    with pytest.raises(ValueError, match="a calibration of 2 depths does not fit 3 heads"):
        other.load_state_dict({"calibration": {"expected": [1.0, 1.0], "accepted": [1.0, 1.0]}})


def test_engine_flag_and_config_errors(ctx):
    model = policy_with_heads(tiny_llama(), ctx)
    assert isinstance(make_engine("vanilla", model), VanillaEngine)
    assert isinstance(make_engine("specroll", model, SpecConfig()), SpeculativeEngine)
    with pytest.raises(ValueError, match="unknown engine 'medusa'"):
        make_engine("medusa", model)
    with pytest.raises(ValueError, match=r"SpecConfig.num_heads \(4\) != heads of the policy \(3\)"):
        SpeculativeEngine(model, SpecConfig(num_heads=4))
    with pytest.raises(ValueError, match=r"need 1 <= SpecConfig.n_min \(4\) <= SpecConfig.n_max \(2\)"):
        SpecConfig(n_min=4, n_max=2)


def test_stats(ctx, monkeypatch):
    model = policy_with_heads(tiny_llama(params_dtype="float64"), ctx)
    engine = SpeculativeEngine(model, SpecConfig(c_hw=64))
    shapes, verify = [], engine.verify

    def spy(state, slots, tree):  # the trees' [rows, nodes] of every verification forward
        shapes.append(tree.shape[:2])
        return verify(state, slots, tree)

    monkeypatch.setattr(engine, "verify", spy)
    out = engine.generate(PROMPTS, SAMPLINGS["greedy"])
    s = out.stats
    assert s["tau"] >= 1 and len(s["acceptance_per_depth"]) == 3
    # the tree size per row and step: the verification forwards' tokens over the rows they served
    assert s["nodes_per_row"] == pytest.approx(sum(b * n for b, n in shapes) / sum(b for b, _ in shapes))
    assert s["nodes_per_row"] > 1
    assert set(s["time_split_s"]) == {"prefill", "propose", "build", "verify", "accept", "commit", "feedback"}
    assert sum(p["tokens"] for p in s["per_step"]) + len(out.tokens) == out.num_tokens
