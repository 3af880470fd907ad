"""Decode with the KV cache equals full recompute (mode a: no cache, causal over the whole text)."""

import pytest
import torch

from conftest import make_policy
from specroll_mcore.config import tiny_llama, tiny_qwen2, tiny_qwen3, tiny_qwen3_moe
from specroll_mcore.model import causal_mask
from specroll_mcore.model.kv_cache import KVCache


def full_recompute_logits(model, seq: list[int]) -> torch.Tensor:
    ids = torch.tensor([seq])
    meta = model.metadata(torch.arange(len(seq))[None], causal_mask(1, len(seq), ids.device))
    return model.full_logits(model(ids, meta))[0]  # [s, V]


@pytest.mark.parametrize("max_tokens", [64, 4])
def test_cached_decode_matches_full_recompute(ctx, max_tokens):
    """Prefill (at 4 tokens a forward, the 5- and 7-token prompts in pieces, each attending to the
    cache of the pieces before it), then cached decoding: the logits of one forward over the whole
    sequence."""
    torch.manual_seed(0)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8}
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
    for cfg in (tiny_llama(), tiny_qwen2(), tiny_qwen3(), tiny_llama(rope_scaling=llama3),
                tiny_qwen2(rope_scaling=yarn), tiny_qwen3_moe()):
        model = make_policy(cfg, ctx)
        prompts = [[3, 14, 15, 92, 65], [35], [89, 79, 32, 38, 46, 26, 43]]  # ragged
        steps = 12
        cache = model.new_cache(num_slots=3, capacity=32)
        from specroll_mcore.rollout.base import prefill

        with torch.no_grad():
            last = prefill(model, cache, prompts, max_tokens_per_forward=max_tokens)
            seqs = [list(p) for p in prompts]
            active = torch.arange(3)
            logits_cached = [[] for _ in prompts]
            for r in range(3):
                logits_cached[r].append(last[r])
            for _ in range(steps):
                nxt = torch.stack([logits_cached[r][-1].argmax() for r in range(3)])
                for r in range(3):
                    seqs[r].append(int(nxt[r]))
                meta = model.metadata(cache.lengths[active][:, None], torch.ones(3, 1, 1, dtype=torch.bool),
                                      cache, active)
                out = model.full_logits(model(nxt[:, None], meta))[:, 0]
                cache.commit(active, torch.ones(3, dtype=torch.long))
                for r in range(3):
                    logits_cached[r].append(out[r])
            for r in range(3):
                ref = full_recompute_logits(model, seqs[r])[len(prompts[r]) - 1:]
                got = torch.stack(logits_cached[r])
                assert (ref - got).abs().max() < 1e-5, (ref - got).abs().max()
                assert torch.equal(ref.argmax(-1), got.argmax(-1))
        assert cache.lengths.tolist() == [len(p) + steps for p in prompts]


def test_shared_prefix_copy(ctx):
    """copy_slots duplicates a prompt's cache for its G samples."""
    model = make_policy(tiny_llama(), ctx)
    from specroll_mcore.rollout.base import prefill

    cache = model.new_cache(num_slots=4, capacity=16)
    with torch.no_grad():
        prefill(model, cache, [[5, 6, 7]], 64)
        cache.copy_slots(torch.tensor([0, 0, 0]), torch.tensor([1, 2, 3]))
        slots = torch.arange(4)
        meta = model.metadata(cache.lengths[:, None], torch.ones(4, 1, 1, dtype=torch.bool), cache, slots)
        out = model.full_logits(model(torch.full((4, 1), 9), meta))[:, 0]
    assert cache.lengths.tolist() == [3, 3, 3, 3]  # the decoded token is not committed
    ref = full_recompute_logits(model, [5, 6, 7, 9])[-1]
    assert (out - ref).abs().max() < 1e-5


def _write(cache, slots, values, extra=0, layer=1):
    """Write ``values`` [b, s] (one number per token, broadcast over a 1 x 2 head) for ``slots`` just
    past their committed lengths, as a forward's layer ``layer`` would; returns the rows used."""
    slots = torch.tensor(slots)
    b, s = values.shape
    rows = cache.rows(slots)
    write_index = cache.lengths[slots][:, None] + torch.arange(s)[None]
    kv = values.t()[:, :, None, None].expand(s, b, 1, 2).float()
    row_index = torch.arange(b)[:, None].expand(b, s)
    k, v = cache.write_and_read(layer, rows, row_index, write_index, int(write_index.max()) + 1 + extra, kv, -kv)
    return rows, k, v


def _context(cache, slot, layer=1):
    """What ``slot`` holds: its committed keys (first channel), through the row it lives in now."""
    row = int(cache.row_of[slot])
    return cache._k[cache._index[layer]][row, :int(cache.lengths[slot]), 0, 0].tolist()


@pytest.mark.parametrize("position_major", [False, True], ids=["keys-as-values", "position-major-keys"])
@pytest.mark.parametrize("two_layers", [False, True], ids=["one-layer", "two-layers"])
def test_rows_move_so_that_every_forward_reads_a_view(position_major, two_layers):
    """Slots of a forward are packed into a contiguous range of rows (views, not gathered copies);
    every slot keeps its own context, commits and prefix copies follow the moved rows."""
    cache = KVCache(num_slots=6, capacity=16, device=torch.device("cpu"), dtype=torch.float32,
                    position_major_keys=position_major, layers=[1, 2] if two_layers else [1])
    _write(cache, range(6), torch.tensor([[10.0 * i + t for t in range(3)] for i in range(6)]))
    cache.commit(torch.arange(6), torch.full((6,), 3))
    expected = {i: [10.0 * i + t for t in range(3)] for i in range(6)}
    for asked in ([1, 3, 5], [0, 2], [5, 1], [4], [2, 4, 0, 5], [3]):
        rows, k, _ = _write(cache, asked, torch.tensor([[100.0 * i] for i in asked]))
        assert rows[1] - rows[0] == len(asked) and cache.row_of[asked].tolist() == list(range(*rows))
        assert k._base is not None  # a view of the cache, no copy
        assert (k.stride(0) == 1) == position_major  # position-major keys: a head dim's values over positions
        for j, i in enumerate(asked):  # the keys read back are each slot's own context + its new token
            assert k[:len(expected[i]) + 1, j, 0, 0].tolist() == expected[i] + [100.0 * i]
        cache.commit(torch.tensor(asked), torch.ones(len(asked), dtype=torch.long))
        for i in asked:
            expected[i].append(100.0 * i)
        assert all(_context(cache, i) == expected[i] for i in range(6))
        assert sorted(cache.row_of.tolist()) == list(range(6))  # still one row per slot
    cache.copy_slots(torch.tensor([3]), torch.tensor([0]))
    assert _context(cache, 0) == expected[3] and _context(cache, 3) == expected[3]


@pytest.mark.parametrize("position_major", [False, True], ids=["keys-as-values", "position-major-keys"])
@pytest.mark.parametrize("two_layers", [False, True], ids=["one-layer", "two-layers"])
def test_interleaved_groups_settle_and_shrink_in_place(position_major, two_layers):
    """A pipeline stage's two response groups (slot s in group s % 2): packed once, after which
    alternating forwards move nothing, and a group that loses a response moves only within its rows."""
    cache = KVCache(num_slots=8, capacity=8, device=torch.device("cpu"), dtype=torch.float32,
                    position_major_keys=position_major, layers=[1, 2] if two_layers else [1])
    g0, g1 = [0, 2, 4, 6], [1, 3, 5, 7]
    _write(cache, range(8), torch.arange(8.0)[:, None])
    cache.commit(torch.arange(8), torch.ones(8, dtype=torch.long))
    assert _write(cache, g0, torch.zeros(4, 1))[0] == (0, 4)
    assert _write(cache, g1, torch.zeros(4, 1))[0] == (4, 8)
    settled = cache.row_of.clone()
    for _ in range(3):
        _write(cache, g0, torch.zeros(4, 1))
        _write(cache, g1, torch.zeros(4, 1))
    assert torch.equal(cache.row_of, settled)
    assert _write(cache, [0, 4, 6], torch.zeros(3, 1))[0] == (0, 3)  # response 2 finished
    assert torch.equal(cache.row_of[g1], settled[g1])  # the other group did not move
    assert all(_context(cache, i) == [float(i)] for i in range(8))


@pytest.mark.parametrize("position_major", [False, True], ids=["keys-as-values", "position-major-keys"])
@pytest.mark.parametrize("two_layers", [False, True], ids=["one-layer", "two-layers"])
def test_moved_rows_keep_an_uncommitted_forward(position_major, two_layers):
    """Between a tree forward and its commit another group's forward may move the tree's rows: the
    scratch positions (the drafted tokens not yet committed) move with them."""
    cache = KVCache(num_slots=5, capacity=8, device=torch.device("cpu"), dtype=torch.float32,
                    position_major_keys=position_major, layers=[1, 2] if two_layers else [1])
    _write(cache, range(5), torch.arange(5.0)[:, None])
    cache.commit(torch.arange(5), torch.ones(5, dtype=torch.long))
    assert _write(cache, [2, 3], torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))[0] == (2, 4)  # a tree each
    assert _write(cache, [1, 4], torch.tensor([[7.0], [8.0]]))[0] == (1, 3)  # slot 2 leaves row 2 for row 4
    assert cache.row_of[[2, 3]].tolist() == [4, 3]
    cache.commit(torch.tensor([2, 3]), torch.tensor([2, 1]), keep_index=torch.tensor([[0, 2], [1, 0]]))
    assert _context(cache, 2) == [2.0, 1.0, 3.0] and _context(cache, 3) == [3.0, 5.0]


@pytest.mark.parametrize("position_major", [False, True], ids=["keys-as-values", "position-major-keys"])
@pytest.mark.parametrize("two_layers", [False, True], ids=["one-layer", "two-layers"])
def test_pack_moves_only_the_rows_beyond_the_range(position_major, two_layers):
    """A group that lost responses: its unfinished responses past the packed range swap rows with the
    finished ones inside it; everything else stays; the order returned is the rows' order."""
    cache = KVCache(num_slots=8, capacity=8, device=torch.device("cpu"), dtype=torch.float32,
                    position_major_keys=position_major, layers=[1, 2] if two_layers else [1])
    _write(cache, range(8), torch.arange(8.0)[:, None])
    cache.commit(torch.arange(8), torch.ones(8, dtype=torch.long))
    live = torch.tensor([0, 1, 3, 4, 6, 7])  # 2 and 5 finished
    perm = cache.pack(live)
    assert cache.row_of.tolist() == [0, 1, 6, 3, 4, 7, 2, 5]  # 6 -> row 2 (2 -> 6), 7 -> row 5 (5 -> 7)
    assert live[perm].tolist() == [0, 1, 6, 3, 4, 7] and cache.rows(live[perm]) == (0, 6)
    assert cache.row_of.tolist() == [0, 1, 6, 3, 4, 7, 2, 5]  # a forward in that order moved nothing
    assert all(_context(cache, i) == [float(i)] for i in range(8))
    assert cache.pack(torch.tensor([4, 1])).tolist() == [1, 0] and cache.row_of[[1, 4]].tolist() == [1, 2]
    assert cache.pack(torch.zeros(0, dtype=torch.long)).numel() == 0
    assert all(_context(cache, i) == [float(i)] for i in range(8))


@pytest.mark.parametrize("position_major", [False, True], ids=["keys-as-values", "position-major-keys"])
def test_stacked_layers_move_together(position_major):
    """With its layers known, the cache keeps every layer's keys (and values) in one tensor: commits,
    row moves and prefix copies move all layers at once, each layer keeping its own contents."""
    cache = KVCache(num_slots=4, capacity=8, device=torch.device("cpu"), dtype=torch.float32,
                    position_major_keys=position_major, layers=[3, 4])
    for layer, scale in ((3, 1.0), (4, -1.0)):  # a tree of 3 tokens per slot, other numbers per layer
        _write(cache, range(4), scale * torch.tensor([[10.0 * i + t for t in range(3)] for i in range(4)]), layer=layer)
    k3, k4 = cache._buffers(3, 1, 2)[0], cache._buffers(4, 1, 2)[0]
    assert k3.data_ptr() != k4.data_ptr() and k3.untyped_storage().data_ptr() == cache._k.untyped_storage().data_ptr()
    cache.commit(torch.arange(4), torch.full((4,), 2), keep_index=torch.tensor([[0, 2]] * 4))
    expected = {i: [10.0 * i, 10.0 * i + 2] for i in range(4)}
    assert all(_context(cache, i, 3) == expected[i] for i in range(4))
    assert all(_context(cache, i, 4) == [-x for x in expected[i]] for i in range(4))
    assert _write(cache, [0, 3], torch.zeros(2, 1), layer=3)[0] == (0, 2)  # slot 3 moves to row 1
    cache.copy_slots(torch.tensor([3]), torch.tensor([2]))
    for i, src in ((0, 0), (1, 1), (2, 3), (3, 3)):
        assert _context(cache, i, 3) == expected[src] and _context(cache, i, 4) == [-x for x in expected[src]]
    values = cache._v[cache._index[4]][int(cache.row_of[2]), :2, 0, 0].tolist()
    assert values == expected[3]  # values: the negated keys written by layer 4


@pytest.mark.parametrize("position_major", [False, True], ids=["keys-as-values", "position-major-keys"])
def test_rows_are_recycled_from_finished_responses_to_waiting_ones(position_major):
    """Continuous batching: 7 responses in 4 rows. Slots take free rows as they are admitted and give
    them back when released; a forward over slots whose rows are scattered among free ones packs
    them, moving only what it must; every held slot keeps its context through all of it, and the
    experts of a released slot stay readable."""
    cache = KVCache(num_slots=7, capacity=8, device=torch.device("cpu"), dtype=torch.float32,
                    position_major_keys=position_major, layers=[1, 2], routing_topk=1, num_rows=4)
    assert cache.row_of.tolist() == [-1] * 7 and cache._k is None

    def step(slots, values):  # one token each, and the experts it was routed to (its value, as an int)
        rows, *_ = _write(cache, slots, torch.tensor(values)[:, None])
        _write(cache, slots, torch.tensor(values)[:, None], layer=2)
        index = torch.tensor(slots)
        write = cache.lengths[index][:, None]
        experts = torch.tensor(values, dtype=torch.long)[:, None]
        cache.write_routing(rows, torch.arange(len(slots))[:, None], write, [experts, experts])
        cache.commit(index, torch.ones(len(slots), dtype=torch.long))
        for s, v in zip(slots, values):
            expected[s].append(v)

    expected = {s: [] for s in range(7)}
    cache.admit([0, 1, 2])
    assert cache.row_of[:3].tolist() == [0, 1, 2]
    step([0, 1, 2], [1.0, 2.0, 3.0])
    cache.release([1])
    cache.admit([3, 4])  # rows 1 (freed) and 3
    assert sorted(cache.row_of[[3, 4]].tolist()) == [1, 3] and cache.lengths[[3, 4]].tolist() == [0, 0]
    step([3, 4], [40.0, 50.0])  # not adjacent: one of them moves next to the other
    step([0, 2, 3, 4], [11.0, 13.0, 41.0, 51.0])
    cache.release([0, 3])
    with pytest.raises(RuntimeError, match="3 slots to admit, 2 of 4 rows free"):
        cache.admit([5, 6, 1])
    cache.admit([5])
    step([5, 2], [60.0, 14.0])
    cache.admit([6])
    perm = cache.pack(torch.tensor([6, 4, 2, 5]))
    assert sorted(cache.row_of[[2, 4, 5, 6]].tolist()) == [0, 1, 2, 3] and len(perm) == 4
    step([2, 4, 5, 6], [15.0, 52.0, 61.0, 70.0])
    for s in (2, 4, 5, 6):
        assert _context(cache, s) == expected[s] and _context(cache, s, 2) == expected[s]
    cache.release([2, 4, 5, 6])
    routing = cache.routing(torch.arange(7))
    for s in range(7):  # [length, layers, topk]: the values written, at both layers
        assert routing[s].shape == (len(expected[s]), 2, 1)
        assert routing[s][:, 0, 0].tolist() == [int(v) for v in expected[s]] == routing[s][:, 1, 0].tolist()
    assert cache.row_of.tolist() == [-1] * 7 and sorted(cache._free) == [0, 1, 2, 3]


def test_cache_rows_errors():
    def cache(**kw):
        return KVCache(capacity=4, device=torch.device("cpu"), dtype=torch.float32, layers=[1], **kw)

    with pytest.raises(ValueError, match="needs the layer numbers that use it"):
        KVCache(num_slots=2, capacity=4, device=torch.device("cpu"), dtype=torch.float32, layers=[])
    for rows in (0, 3):
        with pytest.raises(ValueError, match=f"a KV cache of 2 slots needs 1 to 2 rows, got num_rows={rows}"):
            cache(num_slots=2, num_rows=rows)
    c = cache(num_slots=3, num_rows=2)
    c.admit([0])
    with pytest.raises(RuntimeError, match="a slot admitted twice"):
        c.admit([0])
    with pytest.raises(RuntimeError, match="a slot without a row"):
        c.rows(torch.tensor([2, 0]))
