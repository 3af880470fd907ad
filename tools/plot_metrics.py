#!/usr/bin/env python
"""Plot a GRPO run's metrics.jsonl: reward and accuracy over steps, and generation time of SpecRoll
against the vanilla engine measured on the same steps (when the run compared them).

    python tools/plot_metrics.py runs/smollm2_gsm8k_cpu/metrics.jsonl --out reward_curve.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REQUIRED = ("step", "reward_mean", "accuracy", "generation_s", "training_s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics")
    ap.add_argument("--out", default="grpo_metrics.png")
    ap.add_argument("--window", type=int, default=5, help="moving-average window for the reward")
    args = ap.parse_args()
    path = Path(args.metrics)
    if not path.is_file():
        print(f"{path} does not exist: pass the metrics.jsonl of a `specroll train` run", file=sys.stderr)
        return 2
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            print(f"{path}, line {n}: not JSON ({e})", file=sys.stderr)
            return 2
        missing = [k for k in REQUIRED if k not in rows[-1]]
        if missing:
            print(f"{path}, line {n}: lacks {missing}; is this the metrics.jsonl of a `specroll train` run?",
                  file=sys.stderr)
            return 2
    if not rows:
        print(f"{args.metrics} has no rows", file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    reward = [r["reward_mean"] for r in rows]
    smooth = [statistics.mean(reward[max(0, i - args.window + 1): i + 1]) for i in range(len(reward))]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    ax.plot(steps, reward, "o", alpha=0.4, label="reward (per step)")
    ax.plot(steps, smooth, "-", label=f"reward ({args.window}-step mean)")
    ax.plot(steps, [r["accuracy"] for r in rows], "--", alpha=0.6, label="accuracy")
    ax.set_xlabel("GRPO step")
    ax.set_title("Reward")
    ax.legend()
    ax = axes[1]
    ax.plot(steps, [r["generation_s"] for r in rows], "o-", label="SpecRoll generation")
    if any("vanilla_gen_s" in r for r in rows):
        compared = [r for r in rows if "vanilla_gen_s" in r]
        ax.plot([r["step"] for r in compared], [r["vanilla_gen_s"] for r in compared], "s-",
                label="vanilla generation (same step)")
    ax.plot(steps, [r["training_s"] for r in rows], "^-", label="policy update")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("seconds")
    ax.set_title("Step time")
    ax.legend()
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
