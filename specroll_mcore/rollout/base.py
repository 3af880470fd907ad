"""What every rollout engine shares: the output record, input validation, finish rules, prefill."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from specroll_mcore.config import SamplingConfig
from specroll_mcore.distill import TokenFeatures
from specroll_mcore.model import PolicyModel, causal_mask
from specroll_mcore.model.kv_cache import KVCache
from specroll_mcore.sampling import SampleKeys, sample

FINISH_EOS, FINISH_STOP, FINISH_LENGTH = "eos", "stop", "length"


@dataclass
class RolloutOutput:
    """P prompts x G samples, one entry per response, ordered prompt-major (i * G + j)."""

    prompt_index: list[int]
    sample_index: list[int]
    tokens: list[list[int]]
    logprobs: list[torch.Tensor]
    """Per-token log-probs of the sampling distribution (float32 [len])."""
    finish_reason: list[str]
    stats: dict[str, Any] = field(default_factory=dict)
    features: Optional[list[TokenFeatures]] = None
    """Per response, what the policy computed where each token was sampled (engines that collect
    them, on the last stage; see :class:`TokenFeatures`)."""
    routing: Optional[list[torch.Tensor]] = None
    """Per response, the experts each token its rollout took in (the prompt and the response but its
    last token) was routed to at this stage's layers, [tokens, layers, topk] int16: kept where the policy
    records routing (``PolicyModel.record_routing``) for the update to replay (model/routing.py)."""

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def validate_prompts(prompts: Sequence[Sequence[int]], prompt_ids: Optional[Sequence[int]],
                     vocab_size: int, max_positions: int) -> list[int]:
    """Clear errors for bad rollout input; returns the prompt ids (defaults to 0..P-1)."""
    if len(prompts) == 0:
        raise ValueError("generate() got an empty prompt list; pass at least one tokenized prompt")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if len(p) >= max_positions:
            raise ValueError(f"prompt {i} has {len(p)} tokens but the context length "
                             f"(ModelConfig.max_position_embeddings) is {max_positions}; it must be "
                             f"at most {max_positions - 1} to leave room for one generated token")
        lo, hi = min(p), max(p)
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"prompt {i} has token id {hi if hi >= vocab_size else lo} outside the "
                             f"model vocabulary [0, {vocab_size}); was it tokenized for another model?")
    if prompt_ids is None:
        return list(range(len(prompts)))
    if len(prompt_ids) != len(prompts):
        raise ValueError(f"prompt_ids has {len(prompt_ids)} entries for {len(prompts)} prompts")
    if len(set(prompt_ids)) != len(prompt_ids):
        raise ValueError("prompt_ids must be unique: they key the sampling noise of each prompt")
    return list(prompt_ids)


def check_tokenizer_fits(tokenizer: Any, vocab_size: int) -> None:
    """A tokenizer may have fewer ids than the model (padding), never more."""
    n = len(tokenizer)
    if n > vocab_size:
        raise ValueError(f"the tokenizer has {n} tokens but the model's vocabulary "
                         f"(ModelConfig.vocab_size) is {vocab_size}: they do not belong together")


class FinishRules:
    """EOS, stop strings, the length limit and the context limit, applied token by token."""

    def __init__(self, sampling: SamplingConfig, eos_token_ids: Sequence[int], tokenizer: Any,
                 max_positions: int) -> None:
        if sampling.stop and tokenizer is None:
            raise ValueError("SamplingConfig.stop needs a tokenizer to match text; pass tokenizer=")
        self.sampling = sampling
        self.eos = set() if sampling.ignore_eos else set(int(t) for t in eos_token_ids)
        self.tokenizer = tokenizer
        self.max_positions = max_positions
        self._window = max((len(s) for s in sampling.stop), default=0) + 4

    def limit(self, prompt_len: int) -> int:
        """Most tokens a response of this prompt may have."""
        return min(self.sampling.max_new_tokens, self.max_positions - prompt_len)

    def check(self, response: list[int], prompt_len: int) -> Optional[str]:
        """Finish reason after the response's last token, or None to go on."""
        if response[-1] in self.eos:
            return FINISH_EOS
        if self.sampling.stop:
            tail = self.tokenizer.decode(response[-self._window:])
            if any(s in tail for s in self.sampling.stop):
                return FINISH_STOP
        if len(response) >= self.limit(prompt_len):
            return FINISH_LENGTH
        return None


STEP_BYTES_PER_ID = 48
"""A bound on the memory a decoding or verification step takes beyond the KV cache, per token it
samples and vocabulary id: the logits (float32, gathered over the tensor-parallel ranks, with this
rank's shard) and the sampler's working tensors on them (the noise's int64 hashes and float64
uniforms, the filtered logits, their log-softmax; a top-p sort). Measured on torch's path (a GPU's,
run on a CPU with the noise in one pass and top-p over whole rows): 20-24 bytes at T = 1, 26-30 with
top-p, for whole vanilla and speculative rollouts of a model with 32768 ids
(tests/unit/test_continuous_batching.py); the rest leaves room for a GPU sort's scratch space. For
Qwen2.5's 152k ids that is 7.3 MB a sampled token: 1.9 GB for 256 responses decoded plainly, a tree
step of 1024 tokens four times as much, against a KV cache of tens of GB."""


def step_memory(model: PolicyModel, tokens: int) -> int:
    """Bytes a step sampling ``tokens`` tokens takes beyond the KV cache on this rank
    (:data:`STEP_BYTES_PER_ID`): on the last pipeline stage, which projects onto the vocabulary and
    samples; 0 on the others."""
    return tokens * model.config.vocab_size * STEP_BYTES_PER_ID if model.ctx.is_last_stage else 0


def plan_rows(model: PolicyModel, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, rules: FinishRules,
              extra_capacity: int, max_num_seqs: Optional[int],
              step_tokens: Callable[[int], int] = lambda rows: rows) -> int:
    """The rows of a rollout's KV cache: every response's, or with ``max_num_seqs`` (vLLM's name: the
    most responses in flight) at most that many, the rollout then continuously batched
    (:class:`RolloutState`: a waiting response takes the row of a finished one).

    Before anything is allocated, the cache and the largest step (``step_tokens(rows)``: the most
    tokens a step samples with that many rows in flight, :func:`step_memory`) are checked against the
    memory this rank has free (:func:`available_memory`); where they do not fit on one rank of the
    model-parallel group, every rank of the group raises the same error, naming how many responses
    would fit (a collective of the tensor-, pipeline- and expert-parallel groups: one rank out of
    memory would leave the others waiting in the forward's collectives). Tokens do not depend on the
    rows: the sampling noise is keyed by prompt id, sample and position."""
    G, P = sampling.num_samples, len(prompts)
    rows = P * G if max_num_seqs is None else min(P * G, max_num_seqs)
    capacity = max(len(p) + rules.limit(len(p)) for p in prompts) + extra_capacity
    per_response = model.kv_cache_bytes(1, capacity)  # (a cache's bytes grow with its rows)

    def need(r: int) -> int:
        return per_response * r + step_memory(model, step_tokens(r)) if r else 0

    free = available_memory(model.ctx.device)
    fits = 1 << 40
    if free is not None:  # the most rows that fit (need grows with the rows)
        fits, over = 0, free // per_response + 1
        while over - fits > 1:
            mid = (fits + over) // 2
            fits, over = (mid, over) if need(mid) <= free else (fits, mid)
    ctx, tokens = model.ctx, step_tokens(rows)
    short_here = free is not None and need(rows) > free
    verdict = torch.tensor([float(short_here), -float(fits)], dtype=torch.float64, device=ctx.device)
    ctx.all_reduce_tp(verdict, "max")
    ctx.all_reduce_pp(verdict, "max")
    ctx.all_reduce_ep(verdict, "max")
    if verdict[0] > 0:
        gib, fit = 1 << 30, int(-verdict[1])
        here = (f"{need(rows) / gib:.2f} GiB on this rank, which has {free / gib:.2f} GiB free" if short_here
                else "more memory than another rank of its model-parallel group has free")
        advice = (f"set max_num_seqs to at most {fit} (the responses decoded at once)" if fit >= 1 else
                  "not even one response fits: lower sampling.max_new_tokens, or spread the model over more ranks")
        raise ValueError(f"the KV cache of {rows} responses of up to {capacity} positions "
                         f"({per_response * rows / gib:.2f} GiB) and a step's logits and sampling over the vocabulary "
                         f"({step_memory(model, tokens) / gib:.2f} GiB for {tokens} tokens) need {here}; {advice}")
    return rows


def available_memory(device: torch.device) -> Optional[int]:
    """Bytes a new allocation can take on ``device``: on a GPU what the driver has free plus what torch's
    caching allocator holds unused; on a Linux CPU the kernel's estimate of available memory
    (``MemAvailable``), within the cgroup's limit where one is set (a container's); None where unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        free = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max":
            free = min(free, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(0, free)


ORDERED_PREFILL_TOKENS = 256
"""The most padded tokens a prefill forward of a batch-invariant policy holds where ordered attention
(not the step-attention kernel) runs it: ordered attention gathers the keys and values of each new
token's own forward for it (model/attention.ordered_attention), s x s x head dimension values a KV
head for s new tokens of a row. Its results do not depend on the pieces, so the cap changes nothing
but memory (and the number of forwards)."""


def prefill(model: PolicyModel, cache: KVCache, prompts: Sequence[Sequence[int]],
            max_tokens_per_forward: int, return_hidden: bool = False, slots: Optional[torch.Tensor] = None):
    """Prefill prompt p into cache slot ``slots[p]`` (None: slot p); returns the logits at each
    prompt's last token [P, vocab] on the last stage (None elsewhere), with the hidden states there
    [P, h] if ``return_hidden``. Prompts go in chunks of at most ``max_tokens_per_forward`` padded
    tokens; a prompt longer than that goes alone, in pieces of at most that many tokens, each
    attending to the keys and values of the pieces before it in the cache (vLLM's chunked prefill),
    so that no forward holds more tokens than that. A batch-invariant policy's prompts give the same
    cache and logits however they are chunked and cut (PolicyModel.metadata); without the
    step-attention kernel its forwards hold at most :data:`ORDERED_PREFILL_TOKENS`."""
    if model.batch_invariant and not cache.position_major_keys:
        max_tokens_per_forward = min(max_tokens_per_forward, ORDERED_PREFILL_TOKENS)
    device = cache.device
    out: list[torch.Tensor] = []
    hiddens: list[torch.Tensor] = []
    start = 0
    while start < len(prompts):
        end, longest = start, 0
        while end < len(prompts):
            longest_next = max(longest, len(prompts[end]))
            if end > start and longest_next * (end - start + 1) > max_tokens_per_forward:
                break
            longest, end = longest_next, end + 1
        chunk_slots = torch.arange(start, end, device=device) if slots is None else slots[start:end]
        for offset in range(0, longest, max_tokens_per_forward):  # (one piece unless a prompt is alone)
            result = _prefill_forward(model, cache, [p[offset:offset + max_tokens_per_forward]
                                                     for p in prompts[start:end]], offset, chunk_slots)
        if result is not None:
            logits, hidden = result  # [p, 1, V/tp], [1, p, h]
            out.append(model.full_logits(logits[:, 0]))
            hiddens.append(hidden[0])
        start = end
    if not out:
        return (None, None) if return_hidden else None
    return (torch.cat(out), torch.cat(hiddens)) if return_hidden else torch.cat(out)


def _prefill_forward(model: PolicyModel, cache: KVCache, pieces: Sequence[Sequence[int]], offset: int,
                     slots: torch.Tensor):
    """One prefill forward: ``pieces`` [p] of prompts whose first ``offset`` tokens the cache already
    holds, into ``slots``; the model's output at each piece's last token (None but on the last stage)."""
    device = cache.device
    lengths = torch.tensor([len(p) for p in pieces], device=device)
    longest = max(len(p) for p in pieces)
    ids = torch.zeros(len(pieces), longest, dtype=torch.long, device=device)
    for r, p in enumerate(pieces):
        ids[r, : len(p)] = torch.as_tensor(p, dtype=torch.long)
    positions = offset + torch.arange(longest, device=device)[None, :].expand(len(pieces), longest)
    meta = model.metadata(positions, causal_mask(len(pieces), longest, device, lengths), cache, slots)
    result = model(ids, meta, logits_index=lengths - 1, return_hidden=True)  # last prompt token only
    cache.commit(slots, lengths)
    return result


def sample_rows(model: PolicyModel, logits: Optional[torch.Tensor], keys: SampleKeys,
                sampling: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample on the last stage (logits [n, V]) and share tokens and log-probs with all stages."""
    n = keys.prompt.shape[0]
    if logits is not None:
        tokens, logp = sample(logits, keys, sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p)
        logp = logp.float()
    else:
        tokens = torch.empty(n, dtype=torch.long, device=keys.prompt.device)
        logp = torch.empty(n, dtype=torch.float32, device=keys.prompt.device)
    tokens, logp = model.ctx.broadcast_from_last_stage([tokens, logp])
    return tokens, logp


def num_groups(requested: Optional[int], pp_size: int) -> int:
    """Groups a rollout interleaves over the pipeline stages: ``requested`` or one per stage."""
    if requested is None:
        return pp_size
    if requested < 1:
        raise ValueError(f"pipeline_groups must be at least 1 (or None: one per pipeline stage), got {requested}")
    return requested


def run_order(cache: Any, ctx: Any, slots: torch.Tensor, *aligned: Optional[torch.Tensor]) -> tuple:
    """``slots`` and the per-row tensors aligned with them (None passes through) in the order a group
    runs its next forwards in: as the last stage's KV cache lays them out after :meth:`KVCache.pack`
    (the forward reads its cache as it is), that order broadcast to the other pipeline stages, whose
    forwards place their rows so (:meth:`KVCache.rows`). Each stage's cache layout is its own history:
    a stage runs other groups' forwards, which place their rows, at other points between this group's
    steps than the stage after it (run_groups), so an order read from each stage's own could differ
    from stage to stage, where the forward's activations and the last stage's verdicts are
    row-aligned. Every stage calls this in the same advance (a collective across stages)."""
    perm = cache.pack(slots) if ctx.is_last_stage else torch.empty(len(slots), dtype=torch.long,
                                                                     device=slots.device)
    (perm,) = ctx.broadcast_from_last_stage([perm])  # (one stage: perm itself)
    return (slots[perm], *(t[perm] if t is not None else None for t in aligned))


def keep_rows(keep: Sequence[bool], *tensors: Optional[torch.Tensor]) -> tuple:
    """The rows of ``tensors`` (aligned; None passes through) whose ``keep`` is True. When every row
    goes on (most steps) the tensors themselves: no index list is copied to the device, a copy
    that on a GPU waits for everything queued before it."""
    if all(keep):
        return tensors
    rows = torch.tensor([r for r, k in enumerate(keep) if k], dtype=torch.long, device=tensors[0].device)
    return tuple(t if t is None else t.index_select(0, rows) for t in tensors)


def split_groups(slots: torch.Tensor, k: int) -> list[torch.Tensor]:
    """Slots -> k groups, slot s to group s % k: a prompt's G samples spread over the groups, so
    groups of similar lengths finish together."""
    return [slots[slots % k == g] for g in range(k)]


def run_groups(alive: Callable[[int], bool], k: int, ctx: Any, forward: Callable[[int], None],
               advance: Callable[[int], None], barrier: Callable[[], None] = lambda: None) -> None:
    """Drive a rollout whose responses are split into ``k`` groups through the pipeline stages.

    Group-step j belongs to group j % k and has two parts: ``forward(g)``, this stage's share of the
    group's policy forward (receive from the stage before, compute, send on), and ``advance(g)``,
    what needs the last stage's verdict (sample or accept, broadcast to every stage, commit, record,
    prepare the group's next input). Every stage runs the same sequence of group-steps, but a
    stage ``lead`` places ahead of the last one runs forward(j + lead) before advance(j): while
    the last stage finishes group A, the first one already computes group B, and with one group per
    stage no stage waits on another once the pipeline is full (PP = 1, or one group: forward(j),
    advance(j), one after the other). Group g's forward j needs its advance j - k, which every stage
    has run by then because lead < k; the broadcasts happen in the same order on every stage, and a
    forward's send does not block (ParallelContext.post_forward). ``alive(g)`` changes only in
    advance(g), identically on every stage, so every stage skips the same steps of finished groups
    and stops after the same advance. For the same reason a group admits waiting responses only in its
    own advance (continuous batching): their prompts' prefill goes into its next forward, which every stage
    runs after that advance; another group's next forward may already have run on an earlier stage,
    which is also why a group's rows run in the last stage's order on every stage (:func:`run_order`).
    Such a forward sends twice (ParallelContext.forward_step keeps both sends in flight: the next
    stage takes them only in its own forward of the group). ``barrier()`` follows each group-step's
    forward, run or skipped: PolicyModel.lockstep_barrier, under which expert-parallel replicas
    whose responses differ pair their stages' forwards group-step by group-step."""
    lead = max(0, min(k, ctx.pp_size) - 1 - ctx.pp_rank)
    forwarded, j = 0, 0
    try:
        while any(alive(g) for g in range(k)):
            while forwarded <= j + lead:
                if alive(forwarded % k):
                    with ctx.forward_step():  # (a prefill and a step: two sends in flight together)
                        forward(forwarded % k)
                barrier()
                forwarded += 1
            if alive(j % k):
                advance(j % k)
            j += 1
    finally:
        ctx.flush_sends()


class RolloutState:
    """What a rollout keeps per response: slots in the KV cache, sampling keys, tokens so far, and the
    responses still waiting for rows.

    Slot ``s`` holds response ``s`` = (prompt s // G, sample s % G). The KV cache has ``rows`` rows
    (None: one per response): responses take rows in order, as many as there are; a response that
    finishes gives its row back (:meth:`append`), and :meth:`admit` lets the next waiting ones in:
    continuous batching, vLLM's ``max_num_seqs``. A prompt is prefilled once, into the row of its
    first response let in, copied to the others let in with it, and later ones copy its keys and
    values from a row that still holds them (as vLLM's prefix caching shares a prompt's blocks
    between its samples); where none does (fewer rows than a prompt's samples, or its others already
    finished), it is prefilled again. Both engines start with :meth:`start`; after each step they
    admit, sample the first tokens of the responses that joined (:meth:`first_tokens`), and
    :meth:`prefill` the pending prompts in their next forward. They record tokens through :meth:`append`, which applies
    the finish rules token by token and drops whatever follows a finishing token.
    """

    def __init__(self, model: PolicyModel, prompts: Sequence[Sequence[int]], prompt_ids: list[int],
                 sampling: SamplingConfig, step: int, rules: FinishRules, extra_capacity: int,
                 rows: Optional[int] = None) -> None:
        device = model.ctx.device
        G, P = sampling.num_samples, len(prompts)
        self.model, self.prompts, self.sampling, self.step, self.rules = model, prompts, sampling, step, rules
        self.num = P * G
        self.slots = torch.arange(self.num, device=device)
        self.prompt_of = self.slots // G
        self.key_prompt = torch.tensor(prompt_ids, device=device)[self.prompt_of]
        self.key_sample = self.slots % G
        self.prompt_len = [len(prompts[int(p)]) for p in self.prompt_of]
        self.prompt_ids = prompt_ids
        capacity = max(len(p) + rules.limit(len(p)) for p in prompts) + extra_capacity
        self.num_rows = self.num if rows is None else min(rows, self.num)
        self.cache = model.new_cache(num_slots=self.num, capacity=capacity, num_rows=self.num_rows)
        self.waiting = deque(range(self.num))  # responses not admitted yet, in order
        self.held = 0  # responses holding a row
        self.scheduled: set[int] = set()  # prompts whose prefill a group's next forward runs
        self.kept: dict[int, tuple] = {}  # prompt -> its last token's (logits, hidden state) while it is needed
        self.responses: list[list[int]] = [[] for _ in range(self.num)]
        self.logprobs: list[list[torch.Tensor]] = [[] for _ in range(self.num)]
        self.finish: list[Optional[str]] = [None] * self.num

    def admit(self) -> tuple[list[int], list[int]]:
        """Let the next waiting responses in, in order, as many as there are free rows. Returns
        ``joined``, responses of a prompt already prefilled whose keys and values another of its
        responses still holds: their cache is that prefix, copied now, and their first tokens are
        sampled from the prompt's kept logits (:meth:`first_tokens` without ``prefilled``); and
        ``pending``, responses of prompts to prefill in the next forward (:meth:`prefill`; a new prompt,
        or one none of whose responses holds a row any more). A response of a prompt whose prefill is
        pending elsewhere waits for it, and so do the responses after it."""
        G = self.sampling.num_samples
        joined: list[int] = []
        pending: list[int] = []
        sources: list[int] = []
        new: list[int] = []  # prompts this call prefills
        while self.waiting and self.held < self.num_rows:
            slot = self.waiting[0]
            p = slot // G
            if p in new:
                pending.append(slot)
            elif p in self.scheduled:  # its prefill has not run yet
                break
            elif p in self.kept and (holder := self._holder(p)) is not None:
                joined.append(slot)
                sources.append(holder)
            else:
                pending.append(slot)
                new.append(p)
            self.waiting.popleft()
            self.held += 1
        if not pending and not joined:
            return joined, pending
        firsts = self._firsts(pending)
        self.cache.admit(list(firsts.values()) + [s for s in pending if firsts[s // G] != s] + joined)
        if joined:
            index = torch.tensor(joined, dtype=torch.long, device=self.slots.device)
            self.cache.copy_slots(torch.tensor(sources, dtype=torch.long, device=index.device), index,
                                  length=torch.tensor([self.prompt_len[s] for s in joined], device=index.device))
        self.scheduled.update(new)
        return joined, pending

    def _firsts(self, pending: Sequence[int]) -> dict[int, int]:
        """Each prompt of ``pending`` -> its first pending response: the slot its prefill goes into (those
        take rows first, so that a prefill's rows lie together)."""
        G = self.sampling.num_samples
        firsts: dict[int, int] = {}
        for s in pending:  # (in admission order: a prompt's first comes first)
            firsts.setdefault(s // G, s)
        return firsts

    def _holder(self, prompt: int) -> Optional[int]:
        """A response of ``prompt`` holding a row (its prompt's keys and values are that row's first)."""
        G = self.sampling.num_samples
        rows = self.cache.row_of[prompt * G:(prompt + 1) * G].tolist()
        return next((prompt * G + j for j, r in enumerate(rows) if r >= 0), None)

    def prefill(self, pending: Sequence[int], max_prefill_tokens: int) -> tuple:
        """Prefill the prompts of the ``pending`` responses (from :meth:`admit`), each into its first
        pending response's slot, and share that cache with its other pending responses. Returns what
        :meth:`first_tokens` samples from: the prompts, and on the last stage (None elsewhere) the
        logits [p, V] and hidden states [p, h] at each one's last token."""
        G = self.sampling.num_samples
        firsts = self._firsts(pending)
        prompts, device = list(firsts), self.slots.device
        logits, hidden = prefill(self.model, self.cache, [self.prompts[p] for p in prompts], max_prefill_tokens,
                                 return_hidden=True,
                                 slots=torch.tensor(list(firsts.values()), dtype=torch.long, device=device))
        others = [s for s in pending if s != firsts[s // G]]
        if others:
            self.cache.copy_slots(torch.tensor([firsts[s // G] for s in others], device=device),
                                  torch.tensor(others, dtype=torch.long, device=device))
        return prompts, logits, hidden

    def first_tokens(self, slots: Sequence[int], prefilled: Optional[tuple] = None):
        """Sample the first token of responses ``slots``: from their prompts' :meth:`prefill`
        (``prefilled``), or from the logits kept of it (responses :meth:`admit` joined). Returns their
        slots [n], tokens [n] and log-probs [n], and on the last stage (None elsewhere) the hidden states
        [n, h] and full logits [n, V] they were sampled from. A prompt whose responses still wait keeps
        its logits and hidden state for them."""
        G = self.sampling.num_samples
        index = torch.tensor(list(slots), dtype=torch.long, device=self.slots.device)
        head = self.waiting[0] // G if self.waiting else None  # (the one prompt whose responses may still wait)
        if prefilled is not None:
            prompts, last_logits, last_hidden = prefilled
            self.scheduled.difference_update(prompts)
            row = {p: i for i, p in enumerate(prompts)}
            pick = torch.tensor([row[s // G] for s in slots], dtype=torch.long, device=index.device)
            logits = last_logits[pick] if last_logits is not None else None
            hidden = last_hidden[pick] if last_hidden is not None else None
            if head in row:  # (copies: a view would keep the whole prefill's logits)
                self.kept[head] = tuple(None if t is None else t[row[head]].clone() for t in (last_logits, last_hidden))
        else:
            per_prompt = [self.kept[s // G] for s in slots]
            logits = torch.stack([k[0] for k in per_prompt]) if per_prompt[0][0] is not None else None
            hidden = torch.stack([k[1] for k in per_prompt]) if per_prompt[0][1] is not None else None
        for p in {s // G for s in slots} - {head}:  # (none of its responses waits any more)
            self.kept.pop(p, None)
        tokens, logp = sample_rows(self.model, logits, self.keys(index, torch.zeros_like(index)), self.sampling)
        return index, tokens, logp, hidden, logits

    def start(self, max_prefill_tokens: int):
        """Admit the first responses, prefill their prompts and sample their first tokens (as
        :meth:`first_tokens`)."""
        _, pending = self.admit()  # (nothing is prefilled yet: nothing joins)
        prefilled = self.prefill(pending, max_prefill_tokens)
        self.model.lockstep_barrier()  # (expert parallelism: the replicas' prefills, in however many pieces)
        return self.first_tokens(pending, prefilled)

    def positions(self, slots: torch.Tensor) -> torch.Tensor:
        """[b] each response's length so far: the response index of the token sampled next."""
        return torch.tensor([len(self.responses[s]) for s in slots.tolist()], device=slots.device)

    def longest_context(self, slots: torch.Tensor) -> int:
        """The longest committed context among ``slots``: its prompt and response tokens in the cache
        (all but the last sampled one, which the next forward appends)."""
        return max((self.prompt_len[s] + len(self.responses[s]) - 1 for s in slots.tolist()), default=0)

    def keys(self, slots: torch.Tensor, positions: torch.Tensor) -> SampleKeys:
        return SampleKeys(self.sampling.seed, self.step, self.key_prompt[slots], self.key_sample[slots], positions)

    def append(self, slot: int, tokens: Sequence[int], logps: Sequence[torch.Tensor]) -> bool:
        """Record tokens for a response until one finishes it (its row is then free); True if it goes on."""
        for tok, lp in zip(tokens, logps):
            self.responses[slot].append(int(tok))
            self.logprobs[slot].append(lp)
            self.finish[slot] = self.rules.check(self.responses[slot], self.prompt_len[slot])
            if self.finish[slot] is not None:
                self.cache.release([slot])
                self.held -= 1
                return False
        return True

    def output(self, stats: dict[str, Any], features: Optional[list[TokenFeatures]] = None) -> RolloutOutput:
        routing = None
        if self.cache.routing_topk:  # the tokens every rollout forward took in: prompt and response but the last
            routing = [r[:p + len(t) - 1] for r, p, t in zip(self.cache.routing(self.slots), self.prompt_len,
                                                          self.responses)]
        stats["kv_cache_rows"] = self.num_rows
        return RolloutOutput(
            prompt_index=[self.prompt_ids[int(p)] for p in self.prompt_of],
            sample_index=self.key_sample.tolist(),
            tokens=self.responses,
            logprobs=[torch.stack(lp) if lp else torch.zeros(0) for lp in self.logprobs],
            finish_reason=[str(f) for f in self.finish],
            stats=stats,
            features=features,
            routing=routing,
        )


def tokens_per_step(per_step: list[dict[str, Any]]) -> float:
    """tau: the tokens one verification step confirmed per response, over the steps' rows (before EOS
    or the length limit cut a response)."""
    return sum(p["emitted"] for p in per_step) / max(1, sum(p["active"] for p in per_step))


def nodes_per_row(per_step: list[dict[str, Any]]) -> float:
    """The tree size a response had per verification step, on average over the steps' rows (root
    included: 1 means nothing was drafted; the budget C_hw / B_t, or what weighing kept of it)."""
    return sum(p["nodes_per_row"] * p["active"] for p in per_step) / max(1, sum(p["active"] for p in per_step))


def combined_stats(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """The rollout statistics of a step's rounds as one: tau, tree size and acceptance over all their
    verification steps (``per_step``: all of them), the Reflex gate's share averaged, the slow path's
    counters as after the last round (they are cumulative) with the last event any round had."""
    if len(stats) == 1:
        return stats[0]
    out = dict(stats[-1])
    if all("per_step" in s for s in stats):
        out["per_step"] = [p for s in stats for p in s["per_step"]]
    if "tau" in out:
        steps = out["per_step"]
        out["tau"] = tokens_per_step(steps)
        out["nodes_per_row"] = nodes_per_row(steps)
        tried, accepted = ([sum(d) for d in zip(*(s[key] for s in stats))] for key in ("tried_per_depth",
                                                                                      "accepted_per_depth"))
        out.update(tried_per_depth=tried, accepted_per_depth=accepted,
                   acceptance_per_depth=[a / max(1, t) for a, t in zip(accepted, tried)])
        out["reflex_gate_open"] = sum(s.get("reflex_gate_open", 0.0) for s in stats) / len(stats)
    if out.get("slow_path"):
        events = [s["slow_path"]["event"] for s in stats if s.get("slow_path") and s["slow_path"]["event"]]
        out["slow_path"] = dict(out["slow_path"], event=events[-1] if events else None)
    return out


def over_replicas(stats: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """A speculative rollout's statistics (this data-parallel replica's) with tau, tree size and
    acceptance per depth over every replica's verification steps, the Reflex gate's share and the
    slow path's shares of generation time averaged over the replicas, its records summed (a
    collective over the data-parallel group); other statistics unchanged."""
    if ctx.dp_size == 1 or "tau" not in stats:
        return stats
    steps, sp = stats["per_step"], stats.get("slow_path")
    slow = [sp["records"], sp["time_share"], sp["monitor_share"]] if sp else [0.0] * 3
    local = torch.tensor([sum(p["emitted"] for p in steps), sum(p["active"] for p in steps),
                          sum(p["nodes_per_row"] * p["active"] for p in steps), stats.get("reflex_gate_open", 0.0),
                          *slow, *stats["tried_per_depth"], *stats["accepted_per_depth"]], dtype=torch.float64)
    emitted, rows, nodes, gate, records, slow_share, monitor_share, *depths = ctx.all_reduce_dp(
        local.to(ctx.device)).tolist()
    tried, accepted = depths[:len(depths) // 2], depths[len(depths) // 2:]
    out = dict(stats, tau=emitted / max(1.0, rows), nodes_per_row=nodes / max(1.0, rows),
               reflex_gate_open=gate / ctx.dp_size, tried_per_depth=[int(t) for t in tried],
               accepted_per_depth=[int(a) for a in accepted],
               acceptance_per_depth=[a / max(1.0, t) for a, t in zip(accepted, tried)])
    if sp:
        out["slow_path"] = dict(sp, records=int(records), time_share=slow_share / ctx.dp_size,
                                monitor_share=monitor_share / ctx.dp_size)
    return out
