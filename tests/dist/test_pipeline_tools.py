"""tools/bench_pipeline_rollout.py end to end under torchrun at PP=2 (2 processes, gloo) on a tiny
checkpoint: every variant's tokens equal (the tool exits non-zero otherwise) and the JSON it promises."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_fixtures import tiny_policy_checkpoint

ROOT = Path(__file__).resolve().parent.parent.parent

pytestmark = pytest.mark.dist


def test_bench_pipeline_rollout_smoke(tmp_path):
    ckpt = tiny_policy_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "pp.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tools" / "bench_pipeline_rollout.py"), "--checkpoint", str(ckpt), "--pp", "2",
           "--last-stage-layers", "1", "--prompts", "2", "--samples", "3", "--max-new-tokens", "8", "--reps", "1",
           "--c-hw", "8", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["stage_layers"] == {"even": [1, 1], "last1": [1, 1]}
    for engine in ("vanilla", "specroll"):
        assert report["engines"][engine]["tokens_identical"]
        assert set(report["engines"][engine]["speedup_over_even_one_group_median"]) == {"even/interleaved",
                                                                                        "last1/interleaved"}


def test_bench_checkpoint_at_tp2_smoke(tmp_path):
    """Both ranks run the trainer; rank 0 compares every rank's shards of the two modes' checkpoints,
    reports, and removes what the runs wrote in --dir."""
    ckpt = tiny_policy_checkpoint(tmp_path / "ckpt")
    out, scratch = tmp_path / "c.json", tmp_path / "scratch"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tools" / "bench_checkpoint.py"), "--checkpoint", str(ckpt), "--steps", "2", "--reps", "2",
           "--set", "sampling.max_new_tokens=6", "--set", "parallel.tensor_model_parallel_size=2", "--dir",
           str(scratch), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["identical_checkpoints"] and report["checkpoint_bytes"] > 0 and report["world_size"] == 2
    assert len(report["paired_ratios"]) == 2 and all(len(report["runs"][m]) == 2 for m in ("at_once", "background"))
    assert report["median"]["background"]["run_s"] > 0
    assert scratch.is_dir() and not any(scratch.iterdir())


def test_bench_collectives_at_tp2_smoke(tmp_path):
    """Both engines' collectives at TP=2 by call site: the tokens equal (else the tool fails), drafting
    exchanges its top-ks once a step (head 1's, the Reflex's and the shortlists': one all-gather), and
    the top-p filter its window and log-sum-exp once."""
    out = tmp_path / "c.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tools" / "bench_collectives.py"), "--tp", "2", "--hidden", "64", "--vocab", "512",
           "--max-new-tokens", "12", "--top-p", "0.9", "--reps", "1", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["tp"] == 2 and set(report["engines"]) == {"vanilla", "specroll"}
    vanilla, spec = report["engines"]["vanilla"], report["engines"]["specroll"]
    assert vanilla["per_forward"] >= 2 * 4 and vanilla["by_kind"]["all_reduce"] > 0  # (2 a layer, 4 layers)
    drafting = sum(n for site, n in spec["by_site"].items() if "vocab_parallel_topks < rollout/speculative" in site)
    filtering = sum(n for site, n in spec["by_site"].items()
                    if "vocab_parallel_topks < heads.py" in site and "vocab_parallel_filter" in site)
    assert 0 < drafting <= spec["forwards"] and 0 < filtering <= spec["forwards"]


def test_specroll_generate_at_dp2_equals_one_process(tmp_path):
    """`specroll generate` under torchrun at DP=2 (the prompts dealt out to the replicas): every response
    of one process, and the printed statistics count every replica's tokens (they were the first
    replica's)."""
    ckpt = tiny_policy_checkpoint(tmp_path / "ckpt")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    common = [f"checkpoint={ckpt}", "engine=specroll", "spec.c_hw=8", "sampling.max_new_tokens=8",
              "sampling.num_samples=2", "prompts=['One?', 'Two?', 'Three?', 'Four?', 'Five?']"]
    runs = {}
    for name, launcher in [("one", []), ("dp2", ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"])]:
        args = [a for o in common + [f"output={tmp_path / name}.jsonl"] for a in ("--set", o)]
        proc = subprocess.run([sys.executable, *launcher, "-m", "specroll_mcore.cli", "generate", *args], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        stats = json.loads(proc.stdout.strip().splitlines()[-1])
        runs[name] = (stats, [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()])
    (one, one_rows), (dp2, dp2_rows) = runs["one"], runs["dp2"]
    assert [r["tokens"] for r in dp2_rows] == [r["tokens"] for r in one_rows] and len(one_rows) == 10
    assert dp2["tokens"] == one["tokens"] == sum(len(r["tokens"]) for r in one_rows)
    assert dp2["data_parallel_replicas"] == 2 and dp2["tau"] >= 1 and "tau_per_row" not in dp2


@pytest.mark.parametrize("layout", ["pp2", "dp2"])
def test_specroll_eval_under_torchrun_equals_one_process(tmp_path, layout):
    """`specroll eval` at PP=2 (stages in turn) and at DP=2 (the prompts split over the replicas),
    speculative engine, T=1 with two samples: the figures and every response of one process (at
    DP=2 over the 4 prompts an even split keeps)."""
    ckpt = tiny_policy_checkpoint(tmp_path / "ckpt")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    common = [f"checkpoint={ckpt}", "engine=specroll", "spec.c_hw=8", "reward_fn=rewards_for_tests:token_parity_reward",
              "data.limit=8", "eval.data.limit=5", "eval.batch_prompts=2", "eval.sampling.temperature=1.0",
              "eval.sampling.num_samples=2", "eval.sampling.max_new_tokens=8"]
    runs = {}
    for name, launcher, extra in [("one", [], []),
                                  (layout, ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"],
                                   ["parallel.pipeline_model_parallel_size=2"] if layout == "pp2" else [])]:
        args = [a for o in common + extra for a in ("--set", o)]
        cmd = [sys.executable, *launcher, "-m", "specroll_mcore.cli", "eval", *args,
               "--out", str(tmp_path / f"{name}.json"), "--responses", str(tmp_path / f"{name}.jsonl")]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        runs[name] = (json.loads((tmp_path / f"{name}.json").read_text()),
                      [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()])
    (one, one_rows), (got, got_rows) = runs["one"], runs[layout]
    # at DP=2 the fifth prompt is left over (an even split), so compare over the prompts both evaluated
    kept = {r["id"] for r in got_rows}
    assert len(kept) == (5 if layout == "pp2" else 4) and len(got_rows) == 2 * len(kept)
    assert got_rows == [r for r in one_rows if r["id"] in kept]
    if layout == "pp2":
        for k in ("eval_accuracy", "eval_reward_mean", "eval_response_len", "eval_prompts"):
            assert got[k] == one[k], k
        assert got["eval_tau"] >= 1  # (tree sizes follow each layout's own latency profile: speed only)
    else:
        assert got["skipped"] == {"left over from an even split over the data-parallel replicas": 1}


@pytest.mark.slow  # (~80 s on a fresh clone: `make test-slow`)
def test_multinode_launcher_runs_a_grpo_step(tmp_path):
    """examples/launch_multinode.sh as one node of 2 processes (gloo, DP=2): the launch line users copy."""
    import socket

    ckpt = tiny_policy_checkpoint(tmp_path / "ckpt", with_heads=False)
    config = tmp_path / "c.yaml"
    config.write_text(f"checkpoint: {ckpt}\noutput_dir: {tmp_path / 'run'}\nengine: vanilla\n"
                      "steps: 1\nprompts_per_step: 2\n"
                      "micro_batch_size: 4\ntensorboard: false\nsampling:\n  num_samples: 2\n  max_new_tokens: 8\n"
                      "data:\n  limit: 8\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", NNODES="1", NODE_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), GPUS_PER_NODE="2",
               PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run(["bash", str(ROOT / "examples" / "launch_multinode.sh"), str(config), "--set", "lr=1e-4"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    proc = subprocess.run(["bash", str(ROOT / "examples" / "launch_multinode.sh"), str(config)],
                          env={k: v for k, v in env.items() if k != "MASTER_ADDR"}, capture_output=True, text=True)
    assert proc.returncode != 0 and "MASTER_ADDR: set MASTER_ADDR" in proc.stderr


def test_bench_update_sequence_parallel_smoke(tmp_path):
    """tools/bench_update.py --compare-sequence-parallel at TP=2: the same gradient either way, with
    each form's time, rank 0's peak memory and what its backward keeps."""
    ckpt = tiny_policy_checkpoint(tmp_path / "ckpt", with_heads=False)
    out = tmp_path / "sp.json"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tools" / "bench_update.py"), "--checkpoint", str(ckpt), "--compare-sequence-parallel",
           "--prompts", "2", "--samples", "2", "--max-new-tokens", "6", "--reps", "1",
           "--set", "parallel.tensor_model_parallel_size=2", "--set", "reward_fn=rewards_for_tests:token_parity_reward",
           "--set", "sampling.ignore_eos=true", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    forms = report["sequence_parallel"]
    assert set(forms) == {"whole_sequence", "sequence_parallel"} and report["layout"]["tp"] == 2
    assert all(len(v["runs_s"]) == 1 and v["grad_norm"] > 0 and v["peak_memory_gib"] > 0 for v in forms.values())
    assert report["grad_norm_rel_diff"] < 1e-5
    # each rank keeps its half of the layers' activations for the backward
    assert 0 < forms["sequence_parallel"]["saved_for_backward_gib"] < forms["whole_sequence"]["saved_for_backward_gib"]


def test_bench_optimizer_smoke(tmp_path):
    """tools/bench_optimizer.py at DP=2 on a bfloat16 policy: the sharded optimizer keeps half the
    replicated state a rank (the two ranks' parts add up to one replicated rank's, to the byte), less
    than with the main copies whole (torch's ZeroRedundancyOptimizer over them); its gradients summed
    onto their owners leave each rank its own (the two ranks' add up to every gradient), summed onto
    every replica every rank all; every mode's weights equal the replicated optimizer's; one process
    is refused."""
    ckpt = tiny_policy_checkpoint(tmp_path / "ckpt", with_heads=False)
    out = tmp_path / "opt.json"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    tool = [str(ROOT / "tools" / "bench_optimizer.py"), "--checkpoint", str(ckpt), "--reps", "2", "--out", str(out)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *tool,
           "--zero-reference"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    modes = json.loads(out.read_text())["modes"]
    assert set(modes) == {"replicated", "sharded", "sharded_all_reduce", "zero_fp32_mains"}
    assert all(m["weights_equal_replicated"] and len(m["seconds"]) == 2 for m in modes.values())
    replicated, sharded, zero = (modes[k]["state_bytes_per_rank"] for k in ("replicated", "sharded", "zero_fp32_mains"))
    assert replicated[0] == replicated[1] == sum(sharded) and all(0 < s < z < r for s, z, r in zip(sharded, zero,
                                                                                                    replicated))
    assert modes["sharded_all_reduce"]["state_bytes_per_rank"] == sharded
    grads = {k: m["grad_bytes_per_rank"] for k, m in modes.items()}
    assert grads["replicated"] == grads["sharded_all_reduce"] == grads["zero_fp32_mains"]
    assert grads["replicated"][0] == sum(grads["sharded"]) and min(grads["sharded"]) > 0
    proc = subprocess.run([sys.executable, *tool], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "a sharded optimizer needs data-parallel replicas" in proc.stderr
    proc = subprocess.run([sys.executable, *tool, "--reps", "0"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--reps must be >= 1, got 0" in proc.stderr
