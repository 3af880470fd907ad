#!/usr/bin/env python
"""Rollouts in waves (``max_num_seqs``) against all responses at once, side by side.

    python tools/bench_waves.py --prompts 16 --samples 4 --max-new-tokens 128 --max-num-seqs 16 --reps 3

SmolLM2 (or ``--checkpoint``), GSM8K-style chat prompts, T=1: each engine (vanilla, SpecRoll) rolls the
same prompts out with all responses decoded together and in waves of at most ``--max-num-seqs``,
the two alternating for ``--reps`` repetitions (which goes first alternates too). Reported: the time
of each, the median of the paired ratios waves / together, the largest KV cache each held (the
memory waves bound), tau, and whether the responses were identical in every repetition.
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
    ap.add_argument("--out", default="bench_waves.json")
    args = ap.parse_args()
    engine_names = args.engines.split(",")
    if min(args.prompts, args.samples, args.max_new_tokens, args.reps) < 1:
        ap.error("--prompts, --samples, --max-new-tokens and --reps must be >= 1")
    if not args.samples <= args.max_num_seqs < args.prompts * args.samples:
        ap.error(f"--max-num-seqs must hold one prompt's {args.samples} samples and fewer than the "
                 f"{args.prompts * args.samples} responses (else there is one wave: nothing to compare)")
    if not set(engine_names) <= {"vanilla", "specroll"}:
        ap.error(f"--engines takes vanilla and/or specroll, got {args.engines!r}")

    ctx = parallel.initialize(ParallelConfig())
    ckpt, policy, tok, _ = open_for_rollout(args.checkpoint, ctx, None)
    eos = stop_token_ids(ckpt, tok)
    spec, latency = speculative_setup(policy, SpecConfig(num_heads=policy.num_heads), ckpt)

    def engine(name: str, max_num_seqs):
        if name == "vanilla":
            return VanillaEngine(policy, eos_token_ids=eos, tokenizer=tok, max_num_seqs=max_num_seqs)
        return SpeculativeEngine(policy, spec, eos_token_ids=eos, tokenizer=tok, latency=latency,
                                 max_num_seqs=max_num_seqs)

    largest = [0]  # the largest KV cache of the rollout being timed
    new_cache = policy.new_cache

    def recorded(num_slots: int, capacity: int):
        largest[0] = max(largest[0], policy.kv_cache_bytes(num_slots, capacity))
        return new_cache(num_slots, capacity)

    policy.new_cache = recorded
    prompts = synthetic_chat_prompts(tok, args.prompts, seed=4242)
    ids = list(range(len(prompts)))
    sp = SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens, num_samples=args.samples, seed=3)
    engine("vanilla", None).generate(prompts[:1], SamplingConfig(max_new_tokens=4))  # warm-up
    report = {"checkpoint": str(ckpt), "hardware": hardware_name(), "threads": torch.get_num_threads(),
              "prompts": args.prompts, "samples": args.samples, "max_new_tokens": args.max_new_tokens,
              "max_num_seqs": args.max_num_seqs, "reps": args.reps, "c_hw": spec.c_hw, "engines": {}}
    for name in engine_names:
        engines = {"together": engine(name, None), "waves": engine(name, args.max_num_seqs)}
        times: dict[str, list[float]] = {"together": [], "waves": []}
        kv: dict[str, int] = {}
        outs: dict[str, list] = {"together": [], "waves": []}
        for rep in range(args.reps):
            for kind in (("together", "waves") if rep % 2 == 0 else ("waves", "together")):
                largest[0] = 0
                t0 = time.perf_counter()
                out = engines[kind].generate(prompts, sp, step=rep, prompt_ids=ids)
                times[kind].append(time.perf_counter() - t0)
                kv[kind] = largest[0]
                outs[kind].append(out)
                print(f"{name} {kind:8s} rep {rep}: {times[kind][-1]:.1f} s, {out.num_tokens} tokens, "
                      f"KV cache {kv[kind] / 2**20:.1f} MiB" + (f", tau {out.stats['tau']:.2f}" if "tau" in out.stats
                                                                 else ""), flush=True)
        identical = all(a.tokens == b.tokens for a, b in zip(outs["together"], outs["waves"]))
        ratios = [w / t for w, t in zip(times["waves"], times["together"])]
        row = {"together_s": times["together"], "waves_s": times["waves"],
               "time_ratio_waves_over_together": statistics.median(ratios), "paired_ratios": ratios,
               "kv_cache_mib": {k: v / 2**20 for k, v in kv.items()},
               "waves": outs["waves"][-1].stats.get("waves", 1),
               "tokens": [o.num_tokens for o in outs["together"]], "identical": identical}
        if name == "specroll":
            row["tau"] = {k: [o.stats["tau"] for o in v] for k, v in outs.items()}
        report["engines"][name] = row
        print(f"{name}: waves take x{row['time_ratio_waves_over_together']:.2f} the time of one batch, "
              f"KV cache {row['kv_cache_mib']['waves']:.0f} MiB against {row['kv_cache_mib']['together']:.0f}; "
              f"identical: {identical}", flush=True)
    write_json_atomic(args.out, report)
    print(f"wrote {args.out}")
    if not all(row["identical"] for row in report["engines"].values()):
        raise SystemExit("the responses differed between waves and one batch")


if __name__ == "__main__":
    main()
