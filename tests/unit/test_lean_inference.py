"""Inference runs megatron-core's layers as their submodules chain (model/gpt._chained_layer),
without the layer's per-layer Python: the same operations in the same order, so the same logits to
the bit as megatron's TransformerBlock.forward, for every architecture, dtype and kind of forward."""

import pytest
import torch

from conftest import make_policy
from specroll_mcore.config import tiny_llama, tiny_qwen2, tiny_qwen3, tiny_qwen3_moe
from specroll_mcore.model import causal_mask

CONFIGS = {"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3, "qwen3_moe": tiny_qwen3_moe,
           "qwen2_moe_shared": lambda **kw: tiny_qwen2(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                                                       moe_shared_expert_ffn_hidden_size=64,
                                                       moe_shared_expert_gate=True, **kw)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_lean_layers_equal_megatrons_block(ctx, arch, dtype):
    policy = make_policy(CONFIGS[arch](params_dtype=dtype), ctx)
    assert policy._lean_layers
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, 300, (2, 9), generator=g)
    calls = []
    policy.gpt.decoder.register_forward_pre_hook(lambda *a: calls.append(1))

    def run(lean):
        policy._lean_layers = lean
        cache = policy.new_cache(num_slots=2, capacity=32)
        slots = torch.arange(2)
        with torch.no_grad():
            meta = policy.metadata(torch.arange(9)[None].expand(2, 9), causal_mask(2, 9, ctx.device), cache, slots)
            outs = [policy(prompt, meta)]  # prefill
            cache.commit(slots, torch.full((2,), 9))
            for n in (1, 4):  # a decoding step, then a 4-node chain as a tree would be verified
                pos = cache.lengths[slots][:, None] + torch.arange(n)[None]
                meta = policy.metadata(pos, causal_mask(2, n, ctx.device), cache, slots)
                outs.append(policy(torch.randint(5, 300, (2, n), generator=torch.Generator().manual_seed(n)), meta))
        return outs

    calls.clear()
    lean = run(True)
    assert not calls  # megatron's block did not run
    block = run(False)
    assert len(calls) == 3
    for a, b in zip(lean, block):
        assert torch.equal(a, b)
    policy._lean_layers = True


def test_layers_with_a_feature_the_chain_leaves_out_keep_megatrons_forward(ctx):
    from specroll_mcore.model.gpt import LAYER_FEATURES, lean_layer

    policy = make_policy(tiny_llama(), ctx)
    layer = policy.gpt.decoder.layers[0]
    assert lean_layer(layer)
    for name in LAYER_FEATURES:
        setattr(layer, name, True)
        assert not lean_layer(layer), name
        setattr(layer, name, False)
    layer.hidden_dropout = 0.1  # dropout would apply with the layer in training mode
    assert not lean_layer(layer)
