"""AdamW on float32 main parameters: the policy update (and the heads') for half-precision models.

A bfloat16 weight cannot move by much less than 2**-9 of itself: at GRPO's learning rates (1e-6)
plain AdamW on bfloat16 parameters rounds nearly every update back to the old value, and the policy
does not learn. As megatron-core's mixed-precision optimizer does, each bfloat16 parameter gets a
float32 main copy that AdamW updates; its gradient accumulates in float32 over the micro-batches of
a step (``param.main_grad``, megatron's name for it: a hook moves each backward's ``.grad`` there),
is reduced over data-parallel replicas and clipped in float32, and the model parameter is the main
copy rounded after every step. float32 and float64 parameters are updated in place, exactly as by
``torch.optim.AdamW``. float16 is refused: it needs loss scaling, which this trainer does not do.

The main copies are part of :meth:`MainParamAdamW.state_dict`, so a resumed run continues from the
same float32 weights, not from their rounding.

With a data-parallel group to shard over (``TrainConfig.shard_optimizer``), the optimizer's state is
split over the replicas, ZeRO stage 1 as megatron-core's distributed optimizer shards it: each
parameter (a whole tensor) is owned by one replica, balanced by size as
``torch.distributed.optim.ZeroRedundancyOptimizer`` deals them out, and only its owner keeps its
AdamW moments (8 bytes a parameter) and, for a bfloat16 parameter, its float32 main copy (4 more).
Each parameter's gradient is summed onto its owner alone (:meth:`MainParamAdamW.grad_owners`: a
reduce, half an all-reduce's traffic, as the distributed optimizer's reduce-scatter; the other
replicas then drop their partial sums), clipped there by the norm summed over the owners, and
stepped there; the owner rounds the parameter into its model and broadcasts its new value to the
others (for bfloat16 parameters half the bytes of their main copies), straight into the others'
parameters. A step's traffic is thus a reduce and a broadcast of the parameters, against an
all-reduce and the broadcast had the gradients been summed onto every replica. Each replica saves and
loads its own shard of the state.

The state dict names the parameter of each state (when the optimizer is given the names): a run
resumed at another TP/PP/DP layout, or with the states sharded where they were not, gathers each
parameter's state from the saved shards and splits it for its own layout
(:meth:`MainParamAdamW.load_named_state`, checkpoint/train_state.py).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

MAIN_PARAMS = "main_params"
SHARD = "zero_shard"  # (rank, replicas) of a sharded state
STATE_NAMES = "state_names"  # the parameter of each index of the state (for a state resharded by name)
MAIN_NAMES = "main_names"  # the parameter of each main copy


def zero_owners(groups: Sequence[Sequence[int]], world: int) -> list[dict[int, int]]:
    """Each parameter's owner among ``world`` replicas, for parameter groups given as their
    parameters' sizes: per group, largest first (in order among equals), each to the replica with
    the fewest elements so far (the first such), the totals running over the groups. This is
    ``ZeroRedundancyOptimizer``'s partition, so that states saved with it load as they are. Returns,
    per group, parameter index -> owner."""
    sizes = [0] * world
    owners: list[dict[int, int]] = []
    for numels in groups:
        owner: dict[int, int] = {}
        for i in sorted(range(len(numels)), key=lambda j: numels[j], reverse=True):
            r = sizes.index(min(sizes))
            owner[i] = r
            sizes[r] += numels[i]
        owners.append(owner)
    return owners


def _accumulate_main_grad(p: torch.Tensor) -> None:
    """Post-accumulate-grad hook of a bfloat16 parameter: add this backward's gradient to the float32
    ``main_grad`` and free ``.grad``."""
    if p.main_grad is None:
        p.main_grad = p.grad.float()
    else:
        p.main_grad.add_(p.grad)
    p.grad = None


def _layout(shard: Optional[Sequence[int]]) -> str:
    return "unsharded" if shard is None else f"shard {shard[0]} of {shard[1]} data-parallel replicas"


class MainParamAdamW:
    """``torch.optim.AdamW`` over float32 main copies of bfloat16 parameters (others in place).

    Reduce and clip the gradients :func:`specroll_mcore.parallel.grad_of` returns (``main_grad`` or
    ``.grad``) between the backward passes and :meth:`step`."""

    def __init__(self, params: Iterable[torch.nn.Parameter], shard_group: Optional[dist.ProcessGroup] = None,
                 no_weight_decay: Optional[Callable[[torch.nn.Parameter], bool]] = None,
                 names: Optional[Sequence[str]] = None, **adamw: Any) -> None:
        """``no_weight_decay``: the parameters it is true of take no weight decay (a second AdamW
        parameter group; the policy update passes megatron-core's default rule, 1-D parameters:
        biases and norms); ``names``: the parameters' names, recorded in the state dict so that a
        run at another layout can load the state by name (:meth:`load_named_state`);
        ``adamw``: torch.optim.AdamW's arguments."""
        self.params = list(params)
        self.names = list(names) if names is not None else None
        if self.names is not None and len(self.names) != len(self.params):
            raise ValueError(f"{len(self.names)} names for {len(self.params)} parameters")
        self._hooks = []
        for p in self.params:
            if p.dtype == torch.float16:
                raise ValueError("float16 training needs loss scaling, which the trainer does not do: convert the "
                                 "checkpoint with --dtype bfloat16 (or float32)")
            if p.dtype == torch.bfloat16:  # (every replica's backward accumulates its float32 gradient)
                p.main_grad = None
                self._hooks.append(p.register_post_accumulate_grad_hook(_accumulate_main_grad))
        members = list(range(len(self.params)))  # AdamW's parameter groups, as indices into params
        groups: list[dict[str, Any]] = [{}]
        if no_weight_decay is not None and adamw.get("weight_decay", 1e-2):  # (torch's AdamW decays by default)
            kept = [no_weight_decay(p) for p in self.params]
            split = [(ix, opts) for ix, opts in (([i for i in members if not kept[i]], {}),
                                                 ([i for i in members if kept[i]], {"weight_decay": 0.0})) if ix]
            groups, indices = [opts for _, opts in split], [ix for ix, _ in split]
        else:
            indices = [members]
        self.shard: Optional[tuple[int, int]] = None
        self.owner = [0] * len(self.params)  # each parameter's replica (all 0 unsharded)
        order = indices
        if shard_group is not None and dist.get_world_size(shard_group) > 1:
            self.shard = (dist.get_rank(shard_group), dist.get_world_size(shard_group))
            self._group = shard_group
            owners = zero_owners([[self.params[i].numel() for i in ix] for ix in indices], self.shard[1])
            order = []  # each group's own parameters, in the partition's order (ZeroRedundancyOptimizer's)
            for ix, owner in zip(indices, owners):
                for j, r in owner.items():
                    self.owner[ix[j]] = r
                order.append([ix[j] for j, r in owner.items() if r == self.shard[0]])
        here = self.shard[0] if self.shard is not None else 0
        # main copies: the bfloat16 parameters' this replica owns (None: another's), the others themselves
        self.main: list[Optional[torch.Tensor]] = [
            p if p.dtype != torch.bfloat16 else p.detach().float().clone() if self.owner[i] == here else None
            for i, p in enumerate(self.params)]
        self.optimizer = torch.optim.AdamW([{"params": [self.main[i] for i in ix], **opts}
                                            for ix, opts in zip(order, groups)], **adamw)
        self._offloaded = False  # (:meth:`offload`)
        self._grad_owners: Optional[dict[torch.nn.Parameter, int]] = None

    def grad_owners(self) -> dict[torch.nn.Parameter, int]:
        """Sharded: the global rank of each parameter's owner, the one replica that needs its summed
        gradient (``specroll_mcore.rl.schedule.finalize_grads`` reduces it there); empty where every
        replica steps every parameter."""
        if self.shard is None:
            return {}
        if self._grad_owners is None:
            ranks = [dist.get_global_rank(self._group, r) for r in range(self.shard[1])]
            self._grad_owners = {p: ranks[o] for p, o in zip(self.params, self.owner)}
        return self._grad_owners

    def _half(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """The bfloat16 parameters with a main copy here (this replica's, when sharded) and their copies."""
        return [(p, m) for p, m in zip(self.params, self.main) if m is not None and m is not p]

    def _state_order(self) -> list[int]:
        """The parameter (its position in ``params``) of each index of the local AdamW's state dict."""
        position = {id(m): i for i, m in enumerate(self.main) if m is not None}
        return [position[id(m)] for group in self.optimizer.param_groups for m in group["params"]]

    def set_lr(self, lr: float) -> None:
        """The learning rate of every parameter group's next steps (a schedule's value)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
            if hasattr(p, "main_grad"):
                p.main_grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.reload()
        half = self._half()
        for p, m in half:
            m.grad = p.main_grad
        self.optimizer.step()
        for p, m in half:
            p.copy_(m)
            m.grad = None
        if self.shard is not None:
            self._share_stepped()

    def offload(self) -> None:
        """Move this replica's optimizer state (AdamW's moments; the float32 main copies kept apart from
        a bfloat16 model) to host memory, pinned where CUDA is, between steps (verl's optimizer
        offload): the rollouts' KV cache gets the device memory it took. :meth:`step` brings it back
        first. Where the parameters live on the host (a CPU run) nothing moves."""
        self._move(offload=True)

    def reload(self) -> None:
        """Bring an offloaded state back to its parameters' device (:meth:`step` does it itself)."""
        self._move(offload=False)

    def _move(self, offload: bool) -> None:
        if offload == self._offloaded:  # (a step of a state never offloaded moves nothing)
            return
        self._offloaded = offload
        host = torch.device("cpu")
        for p, m in zip(self.params, self.main):
            if m is None or p.device == host:
                continue
            target = host if offload else p.device
            if m is not p:
                m.data = moved(m.data, target)
            state = self.optimizer.state.get(m, {})
            for k, v in state.items():
                if torch.is_tensor(v) and k != "step":  # (AdamW keeps its step count on the host)
                    state[k] = moved(v, target)

    def _share_stepped(self) -> None:
        """Every replica's stepped parameters to every other replica: a broadcast of each parameter from
        its owner into the others' (all in flight at once, then waited for; no copy, where a flattened
        bucket per owner took twice as long on gloo for SmolLM2, copies included)."""
        here = self.shard[0]
        sources = [dist.get_global_rank(self._group, r) for r in range(self.shard[1])]
        works = [dist.broadcast(p.detach(), sources[o], group=self._group, async_op=True)
                 for p, o in zip(self.params, self.owner)]
        for w in works:
            w.wait()
        # a collective writes in place without bumping the version counter: bumped here, so that caches
        # keyed by it (cpu_gemm's packed weights) see the new values
        for p, o in zip(self.params, self.owner):
            if o != here:
                torch.autograd.graph.increment_version(p)

    def close(self) -> None:
        """Detach from the parameters (their gradient hooks and ``main_grad``), for an optimizer that
        lives for one job while the parameters live on (a slow-path consolidation)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for p in self.params:
            if p.dtype == torch.bfloat16:
                del p.main_grad

    def state_dict(self) -> dict[str, Any]:
        """AdamW's state dict (the format of ``torch.optim.AdamW``; this replica's shard of it when
        sharded, marked ``zero_shard``), plus the float32 main copies of the bfloat16 parameters (those
        this replica owns, when sharded) under ``main_params`` when there are any."""
        state = self.optimizer.state_dict()
        if self.shard is not None:
            state[SHARD] = list(self.shard)
        half = self._half()
        if half:
            state[MAIN_PARAMS] = [m.detach() for _, m in half]  # saved as they are (torch.save copies)
        if self.names is not None:
            state[STATE_NAMES] = [self.names[i] for i in self._state_order()]
            state[MAIN_NAMES] = [n for n, p, m in zip(self.names, self.params, self.main)
                                 if m is not None and m is not p]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        main = state.pop(MAIN_PARAMS, None)
        shard = state.pop(SHARD, None)
        state.pop(STATE_NAMES, None)
        main_names = state.pop(MAIN_NAMES, None)
        if (tuple(shard) if shard is not None else None) != self.shard:
            raise ValueError(f"the checkpoint's optimizer state is {_layout(shard)}, this run's is "
                             f"{_layout(self.shard)}: resume with the TrainConfig.shard_optimizer and data-parallel "
                             "size it was saved with")
        half = self._half()
        if main is not None and main_names is not None and self.names is not None:
            # by name (a sharded state saved before the main copies were sharded holds every one of them)
            by_name = dict(zip(main_names, main))
            main = [by_name.get(n) for n, p, m in zip(self.names, self.params, self.main)
                    if m is not None and m is not p]
        with torch.no_grad():
            if main is None:  # saved without main copies (a float32 run, or an older half-precision one)
                for p, m in half:
                    m.copy_(p)
            elif (len(main) != len(half) or any(a is None for a in main)
                  or any(a.shape != m.shape for a, (_, m) in zip(main, half))):
                raise ValueError(f"the checkpoint's optimizer holds {len(main)} float32 main parameters; this model "
                                 f"has {len(half)} bfloat16 ones of other shapes or names: it was saved by another "
                                 "model or layout")
            else:
                for a, (p, m) in zip(main, half):
                    m.copy_(a)
                    p.copy_(m)
        self.optimizer.load_state_dict(state)

    def load_named_state(self, moments: Mapping[str, Mapping[str, torch.Tensor]], steps: Mapping[str, float],
                         main: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        """Load a state given by parameter name, in this optimizer's layout: ``moments`` AdamW's
        ``exp_avg`` and ``exp_avg_sq`` (each a name -> tensor mapping), ``steps`` each parameter's
        step count (a parameter not in it keeps no state, as one that never took a step), ``main`` the
        float32 main copies of the bfloat16 parameters (None: rounded up from the parameters). A state
        saved at another TP/PP/DP/EP layout, resharded for this one (checkpoint/train_state.py)."""
        if self.names is None:
            raise ValueError("this optimizer was built without its parameters' names")
        with torch.no_grad():
            for n, p, m in zip(self.names, self.params, self.main):
                if m is None:  # (another replica's: only the model's rounding of it is kept here)
                    if main is not None:
                        p.copy_(main[n])
                elif m is not p:
                    m.copy_(main[n] if main is not None else p)
                    p.copy_(m)
        state = self.optimizer.state_dict()
        indices = [i for group in state["param_groups"] for i in group["params"]]
        for index, i in zip(indices, self._state_order()):
            name, m = self.names[i], self.main[i]
            if name not in steps:
                continue
            got = {k: moments[k][name] for k in ("exp_avg", "exp_avg_sq")}
            if any(t.shape != m.shape for t in got.values()):
                raise ValueError(f"{name}: the optimizer state has shape {tuple(got['exp_avg'].shape)}, the "
                                 f"parameter {tuple(m.shape)}")
            state["state"][index] = {"step": torch.tensor(float(steps[name])),
                                     **{k: t.to(m.dtype).clone() for k, t in got.items()}}
        self.optimizer.load_state_dict(state)


def moved(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` (offloading between uses: the optimizer's state, the KL reference's
    weights): to the host into pinned memory (a fast copy, and an asynchronous one back),
    to a GPU without waiting for the host's copy (the stream orders it); ``t`` itself where it is."""
    if t.device == device:
        return t
    if device.type == "cpu":
        return torch.empty_like(t, device=device, pin_memory=torch.cuda.is_available()).copy_(t)
    return t.to(device, non_blocking=True)


class ExpertSplitAdamW:
    """AdamW for a policy whose routed experts are split over expert-parallel ranks, with its state
    sharded (ZeRO-1): the other parameters' state over the data-parallel replicas, which hold them
    all alike, and the experts' over the replicas that hold the same experts (the expert-data-parallel
    group; not sharded where it is one rank). Two :class:`MainParamAdamW`, one interface; its state
    dict holds both parts (``dense``, ``experts``), this replica's shard of each."""

    def __init__(self, dense: list[torch.nn.Parameter], experts: list[torch.nn.Parameter],
                 shard_group: Optional[dist.ProcessGroup], expert_shard_group: Optional[dist.ProcessGroup],
                 no_weight_decay: Optional[Callable[[torch.nn.Parameter], bool]] = None,
                 names: Optional[Sequence[str]] = None, **adamw: Any) -> None:
        """``names``: those of ``dense``, then those of ``experts`` (see :class:`MainParamAdamW`)."""
        split = (names[:len(dense)], names[len(dense):]) if names is not None else (None, None)
        self.parts = {"dense": MainParamAdamW(dense, shard_group, no_weight_decay, split[0], **adamw),
                      "experts": MainParamAdamW(experts, expert_shard_group, no_weight_decay, split[1], **adamw)}
        self.shard = self.parts["dense"].shard
        self.names = list(names) if names is not None else None

    def set_lr(self, lr: float) -> None:
        for part in self.parts.values():
            part.set_lr(lr)

    def grad_owners(self) -> dict[torch.nn.Parameter, int]:
        return {p: owner for part in self.parts.values() for p, owner in part.grad_owners().items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts.values():
            part.zero_grad(set_to_none)

    def step(self) -> None:
        for part in self.parts.values():
            part.step()

    def offload(self) -> None:
        for part in self.parts.values():
            part.offload()

    def reload(self) -> None:
        for part in self.parts.values():
            part.reload()

    def close(self) -> None:
        for part in self.parts.values():
            part.close()

    def state_dict(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != set(self.parts):
            raise ValueError("the checkpoint's optimizer state was not saved with expert parallelism and a sharded "
                             "optimizer: resume with the TrainConfig.shard_optimizer and parallel layout it was saved "
                             "with")
        for name, part in self.parts.items():
            part.load_state_dict(state[name])

    def load_named_state(self, moments: Mapping[str, Mapping[str, torch.Tensor]], steps: Mapping[str, float],
                         main: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        for part in self.parts.values():
            part.load_named_state(moments, steps, main)
