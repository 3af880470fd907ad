"""Run under torchrun (2 processes): megatron's parallel state initialised in one layout after another,
as a launch of several jobs does. Writes, per initialisation, the layout, this rank's live process
groups and open file descriptors, and the sums of an all-reduce over each of the layout's groups. A
job at PP=2 ends with the first stage's send of a forward in flight, received by the next stage only
after a while, when the next job begins: its context is dropped by then (``received``: what came)."""

import argparse
import gc
import json
import os
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.config import ParallelConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", required=True, help="TP,PP,EP;TP,PP,EP;...")
    args = ap.parse_args()
    rows, previous, late = [], None, None
    for i, layout in enumerate(args.layouts.split(";")):
        tp, pp, ep = map(int, layout.split(","))
        if late is not None:  # the last job's forward, received late: the first stage's context is gone
            time.sleep(0.3)
            buf = torch.zeros(4)
            dist.recv(buf, src=late)
            rows[-1]["received"] = buf.tolist()
        gc.collect()
        ctx = parallel.initialize(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 expert_model_parallel_size=ep), timeout_minutes=1)
        sums = {}
        for name in ("tp_group", "pp_group", "dp_group", "ep_group"):
            x = torch.ones(1)
            dist.all_reduce(x, group=getattr(ctx, name))
            sums[name] = int(x)
        rows.append({"layout": layout, "sizes": [ctx.tp_size, ctx.pp_size, ctx.dp_size, ctx.ep_size], "sums": sums,
                     "groups": len(dist.distributed_c10d._world.pg_map), "fds": len(os.listdir("/proc/self/fd")),
                     "same_groups_as_previous": ctx.tp_group is previous})
        previous = ctx.tp_group
        late = None
        if pp == 2 and ctx.is_first_stage:
            ctx.post_forward(torch.full((4,), float(i)))
        elif pp == 2:
            late = ctx.pp_ranks[0]
        del ctx
    if late is not None:
        buf = torch.zeros(4)
        dist.recv(buf, src=late)
        rows[-1]["received"] = buf.tolist()
    (Path(args.out) / f"rank{dist.get_rank()}.json").write_text(json.dumps(rows))
    parallel.destroy()


if __name__ == "__main__":
    main()
