#!/usr/bin/env python
"""A verification forward's cost with the layers chained in inference (model/gpt._chained_layer)
against megatron-core's TransformerBlock.forward, timed alternately in one process, shape by shape.

    python tools/bench_forward_path.py --out bench_forward_path.json                  # SmolLM2's shape
    python tools/bench_forward_path.py --checkpoint smollm2 --out bench_forward_path.json

Without --checkpoint the policy is random, of SmolLM2's shape (or --layers/--hidden/...): latency does
not depend on the weights. On a GPU a small model's forward waits on the host, so this prices the
host work of each path there (gpu_checks.sh runs it); both paths give the same logits to the bit.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.checkpoint.megatron import write_json_atomic  # noqa: E402
from specroll_mcore.config import ModelConfig, ParallelConfig  # noqa: E402
from specroll_mcore.tree.budget import hardware_name  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", help="smollm2 or a checkpoint directory (default: a random policy)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    ap.add_argument("--shapes", default="1x1,1x16,64x1,64x16", help="rows x new tokens per row, comma separated")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="bench_forward_path.json")
    args = ap.parse_args()
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    except ValueError:
        raise SystemExit(f"--shapes must look like 1x1,64x16 (rows x tokens), got {args.shapes!r}")
    if args.reps < 1 or any(r < 1 or n < 1 for r, n in shapes):
        raise SystemExit("--reps and every shape's rows and tokens must be >= 1")
    from specroll_mcore.checkpoint import random_full_state_dict
    from specroll_mcore.model import PolicyModel
    from specroll_mcore.rollout.profile import alternated_medians, tree_forward

    ctx = parallel.initialize(ParallelConfig())
    if args.checkpoint:
        from specroll_mcore.checkpoint.megatron import load_policy
        from specroll_mcore.checkpoint.smollm2 import resolve_checkpoint

        policy = load_policy(resolve_checkpoint(args.checkpoint), ctx, args.dtype)
    else:
        cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.ffn,
                          num_attention_heads=args.heads, num_query_groups=args.kv_heads, vocab_size=args.vocab,
                          max_position_embeddings=8192, kv_channels=args.hidden // args.heads,
                          tie_word_embeddings=True, params_dtype=args.dtype)
        policy = PolicyModel(cfg, ctx).eval()
        policy.load_full_state_dict({k: v.to(ctx.device) for k, v in random_full_state_dict(cfg, 0).items()})
    policy.pack_for_inference()
    lean_ok = policy._lean_layers
    sync = torch.cuda.synchronize if ctx.device.type == "cuda" else (lambda: None)

    def path(run, lean: bool):
        def call() -> None:
            policy._lean_layers = lean
            run()
        return call

    report = {"hardware": hardware_name(), "dtype": args.dtype, "checkpoint": args.checkpoint,
              "layers": policy.config.num_layers, "reps": args.reps, "shapes": {}}
    with torch.inference_mode():
        for rows, n in shapes:
            run = tree_forward(policy, n, 128, rows)
            m = alternated_medians({"chained": path(run, lean_ok), "megatron": path(run, False)}, args.reps, sync)
            key = f"{rows}x{n}"
            report["shapes"][key] = {"chained_ms": m["chained"] * 1e3, "megatron_ms": m["megatron"] * 1e3,
                                     "megatron_over_chained": m["megatron"] / m["chained"]}
            print(f"{rows:4d} rows x {n:3d} tokens: chained {m['chained'] * 1e3:7.2f} ms, megatron's block "
                  f"{m['megatron'] * 1e3:7.2f} ms ({m['megatron'] / m['chained']:.2f}x)", flush=True)
    policy._lean_layers = lean_ok
    write_json_atomic(Path(args.out), report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
