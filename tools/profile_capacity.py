#!/usr/bin/env python
"""Profile C_hw, the token capacity of one verification forward, for this model, hardware and layout.

    python tools/profile_capacity.py --checkpoint smollm2 [--tolerance 2.0]
    torchrun --nproc_per_node 2 tools/profile_capacity.py --checkpoint CKPT --tp 2
    torchrun --nproc_per_node 4 tools/profile_capacity.py --checkpoint CKPT --pp 4 --last-stage-layers 5

Measures the latency of a verification forward against the number of tokens in it (1 .. 512; one
row holding an N-node tree on a 128-token context) and derives C_hw by the documented rule
(specroll_mcore.tree.budget.capacity_from_latency): the largest N whose latency is at most
``tolerance`` x the one-token latency; then the latency of R rows x N-node trees on 128- and
512-token contexts (R, N powers of two up to C_hw, see rollout/profile.forward_grid), which the
engine sizes each step's trees against. The result is cached (``$SPECROLL_CACHE/capacity_profiles.json``)
under a key of the model's architecture (its shapes, not its weights: a policy trained from this one
shares the profile), the dtype it computes in (``--dtype``: the checkpoint's, or the override a run
loads it with, as ``params_dtype`` in a config), the hardware and the TP/PP/EP layout (with the
pipeline's split of the layers: a run whose ParallelConfig sets ``num_layers_in_first_pipeline_stage``
or ``num_layers_in_last_pipeline_stage`` finds the profile taken with the same split), with the
whole curve and grid; the speculative engine reads C_hw from it when SpecConfig.c_hw is unset, and
the grid to keep each step's trees to the nodes that pay for their latency
(SpecConfig.adaptive_nodes).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.checkpoint.megatron import load_policy, write_json_atomic  # noqa: E402
from specroll_mcore.config import ParallelConfig  # noqa: E402
from specroll_mcore.rollout.profile import measure_capacity  # noqa: E402
from specroll_mcore.tree.budget import DEFAULT_TOLERANCE, profile_path  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="smollm2")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"],
                    help="load the checkpoint in this dtype (default: its own)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel size (a mixture of experts)")
    ap.add_argument("--first-stage-layers", type=int, help="layers on the first pipeline stage (an uneven split)")
    ap.add_argument("--last-stage-layers", type=int, help="layers on the last pipeline stage (an uneven split)")
    ap.add_argument("--tokens", default="1,2,4,8,12,16,24,32,48,64,96,128,192,256,384,512")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    ap.add_argument("--out", help="also write the profile as JSON here")
    args = ap.parse_args()
    from specroll_mcore.checkpoint.smollm2 import resolve_checkpoint

    try:
        layout = ParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                                num_layers_in_first_pipeline_stage=args.first_stage_layers,
                                num_layers_in_last_pipeline_stage=args.last_stage_layers,
                                expert_model_parallel_size=args.ep)
    except ValueError as e:
        ap.error(str(e))
    ckpt = resolve_checkpoint(args.checkpoint)
    ctx = parallel.initialize(layout)
    policy = load_policy(ckpt, ctx, params_dtype=args.dtype)
    sizes = [int(x) for x in args.tokens.split(",")]
    record = measure_capacity(policy, sizes, args.reps, args.tolerance, verbose=True)
    if ctx.rank == 0:
        print(f"C_hw = {record['c_hw']} tokens (cached in {profile_path()})")
        if args.out:
            write_json_atomic(Path(args.out), record)
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
