#!/usr/bin/env python
"""The GRPO policy update's cost by how its sequences are split into micro-batches, on one real step.

    python tools/bench_update.py --out bench_update.json        # make demo's config (SmolLM2), 4 prompts x 8 samples
    python tools/bench_update.py --prompts 2 --max-new-tokens 256 --micro-batch-size 4
    torchrun --nproc_per_node 2 tools/bench_update.py --set parallel.tensor_model_parallel_size=2

One step's rollout (the vanilla engine; the update does not depend on which engine sampled), then
the update's forward-backward over the same sequences split three ways, timed in turn (each round
in another order), ``--reps`` rounds, medians:

- ``rollout_order``: runs of ``micro_batch_size`` responses in the rollout's order (micro_batch_tokens 0);
- ``sorted``: the token budget of ``micro_batch_size`` x the longest sequence with the same row cap,
  i.e. the same micro-batches' worst case, with sequences of like lengths together;
- ``token_budget``: that budget without the row cap (TrainConfig.micro_batch_tokens with a large
  micro_batch_size): short responses share a micro-batch by the dozen.

The optimizer step is left out (the same for every split), so every round runs on the same weights
and the gradient norms must agree (``grad_norm_rel_diff``). Reported: micro-batches, token positions
computed and the share of them that is padding, median seconds and the speedup over rollout order.

With ``--replicas R``: the update of R data-parallel replicas instead, the step's groups dealt out
to them as the trainer deals its prompts (whole groups, every R-th), and then as
``TrainConfig.balance_batch`` deals the sequences (schedule.balanced_assignment). Each replica's
share is timed on this machine in turn (token budget of ``micro_batch_size`` x the longest
sequence); a data-parallel update takes its slowest replica's time, whose medians are compared:

    python tools/bench_update.py --replicas 4 --prompts 8 --samples 4 --max-new-tokens 256

With ``--compare-attention``: the update's attention in its causal form (``metadata(positions,
None)``: SDPA's ``is_causal``, what the trainer runs) against an explicit [b, 1, L, L] causal mask
(the form before it), alternating, on the token-budget split; the gradient norms must agree:

    python tools/bench_update.py --compare-attention --prompts 1 --samples 4 --max-new-tokens 1024 \
        --set sampling.ignore_eos=true

With ``--compare-logprob-chunk N``: the update's log-probs over each micro-batch's whole response
span against N positions at a time (``TrainConfig.logprob_chunk``), alternating likewise.

With ``--compare-entropy-bonus C``: the update without and with an entropy bonus of coefficient C
(``TrainConfig.entropy_coeff``: the entropy's gradient through the vocabulary), alternating
likewise (the gradients differ by the bonus, so their norms are not compared).

With ``--compare-sequence-parallel``: the update without and with sequence parallelism
(``ParallelConfig.sequence_parallel``), alternating likewise; under TP > 1 (rank 0's figures):

    torchrun --nproc_per_node 3 tools/bench_update.py --compare-sequence-parallel \
        --set parallel.tensor_model_parallel_size=3 --set recompute_activations=true

The comparisons also report each update's peak memory (a GPU's allocator peak; on a Linux CPU the
process's resident high-water mark, reset before each update, which keeps what the allocator held on
to) and the bytes autograd saves for its backward (the activations; counted in the untimed round).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Iterator

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.checkpoint.megatron import write_json_atomic  # noqa: E402
from specroll_mcore.config import TrainConfig, load_config  # noqa: E402
from specroll_mcore.model import causal_mask  # noqa: E402
from specroll_mcore.rl.schedule import (MicroBatch, balanced_assignment, saved_for_backward,  # noqa: E402
                                       sequence_tokens)
from specroll_mcore.rl.trainer import GRPOTrainer  # noqa: E402
from specroll_mcore.tree.budget import hardware_name  # noqa: E402

VARIANTS = ("rollout_order", "sorted", "token_budget")
DEALS = ("as_rolled_out", "balanced")
PROC_STATUS = Path("/proc/self/status")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "examples" / "configs"
                                            / "smollm2_gsm8k_cpu.yaml"), help="the train config to start from")
    ap.add_argument("--checkpoint", default="smollm2")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=1,
                    help="time R data-parallel replicas' shares, as rolled out and balanced (balance_batch)")
    ap.add_argument("--compare-attention", action="store_true",
                    help="time the update's causal attention against an explicit causal mask")
    ap.add_argument("--compare-logprob-chunk", type=int, default=0, metavar="N",
                    help="time the update's log-probs over the whole span against N positions at a time, "
                         "with peak memory")
    ap.add_argument("--compare-entropy-bonus", type=float, default=0.0, metavar="C",
                    help="time the update without and with TrainConfig.entropy_coeff = C (> 0)")
    ap.add_argument("--compare-sequence-parallel", action="store_true",
                    help="time the update without and with sequence parallelism (TP > 1), with peak memory")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="further config overrides")
    ap.add_argument("--out", default="bench_update.json")
    args = ap.parse_args()
    if min(args.prompts, args.samples, args.max_new_tokens, args.micro_batch_size, args.reps, args.replicas) < 1:
        raise SystemExit("--prompts, --samples, --max-new-tokens, --micro-batch-size, --reps and --replicas must "
                         "be >= 1")
    if args.compare_logprob_chunk < 0:
        raise SystemExit(f"--compare-logprob-chunk must be >= 1 positions, got {args.compare_logprob_chunk}")
    if not (args.compare_entropy_bonus >= 0 and math.isfinite(args.compare_entropy_bonus)):
        raise SystemExit(f"--compare-entropy-bonus must be a coefficient > 0, got {args.compare_entropy_bonus}")
    comparisons = [args.compare_attention, bool(args.compare_logprob_chunk), args.compare_entropy_bonus > 0,
                   args.compare_sequence_parallel]
    names = "--compare-attention, --compare-logprob-chunk, --compare-entropy-bonus and --compare-sequence-parallel"
    if sum(comparisons) > 1:
        raise SystemExit(f"{names}: one comparison a run")
    if any(comparisons) and args.replicas > 1:
        raise SystemExit(f"{names} time one update, not replicas' shares: leave --replicas at 1")
    if args.replicas > args.prompts:
        raise SystemExit(f"--replicas {args.replicas} exceeds --prompts {args.prompts}: every replica rolls out "
                         "whole groups, so it needs a prompt")
    base = load_config(TrainConfig, args.config, [
        f"checkpoint={args.checkpoint}", "engine=vanilla", f"prompts_per_step={args.prompts}",
        f"sampling.num_samples={args.samples}", f"sampling.max_new_tokens={args.max_new_tokens}",
        f"micro_batch_size={args.micro_batch_size}", "micro_batch_tokens=0", "tensorboard=false",
        "compare_vanilla_every=0", *args.set])
    ctx = parallel.initialize(base.parallel)  # (the trainer keeps these groups)
    with run_directory(ctx) as out:
        cfg = dataclasses.replace(base, output_dir=str(out))
        if args.compare_sequence_parallel and cfg.parallel.tensor_model_parallel_size == 1:
            raise SystemExit("--compare-sequence-parallel splits the update's activations over the tensor-parallel "
                             "ranks: launch with torchrun and --set parallel.tensor_model_parallel_size=N (N > 1)")
        trainer = GRPOTrainer(cfg)
        if args.replicas > 1 and trainer.ctx.dp_size > 1:
            raise SystemExit("--replicas times the replicas' shares in one process: run it without data parallelism")
        if args.compare_attention:
            report = bench_attention(trainer, args)
        elif args.compare_sequence_parallel:
            report = bench_sequence_parallel(trainer, args)
        elif args.compare_logprob_chunk:
            report = bench_logprob_chunk(trainer, args)
        elif args.compare_entropy_bonus:
            report = bench_entropy_bonus(trainer, args)
        else:
            report = bench_replicas(trainer, args) if args.replicas > 1 else bench(trainer, args)
    if trainer.ctx.rank == 0:
        write_json_atomic(args.out, report)
        for name, v in report.get("deals", {}).items():
            print(f"{name:14s} tokens per replica {v['tokens']} (max / mean {v['max_over_mean']:.3f}): slowest "
                  f"replica {v['seconds']:.2f} s, {v['speedup']:.2f}x")
        compared = {**report.get("attention", {}), **report.get("logprob_chunk", {}),
                    **report.get("entropy_bonus", {}), **report.get("sequence_parallel", {})}
        for name, v in compared.items():
            print(f"{name:14s} {v['micro_batches']:3d} micro-batches of up to {v['longest_sequence']} tokens: "
                  f"{v['seconds']:.2f} s, {v['speedup']:.2f}x, peak memory {v['peak_memory_gib']:.2f} GiB, "
                  f"saved for the backward {v['saved_for_backward_gib']:.3f} GiB")
        for name, v in report.get("variants", {}).items():
            print(f"{name:14s} {v['micro_batches']:3d} micro-batches, {v['token_positions']:6d} token positions "
                  f"({100 * v['padding']:4.1f}% padding): {v['seconds']:.2f} s, {v['speedup']:.2f}x")
        if "grad_norm_rel_diff" in report:
            print(f"gradient norms agree to {report['grad_norm_rel_diff']:.1e}")
        print(f"wrote {args.out}")
    parallel.destroy()
    return 0


@contextlib.contextmanager
def run_directory(ctx) -> Iterator[str]:
    """The trainer's output directory: a temporary one, the same on every rank (rank 0 makes it and
    names it to the others: the trainer refuses ranks that see different ones), removed at the end."""
    name = [tempfile.mkdtemp(prefix="bench_update.") if ctx.rank == 0 else None]
    if ctx.world_size > 1:
        torch.distributed.broadcast_object_list(name, src=0)
    try:
        yield name[0]
    except BaseException:  # (no barrier: the other ranks need not be here)
        if ctx.rank == 0:
            shutil.rmtree(name[0], ignore_errors=True)
        raise
    ctx.barrier()  # (every rank's trainer is done with it)
    if ctx.rank == 0:
        shutil.rmtree(name[0], ignore_errors=True)


def one_step(trainer: GRPOTrainer) -> tuple[list[tuple], float]:
    """The first step's sequences to train on (the rollout of its prompts, scored) and the seconds the
    rollout took. The optimizer step is patched out from here on, so that every timed update runs on
    the same weights."""
    trainer.policy.pack_for_inference()
    t = time.perf_counter()
    rollout = trainer._rollout_round(trainer._next_examples(), 0, False, False, {})
    gen_s = time.perf_counter() - t
    trainer.optimizer.step = lambda *a, **k: None
    return trainer._training_sequences([rollout])[0], gen_s


def timed_update(trainer: GRPOTrainer, seqs: list[tuple]) -> tuple[float, float, list[MicroBatch]]:
    """(seconds, grad norm, micro-batches) of the update's forward-backward over ``seqs``."""
    minis = trainer._mini_batches(seqs)
    trainer.ctx.barrier()
    t = time.perf_counter()
    norm, *_ = trainer._update(minis)
    trainer.ctx.barrier()
    return time.perf_counter() - t, norm, [mb for part in minis for mb in part]


def bench(trainer: GRPOTrainer, args: argparse.Namespace) -> dict:
    cfg = trainer.cfg
    seqs, gen_s = one_step(trainer)
    longest = max(map(sequence_tokens, seqs))
    budget = args.micro_batch_size * longest
    splits = {"rollout_order": (args.micro_batch_size, 0), "sorted": (args.micro_batch_size, budget),
              "token_budget": (len(seqs), budget)}
    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    norms: dict[str, float] = {}
    shapes: dict[str, dict] = {}
    for rep in range(args.reps + 1):  # round 0 untimed: first-call allocations
        for name in VARIANTS[rep % 3:] + VARIANTS[:rep % 3]:
            cfg.micro_batch_size, cfg.micro_batch_tokens = splits[name]
            dt, norm, mbs = timed_update(trainer, seqs)
            if rep:
                seconds[name].append(dt)
            norms[name] = norm
            real = sum(int(mb.lengths.sum()) for mb in mbs)
            positions = sum(mb.input_ids.numel() for mb in mbs)
            shapes[name] = {"micro_batches": len(mbs), "rows": [len(mb.lengths) for mb in mbs],
                            "token_positions": positions, "tokens": real, "padding": 1 - real / positions}
    base = statistics.median(seconds["rollout_order"])
    variants = {name: {**shapes[name], "micro_batch_size": splits[name][0], "micro_batch_tokens": splits[name][1],
                       "seconds": statistics.median(seconds[name]), "runs_s": seconds[name],
                       "speedup": base / statistics.median(seconds[name]), "grad_norm": norms[name]}
                for name in VARIANTS}
    ref = norms["rollout_order"]
    return {"tool": "bench_update", "hardware": hardware_name(), "checkpoint": cfg.checkpoint,
            "layout": {"tp": trainer.ctx.tp_size, "pp": trainer.ctx.pp_size, "dp": trainer.ctx.dp_size},
            "args": vars(args), "responses": len(seqs), "generation_s": gen_s,
            "response_tokens": sum(len(s[1]) for s in seqs), "longest_sequence": longest,
            "recompute_activations": cfg.recompute_activations, "variants": variants,
            "grad_norm_rel_diff": max(abs(n - ref) for n in norms.values()) / max(abs(ref), 1e-30)}


def peak_memory_reset(device) -> None:
    """Start measuring the process's peak memory anew: the CUDA allocator's peak on a GPU; on Linux
    the resident set's high-water mark (VmHWM, reset through /proc/self/clear_refs)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    elif PROC_STATUS.is_file():
        Path("/proc/self/clear_refs").write_text("5")


def peak_memory_gib(device) -> float:
    """The peak since :func:`peak_memory_reset`, GiB (NaN on a CPU without /proc: not Linux)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    if not PROC_STATUS.is_file():
        return float("nan")
    return int(PROC_STATUS.read_text().split("VmHWM:")[1].split()[0]) / 2**20  # (kB)


def bench_forms(trainer: GRPOTrainer, args: argparse.Namespace, forms: dict[str, Callable[[bool], None]],
                key: str) -> dict:
    """Two forms of the same update on the token-budget split, alternating, ``--reps`` rounds after an
    untimed one: seconds, the peak memory of each timed update and the gradient norm (the same
    gradients either way: their relative difference is reported). ``forms[name](on)`` switches a
    form on before its update and off after it; the first form is the baseline of the speedups."""
    cfg = trainer.cfg
    seqs, gen_s = one_step(trainer)
    longest = max(map(sequence_tokens, seqs))
    tp = trainer.ctx.tp_size  # (room for sequence parallelism's padding: every form splits alike)
    cfg.micro_batch_size, cfg.micro_batch_tokens = len(seqs), args.micro_batch_size * -(-longest // tp) * tp
    names = list(forms)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    peaks: dict[str, list[float]] = {name: [] for name in names}
    saved: dict[str, int] = {}
    norms: dict[str, float] = {}
    for rep in range(args.reps + 1):  # round 0 untimed: first-call allocations, and what the backward keeps
        for name in names[rep % 2:] + names[:rep % 2]:
            forms[name](True)
            peak_memory_reset(trainer.ctx.device)
            with saved_for_backward() if rep == 0 else contextlib.nullcontext([0]) as counted:
                dt, norms[name], mbs = timed_update(trainer, seqs)
            if rep == 0:
                saved[name] = counted[0]
            peak = peak_memory_gib(trainer.ctx.device)
            forms[name](False)
            if rep:
                seconds[name].append(dt)
                peaks[name].append(peak)
    base = statistics.median(seconds[names[0]])
    return {"tool": "bench_update", "hardware": hardware_name(), "checkpoint": cfg.checkpoint, "args": vars(args),
            "layout": {"tp": trainer.ctx.tp_size, "pp": trainer.ctx.pp_size, "dp": trainer.ctx.dp_size},
            "responses": len(seqs), "generation_s": gen_s, "response_tokens": sum(len(s[1]) for s in seqs),
            "recompute_activations": cfg.recompute_activations,
            key: {name: {"micro_batches": len(mbs), "longest_sequence": longest,
                         "micro_batch_tokens": cfg.micro_batch_tokens, "seconds": statistics.median(seconds[name]),
                         "runs_s": seconds[name], "speedup": base / statistics.median(seconds[name]),
                         "peak_memory_gib": statistics.median(peaks[name]), "runs_peak_memory_gib": peaks[name],
                         "saved_for_backward_gib": saved[name] / 2**30,
                         "grad_norm": norms[name]} for name in names},
            "grad_norm_rel_diff": abs(norms[names[0]] - norms[names[1]]) / max(abs(norms[names[0]]), 1e-30)}


def bench_attention(trainer: GRPOTrainer, args: argparse.Namespace) -> dict:
    """The update's causal attention (what the trainer runs) against an explicit causal mask."""
    policy = trainer.policy
    causal = policy.metadata

    def explicit_mask(positions, new_token_mask, *rest, **kw):  # the [b, 1, L, L] mask SDPA reads
        if new_token_mask is None:
            new_token_mask = causal_mask(*positions.shape, positions.device)
        return causal(positions, new_token_mask, *rest, **kw)

    def use(metadata):
        return lambda on: setattr(policy, "metadata", metadata if on else causal)

    return bench_forms(trainer, args, {"explicit_mask": use(explicit_mask), "causal": use(causal)}, "attention")


def bench_logprob_chunk(trainer: GRPOTrainer, args: argparse.Namespace) -> dict:
    """The update's log-probs over the whole span at once against ``--compare-logprob-chunk`` positions
    at a time (TrainConfig.logprob_chunk)."""
    cfg = trainer.cfg

    def chunk(n):
        return lambda on: setattr(cfg, "logprob_chunk", n if on else 0)

    return bench_forms(trainer, args, {"whole_span": chunk(0), f"chunk_{args.compare_logprob_chunk}":
                                       chunk(args.compare_logprob_chunk)}, "logprob_chunk")


def bench_entropy_bonus(trainer: GRPOTrainer, args: argparse.Namespace) -> dict:
    """The update without and with an entropy bonus of ``--compare-entropy-bonus`` (TrainConfig.entropy_coeff)."""
    cfg = trainer.cfg

    def coeff(c):
        return lambda on: setattr(cfg, "entropy_coeff", c if on else 0.0)

    report = bench_forms(trainer, args, {"no_bonus": coeff(0.0), f"entropy_coeff_{args.compare_entropy_bonus:g}":
                                         coeff(args.compare_entropy_bonus)}, "entropy_bonus")
    del report["grad_norm_rel_diff"]  # (the bonus changes the gradient)
    return report


def bench_sequence_parallel(trainer: GRPOTrainer, args: argparse.Namespace) -> dict:
    """The update without and with sequence parallelism (ParallelConfig.sequence_parallel)."""
    contexts = {id(c): c for c in (trainer.ctx, trainer.policy.ctx)}.values()

    def split(on_in_form: bool):
        def switch(on: bool) -> None:
            for c in contexts:
                c.sequence_parallel = on_in_form and on
        return switch

    return bench_forms(trainer, args, {"whole_sequence": split(False), "sequence_parallel": split(True)},
                       "sequence_parallel")


def bench_replicas(trainer: GRPOTrainer, args: argparse.Namespace) -> dict:
    cfg, R = trainer.cfg, args.replicas
    seqs, gen_s = one_step(trainer)
    G = cfg.sampling.num_samples
    shares = [[s for k, s in enumerate(seqs) if (k // G) % R == r] for r in range(R)]  # prompt i: replica i % R
    plan = balanced_assignment([list(map(sequence_tokens, share)) for share in shares])
    deals = {"as_rolled_out": shares, "balanced": [[shares[h][i] for h, i in part] for part in plan]}
    cfg.micro_batch_tokens = args.micro_batch_size * max(map(sequence_tokens, seqs))
    slowest: dict[str, list[float]] = {name: [] for name in DEALS}
    per_replica: dict[str, list[list[float]]] = {name: [] for name in DEALS}
    positions: dict[str, list[int]] = {name: [] for name in DEALS}
    for rep in range(args.reps + 1):  # round 0 untimed: first-call allocations
        for name in DEALS[rep % 2:] + DEALS[:rep % 2]:
            times = []
            for share in deals[name]:
                dt, _, mbs = timed_update(trainer, share)
                positions[name].append(sum(mb.input_ids.numel() for mb in mbs))
                times.append(dt)
            if rep:
                slowest[name].append(max(times))
                per_replica[name].append(times)
    base = statistics.median(slowest["as_rolled_out"])
    out = {}
    for name in DEALS:
        tokens = [sum(map(sequence_tokens, share)) for share in deals[name]]
        out[name] = {"tokens": tokens, "max_over_mean": max(tokens) * R / sum(tokens),
                     "token_positions": positions[name][:R],  # with the padding of each replica's micro-batches
                     "sequences": [len(share) for share in deals[name]], "seconds": statistics.median(slowest[name]),
                     "runs_s": slowest[name], "replica_runs_s": per_replica[name],
                     "speedup": base / statistics.median(slowest[name])}
    return {"tool": "bench_update", "hardware": hardware_name(), "checkpoint": cfg.checkpoint, "args": vars(args),
            "replicas": R, "responses": len(seqs), "generation_s": gen_s, "micro_batch_tokens": cfg.micro_batch_tokens,
            "sequences_moved": sum(h != d for d, part in enumerate(plan) for h, _ in part), "deals": out}


if __name__ == "__main__":
    sys.exit(main())
