#!/usr/bin/env python
"""SpecRoll against the vanilla engine (and transformers ``generate``), side by side, same prompts.

    python tools/bench_specroll.py --prompts 32 --samples 8 --max-new-tokens 256 --reps 3 --out bench_specroll.json

SmolLM2-135M-Instruct with the heads saved by tools/train_heads.py; GSM8K-style prompts from the
offline generator in the chat template; T=1 unless --temperature, --top-p, --top-k and --min-p say
otherwise (the same filters in every engine, transformers' included); EOS honoured (a real rollout:
responses finish at different times). Two scenarios, each alternating vanilla and SpecRoll for
--reps repetitions:
  * batch 1: --batch1-prompts prompts, one response at a time;
  * the full batch: P prompts x G samples at once.
Every repetition checks that both engines emitted identical tokens. Reported: the median of paired
time ratios (vanilla / SpecRoll), tau (tokens per verification step and response), acceptance per
head depth, the speedup against the number of unfinished responses over the rollout (binned, also
drawn to --plot), and transformers ``generate`` (and its prompt-lookup decoding at batch 1) on the
same prompts as ratios. On a GPU one extra SpecRoll run per scenario waits for the device at every
stage boundary and reports that time split too (``time_split_synced_s``). Absolute times on shared
machines are noisy; the ratios are the result.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.config import ParallelConfig, SamplingConfig, SpecConfig  # noqa: E402
from specroll_mcore.checkpoint.megatron import stop_token_ids, write_json_atomic  # noqa: E402
from specroll_mcore.rl.data import synthetic_chat_prompts  # noqa: E402
from specroll_mcore.rollout import SpeculativeEngine, VanillaEngine  # noqa: E402
from specroll_mcore.rollout.base import combined_stats  # noqa: E402
from specroll_mcore.rollout.profile import cached_profile, open_for_rollout, with_step_overhead  # noqa: E402
from specroll_mcore.tree.budget import LatencyCurve, StepCost, hardware_name  # noqa: E402

BINS = [(129, 10**9), (65, 128), (33, 64), (17, 32), (9, 16), (5, 8), (3, 4), (2, 2), (1, 1)]


def run(engine, prompts, sp):
    t0 = time.perf_counter()
    out = engine.generate(prompts, sp, prompt_ids=list(range(len(prompts))))
    return time.perf_counter() - t0, out


def hf_twin(name: str, ckpt: Path, dtype: torch.dtype):
    """The same weights as a ``transformers`` model in ``dtype``: SmolLM2's HF form, or the checkpoint
    exported."""
    import tempfile

    import transformers

    from specroll_mcore.checkpoint.convert import convert_mcore_to_hf
    from specroll_mcore.checkpoint.smollm2 import MODEL_ALIAS, default_hf_dir

    if name == MODEL_ALIAS:
        return transformers.AutoModelForCausalLM.from_pretrained(default_hf_dir(), dtype=dtype).eval()
    with tempfile.TemporaryDirectory() as tmp:
        path = convert_mcore_to_hf(ckpt, Path(tmp) / "hf")
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def wait(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_hf(hf, prompts, sp, tok, prompt_lookup: int = 0) -> float:
    wait(hf.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:  # batch 1: what prompt lookup decoding supports
            kw = dict(prompt_lookup_num_tokens=prompt_lookup) if prompt_lookup else {}
            hf.generate(torch.tensor([p], device=hf.device), **hf_sampling(sp),
                        max_new_tokens=sp.max_new_tokens, pad_token_id=pad_id(tok), **kw)
    wait(hf.device)
    return time.perf_counter() - t0


def hf_sampling(sp: SamplingConfig) -> dict:
    """``generate``'s arguments for the same sampling filters (its own defaults for top-k and top-p
    would otherwise apply)."""
    if sp.temperature == 0:
        return dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    return dict(do_sample=True, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
                min_p=sp.min_p or None)


def pad_id(tok) -> int:
    """The tokenizer's pad token, or its end of sequence where it has none (as ``generate`` does)."""
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def time_hf_batch(hf, prompts, sp, tok) -> float:
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id(tok), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    ids, mask = ids.to(hf.device), mask.to(hf.device)
    wait(hf.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        hf.generate(input_ids=ids, attention_mask=mask, **hf_sampling(sp),
                    max_new_tokens=sp.max_new_tokens, pad_token_id=pad_id(tok),
                    num_return_sequences=sp.num_samples)
    wait(hf.device)
    return time.perf_counter() - t0


def synced_split(spec, runner, prompts, sp) -> dict:
    """On a GPU, one more SpecRoll run that waits for the device at each stage boundary, so its time
    split charges every stage its own kernels (the timed runs overlap them)."""
    spec.sync_timers = True
    try:
        return run(runner, prompts, sp)[1].stats["time_split_s"]
    finally:
        spec.sync_timers = False


def first_difference(a: list[int], b: list[int]) -> int:
    """The first position where two responses differ (the shorter one's length if one extends the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def binned_speedup(vanilla_steps, spec_steps) -> list[dict]:
    rows = []
    for lo, hi in BINS:
        v = [s for s in vanilla_steps if lo <= s["active"] <= hi]
        p = [s for s in spec_steps if lo <= s["active"] <= hi]
        if not v or not p:
            continue
        v_rate = sum(s["tokens"] for s in v) / sum(s["seconds"] for s in v)
        p_rate = sum(s["tokens"] for s in p) / sum(s["seconds"] for s in p)
        rows.append({"active_min": lo, "active_max": min(hi, max(s["active"] for s in v)),
                     "vanilla_tokens_per_s": v_rate, "specroll_tokens_per_s": p_rate, "speedup": p_rate / v_rate,
                     "nodes_per_row": statistics.median(s["nodes_per_row"] for s in p)})
    return rows


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [(r["active_min"] + r["active_max"]) / 2 for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, [r["speedup"] for r in rows], "o-")
    for xi, r in zip(x, rows):
        ax.annotate(f"N={r['nodes_per_row']:.0f}", (xi, r["speedup"]), textcoords="offset points", xytext=(0, 6),
                    ha="center", fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("unfinished responses B_t")
    ax.set_ylabel("SpecRoll / vanilla tokens per second")
    ax.set_title(f"Generation speedup over the rollout (SmolLM2-135M, {hardware_name()})", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def scenario(name, vanilla, spec, prompts, sp, reps, third=None):
    """``third``: (its key in the result, what it is, engine): SpecRoll sizing its trees otherwise,
    run after the other two in every repetition."""
    key, what, other = third if third is not None else (None, None, None)
    ratios, tv, ts, tc, outs, sc = [], [], [], [], None, None
    for _ in range(reps):  # alternate A and B (and C)
        a, va = run(vanilla, prompts, sp)
        b, sb = run(spec, prompts, sp)
        if other is not None:
            c, sc = run(other, prompts, sp)
            tc.append(c)
        if va.tokens != sb.tokens:
            diff = sum(x != y for x, y in zip(va.tokens, sb.tokens))
            print(f"  WARNING {name}: {diff}/{len(va.tokens)} responses differ (near-ties of the sampled argmax "
                  "between a tree forward and a one-token forward)")
        ratios.append(a / b)
        tv.append(a)
        ts.append(b)
        outs = (va, sb)
    va, sb = outs
    res = {"vanilla_s": tv, "specroll_s": ts, "speedup_median": statistics.median(ratios),
           "tokens": va.num_tokens, "identical_tokens": va.tokens == sb.tokens,
           "identical_responses": sum(x == y for x, y in zip(va.tokens, sb.tokens)), "responses": len(va.tokens),
           "first_divergence": [first_difference(x, y) for x, y in zip(va.tokens, sb.tokens) if x != y],
           "tau": sb.stats["tau"], "acceptance_per_depth": sb.stats["acceptance_per_depth"],
           "nodes_per_row_mean": statistics.mean(s["nodes_per_row"] for s in sb.stats["per_step"]),
           "time_split_s": sb.stats["time_split_s"], "c_hw": sb.stats["c_hw"],
           "finish_reasons": {r: va.finish_reason.count(r) for r in set(va.finish_reason)},
           "binned": binned_speedup(va.stats["per_step"], sb.stats["per_step"])}
    if other is not None:
        res[key] = {
            "specroll_s": tc, "speedup_median": statistics.median(a / c for a, c in zip(tv, tc)),
            "specroll_over_this_median": statistics.median(c / b for b, c in zip(ts, tc)),
            "identical_tokens": sc.tokens == va.tokens, "tau": sc.stats["tau"],
            "nodes_per_row_mean": statistics.mean(s["nodes_per_row"] for s in sc.stats["per_step"]),
            "time_split_s": sc.stats["time_split_s"]}
        print(f"  {what}: {res[key]['speedup_median']:.2f}x, tau {sc.stats['tau']:.2f}; SpecRoll over it "
              f"{res[key]['specroll_over_this_median']:.2f}x", flush=True)
    print(f"{name}: speedup {res['speedup_median']:.2f}x (median of {reps} paired), tau {res['tau']:.2f}, "
          f"acceptance per depth {[round(a, 3) for a in res['acceptance_per_depth']]}, "
          f"{res['tokens']} tokens, identical responses {res['identical_responses']}/{res['responses']}", flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="smollm2")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"],
                    help="load the checkpoint (policy and heads) in this dtype (default: its own)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch1-prompts", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--c-hw", type=int, default=None)
    ap.add_argument("--n-max", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0, help="SamplingConfig.top_p (also transformers')")
    ap.add_argument("--top-k", type=int, default=0, help="SamplingConfig.top_k, 0: off (also transformers')")
    ap.add_argument("--min-p", type=float, default=0.0, help="SamplingConfig.min_p, 0: off (also transformers')")
    ap.add_argument("--draft-vocab", type=int, default=SpecConfig.draft_vocab,
                    help="ids the heads draft from (SpecConfig.draft_vocab; 0: the whole vocabulary)")
    ap.add_argument("--coupled", action=argparse.BooleanOptionalAction, default=True,
                    help="draft with the sampler's noise (SpecConfig.coupled)")
    ap.add_argument("--adaptive-nodes", action=argparse.BooleanOptionalAction, default=True,
                    help="keep each step's trees to the nodes that pay for their latency (SpecConfig.adaptive_nodes)")
    third = ap.add_mutually_exclusive_group()
    third.add_argument("--one-row-curve", action="store_true",
                       help="also run SpecRoll sizing its trees by the profile's one-row curve instead of its grid "
                            "over rows x nodes x context, alternating with the other two")
    third.add_argument("--forward-only", action="store_true",
                       help="also run SpecRoll sizing its trees by their forward's latency alone, without the step's "
                            "work around it (SpecConfig.step_overhead off), alternating with the other two")
    ap.add_argument("--step-overhead", action=argparse.BooleanOptionalAction, default=True,
                    help="size trees with the step's work around its forward priced in (SpecConfig.step_overhead; "
                         "measured on first use and cached)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-full", action="store_true")
    ap.add_argument("--skip-batch1", action="store_true")
    ap.add_argument("--out", default="bench_specroll.json")
    ap.add_argument("--plot", default="bench_specroll.png")
    args = ap.parse_args()
    ctx = parallel.initialize(ParallelConfig())
    ckpt, policy, tok, cap = open_for_rollout(args.checkpoint, ctx, args.c_hw, params_dtype=args.dtype)
    c_hw = cap.c_hw
    spec_cfg = SpecConfig(num_heads=policy.num_heads, c_hw=c_hw, n_max=args.n_max, topk=args.topk,
                          coupled=args.coupled, draft_vocab=args.draft_vocab, adaptive_nodes=args.adaptive_nodes,
                          step_overhead=args.step_overhead)
    latency = with_step_overhead(policy, spec_cfg, cap.latency)
    eos = stop_token_ids(ckpt, tok)
    vanilla = VanillaEngine(policy, eos_token_ids=eos)
    spec = SpeculativeEngine(policy, spec_cfg, eos_token_ids=eos, latency=latency)
    third = None
    if args.one_row_curve:
        record = cached_profile(policy)
        if record is None:
            raise SystemExit("--one-row-curve needs a cached capacity profile (run tools/profile_capacity.py)")
        curve = LatencyCurve.from_profile(record)  # (with the same step overhead: only the forward's model differs)
        third = ("one_row_curve", "sizing trees by the one-row curve",
                 SpeculativeEngine(policy, spec_cfg, eos_token_ids=eos, latency=StepCost(curve, latency.overhead)
                                   if isinstance(latency, StepCost) else curve))
    elif args.forward_only:
        if not isinstance(latency, StepCost):
            raise SystemExit("--forward-only compares against the step overhead, which needs a latency profile, "
                             "--adaptive-nodes and --step-overhead")
        third = ("forward_only", "sizing trees by their forward alone",
                 SpeculativeEngine(policy, spec_cfg, eos_token_ids=eos, latency=cap.latency))
    report = {"checkpoint": str(ckpt), "hardware": hardware_name(), "dtype": str(policy.dtype).removeprefix("torch."),
              "spec": dataclasses.asdict(spec_cfg),
              "latency": ({"model": type(cap.latency).__name__, **dataclasses.asdict(cap.latency)}
                          if cap.latency is not None else None),
              "step_overhead": (dataclasses.asdict(latency.overhead) if isinstance(latency, StepCost) else None),
              "threads": torch.get_num_threads(),
              "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
              "reps": args.reps, "max_new_tokens": args.max_new_tokens}
    print(f"c_hw={c_hw} heads={policy.num_heads} topk={args.topk} n_max={args.n_max} threads={torch.get_num_threads()}")
    filters = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p)
    sp1 = SamplingConfig(**filters, max_new_tokens=args.max_new_tokens, num_samples=1, seed=1)
    p1 = synthetic_chat_prompts(tok, args.batch1_prompts, seed=777)
    run(vanilla, p1[:1], SamplingConfig(max_new_tokens=4))  # warm-up

    def one_at_a_time(engine):
        class Seq:
            def generate(self, prompts, sp, prompt_ids=None):
                outs = [engine.generate([p], sp, prompt_ids=[i]) for i, p in zip(prompt_ids, prompts)]
                first = outs[0]
                first.tokens = [t for o in outs for t in o.tokens]
                first.finish_reason = [f for o in outs for f in o.finish_reason]
                # tau, tree size and acceptance over every prompt's steps; the rest (time split) the last prompt's
                first.stats = combined_stats([o.stats for o in outs])
                return first
        return Seq()

    hf = None
    if not args.skip_hf:
        hf = hf_twin(args.checkpoint, ckpt, policy.dtype).to(ctx.device)
    if not args.skip_batch1:
        third_b1 = None if third is None else (*third[:2], one_at_a_time(third[2]))  # (one response at a time too)
        report["batch1"] = scenario("batch 1", one_at_a_time(vanilla), one_at_a_time(spec), p1, sp1, args.reps,
                                     third_b1)
        if ctx.device.type == "cuda":
            report["batch1"]["time_split_synced_s"] = synced_split(spec, one_at_a_time(spec), p1[:1], sp1)
    if not args.skip_batch1 and hf is not None:
        t_hf = time_hf(hf, p1, sp1, tok)
        t_spec = statistics.median(report["batch1"]["specroll_s"])
        report["batch1"]["hf_generate_s"] = t_hf
        report["batch1"]["specroll_over_hf_generate"] = t_hf / t_spec
        try:
            t_pl = time_hf(hf, p1, sp1, tok, prompt_lookup=10)
            report["batch1"]["hf_prompt_lookup_s"] = t_pl
            report["batch1"]["specroll_over_hf_prompt_lookup"] = t_pl / t_spec
        except Exception as e:  # noqa: BLE001  (report, do not fail the benchmark)
            report["batch1"]["hf_prompt_lookup_error"] = repr(e)
        print(f"batch 1: SpecRoll vs transformers generate {report['batch1']['specroll_over_hf_generate']:.2f}x"
              + (f", vs prompt lookup {report['batch1'].get('specroll_over_hf_prompt_lookup', 0):.2f}x"), flush=True)
    if not args.skip_full:
        spf = SamplingConfig(**filters, max_new_tokens=args.max_new_tokens, num_samples=args.samples, seed=2)
        pf = synthetic_chat_prompts(tok, args.prompts, seed=4242)
        report["full"] = scenario(f"{args.prompts} prompts x {args.samples} samples", vanilla, spec, pf, spf, args.reps,
                                  third)
        if ctx.device.type == "cuda":
            report["full"]["time_split_synced_s"] = synced_split(spec, spec, pf, spf)
        if hf is not None:
            t_hf = time_hf_batch(hf, pf, spf, tok)
            report["full"]["hf_generate_s"] = t_hf
            report["full"]["specroll_over_hf_generate"] = t_hf / statistics.median(report["full"]["specroll_s"])
            print(f"full batch: SpecRoll vs transformers generate {report['full']['specroll_over_hf_generate']:.2f}x")
        if args.plot:
            plot(report["full"]["binned"], args.plot)
    write_json_atomic(Path(args.out), report)
    print(f"wrote {args.out}")
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
