"""Every bad input a user can hit gets a clear error naming the values involved."""

import dataclasses
import re

import pytest
import torch

from conftest import make_policy
from specroll_mcore import parallel
from specroll_mcore.config import ModelConfig, ParallelConfig, SamplingConfig, tiny_llama
from specroll_mcore.rollout import VanillaEngine


@pytest.fixture(scope="module")
def engine(ctx):
    return VanillaEngine(make_policy(tiny_llama(max_position_embeddings=32), ctx), eos_token_ids=[1])


def test_prompt_longer_than_context(engine):
    with pytest.raises(ValueError, match=r"prompt 1 has 40 tokens .*max_position_embeddings\) is 32"):
        engine.generate([[2, 3], [4] * 40], SamplingConfig(max_new_tokens=4))


def test_empty_prompt_list_and_empty_prompt(engine):
    with pytest.raises(ValueError, match="empty prompt list"):
        engine.generate([], SamplingConfig())
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        engine.generate([[]], SamplingConfig())


def test_token_id_outside_vocabulary(engine):
    with pytest.raises(ValueError, match=r"token id 300 outside the model vocabulary \[0, 300\)"):
        engine.generate([[5, 300]], SamplingConfig())


def test_duplicate_prompt_ids(engine):
    with pytest.raises(ValueError, match="prompt_ids must be unique"):
        engine.generate([[5], [6]], SamplingConfig(), prompt_ids=[3, 3])
    with pytest.raises(ValueError, match="prompt_ids has 1 entries for 2 prompts"):
        engine.generate([[5], [6]], SamplingConfig(), prompt_ids=[3])


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.5), r"temperature must be >= 0, got -0.5"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (dict(top_k=-1), r"top_k must be >= 0"),
    (dict(min_p=-0.1), r"SamplingConfig.min_p must be in \[0, 1\] \(0 disables it\), got -0.1"),
    (dict(min_p=1.5), r"SamplingConfig.min_p must be in \[0, 1\] \(0 disables it\), got 1.5"),
    (dict(min_p=float("nan")), r"SamplingConfig.min_p must be in \[0, 1\] \(0 disables it\), got nan"),
    (dict(max_new_tokens=0), r"max_new_tokens must be >= 1"),
    (dict(num_samples=0), r"SamplingConfig.num_samples must be >= 1, got 0"),
    (dict(seed=-1), r"SamplingConfig.seed must be in \[0, 2\*\*32\), got -1"),
    (dict(seed=2**32), r"SamplingConfig.seed must be in \[0, 2\*\*32\), got 4294967296"),
    (dict(stop=["\n", ""]), r"SamplingConfig.stop must be non-empty strings, got \('\\n', ''\)"),
    (dict(temperature=float("nan")), r"temperature must be >= 0, got nan"),
])
def test_sampling_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def test_stop_strings_need_a_tokenizer(engine):
    with pytest.raises(ValueError, match="needs a tokenizer"):
        engine.generate([[5]], SamplingConfig(stop=["\n"]))


@pytest.mark.parametrize("tp, pp, world, match", [
    (2, 1, 3, r"world size 3 is not divisible by tensor_model_parallel_size \(2\) x "
              r"pipeline_model_parallel_size \(1\)"),
    (8, 1, 8, r"num_attention_heads \(4\) is not divisible by .*tensor_model_parallel_size \(8\)"),
    (4, 1, 4, r"num_query_groups \(2 KV heads\) is not divisible by .*tensor_model_parallel_size \(4\)"),
    (1, 3, 3, r"num_layers \(4\) is not divisible by .*pipeline_model_parallel_size \(3\)"),
    (2, 1, 2, r"tensor_model_parallel_size is 2 but the model is a mixture of experts \(ModelConfig.num_experts 4\)"),
])
def test_parallel_layout(tp, pp, world, match):
    cfg = tiny_llama(num_experts=4) if "experts" in match else tiny_llama()
    with pytest.raises(ValueError, match=match):
        ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp).validate(cfg, world)


def test_sequence_parallelism_needs_tensor_parallelism_and_an_even_split(engine):
    with pytest.raises(ValueError, match=r"ParallelConfig.sequence_parallel .* tensor_model_parallel_size is 1"):
        ParallelConfig(sequence_parallel=True)
    # a forward whose positions do not split evenly over the TP ranks (the check comes before any
    # communication, so one process stands for TP=2)
    policy = engine.model
    ctx = policy.ctx
    policy.ctx = dataclasses.replace(ctx, tp_size=2, sequence_parallel=True)
    try:
        ids = torch.tensor([[5, 6, 7]])
        meta = policy.metadata(torch.arange(3)[None], None)
        with policy.sequence_parallel(), pytest.raises(ValueError, match=r"sequence parallelism splits the "
                                                                          r"sequence over the 2 .* has 3 positions"):
            policy.stage_forward(ids, meta)
    finally:
        policy.ctx = ctx
    assert not policy._sequence_parallel
    assert not any(getattr(m, "sequence_parallel", False) or getattr(m, "reduce_scatter_embeddings", False)
                   for m in policy.gpt.modules())  # all restored


@pytest.mark.parametrize("experts, ep, world, match", [
    (None, 2, 2, r"expert_model_parallel_size is 2 but the model has no experts"),
    (6, 4, 4, r"num_experts \(6\) is not divisible by ParallelConfig.expert_model_parallel_size \(4\)"),
    (4, 2, 3, r"data-parallel size \(3 = world size 3 / \(TP 1 x PP 1\)\) is not divisible by "
              r"ParallelConfig.expert_model_parallel_size \(2\)"),
    (4, 0, 2, r"expert_model_parallel_size must be >= 1, got 0"),
])
def test_expert_parallel_layout(experts, ep, world, match):
    cfg = tiny_llama(num_experts=experts) if experts else tiny_llama()
    with pytest.raises(ValueError, match=match):
        ParallelConfig(expert_model_parallel_size=ep).validate(cfg, world)


def test_a_policy_is_not_built_in_a_tensor_parallel_layout_its_experts_cannot_take():
    """A checkpoint converted at TP=1 loads into any layout (resharded): not a mixture of experts at TP=2."""
    from types import SimpleNamespace

    from specroll_mcore.model.gpt import transformer_config

    with pytest.raises(ValueError, match=r"tensor_model_parallel_size is 2 but the model is a mixture of experts"):
        transformer_config(tiny_llama(num_experts=4), SimpleNamespace(tp_size=2, stage_layers=lambda n: [n]))


def test_initialize_rejects_a_layout_that_does_not_fit_the_world():
    with pytest.raises(ValueError, match="world size 1 is not divisible"):
        parallel.initialize(ParallelConfig(tensor_model_parallel_size=2), tiny_llama())
    with pytest.raises(ValueError, match=r"the data-parallel size \(1\) is not divisible by "
                                         r"expert_model_parallel_size \(2\)"):
        parallel.initialize(ParallelConfig(expert_model_parallel_size=2))  # (no model: tools that load one later)


def test_tokenizer_larger_than_vocabulary(ctx):
    class Tok:
        def __len__(self):
            return 301

    with pytest.raises(ValueError, match=r"tokenizer has 301 tokens but the model's vocabulary .* is 300"):
        VanillaEngine(make_policy(tiny_llama(), ctx), tokenizer=Tok())


def test_model_config_errors():
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) must be a multiple of .*num_query_groups \(4\)"):
        tiny_llama(num_attention_heads=6, num_query_groups=4)
    with pytest.raises(ValueError, match="params_dtype must be one of"):
        tiny_llama(params_dtype="float8")
    with pytest.raises(ValueError, match="ModelConfig.kv_channels must be even for RoPE, got 7"):
        tiny_llama(kv_channels=7)
    with pytest.raises(ValueError, match=r"hidden_size \(66\) is not divisible by num_attention_heads \(4\); set "
                                         r"ModelConfig.kv_channels explicitly"):
        tiny_llama(hidden_size=66, num_attention_heads=4, num_query_groups=2)
    with pytest.raises(ValueError, match=r"rope_type'\] must be one of \['linear', 'llama3', 'yarn'\], got 'dynamic'"):
        tiny_llama(rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    with pytest.raises(ValueError, match=r"of type 'yarn' lacks \['original_max_position_embeddings'\]"):
        tiny_llama(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match=r"'linear' does not take \['low_freq_factor'\]; it takes \['factor'\]"):
        tiny_llama(rope_scaling={"rope_type": "linear", "factor": 4.0, "low_freq_factor": 1.0})
    with pytest.raises(ValueError, match=r"rope_scaling\['truncate'\] must be true or false, got 'no'"):
        tiny_llama(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                 "truncate": "no"})
    with pytest.raises(ValueError, match=r"of type 'llama3' lacks \['high_freq_factor', 'low_freq_factor'\]"):
        tiny_llama(rope_scaling={"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192})
    with pytest.raises(ValueError, match=r"rope_scaling\['factor'\] must be a positive number, got 0"):
        tiny_llama(rope_scaling={"rope_type": "linear", "factor": 0})
    with pytest.raises(ValueError, match=r"high_freq_factor \(1.0\) must exceed low_freq_factor \(4.0\)"):
        tiny_llama(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                                 "original_max_position_embeddings": 8192})
    with pytest.raises(ValueError, match=r"unknown ModelConfig field\(s\) \['hidden'\]"):
        ModelConfig.from_dict({"hidden": 3})


@pytest.mark.parametrize("fields, match", [
    (dict(moe_router_topk=4), r"ModelConfig.moe_router_topk set but num_experts is not"),
    (dict(num_experts=1), r"num_experts must be at least 2, got 1"),
    (dict(num_experts=4, moe_router_topk=5), r"moe_router_topk \(5\) must be between 1 and num_experts \(4\)"),
    (dict(num_experts=4, moe_router_topk=1), r"moe_router_topk 1 with moe_norm_topk_prob true .* set "
                                             r"moe_norm_topk_prob false"),
    (dict(num_experts=4, moe_ffn_hidden_size=0), r"moe_ffn_hidden_size must be positive, got 0"),
    (dict(num_experts=4, moe_shared_expert_gate=True), r"moe_shared_expert_gate is set but there is no shared expert"),
])
def test_mixture_of_experts_config_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        tiny_llama(**fields)
    tiny_llama(num_experts=4, moe_router_topk=1, moe_norm_topk_prob=False)  # (Switch-style routing: fine)


def test_weights_that_do_not_fit_the_config(ctx):
    from specroll_mcore.checkpoint import random_full_state_dict

    model = make_policy(tiny_llama(), ctx)
    bad = random_full_state_dict(tiny_llama(ffn_hidden_size=96), 0)
    with pytest.raises(ValueError, match=r"mlp.linear_fc1.weight has shape \(192, 64\) but the model config "
                                         r"implies \(256, 64\)"):
        model.load_full_state_dict(bad)
    missing = random_full_state_dict(tiny_llama(), 0)
    del missing["decoder.layers.2.input_layernorm.weight"]
    with pytest.raises(ValueError, match="missing"):
        model.load_full_state_dict(missing)


def test_generate_config_errors(tmp_path):
    from specroll_mcore.config import load_generate_config

    with pytest.raises(ValueError, match=r"unknown field\(s\) \['sampling.temprature'\]"):
        load_generate_config(None, ["sampling.temprature=0.5"])
    with pytest.raises(ValueError, match="must look like key.sub=value"):
        load_generate_config(None, ["engine"])
    with pytest.raises(ValueError, match="GenerateConfig.engine must be 'vanilla' or 'specroll'"):
        load_generate_config(None, ["engine=beam"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("sampling:\n  top_p: 2.0\n")
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 2.0"):
        load_generate_config(str(bad))
    bad.write_text("sampling: 0.7\n")  # (meant sampling.temperature)
    with pytest.raises(ValueError, match="sampling must be a mapping of SamplingConfig's fields, got 0.7"):
        load_generate_config(str(bad))
    bad.write_text("- checkpoint: smollm2\n")
    with pytest.raises(ValueError, match="config must be a mapping, got list"):
        load_generate_config(str(bad))


def test_config_values_of_another_type_are_refused_by_name():
    """Every field's value is checked against its type, so that a wrong one is refused before it runs:
    a seed of 1.5 was used as given, ``prompts: Why?`` became one prompt per character, ``stop: Answer:``
    (a YAML mapping) stopped at any of its keys' characters and ``stop=####`` (a YAML comment, null)
    crashed in the trainer."""
    from specroll_mcore.config import TrainConfig, load_config, load_generate_config

    cfg = load_generate_config(None, ["prompts=Why is the sky blue?", "sampling.stop='####'", "sampling.temperature=1",
                                      "sampling.max_new_tokens=1e3", "spec.c_hw=32.0", "output="])
    assert cfg.prompts == ("Why is the sky blue?",) and cfg.sampling.stop == ("####",)  # one string: one item
    assert type(cfg.sampling.temperature) is float and cfg.sampling.max_new_tokens == 1000 and cfg.spec.c_hw == 32
    assert cfg.output is None
    for override, message in [
            ("sampling.seed=1.5", "sampling.seed must be an integer, got 1.5"),
            ("sampling.num_samples=true", "sampling.num_samples must be an integer, got True"),
            ("sampling.max_new_tokens=many", "sampling.max_new_tokens must be an integer, got 'many'"),
            ("sampling.top_p=[0.9]", "sampling.top_p must be a number, got [0.9]"),
            ("sampling.ignore_eos=1", "sampling.ignore_eos must be true or false, got 1"),
            ("spec.reflex.decay=[0.5, x]", "spec.reflex.decay must be a list of numbers, got [0.5, 'x']"),
            ("prompts=[1, 2]", "prompts must be a list of strings, got [1, 2]"),
            ("chat_template_kwargs=[1]", "chat_template_kwargs must be a mapping, got [1]"),
            ("spec.c_hw=lots", "spec.c_hw must be an integer or null, got 'lots'"),
            ("sampling.stop=Answer:", "sampling.stop must be a list of strings, got {'Answer': None} (a mapping: "
                                      "YAML reads unquoted 'text: ...' as one, so quote the value; or a --set key "
                                      "that goes past sampling.stop)"),
            ("spec.reflex.decay.0=0.4", "spec.reflex.decay must be a list of numbers, got {'0': 0.4} (a mapping"),
            ("sampling.stop=####", "override sampling.stop=####: YAML reads a value starting with '#' as a comment; "
                                   "quote it: sampling.stop=\'\"####\"\'"),
            ("spec=5", "spec must be a mapping of SpecConfig's fields, got 5")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            load_generate_config(None, [override])
    with pytest.raises(ValueError, match=re.escape("override sampling.seed=2: sampling is not a section (it was set "
                                                   "to 3)")):
        load_generate_config(None, ["sampling=3", "sampling.seed=2"])
    with pytest.raises(ValueError, match=re.escape("eval.batch_prompts must be an integer, got 'all'")):
        load_config(TrainConfig, None, ["eval.batch_prompts=all"])
    for name in ("SIGKILL", "TERM", "SIGNOPE", "SIG_DFL"):
        with pytest.raises(ValueError, match=f"TrainConfig.exit_signal must name a signal a process can catch .* got "
                                             f"'{name}'"):
            load_config(TrainConfig, None, [f"exit_signal={name}"])
    assert load_config(TrainConfig, None, ["exit_signal=null"]).exit_signal is None
    with pytest.raises(ValueError, match=re.escape("EvalConfig.sampling.num_samples 4 at temperature 0 samples the "
                                                   "same greedy response 4 times")):
        load_config(TrainConfig, None, ["eval.sampling.num_samples=4"])
    assert load_config(TrainConfig, None, ["eval.sampling.num_samples=4",
                                           "eval.sampling.temperature=0.6"]).eval.sampling.num_samples == 4


def test_spec_config_errors():
    from specroll_mcore.config import SpecConfig

    with pytest.raises(ValueError, match=r"SpecConfig.shortlist \(2\) must be >= SpecConfig.topk \(4\)"):
        SpecConfig(shortlist=2)
    with pytest.raises(ValueError, match=r"need 1 <= SpecConfig.n_min \(4\) <= SpecConfig.n_max \(2\)"):
        SpecConfig(n_min=4, n_max=2)
    with pytest.raises(ValueError, match=r"SpecConfig.probe_every must be >= 0 \(0: never\), got -1"):
        SpecConfig(probe_every=-1)


def test_missing_local_dataset_names_the_field(tmp_path):
    from specroll_mcore.rl.data import load_examples

    for source in (str(tmp_path / "gsm8k.jsonl"), "./no_such_dir", "train.parquet"):
        with pytest.raises(FileNotFoundError, match=r"data.source .*no such file or directory; give an existing"):
            load_examples(source)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no .json/.jsonl/.parquet files under"):
        load_examples(str(tmp_path / "empty"))


def test_which_layout_changes_a_resume_reshards_and_which_it_refuses():
    """A resume at another layout reshards the training state, but not one whose optimizer state does
    not name its parameters; the data-parallel size matters only where the optimizer's states are
    split over it."""
    from specroll_mcore.checkpoint.train_state import layout_changes, reshard_refusal

    saved = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "pipeline_stage_layers": [4],
             "data_parallel_size": 1, "expert_model_parallel_size": 1, "shard_optimizer": False,
             "named_optimizer_state": True}
    assert layout_changes(saved, {**saved, "data_parallel_size": 4}) == []
    assert layout_changes(saved, {**saved, "data_parallel_size": 4, "shard_optimizer": True}) == [
        "shard_optimizer False -> True", "data_parallel_size 1 -> 4"]
    assert layout_changes(saved, {**saved, "tensor_model_parallel_size": 1}) == ["tensor_model_parallel_size 2 -> 1"]
    assert layout_changes(saved, {**saved, "expert_model_parallel_size": 2}) == ["expert_model_parallel_size 1 -> 2"]
    assert reshard_refusal(saved, {**saved, "tensor_model_parallel_size": 1, "expert_model_parallel_size": 2}) is None
    why = reshard_refusal({**saved, "named_optimizer_state": False}, saved)
    assert "its optimizer state does not name its parameters; resume with the layout it was saved with" in why


@pytest.mark.parametrize("fields, match", [
    (["steps=0"], "TrainConfig.steps must be >= 1, got 0"),
    (["prompts_per_step=0"], "TrainConfig.prompts_per_step must be >= 1, got 0"),
    (["micro_batch_size=0"], "TrainConfig.micro_batch_size must be >= 1, got 0"),
    (["engine=medusa"], "TrainConfig.engine must be 'vanilla' or 'specroll', got 'medusa'"),
    (["lr=0"], "TrainConfig.lr must be > 0, got 0"),
    (["clip_low=1.0"], r"TrainConfig.clip_low must be in \[0, 1\) and clip_high >= 0, got 1.0, 0.2"),
    (["clip_high=-0.1"], r"TrainConfig.clip_low must be in \[0, 1\) and clip_high >= 0, got 0.2, -0.1"),
    (["kl_beta=-0.01"], "TrainConfig.kl_beta must be >= 0, got -0.01"),
    (["offload_reference=true"], r"TrainConfig.offload_reference keeps the KL term's reference weights in host "
                                 r"memory, but kl_beta is 0 \(no reference is kept\): set kl_beta > 0 or "
                                 r"offload_reference false"),
    (["save_every=0"], "TrainConfig.save_every and keep_last must be >= 1, got 0, "),
    (["keep_last=0"], "TrainConfig.save_every and keep_last must be >= 1, got .*, 0"),
    (["spec.num_heads=0"], "SpecConfig.num_heads must be >= 1, got 0"),
    (["spec.topk=0"], "SpecConfig.topk must be >= 1, got 0"),
    (["spec.draft_vocab=2"], r"SpecConfig.draft_vocab \(2\) must be 0 \(the whole vocabulary\) or at least the "
                             r"candidates a head proposes, max\(SpecConfig.topk, reflex.support_topk\) = "),
    (["spec.c_hw=0"], "SpecConfig.c_hw must be >= 1, got 0"),
    (["spec.reflex.decay=[0.5, 1.0]"], r"ReflexConfig.decay must be values in \[0, 1\), got \(0.5, 1.0\)"),
    (["spec.reflex.alpha=-0.1"], "ReflexConfig.alpha must be >= 0, got -0.1"),
    (["spec.reflex.z_delta=-1"], "ReflexConfig.z_delta must be >= 0, got -1"),
    (["spec.reflex.min_observations=1"], "ReflexConfig.min_observations must be >= 2, got 1"),
    (["spec.reflex.support_topk=0"], "ReflexConfig.support_topk must be >= 1, got 0"),
    (["spec.reflex.coverage_weight=-1"], "ReflexConfig.coverage_weight must be >= 0, got -1"),
    (["spec.slow_path.window=0"], "SlowPathConfig.window must be >= 1, got 0"),
    (["spec.slow_path.cooldown_batches=-1"], "SlowPathConfig.cooldown_batches must be >= 0, got -1"),
    (["spec.slow_path.tolerance=1"], r"SlowPathConfig.tolerance must be in \(0, 1\), got 1"),
    (["spec.slow_path.holdout_fraction=1"], r"SlowPathConfig.holdout_fraction must be in \(0, 1\), got 1"),
    (["spec.slow_path.buffer_size=8", "spec.slow_path.max_records=16"],
     r"SlowPathConfig.max_records \(16\) must be <= buffer_size \(8\)"),
    (["spec.slow_path.rank_weight=-1"], "SlowPathConfig.rank_weight must be >= 0, got -1"),
    (["spec.slow_path.lr=0"], r"SlowPathConfig.lr must be > 0, got 0.0 \(a rate of 0 would run events that change "
                              r"nothing: switch the slow path off with enabled: false\)"),
    (["parallel.backend=mpi"], "ParallelConfig.backend must be None, 'gloo' or 'nccl', got 'mpi'"),
])
def test_train_config_fields_name_what_is_wrong(fields, match):
    """Each field a run's YAML or --set can give a bad value: refused on loading, with the field's name,
    the bound and the value given."""
    from specroll_mcore.config import TrainConfig, load_config

    with pytest.raises(ValueError, match=match):
        load_config(TrainConfig, None, fields)


def test_generate_config_needs_prompts():
    from specroll_mcore.config import load_generate_config

    with pytest.raises(ValueError, match="GenerateConfig.prompts is empty; give at least one prompt"):
        load_generate_config(None, ["prompts=[]"])
    with pytest.raises(ValueError, match="GenerateConfig.engine must be 'vanilla' or 'specroll', got 'fast'"):
        load_generate_config(None, ["prompts=hello", "engine=fast"])
