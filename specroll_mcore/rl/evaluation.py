"""Held-out evaluation of a policy (TrainConfig.eval; verl's validation): the rollout engine answers
held-out prompts and the GRPO reward function scores the answers.

:class:`HeldOut` picks the prompts (those that are training prompts too are left out, the rest cut to
a multiple of the data-parallel size) and :func:`evaluate` rolls them out and scores them. The GRPO
trainer evaluates during training (``eval.every``, ``eval.before_training``); ``specroll eval`` runs
the same evaluation of any checkpoint from the same config, so its figures compare with a run's.
"""

from __future__ import annotations

import functools
import importlib
import math
import numbers
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from specroll_mcore.config import DataConfig, EvalConfig, TrainConfig
from specroll_mcore.rl.data import Example, LoadReport, load_data, render_prompt
from specroll_mcore.rl.rewards import RewardConfig, opens_thinking, parse_reference, score
from specroll_mcore.rollout.base import combined_stats, over_replicas

Scorer = Callable[[list[int], str, Sequence[int]], tuple[float, float]]
"""(response tokens, reference answer, prompt tokens) -> (reward, correct)."""


def usable_prompts(examples: list[Example], data: DataConfig, tokenizer: Any, max_positions: int,
                   report: LoadReport, math_verify: bool = True) -> tuple[list[Example], dict[int, list[int]]]:
    """The examples whose rendered prompt fits the context, and their token ids; the others are
    skipped and counted in ``report`` (a cut question changes its answer). ``math_verify``: the
    rewards are math-verify's (no TrainConfig.reward_fn), so an example whose reference answer it
    finds nothing to check against is skipped and counted too (its responses could not be scored)."""
    limit = min(data.max_prompt_tokens, max_positions - 1)
    kept, prompt_ids = [], {}
    for ex in examples:
        if math_verify and not parse_reference(ex.reference):
            report.skip("unparseable reference answer")
            continue
        ids = render_prompt(tokenizer, ex, data)
        if len(ids) > limit:
            report.skip("prompt over the context limit")
            continue
        kept.append(ex)
        prompt_ids[ex.id] = ids
    return kept, prompt_ids


def reward_function(path: str) -> Callable[..., tuple[float, float]]:
    """``TrainConfig.reward_fn`` (``module:function``, the format the config checks) -> the function."""
    module, name = path.split(":", 1)
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise ValueError(f"TrainConfig.reward_fn {path!r}: cannot import {module!r} ({e}); put its directory on "
                         "PYTHONPATH or install its package") from e
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ValueError(f"TrainConfig.reward_fn {path!r}: {mod.__file__} has no function {name!r}")
    return fn


def checked_reward(name: Optional[str], result: Any) -> tuple[float, float]:
    """A custom reward function's ``(reward, correct)`` as floats, refused by name unless it is two finite
    numbers (Python's, numpy's or one-element tensors): a lone number, or a dict as verl's compute_score
    returns, would fail far from its cause, and a NaN would skip every step it reached."""
    if (isinstance(result, (tuple, list)) and len(result) == 2
            and all((isinstance(x, numbers.Real) or torch.is_tensor(x) and x.numel() == 1) and math.isfinite(float(x))
                    for x in result)):
        return float(result[0]), float(result[1])
    raise ValueError(f"TrainConfig.reward_fn {name!r} returned {result!r}: it must return (reward, correct), two "
                     f"finite numbers (correct: 1 or 0, or a bool)")


def make_scorer(cfg: TrainConfig, tokenizer: Any, reward_fn: Optional[Callable[..., Any]] = None) -> Scorer:
    """The GRPO reward of one response: ``reward_fn`` (TrainConfig.reward_fn, resolved) on the decoded
    text, or math-verify's answer check with TrainConfig.format_reward (after the thinking, where the
    prompt's last tokens leave a ``<think>`` block open: :func:`~specroll_mcore.rl.rewards.final_part`)."""
    rewards = RewardConfig(cfg.format_reward)

    @functools.lru_cache(maxsize=65536)  # (a prompt's G responses, and its later steps, share its tail)
    def thinking(tail: tuple[int, ...]) -> bool:
        return opens_thinking(tokenizer.decode(list(tail)))

    def scorer(tokens: list[int], reference: str, prompt: Sequence[int]) -> tuple[float, float]:
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        if reward_fn is not None:
            return checked_reward(cfg.reward_fn, reward_fn(text, reference, tokens))
        return score(text, reference, rewards, thinking(tuple(prompt[-16:])))

    return scorer


@dataclass
class HeldOut:
    """The prompts of an evaluation, the same on every rank."""

    examples: list[Example]
    prompt_ids: dict[int, list[int]]
    report: LoadReport

    @classmethod
    def load(cls, ev: EvalConfig, seed: int, tokenizer: Any, max_positions: int, training: list[Example],
             dp_size: int, math_verify: bool = True) -> "HeldOut":
        """``ev.data``'s prompts, less those whose question is among ``training``'s (counted), cut to a
        multiple of ``dp_size``, so that every replica rolls out as many of them in as many rollouts
        as the others (expert parallelism runs them in lockstep); ``math_verify`` as
        :func:`usable_prompts`'."""
        examples, report = load_data(ev.data, seed)
        trained = {ex.question for ex in training}
        for ex in examples:
            if ex.question in trained:
                report.skip("also a training prompt")
        examples = [ex for ex in examples if ex.question not in trained]
        usable, prompt_ids = usable_prompts(examples, ev.data, tokenizer, max_positions, report, math_verify)
        if len(usable) < dp_size:
            raise ValueError(f"only {len(usable)} usable evaluation prompts (skipped: {report.skipped}) for "
                             f"{dp_size} data-parallel replicas: raise TrainConfig.eval.data.limit or give "
                             "eval.data another source")
        for _ in range(len(usable) % dp_size):
            report.skip("left over from an even split over the data-parallel replicas")
        return cls(usable[:len(usable) - len(usable) % dp_size], prompt_ids, report)


def evaluate(engine: Any, held_out: HeldOut, ev: EvalConfig, scorer: Scorer, ctx: Any,
             responses: Optional[list[dict[str, Any]]] = None) -> dict[str, Any]:
    """Each data-parallel replica rolls out its share of ``held_out`` (``ev.batch_prompts`` at a time)
    inside the engine's ``held_out()``, with noise keyed by step 0, and ``scorer`` scores every
    response (the reward without the overlong penalty, a shaping of training). Returns
    ``eval_accuracy``, ``eval_reward_mean`` and ``eval_response_len`` over all replicas' responses,
    ``eval_prompts``, ``eval_s``, with several samples a prompt ``eval_pass_at_n`` (the share of
    prompts with a correct response among their ``num_samples``), and for the speculative engine
    ``eval_tau``. ``responses``: a list that gets one record per response of this replica (example
    id, sample, question, reference, response tokens, reward, correct, finish reason)."""
    G, batch = ev.sampling.num_samples, ev.batch_prompts * ctx.dp_size
    t0 = time.perf_counter()
    engine.model.pack_for_inference()
    sums = torch.zeros(5, dtype=torch.float64)  # reward, correct, tokens, responses, prompts solved
    stats = []
    with engine.held_out():
        for start in range(0, len(held_out.examples), batch):
            mine = held_out.examples[start:start + batch][ctx.dp_rank::ctx.dp_size]
            out = engine.generate([held_out.prompt_ids[e.id] for e in mine], ev.sampling, step=0,
                                  prompt_ids=[e.id for e in mine])
            solved = [False] * len(mine)
            for k, toks in enumerate(out.tokens):
                ex = mine[k // G]
                r, c = scorer(toks, ex.reference, held_out.prompt_ids[ex.id])
                sums += torch.tensor([float(r), float(c), len(toks), 1.0, 0.0], dtype=torch.float64)
                solved[k // G] = solved[k // G] or bool(c)
                if responses is not None:
                    responses.append({"id": ex.id, "sample": k % G, "question": ex.question,
                                      "reference": ex.reference, "tokens": toks, "reward": float(r),
                                      "correct": bool(c), "finish_reason": out.finish_reason[k]})
            sums[4] += sum(solved)
            stats.append(out.stats)
    sums = ctx.all_reduce_dp(sums)
    n = float(sums[3])
    row = {"eval_accuracy": float(sums[1]) / n, "eval_reward_mean": float(sums[0]) / n,
           "eval_response_len": float(sums[2]) / n, "eval_prompts": len(held_out.examples),
           "eval_s": time.perf_counter() - t0}
    if G > 1:
        row["eval_pass_at_n"] = float(sums[4]) / len(held_out.examples)
    combined = over_replicas(combined_stats(stats), ctx)  # (over every replica's verification steps)
    if "tau" in combined:
        row["eval_tau"] = combined["tau"]
    return row
