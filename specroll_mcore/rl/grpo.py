"""GRPO as pure tensor functions (no torch.distributed, no model): advantages and the policy loss.

Shapes follow verl's convention: B responses, T response tokens (right-padded), G samples per prompt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch


def learning_rate(step: int, lr: float, steps: int, warmup_steps: int = 0, decay: str = "constant",
                  min_lr: float = 0.0) -> float:
    """The learning rate of training step ``step`` (1-based) of ``steps``: ``lr x step / warmup_steps``
    over the warm-up (the first step learns already), then ``lr`` (``constant``) or a cosine from
    ``lr`` down to ``min_lr`` at the last step (``cosine``), as megatron-core's --lr-decay-style."""
    if decay not in ("constant", "cosine"):
        raise ValueError(f"learning-rate decay must be 'constant' or 'cosine', got {decay!r}")
    if step <= warmup_steps:
        return lr * step / warmup_steps
    if decay == "constant":
        return lr
    progress = min(1.0, (step - warmup_steps) / max(1, steps - warmup_steps))
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def group_advantages(rewards: torch.Tensor, num_samples: int, mean_only: bool = False,
                     eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantages.

    rewards: [B] with B = P * G, grouped prompt-major (response i*G + j is sample j of prompt i).
    Returns [B]: (r - mean_group) / (std_group + eps), or r - mean_group if ``mean_only``.
    std is the unbiased sample std (as in the GRPO paper and TRL); a group whose rewards are all
    equal gets advantage 0.
    """
    if rewards.numel() % num_samples:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {num_samples}")
    r = rewards.double().reshape(-1, num_samples)  # [P, G]
    centred = r - r.mean(dim=1, keepdim=True)
    if not mean_only:
        std = r.std(dim=1, keepdim=True, unbiased=num_samples > 1) if num_samples > 1 else torch.ones_like(r[:, :1])
        centred = torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))
    return centred.reshape(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def varied_groups(rewards: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Groups DAPO's dynamic sampling trains on: rewards [B] (prompt-major, B = P * G) -> [P] bool,
    True where the group's rewards are not all equal. A group of equal rewards has advantage 0 on
    every response, so it adds no gradient and only dilutes a token-level loss. With G = 1 every
    group is kept (as verl does: there is nothing to compare)."""
    if rewards.numel() % num_samples:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {num_samples}")
    r = rewards.reshape(-1, num_samples)  # [P, G]
    if num_samples == 1:
        return torch.ones(r.shape[0], dtype=torch.bool)
    return (r != r[:, :1]).any(dim=1)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) per token: exp(d) - d - 1 with d = ref_logp - logp.
    Unbiased, always >= 0. [B, T] -> [B, T]."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def k2_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k2 estimator per token: (logp - ref_logp)^2 / 2 (verl's ``mse``). A biased estimate
    of KL(pi || pi_ref)'s value, but as a loss on the policy's own samples its gradient is that KL's
    in expectation (k3's is KL(pi_ref || pi)'s). [B, T] -> [B, T]."""
    return 0.5 * (logp - ref_logp) ** 2


NORMALIZATIONS = ("token", "sequence", "constant")
"""The loss normalisations (TrainConfig.loss_normalization; see :func:`policy_loss`)."""

RATIO_LEVELS = ("token", "sequence")
"""The importance ratio's levels (TrainConfig.ratio_level; see :func:`policy_loss`)."""

KL_ESTIMATORS = {"k2": k2_kl, "k3": k3_kl}
"""The KL penalty's per-token estimators (TrainConfig.kl_estimator). k1 (logp - ref_logp) is not one: as
a loss on the policy's own samples its gradient is 0 in expectation."""


@dataclass
class LossOutput:
    loss: torch.Tensor
    """Scalar to backpropagate."""
    clip_fraction: float
    ratio_mean: float
    kl: float
    pg_loss: float
    """The clipped-ratio term alone, normalised as the loss (without the KL penalty and the entropy
    bonus: verl's ``pg_loss``)."""


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_low: float = 0.2, clip_high: float = 0.2, normalization: str = "token",
                ref_logp: Optional[torch.Tensor] = None, kl_beta: float = 0.0,
                total_tokens: Optional[float] = None, total_sequences: Optional[float] = None,
                max_tokens: Optional[int] = None, ratio_level: str = "token",
                clip_ratio_c: Optional[float] = None, entropy: Optional[torch.Tensor] = None,
                entropy_coeff: float = 0.0, kl_estimator: str = "k3") -> LossOutput:
    """Clipped-ratio GRPO loss.

    logp, old_logp, mask: [B, T] (log-probs of the sampled tokens under the current policy and under
    the rollout policy; mask 1 on response tokens). advantages: [B].
    Per token: -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A) (+ kl_beta * k3, or the
    ``kl_estimator`` of :data:`KL_ESTIMATORS`; the ``kl`` reported is k3's mean, an unbiased estimate
    of KL(pi || pi_ref), whichever the loss takes).
    ratio_level: ``token``, each token's own ratio pi / pi_old; ``sequence``, every token of a
    response takes the response's ratio, the geometric mean of its tokens' (GSPO; TRL's
    ``importance_sampling_level="sequence"``), whose gradient spreads evenly over the tokens.
    clip_ratio_c (dual-clip PPO; > 1, None: off): a token of negative advantage loses at most
    clip_ratio_c * |A|, however far its ratio has grown (with no gradient beyond).
    entropy [B, T] (the policy's entropy at each position, with gradients) and entropy_coeff >= 0:
    an entropy bonus, - entropy_coeff * entropy per token, normalised as the rest (verl's
    ``entropy_coeff``).
    normalization: ``token`` averages over all tokens of the batch (DAPO), ``sequence`` averages each
    response over its tokens, then over responses (the GRPO paper), ``constant`` sums each
    response's tokens, divides by the constant ``max_tokens`` (the response length limit) and
    averages over responses (Dr. GRPO: no response's tokens weigh more for its being short; TRL's
    ``dr_grpo``). ``total_tokens`` / ``total_sequences`` override the denominators so that
    micro-batches of a gradient-accumulation step add up to the loss of the whole batch.
    """
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be 'token', 'sequence' or 'constant', got {normalization!r}")
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be 'token' or 'sequence', got {ratio_level!r}")
    if clip_ratio_c is not None and not clip_ratio_c > 1:
        raise ValueError(f"clip_ratio_c (dual clip) must be > 1, got {clip_ratio_c}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {sorted(KL_ESTIMATORS)}, got {kl_estimator!r}")
    if not (math.isfinite(entropy_coeff) and entropy_coeff >= 0):
        raise ValueError(f"entropy_coeff must be a finite number >= 0, got {entropy_coeff}")
    if entropy_coeff > 0 and (entropy is None or entropy.shape != logp.shape):
        raise ValueError(f"an entropy bonus (entropy_coeff {entropy_coeff}) needs the entropy at every position, "
                         f"shaped as logp {tuple(logp.shape)}; got "
                         f"{None if entropy is None else tuple(entropy.shape)}")
    if normalization == "constant" and not (max_tokens is not None and max_tokens >= 1):
        raise ValueError(f"normalization 'constant' divides by max_tokens, the response length limit: give one "
                         f">= 1, got {max_tokens}")
    mask = mask.to(logp.dtype)
    log_ratio = logp - old_logp  # [B, T]
    if ratio_level == "sequence":  # mean over the response's tokens, the same for each of them
        log_ratio = ((log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).expand_as(logp)
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None].to(logp.dtype)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if clip_ratio_c is not None:  # (-c * A > 0 where A < 0)
        per_token = torch.where(adv < 0, torch.minimum(per_token, -clip_ratio_c * adv), per_token)

    def normalised(per_token: torch.Tensor) -> torch.Tensor:
        if normalization == "token":
            return (per_token * mask).sum() / (total_tokens if total_tokens is not None else mask.sum().clamp(min=1))
        per_seq = (per_token * mask).sum(1)
        per_seq = per_seq / (max_tokens if normalization == "constant" else mask.sum(1).clamp(min=1))
        return per_seq.sum() / (total_sequences if total_sequences is not None else per_seq.numel())

    extra_terms = entropy_coeff > 0 or (ref_logp is not None and kl_beta > 0)
    pg_loss = float(normalised(per_token.detach())) if extra_terms else None
    if entropy_coeff > 0:
        per_token = per_token - entropy_coeff * entropy.to(logp.dtype)
    kl_value = torch.zeros((), dtype=logp.dtype)
    if ref_logp is not None and kl_beta > 0:
        kl_tok = k3_kl(logp, ref_logp)
        penalty = kl_tok if kl_estimator == "k3" else KL_ESTIMATORS[kl_estimator](logp, ref_logp)
        per_token = per_token + kl_beta * penalty
        kl_value = (kl_tok.detach() * mask).sum() / mask.sum().clamp(min=1)
    loss = normalised(per_token)
    with torch.no_grad():
        is_clipped = ((ratio < 1 - clip_low) & (adv < 0)) | ((ratio > 1 + clip_high) & (adv > 0))
        if clip_ratio_c is not None:
            is_clipped |= (ratio > clip_ratio_c) & (adv < 0)
        n = mask.sum().clamp(min=1)
        clip_fraction = float((is_clipped.to(mask.dtype) * mask).sum() / n)
        ratio_mean = float((ratio * mask).sum() / n)
    return LossOutput(loss, clip_fraction, ratio_mean, float(kl_value.detach()),
                      float(loss.detach()) if pg_loss is None else pg_loss)
