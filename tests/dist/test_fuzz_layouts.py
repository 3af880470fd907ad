"""tools/fuzz_exactness.py across layouts: random cases rolled out at TP=2, PP=2, EP=2 (2 processes,
gloo) and PP=3 split unevenly (3) against the vanilla engine of one process (float32: the near-ties
that part them counted; bfloat16: the layout's engines against each other), and the cases of a
pipeline bug and an expert-parallel deadlock it found replayed; its comparison reports what a layout
changed, a launch that fails or hangs is reported, not lost, and a run stopped stops its processes."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest

from conftest import import_tool

ROOT = Path(__file__).resolve().parent.parent.parent
pytestmark = pytest.mark.dist


def bfloat16_kernels() -> bool:
    return import_tool("fuzz_exactness").bfloat16_kernels()


@pytest.mark.parametrize("layout, dtype", [
    # (PP=2 in float64 in `make test-slow`: the default suite runs PP=3 in float64 and PP=2 in float32)
    ({"tp": 2}, "float64"), pytest.param({"pp": 2}, "float64", marks=pytest.mark.slow), ({"ep": 2}, "float64"),
    ({"pp": 3, "first_stage_layers": 2}, "float64"),
    ({"pp": 2}, "float32"),
    pytest.param({"tp": 2}, "bfloat16", marks=pytest.mark.skipif(not bfloat16_kernels(), reason="no AVX-512 bf16"))],
    ids=["tp2", "pp2", "ep2", "pp3-uneven", "pp2-float32", "tp2-bfloat16"])
def test_random_cases_at_a_layout_give_one_process_tokens(tmp_path, layout, dtype):
    """In float64 checked against one process too; in float32 the near-ties parted counted, against one
    process too; in bfloat16 the layout's engines against each other (the cases' models drawn in the
    dtype by the processes at the layout: the case records it)."""
    out = tmp_path / "fuzz.json"
    args = [a for k, v in layout.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "fuzz_exactness.py"), *args, "--cases", "3",
                           "--seed", "7", "--dtype", dtype, "--out", str(out)],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["cases"] == 3 and report["failures"] == [] and report["errors"] == []
    assert report["coverage"]["dtype"] == {dtype: 3}
    assert report["layout"] == {"tp": 1, "pp": 1, "ep": 1, "first_stage_layers": None, **layout}
    assert report["coverage"]["layers"] == {"4" if "first_stage_layers" in layout else "2": 3}  # (3 stages: 2, 1, 1)
    dense = ["llama", "qwen2", "qwen3"]
    assert report["archs"] == {"tp": dense, "pp": dense + ["qwen3_moe"], "ep": ["qwen3_moe"]}[next(iter(layout))]
    assert report["tau"]["max"] >= 1
    if dtype == "float32":  # (the layout's own checks and each rollout against one process, under the bound)
        assert report["over_bound"] == [] and len(report["parted"]) == 10, report["parted"]
        assert all(v["responses"] > 0 for v in report["parted"].values())


def test_a_case_replayed_at_a_layout(tmp_path):
    """The case of one seed at PP=2, described: the one whose stages parted before each group's rows ran
    in one order on every stage (rollout.base.run_order; three groups of responses over two stages,
    continuous batching, prompts prefilled in pieces of 3, responses ending at an EOS). The stages had
    ordered a group's rows each by its own cache layout, and the first stage, waiting for one
    broadcast, was sent another (gloo: "Received data size doesn't match expected size")."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "fuzz_exactness.py"), "--pp", "2", "--replay",
                           "429015258"], env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = json.loads(proc.stdout[proc.stdout.index("{\n"):])
    assert got["seed"] == 429015258 and got["failures"] == [] and got["tau"] > 2
    assert {k: got["case"][k] for k in ("pipeline_groups", "max_num_seqs", "max_prefill_tokens", "eos")} == {
        "pipeline_groups": 3, "max_num_seqs": 5, "max_prefill_tokens": 3, "eos": True}


def test_expert_parallel_pipeline_case_replayed(tmp_path):
    """The case of one seed at EP=2 x PP=2 (4 processes), described: the one whose ranks waited on each
    other in a cycle before the expert lockstep paired each stage's forwards group-step by group-step
    (PolicyModel.lockstep_barrier; continuous batching with two rows, prompts prefilled in pieces of 3:
    one replica's admitted prompt took several prefill forwards where the other decoded)."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "fuzz_exactness.py"), "--ep", "2", "--pp", "2",
                           "--archs", "qwen3_moe", "--replay", "530465698"],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = json.loads(proc.stdout[proc.stdout.index("{\n"):])
    assert got["seed"] == 530465698 and got["failures"] == []
    assert {k: got["case"][k] for k in ("arch", "max_num_seqs", "max_prefill_tokens")} == {
        "arch": "qwen3_moe", "max_num_seqs": 2, "max_prefill_tokens": 3}


def test_the_comparison_reports_what_a_layout_changed(ctx):
    """A layout's rollouts (here this process's) against the reference: equal, then one token, one
    log-prob, and the EOS-picking rollout changed in turn (that one alone reported: the case's EOS
    came from other tokens)."""
    fuzz = import_tool("fuzz_exactness")
    case = fuzz.draw_case(4, ctx, ["llama"])
    assert case.sampling.max_new_tokens > 2 and len(case.prompts) == 4
    case = dataclasses.replace(case, subset=[1, 3])
    outputs = fuzz.rollouts(case)
    assert fuzz.compare_layout(case, {"plain": [case.plain], "outputs": outputs})["failures"] == []

    part = outputs["specroll, a subset of the prompts"]
    tokens = [list(t) for t in part.tokens]
    tokens[-1][1] = (tokens[-1][1] + 1) % 300
    changed = dict(outputs, **{"specroll, a subset of the prompts": dataclasses.replace(part, tokens=tokens)})
    (f,) = fuzz.compare_layout(case, {"plain": [case.plain], "outputs": changed})["failures"]
    assert f["engine"] == "specroll, a subset of the prompts, against one process" and f["position"] == 1
    assert f["response"] == case.subset_rows[-1]  # (its row among all prompts' responses)

    logprobs = [lp.clone() for lp in outputs["specroll"].logprobs]
    logprobs[0][0] += 1e-6
    changed = dict(outputs, specroll=dataclasses.replace(outputs["specroll"], logprobs=logprobs))
    (f,) = fuzz.compare_layout(case, {"plain": [case.plain], "outputs": changed})["failures"]
    assert f["engine"] == "specroll, against one process" and f["response"] == 0 and f["logprob_gap"] > 1e-9

    plain = dataclasses.replace(case.plain, tokens=[[t + 1 for t in ts] for ts in case.plain.tokens])
    failures = fuzz.compare_layout(case, {"plain": [case.plain, plain], "outputs": changed})["failures"]
    assert [f["engine"] for f in failures] == ["vanilla, no EOS, all prompts at once, against one process"]


@pytest.mark.parametrize("command, message", [
    ("raise SystemExit(3)", "the 2 processes at the layout exited with status 3, after 0 cases"),
    ("import time; time.sleep(60)", "the 2 processes at the layout were stopped 1 s after --minutes, after 0 cases")])
def test_a_launch_that_fails_or_hangs_is_reported(ctx, monkeypatch, command, message):
    fuzz = import_tool("fuzz_exactness")
    real = subprocess.Popen
    monkeypatch.setattr(fuzz.subprocess, "Popen", lambda cmd, **kw: real([sys.executable, "-c", command], **kw))
    monkeypatch.setattr(fuzz, "WORKER_GRACE_S", 1)
    args = Namespace(tp=2, pp=1, ep=1, seed=0, minutes=0.001, cases=1, replay=None, dtype="float64",
                     first_stage_layers=None)
    results, errors = fuzz.across_layout(args, ["llama"], ctx)
    assert results == [] and len(errors) == 1 and errors[0]["error"].startswith(message), errors


def test_a_stopped_run_stops_its_processes(tmp_path):
    """SIGTERM (or Ctrl-C) to the tool while the processes at the layout run: they go too (they run in
    a session of their own, which a signal to the tool's does not reach)."""
    def launched() -> list[int]:  # (torchrun and its workers: their command names the case folder, in TMPDIR)
        pids = []
        for d in Path("/proc").iterdir():
            try:
                cmd = (d / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if d.name.isdigit() and "--worker" in cmd and str(tmp_path) in cmd:
                pids.append(int(d.name))
        return pids

    tool = subprocess.Popen([sys.executable, str(ROOT / "tools" / "fuzz_exactness.py"), "--pp", "2", "--minutes", "5",
                             "--out", str(tmp_path / "fuzz.json")], env=dict(os.environ, TMPDIR=str(tmp_path)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len(launched()) < 3 and time.monotonic() < deadline:  # torchrun and 2 workers
            time.sleep(0.5)
        assert len(launched()) >= 3, "the processes at the layout never started"
        tool.send_signal(signal.SIGTERM)
        assert tool.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while launched() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert launched() == []
        assert not (tmp_path / "fuzz.json").exists()
    finally:
        if tool.poll() is None:
            tool.kill()
