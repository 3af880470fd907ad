"""Run under torchrun: one GRPO step (vanilla rollouts) at the given TP/PP layout; with --specroll,
three steps with SpecRoll rollouts and a slow path that consolidates a head every step, then a check
that every data-parallel replica holds the same heads. With --jobs, several such runs one after the
other in the same processes (each its own trainer and layout over the one process group): a launch
pays torchrun's start and the imports, ~8 s on 2 cores against ~2 s for a run of these tests."""

import argparse
import json
import os
import signal
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the test reward

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.config import TrainConfig, load_config  # noqa: E402
from specroll_mcore.distill import full_head_state  # noqa: E402
from specroll_mcore.rl.trainer import GRPOTrainer  # noqa: E402
from specroll_mcore.rollout.base import FINISH_EOS, FINISH_LENGTH  # noqa: E402

BUSY_SLOW_PATH = ["engine=specroll", "steps=3", "spec.slow_path.window=4", "spec.slow_path.min_records=4",
                  "spec.slow_path.cooldown_batches=1", "spec.slow_path.time_cap=1.0",
                  "spec.slow_path.reference_windows=1", "spec.slow_path.degraded_windows=1",
                  "spec.slow_path.tolerance=0.01", "spec.slow_path.lr=1e-2", "spec.c_hw=64"]


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
    ap.add_argument("--jobs", help="a JSON file holding a list of runs, each the arguments above as a list")
    return ap


def run(a: argparse.Namespace) -> None:
    trainer = GRPOTrainer(load_config(TrainConfig, None, overrides(a.ckpt, a.out, a.tp, a.pp) +
                                      (BUSY_SLOW_PATH if a.specroll else []) + a.set))
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
