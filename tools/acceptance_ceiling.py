#!/usr/bin/env python
"""How far speculation can go on this policy, sampler and machine: the rank-oracle ceiling beside
the horizon heads, per tree budget.

    python tools/acceptance_ceiling.py --prompts 16 --max-new-tokens 128 --temperature 1.0 --out ceiling.json

1. Sample responses with the vanilla engine (chat-templated GSM8K-style prompts, EOS honoured).
2. One teacher-forced forward per response gives the policy's rank of every sampled token.
3. For each budget N (nodes per tree, root included), the best fixed rank tree (tree/oracle.py) is
   chosen on half of the responses and replayed on the other half: the tau a drafter that ranks
   exactly like the policy would reach with N nodes (a ceiling for depth-H trees of N nodes whose
   drafts ignore the sampler's noise; coupled drafts, SpecConfig.coupled, are not bound by it: a
   coupled drafter equal to the policy reaches tau = H + 1 at any temperature).
4. The heads in the checkpoint draft on the same prompts with the same seed at every budget
   (SpecRoll engine, static heads: Reflex and slow path off; coupled unless --no-coupled), giving
   their tau.
5. The latency of a verification forward of N tokens against a one-token forward on this machine
   turns each tau into a speedup bound tau / (latency(N) / latency(1)): drafting, tree building
   and acceptance are not counted, so real speedups are lower.

The JSON holds the rank coverage (how often the sampled token is the policy's top-1, top-2, ...),
and per budget: latency ratio, oracle tau and bound, heads tau and bound.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.checkpoint.megatron import stop_token_ids, write_json_atomic  # noqa: E402
from specroll_mcore.config import ParallelConfig, ReflexConfig, SamplingConfig, SlowPathConfig, SpecConfig  # noqa: E402
from specroll_mcore.model import causal_mask  # noqa: E402
from specroll_mcore.rl.data import synthetic_chat_prompts  # noqa: E402
from specroll_mcore.rollout import SpeculativeEngine, VanillaEngine  # noqa: E402
from specroll_mcore.rollout.profile import forward_latency, open_for_rollout  # noqa: E402
from specroll_mcore.tree.oracle import best_rank_tree, oracle_tau  # noqa: E402


@torch.inference_mode()
def sampled_ranks(policy, prompt: list[int], response: list[int]) -> list[int]:
    """The policy's rank (0 = most likely) of each response token under its own prefix."""
    ids = torch.tensor([prompt + response], device=policy.ctx.device)
    L = ids.shape[1]
    meta = policy.metadata(torch.arange(L, device=ids.device)[None], causal_mask(1, L, ids.device))
    logits = policy.full_logits(policy(ids, meta))[0, len(prompt) - 1: L - 1].float()  # predicts each response token
    chosen = logits.gather(1, torch.tensor(response, device=ids.device)[:, None])
    return (logits > chosen).sum(-1).tolist()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="smollm2", help="'smollm2' or a checkpoint directory with heads")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--budgets", default="2,4,8,16", help="nodes per tree, root included")
    ap.add_argument("--topk", type=int, default=4, help="candidates per head for the heads' trees")
    ap.add_argument("--coupled", action=argparse.BooleanOptionalAction, default=True,
                    help="heads draft with the sampler's noise (SpecConfig.coupled)")
    ap.add_argument("--latency-reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--out", default="acceptance_ceiling.json")
    args = ap.parse_args()
    budgets = sorted({int(b) for b in args.budgets.split(",")})
    if args.prompts < 2 or not budgets or budgets[0] < 1:
        ap.error("need --prompts >= 2 (half choose the oracle tree, half evaluate it) and budgets >= 1")

    ctx = parallel.initialize(ParallelConfig())
    if ctx.world_size != 1:
        raise SystemExit("acceptance_ceiling.py runs in one process (TP=1, PP=1)")
    ckpt, policy, tok, _ = open_for_rollout(args.checkpoint, ctx, c_hw=max(budgets) * args.prompts)
    depth = policy.num_heads  # heads.pt is required (load_policy says how to make one)
    prompts = synthetic_chat_prompts(tok, args.prompts, seed=args.seed)
    sp = SamplingConfig(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                        num_samples=1, seed=args.seed)
    eos = stop_token_ids(ckpt, tok)
    out = VanillaEngine(policy, eos_token_ids=eos).generate(prompts, sp, prompt_ids=list(range(len(prompts))))
    ranks = [sampled_ranks(policy, p, r) for p, r in zip(prompts, out.tokens)]
    flat = [r for rs in ranks for r in rs]
    coverage = {f"top{k}": sum(r < k for r in flat) / len(flat) for k in (1, 2, 4, 8, 16)}
    print(f"{len(flat)} sampled tokens at T={args.temperature}: policy's rank < k for "
          + ", ".join(f"{k} {v:.3f}" for k, v in coverage.items()), flush=True)

    sizes = sorted({1, *budgets})
    lat = forward_latency(policy, sizes, reps=args.latency_reps)
    base = lat["tree_row_s"][0]
    fit, held = ranks[0::2], ranks[1::2]
    rows = []
    for n in budgets:
        latency_ratio = lat["tree_row_s"][sizes.index(n)] / base
        tree = best_rank_tree(fit, n, depth)
        o_tau = oracle_tau(held, tree, depth)
        spec_cfg = SpecConfig(num_heads=depth, topk=args.topk, c_hw=n * len(prompts), n_min=n, n_max=n,
                              coupled=args.coupled,
                              reflex=ReflexConfig(enabled=False), slow_path=SlowPathConfig(enabled=False))
        spec_out = SpeculativeEngine(policy, spec_cfg, eos_token_ids=eos).generate(
            prompts, sp, prompt_ids=list(range(len(prompts))))
        if spec_out.tokens != out.tokens:
            diff = sum(a != b for a, b in zip(spec_out.tokens, out.tokens))
            print(f"  note: {diff}/{len(prompts)} responses differ from vanilla at N={n} (float32 near-ties)")
        h_tau = spec_out.stats["tau"]
        rows.append({"nodes": n, "latency_ratio": latency_ratio, "oracle_tau": o_tau,
                     "oracle_speedup_bound": o_tau / latency_ratio,
                     "oracle_tree": sorted(tree, key=lambda p: (len(p), p)),
                     "heads_tau": h_tau, "heads_speedup_bound": h_tau / latency_ratio,
                     "heads_acceptance_per_depth": spec_out.stats["acceptance_per_depth"]})
        print(f"N={n:3d}: latency x{latency_ratio:.2f} | oracle tau {o_tau:.2f} (bound {o_tau / latency_ratio:.2f}x)"
              f" | heads tau {h_tau:.2f} (bound {h_tau / latency_ratio:.2f}x)", flush=True)
    report = {"checkpoint": str(ckpt), "temperature": args.temperature, "top_p": args.top_p,
              "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "depth": depth, "topk": args.topk,
              "coupled": args.coupled,
              "sampled_tokens": len(flat), "rank_coverage": coverage, "threads": torch.get_num_threads(),
              "latency": lat, "budgets": rows}
    write_json_atomic(Path(args.out), report)
    print(f"wrote {args.out}")
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
