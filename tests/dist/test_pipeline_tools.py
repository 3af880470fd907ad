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


@pytest.mark.slow  # (~80 s on a fresh clone: `make test-slow`)
def test_multinode_launcher_runs_a_grpo_step(tmp_path):
    """examples/launch_multinode.sh as one node of 2 processes (gloo, DP=2): the launch line users copy."""
    import socket

    ckpt = tiny_policy_checkpoint(tmp_path / "ckpt", with_heads=False)
    config = tmp_path / "c.yaml"
    config.write_text(f"checkpoint: {ckpt}\noutput_dir: {tmp_path / 'run'}\nengine: vanilla\n"
                      "steps: 1\nprompts_per_step: 2\n"
                      "micro_batch_size: 4\ntensorboard: false\nsampling:\n  num_samples: 2\n  max_new_tokens: 8\n"
                      "data:\n  limit: 8\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", NNODES="1", NODE_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), GPUS_PER_NODE="2",
               PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run(["bash", str(ROOT / "examples" / "launch_multinode.sh"), str(config), "--set", "lr=1e-4"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    proc = subprocess.run(["bash", str(ROOT / "examples" / "launch_multinode.sh"), str(config)],
                          env={k: v for k, v in env.items() if k != "MASTER_ADDR"}, capture_output=True, text=True)
    assert proc.returncode != 0 and "MASTER_ADDR: set MASTER_ADDR" in proc.stderr
