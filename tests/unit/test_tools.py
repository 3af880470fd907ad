"""The rollout benchmarks run end to end on a tiny checkpoint and write the JSON they promise
(tokens are checked against vanilla inside them; a mismatch exits non-zero)."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from conftest import import_tool
from grpo_fixtures import tiny_policy_checkpoint
from specroll_mcore.rollout.base import RolloutOutput

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    return tiny_policy_checkpoint(tmp_path_factory.mktemp("tools"))


def refused(capsys, name, *args):
    """(exit status, stderr) of a tool that refuses ``args``, run in this process, whose imports are
    loaded already (a new interpreter spends seconds on them)."""
    main = import_tool(name.removesuffix(".py")).main
    with mock.patch.object(sys, "argv", [name, *map(str, args)]), pytest.raises(SystemExit) as stop:
        main()
    code, err = stop.value.code, capsys.readouterr().err
    return (1, err + code) if isinstance(code, str) else (code, err)  # SystemExit(message): status 1


def run_tool(name, *args, **env_extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", **env_extra)
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / name), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_bench_specroll_smoke(tiny_ckpt, tmp_path):
    out = tmp_path / "results" / "b.json"  # (folders made for the outputs: a long run is not lost at its end)
    run_tool("bench_specroll.py", "--checkpoint", tiny_ckpt, "--prompts", 2, "--samples", 2, "--max-new-tokens", 8,
             "--batch1-prompts", 1, "--reps", 1, "--c-hw", 16, "--top-k", 50, "--min-p", 0.05, "--out", out,
             "--plot", tmp_path / "plots" / "b.png")
    assert (tmp_path / "plots" / "b.png").is_file()
    report = json.loads(out.read_text())
    assert report["spec"]["reflex"]["enabled"] and report["spec"]["slow_path"]["enabled"]
    assert (report["top_k"], report["min_p"]) == (50, 0.05)
    for scenario in ("batch1", "full"):  # the filters in both engines and in transformers' generate
        assert report[scenario]["identical_tokens"] and report[scenario]["specroll_over_hf_generate"] > 0, scenario


def test_lookup_headroom_counts_what_a_chain_would_add(tiny_ckpt, tmp_path, capsys):
    tool = import_tool("bench_lookup_headroom")
    context = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 6, 7]
    assert tool.lookup(context, 1, 3, 2) == [1, 2]  # "5 6 7" does not recur in full, "6 7" does: latest first
    assert tool.lookup(context, 3, 3, 2) == [] and tool.lookup(context, 1, 1, 5) == [1, 2, 6, 7]
    assert tool.lookup([3], 1, 2, 4) == []
    # prompt 1 2 3 | response 1 2 3 4 1 2 9, its steps emitting 2 (the heads' drafts: 1 accepted), 3, 2 tokens
    steps = tool.step_headroom([1, 2, 3], [1, 2, 3, 4, 1, 2, 9], [2, 3, 2], 1, 3, 3)
    assert steps == [{"length": 1, "accepted": 1, "chain": 3, "match": 2},  # "1" -> 2 3 1 against 2 3 4
                     {"length": 3, "accepted": 2, "chain": 3, "match": 0},  # "1 2 3" -> 1 2 3 against 4 1 2
                     {"length": 6, "accepted": 1, "chain": 3, "match": 0}]  # "1 2" -> 3 4 1 against 9
    row = tool.summarise(steps, [4, 4, 4], [3, 5, 8], None)
    assert row["tau_heads"] == 7 / 3 and row["tau_with_lookup"] == 8 / 3 and row["steps_gaining"] == 1 / 3
    assert tool.parse_settings("2-3:5,1:4") == [(2, 3, 5), (1, 1, 4)]
    for bad in ("3-2:5", "2-3", "0-1:3", "a-b:c", "1-2:0"):
        with pytest.raises(ValueError, match="--settings"):
            tool.parse_settings(bad)
    out = tmp_path / "new" / "h.json"
    run_tool("bench_lookup_headroom.py", "--checkpoint", tiny_ckpt, "--prompts", 2, "--max-new-tokens", 12,
             "--c-hw", 16, "--settings", "1-2:3", "--out", out)
    figures = json.loads(out.read_text())["settings"]["n=1-2,k=3"]
    assert figures["tau_with_lookup"] >= figures["tau_heads"] >= 1 and figures["steps"] > 0
    code, err = refused(capsys, "bench_lookup_headroom.py", "--settings", "2-3")
    assert code == 2 and "is not MIN-MAX:K" in err


@pytest.mark.parametrize("batch, prompts, dp, message", [
    (7, 320, 2, "--batch 7 is not divisible by the 2 data-parallel replicas (world size / (tp x pp)); pass a "
                "multiple of 2"),
    (8, 1, 2, "--prompts 1 (4 more held out) cannot give each of the 2 data-parallel replicas a training and a "
              "held-out prompt: pass --prompts >= 2"),
    (16, 40, 8, "--prompts 40 (4 more held out) cannot give each of the 8 data-parallel replicas a training and a "
                "held-out prompt: pass --prompts >= 80"),
])
def test_train_heads_checks_the_data_parallel_split(batch, prompts, dp, message):
    check = import_tool("train_heads").check_data_parallel_split
    with pytest.raises(SystemExit, match=re.escape(message)):
        check(batch, prompts, dp)
    check(batch * dp, 10 * dp, dp)  # what the message asks for passes (the --prompts it names, here 10 x DP)
    check(16, 2, 2)  # (at DP <= 4 the 4 held-out prompts suffice)


def test_bench_sampling_smoke(tiny_ckpt, tmp_path, capsys):
    from specroll_mcore import sampling

    if sampling.noise_kernel() is None:
        pytest.skip("the noise kernel is not built on this machine")
    out = tmp_path / "s.json"
    run_tool("bench_sampling.py", "--checkpoint", tiny_ckpt, "--rows", "1,3", "--shapes", "1x2", "--max-new-tokens", 6,
             "--reps", 1, "--top-p", 0.9, "--out", out, SPECROLL_CACHE=str(tmp_path / "cache"))
    report = json.loads(out.read_text())
    assert set(report["sample_ms"]) == {"1", "3"} and report["sample_ms"]["1"]["identical"]
    for part in ("rollouts", "nucleus_rollouts"):  # the noise kernel, then top-p's window, on and off
        assert all(r["identical"] for r in report[part].values()) and len(report[part]) == 2, part
    code, err = refused(capsys, "bench_sampling.py", "--top-p", 0)
    assert code != 0 and "--top-p must be in (0, 1], got 0.0" in err


def test_plot_metrics_plots_a_run_and_names_what_a_file_lacks(tmp_path):
    run_tool("plot_metrics.py", ROOT / "docs" / "results" / "grpo_smollm2_30steps.jsonl", "--out", tmp_path / "m.png")
    assert (tmp_path / "m.png").stat().st_size > 0
    bad = tmp_path / "bad.jsonl"
    for text, message in [('{"step": 1, "reward_mean": 0.1}\n', "line 1: lacks ['accuracy', 'generation_s', "
                                                                  "'training_s']; is this the metrics.jsonl"),
                          ("{not json\n", "line 1: not JSON"), ("\n", "has no rows")]:
        bad.write_text(text)
        proc = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_metrics.py"), str(bad), "--out",
                               str(tmp_path / "x.png")], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_metrics.py"), str(tmp_path / "none.jsonl")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_bench_specroll_against_the_one_row_curve(tiny_ckpt, tmp_path, capsys, monkeypatch):
    """--one-row-curve adds SpecRoll sized by the profile's one-row curve to every scenario; it needs
    a cached profile, which a configured C_hw does not measure; so does --forward-only (SpecRoll
    pricing the forward alone, which tools/gpu_checks.sh's dry run runs)."""
    out = tmp_path / "b.json"
    cache = str(tmp_path / "cache")
    args = ["--checkpoint", tiny_ckpt, "--prompts", 2, "--samples", 2, "--max-new-tokens", 8, "--batch1-prompts", 1,
            "--reps", 1, "--skip-hf", "--one-row-curve", "--out", out, "--plot", ""]
    run_tool("bench_specroll.py", *args, SPECROLL_CACHE=cache)
    report = json.loads(out.read_text())
    assert report["latency"]["model"] == "LatencySurface"
    for scenario in ("batch1", "full"):
        third = report[scenario]["one_row_curve"]
        assert third["identical_tokens"] and len(third["specroll_s"]) == 1 and third["speedup_median"] > 0
    monkeypatch.setenv("SPECROLL_CACHE", str(tmp_path / "empty"))  # (the refusals: in this process)
    code, err = refused(capsys, "bench_specroll.py", *args, "--c-hw", "16")
    assert code == 1 and "--one-row-curve needs a cached capacity profile" in err
    args[args.index("--one-row-curve")] = "--forward-only"
    code, err = refused(capsys, "bench_specroll.py", *args, "--c-hw", "16")
    assert code == 1 and "--forward-only compares against the step overhead, which needs a latency profile" in err


def test_bench_drift_smoke(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "d.json"
    run_tool("bench_drift.py", "--checkpoint", tiny_ckpt, "--drift-steps", 2, "--measure-every", 2, "--batches", 1,
             "--prompts-per-batch", 1, "--max-new-tokens", 8, "--c-hw", 16, "--sft-batch", 2, "--adapt-every", 1,
             "--no-adaptive-nodes", "--seed", 1, "--out", out, "--plot", tmp_path / "d.png")
    report = json.loads(out.read_text())
    assert report["args"]["adaptive_nodes"] is False and report["args"]["seed"] == 1
    assert [c["drift_step"] for c in report["checkpoints"]] == [0, 2]
    assert set(report["summary"]) == {"static", "reflex", "slow", "both"}
    # a rollout between the checkpoints, for the variants whose slow path keeps what it sees
    assert [a["drift_step"] for a in report["adaptation"]] == [1]
    assert set(report["adaptation"][0]["events"]) == {"slow", "both"}
    assert (tmp_path / "d.png").is_file()
    code, err = refused(capsys, "bench_drift.py", "--adapt-every", "-1")
    assert code == 2 and "--adapt-every must be >= 0" in err
    code, err = refused(capsys, "bench_drift.py", "--tolerance", "1.5")
    assert code == 2 and "SlowPathConfig.tolerance must be in (0, 1)" in err
    code, err = refused(capsys, "bench_drift.py", "--seed", "-1")
    assert code == 2 and "--seed must be >= 0" in err


def test_acceptance_ceiling_smoke(tiny_ckpt, tmp_path):
    out = tmp_path / "c.json"
    run_tool("acceptance_ceiling.py", "--checkpoint", tiny_ckpt, "--prompts", 2, "--max-new-tokens", 8,
             "--budgets", "2,4", "--latency-reps", 1, "--out", out)
    report = json.loads(out.read_text())
    assert [b["nodes"] for b in report["budgets"]] == [2, 4]
    for b in report["budgets"]:
        assert 1.0 <= b["oracle_tau"] <= 1 + report["depth"] and 1.0 <= b["heads_tau"] <= 1 + report["depth"]
        assert len(b["oracle_tree"]) <= b["nodes"] - 1  # fewer only if the responses hold fewer rank prefixes
    cover = list(report["rank_coverage"].values())
    assert cover == sorted(cover) and 0 <= cover[0] and cover[-1] <= 1


def test_acceptance_ceiling_needs_two_prompts(tiny_ckpt, capsys):
    code, err = refused(capsys, "acceptance_ceiling.py", "--checkpoint", tiny_ckpt, "--prompts", "1")
    assert code == 2 and "--prompts >= 2" in err


def test_profile_capacity_smoke(tiny_ckpt, tmp_path):
    out = tmp_path / "new" / "p.json"
    run_tool("profile_capacity.py", "--checkpoint", tiny_ckpt, "--tokens", "1,2,4", "--reps", 1, "--out", out,
             SPECROLL_CACHE=str(tmp_path / "cache"))
    record = json.loads(out.read_text())
    assert record["c_hw"] in (1, 2, 4) and record["curve"]["tokens"] == [1, 2, 4]
    assert len(record["architecture"]) == 16 and (record["tp"], record["pp"], record["ep"]) == (1, 1, 1)
    cached = json.loads((tmp_path / "cache" / "capacity_profiles.json").read_text())
    assert [r["c_hw"] for r in cached.values()] == [record["c_hw"]]


def test_profile_capacity_refuses_a_split_without_a_pipeline(capsys):
    code, err = refused(capsys, "profile_capacity.py", "--last-stage-layers", "2")
    assert code == 2 and "num_layers_in_last_pipeline_stage is set (2) but pipeline_model_parallel_size is 1" in err


def test_bench_cpu_gemm_smoke_and_nothing_to_compare(tiny_ckpt, tmp_path):
    out = tmp_path / "g.json"
    run_tool("bench_cpu_gemm.py", "--checkpoint", tiny_ckpt, "--rows", "1,5", "--reps", 1, "--out", out)
    report = json.loads(out.read_text())
    kernels = {"blas", "onednn"} | ({"panels"} if report["panels"] else set())
    for section in ("layers_ms", "vocab_ms"):
        assert set(report[section]) == {"1", "5"} and set(report[section]["5"]) == kernels
    assert set(report["forward_ms"]["1"]) == {"blas", "onednn", "panels"}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_cpu_gemm.py"), "--checkpoint", tiny_ckpt],
                          env=dict(os.environ, SPECROLL_PACKED_GEMM="0"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "nothing to compare" in proc.stderr


def test_bench_step_attention_smoke_and_its_errors(tiny_ckpt, tmp_path, capsys):
    from specroll_mcore.model.attention import step_attention_kernels

    code, err = refused(capsys, "bench_step_attention.py", "--checkpoint", tiny_ckpt, "--shapes", "4x")
    assert code != 0 and "--shapes must be ROWSxNODES" in err
    tool = [sys.executable, str(ROOT / "tools" / "bench_step_attention.py"), "--checkpoint", str(tiny_ckpt)]
    off = subprocess.run(tool, env=dict(os.environ, SPECROLL_STEP_ATTENTION="0"), capture_output=True, text=True,
                         timeout=300)
    assert off.returncode == 2 and "nothing to compare" in off.stderr
    if step_attention_kernels() is None:
        pytest.skip("no step-attention kernel on this machine")
    out = tmp_path / "s.json"
    run_tool("bench_step_attention.py", "--checkpoint", tiny_ckpt, "--shapes", "1x1,2x3", "--context", 20, "--reps", 1,
             "--out", out)
    report = json.loads(out.read_text())
    assert set(report["shapes"]) == {"1x1", "2x3"}
    assert all(r["step_kernel"] > 0 and r["ordered_attention"] > 0 for r in report["shapes"].values())


def test_bench_step_phases_smoke_and_bad_input(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "p.json"
    run_tool("bench_step_phases.py", "--checkpoint", tiny_ckpt, "--prompts", 2, "--samples", 2, "--max-new-tokens", 8,
             "--steps", 3, "--reps", 1, "--dtype", "bfloat16", "--out", out)
    report = json.loads(out.read_text())
    assert report["dtype"] == "bfloat16"
    assert set(report["phases"]) == {"propose", "accept", "feedback"}
    assert all(p["ms_per_step"] > 0 and p["steps"] == 3 and p["rows_per_step"] >= 1 for p in report["phases"].values())
    assert all(p["ops_per_step"] > 0 for p in report["phases"].values()) and report["total_syncs_per_step"] >= 0
    rollouts = report["rollouts"]  # whole rollouts of both engines, the same tokens
    assert rollouts["tokens_identical"] and rollouts["tokens"] > 0
    assert rollouts["launch_bound_speedup"] == pytest.approx(
        rollouts["vanilla"]["ops_per_token"] / rollouts["specroll"]["ops_per_token"])
    code, err = refused(capsys, "bench_step_phases.py", "--n-max", "0")
    assert code != 0 and "--n-max must be >= 1, got 0" in err


def test_step_phases_op_counter():
    """The counter behind bench_step_phases' operation and sync counts, on operations counted by hand."""
    OpCounter = import_tool("bench_step_phases").OpCounter
    x = torch.ones(4)
    counter = OpCounter()
    with counter, torch.inference_mode():
        y = (x + 1) * 2  # 2 operations
        y.view(2, 2).unsqueeze(0)  # views: no operation
        int(y.sum())  # sum + a scalar read (sync)
        bool(y.any())  # any + a scalar read (sync)
        y.tolist()  # a sync (and two metadata checks, no operation)
        (y > 3).nonzero()  # gt + nonzero (sync)
        y[y > 5]  # gt + index by a boolean mask (sync)
    assert "tolist" not in torch.Tensor.__dict__  # torch's own method again
    counts = counter.per_step(2)
    assert counts["ops_per_step"] == 10 / 2 and counts["syncs_per_step"] == 5 / 2 and counts["views_per_step"] == 4 / 2
    assert counts["ops_by_name_per_step"]["sum"] == 0.5
    outer, inner = OpCounter(), OpCounter()  # nested counters: the outer one counts the inner one's too
    with outer:
        x + 1
        with inner:
            (x * 2).tolist()
    assert "tolist" not in torch.Tensor.__dict__
    assert (sum(outer.ops.values()), outer.tolist, sum(inner.ops.values()), inner.tolist) == (2, 1, 1, 1)


def test_bench_forward_path_refuses_bad_shapes(capsys):
    code, err = refused(capsys, "bench_forward_path.py", "--shapes", "1by1")
    assert code != 0 and "--shapes must look like 1x1,64x16 (rows x tokens), got '1by1'" in err
    code, err = refused(capsys, "bench_forward_path.py", "--shapes", "1x0")
    assert code != 0 and "--reps and every shape's rows and tokens must be >= 1" in err


@pytest.mark.slow  # (~80 s: eleven tool processes; each tool's own smoke test is in the default suite)
def test_gpu_checks_script_dry_run(tiny_ckpt, tmp_path, capsys):
    """tools/gpu_checks.sh with QUICK=1 runs every stage (on the CPU here; tests/gpu only collected, the
    default suite runs them) and leaves their results; on the tiny checkpoint the transformers
    baseline is its own export, not SmolLM2."""
    out = tmp_path / "gpu"
    env = dict(os.environ, OMP_NUM_THREADS="1", QUICK="1", CKPT=str(tiny_ckpt), PY=sys.executable,
               SPECROLL_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run(["bash", str(ROOT / "tools" / "gpu_checks.sh"), str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    log = (out / "gpu_checks.log").read_text()
    for stage in ("tests", "fuzz", "fuzz_f32", "profile", "bench_full", "bench_full_bf16", "bench_batch1",
                  "bench_batch1_t0", "step_phases", "step_phases_walk", "grpo", "forward_path", "update_attention",
                  "prefill"):
        assert f"== {stage} rc=0" in log, log[-3000:]
    assert set(json.loads((out / "bench_update_attention.json").read_text())["attention"]) == {"causal",
                                                                                                "explicit_mask"}
    assert re.search(r"\d+ tests collected", log), log[:3000]  # tests/gpu, collected only
    fuzz = json.loads((out / "fuzz_exactness.json").read_text())
    assert fuzz["cases"] == 2 and fuzz["failures"] == fuzz["errors"] == []
    fuzz = json.loads((out / "fuzz_exactness_f32.json").read_text())
    assert fuzz["cases"] == 2 and fuzz["dtype"] == "float32" and fuzz["over_bound"] == []
    assert json.loads((out / "step_phases_b1.json").read_text())["total_ops_per_step"] > 0
    walk = json.loads((out / "step_phases_b1_walk.json").read_text())["phases"]["accept"]
    assert walk["syncs_per_step"] > 0  # (the CPU's default walk here too; on a GPU the default samples at once)
    assert set(json.loads((out / "bench_prefill.json").read_text())["ways"]) == {"whole", "pieces_16"}
    assert set(json.loads((out / "forward_path.json").read_text())["shapes"]) == {"1x1", "2x4"}
    full = json.loads((out / "bench_specroll_full.json").read_text())["full"]
    assert full["identical_tokens"] and full["specroll_over_hf_generate"] > 0
    assert full["forward_only"]["identical_tokens"]
    assert json.loads((out / "bench_specroll_b1.json").read_text())["batch1"]["identical_tokens"]
    bf16 = json.loads((out / "bench_specroll_full_bf16.json").read_text())
    assert bf16["dtype"] == "bfloat16" and bf16["full"]["responses"] == 4
    grpo = [json.loads(line) for line in (out / "grpo_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in grpo] == [0, 1, 2]  # the demo config's held-out evaluation first, then 2 steps
    assert "eval_accuracy" in grpo[0] and "eval_accuracy" in grpo[-1] and grpo[-1]["rollouts_identical"]


def test_bench_rollout_smoke(tmp_path):
    out = tmp_path / "r.json"
    run_tool("bench_rollout.py", "--model", "tiny", "--batches", "1,2", "--new-tokens", 4, "--reps", 1,
             "--latency-tokens", "1,2", "--latency-reps", 1, "--out", out)
    report = json.loads(out.read_text())
    assert report["forward_latency"]["tokens"] == [1, 2]
    assert [r["batch"] for r in report["throughput"]] == [1, 2]
    assert all(r["speed_ratio_ours_over_hf"] > 0 for r in report["throughput"])


def test_bench_checkpoint_bad_arguments_and_work_directory(tmp_path, capsys, monkeypatch):
    """(Its runs: tests/dist/test_pipeline_tools.py, under torchrun.) In one process the runs go into a
    fresh directory in --dir or the system's temporary one; under torchrun into one named by the
    launch, the same on every rank."""
    code, err = refused(capsys, "bench_checkpoint.py", "--steps", "1")
    assert code != 0 and "--steps must be >= 2 (the last step's checkpoint is written at once)" in err
    tool = import_tool("bench_checkpoint")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    one, two = tool.work_root(str(tmp_path)), tool.work_root(str(tmp_path))
    assert one.parent == two.parent == tmp_path and one != two and one.is_dir()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert tool.work_root(str(tmp_path)) == tool.work_root(str(tmp_path)) == tmp_path / "bench_checkpoint.abc.29500"
    monkeypatch.chdir(tmp_path / "bench_checkpoint.abc.29500")
    assert tool.work_root(None) == tmp_path / "bench_checkpoint.abc.29500" / "bench_checkpoint.abc.29500"


def test_bench_max_num_seqs_smoke_and_bad_arguments(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "w.json"
    run_tool("bench_max_num_seqs.py", "--checkpoint", tiny_ckpt, "--prompts", 3, "--samples", 2, "--max-new-tokens", 8,
             "--max-num-seqs", 3, "--reps", 3, "--out", out)
    report = json.loads(out.read_text())
    assert report["static_batches"] == 3  # one prompt's two responses a batch
    for name in ("vanilla", "specroll"):
        row = report["engines"][name]
        assert row["identical"] and all(len(row[f"{k}_s"]) == 3 for k in ("together", "continuous", "static"))
        assert 0 < row["kv_cache_mib"]["continuous"] < row["kv_cache_mib"]["together"]
        assert row["kv_cache_mib"]["static"] < row["kv_cache_mib"]["continuous"]  # (2 rows against 3)
        assert max(row["responses_per_step"]["continuous"]) <= 3 and row["speedup_continuous_over_static"] > 0
    code, err = refused(capsys, "bench_max_num_seqs.py", "--prompts", 2, "--samples", 4, "--max-num-seqs", 8)
    assert code != 0 and "fewer than the 8 responses (else all are in flight at once" in err
    code, err = refused(capsys, "bench_max_num_seqs.py", "--samples", 4, "--max-num-seqs", 3)
    assert code != 0 and "--max-num-seqs must hold one prompt's 4 samples" in err


def test_bench_prefill_smoke_and_bad_arguments(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "p.json"
    run_tool("bench_prefill.py", "--checkpoint", tiny_ckpt, "--prompts", 2, "--prompt-tokens", 40, "--pieces", "8,16",
             "--reps", 2, "--out", out)
    report = json.loads(out.read_text())
    ways = report["ways"]
    assert [(w["max_prefill_tokens"], w["forwards"]) for w in ways.values()] == [(80, 1), (8, 10), (16, 6)]
    assert all(len(w["times_s"]) == 2 and w["peak_mib_beyond_kv"] > 0 for w in ways.values())
    assert ways["whole"]["logits_max_diff"] == 0 and max(w["logits_max_diff"] for w in ways.values()) < 1e-4
    assert ways["pieces_8"]["peak_mib_beyond_kv"] < ways["whole"]["peak_mib_beyond_kv"]
    for args, message in ((("--pieces", "8,x"), "--pieces takes comma-separated numbers of tokens"),
                          (("--prompt-tokens", 40, "--pieces", 40),
                           "every --pieces value must be in [1, --prompt-tokens)"),
                          (("--reps", 0), "--prompts, --prompt-tokens and --reps must be >= 1"),
                          (("--checkpoint", tiny_ckpt, "--prompt-tokens", 5000), "is over the model's 512 positions")):
        code, err = refused(capsys, "bench_prefill.py", *args)
        assert code != 0 and message in err, err


def test_bench_update_smoke_and_bad_arguments(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "u.json"
    run_tool("bench_update.py", "--checkpoint", tiny_ckpt, "--prompts", 2, "--samples", 3, "--max-new-tokens", 6,
             "--micro-batch-size", 2, "--reps", 1, "--set", "reward_fn=rewards_for_tests:token_parity_reward",
             "--out", out, PYTHONPATH=str(ROOT / "tests"))
    report = json.loads(out.read_text())
    variants = report["variants"]
    assert set(variants) == {"rollout_order", "sorted", "token_budget"} and report["responses"] == 6
    assert len({v["tokens"] for v in variants.values()}) == 1  # the same sequences, split three ways
    assert variants["rollout_order"]["rows"] == [2, 2, 2]
    assert variants["sorted"]["token_positions"] <= variants["rollout_order"]["token_positions"]
    assert report["grad_norm_rel_diff"] < 1e-4 and variants["sorted"]["grad_norm"] > 0
    code, err = refused(capsys, "bench_update.py", "--reps", "0")
    assert code != 0 and "--micro-batch-size, --reps and --replicas must be >= 1" in err
    code, err = refused(capsys, "bench_update.py", "--replicas", "3", "--prompts", "2")
    assert code != 0 and "--replicas 3 exceeds --prompts 2: every replica rolls out whole groups" in err
    code, err = refused(capsys, "bench_update.py", "--compare-attention", "--replicas", "2")
    assert code != 0 and "time one update, not replicas' shares: leave --replicas at 1" in err
    code, err = refused(capsys, "bench_update.py", "--compare-attention", "--compare-logprob-chunk", "4")
    assert code != 0 and "--compare-entropy-bonus and --compare-sequence-parallel: one comparison a run" in err
    code, err = refused(capsys, "bench_update.py", "--compare-sequence-parallel")
    assert code != 0 and "launch with torchrun and --set parallel.tensor_model_parallel_size=N (N > 1)" in err
    code, err = refused(capsys, "bench_update.py", "--compare-logprob-chunk", "-2")
    assert code != 0 and "--compare-logprob-chunk must be >= 1 positions, got -2" in err
    code, err = refused(capsys, "bench_update.py", "--compare-entropy-bonus", "-0.1")
    assert code != 0 and "--compare-entropy-bonus must be a coefficient > 0, got -0.1" in err


@pytest.mark.parametrize("compare, key, names", [
    (["--compare-attention"], "attention", {"causal", "explicit_mask"}),
    (["--compare-logprob-chunk", "4"], "logprob_chunk", {"whole_span", "chunk_4"}),
    (["--compare-entropy-bonus", "0.5"], "entropy_bonus", {"no_bonus", "entropy_coeff_0.5"}),
])
def test_bench_update_comparisons_smoke(tiny_ckpt, tmp_path, compare, key, names):
    out = tmp_path / "a.json"
    run_tool("bench_update.py", "--checkpoint", tiny_ckpt, "--prompts", 2, "--samples", 2, "--max-new-tokens", 6,
             "--reps", 1, *compare, "--set", "reward_fn=rewards_for_tests:token_parity_reward",
             "--set", "sampling.ignore_eos=true", "--out", out, PYTHONPATH=str(ROOT / "tests"))
    report = json.loads(out.read_text())
    forms = report[key]
    assert set(forms) == names and report["response_tokens"] == 4 * 6
    assert all(len(v["runs_s"]) == 1 and v["grad_norm"] > 0 and v["peak_memory_gib"] > 0
               and v["saved_for_backward_gib"] > 0 for v in forms.values())
    if key == "entropy_bonus":  # the bonus changes the gradient
        assert "grad_norm_rel_diff" not in report and len({v["grad_norm"] for v in forms.values()}) == 2
    else:
        assert report["grad_norm_rel_diff"] < 1e-5  # the same update either way


def test_bench_update_replicas_smoke(tiny_ckpt, tmp_path):
    out = tmp_path / "r.json"
    run_tool("bench_update.py", "--checkpoint", tiny_ckpt, "--prompts", 3, "--samples", 2, "--max-new-tokens", 6,
             "--micro-batch-size", 2, "--reps", 1, "--replicas", 2, "--set",
             "reward_fn=rewards_for_tests:token_parity_reward", "--out", out, PYTHONPATH=str(ROOT / "tests"))
    report = json.loads(out.read_text())
    rolled, balanced = report["deals"]["as_rolled_out"], report["deals"]["balanced"]
    assert rolled["sequences"] == [4, 2] and sum(balanced["sequences"]) == 6  # prompts 0, 2 | 1
    assert sum(rolled["tokens"]) == sum(balanced["tokens"]) and balanced["max_over_mean"] <= rolled["max_over_mean"]
    assert len(rolled["replica_runs_s"]) == 1
    assert len(rolled["replica_runs_s"][0]) == len(rolled["token_positions"]) == 2


def test_train_heads_smoke_and_bad_checkpoint(tmp_path, capsys):
    ckpt = tiny_policy_checkpoint(tmp_path / "fresh", with_heads=False)
    out, cache = tmp_path / "h.json", tmp_path / "cache" / "records.pt"  # (its folder made)
    args = ["--checkpoint", ckpt, "--prompts", 4, "--samples", 1, "--max-new-tokens", 8, "--steps", 10, "--batch", 8,
            "--save-every", 4, "--records-cache", cache, "--out", out, "--max-num-seqs", 3]
    run_tool("train_heads.py", *args)
    summary = json.loads(out.read_text())
    assert summary["train_positions"] > 0 and summary["heldout_positions"] > 0
    assert set(summary["heldout_after"]) == set(summary["heldout_before"])
    from specroll_mcore.checkpoint.megatron import load_heads, read_checkpoint_config

    heads, meta = load_heads(ckpt)  # tied to this policy
    assert meta["steps"] == 10 and meta["fitted_on"] == read_checkpoint_config(ckpt)["policy_fingerprint"]
    assert {f"heads.root_layers.{i}.weight" for i in range(3)} <= set(heads)
    assert any(v.abs().sum() > 0 for k, v in heads.items() if "root_layers" in k)  # U trained too
    assert {"heads.path_layers.1.0.weight", "heads.path_layers.2.1.weight"} <= set(heads)
    assert all(v.abs().sum() > 0 for k, v in heads.items() if "path_layers" in k)  # and every V
    counts = heads["heads.token_counts"]  # every training position's token, counted
    assert counts.dtype == torch.long and int(counts.sum()) == summary["train_positions"]
    run_tool("train_heads.py", *args)  # the same records, read back from the cache
    assert json.loads(out.read_text())["train_positions"] == summary["train_positions"]
    cache.write_bytes(b"not records")
    code, err = refused(capsys, "train_heads.py", *args)
    assert code == 1 and "is not a records file of this version" in err
    with pytest.raises(FileNotFoundError, match="is not a specroll Megatron checkpoint"):
        refused(capsys, "train_heads.py", "--checkpoint", tmp_path / "nope")
    code, err = refused(capsys, "train_heads.py", "--target-topk", "0")
    assert code == 2 and "--target-topk must be >= 1" in err
    code, err = refused(capsys, "train_heads.py", "--steps", "1")
    assert code == 2 and "--steps must be >= 2" in err
    code, err = refused(capsys, "train_heads.py", "--num-heads", "0")
    assert code == 2 and "--num-heads must be >= 1, got 0" in err
    code, err = refused(capsys, "train_heads.py", "--max-num-seqs", "0")
    assert code == 2 and "--max-num-seqs must be a positive number of continuations, got 0" in err


def test_train_heads_learns_on_a_runs_data(tiny_ckpt, tmp_path, capsys):
    """--config / --set: the heads' prompts are those of a GRPO run's data section, rendered as the run
    renders them (a dataset's usable rows, shuffled by the seed); too few of them is refused before
    any sampling. Without them, the embedded problems as the rollout benchmarks pose them."""
    import transformers

    from grpo_fixtures import _smollm2_tokenizer_files
    from specroll_mcore.config import DataConfig
    from specroll_mcore.rl.data import chat_prompt_ids, load_examples, render_prompt
    from specroll_mcore.rl.synthetic import problems

    train_heads = import_tool("train_heads")
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}? End with a line 'Answer: $Answer'."}],
             "reward_model": {"ground_truth": str(2 * i)}} for i in range(6)]
    data = tmp_path / "dapo.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows + rows[:1]))  # (a repeated row: used once)
    tok = transformers.AutoTokenizer.from_pretrained(_smollm2_tokenizer_files())
    cfg = DataConfig(source=str(data))
    rendered = {tuple(render_prompt(tok, e, cfg)) for e in load_examples(str(data))[0]}
    picked = train_heads.distill_prompts(tok, cfg, 5, 0, 512)
    assert len({tuple(p) for p in picked}) == 5 and {tuple(p) for p in picked} <= rendered
    again, reseeded = (train_heads.distill_prompts(tok, cfg, 5, seed, 512) for seed in (0, 1))
    assert picked == again != reseeded
    with pytest.raises(SystemExit, match=r"--prompts asks for 7 prompts with the held-out ones, but data.source "
                                         r"'.*dapo.jsonl' gives 6 usable ones \(skipped: \{'duplicate row': 1\}\)"):
        train_heads.distill_prompts(tok, cfg, 7, 0, 512)
    default = train_heads.distill_prompts(tok, DataConfig(instruction=""), 6, 0, 512)
    assert default == [chat_prompt_ids(tok, p.question) for p in problems(6, seed=10_000)]

    out, ckpt = tmp_path / "h.json", shutil.copytree(tiny_ckpt, tmp_path / "ckpt")  # (heads.pt is written beside it)
    run_tool("train_heads.py", "--checkpoint", ckpt, "--set", f"data.source={data}", "--prompts", 2,
             "--samples", 1, "--max-new-tokens", 4, "--steps", 2, "--batch", 4, "--out", out)
    summary = json.loads(out.read_text())
    assert summary["data"] == str(data) and summary["train_positions"] > 0
    code, err = refused(capsys, "train_heads.py", "--set", "data.limit=0")
    assert code == 2 and "--config / --set: DataConfig.limit must be >= 1" in err


def test_bench_moe_experts_smoke_and_a_dense_checkpoint(tiny_ckpt, tmp_path):
    out = tmp_path / "m.json"
    run_tool("bench_moe_experts.py", "--layers", 1, "--hidden", 64, "--experts", 8, "--topk", 2, "--expert-ffn", 16,
             "--rows", "1,3", "--max-new-tokens", 4, "--reps", 2, "--out", out)
    report = json.loads(out.read_text())
    assert set(report["rows"]) == {"1", "3"} and all(r["identical"] for r in report["rows"].values())
    assert all(len(r["times_ms"]["routed"]) == len(r["times_ms"]["all"]) == 2 for r in report["rows"].values())
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_moe_experts.py"), "--checkpoint",
                           str(tiny_ckpt)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "holds a dense model: there are no experts to compare" in proc.stderr


def test_bench_convert_smoke(tmp_path):
    out = tmp_path / "c.json"
    run_tool("bench_convert.py", "--synthetic-layers", 2, "--synthetic-hidden", 64, "--synthetic-ffn", 128,
             "--synthetic-vocab", 256, "--tp", 2, "--max-shard-mb", 1, "--out", out)
    report = json.loads(out.read_text())
    assert set(report) == {"smollm2", "synthetic_tp1", "synthetic_tp2", "export_tp2", "export_pp2"}
    assert all(r["seconds"] > 0 and r["peak_rss_mb"] > 0 and r["peak_anon_mb"] > 0 for r in report.values())
    assert report["export_pp2"]["files"] == ["model.safetensors"]


def test_ablate_reflex_smoke_and_bad_input(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "a.json"
    run_tool("ablate_reflex.py", "--checkpoint", tiny_ckpt, "--prompts", 2, "--max-new-tokens", 8, "--alphas", "0.1",
             "--c-hw", 16, "--drift-steps", 1, "--sft-batch", 2, "--out", out)
    report = json.loads(out.read_text())
    assert len(report["sft_heldout_nll"]) == 2  # the policy was moved first
    assert list(report["variants"]) == ["off", "configured", "z_delta=0", "no gate, alpha=0.1"]
    assert report["variants"]["off"]["gate_open"] == 0.0
    assert all(1.0 <= v["tau"] <= 4.0 for v in report["variants"].values())
    code, err = refused(capsys, "ablate_reflex.py", "--prompts", "0")
    assert code == 2 and "--prompts and --max-new-tokens must be >= 1" in err
    code, err = refused(capsys, "ablate_reflex.py", "--drift-steps", "-1")
    assert code == 2 and "--drift-steps must be >= 0" in err


def test_fuzz_exactness_smoke_and_bad_arguments(tmp_path, capsys):
    out = tmp_path / "f.json"
    run_tool("fuzz_exactness.py", "--cases", 4, "--seed", 3, "--out", out)
    report = json.loads(out.read_text())
    assert report["cases"] == 4 and report["failures"] == [] and report["errors"] == []
    assert sum(report["coverage"]["arch"].values()) == 4 and report["tau"]["max"] >= 1
    for args, message in ((("--archs", "gpt2"), "--archs takes names among llama, qwen2, qwen3, qwen3_moe"),
                          (("--minutes", 0), "--minutes must be > 0 and --cases >= 0, got 0.0 and 0"),
                          (("--cases", -1), "--minutes must be > 0 and --cases >= 0, got 5.0 and -1"),
                          (("--pp", 0), "--tp, --pp and --ep must be >= 1, got 1, 0 and 1"),
                          (("--first-stage-layers", 2), "--first-stage-layers splits a pipeline unevenly: it takes "
                                                        "--pp 2 or more and at least 1 layer, got --pp 1 and 2"),
                          (("--pp", 3, "--first-stage-layers", 0), "got --pp 3 and 0"),
                          (("--ep", 2, "--archs", "llama"), "--ep splits a mixture's experts: it takes --archs "
                                                            "qwen3_moe alone, got 'llama'"),
                          (("--tp", 2, "--archs", "llama,qwen3_moe"), "--tp > 1 takes dense models (--archs among "
                                                                      "llama, qwen2, qwen3)")):
        code, err = refused(capsys, "fuzz_exactness.py", *args)
        assert code != 0 and message in err, err
    with mock.patch.object(import_tool("fuzz_exactness"), "bfloat16_kernels", lambda: False):
        code, err = refused(capsys, "fuzz_exactness.py", "--dtype", "bfloat16")
    assert code != 0 and "with AVX-512 bfloat16 instructions (oneDNN's row-invariant products), and this one has " \
                         "none: use --dtype float64" in err, err


def test_fuzz_exactness_counts_float32_near_ties(tmp_path):
    out = tmp_path / "f.json"
    run_tool("fuzz_exactness.py", "--dtype", "float32", "--cases", 3, "--seed", 3, "--out", out)
    report = json.loads(out.read_text())
    assert report["cases"] == 3 and report["failures"] == report["errors"] == [] and report["bound"] == 1e-3
    assert set(report["parted"]) == {"specroll", "specroll, a subset of the prompts", "vanilla, scheduled",
                                     "vanilla, a subset of the prompts"}
    assert all(v["responses"] > 0 and v["rate"] == v["parted"] / v["responses"] for v in report["parted"].values())


def test_fuzz_exactness_tells_a_near_tie_from_a_failure_in_float32():
    """A token sampled the other way and a log-prob off by more than 1e-4 (a token on the edge of top-p)
    are near-ties, counted; a finish reason of equal tokens, or a missing response, is a failure. Over
    the cases, a check whose share of parted responses is above 0.1% is named."""
    fuzz = import_tool("fuzz_exactness")
    ref = RolloutOutput([0, 0, 1], [0, 1, 0], [[5, 6, 7], [5, 6], [8]],
                        [torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])],
                        ["length", "eos", "length"])
    same = dataclasses.replace(ref, logprobs=[lp + 5e-5 for lp in ref.logprobs])
    assert fuzz.divergences(ref, same) == ([], None)
    other = dataclasses.replace(ref, tokens=[[5, 9, 7], [5, 6], [8]],
                                logprobs=[torch.tensor([-1.0, -2.5, -3.0]), torch.tensor([-1.0, -2.0002]),
                                          torch.tensor([-0.5])], finish_reason=["length", "eos", "eos"])
    parted, failure = fuzz.divergences(ref, other)
    assert parted == [{"response": 0, "position": 1, "kind": "token"}, {"response": 1, "position": 1,
                                                                         "kind": "log-prob"}]
    assert failure == {"response": 2, "finish_reason": ["length", "eos"]}
    assert fuzz.divergences(ref, dataclasses.replace(ref, tokens=ref.tokens[:2]))[1] == {"responses": [3, 2]}
    assert fuzz.divergences(ref, dataclasses.replace(ref, tokens=[[8]], logprobs=[torch.tensor([-0.5])],
                                                     finish_reason=["length"]), rows=[2]) == ([], None)
    results = [{"responses": {"specroll": 999, "vanilla, scheduled": 999},
                "parted": [{"engine": "specroll", "kind": "token"}]},
               {"responses": {"specroll": 1, "vanilla, scheduled": 1},
                "parted": [{"engine": "vanilla, scheduled", "kind": "log-prob"}] * 2}]
    shares, over = fuzz.parted_share(results)
    assert shares["specroll"] == {"responses": 1000, "parted": 1, "token": 1, "log-prob": 0, "rate": 1e-3}
    assert shares["vanilla, scheduled"]["rate"] == 2e-3 and over == ["vanilla, scheduled"]


def test_fuzz_exactness_counts_a_layouts_float32_near_ties_against_one_process(ctx):
    """In float32 a layout's rollouts part from one process's by near-ties, counted as checks "...,
    against one process": a log-prob apart in the plain rollout is counted and the comparison goes on;
    a token sampled otherwise there ends it (the layout drew its EOS from other tokens: another case);
    a finish reason of equal tokens is a failure (float64: tests/dist/test_fuzz_layouts.py)."""
    fuzz = import_tool("fuzz_exactness")
    case = fuzz.draw_case(5, ctx, ["llama"], "float32")
    outputs = fuzz.rollouts(case)
    plain = case.plain
    nudged = dataclasses.replace(plain, logprobs=[lp - 1e-3 for lp in plain.logprobs])
    got = fuzz.compare_layout(case, {"plain": [nudged], "outputs": outputs}, "float32")
    assert got["failures"] == [] and len(got["responses"]) == 1 + len(outputs)
    assert {y["engine"] for y in got["parted"]} == {"vanilla, no EOS, all prompts at once, against one process"}
    assert len(got["parted"]) == len(plain.tokens) and {y["kind"] for y in got["parted"]} == {"log-prob"}
    other = dataclasses.replace(plain, tokens=[[t + 1 for t in ts] for ts in plain.tokens])
    got = fuzz.compare_layout(case, {"plain": [plain, other], "outputs": outputs}, "float32")
    assert got["failures"] == [] and {y["kind"] for y in got["parted"]} == {"token"}
    assert dict(got["responses"]) == {"vanilla, no EOS, all prompts at once, against one process":
                                      2 * len(plain.tokens)}
    finished = dataclasses.replace(plain, finish_reason=["eos"] * len(plain.tokens))
    got = fuzz.compare_layout(case, {"plain": [finished], "outputs": outputs}, "float32")
    assert got["failures"][0]["finish_reason"] == ["length", "eos"] and len(got["responses"]) == 1


@pytest.mark.parametrize("field, found", [("tokens", "position"), ("logprobs", "logprob_gap")])
def test_fuzz_exactness_finds_a_changed_token_or_log_prob(ctx, monkeypatch, field, found):
    """A speculative engine whose accepted tokens, or their log-probs, differ from the sampler's: the
    case reports it against the vanilla engine, for all its prompts and for a subset of them."""
    from specroll_mcore.rollout import speculative

    fuzz = import_tool("fuzz_exactness")
    assert fuzz.run_case(4, ctx, ["llama"])["failures"] == []
    real = speculative.accept

    def accept(*args, **kwargs):
        acc = real(*args, **kwargs)
        if field == "tokens":
            acc.tokens[:, 0] = (acc.tokens[:, 0] + 1) % 300
        else:
            acc.logprobs[:, 0] += 1e-4
        return acc

    monkeypatch.setattr(speculative, "accept", accept)
    got = fuzz.run_case(4, ctx, ["llama"])
    assert got["case"]["max_new_tokens"] > 2 and not got["case"]["eos"]
    assert {f["engine"] for f in got["failures"]} == {"specroll", "specroll, a subset of the prompts"}
    assert all(found in f for f in got["failures"]), got["failures"]
