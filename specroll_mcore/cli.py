"""The ``specroll`` command: ``generate``, ``train`` (GRPO), ``eval`` (held-out evaluation) and ``convert``.

Run with torchrun for TP/PP/DP, e.g.
    torchrun --nproc_per_node 2 -m specroll_mcore.cli generate --set parallel.tensor_model_parallel_size=2
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Optional, Sequence


def _quiet() -> None:
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)


def cmd_generate(args: argparse.Namespace) -> int:
    import transformers

    from specroll_mcore import parallel
    from specroll_mcore.checkpoint.megatron import load_policy, stop_token_ids, write_text_atomic
    from specroll_mcore.checkpoint.smollm2 import resolve_checkpoint
    from specroll_mcore.config import load_generate_config
    from specroll_mcore.rl.data import chat_prompt_ids
    from specroll_mcore.rollout import engine_for

    cfg = load_generate_config(args.config, args.set)
    ckpt = resolve_checkpoint(cfg.checkpoint)
    ctx = parallel.initialize(cfg.parallel)
    policy = load_policy(ckpt, ctx, cfg.params_dtype, with_heads=cfg.engine == "specroll")
    tokenizer = transformers.AutoTokenizer.from_pretrained(ckpt)
    if cfg.chat:
        prompts = [chat_prompt_ids(tokenizer, p, cfg.chat_template_kwargs) for p in cfg.prompts]
    else:
        prompts = [tokenizer(p)["input_ids"] for p in cfg.prompts]
    # Data parallel: each DP rank takes every dp_size-th prompt; ids stay global, so the tokens do not
    # depend on the DP size.
    mine = list(range(ctx.dp_rank, len(prompts), ctx.dp_size))
    engine = engine_for(cfg.engine, policy, cfg.spec, eos_token_ids=stop_token_ids(ckpt, tokenizer),
                        tokenizer=tokenizer, pipeline_groups=cfg.parallel.rollout_groups,
                        max_num_seqs=cfg.max_num_seqs, max_prefill_tokens=cfg.max_prefill_tokens)
    out = engine.generate([prompts[i] for i in mine], cfg.sampling, prompt_ids=mine)
    rows = [{"prompt_index": p, "sample_index": s, "prompt": cfg.prompts[p],
             "response": tokenizer.decode(t, skip_special_tokens=True), "tokens": t,
             "logprobs": [round(float(x), 6) for x in lp], "finish_reason": f}
            for p, s, t, lp, f in zip(out.prompt_index, out.sample_index, out.tokens, out.logprobs, out.finish_reason)]
    rows = ctx.gather_to_rank0(rows)
    stats = generate_stats(out.stats, ctx)
    if ctx.rank == 0:
        rows.sort(key=lambda r: (r["prompt_index"], r["sample_index"]))
        for r in rows:
            print(f"--- prompt {r['prompt_index']} sample {r['sample_index']} ({r['finish_reason']}, "
                  f"{len(r['tokens'])} tokens)\n{r['prompt']}\n>>> {r['response']}")
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in stats.items()
                          if k != "per_step"}))
        if cfg.output:  # (a kill while it is written leaves the previous file whole)
            write_text_atomic(Path(cfg.output), "".join(json.dumps(r) + "\n" for r in rows))
    parallel.destroy()
    return 0


def generate_stats(stats: dict, ctx) -> dict:
    """A rollout's statistics over every data-parallel replica (each generated its share of the
    prompts): tokens and forwards summed, the time the slowest replica's, tau, tree size and acceptance
    over all their verification steps; the rest (the time split, the slow path) the first replica's, and
    no figures per row (``tau_per_row``: the first replica's rows only)."""
    import torch

    from specroll_mcore.rollout.base import over_replicas

    if ctx.dp_size == 1:
        return stats
    counts = ctx.all_reduce_dp(torch.tensor([float(stats["tokens"]), float(stats["forwards"])], dtype=torch.float64,
                                            device=ctx.device)).tolist()
    total_s = float(ctx.all_reduce_max(torch.tensor([stats["total_s"]], dtype=torch.float64, device=ctx.device)))
    out = dict(over_replicas(stats, ctx), tokens=int(counts[0]), forwards=int(counts[1]), total_s=total_s,
               tokens_per_s=counts[0] / max(total_s, 1e-9), data_parallel_replicas=ctx.dp_size)
    out.pop("tau_per_row", None)
    return out


def cmd_convert(args: argparse.Namespace) -> int:
    from specroll_mcore.checkpoint import convert

    if args.direction == "hf-to-mcore":
        src = Path(args.src)
        if src.suffix == ".gguf":
            hf_dir = Path(args.out).with_name(Path(args.out).name + "-hf")
            src = convert.gguf_to_hf(src, hf_dir, overwrite=args.overwrite)
        out = convert.convert_hf_to_mcore(src, Path(args.out), args.tp, args.pp, args.dtype, args.overwrite,
                                          args.first_stage_layers, args.last_stage_layers)
    elif args.direction == "mcore-to-hf":
        out = convert.convert_mcore_to_hf(Path(args.src), Path(args.out), args.overwrite,
                                          parse_size(args.max_shard_size, "--max-shard-size"), args.iteration)
    else:  # smollm2
        from specroll_mcore.checkpoint.smollm2 import default_checkpoint

        out = default_checkpoint(Path(args.cache) if args.cache else None, args.tp, args.pp)
    print(out)
    return 0


SIZE_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9,
              "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30}


def parse_size(text: str, what: str) -> int:
    """``5GB``, ``500MB``, ``2GiB`` or a byte count -> bytes (as ``save_pretrained``'s max_shard_size)."""
    number = text.strip().rstrip("bBiIkKmMgG")
    unit = text.strip()[len(number):].upper()
    try:
        size = int(float(number) * SIZE_UNITS[unit])
    except (KeyError, ValueError):
        raise ValueError(f"{what} must be a size such as 5GB, 500MB or 2GiB, got {text!r}") from None
    if size <= 0:
        raise ValueError(f"{what} must be > 0, got {text!r}")
    return size


def cmd_train(args: argparse.Namespace) -> int:
    from specroll_mcore.config import TrainConfig, load_config
    from specroll_mcore.rl.trainer import GRPOTrainer

    cfg = load_config(TrainConfig, args.config, args.set + (["resume=true"] if args.resume else []))
    trainer = GRPOTrainer(cfg)
    trainer.run()
    from specroll_mcore import parallel

    parallel.destroy()
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """The held-out evaluation of a GRPO config (its ``eval`` section, scored by its reward) of the
    config's checkpoint, as ``specroll train`` runs it during training."""
    import transformers

    from specroll_mcore import parallel
    from specroll_mcore.checkpoint.megatron import load_policy, stop_token_ids, write_json_atomic, write_text_atomic
    from specroll_mcore.checkpoint.smollm2 import resolve_checkpoint
    from specroll_mcore.config import TrainConfig, load_config
    from specroll_mcore.rl.data import load_data
    from specroll_mcore.rl.evaluation import HeldOut, evaluate, make_scorer, reward_function, usable_prompts
    from specroll_mcore.rollout import engine_for

    cfg = load_config(TrainConfig, args.config, args.set)
    ctx = parallel.initialize(cfg.parallel)
    reward_fn = reward_function(cfg.reward_fn) if cfg.reward_fn else None
    ckpt = resolve_checkpoint(cfg.checkpoint)
    policy = load_policy(ckpt, ctx, with_heads=cfg.engine == "specroll")
    tokenizer = transformers.AutoTokenizer.from_pretrained(ckpt)
    positions = policy.config.max_position_embeddings
    # the training prompts, left out of the evaluation as in training (the same held-out prompts)
    examples, report = load_data(cfg.data, cfg.seed)
    math_verify = reward_fn is None
    training = usable_prompts(examples, cfg.data, tokenizer, positions, report, math_verify)[0]
    held_out = HeldOut.load(cfg.eval, cfg.seed, tokenizer, positions, training, ctx.dp_size, math_verify)
    engine = engine_for(cfg.engine, policy, cfg.spec, eos_token_ids=stop_token_ids(ckpt, tokenizer),
                        tokenizer=tokenizer, pipeline_groups=cfg.parallel.rollout_groups,
                        max_num_seqs=cfg.max_num_seqs, max_prefill_tokens=cfg.max_prefill_tokens)
    responses: list[dict] = []
    row = {"checkpoint": str(ckpt), "engine": cfg.engine, "skipped": held_out.report.skipped,
           **evaluate(engine, held_out, cfg.eval, make_scorer(cfg, tokenizer, reward_fn), ctx, responses)}
    responses = ctx.gather_to_rank0([dict(r, response=tokenizer.decode(r["tokens"], skip_special_tokens=True))
                                     for r in responses])
    if ctx.rank == 0:
        print(json.dumps(row))
        if args.out:
            write_json_atomic(Path(args.out), row)
        if args.responses:
            responses.sort(key=lambda r: (r["id"], r["sample"]))
            write_text_atomic(Path(args.responses), "".join(json.dumps(r) + "\n" for r in responses))
    parallel.destroy()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specroll", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="sample responses with the rollout engine")
    g.add_argument("--config", help="YAML file (see examples/configs/demo_cpu.yaml)")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. sampling.temperature=0.7 (repeatable)")
    g.set_defaults(func=cmd_generate)
    t = sub.add_parser("train", help="GRPO with SpecRoll rollouts")
    t.add_argument("--config", help="YAML file (see examples/configs/smollm2_gsm8k_cpu.yaml)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. steps=40 or sampling.num_samples=8 (repeatable)")
    t.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    t.set_defaults(func=cmd_train)
    e = sub.add_parser("eval", help="the held-out evaluation of a GRPO config, of its checkpoint")
    e.add_argument("--config", help="a GRPO YAML file: its checkpoint, engine, reward and eval section (see "
                   "examples/configs/qwen2.5_7b_gsm8k_1node.yaml)")
    e.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. checkpoint=runs/NAME or eval.data.limit=200 (repeatable)")
    e.add_argument("--out", help="also write the figures here (JSON)")
    e.add_argument("--responses", help="write every response here, one JSON line each (question, reference, "
                   "response, reward, correct, finish reason)")
    e.set_defaults(func=cmd_eval)
    c = sub.add_parser("convert", help="convert checkpoints between Hugging Face and Megatron")
    c.add_argument("direction", choices=["hf-to-mcore", "mcore-to-hf", "smollm2"])
    c.add_argument("src", nargs="?", help="HF directory, Hub model id or .gguf file (hf-to-mcore), Megatron checkpoint "
                   "(mcore-to-hf)")
    c.add_argument("out", nargs="?", help="output directory")
    c.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the output")
    c.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the output")
    c.add_argument("--first-stage-layers", type=int, help="layers on the first pipeline stage (uneven split; "
                   "ParallelConfig.num_layers_in_first_pipeline_stage)")
    c.add_argument("--last-stage-layers", type=int, help="layers on the last pipeline stage (uneven split; "
                   "ParallelConfig.num_layers_in_last_pipeline_stage)")
    c.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"], help="output dtype")
    c.add_argument("--max-shard-size", default="5GB", help="mcore-to-hf: largest safetensors file written, e.g. 5GB "
                   "or 500MB (a larger model gets several, with model.safetensors.index.json)")
    c.add_argument("--iteration", type=int, help="mcore-to-hf of a training run: the iteration to export (default: "
                   "the latest)")
    c.add_argument("--cache", help="cache directory for `smollm2` (default $SPECROLL_CACHE or ~/.cache/specroll_mcore)")
    c.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    c.set_defaults(func=cmd_convert)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    _quiet()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "convert" and args.direction != "smollm2" and not (args.src and args.out):
        parser.error(f"convert {args.direction} needs SRC and OUT")
    if args.command == "convert" and args.direction != "mcore-to-hf" and args.iteration is not None:
        parser.error(f"--iteration selects the training iteration mcore-to-hf exports; convert {args.direction} "
                     "reads no training run")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError, KeyError, RuntimeError) as e:
        print(f"specroll {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
