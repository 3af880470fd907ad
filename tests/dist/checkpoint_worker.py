"""Run under torchrun: load a converted checkpoint at a TP/PP layout (resharding when the checkpoint
was written for another) and save the logits of a fixed batch from the last stage's first TP rank;
for several checkpoints and layouts one after the other in the same processes."""

import argparse
import warnings

import torch

warnings.filterwarnings("ignore")

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.checkpoint.megatron import load_policy  # noqa: E402
from specroll_mcore.config import ParallelConfig  # noqa: E402
from specroll_mcore.model import causal_mask  # noqa: E402

IDS = torch.tensor([[5, 17, 33, 2, 8, 100, 250, 7, 9, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--load", action="append", required=True, nargs=4, metavar=("CKPT", "TP", "PP", "OUT"),
                    help="load CKPT at that layout and save the logits to OUT; several load one after the other in "
                         "these processes")
    args = ap.parse_args()
    for ckpt, tp, pp, out in args.load:
        ctx = parallel.initialize(ParallelConfig(tensor_model_parallel_size=int(tp),
                                                 pipeline_model_parallel_size=int(pp)))
        policy = load_policy(ckpt, ctx)
        s = IDS.shape[1]
        with torch.no_grad():
            logits = policy(IDS, policy.metadata(torch.arange(s)[None].expand(2, s), causal_mask(2, s, IDS.device)))
            full = policy.full_logits(logits) if logits is not None else None
        if ctx.is_last_stage and ctx.tp_rank == 0:
            torch.save(full, out)
    parallel.destroy()


if __name__ == "__main__":
    main()
