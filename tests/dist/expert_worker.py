"""Run under torchrun (2 processes, or 4 with --pp 2): a Qwen3-MoE at DP=2 without and with expert
parallelism (EP=2), rebuilt from the same seeded weights in one launch; each replica rolls out its
own prompts, whose responses take different numbers of forwards, and computes log-probs over its own
number of micro-batches. Saves each rank's results for both layouts (tests/dist/test_expert_parallel.py)."""

import argparse
import warnings

import torch

warnings.filterwarnings("ignore")

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.checkpoint import random_full_heads, random_full_state_dict  # noqa: E402
from specroll_mcore.config import ParallelConfig, SamplingConfig, SpecConfig, tiny_qwen3_moe  # noqa: E402
from specroll_mcore.model import PolicyModel, causal_mask  # noqa: E402
from specroll_mcore.rl.schedule import forward_logprobs, pack_micro_batch  # noqa: E402
from specroll_mcore.rollout import SpeculativeEngine, VanillaEngine  # noqa: E402

# replica 0: three prompts and short responses; replica 1: two prompts and responses twice as long
PROMPTS = {0: [[11, 12, 13, 14], [21], [31, 32, 33]], 1: [[5, 6], [7, 8, 9, 10, 11]]}
MAX_NEW = {0: 10, 1: 20}


def run(dtype: str, ctx) -> dict:
    cfg = tiny_qwen3_moe(params_dtype=dtype, num_experts=8, moe_router_topk=2)
    full = random_full_state_dict(cfg, seed=7, std=0.08)
    model = PolicyModel(cfg, ctx, num_heads=3).eval()
    model.load_full_state_dict(full)
    g = torch.Generator().manual_seed(11)
    model.load_full_heads(random_full_heads(cfg, 3, g))
    model.record_routing = True
    prompts, out = PROMPTS[ctx.dp_rank], {}
    out["local_experts"] = len(model.gpt.decoder.layers[0].mlp.experts.local_experts)
    gathered = model.expert_state_dict()
    first = sum(ctx.stage_layers(cfg.num_layers)[:ctx.pp_rank])  # this stage's first layer

    def global_name(k: str) -> str:
        _, _, i, rest = k.split(".", 3)
        return f"decoder.layers.{int(i) + first}.{rest}"

    out["gathered_equal"] = all(torch.equal(gathered[k], full[global_name(k)]) for k in gathered
                                if ".local_experts." in k)
    out["gathered_experts"] = sum(".local_experts." in k for k in gathered)
    for T in (1.0, 0.0):
        sp = SamplingConfig(temperature=T, top_p=0.9 if T else 1.0, max_new_tokens=MAX_NEW[ctx.dp_rank],
                            num_samples=2, seed=5)
        r = VanillaEngine(model, eos_token_ids=[3]).generate(prompts, sp, step=1)
        out[f"vanilla-{T}"] = {"tokens": r.tokens, "logprobs": r.logprobs, "routing": r.routing}
        r = SpeculativeEngine(model, SpecConfig(c_hw=24), eos_token_ids=[3]).generate(prompts, sp, step=1)
        out[f"spec-{T}"] = {"tokens": r.tokens, "logprobs": r.logprobs, "forwards": r.stats["forwards"]}
    if dtype == "float32":  # the step-overhead profile's rollouts, in step over the EP group (collective)
        from specroll_mcore.rollout.profile import measure_step_overhead

        out["overhead_rows"] = measure_step_overhead(model, SpecConfig(c_hw=8))["rows"]
    # the update's log-probs over this replica's micro-batches: 3 on replica 0, 1 on replica 1
    seqs = [(p, t, None, 0.0) for p, t in zip([prompts[i // 2] for i in range(len(r.tokens))], r.tokens)]
    mbs = [pack_micro_batch(seqs[i:i + 2], ctx.device) for i in range(0, len(seqs), 2)]
    out["logprobs"] = forward_logprobs(model, mbs, 1.0, replay=False)
    with torch.no_grad():  # a plain forward outside any lockstep block: both replicas run one
        ids = torch.tensor([p + [1] * (5 - len(p)) for p in prompts[:2]])
        lengths = torch.tensor([len(p) for p in prompts[:2]])
        out["causal"] = model(ids, model.metadata(torch.arange(5)[None].expand(2, 5), causal_mask(2, 5, ids.device,
                                                                                                  lengths)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--pp", type=int, default=1)
    a = ap.parse_args()
    results = {}
    for ep in (1, 2):
        for dtype in ("float32", "bfloat16"):
            ctx = parallel.initialize(ParallelConfig(expert_model_parallel_size=ep, pipeline_model_parallel_size=a.pp),
                                      tiny_qwen3_moe(params_dtype=dtype, num_experts=8))
            results[(ep, dtype)] = run(dtype, ctx)
    torch.save(results, f"{a.out}.rank{ctx.rank}.pt")
    parallel.destroy()


if __name__ == "__main__":
    main()
