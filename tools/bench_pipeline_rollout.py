#!/usr/bin/env python
"""Rollouts under pipeline parallelism: the whole batch through the stages one after another
against groups of responses interleaved over the stages (``pipeline_groups``), side by side.

    torchrun --standalone --nproc_per_node 2 tools/bench_pipeline_rollout.py --pp 2 --out bench_pp2.json

SmolLM2-135M-Instruct (heads from tools/train_heads.py) split over the pipeline stages; P GSM8K-style
prompts x G samples, T=1, EOS honoured. For each engine (vanilla, SpecRoll) the variants alternate
for --reps repetitions in one run: the whole batch in one group (``pipeline_groups=1``: a stage
waits while the others compute) and one group per stage (the default), on an even layer split and
on each uneven one given by --last-stage-layers (the same weights, resharded); every repetition
checks that all variants emitted identical tokens. Reported: per engine and variant the median of
the paired time ratios against one group on the even split, and tau for SpecRoll (a group's size
sets its trees' budget). The last stage writes the JSON.

    torchrun --standalone --nproc_per_node 2 tools/bench_pipeline_rollout.py --pp 2 --last-stage-layers 10
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.checkpoint.megatron import (load_policy, stop_token_ids,  # noqa: E402
                                                write_json_atomic)
from specroll_mcore.config import ParallelConfig, SamplingConfig, SpecConfig  # noqa: E402
from specroll_mcore.rl.data import synthetic_chat_prompts  # noqa: E402
from specroll_mcore.rollout import SpeculativeEngine, VanillaEngine  # noqa: E402
from specroll_mcore.rollout.profile import open_for_rollout  # noqa: E402
from specroll_mcore.tree.budget import hardware_name  # noqa: E402


def timed(engine, prompts, sp, ctx):
    ctx.barrier()
    t0 = time.perf_counter()
    out = engine.generate(prompts, sp, prompt_ids=list(range(len(prompts))))
    ctx.barrier()
    return time.perf_counter() - t0, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="smollm2")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--last-stage-layers", type=int, action="append", default=[],
                    help="also run an uneven split with this many layers on the last stage (repeatable)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--c-hw", type=int, default=None)
    ap.add_argument("--engines", default="vanilla,specroll")
    ap.add_argument("--out", default="bench_pipeline_rollout.json")
    args = ap.parse_args()
    ctx = parallel.initialize(ParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp))
    ckpt, policy, tok, cap = open_for_rollout(args.checkpoint, ctx, args.c_hw)
    policies = {"even": policy}
    for n in args.last_stage_layers:  # the same weights split otherwise (resharded from the full form)
        policies[f"last{n}"] = load_policy(ckpt, dataclasses.replace(ctx, last_stage_layers=n), with_heads=True)
    writer = ctx.is_last_stage and ctx.tp_rank == 0 and ctx.dp_rank == 0

    def say(msg: str) -> None:
        if writer:
            print(msg, flush=True)

    eos = stop_token_ids(ckpt, tok)
    spec_cfg = SpecConfig(num_heads=policy.num_heads, c_hw=cap.c_hw)

    def make(name: str, model, groups: int):
        if name == "vanilla":
            return VanillaEngine(model, eos_token_ids=eos, pipeline_groups=groups)
        return SpeculativeEngine(model, spec_cfg, eos_token_ids=eos, latency=cap.latency, pipeline_groups=groups)

    sp = SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens, num_samples=args.samples, seed=3)
    prompts = synthetic_chat_prompts(tok, args.prompts, seed=4242)
    for model in policies.values():  # warm-up
        timed(make("vanilla", model, ctx.pp_size), prompts[:1], SamplingConfig(max_new_tokens=4), ctx)
    report = {"checkpoint": str(ckpt), "hardware": hardware_name(), "tp": ctx.tp_size, "pp": ctx.pp_size,
              "stage_layers": {k: m.ctx.stage_layers(m.config.num_layers) for k, m in policies.items()},
              "threads_per_process": torch.get_num_threads(), "c_hw": cap.c_hw, "prompts": args.prompts,
              "samples": args.samples, "max_new_tokens": args.max_new_tokens, "reps": args.reps, "engines": {}}
    for name in args.engines.split(","):
        variants = {"even/one_group": make(name, policy, 1)}
        variants.update({f"{k}/interleaved": make(name, m, ctx.pp_size) for k, m in policies.items()})
        runs = {v: [] for v in variants}
        for rep in range(args.reps):
            outs = {}
            for v, engine in variants.items():
                seconds, outs[v] = timed(engine, prompts, sp, ctx)
                runs[v].append({"seconds": seconds, "tokens": outs[v].num_tokens, "tau": outs[v].stats.get("tau"),
                                "forwards": outs[v].stats["forwards"]})
            base = outs["even/one_group"]
            for v, out in outs.items():
                if out.tokens != base.tokens:
                    raise SystemExit(f"{name}: tokens of {v} differ from even/one_group (rep {rep})")
            say(f"{name} rep {rep}: " + ", ".join(f"{v} {r[-1]['seconds']:.2f} s" for v, r in runs.items())
                + f"; {base.num_tokens} tokens, identical")
        base = runs["even/one_group"]
        speedups = {v: statistics.median(a["seconds"] / b["seconds"] for a, b in zip(base, r))
                    for v, r in runs.items() if v != "even/one_group"}
        report["engines"][name] = {"runs": runs, "speedup_over_even_one_group_median": speedups,
                                   "tokens_identical": True}
        say(f"{name}: speedup over the whole batch in one group, even split (median of {args.reps} paired "
            f"ratios): " + ", ".join(f"{v} {x:.2f}x" for v, x in speedups.items()))
    if writer:
        write_json_atomic(args.out, report)
    parallel.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
