"""GPU checks (skipped without CUDA): the same contracts as the CPU suite, on nccl/CUDA.

Run on a GPU machine with `python -m pytest tests/gpu`."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def gpu_ctx():
    from specroll_mcore import parallel
    from specroll_mcore.config import ParallelConfig

    return parallel.initialize(ParallelConfig())


def _policy(ctx, dtype="float32"):
    from specroll_mcore.checkpoint import random_full_state_dict
    from specroll_mcore.config import tiny_qwen2
    from specroll_mcore.model import PolicyModel

    cfg = tiny_qwen2(params_dtype=dtype)
    model = PolicyModel(cfg, ctx, num_heads=3).eval()
    model.load_full_state_dict({k: v.cuda() for k, v in random_full_state_dict(cfg, 0, std=0.08).items()})
    return model


def test_kv_cache_matches_recompute_on_gpu(gpu_ctx):
    from specroll_mcore.config import SamplingConfig
    from specroll_mcore.model import causal_mask
    from specroll_mcore.rollout import VanillaEngine

    model = _policy(gpu_ctx)
    out = VanillaEngine(model).generate([[3, 4, 5, 6]], SamplingConfig(temperature=0, max_new_tokens=16))
    seq = [3, 4, 5, 6] + out.tokens[0]
    ids = torch.tensor([seq], device="cuda")
    with torch.no_grad():
        logits = model.full_logits(model(ids, model.metadata(torch.arange(len(seq), device="cuda")[None],
                                                              causal_mask(1, len(seq), ids.device))))[0]
    assert logits[3:-1].argmax(-1).tolist() == out.tokens[0]


def test_speculative_equals_vanilla_on_gpu(gpu_ctx):
    from specroll_mcore.config import SamplingConfig, SpecConfig
    from specroll_mcore.rollout import SpeculativeEngine, VanillaEngine

    model = _policy(gpu_ctx, "float64")
    sp = SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=32, num_samples=4, seed=3)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    a = VanillaEngine(model).generate(prompts, sp)
    b = SpeculativeEngine(model, SpecConfig(c_hw=64)).generate(prompts, sp)
    assert a.tokens == b.tokens
