"""The CPU step-attention kernel (csrc/step_attention.cpp) against attention computed in float64 over
each token's visible keys, its results against one-token calls bit for bit, and its input checks."""

import pytest
import torch

from specroll_mcore.model.attention import step_attention_kernels
from specroll_mcore.model.kv_cache import KVCache

kernels = step_attention_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="step-attention kernel needs an AVX-512 CPU and a C++ compiler")


def random_tree(n: int, g: torch.Generator) -> tuple[list[int], torch.Tensor]:
    """Parents (node 0 the root) and the ancestor-or-self mask [n, n] of a random tree."""
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parent):
        while p >= 0:
            mask[i, p], p = True, parent[p]
    return parent, mask


def filled_cache(committed: list[int], s: int, groups: int, d: int, dtype, g: torch.Generator):
    """A position-major cache whose rows hold random committed keys/values and ``s`` new tokens each,
    written as a forward writes them; returns (cache, key view, value view) [positions, b, groups, d]."""
    b = len(committed)
    cache = KVCache(b, max(committed) + s + 5, torch.device("cpu"), dtype, [1], position_major_keys=True)
    lengths = torch.tensor(committed)
    full = max(committed) + s
    k, v = (torch.randn(full, b, groups, d, generator=g).to(dtype) for _ in range(2))
    index = torch.arange(full)[None].expand(b, full)
    key, value = cache.write_and_read(1, cache.rows(torch.arange(b)), torch.arange(b)[:, None].expand(b, full), index,
                                      full, k, v)
    cache.lengths[:] = lengths
    return cache, key, value


def reference(query, key, value, committed, new_mask, scale):
    """float64: softmax over each token's committed context and visible new tokens."""
    s, b, heads, d = query.shape
    per_group = heads // key.shape[2]
    out = torch.zeros(s, b, heads, d, dtype=torch.float64)
    for r in range(b):
        L = int(committed[r])
        for i in range(s):
            keys = list(range(L)) + [L + t for t in range(s) if new_mask[r, i, t]]
            for h in range(heads):
                k, v = key[keys, r, h // per_group].double(), value[keys, r, h // per_group].double()
                out[i, r, h] = torch.softmax(k @ query[i, r, h].double() * scale, 0) @ v
    return out.reshape(s, b, heads * d)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("heads,groups,d", [(9, 3, 64), (4, 1, 32), (4, 4, 16)])
def test_kernel_equals_float64_attention(dtype, tol, heads, groups, d):
    g = torch.Generator().manual_seed(heads * d)
    committed, s = [0, 17, 100, 63, 150], 6  # ragged rows, one with no committed context
    _, key, value = filled_cache(committed, s, groups, d, dtype, g)
    mask = torch.stack([random_tree(s, g)[1] for _ in committed])
    query = torch.randn(s, len(committed), heads, d, generator=g).to(dtype)
    out = kernels.step_attention(query, key, value, torch.tensor(committed), mask, d ** -0.5)
    assert out.shape == (s, len(committed), heads * d) and out.dtype == dtype
    ref = reference(query, key, value, committed, mask, d ** -0.5)
    assert (out.double() - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_nodes_equal_one_token_calls_bit_for_bit(dtype):
    """Every node of a random tree gets exactly what a one-token call gives it once its ancestors are
    committed in order before it (a decoding step of the same token), in any company of rows."""
    g = torch.Generator().manual_seed(1)
    heads, groups, d, s = 9, 3, 64, 12
    committed = [37, 120, 5]
    _, key, value = filled_cache(committed, s, groups, d, dtype, g)
    trees = [random_tree(s, g) for _ in committed]
    mask = torch.stack([m for _, m in trees])
    query = torch.randn(s, len(committed), heads, d, generator=g).to(dtype)
    out = kernels.step_attention(query, key, value, torch.tensor(committed), mask, 0.125)
    for r, (parent, _) in enumerate(trees):
        L = committed[r]
        for node in range(s):
            path = [node]
            while parent[path[-1]] >= 0:
                path.append(parent[path[-1]])
            order = list(range(L)) + [L + t for t in reversed(path)]  # context, ancestors, the node itself
            k, v = key[order, r:r + 1].clone(), value[order, r:r + 1].clone()
            one = kernels.step_attention(query[node:node + 1, r:r + 1].contiguous(), k.permute(1, 2, 3, 0)
                                         .contiguous().permute(3, 0, 1, 2), v,
                                         torch.tensor([len(order) - 1]), torch.ones(1, 1, 1, dtype=torch.bool), 0.125)
            assert torch.equal(one[0, 0], out[node, r]), f"row {r} node {node}"


def test_bad_inputs_are_refused_with_the_reason():
    g = torch.Generator().manual_seed(2)
    _, key, value = filled_cache([4, 8], 2, 1, 16, torch.float32, g)
    query, committed = torch.randn(2, 2, 2, 16), torch.tensor([4, 8])
    mask = torch.ones(2, 2, 2, dtype=torch.bool)
    step = kernels.step_attention
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        step(query.half(), key.half(), value.half(), committed, mask, 0.25)
    with pytest.raises(RuntimeError, match="share a dtype"):
        step(query.bfloat16(), key, value, committed, mask, 0.25)
    with pytest.raises(RuntimeError, match="position-major"):
        step(query, key.contiguous(), value, committed, mask, 0.25)
    with pytest.raises(RuntimeError, match="new_mask must be bool"):
        step(query, key, value, committed, mask[:, :1], 0.25)
    with pytest.raises(RuntimeError, match="committed must be int64"):
        step(query, key, value, committed.int(), mask, 0.25)
    with pytest.raises(RuntimeError, match="row 1 needs 11 key positions"):
        step(query, key, value, torch.tensor([4, 9]), mask, 0.25)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        step(torch.randn(2, 2, 2, 8), key[..., :8], value[..., :8], committed, mask, 0.25)
    with pytest.raises(RuntimeError, match="do not divide"):
        _, k3, v3 = filled_cache([4, 8], 2, 3, 16, torch.float32, g)
        step(query, k3, v3, committed, mask, 0.25)


def test_switch_and_layout(monkeypatch):
    """SPECROLL_STEP_ATTENTION=0 turns the kernel off; a cache not made for it keeps keys as before."""
    monkeypatch.setenv("SPECROLL_STEP_ATTENTION", "0")
    assert step_attention_kernels() is None
    cache = KVCache(2, 8, torch.device("cpu"), torch.bfloat16, [1])
    key, _ = cache.write_and_read(1, (0, 2), torch.arange(2)[:, None], torch.zeros(2, 1, dtype=torch.long), 1,
                                  torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16))
    assert not cache.position_major_keys and key.stride(-1) == 1
