"""Run under torchrun: one GRPO step (vanilla rollouts) at the given TP/PP layout; with --specroll,
three steps with SpecRoll rollouts and a slow path that consolidates a head every step, then a check
that every data-parallel replica holds the same heads. With --jobs, several such runs one after the
other in the same processes (each its own trainer and layout over the one process group): a launch
pays torchrun's start and the imports, ~8 s on 2 cores against ~2 s for a run of these tests."""

import argparse
import contextlib
import json
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Iterator

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the test reward

from grpo_fixtures import BUSY_SLOW_PATH  # noqa: E402
from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.checkpoint import train_state  # noqa: E402
from specroll_mcore.config import TrainConfig, load_config  # noqa: E402
from specroll_mcore.distill import full_head_state  # noqa: E402
from specroll_mcore.rl.trainer import GRPOTrainer  # noqa: E402
from specroll_mcore.rollout import profile  # noqa: E402
from specroll_mcore.rollout.base import FINISH_EOS, FINISH_LENGTH  # noqa: E402
from specroll_mcore.tree import budget  # noqa: E402

SPECROLL = ["engine=specroll", "steps=3", *BUSY_SLOW_PATH, "spec.c_hw=64"]  # (--specroll)


WEIGHED_TREES = {"c_hw": 64, "rule": "a test's", "curve": {"tokens": [1, 8, 64], "tree_row_s": [1.0, 1.1, 3.0]}}
"""A capacity profile in which a forward's latency grows with its tokens: each step weighs its trees'
nodes by the drafts' beliefs times the tree-size calibration (SpecConfig.adaptive_nodes)."""


def overrides(ckpt: str, out: str, tp: int, pp: int) -> list[str]:
    return [f"checkpoint={ckpt}", f"output_dir={out}", "steps=1", "prompts_per_step=2", "sampling.num_samples=3",
            "sampling.max_new_tokens=12", "micro_batch_size=3", "lr=1e-3", "engine=vanilla", "tensorboard=false",
            "reward_fn=rewards_for_tests:token_parity_reward", "data.limit=16",
            f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}"]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt")
    ap.add_argument("--out")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--specroll", action="store_true")
    ap.add_argument("--set", action="append", default=[], help="more TrainConfig overrides")
    ap.add_argument("--cut-odd-prompts", action="store_true",
                    help="report the responses to the step's odd-numbered prompts as cut at the length limit, "
                         "the others as ended by EOS")
    ap.add_argument("--dump-rollout-stats", action="store_true",
                    help="each rank writes its own rollouts' statistics per step (rollout_stats_rank{R}.json)")
    ap.add_argument("--sigterm-after-step", type=int,
                    help="the last rank sends itself SIGTERM when this step ends (the others get none)")
    ap.add_argument("--weighed-trees", action="store_true",
                    help="cache WEIGHED_TREES as the policy's capacity profile (where the engine looks it up, on every "
                         "rank) and price no step overhead: trees sized by a latency that depends on no clock")
    ap.add_argument("--own-directory-per-rank", action="store_true",
                    help="each rank works in a folder of its own under --out, with the output directory 'run' "
                         "relative to it (as nodes with output directories on their own disks); the shared-directory "
                         "check waits 1 s")
    ap.add_argument("--last-rank-reads-no-checkpoint", action="store_true",
                    help="the last rank finds no training checkpoint in the output directory (as a file system "
                         "that shows it stale files would)")
    ap.add_argument("--jobs", help="a JSON file holding a list of runs, each the arguments above as a list")
    return ap


@contextlib.contextmanager
def weighed_trees() -> Iterator[None]:
    """The engines built inside find WEIGHED_TREES cached as their policy's capacity profile."""
    cached = profile.cached_profile

    def cached_profile(policy):
        budget.save_capacity(profile.capacity_key(policy), WEIGHED_TREES)
        return cached(policy)

    profile.cached_profile = cached_profile
    try:
        yield
    finally:
        profile.cached_profile = cached


def run(a: argparse.Namespace) -> None:
    out = a.out
    if a.own_directory_per_rank:
        here = Path(a.out) / f"rank{os.environ['RANK']}"
        here.mkdir(parents=True, exist_ok=True)
        os.chdir(here)
        out, train_state.SHARED_CHECK_WAIT_S = "run", 1.0
    if a.last_rank_reads_no_checkpoint and int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
        train_state.latest_training_checkpoint = lambda out_dir: None
    with weighed_trees() if a.weighed_trees else contextlib.nullcontext():
        trainer = GRPOTrainer(load_config(TrainConfig, None, overrides(a.ckpt, out, a.tp, a.pp) +
                                          (SPECROLL if a.specroll else []) + a.set +
                                          ["spec.step_overhead=false"] * a.weighed_trees))
    if a.cut_odd_prompts:  # at DP=2 every response of replica 1 is cut (prompts are dealt out in turn)
        rollout_round = trainer._rollout_round

        def cut_round(*args, **kwargs):
            r = rollout_round(*args, **kwargs)
            ctx, G = trainer.ctx, trainer.cfg.sampling.num_samples
            r.rollout.finish_reason = [FINISH_LENGTH if (ctx.dp_rank + k // G * ctx.dp_size) % 2 else FINISH_EOS
                                       for k in range(len(r.rollout.finish_reason))]
            return r

        trainer._rollout_round = cut_round
    dumped = []
    if a.dump_rollout_stats:
        rollout_round = trainer._rollout_round

        def recorded_round(examples, step, *args, **kwargs):
            r = rollout_round(examples, step, *args, **kwargs)
            st = r.rollout.stats
            dumped.append({"step": step + 1, "gen_s": r.gen_s, "tried": st["tried_per_depth"],
                           "accepted": st["accepted_per_depth"], "slow_path": st.get("slow_path"),
                           "per_step": [{k: p[k] for k in ("emitted", "active", "nodes_per_row")}
                                        for p in st["per_step"]]})
            return r

        trainer._rollout_round = recorded_round
        mini_batches = trainer._mini_batches

        def recorded_mini_batches(seqs):  # each replica's positions in the update, and the real ones
            parts = mini_batches(seqs)
            mbs = [mb for part in parts for mb in part]
            dumped.append({"step": trainer.state["step"] + 1, "update_real": sum(int(mb.lengths.sum()) for mb in mbs),
                           "update_positions": sum(mb.input_ids.numel() for mb in mbs)})
            return parts

        trainer._mini_batches = recorded_mini_batches
    if a.sigterm_after_step is not None and trainer.ctx.rank == trainer.ctx.world_size - 1:
        step = trainer.step

        def signalled_step():
            row = step()
            if trainer.state["step"] == a.sigterm_after_step:
                os.kill(os.getpid(), signal.SIGTERM)
            return row

        trainer.step = signalled_step
    trainer.run()
    ctx = trainer.ctx
    if a.dump_rollout_stats:
        (Path(a.out) / f"rollout_stats_rank{ctx.rank}.json").write_text(json.dumps(dumped))
    if a.specroll and ctx.is_last_stage:
        heads = full_head_state(trainer.policy)
        spread = max(float((ctx.all_reduce_dp(v.clone()) / ctx.dp_size - v).abs().max()) for v in heads.values())
        if ctx.tp_rank == 0 and ctx.dp_rank == 0:
            (Path(a.out) / "heads_check.json").write_text(json.dumps({"dp_spread": spread}))


if __name__ == "__main__":
    ap = parser()
    first = ap.parse_args()
    for job in json.loads(Path(first.jobs).read_text()) if first.jobs else [sys.argv[1:]]:
        run(ap.parse_args(job))
    parallel.destroy()
