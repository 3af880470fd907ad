"""tools/train_heads.py at TP=2, PP=2 and DP=2 (2 processes, torchrun, gloo) against one process.

In float64 every layout samples the same responses (the sampling noise is keyed by prompt id, and
float64 has no near-ties to flip), so TP=2 and PP=2 train the same heads as one process, up to the
order of the TP reductions. DP=2 splits every batch between two replicas, so its heads take other
steps; its record counts and its held-out accuracy before training (zero heads: the policy itself,
counted over both replicas) equal one process's.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_fixtures import tiny_policy_checkpoint
from specroll_mcore.checkpoint.megatron import load_heads

ROOT = Path(__file__).parent.parent.parent
ARGS = ["--prompts", 8, "--samples", 2, "--max-new-tokens", 8, "--steps", 3, "--batch", 8, "--save-every", 2,
        "--dtype", "float64"]
pytestmark = pytest.mark.dist


def train(src: Path, tmp_path: Path, nproc: int, *layout) -> tuple[dict, dict]:
    ckpt = tmp_path / f"ckpt-{nproc}-{'-'.join(map(str, layout))}"
    shutil.copytree(src, ckpt)
    out = ckpt / "summary.json"
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    cmd = [sys.executable, *launch, str(ROOT / "tools" / "train_heads.py"), "--checkpoint", str(ckpt),
           *map(str, ARGS), *map(str, layout), "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), load_heads(ckpt)[0]


def test_train_heads_in_every_layout_matches_one_process(tmp_path):
    src = tiny_policy_checkpoint(tmp_path / "fresh", with_heads=False)
    ref, ref_heads = train(src, tmp_path, 1)
    assert ref["layout"] == {"tp": 1, "pp": 1, "dp": 1, "ep": 1}
    for layout, want in [(("--tp", 2), {"tp": 2, "pp": 1, "dp": 1, "ep": 1}),
                         (("--pp", 2), {"tp": 1, "pp": 2, "dp": 1, "ep": 1})]:
        got, heads = train(src, tmp_path, 2, *layout)
        assert got["layout"] == want
        assert (got["train_positions"], got["heldout_positions"]) == (ref["train_positions"], ref["heldout_positions"])
        assert set(heads) == set(ref_heads)
        for k, v in ref_heads.items():
            assert v.abs().max() > 0, k  # every weight moved from zero
            assert (heads[k] - v).abs().max() < 1e-9, (layout, k)
        for name in ("heldout_before", "heldout_after"):
            for metric, values in ref[name].items():
                assert got[name][metric] == pytest.approx(values, abs=1e-9), (layout, name, metric)
    got, heads = train(src, tmp_path, 2)  # world 2, TP=PP=1: two data-parallel replicas
    assert got["layout"] == {"tp": 1, "pp": 1, "dp": 2, "ep": 1}
    assert (got["train_positions"], got["heldout_positions"]) == (ref["train_positions"], ref["heldout_positions"])
    assert got["heldout_before"] == ref["heldout_before"]
    assert all(v.abs().max() > 0 for v in heads.values())


def test_train_heads_checks_the_data_parallel_split(tmp_path):
    """Under torchrun at DP=2 the tool refuses a split its replicas cannot share, before loading the
    policy (the messages for every case: tests/unit/test_tools.py)."""
    src = tiny_policy_checkpoint(tmp_path / "fresh", with_heads=False)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tools" / "train_heads.py"), "--checkpoint", str(ckpt), "--prompts", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    message = "cannot give each of the 2 data-parallel replicas a training and a held-out prompt"
    assert proc.returncode != 0 and message in proc.stderr + proc.stdout
