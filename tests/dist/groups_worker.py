"""Run under torchrun (2 processes): megatron's parallel state initialised in one layout after another,
as a launch of several jobs does. Writes, per initialisation, the layout, this rank's live process
groups and open file descriptors, and the sums of an all-reduce over each of the layout's groups."""

import argparse
import json
import os
import sys
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
    rows, previous = [], None
    for layout in args.layouts.split(";"):
        tp, pp, ep = map(int, layout.split(","))
        ctx = parallel.initialize(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 expert_model_parallel_size=ep))
        sums = {}
        for name in ("tp_group", "pp_group", "dp_group", "ep_group"):
            x = torch.ones(1)
            dist.all_reduce(x, group=getattr(ctx, name))
            sums[name] = int(x)
        rows.append({"layout": layout, "sizes": [ctx.tp_size, ctx.pp_size, ctx.dp_size, ctx.ep_size], "sums": sums,
                     "groups": len(dist.distributed_c10d._world.pg_map), "fds": len(os.listdir("/proc/self/fd")),
                     "same_groups_as_previous": ctx.tp_group is previous})
        previous = ctx.tp_group
    (Path(args.out) / f"rank{dist.get_rank()}.json").write_text(json.dumps(rows))
    parallel.destroy()


if __name__ == "__main__":
    main()
