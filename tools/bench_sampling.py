#!/usr/bin/env python
"""The counter-based sampler on CPU with its compiled noise kernel and with torch's ops, side by side.

    python tools/bench_sampling.py --rows 1,16,256 --shapes 1x1,4x4 --max-new-tokens 128 --reps 3 \
        --out bench_sampling.json

Two parts, each alternating the kernel on and off (``SPECROLL_NOISE_KERNEL``, read at every call)
in one process, ABBA, for --reps rounds:
  * ``sample`` on [rows, 49152] float32 logits at T=1 (SmolLM2's vocabulary), ms per call (median
    of 7 calls per turn); the noise alone too;
  * rollouts of SmolLM2 with both engines for P x G prompt shapes (``4x4``: 4 prompts x 4 samples),
    T=1, EOS honoured, tokens checked identical on and off.
With ``--top-p`` < 1 the rollouts sample with that nucleus, and a third part runs them (kernel on)
with each row's top-p cut looked for among its ``sampling.NUCLEUS_WINDOW`` most likely ids first
("on") against every row sorted whole ("off").
Reported: medians of the paired ratios (off / on); absolute times on shared machines are noisy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from specroll_mcore import parallel, sampling  # noqa: E402
from specroll_mcore.checkpoint.megatron import stop_token_ids, write_json_atomic  # noqa: E402
from specroll_mcore.config import ParallelConfig, SamplingConfig, SpecConfig  # noqa: E402
from specroll_mcore.rl.data import synthetic_chat_prompts  # noqa: E402
from specroll_mcore.rollout import SpeculativeEngine, VanillaEngine  # noqa: E402
from specroll_mcore.rollout.profile import open_for_rollout  # noqa: E402
from specroll_mcore.tree.budget import hardware_name  # noqa: E402

VOCAB = 49152


def kernel(on: bool) -> None:
    os.environ["SPECROLL_NOISE_KERNEL"] = "1" if on else "0"


def call_ms(fn, calls: int = 7) -> float:
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def nucleus_window(on: bool, window: int = sampling.NUCLEUS_WINDOW) -> None:
    """Top-p's cut looked for in each row's top ids first (on), or every row sorted whole (off)."""
    sampling.NUCLEUS_WINDOW = window if on else sys.maxsize


def paired(measure, reps: int, switch=kernel) -> dict:
    """``measure()`` -> (time, result to compare), taken with ``switch`` on and off (the noise kernel
    by default) in ABBA order for ``reps`` rounds: both times, the median of the ratios off / on, and
    whether the results agreed."""
    on_t, off_t, same = [], [], True
    for r in range(reps):
        order = (True, False) if r % 2 == 0 else (False, True)
        got = {}
        for on in order:
            switch(on)
            got[on] = measure()
        (t_on, res_on), (t_off, res_off) = got[True], got[False]
        on_t.append(t_on)
        off_t.append(t_off)
        same = same and res_on == res_off
    return {"on": on_t, "off": off_t, "speedup_median": statistics.median(b / a for a, b in zip(on_t, off_t)),
            "identical": same}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="smollm2")
    ap.add_argument("--rows", default="1,16,256", help="rows of the sample() calls, comma-separated")
    ap.add_argument("--shapes", default="1x1,4x4", help="rollouts: PROMPTSxSAMPLES, comma-separated ('' for none)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="the rollouts' nucleus; < 1 adds the rollouts with top-p's cut looked for among each row's "
                         "most likely ids against every row sorted whole")
    ap.add_argument("--out", default="bench_sampling.json")
    args = ap.parse_args()
    if sampling.noise_kernel() is None:
        print("the noise kernel is not built on this machine (see the warning above): nothing to compare")
        return 1
    if not 0 < args.top_p <= 1:
        ap.error(f"--top-p must be in (0, 1], got {args.top_p}")
    report = {"hardware": hardware_name(), "threads": torch.get_num_threads(), "reps": args.reps,
              "vocab": VOCAB, "top_p": args.top_p, "sample_ms": {}, "noise_ms": {}, "rollouts": {}}
    if args.top_p < 1:
        report.update(nucleus_window=sampling.NUCLEUS_WINDOW, nucleus_rollouts={})
    gen = torch.Generator().manual_seed(0)
    for n in (int(r) for r in args.rows.split(",") if r):
        logits = torch.randn(n, VOCAB, generator=gen) * 3
        keys = sampling.SampleKeys(0, 1, torch.arange(n), torch.zeros(n, dtype=torch.long), torch.full((n,), 5))
        report["sample_ms"][n] = paired(lambda: (call_ms(lambda: sampling.sample(logits, keys, 1.0)),
                                                 sampling.sample(logits, keys, 1.0)[0].tolist()), args.reps)
        report["noise_ms"][n] = paired(lambda: (call_ms(lambda: sampling.gumbel_noise(keys, VOCAB, torch.float32)),
                                                None), args.reps)
        print(f"sample, {n} rows: {report['sample_ms'][n]['speedup_median']:.2f}x "
              f"({statistics.median(report['sample_ms'][n]['off']):.2f} -> "
              f"{statistics.median(report['sample_ms'][n]['on']):.2f} ms); noise "
              f"{report['noise_ms'][n]['speedup_median']:.2f}x", flush=True)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    if shapes:
        ctx = parallel.initialize(ParallelConfig())
        ckpt, policy, tok, cap = open_for_rollout(args.checkpoint, ctx)
        eos = stop_token_ids(ckpt, tok)
        engines = {"vanilla": VanillaEngine(policy, eos_token_ids=eos),
                   "specroll": SpeculativeEngine(policy, SpecConfig(num_heads=policy.num_heads, c_hw=cap.c_hw),
                                                 eos_token_ids=eos, latency=cap.latency)}
        report["c_hw"] = cap.c_hw
        for P, G in shapes:
            prompts = synthetic_chat_prompts(tok, P, seed=777)
            sp = SamplingConfig(temperature=1.0, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                                num_samples=G, seed=1)
            for name, engine in engines.items():
                def rollout():
                    t0 = time.perf_counter()
                    out = engine.generate(prompts, sp, prompt_ids=list(range(P)))
                    return time.perf_counter() - t0, out.tokens
                engine.generate(prompts[:1], SamplingConfig(max_new_tokens=4))  # warm-up
                parts = [("rollouts", kernel, "noise kernel")]
                if args.top_p < 1:
                    parts.append(("nucleus_rollouts", nucleus_window, "top-p window"))
                for part, switch, what in parts:
                    res = paired(rollout, args.reps, switch)
                    kernel(True)
                    nucleus_window(True)
                    report[part][f"{name} {P}x{G}"] = res
                    print(f"{what}, {name} {P}x{G}: {res['speedup_median']:.2f}x ({statistics.median(res['off']):.1f} "
                          f"-> {statistics.median(res['on']):.1f} s), tokens identical on and off: {res['identical']}",
                          flush=True)
    write_json_atomic(Path(args.out), report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
