"""Reflex: the gradient-free fast path that corrects the heads' input within one trajectory.

After each verification, for every horizon the accepted path reached, the verifier has told us the
policy's distribution p at that position and the token it sampled. The head's draft q was built
from ``z`` (its output for that position). On the small support

    S = candidates  U  top-k(q)  U  top-k(p)  U  {sampled token}

the draft error splits into

    r_dist = W_S^T (p_S - q_S)                               (distribution error)
    r_cov  = sum_{y in C* \\ C} p_S(y) (W_y - W_b*)           (coverage error)

where C are the candidates the tree could use, C* = top-|C|(p) and b* the weakest candidate.
Both are directions in hidden space (``W`` is the policy's own vocab projection: r_dist is minus the
gradient of CE(p_S, q_S) with respect to z). A per-trajectory, per-horizon memory
``m <- rho_h m + (1 - rho_h) e`` with ``e = r_dist + w_cov r_cov`` accumulates them, and the next
proposal adds

    dz = alpha * RMS(z) * m / RMS(m)

to the head's input, only while a gate passes: the cosine alignments a between the memory and the
feedback that then arrived must have a positive lower confidence bound,
``mean(a) - z_delta * std(a) / sqrt(n) > 0``. No gradients, no parameter changes. Under tensor
parallelism each rank multiplies its own vocabulary rows and the partial sums are all-reduced: the
vocabulary matrix is never gathered. State is indexed by rollout slot and released when the
response finishes, so nothing leaks from one trajectory into another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch


@dataclass
class ReflexState:
    """Memory and gate statistics, [slots, H, ...] (float32 whatever the model dtype)."""

    memory: torch.Tensor  # [S, H, h]
    count: torch.Tensor  # [S, H] alignments observed
    mean: torch.Tensor  # [S, H] their running mean
    m2: torch.Tensor  # [S, H] running sum of squared deviations (Welford)
    totals: torch.Tensor  # [2, H] float64: every alignment of the rollout, summed and counted (kept on release)

    @classmethod
    def new(cls, num_slots: int, num_heads: int, hidden_size: int, device: torch.device) -> "ReflexState":
        z = torch.zeros(num_slots, num_heads, device=device)
        return cls(torch.zeros(num_slots, num_heads, hidden_size, device=device), z.clone(), z.clone(), z.clone(),
                   torch.zeros(2, num_heads, dtype=torch.float64, device=device))

    def mean_alignment(self) -> list[Optional[float]]:
        """Per horizon, the mean of every alignment observed so far (None where there was none)."""
        return [a / n if n else None for a, n in self.totals.t().tolist()]

    def release(self, slots: torch.Tensor) -> None:
        """Forget finished trajectories."""
        for t in (self.memory, self.count, self.mean, self.m2):
            t[slots] = 0

    def gate(self, slots: torch.Tensor, z_delta: float, min_observations: int, gated: bool = True) -> torch.Tensor:
        """[b, H] bool: the lower confidence bound of the alignment is positive (only the count of
        alignments is checked when not ``gated``)."""
        n, mean, m2 = self.count[slots], self.mean[slots], self.m2[slots]
        if not gated:
            return n >= min_observations
        std = torch.sqrt(m2 / (n - 1).clamp(min=1))
        lcb = mean - z_delta * std / torch.sqrt(n.clamp(min=1))
        return (n >= min_observations) & (lcb > 0)


def correction(state: ReflexState, slots: torch.Tensor, x: torch.Tensor, alpha: float, z_delta: float,
               min_observations: int, gated: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The bounded input correction for the next proposal.

    x [b, h] is the heads' input. Returns delta [H, b, h] (x's dtype; zero where the gate is closed)
    and the gate [b, H]."""
    m = state.memory[slots]  # [b, H, h]
    rms_m = m.pow(2).mean(-1).sqrt()
    open_ = state.gate(slots, z_delta, min_observations, gated) & (rms_m > 0)
    rms_x = x.float().pow(2).mean(-1).sqrt()  # [b]
    scale = alpha * rms_x[:, None] / rms_m.clamp(min=1e-12) * open_.float()  # [b, H]
    return (m * scale[..., None]).transpose(0, 1).to(x.dtype), open_


def support(candidates: torch.Tensor, q_top: torch.Tensor, p_top: torch.Tensor,
            sampled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """S per observation: ids [m, s] and a mask [m, s] that keeps the first copy of each id."""
    ids = torch.cat([candidates, q_top, p_top, sampled[:, None]], dim=1)
    same = ids[:, :, None] == ids[:, None, :]
    earlier = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device).tril(-1)
    return ids, ~(same & earlier).any(-1)


def feedback_coefficients(p_logits: torch.Tensor, q_logits: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor,
                          candidates: torch.Tensor, p_star: torch.Tensor, coverage_weight: float) -> torch.Tensor:
    """Coefficients c [m, s] with e = sum_s c_s W_s = r_dist + coverage_weight * r_cov.

    p_logits, q_logits [m, s]: the policy's and the head's logits on S (already divided by the
    temperature); candidates [m, k] the head's candidates, weakest last; p_star [m, k] the policy's
    top-k."""
    neg = torch.finfo(torch.float32).min
    p_s = torch.softmax(p_logits.float().masked_fill(~valid, neg), -1)
    q_s = torch.softmax(q_logits.float().masked_fill(~valid, neg), -1)
    coef = p_s - q_s
    if coverage_weight > 0:
        in_cand = (ids[:, :, None] == candidates[:, None, :]).any(-1)
        in_star = (ids[:, :, None] == p_star[:, None, :]).any(-1)
        missing = (in_star & ~in_cand & valid).float()
        weakest = (ids == candidates[:, -1:]) & valid
        coef = coef + coverage_weight * (p_s * missing - (p_s * missing).sum(-1, keepdim=True) * weakest.float())
    return coef * valid.float()


def feedback_vectors(rows: torch.Tensor, coef: torch.Tensor, ctx: Any) -> torch.Tensor:
    """e = sum_s coef_s W_s -> [m, h] from ``rows`` [m, s, h] = this rank's :func:`vocab_rows` of
    the support (zero where another rank owns the id): partial sums, all-reduced over TP."""
    partial = torch.einsum("ms,msh->mh", coef, rows.float())
    return ctx.all_reduce_tp(partial.contiguous(), "sum")


def update(state: ReflexState, slots: torch.Tensor, horizons: torch.Tensor, feedback: torch.Tensor,
           decay: Sequence[float], observed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Score the memory against the feedback that arrived (delayed alignment), then fold the
    feedback in. (slots, horizons) pairs are distinct; ``observed`` [m] (default: all) marks the pairs
    whose feedback counts, the others change nothing. Returns the alignments [m] (NaN where the
    memory was still empty or the pair is not observed).

    Every pair is computed and the unobserved or empty ones keep their values, rather than selected
    by a boolean mask: no host sync (each mask would wait for the device to know its size)."""
    idx = (slots, horizons)
    m_old = state.memory[idx]  # [m, h]
    e = feedback.float()
    has = m_old.norm(dim=-1) > 0
    if observed is not None:
        has = has & observed
    a = torch.nn.functional.cosine_similarity(m_old, e, dim=-1, eps=1e-12)
    mean = state.mean[idx]
    n = state.count[idx] + has.float()
    d = torch.where(has, a - mean, 0.0)
    new_mean = mean + d / n.clamp(min=1)  # (d = 0 leaves the mean as it was)
    state.m2[idx] = torch.where(has, state.m2[idx] + d * (a - new_mean), state.m2[idx])
    state.mean[idx] = new_mean
    state.count[idx] = n
    state.totals.index_add_(1, horizons, torch.stack([torch.where(has, a, 0.0), has.float()]).double())
    rho = torch.tensor(list(decay), dtype=e.dtype, device=e.device)[horizons][:, None]
    folded = rho * m_old + (1 - rho) * e
    state.memory[idx] = folded if observed is None else torch.where(observed[:, None], folded, m_old)
    return torch.where(has, a, math.nan)
