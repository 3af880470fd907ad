"""megatron's parallel state initialised again in one process (the jobs of one launch, trainers and
tools one after the other): the same layout keeps its process groups; another destroys the old ones
(megatron-core's destroy_model_parallel only forgets them, which leaked ~75 file descriptors a
re-initialisation at 2 processes). A pipeline send still in flight when its job ends arrives (its
gloo work, dropped with the job's context, never did: the next stage waited in its receive)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.dist


def test_layouts_one_after_another_keep_no_old_process_groups(tmp_path):
    cycle = ["2,1,1", "1,2,1", "1,1,2", "1,1,1", "1,1,1"]
    env = dict(os.environ, PYTHONPATH=str(HERE.parent.parent), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(HERE / "groups_worker.py"), f"--out={tmp_path}", f"--layouts={';'.join(cycle * 4)}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        rows = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for row in rows:  # each group the layout's: an all-reduce over it sums its size
            tp, pp, dp, ep = row["sizes"]
            assert [tp, pp, ep] == list(map(int, row["layout"].split(","))) and tp * pp * dp == 2
            assert row["sums"] == {"tp_group": tp, "pp_group": pp, "dp_group": dp, "ep_group": ep}, row
        # a job's send left in flight reached the next stage after the job's context was dropped
        assert [r.get("received") for r in rows] == [[float(i)] * 4 if rank == 1 and r["layout"] == "1,2,1" else None
                                                     for i, r in enumerate(rows)]
        # the same layout again at once (the fifth of each cycle): the same groups; another layout: new ones
        assert [r["same_groups_as_previous"] for r in rows] == [
            i > 0 and rows[i - 1]["layout"] == r["layout"] for i, r in enumerate(rows)]
        # from the second cycle on (the first opens connections on first use), each holds what the last held
        for i, row in enumerate(rows[2 * len(cycle):], 2 * len(cycle)):
            last = rows[i - len(cycle)]
            assert (row["groups"], row["fds"]) == (last["groups"], last["fds"]), (rank, i, row, last)
