"""Expert parallelism (ParallelConfig.expert_model_parallel_size): a mixture of experts whose experts
are split over the data-parallel ranks equals the same layout without it (2 processes, and 4 with
pipeline parallelism; gloo).

Rollouts and log-probs compare exactly: an expert computes each token routed to it alone (the
products are row-invariant on CPU), wherever the token came from. The replicas of these tests
take different numbers of forwards and micro-batches, which is what the EP group's lockstep and
stand-in micro-batches are for: without them a run deadlocks (the tests' timeout) or fails."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_fixtures import max_apart, tiny_policy_checkpoint
from specroll_mcore.checkpoint.megatron import load_full_state_dict
from test_grpo_layouts import launch, run, run_jobs
from test_train_heads_layouts import train

HERE = Path(__file__).parent
pytestmark = pytest.mark.dist


@pytest.mark.parametrize("pp", [1, pytest.param(2, marks=pytest.mark.slow)])  # (PP=2: 4 processes, ~30 s)
def test_rollouts_and_logprobs_at_ep2_equal_ep1(tmp_path, pp):
    """Each replica rolls out its own prompts (replica 1's responses twice as long: it runs forwards
    while replica 0 has finished), vanilla and SpecRoll, at T=1 with top-p and at T=0, in float32 and
    bfloat16, and computes log-probs over 3 and 2 micro-batches: tokens, log-probs, the recorded
    routing and the logits are those without expert parallelism, bit for bit. Each rank holds half
    the experts, and the experts gathered for a checkpoint are the full set. PP=2 (4 processes):
    each stage's EP group keeps its own lockstep (`make test-slow`)."""
    out = tmp_path / "res"
    env = dict(os.environ, PYTHONPATH=str(HERE.parent.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={2 * pp}",
           str(HERE / "expert_worker.py"), f"--out={out}", f"--pp={pp}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(2 * pp):
        res = torch.load(f"{out}.rank{rank}.pt", weights_only=False)
        last = rank >= 2 * (pp - 1)  # (ranks 0, 1: the first stage's two replicas)
        for dtype in ("float32", "bfloat16"):
            ref, got = res[(1, dtype)], res[(2, dtype)]
            assert (ref["local_experts"], got["local_experts"]) == (8, 4)
            # 2 linears x 8 experts x the stage's layers (4 in all)
            assert got["gathered_equal"] and got["gathered_experts"] == 2 * 8 * 4 // pp
            for name in ("vanilla-1.0", "vanilla-0.0", "spec-1.0", "spec-0.0"):
                assert got[name]["tokens"] == ref[name]["tokens"], (rank, dtype, name)
                assert all(torch.equal(a, b) for a, b in zip(got[name]["logprobs"], ref[name]["logprobs"]))
            assert all(torch.equal(a, b) for a, b in zip(got["vanilla-1.0"]["routing"], ref["vanilla-1.0"]["routing"]))
            assert len(got["logprobs"]) == (3 if rank % 2 == 0 else 2)
            assert dtype != "float32" or got["overhead_rows"] == ref["overhead_rows"] == [1, 2, 4]
            if last:  # (log-probs and logits are the last stage's)
                assert all(torch.equal(a, b) for a, b in zip(got["logprobs"], ref["logprobs"]))
                assert torch.equal(got["causal"], ref["causal"])
        lengths = [len(t) for t in res[(2, "float32")]["vanilla-1.0"]["tokens"]]
        assert lengths == ([10] * 6 if rank % 2 == 0 else [20] * 4)  # the replicas' forwards differ in number


def _prompts(tmp_path: Path) -> Path:
    long_question = "A farmer keeps a ledger of every animal on the farm. " * 12 + "How many hens are left?"
    rows = [{"question": q, "answer": f"#### {a}"} for q, a in
            [(long_question, 3), ("What is 2 + 2?", 4), ("What is 3 + 5?", 8), ("What is 9 - 4?", 5)]]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def test_grpo_steps_at_ep2_equal_ep1_and_resume(tmp_path):
    """Two GRPO steps with SpecRoll rollouts on a Qwen3-MoE at DP=2, with routing replay and a
    load-balancing loss, one sequence per micro-batch, and the long prompt's group dealt out by
    balance_batch: in the first step the replicas train 5 and 7 micro-batches, so one runs two
    stand-ins. At EP=2 the steps equal EP=1's: losses, gradient norms, load-balancing losses and
    weights (to 0.1 x lr, as in test_grpo_layouts.py: SpecRoll's float32 log-probs move by rounding with
    the trees' shapes, which each run's measured capacity sets), also with a sharded optimizer
    (ZeRO-1). Runs stopped after step 1 at EP=2 and resumed (each expert-parallel rank loading its
    experts' AdamW state, or each replica its shards) end with the same weights, and so do they resumed
    at EP=1, and EP=1's at EP=2."""
    ckpt = tiny_policy_checkpoint(tmp_path, with_heads=True, arch="qwen3_moe")
    common = (f"--set=data.source={_prompts(tmp_path)}", "--set=data.limit=8", "--set=prompts_per_step=4",
              "--set=routing_replay=true", "--set=moe_aux_loss_coeff=0.05", "--set=micro_batch_size=1",
              "--set=engine=specroll", "--set=steps=2", "--set=save_every=1", "--set=keep_last=2",
              "--set=spec.step_overhead=false")  # (its measurement at EP=2: test_rollouts_and_logprobs_at_ep2_...)
    ep2 = "--set=parallel.expert_model_parallel_size=2"
    sharded = ("--set=shard_optimizer=true",)
    ref, got, _ = run_jobs(ckpt, 2, (tmp_path / "ep1", 1, 1, *common), (tmp_path / "ep2", 1, 1, *common, ep2),
                           (tmp_path / "ep2_sharded", 1, 1, *common, ep2, *sharded))
    assert ref[0]["dp_sequences_moved"] > 0
    for a, b in zip(ref, got):
        for k in ("reward_mean", "response_len", "dp_sequences_moved"):
            assert a[k] == b[k], k
        for k in ("loss", "grad_norm", "moe_aux_loss", "entropy"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    ref_w = load_full_state_dict(tmp_path / "ep1")
    start = load_full_state_dict(ckpt)
    experts = [k for k in ref_w if ".local_experts." in k]
    assert len(experts) == 2 * 2 * 4 and all((ref_w[k] != start[k]).any() for k in experts)  # every expert moved
    w = load_full_state_dict(tmp_path / "ep2")  # the checkpoint holds every expert, as without EP
    assert max_apart(w, ref_w) < 1e-4
    assert (tmp_path / "ep2" / "iter_0000002" / "mp_rank_00" / "optim_ep1.pt").is_file()

    # and with AdamW's state sharded (ZeRO-1): the experts' over the replicas holding the same experts (here
    # one each), the rest over both replicas, each of which saves its part
    w = load_full_state_dict(tmp_path / "ep2_sharded")
    assert max_apart(w, ref_w) < 1e-4
    parts = torch.load(tmp_path / "ep2_sharded" / "iter_0000002" / "mp_rank_00" / "optim_dp1.pt",
                       weights_only=False)["optimizer"]
    assert parts["dense"]["zero_shard"] == [1, 2] and "zero_shard" not in parts["experts"]

    # each run as it stood after step 1, resumed in its own layout and in others: from EP=2 at EP=1 (an
    # expert-parallel rank's experts' AdamW states gathered by their global numbers) and from EP=1 at EP=2
    resumes = [("ep2", (ep2,)), ("ep2_sharded", (ep2, *sharded)), ("ep2", ()), ("ep2_sharded", sharded),
               ("ep1", (ep2, *sharded))]
    for i, (name, _) in enumerate(resumes):
        resumed = tmp_path / f"resumed{i}"
        shutil.copytree(tmp_path / name, resumed)
        shutil.rmtree(resumed / "iter_0000002")
        (resumed / "latest_checkpointed_iteration.txt").write_text("1")
    runs = run_jobs(ckpt, 2, *[(tmp_path / f"resumed{i}", 1, 1, *common, *extra, "--set=resume=true")
                               for i, (_, extra) in enumerate(resumes)])
    for i, ((name, extra), rows) in enumerate(zip(resumes, runs)):
        assert rows[-1]["step"] == 2 and rows[-1]["grad_norm"] == pytest.approx(got[1]["grad_norm"], rel=1e-4)
        w = load_full_state_dict(tmp_path / f"resumed{i}")
        assert max_apart(w, ref_w) < 1e-4, (name, extra)

    # an iteration saved before checkpoints recorded their layout resumes only in its own
    (tmp_path / "resumed0" / "iter_0000002" / "layout.json").unlink()
    proc = launch(ckpt, tmp_path / "resumed0", 1, 1, 2, *common, "--set=steps=3", "--set=resume=true")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "was saved with expert_model_parallel_size 2, this run has 1" in out, out[-4000:]


def test_train_heads_at_ep2_equals_ep1(tmp_path):
    """tools/train_heads.py on a Qwen3-MoE at DP=2 with --ep 2: the replicas sample the same records
    (in lockstep) and train the same heads as at EP=1, in float64 up to rounding (an expert takes both
    replicas' tokens in one product at EP=2, and float64 products depend on the rows in the call)."""
    src = tiny_policy_checkpoint(tmp_path / "fresh", with_heads=False, arch="qwen3_moe")
    ref, ref_heads = train(src, tmp_path, 2)
    got, heads = train(src, tmp_path, 2, "--ep", 2)
    assert got["layout"] == {"tp": 1, "pp": 1, "dp": 2, "ep": 2}
    for k in ("train_positions", "heldout_positions", "heldout_before", "heldout_after"):
        assert got[k] == ref[k], k
    assert set(heads) == set(ref_heads)
    assert max((heads[k] - v).abs().max().item() for k, v in ref_heads.items()) < 1e-9


@pytest.mark.slow
def test_grpo_step_at_pp2_ep2_equals_ep1(tmp_path):
    """PP=2 x DP=2 (4 processes), EP=2 against EP=1: a GRPO step with SpecRoll rollouts, routing replay,
    a load-balancing loss, activation recomputation and balance_batch, one sequence per micro-batch, so
    that each stage's EP group runs stand-ins through 1F1B (`make test-slow`; ~70 s on 2 cores)."""
    ckpt = tiny_policy_checkpoint(tmp_path, with_heads=True, num_layers=4, arch="qwen3_moe")
    common = (f"--set=data.source={_prompts(tmp_path)}", "--set=data.limit=8", "--set=prompts_per_step=4",
              "--set=routing_replay=true", "--set=moe_aux_loss_coeff=0.05", "--set=micro_batch_size=1",
              "--set=engine=specroll", "--set=recompute_activations=true")
    ref = run(ckpt, tmp_path / "ep1", 1, 2, 4, *common)
    got = run(ckpt, tmp_path / "ep2", 1, 2, 4, *common, "--set=parallel.expert_model_parallel_size=2")
    assert got[0]["dp_sequences_moved"] == ref[0]["dp_sequences_moved"] > 0
    for k in ("grad_norm", "moe_aux_loss", "entropy"):
        assert got[0][k] == pytest.approx(ref[0][k], rel=1e-4), k
    ref_w, w = load_full_state_dict(tmp_path / "ep1"), load_full_state_dict(tmp_path / "ep2")
    # 0.1 x lr (see test_grpo_steps_at_ep2_equal_ep1_and_resume)
    assert max_apart(w, ref_w) < 1e-4
