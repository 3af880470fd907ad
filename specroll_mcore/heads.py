"""Horizon heads: H small residual blocks that draft tokens t+2 ... t+H+1 from the policy's h_t.

    z_i = h_t + SiLU(W_i h_t + U_i e(x_{t+1}) + sum_{j=1..i} V_{i,j} e(y_j))      (i = 0 .. H-1)
    logits_i = output_layer(z_i, weight=shared)        (the policy's own vocab-parallel projection)

``x_{t+1}`` is the root: the token the policy sampled from h_t, known when the heads draft (at
T = 1 it is often not the policy's most likely token, and h_t alone cannot tell which one it was).
``y_1 .. y_i`` are the drafted tokens on the path from the root to the node head i extends: head i
drafts the children of a node at depth i, conditioned on the tokens that node stands for (in
training, the realised tokens x_{t+2} .. x_{t+i+1}). ``e(x)`` is a token's row of the policy's
vocab projection (on the last stage for tied and untied models alike). W, U and V are
zero-initialised: a new head starts as the policy itself. Heads saved without U or V load with
them zero (``z_i = h_t + SiLU(W_i h_t)`` is the first form; U alone the second).

The heads own no vocabulary matrix, no KV cache and no backbone; they carry ``token_counts`` [V], how
often each token occurred in the responses they were fitted on (replicated, not a parameter), which
ranks the ids they draft from (:class:`DraftVocab`). Under TP, every W, U, V is a megatron
``ColumnParallelLinear`` (cpu_gemm's subclass, for its CPU inference forward; each rank holds h/tp
output rows); SiLU is elementwise, so each rank activates its slice and the slices are all-gathered
before the residual add. The logits stay sharded over the vocabulary: :func:`vocab_parallel_topk`
and :func:`vocab_parallel_logsumexp` never gather the full vocabulary (local top-k plus a small
all-gather; a global log-sum-exp by all-reduce).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from specroll_mcore import cpu_gemm
from specroll_mcore.cpu_gemm import PackedColumnParallelLinear
from specroll_mcore.sampling import SampleKeys, gumbel_noise, gumbel_noise_at, upcast


@dataclass
class HorizonHeadsSubmodules:
    linear: Any = PackedColumnParallelLinear


class HorizonHeads(MegatronModule):
    """H residual heads on the final hidden state; parameters ``layers.{i}.weight`` (W_i),
    ``root_layers.{i}.weight`` (U_i) and ``path_layers.{i}.{j}.weight`` (V_{i,j+1}, j < i), [h/tp, h] each.
    ``tp_group``: the tensor-parallel group of their linears and gathers (the policy's)."""

    def __init__(self, config: Any, submodules: HorizonHeadsSubmodules, num_heads: int, vocab_size: int = 0,
                 tp_group: Optional[torch.distributed.ProcessGroup] = None) -> None:
        super().__init__(config=config)
        self.num_heads = num_heads
        self.tp_group = tp_group
        self.register_buffer("token_counts", torch.zeros(vocab_size, dtype=torch.long))

        def linears(n: int) -> torch.nn.ModuleList:
            return torch.nn.ModuleList(
                build_module(submodules.linear, config.hidden_size, config.hidden_size, config=config,
                             init_method=torch.nn.init.zeros_, bias=False, gather_output=False, skip_bias_add=True,
                             tp_group=tp_group)
                for _ in range(n))

        self.layers = linears(num_heads)
        self.root_layers = linears(num_heads)
        self.path_layers = torch.nn.ModuleList(linears(i) for i in range(num_heads))

    def forward(self, hidden: torch.Tensor, delta: Optional[torch.Tensor] = None,
                root: Optional[torch.Tensor] = None, path: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Every head on the same inputs (training, with the realised tokens as the path):
        hidden [n, h] -> z [H, n, h]. ``delta`` [H, n, h] is added to each head's input (Reflex);
        ``root`` [n, h]: e(x_{t+1}); ``path`` [n, >= H-1, h]: e(y_1), e(y_2), ... (each head reads
        the first i)."""
        return torch.stack([self.forward_one(i, hidden, None if delta is None else delta[i], root, path)
                            for i in range(self.num_heads)])

    def forward_one(self, index: int, hidden: torch.Tensor, delta: Optional[torch.Tensor] = None,
                    root: Optional[torch.Tensor] = None, path: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Head ``index`` alone: hidden [n, h] (+ its delta [n, h], root features [n, h], path
        features [n, >= index, h]) -> z [n, h]. A missing root or path counts as U = 0 or V = 0."""
        return self.output(index, *self.preactivation(index, hidden, delta, root), path)

    def preactivation(self, index: int, hidden: torch.Tensor, delta: Optional[torch.Tensor] = None,
                      root: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Head ``index``'s input x = hidden (+ delta) [n, h] and its path-free pre-activation
        W x + U e(root) [n, h/tp]: drafting computes them once per row and lets :meth:`output` add
        each expanded node's path."""
        x = hidden if delta is None else hidden + delta
        y, _ = self.layers[index](x)
        if root is not None:
            y = y + self.root_layers[index](root)[0]
        return x, y

    def output(self, index: int, x: torch.Tensor, y: torch.Tensor, path: Optional[torch.Tensor] = None) -> torch.Tensor:
        """z = x + SiLU(y + sum_j V_{index,j} e(y_j)) from :meth:`preactivation`'s x, y [n, ...] and the
        path features [n, >= index, h] (None: V = 0)."""
        if path is not None:
            for j, layer in enumerate(self.path_layers[index]):
                y = y + layer(path[:, j])[0]
        return x + gather_from_tensor_model_parallel_region(F.silu(y), group=self.tp_group)

    def head_parameters(self, index: int) -> list[torch.nn.Parameter]:
        """Head ``index``'s own parameters (W_i, U_i and its V_{i,j})."""
        return [*self.layers[index].parameters(), *self.root_layers[index].parameters(),
                *self.path_layers[index].parameters()]


def horizon_heads_spec(num_heads: int, vocab_size: int = 0) -> ModuleSpec:
    """The heads as a ModuleSpec (swap the linear for another TP implementation via submodules)."""
    return ModuleSpec(module=HorizonHeads, params={"num_heads": num_heads, "vocab_size": vocab_size},
                      submodules=HorizonHeadsSubmodules())


TOKEN_COUNTS = "token_counts"
"""The heads' replicated buffer (state-dict key): never sharded over TP, never cast to the weights' dtype."""


@dataclass
class DraftVocab:
    """The ids the heads draft from: the ``size`` most frequent tokens of their ``token_counts``
    (as in frequency-ranked drafting, FR-Spec), laid out like vocab-parallel logits. Index v of the
    subset is global id ``ids[v]`` (sorted), and each TP rank holds the indices of the ids in its own
    vocabulary shard, ``start .. start + len(local_ids) - 1``, so the vocab-parallel top-k and
    log-sum-exp work on subset logits unchanged, with ``start`` and ``size`` in place of the
    vocabulary's. A draft over fewer ids costs a fraction of a projection over the whole
    vocabulary (the output matrix is read for ``size`` rows) and can only miss tokens outside the
    subset: speed, never tokens."""

    ids: torch.Tensor  # [size] global ids, sorted
    local_ids: torch.Tensor  # [size_r] the ids in this rank's shard
    rows: torch.Tensor  # [size_r, h] their rows of the vocab projection
    start: int  # subset index of local_ids[0]
    packed: cpu_gemm.PackedWeight = field(default_factory=lambda: cpu_gemm.PackedWeight(frozen=True))
    """the rows' packed copies for CPU float32 products (cpu_gemm.py), made on first use"""

    @property
    def size(self) -> int:
        return self.ids.numel()

    @classmethod
    def for_policy(cls, policy: Any, size: int) -> Optional["DraftVocab"]:
        """The draft vocabulary of ``policy``'s heads (``SpecConfig.draft_vocab`` = ``size``) from
        their token counts and the current output layer; None: the whole vocabulary (``size`` 0 or
        not smaller than it, or heads without counts)."""
        heads = policy.heads
        if heads is None or size == 0 or size >= policy.config.vocab_size or not bool(heads.token_counts.any()):
            return None
        return cls.build(heads.token_counts, size, policy.output_weight(), policy.vocab_start)

    @classmethod
    def build(cls, counts: torch.Tensor, size: int, weight: torch.Tensor, vocab_start: int) -> "DraftVocab":
        """The ``size`` ids with the largest ``counts`` [V] (ties: lower id); ``weight`` [V/tp, h]
        is this rank's vocab projection, its first row global id ``vocab_start``."""
        ranked = torch.sort(counts, descending=True, stable=True).indices
        ids = torch.sort(ranked[:size]).values
        ids = ids.to(weight.device)
        own = (ids >= vocab_start) & (ids < vocab_start + weight.shape[0])
        local_ids = ids[own]
        return cls(ids, local_ids, weight[local_ids - vocab_start], int((ids < vocab_start).sum()))

    def project(self, z: torch.Tensor) -> torch.Tensor:
        """Subset logits of this rank's ids: [..., h] -> [..., size_r] (on CPU as the policy's vocab
        projection, :func:`specroll_mcore.cpu_gemm.vocab_product`)."""
        if z.device.type != "cpu":
            return z.to(self.rows.dtype) @ self.rows.t()
        return cpu_gemm.vocab_product(z, self.rows, self.packed)

    def global_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Subset indices (as vocab-parallel top-k returns them) -> global token ids."""
        return self.ids[index.clamp(0, self.size - 1)]

    def topk_ids(self, z: torch.Tensor, k: int, ctx: Any) -> torch.Tensor:
        """The k ids of the subset with the largest logits for head outputs z [n, h] -> [n, k]
        (vocab-parallel: each rank scores its own ids)."""
        return self.global_ids(vocab_parallel_topk(self.project(z), k, self.start, self.size, ctx)[1])


# ------------------------------------------------------------------------------------------------
# Vocab-parallel reductions. ``vocab_start`` is this rank's first vocabulary id; ids at or past
# ``vocab_size`` are TP padding and never selected.
# ------------------------------------------------------------------------------------------------
def _mask_padding(logits: torch.Tensor, vocab_start: int, vocab_size: int) -> torch.Tensor:
    local = logits.shape[-1]
    if vocab_start + local <= vocab_size:
        return logits
    valid = torch.arange(vocab_start, vocab_start + local, device=logits.device) < vocab_size
    return logits.masked_fill(~valid, float("-inf"))


def _reduce_tp(x: torch.Tensor, group: Optional[torch.distributed.ProcessGroup]) -> torch.Tensor:
    """Sum over TP with gradients (megatron's reduce-from-TP region: backward passes the gradient
    through). The region all-reduces its input in place, and only when it is contiguous: it gets a
    fresh contiguous copy, so no tensor that autograd saved (exp saves its output) is overwritten."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x.clone(memory_format=torch.contiguous_format), group=group)


def vocab_parallel_logsumexp(logits: torch.Tensor, vocab_start: int, vocab_size: int, ctx: Any) -> torch.Tensor:
    """log-sum-exp over the full vocabulary of vocab-parallel logits [..., V/tp] -> [...] (float32, or
    float64 for float64 logits), with gradients: each rank's shard log-sum-exp, combined over TP by
    megatron's reduce-from-TP region (its backward passes the gradient to every shard; the max is a
    detached constant). The vocabulary is never gathered."""
    lse = torch.logsumexp(_mask_padding(upcast(logits), vocab_start, vocab_size), dim=-1)
    if ctx.tp_size == 1:
        return lse
    m = ctx.all_reduce_tp(lse.detach().clone(), "max")
    return m + torch.log(_reduce_tp(torch.exp(lse - m), ctx.tp_group))


class _VocabParallelEntropy(torch.autograd.Function):
    """H = log S - A / S with S = sum exp(d), A = sum d exp(d), d = (x - max) / T, each sum taken per
    shard and all-reduced over TP. The backward is local: dH/dx = -p (log p + H) / T, from the
    shifted logits d (kept only where the logits need a gradient: the one [.., V/tp] tensor kept) and
    the global log S and H. Both passes work ``ROWS`` rows at a time, so that their temporaries stay
    in cache and no other tensor of the logits' size is allocated."""

    ROWS = 8

    @staticmethod
    def forward(fctx: Any, x: torch.Tensor, temperature: float, ctx: Any) -> torch.Tensor:
        R = _VocabParallelEntropy.ROWS
        flat = x.detach().reshape(-1, x.shape[-1])
        top = ctx.all_reduce_tp(flat.amax(-1, keepdim=True), "max")
        d = None
        if fctx.needs_input_grad[0]:
            d = flat - top
            if temperature != 1.0:
                d.div_(temperature)
        sums = flat.new_empty(2, flat.shape[0])
        for r in range(0, flat.shape[0], R):
            if d is not None:
                rows = d[r:r + R]
            else:
                rows = flat[r:r + R] - top[r:r + R]
                if temperature != 1.0:
                    rows.div_(temperature)
            e = torch.exp(rows)
            sums[0, r:r + rows.shape[0]] = e.sum(-1)
            sums[1, r:r + rows.shape[0]] = e.mul_(rows).sum(-1)
        ctx.all_reduce_tp(sums)
        log_s = torch.log(sums[0])
        entropy = log_s - sums[1] / sums[0]
        if d is not None:
            fctx.save_for_backward(d, log_s, entropy)
            fctx.temperature = temperature
        return entropy.reshape(x.shape[:-1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(fctx: Any, grad: torch.Tensor):
        R = _VocabParallelEntropy.ROWS
        d, log_s, entropy = fctx.saved_tensors
        scale = grad.reshape(-1) / -fctx.temperature
        out = torch.empty_like(d)
        for r in range(0, d.shape[0], R):
            n = min(R, d.shape[0] - r)
            log_p = d[r:r + n] - log_s[r:r + n, None]
            p = torch.exp(log_p, out=out[r:r + n])
            p.mul_(log_p.add_(entropy[r:r + n, None])).mul_(scale[r:r + n, None])
        return out.reshape(grad.shape + d.shape[-1:]), None, None


def vocab_parallel_entropy(logits: torch.Tensor, vocab_start: int, vocab_size: int, ctx: Any,
                           temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) over the full vocabulary of vocab-parallel logits
    [B, ..., V/tp] -> [B, ...] (float32, or float64 for float64 logits): log Z - E_p[(x - max) / T]
    from each shard's sums, combined over TP, never gathering the vocabulary. With gradients to
    logits that require them (an entropy bonus in a loss): the backward communicates nothing (every
    TP rank holds the same entropy, so each shard's gradient is its own part) and keeps one float32
    copy of the logits; without (a metric), nothing of the logits' size is made. TP padding ids get
    no probability and no gradient."""
    x = upcast(logits)
    local = x.shape[-1]
    if vocab_start + local > vocab_size:  # finite, so that 0 x it stays 0
        x = x.masked_fill(torch.arange(vocab_start, vocab_start + local, device=x.device) >= vocab_size, -1e30)
    return _VocabParallelEntropy.apply(x, temperature, ctx)


def vocab_parallel_log_probs(logits: torch.Tensor, ids: torch.Tensor, vocab_start: int, vocab_size: int,
                             ctx: Any) -> torch.Tensor:
    """Log-softmax over the full vocabulary of vocab-parallel logits [..., V/tp], read at global
    ``ids`` [..., k] -> [..., k], with gradients (training the heads under TP): each rank picks the
    ids it owns (zero elsewhere), the picks are summed over TP by the reduce-from-TP region, minus
    :func:`vocab_parallel_logsumexp`. One shard takes the fused log-softmax (its backward is ~40%
    cheaper on CPU)."""
    if ctx.tp_size == 1:
        return torch.log_softmax(_mask_padding(upcast(logits), vocab_start, vocab_size), -1).gather(-1, ids)
    local = ids - vocab_start
    own = (local >= 0) & (local < logits.shape[-1])
    picked = torch.where(own, upcast(logits).gather(-1, local.clamp(0, logits.shape[-1] - 1)), 0.0)
    picked = _reduce_tp(picked, ctx.tp_group)
    return picked - vocab_parallel_logsumexp(logits, vocab_start, vocab_size, ctx)[..., None]


def vocab_parallel_topk(logits: torch.Tensor, k: int, vocab_start: int, vocab_size: int,
                        ctx: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k over the full vocabulary of vocab-parallel logits [n, V/tp] -> values, global ids [n, k].

    Each rank takes its local top-k; the tp x k candidates are all-gathered (a few numbers per row,
    never the vocabulary; values and ids in one float64 message, which holds both exactly) and
    reduced to the global top-k. Ties resolve to the lower id, as ``torch.topk`` on the gathered
    logits would. Several at once, in one exchange: :func:`vocab_parallel_topks`."""
    (found,) = vocab_parallel_topks([TopK(logits, k)], vocab_start, vocab_size, ctx)
    return found.values, found.ids


@dataclass
class TopK:
    """One request of :func:`vocab_parallel_topks` and, once answered, its result."""

    logits: torch.Tensor
    """Vocab-parallel logits [n, V/tp]."""
    k: int
    with_logsumexp: bool = False
    """Also the log-sum-exp of the logits over the full vocabulary (:func:`vocab_parallel_logsumexp`'s
    value, without gradients)."""
    values: Optional[torch.Tensor] = None
    """[n, k], the logits' dtype."""
    ids: Optional[torch.Tensor] = None
    """[n, k], global ids."""
    logsumexp: Optional[torch.Tensor] = None
    """[n], float32 (float64 for float64 logits), where asked for."""


def vocab_parallel_topks(requests: list[TopK], vocab_start: int, vocab_size: int, ctx: Any) -> list[TopK]:
    """:func:`vocab_parallel_topk` of each request, and where it asks, the log-sum-exp of its logits,
    with one all-gather over TP for all of them (a collective's latency, not its bytes, is what a
    few numbers per row cost; drafting asks for up to four per step). A request's log-sum-exp comes
    from each rank's own: the largest plus log sum exp(own - largest), the formula (and, over two
    ranks, the very floats) of :func:`vocab_parallel_logsumexp`'s two all-reduces. Inference only:
    no gradients. Returns the requests, filled in."""
    parts = []
    for r in requests:
        x = _mask_padding(r.logits, vocab_start, vocab_size)
        values, idx = torch.topk(x, min(r.k, x.shape[-1]), dim=-1)  # a shard may hold fewer than k
        r.values, r.ids = values, idx + vocab_start
        if r.with_logsumexp:
            r.logsumexp = torch.logsumexp(upcast(x.detach()), dim=-1)
        if ctx.tp_size == 1:
            continue
        if values.shape[-1] < r.k:  # every rank sends k: the missing ones are -inf at an id past the vocabulary
            pad = r.k - values.shape[-1]
            r.values = torch.cat([values, values.new_full((values.shape[0], pad), float("-inf"))], -1)
            r.ids = torch.cat([r.ids, r.ids.new_full((r.ids.shape[0], pad), vocab_size)], -1)
        # values, ids (below 2**53: exact in float64, as every value dtype is) and the shard's log-sum-exp
        own = [r.values.double(), r.ids.double()] + ([r.logsumexp.double()[:, None]] if r.with_logsumexp else [])
        parts.append(torch.cat(own, -1))
    if ctx.tp_size == 1:
        return requests
    gathered = ctx.all_gather_tp(torch.cat([p.reshape(-1) for p in parts]))  # [tp, all parts]: rank order = vocab
    for r, part in zip(requests, gathered.split([p.numel() for p in parts], dim=1)):
        n, k = r.values.shape[0], r.k
        part = part.reshape(ctx.tp_size, n, -1)
        values = part[..., :k].permute(1, 0, 2).reshape(n, -1).to(r.values.dtype)
        idx = part[..., k:2 * k].permute(1, 0, 2).reshape(n, -1).long()
        order = torch.argsort(-values, dim=-1, stable=True)[:, :k]
        r.values, r.ids = values.gather(-1, order), idx.gather(-1, order)
        if r.with_logsumexp:
            shards = part[..., 2 * k].to(r.logsumexp.dtype)  # [tp, n]
            top = shards.amax(0)
            r.logsumexp = top + torch.log(torch.exp(shards - top).sum(0))
    return requests


def vocab_parallel_filter(logits: torch.Tensor, top_p: float, top_k: int, vocab_start: int, vocab_size: int,
                          ctx: Any, window: int = 256, min_p: float = 0.0) -> torch.Tensor:
    """The sampler's top-k / top-p / min-p filter (:func:`specroll_mcore.sampling.filter_logits`,
    temperature already applied) on vocab-parallel logits [n, V/tp], for drafting: removed ids get -inf.

    Top-k and min-p are exact (the global k-th value; the best one's + log(min_p), the best by an
    all-reduced max). Top-p reads the global top-``window`` ids: when the kept set lies within them
    (mass of better ids reaches top_p) the cut equals the sampler's up to ties; otherwise nothing
    beyond top-k is removed. Drafts only decide speed, so this never changes a token; it never
    gathers the vocabulary."""
    x = _mask_padding(logits, vocab_start, vocab_size)
    if 0 < top_k < vocab_size:
        kth = vocab_parallel_topk(x, top_k, vocab_start, vocab_size, ctx)[0][:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        (found,) = vocab_parallel_topks([TopK(x, min(window, vocab_size), with_logsumexp=True)], vocab_start,
                                        vocab_size, ctx)  # (one exchange for both)
        values = found.values
        probs = torch.exp(values.float() - found.logsumexp[:, None])
        kept = ((torch.cumsum(probs, dim=-1) - probs) < top_p).sum(-1, keepdim=True)  # >= 1
        cut = values.gather(-1, (kept - 1).clamp(max=values.shape[-1] - 1))
        cut = cut.masked_fill(kept >= values.shape[-1], float("-inf"))
        x = x.masked_fill(x < cut, float("-inf"))
    if min_p > 0:
        best = ctx.all_reduce_tp(x.amax(-1, keepdim=True).float(), "max")
        x = x.masked_fill(x < best + math.log(min_p), float("-inf"))
    return x


def coupled_scores(logits: torch.Tensor, keys: SampleKeys, top_p: float, top_k: int, vocab_start: int,
                   vocab_size: int, ctx: Any, column_ids: Optional[torch.Tensor] = None,
                   min_p: float = 0.0) -> torch.Tensor:
    """Vocab-parallel logits [n, V/tp] (temperature applied) -> the sampler's own scores for them:
    filtered logits plus this shard's slice of the Gumbel noise of ``keys`` [n / P]: key r scores
    rows r*P .. r*P + P - 1 (P drafts of the same position, under different draft paths: the
    sampler's noise depends on the position, not on the path). Their argmax over the vocabulary is
    the token :func:`specroll_mcore.sampling.sample` would draw from these logits (up to the top-p
    approximation of :func:`vocab_parallel_filter`), so a draft ranked by them is the policy's sample
    wherever draft and policy agree. ``column_ids`` [V/tp]: the global token id of each column when
    the logits cover a :class:`DraftVocab` (default: ids ``vocab_start ..``)."""
    x = vocab_parallel_filter(logits, top_p, top_k, vocab_start, vocab_size, ctx, min_p=min_p)
    n, v = x.shape
    noise = (gumbel_noise(keys, v, x.dtype, vocab_start) if column_ids is None else
             gumbel_noise_at(keys, column_ids[None], x.dtype))  # [n / P, V/tp]
    return (x.view(noise.shape[0], n // noise.shape[0], v) + noise[:, None]).view(n, v)


def vocab_rows(weight: torch.Tensor, ids: torch.Tensor, vocab_start: int, whole: bool = False) -> torch.Tensor:
    """This rank's rows of the vocab projection for global ``ids`` [...] -> [..., h]; rows another
    rank owns are zero, so a sum over TP ranks (an all-reduce of whatever the rows are multiplied
    into) gives the true product without ever gathering the vocabulary matrix. ``whole``: the
    weight holds every id's row (no tensor parallelism), read without an ownership mask."""
    if weight.shape[0] == 0:  # (a rank holding none of a draft vocabulary's ids)
        return weight.new_zeros(*ids.shape, weight.shape[1])
    local = ids - vocab_start if vocab_start else ids

    def take(index: torch.Tensor) -> torch.Tensor:  # index_select: a row copy each (advanced indexing
        return weight.index_select(0, index.reshape(-1)).view(*ids.shape, weight.shape[1])  # is ~4x slower on CPU)

    if whole:
        return take(local)
    own = (local >= 0) & (local < weight.shape[0])
    if ids.device.type == "cpu" and bool(own.all()):  # (no TP, or ids of one rank: no zeroing pass)
        return take(local)
    rows = take(local.clamp(0, weight.shape[0] - 1))
    return rows * own[..., None].to(rows.dtype)


def support_logits(rows: torch.Tensor, z: torch.Tensor, ctx: Any) -> torch.Tensor:
    """Logits of some vocabulary entries for inputs z [n, h]: ``W_ids z`` -> [n, s], with ``rows``
    [n, s, h] = :func:`vocab_rows` of those ids.

    Inference only (the all-reduce is not differentiable); the slow path has its own autograd form."""
    partial = torch.einsum("nsh,nh->ns", rows.to(z.dtype), z)
    return ctx.all_reduce_tp(partial.contiguous(), "sum")
