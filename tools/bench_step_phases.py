#!/usr/bin/env python
"""The speculative step's host work, phase by phase, on inputs captured from a real rollout.

    python tools/bench_step_phases.py --prompts 1 --samples 1 --out step_phases_b1.json     # batch 1
    python tools/bench_step_phases.py --prompts 4 --samples 4 --c-hw 64 --n-max 4           # 16 responses

One SpecRoll rollout (fixed trees of --n-max nodes, so that every step drafts) records the inputs of
every step's drafting (``SpeculativeEngine.propose``), acceptance (``verify.accept``, the policy's
sampling at the tree nodes included) and feedback (``SpeculativeEngine.feedback``: the slow path's
records and Reflex); each phase is then run again on the first --steps of them, --reps times, and
the median ms per step reported. The verification forward is left out: it is the same for any host
code. Compare two versions of the code by running this tool from each, alternating; the machines
are shared and noisy, so repeat.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from typing import Any, Callable

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.checkpoint.megatron import write_json_atomic  # noqa: E402
from specroll_mcore.config import ParallelConfig, SamplingConfig, SpecConfig  # noqa: E402
from specroll_mcore.rl.data import synthetic_chat_prompts  # noqa: E402
from specroll_mcore.rollout import SpeculativeEngine  # noqa: E402
from specroll_mcore.rollout import speculative  # noqa: E402
from specroll_mcore.rollout.profile import open_for_rollout  # noqa: E402
from specroll_mcore.tree.budget import hardware_name  # noqa: E402

PHASES = ("propose", "accept", "feedback")


def capture(engine: SpeculativeEngine, prompts: list, sampling: SamplingConfig) -> tuple[dict[str, list], Any]:
    """Run one rollout, recording each phase's calls (arguments as passed)."""
    calls: dict[str, list] = {name: [] for name in PHASES}
    originals = {"propose": engine.propose, "feedback": engine.feedback, "accept": speculative.accept}

    def recorder(name: str) -> Callable:
        def call(*args, **kwargs):
            calls[name].append((args, kwargs))
            return originals[name](*args, **kwargs)
        return call

    engine.propose, engine.feedback = recorder("propose"), recorder("feedback")
    speculative.accept = recorder("accept")
    try:
        out = engine.generate(prompts, sampling, prompt_ids=list(range(len(prompts))))
    finally:
        speculative.accept = originals["accept"]
        del engine.propose, engine.feedback  # the class's methods again
    return calls, out


def replay(fn: Callable, calls: list, name: str) -> None:
    with torch.inference_mode():
        for args, kwargs in calls:
            if name == "feedback" and args[-1] is not None:  # Reflex's state is updated in place: a copy each
                args = (*args[:-1], copy.deepcopy(args[-1]))
            fn(*args, **kwargs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="smollm2", help="Megatron checkpoint dir with heads, or smollm2")
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--c-hw", type=int, default=16, help="C_hw (so that trees of --n-max nodes fit)")
    ap.add_argument("--n-max", type=int, default=8, help="nodes per row of every step's tree")
    ap.add_argument("--steps", type=int, default=40, help="captured steps replayed per phase")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default="bench_step_phases.json")
    args = ap.parse_args()
    for flag in ("prompts", "samples", "max_new_tokens", "c_hw", "n_max", "steps", "reps"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    ctx = parallel.initialize(ParallelConfig())
    ckpt, policy, tok, _ = open_for_rollout(args.checkpoint, ctx, args.c_hw)
    if policy.num_heads == 0:
        raise SystemExit(f"{ckpt} has no horizon heads: train them first (tools/train_heads.py)")
    spec = SpecConfig(num_heads=policy.num_heads, c_hw=args.c_hw, n_max=args.n_max, adaptive_nodes=False)
    engine = SpeculativeEngine(policy, spec, eos_token_ids=[tok.eos_token_id])
    prompts = synthetic_chat_prompts(tok, args.prompts, seed=4242)
    sampling = SamplingConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                              num_samples=args.samples, seed=2)
    engine.generate(prompts[:1], SamplingConfig(max_new_tokens=4), prompt_ids=[0])  # warm-up (kernels, packing)
    calls, out = capture(engine, prompts, sampling)
    methods = {"propose": engine.propose, "feedback": engine.feedback, "accept": speculative.accept}
    phases = {}
    for name in PHASES:
        taken = calls[name][:args.steps]
        if not taken:
            raise SystemExit(f"the rollout made no {name} call to time (raise --max-new-tokens)")
        replay(methods[name], taken[:1], name)  # untimed
        times = []
        for _ in range(args.reps):
            t = time.perf_counter()
            replay(methods[name], taken, name)
            times.append((time.perf_counter() - t) / len(taken) * 1e3)
        rows = [len(a[1]) if name == "feedback" else int(a[0].shape[0]) for a, _ in taken]  # slots / hidden / trees
        phases[name] = {"ms_per_step": statistics.median(times), "steps": len(taken),
                        "rows_per_step": statistics.mean(rows)}
        print(f"{name:9s} {phases[name]['ms_per_step']:7.3f} ms a step ({len(taken)} steps, "
              f"{phases[name]['rows_per_step']:.1f} rows)", flush=True)
    report = {"checkpoint": str(ckpt), "hardware": hardware_name(), "dtype": str(policy.dtype).removeprefix("torch."),
              "threads": torch.get_num_threads(), "args": vars(args), "tau": out.stats["tau"],
              "steps": out.stats["steps"], "phases": phases,
              "total_ms_per_step": sum(p["ms_per_step"] for p in phases.values())}
    write_json_atomic(args.out, report)
    print(f"host work {report['total_ms_per_step']:.2f} ms a step (tau {out.stats['tau']:.2f}); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
