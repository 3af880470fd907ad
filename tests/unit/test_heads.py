"""Horizon heads: the root-token and draft-path inputs, and heads saved before them."""

import math

import pytest
import torch

from specroll_mcore.config import tiny_llama
from specroll_mcore.distill import DistillRecords, draft_path, freeze_all_but_heads, head_loss, train_heads_step
from specroll_mcore.heads import vocab_parallel_log_probs, vocab_rows
from specroll_mcore.model import PolicyModel


def test_root_features_are_rows_of_the_vocab_projection(ctx):
    model = PolicyModel(tiny_llama(), ctx, num_heads=2).eval()
    ids = torch.tensor([0, 7, 299])
    assert torch.equal(model.root_features(ids), model.output_weight()[ids])


def test_heads_name_the_policys_tensor_parallel_group(ctx):
    """megatron-core warns that leaving a linear's or a TP region's group to its global default
    will soon be refused: the heads are built with the policy's TP group and pass it on."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PolicyModel(tiny_llama(), ctx, num_heads=2).eval()
        with torch.no_grad():
            model.head_logits(torch.randn(3, 64), torch.tensor([1, 2, 3]))
    assert [str(w.message) for w in caught if "tp_group is None" in str(w.message)] == []
    linears = [*model.heads.layers, *model.heads.root_layers, *model.heads.path_layers[1]]
    assert model.heads.tp_group is ctx.tp_group and all(layer.tp_group is ctx.tp_group for layer in linears)


def test_vocab_rows_of_a_shard_are_its_rows_and_zero_elsewhere():
    """This rank's rows for global ids (ids of other ranks zero, so a sum over ranks is the true
    product), also for a shard that holds none of them (a draft vocabulary's ids all on other ranks)."""
    weight = torch.arange(12.0).reshape(4, 3)  # global ids 10 .. 13
    ids = torch.tensor([[10, 13], [9, 14]])
    assert vocab_rows(weight, ids, 10).tolist() == [[[0, 1, 2], [9, 10, 11]], [[0, 0, 0], [0, 0, 0]]]
    assert torch.equal(vocab_rows(weight, ids[:1], 10), weight[ids[:1] - 10])
    assert torch.equal(vocab_rows(weight[:0], ids, 10), torch.zeros(2, 2, 3))
    # a whole vocabulary (no TP): its rows, read without an ownership mask
    assert torch.equal(vocab_rows(weight, ids[:1], 10, whole=True), weight[ids[:1] - 10])
    assert torch.equal(vocab_rows(weight, ids[:1] - 10, 0, whole=True), weight[ids[:1] - 10])


def test_heads_read_the_root_through_u_only(ctx):
    model = PolicyModel(tiny_llama(), ctx, num_heads=2).eval()
    h = torch.randn(3, 64)
    a, b = torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    with torch.no_grad():
        assert torch.equal(model.head_logits(h, a), model.head_logits(h, b))  # U = 0: the root is ignored
        model.heads.root_layers[1].weight.normal_(std=0.1)
        la, lb = model.head_logits(h, a), model.head_logits(h, b)
    assert torch.equal(la[0], lb[0]) and not torch.allclose(la[1], lb[1])


def test_head_i_reads_the_first_i_path_tokens_through_v_only(ctx):
    model = PolicyModel(tiny_llama(), ctx, num_heads=3).eval()
    h, root = torch.randn(2, 64), torch.tensor([1, 2])
    a, b, c = torch.tensor([[4, 5], [6, 7]]), torch.tensor([[9, 5], [8, 7]]), torch.tensor([[4, 11], [6, 12]])
    assert [len(layers) for layers in model.heads.path_layers] == [0, 1, 2]
    with torch.no_grad():
        assert torch.equal(model.head_logits(h, root, path_ids=a), model.head_logits(h, root))  # V = 0
        for layers in model.heads.path_layers:
            for layer in layers:
                layer.weight.normal_(std=0.1)
        la, lb, lc = (model.head_logits(h, root, path_ids=x) for x in (a, b, c))
    assert torch.equal(la[0], lb[0]) and torch.equal(la[0], lc[0])  # head 1: no path
    assert not torch.allclose(la[1], lb[1]) and torch.equal(la[1], lc[1])  # head 2 reads path token 1 only
    assert not torch.allclose(la[2], lc[2])  # head 3 reads both


def test_heads_saved_without_root_layers_load_with_u_zero(ctx):
    model = PolicyModel(tiny_llama(), ctx, num_heads=2).eval()
    with torch.no_grad():
        model.heads.root_layers[0].weight.fill_(1.0)
    w = {f"heads.layers.{i}.weight": torch.randn(64, 64) for i in range(2)}
    model.load_full_heads(w)  # the layout before root tokens: z = h + SiLU(W h)
    assert torch.equal(model.heads.layers[1].weight, w["heads.layers.1.weight"])
    assert all(layer.weight.abs().sum() == 0 for layer in model.heads.root_layers)
    assert all(layer.weight.abs().sum() == 0 for layers in model.heads.path_layers for layer in layers)
    with pytest.raises(ValueError, match="do not match this policy's heads"):
        model.load_full_heads({"heads.root_layers.0.weight": torch.zeros(64, 64)})  # W missing
    with pytest.raises(ValueError, match="do not match this policy's heads"):
        model.load_full_heads({**w, "heads.layers.2.weight": torch.zeros(64, 64)})  # a third head
    assert model.heads.token_counts.shape == (300,) and not model.heads.token_counts.any()  # no counts saved
    with pytest.raises(ValueError, match=r"heads.token_counts has shape \(299,\) on this rank, this policy's heads "
                                         r"need \(300,\)"):
        model.load_full_heads({**w, "heads.token_counts": torch.ones(299, dtype=torch.long)})


def test_token_counts_load_unsharded_and_uncast(ctx):
    """The counts are replicated (every TP rank holds all V) and stay integers in any weight dtype."""
    model = PolicyModel(tiny_llama(params_dtype="bfloat16"), ctx, num_heads=2).eval()
    w = {f"heads.layers.{i}.weight": torch.randn(64, 64) for i in range(2)}
    counts = torch.arange(300) * 1001  # not representable in bfloat16
    model.load_full_heads({**w, "heads.token_counts": counts})
    assert model.heads.token_counts.dtype == torch.long and torch.equal(model.heads.token_counts, counts)
    assert model.heads.layers[0].weight.dtype == torch.bfloat16


def test_draft_vocab_scores_its_ids_as_the_whole_vocabulary_does(ctx):
    """A draft vocabulary's logits and coupled scores are the whole vocabulary's at its ids, and its
    indices map back to those ids."""
    from specroll_mcore.heads import DraftVocab, coupled_scores, vocab_parallel_topk
    from specroll_mcore.sampling import SampleKeys

    model = PolicyModel(tiny_llama(), ctx, num_heads=2).eval()
    counts = torch.zeros(300, dtype=torch.long)
    counts[torch.tensor([299, 5, 77, 140, 6, 200])] = torch.tensor([9, 8, 8, 7, 1, 5])
    dv = DraftVocab.build(counts, 5, model.output_weight(), model.vocab_start)
    assert dv.ids.tolist() == [5, 77, 140, 200, 299] and dv.start == 0 and dv.size == 5  # 6 (count 1) left out
    z = torch.randn(2, 3, 64)
    full = model.vocab_projection(z)
    assert torch.allclose(dv.project(z), full[..., dv.ids], atol=1e-6)
    keys = SampleKeys(1, 2, torch.arange(3), torch.zeros(3, dtype=torch.long), torch.arange(3) + 4)
    flat, sub = full.reshape(6, -1), dv.project(z).reshape(6, -1)
    whole = coupled_scores(flat, keys, 1.0, 0, 0, 300, ctx)  # key r scores rows 2r, 2r + 1
    part = coupled_scores(sub, keys, 1.0, 0, dv.start, dv.size, ctx, dv.local_ids)
    assert torch.allclose(part, whole[:, dv.ids], atol=1e-6)
    _, idx = vocab_parallel_topk(part, 2, dv.start, dv.size, ctx)
    assert torch.equal(dv.global_ids(idx), dv.ids[part.topk(2).indices])


def test_records_from_sampling_equal_records_from_a_full_forward(ctx):
    """What the vanilla engine computed while sampling (KV cache, one token per forward) gives the
    same distillation records as a full forward over prompt + response, early EOS included."""
    from conftest import make_policy
    from specroll_mcore.config import SamplingConfig, tiny_qwen2
    from specroll_mcore.distill import TokenFeatures, records_from_features
    from specroll_mcore.model import causal_mask
    from specroll_mcore.sampling import top_distribution
    from specroll_mcore.rollout import VanillaEngine

    model = make_policy(tiny_qwen2(params_dtype="float64"), ctx, seed=6)
    model.eval()
    prompts = [[11, 12, 13, 14], [21], [31, 32, 33]]
    sp = SamplingConfig(temperature=1.0, max_new_tokens=12, num_samples=2, seed=3)
    eos = VanillaEngine(model).generate(prompts, sp).tokens[0][4]  # a token some response samples early
    out = VanillaEngine(model, eos_token_ids=[eos]).generate(prompts, sp, features_topk=8)
    assert "eos" in out.finish_reason and "length" in out.finish_reason  # ragged responses
    for p, toks, feat in zip(out.prompt_index, out.tokens, out.features):
        got = records_from_features(feat, toks, num_heads=3)
        seq, start = prompts[p] + toks, len(prompts[p])
        with torch.no_grad():  # the positions that sampled the response, in one forward
            logits, hidden = model(torch.tensor([seq]), model.metadata(torch.arange(len(seq))[None],
                                                                       causal_mask(1, len(seq), "cpu")),
                                   return_hidden=True)
        top_ids, top_probs = top_distribution(model.full_logits(logits[0, start - 1:-1]), 8)
        ref = records_from_features(TokenFeatures(hidden[start - 1:-1, 0], top_ids, top_probs), toks, num_heads=3)
        assert len(got) == len(toks) == len(ref)
        assert torch.allclose(got.hidden, ref.hidden, atol=1e-9)
        assert torch.allclose(got.target_probs, ref.target_probs, atol=1e-9)
        for name in ("root", "target_ids", "realised", "valid"):
            assert torch.equal(getattr(got, name), getattr(ref, name)), name
        assert got.valid[-1].sum() == 0 and got.valid[0].all() == (len(toks) > 3)
    with pytest.raises(ValueError, match="feature rows for a response of"):
        records_from_features(out.features[0], out.tokens[0] + [1], num_heads=3)
    plain = VanillaEngine(model).generate(prompts, SamplingConfig(max_new_tokens=4))
    assert plain.features is None
    with pytest.raises(ValueError, match="features_topk must be in"):
        VanillaEngine(model).generate(prompts, SamplingConfig(max_new_tokens=4), features_topk=-1)


def test_vocab_parallel_log_probs_equal_log_softmax_and_skip_padding(ctx):
    logits = torch.randn(2, 3, 10, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[[0, 7], [3, 3], [6, 1]], [[2, 5], [4, 0], [6, 6]]])
    got = vocab_parallel_log_probs(logits, ids, 0, 7, ctx)  # ids 7..9 are TP padding
    ref = torch.log_softmax(logits[..., :7], -1).gather(-1, ids.clamp(max=6))
    assert torch.allclose(got[ids < 7], ref[ids < 7])
    assert torch.isneginf(got[ids == 7]).all()
    got[ids < 7].sum().backward()
    assert logits.grad[..., 7:].abs().sum() == 0 and logits.grad[..., :7].abs().sum() > 0


def test_head_loss_equals_full_vocabulary_reference_and_trains_every_head_weight(ctx):
    """The vocab-parallel loss against soft CE + NLL written out on the gathered log-softmax."""
    torch.manual_seed(0)
    model = PolicyModel(tiny_llama(), ctx, num_heads=3).eval()
    with torch.no_grad():
        for p in model.heads.parameters():
            p.normal_(std=0.05)
    n, K, V = 12, 4, model.config.vocab_size
    probs = torch.rand(n, 3, K)
    rec = DistillRecords(torch.randn(n, 64), torch.randint(0, V, (n,)), torch.randint(0, V, (n, 3, K)),
                         probs / probs.sum(-1, keepdim=True), torch.randint(0, V, (n, 3)), torch.rand(n, 3) > 0.2)
    loss, parts = head_loss(model, rec)
    logq = torch.log_softmax(model.full_logits(model.head_logits(rec.hidden, rec.root, path_ids=draft_path(rec))), -1)
    logq = logq.transpose(0, 1)
    soft = -(rec.target_probs * logq.gather(-1, rec.target_ids)).sum(-1)
    nll = -logq.gather(-1, rec.realised[..., None])[..., 0]
    w = rec.valid.float()
    assert torch.allclose(loss, ((soft + nll) * w).sum() / w.sum(), rtol=1e-5)
    assert parts["nll"] == pytest.approx(float((nll * w).sum().detach() / w.sum()), rel=1e-5)
    params = freeze_all_but_heads(model)
    before = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-2)
    m = train_heads_step(model, opt, rec)
    assert m["loss"] == pytest.approx(float(loss.detach()), rel=1e-5) and m["grad_norm"] > 0
    assert all(not torch.equal(p, b) for p, b in zip(params, before))
    assert all(not p.requires_grad for p in model.gpt.parameters())


def test_vocab_parallel_entropy_equals_the_categorical_entropy(ctx):
    """The update's entropy metric against torch.distributions on the same logits: padding ids past
    the vocabulary (a TP shard's tail) take no probability, temperature applies."""
    from specroll_mcore.heads import vocab_parallel_entropy

    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(5, 4, 64, generator=g)
    logits[1, 2] = 0.0  # uniform over the 60 real ids
    logits[2, 0, 7] = 80.0  # one id holds all the mass
    got = vocab_parallel_entropy(logits, 0, 60, ctx, temperature=0.7)
    ref = torch.distributions.Categorical(logits=logits[..., :60].double() / 0.7).entropy()
    assert got.shape == (5, 4) and torch.allclose(got.double(), ref, atol=1e-5)
    assert got[1, 2].item() == pytest.approx(math.log(60), abs=1e-5) and got[2, 0].item() == pytest.approx(0, abs=1e-5)
    assert torch.equal(vocab_parallel_entropy(logits.bfloat16(), 0, 60, ctx).isfinite(), torch.ones(5, 4).bool())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_differentiable_entropy_gives_torchs_entropy_and_gradient(ctx, temperature):
    """The entropy bonus's entropy: values and gradients of torch.distributions' entropy on the same
    float64 logits (autograd through the softmax), padding ids past the vocabulary taking neither
    probability nor gradient; gradcheck on its hand-written backward; the metric's values (logits
    without gradients: nothing kept for a backward) the same."""
    from specroll_mcore.heads import vocab_parallel_entropy

    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(5, 4, 64, generator=g, dtype=torch.float64))
    logits[2, 0, 7] = 80.0  # one id holds all the mass
    logits.requires_grad_()
    weights = torch.randn(5, 4, generator=g, dtype=torch.float64)
    got = vocab_parallel_entropy(logits, 0, 60, ctx, temperature)
    ref = torch.distributions.Categorical(logits=logits[..., :60] / temperature).entropy()
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(got.detach(), vocab_parallel_entropy(logits.detach(), 0, 60, ctx, temperature))
    (grad,) = torch.autograd.grad((got * weights).sum(), logits)
    (expected,) = torch.autograd.grad((ref * weights).sum(), logits)
    torch.testing.assert_close(grad, expected)
    assert grad[..., 60:].abs().max() == 0
    small = logits.detach()[:2, :2, :9].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda x: vocab_parallel_entropy(x, 0, 8, ctx, temperature),
                                    (small,))
    assert vocab_parallel_entropy(logits.detach().float(), 0, 60, ctx).dtype == torch.float32


class _ThreadedTP:
    """One TP rank of a group whose ranks are threads of this process: all_gather_tp exchanges
    through shared memory (what the top-k's reduction does with the message, without processes)."""

    def __init__(self, rank: int, sent: dict, meet):
        self.tp_size, self.tp_rank, self._sent, self._meet = 2, rank, sent, meet

    def all_gather_tp(self, tensor: torch.Tensor) -> torch.Tensor:
        self._sent[self.tp_rank] = tensor.clone()
        self._meet.wait()
        gathered = torch.stack([self._sent[r] for r in range(self.tp_size)])
        self._meet.wait()  # (both read before either sends again)
        return gathered


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_vocab_parallel_topk_over_two_shards_equals_the_whole_vocabularys(dtype):
    """Values and global ids of the top-k over two vocabulary shards (an uneven split, padded ids
    past the vocabulary, ties across the shards, a k above one shard's size, a row one shard holds no
    finite logit of): torch's top-k over the whole vocabulary, ties to the lower id, values bit for
    bit in the logits' dtype."""
    import threading

    from specroll_mcore.heads import vocab_parallel_topk

    g = torch.Generator().manual_seed(3)
    vocab, split = 13, 5  # rank 0 holds ids 0-4, rank 1 ids 5-12 (and 3 padded ids past the vocabulary)
    # distinct values, exact in every dtype (ties within a shard are torch.topk's to order)
    full = torch.stack([torch.randperm(vocab, generator=g) for _ in range(4)]).sub(6).div(4).to(dtype)
    full[0, 2] = full[0, 9] = 2.5  # a tie across the shards: id 2 first
    full[1, 6:] = float("-inf")  # rank 1 holds no finite logit of row 1
    shards = [full[:, :split], torch.cat([full[:, split:], torch.full((4, 3), 50.0).to(dtype)], -1)]
    for k in (3, 7):
        got, meet, sent = [None, None], threading.Barrier(2, timeout=60), {}  # (a failing rank breaks it)

        def rank(r):
            got[r] = vocab_parallel_topk(shards[r], k, (0, split)[r], vocab, _ThreadedTP(r, sent, meet))

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        order = torch.argsort(-full.double(), dim=-1, stable=True)[:, :k]  # ties: the lower id first
        want = full.gather(-1, order)
        live = torch.isfinite(want)  # (past a row's finite logits any id may fill its -inf places)
        assert not live[1, 6:].any() and live[1, :6].all()
        for values, ids in got:
            assert values.dtype == dtype and ids.dtype == torch.long
            assert torch.equal(values, want) and torch.equal(ids[live], order[live]), (k, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_several_vocab_parallel_topks_share_one_exchange(dtype):
    """Requests of different rows and k, two with their log-sum-exp, answered over two vocabulary
    shards with one all-gather: each the top-k of its own call, the log-sum-exp that of the whole
    vocabulary (TP padding left out), the same on both ranks; at TP=1 the same results."""
    import threading

    from specroll_mcore.heads import TopK, vocab_parallel_topk, vocab_parallel_topks

    g = torch.Generator().manual_seed(5)
    vocab, split = 13, 5
    fulls = [torch.randn(n, vocab, generator=g, dtype=torch.float64).mul(3).to(dtype) for n in (4, 2, 6)]
    shards = [[f[:, :split], torch.cat([f[:, split:], torch.full((f.shape[0], 3), 50.0).to(dtype)], -1)]
              for f in fulls]
    asks = [(0, 3, True), (1, 7, False), (2, 2, True)]  # (logits, k, with its log-sum-exp)
    got, single, meet, sent, exchanges = [None, None], [None, None], threading.Barrier(2, timeout=60), {}, []

    class Counted(_ThreadedTP):
        def all_gather_tp(self, tensor):
            exchanges.append(self.tp_rank)
            return super().all_gather_tp(tensor)

    def rank(r):
        ctx = Counted(r, sent, meet)
        got[r] = vocab_parallel_topks([TopK(shards[i][r], k, lse) for i, k, lse in asks], (0, split)[r], vocab, ctx)
        single[r] = [vocab_parallel_topk(shards[i][r], k, (0, split)[r], vocab, _ThreadedTP(r, sent, meet))
                     for i, k, _ in asks]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(exchanges) == [0, 1]  # one all-gather on each rank for the three requests
    whole = vocab_parallel_topks([TopK(fulls[i], k, lse) for i, k, lse in asks], 0, vocab,
                                 type("OneRank", (), {"tp_size": 1})())
    for r in range(2):
        for (i, k, lse), found, (values, ids), alone in zip(asks, got[r], single[r], whole):
            assert torch.equal(found.values, values) and torch.equal(found.ids, ids)
            assert torch.equal(found.values, alone.values) and torch.equal(found.ids, alone.ids)
            assert (found.logsumexp is None) == (alone.logsumexp is None) == (not lse)
            if lse:
                want = torch.logsumexp(fulls[i].double(), -1)
                assert found.logsumexp.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
                assert torch.allclose(found.logsumexp.double(), want, rtol=0, atol=1e-12 if dtype == torch.float64
                                      else 1e-5)
                assert torch.equal(found.logsumexp, got[0][asks.index((i, k, lse))].logsumexp)
                assert torch.allclose(alone.logsumexp.double(), want, rtol=0, atol=1e-5)
