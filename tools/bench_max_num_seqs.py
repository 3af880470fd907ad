#!/usr/bin/env python
"""Rollouts with at most ``max_num_seqs`` responses in flight: continuously batched, in static batches
of whole prompts one after another, and all at once, side by side.

    python tools/bench_max_num_seqs.py --prompts 16 --samples 4 --max-new-tokens 128 --max-num-seqs 16 --reps 3

SmolLM2 (or ``--checkpoint``), GSM8K-style chat prompts, T=1: each engine (vanilla, SpecRoll) rolls the
same prompts out three ways, which go first rotating over ``--reps`` repetitions:
``together`` (every response at once, the KV cache of all of them), ``continuous`` (``max_num_seqs``:
a waiting prompt's responses take the rows of finished ones as soon as they fit) and ``static`` (the
same bound as one ``generate`` call per batch of ``max_num_seqs // samples`` prompts, each batch
running until its longest response ends: what continuous batching replaces). Reported: the times,
the medians of the paired ratios continuous / together, static / together and static / continuous,
the largest KV cache each held, the forwards and the mean responses per decoding step, tau, and
whether the responses were identical in every repetition.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.checkpoint.megatron import stop_token_ids, write_json_atomic  # noqa: E402
from specroll_mcore.config import ParallelConfig, SamplingConfig, SpecConfig  # noqa: E402
from specroll_mcore.rl.data import synthetic_chat_prompts  # noqa: E402
from specroll_mcore.rollout import SpeculativeEngine, VanillaEngine  # noqa: E402
from specroll_mcore.rollout.base import tokens_per_step  # noqa: E402
from specroll_mcore.rollout.profile import open_for_rollout, speculative_setup  # noqa: E402
from specroll_mcore.tree.budget import hardware_name  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="smollm2")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--engines", default="vanilla,specroll")
    ap.add_argument("--out", default="bench_max_num_seqs.json")
    args = ap.parse_args()
    engine_names = args.engines.split(",")
    if min(args.prompts, args.samples, args.max_new_tokens, args.reps) < 1:
        ap.error("--prompts, --samples, --max-new-tokens and --reps must be >= 1")
    if not args.samples <= args.max_num_seqs < args.prompts * args.samples:
        ap.error(f"--max-num-seqs must hold one prompt's {args.samples} samples and fewer than the "
                 f"{args.prompts * args.samples} responses (else all are in flight at once: nothing to compare)")
    if not set(engine_names) <= {"vanilla", "specroll"}:
        ap.error(f"--engines takes vanilla and/or specroll, got {args.engines!r}")

    ctx = parallel.initialize(ParallelConfig())
    ckpt, policy, tok, _ = open_for_rollout(args.checkpoint, ctx, None)
    eos = stop_token_ids(ckpt, tok)
    spec, latency = speculative_setup(policy, SpecConfig(num_heads=policy.num_heads))

    def engine(name: str, max_num_seqs):
        if name == "vanilla":
            return VanillaEngine(policy, eos_token_ids=eos, tokenizer=tok, max_num_seqs=max_num_seqs)
        return SpeculativeEngine(policy, spec, eos_token_ids=eos, tokenizer=tok, latency=latency,
                                 max_num_seqs=max_num_seqs)

    largest = [0]  # the largest KV cache of the rollout being timed
    new_cache = policy.new_cache

    def recorded(num_slots: int, capacity: int, num_rows=None):
        largest[0] = max(largest[0], policy.kv_cache_bytes(num_rows or num_slots, capacity))
        return new_cache(num_slots, capacity, num_rows)

    policy.new_cache = recorded
    prompts = synthetic_chat_prompts(tok, args.prompts, seed=4242)
    ids = list(range(len(prompts)))
    per_batch = args.max_num_seqs // args.samples
    sp = SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens, num_samples=args.samples, seed=3)
    engine("vanilla", None).generate(prompts[:1], SamplingConfig(max_new_tokens=4))  # warm-up
    report = {"checkpoint": str(ckpt), "hardware": hardware_name(), "threads": torch.get_num_threads(),
              "prompts": args.prompts, "samples": args.samples, "max_new_tokens": args.max_new_tokens,
              "max_num_seqs": args.max_num_seqs, "static_batches": -(-args.prompts // per_batch), "reps": args.reps,
              "c_hw": spec.c_hw, "engines": {}}
    kinds = ("together", "continuous", "static")
    for name in engine_names:
        engines = {"together": engine(name, None), "continuous": engine(name, args.max_num_seqs)}

        def rollout(kind: str, rep: int) -> list:
            if kind != "static":
                return [engines[kind].generate(prompts, sp, step=rep, prompt_ids=ids)]
            return [engines["together"].generate(prompts[i:i + per_batch], sp, step=rep,
                                                 prompt_ids=ids[i:i + per_batch])
                    for i in range(0, len(prompts), per_batch)]

        times: dict[str, list[float]] = {k: [] for k in kinds}
        kv: dict[str, int] = {}
        outs: dict[str, list] = {k: [] for k in kinds}
        for rep in range(args.reps):
            for kind in kinds[rep % 3:] + kinds[:rep % 3]:
                largest[0] = 0
                t0 = time.perf_counter()
                parts = rollout(kind, rep)
                times[kind].append(time.perf_counter() - t0)
                kv[kind] = largest[0]
                outs[kind].append(parts)
                tokens = [t for o in parts for t in o.tokens]
                steps = [p for o in parts for p in o.stats["per_step"]]
                print(f"{name} {kind:10s} rep {rep}: {times[kind][-1]:.1f} s, {sum(map(len, tokens))} tokens, "
                      f"{sum(o.stats['forwards'] for o in parts)} forwards, "
                      f"{statistics.mean(p['active'] for p in steps):.1f} responses a step, "
                      f"KV cache {kv[kind] / 2**20:.1f} MiB", flush=True)

        def tokens(kind: str, rep: int) -> list:
            return [t for o in outs[kind][rep] for t in o.tokens]

        identical = all(tokens(k, r) == tokens("together", r) for k in kinds for r in range(args.reps))

        def ratio(a: str, b: str) -> float:
            return statistics.median(x / y for x, y in zip(times[a], times[b]))

        row = {**{f"{k}_s": times[k] for k in kinds},
               "time_ratio_continuous_over_together": ratio("continuous", "together"),
               "time_ratio_static_over_together": ratio("static", "together"),
               "speedup_continuous_over_static": ratio("static", "continuous"),
               "kv_cache_mib": {k: v / 2**20 for k, v in kv.items()},
               "forwards": {k: [sum(o.stats["forwards"] for o in parts) for parts in outs[k]] for k in kinds},
               "responses_per_step": {k: [statistics.mean(p["active"] for o in parts for p in o.stats["per_step"])
                                          for parts in outs[k]] for k in kinds},
               "tokens": [sum(map(len, tokens("together", r))) for r in range(args.reps)], "identical": identical}
        if name == "specroll":
            row["tau"] = {k: [tokens_per_step([p for o in parts for p in o.stats["per_step"]]) for parts in outs[k]]
                          for k in kinds}
        report["engines"][name] = row
        print(f"{name}: continuous x{row['time_ratio_continuous_over_together']:.2f} the time of all at once, "
              f"static batches x{row['time_ratio_static_over_together']:.2f}; continuous is "
              f"{row['speedup_continuous_over_static']:.2f}x static; KV cache {row['kv_cache_mib']['continuous']:.0f} "
              f"MiB against {row['kv_cache_mib']['together']:.0f}; identical: {identical}", flush=True)
    write_json_atomic(args.out, report)
    print(f"wrote {args.out}")
    if not all(row["identical"] for row in report["engines"].values()):
        raise SystemExit("the responses differed between the ways of batching them")


if __name__ == "__main__":
    main()
