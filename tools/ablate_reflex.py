#!/usr/bin/env python
"""Reflex ablation at a fixed policy: tau with the fast path off, as configured, with a looser gate,
and with the gate removed at several correction sizes, on the same prompts and seed.

    python tools/ablate_reflex.py --checkpoint smollm2 --prompts 8 --max-new-tokens 128 --out reflex_ablation.json
    python tools/ablate_reflex.py --drift-steps 100 --style reversed --sft-lr 1e-4 --out reflex_ablation_drift.json

Every variant must emit the tokens of the first one (Reflex can only change how many a step
confirms); the run fails otherwise. The gate-off rows show what the memory's correction does to the
drafts when it is always applied: if tau falls, the verifier's past feedback does not predict its
next verdict and the gate is what keeps Reflex harmless. The slow path is off throughout.

With ``--drift-steps N`` the policy is first moved by N supervised fine-tuning steps
(specroll_mcore/rl/drift.py, as in tools/bench_drift.py) while the heads stay as warm-started: the
ablation then runs where the heads are stale, which is where Reflex is meant to help.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.checkpoint.megatron import stop_token_ids, write_json_atomic  # noqa: E402
from specroll_mcore.config import ParallelConfig, ReflexConfig, SamplingConfig, SlowPathConfig, SpecConfig  # noqa: E402
from specroll_mcore.rl.data import synthetic_chat_prompts  # noqa: E402
from specroll_mcore.rl.drift import STYLES, SFTDrift  # noqa: E402
from specroll_mcore.rollout import SpeculativeEngine  # noqa: E402
from specroll_mcore.rollout.profile import open_for_rollout  # noqa: E402


def variants(alphas: list[float]) -> dict[str, ReflexConfig]:
    base = ReflexConfig()
    out = {"off": dataclasses.replace(base, enabled=False), "configured": base,
           "z_delta=0": dataclasses.replace(base, z_delta=0.0)}
    for a in alphas:
        out[f"no gate, alpha={a:g}"] = dataclasses.replace(base, gate=False, alpha=a)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="smollm2")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--c-hw", type=int, default=128, help="token capacity (N_t per row = C_hw / prompts, <= 16)")
    ap.add_argument("--alphas", default="0.03,0.1,0.3", help="correction sizes tried without the gate")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--drift-steps", type=int, default=0,
                    help="supervised fine-tuning steps that move the policy first (heads frozen); 0: none")
    ap.add_argument("--style", choices=sorted(STYLES), default="reversed", help="the drift target (see bench_drift.py)")
    ap.add_argument("--sft-lr", type=float, default=1e-4)
    ap.add_argument("--sft-batch", type=int, default=8)
    ap.add_argument("--out", default="reflex_ablation.json")
    args = ap.parse_args()
    if args.prompts < 1 or args.max_new_tokens < 1:
        ap.error("--prompts and --max-new-tokens must be >= 1")
    if args.drift_steps < 0 or args.sft_batch < 1 or not args.sft_lr > 0:
        ap.error("--drift-steps must be >= 0, --sft-batch >= 1 and --sft-lr > 0")

    ctx = parallel.initialize(ParallelConfig())
    ckpt, policy, tok, cap = open_for_rollout(args.checkpoint, ctx, args.c_hw)
    c_hw = cap.c_hw  # fixed trees (no latency curve): tau compares the drafts, not tree sizes
    prompts = synthetic_chat_prompts(tok, args.prompts, seed=555)
    sp = SamplingConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=args.seed)
    report = {"checkpoint": str(ckpt), "c_hw": c_hw, "args": vars(args), "variants": {}}
    if args.drift_steps:
        drift = SFTDrift(policy, tok, args.style, args.sft_lr, args.sft_batch, args.drift_steps)
        before = drift.held_nll()
        for _ in range(args.drift_steps):
            drift.step()
        report["sft_heldout_nll"] = [before, drift.held_nll()]
        print(f"drift: {args.drift_steps} steps, held-out {args.style} NLL {before:.3f} -> "
              f"{report['sft_heldout_nll'][1]:.3f}", flush=True)
    reference = None
    for name, rc in variants([float(a) for a in args.alphas.split(",")]).items():
        spec = SpecConfig(num_heads=policy.num_heads, c_hw=c_hw, reflex=rc, slow_path=SlowPathConfig(enabled=False))
        out = SpeculativeEngine(policy, spec, eos_token_ids=stop_token_ids(ckpt, tok)).generate(prompts, sp)
        if reference is None:
            reference = out.tokens
        elif out.tokens != reference:
            print(f"ERROR: {name} emitted other tokens than {next(iter(report['variants']))}", file=sys.stderr)
            return 1
        row = {"reflex": dataclasses.asdict(rc), "tau": out.stats["tau"],
               "acceptance_per_depth": out.stats["acceptance_per_depth"],
               "gate_open": out.stats["reflex_gate_open"],
               "alignment_per_depth": out.stats["reflex_alignment_per_depth"], "tokens": out.num_tokens}
        report["variants"][name] = row
        print(f"{name:22s} tau {row['tau']:.3f}  acceptance per depth "
              f"{[round(a, 3) for a in row['acceptance_per_depth']]}  gate open {row['gate_open']:.3f}  "
              f"alignment {[a if a is None else round(a, 3) for a in row['alignment_per_depth']]}", flush=True)
    write_json_atomic(Path(args.out), report)
    print(f"wrote {args.out}")
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
