#!/usr/bin/env python
"""Collectives per rollout step of each engine at a parallel layout, by call site, and the rollout time.

    torchrun --standalone --nproc_per_node 2 tools/bench_collectives.py --tp 2 --out bench_collectives.json
    torchrun --standalone --nproc_per_node 2 tools/bench_collectives.py --tp 2 --top-p 0.95 --hidden 512 \\
        --layers 8 --vocab 32000
    torchrun --standalone --nproc_per_node 3 tools/bench_collectives.py --tp 3 --checkpoint smollm2

The policy is a seeded random Llama of the given shape with random horizon heads, or a checkpoint
(``--checkpoint``: with its heads where it has them, else zero-initialised ones); P random prompts of
16-40 tokens x G samples at T=1 (``--top-p``: the drafts' filter takes one more exchange). Each engine
rolls out once untimed, then ``--reps`` times, the engines alternating, then once more with
``torch.distributed``'s collectives (megatron-core's included) counted by kind and by call site (the
innermost frame of this package outside parallel.py, and its caller). Reported per engine: collectives
per forward and per token, by kind and by call site, the median rollout seconds and tau; the engines'
tokens must be identical (the tool exits non-zero otherwise). The counts depend on the code and the
layout, not on the machine: compare code versions by them, and their times only side by side. The
first rank writes the JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.checkpoint.megatron import write_json_atomic  # noqa: E402
from specroll_mcore.config import ParallelConfig, SamplingConfig, SpecConfig, tiny_llama  # noqa: E402
from specroll_mcore.rollout import SpeculativeEngine, VanillaEngine  # noqa: E402
from specroll_mcore.tree.budget import hardware_name  # noqa: E402

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
               "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_to_all_single", "all_gather_object",
               "broadcast_object_list", "barrier")


@contextmanager
def counted() -> Iterator[Counter]:
    """Inside, every call of a ``torch.distributed`` collective (:data:`COLLECTIVES`) is counted by
    (kind, call site)."""
    calls: Counter = Counter()
    real = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def wrapped(name, fn):
        def call(*args, **kwargs):
            frames = [f"{f.filename.split('specroll_mcore/')[-1]}:{f.lineno} {f.name}"
                      for f in reversed(traceback.extract_stack()[:-1])
                      if "specroll_mcore/" in f.filename and not f.filename.endswith("specroll_mcore/parallel.py")]
            calls[(name, " < ".join(frames[:2]) or "?")] += 1
            return fn(*args, **kwargs)
        return call

    for name, fn in real.items():
        setattr(dist, name, wrapped(name, fn))
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def policy_for(args: argparse.Namespace, ctx):
    if args.checkpoint:
        from specroll_mcore.checkpoint.megatron import heads_path, load_policy
        from specroll_mcore.checkpoint.smollm2 import resolve_checkpoint

        ckpt = resolve_checkpoint(args.checkpoint)
        with_heads = heads_path(ckpt).is_file()
        return load_policy(ckpt, ctx, num_heads=0 if with_heads else 3, with_heads=with_heads), str(ckpt)
    from specroll_mcore.checkpoint import random_full_heads, random_full_state_dict
    from specroll_mcore.model import PolicyModel

    cfg = tiny_llama(num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.hidden * 11 // 4,
                     num_attention_heads=args.heads, num_query_groups=args.groups, vocab_size=args.vocab,
                     max_position_embeddings=512)
    model = PolicyModel(cfg, ctx, num_heads=3).eval()
    model.load_full_state_dict(random_full_state_dict(cfg, seed=7, std=0.05))
    model.load_full_heads(random_full_heads(cfg, 3, torch.Generator().manual_seed(11)))
    return model, "random llama " + "x".join(map(str, (args.layers, args.hidden, args.vocab)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--checkpoint", help="a checkpoint, or smollm2 (default: a random Llama of the shape below)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4, help="attention heads (TP must divide them and --groups)")
    ap.add_argument("--groups", type=int, default=2, help="key/value heads")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--c-hw", type=int, default=24, help="the SpecRoll engine's C_hw (no profile is taken)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="bench_collectives.json")
    args = ap.parse_args()
    if min(args.prompts, args.samples, args.max_new_tokens, args.reps, args.c_hw) < 1 or not 0 < args.top_p <= 1:
        ap.error("--prompts, --samples, --max-new-tokens, --reps and --c-hw must be >= 1, --top-p in (0, 1]")
    ctx = parallel.initialize(ParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp))
    model, source = policy_for(args, ctx)
    g = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (int(torch.randint(16, 41, (1,), generator=g)),), generator=g).tolist()
               for _ in range(args.prompts)]
    sp = SamplingConfig(temperature=1.0, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                        num_samples=args.samples, seed=3)
    engines = {"vanilla": VanillaEngine(model),
               "specroll": SpeculativeEngine(model, SpecConfig(num_heads=model.num_heads, c_hw=args.c_hw))}
    outs = {name: engine.generate(prompts, sp, step=1) for name, engine in engines.items()}  # (untimed)
    if outs["vanilla"].tokens != outs["specroll"].tokens:
        raise SystemExit("the engines' tokens differ")
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    for rep in range(args.reps):
        for name in (list(engines) if rep % 2 == 0 else list(engines)[::-1]):
            ctx.barrier()
            t = time.perf_counter()
            engines[name].generate(prompts, sp, step=1)
            seconds[name].append(time.perf_counter() - t)
    report = {"policy": source, "hardware": hardware_name(), "tp": ctx.tp_size, "pp": ctx.pp_size,
              "prompts": args.prompts, "samples": args.samples, "max_new_tokens": args.max_new_tokens,
              "top_p": args.top_p, "c_hw": args.c_hw, "reps": args.reps, "engines": {}}
    for name, engine in engines.items():
        with counted() as calls:
            out = engine.generate(prompts, sp, step=1)
        forwards, total = out.stats["forwards"], sum(calls.values())
        kinds = Counter()
        for (kind, _), n in calls.items():
            kinds[kind] += n
        report["engines"][name] = {
            "collectives": total, "forwards": forwards, "tokens": out.num_tokens,
            "per_forward": total / forwards, "per_token": total / out.num_tokens, "tau": out.stats.get("tau"),
            "by_kind": dict(kinds.most_common()),
            "by_site": {f"{kind} {site}": n for (kind, site), n in calls.most_common()},
            "seconds": seconds[name], "median_s": statistics.median(seconds[name])}
    v, s = report["engines"]["vanilla"], report["engines"]["specroll"]
    report["specroll_over_vanilla"] = {"per_forward": s["per_forward"] / v["per_forward"],
                                       "collectives": s["collectives"] / v["collectives"],
                                       "speedup": statistics.median(a / b for a, b in zip(v["seconds"],
                                                                                          s["seconds"]))}
    if ctx.rank == 0:
        for name, row in report["engines"].items():
            print(f"{name:9s} {row['collectives']:5d} collectives over {row['forwards']} forwards "
                  f"({row['per_forward']:.1f} a forward, {row['per_token']:.2f} a token), median "
                  f"{row['median_s']:.3f} s, tau {row['tau'] or 1:.2f}")
            for site, n in list(row["by_site"].items())[:8]:
                print(f"    {n:5d}  {site}")
        write_json_atomic(Path(args.out), report)
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
