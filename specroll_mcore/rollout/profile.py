"""Forward latency against the number of tokens in it: the measurement behind C_hw."""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch

from specroll_mcore.model import PolicyModel, causal_mask
from specroll_mcore.rollout.base import prefill


@torch.inference_mode()
def forward_latency(policy: PolicyModel, sizes: Sequence[int], reps: int, context: int = 128,
                    verbose: bool = False) -> dict:
    """Median seconds of one forward holding N new tokens, in two shapes alternated: one row
    appending an N-node tree (a causal chain, the densest mask) and N rows appending one token each
    (decode), each on a ``context``-token committed prefix. Run on every rank of the layout."""
    device = policy.ctx.device
    res = {"tokens": list(sizes), "context": context, "tree_row_s": [], "decode_rows_s": []}
    prompt = [list(range(5, 5 + context))]
    one = torch.zeros(1, dtype=torch.long, device=device)
    for n in sizes:
        tree_cache = policy.new_cache(num_slots=1, capacity=context + n)
        prefill(policy, tree_cache, prompt, 4096)
        rows = torch.arange(n, device=device)
        dec_cache = policy.new_cache(num_slots=n, capacity=context + 1)
        prefill(policy, dec_cache, prompt, 4096)
        dec_cache.copy_slots(torch.zeros(n, dtype=torch.long, device=device), rows)
        tree_t, dec_t = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            meta = policy.metadata(tree_cache.lengths[one][:, None] + torch.arange(n, device=device)[None],
                                   causal_mask(1, n, device), tree_cache, one)
            out = policy(torch.full((1, n), 7, device=device), meta)
            if out is not None:
                policy.full_logits(out)
            tree_t.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            meta = policy.metadata(dec_cache.lengths[rows][:, None],
                                   torch.ones(n, 1, 1, dtype=torch.bool, device=device), dec_cache, rows)
            out = policy(torch.full((n, 1), 7, device=device), meta)
            if out is not None:
                policy.full_logits(out)
            dec_t.append(time.perf_counter() - t0)
        res["tree_row_s"].append(statistics.median(tree_t))
        res["decode_rows_s"].append(statistics.median(dec_t))
        if verbose:
            print(f"  forward with {n:4d} tokens: tree row {res['tree_row_s'][-1] * 1e3:8.1f} ms   "
                  f"decode rows {res['decode_rows_s'][-1] * 1e3:8.1f} ms", flush=True)
    return res
