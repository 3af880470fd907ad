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
from specroll_mcore.model import PolicyModel
from specroll_mcore.rollout.base import (FinishRules, RolloutOutput, RolloutState, check_tokenizer_fits,
                                         sample_rows, validate_prompts)


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
                 prompt_ids: Optional[Sequence[int]] = None) -> RolloutOutput:
        """Sample ``sampling.num_samples`` responses for each tokenized prompt.

        ``step`` (the rollout / RL step) and ``prompt_ids`` (stable ids, e.g. dataset indices) key
        the sampling noise together with the seed, the sample index and the position, so a response
        does not depend on which other prompts share the batch or in which order.
        """
        model, cfg = self.model, self.model.config
        ids = validate_prompts(prompts, prompt_ids, cfg.vocab_size, cfg.max_position_embeddings)
        rules = FinishRules(sampling, self.eos_token_ids, self.tokenizer, cfg.max_position_embeddings)
        device = model.ctx.device
        t0 = time.perf_counter()

        # 1. Prefill each prompt once, share its cache with its G samples, sample the first tokens.
        state = RolloutState(model, prompts, ids, sampling, step, rules, extra_capacity=0)
        tokens, logp, _ = state.start(prompts, self.max_prefill_tokens)
        t_prefill = time.perf_counter() - t0
        active = state.slots
        forwards, per_step, t_step = 1, [], time.perf_counter()
        while True:
            # 2. Record the new tokens; finished responses leave the batch.
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
            out = model(tokens[:, None], meta)
            state.cache.commit(active, torch.ones(b, dtype=torch.long, device=device))
            forwards += 1
            logits = model.full_logits(out[:, 0]) if out is not None else None
            positions = torch.tensor([len(state.responses[s]) for s in active.tolist()], device=device)
            tokens, logp = sample_rows(model, logits, state.keys(active, positions), sampling)

        elapsed = time.perf_counter() - t0
        num_tokens = sum(len(r) for r in state.responses)
        return state.output({"engine": "vanilla", "forwards": forwards, "tokens": num_tokens,
                             "prefill_s": t_prefill, "total_s": elapsed,
                             "tokens_per_s": num_tokens / max(elapsed, 1e-9), "per_step": per_step})
