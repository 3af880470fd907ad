#!/usr/bin/env python
"""The exactness contract under random configurations: SpecRoll's rollouts against the vanilla
engine's, token for token, in float64 (where near-ties cannot happen) or bfloat16 on a CPU.

    python tools/fuzz_exactness.py --minutes 10 --out fuzz_exactness.json
    python tools/fuzz_exactness.py --replay 123456789      # one case again, described

Each case draws, from its own seed: a random tiny model (Llama, Qwen2, Qwen3 or Qwen3-MoE shapes,
float64) whose horizon heads are random, or whose embeddings are all nearly the same so that the
heads draft nearly the policy's own distribution (long accepted paths, to the end of the trees);
1-5 prompts of 1-20 tokens; the sampling (greedy or T = 0.6 / 1, top-p, top-k, min-p, 1-40 new
tokens, 1-3 samples, the seed and the rollout step, prompt ids); an end-of-sequence token (one the
model emits, or none); the scheduling (``max_num_seqs``: continuous batching; ``max_prefill_tokens``:
prompts prefilled in pieces); the speculative engine's settings (C_hw, top-k, N_max, coupled drafts,
a draft vocabulary, Reflex, the slow path, a latency curve that trims trees or none, acceptance
walked or sampled at once). It then checks, against the vanilla engine with everything at once:

- the vanilla engine with the case's scheduling,
- the speculative engine with the case's scheduling and settings,
- the speculative engine on a random subset of the prompts (same prompt ids): their responses alone

give the same tokens, finish reasons and log-probs (to 1e-9). ``--dtype bfloat16`` checks the same on
a half-precision policy, whose steps a CPU with AVX-512 bfloat16 instructions computes bit for bit
as one-token forwards (``PolicyModel.batch_invariant``; half its models in SmolLM2's attention
shape, for the step-attention kernel). Reported (JSON): the cases, every
failure with its case seed (``--replay`` it), the engine, the first response and position that
differ; how often each setting was drawn; SpecRoll's tokens per step over the cases. Exits 1 on
any failure. A tool for changes to the engines, trees, sampler or acceptance, beside the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Optional

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.checkpoint import random_full_state_dict  # noqa: E402
from specroll_mcore.checkpoint.megatron import write_json_atomic  # noqa: E402
from specroll_mcore.config import (ParallelConfig, ReflexConfig, SamplingConfig, SlowPathConfig,  # noqa: E402
                                   SpecConfig, tiny_llama, tiny_qwen2, tiny_qwen3, tiny_qwen3_moe)
from specroll_mcore.model import PolicyModel  # noqa: E402
from specroll_mcore.rollout import SpeculativeEngine, VanillaEngine  # noqa: E402
from specroll_mcore.rollout.base import RolloutOutput  # noqa: E402
from specroll_mcore.tree import LatencyCurve  # noqa: E402

ARCHS = {"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3, "qwen3_moe": tiny_qwen3_moe}
CURVES = {"none": None, "flat": LatencyCurve((1, 64), (1.0, 1.0)), "steep": LatencyCurve((1, 2, 64), (1.0, 2.0, 64.0)),
          "mid": LatencyCurve((1, 8, 16, 64), (1.0, 1.1, 2.0, 8.0))}


def bfloat16_kernels() -> bool:
    """Whether this CPU has AVX-512 bfloat16 instructions (tests/unit/test_batch_invariance.py)."""
    info = Path("/proc/cpuinfo")
    return info.exists() and "avx512_bf16" in info.read_text()


def draw_model(r: random.Random, ctx: Any, archs: list[str], dtype: str) -> tuple[PolicyModel, dict[str, Any]]:
    """A tiny model with 3 heads: random heads, or embeddings within ``spread`` of one vector (the
    policy's distribution then hardly depends on the context, and zero-initialised heads, z = h, draft
    it nearly exactly); in bfloat16 half the time SmolLM2's attention shape (9 heads of 64 in 3
    groups), which the CPU's step-attention kernel takes."""
    arch = r.choice(archs)
    wide = dtype == "bfloat16" and r.random() < 0.5
    shape = dict(hidden_size=576, ffn_hidden_size=256, num_attention_heads=9, num_query_groups=3,
                 kv_channels=64) if wide else {}
    cfg = ARCHS[arch](params_dtype=dtype, num_layers=2, **shape)
    model = PolicyModel(cfg, ctx, num_heads=3).eval()
    full = random_full_state_dict(cfg, seed=r.randrange(10**6), std=0.08)
    spread = r.choice([0.0, 0.01, 0.05, None])
    g = torch.Generator().manual_seed(r.randrange(10**6))
    if spread is not None:
        emb = full["embedding.word_embeddings.weight"]
        full["embedding.word_embeddings.weight"] = emb[:1].expand_as(emb) + spread * torch.randn(
            emb.shape, generator=g, dtype=emb.dtype)
    model.load_full_state_dict(full)
    if spread is None:
        with torch.no_grad():
            paths = (v for vs in model.heads.path_layers for v in vs)
            for layer in [*model.heads.layers, *model.heads.root_layers, *paths]:
                layer.weight.copy_(0.05 * torch.randn(layer.weight.shape, generator=g).to(layer.weight.dtype))
    return model, {"arch": arch, "attention": "9 x 64" if wide else "tiny",
                   "heads": "random" if spread is None else f"near the policy (spread {spread})"}


def differences(ref: RolloutOutput, out: RolloutOutput, rows: Optional[list[int]] = None) -> Optional[dict[str, Any]]:
    """The first difference of ``out`` from ``ref`` (``rows``: the rows of ``ref`` that ``out``'s are),
    or None."""
    rows = list(range(len(ref.tokens))) if rows is None else rows
    if len(out.tokens) != len(rows):
        return {"responses": [len(rows), len(out.tokens)]}
    for i, j in enumerate(rows):
        a, b = ref.tokens[j], out.tokens[i]
        if a != b:
            at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return {"response": j, "position": at, "tokens": [a[at:at + 4], b[at:at + 4]],
                    "lengths": [len(a), len(b)]}
        if ref.finish_reason[j] != out.finish_reason[i]:
            return {"response": j, "finish_reason": [ref.finish_reason[j], out.finish_reason[i]]}
        if len(a):
            gap = float((ref.logprobs[j] - out.logprobs[i]).abs().max())
            if not gap <= 1e-9:
                return {"response": j, "logprob_gap": gap}
    return None


def run_case(case_seed: int, ctx: Any, archs: list[str], dtype: str = "float64") -> dict[str, Any]:
    """One case, drawn from ``case_seed`` alone: its settings, SpecRoll's tokens per step, failures."""
    r = random.Random(case_seed)
    model, case = draw_model(r, ctx, archs, dtype)
    prompts = [[r.randrange(1, 300) for _ in range(r.randint(1, 20))] for _ in range(r.randint(1, 5))]
    sp = SamplingConfig(temperature=r.choice([0.0, 0.6, 1.0]), top_p=r.choice([1.0, 0.9]), top_k=r.choice([0, 5]),
                        min_p=r.choice([0.0, 0.1]), max_new_tokens=r.randint(1, 40), num_samples=r.randint(1, 3),
                        seed=r.randrange(1000))
    step = r.randrange(5)
    ids = r.sample(range(10**6), len(prompts)) if r.random() < 0.5 else None
    seen = [t for ts in VanillaEngine(model).generate(prompts, sp, step=step, prompt_ids=ids).tokens for t in ts]
    eos = [r.choice(seen)] if seen and r.random() < 0.7 else []
    sched = {"max_num_seqs": r.choice([None, 1, 2, 5]), "max_prefill_tokens": r.choice([4096, 3, 7])}
    spec = SpecConfig(c_hw=r.choice([1, 3, 8, 16, 64]), topk=r.choice([1, 2, 4]), n_max=r.choice([1, 4, 16]),
                      coupled=r.random() < 0.8, draft_vocab=r.choice([0, 0, 64]),
                      reflex=ReflexConfig(enabled=r.random() < 0.5), slow_path=SlowPathConfig(enabled=r.random() < 0.3))
    curve = r.choice(sorted(CURVES))
    at_once = r.choice(["0", "1"])
    subset = sorted(r.sample(range(len(prompts)), r.randint(1, len(prompts))))
    case.update(prompts=len(prompts), prompt_tokens=[len(p) for p in prompts], temperature=sp.temperature,
                top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p, max_new_tokens=sp.max_new_tokens,
                num_samples=sp.num_samples, prompt_ids=ids is not None, eos=bool(eos), **sched, c_hw=spec.c_hw,
                topk=spec.topk, n_max=spec.n_max, coupled=spec.coupled, draft_vocab=spec.draft_vocab,
                reflex=spec.reflex.enabled, slow_path=spec.slow_path.enabled, latency=curve, accept_at_once=at_once)
    saved = os.environ.get("SPECROLL_ACCEPT_AT_ONCE")
    os.environ["SPECROLL_ACCEPT_AT_ONCE"] = at_once
    try:
        ref = VanillaEngine(model, eos_token_ids=eos).generate(prompts, sp, step=step, prompt_ids=ids)
        speculative = SpeculativeEngine(model, spec, eos_token_ids=eos, latency=CURVES[curve], **sched)
        spec_out = speculative.generate(prompts, sp, step=step, prompt_ids=ids)
        vanilla = VanillaEngine(model, eos_token_ids=eos, **sched).generate(prompts, sp, step=step, prompt_ids=ids)
        own_ids = [ids[i] if ids is not None else i for i in subset]
        part = [prompts[i] for i in subset]
        rows = [i * sp.num_samples + s for i in subset for s in range(sp.num_samples)]
        spec_part = SpeculativeEngine(model, spec, eos_token_ids=eos, latency=CURVES[curve], **sched).generate(
            part, sp, step=step, prompt_ids=own_ids)
        vanilla_part = VanillaEngine(model, eos_token_ids=eos, **sched).generate(part, sp, step=step,
                                                                                 prompt_ids=own_ids)
    finally:
        if saved is None:
            os.environ.pop("SPECROLL_ACCEPT_AT_ONCE", None)
        else:
            os.environ["SPECROLL_ACCEPT_AT_ONCE"] = saved
    checks = {  # (the contract: SpecRoll against the vanilla engine scheduled alike; then the schedule's own)
        "specroll": (vanilla, spec_out, None),
        "specroll, a subset of the prompts": (vanilla_part, spec_part, None),
        "vanilla, scheduled": (ref, vanilla, None),
        "vanilla, a subset of the prompts": (ref, vanilla_part, rows)}
    failures = [{"engine": name, **diff} for name, (expected, out, rows) in checks.items()
                if (diff := differences(expected, out, rows)) is not None]
    return {"case": case, "tau": spec_out.stats.get("tau"), "failures": failures}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0, help="stop drawing cases after this long")
    ap.add_argument("--cases", type=int, default=0, help="stop after this many cases (0: --minutes alone)")
    ap.add_argument("--seed", type=int, default=0, help="draws the cases' seeds")
    ap.add_argument("--archs", default=",".join(ARCHS), help=f"comma-separated, of {', '.join(ARCHS)}")
    ap.add_argument("--dtype", default="float64", choices=("float64", "bfloat16"),
                    help="bfloat16: the half-precision policy's bit-for-bit steps (a CPU with AVX-512 bfloat16)")
    ap.add_argument("--replay", type=int, default=None, help="run the case of this seed alone and describe it")
    ap.add_argument("--out", default="fuzz_exactness.json")
    args = ap.parse_args()
    archs = args.archs.split(",")
    if not archs or any(a not in ARCHS for a in archs):
        ap.error(f"--archs takes names among {', '.join(ARCHS)}, got {args.archs!r}")
    if args.cases < 0 or not args.minutes > 0:
        ap.error(f"--minutes must be > 0 and --cases >= 0, got {args.minutes} and {args.cases}")

    if args.dtype == "bfloat16" and not bfloat16_kernels():
        ap.error("--dtype bfloat16 checks tokens bit for bit, which a half-precision policy computes on a CPU "
                 "with AVX-512 bfloat16 instructions (oneDNN's row-invariant products), and this one has none: "
                 "use --dtype float64")
    # (bfloat16's contract is the CPU's; float64 holds on a GPU too, where the engines take their GPU paths)
    ctx = parallel.initialize(ParallelConfig(backend="gloo" if args.dtype == "bfloat16" else None))
    if args.replay is not None:
        got = run_case(args.replay, ctx, archs, args.dtype)
        print(json.dumps(got, indent=1))
        parallel.destroy()
        return 1 if got["failures"] else 0
    draw = random.Random(args.seed)
    deadline = time.monotonic() + 60 * args.minutes
    results, errors = [], []
    while time.monotonic() < deadline and (args.cases == 0 or len(results) + len(errors) < args.cases):
        case_seed = draw.randrange(10**9)
        try:
            got = run_case(case_seed, ctx, archs, args.dtype)
        except Exception:  # a crash is a failure too, reported with the case that made it
            errors.append({"seed": case_seed, "error": traceback.format_exc(limit=4)[-2000:]})
            print(f"case {case_seed} raised:\n{errors[-1]['error']}", flush=True)
            continue
        results.append({"seed": case_seed, **got})
        for f in got["failures"]:
            print(f"case {case_seed}: {json.dumps(f)}", flush=True)
    failures = [{"seed": x["seed"], **f, "case": x["case"]} for x in results for f in x["failures"]]
    coverage: dict[str, dict[str, int]] = {}
    for x in results:
        for k, v in x["case"].items():
            if k not in ("prompt_tokens", "max_new_tokens"):  # (drawn from wide ranges)
                coverage.setdefault(k, Counter())[str(v)] += 1
    taus = sorted(x["tau"] for x in results if x["tau"] is not None)
    report = {"cases": len(results) + len(errors), "failures": failures, "errors": errors,
              "minutes": args.minutes, "seed": args.seed, "archs": archs, "dtype": args.dtype,
              "tau": {"median": statistics.median(taus), "max": taus[-1],
                      "cases_over_2": sum(t > 2 for t in taus), "cases_over_3": sum(t > 3 for t in taus)}
              if taus else None,
              "coverage": {k: dict(sorted(v.items())) for k, v in coverage.items()}}
    write_json_atomic(args.out, report)
    print(f"{report['cases']} cases, {len(failures)} failures, {len(errors)} errors; SpecRoll's tokens per step: "
          f"{report['tau']}; wrote {args.out}")
    parallel.destroy()
    return 1 if failures or errors else 0


if __name__ == "__main__":
    sys.exit(main())
