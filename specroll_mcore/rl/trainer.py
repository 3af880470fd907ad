"""The GRPO loop: SpecRoll (or vanilla) rollouts -> verifiable rewards -> group advantages ->
clipped-ratio policy update with megatron-core TP/PP/DP -> metrics -> checkpoints.

The policy is one megatron-core model, the rollout engine and the trained network at once
(colocated: no weight copy, no resharding). Horizon heads ride on it: they read the current policy's
hidden states and its current vocab projection, so they can never be stale copies; they change only
through the slow path, which the SpecRoll engine runs between rollout batches (its state is saved in
every checkpoint), and every policy update advances the policy version they are tied to.

Departures from the GRPO paper, all configurable: token-level loss normalisation by default (DAPO;
``loss_normalization=sequence`` gives the paper's), no KL term by default (``kl_beta``), optional
asymmetric clipping (``clip_high``); DAPO's dynamic sampling (``dynamic_sampling``), soft overlong
punishment (``overlong_buffer``) and overlong filtering (``overlong_filter``) are off by default.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from specroll_mcore import parallel
from specroll_mcore.checkpoint.convert import TOKENIZER_FILES
from specroll_mcore.checkpoint.shard import expert_global_name
from specroll_mcore.checkpoint.smollm2 import resolve_checkpoint
from specroll_mcore.checkpoint.megatron import (CONFIG_FILE, LAYOUT_KEYS, iteration_layout, load_policy,
                                                model_config_of, read_checkpoint_config, stage_layers_of,
                                                stop_token_ids, write_text_atomic)
from specroll_mcore.checkpoint.train_state import (PendingCheckpoint, agreed_latest_checkpoint, check_shared_directory,
                                                   layout_changes, load_training_checkpoint, reshard_refusal,
                                                   save_training_checkpoint, training_layout)
from specroll_mcore.config import TrainConfig
from specroll_mcore.distill import full_head_state
from specroll_mcore.model import PolicyModel
from specroll_mcore.optimizer import ExpertSplitAdamW, MainParamAdamW, moved
from specroll_mcore.rl.data import Example, load_data
from specroll_mcore.rl.evaluation import HeldOut, evaluate, make_scorer, reward_function, usable_prompts
from specroll_mcore.rl.grpo import group_advantages, learning_rate, policy_loss, varied_groups
from specroll_mcore.rl.rewards import overlong_penalty
from specroll_mcore.rl.schedule import (MicroBatch, finalize_grads, forward_backward, forward_logprobs,
                                       balanced_assignment, global_grad_norm, micro_batch_split, moe_aux_loss,
                                       pack_micro_batch, routers_training, sequence_tokens, set_moe_aux_loss_scale,
                                       trained, update_multiple)
from specroll_mcore.rollout import SpeculativeEngine, VanillaEngine, engine_for
from specroll_mcore.rollout.base import FINISH_LENGTH, combined_stats, over_replicas


def reference_weights(policy: PolicyModel, offload: bool = False) -> dict[str, torch.Tensor]:
    """A copy of this stage's weights, the frozen reference of the KL term; ``offload``: in pinned host
    memory (verl's ``ref.param_offload``), brought to the device only for the reference's forwards
    (:func:`swapped_weights`). Where the policy lives on the host it is a plain copy either way."""
    host = torch.device("cpu")
    return {k: moved(p.detach(), host) if offload and p.device != host else p.detach().clone()
            for k, p in policy.gpt.named_parameters()}


@contextlib.contextmanager
def swapped_weights(policy: PolicyModel, state: dict[str, torch.Tensor]) -> Iterator[None]:
    """Run the policy with other weights for the time of the block (the KL reference's): each
    parameter swaps its storage with the state's tensor of the same name, and back, so nothing is
    copied (the CPU's packed layouts are keyed by storage and follow); a tensor offloaded to the host
    comes to its parameter's device first, and that copy is freed when the block ends."""
    params = dict(policy.gpt.named_parameters())
    here = {k: moved(v, params[k].device) for k, v in state.items()}  # (``v`` itself unless offloaded)

    def swap() -> None:
        for k, v in here.items():
            params[k].data, v.data = v.data, params[k].data

    swap()
    try:
        yield
    finally:
        swap()
        here.clear()


class GRPOTrainer:
    def __init__(self, cfg: TrainConfig) -> None:
        self.started = time.monotonic()  # (TrainConfig.exit_duration_in_mins counts from here)
        self.pending: Optional[PendingCheckpoint] = None  # a checkpoint written in the background
        import transformers

        self.cfg = cfg
        self.ctx = parallel.initialize(cfg.parallel)
        if cfg.prompts_per_step < self.ctx.dp_size:
            raise ValueError(f"TrainConfig.prompts_per_step ({cfg.prompts_per_step}) is below the data-parallel size "
                             f"({self.ctx.dp_size}): every replica needs a prompt per step; raise prompts_per_step "
                             "or run fewer data-parallel replicas (world size / (TP x PP))")
        self.reward_fn = reward_function(cfg.reward_fn) if cfg.reward_fn else None  # before the slow work
        torch.manual_seed(cfg.seed)
        self.source = resolve_checkpoint(cfg.checkpoint)
        self.out = Path(cfg.output_dir)
        overrides = {}
        if cfg.moe_aux_loss_coeff is not None:
            if cfg.moe_aux_loss_coeff and not model_config_of(self.source).is_moe:
                raise ValueError(f"TrainConfig.moe_aux_loss_coeff is {cfg.moe_aux_loss_coeff} but the policy in "
                                 f"{self.source} has no experts (a dense model has no router to balance); "
                                 "leave it unset")
            overrides["moe_aux_loss_coeff"] = cfg.moe_aux_loss_coeff
        self.policy = load_policy(self.source, self.ctx, with_heads=cfg.engine == "specroll", overrides=overrides)
        if cfg.routing_replay and not self.policy.config.is_moe:
            raise ValueError(f"TrainConfig.routing_replay is on but the policy in {self.source} has no experts "
                             "(a dense model has no routing to replay); turn it off")
        self.policy.record_routing = cfg.routing_replay
        for p in self.policy.gpt.parameters():
            p.requires_grad_(True)
        if self.policy.heads is not None:
            for p in self.policy.heads.parameters():
                p.requires_grad_(False)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(self.source)
        self.eos = stop_token_ids(self.source, self.tokenizer)

        # Data: prompts that do not fit are skipped and counted (a cut question changes its answer).
        examples, self.data_report = load_data(cfg.data, cfg.seed)
        positions, math_verify = self.policy.config.max_position_embeddings, self.reward_fn is None
        self.examples, self.prompt_ids = usable_prompts(examples, cfg.data, self.tokenizer, positions,
                                                        self.data_report, math_verify)
        if len(self.examples) < cfg.prompts_per_step:
            raise ValueError(f"only {len(self.examples)} usable prompts (skipped: {self.data_report.skipped}); "
                             f"TrainConfig.prompts_per_step is {cfg.prompts_per_step}")
        self.eval_set = HeldOut.load(cfg.eval, cfg.seed, self.tokenizer, positions, self.examples, self.ctx.dp_size,
                                     math_verify) if cfg.eval.enabled else None
        self.scorer = make_scorer(cfg, self.tokenizer, self.reward_fn)

        scheduling = {"pipeline_groups": cfg.parallel.rollout_groups, "max_num_seqs": cfg.max_num_seqs,
                      "max_prefill_tokens": cfg.max_prefill_tokens}
        self.engine = engine_for(cfg.engine, self.policy, cfg.spec, eos_token_ids=self.eos,
                                 tokenizer=self.tokenizer, **scheduling)
        self.vanilla = VanillaEngine(self.policy, eos_token_ids=self.eos, tokenizer=self.tokenizer,
                                     **scheduling) if cfg.compare_vanilla_every else None
        # (named as checkpoints hold them: a run in another layout loads AdamW's states by these names)
        experts = (self.policy.config.num_experts, self.ctx.ep_size, self.ctx.ep_rank)
        names, params = zip(*[(expert_global_name(n, *experts), p) for n, p in self.policy.gpt.named_parameters()
                              if p.requires_grad])
        adamw = dict(no_weight_decay=lambda p: p.ndim < 2, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                     weight_decay=cfg.weight_decay)
        if cfg.shard_optimizer and self.ctx.ep_size > 1:  # experts' state over the ranks holding them alike
            split = [parallel.expert_parallel(p) for p in params]
            self.optimizer: Any = ExpertSplitAdamW([p for p, e in zip(params, split) if not e],
                                                   [p for p, e in zip(params, split) if e],
                                                   self.ctx.dp_group, self.ctx.expert_dp_group,
                                                   names=[n for n, e in zip(names, split) if not e]
                                                   + [n for n, e in zip(names, split) if e], **adamw)
        else:
            self.optimizer = MainParamAdamW(params, shard_group=self.ctx.dp_group if cfg.shard_optimizer else None,
                                            names=names, **adamw)
        # the frozen reference for the KL term: this stage's weights as loaded (a resumed run too)
        self.ref_state = reference_weights(self.policy, cfg.offload_reference) if cfg.kl_beta > 0 else None
        self.state: dict[str, Any] = {"step": 0, "policy_version": 0, "cursor": 0, "epoch": 0,
                                      "skipped_steps": 0, "data_skipped": self.data_report.skipped}
        self.heads_meta: dict[str, Any] = {"num_heads": self.policy.num_heads}
        latest = self._prepare_output()
        if cfg.resume and latest is not None:
            self._resume(latest)
        if cfg.offload_optimizer:  # (from the first rollout on; each step brings the state back)
            self.optimizer.offload()
        self.writer = self._tensorboard()

    # -- setup -------------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, Any]:
        """TrainConfig.eval's held-out evaluation of the current policy (see rl/evaluation.py)."""
        return evaluate(self.engine, self.eval_set, self.cfg.eval, self.scorer, self.ctx)

    def _prepare_output(self) -> Optional[Path]:
        """Checks the output directory and writes the run's config there; returns its latest
        checkpoint (every rank the same), None where it holds none."""
        if self.ctx.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
        self.ctx.barrier()
        check_shared_directory(self.ctx, self.out)  # (before any rank reads what it holds)
        latest = agreed_latest_checkpoint(self.ctx, self.out)
        if not self.cfg.resume and latest is not None:
            raise FileExistsError(f"{self.out} already holds a training checkpoint; pass --resume to continue it "
                                  f"or choose another TrainConfig.output_dir")
        here = training_layout(self.policy, self.optimizer)
        settings = json.loads(json.dumps(self.cfg, default=vars))  # (as the run's config records them)
        if latest is not None:
            meta = read_checkpoint_config(self.out)
            self._check_layout(latest, meta, here)
            # a longer run or another lr is legitimate, but never silent: the exact continuation needs the same
            # seed, data and sampling settings
            changed = changed_settings(meta.get("train_config") or {}, settings)
            if changed and self.ctx.rank == 0:
                print(f"resuming {self.out} with changed settings: "
                      + "; ".join(f"{k} {a!r} -> {b!r}" for k, a, b in changed))
        if self.ctx.rank == 0:
            if not self.cfg.resume and (self.out / "metrics.jsonl").is_file():
                (self.out / "metrics.jsonl").unlink()  # a fresh run: no rows from an earlier, unsaved one
            meta = read_checkpoint_config(self.source)
            meta.update(**{k: here[k] for k in LAYOUT_KEYS}, trained_from=str(self.source), train_config=settings)
            # (other ranks may be reading it meanwhile; a kill leaves the old one whole)
            write_text_atomic(self.out / CONFIG_FILE, json.dumps(meta, indent=2, default=str))
            for name in TOKENIZER_FILES:
                if (self.source / name).is_file():
                    shutil.copy2(self.source / name, self.out / name)
        self.ctx.barrier()
        return latest

    def _check_layout(self, latest: Path, meta: dict[str, Any], here: dict[str, Any]) -> None:
        """A resume at another layout reshards the latest checkpoint (checkpoint/train_state.py), one of
        a run that records its layout and names its optimizer state; anything else is refused here,
        before this run's layout is written over the saved one. ``meta``: the run's config (the layout
        of iterations saved before they recorded their own)."""
        recorded = iteration_layout(latest)
        if recorded is not None:
            changes = layout_changes(recorded, here)
            why = reshard_refusal(recorded, here)
        else:
            saved = {**{k: meta.get(k) for k in LAYOUT_KEYS},
                     "pipeline_stage_layers": stage_layers_of(meta, self.policy.config)}  # (older runs: even)
            changes = [f"{k} {saved[k]} -> {here[k]}" for k in LAYOUT_KEYS if saved[k] != here[k]]
            why = ("it was written before checkpoints recorded their layout; resume with the parallel config it "
                   "was saved with (ParallelConfig)")
        if not changes:
            return
        if why is not None:
            raise ValueError(f"{self.out} was trained in another parallel layout ({'; '.join(changes)}): {why}")
        if self.ctx.rank == 0:
            print(f"resuming {self.out} in another parallel layout ({'; '.join(changes)}): its weights and optimizer "
                  "state are resharded")

    def _resume(self, latest: Path) -> None:
        state, heads, meta, engine_state = load_training_checkpoint(latest, self.policy, self.optimizer)
        self.state = state
        if heads is not None and self.policy.heads is not None:
            self.policy.load_full_heads(heads)
            self.heads_meta = meta
        if engine_state is not None and isinstance(self.engine, SpeculativeEngine):
            self.engine.load_state_dict(engine_state)
        if self.ctx.rank == 0 and (self.out / "metrics.jsonl").is_file():  # drop rows of steps not checkpointed
            rows = [line for line in (self.out / "metrics.jsonl").read_text().splitlines()
                    if line and json.loads(line)["step"] <= state["step"]]
            write_text_atomic(self.out / "metrics.jsonl", "".join(r + "\n" for r in rows))
        if self.ctx.rank == 0:
            print(f"resumed from {latest} at step {state['step']}")

    def _tensorboard(self):
        if not self.cfg.tensorboard or self.ctx.rank != 0:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # pragma: no cover - the package is a dependency
            raise RuntimeError("TensorBoard logging needs the `tensorboard` package (or set tensorboard=false)") from e
        return SummaryWriter(str(self.out / "tb"), purge_step=self.state["step"] + 1)

    # -- data ---------------------------------------------------------------------------------------------
    def _next_examples(self, taken: Optional[set[int]] = None) -> list[Example]:
        """The next P examples of a seeded per-epoch shuffle, none of them twice in a step (``taken``:
        the ids this step already drew). The noise is keyed by the example, so a second copy would roll
        out the same responses; one met again where an epoch wraps is passed over for that epoch. The
        caller leaves at least P examples outside ``taken``. The position is part of the checkpoint."""
        out: list[Example] = []
        seen = set(taken or ())
        while len(out) < self.cfg.prompts_per_step:
            g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.state["epoch"])
            order = torch.randperm(len(self.examples), generator=g).tolist()
            while len(out) < self.cfg.prompts_per_step and self.state["cursor"] < len(order):
                ex = self.examples[order[self.state["cursor"]]]
                self.state["cursor"] += 1
                if ex.id not in seen:
                    out.append(ex)
                    seen.add(ex.id)
            if self.state["cursor"] >= len(order):
                self.state["epoch"] += 1
                self.state["cursor"] = 0
        return out

    # -- one GRPO step -------------------------------------------------------------------------------------
    def step(self) -> dict[str, Any]:
        cfg, ctx, policy = self.cfg, self.ctx, self.policy
        P = cfg.prompts_per_step
        step = self.state["step"]

        # 1. Rollouts, rewards and group advantages: one round of P prompts, or with dynamic sampling
        # more rounds until P groups of varied rewards are in hand. The updated weights are laid out for
        # inference products first, so neither engine's time holds it.
        t0 = time.perf_counter()
        policy.pack_for_inference()
        pack_s = time.perf_counter() - t0
        row: dict[str, Any] = {}
        compare = self.vanilla is not None and cfg.engine != "vanilla" and step % cfg.compare_vanilla_every == 0
        # compared steps take turns at which engine goes first, so that neither is always the one timed
        # right after the policy update
        vanilla_first = compare and (step // cfg.compare_vanilla_every) % 2 == 1
        rounds: list[_Round] = []
        taken: set[int] = set()
        varied = 0  # groups of varied rewards so far (dynamic sampling)
        while True:
            examples = self._next_examples(taken)
            taken.update(e.id for e in examples)
            rounds.append(self._rollout_round(examples, step, compare, vanilla_first, row))
            if not cfg.dynamic_sampling:
                break
            varied += int(rounds[-1].varied.sum())
            if varied >= P or len(rounds) >= cfg.max_sampling_rounds or len(self.examples) - len(taken) < P:
                break

        # 2. Policy update over micro-batches (gradient accumulation), TP/PP/DP.
        t2 = time.perf_counter()
        seqs, trained_groups = self._training_sequences(rounds)
        balance: dict[str, float] = {}
        if seqs and cfg.balance_batch and ctx.dp_size > 1:
            seqs, balance = self._balanced(seqs)
        if seqs:
            minis = self._mini_batches(seqs)
            norm, loss, parts, skipped, extra = self._update(minis)
            mbs = [mb for part in minis for mb in part]
            counts = torch.tensor([sum(float(mb.lengths.sum()) for mb in mbs), sum(mb.input_ids.numel() for mb in mbs)],
                                  dtype=torch.float64)
            real, positions = ctx.all_reduce_dp(counts).tolist()
            extra["update_padding"] = 1.0 - real / positions  # the share of padded positions, every replica's
        else:  # dynamic sampling found too few groups with a learning signal: no update
            norm, loss, parts, skipped, extra = 0.0, 0.0, [], True, {}
            self.state["skipped_steps"] += 1
        train_s = time.perf_counter() - t2 + sum(r.reward_s for r in rounds)

        # 3. Metrics over every response rolled out (summed over data-parallel ranks).
        rewards_t = torch.cat([r.rewards for r in rounds])
        gen_s = sum(r.gen_s for r in rounds)
        n = ctx.all_reduce_dp(torch.tensor(float(rewards_t.numel())))
        sums = ctx.all_reduce_dp(torch.tensor([rewards_t.sum().item(), (rewards_t ** 2).sum().item(),
                                               sum(sum(r.correct) for r in rounds),
                                               float(sum(r.rollout.num_tokens for r in rounds))]))
        mean = float(sums[0] / n)
        stats = combined_stats([r.rollout.stats for r in rounds])
        if ctx.dp_size > 1:  # the figures of every replica's rollout, not the first replica's alone
            stats, slowest = over_replicas(stats, ctx), self._slowest_generation(gen_s, row)
            train_s = max(0.0, train_s - (slowest - gen_s))  # (this rank waited for it in the update's collectives)
            gen_s = slowest
        row.update({
            "step": step + 1, "reward_mean": mean, "reward_std": math.sqrt(max(0.0, float(sums[1] / n) - mean ** 2)),
            "accuracy": float(sums[2] / n), "response_len": float(sums[3] / n), "generation_s": gen_s,
            "training_s": train_s, "pack_s": pack_s, "step_s": pack_s + gen_s + train_s,
            "gen_share": gen_s / max(1e-9, pack_s + gen_s + train_s),
            "gen_tokens_per_s": float(sums[3]) / max(1e-9, gen_s),  # every replica's tokens in the step's generation
            "loss": loss, "grad_norm": norm, "skipped": skipped, "policy_version": self.state["policy_version"],
            "lr": self._lr(),
            **over_tokens(parts, ("clip_fraction", "kl"), ctx),
        })
        row.update(extra)
        row.update(balance)
        if cfg.dynamic_sampling:
            row.update(sampling_rounds=len(rounds), groups_varied=varied, groups_trained=trained_groups)
        if cfg.overlong_filter:  # responses cut at the length limit, masked out of the loss
            cut = sum(not trained(s) for s in seqs if s[6] is not None)  # (not an idle_sequence)
            row["overlong_filtered"] = int(ctx.all_reduce_dp(torch.tensor(float(cut))))
        if "tau" in stats:
            row["tau"] = stats["tau"]
            row["nodes_per_row"] = stats["nodes_per_row"]
            row["acceptance_per_head"] = stats["acceptance_per_depth"]
            row["reflex_gate_open"] = stats.get("reflex_gate_open", 0.0)
        if stats.get("slow_path"):
            sp = stats["slow_path"]
            row.update(slow_path_events=sp["events"], slow_path_share=sp["time_share"],
                       slow_path_monitor_share=sp["monitor_share"], slow_path_records=sp["records"])
            if sp["event"]:
                row["slow_path_event"] = {k: sp["event"][k] for k in ("head", "steps", "kept", "heldout_before",
                                                                       "heldout_after", "seconds")}
        self.state["step"] = step + 1
        return row

    def _rollout_round(self, examples: list[Example], step: int, compare: bool, vanilla_first: bool,
                       row: dict[str, Any]) -> "_Round":
        """This replica's share of ``examples`` rolled out (the exactness contract keys the noise by the
        step and the example ids), scored and turned into group advantages."""
        cfg, ctx, G = self.cfg, self.ctx, self.cfg.sampling.num_samples
        mine = examples[ctx.dp_rank::ctx.dp_size]  # whole groups per data-parallel rank
        prompts = [self.prompt_ids[e.id] for e in mine]
        ids = [e.id for e in mine]
        if vanilla_first:
            ref = self._timed_vanilla(prompts, ids, step, row)
        t0 = time.perf_counter()
        rollout = self.engine.generate(prompts, cfg.sampling, step=step, prompt_ids=ids)
        gen_s = time.perf_counter() - t0
        if compare:
            if not vanilla_first:
                ref = self._timed_vanilla(prompts, ids, step, row)
            row["rollouts_identical"] = row.get("rollouts_identical", True) and ref.tokens == rollout.tokens
        t1 = time.perf_counter()
        rewards, correct = [], []
        for k, toks in enumerate(rollout.tokens):
            r, c = self.scorer(toks, mine[k // G].reference, prompts[k // G])
            rewards.append(float(r) + overlong_penalty(len(toks), cfg.sampling.max_new_tokens, cfg.overlong_buffer,
                                                       cfg.overlong_penalty))
            correct.append(float(c))
        rewards_t = torch.tensor(rewards, dtype=torch.float32)
        adv = group_advantages(rewards_t, G, cfg.adv_mean_only, cfg.adv_eps)
        varied = None
        if cfg.dynamic_sampling:  # every replica learns every group's verdict, in the examples' order
            flags = torch.zeros(len(examples))
            flags[ctx.dp_rank::ctx.dp_size] = varied_groups(rewards_t, G).float()
            varied = ctx.all_reduce_dp(flags) > 0
        return _Round(examples, prompts, rollout, rewards_t, correct, adv, varied, gen_s, time.perf_counter() - t1)

    def _training_sequences(self, rounds: list["_Round"]) -> tuple[list[tuple], int]:
        """This replica's (prompt, response tokens, rollout log-probs, advantage) to train on, and the
        number of groups trained on over all replicas. One round: its own responses. With dynamic
        sampling: the first P groups of varied rewards in (round, prompt) order, dealt out evenly over
        the replicas; fewer groups than replicas, their responses dealt out one by one (a replica left
        without one takes one with no loss, to join the update's reductions), so that the step trains
        on them at any data-parallel size."""
        ctx, G = self.ctx, self.cfg.sampling.num_samples
        # (a replica's prompt j is the step's prompt j x dp_size + dp_rank: prompts are dealt out in turn)
        seqs = [response_sequences(r.prompts, r.rollout, r.advantages, G, self.cfg.overlong_filter,
                                   [j * ctx.dp_size + ctx.dp_rank for j in range(len(r.prompts))]) for r in rounds]
        if not self.cfg.dynamic_sampling:
            return seqs[0], len(rounds[0].examples)
        chosen = [(place, [(*seq[:6], place * G + s) for s, seq in enumerate(seqs[r][j * G:(j + 1) * G])])
                  for place, r, j in chosen_groups([r.varied for r in rounds], self.cfg.prompts_per_step,
                                                   ctx.dp_size, ctx.dp_rank)]
        groups = sorted((g for part in ctx.all_gather_object_dp(chosen) for g in part), key=lambda g: g[0])
        if not groups:
            return [], 0
        if len(groups) >= ctx.dp_size:
            return [seq for _, g in groups[ctx.dp_rank::ctx.dp_size] for seq in g], len(groups)
        every = [seq for _, g in groups for seq in g]
        return every[ctx.dp_rank::ctx.dp_size] or [idle_sequence(every[0])], len(groups)

    def _balanced(self, seqs: list[tuple]) -> tuple[list[tuple], dict[str, float]]:
        """This replica's share of the update's sequences once they are dealt out over the replicas by
        their tokens (TrainConfig.balance_batch, schedule.balanced_assignment), and the step's metrics:
        ``dp_tokens_max_over_mean`` (the largest replica's tokens over the mean) as trained and as the
        rollout left them (``_rollout``), and ``dp_sequences_moved``. Sequences not trained on stay on
        their replica. Only those that move are exchanged."""
        ctx = self.ctx
        train = [s for s in seqs if trained(s)]
        costs = ctx.all_gather_object_dp([sequence_tokens(s) for s in train])
        plan = balanced_assignment(costs)
        moves = [(d, r, i) for d, part in enumerate(plan) for r, i in part if r != d]
        received: dict[tuple[int, int], tuple] = {}
        if moves:  # every replica has the same plan, so all of them take part or none
            sent = {(r, i): train[i] for _, r, i in moves if r == ctx.dp_rank}
            for part in ctx.all_gather_object_dp(sent):
                received.update(part)
        mine = [train[i] if r == ctx.dp_rank else received[(r, i)] for r, i in plan[ctx.dp_rank]]

        def imbalance(loads: list[int]) -> float:
            return max(loads) * len(loads) / max(1, sum(loads))

        after = [sum(costs[r][i] for r, i in part) for part in plan]
        return mine + [s for s in seqs if not trained(s)], {
            "dp_tokens_max_over_mean": imbalance(after),
            "dp_tokens_max_over_mean_rollout": imbalance([sum(c) for c in costs]),
            "dp_sequences_moved": len(moves)}

    def _update(self, minis: list[list[MicroBatch]]) -> tuple[float, float, list[dict], bool, dict[str, Any]]:
        """The step's optimizer steps: TrainConfig.ppo_epochs passes over the mini-batches, one
        optimizer step each, every one on its micro-batches (gradient accumulation). The old log-probs
        (the rollout's, or recomputed where it filtered its distribution) and the KL reference's are
        those of the weights the step starts from, so that later mini-batches see the ratio to the
        policy that sampled them (PPO's clipping at work). Returns (grad norm and loss, each the mean
        over the optimizer steps; per-micro-batch metrics of them all; whether any was skipped; step
        metrics). The step metrics: ``rollout_logp_gap_mean`` / ``_max``, |log-prob of the first
        forward - the rollout's| over the response tokens (same weights: how far the rollout's numerics
        are from the update's, where the rollout's log-probs are the old ones), ``entropy`` (the
        policy's, at the sampling temperature, mean over the response tokens of all replicas and
        optimizer steps: its fall is the entropy collapse DAPO's clip-higher works against),
        ``moe_aux_loss`` (the unweighted load-balancing loss of a mixture of experts that applies one,
        mean over the optimizer steps) and, where there are several, ``optimizer_steps``."""
        cfg, policy = self.cfg, self.policy
        every = [mb for mbs in minis for mb in mbs]
        recomputed = cfg.sampling.top_p < 1 or cfg.sampling.top_k > 0 or cfg.sampling.min_p > 0
        if recomputed:
            # the rollout's log-probs are of the filtered distribution: recompute unfiltered ones
            for mb, lp in zip(every, forward_logprobs(policy, every, cfg.sampling.temperature,
                                                      logprob_chunk=cfg.logprob_chunk)):
                if lp is not None:
                    mb.old_logp = lp.detach()
        if self.ref_state is not None:
            with swapped_weights(policy, self.ref_state):
                for mb, lp in zip(every, forward_logprobs(policy, every, cfg.sampling.temperature, replay=False,
                                                          logprob_chunk=cfg.logprob_chunk)):
                    mb.ref_logp = lp
        norms, losses, pg_losses, parts, aux, skipped, taken = [], [], [], [], [], False, 0
        entropy, tokens = 0.0, 0.0
        extra: dict[str, Any] = {}
        for epoch in range(cfg.ppo_epochs):
            for k, mbs in enumerate(minis):
                first = epoch == 0 and k == 0
                out = self._optimizer_step(mbs, gap=first and not recomputed)
                if out is None:  # every response of the mini-batch masked out (overlong filtering)
                    skipped = True
                    continue
                norm, loss, step_parts, stepped, step_extra = out
                skipped |= not stepped
                taken += stepped
                norms.append(norm)
                losses.append(loss)
                parts += step_parts
                entropy += step_extra.pop("entropy_sum")
                tokens += step_extra.pop("tokens")
                pg_losses.append(step_extra.pop("pg_loss"))
                if "moe_aux_loss" in step_extra:
                    aux.append(step_extra.pop("moe_aux_loss"))
                extra.update(step_extra)
        if not norms:
            return 0.0, 0.0, [], True, {}
        extra["entropy"] = entropy / tokens
        extra["pg_loss"] = sum(pg_losses) / len(pg_losses)
        if aux:
            extra["moe_aux_loss"] = sum(aux) / len(aux)
        if cfg.mini_batches * cfg.ppo_epochs > 1:
            extra["optimizer_steps"] = taken
        return sum(norms) / len(norms), sum(losses) / len(losses), parts, skipped, extra

    def _optimizer_step(self, mbs: list[MicroBatch], gap: bool) -> Optional[tuple[float, float, list[dict], bool,
                                                                                   dict[str, float]]]:
        """One optimizer step on the micro-batches of a mini-batch: (grad norm, loss, per-micro-batch
        metrics, whether the weights were updated (not where the loss or the norm is not finite), step
        metrics: ``entropy_sum`` and ``tokens`` over all replicas, ``moe_aux_loss``, and with ``gap``
        the rollout log-prob gap); None where no replica has a response token to learn from."""
        cfg, ctx, policy = self.cfg, self.ctx, self.policy
        total_tokens = ctx.all_reduce_dp(torch.tensor(float(sum(float(mb.loss_mask.sum()) for mb in mbs))))
        total_seqs = ctx.all_reduce_dp(torch.tensor(float(sum(int((mb.loss_mask.sum(1) > 0).sum()) for mb in mbs))))
        if float(total_tokens) == 0:
            self.state["skipped_steps"] += 1
            return None

        def loss_fn(mb: MicroBatch, logp: torch.Tensor, entropy: Optional[torch.Tensor] = None):
            out = policy_loss(logp, mb.old_logp, mb.advantages, mb.loss_mask, cfg.clip_low, cfg.clip_high,
                              normalization=cfg.loss_normalization, ref_logp=mb.ref_logp, kl_beta=cfg.kl_beta,
                              total_tokens=float(total_tokens), total_sequences=float(total_seqs),
                              max_tokens=cfg.sampling.max_new_tokens, ratio_level=cfg.ratio_level,
                              clip_ratio_c=cfg.clip_ratio_c, entropy=entropy, entropy_coeff=cfg.entropy_coeff,
                              kl_estimator=cfg.kl_estimator)
            m = {"loss": float(out.loss.detach()), "pg_loss": out.pg_loss, "clip_fraction": out.clip_fraction,
                 "ratio": out.ratio_mean, "kl": out.kl, "tokens": float(mb.loss_mask.sum())}
            if gap:  # the rollout's log-probs against this forward's, same weights: numerics alone
                diff = torch.where(mb.loss_mask > 0, (logp.detach() - mb.old_logp).abs(), 0.0)
                m["logp_gap_sum"], m["logp_gap_max"] = torch.stack([diff.sum(), diff.max()]).tolist()
            return out.loss, m

        self.optimizer.zero_grad(set_to_none=True)
        balanced = policy.config.is_moe and policy.config.moe_aux_loss_coeff > 0
        if balanced:
            total_mbs = int(ctx.all_reduce_dp(torch.tensor(float(len(mbs)))))
            set_moe_aux_loss_scale(total_mbs)
        with routers_training(policy) if balanced else contextlib.nullcontext():
            parts = forward_backward(policy, mbs, loss_fn, cfg.sampling.temperature, cfg.recompute_activations,
                                     cfg.logprob_chunk, entropy_grad=cfg.entropy_coeff > 0)
        extra = {"moe_aux_loss": moe_aux_loss(policy, total_mbs, cfg.recompute_activations)} if balanced else {}
        owners = self.optimizer.grad_owners()  # (sharded: each gradient summed onto its owner alone)
        finalize_grads(policy, owners)
        norm = float(global_grad_norm(policy, owners))
        loss, pg_loss, entropy = ctx.all_reduce_dp(torch.tensor(
            [sum(p[k] for p in parts) for k in ("loss", "pg_loss", "entropy_sum")], dtype=torch.float64)).tolist()
        extra.update(pg_loss=pg_loss, entropy_sum=entropy, tokens=float(total_tokens))
        if gap:
            gap_sum = ctx.all_reduce_dp(torch.tensor(sum(p["logp_gap_sum"] for p in parts)))
            gap_max = ctx.all_reduce_max(torch.tensor(max((p["logp_gap_max"] for p in parts), default=0.0)))
            extra.update(rollout_logp_gap_mean=float(gap_sum / total_tokens), rollout_logp_gap_max=float(gap_max))
        if not (math.isfinite(norm) and math.isfinite(loss)):
            self.optimizer.zero_grad(set_to_none=True)  # skip the update; the last checkpoint stays valid
            self.state["skipped_steps"] += 1
            return norm, loss, parts, False, extra
        if cfg.grad_clip > 0:
            parallel.clip_grads(list(policy.gpt.parameters()), norm, cfg.grad_clip)
        self.optimizer.set_lr(self._lr())
        self.optimizer.step()
        # the gradients (float32: 4 bytes a parameter) are not kept through the next rollout, whose KV
        # cache gets their memory (the rollout's check, rollout.base.plan_rows, counts what is free then)
        self.optimizer.zero_grad(set_to_none=True)
        if cfg.offload_optimizer:
            self.optimizer.offload()
        self.state["policy_version"] += 1  # the heads are tied to the new policy version
        return norm, loss, parts, True, extra

    def _slowest_generation(self, gen_s: float, row: dict[str, Any]) -> float:
        """The generation time a step waits for: the slowest data-parallel replica's; the vanilla engine's
        too (in ``row``), whose rollouts are identical only if every replica's were."""
        ctx = self.ctx
        worst = ctx.all_reduce_max(torch.tensor([gen_s, row.get("vanilla_gen_s", 0.0),
                                                 float(not row.get("rollouts_identical", True))],
                                                dtype=torch.float64, device=ctx.device)).tolist()
        if "vanilla_gen_s" in row:
            row.update(vanilla_gen_s=worst[1], rollouts_identical=not worst[2])
        return worst[0]

    def _timed_vanilla(self, prompts: list, ids: list, step: int, row: dict[str, Any]) -> Any:
        """The vanilla engine's rollout of the same step (the reference SpecRoll's is timed against)."""
        t = time.perf_counter()
        ref = self.vanilla.generate(prompts, self.cfg.sampling, step=step, prompt_ids=ids)
        row["vanilla_gen_s"] = row.get("vanilla_gen_s", 0.0) + time.perf_counter() - t
        return ref

    def _lr(self) -> float:
        """This step's learning rate (TrainConfig.lr_warmup_steps, lr_decay): a function of the step
        alone, so a resumed run follows the same schedule."""
        cfg = self.cfg
        return learning_rate(self.state["step"] + 1, cfg.lr, cfg.steps, cfg.lr_warmup_steps, cfg.lr_decay, cfg.min_lr)

    def _mini_batches(self, seqs: list[tuple]) -> list[list[MicroBatch]]:
        """This replica's share of the step's TrainConfig.mini_batches parts, one optimizer step each,
        each in micro-batches (:meth:`_micro_batches`). The parts are consecutive in the step's batch
        over all replicas (the sequences' places, response_sequences), the first ones taking the larger
        shares, so that an optimizer step trains on the same responses at any data-parallel size and
        however balance_batch dealt them out. Sequences not trained on (overlong filtering: the longest
        ones) are left out, as their loss terms and its normalisation are 0. A part with no sequence
        here holds one with no loss, so that this replica still joins that optimizer step's reductions
        (a step whose replicas all have none skips it)."""
        M, train = self.cfg.mini_batches, [s for s in seqs if trained(s)]
        idle = idle_sequence(seqs[0])
        if M == 1:
            return [self._micro_batches(train or [idle])]
        places = sorted(p for part in self.ctx.all_gather_object_dp([s[6] for s in train]) for p in part)
        cuts = [-(-k * len(places) // M) for k in range(M + 1)]
        bounds = [places[c] if c < len(places) else math.inf for c in cuts]  # (the places each part starts at)
        return [self._micro_batches([s for s in train if bounds[k] <= s[6] < bounds[k + 1]] or [idle])
                for k in range(M)]

    def _micro_batches(self, seqs: list[tuple]) -> list[MicroBatch]:
        """(prompt, response tokens, rollout log-probs, advantage, trained, ...) -> prompt + response
        sequences, labels shifted by one, loss on response tokens only; split by
        TrainConfig.micro_batch_size and micro_batch_tokens (schedule.micro_batch_split)."""
        multiple = update_multiple(self.ctx)  # (sequence parallelism: each TP rank takes as many positions)
        split = micro_batch_split([sequence_tokens(s) for s in seqs], self.cfg.micro_batch_size,
                                  self.cfg.micro_batch_tokens, multiple)
        return [pack_micro_batch([seqs[i] for i in idx], self.ctx.device, multiple) for idx in split]

    # -- loop ---------------------------------------------------------------------------------------------
    def save(self, background: bool = False) -> Path:
        """A checkpoint of this step (a collective); ``background``: written while training goes on
        (TrainConfig.async_save), named by the tracker once :meth:`commit_pending` renames it into place.
        A checkpoint still being written is committed first."""
        self.commit_pending()
        heads = full_head_state(self.policy) if self.policy.heads is not None else None  # TP-gathered
        meta = {**self.heads_meta, "policy_version": self.state["policy_version"]}
        engine = self.engine.state_dict() if isinstance(self.engine, SpeculativeEngine) else None
        saved = save_training_checkpoint(self.out, self.state["step"], self.policy, self.optimizer, dict(self.state),
                                         heads, meta, self.cfg.keep_last, engine_state=engine, background=background)
        if isinstance(saved, PendingCheckpoint):
            self.pending = saved
            return saved.path
        return saved

    def commit_pending(self) -> None:
        """Rename the checkpoint written in the background into place, once this rank's files are
        written (a collective)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.commit()

    def log(self, row: dict[str, Any]) -> None:
        if self.ctx.rank != 0:
            return
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.writer.add_scalar(k, v, row["step"])
            self.writer.flush()

    def _agree(self, received: bool) -> tuple[bool, float, bool]:
        """(whether any rank got TrainConfig.exit_signal, the most minutes any rank has run, whether every
        rank has written its files of the checkpoint saved in the background), agreed by every rank in
        one all-reduce (none where nothing asks for one)."""
        if self.cfg.exit_signal is None and self.cfg.exit_duration_in_mins is None and self.pending is None:
            return False, 0.0, True
        unwritten = self.pending is not None and not self.pending.written()
        flags = self.ctx.all_reduce_max(torch.tensor([float(received), (time.monotonic() - self.started) / 60,
                                                      float(unwritten)], dtype=torch.float64,
                                                     device=self.ctx.device)).tolist()
        return bool(flags[0]), flags[1], not flags[2]

    def run(self, stop_after: Optional[int] = None) -> list[dict[str, Any]]:
        from tqdm import tqdm

        rows = []
        ev = self.cfg.eval
        if ev.before_training and self.state["step"] == 0:
            row = {"step": 0, **self.evaluate()}
            self.log(row)
            rows.append(row)
        bar = tqdm(total=self.cfg.steps, initial=self.state["step"], desc="GRPO", disable=self.ctx.rank != 0)
        with caught(self.cfg.exit_signal) as received:
            while self.state["step"] < self.cfg.steps:
                row = self.step()
                if ev.every and (self.state["step"] % ev.every == 0 or self.state["step"] == self.cfg.steps):
                    row.update(self.evaluate())
                self.log(row)
                rows.append(row)
                bar.update(1)
                bar.set_postfix(reward=f"{row['reward_mean']:.2f}", gen=f"{row['generation_s']:.0f}s",
                                train=f"{row['training_s']:.0f}s")
                # every rank stops after the same step, whichever ranks the signal reached or ran out of time
                signalled, minutes, written = self._agree(received())
                if written:  # (a checkpoint saved in the background, its files now written on every rank)
                    self.commit_pending()
                timed_out = self.cfg.exit_duration_in_mins is not None and minutes >= self.cfg.exit_duration_in_mins
                stop = signalled or timed_out
                last = self.state["step"] == self.cfg.steps
                if stop or last or self.state["step"] % self.cfg.save_every == 0:
                    path = self.save(background=self.cfg.async_save and not (stop or last))
                if stop:
                    if self.ctx.rank == 0:
                        limit = self.cfg.exit_duration_in_mins
                        why = (f"{self.cfg.exit_signal} received" if signalled else
                               f"exit_duration_in_mins ({limit:g}) reached at {minutes:.2f} min")
                        print(f"\n{why}: saved {path} after step {self.state['step']}; continue with --resume")
                    break
                if stop_after is not None and len(rows) >= stop_after:
                    break
        self.commit_pending()
        bar.close()
        if self.ctx.rank == 0 and rows:
            print(summary_table(rows))
            if isinstance(self.engine, SpeculativeEngine):
                per_replica = -(-self.cfg.prompts_per_step // self.ctx.dp_size) * self.cfg.sampling.num_samples
                in_flight = min(per_replica, self.cfg.max_num_seqs or per_replica)
                note = plain_decoding_note(rows, self.engine.c_hw, in_flight)
                if note:
                    print(note)
        return rows


def over_tokens(parts: list[dict[str, float]], names: tuple[str, ...], ctx: Any) -> dict[str, float]:
    """Micro-batch metrics ``names`` (``parts``: this replica's micro-batches, each with its ``tokens``)
    as means over every replica's response tokens, as micro-batches and replicas differ in size."""
    sums = ctx.all_reduce_dp(torch.tensor([*(sum(p[n] * p["tokens"] for p in parts) for n in names),
                                           sum(p["tokens"] for p in parts)], dtype=torch.float64, device=ctx.device))
    *weighted, tokens = sums.tolist()
    return {n: w / max(1.0, tokens) for n, w in zip(names, weighted)}


@contextlib.contextmanager
def caught(name: Optional[str]) -> Iterator[Callable[[], bool]]:
    """Inside, the signal ``name`` (TrainConfig.exit_signal) is only recorded: yields whether it came. The
    first one puts the signal's previous action back, so that a second acts at once. Outside the main
    thread (where Python cannot handle signals) or with None, nothing is caught."""
    if name is None or threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    number = getattr(signal, name)
    came: list[int] = []

    def record(signum: int, frame: Any) -> None:
        came.append(signum)
        signal.signal(signum, previous)

    previous = signal.signal(number, record)
    if previous is None:  # (set outside Python)
        previous = signal.SIG_DFL
    try:
        yield lambda: bool(came)
    finally:
        signal.signal(number, previous)


def changed_settings(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted field, saved value, current value) for every TrainConfig field a resumed run changes
    (``resume`` itself aside); a field missing on one side (a config of another version) counts as
    changed."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if prefix + key == "resume" or a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out += changed_settings(a, b, f"{prefix}{key}.")
        else:
            out.append((prefix + key, a, b))
    return out


@dataclass
class _Round:
    """One rollout round of a step on this data-parallel replica."""

    examples: list[Example]  # the round's prompts over all replicas (this one has every dp_size-th)
    prompts: list[list[int]]  # this replica's
    rollout: Any  # RolloutOutput
    rewards: torch.Tensor  # [len(prompts) * G]
    correct: list[float]
    advantages: torch.Tensor  # [len(prompts) * G]
    varied: Optional[torch.Tensor]  # [len(examples)] bool: groups of varied rewards (dynamic sampling)
    gen_s: float
    reward_s: float


def response_sequences(prompts: list[list[int]], rollout: Any, advantages: torch.Tensor, G: int,
                       overlong_filter: bool = False, places: Optional[Sequence[int]] = None) -> list[tuple]:
    """(prompt, response tokens, rollout log-probs, advantage, trained, routing, place) of every response
    of a rollout, in its order (response k answers prompt k // G): what the policy update trains on.
    With ``overlong_filter`` a response cut at the length limit is not trained on (DAPO); ``routing``:
    its tokens' experts where the rollout kept them (TrainConfig.routing_replay), else None; ``place``:
    where the response stands in the step's batch over all data-parallel replicas (its prompt's place
    in ``places`` x G + its sample; default: the rollout's order), which decides its mini-batch
    (GRPOTrainer._mini_batches)."""
    routing = rollout.routing or [None] * len(rollout.tokens)
    places = range(len(prompts)) if places is None else places
    return [(prompts[k // G], toks, lps, float(advantages[k]), not (overlong_filter and reason == FINISH_LENGTH),
             routing[k], places[k // G] * G + k % G)
            for k, (toks, lps, reason) in enumerate(zip(rollout.tokens, rollout.logprobs, rollout.finish_reason))]


def idle_sequence(seq: tuple) -> tuple:
    """``seq`` (response_sequences) with nothing to learn and no place in the step: one a replica holds
    to join an optimizer step's reductions where it has no response to train on."""
    return (*seq[:4], False, seq[5], None)


def chosen_groups(varied: list[torch.Tensor], count: int, dp_size: int, dp_rank: int) -> list[tuple[int, int, int]]:
    """Dynamic sampling's choice: the first ``count`` groups of varied rewards over a step's rounds,
    in (round, prompt) order. ``varied``: per round, [prompts of all replicas] bool, prompt i being
    replica ``i % dp_size``'s local group ``i // dp_size``. Returns this replica's chosen groups as
    (place in the order, round, local group index)."""
    out, place = [], 0
    for r, flags in enumerate(varied):
        for i in flags.nonzero().flatten().tolist():
            if place == count:
                return out
            if i % dp_size == dp_rank:
                out.append((place, r, i // dp_size))
            place += 1
    return out


def plain_decoding_note(rows: list[dict[str, Any]], c_hw: int, in_flight: int) -> Optional[str]:
    """Why tau is 1 where SpecRoll drafted no node beyond each row's root at any step (None where it
    drafted): the summary table's last line, so that a run on a CPU does not read as a failed engine."""
    nodes = [r["nodes_per_row"] for r in rows if "nodes_per_row" in r]
    if not nodes or max(nodes) > 1.0:
        return None
    return (f"SpecRoll decoded plainly at every step (one node a row, tau 1): up to {in_flight} responses in flight "
            f"and a verification forward profiled at C_hw = {c_hw} tokens for this hardware leave no room for "
            "drafts that pay for their latency. Speculation pays where fewer responses share a forward (batch 1 "
            "on a 2-core CPU: tools/bench_specroll.py) or where a forward costs the same over more tokens (a GPU).")


def summary_table(rows: list[dict[str, Any]]) -> str:
    """The run's rows as a table: one line a step, '-' where a step lacks the figure."""
    cols = [("step", "{:>4}"), ("reward_mean", "{:>7.3f}"), ("accuracy", "{:>6.3f}"), ("response_len", "{:>6.1f}"),
            ("entropy", "{:>6.3f}"), ("tau", "{:>5.2f}"), ("nodes_per_row", "{:>5.2f}"), ("generation_s", "{:>7.1f}"),
            ("vanilla_gen_s", "{:>7.1f}"), ("training_s", "{:>7.1f}"), ("gen_share", "{:>5.2f}"),
            ("eval_accuracy", "{:>6.3f}")]
    labels = {"nodes_per_row": "nodes/row", "vanilla_gen_s": "vanilla_gen", "eval_accuracy": "eval_acc"}  # (<= 12)
    head = " ".join(f"{labels.get(c, c):>12}" for c, _ in cols)
    lines = [head]
    for r in rows:
        lines.append(" ".join(f"{(fmt.format(r[c]) if c in r else '-'):>12}" for c, fmt in cols))
    return "\n".join(lines)
