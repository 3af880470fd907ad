#!/usr/bin/env python
"""How much prompt-lookup branches could add to SpecRoll's trees: an upper bound from real rollouts.

    python tools/bench_lookup_headroom.py --prompts 8 --max-new-tokens 128 --temperature 1 --out headroom.json

Prompt lookup (n-gram drafting: `transformers`' prompt_lookup_num_tokens, vLLM's ngram speculator)
proposes the tokens that followed the last earlier occurrence of the context's last n tokens; it
costs no forward, only tree nodes. This tool rolls out the same batch-1 responses as
tools/bench_specroll.py (GSM8K-style chat prompts, one response at a time, SpecRoll with the heads
and the tree sizing of the checkpoint) and, at every verification step, compares the chain that
lookup would have drafted there with the tokens the policy then sampled. Acceptance is a pure
function of the tokens (counter-based sampling): a tree holding both the heads' nodes and the chain
accepts the longer of the two matches, so ``max(heads' accepted, chain's match)`` bounds what the
step would have emitted. Reported per lookup setting (n from --min-n to --max-n, longest first; chains
of up to K tokens): tau of the heads alone and with the chains, how often a chain exists and how often
its first token is right, the nodes it adds (at most its length: nodes it shares with the heads' tree
are counted too), and, where the checkpoint has a latency profile, the speedup those tokens and
nodes would give by the engine's own step-cost model. Each step is taken as it was (a longer
acceptance would move the later steps' positions), so this is an estimate, not a measurement.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.checkpoint.megatron import stop_token_ids, write_json_atomic  # noqa: E402
from specroll_mcore.config import ParallelConfig, SamplingConfig, SpecConfig  # noqa: E402
from specroll_mcore.rl.data import synthetic_chat_prompts  # noqa: E402
from specroll_mcore.rollout import SpeculativeEngine  # noqa: E402
from specroll_mcore.rollout.profile import open_for_rollout, with_step_overhead  # noqa: E402
from specroll_mcore.tree.budget import hardware_name  # noqa: E402


def lookup(context: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Prompt lookup's chain: for n from ``max_n`` down to ``min_n``, the up to ``k`` tokens that followed
    the latest earlier occurrence of the context's last n tokens; [] if none occurs."""
    for n in range(max_n, min_n - 1, -1):
        if len(context) <= n:
            continue
        suffix = list(context[-n:])
        for j in range(len(context) - n - 1, -1, -1):
            if list(context[j:j + n]) == suffix:
                return list(context[j + n:j + n + k])
    return []


def step_headroom(prompt: Sequence[int], tokens: Sequence[int], emitted: Sequence[int], min_n: int, max_n: int,
                  k: int) -> list[dict[str, int]]:
    """Per verification step of one response (``emitted``: the tokens each step emitted, the last
    step's possibly past the response's end): the response length before it, the heads' accepted
    drafts, the chain's length and how many of its tokens the policy then sampled."""
    rows, length = [], 1  # the first token is sampled from the prompt's forward
    for e in emitted:
        chain = lookup(list(prompt) + list(tokens[:length]), min_n, max_n, k)
        truth = tokens[length:length + len(chain)]
        match = 0
        while match < len(truth) and chain[match] == truth[match]:
            match += 1
        rows.append({"length": length, "accepted": e - 1, "chain": len(chain), "match": match})
        length += e
    return rows


def summarise(steps: list[dict[str, int]], nodes: list[int], contexts: list[int], latency: Any) -> dict[str, Any]:
    """Figures of one lookup setting over all steps (``nodes``: each step's tree size; ``contexts``:
    its committed context; ``latency``: the engine's step-cost model or None)."""
    n = len(steps)
    heads = sum(s["accepted"] + 1 for s in steps)
    both = sum(max(s["accepted"], s["match"]) + 1 for s in steps)
    with_chain = [s for s in steps if s["chain"]]
    row = {"steps": n, "tau_heads": heads / n, "tau_with_lookup": both / n,
           "chain_share": len(with_chain) / n,
           "first_token_right": sum(s["match"] > 0 for s in with_chain) / max(len(with_chain), 1),
           "steps_gaining": sum(s["match"] > s["accepted"] for s in steps) / n,
           "nodes_per_step": sum(nodes) / n, "nodes_added_per_step": sum(s["chain"] for s in steps) / n}
    if latency is not None:
        old = sum(latency.step(1, m, c) for m, c in zip(nodes, contexts))
        new = sum(latency.step(1, m + s["chain"], c) for m, s, c in zip(nodes, steps, contexts))
        row["estimated_speedup"] = (both / new) / (heads / old)
    return row


def parse_settings(text: str) -> list[tuple[int, int, int]]:
    """``"1-3:3,2-3:5"`` -> [(min_n, max_n, k), ...]."""
    out = []
    for part in text.split(","):
        try:
            ns, k = part.split(":")
            lo, _, hi = ns.partition("-")
            setting = (int(lo), int(hi or lo), int(k))
        except ValueError:
            raise ValueError(f"--settings: {part!r} is not MIN-MAX:K (e.g. 2-3:5)") from None
        if not 1 <= setting[0] <= setting[1] or setting[2] < 1:
            raise ValueError(f"--settings: {part!r} needs 1 <= MIN <= MAX and K >= 1")
        out.append(setting)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="smollm2")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1, help="sampling seed (tools/bench_specroll.py's batch 1 uses 1)")
    ap.add_argument("--c-hw", type=int, default=None, help="SpecConfig.c_hw (default: the capacity profile's)")
    ap.add_argument("--settings", default="1-3:3,1-3:5,2-3:3,2-3:5,3-3:5",
                    help="lookup settings MIN_N-MAX_N:K, comma-separated")
    ap.add_argument("--out", default="bench_lookup_headroom.json")
    args = ap.parse_args(argv)
    try:
        settings = parse_settings(args.settings)
    except ValueError as e:
        ap.error(str(e))
    ctx = parallel.initialize(ParallelConfig())
    ckpt, policy, tok, cap = open_for_rollout(args.checkpoint, ctx, args.c_hw)
    spec_cfg = SpecConfig(num_heads=policy.num_heads, c_hw=cap.c_hw)
    latency = with_step_overhead(policy, spec_cfg, cap.latency)
    engine = SpeculativeEngine(policy, spec_cfg, eos_token_ids=stop_token_ids(ckpt, tok), latency=latency)
    sp = SamplingConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=args.seed)
    responses = []
    for i, prompt in enumerate(synthetic_chat_prompts(tok, args.prompts, seed=777)):
        out = engine.generate([prompt], sp, prompt_ids=[i])
        responses.append((prompt, out.tokens[0], out.stats["per_step"]))
        print(f"prompt {i}: {len(out.tokens[0])} tokens, tau {out.stats['tau']:.2f}", flush=True)
    report = {"checkpoint": str(ckpt), "hardware": hardware_name(), "threads": torch.get_num_threads(),
              "c_hw": cap.c_hw, "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
              "prompts": args.prompts, "settings": {}}
    for lo, hi, k in settings:
        steps, nodes, contexts = [], [], []
        for prompt, tokens, per_step in responses:
            rows = step_headroom(prompt, tokens, [s["emitted"] for s in per_step], lo, hi, k)
            steps += rows
            nodes += [s["nodes_per_row"] for s in per_step]
            contexts += [len(prompt) + r["length"] - 1 for r in rows]
        row = summarise(steps, nodes, contexts, latency)
        report["settings"][f"n={lo}-{hi},k={k}"] = row
        print(f"n={lo}-{hi} k={k}: " + ", ".join(f"{key} {v:.3f}" if isinstance(v, float) else f"{key} {v}"
                                                 for key, v in row.items()), flush=True)
    write_json_atomic(Path(args.out), report)
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
