"""Run under torchrun: build the policy at a TP/PP layout from seeded full weights, compute causal
logits, tree logits and a vanilla rollout, and save them from the last stage's first TP rank; for
several layouts one after the other in the same processes (a launch's start paid once)."""

import argparse
import os
import warnings
from pathlib import Path
from typing import Optional

import torch

warnings.filterwarnings("ignore")

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.checkpoint import random_full_heads, random_full_state_dict  # noqa: E402
from specroll_mcore.config import (ParallelConfig, ReflexConfig, SamplingConfig, SlowPathConfig,  # noqa: E402
                                   SpecConfig, tiny_llama, tiny_qwen2)
from specroll_mcore.heads import (coupled_scores, vocab_parallel_entropy, vocab_parallel_filter,  # noqa: E402
                                  vocab_parallel_logsumexp, vocab_parallel_topk)
from specroll_mcore.model import PolicyModel, causal_mask  # noqa: E402
from specroll_mcore.rollout import SpeculativeEngine, VanillaEngine  # noqa: E402
from specroll_mcore.rollout.base import prefill  # noqa: E402
from specroll_mcore.sampling import SampleKeys  # noqa: E402
from specroll_mcore.tree import LatencyCurve, tree_ancestor_mask, tree_depths  # noqa: E402

PROMPTS = [[11, 12, 13, 14], [21], [31, 32, 33, 34, 35, 36, 37]]
TREE_PARENTS = torch.tensor([[-1, 0, 0, 1, 3], [-1, -1, 1, -2, -2], [-1, 0, 1, 2, 0]])
TREE_TOKENS = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0], [13, 14, 15, 16, 17]])
MID_LATENCY = LatencyCurve((1, 6, 12, 24), (1e-3, 1.1e-3, 2e-3, 8e-3))
STEEP_LATENCY = LatencyCurve((1, 2, 24), (1e-3, 2e-3, 24e-3))  # trees shrink to their roots: no drafting between probes


def models():
    return {"llama": tiny_llama, "qwen2": tiny_qwen2}


def policy(arch: str, dtype: str, ctx) -> tuple[PolicyModel, torch.Generator]:
    """The seeded policy with seeded heads, and the generator the heads were drawn from."""
    cfg = models()[arch](params_dtype=dtype)
    model = PolicyModel(cfg, ctx, num_heads=3).eval()
    model.load_full_state_dict(random_full_state_dict(cfg, seed=7, std=0.08))
    g = torch.Generator().manual_seed(11)
    model.load_full_heads(random_full_heads(cfg, 3, g))
    return model, g


def caches(ctx, cache_root: Path) -> dict:
    """Profiles where only rank 0 has them cached (each rank a node with a cache of its own), and
    profiles every rank has cached but each another one (nodes profiled apart): with a configured
    C_hw no rank takes its own latency profile; the step-overhead profile is measured on every rank
    (one rank alone skipping the collective measurement would hang the others) and cached on each,
    the same everywhere."""
    from specroll_mcore.rollout import profile
    from specroll_mcore.tree import budget

    model, _ = policy("llama", "float32", ctx)
    out = {}
    for case, spec in (("missing", SpecConfig(c_hw=8)), ("differ", SpecConfig(c_hw=8, topk=2))):
        os.environ["SPECROLL_CACHE"] = str(cache_root / case / f"rank{ctx.rank}")
        key = profile.overhead_key(model, spec)
        if ctx.rank == 0 or case == "differ":
            stale = 9.0 + ctx.rank
            budget.save_capacity(key, {"rows": [1], "plain_s": [stale], "drafted_s": [stale], "drafting_s": [stale]})
            budget.save_capacity(profile.capacity_key(model),
                                 {"c_hw": 4, "curve": {"tokens": [1, 4, 8], "tree_row_s": [1.0, 1.5, 3.0 + ctx.rank]}})
        cost = profile.with_step_overhead(model, spec, MID_LATENCY)
        cached = [None] * ctx.world_size
        torch.distributed.all_gather_object(cached, budget.load_profile(key))
        out[case] = {"latency": profile.ensure_capacity(model, 8).latency, "rows": cost.overhead.rows,
                     "stale_kept": cost.overhead.plain[0] >= 9.0, "cached": cached[ctx.rank]["rows"],
                     "same_everywhere": all(c == cached[0] for c in cached)}
    return out


def run(arch: str, dtype: str, ctx) -> dict:
    model, g = policy(arch, dtype, ctx)
    cfg = model.config
    out = {}
    with torch.no_grad():
        ids = torch.tensor([p + [1] * (7 - len(p)) for p in PROMPTS])
        lengths = torch.tensor([len(p) for p in PROMPTS])
        meta = model.metadata(torch.arange(7)[None].expand(3, 7), causal_mask(3, 7, ids.device, lengths))
        logits = model(ids, meta)
        out["causal"] = model.full_logits(logits) if logits is not None else None
        cache = model.new_cache(3, 32)
        prefill(model, cache, PROMPTS, 64)
        positions = cache.lengths[:, None] + tree_depths(TREE_PARENTS)
        logits = model(TREE_TOKENS, model.metadata(positions, tree_ancestor_mask(TREE_PARENTS), cache, torch.arange(3)))
        out["tree"] = model.full_logits(logits) if logits is not None else None
        if ctx.is_last_stage:  # vocab-parallel top-k / log-sum-exp of the head logits, never gathered
            head_logits = model.head_logits(torch.randn(5, cfg.hidden_size, generator=g).to(cfg.torch_dtype),
                                            torch.tensor([3, 150, 151, 299, 0]),  # roots on both vocab shards
                                            path_ids=torch.tensor([[7, 160], [299, 2], [151, 150], [0, 0], [3, 298]]))
            flat = head_logits.reshape(15, -1)
            values, ids = vocab_parallel_topk(flat, 6, model.vocab_start, cfg.vocab_size, ctx)
            out["heads_topk"] = (values, ids)
            out["heads_lse"] = vocab_parallel_logsumexp(flat, model.vocab_start, cfg.vocab_size, ctx)
            out["heads_entropy"] = vocab_parallel_entropy(flat, model.vocab_start, cfg.vocab_size, ctx, 0.7)
            with torch.enable_grad():  # the entropy bonus's: values and each shard's gradient, gathered
                x = flat.float().requires_grad_()
                h = vocab_parallel_entropy(x, model.vocab_start, cfg.vocab_size, ctx, 0.7)
                (grad,) = torch.autograd.grad((h * torch.linspace(-1, 1, 15)).sum(), x)
            out["heads_entropy_grad"] = (h, model.full_logits(grad))
            out["heads_full"] = model.full_logits(head_logits)
            # coupled drafting: the sampler's scores, top-p / top-k / min-p filtered without gathering
            keys = SampleKeys(3, 1, torch.arange(15), torch.zeros(15, dtype=torch.long), torch.arange(15) + 4)
            scores = coupled_scores(flat, keys, 0.9, 20, model.vocab_start, cfg.vocab_size, ctx, min_p=0.6)
            out["heads_coupled"] = vocab_parallel_topk(scores, 4, model.vocab_start, cfg.vocab_size, ctx)
            kept = torch.isfinite(vocab_parallel_filter(flat, 0.9, 0, model.vocab_start, cfg.vocab_size, ctx,
                                                        window=16))
            out["heads_filter_kept"] = ctx.all_reduce_tp(kept.sum(-1), "sum")
    engine = VanillaEngine(model, eos_token_ids=[3])
    samplings = {"t1": SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=16, num_samples=2, seed=5),
                 "greedy": SamplingConfig(temperature=0.0, max_new_tokens=16)}
    if dtype == "float32":  # (T=1 tokens at another layout may part at float32 near-ties: compared in float64)
        del samplings["t1"]
    for name, sp in samplings.items():
        r = engine.generate(PROMPTS, sp, step=1, features_topk=4)
        out[name] = {"tokens": r.tokens, "logprobs": r.logprobs, "finish": r.finish_reason, "features": r.features}
        r = SpeculativeEngine(model, SpecConfig(c_hw=24), eos_token_ids=[3]).generate(PROMPTS, sp, step=1)
        out["spec-" + name] = {"tokens": r.tokens, "logprobs": r.logprobs, "finish": r.finish_reason}
        if arch != "llama":  # (the engines' scheduling variants below on the Llama: the Qwen2 differs in its model)
            continue
        # trees cut to what pays for its latency (each TP rank decides alone, from the same drafts)
        r = SpeculativeEngine(model, SpecConfig(c_hw=24), eos_token_ids=[3], latency=MID_LATENCY).generate(
            PROMPTS, sp, step=1)
        out["spec-adaptive-" + name] = {"tokens": r.tokens, "logprobs": r.logprobs, "finish": r.finish_reason}
        r = SpeculativeEngine(model, SpecConfig(c_hw=24, probe_every=3), eos_token_ids=[3],
                              latency=STEEP_LATENCY).generate(PROMPTS, sp, step=1)
        out["spec-idle-" + name] = {"tokens": r.tokens, "logprobs": r.logprobs, "finish": r.finish_reason}
        # the whole batch in one group (stages one after another), and more groups than stages
        r = VanillaEngine(model, eos_token_ids=[3], pipeline_groups=1).generate(PROMPTS, sp, step=1)
        out["groups1-" + name] = {"tokens": r.tokens, "logprobs": r.logprobs, "finish": r.finish_reason}
        r = SpeculativeEngine(model, SpecConfig(c_hw=24), eos_token_ids=[3], pipeline_groups=3).generate(
            PROMPTS, sp, step=1)
        out["spec-groups3-" + name] = {"tokens": r.tokens, "logprobs": r.logprobs, "finish": r.finish_reason}
        # continuously batched: at most 3 responses in flight (a waiting prompt's two start when two
        # rows are free), one prompt's, and one response (below a prompt's samples)
        r = VanillaEngine(model, eos_token_ids=[3], max_num_seqs=sp.num_samples + 1).generate(PROMPTS, sp, step=1)
        out["continuous-" + name] = {"tokens": r.tokens, "logprobs": r.logprobs, "finish": r.finish_reason}
        r = SpeculativeEngine(model, SpecConfig(c_hw=24), eos_token_ids=[3], max_num_seqs=sp.num_samples + 1).generate(
            PROMPTS, sp, step=1)
        out["spec-continuous-" + name] = {"tokens": r.tokens, "logprobs": r.logprobs, "finish": r.finish_reason}
        r = SpeculativeEngine(model, SpecConfig(c_hw=24), eos_token_ids=[3], max_num_seqs=sp.num_samples).generate(
            PROMPTS, sp, step=1)
        out["spec-one-prompt-" + name] = {"tokens": r.tokens, "logprobs": r.logprobs, "finish": r.finish_reason}
        r = VanillaEngine(model, eos_token_ids=[3], max_num_seqs=1).generate(PROMPTS, sp, step=1)
        out["one-row-" + name] = {"tokens": r.tokens, "logprobs": r.logprobs, "finish": r.finish_reason}
        # prompts of 4 and 7 tokens prefilled in pieces of at most 3, all at once and continuously batched
        r = VanillaEngine(model, eos_token_ids=[3], max_prefill_tokens=3).generate(PROMPTS, sp, step=1)
        out["pieces-" + name] = {"tokens": r.tokens, "logprobs": r.logprobs, "finish": r.finish_reason}
        r = SpeculativeEngine(model, SpecConfig(c_hw=24), eos_token_ids=[3], max_num_seqs=sp.num_samples + 1,
                              max_prefill_tokens=3).generate(PROMPTS, sp, step=1)
        out["spec-pieces-" + name] = {"tokens": r.tokens, "logprobs": r.logprobs, "finish": r.finish_reason}
    out["refused"] = refused(model, ctx)
    out["adapt"] = adapt(model, ctx)
    out["draft_vocab"] = draft_vocab(model) if dtype == "float64" else None  # (compared in float64)
    return out


def refused(model, ctx) -> str:
    """The error every rank raises when the KV cache does not fit on one of them: the ranks but the one
    whose results are saved see room for three responses only. (Each rank raising alone would leave
    the others in the forward's collectives.)"""
    from specroll_mcore.rollout import base

    sp = SamplingConfig(temperature=1.0, max_new_tokens=16, num_samples=2)
    capacity = max(len(p) for p in PROMPTS) + sp.max_new_tokens
    free = base.available_memory
    if not (ctx.is_last_stage and ctx.tp_rank == 0):
        base.available_memory = lambda device: 3 * (model.kv_cache_bytes(1, capacity) + base.step_memory(model, 1))
    try:
        VanillaEngine(model).generate(PROMPTS, sp)
    except ValueError as e:
        return str(e)
    finally:
        base.available_memory = free
    return "not refused"


def draft_vocab(model) -> dict:
    """Drafts from a 40-id draft vocabulary whose ids sit unevenly on the TP shards (ids 0-255 on
    rank 0 at TP=2): 37 and 3 (fewer than the shortlist of 8), then 40 and none; and the slow path's
    ranking of head 1's candidates over that vocabulary (last stage)."""
    out = {}
    for name, high in {"uneven": [260, 280, 299], "one_shard": [250, 251, 252]}.items():
        if model.heads is not None:
            counts = torch.zeros(model.config.vocab_size, dtype=torch.long)
            counts[torch.arange(37) * 4] = 100 + torch.arange(37)
            counts[torch.tensor(high)] = 50
            model.heads.token_counts.copy_(counts)
        engine = SpeculativeEngine(model, SpecConfig(c_hw=24, shortlist=8, draft_vocab=40), eos_token_ids=[3],
                                   pipeline_groups=2)
        r = engine.generate(PROMPTS, SamplingConfig(temperature=1.0, max_new_tokens=16, num_samples=2, seed=9),
                            step=3)
        out[name] = {"tokens": r.tokens, "tau_per_row": r.stats["tau_per_row"]}
        if model.heads is not None:  # the slow path ranks head 1's candidates over the same ids
            sp = engine.slow_path
            cand = sp.head_candidates(sp.buffer.latest(16, 1), 1, 4, engine.draft_vocab())
            out[name]["slow_path_candidates"] = cand.tolist()
    return out


def adapt(model, ctx) -> dict:
    """Reflex with its gate forced open and one slow-path consolidation of head 1 (kept): the
    per-response speculation and the updated head weights are layout independent (in two groups
    of responses at every layout: a group's size sets its trees' budget)."""
    spec = SpecConfig(c_hw=24, reflex=ReflexConfig(alpha=0.5, z_delta=0.0, min_observations=2),
                      slow_path=SlowPathConfig(min_records=4, max_records=32, buffer_size=64, steps=3, lr=1e-3))
    engine = SpeculativeEngine(model, spec, eos_token_ids=[3], pipeline_groups=2)
    r = engine.generate(PROMPTS, SamplingConfig(temperature=1.0, max_new_tokens=16, num_samples=2, seed=9), step=2)
    res = {"tokens": r.tokens, "tau_per_row": r.stats["tau_per_row"], "gate": r.stats["reflex_gate_open"]}
    if ctx.is_last_stage:
        engine.slow_path.expected_acceptance = lambda rec, head, dv=None: 0.0  # keep the update whatever it does
        res["event"] = engine.slow_path.consolidate(1)
        w = model.heads.layers[1].weight.detach()
        res["head1"] = ctx.all_gather_tp(w).reshape(-1, w.shape[1])
    return res


def layout_name(tp: int, pp: int, last_stage_layers: Optional[int] = None) -> str:
    return f"tp{tp}pp{pp}" + (f"-last{last_stage_layers}" if last_stage_layers is not None else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", action="append", required=True,
                    help="TP,PP or TP,PP,LAST (LAST: the last stage's layers, an uneven pipeline split); "
                         "several run one after the other in these processes")
    ap.add_argument("--out", required=True, help="a folder: each layout's results in NAME.pt (layout_name)")
    args = ap.parse_args()
    for layout in args.layout:
        tp, pp, *last = (int(x) for x in layout.split(","))
        last_stage_layers = last[0] if last else None
        ctx = parallel.initialize(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 num_layers_in_last_pipeline_stage=last_stage_layers))
        name = layout_name(tp, pp, last_stage_layers)
        results = {f"{arch}-{dtype}": run(arch, dtype, ctx) for arch in models() for dtype in ("float32", "float64")}
        results["caches"] = caches(ctx, Path(args.out) / f"caches-{name}")
        if ctx.is_last_stage and ctx.tp_rank == 0:
            torch.save(results, Path(args.out) / f"{name}.pt")
    parallel.destroy()


if __name__ == "__main__":
    main()
