"""Half-precision steps compute each token as a one-token forward would, bit for bit: the step-attention
kernel or ordered attention (model/attention.py) and row-invariant products (cpu_gemm.half_product).
References: one-token forwards of the same tokens, one-row products, and the vanilla engine's tokens."""

import pytest
import torch

from specroll_mcore import cpu_gemm
from specroll_mcore.checkpoint.megatron import load_policy
from specroll_mcore.config import SamplingConfig, SpecConfig, tiny_llama, tiny_qwen2, tiny_qwen3, tiny_qwen3_moe
from specroll_mcore.model.attention import KEY_BLOCK, causal_mask, one_token_key_order, step_attention_kernels
from specroll_mcore.rollout import SpeculativeEngine, VanillaEngine
from specroll_mcore.rollout.base import prefill

from conftest import import_tool
from test_speculative import PROMPTS, policy_with_heads

# Row invariance is a property of oneDNN's AVX-512 bfloat16 kernels (measured on them); elsewhere a
# half-precision step is exact only up to rounding, as in float32.
BF16_KERNELS = import_tool("fuzz_exactness").bfloat16_kernels()
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
    # (1536, 576): SmolLM2's MLP output product, whose one-row call oneDNN computes otherwise (HALF_ONE_ROW_AS_TWO)
    for n_in, n_out in ((64, 96), (96, 1000), (1536, 576)):
        w = (0.05 * torch.randn(n_out, n_in, generator=g)).bfloat16()
        x = torch.randn(cpu_gemm.HALF_MAX_ROWS + 40, n_in, generator=g).bfloat16()
        one_row = torch.cat([cpu_gemm.half_product(x[i:i + 1], w) for i in range(len(x))])
        for n in (2, 9, 33, 64, cpu_gemm.HALF_MAX_ROWS + 1, cpu_gemm.HALF_MAX_ROWS + 40):
            out = cpu_gemm.half_product(x[:n], w)
            assert out.is_contiguous() and torch.equal(out, one_row[:n]), n


def random_tree(n: int, g: torch.Generator) -> tuple[list[int], torch.Tensor]:
    """Parents (node 0 the root) and the ancestor-or-self mask [1, n, n] of a random tree."""
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    mask = torch.eye(n, dtype=torch.bool)[None].clone()
    for i, p in enumerate(parent):
        while p >= 0:
            mask[0, i, p], p = True, parent[p]
    return parent, mask


def check_trees(model, vocab_size: int, context: int, sizes: tuple[int, ...]) -> None:
    """Random trees after a ``context``-token prompt: every node's logits from the tree forward equal
    (bit for bit) those of one-token forwards along its path. The one-token forwards walk each tree
    depth first on the prompt's cache, its committed length set back to the node's parent before the
    node's forward: every node is decoded once, right after its ancestors, as the vanilla engine
    decodes a response (what lies past the committed length is the scratch of other forwards)."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab_size, (1, context), generator=g)
    slots = torch.tensor([0])
    one_token = torch.ones(1, 1, 1, dtype=torch.bool)
    with torch.inference_mode():
        cache = model.new_cache(1, context + max(sizes))
        model(prompt, model.metadata(torch.arange(context)[None], causal_mask(1, context, torch.device("cpu")),
                                     cache, slots))
        cache.commit(slots, torch.tensor([context]))
        for n in sizes:
            parent, mask = random_tree(n, g)
            tokens = torch.randint(3, vocab_size, (1, n), generator=g)
            depth = mask[0].sum(-1) - 1
            tree_logits = model(tokens, model.metadata(context + depth[None], mask, cache, slots))[0]
            children = [[i for i in range(n) if parent[i] == node] for node in range(n)]
            stack = [0]
            while stack:
                node = stack.pop()
                cache.lengths[slots] = context + depth[node]
                one = model(tokens[:, node:node + 1], model.metadata(cache.lengths[slots][:, None], one_token,
                                                                     cache, slots))[0, 0]
                assert torch.equal(one, tree_logits[node]), f"{n}-node tree: node {node} (depth {int(depth[node])})"
                stack.extend(children[node])
            cache.lengths[slots] = context


@needs_bf16_kernels
@pytest.mark.parametrize("make_cfg", [tiny_llama, tiny_qwen2, tiny_qwen3, tiny_qwen3_moe])
@pytest.mark.parametrize("step_kernel", [True, False], ids=["step-kernel", "ordered-attention"])
def test_tree_forward_equals_one_token_forwards_in_bfloat16(ctx, make_cfg, step_kernel, monkeypatch):
    """Both ways a half-precision step's attention runs: the step kernel (where it builds) and ordered
    attention (SPECROLL_STEP_ATTENTION=0, or no AVX-512)."""
    if not step_kernel:
        monkeypatch.setenv("SPECROLL_STEP_ATTENTION", "0")
    elif step_attention_kernels() is None:
        pytest.skip("no step-attention kernel on this machine")
    # SmolLM2's attention shape (9 heads of 64 in 3 groups) on a 150-token context
    cfg = make_cfg(params_dtype="bfloat16", num_layers=2, hidden_size=576, ffn_hidden_size=256,
                   num_attention_heads=9, num_query_groups=3, kv_channels=64, max_position_embeddings=512)
    model = policy_with_heads(cfg, ctx)
    assert model.batch_invariant and model.new_cache(1, 8).position_major_keys == step_kernel
    check_trees(model, cfg.vocab_size, 150, (12, 24))


@needs_bf16_kernels
def test_smollm2_tree_forward_equals_one_token_forwards_in_bfloat16(ctx, smollm2_checkpoint):
    """The real model's 30 layers: a rare rounding difference (a few attention outputs in 10^5)
    reaches the logits here where two tiny layers may miss it."""
    model = load_policy(smollm2_checkpoint, ctx, params_dtype="bfloat16")
    for context in (150, 230):
        check_trees(model, model.config.vocab_size, context, (6, 12, 16, 24))


@needs_bf16_kernels
@pytest.mark.parametrize("make_cfg", [tiny_qwen2, tiny_qwen3_moe])
def test_speculative_equals_vanilla_in_bfloat16(ctx, make_cfg):
    """Qwen2's heads of 16 on the step kernel; the Qwen3-MoE's of 24, which the kernel does not take,
    on ordered attention (and its experts routed in float64)."""
    model = policy_with_heads(make_cfg(params_dtype="bfloat16"), ctx, seed=1)
    kernel = make_cfg is tiny_qwen2 and step_attention_kernels() is not None
    assert model.new_cache(1, 8).position_major_keys == kernel
    sp = SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=40, num_samples=3, seed=7)
    ref = VanillaEngine(model, eos_token_ids=[9]).generate(PROMPTS, sp)
    for c_hw in (16, 64):
        out = SpeculativeEngine(model, SpecConfig(c_hw=c_hw), eos_token_ids=[9]).generate(PROMPTS, sp)
        assert out.tokens == ref.tokens, f"c_hw={c_hw}"
        assert all(torch.equal(a, b) for a, b in zip(out.logprobs, ref.logprobs))


@needs_bf16_kernels
@pytest.mark.parametrize("make_cfg, shape", [(tiny_qwen3, "tiny"), (tiny_qwen3_moe, "tiny"), (tiny_llama, "smollm2")])
def test_a_prompts_prefill_does_not_depend_on_its_batch_or_pieces_in_bfloat16(ctx, make_cfg, shape):
    """A half-precision prompt prefilled alone, padded beside a longer prompt, after it, or cut into
    pieces of 3 and 7 tokens: its last token's logits and the next step's (which read every key and
    value it left in the cache) are the same bit for bit. Every token runs over its keys in one-token
    order, on ordered attention (Qwen3's heads of 24) or the step kernel (SmolLM2's attention shape);
    SDPA's prefill had differed with the padding (Qwen3) and with the pieces (SmolLM2's shape)."""
    wide = dict(hidden_size=576, ffn_hidden_size=256, num_attention_heads=9, num_query_groups=3, kv_channels=64)
    cfg = make_cfg(params_dtype="bfloat16", num_layers=2, **(wide if shape == "smollm2" else {}))
    model = policy_with_heads(cfg, ctx)
    g = torch.Generator().manual_seed(0)
    prompt, longer = (torch.randint(1, 300, (n,), generator=g).tolist() for n in (14, 20))
    got = {}
    with torch.inference_mode():
        for name, prompts, per_forward in (("alone", [prompt], 4096), ("padded", [prompt, longer], 4096),
                                           ("second", [longer, prompt], 4096), ("pieces_3", [prompt], 3),
                                           ("pieces_7", [prompt], 7)):
            cache = model.new_cache(len(prompts), 32)
            row = prompts.index(prompt)
            first = prefill(model, cache, prompts, per_forward)[row]
            slot = torch.tensor([row])
            meta = model.metadata(cache.lengths[slot][:, None], torch.ones(1, 1, 1, dtype=torch.bool), cache, slot)
            got[name] = (first, model.full_logits(model(torch.tensor([[7]]), meta))[0, 0])
    for name, (first, step) in got.items():
        assert torch.equal(first, got["alone"][0]) and torch.equal(step, got["alone"][1]), name
