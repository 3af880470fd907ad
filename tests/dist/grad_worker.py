"""Run under torchrun: the update's gradient reduction at a TP/PP layout with data-parallel replicas,
summed onto every replica (a replicated optimizer) and onto each parameter's owner alone (a sharded
one, ``MainParamAdamW.grad_owners``), from the same seeded per-rank gradients; each rank saves what it
holds after each, the gradient norms, and the bytes each kind of collective carried."""

import argparse
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.checkpoint import random_full_state_dict  # noqa: E402
from specroll_mcore.config import ParallelConfig, tiny_qwen3  # noqa: E402
from specroll_mcore.model import PolicyModel  # noqa: E402
from specroll_mcore.optimizer import MainParamAdamW  # noqa: E402
from specroll_mcore.parallel import grad_of  # noqa: E402
from specroll_mcore.rl.schedule import finalize_grads, global_grad_norm  # noqa: E402


def seeded_grads(policy: PolicyModel) -> None:
    """Each parameter's gradient, seeded by its name and the replica, stage and (where the parameter is
    split over TP, or its gradient is a TP rank's part: the query/key norms) TP rank: replicated
    parameters' gradients agree over a TP group, as a backward leaves them."""
    ctx = policy.ctx
    for i, (name, p) in enumerate(policy.gpt.named_parameters()):
        per_tp = getattr(p, "tensor_model_parallel", False) or "q_layernorm" in name or "k_layernorm" in name
        seed = 1000 * i + 100 * ctx.dp_rank + 10 * ctx.pp_rank + (ctx.tp_rank if per_tp else 0)
        g = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))
        if p.dtype == torch.bfloat16:
            p.main_grad, p.grad = g, None
        else:
            p.grad = g.to(p.dtype)


class Traffic:
    """The bytes of the gradient collectives (all-reduce, reduce) issued while it is active."""

    def __init__(self) -> None:
        self.bytes = {"all_reduce": 0, "reduce": 0}

    def __enter__(self) -> "Traffic":
        self.saved = dist.all_reduce, dist.reduce
        for kind, fn in zip(self.bytes, self.saved):
            def counted(t, *args, _kind=kind, _fn=fn, **kwargs):
                self.bytes[_kind] += t.numel() * t.element_size()
                return _fn(t, *args, **kwargs)
            setattr(dist, kind, counted)
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce, dist.reduce = self.saved


def run(dtype: str, ctx) -> dict:
    cfg = tiny_qwen3(tie_word_embeddings=True, params_dtype=dtype)
    policy = PolicyModel(cfg, ctx)
    policy.load_full_state_dict(random_full_state_dict(cfg, seed=3))
    params = [p for p in policy.gpt.parameters() if p.requires_grad]
    opt = MainParamAdamW(params, shard_group=ctx.dp_group)
    names = {p: name for name, p in policy.gpt.named_parameters()}
    out = {}
    for mode, owners in (("all_reduce", {}), ("owners", opt.grad_owners())):
        seeded_grads(policy)
        with Traffic() as traffic:
            finalize_grads(policy, owners)
            norm = float(global_grad_norm(policy, owners))
        out[mode] = {"grads": {names[p]: None if grad_of(p) is None else grad_of(p).clone() for p in params},
                     "norm": norm, "bytes": traffic.bytes}
    out["owned"] = sorted(names[p] for p, owner in opt.grad_owners().items() if owner == ctx.rank)
    out["grad_bytes"] = sum(p.numel() * 4 for p in params)
    out["tied"] = names[policy.gpt.shared_embedding_or_output_weight()] \
        if ctx.pp_size > 1 and (ctx.is_first_stage or ctx.is_last_stage) else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", action="append", required=True, help="TP,PP (the replicas: the rest)")
    ap.add_argument("--out", required=True, help="a folder: each layout's results in tpT-ppP-rankR.pt")
    args = ap.parse_args()
    for layout in args.layout:
        tp, pp = (int(x) for x in layout.split(","))
        ctx = parallel.initialize(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp))
        results = {dtype: run(dtype, ctx) for dtype in ("float32", "bfloat16")}
        results["layout"] = {"tp": ctx.tp_rank, "pp": ctx.pp_rank, "dp": ctx.dp_rank, "dp_size": ctx.dp_size}
        torch.save(results, Path(args.out) / f"tp{tp}-pp{pp}-rank{ctx.rank}.pt")
    parallel.destroy()


if __name__ == "__main__":
    main()
