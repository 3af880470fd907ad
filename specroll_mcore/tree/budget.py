"""Concurrency-aware node budget and the hardware capacity C_hw it is derived from.

    N_t = clip(floor(C_hw / B_t), N_min, N_max)

B_t is the number of unfinished responses at step t; C_hw the number of tokens one verification
forward can hold before its latency stops being (almost) flat, for this model, hardware and
parallel layout. With many responses each tree is small (the forward is already full); as responses
finish, trees grow into the freed capacity. When B_t * N_min > C_hw the rows are verified in
several forwards of at most C_hw tokens each.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional, Sequence


def node_budget(active_rows: int, c_hw: int, n_min: int, n_max: int) -> int:
    """Nodes per row (root included) for ``active_rows`` unfinished responses."""
    if active_rows <= 0:
        return n_min
    return max(n_min, min(n_max, c_hw // active_rows))


def row_chunks(active_rows: int, nodes_per_row: int, c_hw: int) -> list[tuple[int, int]]:
    """Split rows into [start, end) groups whose trees total at most C_hw tokens per forward."""
    per = max(1, c_hw // max(1, nodes_per_row))
    return [(s, min(active_rows, s + per)) for s in range(0, active_rows, per)]


def capacity_from_latency(tokens: Sequence[int], seconds: Sequence[float], tolerance: float = 1.5) -> int:
    """The documented rule: C_hw is the largest measured token count whose forward latency is at most
    ``tolerance`` x the latency of a one-token forward. Up to there, extra tokens are almost free
    (the forward is bound by reading the weights); past it, each token costs compute."""
    if len(tokens) != len(seconds) or not tokens:
        raise ValueError("tokens and seconds must be non-empty and of equal length")
    base = seconds[list(tokens).index(min(tokens))]
    ok = [t for t, s in zip(tokens, seconds) if s <= tolerance * base]
    return max(ok) if ok else min(tokens)


def profile_key(model_fingerprint: str, hardware: str, tp: int, pp: int) -> str:
    raw = json.dumps([model_fingerprint, hardware, tp, pp])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def hardware_name() -> str:
    import platform

    import torch

    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name()}x{torch.cuda.device_count()}"
    return f"cpu:{platform.processor() or platform.machine()}:{os.cpu_count()}cores:{torch.get_num_threads()}threads"


def profile_path(cache: Optional[Path] = None) -> Path:
    root = Path(cache or os.environ.get("SPECROLL_CACHE") or Path.home() / ".cache" / "specroll_mcore")
    return root / "capacity_profiles.json"


def save_capacity(key: str, record: dict, cache: Optional[Path] = None) -> Path:
    """Add one profile to the cache file (atomically replaced)."""
    path = profile_path(cache)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[key] = record
    from specroll_mcore.checkpoint.megatron import write_json_atomic

    write_json_atomic(path, data)
    return path


DEFAULT_C_HW = 64
"""Used by an engine built without a measured C_hw (the CLI, the trainer and the benchmarks measure
one, see rollout/profile.ensure_capacity)."""


def load_capacity(key: str, cache: Optional[Path] = None) -> Optional[int]:
    path = profile_path(cache)
    if not path.is_file():
        return None
    rec = json.loads(path.read_text()).get(key)
    return int(rec["c_hw"]) if rec else None
