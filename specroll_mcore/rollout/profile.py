"""Forward latency against the number of tokens in it (the measurement behind C_hw) and against the
forward's shape, rows x nodes per row x context (what the speculative engine sizes trees with)."""

from __future__ import annotations

import json
import statistics
import time
import zlib
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from specroll_mcore.model import PolicyModel, causal_mask
from specroll_mcore.rollout.base import prefill
from specroll_mcore.tree.budget import DEFAULT_TOLERANCE, Latency, LatencyCurve, LatencySurface


QUICK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
QUICK_REPS = 5
"""The profile taken on first use (:func:`ensure_capacity`): medians of 5 alternated timings per
size (of 3, one noisy one-token latency on a shared 2-core machine moved C_hw from 16 to 32)."""
QUICK_MORE_SIZES = (256, 512, 1024, 2048)
"""Sizes the quick profile goes on to, one at a time, while its curve is still flat at the largest
size measured: on an H200 a SmolLM2 forward costs the same from 1 to 1024 tokens, and a C_hw of 128
would leave a step of 128 rows or more no node to draft with (it then decodes plainly)."""

GRID_CONTEXTS = (128, 512)
"""Committed context lengths the latency grid is measured at (:func:`forward_grid`): a step's
longer contexts cost more attention per token, and more so in bfloat16's ordered attention."""


def dtype_name(policy: PolicyModel) -> str:
    """The dtype the policy computes in, as a capacity profile's key holds it ("bfloat16")."""
    return str(policy.dtype).removeprefix("torch.")


LATENCY_NEUTRAL_FIELDS = frozenset({"rope_theta", "rope_scaling", "norm_eps", "max_position_embeddings",
                                    "init_method_std", "moe_aux_loss_coeff", "params_dtype"})
"""ModelConfig fields a forward's latency does not depend on: values its kernels compute with, not
the shapes they run on (RoPE's frequencies are computed once per position either way), the
initialisation and a training loss weight. The dtype the policy computes in is a key of its own
(:func:`dtype_name`: a checkpoint may be loaded in another)."""


def architecture(policy: PolicyModel) -> str:
    """The shapes of this policy's forward, as a capacity profile's key holds them: a digest of its
    ModelConfig less :data:`LATENCY_NEUTRAL_FIELDS`. Not the weights: a forward's latency does not
    depend on them, so a policy trained from another (GRPO, fine-tuning) finds the profile measured
    for it. (A mixture of experts' routing moves with the weights, and with it how evenly its experts
    are loaded; its forwards are dropless, as many expert products in all whatever the routing: the
    profile holds the routing of the weights it was measured with.)"""
    import hashlib

    shapes = {k: v for k, v in policy.config.to_dict().items() if k not in LATENCY_NEUTRAL_FIELDS}
    return hashlib.sha256(json.dumps(shapes, sort_keys=True).encode()).hexdigest()[:16]


class Capacity(NamedTuple):
    """What the speculative engine needs to know about this policy, hardware and layout."""

    c_hw: int
    """Tokens per verification forward (the node budget's C_hw)."""
    latency: Optional[Latency]
    """The profiled forward latency (None: not profiled, e.g. C_hw configured on a machine without a
    cached profile); the engine keeps each step's trees to what pays for its latency with it: the
    profile's grid over the forward's shape, or for a profile from before grids, its one-row curve."""


def open_for_rollout(checkpoint: str, ctx: Any, c_hw: Optional[int] = None, with_heads: bool = True,
                     params_dtype: Optional[str] = None) -> tuple[Any, PolicyModel, Any, Capacity]:
    """``smollm2`` or a checkpoint directory -> (path, policy with heads, tokenizer, capacity): what
    the rollout tools start from. ``params_dtype`` loads the checkpoint in another dtype."""
    import transformers

    from specroll_mcore.checkpoint.megatron import load_policy
    from specroll_mcore.checkpoint.smollm2 import resolve_checkpoint

    path = resolve_checkpoint(checkpoint)
    policy = load_policy(path, ctx, params_dtype, with_heads=with_heads)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return path, policy, tokenizer, ensure_capacity(policy, c_hw)


def ensure_capacity(policy: PolicyModel, configured: Optional[int], tolerance: float = DEFAULT_TOLERANCE) -> Capacity:
    """C_hw and the latency profile for this policy, hardware and layout: SpecConfig.c_hw if set
    (with the cached profile where every rank has the same one; nothing is measured), else the cached
    profile's (C_hw derived from its one-row curve by today's rule), else (where any rank lacks it or
    holds another: :func:`unshared_profile`) a quick profile now (45-66 s for SmolLM2 on a 2-core CPU, most of it
    the grid; 1 to 128 tokens, and on to 2048 while the curve stays flat: :data:`QUICK_MORE_SIZES`;
    see :func:`measure_capacity`). Collective: every rank gets the same."""
    from specroll_mcore.tree.budget import capacity_from_latency

    record = cached_profile(policy)
    if unshared_profile(policy.ctx, record):
        record = None if configured else measure_capacity(policy, QUICK_SIZES, reps=QUICK_REPS, tolerance=tolerance,
                                                          quick=True, more_sizes=QUICK_MORE_SIZES)
    curve = LatencyCurve.from_profile(record) if record is not None else None
    latency = (LatencySurface.from_profile(record) or curve) if record is not None else None
    if configured:
        return Capacity(configured, latency)
    return Capacity(capacity_from_latency(curve.tokens, curve.seconds, tolerance), latency)


def cached_profile(policy: PolicyModel) -> Optional[dict]:
    """The cached capacity profile of this policy's architecture, its dtype, this hardware and the
    layout, or None."""
    from specroll_mcore.tree.budget import load_profile

    return load_profile(capacity_key(policy))


def capacity_key(policy: PolicyModel) -> str:
    """The cache key of this policy's capacity profile (tree/budget.profile_key): its architecture
    (:func:`architecture`), the dtype it computes in, this hardware and the layout."""
    from specroll_mcore.tree.budget import hardware_name, profile_key

    ctx = policy.ctx
    return profile_key(architecture(policy), dtype_name(policy), hardware_name(), ctx.tp_size, ctx.pp_size,
                       ctx.ep_size, ctx.stage_layers(policy.config.num_layers))


def speculative_setup(policy: PolicyModel, spec: Any) -> tuple[Any, Optional[Latency]]:
    """The SpecConfig a SpecRoll engine runs ``policy`` with: its head count and C_hw filled in
    (:func:`ensure_capacity`), and the latency profile to size trees with (with the step's work
    around its forward: :func:`with_step_overhead`)."""
    import dataclasses

    cap = ensure_capacity(policy, spec.c_hw)
    spec = dataclasses.replace(spec, num_heads=policy.num_heads, c_hw=cap.c_hw)
    return spec, with_step_overhead(policy, spec, cap.latency)


OVERHEAD_WARMUP, OVERHEAD_STEPS = 2, 8
"""Steps of each measuring rollout left out (a process's first steps of a shape are slower), and
steps timed after them (:func:`measure_step_overhead`)."""
OVERHEAD_MAX_ROWS = 64
"""The most rows the step overhead is measured at; past them it is read along the last segment (the
work around a forward grows about linearly with its rows, and a GPU's launches not at all), and a
measurement stays a few seconds where C_hw is in the thousands."""


def overhead_rows(c_hw: int) -> list[int]:
    """Row counts the step overhead is measured at: powers of two up to the most rows a drafted
    step can have (C_hw // 2: trees of two nodes; :data:`OVERHEAD_MAX_ROWS` at most), and at least
    1 and 2. Past C_hw // 2 steps decode plainly whatever the overhead (tree/budget.node_budget)."""
    top = max(2, min(OVERHEAD_MAX_ROWS, c_hw // 2))
    return [1 << i for i in range(top.bit_length())]


def overhead_key(policy: PolicyModel, spec: Any) -> str:
    """The cache key of a step-overhead profile: the capacity profile's (architecture, dtype,
    hardware, layout) and the engine settings that change a step's work around its forward."""
    import hashlib
    import json

    settings = [spec.num_heads, spec.topk, spec.c_hw, spec.n_max, spec.shortlist, spec.draft_vocab, spec.coupled,
                spec.reflex.enabled, spec.slow_path.enabled]
    digest = hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:12]
    return f"{capacity_key(policy)}:step-overhead:{digest}"


def with_step_overhead(policy: PolicyModel, spec: Any, latency: Optional[Latency]) -> Optional[Latency]:
    """``latency`` with the step's work around its forward added (tree/budget.StepCost): the cached
    step-overhead profile of this policy, hardware, layout and engine settings, else one measured
    now (:func:`measure_step_overhead`; ~11 s for SmolLM2 on 2 CPU cores) and cached. Collective
    (:func:`unshared_profile`). ``latency`` itself where nothing is weighed
    (no latency profile, ``spec.adaptive_nodes`` off) or ``spec.step_overhead`` is off."""
    from specroll_mcore.tree.budget import StepCost, StepOverhead, load_profile, save_capacity

    if latency is None or not (spec.adaptive_nodes and spec.step_overhead):
        return latency
    key = overhead_key(policy, spec)
    record = load_profile(key)
    if unshared_profile(policy.ctx, record):
        record = measure_step_overhead(policy, spec)
        save_capacity(key, record)
    return StepCost(latency, StepOverhead.from_record(record))


def measure_step_overhead(policy: PolicyModel, spec: Any, rows: Optional[Sequence[int]] = None, context: int = 32,
                          warmup: int = OVERHEAD_WARMUP, steps: int = OVERHEAD_STEPS, verbose: bool = False) -> dict:
    """Median seconds of a speculative step's work besides its verification forward, at each of
    ``rows`` unfinished responses (default :func:`overhead_rows` of ``spec.c_hw``), for plain steps
    (trees of one node) and for drafted ones (every step's whole node budget, nothing weighed), and
    of the drafted ones' work, the part before the forward (proposing and building the trees): the
    engine's own timing of each step less its forward's, over rollouts at T = 1 of a synthetic
    ``context``-token prompt (the work besides the forward hardly depends on it: SmolLM2's is the
    same within noise at 32 and 128 tokens, and a short prefill is quicker), each past ``warmup``
    steps, ``steps`` of them (fewer where drafts emit more than two tokens a step on average, at
    least one). On a GPU each stage waits for its kernels (sync_timers), so a forward's kernels are
    charged to the forward.
    Adaptation runs as in a rollout (Reflex, slow-path records) on engines of its own: the engines
    the caller builds are not touched. Collective: every rank rolls out alike; the slowest rank's
    medians are kept. Returns the record :func:`with_step_overhead` caches."""
    import dataclasses

    from specroll_mcore.config import SamplingConfig
    from specroll_mcore.rollout.speculative import SpeculativeEngine
    from specroll_mcore.tree.budget import DEFAULT_C_HW, hardware_name

    c_hw = spec.c_hw or DEFAULT_C_HW
    rows = list(rows or overhead_rows(c_hw))
    prompt = [(5 + i) % policy.config.vocab_size for i in range(context)]
    # (one group: every step holds all rows, also under pipeline parallelism; no latency: whole budgets)
    engines = {kind: SpeculativeEngine(policy, dataclasses.replace(spec, n_min=1, n_max=n_max), sync_timers=True,
                                       pipeline_groups=1)
               for kind, n_max in (("plain", 1), ("drafted", spec.n_max))}
    # (a drafted step emits 1 .. H + 1 tokens a row: at 2 on average, as many steps as plain ones; at
    # H + 1 every time, one past the warm-up)
    new_tokens = {"plain": warmup + steps + 1,
                  "drafted": max(2 * (warmup + steps), (warmup + 1) * (spec.num_heads + 1)) + 1}
    medians: dict[str, list[float]] = {"plain": [], "drafted": [], "drafting": []}
    for r in rows:
        for kind, engine in engines.items():
            sampling = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens[kind], seed=r)
            out = engine._generate([prompt] * r, sampling, 0, None)  # (no slow-path batch end: nothing consolidates)
            timed = [p for p in out.stats["per_step"] if p["active"] == r][warmup:]
            medians[kind].append(statistics.median(p["seconds"] - p["forward_s"] for p in timed))
            if kind == "drafted":
                medians["drafting"].append(statistics.median(p["prepare_s"] for p in timed))
        if verbose and policy.ctx.rank == 0:
            print(f"  {r:4d} rows: plain step {medians['plain'][-1] * 1e3:.1f} ms, drafted step "
                  f"{medians['drafted'][-1] * 1e3:.1f} ms ({medians['drafting'][-1] * 1e3:.1f} ms proposing and "
                  "building) besides the forward", flush=True)
    names = ("plain", "drafted", "drafting")
    reduced = policy.ctx.all_reduce_max(torch.tensor([medians[n] for n in names], dtype=torch.float64)).tolist()
    return {"kind": "step_overhead", "rows": rows, **{f"{n}_s": s for n, s in zip(names, reduced)},
            "context": context, "temperature": 1.0, "steps": steps, "hardware": hardware_name(),
            "dtype": dtype_name(policy), "c_hw": c_hw, "n_max": spec.n_max}


def measure_capacity(policy: PolicyModel, sizes: Sequence[int], reps: int, tolerance: float = DEFAULT_TOLERANCE,
                     quick: bool = False, verbose: bool = False, more_sizes: Sequence[int] = ()) -> dict:
    """Profile the forward latency on every rank (collective; the slowest rank's latencies decide),
    derive C_hw by the documented rule (tree/budget.capacity_from_latency), measure the latency
    grid over the shapes trees of that C_hw take (:func:`forward_grid`) and cache the record (every
    rank, into its cache: the same record everywhere). ``more_sizes``: larger sizes measured one at
    a time after ``sizes``, each only while C_hw is still the largest size measured (every rank
    decides alike: on the reduced latencies). Returns the record."""
    from specroll_mcore.tree.budget import (capacity_from_latency, hardware_name, save_capacity,
                                            tree_row_seconds)

    ctx = policy.ctx

    def slowest_rank(measured: dict) -> dict:
        for name in ("tree_row_s", "decode_rows_s"):
            measured[name] = ctx.all_reduce_max(torch.tensor(measured[name], dtype=torch.float64)).tolist()
        return measured

    curve = slowest_rank(forward_latency(policy, sizes, reps, verbose=verbose and ctx.rank == 0))
    c_hw = capacity_from_latency(curve["tokens"], tree_row_seconds(curve), tolerance)
    for n in (n for n in more_sizes if n > max(sizes)):
        if c_hw != curve["tokens"][-1]:
            break
        more = slowest_rank(forward_latency(policy, [n], reps, verbose=verbose and ctx.rank == 0))
        for name in ("tokens", "tree_row_s", "decode_rows_s"):
            curve[name] += more[name]
        c_hw = capacity_from_latency(curve["tokens"], tree_row_seconds(curve), tolerance)
    grid = forward_grid(policy, c_hw, reps, verbose=verbose and ctx.rank == 0)
    seconds = torch.tensor([[[-1.0 if s is None else s for s in row] for row in c] for c in grid["seconds"]],
                           dtype=torch.float64)  # (unmeasured: -1, the same shapes on every rank)
    grid["seconds"] = [[[None if s < 0 else s for s in row] for row in c]
                       for c in ctx.all_reduce_max(seconds).tolist()]
    curve["grid"] = grid
    record = {"c_hw": c_hw, "rule": f"largest N with latency(N) <= {tolerance} x latency(1)",
              "hardware": hardware_name(), "dtype": dtype_name(policy), "tp": ctx.tp_size, "pp": ctx.pp_size,
              "ep": ctx.ep_size, "stage_layers": ctx.stage_layers(policy.config.num_layers),
              "architecture": architecture(policy), "curve": curve, "quick": quick}
    save_capacity(capacity_key(policy), record)
    return record


def unshared_profile(ctx: Any, record: Optional[dict]) -> bool:
    """Whether any rank lacks a cached profile (``record`` None) or holds another than the others
    (nodes with caches of their own, not a shared home directory, profiled apart): then every rank
    measures it again, together (the measurements are collective), and caches what they measured,
    so that they end up with the same profile. Ranks that sized trees or C_hw from different
    profiles would build trees of different shapes for one forward."""
    seen = ctx.gather_values(-1.0 if record is None else float(zlib.crc32(json.dumps(record, sort_keys=True).encode())))
    return min(seen) < 0 or len(set(seen)) > 1


def _committed_cache(policy: PolicyModel, rows: int, context: int, capacity: int) -> Any:
    """A cache of ``rows`` slots, each holding the same ``context``-token committed prefix."""
    device = policy.ctx.device
    cache = policy.new_cache(num_slots=rows, capacity=capacity)
    vocab = policy.config.vocab_size
    prefill(policy, cache, [[(5 + i) % vocab for i in range(context)]], 4096)
    if rows > 1:
        cache.copy_slots(torch.zeros(rows - 1, dtype=torch.long, device=device),
                         torch.arange(1, rows, device=device))
    return cache


def _step(policy: PolicyModel, cache: Any, rows: int, n: int) -> Callable[[], None]:
    """A verification forward over the cache's first ``rows`` slots, each appending an ``n``-node
    tree (a causal chain, the densest mask), logits gathered; written to scratch positions, never
    committed, so each call reruns it."""
    device = policy.ctx.device
    slots = torch.arange(rows, device=device)
    mask = causal_mask(rows, n, device)

    def run() -> None:
        meta = policy.metadata(cache.lengths[slots][:, None] + torch.arange(n, device=device)[None], mask, cache,
                               slots)
        out = policy(torch.full((rows, n), 7, device=device), meta)
        if out is not None:
            policy.full_logits(out)
    return run


def tree_forward(policy: PolicyModel, n: int, context: int = 128, rows: int = 1) -> Callable[[], None]:
    """A verification forward to time: ``rows`` rows (one by default) appending an ``n``-node tree
    each to a ``context``-token committed prefix (see :func:`_step`). Call under inference mode."""
    return _step(policy, _committed_cache(policy, rows, context, context + n), rows, n)


def decode_forward(policy: PolicyModel, n: int, context: int = 128) -> Callable[[], None]:
    """A decode forward to time: ``n`` rows appending one token each to copies of a ``context``-token
    prefix. Call under inference mode."""
    return tree_forward(policy, 1, context, rows=n)


def grid_axes(c_hw: int) -> tuple[list[int], list[int]]:
    """The rows and nodes per row of :func:`forward_grid`: powers of two up to C_hw (at least 1 and
    2 nodes). Node budgets keep a step's trees to C_hw tokens (tree/budget.node_budget), so these
    cover the shapes the engine weighs; the grid extrapolates past them."""
    powers = [1 << i for i in range(max(1, c_hw).bit_length()) if 1 << i <= max(1, c_hw)]
    return powers, powers if len(powers) > 1 else [1, 2]


def alternated_medians(runs: dict[Any, Callable[[], None]], reps: int, sync: Callable[[], None]) -> dict[Any, float]:
    """Median seconds of each run: every run once untimed first (a process's first forward of a
    shape is slower: allocations, kernel setup), then ``reps`` rounds timing each in turn, each
    timing between two ``sync`` calls."""
    for run in runs.values():
        run()
    times: dict[Any, list[float]] = {key: [] for key in runs}
    for _ in range(reps):
        for key, run in runs.items():
            sync()
            t0 = time.perf_counter()
            run()
            sync()
            times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(t) for key, t in times.items()}


@torch.inference_mode()
def forward_grid(policy: PolicyModel, c_hw: int, reps: int, contexts: Sequence[int] = GRID_CONTEXTS,
                 verbose: bool = False) -> dict:
    """Median seconds of a verification forward of R rows appending N-node trees each (R, N over
    :func:`grid_axes`, the shapes with R * N <= C_hw and every row count at 1 and 2 nodes; others
    None) on ``context``-token committed prefixes, at each of ``contexts``: the latency surface
    (tree/budget.LatencySurface) trees are sized against. The node counts of one row count share
    one cache and are timed alternately; each shape runs once untimed first. Run on every rank of
    the layout; on a GPU each timing waits for the device."""
    sync = torch.cuda.synchronize if policy.ctx.device.type == "cuda" else (lambda: None)
    rows, nodes = grid_axes(c_hw)
    seconds = []
    with policy.expert_lockstep():
        for context in contexts:
            per_context = []
            for r in rows:
                shapes = [n for n in nodes if n <= 2 or r * n <= c_hw]
                cache = _committed_cache(policy, r, context, context + max(shapes))
                medians = alternated_medians({n: _step(policy, cache, r, n) for n in shapes}, reps, sync)
                del cache
                per_context.append([medians.get(n) for n in nodes])
                if verbose:
                    print(f"  context {context:5d}, {r:4d} rows: " + "  ".join(
                        f"{n} nodes {s * 1e3:.1f} ms" for n, s in zip(nodes, per_context[-1]) if s is not None),
                          flush=True)
            seconds.append(per_context)
    return {"rows": rows, "nodes": nodes, "contexts": list(contexts), "seconds": seconds}


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
    with policy.expert_lockstep():
        for n in sizes:
            medians = alternated_medians({"tree_row_s": tree_forward(policy, n, context),
                                          "decode_rows_s": decode_forward(policy, n, context)}, reps, sync)
            for name, seconds in medians.items():
                res[name].append(seconds)
            if verbose:
                print(f"  forward with {n:4d} tokens: tree row {res['tree_row_s'][-1] * 1e3:8.1f} ms   "
                      f"decode rows {res['decode_rows_s'][-1] * 1e3:8.1f} ms", flush=True)
    return res
