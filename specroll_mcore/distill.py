"""Head warm-start by self-distillation on the policy's own continuations (backbone frozen).

For a response x the policy sampled, its hidden state h_t and its next-token distributions p_t
are the ones sampling computed (:class:`TokenFeatures`, returned by the vanilla engine with
``features_topk``: no second forward). Head h (1..H) at position t is trained towards the
policy's distribution for token t+h+1, i.e. p_{t+h}, and the token actually realised there:

    loss_h(t) = CE(p_{t+h}^topK, q_h(. | h_t, x_{t+1} .. x_{t+h})) + NLL(x_{t+h+1} | q_h(. | h_t, x_{t+1} .. x_{t+h}))

(the soft cross-entropy on the policy's top-K equals the KL to it up to a constant). Head h reads
the realised tokens between the root and its target as its draft path (teacher forcing: at
inference it reads the drafted tokens of the node it extends, which match these whenever that node
can be accepted). Only the head weights receive gradients; the backbone and the shared vocab
projection are frozen. Records are plain tensors, so the slow path can reuse this loss on
verification by-products.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import torch

from specroll_mcore.checkpoint.shard import unshard_tensor
from specroll_mcore.heads import vocab_parallel_log_probs, vocab_parallel_topk
from specroll_mcore.model import PolicyModel
from specroll_mcore.optimizer import MainParamAdamW
from specroll_mcore.parallel import average_grads_dp, clip_grads, grad_sq_norm
from specroll_mcore.sampling import upcast


@dataclass
class TokenFeatures:
    """For each token of one response, the policy's state at the position it was sampled from:
    the final hidden state and the top-K of the policy's own next-token distribution (temperature 1,
    no top-k / top-p filter). Row i belongs to response token i. Head distillation
    (:func:`records_from_features`) needs nothing else."""

    hidden: torch.Tensor  # [len, h]
    top_ids: torch.Tensor  # [len, K]
    top_probs: torch.Tensor  # [len, K]


@dataclass
class DistillRecords:
    """N training positions for H heads."""

    hidden: torch.Tensor  # [N, h] the policy's final hidden state at t
    root: torch.Tensor  # [N] x_{t+1}, the token sampled from it
    target_ids: torch.Tensor  # [N, H, K] top-K ids of p_{t+h}
    target_probs: torch.Tensor  # [N, H, K] their probabilities
    realised: torch.Tensor  # [N, H] x_{t+h+1}
    valid: torch.Tensor  # [N, H] bool: t+h+1 inside the sequence

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def subset(self, idx: torch.Tensor) -> "DistillRecords":
        return DistillRecords(*(getattr(self, f.name)[idx] for f in fields(DistillRecords)))

    @staticmethod
    def cat(parts: Sequence["DistillRecords"]) -> "DistillRecords":
        return DistillRecords(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(DistillRecords)))


def records_from_features(features: TokenFeatures, tokens: Sequence[int], num_heads: int) -> DistillRecords:
    """Records for every token of one response from what the policy computed while sampling it.

    Row i of ``features`` is the position t that sampled response token i (x_{t+1}); head h's target
    there is row i+h's distribution (p_{t+h}) and its realised token is response token i+h."""
    n = len(tokens)
    if features.hidden.shape[0] != n:
        raise ValueError(f"{features.hidden.shape[0]} feature rows for a response of {n} tokens: "
                         "pass the features that came with these tokens")
    device = features.hidden.device
    ids = torch.as_tensor(list(tokens), dtype=torch.long, device=device)
    ahead = torch.arange(n, device=device)[:, None] + torch.arange(1, num_heads + 1, device=device)[None]  # i+h
    at = ahead.clamp(max=n - 1)
    return DistillRecords(upcast(features.hidden), ids, features.top_ids[at], upcast(features.top_probs[at]),
                          ids[at], ahead < n)


def draft_path(rec: "DistillRecords") -> torch.Tensor:
    """[N, H-1]: the tokens head i reads as its path (the first i), x_{t+2} .. x_{t+H}: realised
    tokens of the earlier heads' targets. Records of the slow path have the same layout."""
    return rec.realised[:, :-1]


def head_loss(policy: PolicyModel, rec: DistillRecords) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean over valid (position, head) pairs of soft CE to the policy's top-K plus NLL of the realised
    token. Vocab-parallel under TP (the log-softmax never gathers the vocabulary); every rank of a
    TP group returns the same loss and backpropagates into its own shard of the heads."""
    logits = policy.head_logits(rec.hidden.to(policy.dtype), rec.root, path_ids=draft_path(rec))  # [H, N, V/tp]
    ids = torch.cat([rec.target_ids, rec.realised[..., None]], -1).transpose(0, 1)  # [H, N, K + 1]
    logq = vocab_parallel_log_probs(logits, ids, policy.vocab_start, policy.config.vocab_size, policy.ctx)
    logq = logq.transpose(0, 1)  # [N, H, K + 1]
    soft = -(rec.target_probs * logq[..., :-1]).sum(-1)  # [N, H]
    nll = -logq[..., -1]
    w = rec.valid.float()
    loss = ((soft + nll) * w).sum() / w.sum().clamp(min=1)
    with torch.no_grad():
        parts = {"soft_ce": float((soft * w).sum() / w.sum()), "nll": float((nll * w).sum() / w.sum())}
    return loss, parts


@torch.no_grad()
def head_accuracy(policy: PolicyModel, rec: DistillRecords, k: int = 5, batch: int = 256) -> dict[str, list[float]]:
    """Per head: top-1 and top-k accuracy against the realised token, and top-1 agreement with the
    policy's own most likely token. Vocab-parallel top-k under TP; counts are summed over the
    data-parallel replicas (each holds its own records), so every replica reports the same figures."""
    H = rec.valid.shape[1]
    counts = torch.zeros(4, H, dtype=torch.float64)  # top-1 hits, top-k hits, agreement, positions
    for s in range(0, len(rec), batch):
        r = rec.subset(torch.arange(s, min(len(rec), s + batch)))
        logits = policy.head_logits(r.hidden.to(policy.dtype), r.root, path_ids=draft_path(r))  # [H, n, V/tp]
        top = vocab_parallel_topk(logits.flatten(0, 1), k, policy.vocab_start, policy.config.vocab_size,
                                  policy.ctx)[1].view(H, -1, k).transpose(0, 1).to(r.realised.device)  # [n, H, k]
        w = r.valid.double()
        counts[0] += ((top[..., 0] == r.realised).double() * w).sum(0).cpu()
        counts[1] += ((top == r.realised[..., None]).any(-1).double() * w).sum(0).cpu()
        counts[2] += ((top[..., 0] == r.target_ids[..., 0]).double() * w).sum(0).cpu()
        counts[3] += w.sum(0).cpu()
    counts = policy.ctx.all_reduce_dp(counts)
    hit1, hitk, agree, c = counts[0], counts[1], counts[2], counts[3].clamp(min=1)
    return {"top1": (hit1 / c).tolist(), f"top{k}": (hitk / c).tolist(), "agree_policy_top1": (agree / c).tolist()}


def train_heads_step(policy: PolicyModel, optimizer: MainParamAdamW | torch.optim.Optimizer, rec: DistillRecords,
                     grad_clip: float = 1.0) -> dict[str, float]:
    """One optimizer step of the heads on ``rec`` (this replica's share of the batch). Gradients are
    averaged over the data-parallel replicas and clipped by their global norm over the TP shards,
    so every layout takes the step a single process would take on the whole batch."""
    ctx = policy.ctx
    policy.heads.train()
    optimizer.zero_grad(set_to_none=True)
    loss, parts = head_loss(policy, rec)
    loss.backward()
    params = list(policy.heads.parameters())
    average_grads_dp(params, ctx)
    norm = float(grad_sq_norm(params, ctx).sqrt())
    clip_grads(params, norm, grad_clip)
    optimizer.step()
    policy.heads.eval()
    stats = torch.tensor([float(loss.detach()), parts["soft_ce"], parts["nll"]], dtype=torch.float64)
    stats = ctx.all_reduce_dp(stats)
    stats /= ctx.dp_size
    return {"loss": float(stats[0]), "soft_ce": float(stats[1]), "nll": float(stats[2]), "grad_norm": norm}


def freeze_all_but_heads(policy: PolicyModel) -> list[torch.nn.Parameter]:
    for p in policy.gpt.parameters():
        p.requires_grad_(False)
    params = list(policy.heads.parameters())
    for p in params:
        p.requires_grad_(True)
    return params


def full_head_state(policy: PolicyModel) -> dict[str, torch.Tensor]:
    """Unsharded head weights (the TP=1 layout), on every TP rank of the last stage (a TP collective:
    each ``layers.{i}.weight`` is column-parallel, [h/tp, h] per rank, gathered along its rows; the
    replicated ``token_counts`` come back as they are; see checkpoint/shard.py)."""
    out = {}
    for k, v in policy.heads.state_dict().items():
        if k.endswith("_extra_state") or v is None:
            continue
        v = v.detach()
        if policy.ctx.tp_size > 1:
            v = unshard_tensor(f"heads.{k}", list(policy.ctx.all_gather_tp(v)), policy.config)
        out[f"heads.{k}"] = v.clone().cpu()
    return out
