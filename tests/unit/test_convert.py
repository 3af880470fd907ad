"""HF <-> Megatron conversion: logits parity with transformers, bit-exact round trip, bad input."""

import json
import re
import shutil

import pytest
import torch
import transformers

from hf_fixtures import LLAMA3_SCALING, save_tiny_hf, tiny_hf_config
from specroll_mcore.checkpoint import convert
from specroll_mcore.checkpoint.hf import fuse_qkv, model_config_from_hf, split_qkv
from specroll_mcore.checkpoint.megatron import (CONFIG_FILE, TRACKER_FILE, load_full_state_dict, load_heads,
                                                load_policy, save_heads)
from specroll_mcore.config import SamplingConfig
from specroll_mcore.model import causal_mask
from specroll_mcore.rollout import VanillaEngine

CASES = [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True), ("qwen3", False), ("qwen3", True),
         ("llama3", False), ("mistral", False), ("qwen2_yarn", True), ("phi3", False), ("qwen3_moe", False),
         ("qwen2_moe", True), ("mixtral", False)]


def our_logits(policy, ids):
    s = ids.shape[1]
    meta = policy.metadata(torch.arange(s)[None].expand(ids.shape[0], s), causal_mask(ids.shape[0], s, ids.device))
    return policy.full_logits(policy(ids, meta))


@pytest.mark.parametrize("arch, tied", CASES)
def test_logits_and_greedy_parity_with_transformers(tmp_path, ctx, arch, tied):
    hf = save_tiny_hf(tmp_path / "hf", arch, tied)
    out = convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "mcore")
    policy = load_policy(out, ctx)
    ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf(ids).logits - our_logits(policy, ids)).abs().max().item()
    print(f"{arch} tied={tied}: max |logits diff| = {diff:.2e}")
    assert diff < 1e-4  # float32; HF computes RoPE tables in float32 as we do
    prompts = [[5, 6, 7, 8], [9, 10]]
    ours = VanillaEngine(policy).generate(prompts, SamplingConfig(temperature=0, max_new_tokens=12, ignore_eos=True))
    for p, toks in zip(prompts, ours.tokens):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(p):]
        assert ref.tolist() == toks


@pytest.mark.parametrize("arch, safe", [("qwen2", True), ("qwen2", False), ("qwen3", True), ("llama3", True),
                                        ("phi3", True), ("qwen2_moe", True), ("mixtral", True)])
def test_round_trip_is_bit_exact(tmp_path, arch, safe):
    hf = save_tiny_hf(tmp_path / "hf", arch, tied=False, safe=safe)
    tp = 1 if arch in ("qwen2_moe", "mixtral") else 2  # (mixtures of experts: TP 1, ParallelConfig.validate)
    convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", tensor_parallel_size=tp, pipeline_parallel_size=2)
    assert (tmp_path / f"mcore/release/mp_rank_0{tp - 1}_001/model_optim_rng.pt").is_file()
    convert.convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    ref, got = hf.state_dict(), back.state_dict()
    assert set(ref) == set(got)
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


def test_export_records_the_dtype_its_weights_have(tmp_path):
    """A float32 source converted to bfloat16 exports bfloat16 weights, and its config must say so under
    the name transformers >= 4.56 reads (`dtype`, which the source config holds as float32)."""
    save_tiny_hf(tmp_path / "hf", "qwen2", False)
    assert json.loads((tmp_path / "hf/config.json").read_text())["dtype"] == "float32"
    convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", params_dtype="bfloat16")
    convert.convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back")
    config = json.loads((tmp_path / "back/config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype="auto")
    assert {p.dtype for p in back.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "qwen2_yarn", "qwen3", "qwen3_moe", "qwen2_moe",
                                  "mixtral"])
def test_config_written_back_describes_the_same_model(arch):
    """A checkpoint without its source's config.json (trained from a random init, say) is written
    back with one made from its ModelConfig: transformers reads it as the same architecture."""
    model = model_config_from_hf(tiny_hf_config(arch, tied=False))
    back = transformers.AutoConfig.for_model(**convert._hf_config_from_model(model))
    assert type(back) is type(tiny_hf_config(arch, tied=False))
    assert model_config_from_hf(back) == model


@pytest.mark.parametrize("moe", [dict(qk_layernorm=True, kv_channels=24), {}, dict(moe_norm_topk_prob=False),
                                 dict(add_qkv_bias=True, moe_shared_expert_ffn_hidden_size=32,
                                      moe_shared_expert_gate=True)],
                         ids=["qwen3_moe", "mixtral", "qwen2_moe", "qwen2_moe_shared"])
# (transformers warns when it initialises the zero-width shared expert of the export without one)
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op:UserWarning")
def test_mixture_of_experts_without_its_source_config_exports_the_same_model(tmp_path, ctx, moe):
    """A checkpoint of a mixture of experts with no source config.json (a random init, say) is
    written back as the architecture its ModelConfig describes, transformers loads every weight of it
    from the checkpoint and computes its logits; the export converts back to the same checkpoint."""
    from specroll_mcore.checkpoint import random_full_state_dict
    from specroll_mcore.checkpoint.megatron import write_checkpoint_files
    from specroll_mcore.config import tiny_llama

    cfg = tiny_llama(num_layers=2, vocab_size=320, num_experts=4, moe_ffn_hidden_size=48, norm_eps=1e-6, **moe)
    write_checkpoint_files(tmp_path / "mcore", random_full_state_dict(cfg, 0, std=0.08), cfg, 1, 1)
    (tmp_path / "mcore/latest_checkpointed_iteration.txt").write_text("release")
    convert.convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "hf")
    # (a Qwen2-MoE without a shared expert: one of zero width, as transformers' always has one)
    hf, loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not loaded["missing_keys"] and not loaded["unexpected_keys"], loaded
    ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf.eval()(ids).logits - our_logits(load_policy(tmp_path / "mcore", ctx), ids)).abs().max().item()
    assert diff < 1e-4, f"{type(hf).__name__}: {diff:.2e}"
    back, start = (load_full_state_dict(convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "back")),
                   load_full_state_dict(tmp_path / "mcore"))
    assert start.keys() == back.keys() and all(torch.equal(start[k], back[k]) for k in start)


YARN_VARIANTS = [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen3's recipe
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2,
     "truncate": False},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
     "mscale_all_dim": 0.8},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8192, "attention_factor": 1.25},
]


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3_SCALING, *YARN_VARIANTS],
                         ids=["plain", "linear", "llama3", "yarn", "yarn-betas-untruncated", "yarn-mscales",
                              "yarn-attention-factor"])
def test_rope_frequencies_match_transformers(scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from specroll_mcore.model.attention import rope_attention_factor, rope_inv_freq
    context = int(scaling["factor"] * scaling.get("original_max_position_embeddings", 2048)) if scaling else 2048
    hf_cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=2, rope_theta=500000.0,
                                      max_position_embeddings=context, rope_scaling=dict(scaling) if scaling else None)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        ref, ref_factor = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128)), 1.0
    else:
        ref, ref_factor = ROPE_INIT_FUNCTIONS[kind](hf_cfg, torch.device("cpu"))
    model = model_config_from_hf(hf_cfg)
    assert model.rope_scaling == (None if scaling is None else dict(scaling))
    ours = rope_inv_freq(128, model.rope_theta, model.rope_scaling, torch.float32, torch.device("cpu"))
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
    assert rope_attention_factor(model.rope_scaling) == pytest.approx(ref_factor, rel=1e-12)
    if scaling is not None:  # the scaling lowers frequencies; llama3 keeps the highest as they are
        plain = rope_inv_freq(128, model.rope_theta, None, torch.float32, torch.device("cpu"))
        assert (ours < plain).any() and (ours[0] == plain[0]) == (kind in ("llama3", "yarn"))


def test_stop_tokens_are_the_tokenizers_eos_and_the_generation_configs(tmp_path):
    """The converter keeps generation_config.json; its eos_token_id (an id or a list) joins the
    tokenizer's EOS, as transformers' generate and vLLM stop."""
    from types import SimpleNamespace

    from specroll_mcore.checkpoint.megatron import stop_token_ids
    save_tiny_hf(tmp_path / "hf", "llama", False)
    (tmp_path / "hf/generation_config.json").write_text(json.dumps({"eos_token_id": [7, 3]}))
    out = convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "mcore")
    tok = SimpleNamespace(eos_token_id=3)
    assert stop_token_ids(out, tok) == [3, 7]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 9, "bos_token_id": 1}))
    assert stop_token_ids(out, tok) == [3, 9]
    assert stop_token_ids(out, SimpleNamespace(eos_token_id=None)) == [9]
    (out / "generation_config.json").unlink()
    assert stop_token_ids(out, tok) == [3]
    (out / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"generation_config.json is not a JSON object .*fix or delete it"):
        stop_token_ids(out, tok)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ["</s>"]}))
    with pytest.raises(ValueError, match=r"eos_token_id must be a token id or a list of them, got \['</s>'\]"):
        stop_token_ids(out, tok)


def test_qkv_fuse_split_inverse():
    cfg = model_config_from_hf(transformers.LlamaConfig(hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                                                        intermediate_size=8, num_hidden_layers=1, vocab_size=10))
    q, k, v = torch.randn(48, 48), torch.randn(16, 48), torch.randn(16, 48)
    fused = fuse_qkv(q, k, v, cfg)
    # Group 0 is [q heads 0-2, k head 0, v head 0], as megatron-core splits it.
    assert torch.equal(fused[:24], q[:24]) and torch.equal(fused[24:32], k[:8]) and torch.equal(fused[32:40], v[:8])
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, cfg), (q, k, v)))


# -- bad input -------------------------------------------------------------------------------------
def test_a_hub_model_id_is_downloaded_with_only_what_the_conversion_reads(tmp_path, monkeypatch):
    """``Qwen/Qwen2.5-7B-Instruct`` converts as its download (Hub calls replaced by a local repository
    here): config, tokenizer and the safetensors, not the .bin twins or other formats; offline, the cache
    serves it; neither: an error that says how to download it."""
    import fnmatch

    import huggingface_hub

    save_tiny_hf(tmp_path / "repo", "qwen2", False)
    (tmp_path / "repo" / "pytorch_model.bin").write_bytes(b"")  # a repository with both formats
    files = sorted(p.name for p in (tmp_path / "repo").iterdir())
    fetched = []

    def snapshot_download(repo_id, allow_patterns, local_files_only=False):
        assert repo_id == "org/tiny-qwen"
        fetched.append((sorted(f for f in files if any(fnmatch.fnmatch(f, p) for p in allow_patterns)),
                        local_files_only))
        return str(tmp_path / "repo")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo_id: files)
    out = convert.convert_hf_to_mcore("org/tiny-qwen", tmp_path / "mcore")
    assert fetched == [(sorted(set(files) - {"pytorch_model.bin"}), False)]
    assert json.loads((out / CONFIG_FILE).read_text())["source"] == "org/tiny-qwen"
    assert load_full_state_dict(out).keys() == load_full_state_dict(
        convert.convert_hf_to_mcore(tmp_path / "repo", tmp_path / "local")).keys()

    def offline(repo_id):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "list_repo_files", offline)
    convert.convert_hf_to_mcore("org/tiny-qwen", tmp_path / "from-cache")
    assert fetched[-1][1] is True  # the cache only

    def not_cached(repo_id, allow_patterns, local_files_only=False):
        raise FileNotFoundError("not in the cache")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", not_cached)
    with pytest.raises(FileNotFoundError, match=re.escape("org/tiny-qwen is not a local directory, and the Hugging "
                                                          "Face Hub did not give it (OSError: no network); download "
                                                          "it (`hf download org/tiny-qwen --local-dir DIR`)")):
        convert.convert_hf_to_mcore("org/tiny-qwen", tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="has no config.json"):  # a path, not an id: as before
        convert.convert_hf_to_mcore(tmp_path / "no" / "such", tmp_path / "nothing")


def test_unknown_architecture(tmp_path):
    save_tiny_hf(tmp_path / "hf", "llama", False)
    cfg = json.loads((tmp_path / "hf/config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (tmp_path / "hf/config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported architecture \['GPT2LMHeadModel'\]"):
        convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "out")


def test_unsupported_attention_variants(tmp_path):
    save_tiny_hf(tmp_path / "hf", "qwen3", False)
    cfg = json.loads((tmp_path / "hf/config.json").read_text())
    (tmp_path / "hf/config.json").write_text(json.dumps({**cfg, "use_sliding_window": True, "sliding_window": 64}))
    with pytest.raises(ValueError, match=r"sliding-window attention over 64 tokens, shorter than the 128-token "
                                         r"context .* lower max_position_embeddings to 64"):
        convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "out")
    mistral = {**cfg, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 64}
    with pytest.raises(ValueError, match="sliding-window attention over 64 tokens"):
        model_config_from_hf(mistral)
    assert model_config_from_hf({**mistral, "sliding_window": None}).max_position_embeddings == 128
    assert model_config_from_hf({**mistral, "max_position_embeddings": 64}).max_position_embeddings == 64
    assert model_config_from_hf({**cfg, "use_sliding_window": False, "sliding_window": 64}).qk_layernorm
    phi3 = {**cfg, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "sliding_window": 2047,
            "max_position_embeddings": 4096}  # Phi-3-mini's
    with pytest.raises(ValueError, match="sliding-window attention over 2047 tokens, shorter than the 4096-token"):
        model_config_from_hf(phi3)
    dynamic = {"rope_type": "dynamic", "factor": 4.0}
    (tmp_path / "hf/config.json").write_text(json.dumps({**cfg, "rope_scaling": dynamic}))
    with pytest.raises(ValueError, match="RoPE scaling 'dynamic' is not supported; supported: plain RoPE, linear, "
                                         "llama3, yarn"):
        convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "out")
    (tmp_path / "hf/config.json").write_text(json.dumps({**cfg, "partial_rotary_factor": 0.5}))
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5 is not supported"):
        convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unsupported_mixture_of_experts_variants(tmp_path):
    save_tiny_hf(tmp_path / "hf", "qwen3_moe", False)
    cfg = json.loads((tmp_path / "hf/config.json").read_text())
    for change, match in [({"decoder_sparse_step": 2}, r"mixes dense and mixture-of-experts layers "
                                                       r"\(decoder_sparse_step 2"),
                          ({"mlp_only_layers": [0]}, r"mlp_only_layers \[0\]\): not supported"),
                          ({"router_jitter_noise": 0.01}, r"router_jitter_noise 0.01: not supported")]:
        (tmp_path / "hf/config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=match):
            convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "out")
    (tmp_path / "hf/config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size is 2 but the model is a mixture of experts"):
        convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "out", tensor_parallel_size=2)
    for change, match in [({"num_experts": 8}, r"mlp.gate.weight has shape \(4, 64\) but config.json implies "
                                                r"\(8, 64\)"),
                          ({"moe_intermediate_size": 40}, r"experts.0.gate_proj.weight has shape \(48, 64\) but "
                                                          r"config.json implies \(40, 64\)")]:
        (tmp_path / "hf/config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=match):
            convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_variants_whose_tensors_would_be_dropped_are_refused(tmp_path):
    """Biases or activations the Megatron layer here does not have are refused by their config fields;
    a tensor the conversion would not read (here an output-projection bias its config does not
    announce) is refused after reading the rest, before anything is written."""
    from safetensors.torch import load_file, save_file

    for change, match in [({"attention_bias": True}, r"sets attention_bias, which in LlamaForCausalLM also gives the "
                                                     r"output projection \(o_proj\) a bias: not supported"),
                          ({"mlp_bias": True}, "sets mlp_bias: not supported"),
                          ({"hidden_act": "gelu"}, r"sets hidden_act 'gelu': not supported, the MLP here is SwiGLU")]:
        cfg = tiny_hf_config("llama", False)
        for k, v in change.items():
            setattr(cfg, k, v)
        transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
        with pytest.raises(ValueError, match=match):
            convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "out")
        shutil.rmtree(tmp_path / "hf")
    save_tiny_hf(tmp_path / "hf", "llama", False)
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    weights["model.layers.2.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(weights, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"holds 1 tensors this conversion would drop, such as "
                                         r"\['model.layers.2.self_attn.o_proj.bias'\]: a variant of LlamaForCausalLM"):
        convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        convert.convert_hf_to_mcore(tmp_path, tmp_path / "out")
    save_tiny_hf(tmp_path / "hf", "llama", False)
    (tmp_path / "hf/model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="has no weights"):
        convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="not a specroll Megatron checkpoint"):
        convert.convert_mcore_to_hf(tmp_path / "hf", tmp_path / "back")
    with pytest.raises(FileNotFoundError, match="GGUF file .* does not exist"):
        convert.gguf_to_hf(tmp_path / "nope.gguf", tmp_path / "x")


def test_incomplete_checkpoint(tmp_path, ctx):
    save_tiny_hf(tmp_path / "hf", "llama", False)
    convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", tensor_parallel_size=2)
    shutil.rmtree(tmp_path / "mcore/release/mp_rank_01")
    with pytest.raises(FileNotFoundError, match="mp_rank_01/model_optim_rng.pt is missing"):
        load_policy(tmp_path / "mcore", ctx)


def test_a_checkpoint_without_its_tracker_file_is_incomplete(tmp_path, ctx):
    save_tiny_hf(tmp_path / "hf", "llama", False)
    ckpt = convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "mcore")
    (ckpt / TRACKER_FILE).unlink()  # (a copy cut short: the tracker is written last)
    with pytest.raises(FileNotFoundError, match=f"{TRACKER_FILE} is missing: .* holds no complete checkpoint"):
        load_policy(ckpt, ctx)


def test_heads_are_refused_when_missing_or_fitted_on_other_weights(tmp_path, ctx):
    save_tiny_hf(tmp_path / "hf", "llama", False)
    ckpt = convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "mcore")
    with pytest.raises(FileNotFoundError, match="heads.pt does not exist: train heads with tools/train_heads.py"):
        load_policy(ckpt, ctx, with_heads=True)
    heads = {"heads.layers.0.weight": 0.01 * torch.randn(64, 64)}
    save_heads(ckpt, heads, {"num_heads": 1})
    assert load_policy(ckpt, ctx, with_heads=True).num_heads == 1
    config = json.loads((ckpt / CONFIG_FILE).read_text())
    fitted_on, config["policy_fingerprint"] = config["policy_fingerprint"], "0123456789abcdef"
    (ckpt / CONFIG_FILE).write_text(json.dumps(config))  # the weights changed, the heads did not follow
    with pytest.raises(ValueError, match=f"were fitted on policy {fitted_on}, the checkpoint holds policy "
                                         "0123456789abcdef: retrain or consolidate them"):
        load_policy(ckpt, ctx, with_heads=True)
    stale, meta = load_heads(ckpt, allow_stale=True)
    assert meta["fitted_on"] == fitted_on
    assert torch.equal(stale["heads.layers.0.weight"], heads["heads.layers.0.weight"])


def test_heads_of_a_grpo_run_are_saved_where_they_are_loaded(tmp_path, ctx):
    """In a GRPO run's output directory the heads live in its latest iteration, beside its weights: heads
    saved for the run (tools/train_heads.py --checkpoint RUN) replace those the trainer saved there; they
    were written beside the run's config, where nothing read them."""
    from specroll_mcore.checkpoint.megatron import heads_path

    save_tiny_hf(tmp_path / "hf", "llama", False)
    ckpt = convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "mcore")
    run = tmp_path / "run"  # a run's layout: its config at the top, each checkpoint in iter_NNNNNNN
    shutil.copytree(ckpt, run, ignore=shutil.ignore_patterns("release"))
    shutil.copytree(ckpt / "release", run / "iter_0000002")
    (run / TRACKER_FILE).write_text("2")
    assert heads_path(ckpt) == ckpt / "heads.pt" and heads_path(run) == run / "iter_0000002/heads.pt"
    with pytest.raises(FileNotFoundError, match="iter_0000002/heads.pt does not exist: train heads with"):
        load_heads(run)  # (a run with the vanilla engine: no heads)
    torch.save({"heads": {"heads.layers.0.weight": torch.zeros(64, 64)}, "meta": {"num_heads": 1, "policy_version": 2}},
               run / "iter_0000002/heads.pt")  # as the trainer saves them
    refitted = {"heads.layers.0.weight": torch.ones(64, 64)}
    assert save_heads(run, refitted, {"num_heads": 1, "steps": 5}) == run / "iter_0000002/heads.pt"
    heads, meta = load_heads(run)
    assert torch.equal(heads["heads.layers.0.weight"], refitted["heads.layers.0.weight"]) and meta["steps"] == 5
    policy = load_policy(run, ctx, with_heads=True)
    assert torch.equal(policy.heads.layers[0].weight, refitted["heads.layers.0.weight"])
    assert not (run / "heads.pt").exists()


def test_shape_that_does_not_match_config(tmp_path):
    for arch, name, shape in [("llama", "gate_proj", r"\(96, 64\)"), ("phi3", "gate_up_proj", r"\(192, 64\)")]:
        save_tiny_hf(tmp_path / arch, arch, False)
        cfg = json.loads((tmp_path / arch / "config.json").read_text())
        cfg["intermediate_size"] = 128
        (tmp_path / arch / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=rf"{name}.weight has shape {shape} but config.json implies "
                                             r"\((128|256), 64\)"):
            convert.convert_hf_to_mcore(tmp_path / arch, tmp_path / "out")


def test_weights_that_do_not_match_config_or_index(tmp_path):
    model = save_tiny_hf(tmp_path / "hf", "llama", False)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["num_hidden_layers"] += 1  # a config.json of a deeper model beside these weights
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    last = cfg["num_hidden_layers"] - 1
    with pytest.raises(ValueError, match=rf"model.layers.{last}.mlp.down_proj.weight is missing from .*; does "
                                         "config.json belong to these weights\\?"):
        convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "out")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()  # a download cut short
    with pytest.raises(FileNotFoundError, match=f"weight shards listed in the index are missing: .*{shards[1].name}"):
        convert.convert_hf_to_mcore(tmp_path / "sharded", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_tp_that_does_not_divide_heads(tmp_path):
    save_tiny_hf(tmp_path / "hf", "llama", False)
    with pytest.raises(ValueError, match=r"num_query_groups \(2 KV heads\) is not divisible by .*\(4\)"):
        convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "out", tensor_parallel_size=4)
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by .*\(8\)"):
        convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "out", tensor_parallel_size=8)


def test_output_is_atomic(tmp_path, monkeypatch):
    save_tiny_hf(tmp_path / "hf", "llama", False)
    calls = {"n": 0}
    real_save = torch.save

    def dying_save(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("killed while writing the second shard")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "out", tensor_parallel_size=2)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no half-written temporary left either
    monkeypatch.setattr(torch, "save", real_save)
    convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "out")
    with pytest.raises(FileExistsError, match="already exists; pass overwrite=True"):
        convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "out")
    convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "out", overwrite=True)


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_written_files_are_readable_as_the_umask_allows(tmp_path, umask):
    """Converted models, exported safetensors and heads get the permissions a plain write gives (their
    temporaries and safetensors' writer create files private, 0o600, which other users of a cluster or a
    serving container under another uid could not read); a file written over keeps its own."""
    import os

    from specroll_mcore.checkpoint.megatron import save_atomic, write_json_atomic

    save_tiny_hf(tmp_path / "hf", "qwen2", False)
    old = os.umask(umask)
    try:
        mcore = convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", tensor_parallel_size=2)
        save_heads(mcore, {"heads.layers.0.weight": torch.zeros(64, 64)}, {"num_heads": 1})
        hf = convert.convert_mcore_to_hf(mcore, tmp_path / "back")
        write_json_atomic(tmp_path / "new.json", {})
        write_json_atomic(tmp_path / "made" / "for" / "it.json", {"a": 1})  # an output folder is made
        assert json.loads((tmp_path / "made/for/it.json").read_text()) == {"a": 1}
        for path in [mcore, hf, *mcore.rglob("*"), *hf.rglob("*"), tmp_path / "new.json"]:
            want = (0o777 if path.is_dir() else 0o666) & ~umask
            assert oct(path.stat().st_mode & 0o777) == oct(want), path
        assert (hf / "model.safetensors").is_file() and (mcore / "heads.pt").is_file()
        for path, write in [(tmp_path / "private.json", lambda p: write_json_atomic(p, {"a": 1})),
                            (tmp_path / "private.pt", lambda p: save_atomic({"a": 1}, p))]:
            path.write_text("")
            path.chmod(0o600)
            write(path)
            assert oct(path.stat().st_mode & 0o777) == oct(0o600)
    finally:
        os.umask(old)


def test_json_written_by_many_processes_at_once_stays_whole(tmp_path):
    """Every rank of a run caches its profiles (one file on a shared file system): writers at once
    each replace the file whole, through temporaries of their own, and leave none behind; a write
    that fails leaves the file as it was."""
    import json
    import multiprocessing

    from specroll_mcore.checkpoint.megatron import write_json_atomic

    path = tmp_path / "profiles.json"
    ctx = multiprocessing.get_context("fork")  # (the writers only write JSON)
    start = ctx.Barrier(3)
    procs = [ctx.Process(target=_write_many, args=(path, start)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * 3
    assert json.loads(path.read_text())["rows"] == list(range(2000))
    with pytest.raises(TypeError):
        write_json_atomic(path, {"rows": object()})
    assert json.loads(path.read_text())["rows"] == list(range(2000))
    assert [p.name for p in tmp_path.iterdir()] == ["profiles.json"]


def _write_many(path, start):
    from specroll_mcore.checkpoint.megatron import write_json_atomic

    start.wait()
    for _ in range(200):
        write_json_atomic(path, {"rows": list(range(2000))})


def test_cli_reports_errors(tmp_path, capsys):
    from specroll_mcore.cli import main

    assert main(["convert", "hf-to-mcore", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_export_in_shards_streams_and_loads_in_transformers(tmp_path, arch, capsys):
    """convert_mcore_to_hf reads the checkpoint stage by stage (memory-mapped) and writes shards of at
    most max_shard_bytes with save_pretrained's index: transformers loads them to the same weights as
    one file, and they convert back bit for bit. A tensor larger than the limit gets a shard alone."""
    from safetensors import safe_open

    from specroll_mcore.cli import main

    save_tiny_hf(tmp_path / "hf", arch, tied=False)
    tp = 1 if arch == "qwen3_moe" else 2
    convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", tensor_parallel_size=tp, pipeline_parallel_size=2)
    ref = convert.HFCheckpointReader(tmp_path / "hf")  # the tensors as saved (transformers fuses experts on load)
    total = sum(ref[k].numel() * ref[k].element_size() for k in ref)
    assert main(["convert", "mcore-to-hf", str(tmp_path / "mcore"), str(tmp_path / "shards"),
                 "--max-shard-size", f"{total // 3 // 1000}KB"]) == 0
    index = json.loads((tmp_path / "shards/model.safetensors.index.json").read_text())
    files = sorted({f for f in index["weight_map"].values()})
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["metadata"]["total_size"] == total and set(index["weight_map"]) == set(ref)
    assert sorted(p.name for p in (tmp_path / "shards").glob("*.safetensors")) == files
    for f in files:  # each within the limit, or a single tensor
        with safe_open(str(tmp_path / "shards" / f), "pt") as sf:
            sizes = [sf.get_tensor(k).numel() * sf.get_tensor(k).element_size() for k in sf.keys()]
        assert sum(sizes) <= total // 3 or len(sizes) == 1
    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "shards").state_dict()
    assert set(got) == set(want) and all(torch.equal(want[k], got[k]) for k in want)
    convert.convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "alone", max_shard_bytes=1)  # a tensor a file
    assert len(list((tmp_path / "alone").glob("*.safetensors"))) == len(ref)
    convert.convert_hf_to_mcore(tmp_path / "shards", tmp_path / "again", tensor_parallel_size=tp,
                                pipeline_parallel_size=2)
    for f in (tmp_path / "mcore/release").rglob("model_optim_rng.pt"):
        a = torch.load(f, weights_only=True)["model"]
        b = torch.load(tmp_path / "again/release" / f.parent.name / f.name, weights_only=True)["model"]
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    capsys.readouterr()
    assert main(["convert", "mcore-to-hf", str(tmp_path / "mcore"), str(tmp_path / "x"),
                 "--max-shard-size", "lots"]) == 2
    assert "--max-shard-size must be a size such as 5GB, 500MB or 2GiB, got 'lots'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_shard_bytes must be > 0, got 0"):
        convert.convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "x", max_shard_bytes=0)


def test_a_checkpoint_config_that_does_not_match_its_shards_is_refused(tmp_path, ctx):
    """specroll_config.json edited or copied from another model beside the shards: a layer count that
    differs from the shards' (more or fewer: fewer once loaded only the first layers, silently),
    in the layout written (read directly) and in another (resharded), with and without the stage
    split the converter records (checkpoints written before it), and a width that differs."""
    save_tiny_hf(tmp_path / "hf", "llama", False)
    for tp in (1, 2):
        ckpt = convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / f"tp{tp}", tensor_parallel_size=tp)
        config = json.loads((ckpt / CONFIG_FILE).read_text())
        layers = config["model"]["num_layers"]
        for num_layers in (layers - 1, layers + 1):
            for recorded in (True, False):
                edited = json.loads(json.dumps(config))
                edited["model"]["num_layers"] = num_layers
                if not recorded:
                    del edited["pipeline_stage_layers"]
                (ckpt / CONFIG_FILE).write_text(json.dumps(edited))
                match = (rf"gives the model num_layers={num_layers} but records its pipeline stages holding "
                         rf"\[{layers}\] layers; does it belong" if recorded else
                         rf"the shards of pipeline stage 0 hold {layers} layers, {CONFIG_FILE} gives that stage "
                         rf"{num_layers}; does it belong" if tp == 2 else  # (resharded; else read directly)
                         r"the shard does not fit this stage of the model: missing \[.*\], unexpected \[.*\]; was "
                         r"the checkpoint written for this model config\?")
                with pytest.raises(ValueError, match=match):
                    load_policy(ckpt, ctx)
        edited = json.loads(json.dumps(config))
        edited["model"]["ffn_hidden_size"] = 2 * config["model"]["ffn_hidden_size"]
        (ckpt / CONFIG_FILE).write_text(json.dumps(edited))
        with pytest.raises(ValueError, match=r"decoder.layers.0.mlp.linear_fc1.weight.* (shape|!=).*"
                                             rf"(was the checkpoint written for this model config|does {CONFIG_FILE} "
                                             r"belong)"):
            load_policy(ckpt, ctx)


def test_export_names_a_tensor_the_checkpoint_lacks_or_misshapes(tmp_path):
    save_tiny_hf(tmp_path / "hf", "llama", tied=False)
    convert.convert_hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", pipeline_parallel_size=2)
    shard = tmp_path / "mcore/release/mp_rank_00_001/model_optim_rng.pt"
    blob = torch.load(shard, weights_only=True)
    del blob["model"]["decoder.final_layernorm.weight"]
    torch.save(blob, shard)
    with pytest.raises(ValueError, match=r"lacks decoder.final_layernorm.weight \(stage 1"):
        convert.convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back")
    blob["model"]["decoder.final_layernorm.weight"] = torch.ones(7)
    torch.save(blob, shard)
    with pytest.raises(ValueError, match=r"decoder.final_layernorm.weight has shape \(7,\) but the model config"):
        convert.convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back")
    assert not (tmp_path / "back").exists()


def test_iteration_is_for_exporting_a_training_run(tmp_path, capsys):
    from specroll_mcore.cli import main

    with pytest.raises(SystemExit):
        main(["convert", "hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "mcore"), "--iteration", "3"])
    err = capsys.readouterr().err
    assert "--iteration selects the training iteration mcore-to-hf exports; convert hf-to-mcore" in err


def test_atomic_writes_make_their_new_name_durable(tmp_path, monkeypatch):
    """A rename survives a crash of the machine only once its directory is fsynced: each atomic write
    fsyncs the directory after its rename (and a written directory's own entries before)."""
    import os

    from specroll_mcore.checkpoint.megatron import atomic_directory, save_atomic, write_json_atomic

    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), replace(a, b))[1])
    def tree(d):
        (d / "sub").mkdir()
        (d / "sub" / "x").write_text("x")

    for name, write in [("a.json", lambda p: write_json_atomic(p, {"a": 1})), ("b.pt", lambda p: save_atomic({}, p)),
                        ("c", lambda p: atomic_directory(p, tree))]:
        events.clear()
        write(tmp_path / name)
        assert events[-2:] == [("replace", str(tmp_path / name)), ("fsync", str(tmp_path))], (name, events)
    assert any(e[0] == "fsync" and e[1].endswith("/sub") for e in events)  # (inside the temporary directory)
