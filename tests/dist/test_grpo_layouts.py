"""A GRPO step at TP=2 and at PP=2 (2 processes, gloo) equals the TP=1 step: same rollouts and
rewards, the same loss and gradient norm (rel 1e-4), and the same updated weights.

Weight tolerance 1e-4 = 0.1 x lr: TP reductions reorder float sums, so gradients differ by a few
ulps; Adam's first step is lr * g / (|g| + eps), which turns an ulp-level gradient difference into a
visible update difference only where |g| is near eps. A wrong shard or a missing gradient reduction
changes updates by O(lr) = 1e-3 on many weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_fixtures import tiny_policy_checkpoint
from specroll_mcore.checkpoint.megatron import load_full_state_dict

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.dist


def run(ckpt, out, tp, pp, nproc, *extra):
    env = dict(os.environ, PYTHONPATH=f"{HERE.parent.parent}{os.pathsep}{HERE.parent}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(HERE / "grpo_worker.py"), f"--ckpt={ckpt}", f"--out={out}", f"--tp={tp}", f"--pp={pp}", *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_grpo_step_tp2_and_pp2_equal_tp1(tmp_path):
    ckpt = tiny_policy_checkpoint(tmp_path, with_heads=False)
    ref = run(ckpt, tmp_path / "tp1", 1, 1, 1)
    ref_w = load_full_state_dict(tmp_path / "tp1")
    for tp, pp in [(2, 1), (1, 2)]:
        got = run(ckpt, tmp_path / f"tp{tp}pp{pp}", tp, pp, 2)
        for k in ("reward_mean", "response_len"):
            assert got[0][k] == ref[0][k], (tp, pp, k)
        for k in ("loss", "grad_norm"):
            assert got[0][k] == pytest.approx(ref[0][k], rel=1e-4, abs=1e-6), (tp, pp, k)
        w = load_full_state_dict(tmp_path / f"tp{tp}pp{pp}")
        diff = max((w[k] - ref_w[k]).abs().max().item() for k in ref_w)
        print(f"TP={tp} PP={pp}: max |weight diff| after one step = {diff:.2e}")
        assert diff < 1e-4
        assert any((ref_w[k] != load_full_state_dict(ckpt)[k]).any() for k in ref_w)  # the step moved the weights


@pytest.mark.parametrize("tp", [1, 2])  # DP=2, or TP=2
def test_slow_path_under_data_and_tensor_parallelism(tmp_path, tp):
    """Consolidations run every step; the collective decisions and updates do not deadlock, and every
    data-parallel replica ends with the same heads."""
    ckpt = tiny_policy_checkpoint(tmp_path, with_heads=True)
    rows = run(ckpt, tmp_path / "run", tp, 1, 2, "--specroll")
    assert rows[-1]["slow_path_events"] >= 2, rows
    assert json.loads((tmp_path / "run" / "heads_check.json").read_text())["dp_spread"] == 0.0
