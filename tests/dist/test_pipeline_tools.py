"""tools/bench_pipeline_rollout.py end to end under torchrun at PP=2 (2 processes, gloo) on a tiny
checkpoint: every variant's tokens equal (the tool exits non-zero otherwise) and the JSON it promises."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_fixtures import tiny_policy_checkpoint

ROOT = Path(__file__).resolve().parent.parent.parent

pytestmark = pytest.mark.dist


def test_bench_pipeline_rollout_smoke(tmp_path):
    ckpt = tiny_policy_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "pp.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tools" / "bench_pipeline_rollout.py"), "--checkpoint", str(ckpt), "--pp", "2",
           "--last-stage-layers", "1", "--prompts", "2", "--samples", "3", "--max-new-tokens", "8", "--reps", "1",
           "--c-hw", "8", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["stage_layers"] == {"even": [1, 1], "last1": [1, 1]}
    for engine in ("vanilla", "specroll"):
        assert report["engines"][engine]["tokens_identical"]
        assert set(report["engines"][engine]["speedup_over_even_one_group_median"]) == {"even/interleaved",
                                                                                        "last1/interleaved"}
