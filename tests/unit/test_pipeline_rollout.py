"""Rollouts in groups interleaved over pipeline stages (rollout/base.run_groups) and uneven pipeline
splits (ParallelConfig.num_layers_in_first/last_pipeline_stage).

The schedule is checked on simulated stages (threads that pass activations through queues and meet
in barriers for each broadcast, as the real stages do through gloo): no deadlock and the same
broadcast order on every stage, whatever the stage count, group count and group lifetimes. The
engines are checked against one group (tokens identical); the real PP=2 runs are in
tests/dist/test_layouts.py."""

import contextlib
import queue
import random
import threading
from types import SimpleNamespace

import pytest
import torch

from specroll_mcore import parallel
from specroll_mcore.checkpoint import random_full_state_dict
from specroll_mcore.checkpoint.megatron import (load_full_state_dict, load_local_state_dict,
                                                read_checkpoint_config, write_checkpoint_files)
from specroll_mcore.checkpoint.shard import local_state_dict
from specroll_mcore.config import ParallelConfig, SamplingConfig, SpecConfig, pipeline_split, tiny_llama
from specroll_mcore.model import PolicyModel
from specroll_mcore.rollout import SpeculativeEngine, VanillaEngine
from specroll_mcore.rollout.base import num_groups, run_groups, split_groups

PROMPTS = [[11, 12, 13, 14], [21], [31, 32, 33, 34, 35, 36, 37], [5, 6]]


class _Send:
    """A send in flight between simulated stages: its wait() returns once the receiver took it."""

    def __init__(self) -> None:
        self.taken = threading.Event()

    def wait(self) -> None:
        assert self.taken.wait(timeout=5), "a send never received: the stages wait on each other"


def simulate(pp: int, k: int, lifetimes: list[int], prefills: frozenset = frozenset(),
             steps_in_flight: bool = True, monkeypatch=None) -> list[list[tuple[str, int]]]:
    """Run run_groups on ``pp`` simulated stages; group g lives for lifetimes[g] steps. Returns each
    stage's log of (event, group-step): 'F' forwards, 'B' broadcasts (advances). The group-steps
    ``(g, step)`` in ``prefills`` run two forwards (a prefill, then the step) and send twice; sends
    go through ParallelContext's own post_forward / forward_step / flush_sends (with
    ``steps_in_flight`` False, forward_step does nothing: one send in flight at a time)."""
    barriers: dict[int, threading.Barrier] = {}
    lock = threading.Lock()
    links = [queue.Queue() for _ in range(pp)]  # links[s]: activations into stage s
    logs: list[list[tuple[str, int]]] = [[] for _ in range(pp)]
    errors: list[BaseException] = []
    if monkeypatch is not None:  # (the stages' sends in flight kept apart from the process's own)
        monkeypatch.setattr(parallel, "_IN_FLIGHT", {})

        def isend(tensor, dst):
            work = _Send()
            links[dst].put((tuple(tensor.tolist()), work))
            return work

        monkeypatch.setattr(parallel.dist, "isend", isend)

    def stage(s: int) -> None:
        steps = [0] * k  # advances done per group
        counter = {"f": 0, "b": 0}
        ctx = SimpleNamespace(pp_size=pp, pp_rank=s, pp_ranks=list(range(pp)), _sends=[], _step_start=None)
        for name in ("post_forward", "flush_sends") + (("forward_step",) if steps_in_flight else ()):
            setattr(ctx, name, getattr(parallel.ParallelContext, name).__get__(ctx))
        if not steps_in_flight:
            ctx.forward_step = contextlib.nullcontext
        if monkeypatch is None:  # sends that never block
            ctx.post_forward, ctx.flush_sends = (lambda t: links[s + 1].put((tuple(t.tolist()), _Send()))), lambda: None

        def forward(g: int) -> None:
            for part in range(2 if (g, steps[g]) in prefills else 1):
                if s > 0:
                    got, work = links[s].get(timeout=5)  # blocks like recv_forward
                    work.taken.set()
                    assert got == (g, steps[g], part), (s, got, (g, steps[g], part))
                if s < pp - 1:
                    ctx.post_forward(torch.tensor([g, steps[g], part]))
            logs[s].append(("F", g))
            counter["f"] += 1

        def advance(g: int) -> None:
            n = counter["b"]
            with lock:
                barrier = barriers.setdefault(n, threading.Barrier(pp, timeout=5))
            barrier.wait()  # the broadcast: every stage, same order
            logs[s].append(("B", g))
            counter["b"] += 1
            steps[g] += 1

        try:
            run_groups(lambda g: steps[g] < lifetimes[g], k, ctx, forward, advance)
        except BaseException as e:  # noqa: BLE001  (reported by the test)
            errors.append(e)

    threads = [threading.Thread(target=stage, args=(s,)) for s in range(pp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    return logs


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_interleaved_groups_never_deadlock_and_broadcast_in_one_order(pp, k):
    rng = random.Random(pp * 10 + k)
    for _ in range(3):
        lifetimes = [rng.randint(0, 7) for _ in range(k)]
        logs = simulate(pp, k, lifetimes)
        orders = [[g for e, g in log if e == "B"] for log in logs]
        assert all(o == orders[0] for o in orders)
        assert sorted(orders[0]) == sorted(g for g in range(k) for _ in range(lifetimes[g]))
        for log in logs:  # every forward is followed by its advance
            assert sum(e == "F" for e, _ in log) == sum(lifetimes)


@pytest.mark.parametrize("pp", [2, 3])
@pytest.mark.parametrize("k", [2, 3])
def test_steps_that_prefill_and_decode_keep_both_sends_in_flight(pp, k, monkeypatch):
    """Continuous batching: a group-step that prefills admitted prompts sends twice. The next stage
    takes both only in its own step, after this stage's next broadcast: with one send in flight at a
    time (waiting for the prefill's before posting the step's) the stages wait on each other."""
    rng = random.Random(pp * 10 + k)
    lifetimes = [6] * k
    prefills = frozenset((g, step) for g in range(k) for step in range(6) if rng.random() < 0.4) | {(0, 2)}
    logs = simulate(pp, k, lifetimes, prefills, monkeypatch=monkeypatch)
    assert all(sum(e == "B" for e, _ in log) == 6 * k for log in logs)
    if (pp, k) == (2, 2):  # (a deadlock shows after the simulation's timeouts: once is enough)
        with pytest.raises(AssertionError, match="the stages wait on each other"):
            simulate(pp, k, lifetimes, prefills, steps_in_flight=False, monkeypatch=monkeypatch)


class _Group:
    """A collective of simulated ranks (threads): every member's call returns once all have called it."""

    def __init__(self, size: int) -> None:
        self.values: list[torch.Tensor] = []
        self.lock = threading.Lock()
        self.arrived = threading.Barrier(size, action=self._sum, timeout=5)
        self.read = threading.Barrier(size, timeout=5)

    def _sum(self) -> None:
        self.total, self.values = torch.stack(self.values).sum(0), []

    def abort(self) -> None:
        self.arrived.abort()
        self.read.abort()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.values.append(tensor.clone())
        try:
            self.arrived.wait()
            tensor.copy_(self.total)
            self.read.wait()
        except threading.BrokenBarrierError:
            raise AssertionError("a collective never completed: the ranks wait on each other") from None
        return tensor


def simulate_replicas(pp: int, k: int, lifetimes: list[list[int]], pieces: list[dict], barrier: bool = True) -> dict:
    """Expert-parallel replicas (one per entry of ``lifetimes``, their groups' lifetimes) of ``pp``
    simulated stages each, through the rollouts' schedule: a first prefill, then run_groups. Each
    forward of a stage goes through PolicyModel's own lockstep (its count over the stage's EP group,
    then a collective of that group for its MoE layers; an idle rank's dummy forward joins that
    collective); replica r's prefill of its group-step ``(g, step)`` (``"start"``: the first prefill)
    takes ``pieces[r][(g, step)]`` forwards more. ``barrier`` False: PolicyModel.lockstep_barrier
    is not called. Returns the forwards each (replica, stage) ran, its idle ones apart."""
    R = len(lifetimes)
    ep_groups = [_Group(R) for _ in range(pp)]
    pp_groups = [_Group(pp) for _ in range(R)]
    links = {(r, s): queue.Queue() for r in range(R) for s in range(pp)}
    ran: dict = {}
    errors: list[BaseException] = []

    def rank(r: int, s: int) -> None:
        moe = lambda: ep_groups[s].all_reduce(torch.zeros(1))  # noqa: E731  (a MoE layer's all-to-all)
        ctx = SimpleNamespace(ep_size=R, pp_size=pp, device=torch.device("cpu"),
                              all_reduce_ep=lambda t, op="sum": ep_groups[s].all_reduce(t))
        idle = []
        model = SimpleNamespace(ctx=ctx, _lockstep=False, _idle_forward=lambda: (idle.append(1), moe()))
        for name in ("expert_lockstep", "lockstep_barrier", "_lockstep_count"):
            setattr(model, name, getattr(PolicyModel, name).__get__(model))
        steps, forwards = [0] * k, []

        def stage_forward(what) -> None:
            if s > 0:
                assert links[r, s].get(timeout=5) == what
            model._lockstep_count(forward=True)
            moe()
            forwards.append(what)
            if s < pp - 1:
                links[r, s + 1].put(what)

        def forward(g: int) -> None:
            for part in range(pieces[r].get((g, steps[g]), 0) + 1):
                stage_forward((g, steps[g], part))

        def advance(g: int) -> None:
            pp_groups[r].all_reduce(torch.zeros(1))  # the replica's broadcast of the step's tokens
            steps[g] += 1

        try:
            with model.expert_lockstep():
                for part in range(pieces[r].get("start", 1)):
                    stage_forward(("start", part))
                if barrier:
                    model.lockstep_barrier()
                pp_groups[r].all_reduce(torch.zeros(1))  # the first tokens
                run_groups(lambda g: steps[g] < lifetimes[r][g], k, SimpleNamespace(
                    pp_size=pp, pp_rank=s, forward_step=contextlib.nullcontext, flush_sends=lambda: None),
                    forward, advance, model.lockstep_barrier if barrier else lambda: None)
        except BaseException as e:  # noqa: BLE001  (reported by the test)
            errors.append(e)
            for group in ep_groups + pp_groups:  # (the others stop too)
                group.abort()
        ran[r, s] = (len(forwards), len(idle))

    threads = [threading.Thread(target=rank, args=(r, s)) for r in range(R) for s in range(pp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return ran


@pytest.mark.parametrize("pp, k, replicas", [(2, 2, 2), (2, 1, 2), (3, 3, 2), (2, 2, 3)])
def test_expert_parallel_replicas_pair_their_stages_forwards_without_deadlock(pp, k, replicas):
    """Expert parallelism over pipeline stages: replicas roll out different prompts, so their groups live
    for different numbers of steps and prefill admitted prompts in different numbers of pieces. Each
    stage's EP group pairs forwards step by step (PolicyModel.lockstep_barrier after each group-step and
    the first prefill); every rank runs as many forwards, its own or idle, as every other of its stage."""
    rng = random.Random(pp * 100 + k * 10 + replicas)
    for _ in range(4):
        lifetimes = [[rng.randint(0, 6) for _ in range(k)] for _ in range(replicas)]
        pieces = [{(g, step): rng.choice([0, 0, 1, 2]) for g in range(k) for step in range(6)}
                  | {"start": rng.randint(1, 3)} for _ in range(replicas)]
        ran = simulate_replicas(pp, k, lifetimes, pieces)
        for r in range(replicas):
            own = pieces[r]["start"] + sum(1 + pieces[r][g, step] for g in range(k) for step in range(lifetimes[r][g]))
            assert all(ran[r, s][0] == own for s in range(pp))
        for s in range(pp):
            assert len({sum(ran[r, s]) for r in range(replicas)}) == 1


def test_expert_parallel_replicas_without_the_barrier_deadlock():
    """The case the barrier is for (fuzz case 530465698's pattern): one replica prefills an admitted
    prompt in three pieces where the other decodes. Each stage's EP group then pairs forwards that
    one replica's pipeline runs before a broadcast and the other after its own, in a cycle."""
    lifetimes, pieces = [[4, 4], [4, 4]], [{(1, 1): 2, "start": 1}, {"start": 1}]
    ran = simulate_replicas(2, 2, lifetimes, pieces)
    assert all(ran[0, s] == (11, 0) and ran[1, s] == (9, 2) for s in range(2))  # (9 forwards of its own, 2 idle)
    with pytest.raises(AssertionError, match="the ranks wait on each other"):
        simulate_replicas(2, 2, lifetimes, pieces, barrier=False)


def test_first_stage_runs_ahead_by_one_group_per_later_stage():
    logs = simulate(2, 2, [3, 3])
    assert logs[0][:4] == [("F", 0), ("F", 1), ("B", 0), ("F", 0)]  # group 1 computes while group 0 samples
    assert logs[1][:4] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]


def test_rollout_groups_config(tiny_ckpt_for_groups, tmp_path, ctx):
    from specroll_mcore.config import TrainConfig, load_config
    from specroll_mcore.rl.trainer import GRPOTrainer

    with pytest.raises(ValueError, match=r"ParallelConfig.rollout_groups must be >= 1 .*got 0"):
        ParallelConfig(rollout_groups=0)
    cfg = load_config(TrainConfig, None, [f"checkpoint={tiny_ckpt_for_groups}", f"output_dir={tmp_path / 'run'}",
                                          "engine=vanilla", "compare_vanilla_every=1", "parallel.rollout_groups=3",
                                          "data.limit=8", "prompts_per_step=2", "tensorboard=false"])
    trainer = GRPOTrainer(cfg)
    assert trainer.engine.groups == 3 and trainer.vanilla.groups == 3


@pytest.fixture(scope="module")
def tiny_ckpt_for_groups(tmp_path_factory):
    from grpo_fixtures import tiny_policy_checkpoint

    return tiny_policy_checkpoint(tmp_path_factory.mktemp("groups"), with_heads=False)


def test_groups_and_their_errors():
    assert num_groups(None, 4) == 4 and num_groups(1, 4) == 1
    with pytest.raises(ValueError, match="pipeline_groups must be at least 1"):
        num_groups(0, 2)
    groups = split_groups(torch.arange(7), 3)
    assert [g.tolist() for g in groups] == [[0, 3, 6], [1, 4], [2, 5]]


@pytest.fixture(scope="module")
def policy(ctx):
    cfg = tiny_llama(params_dtype="float64")
    model = PolicyModel(cfg, ctx, num_heads=3).eval()
    model.load_full_state_dict(random_full_state_dict(cfg, seed=7, std=0.08))
    return model


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_groups_emit_the_tokens_of_one_group(policy, temperature):
    sp = SamplingConfig(temperature=temperature, top_p=0.9, max_new_tokens=12, num_samples=3, seed=5)
    ref = VanillaEngine(policy, eos_token_ids=[3], pipeline_groups=1).generate(PROMPTS, sp, features_topk=4)
    got = VanillaEngine(policy, eos_token_ids=[3], pipeline_groups=3).generate(PROMPTS, sp, features_topk=4)
    assert got.tokens == ref.tokens and got.finish_reason == ref.finish_reason
    for a, b in zip(got.logprobs, ref.logprobs):  # (float64; smaller batches round products otherwise)
        assert torch.allclose(a, b, atol=1e-9)
    for a, b in zip(got.features, ref.features):
        assert torch.equal(a.top_ids, b.top_ids) and torch.allclose(a.hidden, b.hidden, atol=1e-9)
    assert got.stats["forwards"] > ref.stats["forwards"]  # 3 groups: 3 forwards per round
    spec = SpeculativeEngine(policy, SpecConfig(c_hw=12), eos_token_ids=[3], pipeline_groups=2).generate(PROMPTS, sp)
    assert spec.tokens == ref.tokens and spec.stats["groups"] == 2
    for a, b in zip(spec.logprobs, ref.logprobs):
        assert torch.allclose(a, b, atol=1e-9)


def test_pipeline_split():
    assert pipeline_split(30, 2) == [15, 15]
    assert pipeline_split(30, 2, last=10) == [20, 10]
    assert pipeline_split(30, 2, first=18) == [18, 12]
    assert pipeline_split(10, 4, 1, 1) == [1, 4, 4, 1]
    assert pipeline_split(9, 3, last=1) == [4, 4, 1]
    assert ParallelConfig(pipeline_model_parallel_size=2, num_layers_in_last_pipeline_stage=1).stage_layers(4) == [3, 1]


@pytest.mark.parametrize("pp, first, last, layers, match", [
    (1, None, 2, 4, r"num_layers_in_last_pipeline_stage is set \(2\) but pipeline_model_parallel_size is 1"),
    (2, 0, None, 4, r"num_layers_in_first_pipeline_stage must be >= 1"),
    (2, 3, 3, 4, r"leave -2 of ModelConfig.num_layers \(4\) for the other 0 stage\(s\).*must add up to 4"),
    (4, 1, 1, 9, r"leave 7 of ModelConfig.num_layers \(9\) for the other 2 stage\(s\): they must share them evenly"),
    (2, None, 4, 4, r"leave 0 of ModelConfig.num_layers \(4\) for the other 1 stage\(s\)"),
    (3, None, None, 4, r"num_layers \(4\) is not divisible by .*pipeline_model_parallel_size \(3\); set "
                       r"num_layers_in_first_pipeline_stage"),
])
def test_pipeline_split_errors(pp, first, last, layers, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(pipeline_model_parallel_size=pp, num_layers_in_first_pipeline_stage=first,
                       num_layers_in_last_pipeline_stage=last).validate(tiny_llama(num_layers=layers), pp)


def test_uneven_checkpoint_shards_round_trip(tmp_path):
    cfg = tiny_llama()
    full = random_full_state_dict(cfg, seed=3)
    write_checkpoint_files(tmp_path / "ckpt", full, cfg, 1, 2, stage_layers=[3, 1])
    assert read_checkpoint_config(tmp_path / "ckpt")["pipeline_stage_layers"] == [3, 1]
    back = load_full_state_dict(tmp_path / "ckpt")
    assert set(back) == set(full) and all(torch.equal(back[k], full[k]) for k in full)
    last = load_local_state_dict(tmp_path / "ckpt", cfg, 1, 0, 2, 1, [3, 1])
    assert torch.equal(last["decoder.layers.0.mlp.linear_fc1.weight"], full["decoder.layers.3.mlp.linear_fc1.weight"])
    assert last.keys() == local_state_dict(full, cfg, 1, 0, 2, 1, [3, 1]).keys()
    assert load_local_state_dict(tmp_path / "ckpt", cfg, 1, 0, 2, 1) is None  # an even split reshards


def test_converter_writes_an_uneven_split(tmp_path, capsys):
    import transformers

    from specroll_mcore.cli import main

    hf_cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(hf_cfg).save_pretrained(tmp_path / "hf")
    assert main(["convert", "hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "mc"), "--pp", "2",
                 "--first-stage-layers", "1"]) == 0
    assert read_checkpoint_config(tmp_path / "mc")["pipeline_stage_layers"] == [1, 3]
    assert main(["convert", "hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "mc2"), "--pp", "2",
                 "--first-stage-layers", "4"]) == 2
    assert "leave 0 of ModelConfig.num_layers (4) for the other 1 stage(s)" in capsys.readouterr().err
    assert not (tmp_path / "mc2").exists()


@pytest.mark.parametrize("name, config, shape, world", [
    ("demo_cpu.yaml", "generate", None, 1),
    ("smollm2_gsm8k_cpu.yaml", "train", None, 1),
    # Qwen2.5-7B-Instruct and Qwen2.5-14B shapes (their config.json), on 8 and 4 x 8 GPUs
    ("qwen2.5_7b_gsm8k_1node.yaml", "train", dict(num_layers=28, hidden_size=3584, ffn_hidden_size=18944,
                                                  num_attention_heads=28, num_query_groups=4), 8),
    ("qwen2.5_14b_dapo_multinode.yaml", "train", dict(num_layers=48, hidden_size=5120, ffn_hidden_size=13824,
                                                      num_attention_heads=40, num_query_groups=8), 32),
    # Qwen3-8B (its config.json: head_dim 128 of 32 query and 8 KV heads, q/k norms), on 8 GPUs
    ("qwen3_8b_dapo_1node.yaml", "train", dict(num_layers=36, hidden_size=4096, ffn_hidden_size=12288,
                                               num_attention_heads=32, num_query_groups=8, kv_channels=128,
                                               qk_layernorm=True, rope_theta=1e6), 8),
    # Qwen3-30B-A3B (its config.json: 128 experts of width 768, 8 a token), on 4 x 8 GPUs
    ("qwen3_30b_a3b_dapo_multinode.yaml", "train", dict(num_layers=48, hidden_size=2048, ffn_hidden_size=6144,
                                                       num_attention_heads=32, num_query_groups=4, kv_channels=128,
                                                       qk_layernorm=True, rope_theta=1e6, num_experts=128,
                                                       moe_router_topk=8, moe_ffn_hidden_size=768), 32),
])
def test_example_configs_load_and_fit_their_models(name, config, shape, world):
    from pathlib import Path

    from specroll_mcore.config import GenerateConfig, TrainConfig, load_config

    path = Path(__file__).resolve().parents[2] / "examples" / "configs" / name
    cfg = load_config(TrainConfig if config == "train" else GenerateConfig, str(path), [])
    if shape is not None:
        model = tiny_llama(**shape, vocab_size=152064, max_position_embeddings=32768)
        assert cfg.parallel.validate(model, world) >= 1
        if name.startswith("qwen2.5_14b"):
            assert cfg.parallel.stage_layers(48) == [26, 22]


@pytest.mark.parametrize("groups", [1, 3])
def test_rollouts_read_the_kv_cache_in_place(policy, groups, monkeypatch):
    """Responses finish at different steps, groups interleave by slot: every forward of either engine
    still finds its rows packed in its order (KVCache.pack when a group changes), so the cache never
    rearranges a request itself, and only the rows beyond a shrinking group move."""
    from specroll_mcore.model.kv_cache import KVCache

    arranged, moved = [], []
    rows, place = KVCache.rows, KVCache._place

    def checked_rows(self, slots):
        before = self.row_of[slots].clone()
        out = rows(self, slots)
        arranged.append(not torch.equal(before, torch.arange(*out)))
        return out

    def counted_place(self, slots, target):
        moved.append(len(slots))
        return place(self, slots, target)

    monkeypatch.setattr(KVCache, "rows", checked_rows)
    monkeypatch.setattr(KVCache, "_place", counted_place)
    sp = SamplingConfig(temperature=1.0, max_new_tokens=12, num_samples=3, seed=5)
    out = VanillaEngine(policy, eos_token_ids=[3], pipeline_groups=groups).generate(PROMPTS, sp)
    assert len({len(t) for t in out.tokens}) > 1 and "eos" in out.finish_reason  # ragged
    SpeculativeEngine(policy, SpecConfig(c_hw=12), eos_token_ids=[3], pipeline_groups=groups).generate(PROMPTS, sp)
    assert arranged and not any(arranged)
    assert max(moved) <= len(out.tokens) // 2  # whole groups never move together
