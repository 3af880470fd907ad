#!/usr/bin/env python
"""The speculative step's host work, phase by phase, on inputs captured from a real rollout.

    python tools/bench_step_phases.py --prompts 1 --samples 1 --out step_phases_b1.json     # batch 1
    python tools/bench_step_phases.py --prompts 4 --samples 4 --c-hw 64 --n-max 4           # 16 responses
    python tools/bench_step_phases.py --dtype bfloat16 --out step_phases_b1_bf16.json        # SmolLM2 in bfloat16

One SpecRoll rollout (fixed trees of --n-max nodes, so that every step drafts) records the inputs of
every step's drafting (``SpeculativeEngine.propose``), acceptance (``verify.accept``, the policy's
sampling at the tree nodes included) and feedback (``SpeculativeEngine.feedback``: the slow path's
records and Reflex); each phase is then run again on the first --steps of them, --reps times, and
the median ms per step reported. The verification forward is left out: it is the same for any host
code. Compare two versions of the code by running this tool from each, alternating; the machines
are shared and noisy, so repeat.

Each phase also reports, from one more pass, the torch operations it dispatches per step (views,
metadata and allocations apart: they launch nothing) and the host syncs among them: scalar reads
(``.item()``, ``int()``, ``bool()`` of a tensor), ``nonzero``, indexing by a boolean mask and
``.tolist()``. On a GPU each operation is a kernel launch and each sync waits for the device, and a
forward of a model the size of SmolLM2 is itself bound by its launches there, so these counts price
the step's host work on a GPU where this CPU cannot time it. Operations of the CPU kernels (csrc/)
are not dispatched by torch and not counted; ``SPECROLL_NOISE_KERNEL=0 SPECROLL_PACKED_GEMM=0``
count the operations the GPU path runs instead (and ``SPECROLL_ACCEPT_AT_ONCE=1`` its acceptance,
verify.accept_at_once). The sampler's noise is counted in one pass over each call's rows, as a GPU
computes it (on a CPU it goes in cache-sized row chunks). The step's sampling keys, made once a step for
drafting and acceptance, are counted in the captured rollout (``step_keys``, part of the totals; not
timed), and so, for scale, are its verification forwards (``verify_forward``).

Whole rollouts are counted too: the captured SpecRoll rollout and a vanilla one of the same prompts
(the same tokens), operations and syncs per generated token (``rollouts``). Where every operation
costs a launch and little else (a GPU with a small model) their ratio, vanilla over SpecRoll, is
the speedup the launches allow: what the trees' tau buys once their forwards and host work are paid.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
import warnings
from collections import Counter
from typing import Any, Callable

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from specroll_mcore import parallel, sampling as sampler  # noqa: E402
from specroll_mcore.checkpoint.megatron import stop_token_ids, write_json_atomic  # noqa: E402
from specroll_mcore.config import ParallelConfig, SamplingConfig, SpecConfig  # noqa: E402
from specroll_mcore.rl.data import synthetic_chat_prompts  # noqa: E402
from specroll_mcore.rollout import SpeculativeEngine, VanillaEngine  # noqa: E402
from specroll_mcore.rollout import speculative  # noqa: E402
from specroll_mcore.rollout.profile import open_for_rollout  # noqa: E402
from specroll_mcore.tree.budget import hardware_name  # noqa: E402

PHASES = ("propose", "accept", "feedback")
# operations whose result the host waits for (a scalar read, a data-dependent shape)
SYNC_OPS = frozenset({"item", "_local_scalar_dense", "is_nonzero", "equal", "allclose", "nonzero", "nonzero_numpy",
                      "masked_select"})
# operations that launch no kernel: views, metadata, allocation
VIEW_OPS = frozenset({"reshape", "view", "view_as", "_unsafe_view", "unsqueeze", "squeeze", "select", "slice", "expand",
                      "expand_as", "flatten", "alias", "detach", "detach_", "permute", "transpose", "t", "split",
                      "split_with_sizes", "chunk", "unbind", "narrow", "as_strided", "lift_fresh", "set_", "empty",
                      "new_empty", "empty_like", "empty_strided", "resolve_conj", "resolve_neg", "to (same tensor)"})


class OpCounter(TorchDispatchMode):
    """Counts the torch operations dispatched, ``Tensor.tolist`` calls and indexing by boolean masks
    while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.tolist = 0
        self.masks = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("index", "index_put_", "index_put") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            self.masks += 1  # a boolean mask's positions: the host waits for them as for nonzero
        out = func(*args, **(kwargs or {}))
        # a conversion to the dtype and device a tensor already has returns it: no kernel
        self.ops["to (same tensor)" if name in ("to", "contiguous") and out is args[0] else name] += 1
        return out

    def __enter__(self):
        original, counter = torch.Tensor.tolist, self
        self._outer_tolist = torch.Tensor.__dict__.get("tolist")  # an enclosing counter's, or none

        def tolist(tensor):
            counter.tolist += 1
            return original(tensor)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        if self._outer_tolist is None:
            del torch.Tensor.tolist  # torch's own method again (TensorBase's)
        else:
            torch.Tensor.tolist = self._outer_tolist
        return super().__exit__(*exc)

    def per_step(self, steps: int) -> dict[str, Any]:
        syncs = sum(self.ops[name] for name in SYNC_OPS) + self.tolist + self.masks
        launches = sum(n for name, n in self.ops.items() if name not in VIEW_OPS)
        return {"ops_per_step": launches / steps, "syncs_per_step": syncs / steps,
                "views_per_step": (sum(self.ops.values()) - launches) / steps,
                "ops_by_name_per_step": {k: v / steps for k, v in self.ops.most_common() if k not in VIEW_OPS}}


@contextlib.contextmanager
def noise_in_one_pass():
    """Count the sampler's noise as a GPU computes it, one pass over a call's rows: on a CPU it goes
    in row chunks that stay in cache (``sampling.CPU_CHUNK``: one row of SmolLM2's vocabulary a
    chunk), each chunk its own few operations. The values are the same either way."""
    chunk = sampler.CPU_CHUNK
    sampler.CPU_CHUNK = 1 << 62
    try:
        yield
    finally:
        sampler.CPU_CHUNK = chunk


def capture(engine: SpeculativeEngine, prompts: list,
            sampling: SamplingConfig) -> tuple[dict[str, list], Any, OpCounter, OpCounter, OpCounter]:
    """Run one rollout, recording each phase's calls (arguments as passed) and counting the
    operations of its verification forwards, of each step's sampling keys (made once a step for
    drafting and acceptance; counted here, not replayed) and of the whole rollout."""
    calls: dict[str, list] = {name: [] for name in PHASES}
    originals = {"propose": engine.propose, "feedback": engine.feedback, "accept": speculative.accept,
                 "verify": engine.verify, "step_keys": getattr(speculative._Rollout, "step_keys", None)}
    forwards, keys, total = OpCounter(), OpCounter(), OpCounter()

    def counted_verify(*args, **kwargs):
        with forwards:
            return originals["verify"](*args, **kwargs)

    def counted_keys(*args, **kwargs):
        with keys:
            return originals["step_keys"](*args, **kwargs)

    def recorder(name: str) -> Callable:
        def call(*args, **kwargs):
            calls[name].append((args, kwargs))
            return originals[name](*args, **kwargs)
        return call

    engine.propose, engine.feedback, engine.verify = recorder("propose"), recorder("feedback"), counted_verify
    speculative.accept = recorder("accept")
    if originals["step_keys"] is not None:  # (code before the step's key table: keys made in the phases)
        speculative._Rollout.step_keys = counted_keys
    try:
        with total, noise_in_one_pass():
            out = engine.generate(prompts, sampling, prompt_ids=list(range(len(prompts))))
    finally:
        speculative.accept = originals["accept"]
        if originals["step_keys"] is not None:
            speculative._Rollout.step_keys = originals["step_keys"]
        del engine.propose, engine.feedback, engine.verify  # the class's methods again
    return calls, out, forwards, keys, total


def fresh(calls: list, name: str) -> list:
    """The calls to replay once: feedback updates Reflex's state in place, so each replay gets its
    own copy, made here (outside the timed and counted replay)."""
    if name != "feedback":
        return calls
    return [((*args[:-1], copy.deepcopy(args[-1])) if args[-1] is not None else args, kwargs) for args, kwargs in calls]


def replay(fn: Callable, calls: list) -> None:
    with torch.inference_mode():
        for args, kwargs in calls:
            fn(*args, **kwargs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="smollm2", help="Megatron checkpoint dir with heads, or smollm2")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"],
                    help="load the checkpoint (policy and heads) in this dtype (default: its own); a half-precision "
                         "step's host work differs from float32's (its heads' products, conversions)")
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--c-hw", type=int, default=16, help="C_hw (so that trees of --n-max nodes fit)")
    ap.add_argument("--n-max", type=int, default=8, help="nodes per row of every step's tree")
    ap.add_argument("--steps", type=int, default=40, help="captured steps replayed per phase")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default="bench_step_phases.json")
    args = ap.parse_args()
    for flag in ("prompts", "samples", "max_new_tokens", "c_hw", "n_max", "steps", "reps"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    ctx = parallel.initialize(ParallelConfig())
    ckpt, policy, tok, _ = open_for_rollout(args.checkpoint, ctx, args.c_hw, params_dtype=args.dtype)
    spec = SpecConfig(num_heads=policy.num_heads, c_hw=args.c_hw, n_max=args.n_max, adaptive_nodes=False)
    eos = stop_token_ids(ckpt, tok)
    engine = SpeculativeEngine(policy, spec, eos_token_ids=eos)
    prompts = synthetic_chat_prompts(tok, args.prompts, seed=4242)
    sampling = SamplingConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                              num_samples=args.samples, seed=2)
    engine.generate(prompts[:1], SamplingConfig(max_new_tokens=4), prompt_ids=[0])  # warm-up (kernels, packing)
    calls, out, forwards, keys, total = capture(engine, prompts, sampling)
    vanilla, vanilla_engine = OpCounter(), VanillaEngine(policy, eos_token_ids=eos)
    with vanilla, noise_in_one_pass():
        ref = vanilla_engine.generate(prompts, sampling, prompt_ids=list(range(len(prompts))))
    tokens = out.stats["tokens"]
    rollouts = {"tokens": tokens, "tokens_identical": ref.tokens == out.tokens,
                "specroll": total.per_step(tokens), "vanilla": vanilla.per_step(tokens)}
    for r in (rollouts["specroll"], rollouts["vanilla"]):  # (per_step(tokens): per generated token)
        r["ops_per_token"], r["syncs_per_token"] = r.pop("ops_per_step"), r.pop("syncs_per_step")
        del r["views_per_step"], r["ops_by_name_per_step"]
    rollouts["launch_bound_speedup"] = rollouts["vanilla"]["ops_per_token"] / rollouts["specroll"]["ops_per_token"]
    methods = {"propose": engine.propose, "feedback": engine.feedback, "accept": speculative.accept}
    sync = (lambda: torch.cuda.synchronize(ctx.device)) if ctx.device.type == "cuda" else (lambda: None)
    phases = {}
    for name in PHASES:
        taken = calls[name][:args.steps]
        if not taken:
            raise SystemExit(f"the rollout made no {name} call to time (raise --max-new-tokens)")
        replay(methods[name], fresh(taken[:1], name))  # untimed
        times = []
        for _ in range(args.reps):
            calls_once = fresh(taken, name)
            sync()
            t = time.perf_counter()
            replay(methods[name], calls_once)
            sync()
            times.append((time.perf_counter() - t) / len(taken) * 1e3)
        counter, calls_once = OpCounter(), fresh(taken, name)
        with counter, noise_in_one_pass():
            replay(methods[name], calls_once)
        rows = [len(a[1]) if name == "feedback" else int(a[0].shape[0]) for a, _ in taken]  # slots / hidden / trees
        phases[name] = {"ms_per_step": statistics.median(times), "steps": len(taken),
                        "rows_per_step": statistics.mean(rows), **counter.per_step(len(taken))}
        print(f"{name:9s} {phases[name]['ms_per_step']:7.3f} ms a step ({len(taken)} steps, "
              f"{phases[name]['rows_per_step']:.1f} rows), {phases[name]['ops_per_step']:.0f} torch operations "
              f"and {phases[name]['syncs_per_step']:.1f} host syncs a step", flush=True)
    step_keys = keys.per_step(out.stats["steps"])  # counted in the rollout, not replayed
    report = {"checkpoint": str(ckpt), "hardware": hardware_name(), "dtype": str(policy.dtype).removeprefix("torch."),
              "threads": torch.get_num_threads(), "args": vars(args), "tau": out.stats["tau"],
              "steps": out.stats["steps"], "phases": phases,
              "total_ms_per_step": sum(p["ms_per_step"] for p in phases.values()),
              "step_keys": step_keys,
              "total_ops_per_step": sum(p["ops_per_step"] for p in (*phases.values(), step_keys)),
              "total_syncs_per_step": sum(p["syncs_per_step"] for p in (*phases.values(), step_keys)),
              # the verification forwards of the captured rollout, for scale (not replayed or timed)
              "verify_forward": forwards.per_step(out.stats["steps"]),
              "rollouts": rollouts}
    write_json_atomic(args.out, report)
    fwd = report["verify_forward"]
    print(f"host work {report['total_ms_per_step']:.2f} ms, {report['total_ops_per_step']:.0f} torch operations and "
          f"{report['total_syncs_per_step']:.1f} host syncs a step (the verification forward: "
          f"{fwd['ops_per_step']:.0f} operations, {fwd['syncs_per_step']:.1f} syncs; tau {out.stats['tau']:.2f})")
    print(f"whole rollouts, a token: SpecRoll {rollouts['specroll']['ops_per_token']:.0f} operations and "
          f"{rollouts['specroll']['syncs_per_token']:.1f} syncs, "
          f"vanilla {rollouts['vanilla']['ops_per_token']:.0f} and "
          f"{rollouts['vanilla']['syncs_per_token']:.1f} (tokens identical: {rollouts['tokens_identical']}): "
          f"{rollouts['launch_bound_speedup']:.2f}x where launches bound both; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
