"""Converted checkpoints at TP=2 and PP=2 (2 processes) give transformers' logits, including a TP=1
checkpoint resharded to TP=2 on load. Tolerance 1e-4 in float32: the TP all-reduce sums partial
products in another order than one process does (differences of a few ulps of the logits)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_fixtures import save_tiny_hf
from specroll_mcore.checkpoint import convert

HERE = Path(__file__).parent
pytestmark = pytest.mark.dist


def run_worker(loads: list[tuple[Path, int, int, Path]]) -> list[torch.Tensor]:
    """The logits of each (checkpoint, TP, PP, output file) loaded at its layout, all in one launch."""
    env = dict(os.environ, PYTHONPATH=str(HERE.parent.parent), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(HERE / "checkpoint_worker.py"), *[str(a) for load in loads for a in ("--load", *load)]]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(out) for *_, out in loads]


@pytest.mark.parametrize("arch, tied", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_converted_checkpoint_at_tp2_and_pp2(tmp_path, arch, tied):
    """Qwen3 at TP=2 only: its replicated q/k norms are what differs from the others' layouts."""
    hf = save_tiny_hf(tmp_path / "hf", arch, tied, seed=3)
    import checkpoint_worker

    with torch.no_grad():
        ref = hf(checkpoint_worker.IDS).logits
    tp2 = convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "tp2", tensor_parallel_size=2)
    layouts = [(tp2, 2, 1)]
    if arch != "qwen3":
        tp1 = convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "tp1")
        pp2 = convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "pp2", pipeline_parallel_size=2)
        layouts += [(pp2, 1, 2), (tp1, 2, 1)]  # the last one reshards on load
    loads = [(ckpt, tp, pp, tmp_path / f"{ckpt.name}-{tp}{pp}.pt") for ckpt, tp, pp in layouts]
    for (ckpt, tp, pp, _), got in zip(loads, run_worker(loads)):
        diff = (got - ref).abs().max().item()
        print(f"{arch} {ckpt.name} loaded at TP={tp} PP={pp}: max |logits diff| = {diff:.2e}")
        assert diff < 1e-4
