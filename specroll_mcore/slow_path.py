"""The slow path: a drift monitor over verification by-products and persistent one-head consolidation.

Verification already computes, at every accepted position, the policy's hidden state, its
distribution for the next token and the token it sampled. :class:`RecordStreams` turns them into
training records for the heads: the record of the hidden state that sampled response token j
targets tokens j+1 .. j+H (head h: the policy's distribution p_{j+h} and the realised token). A
record *matures* once all H targets are known (or its response ended); matured records enter a
ring buffer.

:class:`AcceptanceMonitor` watches each head's acceptance over windows of ``window`` matured
records. After every rollout batch the heads, as they are now, are scored on the most recent
``scored_per_batch`` new records: a record's score for head h is the policy's probability mass on
the head's top candidates at depth h (the chance that a draft there is accepted, given the path to
it). Every token the policy samples makes a record, so the monitor hears about every head whatever
the tree sizes were (drafts that are not tried, because the trees shrank or drafting paused,
would otherwise starve it exactly when the heads go stale). Only sustained degradation triggers a
consolidation: ``degraded_windows`` consecutive windows below ``(1 - tolerance)`` x the head's
reference, at least ``min_records`` records, ``cooldown_batches`` rollout batches since the last
event, and consolidation time so far under ``time_cap`` x generation time (an event runs its
``steps`` whole once admitted, so the share can overshoot by one event). The scoring is bounded by
``scored_per_batch`` instead and accounted apart (``monitor_seconds``): on a small batch it would
otherwise spend the whole cap on watching.

A consolidation updates ONE head on at most ``max_records`` recent records: of the degraded heads,
the one whose return to its reference would add the most tokens per step to a chain of drafts
(:meth:`AcceptanceMonitor.most_degraded`; a shallow head's loss also costs the drafts below it).
The objective:

    KL(p_S || q_raw) + corrected_weight * KL(p_S || q_corrected) + rank_weight * ranking
        + proximal * ||theta - theta_prev||^2

on a support S shared by the event's records: every record's stored target top-K and realised
token and the head's own top candidates before the event (a restricted softmax over each record's
own few ids would let tokens outside them rise unchecked); ``q_corrected`` uses the
Reflex correction that was applied when the record's proposal was made; the ranking term asks the
head's logit gaps between the policy's most likely token and the rest of S to reach the policy's own
log-prob gaps (capped at ``rank_margin``). The backbone and the vocab projection are frozen; logits
are taken on S only (each TP rank multiplies its own vocabulary rows, partial sums are all-reduced).
As in distillation, head i reads the record's realised tokens j+1 .. j+i as its draft path.
The event's tokens are first added to the heads' ``token_counts``, so tokens the drifted policy
samples enter the draft vocabulary (``SpecConfig.draft_vocab``); the head's candidates (in the
support and in the held-out test) are then ranked over that vocabulary, the ids the engine will
draft from. The update is rolled back if the held-out expected acceptance (the policy's probability
mass on the head's top-k candidates) gets worse. It runs on the last pipeline stage only, between
rollout batches; other stages are not involved.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

import torch

from specroll_mcore.config import SlowPathConfig
from specroll_mcore.distill import draft_path
from specroll_mcore.heads import DraftVocab, vocab_parallel_topk, vocab_rows
from specroll_mcore.optimizer import MainParamAdamW
from specroll_mcore.parallel import average_grads_dp


@dataclass
class Records:
    """N head-training records (float32 hidden states whatever the model dtype)."""

    hidden: torch.Tensor  # [N, h] the policy's hidden state that sampled token j
    delta: torch.Tensor  # [N, H, h] the Reflex correction its proposal used (zeros if none)
    target_ids: torch.Tensor  # [N, H, K] top-K ids of p_{j+h}, most likely first
    target_probs: torch.Tensor  # [N, H, K]
    realised: torch.Tensor  # [N, H] token j+h
    valid: torch.Tensor  # [N, H] bool: token j+h exists
    root: torch.Tensor  # [N] token j (the heads' root when they drafted from this hidden state)

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def select(self, idx: torch.Tensor) -> "Records":
        return Records(*(getattr(self, f.name)[idx] for f in fields(self)))

    def detached(self) -> "Records":
        """Ordinary tensors (records are made under inference mode; autograd refuses those)."""
        return Records(*(getattr(self, f.name).clone() for f in fields(self)))

    @staticmethod
    def cat(parts: list["Records"]) -> "Records":
        return Records(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(Records)))


class RecordBuffer:
    """The most recent ``capacity`` matured records. Verification adds a few records per step; they
    are concatenated when read (a consolidation, a checkpoint), not on every add."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._parts: list[Records] = []
        self._count = 0

    def __len__(self) -> int:
        return min(self._count, self.capacity)

    def add(self, rec: Records) -> None:
        if len(rec):
            self._parts.append(rec)
            self._count += len(rec)
            if self._count > 2 * self.capacity:  # amortised trimming keeps memory bounded
                self._compact()

    def _compact(self) -> None:
        rec = Records.cat(self._parts)
        if len(rec) > self.capacity:
            rec = rec.select(torch.arange(len(rec) - self.capacity, len(rec), device=rec.hidden.device))
        self._parts, self._count = [rec], len(rec)

    @property
    def records(self) -> Optional[Records]:
        if not self._parts:
            return None
        if len(self._parts) > 1 or self._count > self.capacity:
            self._compact()
        return self._parts[0]

    @records.setter
    def records(self, rec: Optional[Records]) -> None:
        self._parts = [] if rec is None else [rec]
        self._count = 0 if rec is None else len(rec)

    def latest(self, n: int, head: int) -> Optional[Records]:
        """The ``n`` most recent records with a target for ``head``."""
        rec = self.records
        if rec is None:
            return None
        idx = rec.valid[:, head].nonzero().flatten()[-n:]
        return rec.select(idx) if idx.numel() else None


class RecordStreams:
    """Per-response entries (hidden state, target top-K, token) -> matured :class:`Records`.

    Each response keeps its last ``2H + 2`` entries in device ring buffers (an entry waits for its H
    successors; one step appends at most H + 1), so a verification step costs a few batched copies
    and gathers whatever the number of rows."""

    def __init__(self, num_heads: int, hidden_size: int, topk: int) -> None:
        self.H, self.h, self.K = num_heads, hidden_size, topk
        self.W = 2 * num_heads + 2
        self.count: dict[int, int] = {}  # slot -> entries appended so far
        self.matured: dict[int, int] = {}  # slot -> entries already turned into records
        self.ready: list[Records] = []
        self._buf: Optional[dict[str, torch.Tensor]] = None

    def _ensure(self, slots: list[int], device: torch.device) -> dict[str, torch.Tensor]:
        need = max(slots) + 1
        buf = self._buf
        if buf is not None and buf["tok"].shape[0] >= need:
            return buf
        n, W, H, h, K = max(need, 2 * (0 if buf is None else buf["tok"].shape[0])), self.W, self.H, self.h, self.K
        new = {"hid": torch.zeros(n, W, h, device=device), "delta": torch.zeros(n, W, H, h, device=device),
               "ids": torch.zeros(n, W, K, dtype=torch.long, device=device),
               "probs": torch.zeros(n, W, K, device=device), "tok": torch.zeros(n, W, dtype=torch.long, device=device)}
        if buf is not None:
            old = buf["tok"].shape[0]
            for k in new:
                new[k][:old] = buf[k]
        self._buf = new
        return new

    def add(self, slot: int, hidden: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor,
            tokens: torch.Tensor) -> None:
        """Append response tokens j.. of one slot: the hidden state each was sampled from [c, h],
        the top-K of the distribution it was sampled from [c, K] and the tokens [c]."""
        self.add_rows([slot], [tokens.shape[0]], hidden, ids, probs, tokens)

    def add_rows(self, slots: list[int], counts: list[int], hidden: torch.Tensor, ids: torch.Tensor,
                 probs: torch.Tensor, tokens: torch.Tensor) -> None:
        """:meth:`add` for many slots at once; the entries are flattened slot by slot (``counts`` each)."""
        if not slots:
            return
        if max(counts) > self.H + 1:  # more than one step's worth: feed it step by step
            offsets = [sum(counts[:r]) for r in range(len(counts))]
            fed = [0] * len(counts)
            while any(f < c for f, c in zip(fed, counts)):
                take = [min(self.H + 1, c - f) for f, c in zip(fed, counts)]
                idx = torch.tensor([o + f + i for o, f, t in zip(offsets, fed, take) for i in range(t)],
                                   dtype=torch.long, device=tokens.device)
                self.add_rows(slots, take, hidden[idx], ids[idx], probs[idx], tokens[idx])
                fed = [f + t for f, t in zip(fed, take)]
            return
        buf = self._ensure(slots, hidden.device)
        dst_slot, dst_pos = [], []
        for slot, c in zip(slots, counts):
            n = self.count.setdefault(slot, 0)
            self.matured.setdefault(slot, 0)
            dst_slot += [slot] * c
            dst_pos += [(n + i) % self.W for i in range(c)]
            self.count[slot] = n + c
        if dst_slot:
            at = (torch.tensor(dst_slot, device=hidden.device), torch.tensor(dst_pos, device=hidden.device))
            buf["hid"][at] = hidden.float()
            buf["delta"][at] = 0.0
            buf["ids"][at] = ids
            buf["probs"][at] = probs.float()
            buf["tok"][at] = tokens
        self._mature(slots, final=False)

    def set_delta(self, slots: list[int], delta: torch.Tensor) -> None:
        """The proposal from each slot's newest entry used ``delta`` [H, b, h]."""
        rows = [r for r, s in enumerate(slots) if self.count.get(s, 0) > self.matured.get(s, 0)]
        if not rows or self._buf is None:
            return
        dev = delta.device
        at = (torch.tensor([slots[r] for r in rows], device=dev),
              torch.tensor([(self.count[slots[r]] - 1) % self.W for r in rows], device=dev))
        self._buf["delta"][at] = delta[:, rows].transpose(0, 1).float()

    def finish(self, slot: int) -> None:
        """The response ended (or its stream pauses): its last entries become partial records."""
        self.finish_rows([slot])

    def finish_rows(self, slots: list[int]) -> None:
        slots = [s for s in slots if s in self.count]
        if slots:
            self._mature(slots, final=True)
        for s in slots:
            del self.count[s], self.matured[s]

    def take(self) -> Optional[Records]:
        out, self.ready = self.ready, []
        return Records.cat(out) if out else None

    def _mature(self, slots: list[int], final: bool) -> None:
        """Records for every entry whose H targets are known (all remaining ones if ``final``; an
        entry with no successor at all gives none), in slot order, oldest entry first."""
        H, W = self.H, self.W
        src_slot, src_pos, last = [], [], []
        for slot in slots:
            n, done = self.count[slot], self.matured[slot]
            upto = n - 1 if final else n - H  # entries [done, upto) mature now
            for j in range(done, upto):
                src_slot.append(slot)
                src_pos.append(j)
                last.append(n - 1)
            self.matured[slot] = max(done, upto)
        if not src_slot:
            return
        buf, dev = self._buf, self._buf["tok"].device
        s_t = torch.tensor(src_slot, device=dev)
        j_t = torch.tensor(src_pos, device=dev)
        tgt = j_t[:, None] + 1 + torch.arange(H, device=dev)[None]  # [m, H] positions j+1 .. j+H
        last_t = torch.tensor(last, device=dev)[:, None]
        valid = tgt <= last_t
        tgt = torch.minimum(tgt, last_t) % W  # missing targets repeat the last one (masked by valid)
        ts = s_t[:, None].expand_as(tgt)
        self.ready.append(Records(buf["hid"][s_t, j_t % W], buf["delta"][s_t, j_t % W], buf["ids"][ts, tgt],
                                  buf["probs"][ts, tgt], buf["tok"][ts, tgt], valid, buf["tok"][s_t, j_t % W]))


def chain_tokens(acceptance: list[float]) -> float:
    """Tokens per step of a chain of drafts with per-depth acceptance a: ``1 + a_0 + a_0 a_1 + ...``."""
    total, reach = 1.0, 1.0
    for a in acceptance:
        reach *= a
        total += reach
    return total


class AcceptanceMonitor:
    """Per-head acceptance over windows of ``window`` scored records."""

    def __init__(self, num_heads: int, cfg: SlowPathConfig) -> None:
        self.cfg = cfg
        self.count = [0] * num_heads  # records in the open window
        self.total = [0.0] * num_heads  # their summed scores
        self.rates: list[list[float]] = [[] for _ in range(num_heads)]
        self.reference: list[Optional[float]] = [None] * num_heads
        self.consecutive = [0] * num_heads

    def observe(self, head: int, scores: list[float]) -> None:
        """Records' acceptance scores for ``head``, oldest first; every ``window`` of them closes a window."""
        for x in scores:
            self.count[head] += 1
            self.total[head] += x
            if self.count[head] == self.cfg.window:
                self._close(head, self.total[head] / self.count[head])
                self.count[head], self.total[head] = 0, 0.0

    def _close(self, h: int, rate: float) -> None:
        cfg = self.cfg
        self.rates[h].append(rate)
        recent = self.rates[h][-cfg.reference_windows:]
        if self.reference[h] is None:
            if len(self.rates[h]) >= cfg.reference_windows:
                self.reference[h] = sum(recent) / len(recent)
            return
        self.consecutive[h] = self.consecutive[h] + 1 if rate < (1 - cfg.tolerance) * self.reference[h] else 0
        if len(recent) == cfg.reference_windows:  # a sustained recovery raises the bar again
            self.reference[h] = max(self.reference[h], sum(recent) / len(recent))

    def degraded(self) -> list[int]:
        return [h for h, c in enumerate(self.consecutive) if c >= self.cfg.degraded_windows]

    def most_degraded(self) -> Optional[int]:
        """The degraded head whose recovery is worth the most tokens per verification step.

        With each head's current acceptance a_h (the mean of its last ``degraded_windows`` windows),
        a chain of drafts confirms ``1 + a_0 + a_0 a_1 + ...`` tokens per step; the head chosen is
        the one whose return to its reference adds the most to that sum. A shallow head's loss
        also costs every draft below it, so a deep head with a larger relative drop can be worth
        less."""
        heads = self.degraded()
        if not heads:
            return None
        now = [self._current(h) for h in range(len(self.rates))]

        def gain(h: int) -> float:
            restored = list(now)
            restored[h] = self.reference[h]
            return chain_tokens(restored) - chain_tokens(now)

        return max(heads, key=gain)

    def _current(self, h: int) -> float:
        recent = self.rates[h][-self.cfg.degraded_windows:]
        return sum(recent) / len(recent) if recent else 0.0

    def consolidated(self, h: int) -> None:
        self.consecutive[h] = 0

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("count", "total", "rates", "reference", "consecutive")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "tried" in state:  # a monitor of verification events (older checkpoints): windows start afresh
            return
        for k, v in state.items():
            setattr(self, k, v)


@dataclass
class EventBatch:
    """A consolidation's fixed quantities, shared by its steps (none depends on the head's weights):
    the head's inputs, this rank's vocabulary rows of the support S, the targets on S."""

    hidden: torch.Tensor  # [N, h] the policy's hidden states
    root: torch.Tensor  # [N, h] root token features
    path: Optional[torch.Tensor]  # [N, head, h] draft path features (None for head 0)
    rows: torch.Tensor  # [u, h] this rank's vocabulary rows of S (zero where another rank owns the id)
    p: torch.Tensor  # [N, u] the policy's top-K distribution on S, renormalised
    logp: torch.Tensor  # [N, u] its log (floored)
    top: torch.Tensor  # [N, 1] column of the policy's most likely token
    want: torch.Tensor  # [N, u] the log-prob gaps the ranking term asks for (capped at the margin; 0 at ``top``)
    corrected: torch.Tensor  # [c] records whose proposal used a Reflex correction
    delta: torch.Tensor  # [c, h] those corrections


@dataclass
class SlowPathStats:
    events: list[dict] = field(default_factory=list)
    slow_seconds: float = 0.0  # consolidations (the time cap's account)
    monitor_seconds: float = 0.0  # scoring the heads on records
    generation_seconds: float = 0.0
    batches_since_event: int = 10**9
    skipped: dict[str, int] = field(default_factory=dict)


class SlowPath:
    """Monitor + records + consolidation for one policy's heads (last pipeline stage).

    ``candidates``: the drafts per node (``SpecConfig.topk``); ``draft_vocab``: the size of the
    vocabulary the heads draft from (``SpecConfig.draft_vocab``; 0: the whole vocabulary)."""

    def __init__(self, policy: Any, cfg: SlowPathConfig, candidates: int, seed: int = 0, draft_vocab: int = 0) -> None:
        self.policy, self.cfg, self.candidates, self.seed = policy, cfg, candidates, seed
        self.draft_vocab = draft_vocab
        H = policy.num_heads
        self.streams = RecordStreams(H, policy.config.hidden_size, cfg.target_topk)
        self.buffer = RecordBuffer(cfg.buffer_size)
        self.monitor = AcceptanceMonitor(H, cfg)
        self.stats = SlowPathStats()
        self.unscored = 0  # records matured since the monitor last scored the heads

    # -- fed by the speculative engine ----------------------------------------------------------
    def observe(self, slots: list[int], counts: list[int], hidden: torch.Tensor, top_ids: torch.Tensor,
                top_probs: torch.Tensor, tokens: torch.Tensor) -> None:
        """One verification step: rows' emitted tokens (flattened over rows, ``counts`` each) with
        the hidden state each was sampled from and the top-K of its distribution."""
        self.streams.add_rows(slots, counts, hidden, top_ids, top_probs, tokens)
        self._collect()

    def proposal_delta(self, slots: list[int], delta: torch.Tensor) -> None:
        self.streams.set_delta(slots, delta)

    def finished(self, slots: list[int]) -> None:
        self.streams.finish_rows(slots)
        self._collect()

    def _collect(self) -> None:
        rec = self.streams.take()
        if rec is not None:
            self.buffer.add(rec)
            self.unscored += len(rec)

    # -- between rollout batches ----------------------------------------------------------------
    def end_batch(self, generation_seconds: float, draft_vocab: Optional[DraftVocab]) -> Optional[dict]:
        """Account one rollout batch, score the heads on its records over ``draft_vocab`` (what the
        batch drafted from; None: the whole vocabulary), and consolidate one head if the trigger
        fires. Returns the event.

        Data-parallel replicas see different rollouts; they follow replica 0's decision and average
        their gradients, so the heads stay identical everywhere."""
        st, cfg = self.stats, self.cfg
        st.generation_seconds += generation_seconds
        st.batches_since_event += 1
        t0 = time.perf_counter()
        self.score(draft_vocab)
        st.monitor_seconds += time.perf_counter() - t0
        head = self.monitor.most_degraded()
        if head is not None:
            budget = cfg.time_cap * st.generation_seconds - st.slow_seconds
            reason = ("records" if len(self.buffer) < cfg.min_records else
                      "cooldown" if st.batches_since_event < cfg.cooldown_batches else
                      "time_cap" if budget <= 0 else None)
            if reason:
                st.skipped[reason] = st.skipped.get(reason, 0) + 1
                head = None
        head = self._replica0(head)
        if head is None:
            return None
        t0 = time.perf_counter()
        event = self.consolidate(head)
        event["seconds"] = time.perf_counter() - t0
        st.slow_seconds += event["seconds"]
        st.batches_since_event = 0
        self.monitor.consolidated(head)
        st.events.append(event)
        return event

    def score(self, dv: Optional[DraftVocab]) -> None:
        """Score every head on the most recent of the records matured since the last call (at most
        ``scored_per_batch``), ranking its candidates over ``dv`` (the draft vocabulary the batch was
        drafted from), and feed the scores to the monitor, oldest first. Each replica scores its own
        records; the trigger follows replica 0."""
        n, self.unscored = min(self.unscored, self.cfg.scored_per_batch), 0
        if n == 0:
            return
        for head in range(self.policy.num_heads):
            rec = self.buffer.latest(n, head)
            if rec is not None:
                self.monitor.observe(head, self.acceptance(rec, head, dv).tolist())

    def _replica0(self, head: Optional[int]) -> Optional[int]:
        """The decision of TP rank 0 of DP replica 0, on every rank of the last stage (the time guard
        reads each rank's own clock; the consolidation that follows is collective)."""
        ctx = self.policy.ctx
        if ctx.dp_size == 1 and ctx.tp_size == 1:
            return head
        t = torch.tensor([head + 1 if head is not None else 0], device=ctx.device)
        if ctx.tp_rank != 0:
            t.zero_()
        ctx.all_reduce_tp(t)
        if ctx.dp_rank != 0:
            t.zero_()
        v = int(ctx.all_reduce_dp(t))
        return v - 1 if v > 0 else None

    def consolidate(self, head: int) -> dict:
        """Update head ``head`` on recent records; keep the update only if held-out acceptance does
        not get worse."""
        cfg, policy = self.cfg, self.policy
        rec = self.buffer.latest(cfg.max_records, head)
        short = torch.tensor([1 if rec is None or len(rec) < 2 else 0], device=policy.ctx.device)
        if int(policy.ctx.all_reduce_dp(short)) > 0:  # every replica needs records, or none trains
            return {"head": head, "records": 0, "steps": 0, "kept": False}
        rec = rec.detached()
        # the tokens the policy samples now join the ranking of the draft vocabulary (every replica's)
        counts = torch.bincount(rec.root, minlength=policy.heads.token_counts.numel())
        policy.heads.token_counts.add_(policy.ctx.all_reduce_dp(counts))
        dv = DraftVocab.for_policy(policy, self.draft_vocab)  # what the heads will draft from next
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + len(self.stats.events))
        perm = torch.randperm(len(rec), generator=g).to(rec.hidden.device)
        n_hold = max(1, int(len(rec) * cfg.holdout_fraction))
        hold, train = rec.select(perm[:n_hold]), rec.select(perm[n_hold:])
        support = torch.unique(torch.cat([rec.target_ids[:, head].flatten(), rec.realised[:, head],
                                          self.head_candidates(rec, head, 2 * self.candidates, dv).flatten()]))
        params = policy.heads.head_parameters(head)
        prev = [p.detach().clone() for p in params]
        before = self.expected_acceptance(hold, head, dv)
        steps, losses = 0, []
        flags = [p.requires_grad for p in params]

        def restore() -> None:
            with torch.no_grad():
                for p, old in zip(params, prev):
                    p.copy_(old)

        with torch.inference_mode(False), torch.enable_grad():
            for p in params:
                p.requires_grad_(True)
            # Adam (AdamW without decay), on float32 main copies of bfloat16 heads
            opt = MainParamAdamW(params, lr=cfg.lr, weight_decay=0.0, foreach=True)
            try:
                batch = self.event_batch(train, head, support)  # frozen inputs and targets: built once
                for _ in range(cfg.steps):
                    opt.zero_grad(set_to_none=True)
                    loss, parts = self.loss(batch, head, prev)
                    loss.backward()
                    average_grads_dp(params, policy.ctx)  # the same update on every data-parallel replica
                    opt.step()
                    steps += 1
                    losses.append(parts)
            except BaseException:  # an event that fails half-way leaves the head as it was
                restore()
                raise
            finally:
                opt.close()
                for p, f in zip(params, flags):
                    p.requires_grad_(f)
                    p.grad = None
        after = self.expected_acceptance(hold, head, dv)
        kept = after >= before
        if not kept:
            restore()
        return {"head": head, "records": len(rec), "steps": steps, "kept": kept, "heldout_before": before,
                "heldout_after": after, "loss_first": losses[0]["loss"] if losses else None,
                "loss_last": losses[-1]["loss"] if losses else None}

    # -- the consolidation objective ------------------------------------------------------------
    def event_batch(self, rec: Records, head: int, support: torch.Tensor) -> EventBatch:
        """What every step of a consolidation of ``head`` on ``rec`` shares (:class:`EventBatch`),
        on a shared, sorted support ``support`` [u] that holds every record's target top-K and
        realised token and the head's own candidates (the target mass of an id outside a record's
        top-K is zero)."""
        policy, dtype = self.policy, self.policy.dtype
        N, u = len(rec), support.numel()
        p = torch.zeros(N, u, device=support.device)
        p.scatter_add_(1, torch.searchsorted(support, rec.target_ids[:, head].contiguous()), rec.target_probs[:, head])
        p = p / p.sum(-1, keepdim=True).clamp(min=1e-12)
        logp = torch.log(p.clamp(min=1e-12))
        top = torch.searchsorted(support, rec.target_ids[:, head, :1].contiguous())  # [N, 1]
        corrected = (rec.delta[:, head] != 0).any(-1).nonzero().flatten()
        hidden, root, path = self._inputs(rec, head)
        return EventBatch(
            hidden=hidden, root=root, path=path,
            rows=vocab_rows(policy.output_weight().detach(), support, policy.vocab_start,
                            whole=policy.ctx.tp_size == 1).to(dtype),
            p=p, logp=logp, top=top, want=(logp.gather(1, top) - logp).clamp(min=0, max=self.cfg.rank_margin),
            corrected=corrected, delta=rec.delta[corrected, head].to(dtype))

    def _logits_on(self, z: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Differentiable ``z W_S^T`` [N, u] for this rank's vocabulary rows ``rows`` [u, h] of a
        shared support (zero where another rank owns the id): z enters each rank's partial product
        through megatron's copy-to-TP region (its backward all-reduces dz) and the partials are
        summed by the reduce-from-TP region."""
        if self.policy.ctx.tp_size > 1:
            from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                                reduce_from_tensor_model_parallel_region)
            group = self.policy.ctx.tp_group
            return reduce_from_tensor_model_parallel_region(copy_to_tensor_model_parallel_region(z, group) @ rows.t(),
                                                            group)
        return z @ rows.t()

    def loss(self, batch: EventBatch, head: int, prev: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """The consolidation objective for ``head`` on an :meth:`event_batch`."""
        cfg, heads, b = self.cfg, self.policy.heads, batch

        def kl(logits: torch.Tensor, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:  # per record
            return (b.p[rows] * (b.logp[rows] - torch.log_softmax(logits.float(), -1))).sum(-1)

        l_raw = self._logits_on(heads.forward_one(head, b.hidden, None, b.root, b.path), b.rows)
        kl_raw = kl(l_raw)
        loss_raw = kl_raw.mean()
        # q_corrected is q_raw wherever no correction was applied (the term is then KL_raw again):
        # only the corrected records need another forward (under a mostly closed gate, a few of them)
        kl_cor, i = kl_raw, b.corrected
        if cfg.corrected_weight > 0 and i.numel():
            z_cor = heads.forward_one(head, b.hidden[i], b.delta, b.root[i], None if b.path is None else b.path[i])
            kl_cor = kl_raw.index_copy(0, i, kl(self._logits_on(z_cor, b.rows), i))
        loss_cor = kl_cor.mean()
        # ranking: the head's logit gap between the policy's most likely token and every other support
        # entry should reach the policy's own log-prob gap, capped at the margin (the top column's own
        # term is relu(0 - 0): the mean is over the u - 1 others).
        lf = l_raw.float()
        rank = torch.relu(b.want - (lf.gather(1, b.top) - lf)).sum(-1).mean() / max(lf.shape[1] - 1, 1)
        prox = sum(((w - w0) ** 2).sum() for w, w0 in zip(heads.head_parameters(head), prev))
        loss = loss_raw + cfg.corrected_weight * loss_cor + cfg.rank_weight * rank + cfg.proximal * prox
        return loss, {"loss": float(loss.detach()), "kl_raw": float(loss_raw.detach()),
                      "kl_corrected": float(loss_cor.detach()), "rank": float(rank.detach()),
                      "proximal": float(prox.detach())}

    def _inputs(self, rec: Records, head: int) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """The head's inputs for records: hidden [N, h], root features [N, h] and its draft path's
        features [N, head, h] (the realised tokens between the root and its target; None for head 0)."""
        policy, dtype = self.policy, self.policy.dtype
        path = policy.root_features(draft_path(rec)[:, :head]).to(dtype) if head > 0 else None
        return rec.hidden.to(dtype), policy.root_features(rec.root).to(dtype), path

    @torch.no_grad()
    def head_candidates(self, rec: Records, head: int, k: int, dv: Optional[DraftVocab] = None) -> torch.Tensor:
        """The head's current top-k ids [N, k] over the draft vocabulary ``dv`` (None: the whole
        vocabulary), vocab-parallel."""
        policy = self.policy
        hidden, root, path = self._inputs(rec, head)
        z = policy.heads.forward_one(head, hidden, None, root, path)
        if dv is not None:
            return dv.topk_ids(z, k, policy.ctx)
        logits = policy.vocab_projection(z)
        return vocab_parallel_topk(logits, k, policy.vocab_start, policy.config.vocab_size, policy.ctx)[1]

    @torch.no_grad()
    def acceptance(self, rec: Records, head: int, dv: Optional[DraftVocab] = None) -> torch.Tensor:
        """Per record [N]: the policy's probability mass (over the target's top-K) on the head's top-k
        candidates over ``dv``, the chance that the policy's sample at that depth is one of them."""
        cand = self.head_candidates(rec, head, self.candidates, dv)
        hit = (rec.target_ids[:, head, :, None] == cand[:, None, :]).any(-1)
        return (rec.target_probs[:, head] * hit).sum(-1)

    def expected_acceptance(self, rec: Records, head: int, dv: Optional[DraftVocab] = None) -> float:
        """:meth:`acceptance` averaged over the records of every data-parallel replica."""
        mean = self.acceptance(rec, head, dv).mean().double()
        ctx = self.policy.ctx
        return float(ctx.all_reduce_dp(mean.reshape(1)) / ctx.dp_size) if ctx.dp_size > 1 else float(mean)

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        st, rec = self.stats, self.buffer.records
        return {"monitor": self.monitor.state_dict(),
                "buffer": None if rec is None else {f.name: getattr(rec, f.name).cpu() for f in fields(Records)},
                "stats": asdict(st)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.monitor.load_state_dict(state["monitor"])
        buf = state.get("buffer")
        if buf is not None and set(buf) != {f.name for f in fields(Records)}:
            buf = None  # records of an older layout (before root tokens): the buffer refills from rollouts
        self.buffer.records = None if buf is None else Records(**{k: v for k, v in buf.items()})
        self.stats = SlowPathStats(**state["stats"])
