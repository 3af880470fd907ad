"""The GRPO loop on a tiny random policy (SmolLM2's tokenizer): update direction, the exactness
contract at the RL level (vanilla vs SpecRoll), resume after SIGKILL, bad input."""

import builtins
import dataclasses
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpo_fixtures import BUSY_SLOW_PATH, tiny_policy_checkpoint
from specroll_mcore.config import TrainConfig, load_config
from specroll_mcore.rl.grpo import policy_loss
from specroll_mcore.rl.schedule import (finalize_grads, forward_backward, forward_logprobs, pack_micro_batch,
                                       saved_for_backward)
from specroll_mcore.rl.trainer import (GRPOTrainer, plain_decoding_note, response_sequences, summary_table,
                                      swapped_weights)
from specroll_mcore.rollout import VanillaEngine

TESTS = Path(__file__).resolve().parent.parent


def assert_grads_close(actual, expected, rel=1e-5):
    """Float32 gradients summed in another order (pieces, micro-batches, padding): each tensor within
    ``rel`` of its own largest entry. A large tensor's sums (the vocabulary projection's) round at that
    scale, so an absolute bound alike for every tensor fails on CPUs whose kernels sum differently."""
    for a, b in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=rel, atol=rel * float(b.abs().max()))


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    return tiny_policy_checkpoint(tmp_path_factory.mktemp("grpo"))


def overrides(ckpt, out, *extra):
    return [f"checkpoint={ckpt}", f"output_dir={out}", "steps=3", "prompts_per_step=2", "sampling.num_samples=3",
            "sampling.max_new_tokens=12", "micro_batch_size=4", "lr=1e-3", "save_every=1",
            "reward_fn=rewards_for_tests:token_parity_reward", "data.limit=16", "tensorboard=false", *extra]


def test_one_step_lowers_the_loss_on_its_batch(tiny_ckpt, tmp_path, ctx):
    trainer = GRPOTrainer(load_config(TrainConfig, None, overrides(tiny_ckpt, tmp_path / "run", "engine=vanilla")))
    mbs = trainer._micro_batches(step_sequences(trainer, [1.0, -1.0, 0.5, -0.5, 1.0, -1.0]))

    def loss_on_batch():
        lps = forward_logprobs(trainer.policy, mbs, 1.0)
        return sum(float(policy_loss(lp, mb.old_logp, mb.advantages, mb.loss_mask).loss) for lp, mb in zip(lps, mbs))

    before = loss_on_batch()
    trainer.optimizer.zero_grad()
    forward_backward(trainer.policy, mbs,
                     lambda mb, lp: (policy_loss(lp, mb.old_logp, mb.advantages, mb.loss_mask).loss, {}), 1.0)
    finalize_grads(trainer.policy)
    trainer.optimizer.step()
    after = loss_on_batch()
    assert after < before - 1e-4, (before, after)


def test_grad_clip_scales_the_step_and_zero_turns_clipping_off(tiny_ckpt, tmp_path, ctx):
    """grad_clip bounds the gradient's norm; 0 turns clipping off (megatron's convention): the step
    then equals one whose bound is never reached (before, a bound of 0 scaled every gradient to 0)."""
    moved = {}
    for clip in ("0", "1e9", "1e-3"):
        trainer = GRPOTrainer(load_config(TrainConfig, None, overrides(tiny_ckpt, tmp_path / clip, "engine=vanilla",
                                                                       f"grad_clip={clip}", "lr=1e-2")))
        before = {k: p.detach().clone() for k, p in trainer.policy.gpt.named_parameters()}
        norm, *_ = trainer._update(trainer._mini_batches(step_sequences(trainer, [1.0, -1.0, 0.5, -0.5, 1.0, -1.0])))
        assert norm > 1e-3  # (the third run's bound is reached)
        moved[clip] = {k: p.detach() - before[k] for k, p in trainer.policy.gpt.named_parameters()}
    assert all(torch.equal(moved["0"][k], moved["1e9"][k]) for k in moved["0"])
    assert max(float(d.abs().max()) for d in moved["0"].values()) > 0
    assert any(not torch.equal(moved["0"][k], moved["1e-3"][k]) for k in moved["0"])


def run_rows(ckpt, out, *extra):
    trainer = GRPOTrainer(load_config(TrainConfig, None, overrides(ckpt, out, *extra)))
    return trainer.run()


def step_sequences(trainer, advantages, cut=None):
    """The sequences a policy update of ``trainer``'s next step trains on, with the given advantages;
    ``cut``: each response's length kept (ragged micro-batches)."""
    ex = trainer._next_examples()
    prompts = [trainer.prompt_ids[e.id] for e in ex]
    rollout = trainer.engine.generate(prompts, trainer.cfg.sampling, prompt_ids=[e.id for e in ex])
    seqs = response_sequences(prompts, rollout, torch.tensor(advantages), 3)
    return seqs if cut is None else [(p, t[:n], lp[:n], *rest) for (p, t, lp, *rest), n in zip(seqs, cut)]


def test_the_gap_between_rollout_and_update_log_probs_is_logged(tiny_ckpt, tmp_path, ctx, monkeypatch):
    """rollout_logp_gap_mean / _max: |the update's log-prob - the rollout's| on the response tokens. The
    same weights and float32: a few ulps; the rollout's log-probs moved by a known amount: that amount."""
    row = run_rows(tiny_ckpt, tmp_path / "a", "engine=vanilla", "steps=1")[0]
    assert 0 <= row["rollout_logp_gap_mean"] <= row["rollout_logp_gap_max"] < 1e-4
    generate = VanillaEngine.generate

    def shifted(self, *args, **kwargs):  # the rollout reports every log-prob 0.25 lower
        out = generate(self, *args, **kwargs)
        out.logprobs = [lp - 0.25 for lp in out.logprobs]
        return out

    monkeypatch.setattr(VanillaEngine, "generate", shifted)
    row = run_rows(tiny_ckpt, tmp_path / "b", "engine=vanilla", "steps=1")[0]
    assert row["rollout_logp_gap_mean"] == pytest.approx(0.25, abs=1e-4)
    assert row["rollout_logp_gap_max"] == pytest.approx(0.25, abs=1e-4)
    for name, option in (("c", "sampling.top_p=0.9"), ("d", "sampling.min_p=0.1")):
        row = run_rows(tiny_ckpt, tmp_path / name, "engine=vanilla", "steps=1", option)[0]
        assert "rollout_logp_gap_mean" not in row, option  # old log-probs recomputed by the update's forward


def test_routing_replay_routes_the_update_as_the_rollout(tmp_path, ctx, monkeypatch, engine="specroll"):
    """TrainConfig.routing_replay on a Qwen3-MoE, SpecRoll rollouts (both engines keep routing alike:
    test_moe): the update routes every token to the experts its rollout kept. Kept as routed, the
    update's log-probs are the rollout's (a few ulps, as without replay, last); with the rollout's
    experts moved to others, they are another network's."""
    from specroll_mcore.rollout import SpeculativeEngine

    ckpt = tiny_policy_checkpoint(tmp_path / "moe", arch="qwen3_moe")
    row = run_rows(ckpt, tmp_path / "a", f"engine={engine}", "steps=1", "routing_replay=true")[0]
    assert 0 <= row["rollout_logp_gap_mean"] <= row["rollout_logp_gap_max"] < 1e-4
    cls = VanillaEngine if engine == "vanilla" else SpeculativeEngine
    generate = cls.generate

    def moved(self, *args, **kwargs):  # every kept expert replaced by the next one
        out = generate(self, *args, **kwargs)
        assert out.routing is not None and all(r.shape[1:] == (2, 2) for r in out.routing)
        out.routing = [(r + 1) % 4 for r in out.routing]
        return out

    monkeypatch.setattr(cls, "generate", moved)
    row = run_rows(ckpt, tmp_path / "b", f"engine={engine}", "steps=1", "routing_replay=true")[0]
    assert row["rollout_logp_gap_mean"] > 1e-3  # (~9e-3 here: small experts in a tiny model)
    monkeypatch.undo()
    row = run_rows(ckpt, tmp_path / "c", f"engine={engine}", "steps=1")[0]
    assert row["rollout_logp_gap_max"] < 1e-4


def test_rollouts_stop_at_every_eos_the_generation_config_names(tiny_ckpt, tmp_path, ctx):
    """An instruct model's generation_config.json may name end-of-turn tokens beside the tokenizer's
    EOS: the trainer's engines stop at all of them."""
    ckpt = shutil.copytree(tiny_ckpt, tmp_path / "ckpt")
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 17]}))
    trainer = GRPOTrainer(load_config(TrainConfig, None, overrides(ckpt, tmp_path / "run", "compare_vanilla_every=1")))
    assert trainer.tokenizer.eos_token_id == 2 and trainer.eos == [2, 17]
    assert trainer.engine.eos_token_ids == trainer.vanilla.eos_token_ids == [2, 17]


def test_chat_template_kwargs_reach_the_template(tiny_ckpt, tmp_path, ctx):
    """data.chat_template_kwargs are the template's variables: a Qwen3-style template that closes an
    empty thinking block when enable_thinking is false."""
    ckpt = shutil.copytree(tiny_ckpt, tmp_path / "ckpt")
    (ckpt / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
    plain = GRPOTrainer(load_config(TrainConfig, None, overrides(ckpt, tmp_path / "a", "engine=vanilla")))
    quiet = GRPOTrainer(load_config(TrainConfig, None, overrides(ckpt, tmp_path / "b", "engine=vanilla",
                                                                 "data.chat_template_kwargs.enable_thinking=false")))
    closed = plain.tokenizer("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    assert plain.prompt_ids.keys() == quiet.prompt_ids.keys()
    for i, ids in plain.prompt_ids.items():
        assert quiet.prompt_ids[i] == ids + closed
    with pytest.raises(ValueError, match=r"chat_template_kwargs sets \['add_generation_prompt'\], which the prompt "):
        load_config(TrainConfig, None, ["data.chat_template_kwargs.add_generation_prompt=false"])


def test_vanilla_and_specroll_grpo_are_identical(tiny_ckpt, tmp_path, ctx):
    """The exactness contract at the RL level: same rollouts, rewards and losses for 3 steps (SpecRoll's
    rollouts, and the vanilla ones timed beside them, continuously batched in 2 rows, fewer than a
    prompt's 3 samples: a later sample copies its prompt's keys from one in flight or prefills it again)."""
    a = run_rows(tiny_ckpt, tmp_path / "v", "engine=vanilla")
    b = run_rows(tiny_ckpt, tmp_path / "s", "engine=specroll", "compare_vanilla_every=1", "max_num_seqs=2")
    assert all(r["rollouts_identical"] and r["vanilla_gen_s"] > 0 for r in b)  # vanilla timed first at step 2
    assert all(0 <= r["update_padding"] < 1 for r in a)
    for ra, rb in zip(a, b):
        for k in ("reward_mean", "accuracy", "response_len", "policy_version"):  # rollouts and rewards: exact
            assert ra[k] == rb[k], (k, ra[k], rb[k])
        # Losses: the same computation on the same tokens; CPU GEMM kernels may round differently
        # with buffer alignment across processes, hence a float tolerance.
        for k in ("loss", "grad_norm", "clip_fraction"):
            assert rb[k] == pytest.approx(ra[k], rel=1e-5, abs=1e-6), (k, ra[k], rb[k])  # loss ~ 0 on-policy
    assert len({r["reward_mean"] for r in a}) > 1 or a[0]["grad_norm"] > 0  # there was a learning signal


def test_max_num_seqs_and_max_prefill_tokens_reach_the_rollouts_and_their_evaluation(tiny_ckpt, tmp_path, ctx,
                                                                                       monkeypatch):
    trainer = GRPOTrainer(load_config(TrainConfig, None, overrides(
        tiny_ckpt, tmp_path, "steps=1", "engine=specroll", "compare_vanilla_every=1", "max_num_seqs=4",
        "max_prefill_tokens=7", "eval.every=1", "eval.sampling.num_samples=2", "eval.sampling.temperature=1.0",
        *EVAL)))
    assert trainer.engine.max_prefill_tokens == trainer.vanilla.max_prefill_tokens == 7
    made = []
    new_cache = trainer.policy.new_cache
    monkeypatch.setattr(trainer.policy, "new_cache", lambda num_slots, capacity, num_rows=None: made.append(
        (num_slots, num_rows)) or new_cache(num_slots, capacity, num_rows))
    trainer.run()
    # training: 2 prompts x 3 samples in 4 rows, in both engines; evaluation: 6 prompts x 2 in calls of 4 prompts
    assert made == [(6, 4), (6, 4), (8, 4), (4, 4)]


EVAL = ["eval.data.limit=6", "eval.sampling.max_new_tokens=10", "eval.batch_prompts=4"]


def test_evaluation_scores_the_policy_on_held_out_prompts_and_changes_nothing_in_training(tiny_ckpt, tmp_path, ctx):
    """TrainConfig.eval: rows of the evaluated steps (0, 2 and the last) carry the held-out metrics,
    the starting policy's equal to its greedy responses scored directly, and `specroll eval` of the
    last checkpoint gives the last step's; a run with evaluation trains as one without (the
    speculative engine's slow path and tree calibration included)."""
    from specroll_mcore.checkpoint.megatron import load_policy
    from specroll_mcore.config import SamplingConfig
    from specroll_mcore.rl.data import load_examples, render_prompt
    from rewards_for_tests import token_parity_reward

    plain = run_rows(tiny_ckpt, tmp_path / "plain", "engine=specroll")
    rows = run_rows(tiny_ckpt, tmp_path / "eval", "engine=specroll", "eval.every=2", "eval.before_training=true",
                    *EVAL)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["step"] for r in rows if "eval_accuracy" in r] == [0, 2, 3]
    for a, b in zip(plain, rows[1:]):
        for k in ("reward_mean", "accuracy", "response_len", "tau", "nodes_per_row", "acceptance_per_head",
                  "slow_path_records", "slow_path_events"):
            assert a[k] == b[k], (k, a[k], b[k])
        for k in ("loss", "grad_norm", "entropy"):
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (k, a[k], b[k])

    # the reference: the starting policy's greedy responses to the held-out prompts, scored directly
    trainer = GRPOTrainer(load_config(TrainConfig, None, overrides(tiny_ckpt, tmp_path / "ref", "engine=vanilla",
                                                                   "eval.every=1", *EVAL)))
    train_questions = {e.question for e in trainer.examples}
    held_out = [e for e in load_examples("synthetic", "test", 6, 0)[0] if e.question not in train_questions]
    assert [e.id for e in trainer.eval_set.examples] == [e.id for e in held_out] and len(held_out) == 6
    policy = load_policy(tiny_ckpt, ctx)
    prompts = [render_prompt(trainer.tokenizer, e) for e in held_out]
    out = VanillaEngine(policy, eos_token_ids=trainer.eos).generate(
        prompts, SamplingConfig(temperature=0.0, max_new_tokens=10))
    scores = [token_parity_reward(None, None, t) for t in out.tokens]
    first = rows[0]
    assert first["eval_prompts"] == 6 and first["eval_tau"] >= 1
    assert first["eval_accuracy"] == pytest.approx(sum(c for _, c in scores) / 6)
    assert first["eval_reward_mean"] == pytest.approx(sum(r for r, _ in scores) / 6)
    assert first["eval_response_len"] == pytest.approx(sum(map(len, out.tokens)) / 6)

    # `specroll eval` of the run's last checkpoint: the figures its last step logged
    args = [a for o in overrides(tiny_ckpt, tmp_path / "unused", "engine=specroll", *EVAL) for a in ("--set", o)]
    env = dict(os.environ, PYTHONPATH=f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-m", "specroll_mcore.cli", "eval", *args, "--set",
                           f"checkpoint={tmp_path / 'eval'}", "--out", str(tmp_path / "eval.json"),
                           "--responses", str(tmp_path / "responses.jsonl")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads((tmp_path / "eval.json").read_text())
    for k in ("eval_accuracy", "eval_reward_mean", "eval_response_len", "eval_prompts"):
        assert got[k] == rows[-1][k], (k, got[k], rows[-1][k])
    assert got["eval_tau"] >= 1  # (a fresh engine's tree calibration is not the trained run's: speed only)
    responses = [json.loads(line) for line in (tmp_path / "responses.jsonl").read_text().splitlines()]
    assert [r["id"] for r in responses] == [e.id for e in held_out]
    assert [r["question"] for r in responses] == [e.question for e in held_out]
    assert sum(r["correct"] for r in responses) / 6 == got["eval_accuracy"]
    assert all(token_parity_reward(None, None, r["tokens"])[0] == r["reward"] for r in responses)


def test_evaluation_with_several_samples_reports_pass_at_n(tiny_ckpt, tmp_path, ctx):
    """eval.sampling.num_samples = n > 1 (at T > 0): eval_pass_at_n, the share of prompts with a correct
    response among their n, beside the accuracy over all responses (mean@n)."""
    from specroll_mcore.rl.evaluation import evaluate

    trainer = GRPOTrainer(load_config(TrainConfig, None, overrides(
        tiny_ckpt, tmp_path / "run", "engine=vanilla", "eval.every=1", *EVAL, "eval.sampling.temperature=1.0",
        "eval.sampling.num_samples=3")))
    responses: list = []
    row = evaluate(trainer.engine, trainer.eval_set, trainer.cfg.eval, trainer.scorer, trainer.ctx, responses)
    assert len(responses) == 18 and row["eval_prompts"] == 6
    assert row["eval_accuracy"] == sum(r["correct"] for r in responses) / 18
    solved = {r["id"] for r in responses if r["correct"]}
    assert row["eval_pass_at_n"] == len(solved) / 6
    assert row["eval_accuracy"] < row["eval_pass_at_n"] < 1  # (these samples: some prompts solved, not all)
    greedy = evaluate(trainer.engine, trainer.eval_set, dataclasses.replace(
        trainer.cfg.eval, sampling=dataclasses.replace(trainer.cfg.eval.sampling, num_samples=1)), trainer.scorer,
        trainer.ctx)
    assert "eval_pass_at_n" not in greedy


def test_evaluation_prompts_that_are_training_prompts_are_left_out(tiny_ckpt, tmp_path, ctx):
    rows = [{"question": f"What is {i} plus {i}?", "answer": f"#### {2 * i}"} for i in range(6)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = overrides(tiny_ckpt, tmp_path / "r", "engine=vanilla", f"data.source={data}", "data.limit=4",
                     "eval.every=1", f"eval.data.source={data}", "eval.data.limit=6")
    trainer = GRPOTrainer(load_config(TrainConfig, None, args))
    assert [e.question for e in trainer.eval_set.examples] == [r["question"] for r in rows[4:]]
    assert trainer.eval_set.report.skipped == {"also a training prompt": 4}
    with pytest.raises(ValueError, match=r"only 0 usable evaluation prompts \(skipped: \{'also a training "
                                         r"prompt': 4\}\) for 1 data-parallel replicas: raise TrainConfig.eval"):
        GRPOTrainer(load_config(TrainConfig, None, [*args, "eval.data.limit=4"]))
    with pytest.raises(ValueError, match="EvalConfig.every must be >= 0"):
        load_config(TrainConfig, None, ["eval.every=-1"])
    with pytest.raises(ValueError, match="EvalConfig.batch_prompts must be >= 1"):
        load_config(TrainConfig, None, ["eval.batch_prompts=0"])


DYNAMIC = ["dynamic_sampling=true", "max_sampling_rounds=4", "reward_fn=rewards_for_tests:flat_for_even_answers_reward"]


def test_dynamic_sampling_trains_on_groups_with_varied_rewards(tiny_ckpt, tmp_path, ctx):
    """DAPO's dynamic sampling: a step rolls out more rounds until P groups of varied rewards are in
    hand (the test reward gives every response to some prompts the same reward) and trains on exactly
    P of them, dropping the surplus; every round's rollouts are the vanilla engine's."""
    trainer = GRPOTrainer(load_config(TrainConfig, None, overrides(tiny_ckpt, tmp_path / "v", "engine=vanilla",
                                                                   *DYNAMIC)))
    trained = []
    make = trainer._micro_batches
    trainer._micro_batches = lambda seqs: (trained.append(seqs), make(seqs))[1]
    a = trainer.run()
    assert any(r["sampling_rounds"] > 1 for r in a) and any(r["groups_varied"] > 2 for r in a), a
    for r, seqs in zip(a, trained):
        assert r["groups_trained"] == 2 and not r["skipped"] and len(seqs) == 6
        assert all(any(adv != 0 for *_, adv in seqs[g:g + 3]) for g in (0, 3))  # no group without a signal
        assert len({tuple(seq[0]) for seq in seqs}) == 2  # two prompts, each once
    b = run_rows(tiny_ckpt, tmp_path / "s", "engine=specroll", "compare_vanilla_every=1", *DYNAMIC)
    for ra, rb in zip(a, b):
        assert rb["rollouts_identical"]
        for k in ("sampling_rounds", "groups_varied", "reward_mean", "response_len", "policy_version"):
            assert ra[k] == rb[k], (k, ra[k], rb[k])
        for k in ("loss", "grad_norm"):
            assert rb[k] == pytest.approx(ra[k], rel=1e-5, abs=1e-6), (k, ra[k], rb[k])


def test_dynamic_sampling_without_a_signal_skips_the_update_and_overlong_responses_lose_reward(tiny_ckpt, tmp_path,
                                                                                              ctx):
    """Equal rewards everywhere: after max_sampling_rounds rounds no group is left to train on, so the
    step skips its update (counted; the checkpoint is written). The soft overlong punishment over the
    whole length (buffer = max_new_tokens = 12) takes len / 12 from every reward."""
    rows = run_rows(tiny_ckpt, tmp_path / "run", "engine=vanilla", "steps=1", "dynamic_sampling=true",
                    "max_sampling_rounds=2", "reward_fn=rewards_for_tests:constant_reward", "overlong_buffer=12")
    (r,) = rows
    assert r["skipped"] and r["groups_trained"] == 0 and r["groups_varied"] == 0 and r["sampling_rounds"] == 2
    assert r["policy_version"] == 0 and r["grad_norm"] == 0.0
    assert r["reward_mean"] == pytest.approx(0.5 - r["response_len"] / 12, abs=1e-6)
    assert (tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


@pytest.mark.parametrize("dp_rank, place", [(0, 0), (2, 2), (5, 5), (6, None), (7, None)])
def test_fewer_varied_groups_than_replicas_are_dealt_out_response_by_response(dp_rank, place):
    """Dynamic sampling with fewer groups of varied rewards than data-parallel replicas (8 here, one
    prompt a round each; two groups of 3 responses, at places 0 and 1 of the step, rolled out by
    replicas 0 and 2 in two rounds): their responses go round the replicas one by one, so the step
    trains on them as one process would; a replica left without one holds a sequence with nothing to
    learn and no place (it joins the update's reductions; overlong filtering does not count it)."""
    from types import SimpleNamespace

    def round_(varied):
        rollout = SimpleNamespace(tokens=[[5], [6], [7]], logprobs=[torch.tensor([-1.0])] * 3,
                                  finish_reason=["eos"] * 3, routing=None)
        return SimpleNamespace(prompts=[[1, 2]], rollout=rollout, advantages=torch.tensor([1.0, -1.0, 0.0]),
                               varied=torch.tensor(varied))

    rounds = [round_([r == 0 for r in range(8)]), round_([r == 2 for r in range(8)])]
    cfg = SimpleNamespace(sampling=SimpleNamespace(num_samples=3), overlong_filter=False, dynamic_sampling=True,
                          prompts_per_step=8)
    parts = []
    for rank in range(8):  # each replica's chosen groups, as the all-gather collects them
        ctx = SimpleNamespace(dp_size=8, dp_rank=rank, all_gather_object_dp=lambda obj: parts.append(obj) or [obj])
        GRPOTrainer._training_sequences(SimpleNamespace(ctx=ctx, cfg=cfg), rounds)
    assert [len(p) for p in parts] == [1, 0, 1, 0, 0, 0, 0, 0]
    ctx = SimpleNamespace(dp_size=8, dp_rank=dp_rank, all_gather_object_dp=lambda obj: parts)
    (seq,), groups = GRPOTrainer._training_sequences(SimpleNamespace(ctx=ctx, cfg=cfg), rounds)
    assert groups == 2 and seq[6] == place and seq[4] == (place is not None)
    if place is not None:  # (response place % 3 of the group at place // 3)
        assert seq[1] == [[5], [6], [7]][place % 3] and seq[3] == [1.0, -1.0, 0.0][place % 3]


def test_overlong_filtering_masks_cut_responses_as_if_they_were_dropped():
    """DAPO's overlong filtering: responses cut at the length limit are marked untrained, get no loss
    tokens, and the loss (token- and sequence-level, with the trainer's denominators: trained tokens,
    sequences with a loss token) equals the loss of the batch without them."""
    from types import SimpleNamespace

    rollout = SimpleNamespace(tokens=[[5, 6, 7], [8, 9], [10, 11, 12, 13]], finish_reason=["length", "eos", "length"],
                              logprobs=[torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-0.5, -0.7]),
                                        torch.full((4,), -1.0)], routing=None)
    prompts, adv = [[1, 2], [3]], torch.tensor([1.0, -1.0, 0.5])
    assert all(s[4] for s in response_sequences(prompts, rollout, adv, 2))
    seqs = response_sequences(prompts, rollout, adv, 2, overlong_filter=True)
    assert [s[4] for s in seqs] == [False, True, False] and [s[0] for s in seqs] == [[1, 2], [1, 2], [3]]
    mb, kept = pack_micro_batch(seqs, torch.device("cpu")), pack_micro_batch([seqs[1]], torch.device("cpu"))
    assert mb.loss_mask.sum(1).tolist() == [0.0, 2.0, 0.0]
    logp = -torch.rand(mb.loss_mask.shape, generator=torch.Generator().manual_seed(0))
    L = kept.loss_mask.shape[1]
    for norm in ("token", "sequence"):
        got = policy_loss(logp, mb.old_logp, mb.advantages, mb.loss_mask, normalization=norm,
                          total_tokens=float(mb.loss_mask.sum()), total_sequences=1.0).loss
        ref = policy_loss(logp[1:2, :L], kept.old_logp, kept.advantages, kept.loss_mask, normalization=norm).loss
        assert float(got) == pytest.approx(float(ref), rel=1e-6), norm


def test_a_step_whose_responses_were_all_cut_skips_its_update_with_overlong_filtering(tiny_ckpt, tmp_path, ctx):
    """The tiny random policy never samples EOS within 12 tokens: with overlong filtering nothing is
    left to train on, so the step skips its update (counted, no division by zero tokens)."""
    (r,) = run_rows(tiny_ckpt, tmp_path / "run", "engine=vanilla", "steps=1", "overlong_filter=true")
    assert r["overlong_filtered"] == 6 and r["response_len"] == 12
    assert r["skipped"] and r["policy_version"] == 0 and r["loss"] == 0.0


def _train_cmd(ckpt, out, *extra):
    args = []
    for o in overrides(ckpt, out, "steps=4", *BUSY_SLOW_PATH, *extra):
        args += ["--set", o]
    return [sys.executable, "-m", "specroll_mcore.cli", "train", *args]



def test_resume_after_sigkill_equals_uninterrupted(tiny_ckpt, tmp_path):
    env = dict(os.environ, PYTHONPATH=f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    full = subprocess.run(_train_cmd(tiny_ckpt, tmp_path / "full"), env=env, capture_output=True, text=True,
                          timeout=600)
    assert full.returncode == 0, full.stderr[-2000:]
    # Kill -9 while step 3 runs (after the step-2 checkpoint is complete), then resume.
    proc = subprocess.Popen(_train_cmd(tiny_ckpt, tmp_path / "killed"), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    tracker = tmp_path / "killed" / "latest_checkpointed_iteration.txt"
    deadline = time.time() + 300
    while time.time() < deadline and not (tracker.is_file() and tracker.read_text().strip() == "2"):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert tracker.read_text().strip() in ("2", "3")
    resumed = subprocess.run(_train_cmd(tiny_ckpt, tmp_path / "killed") + ["--resume"], env=env,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout

    def rows(d):
        return [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]

    a, b = rows(tmp_path / "full"), rows(tmp_path / "killed")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        for k in ("reward_mean", "response_len", "policy_version", "slow_path_events", "slow_path_records", "tau"):
            assert ra[k] == rb[k], (ra["step"], k, ra[k], rb[k])
        for k in ("loss", "grad_norm"):
            assert rb[k] == pytest.approx(ra[k], rel=1e-5, abs=1e-6), (ra["step"], k, ra[k], rb[k])
    # The trained checkpoint is a Megatron checkpoint the converter reads.
    from specroll_mcore.checkpoint.convert import convert_mcore_to_hf

    hf = convert_mcore_to_hf(tmp_path / "full", tmp_path / "hf-out")
    assert (hf / "model.safetensors").is_file()
    # and any iteration it kept (keep_last 2: steps 3 and 4), as saved
    from safetensors.torch import load_file

    from specroll_mcore.cli import main

    assert main(["convert", "mcore-to-hf", str(tmp_path / "full"), str(tmp_path / "hf-3"), "--iteration", "3"]) == 0
    saved = {i: torch.load(tmp_path / "full" / f"iter_000000{i}" / "mp_rank_00" / "model_optim_rng.pt",
                           weights_only=False)["model"]["decoder.final_layernorm.weight"] for i in (3, 4)}
    assert not torch.equal(saved[3], saved[4])
    for d, i in (("hf-out", 4), ("hf-3", 3)):
        assert torch.equal(load_file(tmp_path / d / "model.safetensors")["model.norm.weight"], saved[i]), d
    with pytest.raises(FileNotFoundError, match=r"full holds no iteration 1; it holds 3, 4 \(TrainConfig.keep_last"):
        convert_mcore_to_hf(tmp_path / "full", tmp_path / "hf-1", iteration=1)
    assert main(["convert", "mcore-to-hf", str(tmp_path / "full"), str(tmp_path / "hf-1"), "--iteration", "1"]) == 2


def test_a_run_out_of_time_ends_after_its_step_with_a_checkpoint(tiny_ckpt, tmp_path, ctx, capsys):
    """exit_duration_in_mins (Megatron-LM's --exit-duration-in-mins): the first step that ends past it
    is saved and the run returns; --resume continues from there, as the uninterrupted run does."""
    out = tmp_path / "run"
    cfg = overrides(tiny_ckpt, out, "engine=vanilla", "save_every=100")
    minutes = 1e-6  # (the first step ends past it)
    rows = GRPOTrainer(load_config(TrainConfig, None, cfg + [f"exit_duration_in_mins={minutes}"])).run()
    assert [r["step"] for r in rows] == [1]
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    said = capsys.readouterr().out
    assert f"exit_duration_in_mins ({minutes:g}) reached at " in said and f"saved {out / 'iter_0000001'}" in said
    resumed = GRPOTrainer(load_config(TrainConfig, None, cfg + ["resume=true"])).run()
    full = GRPOTrainer(load_config(TrainConfig, None, overrides(tiny_ckpt, tmp_path / "full", "engine=vanilla"))).run()
    assert [r["step"] for r in resumed] == [2, 3]
    for a, b in zip(full[1:], resumed):
        assert (a["reward_mean"], a["response_len"]) == (b["reward_mean"], b["response_len"])
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
    with pytest.raises(ValueError, match=r"TrainConfig.exit_duration_in_mins must be > 0 minutes or null, got 0"):
        load_config(TrainConfig, None, cfg + ["exit_duration_in_mins=0"])


def test_sigterm_ends_the_run_after_its_step_with_a_checkpoint(tiny_ckpt, tmp_path):
    """SLURM and torchrun send SIGTERM before they kill: the run finishes the step under way, saves it
    (though it is not a periodic checkpoint's step) and returns, and --resume continues from it."""
    env = dict(os.environ, PYTHONPATH=f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = tmp_path / "run"
    proc = subprocess.Popen(_train_cmd(tiny_ckpt, out, "steps=40", "save_every=100", "engine=vanilla"), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text()):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert 1 <= len(steps) < 40 and steps == list(range(1, len(steps) + 1))
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == str(steps[-1])
    assert f"SIGTERM received: saved {out / f'iter_{steps[-1]:07d}'} after step {steps[-1]}" in stdout
    resumed = subprocess.run(_train_cmd(tiny_ckpt, out, f"steps={steps[-1] + 1}", "engine=vanilla") + ["--resume"],
                             env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0 and f"at step {steps[-1]}" in resumed.stdout, resumed.stderr[-2000:]


def test_the_exit_signal_is_recorded_once_then_acts():
    from specroll_mcore.rl.trainer import caught

    calls = []
    before = signal.signal(signal.SIGUSR1, lambda *a: calls.append("own action"))
    try:
        with caught("SIGUSR1") as received:
            assert not received()
            os.kill(os.getpid(), signal.SIGUSR1)
            assert received() and calls == []  # the first is recorded only
            os.kill(os.getpid(), signal.SIGUSR1)
            assert calls == ["own action"]  # the second acts
        os.kill(os.getpid(), signal.SIGUSR1)
        assert calls == ["own action"] * 2  # and after, the signal's own action is back
        with caught(None) as received:
            assert not received()
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_nan_loss_skips_the_step_and_keeps_the_checkpoint(tiny_ckpt, tmp_path, ctx, monkeypatch):
    import specroll_mcore.rl.trainer as trainer_mod

    real = trainer_mod.policy_loss
    calls = {"n": 0}

    def nan_on_second_step(*args, **kwargs):
        out = real(*args, **kwargs)
        calls["n"] += 1
        if 2 < calls["n"] <= 4:  # both micro-batches of step 2
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(trainer_mod, "policy_loss", nan_on_second_step)
    rows = run_rows(tiny_ckpt, tmp_path / "run", "engine=vanilla")
    assert [r["skipped"] for r in rows] == [False, True, False]
    assert [r["policy_version"] for r in rows] == [1, 1, 2]
    assert (tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text() == "3"


def test_a_custom_reward_must_return_two_finite_numbers():
    import numpy as np

    from specroll_mcore.rl.evaluation import checked_reward

    assert checked_reward("m:f", (0.5, True)) == (0.5, 1.0)
    assert checked_reward("m:f", [np.float32(1.0), np.int64(0)]) == (1.0, 0.0)
    assert checked_reward("m:f", (torch.tensor(0.25), torch.tensor([1]))) == (0.25, 1.0)
    for bad in (0.5, {"score": 1.0, "acc": 1.0}, (1.0,), (float("nan"), 0), ("1", 0), (torch.ones(2), 1), None):
        with pytest.raises(ValueError, match=re.escape(f"TrainConfig.reward_fn 'm:f' returned {bad!r}: it must "
                                                       "return (reward, correct), two finite numbers")):
            checked_reward("m:f", bad)


@pytest.mark.parametrize("reward_fn", ["", "rewards_for_tests:token_parity_reward"])
def test_bad_rows_and_long_prompts_are_skipped_and_counted(tiny_ckpt, tmp_path, ctx, reward_fn):
    """With math-verify's rewards (no reward_fn) a reference it finds nothing to check against is
    skipped too; a custom reward function reads the references its own way."""
    rows = [{"question": "What is 2 + 3?", "answer": "5 #### 5"},
            {"question": "No answer here"},
            {"answer": "#### 4"},
            {"question": "What is 4 + 4?", "answer": "Four and four make eight. ####"},
            {"question": "What is 5 + 5?", "answer": "\\boxed{}"},
            {"question": "Tell me " + "very " * 600 + "much about 7.", "answer": "#### 7"},
            {"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "reward_model": {"ground_truth": "2"}},
            {"problem": "What is 3 + 3?", "gt_answer": "6"}]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = overrides(tiny_ckpt, tmp_path / "run", "engine=vanilla", f"data.source={data}", "data.max_prompt_tokens=256",
                     f"reward_fn={reward_fn}")
    trainer = GRPOTrainer(load_config(TrainConfig, None, args))
    skipped = {"missing reference answer": 2, "missing question": 1, "prompt over the context limit": 1}
    if reward_fn:
        assert len(trainer.examples) == 4  # GSM8K-, DAPO- and SimpleRL-style rows, and the empty \\boxed{}
    else:
        assert len(trainer.examples) == 3
        skipped["unparseable reference answer"] = 1
    assert trainer.data_report.skipped == skipped


def test_train_config_errors(tiny_ckpt, tmp_path):
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['data.sorce'\]"):
        load_config(TrainConfig, None, ["data.sorce=x"])
    with pytest.raises(ValueError, match="loss_normalization must be 'token', 'sequence' or 'constant', got 'batch'"):
        load_config(TrainConfig, None, ["loss_normalization=batch"])
    with pytest.raises(ValueError, match="lr must be a number, got 'fast'"):
        load_config(TrainConfig, None, ["lr=fast"])
    with pytest.raises(ValueError, match="TrainConfig.max_sampling_rounds must be >= 1, got 0"):
        load_config(TrainConfig, None, ["max_sampling_rounds=0"])
    with pytest.raises(ValueError, match=r"TrainConfig.overlong_buffer must be in \[0, sampling.max_new_tokens = 16\]"):
        load_config(TrainConfig, None, ["sampling.max_new_tokens=16", "overlong_buffer=20"])
    with pytest.raises(ValueError, match="TrainConfig.overlong_penalty must be >= 0"):
        load_config(TrainConfig, None, ["overlong_penalty=-1"])
    with pytest.raises(ValueError, match=r"TrainConfig.micro_batch_tokens must be 0 \(off\) or at least "
                                         r"data.max_prompt_tokens \+ sampling.max_new_tokens = 528 .* got 500"):
        load_config(TrainConfig, None, ["data.max_prompt_tokens=512", "sampling.max_new_tokens=16",
                                        "micro_batch_tokens=500"])
    with pytest.raises(ValueError, match=r"micro_batch_tokens .* = 529 \(the longest sequence, 536 padded to a "
                                         r"multiple of TP for sequence parallelism\), got 529"):
        load_config(TrainConfig, None, ["data.max_prompt_tokens=512", "sampling.max_new_tokens=17",
                                        "micro_batch_tokens=529", "parallel.tensor_model_parallel_size=8",
                                        "parallel.sequence_parallel=true"])
    with pytest.raises(ValueError, match=r"TrainConfig.lr_warmup_steps must be in \[0, steps = 20\], got 30"):
        load_config(TrainConfig, None, ["lr_warmup_steps=30"])
    with pytest.raises(ValueError, match="TrainConfig.lr_decay must be 'constant' or 'cosine', got 'step'"):
        load_config(TrainConfig, None, ["lr_decay=step"])
    with pytest.raises(ValueError, match=r"TrainConfig.min_lr must be in \[0, lr = 1e-06\], got 1e-05"):
        load_config(TrainConfig, None, ["min_lr=1e-5"])
    with pytest.raises(ValueError, match="TrainConfig.weight_decay must be >= 0, got -0.01"):
        load_config(TrainConfig, None, ["weight_decay=-0.01"])
    with pytest.raises(ValueError, match=r"TrainConfig.mini_batches must be in \[1, prompts_per_step x "
                                         r"sampling.num_samples = 8\] \(each optimizer step needs responses\), got 9"):
        load_config(TrainConfig, None, ["prompts_per_step=2", "sampling.num_samples=4", "mini_batches=9"])
    with pytest.raises(ValueError, match="TrainConfig.ppo_epochs must be >= 1, got 0"):
        load_config(TrainConfig, None, ["ppo_epochs=0"])
    with pytest.raises(ValueError, match=r"TrainConfig.logprob_chunk must be >= 0 \(0: off\), got -1"):
        load_config(TrainConfig, None, ["logprob_chunk=-1"])
    for fields, match in [(["adam_beta2=1.0"], r"adam_beta1 and adam_beta2 must be in \[0, 1\), got 0.9, 1.0"),
                          (["grad_clip=-1"], r"TrainConfig.grad_clip must be >= 0 \(0: no clipping\), got -1"),
                          (["adv_eps=-1e-6"], "TrainConfig.adv_eps must be >= 0, got -1e-06"),
                          (["format_reward=nan"], "TrainConfig.format_reward must be a finite number, got nan"),
                          (["compare_vanilla_every=-2"], r"compare_vanilla_every must be >= 0 \(0: never\), got -2"),
                          (["data.max_prompt_tokens=0"], "DataConfig.max_prompt_tokens must be >= 1, got 0"),
                          (["data.limit=0"], r"DataConfig.limit must be >= 1 \(or unset\), got 0"),
                          (["output_dir="], r'output_dir must be a string, got None \(an empty value: YAML reads it '
                                            r'as null; write "" for an empty string\)'),
                          (["data.instruction=5"], "data.instruction must be a string, got 5$"),
                          (["sampling.num_samples=1"], r"sampling.num_samples must be >= 2 \(a response alone"),
                          (["ratio_level=group"], "TrainConfig.ratio_level must be 'token' or 'sequence', got 'group'"),
                          (["clip_ratio_c=0.5"], r"clip_ratio_c \(dual clip\) must be > 1 \(or unset: off\), got 0.5"),
                          (["entropy_coeff=-0.01"], r"TrainConfig.entropy_coeff must be a finite number >= 0 "
                                                    r"\(0: no entropy bonus\), got -0.01"),
                          (["entropy_coeff=inf"], "TrainConfig.entropy_coeff must be a finite number >= 0"),
                          (["kl_estimator=k1"], "TrainConfig.kl_estimator must be 'k2' or 'k3', got 'k1'"),
                          (["sampling.temperature=0"], r"sampling.temperature 0 \(greedy\) makes a prompt's")]:
        with pytest.raises(ValueError, match=match):
            load_config(TrainConfig, None, fields)
    with pytest.raises(ValueError, match="TrainConfig.reward_fn must look like 'module:function', got 'my_reward'"):
        load_config(TrainConfig, None, ["reward_fn=my_reward"])
    with pytest.raises(ValueError, match=r"reward_fn 'no_such_module:f': cannot import 'no_such_module' .* PYTHONPATH"):
        GRPOTrainer(load_config(TrainConfig, None, overrides(tiny_ckpt, tmp_path / "r", "reward_fn=no_such_module:f")))
    with pytest.raises(ValueError, match=r"reward_fn 'rewards_for_tests:nope': .*rewards_for_tests.py has no function"):
        GRPOTrainer(load_config(TrainConfig, None, overrides(tiny_ckpt, tmp_path / "r",
                                                             "reward_fn=rewards_for_tests:nope")))
    with pytest.raises(ValueError, match="TrainConfig.moe_aux_loss_coeff must be >= 0, got -0.1"):
        load_config(TrainConfig, None, ["moe_aux_loss_coeff=-0.1"])
    with pytest.raises(ValueError, match=r"TrainConfig.moe_aux_loss_coeff is 0.01 but the policy in .* has no experts"):
        GRPOTrainer(load_config(TrainConfig, None, overrides(tiny_ckpt, tmp_path / "r", "moe_aux_loss_coeff=0.01")))
    with pytest.raises(ValueError, match=r"TrainConfig.routing_replay is on but the policy in .* has no experts"):
        GRPOTrainer(load_config(TrainConfig, None, overrides(tiny_ckpt, tmp_path / "r", "routing_replay=true")))
    with pytest.raises(ValueError, match=r"only 3 usable prompts .*prompts_per_step is 8"):
        GRPOTrainer(load_config(TrainConfig, None, overrides(tiny_ckpt, tmp_path / "r", "engine=vanilla",
                                                             "data.limit=3", "prompts_per_step=8")))


def test_a_step_never_draws_an_example_twice(tiny_ckpt, tmp_path, ctx):
    """3 examples, 2 a step: steps cross epochs, and one that would take an example from the end of
    an epoch and again from the start of the next (the same responses: the noise is keyed by the
    example) passes over the second copy."""
    trainer = GRPOTrainer(load_config(TrainConfig, None, overrides(tiny_ckpt, tmp_path / "run", "engine=vanilla",
                                                                   "data.limit=3")))
    steps = [[e.id for e in trainer._next_examples()] for _ in range(12)]
    assert all(len(set(ids)) == 2 for ids in steps), steps
    assert trainer.state["epoch"] >= 7 and {i for ids in steps for i in ids} == {e.id for e in trainer.examples}
    assert len({e.id for e in trainer._next_examples({trainer.examples[0].id})} & {trainer.examples[0].id}) == 0


def test_fresh_run_refuses_to_overwrite_checkpoints(tiny_ckpt, tmp_path, ctx):
    run_rows(tiny_ckpt, tmp_path / "run", "engine=vanilla", "steps=1")
    with pytest.raises(FileExistsError, match="already holds a training checkpoint; pass --resume"):
        GRPOTrainer(load_config(TrainConfig, None, overrides(tiny_ckpt, tmp_path / "run", "engine=vanilla")))


def test_resume_names_the_settings_it_changes(tiny_ckpt, tmp_path, ctx, capsys):
    run_rows(tiny_ckpt, tmp_path / "run", "engine=vanilla", "steps=1")
    capsys.readouterr()
    GRPOTrainer(load_config(TrainConfig, None, overrides(tiny_ckpt, tmp_path / "run", "engine=vanilla", "steps=1",
                                                         "resume=true")))
    assert "changed settings" not in capsys.readouterr().out  # the same settings
    GRPOTrainer(load_config(TrainConfig, None, overrides(tiny_ckpt, tmp_path / "run", "engine=vanilla", "resume=true",
                                                         "steps=5", "lr=3e-6", "sampling.seed=7")))
    out = capsys.readouterr().out
    assert "run with changed settings: lr 0.001 -> 3e-06; sampling.seed 0 -> 7; steps 1 -> 5\n" in out, out


def test_the_layout_of_a_resume_is_the_latest_iterations(tiny_ckpt, tmp_path, ctx):
    """The run's config file records the layout of the run that wrote it last: a resume in a new
    layout killed before its first checkpoint leaves the new one there, while the latest iteration is
    in the old; the iteration's own record decides. An iteration that records none (saved before they
    did) goes by the config file, and resumes only in that layout."""
    run_rows(tiny_ckpt, tmp_path / "run", "engine=vanilla", "steps=1")
    meta_file = tmp_path / "run" / "specroll_config.json"
    meta = json.loads(meta_file.read_text())
    assert meta["pipeline_stage_layers"] == [2]  # the tiny policy's two layers on one stage
    meta.update(pipeline_model_parallel_size=2, pipeline_stage_layers=[1, 1])  # as a run at PP=2
    meta_file.write_text(json.dumps(meta))
    resumed = overrides(tiny_ckpt, tmp_path / "run", "engine=vanilla", "resume=true")
    assert GRPOTrainer(load_config(TrainConfig, None, resumed)).state["step"] == 1
    meta_file.write_text(json.dumps(meta))
    (tmp_path / "run" / "iter_0000001" / "layout.json").unlink()
    with pytest.raises(ValueError, match=r"was trained in another parallel layout \(pipeline_model_parallel_size "
                                         r"2 -> 1; pipeline_stage_layers \[1, 1\] -> \[2\]\): it was written "
                                         r"before checkpoints recorded their layout; resume with the parallel config"):
        GRPOTrainer(load_config(TrainConfig, None, resumed))


def test_a_checkpoint_is_durable_before_the_tracker_names_it(tiny_ckpt, tmp_path, ctx, monkeypatch):
    """After a crash of the machine (not only of the process) the tracker must not name an iteration
    whose files or directory entries were lost: every file and directory of the iteration is fsynced
    before its rename, the run's directory after it (the new name), and again after the tracker's."""
    out = tmp_path / "run"
    trainer = GRPOTrainer(load_config(TrainConfig, None, overrides(tiny_ckpt, out, "engine=vanilla")))
    events = []
    fsync, replace = os.fsync, os.replace

    def logged_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def logged_replace(a, b):
        events.append(("replace", str(a), str(b)))
        replace(a, b)

    monkeypatch.setattr(os, "fsync", logged_fsync)
    monkeypatch.setattr(os, "replace", logged_replace)
    final = trainer.save()
    tmp = out / f".{final.name}.tmp"
    renamed = events.index(("replace", str(tmp), str(final)))
    synced = {e[1] for e in events[:renamed] if e[0] == "fsync"}
    held = [str(p).replace(str(final), str(tmp)) for p in [final, *final.rglob("*")]]
    assert len(held) > 4 and set(held) <= synced, sorted(set(held) - synced)
    tracker = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2].endswith("_iteration.txt"))
    assert ("fsync", str(out)) in events[renamed:tracker] and events[tracker + 1:] == [("fsync", str(out))]


def test_checkpoints_saved_in_the_background_equal_the_synchronous_ones(tiny_ckpt, tmp_path, ctx, monkeypatch):
    """TrainConfig.async_save: a thread writes each periodic checkpoint while the next step runs, from
    host copies the step cannot change; every kept iteration then holds what a synchronous save
    writes (weights, AdamW's states, trainer state), and the metrics are the same. The tracker names a
    checkpoint only once its files are written: until then a kill would leave the previous one."""
    def contents(it):
        blob = torch.load(it / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
        return blob["model"], blob["optimizer"], json.loads((it / "trainer_state.json").read_text())

    def same(a, b):
        if isinstance(a, torch.Tensor):
            return torch.equal(a, b)
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    import specroll_mcore.rl.trainer as trainer_module

    runs, background = {}, []
    saver = trainer_module.save_training_checkpoint
    monkeypatch.setattr(trainer_module, "save_training_checkpoint",
                        lambda *a, **k: (background.append(k["background"]), saver(*a, **k))[1])
    for mode in ("sync", "async"):
        cfg = overrides(tiny_ckpt, tmp_path / mode, "engine=vanilla", "steps=4", "keep_last=4",
                        f"async_save={mode == 'async'}")
        runs[mode] = GRPOTrainer(load_config(TrainConfig, None, cfg)).run()
    assert background == [False] * 4 + [True, True, True, False]  # (the last step's is written at once)
    for k in ("reward_mean", "loss", "grad_norm"):
        assert [r[k] for r in runs["sync"]] == [r[k] for r in runs["async"]], k
    for step in (1, 2, 3, 4):
        a, b = (contents(tmp_path / mode / f"iter_000000{step}") for mode in ("sync", "async"))
        assert same(a, b), step
    assert not list((tmp_path / "async").glob(".iter_*"))  # (every one renamed into place)

    # named only once written: the files of a background save wait here until the test lets them go
    trainer = GRPOTrainer(load_config(TrainConfig, None, overrides(tiny_ckpt, tmp_path / "async", "engine=vanilla",
                                                                   "steps=5", "resume=true", "async_save=true")))
    go = __import__("threading").Event()
    save = torch.save
    monkeypatch.setattr(torch, "save", lambda *a, **k: (go.wait(60), save(*a, **k))[1])
    trainer.state["step"] = 5
    assert trainer.save(background=True) == tmp_path / "async" / "iter_0000005"
    assert not trainer.pending.written() and not (tmp_path / "async" / "iter_0000005").exists()
    assert (tmp_path / "async" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    go.set()
    trainer.commit_pending()
    assert (tmp_path / "async" / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    assert same(contents(tmp_path / "async" / "iter_0000005")[0], contents(tmp_path / "async" / "iter_0000004")[0])

    # a write that fails is reported when the checkpoint is committed, and the tracker keeps the last one
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(OSError("No space left on device")))
    trainer.state["step"] = 6
    trainer.save(background=True)
    with pytest.raises(RuntimeError, match=r"writing checkpoint .*iter_0000006 failed: No space left on device"):
        trainer.commit_pending()
    assert (tmp_path / "async" / "latest_checkpointed_iteration.txt").read_text().strip() == "5"


@pytest.mark.parametrize("name", ["specroll_config.json", "metrics.jsonl"])
def test_a_resume_killed_while_rewriting_a_run_file_leaves_it_whole(tiny_ckpt, tmp_path, ctx, monkeypatch, name):
    """On resume rank 0 rewrites the run's config (which the other ranks read meanwhile) and drops the
    metrics of steps not checkpointed; a write cut off half way (a kill) must leave the old file."""
    run_rows(tiny_ckpt, tmp_path / "run", "engine=vanilla", "steps=1")
    target = tmp_path / "run" / name
    before = target.read_text()
    real_open = io.open

    class KilledHalfWay:  # a text file whose first write stops half way, as at a kill
        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.close()
            raise KeyboardInterrupt

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def opened(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return KilledHalfWay(f) if "w" in mode and name in Path(file).name else f

    monkeypatch.setattr(io, "open", opened)  # (pathlib's writes)
    monkeypatch.setattr(builtins, "open", opened)
    with pytest.raises(KeyboardInterrupt):
        GRPOTrainer(load_config(TrainConfig, None, overrides(tiny_ckpt, tmp_path / "run", "engine=vanilla",
                                                             "resume=true")))
    monkeypatch.undo()
    assert target.read_text() == before
    assert [p.name for p in target.parent.iterdir() if p.name.endswith(".tmp")] == []
    rows = run_rows(tiny_ckpt, tmp_path / "run", "engine=vanilla", "steps=2", "resume=true")
    assert [r["step"] for r in rows] == [2]
    assert [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_a_bfloat16_policy_learns_at_grpo_learning_rates(tiny_ckpt, tmp_path, ctx):
    """lr 1e-6 on bfloat16 weights: the float32 main weights take every update (plain AdamW on the
    bfloat16 weights rounds nearly all of them away), the model weights are their rounding, and a
    resumed run continues from the same float32 weights."""
    from specroll_mcore.checkpoint.convert import convert_hf_to_mcore

    bf16 = convert_hf_to_mcore(tiny_ckpt.parent / "hf", tmp_path / "bf16", params_dtype="bfloat16")
    args = overrides(bf16, tmp_path / "run", "engine=vanilla", "lr=1e-6", "steps=2")
    trainer = GRPOTrainer(load_config(TrainConfig, None, args))
    assert trainer.policy.dtype == torch.bfloat16
    start = [m.detach().clone() for m in trainer.optimizer.main]
    rows = trainer.run()
    assert all(r["grad_norm"] > 0 and not r["skipped"] for r in rows)
    moved = sum(int((m != s).sum()) for m, s in zip(trainer.optimizer.main, start))
    assert moved > 0.5 * sum(s.numel() for s in start)
    for p, m in zip(trainer.optimizer.params, trainer.optimizer.main):
        assert m.dtype == torch.float32 and torch.equal(p.detach(), m.bfloat16())
    resumed = GRPOTrainer(load_config(TrainConfig, None, args + ["resume=true"]))
    for a, b in zip(resumed.optimizer.main, trainer.optimizer.main):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rollouts_run_without_the_last_updates_gradients(tiny_ckpt, tmp_path, ctx, dtype):
    """The gradients (``.grad``, a bfloat16 policy's float32 ``main_grad``) are dropped once the
    optimizer has stepped, so that every rollout after the first update has their memory for its KV
    cache, and the next update starts from none."""
    from specroll_mcore.checkpoint.convert import convert_hf_to_mcore

    ckpt = tiny_ckpt if dtype == "float32" else convert_hf_to_mcore(tiny_ckpt.parent / "hf", tmp_path / dtype,
                                                                      params_dtype=dtype)
    trainer = GRPOTrainer(load_config(TrainConfig, None, overrides(ckpt, tmp_path / "run", "engine=vanilla",
                                                                   "steps=3")))
    held = []
    generate = trainer.engine.generate

    def recording(*args, **kwargs):
        held.append(sum(t.numel() for p in trainer.policy.gpt.parameters()
                        for t in (p.grad, getattr(p, "main_grad", None)) if t is not None))
        return generate(*args, **kwargs)

    trainer.engine.generate = recording
    rows = trainer.run()
    assert all(r["grad_norm"] > 0 and not r["skipped"] for r in rows)
    assert held == [0, 0, 0]
    assert all(p.grad is None and getattr(p, "main_grad", None) is None for p in trainer.policy.gpt.parameters())


def test_an_optimizer_offloaded_between_steps_gives_the_same_run(tiny_ckpt, tmp_path, ctx, monkeypatch):
    """TrainConfig.offload_optimizer: the state goes to the host after every step and before the first
    rollout, and comes back for each step (on a CPU nothing moves; tests/gpu checks where it goes)."""
    from specroll_mcore.optimizer import MainParamAdamW

    calls = []
    for name in ("offload", "reload"):
        real = getattr(MainParamAdamW, name)
        monkeypatch.setattr(MainParamAdamW, name, lambda self, real=real, name=name: calls.append(name) or real(self))
    runs = {flag: run_rows(tiny_ckpt, tmp_path / flag, "engine=vanilla", "steps=2", f"offload_optimizer={flag}")
            for flag in ("false", "true")}
    assert calls == ["reload"] * 2 + ["offload", "reload", "offload", "reload", "offload"]
    for a, b in zip(runs["false"], runs["true"]):
        assert (a["loss"], a["grad_norm"], a["reward_mean"]) == (b["loss"], b["grad_norm"], b["reward_mean"])


def test_recomputed_activations_give_the_same_gradients(tiny_ckpt, tmp_path, ctx):
    """TrainConfig.recompute_activations: each layer reruns its forward in the backward; the
    gradients of a GRPO micro-batch schedule are those of the plain forward."""
    trainer = GRPOTrainer(load_config(TrainConfig, None, overrides(tiny_ckpt, tmp_path / "run", "engine=vanilla")))
    mbs = trainer._micro_batches(step_sequences(trainer, [1.0, -1.0, 0.5, -0.5, 1.0, -1.0]))

    def grads(recompute):
        trainer.optimizer.zero_grad()
        forward_backward(trainer.policy, mbs, lambda mb, lp: (policy_loss(lp, mb.old_logp, mb.advantages,
                                                                          mb.loss_mask).loss, {}), 1.0, recompute)
        return [p.grad.clone() for p in trainer.policy.gpt.parameters()]

    for a, b in zip(grads(False), grads(True)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def test_log_probs_in_pieces_give_the_whole_spans_gradients_log_probs_and_entropy(tiny_ckpt, tmp_path, ctx):
    """TrainConfig.logprob_chunk: the vocabulary projection and log-probs 3 positions at a time (the
    last piece shorter), recomputed in the backward, on ragged sequences: the gradients, the
    entropy and the no-gradient log-probs (old and reference log-probs) of the whole span at once."""
    trainer = GRPOTrainer(load_config(TrainConfig, None, overrides(tiny_ckpt, tmp_path / "run", "engine=vanilla")))
    mbs = trainer._micro_batches(step_sequences(trainer, [1.0, -1.0, 0.5, -0.5, 1.0, -1.0], cut=(12, 2, 7, 1, 12, 5)))
    assert any(mb.loss_span.stop - mb.loss_span.start > 3 for mb in mbs)

    def update(chunk):
        trainer.optimizer.zero_grad()
        parts = forward_backward(trainer.policy, mbs, lambda mb, lp: (
            policy_loss(lp, mb.old_logp, mb.advantages, mb.loss_mask).loss, {}), 1.0, logprob_chunk=chunk)
        grads = [p.grad.clone() for p in trainer.policy.gpt.parameters()]
        return grads, [p["entropy_sum"] for p in parts], forward_logprobs(trainer.policy, mbs, 1.0, logprob_chunk=chunk)

    (whole, entropy, logps), (pieces, entropy_pieces, logps_pieces) = update(0), update(3)
    assert all(g.abs().sum() > 0 for g in whole[-2:])
    assert_grads_close(pieces, whole)
    assert entropy_pieces == pytest.approx(entropy, rel=1e-6)
    for a, b in zip(logps, logps_pieces):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_log_probs_in_pieces_keep_no_logits_for_the_backward(tiny_ckpt, tmp_path, ctx):
    """What the update keeps for its backward with TrainConfig.logprob_chunk: not the span's logits
    [B, s', V] (each piece's are rebuilt in the backward), so at least their size less than without."""
    trainer = GRPOTrainer(load_config(TrainConfig, None, overrides(tiny_ckpt, tmp_path / "run", "engine=vanilla")))
    mbs = trainer._micro_batches(step_sequences(trainer, [1.0, -1.0, 0.5, -0.5, 1.0, -1.0]))
    logits_bytes = sum(len(mb.lengths) * (mb.loss_span.stop - mb.loss_span.start) for mb in mbs) * \
        trainer.policy.config.vocab_size * 4

    def saved_bytes(chunk):
        with saved_for_backward() as saved:
            forward_backward(trainer.policy, mbs, lambda mb, lp: (
                policy_loss(lp, mb.old_logp, mb.advantages, mb.loss_mask).loss, {}), 1.0, logprob_chunk=chunk)
        return saved[0]

    whole, pieces = saved_bytes(0), saved_bytes(4)
    assert whole - pieces >= logits_bytes, (whole, pieces, logits_bytes)


def test_token_budget_micro_batches_give_the_gradients_of_the_whole_batch(tiny_ckpt, tmp_path, ctx):
    """TrainConfig.micro_batch_tokens: ragged sequences sorted into micro-batches by length, each
    within the budget of padded tokens; the accumulated gradients and the logged metrics are those
    of one micro-batch holding every sequence, and of that micro-batch padded to a multiple of 16
    positions (as sequence parallelism pads it to a multiple of TP)."""
    args = overrides(tiny_ckpt, tmp_path / "run", "engine=vanilla", "data.max_prompt_tokens=100",
                     "micro_batch_tokens=224", "micro_batch_size=3")
    trainer = GRPOTrainer(load_config(TrainConfig, None, args))
    seqs = step_sequences(trainer, [1.0, -1.0, 0.5, -0.5, 1.0, -1.0], cut=(12, 2, 7, 1, 12, 5))  # ragged
    mbs = trainer._micro_batches(seqs)
    assert len(mbs) > 1 and all(mb.input_ids.numel() <= 224 and len(mb.lengths) <= 3 for mb in mbs)
    assert sorted(int(n) for mb in mbs for n in mb.lengths) == sorted(len(p) + len(t) for p, t, *_ in seqs)
    padded = sum(mb.input_ids.numel() for mb in mbs)
    assert padded < len(seqs) * max(len(p) + len(t) for p, t, *_ in seqs)
    whole = [pack_micro_batch(seqs, ctx.device)]
    total = float(whole[0].loss_mask.sum())

    def update(micro_batches):
        trainer.optimizer.zero_grad()
        parts = forward_backward(trainer.policy, micro_batches, lambda mb, lp: (
            (out := policy_loss(lp, mb.old_logp, mb.advantages, mb.loss_mask, total_tokens=total)).loss,
            {"clip": out.clip_fraction * float(mb.loss_mask.sum())}), 1.0)
        return [p.grad.clone() for p in trainer.policy.gpt.parameters()], sum(p["clip"] for p in parts)

    padded = [pack_micro_batch(seqs, ctx.device, multiple=16)]
    assert padded[0].input_ids.shape[1] % 16 == 0 and padded[0].input_ids.shape[1] > whole[0].input_ids.shape[1]
    (split, clipped), (one, clipped_one), (eights, clipped_eights) = update(mbs), update(whole), update(padded)
    assert_grads_close(split, one)
    assert_grads_close(eights, one)
    assert clipped == pytest.approx(clipped_one) == pytest.approx(clipped_eights)


def test_overlong_filtered_sequences_are_left_out_of_the_update(tiny_ckpt, tmp_path, ctx):
    """Responses masked out by overlong filtering take no forward or backward: the gradients are those
    of every sequence in the update with theirs masked; where all are masked, one stays (a replica
    must join the update's reductions)."""
    trainer = GRPOTrainer(load_config(TrainConfig, None, overrides(tiny_ckpt, tmp_path / "run", "engine=vanilla")))
    seqs = step_sequences(trainer, [1.0, -1.0, 0.5, -0.5, 1.0, -1.0], cut=(12, 2, 7, 1, 12, 5))
    seqs = [(p, t, lp, a, n < 12, *rest) for (p, t, lp, a, _, *rest), n in zip(seqs, (12, 2, 7, 1, 12, 5))]
    [mbs] = trainer._mini_batches(seqs)
    assert sum(len(mb.lengths) for mb in mbs) == 4  # the two cut at 12 tokens are left out
    total = float(sum(mb.loss_mask.sum() for mb in mbs))

    def grads(micro_batches):
        trainer.optimizer.zero_grad()
        forward_backward(trainer.policy, micro_batches, lambda mb, lp: (
            policy_loss(lp, mb.old_logp, mb.advantages, mb.loss_mask, total_tokens=total).loss, {}), 1.0)
        return [p.grad.clone() for p in trainer.policy.gpt.parameters()]

    assert_grads_close(grads(mbs), grads([pack_micro_batch(seqs, ctx.device)]))
    cut = [(*s[:4], False, *s[5:]) for s in seqs]
    [[one]] = trainer._mini_batches(cut)
    assert len(one.lengths) == 1 and float(one.loss_mask.sum()) == 0


def test_the_update_computes_logits_over_the_responses_alone(tiny_ckpt, tmp_path, ctx):
    """The update's forwards project to the vocabulary only from the shortest prompt's last token on
    (MicroBatch.loss_span): its log-probs and gradients are those of logits over every position."""
    from specroll_mcore.model import causal_mask
    from specroll_mcore.rl.schedule import token_logprobs

    trainer = GRPOTrainer(load_config(TrainConfig, None, overrides(tiny_ckpt, tmp_path / "run", "engine=vanilla")))
    policy = trainer.policy
    seqs = step_sequences(trainer, [1.0, -1.0, 0.5, -0.5, 1.0, -1.0], cut=(12, 2, 7, 1, 12, 5))
    mbs = trainer._micro_batches(seqs)
    assert any(mb.loss_span.start > 60 for mb in mbs)  # the prompts' positions are left out

    def loss(mb, lp):
        return policy_loss(lp, mb.old_logp, mb.advantages, mb.loss_mask, total_tokens=12.0).loss

    def full_logprobs(mb):  # logits at every position, the reference
        b, L = mb.input_ids.shape
        meta = policy.metadata(torch.arange(L)[None].expand(b, L), causal_mask(b, L, ctx.device, mb.lengths))
        return token_logprobs(policy, policy.stage_forward(mb.input_ids, meta)[0], mb.labels, 1.0) * mb.loss_mask

    trainer.optimizer.zero_grad()
    for mb in mbs:
        loss(mb, full_logprobs(mb)).backward()
    reference = [p.grad.clone() for p in policy.gpt.parameters()]
    trainer.optimizer.zero_grad()
    forward_backward(policy, mbs, lambda mb, lp: (loss(mb, lp), {}), 1.0)
    assert_grads_close([p.grad for p in policy.gpt.parameters()], reference)
    with torch.no_grad():
        for mb, lp in zip(mbs, forward_logprobs(policy, mbs, 1.0)):
            torch.testing.assert_close(lp * mb.loss_mask, full_logprobs(mb), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("temperature, chunk", [(1.0, 0), (0.8, 3)])  # (at 1 the cross entropy works in place)
def test_the_entropy_bonus_gives_the_gradient_of_the_entropy_of_full_logits(tiny_ckpt, tmp_path, ctx, temperature,
                                                                            chunk):
    """TrainConfig.entropy_coeff: forward_backward's differentiable entropy (over the loss span, in
    pieces with logprob_chunk) gives the gradients that autograd gives through torch's entropy of
    logits over every position, in the same clipped loss, on ragged sequences."""
    from specroll_mcore.model import causal_mask
    from specroll_mcore.rl.schedule import token_logprobs

    trainer = GRPOTrainer(load_config(TrainConfig, None, overrides(tiny_ckpt, tmp_path / "run", "engine=vanilla")))
    policy = trainer.policy
    mbs = trainer._micro_batches(step_sequences(trainer, [1.0, -1.0, 0.5, -0.5, 1.0, -1.0], cut=(12, 2, 7, 1, 12, 5)))

    def loss(mb, lp, entropy):
        return policy_loss(lp, mb.old_logp, mb.advantages, mb.loss_mask, total_tokens=12.0, entropy=entropy,
                           entropy_coeff=0.5).loss

    def reference(mb):  # logits at every position: log-probs and entropy, both through autograd
        b, L = mb.input_ids.shape
        meta = policy.metadata(torch.arange(L)[None].expand(b, L), causal_mask(b, L, ctx.device, mb.lengths))
        logits = policy.stage_forward(mb.input_ids, meta)[0]
        entropy = torch.distributions.Categorical(logits=logits.float() / temperature).entropy()
        return token_logprobs(policy, logits, mb.labels, temperature) * mb.loss_mask, entropy * mb.loss_mask

    trainer.optimizer.zero_grad()
    for mb in mbs:
        loss(mb, *reference(mb)).backward()
    expected = [p.grad.clone() for p in policy.gpt.parameters()]
    trainer.optimizer.zero_grad()
    parts = forward_backward(policy, mbs, lambda mb, lp, entropy: (loss(mb, lp, entropy), {}), temperature,
                             logprob_chunk=chunk, entropy_grad=True)
    assert_grads_close([p.grad for p in policy.gpt.parameters()], expected)
    with torch.no_grad():
        logged = sum(float(reference(mb)[1].sum()) for mb in mbs)
    assert sum(p["entropy_sum"] for p in parts) == pytest.approx(logged, rel=1e-5)


def test_an_entropy_bonus_raises_the_policys_entropy(tiny_ckpt, tmp_path, ctx):
    """A trainer step with entropy_coeff > 0 and no advantage (equal rewards) moves the policy
    towards higher entropy on its batch; with entropy_coeff 0 the same step changes nothing."""
    entropies = {}
    for coeff in ("0", "1.0"):
        trainer = GRPOTrainer(load_config(TrainConfig, None, overrides(
            tiny_ckpt, tmp_path / coeff, "engine=vanilla", f"entropy_coeff={coeff}", "lr=1e-2", "grad_clip=0")))
        mbs = trainer._micro_batches(step_sequences(trainer, [0.0] * 6))
        _, loss, _, _, extra = trainer._update([mbs])
        first = extra["entropy"]
        assert extra["pg_loss"] == 0.0 and loss == pytest.approx(-float(coeff) * first, rel=1e-5)  # token mean
        before = [p.detach().clone() for p in trainer.policy.gpt.parameters()]
        second = trainer._update([mbs])[4]["entropy"]
        entropies[coeff] = (first, second)
        moved = max(float((p.detach() - q).abs().max()) for p, q in zip(trainer.policy.gpt.parameters(), before))
        assert (moved > 0) == (coeff != "0"), (coeff, moved)
    assert entropies["0"][1] == pytest.approx(entropies["0"][0], rel=1e-6)
    assert entropies["1.0"][1] > entropies["1.0"][0] + 1e-3, entropies


@pytest.mark.parametrize("temperature", [1.0, 0.8])  # (at 1 the log-probs' cross entropy could clobber the logits)
def test_the_logged_entropy_is_the_policys_over_the_response_tokens(tiny_ckpt, tmp_path, ctx, temperature):
    """The update's ``entropy``: the mean over the response tokens of the entropy of the policy's
    next-token distribution, against transformers' logits of the checkpoint the run starts from (the
    update computes it before its step), on ragged sequences in budgeted micro-batches."""
    import transformers

    args = overrides(tiny_ckpt, tmp_path / "run", "engine=vanilla", f"sampling.temperature={temperature}",
                     "data.max_prompt_tokens=100", "micro_batch_tokens=224", "micro_batch_size=3")
    trainer = GRPOTrainer(load_config(TrainConfig, None, args))
    seqs = step_sequences(trainer, [1.0, -1.0, 0.5, -0.5, 1.0, -1.0], cut=(12, 2, 7, 1, 12, 5))
    mbs = trainer._micro_batches(seqs)
    assert len(mbs) > 1
    extra = trainer._update([mbs])[4]
    hf = transformers.AutoModelForCausalLM.from_pretrained(Path(tiny_ckpt).parent / "hf", dtype=torch.float64)
    entropies = []
    with torch.no_grad():
        for prompt, response, *_ in seqs:
            logits = hf(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1] / temperature
            entropies.append(torch.distributions.Categorical(logits=logits).entropy())
    assert extra["entropy"] == pytest.approx(float(torch.cat(entropies).mean()), rel=1e-5)


def test_the_summary_table_shows_each_steps_entropy_and_a_dash_for_what_a_step_lacks():
    rows = [{"step": 1, "reward_mean": 0.25, "accuracy": 0.125, "response_len": 80.0, "entropy": 1.8234, "tau": 2.1,
             "nodes_per_row": 3.25, "generation_s": 12.0, "vanilla_gen_s": 18.0, "training_s": 30.0, "gen_share": 0.29},
            {"step": 2, "reward_mean": 0.5, "accuracy": 0.25, "response_len": 70.0, "generation_s": 11.0,
             "training_s": 29.0, "gen_share": 0.28}]  # a skipped update logs no entropy; vanilla not timed
    head, first, second = (line.split() for line in summary_table(rows).splitlines())
    assert head == ["step", "reward_mean", "accuracy", "response_len", "entropy", "tau", "nodes/row", "generation_s",
                    "vanilla_gen", "training_s", "gen_share", "eval_acc"]  # (none cut short)
    assert first[4] == "1.823" and first[6:9] == ["3.25", "12.0", "18.0"]
    assert second[4] == "-" and second[6] == "-" and second[8] == "-"


def test_a_run_that_never_drafted_says_why_tau_is_one():
    plain = [{"step": 1, "tau": 1.0, "nodes_per_row": 1.0}, {"step": 2, "tau": 1.0, "nodes_per_row": 1.0}]
    note = plain_decoding_note(plain, 16, 16)
    assert note.startswith("SpecRoll decoded plainly at every step") and "16 responses in flight" in note
    assert "C_hw = 16 tokens" in note
    assert plain_decoding_note([*plain, {"step": 3, "tau": 1.4, "nodes_per_row": 2.5}], 16, 16) is None
    assert plain_decoding_note([{"step": 1}], 16, 16) is None  # (the vanilla engine: no tree figures)


@pytest.mark.parametrize("top_p", [1.0, 0.9])  # the rollout's log-probs, or recomputed before the first step
def test_mini_batches_take_optimizer_steps_against_the_sampling_policy(tiny_ckpt, tmp_path, ctx, top_p):
    """TrainConfig.mini_batches = 2: two optimizer steps per rollout batch, equal to two updates by
    hand on the two halves of its responses, each against the log-probs of the policy that sampled
    (so the second half's ratio is no longer 1); an empty part (fewer responses than mini-batches on
    a replica) holds one sequence with no loss."""
    args = ["engine=vanilla", f"sampling.top_p={top_p}"]
    split = GRPOTrainer(load_config(TrainConfig, None, overrides(tiny_ckpt, tmp_path / "a", *args, "mini_batches=2")))
    by_hand = GRPOTrainer(load_config(TrainConfig, None, overrides(tiny_ckpt, tmp_path / "b", *args)))
    seqs = step_sequences(split, [1.0, -1.0, 0.5, -0.5, 1.0, -1.0], cut=(12, 2, 7, 1, 12, 5))
    minis = split._mini_batches(seqs)
    assert [sum(len(mb.lengths) for mb in part) for part in minis] == [3, 3]
    norm, _, parts, skipped, extra = split._update(minis)
    assert not skipped and extra["optimizer_steps"] == 2 and split.state["policy_version"] == 2
    ratios = [p["ratio"] for p in parts]
    assert abs(ratios[0] - 1) < 1e-5 and abs(ratios[-1] - 1) > 1e-4, ratios  # the second: after a step
    halves = [by_hand._micro_batches(half) for half in (seqs[:3], seqs[3:])]
    if top_p < 1:  # both halves' old log-probs of the starting weights, then no recomputation
        every = [mb for half in halves for mb in half]
        for mb, lp in zip(every, forward_logprobs(by_hand.policy, every, 1.0)):
            mb.old_logp = lp
        by_hand.cfg.sampling.top_p = 1.0
    for half in halves:
        by_hand._update([half])
    for a, b in zip(split.policy.gpt.parameters(), by_hand.policy.gpt.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    one = split._mini_batches(seqs[:1])
    assert [[len(mb.lengths) for mb in part] for part in one] == [[1], [1]]
    assert float(one[0][0].loss_mask.sum()) > 0 and float(one[1][0].loss_mask.sum()) == 0  # the second: no loss
    row = run_rows(tiny_ckpt, tmp_path / "d", "engine=vanilla", "steps=1", "mini_batches=3", "ppo_epochs=2")[0]
    assert row["optimizer_steps"] == 6 and row["policy_version"] == 6 and row["clip_fraction"] > 0


def test_the_kl_reference_is_the_initial_policy_and_the_policy_comes_back(tiny_ckpt, tmp_path, ctx):
    """kl_beta > 0: after steps that moved the policy, the reference log-probs are those of the
    starting checkpoint loaded afresh, and the policy's own weights come back to the bit (and so do its
    log-probs: the CPU's packed weights are not those of the reference)."""
    from specroll_mcore.checkpoint.megatron import load_policy

    trainer = GRPOTrainer(load_config(TrainConfig, None, overrides(tiny_ckpt, tmp_path / "run", "engine=vanilla",
                                                                   "kl_beta=0.1", "steps=2")))
    rows = trainer.run()
    assert rows[-1]["kl"] > 0 and rows[-1]["grad_norm"] > 0
    policy = trainer.policy
    mbs = trainer._micro_batches(step_sequences(trainer, [1.0] * 6))
    weights = {k: v.clone() for k, v in policy.gpt.named_parameters()}
    own = forward_logprobs(policy, mbs, 1.0)
    with swapped_weights(policy, trainer.ref_state):
        ref = forward_logprobs(policy, mbs, 1.0)
    initial = forward_logprobs(load_policy(trainer.source, ctx, with_heads=False), mbs, 1.0)
    for r, i, o, mb in zip(ref, initial, own, mbs):
        torch.testing.assert_close(r * mb.loss_mask, i * mb.loss_mask, rtol=1e-5, atol=1e-6)
        assert ((o - i).abs() * mb.loss_mask).max() > 1e-3  # the policy did move
    assert all(torch.equal(v, weights[k]) for k, v in policy.gpt.named_parameters())
    for o, again, mb in zip(own, forward_logprobs(policy, mbs, 1.0), mbs):
        torch.testing.assert_close(again * mb.loss_mask, o * mb.loss_mask, rtol=1e-6, atol=1e-7)


def test_an_offloaded_reference_gives_the_same_run(tiny_ckpt, tmp_path, ctx):
    """TrainConfig.offload_reference: the reference's weights are copies of the initial policy's, never
    its own tensors, and the KL term, the loss and the update are those of a reference kept in place
    (on a CPU nothing moves; tests/gpu checks that they wait in pinned host memory)."""
    rows, weights = {}, {}
    for flag in ("false", "true"):
        trainer = GRPOTrainer(load_config(TrainConfig, None, overrides(
            tiny_ckpt, tmp_path / flag, "engine=vanilla", "kl_beta=0.1", "steps=2", f"offload_reference={flag}")))
        params = dict(trainer.policy.gpt.named_parameters())
        assert set(trainer.ref_state) == set(params)
        assert all(v.data_ptr() != params[k].data_ptr() for k, v in trainer.ref_state.items())
        rows[flag] = trainer.run()
        weights[flag] = {k: p.detach().clone() for k, p in trainer.policy.gpt.named_parameters()}
    assert rows["true"][-1]["kl"] > 0
    for a, b in zip(rows["false"], rows["true"]):
        assert (a["loss"], a["kl"], a["grad_norm"]) == (b["loss"], b["kl"], b["grad_norm"])
    assert all(torch.equal(v, weights["false"][k]) for k, v in weights["true"].items())


def test_the_kl_estimator_reaches_the_loss(tiny_ckpt, tmp_path, ctx):
    """kl_estimator k2 against k3 over two optimizer steps (the second's policy has moved from the
    reference, so the penalties differ there): the same rollout, different weights after."""
    weights, rows = {}, {}
    for est in ("k2", "k3"):
        trainer = GRPOTrainer(load_config(TrainConfig, None, overrides(
            tiny_ckpt, tmp_path / est, "engine=vanilla", "steps=1", "kl_beta=1.0", "mini_batches=2",
            f"kl_estimator={est}")))
        (rows[est],) = trainer.run()
        weights[est] = [p.detach().clone() for p in trainer.policy.gpt.parameters()]
    assert rows["k2"]["reward_mean"] == rows["k3"]["reward_mean"] and rows["k3"]["kl"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(weights["k2"], weights["k3"]))


@pytest.mark.parametrize("normalization, ratio_level", [("sequence", "sequence"), ("constant", "token")])
def test_sequence_normalisation_mean_only_advantages_plain_prompts_and_tensorboard(tiny_ckpt, tmp_path, ctx,
                                                                                 normalization, ratio_level):
    """The run options no other test takes: the GRPO paper's per-sequence normalisation with GSPO's
    sequence-level ratio, Dr. GRPO's constant normalisation, the dual clip, the k2 KL penalty,
    advantages centred without scaling, prompts without the chat template, TensorBoard events."""
    cfg = load_config(TrainConfig, None, overrides(tiny_ckpt, tmp_path / "run", "engine=vanilla", "steps=1",
                                                   f"loss_normalization={normalization}", "adv_mean_only=true",
                                                   f"ratio_level={ratio_level}", "clip_ratio_c=3.0",
                                                   "kl_beta=0.1", "kl_estimator=k2",
                                                   "data.chat=false", "tensorboard=true"))
    trainer = GRPOTrainer(cfg)
    start = trainer.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert all(start not in ids for ids in trainer.prompt_ids.values())
    (row,) = trainer.run()
    assert row["grad_norm"] > 0 and row["loss"] == row["loss"]
    assert list((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))


def test_the_learning_rate_follows_its_schedule(tiny_ckpt, tmp_path, ctx):
    """lr_warmup_steps and lr_decay: each step's optimizer takes the schedule's learning rate, logged
    as ``lr``; the first warm-up step learns already."""
    from specroll_mcore.rl.grpo import learning_rate

    args = overrides(tiny_ckpt, tmp_path / "run", "engine=vanilla", "steps=4", "lr_warmup_steps=2",
                     "lr_decay=cosine", "min_lr=1e-4")
    trainer = GRPOTrainer(load_config(TrainConfig, None, args))
    taken = []
    step = trainer.optimizer.step
    trainer.optimizer.step = lambda: (taken.append(trainer.optimizer.optimizer.param_groups[0]["lr"]), step())[1]
    rows = trainer.run()
    expected = [learning_rate(k, 1e-3, 4, 2, "cosine", 1e-4) for k in (1, 2, 3, 4)]
    assert taken == [r["lr"] for r in rows] == expected and expected[0] == 5e-4 and expected[-1] == 1e-4


def test_recomputation_saves_the_layer_inputs_only(ctx):
    """The activations kept for the backward of an 8-layer forward: with recomputation, a few
    tensors per layer (its input) instead of every layer's intermediate results."""
    from conftest import make_policy
    from specroll_mcore.config import tiny_llama
    from specroll_mcore.model import causal_mask

    policy = make_policy(tiny_llama(num_layers=8), ctx)
    b, L = 4, 128
    ids = torch.randint(0, 300, (b, L), generator=torch.Generator().manual_seed(0))
    meta = policy.metadata(torch.arange(L)[None].expand(b, L), causal_mask(b, L, ctx.device, torch.full((b,), L)))

    def saved_activation_bytes(recompute):
        with saved_for_backward() as saved:
            logits, _ = policy.stage_forward(ids, meta, recompute=recompute)
        logits.float().sum().backward()
        return saved[0]

    plain, recomputed = saved_activation_bytes(False), saved_activation_bytes(True)
    assert recomputed < 0.25 * plain, (recomputed, plain)
