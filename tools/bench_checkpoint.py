#!/usr/bin/env python
"""Periodic checkpoints written at once or in the background (``TrainConfig.async_save``): the wall
time of GRPO runs that save after every step, the two alternating.

    python tools/bench_checkpoint.py --out bench_checkpoint.json    # SmolLM2, make demo's config, 3 steps
    python tools/bench_checkpoint.py --steps 4 --reps 3 --set sampling.max_new_tokens=64
    torchrun --nproc_per_node 8 tools/bench_checkpoint.py --config examples/configs/qwen2.5_7b_gsm8k_1node.yaml \
        --dir /shared/scratch --steps 3    # the config's TP/PP/DP layout; --dir on a file system every rank shares

Each repetition runs the same seeded steps twice in this process, ``async_save`` off and on (which
goes first alternates), each into a fresh output directory with ``save_every=1``: the run's wall time
(steps, saves, and the last background checkpoint's commit; the trainer's setup is left out) and the
time its saves held the training loop. Reported: medians, the ratio of run times (at once / in the
background), a checkpoint's size on disk, and whether the two modes' checkpoints hold the same
weights and AdamW states (every iteration, every rank's shards compared).

Under torchrun every rank runs the trainer at the config's layout; the times are rank 0's (the
steps are collective; a save holds each rank for its own shards), and rank 0 compares the
checkpoints and writes the JSON. The output directories go into a new directory in ``--dir``
(default: the system's temporary directory in one process; under torchrun the working directory,
which every rank must share, as the trainer checks), removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from specroll_mcore.checkpoint.megatron import write_json_atomic  # noqa: E402
from specroll_mcore.config import TrainConfig, load_config  # noqa: E402
from specroll_mcore.rl.trainer import GRPOTrainer  # noqa: E402

MODES = ("at_once", "background")


def timed_run(cfg: TrainConfig) -> dict[str, float]:
    trainer = GRPOTrainer(cfg)
    held = []
    save = trainer.save

    def timed_save(*args, **kwargs):
        t = time.perf_counter()
        try:
            return save(*args, **kwargs)
        finally:
            held.append(time.perf_counter() - t)

    trainer.save = timed_save
    t = time.perf_counter()
    trainer.run()
    return {"run_s": time.perf_counter() - t, "save_held_s": sum(held)}


def same_checkpoints(a: Path, b: Path) -> bool:
    iters = sorted(p.name for p in a.glob("iter_*"))
    if iters != sorted(p.name for p in b.glob("iter_*")):
        return False
    for it in iters:
        for shard in (a / it).glob("mp_rank_*/model_optim_rng.pt"):
            x, y = (torch.load(d / it / shard.parent.name / shard.name, weights_only=False) for d in (a, b))
            if x["model"].keys() != y["model"].keys() or any(not torch.equal(x["model"][k], y["model"][k])
                                                             for k in x["model"]):
                return False
            sx, sy = x["optimizer"]["state"], y["optimizer"]["state"]
            if sx.keys() != sy.keys() or any(not torch.equal(sx[i][f], sy[i][f]) for i in sx
                                             for f in ("exp_avg", "exp_avg_sq")):
                return False
    return True


def work_root(directory: str | None) -> Path:
    """A new directory for the runs' output directories, made in ``directory`` (default: in one
    process the system's temporary directory, under torchrun the working directory): in one process
    a fresh temporary one, under torchrun one named by the launch (its rendezvous id and port: the
    same on every rank of the launch, another for the next)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return Path(tempfile.mkdtemp(prefix="bench_checkpoint.", dir=directory))
    name = f"bench_checkpoint.{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}.{os.environ['MASTER_PORT']}"
    root = Path(directory or ".").absolute() / name
    root.mkdir(parents=True, exist_ok=True)  # (every rank; the trainer checks that they share it)
    return root


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "examples" / "configs"
                                            / "smollm2_gsm8k_cpu.yaml"))
    ap.add_argument("--checkpoint", help="the policy (default: the config's)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="further config overrides")
    ap.add_argument("--dir", help="write the runs into a new directory here (one every rank shares, under torchrun)")
    ap.add_argument("--out", default="bench_checkpoint.json")
    args = ap.parse_args()
    if args.steps < 2 or args.reps < 1:
        ap.error("--steps must be >= 2 (the last step's checkpoint is written at once) and --reps >= 1")
    root = work_root(args.dir)
    rank = int(os.environ.get("RANK", "0"))
    times: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    try:
        for rep in range(args.reps):
            for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                out = root / f"{mode}{rep}"
                cfg = load_config(TrainConfig, args.config, [
                    f"output_dir={out}", f"steps={args.steps}", "save_every=1", f"keep_last={args.steps}",
                    f"async_save={mode == 'background'}", "compare_vanilla_every=0", "eval.every=0",
                    "eval.before_training=false", "tensorboard=false",
                    *([f"checkpoint={args.checkpoint}"] if args.checkpoint else []), *args.set])
                times[mode].append(timed_run(cfg))
                if rank == 0:
                    print(f"rep {rep} {mode}: {times[mode][-1]}", flush=True)
        if rank != 0:  # (rank 0 reads every rank's shards: each run's last save returned once all were written)
            return 0
        size = sum(p.stat().st_size for p in (root / "at_once0" / f"iter_{args.steps:07d}").rglob("*") if p.is_file())
        identical = all(same_checkpoints(root / f"at_once{r}", root / f"background{r}") for r in range(args.reps))
    finally:
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    median = {m: {k: statistics.median(t[k] for t in times[m]) for k in ("run_s", "save_held_s")} for m in MODES}
    ratios = [a["run_s"] / b["run_s"] for a, b in zip(times["at_once"], times["background"])]
    summary = {"config": args.config, "steps": args.steps, "reps": args.reps, "overrides": args.set,
               "runs": times, "median": median, "run_time_ratio_at_once_over_background": statistics.median(ratios),
               "paired_ratios": ratios, "checkpoint_bytes": size, "identical_checkpoints": identical,
               "torch_threads": torch.get_num_threads(), "world_size": int(os.environ.get("WORLD_SIZE", "1"))}
    print(f"at once {median['at_once']['run_s']:.1f} s (saves held {median['at_once']['save_held_s']:.1f} s), "
          f"in the background {median['background']['run_s']:.1f} s (saves held "
          f"{median['background']['save_held_s']:.1f} s): x{summary['run_time_ratio_at_once_over_background']:.3f}; "
          f"checkpoint {size / 1e9:.2f} GB; identical checkpoints: {identical}")
    write_json_atomic(Path(args.out), summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
