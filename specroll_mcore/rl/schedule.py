"""Forward-backward over micro-batches for the policy update, across pipeline stages, on CPU and GPU.

megatron-core's pipeline schedules allocate on ``device="cuda"`` literally, so this is a schedule of
our own with the same contract: every stage runs the same list of micro-batches; a non-first stage
receives its input activations from the previous stage (and sends their gradient back), a non-last
stage sends its output on (and receives the gradient of it); the last stage computes the loss.
Micro-batches run in megatron's 1F1B order (see :func:`forward_backward`), so the stages work on
different micro-batches at once; gradients are the same as running them one after another.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Optional, Sequence

import torch
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from torch.utils.checkpoint import checkpoint

try:  # megatron-core 0.17 and later (which deprecate 0.16's functions below)
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
except ImportError:  # megatron-core 0.16
    get_moe_metrics_tracker = None
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

from specroll_mcore.heads import vocab_parallel_entropy
from specroll_mcore.model import PolicyModel
from specroll_mcore.model.routing import fill_routing, replay_routing
from specroll_mcore.parallel import ParallelContext, expert_parallel, grad_of, grad_sq_norm, sum_grads


@dataclass
class MicroBatch:
    """B sequences (prompt + response), right-padded to L."""

    input_ids: torch.Tensor  # [B, L]
    lengths: torch.Tensor  # [B]
    labels: torch.Tensor  # [B, L] the next token (0 where none)
    loss_mask: torch.Tensor  # [B, L] 1 where labels[t] is a response token
    old_logp: torch.Tensor  # [B, L] rollout log-probs aligned with labels
    advantages: torch.Tensor  # [B]
    ref_logp: Optional[torch.Tensor] = None
    routing: Optional[torch.Tensor] = None  # [B, L, layers, k] the rollout's experts to replay (model/routing.py)
    loss_start: int = 0  # the first position any row's loss reads (the shortest prompt's last token)
    stand_in: bool = False  # a forward and backward with nothing to learn (see expert_stand_ins)

    @property
    def loss_span(self) -> slice:
        """The positions whose log-probs the loss can read: from the shortest prompt's last token to
        the last labelled position. The update computes logits there only."""
        return slice(self.loss_start, max(self.input_ids.shape[1] - 1, self.loss_start + 1))


def sequence_tokens(seq: tuple) -> int:
    """Prompt + response tokens of a (prompt, response, ...) sequence: its length in a micro-batch."""
    return len(seq[0]) + len(seq[1])


def trained(seq: tuple) -> bool:
    """Whether the loss reads a (prompt, response, log-probs, advantage[, trained[, routing]]) sequence:
    all do but those DAPO's overlong filtering marks ``trained`` False."""
    return len(seq) < 5 or bool(seq[4])


def pack_micro_batch(seqs: list[tuple], device: torch.device, multiple: int = 1) -> MicroBatch:
    """(prompt ids, response ids, response log-probs or None, advantage[, trained[, routing]]) per
    sequence -> one right-padded MicroBatch; labels are the next token, the loss covers the response
    tokens (none of a sequence whose ``trained`` is False: DAPO's overlong filtering). ``routing``:
    the rollout's experts of the sequence's tokens [n, layers, k] (RolloutOutput.routing), replayed
    by the update; where the sequences carry it, tokens past it (the last one, padding) take experts
    0 .. k - 1, which no loss reads. ``multiple``: the padded length is a multiple of it (the TP size
    under sequence parallelism, :func:`update_multiple`)."""
    L = max(sequence_tokens(s) for s in seqs)
    L = -(-L // multiple) * multiple
    B = len(seqs)
    ids = torch.zeros(B, L, dtype=torch.long)
    labels = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L)
    old = torch.zeros(B, L)
    lengths = torch.zeros(B, dtype=torch.long)
    routed = [s[5] if len(s) > 5 else None for s in seqs]
    if any(r is not None for r in routed) and any(r is None for r in routed):
        raise ValueError("either every sequence of a micro-batch carries its rollout's routing or none does")
    for i, (p, t, lp, *_) in enumerate(seqs):
        seq = list(p) + list(t)
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, : len(seq) - 1] = torch.tensor(seq[1:])
        if trained(seqs[i]):
            mask[i, len(p) - 1: len(seq) - 1] = 1.0  # positions whose next token is a response token
        if lp is not None:
            old[i, len(p) - 1: len(seq) - 1] = lp.float()
        lengths[i] = len(seq)
    routing = None
    if routed[0] is not None:
        _, layers, k = routed[0].shape
        routing = torch.stack([fill_routing(r, L, layers, k) for r in routed]).to(device)
    return MicroBatch(ids.to(device), lengths.to(device), labels.to(device), mask.to(device), old.to(device),
                      torch.tensor([s[3] for s in seqs], device=device), routing=routing,
                      loss_start=max(0, min(len(s[0]) for s in seqs) - 1))


def update_multiple(ctx: ParallelContext) -> int:
    """What a policy update's micro-batch length must be a multiple of: the TP size under sequence
    parallelism (each rank takes as many positions), else 1."""
    return ctx.tp_size if ctx.sequence_parallel else 1


def expert_stand_ins(micro_batches: list[MicroBatch], ctx: ParallelContext) -> list[MicroBatch]:
    """Expert parallelism: ``micro_batches`` and as many stand-ins as the EP group's largest count
    needs. Each MoE layer's forward and backward is a collective of the EP group (all-to-alls), so its
    ranks must run as many micro-batches, while each trains its own sequences (their counts differ
    where balance_batch moves some or micro_batch_tokens splits them by length). A stand-in is the
    first two tokens of one sequence, with no loss; its routers add no load-balancing loss
    (:func:`forward_backward`): the update is the one without expert parallelism."""
    if ctx.ep_size == 1:
        return micro_batches
    count = int(ctx.all_reduce_ep(torch.tensor([len(micro_batches)], device=ctx.device), "max").item())
    mb = micro_batches[0]
    two = slice(0, 2)
    stand_in = MicroBatch(mb.input_ids[:1, two], torch.full_like(mb.lengths[:1], 2), mb.labels[:1, two],
                          torch.zeros_like(mb.loss_mask[:1, two]), torch.zeros_like(mb.old_logp[:1, two]),
                          mb.advantages[:1], None if mb.ref_logp is None else torch.zeros_like(mb.ref_logp[:1, two]),
                          None if mb.routing is None else mb.routing[:1, two], loss_start=0, stand_in=True)
    return micro_batches + [stand_in] * (count - len(micro_batches))


def micro_batch_split(lengths: Sequence[int], max_rows: int, max_tokens: int = 0,
                      multiple: int = 1) -> list[list[int]]:
    """The sequences (indices into ``lengths``) of each micro-batch of a policy update.

    ``max_tokens`` 0: runs of ``max_rows`` consecutive sequences, in the given order. Otherwise a
    budget of padded tokens (verl's dynamic batch size): the sequences longest first (ties in the
    given order), each micro-batch taking the next while it has at most ``max_rows`` rows and
    ``rows x its longest <= max_tokens``. Sequences of like lengths then share a micro-batch, so
    little of the update's compute goes to padding, and every micro-batch's activations stay within
    the same bound (the first one is the largest: a run that fits it fits). The loss is normalised
    over the whole batch (grpo.policy_loss), so the split does not change the update. ``multiple``:
    the budget counts each micro-batch's length padded to a multiple of it (:func:`pack_micro_batch`)."""
    if max_rows < 1 or max_tokens < 0:
        raise ValueError(f"micro-batches need max_rows >= 1 and max_tokens >= 0, got {max_rows}, {max_tokens}")
    if not max_tokens:
        return [list(range(s, min(s + max_rows, len(lengths)))) for s in range(0, len(lengths), max_rows)]
    lengths = [-(-n // multiple) * multiple for n in lengths]
    if lengths and max(lengths) > max_tokens:
        raise ValueError(f"a {max(lengths)}-token sequence does not fit a micro-batch of {max_tokens} tokens: "
                         "raise TrainConfig.micro_batch_tokens to at least the longest prompt + response")
    out: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: ties keep their order
        if out and len(out[-1]) < max_rows and (len(out[-1]) + 1) * lengths[out[-1][0]] <= max_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def balanced_assignment(costs: Sequence[Sequence[int]]) -> list[list[tuple[int, int]]]:
    """Which data-parallel replica trains each sequence of a policy update, so that the replicas' loads
    even out while few sequences move (verl's ``balance_batch``; the update's time is its slowest
    replica's). ``costs[r][i]``: the cost (tokens) of replica ``r``'s ``i``-th sequence.

    Each replica keeps its own sequences, largest first, while its load stays within the mean (at least
    one, where it has any); the rest, largest first, go to whichever replica then has the least load
    (the lowest index on ties), which may be their own. Where that would not lower the largest load,
    every sequence stays where it is. Returns, per replica, the (home replica, index) of the sequences
    it trains: its own kept ones in their order, then those it takes. The loss is normalised over all
    replicas together (grpo.policy_loss), so where a sequence is trained does not change the update."""
    R = len(costs)
    mean = sum(sum(c) for c in costs) / max(1, R)
    loads, kept, rest = [0] * R, [[] for _ in range(R)], []
    for r, c in enumerate(costs):
        for i in sorted(range(len(c)), key=lambda i: -c[i]):  # stable: ties keep their order
            if not kept[r] or loads[r] + c[i] <= mean:
                kept[r].append(i)
                loads[r] += c[i]
            else:
                rest.append((c[i], r, i))
    out = [[(r, i) for i in sorted(kept[r])] for r in range(R)]
    for cost, r, i in sorted(rest, key=lambda x: -x[0]):
        d = min(range(R), key=lambda d: (loads[d], d))
        out[d].append((r, i))
        loads[d] += cost
    if max(loads, default=0) >= max((sum(c) for c in costs), default=0):
        return [[(r, i) for i in range(len(c))] for r, c in enumerate(costs)]
    return out


def token_logprobs(policy: PolicyModel, logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """log pi(labels) under softmax(logits / T) from vocab-parallel logits [B, L, V/tp] -> [B, L].

    Differentiable, never gathers the vocabulary (megatron's vocab-parallel cross entropy). TP
    padding ids are excluded from the partition function, as the sampler excludes them. The logits
    are overwritten where no copy of them is made (float32 at temperature 1, no padding ids, and a
    layout the cross entropy takes as it is: it works in place): read anything else from them first."""
    x = logits.float()
    if temperature > 0 and temperature != 1.0:
        x = x / temperature
    local = x.shape[-1]
    start = policy.vocab_start
    if start + local > policy.config.vocab_size:
        pad = torch.arange(start, start + local, device=x.device) >= policy.config.vocab_size
        x = x.masked_fill(pad, -1e9)
    nll = vocab_parallel_cross_entropy(x.transpose(0, 1).contiguous(), labels.transpose(0, 1).contiguous())
    return -nll.transpose(0, 1)


def stage_logprobs(policy: PolicyModel, out: tuple, mb: MicroBatch, temperature: float, chunk: int = 0,
                   entropy: bool = True, entropy_grad: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`token_logprobs` of the micro-batch's labels over its ``loss_span``, laid out [B, L] as
    the labels, and the policy's entropy there [B, s'] (None unless ``entropy``; with gradients to
    the logits under ``entropy_grad``, for an entropy bonus), from the last
    stage's output ``out`` = (logits, hidden states) of :meth:`PolicyModel.stage_forward`. Without
    logits (``project=False``) the hidden states [s', B, h] are projected ``chunk`` positions at a
    time (``TrainConfig.logprob_chunk``): a piece's logits [B, chunk, V/tp] are made, reduced and
    freed before the next's, and with gradients rebuilt in the backward (torch.utils.checkpoint), so
    the span's logits, their float32 copy and their softmax are never held at once; for one more
    vocabulary product."""
    logits, hidden = out
    span = mb.loss_span
    labels = mb.labels[:, span]

    entropy_grad = entropy and entropy_grad and torch.is_grad_enabled()

    def entropy_of(logits: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_entropy(logits if entropy_grad else logits.detach(), policy.vocab_start,
                                      policy.config.vocab_size, policy.ctx, temperature)

    if logits is not None:
        ent = entropy_of(logits) if entropy else None  # (before the log-probs, which may overwrite the logits)
        logp = token_logprobs(policy, logits, labels, temperature)
    else:
        seen: set[int] = set()  # pieces by their first position: the backward's recomputation comes again

        def piece(h: torch.Tensor, lab: torch.Tensor, start: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
            logits = policy.vocab_projection(h).transpose(0, 1)  # [B, c, V/tp]
            # the metric's entropy once; the bonus's again in the recomputation, which its backward reads
            ent = entropy_of(logits) if entropy_grad or (entropy and start not in seen) else None
            seen.add(start)
            return token_logprobs(policy, logits, lab, temperature), ent

        pieces = []
        for start in range(0, hidden.shape[0], chunk):
            args = (hidden[start:start + chunk], labels[:, start:start + chunk], start)
            pieces.append(checkpoint(piece, *args, use_reentrant=False) if torch.is_grad_enabled() else piece(*args))
        logp = torch.cat([lp for lp, _ in pieces], 1)
        ent = torch.cat([e for _, e in pieces], 1) if entropy else None
    # 0 outside the span, where no loss reads them
    return torch.nn.functional.pad(logp, (span.start, mb.labels.shape[1] - span.stop)), ent


@contextlib.contextmanager
def saved_for_backward() -> Iterator[list[int]]:
    """Count the bytes of the tensors autograd saves for the backward inside (parameters left out; a
    tensor saved twice counts twice): the update's activation memory as the allocator would hold it,
    on any device (under activation recomputation, what its forwards keep). Yields [bytes], filled
    as the forwards run."""
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


LossFn = Callable[..., tuple[torch.Tensor, dict]]
"""(micro-batch, log-probs [B, L]) -> (loss, metrics); with ``entropy_grad`` also the entropy [B, L]."""


def forward_backward(policy: PolicyModel, micro_batches: list[MicroBatch], loss_fn: LossFn,
                     temperature: float, recompute: bool = False, logprob_chunk: int = 0,
                     entropy_grad: bool = False) -> list[dict]:
    """Accumulate gradients of ``loss_fn`` over the micro-batches; returns the last stage's metrics
    per micro-batch (shared with every stage): ``loss_fn``'s, and ``entropy_sum``, the policy's entropy
    (at ``temperature``, over the whole vocabulary) summed over the tokens the loss reads.
    ``loss_fn(mb, logp)`` takes the micro-batch's log-probs laid out as its labels [B, L]; with
    ``entropy_grad``, ``loss_fn(mb, logp, entropy)``, the entropy laid out alike (0 outside the
    loss span) with gradients to the logits (an entropy bonus).
    ``recompute``: activation recomputation per layer (:meth:`PolicyModel.stage_forward`);
    ``logprob_chunk`` > 0: the log-probs in pieces of that many positions (:func:`stage_logprobs`).
    Micro-batches that carry routing route by it, in their forward and in their backward's
    recomputation (model/routing.py).

    One forward, one backward (1F1B, megatron's non-interleaved order): stage s runs the forwards of
    ``pp - s - 1`` micro-batches ahead, then alternates the forward of the next micro-batch with the
    backward of the oldest one, then drains the backwards; a stage holds at most ``pp - s``
    micro-batches' activations. Every stage runs its backwards in micro-batch order, so gradients
    accumulate in the same order at any pipeline size. Under expert parallelism the ranks of an EP
    group run as many micro-batches (:func:`expert_stand_ins`); the metrics are the given ones'."""
    ctx = policy.ctx
    first, last = ctx.is_first_stage, ctx.is_last_stage
    metrics: list[dict] = []
    micro_batches = expert_stand_ins(micro_batches, ctx)

    def input_shape(mb: MicroBatch) -> tuple[int, int, int]:
        b, L = mb.input_ids.shape
        return L // update_multiple(ctx), b, policy.config.hidden_size  # (this rank's part of L)

    def recv_forward(mb: MicroBatch) -> Optional[torch.Tensor]:
        return None if first else ctx.recv_forward(input_shape(mb), policy.dtype).requires_grad_()

    def forward(mb: MicroBatch, hidden_in: Optional[torch.Tensor]) -> torch.Tensor:
        """The stage's output: the loss on the last stage, hidden states [L, b, h] on the others."""
        b, L = mb.input_ids.shape
        positions = torch.arange(L, device=ctx.device)[None].expand(b, L)
        # megatron-core's padding mask marks the padding (True), as its z_loss_func documents and every use
        # inverts it (some of its docstrings say otherwise)
        padding = positions >= mb.lengths[:, None].to(ctx.device) if policy.config.is_moe else None
        replay_routing(policy.routers, mb.routing)
        with routers_training(policy, False) if mb.stand_in else contextlib.nullcontext():
            # causal attention without a mask (right-padded rows: see AttentionMetadata.build)
            out = policy.stage_forward(mb.input_ids, policy.metadata(positions, None), hidden_in, recompute=recompute,
                                       padding_mask=padding, logits_span=mb.loss_span,
                                       project=logprob_chunk == 0 or mb.stand_in)
        if mb.stand_in:
            return out if not last else out[0].sum() * 0.0
        if not last:
            return out
        logp, entropy = stage_logprobs(policy, out, mb, temperature, logprob_chunk, entropy_grad=entropy_grad)
        if entropy_grad:
            span = mb.loss_span
            loss, m = loss_fn(mb, logp, torch.nn.functional.pad(entropy, (span.start, logp.shape[1] - span.stop)))
        else:
            loss, m = loss_fn(mb, logp)
        m["entropy_sum"] = float((entropy.detach() * mb.loss_mask[:, mb.loss_span]).sum())
        metrics.append(m)
        return loss

    def backward(hidden_in: Optional[torch.Tensor], out: torch.Tensor, mb: MicroBatch, grad: Optional[torch.Tensor]):
        if recompute:  # the recomputed layers route as this micro-batch's forward did
            replay_routing(policy.routers, mb.routing)
        with routers_training(policy, False) if mb.stand_in else contextlib.nullcontext():
            out.backward(grad)  # grad is None for the loss
        return None if hidden_in is None else hidden_in.grad

    M = len(micro_batches)
    warmup = min(ctx.pp_size - ctx.pp_rank - 1, M)
    in_flight: deque = deque()  # (input, output, micro-batch) of those whose backward is still to run
    with policy.sequence_parallel():  # (the backwards too: they communicate as the forwards did)
        for i in range(warmup):
            x = recv_forward(micro_batches[i])
            out = forward(micro_batches[i], x)
            ctx.send_forward(out.detach())  # never the last stage: warmup is 0 there
            in_flight.append((x, out, micro_batches[i]))
        x = recv_forward(micro_batches[warmup]) if warmup < M else None
        for i in range(warmup, M):
            out = forward(micro_batches[i], x)
            in_flight.append((x, out, micro_batches[i]))
            grad = None if last else ctx.send_forward_recv_backward(out.detach(), in_flight[0][1].shape)
            g_in = backward(*in_flight.popleft(), grad)
            if first:
                continue
            if i == M - 1:
                ctx.send_backward(g_in)
            else:
                shape = input_shape(micro_batches[i + 1])
                x = ctx.send_backward_recv_forward(g_in, shape, policy.dtype).requires_grad_()
        while in_flight:
            x, out, mb = in_flight.popleft()
            g_in = backward(x, out, mb, ctx.recv_backward(out.shape, out.dtype))
            if not first:
                ctx.send_backward(g_in)
    replay_routing(policy.routers, None)
    return ctx.broadcast_object_from_last_stage(metrics)  # type: ignore[return-value]


@contextlib.contextmanager
def routers_training(policy: PolicyModel, training: bool = True) -> Iterator[None]:
    """megatron-core's routers in training mode (or, ``training`` False, in evaluation mode), the rest
    of the policy as it is (evaluation mode: no dropout, none configured anyway): a router attaches
    its load-balancing loss only in training (not a stand-in micro-batch's, :func:`expert_stand_ins`)."""
    modes = [r.training for r in policy.routers]
    for r in policy.routers:
        r.training = training
    try:
        yield
    finally:
        for r, mode in zip(policy.routers, modes):
            r.training = mode


def set_moe_aux_loss_scale(micro_batches: int) -> None:
    """Weigh each micro-batch's load-balancing loss (a mixture of experts with
    ModelConfig.moe_aux_loss_coeff > 0) by 1 / ``micro_batches``, the micro-batches of the step over
    all data-parallel replicas, whose gradients are summed: the step then takes the gradient of their
    mean, as megatron-core's schedules scale it (MoEAuxLossAutoScaler, which megatron-core's routers
    attach the loss with)."""
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / micro_batches))


def moe_aux_loss(policy: PolicyModel, micro_batches: int, recompute: bool) -> float:
    """The unweighted load-balancing loss of the step just run, mean over the model's layers and the
    ``micro_batches`` (over all data-parallel replicas), from megatron-core's tracker, which it then
    clears; 0 without one. Every stage and replica calls it (the sum is all-reduced). With
    ``recompute`` each router ran twice a micro-batch (forward, and again in the backward)."""
    ctx = policy.ctx
    layers = _tracked_load_balancing_losses()
    local = layers.sum().to(ctx.device) if layers is not None else torch.zeros((), device=ctx.device)
    total = ctx.all_reduce_dp(ctx.all_reduce_pp(local))
    return float(total) / ((2 if recompute else 1) * micro_batches * policy.config.num_layers)


def _tracked_load_balancing_losses() -> Optional[torch.Tensor]:
    """The load-balancing losses megatron-core's routers added up since the last call, one a layer
    (None where none was tracked yet), and its tracker cleared."""
    if get_moe_metrics_tracker is None:
        entry = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        values = None if entry is None else entry["values"].clone()
        clear_aux_losses_tracker()
        return values
    tracker = get_moe_metrics_tracker()
    entry = tracker.metrics.get("load_balancing_loss")
    values = None if entry is None else entry.values.clone()
    tracker.clear()
    return values


Owners = Mapping[torch.nn.Parameter, int]  # a parameter -> the global rank of its owner


def finalize_grads(policy: PolicyModel, owners: Optional[Owners] = None) -> None:
    """Sum gradients over data-parallel replicas; sum the tied embedding's two copies (first and
    last stage) so both take the same update; sum the query/key norms' gradients over the TP group
    (replicated weights, each rank's heads giving part of their gradient: megatron-core's
    finalize_model_grads does the same for ``qk_layernorm``), and under sequence parallelism every
    norm's (each rank's part of the sequence giving part of it: megatron's ``sequence_parallel``
    parameters).

    ``owners`` (a sharded optimizer's :meth:`~specroll_mcore.optimizer.MainParamAdamW.grad_owners`):
    a parameter's gradient is summed onto its owner alone (a reduce: half an all-reduce's traffic) and
    dropped by the other replicas, which never read it (:func:`global_grad_norm` sums the owners').
    The replicas a TP group spans own alike (their parameters have the same sizes), so the TP sums run
    among owners. The tied embedding is summed onto every replica first, as its two stages' copies
    may have different owners."""
    ctx = policy.ctx
    owners = owners or {}
    tp_summed = ("layernorm.weight",) if ctx.sequence_parallel else ("q_layernorm.weight", "k_layernorm.weight")
    tied = None
    if ctx.pp_size > 1 and policy.config.tie_word_embeddings and (ctx.is_first_stage or ctx.is_last_stage):
        tied = policy.gpt.shared_embedding_or_output_weight()
        if grad_of(tied) is None:  # this stage's copy took no gradient: it still joins the sum
            if hasattr(tied, "main_grad"):
                tied.main_grad = torch.zeros_like(tied, dtype=torch.float32)
            else:
                tied.grad = torch.zeros_like(tied)
    sum_grads([(g, group, None if p is tied else owners.get(p)) for p in policy.gpt.parameters()
               if (g := grad_of(p)) is not None and (group := ctx.grad_group(expert_parallel(p))) is not None])
    for name, p in policy.gpt.named_parameters():
        if name.endswith(tp_summed) and owners.get(p, ctx.rank) == ctx.rank and (g := grad_of(p)) is not None:
            ctx.all_reduce_tp(g)
    if tied is not None:
        ctx.all_reduce_embedding_group(grad_of(tied))
    for p, owner in owners.items():
        if owner != ctx.rank:  # (a partial sum)
            p.grad = None
            if hasattr(p, "main_grad"):
                p.main_grad = None


def global_grad_norm(policy: PolicyModel, owners: Optional[Owners] = None) -> torch.Tensor:
    """L2 norm of the whole model's gradient across TP and PP: TP-sharded parameters add up over the
    TP group, replicated ones count once; each stage adds its layers; the tied embedding counts once.
    With ``owners`` (:func:`finalize_grads`'s) each replica holds its own parameters' gradients, summed
    over the data-parallel replicas."""
    ctx = policy.ctx
    skip = None
    if ctx.pp_size > 1 and policy.config.tie_word_embeddings and ctx.is_last_stage and not ctx.is_first_stage:
        skip = policy.gpt.shared_embedding_or_output_weight()
    total = grad_sq_norm([p for p in policy.gpt.parameters() if p is not skip], ctx, owned=bool(owners))
    return ctx.all_reduce_pp(total).sqrt()


@torch.no_grad()
def forward_logprobs(policy: PolicyModel, micro_batches: list[MicroBatch], temperature: float,
                     replay: bool = True, logprob_chunk: int = 0) -> list:
    """log pi(labels) per micro-batch without gradients ([B, L] on the last stage, None elsewhere):
    old log-probs recomputed under filtered sampling, and the reference policy's log-probs.
    ``replay``: route by the micro-batches' routing where they carry it (the reference policy routes
    by its own routers: ``replay=False``); ``logprob_chunk`` as :func:`forward_backward`'s."""
    # (expert parallelism: replicas hold different numbers of micro-batches; sequence parallelism: the
    # forwards as the update's)
    with policy.expert_lockstep(), policy.sequence_parallel():
        return _forward_logprobs(policy, micro_batches, temperature, replay, logprob_chunk)


def _forward_logprobs(policy: PolicyModel, micro_batches: list[MicroBatch], temperature: float,
                      replay: bool, logprob_chunk: int) -> list:
    ctx = policy.ctx
    out: list = []
    for mb in micro_batches:
        replay_routing(policy.routers, mb.routing if replay else None)
        b, L = mb.input_ids.shape
        positions = torch.arange(L, device=ctx.device)[None].expand(b, L)
        meta = policy.metadata(positions, None)  # causal, right-padded rows (as the update's forward)
        shape = (L // update_multiple(ctx), b, policy.config.hidden_size)
        hidden_in = None if ctx.is_first_stage else ctx.recv_forward(shape, policy.dtype)
        res = policy.stage_forward(mb.input_ids, meta, hidden_in, logits_span=mb.loss_span,
                                   project=logprob_chunk == 0)
        if ctx.is_last_stage:
            out.append(stage_logprobs(policy, res, mb, temperature, logprob_chunk, entropy=False)[0])
        else:
            ctx.send_forward(res)
            out.append(None)
    replay_routing(policy.routers, None)
    return out
