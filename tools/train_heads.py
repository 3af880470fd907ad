#!/usr/bin/env python
"""Warm-start the horizon heads of a policy checkpoint by self-distillation (backbone frozen).

    python tools/train_heads.py --checkpoint smollm2 --prompts 320 --steps 800
    torchrun --nproc_per_node 8 tools/train_heads.py --checkpoint CKPT --tp 4 --pp 1   # 2 replicas x TP 4

1. samples continuations of prompts with the policy itself (vanilla engine, T=1): the embedded
   GSM8K-style problems, or with --config the prompts of a GRPO run's data section (DAPO-Math-17K, a
   local dataset...), rendered as that run renders them;
2. keeps, for every sampled token, the hidden state and top-K distribution it was sampled from;
3. trains the H heads (AdamW) on KL-to-policy + NLL of realised tokens, batches of positions;
4. reports per-head top-1 / top-5 accuracy on held-out continuations (before and after);
5. saves the heads beside the checkpoint (heads.pt, atomic, recording the policy fingerprint; in a
   GRPO run's output directory, in its latest checkpoint, beside the weights they were fitted on), with
   how often each token occurs in the training responses (``heads.token_counts``: the ranking of
   the ids the engine drafts from, SpecConfig.draft_vocab).
Progress bar; a checkpoint of the heads every --save-every steps. JSON summary with --out.

Under torchrun with --tp / --pp the policy runs in that layout and the remaining factor of the world
size is data parallel: the replicas sample disjoint chunks of prompts (each response's tokens are the
same as in one process: the sampling noise is keyed by prompt id), the heads train on the last
stage with vocab-parallel losses, gradients averaged over the replicas (each takes --batch / DP
positions per step), and the first rank of the last stage writes heads.pt and the summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.checkpoint.megatron import (load_policy, save_atomic, save_heads,  # noqa: E402
                                                stop_token_ids, write_json_atomic)
from specroll_mcore.config import DataConfig, ParallelConfig, SamplingConfig, TrainConfig, load_config  # noqa: E402
from specroll_mcore.distill import (DistillRecords, freeze_all_but_heads, full_head_state, head_accuracy,  # noqa: E402
                                    records_from_features, train_heads_step)
from specroll_mcore.optimizer import MainParamAdamW  # noqa: E402
from specroll_mcore.rl.data import load_data  # noqa: E402
from specroll_mcore.rl.evaluation import usable_prompts  # noqa: E402
from specroll_mcore.rollout import VanillaEngine  # noqa: E402


def heldout_prompts(prompts: int) -> int:
    """Prompts held out beside ``prompts`` training ones, for the heads' accuracy."""
    return max(4, prompts // 10)


def check_data_parallel_split(batch: int, prompts: int, dp_size: int) -> None:
    """Refuse, before any work, a batch of positions or a prompt count that the data-parallel
    replicas cannot share: each takes batch / DP positions a step, and training and held-out prompts."""
    if batch % dp_size:
        raise SystemExit(f"--batch {batch} is not divisible by the {dp_size} data-parallel replicas "
                         f"(world size / (tp x pp)); pass a multiple of {dp_size}")
    held = heldout_prompts(prompts)
    if min(prompts, held) < dp_size:  # every replica needs training and held-out prompts
        need = dp_size if dp_size <= 4 else 10 * dp_size  # held out: max(4, prompts // 10)
        raise SystemExit(f"--prompts {prompts} ({held} more held out) cannot give each of the {dp_size} "
                         f"data-parallel replicas a training and a held-out prompt: pass --prompts >= {need}")


def distill_prompts(tokenizer, data: DataConfig, n: int, seed: int, max_positions: int) -> list[list[int]]:
    """``n`` prompts of ``data`` as token ids, rendered as a GRPO run on it renders them: the synthetic
    source's problems from a seed of the heads' own (10000 + ``seed``: not the run's training problems),
    a dataset's usable rows (those a run would keep) in an order shuffled by ``seed``."""
    synthetic = data.source == "synthetic"
    examples, report = load_data(dataclasses.replace(data, limit=n) if synthetic else data, 10_000 + seed)
    kept, ids = usable_prompts(examples, data, tokenizer, max_positions, report, math_verify=False)
    if len(kept) < n:
        raise SystemExit(f"--prompts asks for {n} prompts with the held-out ones, but data.source {data.source!r} "
                         f"gives {len(kept)} usable ones (skipped: {report.skipped}); pass fewer --prompts")
    order = range(n) if synthetic else torch.randperm(len(kept), generator=torch.Generator().manual_seed(seed))[:n]
    return [ids[kept[int(i)].id] for i in order]


def replica_path(path: Path, ctx: parallel.ParallelContext) -> Path:
    """The records file of this data-parallel replica (each replica keeps the records it sampled)."""
    return path if ctx.dp_size == 1 else path.with_name(f"{path.stem}.dp{ctx.dp_rank}of{ctx.dp_size}{path.suffix}")


def save_records(path: Path, train: DistillRecords, heldout: DistillRecords) -> None:
    save_atomic({"fields": [f.name for f in dataclasses.fields(DistillRecords)],
                 "train": dataclasses.asdict(train), "heldout": dataclasses.asdict(heldout)}, path)


def load_records(path: Path) -> tuple[DistillRecords, DistillRecords]:
    """Records saved by :func:`save_records` (plain tensors: loaded with ``weights_only=True``)."""
    want = [f.name for f in dataclasses.fields(DistillRecords)]
    try:
        blob = torch.load(path, weights_only=True)
        ok = isinstance(blob, dict) and blob.get("fields") == want
    except Exception:  # noqa: BLE001  (any unreadable file gets the same answer)
        ok = False
    if not ok:
        raise SystemExit(f"--records-cache {path} is not a records file of this version (fields {want}); "
                         "delete it, or pass another path to sample new records")
    return DistillRecords(**blob["train"]), DistillRecords(**blob["heldout"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="smollm2", help="Megatron checkpoint dir, or smollm2 (the default model)")
    ap.add_argument("--config", help="a GRPO run config (specroll train --config): the heads learn on the prompts of "
                                     "its data section, rendered as the run renders them (default: the embedded "
                                     "GSM8K-style problems, without an instruction, as the rollout benchmarks "
                                     "pose them)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="overrides of that config, as specroll train takes them (data.source=..., data.limit=...)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (launch with torchrun)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (the heads train on the last)")
    ap.add_argument("--ep", type=int, default=1,
                    help="expert-parallel size (a mixture of experts: its experts split over data-parallel ranks)")
    ap.add_argument("--dtype", choices=["float32", "float64", "bfloat16"],
                    help="parameter dtype of the policy and heads (default: the checkpoint's)")
    ap.add_argument("--num-heads", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=320,
                    help="training prompts (10%% more are held out); more data is what improves the heads")
    ap.add_argument("--samples", type=int, default=2, help="continuations per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="the most continuations sampled at once (VanillaEngine's max_num_seqs; default: a chunk's "
                         "32 prompts x --samples): a bound on the KV cache's memory")
    ap.add_argument("--target-topk", type=int, default=32, help="the policy's top-K kept as each head's target")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=256, help="positions per step (over all data-parallel replicas)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="JSON summary")
    ap.add_argument("--records-cache", help="save the distillation records here, or load them if the file exists "
                                            "(skips sampling on a rerun; one file per data-parallel replica)")
    ap.add_argument("--init-from-saved", action="store_true",
                    help="continue from the heads saved beside the checkpoint instead of zero-initialised ones")
    args = ap.parse_args()
    if args.target_topk < 1:
        ap.error(f"--target-topk must be >= 1, got {args.target_topk}")
    if args.num_heads < 1:
        ap.error(f"--num-heads must be >= 1, got {args.num_heads}")
    if args.steps < 2:
        ap.error(f"--steps must be >= 2 (a warm-up and a decay), got {args.steps}")
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        ap.error(f"--max-num-seqs must be a positive number of continuations, got {args.max_num_seqs}")
    try:
        data = (load_config(TrainConfig, args.config, args.set).data if args.config or args.set
                else DataConfig(instruction=""))  # (the problems as the rollout benchmarks pose them)
    except (OSError, ValueError) as e:
        ap.error(f"--config / --set: {e}")

    from specroll_mcore.checkpoint.smollm2 import resolve_checkpoint

    ckpt = resolve_checkpoint(args.checkpoint)
    ctx = parallel.initialize(ParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                                             expert_model_parallel_size=args.ep))
    check_data_parallel_split(args.batch, args.prompts, ctx.dp_size)
    policy = load_policy(ckpt, ctx, params_dtype=args.dtype, num_heads=args.num_heads,
                         with_heads=args.init_from_saved)
    last = ctx.is_last_stage
    report = last and ctx.tp_rank == 0 and ctx.dp_rank == 0  # prints, writes heads.pt and the summary
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    t0 = time.perf_counter()
    held = heldout_prompts(args.prompts)
    prompts = distill_prompts(tok, data, args.prompts + held, args.seed, policy.config.max_position_embeddings)

    cache = replica_path(Path(args.records_cache), ctx) if args.records_cache else None
    # every rank takes the same branch: sampling is collective over TP and PP
    cached = cache is not None and not int(ctx.all_reduce_max(torch.tensor([0 if cache.is_file() else 1])))
    t_sample = 0.0
    train = heldout = None
    if cached:
        if last:
            train, heldout = load_records(cache)
            if report:
                print(f"loaded distillation records from {cache}")
    else:
        # 1-2. The policy's own continuations, with the hidden states and top-K distributions sampling
        # computed for each token: the distillation records (on the last stage). Prompts go round-robin
        # to the data-parallel replicas (training and held-out alike), in chunks of 32 per replica.
        engine = VanillaEngine(policy, eos_token_ids=stop_token_ids(ckpt, tok), max_num_seqs=args.max_num_seqs)
        sp = SamplingConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens, num_samples=args.samples,
                            seed=args.seed)
        train_parts, held_parts = [], []
        mine = list(range(ctx.dp_rank, len(prompts), ctx.dp_size))
        for s in tqdm(range(0, len(mine), 32), desc="sampling continuations", disable=not report):
            ids = mine[s:s + 32]
            out = engine.generate([prompts[i] for i in ids], sp, prompt_ids=ids, features_topk=args.target_topk)
            for pi, toks, feat in zip(out.prompt_index, out.tokens, out.features or []):
                rec = records_from_features(feat, toks, args.num_heads)
                (held_parts if pi >= args.prompts else train_parts).append(rec)
        t_sample = time.perf_counter() - t0
        if last:
            train, heldout = DistillRecords.cat(train_parts), DistillRecords.cat(held_parts)
            if cache is not None and ctx.tp_rank == 0:
                save_records(cache, train, heldout)
    if not last:  # the heads live on the last stage; the other stages are done
        parallel.destroy()
        return 0

    before = head_accuracy(policy, heldout)
    if report:
        print(f"{len(train)} training / {len(heldout)} held-out positions on replica 0 of {ctx.dp_size}; "
              f"held-out before: {json.dumps(before)}")

    # 3. Train the heads only (each replica on its own records; gradients averaged over replicas),
    # and count the tokens of the responses, which rank the ids they draft from (SpecConfig.draft_vocab).
    counts = torch.bincount(train.root.cpu(), minlength=policy.config.vocab_size)
    policy.heads.token_counts.copy_(ctx.all_reduce_dp(counts.to(ctx.device)))
    params = freeze_all_but_heads(policy)
    opt = MainParamAdamW(params, lr=args.lr, weight_decay=0.0)  # float32 main copies of bfloat16 heads
    # one cycle: warm-up over 10% of the steps, at least 1.5 of them (torch's schedule divides by the
    # warm-up's length in steps, less one)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt.optimizer, max_lr=args.lr, total_steps=args.steps,
                                                pct_start=max(0.1, 1.5 / args.steps))
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + ctx.dp_rank)
    bar = tqdm(range(args.steps), desc="training heads", disable=not report)
    history = []
    for step in bar:
        idx = torch.randint(0, len(train), (args.batch // ctx.dp_size,), generator=g)
        m = train_heads_step(policy, opt, train.subset(idx))
        sched.step()
        history.append(m)
        bar.set_postfix(loss=f"{m['loss']:.3f}")
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            state = full_head_state(policy)  # a TP collective
            if report:
                save_heads(ckpt, state, {"num_heads": args.num_heads, "steps": step + 1})
    after = head_accuracy(policy, heldout)
    state = full_head_state(policy)
    positions = ctx.all_reduce_dp(torch.tensor([len(train), len(heldout)]))
    if report:
        summary = {"checkpoint": str(ckpt), "data": data.source,
                   "layout": {"tp": ctx.tp_size, "pp": ctx.pp_size, "dp": ctx.dp_size, "ep": ctx.ep_size},
                   "train_positions": int(positions[0]), "heldout_positions": int(positions[1]),
                   "heldout_before": before, "heldout_after": after, "final_loss": history[-1],
                   "seconds": {"sampling": t_sample, "total": time.perf_counter() - t0}}
        summary["heads"] = str(save_heads(ckpt, state, {"num_heads": args.num_heads, "steps": args.steps,
                                                          "heldout_accuracy": after}))
        print(json.dumps(summary, indent=2))
        if args.out:
            write_json_atomic(Path(args.out), summary)
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
