"""The vanilla rollout engine: prefill once per prompt, then one token per response per forward.

It is the reference the speculative engine must match token for token, and the baseline it is
measured against. Every pipeline stage runs this same loop; the last stage samples and the tokens
are broadcast, so all stages agree on what was committed.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import torch

from specroll_mcore.config import SamplingConfig
from specroll_mcore.distill import TokenFeatures
from specroll_mcore.model import PolicyModel
from specroll_mcore.rollout.base import (FinishRules, RolloutOutput, RolloutState, check_tokenizer_fits,
                                         sample_rows, validate_prompts)
from specroll_mcore.sampling import top_distribution, upcast


class VanillaEngine:
    """Autoregressive sampling of P prompts x G samples with a KV cache and per-row finish."""

    def __init__(self, model: PolicyModel, eos_token_ids: Sequence[int] = (), tokenizer: Any = None,
                 max_prefill_tokens: int = 4096) -> None:
        if tokenizer is not None:
            check_tokenizer_fits(tokenizer, model.config.vocab_size)
        self.model = model
        self.eos_token_ids = list(eos_token_ids)
        self.tokenizer = tokenizer
        self.max_prefill_tokens = max_prefill_tokens

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
        model, cfg = self.model, self.model.config
        ids = validate_prompts(prompts, prompt_ids, cfg.vocab_size, cfg.max_position_embeddings)
        rules = FinishRules(sampling, self.eos_token_ids, self.tokenizer, cfg.max_position_embeddings)
        device = model.ctx.device
        t0 = time.perf_counter()

        # 1. Prefill each prompt once, share its cache with its G samples, sample the first tokens.
        state = RolloutState(model, prompts, ids, sampling, step, rules, extra_capacity=0)
        tokens, logp, hidden, logits = state.start(prompts, self.max_prefill_tokens)
        t_prefill = time.perf_counter() - t0
        active = state.slots
        collect = features_topk > 0 and logits is not None
        steps: list[tuple[torch.Tensor, ...]] = []  # per step: (slots, hidden, top ids, top probs) of its tokens
        forwards, per_step, t_step = 1, [], time.perf_counter()
        while True:
            # 2. Record the new tokens; finished responses leave the batch.
            if collect:  # what each new token was sampled from
                steps.append((active, upcast(hidden), *top_distribution(logits, features_topk)))
            keep = [state.append(slot, [tokens[r]], [logp[r]]) for r, slot in enumerate(active.tolist())]
            if forwards > 1:
                per_step.append({"active": active.numel(), "tokens": active.numel(),
                                 "seconds": time.perf_counter() - t_step})
            t_step = time.perf_counter()
            keep_t = torch.tensor(keep, dtype=torch.bool, device=device)
            active, tokens = active[keep_t], tokens[keep_t]
            if active.numel() == 0:
                break
            # 3. Decode: feed each active response's last token at its committed length.
            b = active.numel()
            meta = model.metadata(state.cache.lengths[active][:, None],
                                  torch.ones(b, 1, 1, dtype=torch.bool, device=device), state.cache, active)
            out = model(tokens[:, None], meta, return_hidden=collect)
            state.cache.commit(active, torch.ones(b, dtype=torch.long, device=device))
            forwards += 1
            if collect:
                out, hidden = out[0], out[1][0]
            logits = model.full_logits(out[:, 0]) if out is not None else None
            positions = torch.tensor([len(state.responses[s]) for s in active.tolist()], device=device)
            tokens, logp = sample_rows(model, logits, state.keys(active, positions), sampling)

        elapsed = time.perf_counter() - t0
        num_tokens = sum(len(r) for r in state.responses)
        feats = self._features(steps, state.num) if collect else None
        return state.output({"engine": "vanilla", "forwards": forwards, "tokens": num_tokens,
                             "prefill_s": t_prefill, "total_s": elapsed,
                             "tokens_per_s": num_tokens / max(elapsed, 1e-9), "per_step": per_step}, feats)

    @staticmethod
    def _features(steps: list[tuple[torch.Tensor, ...]], num: int) -> list[TokenFeatures]:
        """Per-step features -> per response, in token order (a response takes one token per step it
        is active in, so its rows in step order are its tokens' rows)."""
        slots, *cols = (torch.cat(c) for c in zip(*steps))
        order = torch.argsort(slots, stable=True)
        rows = torch.bincount(slots, minlength=num).tolist()
        return [TokenFeatures(*parts) for parts in zip(*(c[order].split(rows) for c in cols))]
