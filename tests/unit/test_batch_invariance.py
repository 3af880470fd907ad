"""Half-precision steps compute each token as a one-token forward would, bit for bit: ordered
attention (model/attention.py) and row-invariant products (cpu_gemm.half_product). References: one-token
forwards of the same tokens, one-row products, and the vanilla engine's tokens."""

from pathlib import Path

import pytest
import torch

from specroll_mcore import cpu_gemm
from specroll_mcore.config import SamplingConfig, SpecConfig, tiny_llama, tiny_qwen2
from specroll_mcore.model.attention import KEY_BLOCK, causal_mask, one_token_key_order
from specroll_mcore.rollout import SpeculativeEngine, VanillaEngine

from test_speculative import PROMPTS, policy_with_heads

# Row invariance is a property of oneDNN's AVX-512 bfloat16 kernels (measured on them); elsewhere a
# half-precision step is exact only up to rounding, as in float32.
BF16_KERNELS = "avx512_bf16" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False
needs_bf16_kernels = pytest.mark.skipif(not BF16_KERNELS, reason="CPU without AVX-512 bfloat16 instructions")


def test_one_token_key_order():
    # row 0: 2 committed keys, a tree of 3 new tokens (0 -> 1, 0 -> 2) at positions 2, 3, 4
    mask = torch.zeros(1, 3, 5, dtype=torch.bool)
    mask[0, :, :2] = True
    mask[0, 0, 2] = mask[0, 1, [2, 3]] = mask[0, 2, [2, 4]] = True
    order, valid = one_token_key_order(mask)
    assert order.shape == valid.shape == (1, 3, KEY_BLOCK)
    assert order[0, :, :4].tolist() == [[0, 1, 2, 0], [0, 1, 2, 3], [0, 1, 2, 4]]
    assert valid[0].sum(-1).tolist() == [3, 4, 4] and not bool(order[~valid].any())
    order, valid = one_token_key_order(mask[:, :1])  # a decoding step: its keys are already in order
    assert order is None and valid[0, 0].sum() == 3


@needs_bf16_kernels
def test_half_products_do_not_depend_on_the_row_count():
    g = torch.Generator().manual_seed(0)
    for n_in, n_out in ((64, 96), (96, 1000)):
        w = (0.05 * torch.randn(n_out, n_in, generator=g)).bfloat16()
        x = torch.randn(cpu_gemm.HALF_MAX_ROWS + 40, n_in, generator=g).bfloat16()
        one_row = torch.cat([cpu_gemm.half_product(x[i:i + 1], w) for i in range(len(x))])
        for n in (2, 9, 33, 64, cpu_gemm.HALF_MAX_ROWS + 40):
            out = cpu_gemm.half_product(x[:n], w)
            assert out.is_contiguous() and torch.equal(out, one_row[:n]), n


@needs_bf16_kernels
@pytest.mark.parametrize("make_cfg", [tiny_llama, tiny_qwen2])
def test_tree_forward_equals_one_token_forwards_in_bfloat16(ctx, make_cfg):
    model = policy_with_heads(make_cfg(params_dtype="bfloat16"), ctx)
    assert model.batch_invariant
    prompt, chain = torch.tensor([[5, 6, 7, 8, 9, 10, 11]]), torch.tensor([[40, 41, 42, 43, 44, 45]])
    # a tree: 0 -> 1 -> 2 and 0 -> 3 -> 4 -> 5 (the last branch is the chain's tokens 3..5 after 0)
    tree = torch.tensor([[40, 41, 42, 43, 44, 45]])
    parent = [-1, 0, 1, 0, 3, 4]
    mask = torch.eye(6, dtype=torch.bool)[None].clone()
    for i, p in enumerate(parent):
        while p >= 0:
            mask[0, i, p], p = True, parent[p]
    depth = mask[0].sum(-1) - 1
    paths = {2: [0, 1, 2], 5: [0, 3, 4, 5]}
    slots = torch.tensor([0])

    def prefilled():
        cache = model.new_cache(1, 40)
        model(prompt, model.metadata(torch.arange(7)[None], causal_mask(1, 7, torch.device("cpu")), cache, slots))
        cache.commit(slots, torch.tensor([7]))
        return cache

    with torch.inference_mode():
        cache = prefilled()
        tree_logits = model(tree, model.metadata(7 + depth[None], mask, cache, slots, step=True))[0]
        for leaf, path in paths.items():
            cache = prefilled()
            for node in path:  # the path's tokens one at a time, as the vanilla engine decodes them
                one = model(tree[:, node:node + 1], model.metadata(cache.lengths[slots][:, None],
                                                                   torch.ones(1, 1, 1, dtype=torch.bool), cache, slots,
                                                                   step=True))[0, 0]
                cache.commit(slots, torch.tensor([1]))
                assert torch.equal(one, tree_logits[node]), f"node {node} on the path to {leaf}"


@needs_bf16_kernels
def test_speculative_equals_vanilla_in_bfloat16(ctx):
    model = policy_with_heads(tiny_qwen2(params_dtype="bfloat16"), ctx, seed=1)
    sp = SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=40, num_samples=3, seed=7)
    ref = VanillaEngine(model, eos_token_ids=[9]).generate(PROMPTS, sp)
    for c_hw in (16, 64):
        out = SpeculativeEngine(model, SpecConfig(c_hw=c_hw), eos_token_ids=[9]).generate(PROMPTS, sp)
        assert out.tokens == ref.tokens, f"c_hw={c_hw}"
        assert all(torch.equal(a, b) for a, b in zip(out.logprobs, ref.logprobs))
