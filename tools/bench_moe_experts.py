#!/usr/bin/env python
"""Mixture-of-experts decoding with only the routed experts run against megatron-core's SequentialMLP,
which runs every expert, side by side.

    python tools/bench_moe_experts.py --rows 1,16,64 --max-new-tokens 32 --reps 5 --out bench_moe_experts.json

A policy of Qwen3-MoE's kind with random weights (``--layers``, ``--hidden``, ``--experts``, ``--topk``,
``--expert-ffn``; or ``--checkpoint``) decodes ``--max-new-tokens`` tokens for batches of each row
count with the vanilla engine, T=1, once with :class:`specroll_mcore.model.gpt.SpecRollSequentialMLP`'s
inference forward (the routed experts only) and once with megatron-core's ``SequentialMLP.forward``
(every expert, empty ones included), alternating ABBA for --reps rounds in one process. Reported:
ms per decoding step of both, the median of the paired ratios (all / routed), and whether the tokens
were identical; absolute times on shared machines are noisy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from megatron.core.transformer.moe.experts import SequentialMLP  # noqa: E402

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.checkpoint import random_full_state_dict  # noqa: E402
from specroll_mcore.checkpoint.megatron import load_policy, write_json_atomic  # noqa: E402
from specroll_mcore.config import ParallelConfig, SamplingConfig, tiny_qwen3_moe  # noqa: E402
from specroll_mcore.model import PolicyModel  # noqa: E402
from specroll_mcore.model.gpt import SpecRollSequentialMLP  # noqa: E402
from specroll_mcore.rollout import VanillaEngine  # noqa: E402
from specroll_mcore.tree.budget import hardware_name  # noqa: E402

ROUTED = SpecRollSequentialMLP.forward


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", help="a Megatron checkpoint of a mixture of experts (default: random weights)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--expert-ffn", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", default="1,16,64", help="batch sizes, comma-separated")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="bench_moe_experts.json")
    args = ap.parse_args()
    ctx = parallel.initialize(ParallelConfig())
    if args.checkpoint:
        policy = load_policy(Path(args.checkpoint), ctx, params_dtype=args.dtype)
        if not policy.config.is_moe:
            ap.error(f"{args.checkpoint} holds a dense model: there are no experts to compare")
    else:
        heads = max(1, args.hidden // 64)
        cfg = tiny_qwen3_moe(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=heads,
                             num_query_groups=1, kv_channels=64, num_experts=args.experts, moe_router_topk=args.topk,
                             moe_ffn_hidden_size=args.expert_ffn, vocab_size=2048, params_dtype=args.dtype)
        policy = PolicyModel(cfg, ctx).eval()
        policy.load_full_state_dict(random_full_state_dict(cfg, 0))
    c = policy.config
    engine = VanillaEngine(policy)
    sp = SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens, ignore_eos=True, seed=1)
    report = {"hardware": hardware_name(), "threads": torch.get_num_threads(), "reps": args.reps,
              "model": {"layers": c.num_layers, "hidden": c.hidden_size, "experts": c.num_experts,
                        "topk": c.moe_router_topk, "expert_ffn": c.moe_ffn_hidden_size, "dtype": c.params_dtype},
              "max_new_tokens": args.max_new_tokens, "rows": {}}
    for rows in (int(r) for r in args.rows.split(",") if r):
        prompts = [[5 + i % 1000, 6, 7, 8] for i in range(rows)]
        times: dict[str, list[float]] = {"routed": [], "all": []}
        tokens: dict[str, list] = {}
        engine.generate(prompts, sp)  # warm-up
        for r in range(args.reps):
            for mode in (("routed", "all") if r % 2 == 0 else ("all", "routed")):
                SpecRollSequentialMLP.forward = ROUTED if mode == "routed" else SequentialMLP.forward
                t0 = time.perf_counter()
                out = engine.generate(prompts, sp)
                times[mode].append(1e3 * (time.perf_counter() - t0) / args.max_new_tokens)
                tokens[mode] = out.tokens
        SpecRollSequentialMLP.forward = ROUTED
        res = {"ms_per_step_routed": statistics.median(times["routed"]),
               "ms_per_step_all": statistics.median(times["all"]),
               "speedup_median": statistics.median(a / b for a, b in zip(times["all"], times["routed"])),
               "identical": tokens["routed"] == tokens["all"], "times_ms": times}
        report["rows"][rows] = res
        print(f"{rows} rows: {res['speedup_median']:.2f}x ({res['ms_per_step_all']:.1f} -> "
              f"{res['ms_per_step_routed']:.1f} ms a step), tokens identical: {res['identical']}", flush=True)
    write_json_atomic(Path(args.out), report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
