#!/usr/bin/env python
"""Rollout benchmark: our engine against Hugging Face ``generate`` on the same weights, side by side.

    python tools/bench_rollout.py --out bench_rollout.json            # SmolLM2-135M-Instruct
    python tools/bench_rollout.py --model tiny --out bench_tiny.json  # random tiny Llama

Measures, in one process, alternating A and B for --reps repetitions and reporting medians:
  * tokens/s of the vanilla engine and of ``transformers`` ``generate`` (sampling at T=1, exactly
    --new-tokens per response, EOS ignored so both do the same work) at each batch size, and the
    ratio ours / HF;
  * the latency of one policy forward against the number of tokens in it (1 .. 512), two shapes:
    one row appending N tokens to a 128-token context (a verification tree) and N rows appending one
    token each (decode). This curve feeds the C_hw capacity profile of the speculative engine.
Prompts are GSM8K-style problems from the offline generator, in the chat template.
Absolute times on shared machines are noisy; the ratios are the result.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.config import ParallelConfig, SamplingConfig  # noqa: E402
from specroll_mcore.rollout import VanillaEngine  # noqa: E402
from specroll_mcore.rollout.profile import forward_latency  # noqa: E402
from specroll_mcore.checkpoint.megatron import write_json_atomic  # noqa: E402
from specroll_mcore.rl.data import synthetic_chat_prompts  # noqa: E402


def load_models(name: str, ctx):
    """(policy, hf_model, tokenizer or None) on identical weights."""
    import transformers

    if name == "smollm2":
        from specroll_mcore.checkpoint.megatron import load_policy
        from specroll_mcore.checkpoint.smollm2 import default_checkpoint, default_hf_dir

        hf_dir = default_hf_dir()
        policy = load_policy(default_checkpoint(), ctx)
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        return policy, hf, transformers.AutoTokenizer.from_pretrained(hf_dir)
    from specroll_mcore.checkpoint.hf import hf_architecture, hf_to_full, model_config_from_hf
    from specroll_mcore.model import PolicyModel

    torch.manual_seed(0)
    hc = transformers.LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=6,
                                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    hf = transformers.LlamaForCausalLM(hc).eval()
    cfg = model_config_from_hf(hc)
    policy = PolicyModel(cfg, ctx).eval()
    policy.load_full_state_dict(hf_to_full(hf.state_dict(), cfg, hf_architecture(hc)))
    return policy, hf, None


def make_prompts(tokenizer, n: int, vocab: int) -> list[list[int]]:
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(3, vocab, (int(torch.randint(40, 80, (1,), generator=g)),), generator=g).tolist()
                for _ in range(n)]
    return synthetic_chat_prompts(tokenizer, n, seed=1234)


def time_ours(engine, prompts, new_tokens: int) -> float:
    sp = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
    t0 = time.perf_counter()
    out = engine.generate(prompts, sp)
    dt = time.perf_counter() - t0
    assert all(len(t) == new_tokens for t in out.tokens)
    return dt


def time_hf(hf, prompts, new_tokens: int, pad_id: int) -> float:
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generation needs
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    ids, mask = ids.to(hf.device), mask.to(hf.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_id)
    if out.is_cuda:
        torch.cuda.synchronize(out.device)
    dt = time.perf_counter() - t0
    assert out.shape[1] == longest + new_tokens
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--batches", default="1,8,32", help="comma-separated numbers of concurrent responses")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--latency-tokens", default="1,2,4,8,16,32,64,128,256,512")
    ap.add_argument("--latency-reps", type=int, default=5)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default="bench_rollout.json")
    args = ap.parse_args()

    ctx = parallel.initialize(ParallelConfig())
    policy, hf, tokenizer = load_models(args.model, ctx)
    hf.to(ctx.device)
    engine = VanillaEngine(policy)
    batches = [int(b) for b in args.batches.split(",")]
    prompts_all = make_prompts(tokenizer, max(batches), policy.config.vocab_size)
    pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
    report = {"model": args.model, "new_tokens": args.new_tokens, "reps": args.reps,
              "threads": torch.get_num_threads(), "torch": torch.__version__, "throughput": []}
    print(f"model={args.model} threads={torch.get_num_threads()} new_tokens={args.new_tokens} reps={args.reps}")
    for b in batches:
        prompts = prompts_all[:b]
        time_ours(engine, prompts[:1], 4)  # warm-up
        ours, theirs, ratios = [], [], []
        for _ in range(args.reps):  # alternate A and B
            a = time_ours(engine, prompts, args.new_tokens)
            ours.append(a)
            if not args.skip_hf:
                h = time_hf(hf, prompts, args.new_tokens, pad_id)
                theirs.append(h)
                ratios.append(h / a)
        tokens = b * args.new_tokens
        row = {"batch": b, "ours_tokens_per_s": tokens / statistics.median(ours), "ours_s": ours}
        if theirs:
            row.update(hf_tokens_per_s=tokens / statistics.median(theirs), hf_s=theirs,
                       speed_ratio_ours_over_hf=statistics.median(ratios))
        report["throughput"].append(row)
        print(f"batch {b:3d}: ours {row['ours_tokens_per_s']:8.1f} tok/s" +
              (f"   hf generate {row['hf_tokens_per_s']:8.1f} tok/s   ratio (median of paired) "
               f"{row['speed_ratio_ours_over_hf']:.2f}x" if theirs else ""), flush=True)
    sizes = [int(x) for x in args.latency_tokens.split(",")]
    report["forward_latency"] = forward_latency(policy, sizes, args.latency_reps, verbose=True)
    write_json_atomic(Path(args.out), report)
    print(f"wrote {args.out}")
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
