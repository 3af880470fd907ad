#!/usr/bin/env python
"""Prefill of long prompts in one forward against pieces of at most ``--pieces`` tokens (chunked
prefill: ``max_prefill_tokens``), side by side.

    python tools/bench_prefill.py --prompt-tokens 4096 --pieces 512,1024 --reps 5

SmolLM2 (or ``--checkpoint``), ``--prompts`` prompts of ``--prompt-tokens`` tokens each (GSM8K-style
chat prompts joined end to end, cut to length), prefilled into a KV cache by the engines' own
``rollout.base.prefill``: once with ``max_prefill_tokens`` at least a prompt's length (each prompt in
one forward) and once per ``--pieces`` value, the ways alternating over ``--reps`` repetitions (after
one untimed pass each). Reported: median times and the medians of the paired ratios to one forward;
the memory a prefill allocates at its peak, beyond the KV cache (a GPU's peak allocation, on a CPU
torch's profiler's count of the allocations, one more pass); the largest difference of the last
token's logits from one forward's. The machines are shared and noisy: compare within one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from typing import Callable

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.checkpoint.megatron import write_json_atomic  # noqa: E402
from specroll_mcore.config import ParallelConfig  # noqa: E402
from specroll_mcore.rl.data import synthetic_chat_prompts  # noqa: E402
from specroll_mcore.rollout.base import prefill  # noqa: E402
from specroll_mcore.rollout.profile import open_for_rollout  # noqa: E402
from specroll_mcore.tree.budget import hardware_name  # noqa: E402


def peak_bytes(run: Callable[[], object], device: torch.device) -> int:
    """The most memory ``run`` held allocated at once beyond what it started with."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    held = peak = 0
    for event in sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start):
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    return peak


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="smollm2")
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--pieces", default="512,1024", help="max_prefill_tokens values below --prompt-tokens")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="bench_prefill.json")
    args = ap.parse_args()
    try:
        pieces = [int(x) for x in args.pieces.split(",")]
    except ValueError:
        ap.error(f"--pieces takes comma-separated numbers of tokens, got {args.pieces!r}")
    if min(args.prompts, args.prompt_tokens, args.reps) < 1:
        ap.error("--prompts, --prompt-tokens and --reps must be >= 1")
    if not all(1 <= n < args.prompt_tokens for n in pieces):
        ap.error(f"every --pieces value must be in [1, --prompt-tokens) (a prompt of {args.prompt_tokens} tokens in "
                 f"pieces of fewer tokens), got {args.pieces}")

    ctx = parallel.initialize(ParallelConfig())
    ckpt, policy, tok, _ = open_for_rollout(args.checkpoint, ctx, None, with_heads=False)
    positions = policy.config.max_position_embeddings
    if args.prompt_tokens > positions:
        ap.error(f"--prompt-tokens {args.prompt_tokens} is over the model's {positions} positions")
    stream: list[int] = []
    seed = 0
    while len(stream) < args.prompts * args.prompt_tokens:
        stream += [t for p in synthetic_chat_prompts(tok, 16, seed=seed) for t in p]
        seed += 1
    prompts = [stream[i * args.prompt_tokens:(i + 1) * args.prompt_tokens] for i in range(args.prompts)]
    ways = {"whole": args.prompt_tokens * args.prompts, **{f"pieces_{n}": n for n in pieces}}
    cache = policy.new_cache(args.prompts, args.prompt_tokens)
    logits: dict[str, torch.Tensor] = {}

    def run(name: str) -> None:
        cache.reset()
        with torch.inference_mode():
            logits[name] = prefill(policy, cache, prompts, ways[name])

    times: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    for rep in range(args.reps + 1):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            t0 = time.perf_counter()
            run(name)
            if rep:
                times[name].append(time.perf_counter() - t0)
    report = {"checkpoint": str(ckpt), "hardware": hardware_name(), "threads": torch.get_num_threads(),
              "prompts": args.prompts, "prompt_tokens": args.prompt_tokens, "reps": args.reps, "ways": {}}
    for name, limit in ways.items():
        ratios = [a / b for a, b in zip(times[name], times["whole"])]
        report["ways"][name] = {
            "max_prefill_tokens": limit,
            "forwards": 1 if name == "whole" else -(-args.prompt_tokens // limit) * args.prompts,
            "median_s": statistics.median(times[name]), "times_s": times[name],
            "time_vs_whole": statistics.median(ratios),
            "peak_mib_beyond_kv": peak_bytes(lambda: run(name), ctx.device) / 2**20,
            "logits_max_diff": float((logits[name] - logits["whole"]).abs().max())}
        w = report["ways"][name]
        print(f"{name:12s} max_prefill_tokens {limit:6d}: {w['median_s']:.3f} s ({w['time_vs_whole']:.2f}x the whole "
              f"prompt's), peak {w['peak_mib_beyond_kv']:.0f} MiB beyond the KV cache, logits within "
              f"{w['logits_max_diff']:.1e}", flush=True)
    write_json_atomic(args.out, report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
