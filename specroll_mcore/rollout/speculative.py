"""The SpecRoll speculative engine: a drop-in for :class:`VanillaEngine` that emits the same tokens.

One round, for all unfinished responses at once:
  1. propose   heads read each response's last hidden state and root token and draft level by
               level: head 1 k candidates under the root, head d+1 k candidates under each of a
               few depth-d nodes, conditioned on that node's drafted path (ranked with the noise
               the sampler will use there: SpecConfig.coupled);
  2. build     a sparse tree per response from those candidates under the node budget
               N_t = clip(C_hw / B_t, N_min, N_max), cut to the nodes that pay for their
               latency (SpecConfig.adaptive_nodes);
  3. verify    ONE policy forward over every tree (tree attention on top of the KV cache);
  4. accept    walk each tree with the policy's own counter-based samples (verify.py);
  5. commit    keep the accepted path's keys/values, compacted; drop the rest;
  6. feedback  the hidden state where the last token was sampled seeds the next proposal; the
               verifier's verdict feeds Reflex (reflex.py: a per-trajectory correction of the next
               proposal) and the slow path's records and drift monitor (slow_path.py), each
               switched by its config.
Between rollout batches the slow path may consolidate one head (outside the timed loop's
inference mode; its time is part of the batch's total).
With pipeline parallelism the forward runs stage by stage; proposals, trees and acceptance happen
on the last stage and are broadcast, so every stage commits the same path. The responses go in
groups, one per stage, whose rounds interleave over the stages (rollout/base.run_groups); each
group sizes its trees by its own unfinished responses. With ``max_num_seqs`` a group takes waiting
responses in as its responses finish (continuous batching, rollout/base.RolloutState).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import torch

from specroll_mcore.config import SamplingConfig, SpecConfig, check_max_num_seqs, check_max_prefill_tokens
from specroll_mcore import reflex
from specroll_mcore.cpu_gemm import contents_key
from specroll_mcore.heads import DraftVocab, TopK, coupled_scores, support_logits, vocab_parallel_topks, vocab_rows
from specroll_mcore.model import PolicyModel
from specroll_mcore.rollout.base import (FinishRules, RolloutOutput, RolloutState, check_tokenizer_fits,
                                         keep_rows, nodes_per_row, num_groups, plan_rows, run_groups,
                                         run_order, tokens_per_step, validate_prompts)
from specroll_mcore.sampling import SampleKeys, filter_logits, gumbel_noise_at, sample, top_distribution
from specroll_mcore.slow_path import SlowPath
from specroll_mcore.tree import (ROOT, DepthCalibration, DraftLevel, TreeBatch, expansion, expected_tokens,
                                 node_beliefs, node_budget, row_chunks, select_tree, tree_ancestor_mask, tree_size)
from specroll_mcore.tree.budget import DEFAULT_C_HW, Latency, StepCost
from specroll_mcore.verify import accept, node_rows


@dataclass
class Proposal:
    """What the heads drafted from each row's hidden state (last stage): level d = head d + 1."""

    levels: list[DraftLevel]  # candidates [b, P, k] under P expanded nodes, cumulative log-probs
    q_top: list[torch.Tensor]  # per level [b, P, k'] the draft's own top ids (k' = max(k, Reflex support_topk))
    z: list[torch.Tensor]  # per level [b, P, h] the head's output for each expanded node (Reflex correction included)


IDLE_AFTER = 2
"""Consecutive drafted steps whose weighing kept only the roots after which steps stop drafting until
the next probe step (SpecConfig.probe_every): one such step happens with good heads on an unsure
position, a few in a row mean stale ones."""


class SpeculativeEngine:
    """Same interface as VanillaEngine; ``model`` must carry horizon heads (``num_heads > 0``).

    ``spec.reflex.enabled`` and ``spec.slow_path.enabled`` switch the two adaptation paths
    independently. The slow path's state (records, monitor, time accounts) lives in
    :attr:`slow_path` across :meth:`generate` calls."""

    def __init__(self, model: PolicyModel, spec: SpecConfig, eos_token_ids: Sequence[int] = (),
                 tokenizer: Any = None, max_prefill_tokens: int = 4096, seed: int = 0,
                 sync_timers: bool = False, latency: Optional[Latency] = None,
                 pipeline_groups: Optional[int] = None, max_num_seqs: Optional[int] = None) -> None:
        """``sync_timers``: on a GPU, wait for the device at every stage boundary so that
        ``time_split_s`` charges each stage its own kernels (slower: a profiling run, not a rollout);
        without it a stage's time is its host work plus whatever earlier GPU work it waits on.
        ``latency``: the profiled forward latency of this policy, hardware and layout
        (rollout/profile.ensure_capacity: its grid over the forward's shape, or a one-row curve),
        with which each step keeps only the nodes that pay for themselves (``SpecConfig.adaptive_nodes``);
        None: every step uses its whole budget.
        ``pipeline_groups``: groups of responses interleaved over the pipeline stages, each verifying
        under its own node budget (as :class:`VanillaEngine`; None: one per stage).
        ``max_num_seqs``: the most responses verified at once, continuously batched as with
        :class:`VanillaEngine` (the prompts a group admits are prefilled in its next forward, before its
        verification; their roots' hidden states come from that prefill).
        :meth:`state_dict` holds what a resumed run needs to repeat the same rollout statistics."""
        if model.num_heads != spec.num_heads:
            raise ValueError(f"SpecConfig.num_heads ({spec.num_heads}) != heads of the policy ({model.num_heads}); "
                             f"build the PolicyModel with num_heads={spec.num_heads}")
        if tokenizer is not None:
            check_tokenizer_fits(tokenizer, model.config.vocab_size)
        self.model, self.spec = model, spec
        self.eos_token_ids = list(eos_token_ids)
        self.tokenizer = tokenizer
        self.max_prefill_tokens = check_max_prefill_tokens(max_prefill_tokens)
        self.sync_timers = sync_timers
        self.c_hw = spec.c_hw or DEFAULT_C_HW
        self.reflex_cfg = spec.reflex if spec.reflex.enabled else None
        self.slow_path = (SlowPath(model, spec.slow_path, spec.topk, seed, spec.draft_vocab)
                          if spec.slow_path.enabled and model.heads is not None else None)
        self._draft_vocab: Optional[DraftVocab] = None  # the current rollout's
        self._draft_vocab_built: Optional[tuple[tuple, Optional[DraftVocab]]] = None  # (its key, see draft_vocab)
        self.latency = latency if spec.adaptive_nodes else None
        # (once the drafts are proposed, what proposing them took is spent: trees are weighed without it)
        self.proposed_latency = self.latency.proposed() if isinstance(self.latency, StepCost) else self.latency
        self.calibration = DepthCalibration(spec.num_heads)  # how far the drafts' beliefs hold, per depth
        self.groups = num_groups(pipeline_groups, model.ctx.pp_size)
        self.max_num_seqs = check_max_num_seqs(max_num_seqs)

    def step_tokens(self, rows: int) -> int:
        """The most tree tokens a step verifies (and samples at) with ``rows`` responses in flight: each
        group's rows times their node budget (SpecConfig.n_min .. n_max, C_hw over the rows), at any
        count of unfinished ones."""
        spec, k = self.spec, min(self.groups, max(rows, 1))
        sizes = [rows // k + (g < rows % k) for g in range(k)]  # (split_groups: slot s to group s % k)
        return sum(max(r * spec.n_min, min(r * spec.n_max, self.c_hw)) for r in sizes)

    def state_dict(self) -> dict[str, Any]:
        """Speed-only state that outlives a rollout: the tree-size calibration and the slow path's."""
        return {"calibration": self.calibration.state_dict(),
                "slow_path": self.slow_path.state_dict() if self.slow_path is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "monitor" in state:  # a checkpoint from before the calibration: the slow path's state alone
            state = {"slow_path": state}
        if "calibration" in state:
            self.calibration.load_state_dict(state["calibration"])
        if state.get("slow_path") is not None and self.slow_path is not None:
            self.slow_path.load_state_dict(state["slow_path"])

    @contextlib.contextmanager
    def held_out(self) -> Iterator[None]:
        """Rollouts inside leave the engine's adaptation as it was (an evaluation's): the slow path
        neither records them nor consolidates after them, and the tree-size calibration they moved is
        put back. Their tokens are the same as anywhere (only speed adapts)."""
        calibration, slow_path = self.calibration.state_dict(), self.slow_path
        self.slow_path = None
        try:
            yield
        finally:
            self.slow_path = slow_path
            self.calibration.load_state_dict(calibration)

    def draft_vocab(self) -> Optional[DraftVocab]:
        """The ids the heads draft from (``SpecConfig.draft_vocab``), from their token counts and the
        current output layer; None: the whole vocabulary (also for heads without counts). Built again
        only when the output layer or the counts changed (their version counters: an optimizer step,
        a slow-path event, a checkpoint load); its rows' packed copies go with it."""
        heads = self.model.heads
        if heads is None:
            return None
        key = (contents_key(self.model.output_weight()), contents_key(heads.token_counts), self.spec.draft_vocab)
        if self._draft_vocab_built is None or self._draft_vocab_built[0] != key:
            self._draft_vocab_built = (key, DraftVocab.for_policy(self.model, self.spec.draft_vocab))
        return self._draft_vocab_built[1]

    # -- 1. propose ---------------------------------------------------------------------------------
    def propose(self, hidden: torch.Tensor, roots: torch.Tensor, sampling: SamplingConfig, budget: int,
                keys: Optional[SampleKeys] = None, delta: Optional[torch.Tensor] = None) -> Proposal:
        """hidden [b, h], the roots sampled from it [b] (+ Reflex correction delta [H, b, h]) -> the
        heads' drafts for trees of ``budget`` nodes (last stage only).

        Head 1 drafts under the root over the whole vocabulary (or the draft vocabulary,
        ``SpecConfig.draft_vocab``, see :meth:`draft_vocab`). Every head is also evaluated
        without a path in the same vocabulary projection; for head d+1 (d >= 1) that gives the
        ``SpecConfig.shortlist`` ids it may draft (ranked before the sampling filters), and its
        logits conditioned on each expanded depth-d node's path are taken and filtered on them.
        The expanded nodes are the trunk and the best cumulative scores, as many as trees of
        ``budget`` nodes can extend.

        ``keys`` [H * b], head-major: the sampling keys of the positions the heads draft (those of
        the heads a tree of ``budget`` nodes reaches are used); with ``SpecConfig.coupled`` (and
        T > 0) each head ranks ids by its filtered logits / T plus that position's Gumbel noise (the
        same for every path), and the candidates' log-probs are those of being the argmax of those
        scores (the draft's belief that it is the token the policy will sample)."""
        model, spec, T = self.model, self.spec, sampling.temperature
        start, vocab, ctx = model.vocab_start, model.config.vocab_size, model.ctx
        k, S = spec.topk, min(spec.shortlist, vocab)
        kq = max(k, self.reflex_cfg.support_topk) if self.reflex_cfg else k
        b, h = hidden.shape
        D = min(spec.num_heads, budget - 1)
        coupled = spec.coupled and T > 0 and keys is not None
        root_f = model.root_features(roots).to(hidden.dtype)
        pre = [model.heads.preactivation(i, hidden, None if delta is None else delta[i], root_f) for i in range(D)]
        z = torch.stack([model.heads.output(i, x, y) for i, (x, y) in enumerate(pre)])  # [D, b, h]: without paths
        dv = self._draft_vocab
        if dv is None:  # the whole vocabulary
            logits, columns = model.vocab_projection(z), None  # [D, b, V/tp]
        else:  # its most frequent ids: logits index the subset (start, vocab: its layout), see to_ids
            logits, columns = dv.project(z), dv.local_ids
            start, vocab, S = dv.start, dv.size, min(S, dv.size)

        def to_ids(index: torch.Tensor) -> torch.Tensor:
            """Top-k indices -> token ids. An index past the vocabulary (TP padding) comes out of a
            top-k only tied at -inf: a dead candidate the tree leaves out; it becomes id 0 so that
            nothing indexes past the vocabulary."""
            index = index.masked_fill(index >= vocab, 0)
            return index if dv is None else dv.global_ids(index)

        if T > 0 and T != 1:  # (dividing by 1 changes no value: no copy)
            logits = logits / T
        flat = logits.reshape(D * b, -1)
        # head 1 exactly (its top-k of the sampler's scores where coupled, else of its logits, with their
        # log-sum-exp; the Reflex's top ids of its logits) and heads 2..D's shortlists: one TP exchange.
        # A shortlist ranks the path-free logits (/ T, + the noise where coupled) unfiltered: top-k, top-p
        # and min-p cut relative to a distribution, which moves with the path; the path's own filter comes
        # below (filtering the path-free ranking instead, SmolLM2 at min-p 0.1: depth-2 acceptance 0.38,
        # not 0.65)
        if coupled:
            ranked = coupled_scores(flat[:b], keys.rows(0, b), sampling.top_p, sampling.top_k, start, vocab, ctx,
                                    columns, sampling.min_p)
            asked = [TopK(ranked, k, with_logsumexp=True)] + ([TopK(flat[:b], kq)] if self.reflex_cfg else [])
        else:
            asked = [TopK(flat[:b], kq, with_logsumexp=True)]
        if D > 1:
            deeper = (coupled_scores(flat[b:], keys.rows(b, D * b), 1.0, 0, start, vocab, ctx, columns)
                      if coupled else flat[b:])
            asked.append(TopK(deeper, S))
        head1, *rest = vocab_parallel_topks(asked, start, vocab, ctx)
        values, cand = head1.values[:, :k], head1.ids[:, :k]
        q_top = rest[0].ids if coupled and self.reflex_cfg else head1.ids
        logq = values.float() - head1.logsumexp[:, None]
        cand, q_top = to_ids(cand), to_ids(q_top)
        levels = [DraftLevel(torch.full((b, 1), ROOT, dtype=torch.long, device=hidden.device), cand[:, None],
                             logq[:, None])]
        q_tops, zs = [q_top[:, None]], [z[0][:, None]]
        if D == 1:
            return Proposal(levels, q_tops, zs)
        # heads 2..D on their shortlists, under the expanded nodes of the level above
        short_index = rest[-1].ids.reshape(D - 1, b, S)
        padding = short_index >= vocab  # (dead candidates, see to_ids)
        shortlist = to_ids(short_index)
        # the shortlists' rows of the vocab projection, from the draft vocabulary's own compact copy where
        # there is one (the same values; 2.3 KB a row read from a sixth of the matrix: fewer cache misses)
        rows_of, first = (model.output_weight(), model.vocab_start) if dv is None else (dv.rows, dv.start)
        row_ids = shortlist if dv is None else short_index
        if coupled:  # the noise of every level's position on its shortlist, in one pass
            noise = gumbel_noise_at(keys.rows(b, D * b), shortlist.reshape((D - 1) * b, S)).reshape(D - 1, b, S)
        path = hidden.new_zeros(b, 1, 0, h)  # features of the expanded nodes' paths [b, P, d, h]
        offset = 0  # pool index of the level above's first candidate
        for d in range(1, D):
            above = levels[-1]
            # P depth-d nodes with a child each need d + 2P nodes in the tree: expand no more
            sel = expansion(above, min(k, above.width, (budget - d) // 2))  # [b, P]
            P = sel.shape[1]
            token = above.tokens.reshape(b, -1).gather(1, sel)
            path = torch.cat([path.gather(1, (sel // k)[..., None, None].expand(b, P, *path.shape[2:])),
                              model.root_features(token).to(hidden.dtype)[:, :, None]], 2)  # [b, P, d, h]

            def per_node(x: torch.Tensor) -> torch.Tensor:  # a row's input, for each of its P nodes
                return x[:, None].expand(b, P, *x.shape[1:]).reshape(b * P, *x.shape[1:])

            x, y = pre[d]
            zd = model.heads.output(d, per_node(x), per_node(y), path.reshape(b * P, d, h)).reshape(b, P, h)
            w = vocab_rows(rows_of, row_ids[d - 1], first, whole=ctx.tp_size == 1)  # [b, S, h]: this rank's rows
            lg = ctx.all_reduce_tp(torch.einsum("bsh,bph->bps", w.to(zd.dtype), zd).contiguous(), "sum")
            lg = lg.float().masked_fill(padding[d - 1][:, None], float("-inf"))
            ids = shortlist[d - 1][:, None].expand(b, P, S)
            if coupled:
                rk = filter_logits(lg.reshape(b * P, S), T, sampling.top_p, sampling.top_k,
                                   sampling.min_p).reshape(b, P, S)
                rk = rk + noise[d - 1][:, None]
            else:
                rk = lg / T if T > 0 else lg
            values, j = rk.topk(k, dim=-1)
            local = values - torch.logsumexp(rk, -1, keepdim=True)
            levels.append(DraftLevel(offset + sel, ids.gather(2, j),
                                     above.score.reshape(b, -1).gather(1, sel)[..., None] + local))
            offset += above.width
            q = ids.gather(2, lg.topk(min(kq, S), dim=-1).indices) if self.reflex_cfg else ids.gather(2, j)
            q_tops.append(torch.cat([q, q[..., :1].expand(b, P, kq - q.shape[-1])], -1))
            zs.append(zd)
        return Proposal(levels, q_tops, zs)

    # -- 2. build: keep the nodes that pay for their latency ----------------------------------------------
    def trim(self, tree: TreeBatch, pool_index: torch.Tensor, proposal: Proposal, probe: bool = False,
             context: Optional[int] = None):
        """The prefix of the selected trees with the most expected tokens per second of the step's rest
        (its forward, and with ``SpecConfig.step_overhead`` the work after it; proposing is spent by
        now) (``SpecConfig.adaptive_nodes``; the drafts' beliefs scaled by :attr:`calibration`); on a
        ``probe`` step at least the trunk (``SpecConfig.probe_every``). Returns the trees, their pool
        indices, the drafts' summed beliefs per depth over the kept nodes [H] (what the calibration
        compares with the accepted nodes after verification) and the size the weighing chose (before
        a probe's trunk). ``context``: the longest committed context among the rows (what the
        forward's attention reads). A cost flat over the step's tokens keeps every node without
        weighing them (no host round trip)."""
        b = tree.shape[0]
        beliefs = node_beliefs(proposal.levels, pool_index)
        depth = (tree.depth[:, 1:] - 1).clamp(min=0)  # (padding: depth 0, belief 0)
        keep_n = weighed = tree.shape[1]
        latency = self.proposed_latency
        if latency.step(b, keep_n, context) > latency.step(b, 1, context):
            scale = torch.tensor(self.calibration.factors(), device=beliefs.device)[depth]
            keep_n = weighed = tree_size(expected_tokens((beliefs * scale).clamp(max=1.0)).tolist(), b, latency,
                                         context)
            if probe:  # the trunk comes first in the trees' order (select_tree)
                keep_n = max(keep_n, min(tree.shape[1], len(proposal.levels) + 1))
            tree, pool_index = tree.prefix(keep_n), pool_index[:, :keep_n]
        believed = beliefs.new_zeros(self.spec.num_heads).index_add_(
            0, depth[:, :keep_n - 1].flatten(), beliefs[:, :keep_n - 1].flatten())
        return tree, pool_index, believed, weighed

    def drafts_can_pay(self, rows: int, budget: int, context: Optional[int] = None) -> bool:
        """Whether any trees of ``budget`` nodes could pay for their latency at the current
        calibration. A kept node's expected contribution is its belief times its depth's factor f_d,
        at most 1 (see trim), and the beliefs at one depth sum to at most 1: so depth d offers at most
        f_d expected tokens, in nodes of at most 1 each, which bounds every tree. When even that bound
        does not pay (stale heads: low factors), the step decodes plainly without drafting; probe
        steps draft regardless, so the factors keep being measured."""
        depth = min(self.spec.num_heads, budget - 1)
        if (self.latency is None or depth < 1
                or self.latency.step(rows, depth + 1, context) <= self.latency.step(rows, 1, context)):
            return True  # (as in trim: where extra tokens are free, nothing is weighed)
        offers = sorted((v for f in self.calibration.factors()[:depth] for v in [1.0] * int(f) + [f - int(f)]),
                        reverse=True)[:budget - 1]
        best = [rows * (1.0 + sum(offers[:k])) for k in range(len(offers) + 1)]
        return tree_size(best, rows, self.latency, context) > 1

    # -- 6. feedback ----------------------------------------------------------------------------------
    def feedback(self, active: torch.Tensor, slots: list[int], counts: list[int], acc: Any, logits: torch.Tensor,
                 hidden_all: torch.Tensor, proposal: Optional[Proposal], pool_index: Optional[torch.Tensor],
                 temperature: float, rstate: Optional[reflex.ReflexState], full_batch: bool = False) -> None:
        """The verifier's verdict at every position the accepted path reached -> Reflex memory and
        slow-path records (last stage). ``slots``, ``counts``: ``active`` and ``acc.counts`` as lists;
        ``pool_index`` [b, n]: each tree node's index among the proposal's candidates. Without a
        proposal only the slow path's records are kept, and none for a ``full_batch``."""
        if full_batch:
            # Plain decoding of a full batch: nothing was drafted, so nothing to monitor or correct, and
            # recording every row's top-K would cost more than the records are worth; the slow
            # path's streams restart with speculation.
            if self.slow_path is not None:
                self.slow_path.finished(slots)
            return
        H, k = self.spec.num_heads, self.spec.topk
        on_path = torch.arange(acc.path.shape[1], device=logits.device)[None] < acc.counts[:, None]
        rows, depth = on_path.nonzero(as_tuple=True)  # row-major: each row's path in order
        node = acc.path[rows, depth]
        p_logits = node_rows(logits, rows, node).float()  # [m, V]: the distribution each emitted token came from
        tokens = acc.tokens[rows, depth]
        top_ids = None
        if self.slow_path is not None:
            top_ids, top_probs = top_distribution(p_logits, self.spec.slow_path.target_topk)
            self.slow_path.observe(slots, counts, hidden_all[node, rows], top_ids, top_probs, tokens)
        if rstate is None or proposal is None:
            return
        cfg, model = self.reflex_cfg, self.model
        kp = max(k, cfg.support_topk)
        # Observation (row r, depth i) for every row and drafted depth, row-major: head i drafted
        # (under path node i, where that node was expanded) the token sampled at path node i. Rows
        # whose path stopped short of depth i, or whose node i was not expanded, are computed and
        # not observed (masks rather than index lists: no host sync).
        b, levels = acc.counts.numel(), len(proposal.levels)
        ar, depths = torch.arange(b, device=depth.device), torch.arange(levels, device=depth.device)
        cand, q_top, z, seen = [], [], [], []
        for i, level in enumerate(proposal.levels):
            node_i = pool_index.gather(1, acc.path[:, i:i + 1].clamp(min=0)).squeeze(1)  # [b]
            match = level.parent == node_i[:, None]  # [b, P]: the expanded node on the path
            slot = match.int().argmax(-1)
            seen.append(match.any(-1) & (acc.counts > i))
            cand.append(level.tokens[ar, slot])
            q_top.append(proposal.q_top[i][ar, slot])
            z.append(proposal.z[i][ar, slot])
        seen, cand, q_top, z = (torch.stack(x, 1).flatten(0, 1) for x in (seen, cand, q_top, z))
        # each observation's index among the path's m positions (rows' paths are consecutive there)
        first = acc.counts.cumsum(0) - acc.counts
        j = (first[:, None] + depths).flatten().clamp(max=depth.numel() - 1)
        t = temperature if temperature > 0 else 1.0
        # the policy's top ids (dividing by t > 0 keeps their order): the slow path's top-K already holds them
        p_top = (top_ids if top_ids is not None and top_ids.shape[1] >= kp
                 else p_logits.topk(kp, dim=-1).indices).index_select(0, j)[:, :kp]
        ids, valid = reflex.support(cand, q_top[:, :cfg.support_topk], p_top[:, :cfg.support_topk],
                                    tokens.index_select(0, j))
        w_s = vocab_rows(model.output_weight(), ids, model.vocab_start,  # [b * levels, s, h]: read once, used twice
                         whole=model.ctx.tp_size == 1)
        q_l = support_logits(w_s, z, model.ctx).float() / t
        p_l = p_logits[j[:, None], ids] / t  # the policy's logits on S only
        coef = reflex.feedback_coefficients(p_l, q_l, ids, valid, cand, p_top[:, :k],
                                            cfg.coverage_weight)
        e = reflex.feedback_vectors(w_s, coef, model.ctx)
        reflex.update(rstate, active.repeat_interleave(levels), depths.repeat(b), e, cfg.decay_for(H), observed=seen)

    # -- 3. verify ------------------------------------------------------------------------------------
    def verify(self, state: RolloutState, active: torch.Tensor, tree: TreeBatch):
        """One forward per chunk of at most C_hw tree tokens. Returns full logits [b, n, V] and hidden
        [n, b, h] on the last stage (None elsewhere). Plain decoding (one node per row, when B_t
        exceeds C_hw) stays one forward, as in the vanilla engine: splitting it would only add passes."""
        model = self.model
        mask = tree_ancestor_mask(tree.parents)
        positions = state.cache.lengths[active][:, None] + tree.depth
        logits, hidden = [], []
        chunks = row_chunks(active.numel(), tree.shape[1], self.c_hw) if tree.shape[1] > 1 else [(0, active.numel())]
        for s, e in chunks:
            meta = model.metadata(positions[s:e], mask[s:e], state.cache, active[s:e])
            out = model(tree.tokens[s:e], meta, return_hidden=True)
            if out is not None:
                logits.append(model.full_logits(out[0]))
                hidden.append(out[1])
        if not logits:
            return None, None
        if len(logits) == 1:  # one forward (always in plain decoding): no copy
            return logits[0], hidden[0]
        return torch.cat(logits), torch.cat(hidden, dim=1)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, step: int = 0,
                 prompt_ids: Optional[Sequence[int]] = None) -> RolloutOutput:
        """Same contract as :meth:`VanillaEngine.generate`: identical tokens for the same seed."""
        out = self._generate(prompts, sampling, step, prompt_ids)
        if self.slow_path is not None:
            event = self.slow_path.end_batch(out.stats["total_s"], self._draft_vocab)
            st = self.slow_path.stats
            out.stats["slow_path"] = {"event": event, "events": len(st.events), "records": len(self.slow_path.buffer),
                                      "skipped": dict(st.skipped), "time_share": st.slow_seconds /
                                      max(st.generation_seconds, 1e-9),
                                      "monitor_share": st.monitor_seconds / max(st.generation_seconds, 1e-9)}
            if event is not None:
                out.stats["total_s"] += event["seconds"]
                out.stats["tokens_per_s"] = out.stats["tokens"] / max(out.stats["total_s"], 1e-9)
        return out

    def _generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, step: int,
                  prompt_ids: Optional[Sequence[int]]) -> RolloutOutput:
        """:meth:`generate` without the slow path's end of a batch: the rollout."""
        cfg = self.model.config
        ids = validate_prompts(prompts, prompt_ids, cfg.vocab_size, cfg.max_position_embeddings)
        rules = FinishRules(sampling, self.eos_token_ids, self.tokenizer, cfg.max_position_embeddings)
        rows = plan_rows(self.model, prompts, sampling, rules, self.spec.n_max, self.max_num_seqs, self.step_tokens)
        with self.model.expert_lockstep():  # (expert parallelism: forwards in step with the EP group)
            return self._rollout(prompts, sampling, step, ids, rules, rows)

    @torch.inference_mode()
    def _rollout(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, step: int, ids: list[int],
                 rules: FinishRules, rows: int) -> RolloutOutput:
        rollout = _Rollout(self, sampling)
        self._draft_vocab = self.draft_vocab()  # (the output layer may have changed since the last rollout)
        state = RolloutState(self.model, prompts, ids, sampling, step, rules, extra_capacity=self.spec.n_max,
                             rows=rows)
        groups = rollout.start(state)
        run_groups(lambda i: groups[i].alive(), len(groups), self.model.ctx,
                   lambda i: rollout.forward(groups[i]), lambda i: rollout.advance(groups[i]),
                   self.model.lockstep_barrier)
        return state.output(rollout.stats())


@dataclass
class _VerifyGroup:
    """A group of responses that verify together (rollout/base.run_groups), and its step in flight."""

    slots: torch.Tensor  # unfinished responses
    roots: torch.Tensor  # each one's last sampled token: the root of its next tree
    hidden: Optional[torch.Tensor]  # [b, h] the hidden states the roots were sampled from (last stage)
    steps: int = 0
    roots_only: int = 0  # consecutive drafted steps whose weighing kept only the roots
    # the step in flight: prepared trees, then the verification forward's output
    position: Optional[torch.Tensor] = None  # [b] response index of the token sampled at each root
    # [(H + 1) * b] depth-major (a drafted step at T > 0, last stage): the sampling keys of positions
    # position + 0 .. H, their row hashes computed once for the drafts' noise and the policy's samples
    # along the trees
    keys: Optional[SampleKeys] = None
    nodes: int = 1  # the node budget N_t
    tree: Optional[TreeBatch] = None
    proposal: Optional[Proposal] = None
    pool_index: Optional[torch.Tensor] = None
    believed: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None
    hidden_all: Optional[torch.Tensor] = None
    prepare_s: float = 0.0  # its preparation's (proposing and building its trees)
    forward_s: float = 0.0  # its verification forward's
    pending: list[int] = field(default_factory=list)  # responses joining it: prompts prefilled in its next forward
    prefilled: Any = None  # that prefill's output (RolloutState.prefill), until the group advances

    def alive(self) -> bool:
        return self.slots.numel() > 0 or bool(self.pending)


class _Rollout:
    """One :meth:`SpeculativeEngine.generate` call: its groups' steps and the statistics over them.

    A step of a group: 1-2 :meth:`prepare` (propose and build its trees on the last stage, share them
    with every stage), 3 :meth:`forward` (verify), 4-6 :meth:`advance` (accept on the last stage,
    share the verdict, commit, record tokens, feedback; then prepare the next step)."""

    def __init__(self, engine: SpeculativeEngine, sampling: SamplingConfig) -> None:
        self.engine, self.sampling = engine, sampling
        self.model, self.spec = engine.model, engine.spec
        self.device, H = engine.model.ctx.device, engine.spec.num_heads
        self.sync = engine.sync_timers and self.device.type == "cuda"
        self.t_start = self.clock()
        self.timers = dict(prefill=0.0, propose=0.0, build=0.0, verify=0.0, accept=0.0, commit=0.0, feedback=0.0)
        self.gate_open = self.gate_total = self.steps = 0
        self.prefills = 1  # prefill forwards (the first one; each admission's after)
        self.tried = torch.zeros(H, dtype=torch.long, device=self.device)
        self.accepted = torch.zeros(H, dtype=torch.long, device=self.device)
        self.per_step: list[dict[str, Any]] = []
        self.state: Optional[RolloutState] = None
        self.rstate: Optional[reflex.ReflexState] = None

    def clock(self) -> float:
        if self.sync:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self, state: RolloutState) -> list[_VerifyGroup]:
        """Prefill the prompts that fit, record the first tokens, split the unfinished responses into
        groups and prepare each group's first step."""
        model, H = self.model, self.spec.num_heads
        self.state = state
        first, roots, logp, hidden, _ = state.start(self.engine.max_prefill_tokens)
        self.row_steps = torch.zeros(state.num, dtype=torch.long, device=self.device)
        self.row_emitted = torch.zeros(state.num, dtype=torch.long, device=self.device)
        if self.engine.reflex_cfg is not None and model.ctx.is_last_stage:
            self.rstate = reflex.ReflexState.new(state.num, H, model.config.hidden_size, self.device)
        slots, roots, hidden = self.record_first(first, roots, logp, hidden)
        self.timers["prefill"] = self.clock() - self.t_start
        k = self.engine.groups
        groups = []
        for i in range(k):  # (slot s to group s % k, as split_groups)
            rows = (slots % k == i).nonzero().squeeze(1)
            g = _VerifyGroup(slots[rows], roots[rows], hidden[rows] if hidden is not None else None)
            groups.append(g)
            self.admit(g, g.slots, g.roots, g.hidden)  # (rows the first tokens freed)
        return groups

    def admit(self, g: _VerifyGroup, slots: torch.Tensor, roots: torch.Tensor, hidden: Optional[torch.Tensor]) -> None:
        """The group goes on with ``slots`` (their roots and hidden states) and the waiting responses that
        take free rows: those joining now with their first tokens, the others after its next forward;
        then its next trees."""
        joined, g.pending = self.state.admit()
        if joined:
            slots, roots, hidden = self.join(slots, roots, hidden, joined)
        g.slots, g.roots, g.hidden = run_order(self.state.cache, self.model.ctx, slots, roots, hidden)
        if g.slots.numel() > 0:
            self.prepare(g)

    def join(self, slots: torch.Tensor, roots: torch.Tensor, hidden: Optional[torch.Tensor], joining: list[int],
             prefilled: Optional[tuple] = None) -> tuple:
        """A group's responses with ``joining`` ones, whose first tokens are sampled (from their prompts'
        ``prefilled`` output, or the logits kept of it: RolloutState.first_tokens) and recorded; those that
        finish at once are left out."""
        t = self.clock()
        first, new_roots, logp, new_hidden, _ = self.state.first_tokens(joining, prefilled)
        first, new_roots, new_hidden = self.record_first(first, new_roots, logp, new_hidden)
        self.timers["prefill"] += self.clock() - t
        return (torch.cat([slots, first]), torch.cat([roots, new_roots]),
                torch.cat([hidden, new_hidden]) if hidden is not None else None)

    def record_first(self, slots: torch.Tensor, roots: torch.Tensor, logp: torch.Tensor,
                     hidden: Optional[torch.Tensor]) -> tuple:
        """Record joining responses' first tokens; returns those that go on, their roots and hidden states."""
        new = roots.tolist()  # (one transfer)
        keep = [self.state.append(s, [new[r]], [logp[r]]) for r, s in enumerate(slots.tolist())]
        return keep_rows(keep, slots, roots, hidden)

    # -- 1-2. propose and build ------------------------------------------------------------------------
    def prepare(self, g: _VerifyGroup) -> None:
        """The group's next trees, built on the last stage and shared with every stage."""
        engine, spec, state, device = self.engine, self.spec, self.state, self.device
        t0 = self.clock()
        b = g.slots.numel()
        g.position = state.positions(g.slots)
        g.nodes = n = node_budget(b, engine.c_hw, spec.n_min, spec.n_max)
        probe = spec.probe_every > 0 and g.steps % spec.probe_every == spec.probe_every - 1
        g.proposal = g.pool_index = g.believed = g.keys = None
        context = state.longest_context(g.slots) if n > 1 and engine.latency is not None else None
        if n == 1 or not probe and (g.roots_only >= IDLE_AFTER or not engine.drafts_can_pay(b, n, context)):
            # a full batch, or drafts that do not pay: plain decoding, no proposal
            t1 = self.clock()
            tree = TreeBatch(g.roots[:, None], torch.full((b, 1), -1, dtype=torch.long, device=device),
                             torch.zeros(b, 1, dtype=torch.long, device=device),
                             torch.ones(b, dtype=torch.long, device=device))
        elif self.model.ctx.is_last_stage:
            g.keys = self.step_keys(g)
            g.proposal = engine.propose(g.hidden, g.roots, self.sampling, n, self.draft_keys(g), self.correction(g))
            t1 = self.clock()
            tree, g.pool_index = select_tree(g.roots, g.proposal.levels, n)
            if engine.latency is not None:
                tree, g.pool_index, g.believed, weighed = engine.trim(tree, g.pool_index, g.proposal, probe, context)
                g.roots_only = g.roots_only + 1 if weighed == 1 else 0
        else:
            t1, tree = self.clock(), None
        g.tree = self.share_tree(tree, b, n)
        t2 = self.clock()
        self.timers["propose"] += t1 - t0
        self.timers["build"] += t2 - t1
        g.prepare_s = t2 - t0

    def step_keys(self, g: _VerifyGroup) -> Optional[SampleKeys]:
        """The sampling keys of the positions a drafted step of the group can sample at, position +
        0 .. H [(H + 1) * b] depth-major, with their row hashes (None at T = 0). The drafts' noise and
        the policy's samples at every depth take theirs from it: one row hash of each key a step
        instead of one per use (on a GPU, ~45 kernel launches each)."""
        if self.sampling.temperature == 0:
            return None
        H = self.spec.num_heads
        positions = g.position[None] + torch.arange(H + 1, device=self.device)[:, None]  # [H + 1, b]
        return self.state.keys(g.slots.repeat(H + 1), positions.flatten()).with_hashes()

    def draft_keys(self, g: _VerifyGroup) -> Optional[SampleKeys]:
        """The sampling keys of the positions the heads draft [H * b], head-major (coupled drafts)."""
        if not self.spec.coupled or g.keys is None:
            return None
        return g.keys.rows(0, self.spec.num_heads * g.slots.numel())

    def correction(self, g: _VerifyGroup) -> Optional[torch.Tensor]:
        """Reflex's correction of the group's heads' input [H, b, h] (None: Reflex off)."""
        if self.rstate is None:
            return None
        r = self.engine.reflex_cfg
        delta, open_ = reflex.correction(self.rstate, g.slots, g.hidden, r.alpha, r.z_delta, r.min_observations,
                                         r.gate)
        self.gate_open, self.gate_total = self.gate_open + int(open_.sum()), self.gate_total + open_.numel()
        if self.engine.slow_path is not None:
            self.engine.slow_path.proposal_delta(g.slots.tolist(), delta)
        return delta

    # -- 3. verify -------------------------------------------------------------------------------------
    def forward(self, g: _VerifyGroup) -> None:
        if g.pending:  # the prompts of the responses joining the group: prefilled first
            t = self.clock()
            g.prefilled = self.state.prefill(g.pending, self.engine.max_prefill_tokens)
            self.timers["prefill"] += self.clock() - t
            self.prefills += 1
        if g.slots.numel() == 0:
            return
        t = self.clock()
        g.logits, g.hidden_all = self.engine.verify(self.state, g.slots, g.tree)
        t = self.clock() - t
        self.timers["verify"] += t
        g.forward_s = t

    # -- 4-6. accept, commit, feedback ---------------------------------------------------------------------
    def advance(self, g: _VerifyGroup) -> None:
        """Accept, commit and feed back the group's step (if it verified one), let in the responses whose
        prompts it prefilled, admit waiting ones, and prepare its next trees."""
        slots, roots, hidden = g.slots, g.roots, g.hidden
        if g.slots.numel() > 0:
            slots, roots, hidden = self.settle(g)
        if g.pending:
            slots, roots, hidden = self.join(slots, roots, hidden, g.pending, g.prefilled)
        g.prefilled = None
        self.admit(g, slots, roots, hidden)

    def settle(self, g: _VerifyGroup) -> tuple:
        """Steps 4-6 of the group's verified step; returns the responses that go on, their next roots and
        the hidden states those were sampled from (last stage)."""
        engine, state, device, H = self.engine, self.state, self.device, self.spec.num_heads
        ctx, tree, slots = self.model.ctx, g.tree, g.slots
        b, slots_l = slots.numel(), slots.tolist()
        t3 = self.clock()
        # 4. accept (last stage), shared with every stage
        acc = next_hidden = None
        if g.logits is not None:
            keys, position = g.keys, g.position
            acc = accept(tree, g.logits,
                         lambda logits, rows, positions: self.sample(slots, keys, position, logits, rows, positions),
                         position, max_depth=H)
            self.tried += acc.tried
            self.accepted += acc.accepted
            if g.believed is not None:
                believed, accepted = torch.stack([g.believed, acc.accepted.to(g.believed.dtype)]).tolist()  # (one sync)
                engine.calibration.update(believed, accepted)
            packed = [acc.tokens, acc.logprobs, acc.path, acc.counts]
            next_hidden = g.hidden_all[acc.last_node, torch.arange(b, device=device)]  # [b, h]
        else:
            packed = self.empty_pack(b, H, device)
        emitted, emitted_lp, path, counts = ctx.broadcast_from_last_stage(packed)
        t4 = self.clock()
        # 5. commit the root and the accepted drafts; record tokens; retire finished responses.
        path_len = (path >= 0).sum(-1)  # (plain decoding: the one new token is already in place)
        state.cache.commit(slots, path_len, path.clamp(min=0) if tree.shape[1] > 1 else None)
        keep, recorded = [], 0
        host = torch.cat([counts[:, None], emitted], 1).tolist()  # (one transfer)
        counts_l, emitted_l = [r[0] for r in host], [r[1:] for r in host]
        for r, slot in enumerate(slots_l):
            c, before = counts_l[r], len(state.responses[slot])
            keep.append(state.append(slot, emitted_l[r][:c], emitted_lp[r, :c]))
            recorded += len(state.responses[slot]) - before
        finished = [s for s, k in zip(slots_l, keep) if not k]
        self.row_steps[slots] += 1
        self.row_emitted[slots] += counts
        last = emitted[torch.arange(b, device=device), counts - 1]
        t5 = self.clock()
        # 6. feedback (last stage): Reflex memory, slow-path records; finished rows are released.
        if acc is not None and (self.rstate is not None or engine.slow_path is not None):
            engine.feedback(slots, slots_l, counts_l, acc, g.logits, g.hidden_all, g.proposal, g.pool_index,
                            self.sampling.temperature, self.rstate, full_batch=g.nodes == 1)
            if self.rstate is not None and finished:
                self.rstate.release(torch.tensor(finished, dtype=torch.long, device=device))
            if engine.slow_path is not None:
                engine.slow_path.finished(finished)
        t6 = self.clock()
        self.timers["accept"] += t4 - t3
        self.timers["commit"] += t5 - t4
        self.timers["feedback"] += t6 - t5
        self.per_step.append({"active": b, "nodes_per_row": int(tree.shape[1]), "emitted": sum(counts_l),
                              "tokens": recorded, "seconds": g.prepare_s + g.forward_s + t6 - t3,
                              "prepare_s": g.prepare_s, "forward_s": g.forward_s})
        self.steps += 1
        g.steps += 1
        g.logits = g.hidden_all = None
        return keep_rows(keep, slots, last, next_hidden)

    def sample(self, slots: torch.Tensor, keys: Optional[SampleKeys], position: torch.Tensor, logits: torch.Tensor,
               rows: torch.Tensor, positions: torch.Tensor):
        """The policy's own samples at tree nodes of rows ``rows`` of a group's step (verify.accept):
        ``slots`` [b], their step's ``keys`` (:meth:`step_keys`) and roots' ``position`` [b];
        ``positions``: the response indices sampled at (depth d: ``position[rows] + d``)."""
        if keys is None:  # a plain step (one sample a row) or greedy (the keys are not read)
            keys = self.state.keys(slots[rows], positions)
        else:
            keys = keys.select((positions - position[rows]) * slots.numel() + rows)
        tok, lp = sample(logits, keys, self.sampling.temperature, self.sampling.top_p, self.sampling.top_k,
                         self.sampling.min_p)
        return tok, lp.float()

    def stats(self) -> dict[str, Any]:
        elapsed = time.perf_counter() - self.t_start
        state, H, per_step = self.state, self.spec.num_heads, self.per_step
        num_tokens = sum(len(r) for r in state.responses)
        return {
            "engine": "specroll", "forwards": self.steps + self.prefills, "tokens": num_tokens, "steps": self.steps,
            "groups": self.engine.groups, "total_s": elapsed, "tokens_per_s": num_tokens / max(elapsed, 1e-9),
            "tau": tokens_per_step(per_step),
            "tau_per_row": (self.row_emitted.double() / self.row_steps.clamp(min=1).double()).tolist(),
            "nodes_per_row": nodes_per_row(per_step),
            "acceptance_per_depth": (self.accepted.double() / self.tried.clamp(min=1).double()).tolist(),
            "tried_per_depth": self.tried.tolist(), "accepted_per_depth": self.accepted.tolist(),
            "c_hw": self.engine.c_hw, "time_split_s": self.timers,
            "reflex_gate_open": self.gate_open / self.gate_total if self.gate_total else 0.0,
            # mean cosine between each horizon's memory and the feedback that followed it: the gate opens
            # only where its lower confidence bound is positive (None: no alignment observed)
            "reflex_alignment_per_depth": self.rstate.mean_alignment() if self.rstate is not None else [None] * H,
            "per_step": per_step,
        }

    # -- moving trees and acceptance results between pipeline stages ----------------------------------
    def share_tree(self, tree: Optional[TreeBatch], b: int, n: int) -> TreeBatch:
        """The last stage's trees on every stage (``tree`` None elsewhere)."""
        ctx = self.model.ctx
        if ctx.pp_size == 1 or n == 1:  # every stage builds the one-node trees itself
            return tree
        device = ctx.device
        width = torch.tensor([tree.shape[1] if tree is not None else n], device=device)
        (width,) = ctx.broadcast_from_last_stage([width])
        w = int(width)
        if tree is None or tree.shape[1] != w:
            parts = [torch.zeros(b, w, dtype=torch.long, device=device) for _ in range(3)]
        else:
            parts = [tree.tokens, tree.parents, tree.depth]
        tokens, parents, depth = ctx.broadcast_from_last_stage(parts)  # depths travel: no stage rederives them
        return TreeBatch(tokens, parents, depth, (parents != -2).sum(-1))

    @staticmethod
    def empty_pack(b: int, H: int, device: torch.device) -> list[torch.Tensor]:
        """Buffers for the acceptance results a stage other than the last receives."""
        return [torch.zeros(b, H + 1, dtype=torch.long, device=device),
                torch.zeros(b, H + 1, dtype=torch.float32, device=device),
                torch.zeros(b, H + 1, dtype=torch.long, device=device),
                torch.zeros(b, dtype=torch.long, device=device)]
