"""Forward latency against the number of tokens in it: the measurement behind C_hw."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from specroll_mcore.model import PolicyModel, causal_mask
from specroll_mcore.rollout.base import prefill
from specroll_mcore.tree.budget import DEFAULT_TOLERANCE, LatencyCurve


QUICK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
QUICK_REPS = 5
"""The profile taken on first use (:func:`ensure_capacity`): medians of 5 alternated timings per
size (of 3, one noisy one-token latency on a shared 2-core machine moved C_hw from 16 to 32)."""


def dtype_name(policy: PolicyModel) -> str:
    """The dtype the policy computes in, as a capacity profile's key holds it ("bfloat16")."""
    return str(policy.dtype).removeprefix("torch.")


class Capacity(NamedTuple):
    """What the speculative engine needs to know about this policy, hardware and layout."""

    c_hw: int
    """Tokens per verification forward (the node budget's C_hw)."""
    latency: Optional[LatencyCurve]
    """The profiled forward latency (None: not profiled, e.g. C_hw configured on a machine without a
    cached profile); the engine keeps each step's trees to what pays for its latency with it."""


def open_for_rollout(checkpoint: str, ctx: Any, c_hw: Optional[int] = None, with_heads: bool = True,
                     params_dtype: Optional[str] = None) -> tuple[Any, PolicyModel, Any, Capacity]:
    """``smollm2`` or a checkpoint directory -> (path, policy with heads, tokenizer, capacity): what
    the rollout tools start from. ``params_dtype`` loads the checkpoint in another dtype."""
    import transformers

    from specroll_mcore.checkpoint.megatron import load_policy, read_checkpoint_config
    from specroll_mcore.checkpoint.smollm2 import resolve_checkpoint

    path = resolve_checkpoint(checkpoint)
    policy = load_policy(path, ctx, params_dtype, with_heads=with_heads)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return path, policy, tokenizer, ensure_capacity(policy, c_hw, read_checkpoint_config(path).get("policy_fingerprint"))


def ensure_capacity(policy: PolicyModel, configured: Optional[int], policy_fingerprint: Optional[str],
                    tolerance: float = DEFAULT_TOLERANCE) -> Capacity:
    """C_hw and the latency curve for this policy, hardware and layout: SpecConfig.c_hw if set (with
    the cached curve, if any; nothing is measured), else the cached profile's (C_hw derived from its
    curve by today's rule), else a quick profile now (a few seconds to a minute, see
    :func:`measure_capacity`)."""
    from specroll_mcore.tree.budget import capacity_from_latency, hardware_name, load_profile, profile_key

    ctx = policy.ctx
    record = load_profile(profile_key(policy_fingerprint or "unknown", dtype_name(policy), hardware_name(), ctx.tp_size,
                                      ctx.pp_size))
    if record is None and not configured:
        record = measure_capacity(policy, policy_fingerprint, QUICK_SIZES, reps=QUICK_REPS, tolerance=tolerance,
                                  quick=True)
    latency = LatencyCurve.from_profile(record) if record is not None else None
    if configured:
        return Capacity(configured, latency)
    return Capacity(capacity_from_latency(latency.tokens, latency.seconds, tolerance), latency)


def speculative_setup(policy: PolicyModel, spec: Any, checkpoint: Any) -> tuple[Any, Optional[LatencyCurve]]:
    """The SpecConfig a SpecRoll engine runs ``policy`` (loaded from ``checkpoint``) with: its head
    count and C_hw filled in (:func:`ensure_capacity`), and the latency curve to size trees with."""
    import dataclasses

    from specroll_mcore.checkpoint.megatron import read_checkpoint_config

    cap = ensure_capacity(policy, spec.c_hw, read_checkpoint_config(checkpoint).get("policy_fingerprint"))
    return dataclasses.replace(spec, num_heads=policy.num_heads, c_hw=cap.c_hw), cap.latency


def measure_capacity(policy: PolicyModel, policy_fingerprint: Optional[str], sizes: Sequence[int], reps: int,
                     tolerance: float = DEFAULT_TOLERANCE, quick: bool = False, verbose: bool = False) -> dict:
    """Profile the forward latency on every rank (collective; the slowest rank's latencies decide),
    derive C_hw by the documented rule (tree/budget.capacity_from_latency) and cache the record
    (rank 0). Returns the record."""
    from specroll_mcore.tree.budget import (capacity_from_latency, hardware_name, profile_key, save_capacity,
                                            tree_row_seconds)

    ctx = policy.ctx
    fp = policy_fingerprint or "unknown"
    curve = forward_latency(policy, sizes, reps, verbose=verbose and ctx.rank == 0)
    for name in ("tree_row_s", "decode_rows_s"):
        curve[name] = ctx.all_reduce_max(torch.tensor(curve[name], dtype=torch.float64)).tolist()
    c_hw = capacity_from_latency(list(sizes), tree_row_seconds(curve), tolerance)
    record = {"c_hw": c_hw, "rule": f"largest N with latency(N) <= {tolerance} x latency(1)",
              "hardware": hardware_name(), "dtype": dtype_name(policy), "tp": ctx.tp_size, "pp": ctx.pp_size,
              "policy_fingerprint": fp, "curve": curve, "quick": quick}
    if ctx.rank == 0:
        save_capacity(profile_key(fp, dtype_name(policy), hardware_name(), ctx.tp_size, ctx.pp_size), record)
    return record


def tree_forward(policy: PolicyModel, n: int, context: int = 128) -> Callable[[], None]:
    """A verification forward to time: one row appending an ``n``-node tree (a causal chain, the
    densest mask) to a ``context``-token committed prefix, logits gathered. Each call reruns it (the
    tree is written to scratch positions and never committed). Call under inference mode."""
    device = policy.ctx.device
    one = torch.zeros(1, dtype=torch.long, device=device)
    cache = policy.new_cache(num_slots=1, capacity=context + n)
    prefill(policy, cache, [list(range(5, 5 + context))], 4096)
    mask = causal_mask(1, n, device)

    def run() -> None:
        meta = policy.metadata(cache.lengths[one][:, None] + torch.arange(n, device=device)[None], mask, cache, one,
                               step=True)
        out = policy(torch.full((1, n), 7, device=device), meta)
        if out is not None:
            policy.full_logits(out)
    return run


def decode_forward(policy: PolicyModel, n: int, context: int = 128) -> Callable[[], None]:
    """A decode forward to time: ``n`` rows appending one token each to copies of a ``context``-token
    prefix. Call under inference mode."""
    device = policy.ctx.device
    rows = torch.arange(n, device=device)
    cache = policy.new_cache(num_slots=n, capacity=context + 1)
    prefill(policy, cache, [list(range(5, 5 + context))], 4096)
    cache.copy_slots(torch.zeros(n, dtype=torch.long, device=device), rows)
    mask = torch.ones(n, 1, 1, dtype=torch.bool, device=device)

    def run() -> None:
        meta = policy.metadata(cache.lengths[rows][:, None], mask, cache, rows, step=True)
        out = policy(torch.full((n, 1), 7, device=device), meta)
        if out is not None:
            policy.full_logits(out)
    return run


@torch.inference_mode()
def forward_latency(policy: PolicyModel, sizes: Sequence[int], reps: int, context: int = 128,
                    verbose: bool = False) -> dict:
    """Median seconds of one forward holding N new tokens, in two shapes alternated: one row
    appending an N-node tree (:func:`tree_forward`) and N rows appending one token each
    (:func:`decode_forward`), each on a ``context``-token committed prefix. Each shape runs once
    untimed first: a process's first forwards of a shape are slower (allocations, kernel setup),
    and an inflated one-token latency would double C_hw. Run on every rank of the layout. On a GPU
    each timing waits for the device (kernels run asynchronously)."""
    sync = torch.cuda.synchronize if policy.ctx.device.type == "cuda" else (lambda: None)
    res = {"tokens": list(sizes), "context": context, "tree_row_s": [], "decode_rows_s": []}
    for n in sizes:
        runs = {"tree_row_s": tree_forward(policy, n, context), "decode_rows_s": decode_forward(policy, n, context)}
        for run in runs.values():
            run()
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(reps):
            for name, run in runs.items():
                sync()
                t0 = time.perf_counter()
                run()
                sync()
                times[name].append(time.perf_counter() - t0)
        for name in runs:
            res[name].append(statistics.median(times[name]))
        if verbose:
            print(f"  forward with {n:4d} tokens: tree row {res['tree_row_s'][-1] * 1e3:8.1f} ms   "
                  f"decode rows {res['decode_rows_s'][-1] * 1e3:8.1f} ms", flush=True)
    return res
