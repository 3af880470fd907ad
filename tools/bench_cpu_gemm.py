#!/usr/bin/env python
"""CPU products of a few rows: BLAS, oneDNN's packed layout and the panel kernels, side by side.

    python tools/bench_cpu_gemm.py --out docs/results/cpu_gemm_smollm2.json
    python tools/bench_cpu_gemm.py --rows 1,4,8,16 --reps 9 --skip-forward

Measures on the checkpoint's own float32 weights (specroll_mcore/cpu_gemm.py), alternating the
kernels within every repetition and reporting medians, ms:
  * ``layers``: one forward's worth of layer products (every decoder matrix once) at each row count;
  * ``vocab``: the vocabulary projection (BLAS as ``W @ x^T``, as the policy calls it);
  * ``forward``: a whole verification forward (one row holding an N-node tree on a 128-token
    context, as tools/profile_capacity.py times it) with products on BLAS only
    (SPECROLL_PACKED_GEMM=0), without panels (SPECROLL_PANEL_GEMM=0) and as configured.
The machines are shared and noisy: compare the kernels within one run, not across runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from typing import Callable

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from specroll_mcore import cpu_gemm, parallel  # noqa: E402
from specroll_mcore.checkpoint.megatron import load_policy, write_json_atomic  # noqa: E402
from specroll_mcore.config import ParallelConfig  # noqa: E402
from specroll_mcore.rollout.profile import tree_forward  # noqa: E402
from specroll_mcore.tree.budget import hardware_name  # noqa: E402

FORWARD_SETTINGS = {"blas": {"SPECROLL_PACKED_GEMM": "0"}, "onednn": {"SPECROLL_PANEL_GEMM": "0"}, "panels": {}}


SWITCHES = ("SPECROLL_PACKED_GEMM", "SPECROLL_PANEL_GEMM")


def medians_ms(runs: dict[str, Callable[[], object]], reps: int,
               settings: dict[str, dict[str, str]] | None = None) -> dict[str, float]:
    """Median ms of each run, alternating them within every repetition (after one warm-up call each),
    each under its environment ``settings`` (the product switches; others' values are restored)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    saved = {k: os.environ.get(k) for k in SWITCHES}
    try:
        for rep in range(reps + 1):
            for name, run in runs.items():
                for k in SWITCHES:
                    os.environ.pop(k, None)
                os.environ.update((settings or {}).get(name, {}))
                t0 = time.perf_counter()
                run()
                if rep:
                    times[name].append(time.perf_counter() - t0)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {name: round(statistics.median(t) * 1e3, 2) for name, t in times.items()}


def product_runs(weights: list[torch.Tensor], rows: int, vocab: bool) -> dict[str, Callable[[], object]]:
    """Each kernel over ``weights`` at ``rows`` rows of fresh inputs."""
    xs = [torch.randn(rows, w.shape[1]) for w in weights]
    onednn = [cpu_gemm.pack(w) for w in weights]
    runs: dict[str, Callable[[], object]] = {
        "blas": (lambda: [torch.mm(w, x.t()) for x, w in zip(xs, weights)]) if vocab else
        (lambda: [F.linear(x, w) for x, w in zip(xs, weights)]),
        "onednn": lambda: [cpu_gemm.packed_linear(x, p) for x, p in zip(xs, onednn)],
    }
    kernels = cpu_gemm.panel_kernels()
    if kernels is not None:
        panels = [kernels.pack_panels(w) for w in weights]
        runs["panels"] = lambda: [kernels.panel_linear(x, p, w.shape[0]) for x, p, w in zip(xs, panels, weights)]
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="smollm2")
    ap.add_argument("--rows", default="1,2,4,8,12,16,24,32,48,64,128")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--skip-forward", action="store_true")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    from specroll_mcore.checkpoint.smollm2 import resolve_checkpoint

    if not cpu_gemm.enabled():
        print("this torch build has no oneDNN packed products (or SPECROLL_PACKED_GEMM=0): nothing to compare",
              file=sys.stderr)
        return 2
    ctx = parallel.initialize(ParallelConfig())
    if ctx.device.type != "cpu":
        print(f"the policy runs on {ctx.device}: these are CPU kernels (hide the GPU: CUDA_VISIBLE_DEVICES=)",
              file=sys.stderr)
        return 2
    policy = load_policy(resolve_checkpoint(args.checkpoint), ctx, params_dtype="float32")
    layers = [m.weight.detach() for name, m in policy.gpt.decoder.named_modules() if isinstance(
        m, (cpu_gemm.PackedColumnParallelLinear, cpu_gemm.PackedRowParallelLinear))]
    vocab = [policy.output_weight().detach()]
    rows = [int(r) for r in args.rows.split(",")]
    result = {"hardware": hardware_name(), "threads": torch.get_num_threads(), "rows": rows, "reps": args.reps,
              "layer_matrices": len(layers), "layer_params_M": round(sum(w.numel() for w in layers) / 1e6, 2),
              "panels": cpu_gemm.panel_kernels() is not None, "layers_ms": {}, "vocab_ms": {}, "forward_ms": {}}
    with torch.inference_mode():
        for n in rows:
            result["layers_ms"][n] = medians_ms(product_runs(layers, n, vocab=False), args.reps)
            result["vocab_ms"][n] = medians_ms(product_runs(vocab, n, vocab=True), args.reps)
            line = f"rows {n:4d}  layers {result['layers_ms'][n]}  vocab {result['vocab_ms'][n]}"
            if not args.skip_forward:
                run = tree_forward(policy, n)
                result["forward_ms"][n] = medians_ms({k: run for k in FORWARD_SETTINGS}, args.reps, FORWARD_SETTINGS)
                line += f"  forward {result['forward_ms'][n]}"
            print(line, flush=True)
    if args.out:
        write_json_atomic(args.out, result)
        print(f"wrote {args.out}")
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
