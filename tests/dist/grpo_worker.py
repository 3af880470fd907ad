"""Run under torchrun: one GRPO step (vanilla rollouts) at the given TP/PP layout."""

import argparse
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the test reward

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.config import TrainConfig, load_config  # noqa: E402
from specroll_mcore.rl.trainer import GRPOTrainer  # noqa: E402


def overrides(ckpt: str, out: str, tp: int, pp: int) -> list[str]:
    return [f"checkpoint={ckpt}", f"output_dir={out}", "steps=1", "prompts_per_step=2", "sampling.num_samples=3",
            "sampling.max_new_tokens=12", "micro_batch_size=3", "lr=1e-3", "engine=vanilla", "tensorboard=false",
            "reward_fn=rewards_for_tests:token_parity_reward", "data.limit=16",
            f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt")
    ap.add_argument("--out")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    a = ap.parse_args()
    GRPOTrainer(load_config(TrainConfig, None, overrides(a.ckpt, a.out, a.tp, a.pp))).run()
    parallel.destroy()
