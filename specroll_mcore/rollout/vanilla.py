"""The vanilla rollout engine: prefill once per prompt, then one token per response per forward.

It is the reference the speculative engine must match token for token, and the baseline it is
measured against. Every pipeline stage runs this same loop; the last stage samples and the tokens
are broadcast, so all stages agree on what was committed. Under pipeline parallelism the responses
go in groups, one per stage, whose forwards interleave over the stages (base.run_groups). With
``max_num_seqs`` the rollout is continuously batched: where responses finish, a group takes waiting
responses in, their prompts prefilled in its next forward before its decoding step (every stage
runs the same forwards in the same order, so the stages' sends and receives stay paired).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from specroll_mcore.config import SamplingConfig, check_max_num_seqs, check_max_prefill_tokens
from specroll_mcore.distill import TokenFeatures
from specroll_mcore.model import PolicyModel
from specroll_mcore.rollout.base import (FinishRules, RolloutOutput, RolloutState, check_tokenizer_fits,
                                         keep_rows, num_groups, plan_rows, run_groups, run_order,
                                         sample_rows, split_groups, validate_prompts)
from specroll_mcore.sampling import top_distribution, upcast


@dataclass
class _DecodeGroup:
    """One group of responses decoded together (see :func:`run_groups`)."""

    slots: torch.Tensor  # the group's unfinished responses
    last: torch.Tensor  # their last tokens, fed next
    out: Any = None  # the forward's output, until the group advances
    seconds: float = 0.0  # the forward's time
    pending: list[int] = field(default_factory=list)  # responses joining it: prompts prefilled in its next forward
    prefilled: Any = None  # that prefill's output (RolloutState.prefill), until the group advances

    def alive(self) -> bool:
        return self.slots.numel() > 0 or bool(self.pending)


class VanillaEngine:
    """Autoregressive sampling of P prompts x G samples with a KV cache and per-row finish.

    ``pipeline_groups``: how many groups of responses a rollout interleaves over the pipeline
    stages (:func:`run_groups`; None: one per stage, which keeps every stage busy; 1: the whole
    batch per forward, stages one after another). ``max_num_seqs``: the most responses decoded at
    once (None: all of a call's), a waiting response starting as soon as a finished one leaves it
    room (continuous batching, :class:`RolloutState`). Tokens depend on neither."""

    def __init__(self, model: PolicyModel, eos_token_ids: Sequence[int] = (), tokenizer: Any = None,
                 max_prefill_tokens: int = 4096, pipeline_groups: Optional[int] = None,
                 max_num_seqs: Optional[int] = None) -> None:
        if tokenizer is not None:
            check_tokenizer_fits(tokenizer, model.config.vocab_size)
        self.model = model
        self.eos_token_ids = list(eos_token_ids)
        self.tokenizer = tokenizer
        self.max_prefill_tokens = check_max_prefill_tokens(max_prefill_tokens)
        self.groups = num_groups(pipeline_groups, model.ctx.pp_size)
        self.max_num_seqs = check_max_num_seqs(max_num_seqs)

    def held_out(self) -> contextlib.AbstractContextManager:
        """As :meth:`SpeculativeEngine.held_out`; this engine keeps nothing from one rollout to the next."""
        return contextlib.nullcontext()

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, step: int = 0,
                 prompt_ids: Optional[Sequence[int]] = None, features_topk: int = 0) -> RolloutOutput:
        """Sample ``sampling.num_samples`` responses for each tokenized prompt.

        ``step`` (the rollout / RL step) and ``prompt_ids`` (stable ids, e.g. dataset indices) key
        the sampling noise together with the seed, the sample index and the position, so a response
        does not depend on which other prompts share the batch or in which order.
        ``features_topk`` > 0 also returns, on the last stage, each token's :class:`TokenFeatures`
        with the policy's top-``features_topk`` distribution (the hidden states and logits are
        computed anyway; keeping them spares head distillation a second forward).
        """
        if features_topk < 0 or features_topk > self.model.config.vocab_size:
            raise ValueError(f"features_topk must be in [0, vocab size {self.model.config.vocab_size}], "
                             f"got {features_topk}")
        cfg = self.model.config
        ids = validate_prompts(prompts, prompt_ids, cfg.vocab_size, cfg.max_position_embeddings)
        rules = FinishRules(sampling, self.eos_token_ids, self.tokenizer, cfg.max_position_embeddings)
        rows = plan_rows(self.model, prompts, sampling, rules, 0, self.max_num_seqs)
        with self.model.expert_lockstep():  # (expert parallelism: forwards in step with the EP group)
            return self._rollout(prompts, sampling, step, ids, rules, features_topk, rows)

    def _rollout(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, step: int, ids: list[int],
                 rules: FinishRules, features_topk: int, rows: int) -> RolloutOutput:
        model = self.model
        device = model.ctx.device
        t0 = time.perf_counter()

        # 1. Prefill each prompt that fits once, share its cache with its G samples, sample the first tokens.
        state = RolloutState(model, prompts, ids, sampling, step, rules, extra_capacity=0, rows=rows)
        first, tokens, logp, hidden, logits = state.start(self.max_prefill_tokens)
        t_prefill = time.perf_counter() - t0
        collect = features_topk > 0 and logits is not None
        steps: list[tuple[torch.Tensor, ...]] = []  # per step: (slots, hidden, top ids, top probs) of its tokens
        per_step: list[dict[str, Any]] = []
        forwards = 1  # (prefill)

        def record(slots: torch.Tensor, tokens: torch.Tensor, logp: torch.Tensor, hidden: Optional[torch.Tensor],
                   logits: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            """Record one new token per row; returns the rows that go on and their tokens."""
            if collect:  # what each new token was sampled from
                steps.append((slots, upcast(hidden), *top_distribution(logits, features_topk)))
            new = tokens.tolist()  # (one transfer, not one per row)
            keep = [state.append(slot, [new[r]], [logp[r]]) for r, slot in enumerate(slots.tolist())]
            return keep_rows(keep, slots, tokens)

        # 2. Decode in groups: feed each unfinished response's last token at its committed length.
        # Where responses finish, waiting ones take their rows (their prompts prefilled in the group's next
        # forward, or copied from a row that holds them).
        def join(slots: torch.Tensor, last: torch.Tensor, joining: list[int], prefilled: Optional[tuple] = None):
            """``slots`` (last tokens ``last``) with ``joining`` responses, whose first tokens are sampled
            (from their prompts' ``prefilled`` output, or the logits kept of it) and recorded."""
            new, tokens = record(*state.first_tokens(joining, prefilled))
            return torch.cat([slots, new]), torch.cat([last, tokens])

        def admit(g: _DecodeGroup, slots: torch.Tensor, last: torch.Tensor) -> None:
            """The group goes on with ``slots`` (last tokens ``last``) and the waiting responses that
            take free rows: those joining now with their first tokens, the others after its next forward."""
            joined, g.pending = state.admit()
            if joined:
                slots, last = join(slots, last, joined)
            g.slots, g.last = run_order(state.cache, model.ctx, slots, last)

        active, tokens = record(first, tokens, logp, hidden, logits)
        groups = []
        for i, slots in enumerate(split_groups(active, self.groups)):
            groups.append(_DecodeGroup(slots, tokens[active % self.groups == i]))
            admit(groups[-1], groups[-1].slots, groups[-1].last)  # (rows the first tokens freed)

        def forward(i: int) -> None:
            nonlocal forwards, t_prefill
            g = groups[i]
            if g.pending:
                t = time.perf_counter()
                g.prefilled = state.prefill(g.pending, self.max_prefill_tokens)
                t_prefill, forwards = t_prefill + time.perf_counter() - t, forwards + 1
            b, t = g.slots.numel(), time.perf_counter()
            if b > 0:
                meta = model.metadata(state.cache.lengths[g.slots][:, None],
                                      torch.ones(b, 1, 1, dtype=torch.bool, device=device), state.cache, g.slots)
                g.out = model(g.last[:, None], meta, return_hidden=collect)
                state.cache.commit(g.slots, torch.ones(b, dtype=torch.long, device=device))
                forwards += 1
            g.seconds = time.perf_counter() - t

        def advance(i: int) -> None:
            g, t = groups[i], time.perf_counter()
            slots, last = g.slots[:0], g.last[:0]
            if g.slots.numel() > 0:
                out, hidden = (g.out[0], g.out[1][0]) if collect else (g.out, None)
                logits = model.full_logits(out[:, 0]) if out is not None else None
                tokens, logp = sample_rows(model, logits, state.keys(g.slots, state.positions(g.slots)), sampling)
                per_step.append({"active": g.slots.numel(), "tokens": g.slots.numel(),
                                 "seconds": g.seconds + time.perf_counter() - t})
                slots, last = record(g.slots, tokens, logp, hidden, logits)
            if g.pending:  # the responses whose prompts it prefilled
                slots, last = join(slots, last, g.pending, g.prefilled)
            g.prefilled = g.out = None
            admit(g, slots, last)

        run_groups(lambda i: groups[i].alive(), self.groups, model.ctx, forward, advance, model.lockstep_barrier)

        elapsed = time.perf_counter() - t0
        num_tokens = sum(len(r) for r in state.responses)
        feats = self._features(steps, state.num) if collect else None
        return state.output({"engine": "vanilla", "forwards": forwards, "tokens": num_tokens,
                             "prefill_s": t_prefill, "total_s": elapsed, "groups": self.groups,
                             "tokens_per_s": num_tokens / max(elapsed, 1e-9), "per_step": per_step}, feats)

    @staticmethod
    def _features(steps: list[tuple[torch.Tensor, ...]], num: int) -> list[TokenFeatures]:
        """Per-step features -> per response, in token order (a response takes one token per step it
        is active in, so its rows in step order are its tokens' rows)."""
        slots, *cols = (torch.cat(c) for c in zip(*steps))
        order = torch.argsort(slots, stable=True)
        rows = torch.bincount(slots, minlength=num).tolist()
        return [TokenFeatures(*parts) for parts in zip(*(c[order].split(rows) for c in cols))]
