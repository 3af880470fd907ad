#!/usr/bin/env python
"""Reflex and the slow path under real policy drift: the four-way ablation.

    python tools/bench_drift.py --drift-steps 40 --measure-every 10 --out bench_drift.json --plot bench_drift.png

SmolLM2-135M-Instruct with its warm-started heads (tools/train_heads.py). The policy is moved by real
optimizer steps: supervised fine-tuning (AdamW, backbone only, heads frozen) on worked solutions of
the offline GSM8K-style problems, a distribution the instruct model does not write by itself
(``--style solutions``), by default written in capital letters (``--style upper``: other tokens than
the ones the heads were fitted on), or with every word spelled backwards (``--style reversed``: token
sequences no English text has, a stress test for stale heads). At
drift step 0 and every --measure-every steps, the same fresh prompts are rolled out (T=1, EOS
honoured) by the vanilla engine and by SpecRoll four ways:

    static   heads as warm-started, no adaptation
    reflex   + the Reflex fast path
    slow     + the slow path (its head weights and monitor persist across checkpoints)
    both     Reflex and the slow path

With ``--adapt-every K`` the slow-path variants also roll out one batch of fresh prompts every K
drift steps between checkpoints (not timed, not reported as a checkpoint): in an RL run the slow
path sees a rollout at every policy step, not only when someone measures. Each variant keeps its
own head weights (only the slow path changes them). Per checkpoint and
variant: tau, acceptance per head depth, generation speedup over vanilla on the same prompts
(summed times, engines alternating batch by batch) and slow-path events; every rollout is checked
token for token against vanilla. A drift measure is reported too: the mean KL from the initial
policy to the current one on the measured responses' positions is not cheap, so the SFT loss on
held-out solutions is given instead. JSON to --out, tau over drift steps to --plot.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.checkpoint.megatron import stop_token_ids, write_json_atomic  # noqa: E402
from specroll_mcore.config import ParallelConfig, ReflexConfig, SamplingConfig, SlowPathConfig, SpecConfig  # noqa: E402
from specroll_mcore.rl.data import chat_prompt_ids  # noqa: E402
from specroll_mcore.rl.drift import STYLES, SFTDrift  # noqa: E402
from specroll_mcore.rl.synthetic import problems  # noqa: E402
from specroll_mcore.rollout import SpeculativeEngine, VanillaEngine  # noqa: E402
from specroll_mcore.rollout.profile import open_for_rollout  # noqa: E402

VARIANTS = {"static": (False, False), "reflex": (True, False), "slow": (False, True), "both": (True, True)}
MEASURE_PROMPTS, ADAPT_PROMPTS = 10_000, 20_000  # problem seeds of the two prompt streams, plus the drift step
SEED_STRIDE = 1_000_000  # --seed s offsets every problem and sampling seed by s * SEED_STRIDE


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="smollm2")
    ap.add_argument("--drift-steps", type=int, default=40)
    ap.add_argument("--measure-every", type=int, default=10)
    ap.add_argument("--sft-lr", type=float, default=3e-5)
    ap.add_argument("--sft-batch", type=int, default=8)
    ap.add_argument("--style", choices=sorted(STYLES), default="upper",
                    help="the drift target: worked solutions as written, in capitals, or with every word "
                         "spelled backwards (token sequences the heads never saw)")
    ap.add_argument("--batches", type=int, default=4, help="rollout batches per checkpoint")
    ap.add_argument("--prompts-per-batch", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--c-hw", type=int, default=None)
    ap.add_argument("--adaptive-nodes", action=argparse.BooleanOptionalAction, default=True,
                    help="keep each step's trees to the nodes that pay for their latency "
                         "(SpecConfig.adaptive_nodes); --no-adaptive-nodes fills every tree to its budget, "
                         "so tau measures the heads alone, not the tree sizing learnt along the drift")
    ap.add_argument("--cooldown-batches", type=int, default=None,
                    help="override the slow path's cooldown (default: the config's)")
    ap.add_argument("--tolerance", type=float, default=None,
                    help="override the slow path's degradation tolerance (default: the config's)")
    ap.add_argument("--adapt-every", type=int, default=0,
                    help="between checkpoints, roll out one batch of fresh prompts every this many drift "
                         "steps with the slow-path variants (the rollouts an RL run makes as its policy "
                         "moves; they feed the slow path and are not timed); 0: checkpoints only")
    ap.add_argument("--seed", type=int, default=0,
                    help="offsets the measured and adaptation prompts and their sampling seeds (the drift "
                         "itself, the SFT steps, stays the same): independent repeats of a run")
    ap.add_argument("--out", default="bench_drift.json")
    ap.add_argument("--plot", default="bench_drift.png")
    args = ap.parse_args()
    if args.adapt_every < 0:
        ap.error(f"--adapt-every must be >= 0 (0: no rollouts between checkpoints), got {args.adapt_every}")
    if args.seed < 0:
        ap.error(f"--seed must be >= 0, got {args.seed}")
    try:
        slow_cfg = SlowPathConfig(**{k: v for k, v in (("cooldown_batches", args.cooldown_batches),
                                                       ("tolerance", args.tolerance)) if v is not None})
    except ValueError as e:
        ap.error(str(e))
    ctx = parallel.initialize(ParallelConfig())
    ckpt, policy, tok, cap = open_for_rollout(args.checkpoint, ctx, args.c_hw)
    c_hw = cap.c_hw
    eos = stop_token_ids(ckpt, tok)
    engines, heads = {}, {}
    initial_heads = copy.deepcopy(policy.heads.state_dict())
    for name, (rx, sl) in VARIANTS.items():
        spec = SpecConfig(num_heads=policy.num_heads, c_hw=c_hw, adaptive_nodes=args.adaptive_nodes,
                          reflex=ReflexConfig(enabled=rx), slow_path=dataclasses.replace(slow_cfg, enabled=sl))
        engines[name] = SpeculativeEngine(policy, spec, eos_token_ids=eos, tokenizer=tok, latency=cap.latency)
        heads[name] = copy.deepcopy(initial_heads)
    vanilla = VanillaEngine(policy, eos_token_ids=eos, tokenizer=tok)
    vanilla.generate([[1, 2, 3]], SamplingConfig(max_new_tokens=2))  # warm-up

    drift = SFTDrift(policy, tok, args.style, args.sft_lr, args.sft_batch, args.drift_steps)

    report = {"checkpoint": str(ckpt), "c_hw": c_hw, "args": vars(args), "reflex": ReflexConfig().__dict__,
              "slow_path": slow_cfg.__dict__, "checkpoints": [], "adaptation": []}
    print(f"c_hw={c_hw} variants={list(VARIANTS)}", flush=True)
    step = 0
    while True:
        row = measure(args, step, tok, policy, vanilla, engines, heads)
        row["sft_heldout_nll"] = drift.held_nll()
        report["checkpoints"].append(row)
        print(f"drift step {step}: heldout nll {row['sft_heldout_nll']:.3f} " + " ".join(
            f"{v}: tau {r['tau']:.3f} x{r['speedup']:.2f} ev{r['slow_events']}" for v, r in row["variants"].items()),
            flush=True)
        write_json_atomic(args.out, summarise(report))
        if step >= args.drift_steps:
            break
        for _ in range(args.measure_every):  # real optimizer steps on the backbone
            drift.step()
            step += 1
            if args.adapt_every and step % args.adapt_every == 0 and step % args.measure_every:
                report["adaptation"].append(adapt(args, step, tok, policy, engines, heads))
    report = summarise(report)
    write_json_atomic(args.out, report)
    plot(report, args.plot)
    print(report["summary"])


def prompts_at(args, tok, step: int, n: int, stream: int) -> tuple[list[list[int]], SamplingConfig]:
    """n fresh problems of one stream at this drift step, and their sampling config; --seed moves
    both to values no other seed uses."""
    offset = SEED_STRIDE * args.seed
    prompts = [chat_prompt_ids(tok, q.question) for q in problems(n, seed=stream + step + offset)]
    return prompts, SamplingConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                                   seed=step + 1 + offset)


def rollout(v, policy, engines, heads, prompts, sp, step, ids):
    """Variant ``v`` with its own head weights (what its slow path changed is kept): output, seconds."""
    policy.heads.load_state_dict(heads[v])
    t0 = time.perf_counter()
    out = engines[v].generate(prompts, sp, step=step, prompt_ids=ids)
    seconds = time.perf_counter() - t0
    heads[v] = copy.deepcopy(policy.heads.state_dict())
    return out, seconds


def measure(args, step, tok, policy, vanilla, engines, heads) -> dict:
    """All variants and vanilla on the same prompts, alternating batch by batch."""
    prompts, sp = prompts_at(args, tok, step, args.batches * args.prompts_per_batch, MEASURE_PROMPTS)
    names = list(engines)
    acc = {v: {"time": 0.0, "emitted": 0, "active": 0, "tried": [0] * policy.num_heads,
               "accepted": [0] * policy.num_heads, "gate": [], "events": []} for v in names}
    t_vanilla = 0.0
    for b in range(args.batches):
        sl = slice(b * args.prompts_per_batch, (b + 1) * args.prompts_per_batch)
        ids = list(range(sl.start, sl.stop))
        order = names[b % len(names):] + names[:b % len(names)]
        t0 = time.perf_counter()
        ref = vanilla.generate(prompts[sl], sp, step=step, prompt_ids=ids)
        t_vanilla += time.perf_counter() - t0
        for v in order:
            out, seconds = rollout(v, policy, engines, heads, prompts[sl], sp, step, ids)
            acc[v]["time"] += seconds
            if out.tokens != ref.tokens:
                raise SystemExit(f"variant {v} emitted different tokens than vanilla at drift step {step}")
            s = out.stats
            acc[v]["emitted"] += sum(p["emitted"] for p in s["per_step"])
            acc[v]["active"] += sum(p["active"] for p in s["per_step"])
            for d in range(policy.num_heads):
                acc[v]["tried"][d] += s["tried_per_depth"][d]
                acc[v]["accepted"][d] += s["accepted_per_depth"][d]
            acc[v]["gate"].append(s.get("reflex_gate_open", 0.0))
            ev = (s.get("slow_path") or {}).get("event")
            if ev:
                acc[v]["events"].append(ev)
    res = {"drift_step": step, "vanilla_s": t_vanilla, "variants": {}}
    for v in names:
        a = acc[v]
        res["variants"][v] = {
            "tau": a["emitted"] / max(1, a["active"]),
            "acceptance_per_depth": [x / max(1, t) for x, t in zip(a["accepted"], a["tried"])],
            "speedup": t_vanilla / a["time"], "seconds": a["time"], "reflex_gate_open": sum(a["gate"]) / len(a["gate"]),
            "slow_events": len(a["events"]), "events": a["events"]}
    return res


def adapt(args, step, tok, policy, engines, heads) -> dict:
    """One rollout batch of fresh prompts per slow-path variant at this drift step (not timed).

    Static and Reflex-only variants are skipped: nothing they hold outlives a response."""
    prompts, sp = prompts_at(args, tok, step, args.prompts_per_batch, ADAPT_PROMPTS)
    row = {"drift_step": step, "events": {}}
    for v, (_, slow) in VARIANTS.items():
        if not slow:
            continue
        out, _ = rollout(v, policy, engines, heads, prompts, sp, step, list(range(len(prompts))))
        slow_stats = out.stats.get("slow_path") or {}
        ev = slow_stats.get("event")
        row["events"][v] = [ev] if ev else []
        row.setdefault("skipped_so_far", {})[v] = slow_stats.get("skipped", {})  # guards that held events back
        if ev:
            print(f"  drift step {step}: {v} consolidated head {ev.get('head')}", flush=True)
    return row


def summarise(report: dict) -> dict:
    rows = report["checkpoints"]
    if rows:
        first, last = rows[0]["variants"], rows[-1]["variants"]
        report["summary"] = {v: {"tau_first": first[v]["tau"], "tau_last": last[v]["tau"],
                                 "tau_retained": last[v]["tau"] / first[v]["tau"],
                                 "mean_tau_after_start": (sum(r["variants"][v]["tau"] for r in rows[1:]) /
                                                          max(1, len(rows) - 1)),
                                 "speedup_last": last[v]["speedup"]} for v in first}
    return report


def plot(report: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = report["checkpoints"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for v in VARIANTS:
        xs = [r["drift_step"] for r in rows]
        axes[0].plot(xs, [r["variants"][v]["tau"] for r in rows], marker="o", label=v)
        axes[1].plot(xs, [r["variants"][v]["speedup"] for r in rows], marker="o", label=v)
    axes[0].set_xlabel("SFT drift steps")
    axes[0].set_ylabel("tau (tokens / verification step)")
    axes[1].set_xlabel("SFT drift steps")
    axes[1].set_ylabel("generation speedup vs vanilla")
    axes[0].legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
