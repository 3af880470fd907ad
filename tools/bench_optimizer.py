#!/usr/bin/env python
"""The policy optimizer's step over data-parallel replicas, its gradients' reduction included:
replicated, or sharded (ZeRO-1, ``TrainConfig.shard_optimizer``), on a real checkpoint's parameters.

    torchrun --nproc_per_node 2 tools/bench_optimizer.py --out bench_optimizer.json   # SmolLM2 in bfloat16
    torchrun --nproc_per_node 4 tools/bench_optimizer.py --checkpoint CKPT --reps 7

Every rank builds the policy (``--dtype``, bfloat16 by default) and optimizers over its parameters:
``replicated`` (the gradients summed onto every replica, which steps every parameter), ``sharded``
(each gradient summed onto its owner alone, which steps the parameter, it alone keeping its AdamW
moments and float32 main copy, and broadcasts it to the others: ``optimizer.MainParamAdamW`` with the
data-parallel group, ``MainParamAdamW.grad_owners``) and ``sharded_all_reduce`` (the same optimizer,
the gradients summed onto every replica: the form before). ``--zero-reference`` adds
``zero_fp32_mains``: the same sharding through torch's ``ZeroRedundancyOptimizer`` over float32 main
copies held whole on every replica, broadcast parameter by parameter, after an all-reduce. Each
repetition sets the same seeded float32 gradients in every mode, each rank its own (what the
backward leaves in ``main_grad``), and times in turn, the order rotating, the ranks starting
together, each mode's reduction (``rl.schedule.finalize_grads``), gradient norm
(``global_grad_norm``) and step; reported per mode: the median seconds (the slowest rank's), the
ratio to ``replicated``, the bytes each rank keeps between steps (AdamW's moments and the main
copies) and the gradient bytes it holds for the step after the reduction. After the timed steps every
mode's parameters are compared with ``replicated``'s (the same steps from the same weights: equal bit
for bit at DP=2, where a sum of two is the same in any order).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.checkpoint.megatron import load_policy, write_json_atomic  # noqa: E402
from specroll_mcore.checkpoint.smollm2 import resolve_checkpoint  # noqa: E402
from specroll_mcore.config import ParallelConfig  # noqa: E402
from specroll_mcore.optimizer import MainParamAdamW  # noqa: E402
from specroll_mcore.parallel import grad_of  # noqa: E402
from specroll_mcore.rl.schedule import finalize_grads, global_grad_norm  # noqa: E402

ADAMW = {"lr": 1e-6, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


class ZeroFp32Mains:
    """The reference: float32 main copies of every parameter on every replica, AdamW's moments sharded
    by torch's ZeroRedundancyOptimizer (which broadcasts each stepped main copy), then every main copy
    rounded into the model."""

    def __init__(self, params: list[torch.nn.Parameter], group: dist.ProcessGroup) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        self.params = params
        self.main = [p.detach().float().clone() for p in params]
        self.optimizer = ZeroRedundancyOptimizer(self.main, torch.optim.AdamW, process_group=group, **ADAMW)

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor]) -> None:
        for m, g in zip(self.main, grads):
            m.grad = g
        self.optimizer.step()
        for p, m in zip(self.params, self.main):
            p.copy_(m)
            m.grad = None


def state_bytes(opt: MainParamAdamW | ZeroFp32Mains) -> int:
    """Bytes an optimizer keeps between steps on this rank: AdamW's moments (its local shard's) and the
    main copies it holds besides the parameters themselves."""
    local = opt.optimizer.optim if isinstance(opt, ZeroFp32Mains) else opt.optimizer
    held = [t for s in local.state.values() for t in s.values() if t.dim() > 0]
    held += [m for p, m in zip(opt.params, opt.main) if m is not None and m is not p]
    return sum(t.numel() * t.element_size() for t in held)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--zero-reference", action="store_true",
                    help="also time torch's ZeroRedundancyOptimizer over whole float32 main copies")
    ap.add_argument("--out", default="bench_optimizer.json")
    args = ap.parse_args()
    if args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    ctx = parallel.initialize(ParallelConfig())
    if ctx.dp_size < 2:
        ap.error("a sharded optimizer needs data-parallel replicas: launch with torchrun --nproc_per_node N (N >= 2)")
    ckpt = resolve_checkpoint(args.checkpoint)
    policy = load_policy(ckpt, ctx, params_dtype=args.dtype)
    params = [p for p in policy.gpt.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params]
    opts = {"replicated": MainParamAdamW(params, **ADAMW),
            "sharded": MainParamAdamW(params, shard_group=ctx.dp_group, **ADAMW),
            "sharded_all_reduce": MainParamAdamW(params, shard_group=ctx.dp_group, **ADAMW)}
    if args.zero_reference:
        opts["zero_fp32_mains"] = ZeroFp32Mains(params, ctx.dp_group)
    names = list(opts)
    weights = {name: [t.clone() for t in start] for name in names}  # each mode's own weights, swapped in to step
    seconds: dict[str, list[float]] = {name: [] for name in names}
    grad_bytes: dict[str, int] = {}
    for rep in range(args.reps):
        g = torch.Generator().manual_seed(1000 * rep + ctx.rank)
        grads = [1e-3 * torch.randn(p.shape, generator=g) for p in params]
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            with torch.no_grad():
                for p, w in zip(params, weights[name]):
                    p.copy_(w)
            opt = opts[name]
            for p, gr in zip(params, grads):
                if p.dtype == torch.bfloat16:
                    p.main_grad, p.grad = gr.clone(), None
                else:
                    p.grad = gr.to(p.dtype, copy=True)
            owners = opt.grad_owners() if name == "sharded" else {}
            dist.barrier()
            t = time.perf_counter()
            finalize_grads(policy, owners)
            global_grad_norm(policy, owners)
            grad_bytes[name] = sum(grad_of(p).numel() * grad_of(p).element_size() for p in params
                                   if grad_of(p) is not None)
            if isinstance(opt, MainParamAdamW):
                opt.step()
            else:
                opt.step([grad_of(p).float() for p in params])
            dist.barrier()
            took = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            seconds[name].append(float(took))
            with torch.no_grad():
                weights[name] = [p.detach().clone() for p in params]
    held, held_grads = {}, {}
    for name in names:
        for out, n in ((held, state_bytes(opts[name])), (held_grads, grad_bytes[name])):
            b = torch.tensor([float(n)], dtype=torch.float64)
            every = [torch.zeros_like(b) for _ in range(ctx.world_size)]
            dist.all_gather(every, b)
            out[name] = [int(x) for x in torch.cat(every).tolist()]
    same = {name: all(torch.equal(a, b) for a, b in zip(weights[name], weights["replicated"])) for name in names}
    ref = statistics.median(seconds["replicated"])
    report = {"checkpoint": str(ckpt), "dtype": args.dtype, "replicas": ctx.dp_size, "reps": args.reps,
              "parameters": sum(p.numel() for p in params), "threads": torch.get_num_threads(),
              "modes": {name: {"seconds": seconds[name], "median_s": statistics.median(seconds[name]),
                               "speedup_over_replicated": ref / statistics.median(seconds[name]),
                               "state_bytes_per_rank": held[name], "grad_bytes_per_rank": held_grads[name],
                               "weights_equal_replicated": same[name]}
                        for name in names}}
    if ctx.rank == 0:
        for name, r in report["modes"].items():
            print(f"{name:18s} reduction + step {r['median_s']:.3f} s ({r['speedup_over_replicated']:.2f}x), state "
                  f"per rank {[round(b / 2 ** 20, 1) for b in r['state_bytes_per_rank']]} MiB, gradients per rank "
                  f"{[round(b / 2 ** 20, 1) for b in r['grad_bytes_per_rank']]} MiB, weights equal to replicated: "
                  f"{r['weights_equal_replicated']}", flush=True)
        write_json_atomic(Path(args.out), report)
        print(f"wrote {args.out}")
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
