"""Real policy drift for the adaptation benchmarks: supervised fine-tuning steps on worked solutions
of the offline GSM8K-style problems, in a style the policy does not write by itself.

Styles: ``solutions`` (as written), ``upper`` (in capitals: other tokens than the ones the heads were
fitted on) and ``reversed`` (every word spelled backwards: token sequences no English text has, a
stress test for stale heads). Only the backbone moves (AdamW, gradient clipping at 1); the heads are
frozen, as between two slow-path events. Used by tools/bench_drift.py and tools/ablate_reflex.py.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from specroll_mcore.model import PolicyModel
from specroll_mcore.rl.data import chat_prompt_ids
from specroll_mcore.rl.schedule import (MicroBatch, finalize_grads, forward_backward, forward_logprobs,
                                       pack_micro_batch, update_multiple)
from specroll_mcore.rl.synthetic import problems

STYLES: dict[str, Callable[[str], str]] = {
    "solutions": lambda text: text,
    "upper": str.upper,
    "reversed": lambda text: "\n".join(" ".join(w[::-1] for w in line.split(" ")) for line in text.split("\n")),
}


def sft_batches(tok: Any, n: int, seed: int, batch: int, device: torch.device, style: str,
                multiple: int = 1) -> list[MicroBatch]:
    """Chat prompt + worked solution (in ``style``) + EOS for ``n`` problems, ``batch`` per micro-batch
    (padded to a multiple of ``multiple`` positions: schedule.update_multiple); the loss covers the
    solution tokens."""
    if style not in STYLES:
        raise ValueError(f"unknown drift style {style!r}; choose one of {sorted(STYLES)}")
    seqs = []
    for p in problems(n, seed=seed):
        text = STYLES[style](p.solution)
        seqs.append((chat_prompt_ids(tok, p.question),
                     tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id], None, 0.0))
    return [pack_micro_batch(seqs[s:s + batch], device, multiple) for s in range(0, len(seqs), batch)]


def nll(mb: MicroBatch, logp: torch.Tensor):
    """Mean negative log-likelihood of the solution tokens (a schedule loss function)."""
    loss = -(logp * mb.loss_mask).sum() / mb.loss_mask.sum()
    return loss, {"nll": float(loss.detach())}


class SFTDrift:
    """Moves ``policy``'s backbone one optimizer step at a time: step i trains on micro-batch
    ``i mod steps`` of ``steps`` micro-batches of ``batch`` solutions (seed 4242); :meth:`held_nll`
    is the loss on 16 held-out solutions (seed 9999), the drift measure."""

    def __init__(self, policy: PolicyModel, tok: Any, style: str, lr: float, batch: int, steps: int) -> None:
        if steps < 0 or batch < 1 or not lr > 0:
            raise ValueError(f"drift needs steps >= 0, batch >= 1 and lr > 0, got {steps}, {batch}, {lr}")
        self.policy = policy
        device, multiple = policy.ctx.device, update_multiple(policy.ctx)
        self.train = sft_batches(tok, steps * batch, 4242, batch, device, style, multiple)
        self.held = sft_batches(tok, 16, 9999, 8, device, style, multiple)
        for p in policy.heads.parameters() if policy.heads is not None else ():
            p.requires_grad_(False)
        self.params = list(policy.gpt.parameters())
        for p in self.params:
            p.requires_grad_(True)
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0)
        self.steps_done = 0

    def step(self) -> None:
        if not self.train:
            raise RuntimeError("this drift was built for 0 steps")
        self.opt.zero_grad(set_to_none=True)
        forward_backward(self.policy, [self.train[self.steps_done % len(self.train)]], nll, 1.0)
        finalize_grads(self.policy)
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.steps_done += 1

    def held_nll(self) -> float:
        with torch.no_grad():
            lps = forward_logprobs(self.policy, self.held, 1.0)
        return sum(float(nll(mb, lp)[0]) for mb, lp in zip(self.held, lps)) / len(self.held)
