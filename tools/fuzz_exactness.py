#!/usr/bin/env python
"""The exactness contract under random configurations: SpecRoll's rollouts against the vanilla
engine's, token for token, in float64 (where near-ties cannot happen) or bfloat16 on a CPU.

    python tools/fuzz_exactness.py --minutes 10 --out fuzz_exactness.json
    python tools/fuzz_exactness.py --replay 123456789      # one case again, described
    python tools/fuzz_exactness.py --tp 2 --minutes 10     # the rollouts at TP=2 (--pp 3, --ep 2 alike)
    python tools/fuzz_exactness.py --tp 2 --replay 123456789

Each case draws, from its own seed: a random tiny model (Llama, Qwen2, Qwen3 or Qwen3-MoE shapes,
float64) whose horizon heads are random, or whose embeddings are all nearly the same so that the
heads draft nearly the policy's own distribution (long accepted paths, to the end of the trees);
1-5 prompts of 1-20 tokens; the sampling (greedy or T = 0.6 / 1, top-p, top-k, min-p, 1-40 new
tokens, 1-3 samples, the seed and the rollout step, prompt ids); an end-of-sequence token (one the
model emits, or none); the scheduling (``max_num_seqs``: continuous batching; ``max_prefill_tokens``:
prompts prefilled in pieces; ``pipeline_groups``: groups of responses taking turns, over the pipeline
stages where there are several); the speculative engine's settings (C_hw, top-k, N_max, coupled drafts,
a draft vocabulary, Reflex, the slow path, a latency curve that trims trees or none, acceptance
walked or sampled at once). It then checks, against the vanilla engine with everything at once:

- the vanilla engine with the case's scheduling,
- the speculative engine with the case's scheduling and settings,
- the speculative engine on a random subset of the prompts (same prompt ids): their responses alone

give the same tokens, finish reasons and log-probs (to 1e-9). ``--dtype bfloat16`` checks the same on
a half-precision policy, whose steps a CPU with AVX-512 bfloat16 instructions computes bit for bit
as one-token forwards (``PolicyModel.batch_invariant``; half its models in SmolLM2's attention
shape, for the step-attention kernel). ``--dtype float32``, whose steps' sums depend on the batch
and the tree (~1e-6), counts instead the responses a near-tie parted from the reference's (a
token sampled the other way, or a log-prob 1e-4 or more apart before any did: a token on the edge of
top-p / top-k / min-p kept on one side alone), by check, against the bound of 0.1% of responses.

``--tp N``, ``--pp N``, ``--ep N`` roll the cases out at that layout instead, in tp x pp x ep processes
on gloo (launched here with torchrun; ``--ep``: Qwen3-MoE's experts over as many data-parallel
ranks, the first rolling out all prompts and the others the subset, so the expert group's ranks run
forwards for each other's longer responses; ``--pp``: models of one layer per stage, at least 2, or
``--first-stage-layers`` on the first stage and one on each other), the model's weights, heads and
case drawn alike and sharded by the layout. The checks above run there; in float64 every rollout
there (the one that picks the EOS too) is also checked against the vanilla engine in this process,
all prompts at once (the layout's reductions in another order move log-probs by ~1e-15 and no
token); in float32 the near-ties the layout's sums part from one process's are counted alike, as
checks of their own ("..., against one process"); in bfloat16 the layout's own engines agree bit for
bit (a TP layout's sums differ from one process's). A SIGTERM or Ctrl-C stops the processes too.
Reported (JSON): the cases, every failure with its case seed (``--replay`` it), the engine, the first
response and position that differ; how often each setting was drawn; SpecRoll's tokens per step over
the cases. Exits 1 on any failure. A tool for changes to the engines, trees, sampler or acceptance,
beside the tests.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from specroll_mcore import parallel  # noqa: E402
from specroll_mcore.checkpoint import random_full_heads, random_full_state_dict  # noqa: E402
from specroll_mcore.checkpoint.megatron import write_json_atomic  # noqa: E402
from specroll_mcore.config import (ParallelConfig, ReflexConfig, SamplingConfig, SlowPathConfig,  # noqa: E402
                                   SpecConfig, tiny_llama, tiny_qwen2, tiny_qwen3, tiny_qwen3_moe)
from specroll_mcore.model import PolicyModel  # noqa: E402
from specroll_mcore.rollout import SpeculativeEngine, VanillaEngine  # noqa: E402
from specroll_mcore.rollout.base import RolloutOutput  # noqa: E402
from specroll_mcore.tree import LatencyCurve  # noqa: E402

ARCHS = {"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3, "qwen3_moe": tiny_qwen3_moe}
WORKER_GRACE_S = 600
FLOAT32_LOGPROB_TOL = 1e-4  # (a float32 step's logits move by ~1e-6 with the batch; log-probs alike)
FLOAT32_PARTED_BOUND = 1e-3  # (the share of responses a near-tie may part in float32: 0.1%)
CURVES = {"none": None, "flat": LatencyCurve((1, 64), (1.0, 1.0)), "steep": LatencyCurve((1, 2, 64), (1.0, 2.0, 64.0)),
          "mid": LatencyCurve((1, 8, 16, 64), (1.0, 1.1, 2.0, 8.0))}


def bfloat16_kernels() -> bool:
    """Whether this CPU has AVX-512 bfloat16 instructions (the tests of bit-for-bit bfloat16 ask it here too)."""
    info = Path("/proc/cpuinfo")
    return info.exists() and "avx512_bf16" in info.read_text()


def draw_model(r: random.Random, ctx: Any, archs: list[str], dtype: str,
               layers: int = 2) -> tuple[PolicyModel, dict[str, Any]]:
    """A tiny model of ``layers`` layers with 3 heads: random heads, or embeddings within ``spread`` of
    one vector (the policy's distribution then hardly depends on the context, and zero-initialised
    heads, z = h, draft it nearly exactly); in bfloat16 half the time SmolLM2's attention shape (9 heads of 64 in 3
    groups; 8 in 2 under TP), which the CPU's step-attention kernel takes."""
    arch = r.choice(archs)
    wide = dtype == "bfloat16" and r.random() < 0.5
    heads, groups = (9, 3) if ctx.tp_size == 1 else (8, 2)  # (TP splits the heads and their groups)
    shape = dict(hidden_size=576, ffn_hidden_size=256, num_attention_heads=heads, num_query_groups=groups,
                 kv_channels=64) if wide else {}
    cfg = ARCHS[arch](params_dtype=dtype, num_layers=layers, **shape)
    model = PolicyModel(cfg, ctx, num_heads=3).eval()
    full = random_full_state_dict(cfg, seed=r.randrange(10**6), std=0.08)
    spread = r.choice([0.0, 0.01, 0.05, None])
    if spread == 0.0 and cfg.tie_word_embeddings and dtype == "float32":
        spread = 0.01  # (one embedding tied to the output gives every token one logit: exact ties float32 breaks)
    g = torch.Generator().manual_seed(r.randrange(10**6))
    if spread is not None:
        emb = full["embedding.word_embeddings.weight"]
        full["embedding.word_embeddings.weight"] = emb[:1].expand_as(emb) + spread * torch.randn(
            emb.shape, generator=g, dtype=emb.dtype)
    model.load_full_state_dict(full)
    if spread is None:  # (drawn whole on every rank, then sharded: the same heads at every layout)
        model.load_full_heads(random_full_heads(cfg, 3, g))
    return model, {"arch": arch, "dtype": dtype, "layers": layers,
                   "attention": f"{heads} x 64" if wide else "tiny",
                   "heads": "random" if spread is None else f"near the policy (spread {spread})"}


def differences(ref: RolloutOutput, out: RolloutOutput, rows: Optional[list[int]] = None) -> Optional[dict[str, Any]]:
    """The first difference of ``out`` from ``ref`` (``rows``: the rows of ``ref`` that ``out``'s are),
    or None."""
    rows = list(range(len(ref.tokens))) if rows is None else rows
    if len(out.tokens) != len(rows):
        return {"responses": [len(rows), len(out.tokens)]}
    for i, j in enumerate(rows):
        a, b = ref.tokens[j], out.tokens[i]
        if a != b:
            at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return {"response": j, "position": at, "tokens": [a[at:at + 4], b[at:at + 4]],
                    "lengths": [len(a), len(b)]}
        if ref.finish_reason[j] != out.finish_reason[i]:
            return {"response": j, "finish_reason": [ref.finish_reason[j], out.finish_reason[i]]}
        if len(a):
            gap = float((ref.logprobs[j] - out.logprobs[i]).abs().max())
            if not gap <= 1e-9:
                return {"response": j, "logprob_gap": gap}
    return None


def divergences(ref: RolloutOutput, out: RolloutOutput, rows: Optional[list[int]] = None,
                tol: float = FLOAT32_LOGPROB_TOL) -> tuple[list[dict[str, Any]], Optional[dict[str, Any]]]:
    """float32's comparison of ``out`` with ``ref`` (``rows`` as in :func:`differences`): the responses
    a near-tie parted, each with the first position and what parted there ("token": one sampled the
    other way; "log-prob": one more than ``tol`` apart, a token on the edge of top-p / top-k / min-p
    kept on one side alone), and the first failure, or None: a response count, or a finish reason of
    equal tokens."""
    rows = list(range(len(ref.tokens))) if rows is None else rows
    if len(out.tokens) != len(rows):
        return [], {"responses": [len(rows), len(out.tokens)]}
    parted, failure = [], None
    for i, j in enumerate(rows):
        a, b = ref.tokens[j], out.tokens[i]
        at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        apart = ((ref.logprobs[j][:at] - out.logprobs[i][:at]).abs() > tol).nonzero()
        if len(apart):
            parted.append({"response": j, "position": int(apart[0, 0]), "kind": "log-prob"})
        elif a != b:
            parted.append({"response": j, "position": at, "kind": "token"})
        elif ref.finish_reason[j] != out.finish_reason[i] and failure is None:
            failure = {"response": j, "finish_reason": [ref.finish_reason[j], out.finish_reason[i]]}
    return parted, failure


@dataclass
class Case:
    """One drawn case: a model, prompts and sampling, an EOS, the scheduling and SpecRoll's settings."""

    model: PolicyModel
    info: dict[str, Any]
    prompts: list[list[int]]
    sampling: SamplingConfig
    step: int
    ids: Optional[list[int]]
    plain: RolloutOutput
    """The vanilla engine's responses with no EOS, all prompts at once (the EOS is drawn from them)."""
    eos: list[int]
    sched: dict[str, Any]
    spec: SpecConfig
    curve: str
    at_once: str
    subset: list[int]

    def generate(self, speculative: bool, scheduled: bool = True, part: bool = False) -> RolloutOutput:
        """A new engine's rollout: SpecRoll or vanilla, with the case's scheduling or all prompts at
        once, of all prompts or the subset (with their prompt ids: the same responses)."""
        sched = self.sched if scheduled else {}
        if speculative:
            engine = SpeculativeEngine(self.model, self.spec, eos_token_ids=self.eos, latency=CURVES[self.curve],
                                       **sched)
        else:
            engine = VanillaEngine(self.model, eos_token_ids=self.eos, **sched)
        prompts, ids = self.prompts, self.ids
        if part:
            prompts = [self.prompts[i] for i in self.subset]
            ids = [self.ids[i] if self.ids is not None else i for i in self.subset]
        with accepted_at_once(self.at_once):
            out = engine.generate(prompts, self.sampling, step=self.step, prompt_ids=ids)
        return dataclasses.replace(out, stats={"tau": out.stats.get("tau")}, features=None, routing=None)

    @property
    def subset_rows(self) -> list[int]:
        """The responses of the subset's prompts among all prompts' (prompt-major)."""
        g = self.sampling.num_samples
        return [i * g + s for i in self.subset for s in range(g)]


@contextlib.contextmanager
def accepted_at_once(value: str) -> Iterator[None]:
    """SPECROLL_ACCEPT_AT_ONCE set to ``value`` ("1": every depth's acceptance sampled at once) inside."""
    saved = os.environ.get("SPECROLL_ACCEPT_AT_ONCE")
    os.environ["SPECROLL_ACCEPT_AT_ONCE"] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("SPECROLL_ACCEPT_AT_ONCE", None)
        else:
            os.environ["SPECROLL_ACCEPT_AT_ONCE"] = saved


def draw_case(case_seed: int, ctx: Any, archs: list[str], dtype: str = "float64", layers: int = 2) -> Case:
    """The case of ``case_seed``, drawn from it alone (the same at every layout: the EOS comes from the
    plain rollout, which a layout computes alike); its model of ``layers`` layers, drawn alike for
    any number."""
    r = random.Random(case_seed)
    model, info = draw_model(r, ctx, archs, dtype, layers)
    prompts = [[r.randrange(1, 300) for _ in range(r.randint(1, 20))] for _ in range(r.randint(1, 5))]
    sp = SamplingConfig(temperature=r.choice([0.0, 0.6, 1.0]), top_p=r.choice([1.0, 0.9]), top_k=r.choice([0, 5]),
                        min_p=r.choice([0.0, 0.1]), max_new_tokens=r.randint(1, 40), num_samples=r.randint(1, 3),
                        seed=r.randrange(1000))
    step = r.randrange(5)
    ids = r.sample(range(10**6), len(prompts)) if r.random() < 0.5 else None
    plain = VanillaEngine(model).generate(prompts, sp, step=step, prompt_ids=ids)
    seen = [t for ts in plain.tokens for t in ts]
    eos = [r.choice(seen)] if seen and r.random() < 0.7 else []
    sched = {"max_num_seqs": r.choice([None, 1, 2, 5]), "max_prefill_tokens": r.choice([4096, 3, 7])}
    spec = SpecConfig(c_hw=r.choice([1, 3, 8, 16, 64]), topk=r.choice([1, 2, 4]), n_max=r.choice([1, 4, 16]),
                      coupled=r.random() < 0.8, draft_vocab=r.choice([0, 0, 64]),
                      reflex=ReflexConfig(enabled=r.random() < 0.5), slow_path=SlowPathConfig(enabled=r.random() < 0.3))
    curve = r.choice(sorted(CURVES))
    at_once = r.choice(["0", "1"])
    subset = sorted(r.sample(range(len(prompts)), r.randint(1, len(prompts))))
    sched["pipeline_groups"] = r.choice([None, 1, 3])  # (one per stage; the batch at once; more than stages)
    info.update(prompts=len(prompts), prompt_tokens=[len(p) for p in prompts], temperature=sp.temperature,
                top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p, max_new_tokens=sp.max_new_tokens,
                num_samples=sp.num_samples, prompt_ids=ids is not None, eos=bool(eos), **sched, c_hw=spec.c_hw,
                topk=spec.topk, n_max=spec.n_max, coupled=spec.coupled, draft_vocab=spec.draft_vocab,
                reflex=spec.reflex.enabled, slow_path=spec.slow_path.enabled, latency=curve, accept_at_once=at_once)
    return Case(model, info, prompts, sp, step, ids, plain, eos, sched, spec, curve, at_once, subset)


ROLLOUTS = {  # name: (speculative, with the case's scheduling, the subset of the prompts)
    "vanilla, all prompts at once": (False, False, False),
    "specroll": (True, True, False),
    "vanilla, scheduled": (False, True, False),
    "specroll, a subset of the prompts": (True, True, True),
    "vanilla, a subset of the prompts": (False, True, True)}
CHECKS = {  # check: (expected, got); the contract, SpecRoll against the vanilla engine scheduled alike, first
    "specroll": ("vanilla, scheduled", "specroll"),
    "specroll, a subset of the prompts": ("vanilla, a subset of the prompts", "specroll, a subset of the prompts"),
    "vanilla, scheduled": ("vanilla, all prompts at once", "vanilla, scheduled"),
    "vanilla, a subset of the prompts": ("vanilla, all prompts at once", "vanilla, a subset of the prompts")}


def rollouts(case: Case, names: Iterable[str] = tuple(ROLLOUTS)) -> dict[str, RolloutOutput]:
    """The case's rollouts of ``names`` (ROLLOUTS), one new engine each."""
    return {name: case.generate(*ROLLOUTS[name]) for name in names}


def judge(case: Case, outs: dict[str, RolloutOutput], dtype: str) -> dict[str, Any]:
    """The CHECKS whose two rollouts are in ``outs``: SpecRoll's tokens per step and the failures; in
    float32 the responses near-ties parted too (by check: responses, parted)."""
    got: dict[str, Any] = {"case": case.info, "tau": outs["specroll"].stats["tau"] if "specroll" in outs else None,
                           "failures": [], **({"responses": {}, "parted": []} if dtype == "float32" else {})}
    for name, (a, b) in CHECKS.items():
        if a in outs and b in outs:
            compare(got, name, outs[a], outs[b], case.subset_rows if ROLLOUTS[b][2] > ROLLOUTS[a][2] else None, dtype)
    return got


def compare(into: dict[str, Any], name: str, expected: RolloutOutput, out: RolloutOutput, rows: Optional[list[int]],
            dtype: str) -> None:
    """Check ``name``: ``out`` against ``expected`` (``rows`` as in :func:`differences`), its failure
    added to ``into["failures"]``; in float32 (:func:`divergences`) its responses counted in
    ``into["responses"]`` and those a near-tie parted added to ``into["parted"]``."""
    if dtype == "float32":
        parted, failure = divergences(expected, out, rows)
        into["responses"][name] = into["responses"].get(name, 0) + len(out.tokens)
        into["parted"] += [{"engine": name, **x} for x in parted]
    else:
        failure = differences(expected, out, rows)
    if failure is not None:
        into["failures"].append({"engine": name, **failure})


def run_case(case_seed: int, ctx: Any, archs: list[str], dtype: str = "float64") -> dict[str, Any]:
    """One case, drawn from ``case_seed`` alone: its settings, SpecRoll's tokens per step, failures."""
    case = draw_case(case_seed, ctx, archs, dtype)
    return judge(case, rollouts(case), dtype)


def layout_rollouts(case: Case, ctx: Any) -> dict[str, RolloutOutput]:
    """The case's rollouts at this process's layout: all of ROLLOUTS without data parallelism; under
    expert parallelism the first data-parallel rank rolls out all prompts (SpecRoll and the vanilla
    engine, scheduled) and the others the subset, whose responses take other numbers of forwards (the
    EP group's ranks in lockstep, PolicyModel.expert_lockstep)."""
    if ctx.dp_size == 1:
        return rollouts(case)
    part = ", a subset of the prompts" if ctx.dp_rank > 0 else ""
    return rollouts(case, ["specroll" + part, "vanilla" + (part or ", scheduled")])


def compare_layout(case: Case, got: dict[str, Any], dtype: str = "float64") -> dict[str, Any]:
    """One case's rollouts at a layout (``got``: each data-parallel rank's plain rollout and
    layout_rollouts) against this process's vanilla engine, all prompts at once: the failures, and in
    float32 the responses compared and those a near-tie parted, by check (as :func:`judge` counts them).
    Where the plain rollout, whose tokens the EOS is drawn from, has other tokens at the layout, the
    layout's case is another: the comparison ends there."""
    against: dict[str, Any] = {"failures": [], "responses": {}, "parted": []}
    for plain in got["plain"]:
        compare(against, "vanilla, no EOS, all prompts at once, against one process", case.plain, plain, None, dtype)
    if against["failures"] or any(plain.tokens != case.plain.tokens for plain in got["plain"]):
        return against
    ref = case.generate(speculative=False, scheduled=False)
    for name, out in got["outputs"].items():
        compare(against, f"{name}, against one process", ref, out, case.subset_rows if ROLLOUTS[name][2] else None,
                dtype)
    return against


def in_process(args: argparse.Namespace, archs: list[str], ctx: Any) -> tuple[list[dict[str, Any]],
                                                                            list[dict[str, Any]]]:
    """Cases run and checked in this process, until ``--minutes`` or ``--cases``: (results, errors)."""
    draw = random.Random(args.seed)
    deadline = time.monotonic() + 60 * args.minutes
    results, errors = [], []
    while time.monotonic() < deadline and (args.cases == 0 or len(results) + len(errors) < args.cases):
        case_seed = draw.randrange(10**9)
        try:
            got = run_case(case_seed, ctx, archs, args.dtype)
        except Exception:  # a crash is a failure too, reported with the case that made it
            errors.append({"seed": case_seed, "error": traceback.format_exc(limit=4)[-2000:]})
            print(f"case {case_seed} raised:\n{errors[-1]['error']}", flush=True)
            continue
        results.append({"seed": case_seed, **got})
        for f in got["failures"]:
            print(f"case {case_seed}: {json.dumps(f)}", flush=True)
    return results, errors


def layout_config(args: argparse.Namespace) -> ParallelConfig:
    return ParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                          expert_model_parallel_size=args.ep, backend="gloo",
                          num_layers_in_first_pipeline_stage=args.first_stage_layers)


def model_layers(args: argparse.Namespace) -> int:
    """The layers of the cases' models: one per pipeline stage (at least 2), or with
    ``--first-stage-layers`` that many on the first stage and one on each other."""
    if args.first_stage_layers is not None:
        return args.first_stage_layers + args.pp - 1
    return max(2, args.pp)


def worker(args: argparse.Namespace, archs: list[str]) -> None:
    """Under torchrun, at the layout of ``--tp/--pp/--ep``: each case's rollouts (layout_rollouts) and
    the CHECKS among them, saved by the last stage's first TP rank of every data-parallel rank to
    ``--worker``'s folder (in float64 with the rollouts, for one process to compare); rank 0's clock
    and count decide when to stop, for all."""
    import torch.distributed as dist

    layers = model_layers(args)
    ctx = parallel.initialize(layout_config(args), tiny_qwen3_moe(num_layers=layers) if args.ep > 1 else None)
    folder = Path(args.worker)
    draw = random.Random(args.seed)
    deadline = time.monotonic() + 60 * args.minutes
    count = 0
    while True:
        go = torch.tensor([int(time.monotonic() < deadline and (args.cases == 0 or count < args.cases))])
        dist.broadcast(go, src=0)
        if not go.item():
            break
        case_seed, count = draw.randrange(10**9) if args.replay is None else args.replay, count + 1
        try:
            case = draw_case(case_seed, ctx, archs, args.dtype, layers)
            outs = layout_rollouts(case, ctx)
            got = judge(case, outs, args.dtype)
            if args.dtype != "bfloat16":  # (checked against one process)
                got.update(plain=case.plain, outputs=outs)
        except Exception:  # (raised alike on every rank, or the others wait in a collective until the timeout)
            got = {"error": traceback.format_exc(limit=4)[-2000:]}
            print(f"case {case_seed} raised on rank {ctx.rank}:\n{got['error']}", flush=True)
        if ctx.is_last_stage and ctx.tp_rank == 0:
            torch.save({"seed": case_seed, **got}, folder / f"case{count:06d}-dp{ctx.dp_rank}.pt")
    parallel.destroy()


def stop(launch: subprocess.Popen) -> None:
    """Stop torchrun and the processes it launched: each runs in a session of its own, which torchrun
    stops on SIGTERM (SIGKILL to what is left after a minute)."""
    os.killpg(launch.pid, signal.SIGTERM)
    try:
        launch.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(launch.pid, signal.SIGKILL)
        launch.wait()


def across_layout(args: argparse.Namespace, archs: list[str], ctx: Any) -> tuple[list[dict[str, Any]],
                                                                               list[dict[str, Any]]]:
    """The cases' rollouts at ``--tp/--pp/--ep`` (2+ processes on gloo, launched here with torchrun)
    against this process's vanilla engine (``ctx``: one process), all prompts at once: (results, errors).
    Processes still running WORKER_GRACE_S after ``--minutes`` are stopped (a case that raised on some
    ranks alone leaves the others in a collective); the cases they saved are compared."""
    world = args.tp * args.pp * args.ep
    with tempfile.TemporaryDirectory(prefix="fuzz_layout_") as folder:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", __file__,
               "--worker", folder, "--tp", str(args.tp), "--pp", str(args.pp), "--ep", str(args.ep),
               "--seed", str(args.seed), "--minutes", str(args.minutes), "--cases", str(args.cases),
               "--archs", ",".join(archs), "--dtype", args.dtype,
               *(["--replay", str(args.replay)] if args.replay is not None else []),
               *(["--first-stage-layers", str(args.first_stage_layers)] if args.first_stage_layers is not None else [])]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        stopped = False
        try:
            proc.wait(timeout=60 * args.minutes + WORKER_GRACE_S)
        except subprocess.TimeoutExpired:
            stopped = True
        finally:  # (and interrupted: Ctrl-C, or SIGTERM as main() sets it)
            if proc.poll() is None:
                stop(proc)
        code = proc.returncode
        files: dict[int, list[dict[str, Any]]] = {}
        for f in sorted(Path(folder).glob("case*.pt")):
            files.setdefault(int(f.name[4:10]), []).append(torch.load(f, weights_only=False))
    results, errors, layers = [], [], model_layers(args)
    if code != 0:
        how = f"were stopped {WORKER_GRACE_S} s after --minutes" if stopped else f"exited with status {code}"
        errors.append({"seed": None, "error": f"the {world} processes at the layout {how}, after {len(files)} "
                                              f"cases (their output is above)"})
    for _, parts in sorted(files.items()):
        seed = parts[0]["seed"]
        if any("error" in part for part in parts):
            errors.append({"seed": seed, "error": next(part["error"] for part in parts if "error" in part)})
            continue
        failures = [f for part in parts for f in part["failures"]]
        counts = {}
        if args.dtype != "bfloat16":
            try:
                case = draw_case(seed, ctx, archs, args.dtype, layers)
                outputs = {k: v for part in parts for k, v in part["outputs"].items()}
                against = compare_layout(case, {"plain": [part["plain"] for part in parts], "outputs": outputs},
                                         args.dtype)
            except Exception:
                errors.append({"seed": seed, "error": traceback.format_exc(limit=4)[-2000:]})
                print(f"case {seed} raised:\n{errors[-1]['error']}", flush=True)
                continue
            failures += against["failures"]
            if args.dtype == "float32":
                counts = {"responses": sum((Counter(part["responses"]) for part in parts),
                                           Counter(against["responses"])),
                          "parted": [y for part in parts for y in part["parted"]] + against["parted"]}
        tau = next((part["tau"] for part in parts if part["tau"] is not None), None)
        results.append({"seed": seed, "case": parts[0]["case"], "tau": tau, "failures": failures, **counts})
        for f in failures:
            print(f"case {seed}: {json.dumps(f)}", flush=True)
    return results, errors


def parted_share(results: list[dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """float32 cases' responses that near-ties parted, by check (responses, parted, by kind, rate), and
    the checks whose share is over FLOAT32_PARTED_BOUND."""
    parted = {name: {"responses": 0, "parted": 0, "token": 0, "log-prob": 0}
              for x in results for name in x["responses"]}
    for x in results:
        for name, n in x["responses"].items():
            parted[name]["responses"] += n
        for y in x["parted"]:
            parted[y["engine"]]["parted"] += 1
            parted[y["engine"]][y["kind"]] += 1
    for v in parted.values():
        v["rate"] = v["parted"] / max(v["responses"], 1)
    return parted, [name for name, v in parted.items() if v["rate"] > FLOAT32_PARTED_BOUND]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0, help="stop drawing cases after this long")
    ap.add_argument("--cases", type=int, default=0, help="stop after this many cases (0: --minutes alone)")
    ap.add_argument("--seed", type=int, default=0, help="draws the cases' seeds")
    ap.add_argument("--archs", default=None, help=f"comma-separated, of {', '.join(ARCHS)} (default: all; "
                                                  "qwen3_moe alone under --ep, the dense ones under --tp)")
    ap.add_argument("--dtype", default="float64", choices=("float64", "float32", "bfloat16"),
                    help="float32: the share of responses near-ties part; bfloat16: the half-precision policy's "
                         "bit-for-bit steps (a CPU with AVX-512 bfloat16)")
    ap.add_argument("--tp", type=int, default=1, help="the rollouts at this tensor-parallel size (processes on gloo)")
    ap.add_argument("--pp", type=int, default=1, help="... pipeline-parallel size (the models: one layer per stage, "
                                                      "at least 2)")
    ap.add_argument("--first-stage-layers", type=int, default=None,
                    help="an uneven pipeline split: this many layers on the first stage, one on each other")
    ap.add_argument("--ep", type=int, default=1, help="... expert-parallel size, as many data-parallel ranks "
                                                      "(qwen3_moe)")
    ap.add_argument("--replay", type=int, default=None, help="run the case of this seed alone and describe it "
                                                             "(at the layout of --tp/--pp/--ep, if any)")
    ap.add_argument("--out", default="fuzz_exactness.json")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # (a process at the layout, torchrun's)
    args = ap.parse_args()
    layout = args.tp * args.pp * args.ep > 1
    dense = [a for a in ARCHS if a != "qwen3_moe"]  # (megatron-core's experts under TP: sequence parallel only)
    archs = (args.archs.split(",") if args.archs is not None else ["qwen3_moe"] if args.ep > 1
             else dense if args.tp > 1 else list(ARCHS))
    if not archs or any(a not in ARCHS for a in archs):
        ap.error(f"--archs takes names among {', '.join(ARCHS)}, got {args.archs!r}")
    if args.cases < 0 or not args.minutes > 0:
        ap.error(f"--minutes must be > 0 and --cases >= 0, got {args.minutes} and {args.cases}")
    if min(args.tp, args.pp, args.ep) < 1:
        ap.error(f"--tp, --pp and --ep must be >= 1, got {args.tp}, {args.pp} and {args.ep}")
    if args.first_stage_layers is not None and (args.pp < 2 or args.first_stage_layers < 1):
        ap.error(f"--first-stage-layers splits a pipeline unevenly: it takes --pp 2 or more and at least 1 layer, "
                 f"got --pp {args.pp} and {args.first_stage_layers}")
    if args.ep > 1 and archs != ["qwen3_moe"]:
        ap.error(f"--ep splits a mixture's experts: it takes --archs qwen3_moe alone, got {args.archs!r}")
    if args.tp > 1 and "qwen3_moe" in archs:
        ap.error("--tp > 1 takes dense models (--archs among llama, qwen2, qwen3): a mixture of experts runs at "
                 "TP=1 with pipeline, expert and data parallelism (ParallelConfig.tensor_model_parallel_size)")

    if args.dtype == "bfloat16" and not bfloat16_kernels():
        ap.error("--dtype bfloat16 checks tokens bit for bit, which a half-precision policy computes on a CPU "
                 "with AVX-512 bfloat16 instructions (oneDNN's row-invariant products), and this one has none: "
                 "use --dtype float64")
    if args.worker is not None:
        worker(args, archs)
        return 0
    # (bfloat16's contract is the CPU's; float64 holds on a GPU too, where the engines take their GPU paths)
    ctx = parallel.initialize(ParallelConfig(backend="gloo" if args.dtype == "bfloat16" or layout else None))
    if layout:  # (a SIGTERM, as Ctrl-C, stops the processes across_layout launched)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if args.replay is not None:
        if layout:
            args.cases = 1
            results, errors = across_layout(args, archs, ctx)
            got = results[0] if results else {"errors": errors}
        else:
            got = run_case(args.replay, ctx, archs, args.dtype)
        print(json.dumps(got, indent=1))
        parallel.destroy()
        return 1 if got.get("failures") or got.get("errors") else 0
    results, errors = across_layout(args, archs, ctx) if layout else in_process(args, archs, ctx)
    parallel.destroy()
    failures = [{"seed": x["seed"], **f, "case": x["case"]} for x in results for f in x["failures"]]
    coverage: dict[str, dict[str, int]] = {}
    for x in results:
        for k, v in x["case"].items():
            if k not in ("prompt_tokens", "max_new_tokens"):  # (drawn from wide ranges)
                coverage.setdefault(k, Counter())[str(v)] += 1
    taus = sorted(x["tau"] for x in results if x["tau"] is not None)
    report = {"cases": len(results) + len(errors), "failures": failures, "errors": errors,
              "minutes": args.minutes, "seed": args.seed, "archs": archs, "dtype": args.dtype,
              "layout": {"tp": args.tp, "pp": args.pp, "ep": args.ep, "first_stage_layers": args.first_stage_layers},
              "tau": {"median": statistics.median(taus), "max": taus[-1],
                      "cases_over_2": sum(t > 2 for t in taus), "cases_over_3": sum(t > 3 for t in taus)}
              if taus else None,
              "coverage": {k: dict(sorted(v.items())) for k, v in coverage.items()}}
    over = []
    if args.dtype == "float32":
        parted, over = parted_share(results)
        report.update(parted=parted, bound=FLOAT32_PARTED_BOUND, over_bound=over,
                      parted_responses=[{"seed": x["seed"], **y} for x in results for y in x["parted"]])
        print("responses parted by near-ties: " + "; ".join(f"{name} {v['parted']} of {v['responses']}"
                                                           for name, v in parted.items()))
    write_json_atomic(args.out, report)
    print(f"{report['cases']} cases, {len(failures)} failures, {len(errors)} errors; SpecRoll's tokens per step: "
          f"{report['tau']}; wrote {args.out}")
    return 1 if failures or errors or over else 0


if __name__ == "__main__":
    sys.exit(main())
