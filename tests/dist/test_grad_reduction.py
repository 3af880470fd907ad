"""The update's gradients summed onto each parameter's owner alone under a sharded optimizer (ZeRO-1:
a reduce, half an all-reduce's traffic) against summed onto every replica: each owner holds the same
sums bit for bit (two replicas: a sum of two is the same in any order), the other replicas hold
none, the gradient norm is the same, and the gradients went by reduce, the all-reduces left carrying
only the tied embedding under PP (its stages' copies may have different owners), the TP-summed
query/key norms and scalars. Two processes: DP=2; four: TP=2 x DP=2, whose query/key norms are
summed over TP among owners, and PP=2 x DP=2 with a tied embedding."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.dist


def launch(out: Path, nproc: int, *layouts: str) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{HERE.parent.parent}{os.pathsep}{HERE.parent}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(HERE / "grad_worker.py"), f"--out={out}", *(f"--layout={x}" for x in layouts)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return {f.stem: torch.load(f, weights_only=False) for f in out.glob("*.pt")}


def check(results: dict, tp: int, pp: int, nproc: int) -> None:
    ranks = [results[f"tp{tp}-pp{pp}-rank{r}"] for r in range(nproc)]
    for dtype in ("float32", "bfloat16"):
        owned_somewhere = set()
        for rank in ranks:
            r = rank[dtype]
            full, got = r["all_reduce"], r["owners"]
            assert r["owned"] and len(r["owned"]) < len(full["grads"])
            owned_somewhere.update((rank["layout"]["tp"], rank["layout"]["pp"], n) for n in r["owned"])
            for name, g in got["grads"].items():
                if name in r["owned"]:
                    assert torch.equal(g, full["grads"][name]), (dtype, name)
                else:
                    assert g is None, (dtype, name)
            assert got["norm"] == pytest.approx(full["norm"], rel=1e-12)
            tied = r["tied"]
            tied_bytes = 4 * full["grads"][tied].numel() if tied is not None else 0
            assert got["bytes"]["reduce"] == r["grad_bytes"] - tied_bytes
            assert full["bytes"]["reduce"] == 0 and full["bytes"]["all_reduce"] >= r["grad_bytes"]
            qk = sum(4 * g.numel() for n, g in full["grads"].items() if n.endswith(("q_layernorm.weight",
                                                                                      "k_layernorm.weight")))
            # (the tied embedding: over the replicas, then over its two stages)
            assert 2 * tied_bytes <= got["bytes"]["all_reduce"] <= 2 * tied_bytes + (qk if tp > 1 else 0) + 64
        # every parameter of every TP rank and stage has an owner among the replicas
        every = {(rank["layout"]["tp"], rank["layout"]["pp"], n) for rank in ranks
                 for n in rank[dtype]["all_reduce"]["grads"]}
        assert owned_somewhere == every


def test_gradients_summed_onto_their_owners_at_dp2(tmp_path):
    check(launch(tmp_path, 2, "1,1"), 1, 1, 2)


def test_gradients_summed_onto_their_owners_at_tp2_and_pp2_with_dp2(tmp_path):
    results = launch(tmp_path, 4, "2,1", "1,2")
    check(results, 2, 1, 4)
    check(results, 1, 2, 4)
