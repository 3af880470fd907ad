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

from specroll_mcore.model import PolicyModel


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
    return DistillRecords(features.hidden.float(), ids, features.top_ids[at], features.top_probs[at].float(),
                          ids[at], ahead < n)


def draft_path(rec: "DistillRecords") -> torch.Tensor:
    """[N, H-1]: the tokens head i reads as its path (the first i), x_{t+2} .. x_{t+H}: realised
    tokens of the earlier heads' targets. Records of the slow path have the same layout."""
    return rec.realised[:, :-1]


def head_loss(policy: PolicyModel, rec: DistillRecords) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean over valid (position, head) pairs of soft CE to the policy's top-K plus NLL of the realised token."""
    logits = policy.full_logits(policy.head_logits(rec.hidden.to(policy.dtype), rec.root, path_ids=draft_path(rec)))
    logq = torch.log_softmax(logits.float(), -1)
    logq = logq.transpose(0, 1)  # [N, H, V]
    soft = -(rec.target_probs * logq.gather(-1, rec.target_ids)).sum(-1)  # [N, H]
    nll = -logq.gather(-1, rec.realised[..., None])[..., 0]
    w = rec.valid.float()
    loss = ((soft + nll) * w).sum() / w.sum().clamp(min=1)
    return loss, {"soft_ce": float((soft * w).sum() / w.sum()), "nll": float((nll * w).sum() / w.sum())}


@torch.no_grad()
def head_accuracy(policy: PolicyModel, rec: DistillRecords, k: int = 5, batch: int = 256) -> dict[str, list[float]]:
    """Per head: top-1 and top-k accuracy against the realised token, and top-1 agreement with the
    policy's own most likely token."""
    H = rec.valid.shape[1]
    hit1, hitk, agree, count = torch.zeros(H), torch.zeros(H), torch.zeros(H), torch.zeros(H)
    for s in range(0, len(rec), batch):
        r = rec.subset(torch.arange(s, min(len(rec), s + batch)))
        logits = policy.full_logits(policy.head_logits(r.hidden.to(policy.dtype), r.root, path_ids=draft_path(r)))
        top = logits.topk(k, -1).indices.transpose(0, 1)
        w = r.valid.float()
        hit1 += ((top[..., 0] == r.realised).float() * w).sum(0)
        hitk += ((top == r.realised[..., None]).any(-1).float() * w).sum(0)
        agree += ((top[..., 0] == r.target_ids[..., 0]).float() * w).sum(0)
        count += w.sum(0)
    c = count.clamp(min=1)
    return {"top1": (hit1 / c).tolist(), f"top{k}": (hitk / c).tolist(), "agree_policy_top1": (agree / c).tolist()}


def train_heads_step(policy: PolicyModel, optimizer: torch.optim.Optimizer, rec: DistillRecords,
                     grad_clip: float = 1.0) -> dict[str, float]:
    policy.heads.train()
    optimizer.zero_grad(set_to_none=True)
    loss, parts = head_loss(policy, rec)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.heads.parameters(), grad_clip)
    optimizer.step()
    policy.heads.eval()
    return {"loss": float(loss), **parts}


def freeze_all_but_heads(policy: PolicyModel) -> list[torch.nn.Parameter]:
    for p in policy.gpt.parameters():
        p.requires_grad_(False)
    params = list(policy.heads.parameters())
    for p in params:
        p.requires_grad_(True)
    return params


def full_head_state(policy: PolicyModel) -> dict[str, torch.Tensor]:
    """Unsharded head weights (the TP=1 layout), on every TP rank of the last stage (a TP collective:
    each ``layers.{i}.weight`` is column-parallel, [h/tp, h] per rank, gathered along its rows)."""
    out = {}
    for k, v in policy.heads.state_dict().items():
        if k.endswith("_extra_state") or v is None:
            continue
        v = v.detach()
        if policy.ctx.tp_size > 1:
            v = policy.ctx.all_gather_tp(v).reshape(-1, *v.shape[1:])
        out[f"heads.{k}"] = v.clone().cpu()
    return out
