"""Concurrency-aware node budget and the hardware capacity C_hw it is derived from.

    N_t = clip(floor(C_hw / B_t), N_min, N_max)

B_t is the number of unfinished responses at step t; C_hw the number of tokens one verification
forward can hold before its latency stops being (almost) flat, for this model, hardware and
parallel layout. With many responses each tree is small (the forward is already full); as responses
finish, trees grow into the freed capacity. When B_t * N_min > C_hw the rows are verified in
several forwards of at most C_hw tokens each.

N_t is a budget, not a quota: with the latency profile C_hw was derived from
(:class:`LatencyCurve`), a step keeps only as many of the drafted nodes as pay for their latency
(:func:`tree_size`): the prefix of the trees, in the order they were grown, with the most expected
tokens per second.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union


def node_budget(active_rows: int, c_hw: int, n_min: int, n_max: int) -> int:
    """Nodes per row (root included) for ``active_rows`` unfinished responses."""
    if active_rows <= 0:
        return n_min
    return max(n_min, min(n_max, c_hw // active_rows))


def row_chunks(active_rows: int, nodes_per_row: int, c_hw: int) -> list[tuple[int, int]]:
    """Split rows into [start, end) groups whose trees total at most C_hw tokens per forward."""
    per = max(1, c_hw // max(1, nodes_per_row))
    return [(s, min(active_rows, s + per)) for s in range(0, active_rows, per)]


DEFAULT_TOLERANCE = 2.0
"""The capacity rule's latency tolerance (see :func:`capacity_from_latency`)."""


def capacity_from_latency(tokens: Sequence[int], seconds: Sequence[float],
                          tolerance: float = DEFAULT_TOLERANCE) -> int:
    """The documented rule: C_hw is the largest measured token count whose forward latency is at most
    ``tolerance`` x the latency of a one-token forward. Up to there, extra tokens are cheap (the
    forward is bound by reading the weights); past it, each token costs compute. The default of 2
    leaves the trees room to grow where the drafts are good; :func:`tree_size` keeps each step to
    the nodes that pay for themselves."""
    if len(tokens) != len(seconds) or not tokens:
        raise ValueError("tokens and seconds must be non-empty and of equal length")
    base = seconds[list(tokens).index(min(tokens))]
    ok = [t for t, s in zip(tokens, seconds) if s <= tolerance * base]
    return max(ok) if ok else min(tokens)


def tree_row_seconds(curve: dict) -> list[float]:
    """A profile's tree-row latencies (see rollout/profile.forward_latency), the one-token one the
    smaller of its two timings: a one-node tree and one decode row are the same forward, and C_hw is
    measured against it, so one noisy timing of it must not move C_hw."""
    seconds = [float(s) for s in curve["tree_row_s"]]
    decode = curve.get("decode_rows_s")
    if decode and int(curve["tokens"][0]) == 1:
        seconds[0] = min(seconds[0], float(decode[0]))
    return seconds


@dataclass(frozen=True)
class LatencyCurve:
    """Seconds of one verification forward against the number of tokens in it (a capacity profile's
    one-row tree curve): linear between the measured counts, and past the last one along the last
    segment's slope."""

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.seconds) or len(self.tokens) < 2:
            raise ValueError("a latency curve needs at least two (tokens, seconds) points of equal count")
        if any(a >= b for a, b in zip(self.tokens, self.tokens[1:])) or self.tokens[0] < 1:
            raise ValueError(f"latency curve token counts must be >= 1 and increasing, got {list(self.tokens)}")
        if any(not s > 0 for s in self.seconds):
            raise ValueError(f"latency curve seconds must be > 0, got {list(self.seconds)}")

    @classmethod
    def from_profile(cls, record: dict) -> "LatencyCurve":
        """From a record of :func:`specroll_mcore.rollout.profile.measure_capacity`."""
        curve = record["curve"]
        if len(curve["tokens"]) < 2:
            raise ValueError(f"the cached capacity profile measured {len(curve['tokens'])} token count(s); rerun "
                             f"tools/profile_capacity.py with at least two --tokens (its default measures 1 to 512)")
        return cls(tuple(int(t) for t in curve["tokens"]), tuple(tree_row_seconds(curve)))

    def __call__(self, tokens: int) -> float:
        xs, ys = self.tokens, self.seconds
        i = next((j for j, x in enumerate(xs) if x >= tokens), len(xs) - 1)
        i = max(i, 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (tokens - x0) / (x1 - x0), min(ys))

    def step(self, rows: int, nodes: int, context: Optional[int] = None) -> float:
        """A forward of ``rows`` trees of ``nodes`` nodes each, read as one row's tree of all their
        tokens (the curve knows neither the rows nor their contexts; see :class:`LatencySurface`)."""
        return self(rows * nodes)


def _along(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise linear through (xs, ys) (xs increasing, at least one point), and past either end
    along the nearest segment's slope; a single point is constant."""
    if len(xs) == 1:
        return ys[0]
    i = _segment(xs, x)
    return _lerp(xs[i - 1], xs[i], ys[i - 1], ys[i], x)


def _segment(xs: Sequence[float], x: float) -> int:
    """The segment (xs[i - 1], xs[i]) that :func:`_along` reads at ``x`` (at least two points): its i."""
    i = next((j for j, v in enumerate(xs) if v >= x), len(xs) - 1)
    return min(max(i, 1), len(xs) - 1)


def _lerp(x0: float, x1: float, y0: float, y1: float, x: float) -> float:
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class LatencySurface:
    """Seconds of one verification forward against its shape: ``rows`` rows each appending a tree of
    ``nodes`` nodes to its committed context of ``context`` tokens (a capacity profile's grid, see
    rollout/profile.forward_grid).

    A forward of many rows costs more than one row's tree of as many tokens: every row attends
    over its own context, and gathers and the cache's bookkeeping are per row. On a 2-core
    Xeon, 16 rows x 4 nodes on 320-token contexts took 133 ms in float32 and 122 ms in bfloat16,
    where one row's 64-token tree on a 128-token context takes 108 and 93 ms; relative to the same
    16 rows decoding one token each, those trees cost 1.71x and 1.68x, where the one-row curve
    says 1.88x and 1.50x. The step's trees are sized against this.

    ``seconds[c][r][n]``: at ``contexts[c]``, ``rows[r]``, ``nodes[n]``; None where not measured
    (the grid holds shapes of up to its token budget, and at least nodes 1 and 2 for every row).
    Between measured points: linear in nodes along each measured row, then linear in rows, then
    linear in context; past the grid, along the last segment's slope; never below the fastest
    measured forward."""

    rows: tuple[int, ...]
    nodes: tuple[int, ...]
    contexts: tuple[int, ...]
    seconds: tuple[tuple[tuple[Optional[float], ...], ...], ...]

    def __post_init__(self) -> None:
        for name in ("rows", "nodes", "contexts"):
            axis = getattr(self, name)
            if not axis or axis[0] < 1 or any(a >= b for a, b in zip(axis, axis[1:])):
                raise ValueError(f"a latency surface's {name} must be >= 1 and increasing, got {list(axis)}")
        shape = (len(self.contexts), len(self.rows), len(self.nodes))
        if (len(self.seconds) != shape[0] or any(len(c) != shape[1] for c in self.seconds)
                or any(len(r) != shape[2] for c in self.seconds for r in c)):
            raise ValueError(f"a latency surface's seconds must be [contexts][rows][nodes] = {list(shape)}")
        for c in self.seconds:
            for r, row in zip(self.rows, c):
                measured = [s for s in row if s is not None]
                if len(measured) < min(2, len(self.nodes)) or any(not s > 0 for s in measured):
                    raise ValueError(f"a latency surface needs at least two measured node counts (seconds > 0) "
                                     f"for every row count; {r} rows has {row}")

    @classmethod
    def from_profile(cls, record: dict) -> Optional["LatencySurface"]:
        """From a capacity profile's record (rollout/profile.measure_capacity); None for a record
        without a grid (profiled before there was one: its one-row curve stands in)."""
        grid = record["curve"].get("grid")
        if grid is None:
            return None
        return cls(tuple(int(r) for r in grid["rows"]), tuple(int(n) for n in grid["nodes"]),
                   tuple(int(c) for c in grid["contexts"]),
                   tuple(tuple(tuple(None if s is None else float(s) for s in row) for row in c)
                         for c in grid["seconds"]))

    def step(self, rows: int, nodes: int, context: Optional[int] = None) -> float:
        """Seconds of a forward of ``rows`` trees of ``nodes`` nodes each on contexts of up to
        ``context`` tokens (None: the grid's first context)."""
        # (what _along over every measured point gives, reading only the two points each segment needs:
        # a step's tree sizing reads this tens of times)
        def at_context(c: int) -> float:
            measured = self._measured[c]
            if len(measured) == 1:
                return _along(*measured[0], nodes)
            i = _segment(self.rows, rows)
            return _lerp(self.rows[i - 1], self.rows[i], _along(*measured[i - 1], nodes), _along(*measured[i], nodes),
                         rows)

        if context is None or len(self.contexts) == 1:
            seconds = at_context(0)
        else:
            c = _segment(self.contexts, context)
            seconds = _lerp(self.contexts[c - 1], self.contexts[c], at_context(c - 1), at_context(c), context)
        return max(seconds, self.fastest)

    @functools.cached_property
    def _measured(self) -> list[list[tuple[list[int], list[float]]]]:
        """Per context and row count, its measured (node counts, seconds)."""
        return [[([n for n, s in zip(self.nodes, row) if s is not None], [s for s in row if s is not None])
                 for row in c] for c in self.seconds]

    @functools.cached_property
    def fastest(self) -> float:
        """The fastest measured forward: the floor of every reading."""
        return min(s for c in self.seconds for row in c for s in row if s is not None)


class DepthCalibration:
    """How far the drafts' beliefs are to be trusted, per depth: accepted nodes over the beliefs'
    sum (their expectation) at that depth, both decayed by ``decay`` per step so that the ratio
    follows the policy as it drifts, and both starting at ``prior`` (a ratio of 1 until steps
    accumulate). Measured on SmolLM2 with its warm-started heads: 0.94 / 0.83 / 0.71 at depths 1-3
    at T=1 (overconfident), 1.09 / 1.30 / 1.18 at T=0."""

    def __init__(self, depth: int, decay: float = 0.98, prior: float = 4.0) -> None:
        self.decay = decay
        self.expected = [prior] * depth
        self.accepted = [prior] * depth

    def factors(self) -> list[float]:
        return [a / e if e > 0 else 1.0 for a, e in zip(self.accepted, self.expected)]

    def update(self, expected: Sequence[float], accepted: Sequence[float]) -> None:
        """One step: the beliefs' sum and the accepted nodes at each depth of the verified trees."""
        for d, (e, a) in enumerate(zip(expected, accepted)):
            self.expected[d] = self.decay * self.expected[d] + e
            self.accepted[d] = self.decay * self.accepted[d] + a

    def state_dict(self) -> dict:
        return {"expected": list(self.expected), "accepted": list(self.accepted)}

    def load_state_dict(self, state: dict) -> None:
        if len(state["expected"]) != len(self.expected):
            raise ValueError(f"a calibration of {len(state['expected'])} depths does not fit "
                             f"{len(self.expected)} heads")
        self.expected, self.accepted = list(state["expected"]), list(state["accepted"])


@dataclass(frozen=True)
class StepOverhead:
    """Seconds of a speculative step's work besides its verification forward, against the number of
    rows in it: for a plain step (sample each row's next token, commit it, feedback) and for a drafted
    one (also the heads' proposal, building the trees, accepting along them and committing the
    accepted paths), and of the drafted step's, the part paid before its trees are weighed
    (``drafting``: proposing and building them). A profile of the engine
    (rollout/profile.measure_step_overhead), not of a rollout: a tree size chosen with it depends on
    no wall clock of the rollout itself.

    On a 2-core Xeon in bfloat16, SmolLM2 with three heads spent 4.5 ms on a plain step of 16 rows and
    16.3 ms on a drafted one, around a 46 ms forward: trees of 2 nodes per row that raised tau to 1.41
    made the rollout 0.89x as fast as plain decoding; priced by their forward alone, they pay.

    Linear in rows between the measured counts, along the last segment past them, never below 0."""

    rows: tuple[int, ...]
    plain: tuple[float, ...]
    drafted: tuple[float, ...]
    drafting: tuple[float, ...]

    def __post_init__(self) -> None:
        counts = {len(self.plain), len(self.drafted), len(self.drafting)}
        if not self.rows or counts != {len(self.rows)}:
            raise ValueError("a step overhead needs a plain, a drafted and a drafting time per row count, for at "
                             f"least one row count; got rows {list(self.rows)}, plain {list(self.plain)}, drafted "
                             f"{list(self.drafted)}, drafting {list(self.drafting)}")
        if self.rows[0] < 1 or any(a >= b for a, b in zip(self.rows, self.rows[1:])):
            raise ValueError(f"a step overhead's rows must be >= 1 and increasing, got {list(self.rows)}")
        if any(not s >= 0 for s in self.plain + self.drafted + self.drafting):
            raise ValueError(f"a step overhead's seconds must be >= 0, got plain {list(self.plain)}, drafted "
                             f"{list(self.drafted)}, drafting {list(self.drafting)}")

    @classmethod
    def from_record(cls, record: dict) -> "StepOverhead":
        """From a record of rollout/profile.measure_step_overhead."""
        return cls(tuple(int(r) for r in record["rows"]),
                   *(tuple(float(s) for s in record[name]) for name in ("plain_s", "drafted_s", "drafting_s")))

    def __call__(self, rows: int, drafted: bool) -> float:
        return max(0.0, _along(self.rows, self.drafted if drafted else self.plain, rows))

    def proposed(self) -> "StepOverhead":
        """What is left of the work once the drafts are proposed and the trees built."""
        return StepOverhead(self.rows, self.plain, tuple(max(0.0, d - p) for d, p in zip(self.drafted, self.drafting)),
                            (0.0,) * len(self.rows))


@dataclass(frozen=True)
class StepCost:
    """Seconds of a whole speculative step: its verification forward's (``forward``, the capacity
    profile's latency) plus its work around the forward (``overhead``), which a step with trees of
    more than one node pays in full. Where that work is a large part of a step (many rows on a CPU,
    kernel launches on a GPU), forward latency alone makes any accepted draft look like a gain."""

    forward: Union[LatencyCurve, LatencySurface]
    overhead: StepOverhead

    def step(self, rows: int, nodes: int, context: Optional[int] = None) -> float:
        return self.forward.step(rows, nodes, context) + self.overhead(rows, nodes > 1)

    def proposed(self) -> "StepCost":
        """The cost of a step whose drafts are proposed already: what weighing its trees compares."""
        return StepCost(self.forward, self.overhead.proposed())


Latency = Union[LatencyCurve, LatencySurface, StepCost]
"""A profiled step latency the engine sizes trees with (see rollout/profile.ensure_capacity and
rollout/profile.with_step_overhead)."""


def tree_size(expected: Sequence[float], rows: int, latency: Latency,
              context: Optional[int] = None) -> int:
    """How many nodes per row (root included) a step keeps: ``expected[N - 1]`` is the number of
    tokens the step is expected to emit over its ``rows`` rows with trees of N nodes (from the drafts'
    cumulative probabilities); the step takes ``latency.step(rows, N, context)`` (``context``: the
    longest committed context among the rows): its forward, and with a :class:`StepCost` the work
    around it. Returns the N with the most expected tokens per second (the smallest on ties). Both
    come from profiles, never from this rollout's clock: the choice depends only on the drafts, the
    acceptance seen so far and the cached profiles, so that a rollout's statistics (and the slow
    path they feed) are reproducible and a resumed run repeats them."""
    best, best_rate = 1, -1.0
    for n, e in enumerate(expected, start=1):
        rate = e / latency.step(rows, n, context)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = n, rate
    return best


def profile_key(architecture: str, dtype: str, hardware: str, tp: int, pp: int, ep: int = 1,
                stage_layers: Sequence[int] = ()) -> str:
    """The cache key of a capacity profile: the model's architecture (rollout/profile.architecture:
    the shapes of its forward, not its weights, so a policy trained or fine-tuned from another shares
    its profile), the dtype it computes in (the same checkpoint loaded in bfloat16 has another latency
    curve), the hardware and the layout (expert parallelism, whose all-to-alls a forward waits for,
    and the layers each pipeline stage holds, which sets the slowest stage's share of a forward)."""
    raw = json.dumps([architecture, dtype, hardware, tp, pp, ep, list(stage_layers)])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def hardware_name() -> str:
    """The device a capacity profile was measured on (part of its cache key), with what changes its
    latency curve there: on CPU the model, the vector units torch dispatches to and whether it has
    AMX (bfloat16 products), the core and thread counts, which packed weights products run on
    (cpu_gemm.py: oneDNN's layout, panels) and whether steps' attention runs on the step kernel
    (model/attention.py). Machines sharing a home directory (a cluster's nodes)
    then do not share profiles across CPU generations."""
    import torch

    from specroll_mcore import cpu_gemm

    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name()}x{torch.cuda.device_count()}"
    name = f"cpu:{cpu_model()}:{os.cpu_count()}cores:{torch.get_num_threads()}threads"
    from specroll_mcore.model.attention import step_attention_kernels

    return (name + (":packed" if cpu_gemm.enabled() else "") + (":panels" if cpu_gemm.panel_kernels() else "")
            + (":step-attention" if step_attention_kernels() else ""))


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """This CPU as "model name:torch's CPU capability[:amx]", e.g. "Intel(R) Xeon(R)
    Processor:AVX512:amx" (the model name from /proc/cpuinfo where there is one, else the
    architecture)."""
    import platform

    import torch

    try:
        name, flags = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:  # not Linux
        name, flags = "", set()
    name = name or platform.processor() or platform.machine()
    return f"{name}:{torch.backends.cpu.get_cpu_capability()}" + (":amx" if "amx_bf16" in flags else "")


def parse_cpuinfo(text: str) -> tuple[str, set[str]]:
    """/proc/cpuinfo -> (the first processor's model name, its flags)."""
    name, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not name:
            name = value.strip()
        elif key.strip() == "flags":
            return name, set(value.split())
    return name, flags


def profile_path(cache: Optional[Path] = None) -> Path:
    from specroll_mcore.config import cache_dir

    return cache_dir(cache) / "capacity_profiles.json"


def _cached_profiles(path: Path) -> dict:
    """The profiles in the cache file ``path`` (none where it does not exist)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        data = e
    if not isinstance(data, dict):
        raise ValueError(f"the capacity profile cache {path} is not a JSON object ({data}): delete it, and the "
                         "profiles are measured again on first use (or with tools/profile_capacity.py)")
    return data


def save_capacity(key: str, record: dict, cache: Optional[Path] = None) -> Optional[Path]:
    """Add one profile to the cache file (atomically replaced); returns its path. Where the cache
    cannot be written (a read-only or full file system) it warns and returns None: the caller goes on
    with the record it holds, and the next run measures the profile again."""
    from specroll_mcore.checkpoint.megatron import write_json_atomic

    path = profile_path(cache)
    data = _cached_profiles(path)
    data[key] = record
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, data)
    except OSError as e:
        warnings.warn(f"could not cache a profile in {path} ({e}): this run uses it as measured, and the next one "
                      "measures it again; set SPECROLL_CACHE to a writable directory to keep it", stacklevel=2)
        return None
    return path


DEFAULT_C_HW = 64
"""Used by an engine built without a measured C_hw (the CLI, the trainer and the benchmarks measure
one, see rollout/profile.ensure_capacity)."""


def load_profile(key: str, cache: Optional[Path] = None) -> Optional[dict]:
    """The cached capacity profile under ``key`` (see :func:`profile_key`), or None."""
    return _cached_profiles(profile_path(cache)).get(key)
