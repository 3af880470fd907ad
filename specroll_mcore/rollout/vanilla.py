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
from specroll_mcore.rollout.base import (FinishRules, RolloutOutput, check_tokenizer_fits, prefill,
                                         sample_rows, validate_prompts)
from specroll_mcore.sampling import SampleKeys


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
        G, P = sampling.num_samples, len(prompts)
        n = P * G
        t0 = time.perf_counter()

        # 1. Prefill each prompt once, then share its cache with its G samples.
        capacity = max(len(p) + rules.limit(len(p)) for p in prompts)
        cache = model.new_cache(num_slots=n, capacity=capacity)
        last_logits = prefill(model, cache, prompts, self.max_prefill_tokens)  # slots 0..P-1
        slot_of = torch.arange(n, device=device)
        prompt_of = slot_of // G
        cache.copy_slots(prompt_of.flip(0), slot_of.flip(0))  # high slots first: sources stay intact
        prompt_len = [len(prompts[int(p)]) for p in prompt_of]
        t_prefill = time.perf_counter() - t0

        # 2. First token of every response, from the prompt's last-position logits.
        key_prompt = torch.tensor(ids, device=device)[prompt_of]
        key_sample = slot_of % G
        keys = SampleKeys(sampling.seed, step, key_prompt, key_sample, torch.zeros_like(slot_of))
        logits = last_logits[prompt_of] if last_logits is not None else None
        tokens, logp = sample_rows(model, logits, keys, sampling)

        responses: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[torch.Tensor]] = [[] for _ in range(n)]
        finish: list[Optional[str]] = [None] * n
        active = slot_of
        forwards = 1
        while True:
            # 3. Record the new tokens and retire finished rows.
            keep = []
            for r, slot in enumerate(active.tolist()):
                responses[slot].append(int(tokens[r]))
                logprobs[slot].append(logp[r])
                finish[slot] = rules.check(responses[slot], prompt_len[slot])
                keep.append(finish[slot] is None)
            keep_t = torch.tensor(keep, dtype=torch.bool, device=device)
            active, tokens = active[keep_t], tokens[keep_t]
            if active.numel() == 0:
                break
            # 4. Decode: feed each active row's last token at its committed length.
            b = active.numel()
            positions = cache.lengths[active][:, None]
            meta = model.metadata(positions, torch.ones(b, 1, 1, dtype=torch.bool, device=device),
                                  cache, active)
            out = model(tokens[:, None], meta)
            cache.commit(active, torch.ones(b, dtype=torch.long, device=device))
            forwards += 1
            logits = model.full_logits(out[:, 0]) if out is not None else None
            keys = SampleKeys(sampling.seed, step, key_prompt[active], key_sample[active],
                              torch.tensor([len(responses[s]) for s in active.tolist()], device=device))
            tokens, logp = sample_rows(model, logits, keys, sampling)

        elapsed = time.perf_counter() - t0
        num_tokens = sum(len(r) for r in responses)
        return RolloutOutput(
            prompt_index=[ids[int(p)] for p in prompt_of],
            sample_index=key_sample.tolist(),
            tokens=responses,
            logprobs=[torch.stack(lp) if lp else torch.zeros(0) for lp in logprobs],
            finish_reason=[str(f) for f in finish],
            stats={"engine": "vanilla", "forwards": forwards, "tokens": num_tokens,
                   "prefill_s": t_prefill, "total_s": elapsed,
                   "tokens_per_s": num_tokens / max(elapsed, 1e-9)},
        )
