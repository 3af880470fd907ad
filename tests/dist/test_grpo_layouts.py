"""A GRPO step at TP=2 and at PP=2 (2 processes, gloo) equals the TP=1 step: same rollouts and
rewards, the same loss and gradient norm (rel 1e-4), and the same updated weights.

Weight tolerance 1e-4 = 0.1 x lr: TP reductions reorder float sums, so gradients differ by a few
ulps; Adam's first step is lr * g / (|g| + eps), which turns an ulp-level gradient difference into a
visible update difference only where |g| is near eps. A wrong shard or a missing gradient reduction
changes updates by O(lr) = 1e-3 on many weights.

The one-process references run in the test's own process (run_here); the layouts under torchrun,
those of one test with the same process count in one launch (run_jobs): a launch's start and
imports cost ~8 s on 2 cores, a run of these tests ~2 s. Resumes the tests compare run in fresh
processes at least once (a resumed run in the process that saved could lean on what it left in
memory)."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

import grpo_worker
from grpo_fixtures import max_apart, tiny_policy_checkpoint
from specroll_mcore.checkpoint.megatron import load_full_state_dict, load_heads

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.dist


def torchrun(nproc, *args):
    env = dict(os.environ, PYTHONPATH=f"{HERE.parent.parent}{os.pathsep}{HERE.parent}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(HERE / "grpo_worker.py"), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


def launch(ckpt, out, tp, pp, nproc, *extra):
    return torchrun(nproc, f"--ckpt={ckpt}", f"--out={out}", f"--tp={tp}", f"--pp={pp}", *extra)


def metrics(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def run(ckpt, out, tp, pp, nproc, *extra):
    proc = launch(ckpt, out, tp, pp, nproc, *extra)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return metrics(out)


def run_here(ckpt, out, *extra):
    """:func:`run`'s run at TP=1, PP=1 in one process: in this one (the tests' TP=1 parallel state), on
    one thread as in a launch; the reference the launched layouts are compared with. ``ckpt`` None:
    ``extra`` names it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        grpo_worker.run(grpo_worker.parser().parse_args([f"--ckpt={ckpt}"] * (ckpt is not None) +
                                                        [f"--out={out}", *extra]))
    finally:
        torch.set_num_threads(threads)
    return metrics(out)


def run_jobs(ckpt, nproc, *jobs):
    """Runs ``(out, tp, pp, *extra)`` one after the other in one launch of ``nproc`` processes (each
    run as :func:`run`'s, a launch's start paid once); their metrics, in order. ``ckpt`` None: each
    job's ``extra`` names its own."""
    args = [[f"--ckpt={ckpt}"] * (ckpt is not None) + [f"--out={out}", f"--tp={tp}", f"--pp={pp}", *extra]
            for out, tp, pp, *extra in jobs]
    listing = Path(jobs[0][0]).parent / f"{Path(jobs[0][0]).name}.jobs.json"
    listing.parent.mkdir(parents=True, exist_ok=True)
    listing.write_text(json.dumps(args))
    proc = torchrun(nproc, f"--jobs={listing}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return [metrics(out) for out, *_ in jobs]


def assert_steps_agree(ref: list, got: list, exact=("reward_mean", "response_len"), summed=(),
                       close=("loss", "grad_norm"), where=None) -> None:
    """The metrics rows of a run in another layout against the reference's, step by step: ``exact``
    metrics equal (or missing in both), ``summed`` ones to rel 1e-6 (float32 sums over the replicas
    in another order), ``close`` ones to rel 1e-4, abs 1e-6 (reductions reordered: see above), each
    of those two in both rows or in neither."""
    assert [r["step"] for r in got] == [r["step"] for r in ref], where
    for a, b in zip(ref, got):
        for k in exact:
            assert b.get(k) == a.get(k), (a["step"], k, a.get(k), b.get(k), where)
        for k in (*summed, *close):
            assert (k in a) == (k in b), (a["step"], k, where)
            if k in a:
                tolerance = {"rel": 1e-6} if k in summed else {"rel": 1e-4, "abs": 1e-6}
                assert b[k] == pytest.approx(a[k], **tolerance), (a["step"], k, a[k], b[k], where)


def weights_apart(ref_out: Path, out: Path) -> float:
    """The largest difference between the policy weights two runs saved last (:func:`max_apart`)."""
    return max_apart(load_full_state_dict(out), load_full_state_dict(ref_out))


def test_grpo_step_tp2_and_pp2_equal_tp1(tmp_path):
    """On a Qwen3 (the other layout tests run Llamas): its q/k norms are replicated over TP, but each
    rank's heads give only part of their gradient; without the TP sum the two ranks' copies would
    take different updates (2 x lr apart after one step). TP=2 and PP=2 take their log-probs in pieces
    of 5 positions (TrainConfig.logprob_chunk; the vocab-parallel reductions rerun in the backward),
    TP=1 over the whole span. Two layouts add an entropy bonus (its gradient through each TP shard's
    part of the vocabulary), against a TP=1 run with it."""
    ckpt = tiny_policy_checkpoint(tmp_path, with_heads=False, arch="qwen3")
    # each stage and shard swaps its reference weights in for the KL term's forward; two optimizer steps
    # (the second against the rollout's log-probs, after the first moved the weights)
    kl = ("--set=kl_beta=0.1", "--set=mini_batches=2")
    bonus = ("--set=entropy_coeff=0.05",)
    refs = {(): run_here(ckpt, tmp_path / "tp1", *kl), bonus: run_here(ckpt, tmp_path / "tp1-bonus", *kl, *bonus)}
    kl = (*kl, "--set=logprob_chunk=5")
    ref_ws = {(): load_full_state_dict(tmp_path / "tp1"), bonus: load_full_state_dict(tmp_path / "tp1-bonus")}
    ref_w = ref_ws[()]
    norms = [k for k in ref_w if k.endswith(("q_layernorm.weight", "k_layernorm.weight"))]
    assert len(norms) == 4 and all((ref_w[k] != load_full_state_dict(ckpt)[k]).any() for k in norms)  # they moved
    assert refs[()][0]["optimizer_steps"] == 2
    assert max_apart(ref_ws[bonus], ref_w) > 1e-4  # the bonus moves the step
    # PP=2 with one sequence per micro-batch (6 micro-batches of different lengths through 1F1B, in the
    # token budget's order: longest first, where TP=1 runs 2 of 3 in the rollout's order) and activation
    # recomputation (PP=2 with several padded sequences a micro-batch: the uneven-split test)
    pp2 = ("--set=micro_batch_size=1", "--set=micro_batch_tokens=524", "--set=recompute_activations=true")
    # sequence parallelism, with recomputation (the layers' inputs kept split) and without (megatron's block)
    sp = ("--set=parallel.sequence_parallel=true",)
    layouts = [(2, 1, (), ()), (2, 1, (*sp, "--set=recompute_activations=true"), bonus), (2, 1, sp, ()),
               (1, 2, pp2, bonus)]
    runs = run_jobs(ckpt, 2, *[(tmp_path / f"layout{i}", tp, pp, *kl, *extra, *added)
                               for i, (tp, pp, extra, added) in enumerate(layouts)])
    for i, ((tp, pp, extra, added), got) in enumerate(zip(layouts, runs)):
        # (the entropy: over TP's vocabulary shards)
        assert_steps_agree(refs[added], got, close=("loss", "grad_norm", "entropy"), where=(tp, pp))
        diff = max_apart(load_full_state_dict(tmp_path / f"layout{i}"), ref_ws[added])
        print(f"TP={tp} PP={pp} {extra + added}: max |weight diff| after two optimizer steps = {diff:.2e}")
        assert diff < 1e-4
        assert any((ref_w[k] != load_full_state_dict(ckpt)[k]).any() for k in ref_w)  # the step moved the weights


@pytest.mark.slow  # (4 processes on 2 cores, ~25 s: `make test-slow`)
def test_grpo_step_with_sequence_parallelism_over_tp2_pp2_equals_tp1(tmp_path):
    """TP=2 x PP=2 with sequence parallelism: the stages send each other the TP ranks' parts of the
    sequence (half the positions), through 1F1B with one sequence a micro-batch, with recomputation."""
    ckpt = tiny_policy_checkpoint(tmp_path, with_heads=False)
    ref = run_here(ckpt, tmp_path / "tp1")
    got = run(ckpt, tmp_path / "tp2pp2", 2, 2, 4, "--set=parallel.sequence_parallel=true", "--set=micro_batch_size=1",
              "--set=recompute_activations=true")
    assert_steps_agree(ref, got, close=("loss", "grad_norm", "entropy"))
    assert weights_apart(tmp_path / "tp1", tmp_path / "tp2pp2") < 1e-4


def test_grpo_step_on_an_uneven_pipeline_split_equals_tp1(tmp_path):
    """3 layers as 2 + 1 over PP=2 (checkpoint converted evenly for one stage: resharded on load), on a
    Qwen3-MoE with a load-balancing loss and routing replay: its routers and every expert train, on
    either stage, as in one process, and the loss logged is the same. Each stage replays its own
    layers' routing, also in the recomputation of a micro-batch's backward while later micro-batches'
    forwards have run (1F1B, 2 sequences a micro-batch)."""
    ckpt = tiny_policy_checkpoint(tmp_path, with_heads=False, num_layers=3, arch="qwen3_moe")
    common = ("--set=moe_aux_loss_coeff=0.01", "--set=routing_replay=true", "--set=micro_batch_size=2")
    ref = run_here(ckpt, tmp_path / "tp1", *common)
    got = run(ckpt, tmp_path / "pp2", 1, 2, 2, "--set=parallel.num_layers_in_last_pipeline_stage=1",
              "--set=recompute_activations=true", *common)
    assert got[0]["moe_aux_loss"] == pytest.approx(ref[0]["moe_aux_loss"], rel=1e-6) and ref[0]["moe_aux_loss"] > 1
    assert json.loads((tmp_path / "pp2" / "specroll_config.json").read_text())["pipeline_stage_layers"] == [2, 1]
    assert_steps_agree(ref, got)
    ref_w = load_full_state_dict(tmp_path / "tp1")
    diff = max_apart(load_full_state_dict(tmp_path / "pp2"), ref_w)
    print(f"Qwen3-MoE, PP=2 split 2 + 1: max |weight diff| after one step = {diff:.2e}")
    assert diff < 1e-4
    before = load_full_state_dict(ckpt)
    moe = [k for k in ref_w if ".mlp.router." in k or ".mlp.experts." in k]
    assert len(moe) == 3 * (1 + 4 * 2) and all((ref_w[k] != before[k]).any() for k in moe)  # all of them moved


def test_dynamic_sampling_at_dp2_equals_dp1(tmp_path):
    """DAPO's dynamic sampling at DP=2: the replicas agree on which groups have varied rewards, roll
    out further rounds together and deal the chosen groups out evenly; two steps give DP=1's rounds,
    rewards, loss and weights. On a Qwen3-MoE with a load-balancing loss, weighed over the micro-batches
    of both replicas as over one process's, and routing replay (the chosen groups' routing travels
    with them to the replica that trains on them). The held-out evaluation, its prompts split over the
    replicas, gives DP=1's figures. With fewer prompts per step than replicas the run stops with an
    error naming the field."""
    ckpt = tiny_policy_checkpoint(tmp_path, with_heads=False, arch="qwen3_moe")
    dyn = ["--set=steps=2", "--set=dynamic_sampling=true", "--set=max_sampling_rounds=4",
           "--set=reward_fn=rewards_for_tests:flat_for_even_answers_reward", "--set=moe_aux_loss_coeff=0.05",
           "--set=routing_replay=true"]
    # held-out evaluation before training and after each step: 6 prompts, 2 a rollout per replica
    evaluation = ["--set=eval.every=1", "--set=eval.before_training=true", "--set=eval.data.limit=6",
                  "--set=eval.batch_prompts=2", "--set=eval.sampling.max_new_tokens=8"]
    ref = run_here(ckpt, tmp_path / "dp1", *dyn, *evaluation)
    got = run(ckpt, tmp_path / "dp2", 1, 1, 2, *dyn, *evaluation)
    assert [r["step"] for r in got] == [0, 1, 2]
    for a, b in zip(ref, got):
        assert a["eval_prompts"] == b["eval_prompts"] == 6
        assert (a["eval_accuracy"], a["eval_response_len"]) == (b["eval_accuracy"], b["eval_response_len"])
        assert b["eval_reward_mean"] == pytest.approx(a["eval_reward_mean"], rel=1e-6)
    ref, got = ref[1:], got[1:]
    assert sum(r["sampling_rounds"] for r in ref) > len(ref), ref  # a step took another round
    assert_steps_agree(ref, got, exact=("sampling_rounds", "groups_varied", "groups_trained", "response_len"),
                       summed=("reward_mean",), close=("loss", "grad_norm", "moe_aux_loss"))
    assert weights_apart(tmp_path / "dp1", tmp_path / "dp2") < 1e-4
    proc = launch(ckpt, tmp_path / "p1", 1, 1, 2, "--set=prompts_per_step=1")
    assert proc.returncode != 0 and "TrainConfig.prompts_per_step (1) is below the data-parallel size (2)" in (
        proc.stdout + proc.stderr)


def test_dynamic_sampling_with_fewer_groups_than_replicas_at_dp2_equals_dp1(tmp_path):
    """Dynamic sampling that finds one group of varied rewards in its rounds (one prompt of four has
    an odd answer: flat_for_even_answers_reward) at DP=2: its responses are dealt out over the two
    replicas, and the step trains on them as one process does (the step was skipped there)."""
    ckpt = tiny_policy_checkpoint(tmp_path, with_heads=False)
    rows = [{"question": f"What is {a} + {b}?", "answer": f"#### {a + b}"} for a, b in ((2, 2), (3, 5), (4, 6), (3, 4))]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = (f"--set=data.source={data}", "--set=data.limit=4", "--set=dynamic_sampling=true",
              "--set=max_sampling_rounds=2", "--set=reward_fn=rewards_for_tests:flat_for_even_answers_reward",
              "--set=mini_batches=2")
    ref = run_here(ckpt, tmp_path / "dp1", *common)
    got = run(ckpt, tmp_path / "dp2", 1, 1, 2, *common)
    assert_steps_agree(ref, got, exact=("sampling_rounds", "groups_varied", "groups_trained", "skipped",
                                        "optimizer_steps"), close=("loss", "grad_norm", "entropy"))
    assert (ref[0]["sampling_rounds"], ref[0]["groups_trained"], ref[0]["skipped"]) == (2, 1, False), ref[0]
    assert weights_apart(tmp_path / "dp1", tmp_path / "dp2") < 1e-4


@pytest.mark.parametrize("tp", [1, 2])  # DP=2, or TP=2
def test_slow_path_under_data_and_tensor_parallelism(tmp_path, tp):
    """Consolidations run every step; the collective decisions and updates do not deadlock, and every
    data-parallel replica ends with the same heads."""
    ckpt = tiny_policy_checkpoint(tmp_path, with_heads=True)
    rows = run(ckpt, tmp_path / "run", tp, 1, 2, "--specroll", "--dump-rollout-stats",
               "--set=compare_vanilla_every=1", "--set=prompts_per_step=4", "--set=micro_batch_size=6")
    assert rows[-1]["slow_path_events"] >= 2, rows
    assert json.loads((tmp_path / "run" / "heads_check.json").read_text())["dp_spread"] == 0.0
    # The logged rollout figures are every replica's (DP=2), as each rank recorded its own
    ranks = [json.loads((tmp_path / "run" / f"rollout_stats_rank{r}.json").read_text()) for r in range(2)]
    for row in rows:
        updates = [[rec for rec in rank if rec["step"] == row["step"] and "update_real" in rec] for rank in ranks]
        mine = [[rec for rec in rank if rec["step"] == row["step"] and "per_step" in rec] for rank in ranks]
        replicas = mine if tp == 1 else mine[:1]  # (TP=2: one replica, whose ranks record the same)
        steps = [p for recs in replicas for rec in recs for p in rec["per_step"]]
        assert row["tau"] == pytest.approx(sum(p["emitted"] for p in steps) / sum(p["active"] for p in steps))
        assert row["nodes_per_row"] == pytest.approx(sum(p["nodes_per_row"] * p["active"] for p in steps)
                                                     / sum(p["active"] for p in steps))
        tried = [sum(t) for t in zip(*(rec["tried"] for recs in replicas for rec in recs))]
        accepted = [sum(a) for a in zip(*(rec["accepted"] for recs in replicas for rec in recs))]
        assert row["acceptance_per_head"] == pytest.approx([a / max(1, t) for a, t in zip(accepted, tried)])
        if tp == 1:  # the step waits for the slower replica's generation
            assert row["generation_s"] == pytest.approx(max(sum(rec["gen_s"] for rec in recs) for recs in mine))
        # every replica's tokens (4 prompts x 3 samples in all) over the time the step generated for
        assert row["gen_tokens_per_s"] == pytest.approx(12 * row["response_len"] / row["generation_s"])
        # the update's padding over every replica's micro-batches; the slow path's records summed over the
        # replicas, its shares of the generation time averaged
        real, positions = (sum(rec[k] for recs in updates[:len(replicas)] for rec in recs)
                           for k in ("update_real", "update_positions"))
        assert row["update_padding"] == pytest.approx(1 - real / positions) and real < positions
        slow = [recs[-1]["slow_path"] for recs in replicas]
        assert row["slow_path_records"] == sum(sp["records"] for sp in slow) > 0
        assert row["slow_path_share"] == pytest.approx(sum(sp["time_share"] for sp in slow) / len(slow))
        assert row["rollouts_identical"] and row["vanilla_gen_s"] > 0


def test_sharded_optimizer_equals_replicated_and_resumes(tmp_path):
    """DP=2 with AdamW's states split over the replicas (ZeRO-1): two steps give the weights of the
    replicated optimizer, each replica saves a disjoint part of the states, and a run resumed from
    the step-1 checkpoint (each replica loading its own part) ends with the same weights. With weight
    decay: AdamW's two parameter groups (matrices, and the 1-D parameters that take none) sharded. A
    replicated checkpoint resumes sharded and a sharded one replicated (each replica's part of the
    states gathered by name): a third step gives the uninterrupted replicated run's weights. The sharded
    run writes its step-1 checkpoint in the background (TrainConfig.async_save)."""
    ckpt = tiny_policy_checkpoint(tmp_path, with_heads=False)
    two = ["--set=steps=2", "--set=weight_decay=0.1"]
    sharded = ["--set=shard_optimizer=true", "--set=save_every=1", "--set=keep_last=2"]
    run_jobs(ckpt, 2, (tmp_path / "replicated", 1, 1, *two),
             (tmp_path / "sharded", 1, 1, *two, *sharded, "--set=async_save=true"),  # (step 1's in the background)
             (tmp_path / "resumed", 1, 1, "--set=steps=1", "--set=weight_decay=0.1", *sharded),
             (tmp_path / "three", 1, 1, "--set=steps=3", "--set=weight_decay=0.1"))
    assert (tmp_path / "sharded" / "iter_0000001" / "mp_rank_00" / "optim_dp1.pt").is_file()
    run(ckpt, tmp_path / "resumed", 1, 1, 2, *two, *sharded, "--set=resume=true")  # (in fresh processes)
    ref = load_full_state_dict(tmp_path / "replicated")
    start = load_full_state_dict(ckpt)
    assert any((ref[k] != start[k]).any() for k in ref)
    for name in ("sharded", "resumed"):
        w = load_full_state_dict(tmp_path / name)
        diff = max_apart(w, ref)
        assert diff < 1e-6, (name, diff)
    shard_dir = tmp_path / "sharded" / "iter_0000002" / "mp_rank_00"
    parts = [torch.load(shard_dir / "model_optim_rng.pt", weights_only=False)["optimizer"],
             torch.load(shard_dir / "optim_dp1.pt", weights_only=False)["optimizer"]]
    assert [p["zero_shard"] for p in parts] == [[0, 2], [1, 2]]
    counts = [len(p["state"]) for p in parts]
    assert min(counts) > 0 and sum(counts) == len([k for k in ref if not k.endswith("_extra_state")]), counts
    # a replicated checkpoint resumes sharded, a sharded one replicated
    run_jobs(ckpt, 2, (tmp_path / "replicated", 1, 1, "--set=steps=3", "--set=weight_decay=0.1", *sharded,
                       "--set=resume=true"),
             (tmp_path / "sharded", 1, 1, "--set=steps=3", "--set=weight_decay=0.1", "--set=resume=true"))
    three = load_full_state_dict(tmp_path / "three")
    assert max_apart(three, ref) > 1e-4
    for name in ("replicated", "sharded"):
        w = load_full_state_dict(tmp_path / name)
        diff = max_apart(w, three)
        assert diff < 1e-6, (name, diff)


def test_a_sharded_bfloat16_optimizer_keeps_each_main_copy_on_one_replica(tmp_path):
    """A bfloat16 policy at DP=2 with the optimizer sharded: each float32 main copy lives on the one
    replica that owns its parameter (each replica's checkpoint file holds its own, together every one,
    each rounding to the saved weight), and two steps give the replicated optimizer's weights bit for
    bit. Resumed from the sharded checkpoint, sharded again or replicated (the main copies gathered
    from both replicas' files), a third step gives the uninterrupted replicated run's weights, which
    it would not had a main copy come back as its rounding. The sharded resume reads files that hold
    every main copy, as a sharded optimizer saved them before the copies were sharded: each replica
    takes its own by name."""
    import shutil

    ckpt = tiny_policy_checkpoint(tmp_path, with_heads=False, params_dtype="bfloat16")
    sharded = ["--set=shard_optimizer=true"]
    run_jobs(ckpt, 2, (tmp_path / "replicated", 1, 1, "--set=steps=2"), (tmp_path / "three", 1, 1, "--set=steps=3"),
             (tmp_path / "sharded", 1, 1, "--set=steps=2", *sharded))
    ref, got = load_full_state_dict(tmp_path / "replicated"), load_full_state_dict(tmp_path / "sharded")
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    shard_dir = tmp_path / "sharded" / "iter_0000002" / "mp_rank_00"
    parts = [torch.load(shard_dir / name, weights_only=False)["optimizer"] for name in ("model_optim_rng.pt",
                                                                                           "optim_dp1.pt")]
    names = [set(p["main_names"]) for p in parts]
    weights = dict(torch.load(shard_dir / "model_optim_rng.pt", weights_only=False)["model"])
    assert names[0] and names[1] and not names[0] & names[1] and names[0] | names[1] == {
        k for k, v in weights.items() if isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16}
    for part in parts:
        assert all(torch.equal(m.bfloat16(), weights[n]) for n, m in zip(part["main_names"], part["main_params"]))
    shutil.copytree(tmp_path / "sharded", tmp_path / "again")
    every = [n for part in parts for n in part["main_names"]], [m for part in parts for m in part["main_params"]]
    for name in ("model_optim_rng.pt", "optim_dp1.pt"):
        blob = torch.load(tmp_path / "again" / "iter_0000002" / "mp_rank_00" / name, weights_only=False)
        blob["optimizer"]["main_names"], blob["optimizer"]["main_params"] = every
        torch.save(blob, tmp_path / "again" / "iter_0000002" / "mp_rank_00" / name)
    run_jobs(ckpt, 2, (tmp_path / "again", 1, 1, "--set=steps=3", *sharded, "--set=resume=true"),
             (tmp_path / "sharded", 1, 1, "--set=steps=3", "--set=resume=true"))
    three = load_full_state_dict(tmp_path / "three")
    assert any(not torch.equal(three[k], ref[k]) for k in ref)
    for name in ("again", "sharded"):
        w = load_full_state_dict(tmp_path / name)
        assert all(torch.equal(w[k], three[k]) for k in three), name


UPDATE_SETTINGS = {  # TrainConfig field: the values a drawn case takes (the first: the default)
    "prompts_per_step": [2, 4], "micro_batch_size": [3, 1, 2, 6], "micro_batch_tokens": [0, 524, 1048],
    "mini_batches": [1, 2], "ppo_epochs": [1, 2], "balance_batch": [True, False],
    "recompute_activations": [False, True], "logprob_chunk": [0, 5], "clip_low": [0.2, 0.1], "clip_high": [0.2, 0.28],
    "clip_ratio_c": [None, 3.0], "ratio_level": ["token", "sequence"],
    "loss_normalization": ["token", "sequence", "constant"], "adv_mean_only": [False, True], "kl_beta": [0.0, 0.1],
    "kl_estimator": ["k3", "k2"], "entropy_coeff": [0.0, 0.05], "grad_clip": [1.0, 0.05, 0.0],
    "weight_decay": [0.0, 0.1], "overlong_buffer": [0, 4], "overlong_filter": [False, True],
    "dynamic_sampling": [False, True], "shard_optimizer": [False, True], "sampling.num_samples": [3, 2, 4],
    # (the tiny models put ~0.3 on one token and the rest on a flat tail: a tighter nucleus, or a top-k,
    # often keeps that token alone, and equal rewards leave nothing to learn)
    "sampling.temperature": [1.0, 0.9], "sampling.top_p": [1.0, 0.98]}
LAYOUTS = {  # (TP, PP, overrides) of 2 processes; dp2: two replicas; ep2: two replicas splitting the experts
    "tp2": (2, 1, ()), "pp2": (1, 2, ()), "dp2": (1, 1, ()), "ep2": (1, 1, ("parallel.expert_model_parallel_size=2",))}
ARCH_LAYOUTS = {"llama": ("tp2", "pp2", "dp2"), "qwen3": ("tp2", "pp2", "dp2"), "qwen3_moe": ("pp2", "dp2", "ep2")}


def drawn_update(seed: int, arch: str = "llama") -> dict:
    """A case of the update's settings: each field of UPDATE_SETTINGS at its default or, one time in
    three, at a value drawn from the others; a TP layout with sequence parallelism half the time; a
    mixture of experts with routing replay half the time (no load-balancing loss: it is per
    micro-batch, which the layouts fill differently)."""
    r = random.Random(seed)
    case = {k: r.choice(v[1:]) for k, v in UPDATE_SETTINGS.items() if r.random() < 1 / 3}
    if r.random() < 0.5:
        case["parallel.sequence_parallel"] = True  # (TP=2 only)
    if arch == "qwen3_moe" and r.random() < 0.5:
        case["routing_replay"] = True
    return case


def settings(case: dict, layout: Optional[str] = None) -> list:
    """A drawn case's overrides at ``layout`` (LAYOUTS; None: one process)."""
    return [f"--set={k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}"
            for k, v in case.items() if layout == "tp2" or k != "parallel.sequence_parallel"] + [
        f"--set={o}" for o in (LAYOUTS[layout][2] if layout else ())]


@pytest.mark.parametrize("cases", [3, pytest.param(24, marks=pytest.mark.slow)])
def test_random_update_settings_at_tp2_pp2_dp2_and_ep2_equal_one_process(tmp_path, cases):
    """Cases of the update's settings drawn together (micro- and mini-batches, epochs, clipping, dual
    clip, GSPO's ratio, the three loss normalisations, KL and its estimators, the entropy bonus, gradient
    clipping, weight decay, overlong reward and filtering, dynamic sampling, a sharded optimizer,
    recomputation, log-probs in pieces, sequence parallelism, routing replay, the samples, temperature
    and top-p, whose filter has the old log-probs recomputed) on a Llama or a Qwen3, run
    at TP=2, PP=2 and DP=2, or a Qwen3-MoE, run at PP=2, DP=2 and EP=2 (one launch per model), against
    one process: the same rewards, rounds and optimizer steps, the loss, gradient norm, entropy, clip
    fraction and KL (rel 1e-4), and weights within 1e-4 (0.1 x lr; see the module's docstring) after
    one step of up to 4 optimizer steps, but for at most 3 whose gradient is near Adam's eps. Found:
    mini-batches, and dynamic sampling's skipped steps, that depended on the data-parallel size."""
    archs = tuple(ARCH_LAYOUTS)
    drawn = [(f"case{i}", archs[i % 3], drawn_update(1000 + i, archs[i % 3])) for i in range(cases)]
    ckpts = {arch: tiny_policy_checkpoint(tmp_path / arch, with_heads=False, arch=arch)
             for arch in dict.fromkeys(a for _, a, _ in drawn)}
    refs = {name: run_here(ckpts[arch], tmp_path / name / "ref", *settings(case)) for name, arch, case in drawn}
    jobs = [(tmp_path / name / layout, *LAYOUTS[layout][:2], f"--ckpt={ckpts[arch]}", *settings(case, layout))
            for name, arch, case in drawn for layout in ARCH_LAYOUTS[arch]]  # (in one launch, each its checkpoint)
    for (out, *_), got in zip(jobs, run_jobs(None, 2, *jobs)):
        name, layout = out.parent.name, out.name
        where = (name, layout, next(c for n, _, c in drawn if n == name))
        assert_steps_agree(refs[name], got, exact=("response_len", "optimizer_steps", "skipped", "sampling_rounds",
                                                   "groups_trained", "overlong_filtered"),
                           summed=("reward_mean",), close=("loss", "grad_norm", "entropy", "clip_fraction", "kl"),
                           where=where)
        ref_w, w = load_full_state_dict(out.parent / "ref"), load_full_state_dict(out)
        diff = max_apart(w, ref_w)
        far = sum(int(((w[k] - ref_w[k]).abs() > 1e-4).sum()) for k in ref_w)
        # (a weight whose gradient is near Adam's eps can take an update of up to lr per optimizer step
        # from a rounding: a few such; a wrong shard or reduction moves many)
        assert far <= 3 and diff < 4e-3, (far, diff, where)
    updated = [(name, arch) for name, arch, _ in drawn  # (top-k with top-p can leave one token: equal rewards)
               if not refs[name][0]["skipped"] and refs[name][0]["reward_std"] > 0]
    assert len(updated) * 2 >= cases, refs  # (most cases train: the layouts' updates are compared)
    for name, arch in updated:  # (an update of ~lr a weight, against the layouts' 1e-4)
        start, ref_w = load_full_state_dict(ckpts[arch]), load_full_state_dict(tmp_path / name / "ref")
        assert max_apart(ref_w, start) > 5e-4, name


def test_bfloat16_policy_pp2_equals_pp1(tmp_path):
    """A bfloat16 policy at PP=2 (float32 main weights and gradients; the tied embedding's two copies
    summed in float32) takes the PP=1 step: the same gradient norm (rel 1e-4), and the rounded
    weights differ only where float32 sums in another order land on another bfloat16 value. One
    step: a second one's rollouts would sample from those differing weights, and rollouts are the
    same only for the same weights."""
    ckpt = tiny_policy_checkpoint(tmp_path, with_heads=False, params_dtype="bfloat16")
    extra = ("--set=steps=1", "--set=micro_batch_size=1")
    ref = run_here(ckpt, tmp_path / "pp1", *extra)
    got = run(ckpt, tmp_path / "pp2", 1, 2, 2, *extra)
    assert len(ref) == len(got) == 1
    for ra, rb in zip(ref, got):
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-4)
    start, a, b = (load_full_state_dict(d) for d in (ckpt, tmp_path / "pp1", tmp_path / "pp2"))
    for k in a:
        assert a[k].dtype == torch.bfloat16
        assert (a[k] != b[k]).float().mean() < 0.1, k
    assert all((a[k] != start[k]).float().mean() > 0.5 for k in a if k.endswith("linear_qkv.weight"))


def test_balanced_replicas_equal_dp1(tmp_path):
    """DP=2 with the update's sequences dealt out by their tokens (TrainConfig.balance_batch): the
    replica holding the long prompt's group passes sequences to the other, and the step equals DP=1's
    (the loss is normalised over both replicas). On a Qwen3-MoE with routing replay, so that the
    moved sequences' routing travels with them."""
    ckpt = tiny_policy_checkpoint(tmp_path, with_heads=False, arch="qwen3_moe")
    long_question = "A farmer keeps a ledger of every animal on the farm. " * 12 + "How many hens are left?"
    rows = [{"question": q, "answer": f"#### {a}"} for q, a in
            [(long_question, 3), ("What is 2 + 2?", 4), ("What is 3 + 5?", 8), ("What is 9 - 4?", 5)]]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = (f"--set=data.source={data}", "--set=data.limit=4", "--set=prompts_per_step=4",
              "--set=routing_replay=true")
    ref = run_here(ckpt, tmp_path / "dp1", *common)
    got = run(ckpt, tmp_path / "dp2", 1, 1, 2, *common)
    assert got[0]["dp_sequences_moved"] > 0, got[0]
    assert got[0]["dp_tokens_max_over_mean"] < got[0]["dp_tokens_max_over_mean_rollout"], got[0]
    assert "dp_sequences_moved" not in ref[0]
    assert_steps_agree(ref, got, exact=(), summed=("reward_mean", "response_len"))
    assert weights_apart(tmp_path / "dp1", tmp_path / "dp2") < 1e-4


@pytest.mark.parametrize("common", [
    ("--set=prompts_per_step=4", "--set=mini_batches=2", "--set=ppo_epochs=2", "--set=balance_batch=false"),
    ("--set=prompts_per_step=2", "--set=mini_batches=2", "--set=balance_batch=true"),
    ("--set=prompts_per_step=4", "--set=mini_batches=3", "--set=balance_batch=true", "--set=overlong_filter=true",
     "--cut-odd-prompts")], ids=["even", "a-group-a-replica", "uneven-balanced-filtered"])
def test_mini_batches_at_dp2_equal_dp1(tmp_path, common):
    """Several optimizer steps per rollout batch (TrainConfig.mini_batches) at DP=2 take DP=1's steps:
    each part is consecutive in the step's batch over both replicas (its prompts' places: prompts are
    dealt out in turn), each normalised over both replicas; so too where a replica holds a single
    group (two parts: each replica's half of its group would have made other steps), where the parts
    do not divide the responses, balance_batch moves sequences between the replicas and overlong
    filtering leaves replica 1 nothing to train on."""
    ckpt = tiny_policy_checkpoint(tmp_path, with_heads=False)
    ref = run_here(ckpt, tmp_path / "dp1", *common)
    got = run(ckpt, tmp_path / "dp2", 1, 1, 2, *common)
    M = int(common[1].split("=")[-1]) * (2 if "--set=ppo_epochs=2" in common else 1)
    assert ref[0]["optimizer_steps"] == got[0]["optimizer_steps"] == M
    # (the clip fraction and KL were replica 0's alone)
    assert_steps_agree(ref, got, exact=(), summed=("reward_mean", "response_len"),
                       close=("loss", "grad_norm", "entropy", "clip_fraction", "kl"))
    assert weights_apart(tmp_path / "dp1", tmp_path / "dp2") < 1e-4


def test_a_replica_whose_responses_are_all_overlong_filtered_equals_dp1(tmp_path):
    """Overlong filtering at DP=2 with every response of replica 1 cut at the length limit: balanced,
    replica 0 passes it sequences to train on; unbalanced, it keeps one with no loss and joins the
    update's reductions. Either way the step is DP=1's on the same responses (at DP=1 there is
    nothing to balance: one reference for both)."""
    ckpt = tiny_policy_checkpoint(tmp_path, with_heads=False)
    common = ("--cut-odd-prompts", "--set=prompts_per_step=4", "--set=overlong_filter=true")
    ref = run_here(ckpt, tmp_path / "dp1", *common)
    runs = run_jobs(ckpt, 2, *[(tmp_path / f"dp2-{balance}", 1, 1, *common, f"--set=balance_batch={balance}")
                               for balance in ("true", "false")])
    for balance, got in zip(("true", "false"), runs):
        assert ref[0]["overlong_filtered"] == got[0]["overlong_filtered"] == 6 and not got[0]["skipped"]
        if balance == "true":
            assert got[0]["dp_sequences_moved"] > 0 and got[0]["dp_tokens_max_over_mean_rollout"] == 2.0
        else:
            assert "dp_sequences_moved" not in got[0], got[0]
        assert_steps_agree(ref, got, exact=(), close=("loss", "grad_norm", "entropy"), where=balance)
        assert weights_apart(tmp_path / "dp1", tmp_path / f"dp2-{balance}") < 1e-4, balance


def test_an_output_directory_the_ranks_do_not_share_is_refused(tmp_path):
    """Ranks that see different directories at TrainConfig.output_dir (output directories on each
    node's own disk; here a relative path from two working directories) stop before they train,
    with an error that names the ranks that do not see rank 0's directory and what to give instead:
    a checkpoint would hold rank 0's files alone, and a resume would find it on one node only."""
    ckpt = tiny_policy_checkpoint(tmp_path / "ckpt", with_heads=False)
    proc = launch(ckpt, tmp_path / "runs", 1, 1, 2, "--own-directory-per-rank", "--set=save_every=1")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert ("TrainConfig.output_dir run is not one directory every rank shares: rank(s) [1] of 2 do not see the "
            "file rank 0 wrote there within 1 s") in out and "a file system every node mounts" in out, out[-3000:]
    assert not list((tmp_path / "runs").glob("rank*/run/*"))  # (rank 0's probe removed; nothing trained or saved)


def test_ranks_that_read_different_latest_checkpoints_do_not_resume(tmp_path):
    """A resume where the last rank finds no checkpoint and rank 0 finds step 1's (a file system that
    shows one rank stale files): every rank stops with an error naming the ranks, none trains on
    (rank 0 resumed at step 1 and the last rank started afresh, and their collectives hung)."""
    ckpt = tiny_policy_checkpoint(tmp_path / "ckpt", with_heads=False)
    out = tmp_path / "run"
    run(ckpt, out, 1, 1, 2, "--set=steps=1", "--set=save_every=1")
    proc = launch(ckpt, out, 1, 1, 2, "--set=steps=2", "--set=resume=true", "--last-rank-reads-no-checkpoint")
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    assert f"the ranks read different latest checkpoints in {out}: rank(s) [1] of 2 another than rank 0" in text, (
        text[-3000:])
    assert "reading iter_0000001" in text and "reading none" in text, text[-3000:]
    assert [r["step"] for r in metrics(out)] == [1]  # (step 2 never ran)


def test_a_sigterm_on_one_rank_ends_every_rank_after_the_same_step(tmp_path):
    """At DP=2 only the last rank gets the signal: both stop after that step, with its checkpoint (without
    the ranks agreeing, the other one would wait in the next step's collectives)."""
    ckpt = tiny_policy_checkpoint(tmp_path / "ckpt", with_heads=False)
    out = tmp_path / "run"
    rows = run(ckpt, out, 1, 1, 2, "--set=steps=4", "--set=save_every=100", "--sigterm-after-step=2")
    assert [r["step"] for r in rows] == [1, 2]
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


RUN_SETTINGS = {  # what else a run carries from step to step (the first: the default)
    "lr_warmup_steps": [0, 2], "lr_decay": ["constant", "cosine"], "data.limit": [16, 5],
    "spec.reflex.enabled": [True, False], "spec.slow_path.enabled": [True, False], "async_save": [False, True],
    "eval.every": [0, 2], "compare_vanilla_every": [0, 2]}
EVAL = ["eval.data.limit=4", "eval.sampling.max_new_tokens=8", "eval.batch_prompts=4"]


def drawn_run(seed: int, arch: str, layout: Optional[str]) -> tuple[str, int, int, list, int]:
    """A run of :func:`drawn_update`'s settings at ``layout`` (LAYOUTS; None: one process), with
    SpecRoll rollouts half the time (a busy slow path, trees weighed by a latency profile: the
    tree-size calibration shapes them from step to step), each of RUN_SETTINGS drawn half the time
    and a bfloat16 policy one time in three: the policy's dtype, TP, PP, the worker's other
    arguments, and the step (1 or 2 of 3) after which it is interrupted."""
    r = random.Random(seed)
    case = drawn_update(seed, arch)
    case.update({k: r.choice(v[1:]) for k, v in RUN_SETTINGS.items() if r.random() < 1 / 2})
    specroll = ["--specroll", "--weighed-trees"] if r.random() < 1 / 2 else []
    tp, pp = LAYOUTS[layout][:2] if layout else (1, 1)
    extra = specroll + settings(case, layout) + [f"--set={o}" for o in EVAL + ["save_every=1", "steps=3"]]
    stop = r.choice([1, 2])
    return "bfloat16" if r.random() < 1 / 3 else "float32", tp, pp, extra, stop


def deterministic(row: dict) -> dict:
    """A metrics row less its timings (every metric ending in _s or _share, a slow-path event's seconds)."""
    row = {k: v for k, v in row.items() if not k.endswith(("_s", "_share"))}
    if row.get("slow_path_event"):
        row["slow_path_event"] = {k: v for k, v in row["slow_path_event"].items() if k != "seconds"}
    return row


@pytest.mark.parametrize("cases, launched", [(3, False), pytest.param(18, False, marks=pytest.mark.slow),
                                             pytest.param(9, True, marks=pytest.mark.slow)])
def test_random_runs_interrupted_and_resumed_continue_the_uninterrupted_ones(tmp_path, cases, launched):
    """Runs of drawn settings (:func:`drawn_update`'s and RUN_SETTINGS: SpecRoll with Reflex, a slow
    path consolidating a head nearly every step and trees sized by the tree-size calibration,
    learning-rate warm-up and decay, a dataset that wraps around, evaluation, vanilla comparisons,
    checkpoints in the background) on a Llama, a Qwen3 or a Qwen3-MoE, in float32 or bfloat16
    (float32 main weights), in one process or (``launched``) at TP = 2, PP = 2, DP = 2 or EP = 2,
    stopped by SIGTERM after step 1 or 2 of 3 and resumed in fresh processes: every metric of every
    step but the timings, the policy's weights and the heads equal the uninterrupted run's, bit for
    bit (the same layout, one thread a process). A resume that forgot the calibration would size
    the next trees from its prior: other nodes per row, acceptance, tau and, through the
    verification forward's shape, log-probs a few ulps apart."""
    archs = tuple(ARCH_LAYOUTS)
    drawn = []
    for i in range(cases):
        arch = archs[i % 3]
        layout = ARCH_LAYOUTS[arch][i // 3 % 3] if launched else None
        drawn.append((f"case{i}", arch, *drawn_run(2000 + i, arch, layout)))
    ckpts = {(arch, dtype): tiny_policy_checkpoint(tmp_path / f"{arch}-{dtype}", arch=arch, params_dtype=dtype)
             for arch, dtype in dict.fromkeys((a, d) for _, a, d, *_ in drawn)}
    # (each job names its checkpoint: the runs of a stage in one launch, its start paid once)
    ran = [(tmp_path / name, tp, pp, f"--ckpt={ckpts[arch, dtype]}", *extra, stop)
           for name, arch, dtype, tp, pp, extra, stop in drawn]
    first = [(d / "ref", tp, pp, *extra) for d, tp, pp, *extra, _ in ran] + [
        (d / "resumed", tp, pp, f"--sigterm-after-step={stop}", *extra) for d, tp, pp, *extra, stop in ran]
    if launched:
        run_jobs(None, 2, *first)
    else:
        for out, _, _, *extra in first:
            run_here(None, out, *extra)
    for d, *_, stop in ran:  # (SIGTERM ended the run after that step's checkpoint)
        assert (d / "resumed" / "latest_checkpointed_iteration.txt").read_text().strip() == str(stop), d
    run_jobs(None, 2 if launched else 1, *[(d / "resumed", tp, pp, "--set=resume=true", *extra)
                                           for d, tp, pp, *extra, _ in ran])
    for name, arch, dtype, _, _, extra, stop in drawn:
        where = (name, arch, dtype, stop, extra)
        ref, got = metrics(tmp_path / name / "ref"), metrics(tmp_path / name / "resumed")
        assert [r["step"] for r in ref] == [r["step"] for r in got] == [1, 2, 3], where
        for a, b in zip(ref, got):
            assert deterministic(b) == deterministic(a), (a["step"], where)
        w, ref_w = (load_full_state_dict(tmp_path / name / d) for d in ("resumed", "ref"))
        assert w.keys() == ref_w.keys() and all(torch.equal(w[k], ref_w[k]) for k in w), where
        if "--specroll" in extra:  # (a run of vanilla rollouts keeps no heads)
            (h, meta), (ref_h, ref_meta) = (load_heads(tmp_path / name / d) for d in ("resumed", "ref"))
            assert meta == ref_meta and h.keys() == ref_h.keys() and all(torch.equal(h[k], ref_h[k]) for k in h), where


def test_a_run_resumed_in_other_layouts_continues_the_uninterrupted_one(tmp_path):
    """A run saved at TP=2 resumes at PP=2, then at DP=2 with the optimizer states sharded, then on one
    process: four steps of it give the four steps of one uninterrupted TP=1 run (rollouts, rewards,
    loss, gradient norm; weights at 1e-4). Each resume reshards the weights and AdamW's states by
    parameter name; a resume that lost the states would restart Adam's moments, whose first update
    (lr x sign) moves the weights by ~lr = 1e-3 against the continued run. A directory whose config
    file was given a new layout by a resume killed before its first checkpoint still reads in the
    layout of its latest iteration; an iteration that records no layout is refused at another one."""
    ckpt = tiny_policy_checkpoint(tmp_path, with_heads=False)
    common = ["--set=weight_decay=0.1", "--set=save_every=1", "--set=keep_last=4"]
    ref = run_here(ckpt, tmp_path / "tp1", "--set=steps=4", *common)
    out = tmp_path / "moved"
    run_jobs(ckpt, 2, (out, 2, 1, "--set=steps=1", *common),
             (out, 1, 2, "--set=steps=2", "--set=resume=true", *common))
    run(ckpt, out, 1, 1, 2, "--set=steps=3", "--set=resume=true", "--set=shard_optimizer=true", *common)
    # (the layout a resume at TP=1 writes before its first checkpoint: the DP=2 iteration is still read right)
    config = json.loads((out / "specroll_config.json").read_text())
    (out / "specroll_config.json").write_text(json.dumps({**config, "tensor_model_parallel_size": 2}))
    saved = json.loads((out / "iter_0000003" / "layout.json").read_text())
    assert (saved["data_parallel_size"], saved["shard_optimizer"]) == (2, True)
    at3 = load_full_state_dict(out)
    got = run_here(ckpt, out, "--set=steps=4", "--set=resume=true", *common)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert_steps_agree(ref, got)
    ref_w, w = load_full_state_dict(tmp_path / "tp1"), load_full_state_dict(out)
    diff = max_apart(w, ref_w)
    print(f"four steps over TP=2, PP=2, DP=2 (sharded) and one process: max |weight diff| = {diff:.2e}")
    assert diff < 1e-4
    assert max_apart(w, at3) > 1e-4  # (step 4 moved them)
    # an iteration written before checkpoints recorded their layout resumes only in its own
    (tmp_path / "tp1" / "iter_0000004" / "layout.json").unlink()
    proc = launch(ckpt, tmp_path / "tp1", 2, 1, 2, "--set=steps=5", "--set=resume=true", *common)
    assert proc.returncode != 0 and "was trained in another parallel layout (tensor_model_parallel_size 1 -> 2)" in (
        proc.stdout + proc.stderr) and "written before checkpoints recorded their layout" in proc.stdout + proc.stderr


def test_a_bfloat16_run_resumed_in_another_layout_keeps_its_float32_main_weights(tmp_path):
    """A bfloat16 policy's float32 main copies, saved as TP=2 shards, come back whole at TP=1: each
    rounds to the weight loaded from the same checkpoint, and carries the bits below bfloat16's (were
    they lost, the run would continue from the rounding). Its AdamW moments come back too (a step's
    worth of gradient, nonzero), and a parameter saved without them stays without."""
    from specroll_mcore.config import TrainConfig, load_config
    from specroll_mcore.rl.trainer import GRPOTrainer

    ckpt = tiny_policy_checkpoint(tmp_path, with_heads=False, params_dtype="bfloat16")
    run(ckpt, tmp_path / "tp2", 2, 1, 2, "--set=steps=1")
    weights = load_full_state_dict(tmp_path / "tp2")
    # a parameter AdamW holds no state for (one that has not taken a step yet) stays without one
    for shard in (tmp_path / "tp2" / "iter_0000001").glob("mp_rank_*/model_optim_rng.pt"):
        blob = torch.load(shard, weights_only=False)
        blob["optimizer"]["state"].pop(blob["optimizer"]["state_names"].index("decoder.final_layernorm.weight"))
        torch.save(blob, shard)
    trainer = GRPOTrainer(load_config(TrainConfig, None, grpo_worker.overrides(ckpt, tmp_path / "tp2", 1, 1)
                                      + ["resume=true"]))
    opt = trainer.optimizer
    named = dict(trainer.policy.gpt.named_parameters())
    main = {n: m for n, p, m in zip(opt.names, opt.params, opt.main) if m is not p}
    assert set(main) == set(named) and all(p.dtype == torch.bfloat16 for p in named.values())
    for name, m in main.items():
        full = "embedding.word_embeddings.weight" if name == "output_layer.weight" else name
        assert torch.equal(m.bfloat16(), named[name].detach()), name
        assert torch.equal(named[name].detach(), weights[full]), name
        if m.numel() > 64:
            assert (m != named[name].detach().float()).float().mean() > 0.5, name
        if name == "decoder.final_layernorm.weight":
            assert m not in opt.optimizer.state
            continue
        state = opt.optimizer.state[m]
        assert float(state["step"]) == 1 and (state["exp_avg"] != 0).any(), name
