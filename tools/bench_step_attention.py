#!/usr/bin/env python
"""Half-precision step forwards with the step-attention kernel against ordered attention, side by side.

    python tools/bench_step_attention.py --out docs/results/step_attention_smollm2.json
    python tools/bench_step_attention.py --shapes 16x1,16x4 --context 512 --reps 9

Loads the checkpoint in bfloat16 (PolicyModel.batch_invariant: every step computes each token as a
one-token forward would) and times whole verification forwards of R rows appending N-node trees
each to a --context-token committed prefix (rollout/profile.tree_forward: a causal chain, logits
included), once on the step kernel (model/attention.py, csrc/step_attention.cpp) and once on
ordered attention (SPECROLL_STEP_ATTENTION=0), alternating within every repetition; reports medians
in ms and their ratio. The machines are shared and noisy: compare within one run, not across runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.checkpoint.megatron import load_policy, write_json_atomic  # noqa: E402
from specroll_mcore.checkpoint.smollm2 import resolve_checkpoint  # noqa: E402
from specroll_mcore.config import ParallelConfig  # noqa: E402
from specroll_mcore.model.attention import step_attention_kernels  # noqa: E402
from specroll_mcore.rollout.profile import alternated_medians, tree_forward  # noqa: E402
from specroll_mcore.tree.budget import hardware_name  # noqa: E402

SETTINGS = {"step_kernel": "1", "ordered_attention": "0"}  # SPECROLL_STEP_ATTENTION


def parse_shapes(text: str) -> list[tuple[int, int]]:
    try:
        shapes = [tuple(int(v) for v in part.split("x")) for part in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise SystemExit(f"--shapes must be ROWSxNODES[,ROWSxNODES...] with positive integers, got {text!r}")
    return shapes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="smollm2")
    ap.add_argument("--shapes", default="1x1,1x4,1x8,1x16,16x1,16x2,16x4,64x1",
                    help="rows x nodes per row of the forwards timed")
    ap.add_argument("--context", type=int, default=320, help="committed tokens per row")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="bench_step_attention.json")
    args = ap.parse_args()
    shapes = parse_shapes(args.shapes)
    if step_attention_kernels() is None:
        print("no step-attention kernel on this machine (it needs an AVX-512 CPU and a C++ compiler): "
              "nothing to compare", file=sys.stderr)
        return 2
    ctx = parallel.initialize(ParallelConfig())
    policy = load_policy(resolve_checkpoint(args.checkpoint), ctx, "bfloat16", with_heads=False)
    report = {"checkpoint": args.checkpoint, "hardware": hardware_name(), "dtype": "bfloat16",
              "threads": torch.get_num_threads(), "context": args.context, "reps": args.reps, "shapes": {}}
    with torch.inference_mode():
        def timed(name: str, rows: int, n: int):
            os.environ["SPECROLL_STEP_ATTENTION"] = SETTINGS[name]  # its cache: position-major keys or not
            step = tree_forward(policy, n, args.context, rows)

            def run() -> None:
                os.environ["SPECROLL_STEP_ATTENTION"] = SETTINGS[name]
                step()
            return run

        medians = alternated_medians({(name, r, n): timed(name, r, n) for r, n in shapes for name in SETTINGS},
                                     args.reps, lambda: None)
        for r, n in shapes:
            ms = {name: medians[(name, r, n)] * 1e3 for name in SETTINGS}
            report["shapes"][f"{r}x{n}"] = {**ms, "ordered_over_kernel": ms["ordered_attention"] / ms["step_kernel"]}
            print(f"{r:4d} rows x {n:3d} nodes: step kernel {ms['step_kernel']:7.1f} ms   ordered attention "
                  f"{ms['ordered_attention']:7.1f} ms   ({ms['ordered_attention'] / ms['step_kernel']:.2f}x)",
                  flush=True)
    os.environ.pop("SPECROLL_STEP_ATTENTION", None)
    write_json_atomic(Path(args.out), report)
    print(f"wrote {args.out}")
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
